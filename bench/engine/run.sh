#!/usr/bin/env bash
# Engine benchmarks, side by side in one run: in-process prefill/decode tokens/s next to the
# memory-bandwidth roofline, for the reference model and a generated ~110M-parameter Llama; then
# the server under 32 concurrent streaming clients next to in-process decode at the same
# concurrency. Prints Markdown for docs/results.md. Loopback only.
#
#   bench/engine/run.sh            (after scripts/setup; KEEL_BENCH_QUICK=1 for a short run)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${KEEL_BUILD_DIR:-build}
KEEL=$BUILD/keel
SHARED=${KEEL_SHARED:-$(cd .. && pwd)/shared}
AIDREAMS=$SHARED/data/models/aidreams260K.bin
BIG=$BUILD/bench-models/llama110m
QUICK=${KEEL_BENCH_QUICK:-0}
PORT=${KEEL_BENCH_PORT:-18080}

ninja -C "$BUILD" keel server_load_bench matmul_bench >/dev/null
if [ ! -f "$BIG/model.safetensors" ]; then
  "$KEEL" make-model --arch llama --layers 12 --dim 768 --heads 12 --kv-heads 12 --hidden 2048 \
    --vocab 32000 --tie-embeddings --seed 1 --out "$BIG" 2>/dev/null
fi

echo "## Engine ($(date -u +%Y-%m-%d), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
echo
echo "### MatMul kernel vs scalar loop"
echo
"$BUILD/matmul_bench"
echo
reps=3; [ "$QUICK" = 1 ] && reps=1
"$KEEL" bench --model "$AIDREAMS" --prompt-tokens 32 --decode-tokens 64 --concurrency 1,16 --repeats $reps
echo
"$KEEL" bench --model "$BIG" --prompt-tokens 64 --decode-tokens 32 --concurrency 1,16 --repeats $reps
echo

serve_load() {  # model, name, max_tokens, clients, requests -> prints the load table, sets SERVED
  "$KEEL" --log-level warn serve --model "$1" --model-name "$2" --port "$PORT" --max-queue 256 --max-running 32 &
  local pid=$!
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break; sleep 0.1; done
  local out
  out=$("$BUILD/server_load_bench" --port "$PORT" --model "$2" --clients "$4" --requests "$5" --max-tokens "$3" || true)
  echo "$out"
  SERVED=$(echo "$out" | tail -n 1 | awk -F'|' '{gsub(/ /, "", $4); print $4}')
  kill -TERM $pid
  wait $pid || true
}

compare() {  # model, max_tokens: in-process decode at 32 sequences, and the server's share of it
  local table inproc
  table=$("$KEEL" bench --model "$1" --prompt-tokens 8 --decode-tokens "$2" --concurrency 32 --repeats 1)
  echo "In-process decode at the same concurrency (the server's ceiling):"
  echo
  echo "$table" | tail -n 3
  inproc=$(echo "$table" | tail -n 1 | awk -F'|' '{gsub(/ /, "", $4); print $4}')
  echo
  awk -v s="$SERVED" -v i="$inproc" 'BEGIN { printf "server streamed tokens/s / in-process decode tokens/s = %.2f\n", s / i }'
}

echo "### Server: 32 concurrent streaming clients, aidreams260K, 64 tokens each"
echo
serve_load "$AIDREAMS" aidreams260K 64 32 $([ "$QUICK" = 1 ] && echo 1 || echo 4)
echo
compare "$AIDREAMS" 64
echo
echo "### Server: 32 concurrent streaming clients, llama110m, 32 tokens each"
echo
serve_load "$BIG" llama110m 32 32 1
echo
compare "$BIG" 32
