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
# MORE_LIVE="DIR ..." adds other live runs of the same set-up (catalog, rates, time scale, window,
# SLO, controller flags, engine slots and threads: refused otherwise); the live figure is then their mean, and
# the table shows their range: one live run moves by more than 10 % from the next on this VM.
# The machine's speed drift (sim_bench --speed-sd; docs/results.md, "HiLO: the simulation's
# machine drifts") is simulated at scale 1 with SPEED_SD (the spread of the served rate in flat
# overload replays), SPEED_TAU_S (their correlation time) and SPEED_RUN_SD (the spread of those
# replays' means: a whole run faster or slower); defaults 0.043, 5.6 s and 0.02 for a run with
# one thread per engine (run.env's ENGINE_THREADS=1), else 0.095, 9 s and 0.07 (two threads),
# over SPEED_SEEDS speed paths (default 8; the arrivals stay the live run's seed); the simulated
# figure is their mean, with their range. SPEED_SD=0 SPEED_RUN_SD=0 simulates a constant speed
# (one path). At SIM_SCALE the speed is constant: 100x the product is many machines, whose
# drifts average out.
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
[ $# -ge 1 ] || { sed -n '2,38p' "$0" >&2; exit 2; }
LIVE=$(realpath "$1")
OUT=${2:-$LIVE/sim}
SIM_SCALE=${SIM_SCALE:-100}
SERVERS_SET=${SERVERS:-}
[ -f "$LIVE/run.env" ] && [ -s "$LIVE/summary.jsonl" ] \
  || { echo "sim_vs_live: $LIVE has no run.env or summary.jsonl (run bench/hilo/live.sh first)" >&2; exit 1; }
[ -x "$SIM" ] || { echo "sim_vs_live: $SIM missing (build sim_bench)" >&2; exit 1; }
# The set-up a live run recorded, for comparing runs.
setup() { (. "$1/run.env"; echo "$CATALOG|$BASELINE_RATE|$TIME_SCALE|$WINDOW_S|$SLO_MS|$SEED|${CONTROLLER_FLAGS:-}|${ENGINE_MAX_RUNNING:-}|${ANSWER_MAX_INFLIGHT:-}|${ENGINE_THREADS:-}"); }
LIVE_RUNS=("$LIVE")
for more in ${MORE_LIVE:-}; do
  more=$(realpath "$more")
  [ -f "$more/run.env" ] && [ -s "$more/summary.jsonl" ] || { echo "sim_vs_live: $more has no run.env or summary.jsonl" >&2; exit 1; }
  [ "$(setup "$more")" = "$(setup "$LIVE")" ] \
    || { echo "sim_vs_live: $more was run with another set-up than $LIVE (run.env differs)" >&2; exit 1; }
  LIVE_RUNS+=("$more")
done
. "$LIVE/run.env"
# The drift fitted to the product as the live run ran it (run.env's ENGINE_THREADS: 1, or empty for
# OpenMP's two per engine; docs/results.md, "HiLO: the simulation's machine drifts").
if [ "${ENGINE_THREADS:-}" = 1 ]; then fit=(0.043 5.6 0.02); else fit=(0.095 9 0.07); fi
SPEED_SD=${SPEED_SD:-${fit[0]}}
SPEED_TAU_S=${SPEED_TAU_S:-${fit[1]}}
SPEED_RUN_SD=${SPEED_RUN_SD:-${fit[2]}}
SPEED_SEEDS=${SPEED_SEEDS:-8}
[[ "$SPEED_SEEDS" =~ ^[1-9][0-9]{0,2}$ ]] || { echo "sim_vs_live: SPEED_SEEDS must be 1..999" >&2; exit 2; }
# 1 when the speed drifts, 0 when it is constant; fails unless both are numbers >= 0.
drifts=$(python3 -c 'import sys; sd, run = float(sys.argv[1]), float(sys.argv[2]); assert min(sd, run) >= 0; print(int(sd + run > 0))' \
  "$SPEED_SD" "$SPEED_RUN_SD" 2>/dev/null) || { echo "sim_vs_live: SPEED_SD and SPEED_RUN_SD must be numbers >= 0" >&2; exit 2; }
CATALOG=${SIM_CATALOG:-$CATALOG}
# The engine's workers are the live engine's slots when the run recorded them.
SERVERS=${SERVERS_SET:-engine=${ENGINE_MAX_RUNNING:-8}}
mkdir -p "$OUT"
rm -f "$OUT"/sim_1x*.jsonl "$OUT"/sim_1x*.md
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
# Scale 1: one run per speed path (the first writes the per-window CSVs for the plots).
paths=$SPEED_SEEDS
[ "$drifts" = 1 ] || paths=1
for ((k = 1; k <= paths; k++)); do
  csv=()
  [ "$k" = 1 ] && csv=(--csv-dir "$OUT")
  "$SIM" "${common[@]}" --live-loop --scale 1 --speed-sd "$SPEED_SD" --speed-tau-s "$SPEED_TAU_S" --speed-run-sd "$SPEED_RUN_SD" --speed-seed "$k" \
    --jsonl "$OUT/sim_1x_$k.jsonl" "${csv[@]}" >"$OUT/sim_1x_$k.md"
done
"$SIM" "${common[@]}" --live-loop --scale "$SIM_SCALE" --jsonl "$OUT/sim_scaled.jsonl" >"$OUT/sim_scaled.md"

summaries=()
for d in "${LIVE_RUNS[@]}"; do summaries+=("$d/summary.jsonl"); done
python3 - "$OUT" "$paths" "$OUT/sim_scaled.jsonl" "$SIM_SCALE" "$drifts" "$SPEED_SD" "$SPEED_TAU_S" "$SPEED_RUN_SD" \
  "${summaries[@]}" <<'PY' | tee "$OUT/sim_vs_live.md"
import json, sys
out, paths, scaled, k, drifts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
sd, tau, run_sd = sys.argv[6:9]
live_paths = sys.argv[9:]
def load(path):
    return {(r["label"], r["trace"]): r for r in (json.loads(l) for l in open(path) if l.strip())}
def gather(files):  # (policy, trace) -> ([max drops], [mean drops]), one per file that has it
    acc = {}
    for f in files:
        for key, r in load(f).items():
            m = acc.setdefault(key, ([], []))
            m[0].append(r["max_drop"])
            m[1].append(r["mean_drop"])
    return acc
live = gather(live_paths)
sim1 = gather([f"{out}/sim_1x_{i}.jsonl" for i in range(1, paths + 1)])
simk = load(scaled)
mean = lambda v: sum(v) / len(v)
def cell(v):
    return f"{mean(v):.1f}" if len(v) == 1 else f"{mean(v):.1f} ({min(v):.1f}-{max(v):.1f})"
def diff(s, l):
    if l < 1:
        return f"{s - l:+.1f} pt", abs(s - l) <= 1
    return f"{100 * (s - l) / l:+.0f} %", abs(s - l) <= 0.1 * l
runs = len(live_paths)
print(f"Live: {'the mean of ' + str(runs) + ' runs (range)' if runs > 1 else 'one run'}. Simulated at 1x: "
      + (f"the mean of {paths} machine-speed paths (range), speed sd {sd}, correlation time {tau} s, per-run sd {run_sd}."
         if drifts else "a constant machine speed."))
print()
print(f"| policy | trace | live max drop | sim max drop | diff | live mean drop | sim mean drop | diff | within 10 %? | sim {k}x max / mean drop |")
print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
agree = total = inside = 0
for key, l in live.items():
    s = sim1.get(key)
    if s is None or len(l[0]) != runs:
        continue
    dmax, okmax = diff(mean(s[0]), mean(l[0]))
    dmean, okmean = diff(mean(s[1]), mean(l[1]))
    sk = simk.get(key, {})
    total += 1
    agree += okmax and okmean
    inside += min(s[0]) <= mean(l[0]) <= max(s[0])
    print(f"| {key[0]} | {key[1]} | {cell(l[0])} | {cell(s[0])} | {dmax} | {cell(l[1])} | "
          f"{cell(s[1])} | {dmean} | {'yes' if okmax and okmean else 'no'} | "
          f"{sk.get('max_drop', float('nan')):.1f} / {sk.get('mean_drop', float('nan')):.1f} |")
print(f"\nMax and mean drop both within 10 % (or 1 point) on {agree} of {total} (policy, trace) pairs.")
if paths > 1:
    print(f"The live max drop lies within the simulated paths' range on {inside} of {total}.")
if runs > 1:
    # The live runs against each other: how far one run is from the others' mean.
    pairs = ok = 0
    for key, l in live.items():
        if len(l[0]) != runs:
            continue
        for i in range(runs):
            rest = [j for j in range(runs) if j != i]
            okmax = diff(l[0][i], mean([l[0][j] for j in rest]))[1]
            okmean = diff(l[1][i], mean([l[1][j] for j in rest]))[1]
            pairs += 1
            ok += okmax and okmean
    print(f"Live against live: one run within 10 % (or 1 point) of the others' mean, max and mean drop, on {ok} of {pairs}.")
PY
