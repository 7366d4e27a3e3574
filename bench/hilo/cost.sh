#!/usr/bin/env bash
# Where a request's CPU goes, per product state: the product (bench/hilo/product.sh) pinned to each
# state in turn, a flat open-loop load of RATE req/s for DURATION_S seconds, and each process's CPU time
# (utime + stime from /proc/PID/stat) divided by the requests answered. A state that costs less
# CPU per request is what buys capacity on a machine where every service shares the same cores;
# validate's capacities are noisy (docs/results.md), CPU per request much less so.
#
#   bench/hilo/cost.sh CATALOG [OUT]      (OUT default /tmp/keel-cost)
# Knobs (environment): RATE (20), DURATION_S (30; it was SECONDS, which is bash's own clock, so its
# default never applied and an unset SECONDS ran each state for about 0 s), QUERIES (30),
# MAX_TOKENS (32, every request's max_tokens), STATES (default: every state of the catalog), BUILD,
# PORT_BASE (17700), KEEL_SHARED. Prints a markdown table, also in OUT/cost.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
case "$BUILD" in /*) KEEL=$BUILD/keel ;; *) KEEL=$ROOT/$BUILD/keel ;; esac
[ $# -ge 1 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
CATALOG=$(realpath "$1")
OUT=${2:-/tmp/keel-cost}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
DIR=$OUT/product
export PORT_BASE=${PORT_BASE:-17700}
export KEEL_SHARED=${KEEL_SHARED:-$(cd .. && pwd)/shared}
RATE=${RATE:-20}
SECONDS_PER_STATE=${DURATION_S:-30}
QUERIES=${QUERIES:-30}
MAX_TOKENS=${MAX_TOKENS:-32}
STATES=${STATES:-$(python3 -c 'import json,sys; print(" ".join(s["name"] for s in json.load(open(sys.argv[1]))["states"]))' "$CATALOG")}
FULL=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["states"][0]["name"])' "$CATALOG")
NAMES="controller vector engine-large engine-small gateway-policy gateway answer"  # product.sh's start order
TICK=$(getconf CLK_TCK)

trap 'bench/hilo/product.sh stop "$DIR" || true' EXIT
bench/hilo/product.sh start "$DIR" "$CATALOG" --pin "$FULL" --allow-unvalidated 2>"$OUT/product-start.log" \
  || { echo "cost: the product did not start:" >&2; tail -20 "$OUT/product-start.log" >&2; exit 1; }
. "$DIR/env"
mapfile -t PIDS <"$DIR/pids"
TOKEN=$(cat "$ADMIN_TOKEN_FILE")

pin() {
  curl -sf -X POST -H "Authorization: Bearer $TOKEN" -d "{\"state\":\"$1\"}" "$CONTROLLER/v1/pin" >/dev/null \
    || { echo "cost: the controller refused to pin '$1'" >&2; exit 1; }
  # Every service applies the pinned state within a report round or two.
  for _ in $(seq 1 40); do
    curl -sf "$CONTROLLER/v1/services" | python3 -c '
import json, sys
svc = json.load(sys.stdin)["services"]
sys.exit(0 if len(svc) >= 5 and all(e["applied_state"] == sys.argv[1] for e in svc) else 1)' "$1" && return 0
    sleep 0.25
  done
  echo "cost: WARNING: not every service reported '$1' applied; measuring anyway" >&2
}

cpu_ticks() {  # one line: ticks per process, in NAMES order
  local out=()
  for pid in "${PIDS[@]}"; do
    out+=("$(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)")
  done
  echo "${out[*]}"
}

pin "$FULL"
for _ in $(seq 1 30); do
  "$KEEL" hilo replay --answer "$ANSWER" --controller "$CONTROLLER" --queries "$QUERIES" --max-tokens "$MAX_TOKENS" \
    --write-references "$OUT/references.jsonl" >"$OUT/references.json" 2>"$OUT/references.log" && break
  sleep 0.5
done
printf '0,%s\n%s,%s\n' "$RATE" "$SECONDS_PER_STATE" "$RATE" >"$OUT/flat.csv"

: >"$OUT/cost.jsonl"
for state in $STATES; do
  pin "$state"
  sleep 2
  before=$(cpu_ticks)
  "$KEEL" hilo replay --answer "$ANSWER" --controller "$CONTROLLER" --references "$OUT/references.jsonl" \
    --queries "$QUERIES" --max-tokens "$MAX_TOKENS" --trace-csv "$OUT/flat.csv" --baseline-rate "$RATE" --window-s 5 --label "$state" \
    --out-csv "$OUT/cost_$state.csv" >"$OUT/replay_$state.json" 2>"$OUT/replay_$state.log" \
    || { echo "cost: replay failed in '$state':" >&2; tail -5 "$OUT/replay_$state.log" >&2; exit 1; }
  after=$(cpu_ticks)
  python3 - "$state" "$TICK" "$NAMES" "$before" "$after" "$OUT/replay_$state.json" >>"$OUT/cost.jsonl" <<'PY'
import json, sys
state, tick, names, before, after, summary = sys.argv[1:]
names = names.split(); b = list(map(int, before.split())); a = list(map(int, after.split()))
s = json.loads(open(summary).read().strip().splitlines()[-1])
ok = max(1, s["ok"])
cpu = {n: (a[i] - b[i]) * 1000.0 / int(tick) / ok for i, n in enumerate(names)}
print(json.dumps({"state": state, "ok": s["ok"], "arrived": s["arrived"], "failed": s["failed"],
                  "quality": s["full_quality"] - s["mean_drop"], "cpu_ms_per_request": cpu}))
PY
  tail -1 "$OUT/cost.jsonl" >&2
done

python3 - "$OUT/cost.jsonl" "$NAMES" "$RATE" "$SECONDS_PER_STATE" <<'PY' | tee "$OUT/cost.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
names = sys.argv[2].split()
print(f"Flat {sys.argv[3]} req/s for {sys.argv[4]} s per state; CPU ms per answered request (utime + stime).\n")
print("| state | answered | mean quality | " + " | ".join(names) + " | total | total vs first |")
print("|---|---:|---:|" + "---:|" * (len(names) + 2))
first = None
for r in rows:
    c = r["cpu_ms_per_request"]; total = sum(c.values())
    first = first or total
    print(f"| {r['state']} | {r['ok']}/{r['arrived']} | {r['quality']:.1f} | " +
          " | ".join(f"{c[n]:.2f}" for n in names) + f" | {total:.2f} | {total / first:.2f} |")
PY
