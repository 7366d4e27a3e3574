#!/usr/bin/env bash
# Live surge replay (issue 23): the surge traces replayed open-loop through the whole product on
# this machine (bench/hilo/product.sh), scored per request against the full state's answers, for
# each controller policy. Prints one Markdown table per policy; writes per-window CSVs for
# bench/hilo/plot.sh.
#
#   bench/hilo/live.sh CATALOG [OUT_DIR]      (OUT_DIR default /tmp/keel-live)
#
# First the full state's answers are written once, in a product of their own (POST /v1/pin full
# with DIR/admin.token, `keel hilo replay --write-references`, unpin): at temperature 0 and with
# the same binaries they are the same for every run. Then for each policy, for each trace: start
# the product (unpinned, on CATALOG), wait until the controller is in the full state (HiLO starts
# in the safe state; per-service starts every service at full), run `keel hilo replay --trace T`, stop it, so no run inherits another's backlog.
# Knobs (environment):
#   TRACES         traces to run (default: the nine surge traces and surge_3x)
#   POLICIES       default "hilo per-service"; per-service needs `keel hilo serve --policy`
#                  and is skipped, with a message, when the controller lacks it
#   TIME_SCALE     real seconds per trace second (default 1: 300 s per trace); rates stay real
#   BASELINE_RATE  real req/s at 1x (default: 0.6 x the first state's product capacity in CATALOG,
#                  its smallest per-service figure (the others may be per-service estimates):
#                  HiLO returns to a state only when demand <= 0.8 x its capacity (recover_margin),
#                  so 1x must sit below that with room for noise; the 2.38x peak is then ~1.4x
#                  what the full state sustains)
#   WARMUP_S       real seconds of unscored load before each trace (default 20; 0.1x up to 1x over
#                  the first third, then 1x): the controller's trend would read a jump from zero load as a surge, and a cold engine queues
#   QUERIES (50: the evaluation queries validate scores states on), WINDOW_S (5 trace s), SLO_MS (2000), WORKERS (256), SEED (1)
#   MAX_TOKENS     every request's max_tokens (default 32, what the product catalog was validated
#                  with: a request asking fewer than a state's clamp makes states look alike)
#   ALLOW_UNVALIDATED=1  pass --allow-unvalidated to the controller (a catalog whose figures are
#                  stale or from other binaries; the figures must still be there)
#   PORT_BASE (17600), DIR (product dir, default OUT_DIR/product), BUILD, KEEL_SHARED, and
#   product.sh's ENGINE_MAX_RUNNING, ENGINE_THREADS, ANSWER_MAX_INFLIGHT, CONTROLLER_FLAGS
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
case "$BUILD" in /*) KEEL=$BUILD/keel ;; *) KEEL=$ROOT/$BUILD/keel ;; esac
[ $# -ge 1 ] || { sed -n '2,30p' "$0" >&2; exit 2; }
CATALOG=$(realpath "$1")
OUT=${2:-/tmp/keel-live}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
DIR=${DIR:-$OUT/product}
export PORT_BASE=${PORT_BASE:-17600}
export KEEL_SHARED=${KEEL_SHARED:-$(cd .. && pwd)/shared}
TRACES=${TRACES:-"step ramp spike double_peak sawtooth slow_swell flash_crowd plateau_jitter diurnal_bump surge_3x"}
POLICIES=${POLICIES:-"hilo per-service"}
TIME_SCALE=${TIME_SCALE:-1}
QUERIES=${QUERIES:-50}
MAX_TOKENS=${MAX_TOKENS:-32}
WINDOW_S=${WINDOW_S:-5}
SLO_MS=${SLO_MS:-2000}
WORKERS=${WORKERS:-256}
SEED=${SEED:-1}
WARMUP_S=${WARMUP_S:-20}
[ -x "$KEEL" ] || { echo "live: $KEEL missing (build keel)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "live: python3 is needed for the tables" >&2; exit 1; }

if [ -z "${BASELINE_RATE:-}" ]; then
  BASELINE_RATE=$(python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
f = c["states"][0].get("figures")
if not f: sys.exit("live: the catalog has no figures: set BASELINE_RATE or validate it (keel hilo validate)")
print(round(0.6 * min(f["capacity"].values()), 3))' "$CATALOG")
fi

PRODUCT_FLAGS=()
[ "${ALLOW_UNVALIDATED:-0}" = 1 ] && PRODUCT_FLAGS+=(--allow-unvalidated)
HAS_POLICY=0
"$KEEL" hilo serve --help 2>&1 | grep -q -- '--policy' && HAS_POLICY=1

REFS=$OUT/references.jsonl  # kept: a second run into the same OUT_DIR reuses it
SUMMARY=$OUT/summary.jsonl
: >"$SUMMARY"
trap 'bench/hilo/product.sh stop "$DIR" || true' EXIT

write_references() {  # pin full, write the full state's answers, unpin
  # shellcheck disable=SC1091
  . "$DIR/env"
  local full token
  full=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["states"][0]["name"])' "$CATALOG")
  token=$(cat "$ADMIN_TOKEN_FILE")
  curl -sf -X POST -H "Authorization: Bearer $token" -d "{\"state\":\"$full\"}" "$CONTROLLER/v1/pin" >/dev/null \
    || { echo "live: the controller refused to pin '$full'" >&2; return 1; }
  # Every service applies the pin within a report round; an answer from another state fails the
  # write, so retry until they all have.
  local ok=0
  for _ in $(seq 1 30); do
    if "$KEEL" hilo replay --answer "$ANSWER" --controller "$CONTROLLER" --queries "$QUERIES" --max-tokens "$MAX_TOKENS" \
      --write-references "$REFS" >"$OUT/references.json" 2>"$OUT/references.log"; then ok=1; break; fi
    sleep 0.5
  done
  [ $ok = 1 ] || { echo "live: writing references failed:" >&2; tail -3 "$OUT/references.log" >&2; return 1; }
  curl -sf -X POST -H "Authorization: Bearer $token" -d '{"state":""}' "$CONTROLLER/v1/pin" >/dev/null \
    || { echo "live: the controller refused to unpin" >&2; return 1; }
  echo "live: references written: $(cat "$OUT/references.json")" >&2
}

wait_full() {  # the controller starts in the safe state and climbs to full while load is light
  for _ in $(seq 1 120); do
    curl -sf "$CONTROLLER/v1/state" | grep -q '"index":0,' && return 0
    sleep 0.5
  done
  echo "live: WARNING: the controller did not reach the full state within 60 s; replaying anyway" >&2
}

if [ ! -s "$REFS" ]; then
  bench/hilo/product.sh start "$DIR" "$CATALOG" "${PRODUCT_FLAGS[@]}" 2>"$OUT/product-start.log" \
    || { echo "live: the product did not start:" >&2; tail -20 "$OUT/product-start.log" >&2; exit 1; }
  write_references
  bench/hilo/product.sh stop "$DIR"
fi

# What bench/hilo/sim_vs_live.sh needs to set a simulation up like this run.
cat >"$OUT/run.env" <<ENV
CATALOG=$CATALOG
BASELINE_RATE=$BASELINE_RATE
TIME_SCALE=$TIME_SCALE
WINDOW_S=$WINDOW_S
SLO_MS=$SLO_MS
SEED=$SEED
ENGINE_MAX_RUNNING=${ENGINE_MAX_RUNNING:-32}
ANSWER_MAX_INFLIGHT=${ANSWER_MAX_INFLIGHT:-64}
ENGINE_THREADS=${ENGINE_THREADS-1}
CONTROLLER_FLAGS="${CONTROLLER_FLAGS:-}"
ENV
echo "live: catalog $CATALOG, traces: $TRACES; baseline $BASELINE_RATE req/s, time scale $TIME_SCALE, $QUERIES queries of $MAX_TOKENS tokens, SLO $SLO_MS ms" >&2
for policy in $POLICIES; do
  flags=("${PRODUCT_FLAGS[@]}")
  if [ $HAS_POLICY = 1 ]; then
    flags+=(--policy "$policy")
  elif [ "$policy" != hilo ]; then
    echo "live: SKIPPING policy '$policy': this keel hilo serve has no --policy flag (only the HiLO controller exists)" >&2
    continue
  fi
  for trace in $TRACES; do
    bench/hilo/product.sh start "$DIR" "$CATALOG" "${flags[@]}" 2>"$OUT/product-start.log" \
      || { echo "live: the product did not start:" >&2; tail -20 "$OUT/product-start.log" >&2; exit 1; }
    # shellcheck disable=SC1091
    . "$DIR/env"
    if [ "$policy" = per-service ]; then
      sleep 3  # every service starts at level 0 (full) and needs a report round to be seen
    else
      wait_full
    fi
    echo "live: [$policy] $trace ..." >&2
    "$KEEL" hilo replay --answer "$ANSWER" --controller "$CONTROLLER" --references "$REFS" --queries "$QUERIES" --max-tokens "$MAX_TOKENS" \
      --trace "$trace" --baseline-rate "$BASELINE_RATE" --time-scale "$TIME_SCALE" --window-s "$WINDOW_S" \
      --slo-ms "$SLO_MS" --warmup-s "$WARMUP_S" --workers "$WORKERS" --seed "$SEED" --label "$policy" \
      --out-csv "$OUT/live_${trace}_${policy}.csv" >>"$SUMMARY" 2>"$OUT/replay_${trace}_${policy}.log" \
      || { echo "live: replay failed:" >&2; tail -5 "$OUT/replay_${trace}_${policy}.log" >&2; exit 1; }
    tail -1 "$SUMMARY" >&2
    for f in controller answer gateway engine-large engine-small vector; do
      cp "$DIR/$f.log" "$OUT/${f}_${trace}_${policy}.log" 2>/dev/null || true
    done
    bench/hilo/product.sh stop "$DIR"
  done
done

python3 - "$SUMMARY" "$BASELINE_RATE" "$TIME_SCALE" <<'PY' | tee "$OUT/results.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"Baseline {sys.argv[2]} req/s at 1x, time scale {sys.argv[3]} (real s per trace s).")
for policy in dict.fromkeys(r["label"] for r in rows):
    print(f"\n#### policy: {policy}\n")
    print("| trace | peak | full quality | max drop | mean drop | L | within 0.85 L? | arrived | shed | failed | SLO violations | transitions | time in states (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["label"] != policy: continue
        states = ", ".join(f"{k} {v:.0f}" for k, v in r["time_in_state_s"].items() if v > 0)
        print(f"| {r['trace']} | {r['peak']:.2f}x | {r['full_quality']:.1f} | {r['max_drop']:.1f} | {r['mean_drop']:.1f} | "
              f"{r['limit']:g} | {'yes' if r['within_085_limit'] else 'no'} | {r['arrived']} | {r['shed']} | {r['failed']} | "
              f"{r['slo_violations']} | {r['transitions']} | {states} |")
PY
echo "live: CSVs, summary.jsonl and results.md in $OUT" >&2
