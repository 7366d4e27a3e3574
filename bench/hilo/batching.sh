#!/usr/bin/env bash
# How the product's engine batches: the simulation's batch_slowdown (keel/hilo/sim.h) measured.
# Starts the product (bench/hilo/product.sh) pinned to the catalog's first state, drives `keel
# answer` closed-loop with 1 client and then with as many clients as the engine has batch slots
# (bench/hilo/closed_loop.py), and prints the slowdown per other request in the batch:
#   (mean latency with N clients / mean latency with 1 - 1) / (N - 1)
# which is what sim_bench --batch-slowdown engine=X takes (bench/hilo/sim_vs_live.sh's
# BATCH_SLOWDOWN). The latencies are the product's, end to end: the engine is ~88 % of a request's
# CPU (docs/results.md, "HiLO: what each knob costs").
#
#   bench/hilo/batching.sh CATALOG [OUT]       (OUT default /tmp/keel-batching)
# Knobs: DURATION_S (15 per client count), ENGINE_MAX_RUNNING (32: the slots, and the clients),
# MAX_TOKENS (32), BUILD, PORT_BASE (17900), KEEL_SHARED.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
CATALOG=$(realpath "$1")
OUT=${2:-/tmp/keel-batching}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PORT_BASE=${PORT_BASE:-17900}
export KEEL_SHARED=${KEEL_SHARED:-$(cd .. && pwd)/shared}
export ENGINE_MAX_RUNNING=${ENGINE_MAX_RUNNING:-32}
SECS=${DURATION_S:-15}
FULL=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["states"][0]["name"])' "$CATALOG")
trap 'bench/hilo/product.sh stop "$OUT/product" || true' EXIT
bench/hilo/product.sh start "$OUT/product" "$CATALOG" --pin "$FULL" --allow-unvalidated 2>"$OUT/product-start.log" \
  || { echo "batching: the product did not start:" >&2; tail -20 "$OUT/product-start.log" >&2; exit 1; }
. "$OUT/product/env"
python3 bench/hilo/closed_loop.py "$ANSWER" 3 4 "${MAX_TOKENS:-32}" >/dev/null  # warm up
python3 bench/hilo/closed_loop.py "$ANSWER" "$SECS" "1,$ENGINE_MAX_RUNNING" "${MAX_TOKENS:-32}" | tee "$OUT/closed_loop.jsonl"
python3 - "$OUT/closed_loop.jsonl" <<'PY' | tee "$OUT/batching.md"
import json, sys
one, full = [json.loads(l) for l in open(sys.argv[1])]
n = full["clients"]
x = (full["mean_ms"] / one["mean_ms"] - 1) / (n - 1)
print(f"1 client: {one['rate']:.1f} req/s, mean {one['mean_ms']:.1f} ms; {n} clients: {full['rate']:.1f} req/s, "
      f"mean {full['mean_ms']:.1f} ms; batch gain {full['rate'] / one['rate']:.2f}x")
print(f"batch slowdown per other request: {x:.3f}  (sim_bench --batch-slowdown engine={x:.3f})")
PY
