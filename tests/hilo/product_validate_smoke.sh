#!/usr/bin/env bash
# CTest: the whole product as real processes (bench/hilo/product.sh), then `keel hilo validate`
# over it with a tiny evaluation set and an SLO no machine misses (this checks the plumbing, not
# figures: pins reach every service, answers are scored, ramps run, the catalog is written), then
# a controller restarted on the validated catalog must accept it unpinned.
set -euo pipefail
cd "$(dirname "$0")/../.."
KEEL=${KEEL_BINARY:-build/keel}
export BUILD=$(dirname "$KEEL")
DIR=$(mktemp -d /tmp/keel-hilo-smoke.XXXXXX)
cleanup() { bench/hilo/product.sh stop "$DIR" || true; rm -rf "$DIR"; }
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$DIR"/*.log; do echo "== $f" >&2; tail -5 "$f" >&2; done; exit 1; }

# Six fixed ports, chosen below the kernel's ephemeral range (32768 and up on Linux): there, the
# client side of any other test's loopback connection can hold a port at any moment, and a CI run
# lost this test to exactly that. Below it, only listeners can collide: skip bases where one
# answers, and start again on another base if a service still loses its port.
port_listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_port_base() {
  local base p
  for _ in $(seq 1 50); do
    base=$((20000 + (RANDOM % 1500) * 8))
    for p in $(seq "$base" $((base + 5))); do port_listening "$p" && continue 2; done
    echo "$base"; return 0
  done
  return 1
}
# A PORT_BASE set by the caller is used as given, once.
fixed_base=${PORT_BASE:-}
started=0
for attempt in 1 2 3; do
  PORT_BASE=${fixed_base:-$(pick_port_base)} || fail "no free block of ports"
  export PORT_BASE
  if bench/hilo/product.sh start "$DIR" bench/hilo/product_catalog.json --pin full --allow-unvalidated; then
    started=1; break
  fi
  echo "product did not start on ports $PORT_BASE..$((PORT_BASE + 5)) (attempt $attempt)" >&2
  bench/hilo/product.sh stop "$DIR" || true
  [ -n "$fixed_base" ] && break
done
[ "$started" = 1 ] || fail "product did not start"
source "$DIR/env"
"$KEEL" hilo validate --catalog bench/hilo/product_catalog.json --out "$DIR/validated.json" --controller "$CONTROLLER" \
  --admin-token-file "$ADMIN_TOKEN_FILE" --answer "$ANSWER" --model answer --max-tokens 8 --queries 4 \
  --step-s 1 --start-rate 1 --growth 2 --max-rate 2 --refine-steps 0 --slo-ms 60000 --max-error-fraction 0.5 --rounds 2 \
  >"$DIR/validate.out" 2>&1 || { cat "$DIR/validate.out" >&2; fail "validate failed"; }
cat "$DIR/validate.out"
# Every state validated, with the running binaries' fingerprint: check says usable (exit 0).
"$KEEL" hilo check --catalog "$DIR/validated.json" || fail "the validated catalog is not usable"
grep -q '"binaries": "keel-xxh3-' "$DIR/validated.json" || fail "no fingerprint written"
# The first state is its own reference: quality = 100 x recall@10, and IVF nprobe 64 finds them all.
grep -E '^full +100\.00 +1\.000' "$DIR/validate.out" >/dev/null || fail "full state should score 100 with recall 1"
# Two rounds: every state ramped twice, and the table gives both rounds' capacities.
[ "$(grep -c 'round 2/2\] capacity' "$DIR/validate.out")" = 5 ] || fail "every state should have a second round"
grep -E '^minimal .* 2 2 \(0\.0 %\)$' "$DIR/validate.out" >/dev/null || fail "the table should list both rounds' capacities"
# The controller left pinned refuses to unpin on the old catalog; a controller on the validated one
# starts unpinned.
bench/hilo/product.sh stop "$DIR"
# The controller's tuning flags: one out of range is refused at start, naming it.
if "$KEEL" hilo serve --catalog "$DIR/validated.json" --port 0 --headroom 0.5 >"$DIR/bad.log" 2>&1; then
  fail "--headroom 0.5 was accepted"
fi
grep -q "headroom: expected 1..10" "$DIR/bad.log" || { cat "$DIR/bad.log" >&2; fail "--headroom 0.5 refused without naming it"; }
"$KEEL" hilo serve --catalog "$DIR/validated.json" --port "$PORT_BASE" --headroom 1.25 --recover-margin 0.7 \
  --trend-damping-s 3 --recent-rate-guard false >"$DIR/controller2.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$PORT_BASE/health" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$PORT_BASE/v1/state" | grep -q '"pinned":false' || { kill $pid; fail "validated controller did not start unpinned"; }
grep -q "headroom 1.25, recover margin 0.7 after 10 s.*trend damping 3 s, recent-rate guard off" "$DIR/controller2.log" \
  || { kill $pid; cat "$DIR/controller2.log" >&2; fail "the controller did not take its tuning flags"; }
kill $pid
wait $pid 2>/dev/null || true
# The per-service baseline's thresholds: a recover threshold above the degrade one is refused; good
# ones are logged per service.
if "$KEEL" hilo serve --catalog "$DIR/validated.json" --port 0 --policy per-service --baseline-queue-ms 20 \
     --baseline-recover-queue-ms 50 >"$DIR/bad2.log" 2>&1; then
  fail "--baseline-recover-queue-ms above --baseline-queue-ms was accepted"
fi
grep -q "per_service.answer: .*recover_queue_ms" "$DIR/bad2.log" || { cat "$DIR/bad2.log" >&2; fail "bad baseline thresholds refused without naming them"; }
"$KEEL" hilo serve --catalog "$DIR/validated.json" --port "$PORT_BASE" --policy per-service --baseline-queue-ms 100 \
  --baseline-utilisation 0.95 >"$DIR/controller3.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$PORT_BASE/health" >/dev/null && break; sleep 0.1; done
grep -q "engine degrades on queueing > 100 ms or utilisation >= 0.95" "$DIR/controller3.log" \
  || { kill $pid; cat "$DIR/controller3.log" >&2; fail "the baseline did not take its thresholds"; }
kill $pid
wait $pid 2>/dev/null || true
echo "product validate smoke: ok"
