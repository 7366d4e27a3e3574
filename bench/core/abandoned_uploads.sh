#!/usr/bin/env bash
# Memory after abandoned uploads: a Keel HTTP service receives N requests whose bodies stop one
# byte short of their Content-Length, from CONC clients at a time, each of which then hangs up.
# Prints the service's RSS before, after, and the growth, for Keel as built (glibc's mmap
# threshold fixed at 1 MiB by `keel` itself) and for the baseline in the same run: glibc with the
# threshold where its dynamic rule leaves it after the first large body is freed (just above the
# body size, MALLOC_MMAP_THRESHOLD_), i.e. every body from the heap arenas.
#
#   bench/core/abandoned_uploads.sh [gateway|vector] [N=1000] [BODY_MIB=4] [CONC=32]
# KEEL (default build/keel). Runs on loopback only.
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVICE=${1:-gateway}; N=${2:-1000}; BODY_MIB=${3:-4}; CONC=${4:-32}
KEEL=${KEEL:-build/keel}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"; [ -n "${PID:-}" ] && kill "$PID" 2>/dev/null || true' EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
case "$SERVICE" in
  gateway)
    cat >"$TMP/gw.json" <<JSON
{"listen": {"host": "127.0.0.1", "port": $PORT, "threads": 2},
 "policy": {"socket": "$TMP/none.sock"},
 "upstreams": [{"name": "u", "format": "openai", "base_url": "http://127.0.0.1:9", "api_key": "x"}],
 "models": [{"name": "m", "targets": [{"upstream": "u", "model": "m"}]}]}
JSON
    CMD=("$KEEL" --log-level error gateway --config "$TMP/gw.json"); TARGET=/v1/chat/completions ;;
  vector)
    CMD=("$KEEL" --log-level error vector --dir "$TMP/v" --port "$PORT" --placement off); TARGET=/v1/upsert ;;
  *) echo "usage: $0 [gateway|vector] [N] [BODY_MIB] [CONC]" >&2; exit 2 ;;
esac

flood() {
  python3 - "$PORT" "$TARGET" "$N" "$BODY_MIB" "$CONC" <<'PY'
import socket, sys, threading, time
port, target, n, mib, conc = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
size = mib << 20
head = (f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n").encode()
body = b"x" * (size - 1)
sem = threading.Semaphore(conc)
def one():
    try:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head); s.sendall(body); time.sleep(0.05); s.close()
    except OSError:
        pass
    finally:
        sem.release()
threads = []
for _ in range(n):
    sem.acquire(); t = threading.Thread(target=one); t.start(); threads.append(t)
for t in threads: t.join()
PY
}

rss_mib() { awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$1/status"; }

run() {  # label, then env assignments for the service
  local label=$1; shift
  env "$@" "${CMD[@]}" >"$TMP/svc.log" 2>&1 &
  PID=$!
  for _ in $(seq 100); do python3 -c "import socket; socket.create_connection(('127.0.0.1',$PORT))" 2>/dev/null && break; sleep 0.1; done
  local before; before=$(rss_mib "$PID")
  flood; sleep 2
  local after; after=$(rss_mib "$PID")
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
  rm -rf "$TMP/v"
  echo "$label $before $after"
}

echo "service=$SERVICE uploads=$N body=${BODY_MIB}MiB concurrency=$CONC keel=$KEEL"
K=$(run keel)
B=$(run baseline MALLOC_MMAP_THRESHOLD_=$(( (BODY_MIB << 20) + 4096 )))
printf '%-9s %12s %12s %12s\n' "" "RSS before" "RSS after" "growth MiB"
for line in "$K" "$B"; do
  read -r label before after <<<"$line"
  printf '%-9s %12s %12s %12.1f\n' "$label" "$before" "$after" "$(python3 -c "print($after - $before)")"
done
read -r _ kb ka <<<"$K"; read -r _ bb ba <<<"$B"
echo "growth ratio baseline / keel: $(python3 -c "print(f'{($ba - $bb) / max($ka - $kb, 0.1):.1f}')")x"
