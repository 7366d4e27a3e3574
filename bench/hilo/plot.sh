#!/usr/bin/env bash
# PNG plots of the HiLO surge runs, one per trace: quality over time (top; the line is the full
# state's quality minus the operating limit L) and the state index over time (bottom; 0 = full,
# higher = cheaper; grey: arrivals per window of the live run), for every series found:
#   live HiLO / live per-service   OUT_DIR/live_<trace>_<policy>.csv   (bench/hilo/live.sh)
#   sim HiLO / sim baseline        SIM_DIR/sim_<trace>_<policy>.csv    (sim_bench --csv-dir SIM_DIR)
# The simulation's quality is on the catalog's figures (state 0's quality as full), the live one
# on the references run's (100 x recall@10 of the full state's answers).
#
#   bench/hilo/plot.sh OUT_DIR [SIM_DIR] [IMG_DIR]     (IMG_DIR default docs/img/hilo)
# gnuplot (Debian gnuplot-nox) is installed on first use; it is only needed here, not by the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { sed -n '2,11p' "$0" >&2; exit 2; }
OUT=$1
SIM=${2:-}
IMG=${3:-docs/img/hilo}
mkdir -p "$IMG"
if ! command -v gnuplot >/dev/null; then
  echo "plot: installing gnuplot-nox" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends gnuplot-nox >/dev/null
fi
command -v gnuplot >/dev/null || { echo "plot: gnuplot missing (apt-get install gnuplot-nox)" >&2; exit 1; }

traces=$(ls "$OUT" | sed -n 's/^live_\(.*\)_\(hilo\|per-service\)\.csv$/\1/p' | sort -u)
[ -n "$traces" ] || { echo "plot: no live_<trace>_<policy>.csv in $OUT" >&2; exit 1; }
for trace in $traces; do
  # Full quality and L of this trace's HiLO run (the line drawn at full - L).
  read -r full limit nstates < <(python3 - "$OUT/summary.jsonl" "$trace" <<'PY'
import json, sys
full, limit, states = 100.0, 0.0, 5
for line in open(sys.argv[1]):
    if not line.strip(): continue
    r = json.loads(line)
    if r["trace"] == sys.argv[2]:
        full, limit, states = r["full_quality"], r["limit"], max(1, len(r["time_in_state_s"]))
        if r.get("label") == "hilo": break
print(full, limit, states)
PY
)
  q=() s=()
  add() {  # add FILE TITLE QCOL SCOL COLOUR
    [ -f "$1" ] || return 0
    q+=("'$1' every ::1 using 1:$3 with lines lw 2 lc rgb '$5' title '$2'")
    s+=("'$1' every ::1 using 1:$4 with steps lw 2 lc rgb '$5' title '$2'")
  }
  # Live per-service: no product state; the cheapest level any service applied.
  add "$OUT/live_${trace}_hilo.csv" "live HiLO" 3 '($5 < 0 ? 1/0 : $5)' '#1f77b4'
  add "$OUT/live_${trace}_per-service.csv" "live per-service" 3 '(m = $7 > $8 ? $7 : $8, m = m > $9 ? m : $9, m = m > $10 ? m : $10, m < 0 ? 1/0 : m)' '#d62728'
  if [ -n "$SIM" ]; then
    add "$SIM/sim_${trace}_hilo.csv" "sim HiLO" 3 4 '#17becf'
    add "$SIM/sim_${trace}_baseline.csv" "sim baseline" 3 4 '#ff7f0e'
  fi
  arrivals="'$OUT/live_${trace}_hilo.csv' every ::1 using 1:2 axes x1y2 with impulses lc rgb '#bbbbbb' title 'live arrivals / window'"
  [ -f "$OUT/live_${trace}_hilo.csv" ] || arrivals=""
  qplot=$(IFS=,; echo "${q[*]}")
  splot=$(IFS=,; echo "${s[*]}")
  png="$IMG/live_${trace}.png"
  gnuplot <<GP
set terminal pngcairo size 1000,700 font ",10"
set output '$png'
set datafile separator ','
set multiplot layout 2,1 title "HiLO surge '$trace': quality and state over time" noenhanced
set xlabel 'trace time (s)'
set ylabel 'window quality (0..100)'
set yrange [0:105]
set grid
set key bottom right opaque box
set arrow 1 from graph 0, first ($full - $limit) to graph 1, first ($full - $limit) nohead dt 2 lw 2 lc rgb 'black'
set label 1 sprintf('full - L = %.1f', $full - $limit) at graph 0.01, first ($full - $limit + 3)
plot $qplot
unset arrow 1
unset label 1
set ylabel 'state index (0 = full)'
set yrange [-0.3:$nstates - 0.5]
set ytics 1
set y2label 'arrivals per window'
set y2tics
set key top right opaque box
plot ${arrivals:+$arrivals,} $splot
unset multiplot
GP
  echo "plot: $png" >&2
done
