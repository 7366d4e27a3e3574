#!/usr/bin/env bash
# Keel's engine next to llama.cpp on the same weights, on this machine, in one run (issue 24).
#
#   bench/engine/vs_llamacpp.sh            full run: 4 interleaved rounds, 64 decode tokens
#   KEEL_BENCH_QUICK=1 bench/engine/vs_llamacpp.sh    smoke run: 1 round, 16 decode tokens
#   bench/engine/vs_llamacpp.sh --help
#
# What it does:
#  1. llama.cpp: `npm install --ignore-scripts node-llama-cpp@3.21.1 @node-llama-cpp/linux-x64@3.21.1`
#     into $BUILD/llamacpp (reused on later runs). The npm package bundles llama.cpp's source as a
#     git bundle (node-llama-cpp/llama/gitRelease.bundle, cloned to $BUILD/llamacpp/src);
#     @node-llama-cpp/linux-x64 ships prebuilt libllama/libggml with one CPU backend per x86
#     variant (haswell ... zen4, sapphirerapids), picked at run time by cpuid. llama-bench,
#     llama-batched-bench and bench/engine/llamacpp_greedy.cc are compiled from that source and
#     linked against those prebuilt libraries (copied beside them in $BUILD/llamacpp/bin). If that
#     fails (or KEEL_LLAMACPP_FROM_SOURCE=1), ggml and llama are built from the bundled source
#     with GGML_NATIVE=ON (-march=native) in $BUILD/llamacpp/cmake-native instead; the output says
#     which ran. Cached: nothing is installed or compiled again once the binaries exist.
#     build/keel itself is not built here (the tree is shared): build it first.
#  2. Models: `keel make-model` 12 layers x 768, 12 heads, FFN 2048, vocab 32000, tied embeddings,
#     seed 1, in F32 and F16 ($BUILD/bench-models/llama110m-{f32,f16}); each converted to GGUF with
#     bench/engine/safetensors_to_gguf.py (same values, same dtype, q/k rows permuted back to
#     llama.cpp's RoPE order; norms widened to F32 as llama.cpp's converter does). The conversion
#     is checked on a real model: aidreams260K (llama2.c) -> `keel convert` -> GGUF, and greedy
#     token ids of `keel generate --temperature 0` and llamacpp_greedy are compared (from BOS and
#     from two prompts); the 110M models are compared the same way (random weights, so a weaker
#     check). Agreement counts are printed; a disagreement is reported, not fatal.
#  3. Measures, 2 threads, rounds interleaved (Keel, llama.cpp, Keel, llama.cpp, ...), median of
#     each: F32 and F16 x {prefill 64, prefill 512, decode 1, 4 and 16 sequences}. Decode is 64
#     new tokens per sequence after a 64-token prompt on both sides.
#       Keel:      OMP_NUM_THREADS=2 keel bench --prompt-tokens 64 --decode-tokens 64
#                  --concurrency 1,4,16 --repeats 2 (and --prompt-tokens 512 for prefill 512)
#       llama.cpp: llama-bench -t 2 -p 64,512 -n 0 -r 2;  llama-bench -t 2 -p 0 -n 64 -d 64 -r 2;
#                  llama-batched-bench -t 2 -c 2048 -npp 64 -ntg 64 -npl 4,16 (S_TG t/s)
#     Within a round both sides report the best of 2 runs (llama-batched-bench: 1 run after its own
#     warm-up). The KV cache is F16 on both sides (llama.cpp's default; Keel --kv-codec raw:f16);
#     KEEL_BENCH_KV=f32 makes both F32. llama.cpp's flash attention is left at its default (auto).
#  4. Prints one Markdown table (Keel tok/s, llama.cpp tok/s, ratio) with the date, CPU, the
#     llama.cpp CPU backend variant that loaded, llama.cpp's version and this command; then Keel's
#     memory roofline for single-sequence decode and Keel decode / roofline.
# Needs: npm (and the npm registry), g++, python3 (standard library only), a built $BUILD/keel.
# Environment: KEEL_BUILD_DIR (default build), KEEL_SHARED (default ../shared), KEEL_BENCH_QUICK,
# KEEL_BENCH_KV, KEEL_LLAMACPP_FROM_SOURCE. Logs of every tool run: $BUILD/llamacpp/logs/.
set -euo pipefail

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "vs_llamacpp.sh: no arguments expected (see --help)" >&2
  exit 2
fi

cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${KEEL_BUILD_DIR:-build}
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
KEEL=$BUILD/keel
SHARED=${KEEL_SHARED:-$(cd .. && pwd)/shared}
QUICK=${KEEL_BENCH_QUICK:-0}
KV=${KEEL_BENCH_KV:-f16}
NLC_VERSION=3.21.1
CACHE=$BUILD/llamacpp
LOGS=$CACHE/logs
THREADS=2
PROMPT=64
LONG_PROMPT=512
if [ "$QUICK" = 1 ]; then ROUNDS=1; DECODE=16; else ROUNDS=4; DECODE=64; fi
case "$KV" in f16 | f32) ;; *) echo "vs_llamacpp.sh: KEEL_BENCH_KV must be f16 or f32" >&2; exit 2 ;; esac

die() { echo "vs_llamacpp.sh: $*" >&2; exit 1; }
# run_logged NAME CMD...: runs CMD with stdout+stderr in $LOGS/NAME.log; on failure shows its tail.
# run_split NAME CMD...: the same with stdout alone in $LOGS/NAME.out (for JSON output).
run_logged() {
  local name=$1; shift
  if ! "$@" >"$LOGS/$name.log" 2>&1; then
    echo "vs_llamacpp.sh: '$*' failed; last lines of $LOGS/$name.log:" >&2
    tail -n 20 "$LOGS/$name.log" >&2
    exit 1
  fi
}
run_split() {
  local name=$1; shift
  if ! "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.log"; then
    echo "vs_llamacpp.sh: '$*' failed; last lines of $LOGS/$name.log:" >&2
    tail -n 20 "$LOGS/$name.log" >&2
    exit 1
  fi
}

[ -x "$KEEL" ] || die "$KEEL not found: build it first (flock /tmp/keel-build.lock ninja -C build keel)"
command -v python3 >/dev/null || die "python3 is required (standard library only)"
command -v g++ >/dev/null || die "g++ is required (apt-get install g++)"
mkdir -p "$CACHE" "$LOGS" "$CACHE/models"

# ---------------------------------------------------------------------------------------------
# 1. llama.cpp
# ---------------------------------------------------------------------------------------------
NLC=$CACHE/node_modules/node-llama-cpp
PREBUILT=$CACHE/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
installed_version() { node -p "require('$NLC/package.json').version" 2>/dev/null || true; }
if [ "$(installed_version)" != "$NLC_VERSION" ] || [ ! -d "$PREBUILT" ]; then
  command -v npm >/dev/null || die "npm is missing: apt-get install npm (needs the npm registry)"
  echo "Installing node-llama-cpp@$NLC_VERSION into $CACHE (npm, --ignore-scripts) ..." >&2
  [ -f "$CACHE/package.json" ] || echo '{"name": "keel-llamacpp-cache", "private": true}' >"$CACHE/package.json"
  # --omit=optional skips the CUDA/Vulkan/ARM prebuilt packages (~650 MB); the x64 CPU one is named.
  if ! npm install --prefix "$CACHE" --ignore-scripts --no-audit --no-fund --omit=optional --save-exact \
      "node-llama-cpp@$NLC_VERSION" "@node-llama-cpp/linux-x64@$NLC_VERSION" >"$LOGS/npm.log" 2>&1; then
    tail -n 20 "$LOGS/npm.log" >&2
    die "npm install node-llama-cpp@$NLC_VERSION failed (log: $LOGS/npm.log)"
  fi
  [ "$(installed_version)" = "$NLC_VERSION" ] || die "npm install did not leave node-llama-cpp@$NLC_VERSION in $CACHE"
fi
SRC=$CACHE/src
if [ ! -f "$SRC/include/llama.h" ]; then
  [ -f "$NLC/llama/gitRelease.bundle" ] || die "no llama.cpp source bundle in $NLC/llama"
  rm -rf "$SRC"
  run_logged git-clone git clone -q "$NLC/llama/gitRelease.bundle" "$SRC"
fi
NLC_TAG=$(python3 -c "import json; print(json.load(open('$NLC/llama/llama.cpp.info.json'))['tag'])")
SRC_COMMIT=$(git -C "$SRC" rev-parse --short=12 HEAD)

TOOL_FLAGS=(-std=c++17 -O2 -DNDEBUG -I"$SRC/include" -I"$SRC/ggml/include" -I"$SRC/common" -I"$SRC/vendor" -pthread)
build_tools_prebuilt() {  # into $CACHE/bin: the prebuilt libraries and our tools, rpath $ORIGIN
  local bin=$CACHE/bin
  mkdir -p "$bin"
  cp -f "$PREBUILT"/*.so "$bin"/
  local libs=(-L"$bin" -l:libllama-common.so -l:libllama.v0.4.0.so -l:libggml.v0.4.0.so -l:libggml-base.so '-Wl,-rpath,$ORIGIN')
  g++ "${TOOL_FLAGS[@]}" "$SRC/tools/llama-bench/main.cpp" "$SRC/tools/llama-bench/llama-bench.cpp" \
    -o "$bin/llama-bench" "${libs[@]}" &&
  g++ "${TOOL_FLAGS[@]}" "$SRC/tools/batched-bench/main.cpp" "$SRC/tools/batched-bench/batched-bench.cpp" \
    -o "$bin/llama-batched-bench" "${libs[@]}"
}
build_tools_source() {  # in $CACHE/cmake-native/bin: ggml + llama built here with GGML_NATIVE=ON
  command -v cmake >/dev/null || die "cmake is required for the source build (apt-get install cmake)"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$SRC" -B "$CACHE/cmake-native" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF &&
  cmake --build "$CACHE/cmake-native" -j "$(nproc)" --target llama-bench llama-batched-bench
}

MODE=prebuilt
[ "${KEEL_LLAMACPP_FROM_SOURCE:-0}" = 1 ] && MODE=native
if [ "$MODE" = prebuilt ]; then
  if [ ! -x "$CACHE/bin/llama-bench" ] || [ ! -x "$CACHE/bin/llama-batched-bench" ]; then
    echo "Compiling llama-bench and llama-batched-bench against the prebuilt libraries ..." >&2
    if ! build_tools_prebuilt >"$LOGS/build-prebuilt.log" 2>&1; then
      echo "vs_llamacpp.sh: linking against the prebuilt libraries failed ($LOGS/build-prebuilt.log);" \
        "building llama.cpp from the bundled source with GGML_NATIVE=ON" >&2
      rm -f "$CACHE/bin/llama-bench" "$CACHE/bin/llama-batched-bench"
      MODE=native
    fi
  fi
fi
if [ "$MODE" = native ] && { [ ! -x "$CACHE/cmake-native/bin/llama-bench" ] || [ ! -x "$CACHE/cmake-native/bin/llama-batched-bench" ]; }; then
  echo "Building llama.cpp from $SRC (GGML_NATIVE=ON; takes a while on 2 cores) ..." >&2
  run_logged build-native build_tools_source
fi
if [ "$MODE" = prebuilt ]; then
  LBIN=$CACHE/bin
  LLAMA_LIBS=(-L"$LBIN" -l:libllama.v0.4.0.so -l:libggml.v0.4.0.so -l:libggml-base.so)
  BUILD_KIND="prebuilt @node-llama-cpp/linux-x64@$NLC_VERSION libraries (GGML_BACKEND_DL, CPU variant chosen by cpuid)"
else
  LBIN=$CACHE/cmake-native/bin  # llama.cpp's CMake puts the shared libraries beside the tools
  LLAMA_LIBS=(-L"$LBIN" -lllama -lggml -lggml-base)
  BUILD_KIND="built here from the bundled source, GGML_NATIVE=ON (-march=native)"
fi
if [ ! -x "$LBIN/llamacpp_greedy" ] || [ "$ROOT/bench/engine/llamacpp_greedy.cc" -nt "$LBIN/llamacpp_greedy" ]; then
  run_logged build-greedy g++ "${TOOL_FLAGS[@]}" "$ROOT/bench/engine/llamacpp_greedy.cc" -o "$LBIN/llamacpp_greedy" \
    "${LLAMA_LIBS[@]}" '-Wl,-rpath,$ORIGIN'
fi

# ---------------------------------------------------------------------------------------------
# 2. Models, GGUF conversion, and a token-for-token check of the conversion
# ---------------------------------------------------------------------------------------------
make_gguf() {  # model dir, gguf path: converts when the GGUF is missing or older than the model
  if [ ! -f "$2" ] || [ "$1/model.safetensors" -nt "$2" ] || [ "$ROOT/bench/engine/safetensors_to_gguf.py" -nt "$2" ]; then
    run_logged "convert-$(basename "$2" .gguf)" python3 "$ROOT/bench/engine/safetensors_to_gguf.py" "$1" "$2"
  fi
}
for dt in f32 f16; do
  dir=$BUILD/bench-models/llama110m-$dt
  if [ ! -f "$dir/model.safetensors" ]; then
    run_logged "make-model-$dt" "$KEEL" make-model --arch llama --layers 12 --dim 768 --heads 12 --kv-heads 12 \
      --hidden 2048 --vocab 32000 --tie-embeddings --seed 1 --dtype "$dt" --out "$dir"
  fi
  make_gguf "$dir" "$CACHE/models/llama110m-$dt.gguf"
done
AIDREAMS=$SHARED/data/models/aidreams260K.bin
AID_DIR=$CACHE/models/aidreams260K
if [ ! -f "$AID_DIR/model.safetensors" ]; then
  [ -f "$AIDREAMS" ] || die "$AIDREAMS not found (set KEEL_SHARED)"
  run_logged convert-aidreams "$KEEL" convert --model "$AIDREAMS" --tokenizer "$SHARED/data/models/aidreams_tok512.bin" --out "$AID_DIR"
fi
make_gguf "$AID_DIR" "$CACHE/models/aidreams260K.gguf"

AGREEMENT=()
# compare LABEL KEEL_MODEL GGUF N [PROMPT]: greedy ids of both engines; appends "agreed/compared".
compare() {
  local label=$1 model=$2 gguf=$3 n=$4 prompt=${5:-} keel_ids llama_ids
  keel_ids=$(OMP_NUM_THREADS=$THREADS "$KEEL" --log-level warn generate --model "$model" --temperature 0 \
    --max-tokens "$n" --print-ids ${prompt:+--prompt "$prompt"} 2>&1 >/dev/null | sed -n 's/^ids: *//p' | tail -n 1)
  llama_ids=$("$LBIN/llamacpp_greedy" "$gguf" "$n" ${prompt:+"$prompt"} 2>"$LOGS/greedy.log" | sed -n 's/^ids: *//p')
  AGREEMENT+=("$(python3 - "$label" "$keel_ids" "$llama_ids" <<'EOF'
import sys
label, a, b = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
same = 0
while same < min(len(a), len(b)) and a[same] == b[same]:
    same += 1
n = max(len(a), len(b))
verdict = "identical" if a == b and n > 0 else "DIFFER from token %d" % same
print("%s: %d/%d greedy tokens agree (%s)" % (label, same, n, verdict))
EOF
)")
}
echo "Checking the GGUF conversion (greedy token ids, Keel vs llama.cpp, F32 KV on both) ..." >&2
compare "aidreams260K from BOS" "$AID_DIR" "$CACHE/models/aidreams260K.gguf" 127
compare "aidreams260K, prompt \"Echoes of vectors\"" "$AID_DIR" "$CACHE/models/aidreams260K.gguf" 100 "Echoes of vectors"
compare "aidreams260K, prompt \"I dream of circuits\"" "$AID_DIR" "$CACHE/models/aidreams260K.gguf" 100 "I dream of circuits"
for dt in f32 f16; do
  compare "llama110m-$dt (random weights), prompt \"hello world\"" "$BUILD/bench-models/llama110m-$dt" \
    "$CACHE/models/llama110m-$dt.gguf" 32 "hello world"
done
SYSINFO=$(sed -n 's/^system_info: //p' "$LOGS/greedy.log" | head -n 1)

# ---------------------------------------------------------------------------------------------
# 3. Interleaved measurements
# ---------------------------------------------------------------------------------------------
SAMPLES=$CACHE/samples.tsv
: >"$SAMPLES"
sample() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$SAMPLES"; }  # engine dtype row tok/s

keel_round() {  # dtype round
  local dir=$BUILD/bench-models/llama110m-$1 log=$LOGS/keel-$1-$2
  cat "$dir/model.safetensors" >/dev/null  # both engines map their weights: start from the page cache
  run_logged "keel-$1-$2-decode" env OMP_NUM_THREADS=$THREADS "$KEEL" --log-level warn bench --model "$dir" \
    --prompt-tokens $PROMPT --decode-tokens $DECODE --concurrency 1,4,16 --repeats 2 --kv-codec "raw:$KV"
  run_logged "keel-$1-$2-prefill" env OMP_NUM_THREADS=$THREADS "$KEEL" --log-level warn bench --model "$dir" \
    --prompt-tokens $LONG_PROMPT --decode-tokens 1 --concurrency 1 --repeats 2 --kv-codec "raw:$KV"
  # Table rows: | sequences | prefill tok/s | decode tok/s | memory roofline tok/s | ...
  row() { awk -F'|' -v s="$2" -v c="$3" '$2 + 0 == s { v = $c; gsub(/ /, "", v); print v }' "$1.log"; }
  sample keel "$1" "prefill $PROMPT" "$(row "$log-decode" 1 3)"
  sample keel "$1" "prefill $LONG_PROMPT" "$(row "$log-prefill" 1 3)"
  sample keel "$1" "decode 1" "$(row "$log-decode" 1 4)"
  sample keel "$1" "decode 4" "$(row "$log-decode" 4 4)"
  sample keel "$1" "decode 16" "$(row "$log-decode" 16 4)"
  sample keel-roofline "$1" "decode 1" "$(row "$log-decode" 1 5)"
}

llama_round() {  # dtype round
  local gguf=$CACHE/models/llama110m-$1.gguf log=$LOGS/llama-$1-$2
  local kvargs=(-ctk "$KV" -ctv "$KV")
  cat "$gguf" >/dev/null
  run_split "llama-$1-$2-prefill" "$LBIN/llama-bench" -m "$gguf" -t $THREADS -p $PROMPT,$LONG_PROMPT -n 0 -r 2 \
    "${kvargs[@]}" -o json
  run_split "llama-$1-$2-decode" "$LBIN/llama-bench" -m "$gguf" -t $THREADS -p 0 -n $DECODE -d $PROMPT -r 2 \
    "${kvargs[@]}" -o json
  run_logged "llama-$1-$2-batched" "$LBIN/llama-batched-bench" -m "$gguf" -t $THREADS -tb $THREADS -c 2048 \
    -npp $PROMPT -ntg $DECODE -npl 4,16 "${kvargs[@]}"
  python3 - "$log-prefill.out" "$log-decode.out" "$1" "$SAMPLES" <<'EOF'
import json, sys
rows = []
for path in sys.argv[1:3]:
    for t in json.load(open(path)):
        name = "prefill %d" % t["n_prompt"] if t["n_gen"] == 0 else "decode 1"
        rows.append((name, max(t["samples_ts"])))
with open(sys.argv[4], "a") as f:
    for name, ts in rows:
        f.write("llama\t%s\t%s\t%.2f\n" % (sys.argv[3], name, ts))
EOF
  # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
  local pl
  for pl in 4 16; do
    sample llama "$1" "decode $pl" "$(awk -F'|' -v b=$pl '$4 + 0 == b && $2 ~ /[0-9]/ { gsub(/ /, "", $9); print $9 }' "$log-batched.log")"
  done
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
echo "Measuring: $ROUNDS round(s), $THREADS threads, KV $KV, prefill $PROMPT/$LONG_PROMPT, decode $DECODE tokens ..." >&2
for dt in f32 f16; do
  for r in $(seq 1 $ROUNDS); do
    echo "  $dt round $r/$ROUNDS: Keel" >&2
    keel_round "$dt" "$r"
    echo "  $dt round $r/$ROUNDS: llama.cpp" >&2
    llama_round "$dt" "$r"
  done
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
# llama-bench logs "load_backend: loaded CPU backend from .../libggml-cpu-<variant>.so" on stderr.
VARIANT=$(sed -n 's/.*loaded CPU backend from .*\/lib\(ggml-cpu[^/]*\)\.so.*/\1/p' "$LOGS/llama-f32-1-prefill.log" | head -n 1)
[ -n "$VARIANT" ] || VARIANT="ggml-cpu linked in (native build, no runtime variants)"
read -r BUILD_INFO FLASH < <(python3 -c "
import json; t = json.load(open('$LOGS/llama-f32-1-prefill.out'))[0]
print('%s/%s' % (t['build_commit'], t['build_number']), {-1: 'auto', 0: 'off', 1: 'on'}.get(t['flash_attn'], t['flash_attn']))")

# ---------------------------------------------------------------------------------------------
# 4. Report
# ---------------------------------------------------------------------------------------------
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
CPU_FAMILY=$(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs)
CPU_MODEL=$(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | cut -d: -f2 | xargs)
KEEL_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain -- keel apps 2>/dev/null)" ]; then KEEL_COMMIT="$KEEL_COMMIT + uncommitted keel/ or apps/ changes"; fi
CMDLINE="bench/engine/vs_llamacpp.sh"
[ "$QUICK" = 1 ] && CMDLINE="KEEL_BENCH_QUICK=1 $CMDLINE"
[ "$KV" != f16 ] && CMDLINE="KEEL_BENCH_KV=$KV $CMDLINE"

echo "## Keel vs llama.cpp, llama 110M (12 x 768, vocab 32000), $THREADS threads"
echo
echo "$(date -u +%Y-%m-%d); CPU: $CPU (family $CPU_FAMILY, model $CPU_MODEL), $(nproc) cores; Keel $KEEL_COMMIT"
echo "(build/keel built $(date -u -r "$KEEL" '+%Y-%m-%d %H:%M UTC'))."
echo "llama.cpp: node-llama-cpp@$NLC_VERSION bundle (release $NLC_TAG, source commit $SRC_COMMIT, build commit/number $BUILD_INFO),"
echo "$BUILD_KIND; CPU backend llama-bench loaded: $VARIANT. llama.cpp system_info: $SYSINFO"
echo "KV cache: Keel raw:$KV, llama.cpp $KV/$KV (flash attention $FLASH). Prompt $PROMPT tokens before decode;"
echo "decode $DECODE tokens per sequence; median of $ROUNDS interleaved round(s), each the best of 2 runs"
echo "(llama-batched-bench: 1 run). Load average (1/5/15 min) before: $LOAD_BEFORE, after: $LOAD_AFTER"
echo "(anything above ~0 means other work shared the $(nproc) cores). Command: \`$CMDLINE\`"
if grep -qs '^on' /sys/kernel/mm/damon/admin/kdamonds/*/state &&
   grep -qs pageout /sys/kernel/mm/damon/admin/kdamonds/*/contexts/*/schemes/*/action; then
  echo "Note: DAMON pageout is active on this machine: it can evict the mapped weights of either engine"
  echo "mid-run (re-read from disk), which shows as outlier samples below; the medians absorb a few."
fi
echo
python3 - "$SAMPLES" "$PROMPT" "$LONG_PROMPT" <<'EOF'
import statistics, sys
samples = {}
for line in open(sys.argv[1]):
    engine, dtype, row, value = line.rstrip("\n").split("\t")
    if not value:
        sys.exit("vs_llamacpp.sh: a measurement is missing (%s %s %s): see the logs" % (engine, dtype, row))
    samples.setdefault((engine, dtype, row), []).append(float(value))
med = {k: statistics.median(v) for k, v in samples.items()}
rows = [("prefill %s" % sys.argv[2], "prefill %s tokens" % sys.argv[2]),
        ("prefill %s" % sys.argv[3], "prefill %s tokens" % sys.argv[3]),
        ("decode 1", "decode 1 sequence"), ("decode 4", "decode 4 sequences"), ("decode 16", "decode 16 sequences")]
print("| row | Keel tok/s | llama.cpp tok/s | Keel ÷ llama.cpp |")
print("|---|---:|---:|---:|")
for dtype in ("f32", "f16"):
    for key, label in rows:
        k, l = med[("keel", dtype, key)], med[("llama", dtype, key)]
        print("| %s %s | %.1f | %.1f | %.2f |" % (dtype.upper(), label, k, l, k / l))
print()
for dtype in ("f32", "f16"):
    roof = med[("keel-roofline", dtype, "decode 1")]
    dec = med[("keel", dtype, "decode 1")]
    print("%s single-sequence decode: Keel's memory roofline %.1f tok/s (its measured read bandwidth / bytes"
          " per step); Keel decode / roofline = %.2f; llama.cpp decode / the same roofline = %.2f"
          % (dtype.upper(), roof, dec / roof, med[("llama", dtype, "decode 1")] / roof))
print()
print("Samples (tok/s, round order):")
for dtype in ("f32", "f16"):
    for key, label in rows:
        print("- %s %s: Keel %s; llama.cpp %s" % (dtype.upper(), label,
              " ".join("%.1f" % v for v in samples[("keel", dtype, key)]),
              " ".join("%.1f" % v for v in samples[("llama", dtype, key)])))
EOF
echo
echo "Conversion check (greedy token ids, Keel vs llama.cpp, F32 KV):"
for line in "${AGREEMENT[@]}"; do echo "- $line"; done
