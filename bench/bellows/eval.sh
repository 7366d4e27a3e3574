#!/usr/bin/env bash
# BellowsKV evaluation (issue 18): calibrates every configuration with `keel bellows calibrate`
# on data/text/train.txt, then measures all of them and the baselines at equal memory in ONE
# kv_quality_bench run per model on data/text/val.txt. Tables: docs/results.md (BellowsKV).
#   bench/bellows/eval.sh [BUILD_DIR] [OUT_DIR]      (KEEL_SHARED as for the tests)
# Ranks are chosen so that each row's measured effective compression (raw bf16 K/V bytes over
# the bytes the cache holds, 16-token blocks, arena granule included) reaches the target:
# see the comments per model. Baselines get the largest size that does not exceed the target's
# memory; a baseline that cannot reach a target is left out of that target's rows.
set -euo pipefail
BUILD=${1:-build}
OUT=${2:-/tmp/bellows-eval}
SHARED=${KEEL_SHARED:-$(cd "$(dirname "$0")/../../.." && pwd)/shared}
D=$SHARED/data
TOKENS=${BELLOWS_TOKENS:-32768}
WINDOWS=${BELLOWS_WINDOWS:-64}
mkdir -p "$OUT"
KEEL=$BUILD/keel
KVQ=$BUILD/kv_quality_bench

calibrate() {  # model tokenizer name args...
  local model=$1 tok=$2 name=$3; shift 3
  [[ -f $OUT/$name.bkv ]] && return 0
  echo "calibrate $name: $*" >&2
  "$KEEL" bellows calibrate -m "$model" -z "$tok" --text "$D/text/train.txt" --tokens "$TOKENS" \
    --log-level warn --out "$OUT/$name.bkv" "$@" 2>/dev/null
}

run_model() {  # tag model tokenizer context ranks(4x 8x 14x 20x: joint) tt_ranks per_layer_ranks
  local tag=$1 model=$2 tok=$3 ctx=$4
  local -a joint=($5) tt=($6) per=($7) ratios=(4 8 14 20)
  local -a codecs=(--codec raw:bf16)
  for i in 0 1 2 3; do
    local r=${ratios[$i]}
    calibrate "$model" "$tok" "$tag-plain-$r" --rank "${joint[$i]}" --objective plain
    calibrate "$model" "$tok" "$tag-tt-$r" --rank "${tt[$i]}" --token-table --objective plain
    calibrate "$model" "$tok" "$tag-palu-$r" --rank "${per[$i]}" --group-size 1 --objective plain
    calibrate "$model" "$tok" "$tag-input-$r" --rank "${per[$i]}" --input-pca
    codecs+=(--codec "bellows-plain-${r}x=bellows@bellows=$OUT/$tag-plain-$r.bkv"
             --codec "bellows-${r}x=bellows@bellows=$OUT/$tag-tt-$r.bkv"
             --codec "palu-${r}x=bellows@bellows=$OUT/$tag-palu-$r.bkv"
             --codec "input-pca-${r}x=bellows@bellows=$OUT/$tag-input-$r.bkv")
  done
  # Beyond the plain fit, at 14x: the attention-aware objective (the token-table fit otherwise).
  calibrate "$model" "$tok" "$tag-tt-attn-14" --rank "${tt[2]}" --token-table --objective attention
  codecs+=(--codec "bellows-attn-14x=bellows@bellows=$OUT/$tag-tt-attn-14.bkv")
  codecs+=(--codec kivi:2 --codec kivi:4 --codec minicache --codec minicache:q4)
  "$KVQ" --model "$model" --tokenizer "$tok" --text "$D/text/val.txt" --windows "$WINDOWS" --context "$ctx" \
    --spread --split-docs --json "$OUT/$tag.json" "${codecs[@]}" 2>"$OUT/$tag.log" | tee "$OUT/$tag.md"
}

# en-dense6L: 6 layers x 2 x kv_dim 64 = 768 bf16 (1536 B) per token. Joint latent r takes 32r B
# per 16-token block, arena ranges in 64 B: r = 192, 96, 54, 38 -> 4.0, 8.0, 14.2, 20.2x; with
# the token id one fewer. Per layer (128 values): r = 32, 16, 8, 6 -> 4, 8, 16, 21.3x.
run_model en-dense6L "$D/models/en-dense6L.bin" "$D/models/tok354.bin" 256 "192 96 54 38" "191 95 53 37" "32 16 8 6"
# aidreams260K: 4 layers x 2 x 64 = 512 bf16 (1024 B) per token: r = 128, 64, 36, 24 -> 4, 8,
# 14.2, 21.3x; per layer r = 32, 16, 8, 6 -> 4, 8, 16, 21.3x.
run_model aidreams260K "$D/models/aidreams260K.bin" "$D/models/aidreams_tok512.bin" 128 "128 64 36 24" "127 63 35 23" "32 16 8 6"
