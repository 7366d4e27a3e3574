#!/usr/bin/env bash
# The simulation beside a live run (issue 23: "the simulation agrees with the live runs within 10%
# where both exist"). Reads LIVE_OUT/run.env and LIVE_OUT/summary.jsonl written by
# bench/hilo/live.sh, runs build/sim_bench on the same catalog (its validated capacities are the
# live measurements the service models are fitted to), baseline rate, time scale, window, SLO and
# seed, with the live control loop and the live per-service rule (sim_bench --live-loop), at
# scale 1 (the live run) and at SIM_SCALE (default 100: the same traces at 100x the rates,
# capacities and servers), and prints, per trace and policy, the live and simulated max and mean
# drops and their differences relative to the live figure.
#
#   bench/hilo/sim_vs_live.sh LIVE_OUT [OUT]        (OUT default LIVE_OUT/sim)
# The answer service's in-flight bound (run.env's ANSWER_MAX_INFLIGHT; product.sh's default 64 for
# runs that did not record it) is the simulation's entry bound (sim_bench --entry-max-in-flight):
# live, a request beyond it is shed at the entry, and it bounds the engine's queue; ENTRY_BOUND=0
# simulates without it. The engine is simulated as a continuous-batching service
# (sim_bench --batch-slowdown): BATCH_SLOWDOWN, default engine=0.236, measured by
# bench/hilo/batching.sh (docs/results.md); BATCH_SLOWDOWN=0 gives every slot its own worker, the
# model before. CAPACITY_UTILISATION (default 0.945: the full state's catalog capacity, 189.9
# req/s, over the 200.8 req/s it answered under a 300 req/s open-loop overload, bench/hilo/cost.sh;
# docs/results.md) is sim_bench --capacity-utilisation; 0.9 was the assumption before.
# Knobs: BUILD (default build), SIM_SCALE (100), SERVERS (workers per service at scale 1: N, or
# per service as sim_bench --servers takes them; default 8, and the engine's the live run's
# ENGINE_MAX_RUNNING), SIM_CATALOG (default the live run's catalog:
# another validation's figures for the same product, e.g. one with per-service capacities).
# Where a live drop is below 1 point the relative difference is not defined; the absolute one is
# printed and the row is judged on |sim - live| <= 1 point instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
case "$BUILD" in /*) SIM=$BUILD/sim_bench ;; *) SIM=$ROOT/$BUILD/sim_bench ;; esac
[ $# -ge 1 ] || { sed -n '2,24p' "$0" >&2; exit 2; }
LIVE=$(realpath "$1")
OUT=${2:-$LIVE/sim}
SIM_SCALE=${SIM_SCALE:-100}
SERVERS_SET=${SERVERS:-}
[ -f "$LIVE/run.env" ] && [ -s "$LIVE/summary.jsonl" ] \
  || { echo "sim_vs_live: $LIVE has no run.env or summary.jsonl (run bench/hilo/live.sh first)" >&2; exit 1; }
[ -x "$SIM" ] || { echo "sim_vs_live: $SIM missing (build sim_bench)" >&2; exit 1; }
. "$LIVE/run.env"
CATALOG=${SIM_CATALOG:-$CATALOG}
# The engine's workers are the live engine's slots when the run recorded them.
SERVERS=${SERVERS_SET:-engine=${ENGINE_MAX_RUNNING:-8}}
mkdir -p "$OUT"
: >"$OUT/sim_1x.jsonl"
: >"$OUT/sim_scaled.jsonl"
ENTRY_BOUND=${ENTRY_BOUND:-${ANSWER_MAX_INFLIGHT:-64}}
BATCH_SLOWDOWN=${BATCH_SLOWDOWN:-engine=0.236}
CAPACITY_UTILISATION=${CAPACITY_UTILISATION:-0.945}
common=(--catalog "$CATALOG" --baseline-rate "$BASELINE_RATE" --time-scale "$TIME_SCALE" --window-s "$WINDOW_S"
        --slo-ms "$SLO_MS" --seed "$SEED" --servers "$SERVERS" --entry-max-in-flight "$ENTRY_BOUND"
        --batch-slowdown "$BATCH_SLOWDOWN" --capacity-utilisation "$CAPACITY_UTILISATION")
# The live run's baseline thresholds (CONTROLLER_FLAGS in run.env), which sim_bench takes by the
# same names.
read -r -a ctl_flags <<<"${CONTROLLER_FLAGS:-}"
for ((i = 0; i + 1 < ${#ctl_flags[@]}; i++)); do
  case "${ctl_flags[i]}" in
    --baseline-queue-ms|--baseline-recover-queue-ms) common+=("${ctl_flags[i]}" "${ctl_flags[i + 1]}") ;;
    --objective) common+=(--objective "${ctl_flags[i + 1]}") ;;
    --recent-rate-guard) case "${ctl_flags[i + 1]}" in false|0|off|no) common+=(--no-recent-rate-guard) ;; esac ;;
  esac
done
"$SIM" "${common[@]}" --live-loop --scale 1 --jsonl "$OUT/sim_1x.jsonl" --csv-dir "$OUT" >"$OUT/sim_1x.md"
"$SIM" "${common[@]}" --live-loop --scale "$SIM_SCALE" --jsonl "$OUT/sim_scaled.jsonl" >"$OUT/sim_scaled.md"

python3 - "$LIVE/summary.jsonl" "$OUT/sim_1x.jsonl" "$OUT/sim_scaled.jsonl" "$SIM_SCALE" <<'PY' | tee "$OUT/sim_vs_live.md"
import json, sys
def load(path):
    return {(r["label"], r["trace"]): r for r in (json.loads(l) for l in open(path) if l.strip())}
live, sim1, simk = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
k = sys.argv[4]
def diff(s, l):
    if l < 1:
        return f"{s - l:+.1f} pt", abs(s - l) <= 1
    return f"{100 * (s - l) / l:+.0f} %", abs(s - l) <= 0.1 * l
print(f"| policy | trace | live max drop | sim max drop | diff | live mean drop | sim mean drop | diff | within 10 %? | sim {k}x max / mean drop |")
print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
agree = total = 0
for key, l in live.items():
    s = sim1.get(key)
    if s is None:
        continue
    dmax, okmax = diff(s["max_drop"], l["max_drop"])
    dmean, okmean = diff(s["mean_drop"], l["mean_drop"])
    sk = simk.get(key, {})
    total += 1
    agree += okmax and okmean
    print(f"| {key[0]} | {key[1]} | {l['max_drop']:.1f} | {s['max_drop']:.1f} | {dmax} | {l['mean_drop']:.1f} | "
          f"{s['mean_drop']:.1f} | {dmean} | {'yes' if okmax and okmean else 'no'} | "
          f"{sk.get('max_drop', float('nan')):.1f} / {sk.get('mean_drop', float('nan')):.1f} |")
print(f"\nMax and mean drop both within 10 % (or 1 point) on {agree} of {total} live runs.")
PY
