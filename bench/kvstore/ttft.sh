#!/usr/bin/env bash
# Time to first token for prompts sharing a long prefix: no store (recompute), local prefix cache
# (same instance), and shared kvstore (prefix prefilled by another instance). Same run, same model.
# Usage: bench/kvstore/ttft.sh [prefix_words]   (needs build/keel; generates a model once)
set -euo pipefail
cd "$(dirname "$0")/../.."
KEEL=build/keel
WORDS=${1:-460}  # about 2K tokens with the generated tokenizer
MODEL=build/bench-models/ttft
if [ ! -f "$MODEL/config.json" ]; then
  $KEEL make-model --layers 8 --dim 512 --heads 8 --kv-heads 8 --context 4096 --out "$MODEL" >/dev/null 2>&1
fi
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
SP=$(port); PA=$(port); PB=$(port); PC=$(port)
pids=()
trap 'kill ${pids[*]} 2>/dev/null || true' EXIT
$KEEL kvstore --port "$SP" --http-port -1 --dram-mb 2048 2>/dev/null & pids+=($!)
$KEEL serve -m "$MODEL" --port "$PA" --kv-memory-mb 1024 --kvstore 127.0.0.1:$SP --kvstore-timeout-ms 5000 2>/dev/null & pids+=($!)
$KEEL serve -m "$MODEL" --port "$PB" --kv-memory-mb 1024 --kvstore 127.0.0.1:$SP --kvstore-timeout-ms 5000 2>/dev/null & pids+=($!)
$KEEL serve -m "$MODEL" --port "$PC" --kv-memory-mb 1024 2>/dev/null & pids+=($!)
for p in $PA $PB $PC; do for _ in $(seq 1 200); do curl -sf "http://127.0.0.1:$p/healthz" >/dev/null && break; sleep 0.1; done; done
PREFIX=$(python3 -c "import random;random.seed(7);w=['alpha','beta','gamma','delta','river','stone','cloud','light'];print(' '.join(random.choice(w) for _ in range($WORDS)))")
ask() {  # port suffix -> seconds to the (single) first token
  local body
  body=$(python3 -c "import json,sys;print(json.dumps({'model':'ttft','prompt':sys.argv[1]+' '+sys.argv[2],'max_tokens':1,'temperature':0}))" "$PREFIX" "$2")
  curl -s -o /tmp/ttft.$$ -w '%{time_total}' -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$1/v1/completions"
  python3 -c "import json;u=json.load(open('/tmp/ttft.$$'))['usage'];print(' prompt_tokens',u['prompt_tokens'],end='')" >&2
}
echo "# $(nproc) vCPU, model $MODEL ($($KEEL inspect $MODEL 2>/dev/null | grep -i param | head -1)), prefix ${WORDS} words"
cold=$(ask "$PC" "first question"); echo " recompute (no store):        ${cold} s" >&2
local_hit=$(ask "$PC" "second question"); echo " local prefix cache:          ${local_hit} s" >&2
ask "$PA" "question from A" >/dev/null
for _ in $(seq 1 100); do
  n=$(curl -s "http://127.0.0.1:$PA/metrics" | awk '/^keel_kvstore_link_published_chunks_total/{print $2}')
  [ "${n:-0}" != "0" ] && break; sleep 0.1
done
sleep 1
shared=$(ask "$PB" "question from B"); echo " shared store (from A):       ${shared} s" >&2
hit=$(curl -s "http://127.0.0.1:$PB/metrics" | awk '/^keel_kvstore_link_hit_tokens_total/{print $2}')
python3 - "$cold" "$local_hit" "$shared" "$hit" <<'PY'
import sys
cold, local, shared, hit = map(float, sys.argv[1:5])
print(f"| path | TTFT s | vs recompute |\n|---|---|---|\n| recompute | {cold:.3f} | 1.00 |\n| local prefix cache | {local:.3f} | {local/cold:.2f} |\n| shared kvstore (B reuses A) | {shared:.3f} | {shared/cold:.2f} |")
print(f"B tokens served from the store: {int(hit)}")
PY
