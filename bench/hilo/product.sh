#!/usr/bin/env bash
# The whole HiLO product on this machine, every part a real `keel` process on loopback:
#   controller  keel hilo serve      (the catalog; pins need the admin token in $DIR/admin.token)
#   vector      keel vector          (IVF index of the 10,000 SIFT base vectors, loaded at start)
#   engines     keel serve x 2       (tier "large": en-dense6L.bin; tier "small": en-moe8x)
#   gateway     keel gateway         (virtual model "answer" -> answer-large | answer-small by tier),
#               with keel gateway-policy (one key for the answer service, a budget no run reaches)
#   answer      keel answer serve    (the product's entry, OpenAI chat)
# Every service follows the controller (--hilo) and reports its load to it.
#
#   bench/hilo/product.sh start DIR CATALOG [--pin STATE] [--allow-unvalidated] [--policy hilo|per-service]
#   bench/hilo/product.sh stop DIR
# `start` writes DIR/env (URLs, ports, pids) for the scripts that drive the product
# (bench/hilo/live.sh, bench/hilo/cost.sh, keel hilo validate) and logs to DIR/*.log. Knobs (environment): BUILD
# (default build), PORT_BASE (17500), KEEL_SHARED (default ../shared), ENGINE_MAX_RUNNING (32: each
# engine's batch slots; with 8 the engine queued at 1x load, docs/results.md),
# CONTROLLER_FLAGS (extra `keel hilo serve` flags, e.g. "--headroom 1.2" or "--baseline-queue-ms 100"),
# ANSWER_MAX_INFLIGHT (64), ANSWER_GATEWAY_TIMEOUT_MS (5000: the answer service gives up on the
# gateway after this, which cancels the generation, so abandoned requests do not pile up downstream),
# ENGINE_THREADS (each engine's OpenMP threads, default 1; empty: OpenMP's, one per core. With two
# threads an engine sharing the two cores with the other services burned half a core more for the
# same throughput, and validated capacities moved 21-52 % between rounds, against 2-16 % with one:
# docs/results.md, "HiLO: the simulation's machine drifts"),
# ENGINE_PREFIX_CACHE (on|off, default on: the engines' prompt-prefix cache; see docs/hilo.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${BUILD:-build}
case "$BUILD" in /*) KEEL=$BUILD/keel ;; *) KEEL=$ROOT/$BUILD/keel ;; esac
SHARED=${KEEL_SHARED:-$(cd .. && pwd)/shared}
DATA=$SHARED/data
PORT_BASE=${PORT_BASE:-17500}

usage() { sed -n '2,24p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
CMD=$1
DIR=$2

wait_http() {  # wait_http URL NAME LOG
  local pid=${PIDS[$2]:-}
  for _ in $(seq 1 300); do
    # A service that exited (its port taken, say) fails now, and a stranger answering on its
    # port is never mistaken for it.
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
      echo "product: $2 exited before it came up at $1; last lines of $3:" >&2
      tail -20 "$3" >&2 || true
      return 1
    fi
    curl -sf -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "product: $2 did not come up at $1; last lines of $3:" >&2
  tail -20 "$3" >&2 || true
  return 1
}

stop() {
  [ -f "$DIR/pids" ] || return 0
  # Reverse start order: the entry first, the controller last (services fall back when it goes).
  tac "$DIR/pids" | while read -r pid; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    alive=0
    while read -r pid; do kill -0 "$pid" 2>/dev/null && alive=1; done <"$DIR/pids"
    [ $alive -eq 0 ] && break
    sleep 0.1
  done
  while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done <"$DIR/pids"
  rm -f "$DIR/pids"
}

case "$CMD" in
  stop) stop; exit 0 ;;
  start) ;;
  *) usage ;;
esac
[ $# -ge 3 ] || usage
CATALOG=$(realpath "$3")
shift 3
CTL_FLAGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --pin) CTL_FLAGS+=(--pin "$2"); shift 2 ;;
    --allow-unvalidated) CTL_FLAGS+=(--allow-unvalidated); shift ;;
    --policy) CTL_FLAGS+=(--policy "$2"); shift 2 ;;  # keel hilo serve --policy hilo|per-service
    *) usage ;;
  esac
done
if [ -n "${CONTROLLER_FLAGS:-}" ]; then
  # shellcheck disable=SC2206  # the flags are words
  CTL_FLAGS+=(${CONTROLLER_FLAGS})
fi
[ -x "$KEEL" ] || { echo "product: $KEEL missing (build keel)" >&2; exit 1; }
[ -f "$DATA/models/en-dense6L.bin" ] || { echo "product: shared data not found under $SHARED (set KEEL_SHARED)" >&2; exit 1; }

mkdir -p "$DIR"
DIR=$(realpath "$DIR")
stop
: >"$DIR/pids"
CTL_PORT=$PORT_BASE
VEC_PORT=$((PORT_BASE + 1))
ENG_L_PORT=$((PORT_BASE + 2))
ENG_S_PORT=$((PORT_BASE + 3))
GW_PORT=$((PORT_BASE + 4))
ANS_PORT=$((PORT_BASE + 5))
CTL=http://127.0.0.1:$CTL_PORT
for port in $(seq "$CTL_PORT" "$ANS_PORT"); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "product: port $port is already in use (PORT_BASE=$PORT_BASE takes $CTL_PORT..$ANS_PORT)" >&2
    exit 1
  fi
done
declare -A PIDS
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/admin.token"
chmod 600 "$DIR/admin.token"

run() {  # run [VAR=value ...] NAME ARGS... : starts a keel process in the background with those
  # variables set, logs to DIR/NAME.log
  local vars=()
  while [[ $1 == *=* ]]; do vars+=("$1"); shift; done
  local name=$1
  shift
  env "${vars[@]}" "$KEEL" "$@" >"$DIR/$name.log" 2>&1 &
  PIDS[$name]=$!
  echo $! >>"$DIR/pids"
}

run controller hilo serve --catalog "$CATALOG" --port "$CTL_PORT" --admin-token-file "$DIR/admin.token" "${CTL_FLAGS[@]}"
wait_http "$CTL/health" controller "$DIR/controller.log"

rm -rf "$DIR/vector"
run vector vector --dir "$DIR/vector" --port "$VEC_PORT" --index ivf-flat --hilo "$CTL" --hilo-instance vector-0
wait_http "http://127.0.0.1:$VEC_PORT/healthz" vector "$DIR/vector.log"
"$KEEL" answer index --vector "http://127.0.0.1:$VEC_PORT" --bvecs "$DATA/vectors/bigann10k_base.bvecs" >"$DIR/index.log" 2>&1 \
  || { echo "product: loading the vectors failed:" >&2; tail -5 "$DIR/index.log" >&2; exit 1; }

# The engines' thread count, and nothing else's (FAISS in the vector service also uses OpenMP).
ENGINE_ENV=()
ENGINE_THREADS=${ENGINE_THREADS-1}
[ -n "$ENGINE_THREADS" ] && ENGINE_ENV=("OMP_NUM_THREADS=$ENGINE_THREADS")
case "${ENGINE_PREFIX_CACHE:-on}" in
  on) ENGINE_FLAGS=(--prefix-cache) ;;
  off) ENGINE_FLAGS=(--no-prefix-cache) ;;
  *) echo "product: ENGINE_PREFIX_CACHE must be on or off, not '$ENGINE_PREFIX_CACHE'" >&2; exit 2 ;;
esac
run "${ENGINE_ENV[@]}" engine-large serve --model "$DATA/models/en-dense6L.bin" --tokenizer "$DATA/models/tok354.bin" --port "$ENG_L_PORT" \
  --max-running "${ENGINE_MAX_RUNNING:-32}" "${ENGINE_FLAGS[@]}" --hilo "$CTL" --hilo-instance engine-large
run "${ENGINE_ENV[@]}" engine-small serve --model "$DATA/models/en-moe8x" --port "$ENG_S_PORT" \
  --max-running "${ENGINE_MAX_RUNNING:-32}" "${ENGINE_FLAGS[@]}" --hilo "$CTL" --hilo-instance engine-small
wait_http "http://127.0.0.1:$ENG_L_PORT/healthz" engine-large "$DIR/engine-large.log"
wait_http "http://127.0.0.1:$ENG_S_PORT/healthz" engine-small "$DIR/engine-small.log"
MODEL_L=$(curl -sf "http://127.0.0.1:$ENG_L_PORT/v1/models" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
MODEL_S=$(curl -sf "http://127.0.0.1:$ENG_S_PORT/v1/models" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')

# The gateway's governance: a policy service with one key for the answer service (team "product",
# a budget far above any run, models "answer*" allowed).
head -c 32 /dev/urandom | base64 >"$DIR/policy-admin.key"
chmod 600 "$DIR/policy-admin.key"
rm -f "$DIR/policy.db" "$DIR/policy.sock"
run gateway-policy gateway-policy --socket "$DIR/policy.sock" --db "$DIR/policy.db" --admin-key-file "$DIR/policy-admin.key"
for _ in $(seq 1 100); do [ -S "$DIR/policy.sock" ] && break; sleep 0.1; done
ADMIN="Authorization: Bearer $(cat "$DIR/policy-admin.key")"
admin() { curl -sf --unix-socket "$DIR/policy.sock" -H "$ADMIN" "$@"; }
admin -X POST http://x/admin/keys -d '{"principal":"answer","team":"product"}' \
  | sed -n 's/.*"api_key":"\([^"]*\)".*/\1/p' >"$DIR/gateway.key"
[ -s "$DIR/gateway.key" ] || { echo "product: could not create a gateway key" >&2; tail -5 "$DIR/gateway-policy.log" >&2; exit 1; }
chmod 600 "$DIR/gateway.key"
admin -X PUT http://x/admin/budgets -d '{"scope":"team","subject":"product","window":"daily","limit_tokens":1000000000000,"limit_cost":1000000}' >/dev/null
admin -X PUT http://x/admin/policies -d '{"team":"product","allowed_models":["answer*"]}' >/dev/null

cat >"$DIR/gateway.json" <<JSON
{
  "listen": {"host": "127.0.0.1", "port": $GW_PORT},
  "policy": {"socket": "$DIR/policy.sock"},
  "upstreams": [
    {"name": "large", "format": "keel", "base_url": "http://127.0.0.1:$ENG_L_PORT", "timeout_s": 120},
    {"name": "small", "format": "keel", "base_url": "http://127.0.0.1:$ENG_S_PORT", "timeout_s": 120}
  ],
  "models": [
    {"name": "answer-large", "targets": [{"upstream": "large", "model": "$MODEL_L"}],
     "tokenizer": {"path": "$DATA/models/tok354.bin", "vocab_size": 354}},
    {"name": "answer-small", "targets": [{"upstream": "small", "model": "$MODEL_S"}],
     "tokenizer": {"path": "$DATA/models/tok354.bin", "vocab_size": 354}}
  ],
  "hilo": {"controller": "$CTL", "instance": "gateway-0",
           "tiers": {"answer": {"large": "answer-large", "small": "answer-small"}}}
}
JSON
run gateway gateway --config "$DIR/gateway.json"
wait_http "http://127.0.0.1:$GW_PORT/healthz" gateway "$DIR/gateway.log"

run answer answer serve --port "$ANS_PORT" --vector "http://127.0.0.1:$VEC_PORT" --gateway "http://127.0.0.1:$GW_PORT" \
  --model answer --gateway-key-file "$DIR/gateway.key" --corpus "$DATA/text/val.txt" --max-inflight "${ANSWER_MAX_INFLIGHT:-64}" \
  --gateway-timeout-ms "${ANSWER_GATEWAY_TIMEOUT_MS:-5000}" --hilo "$CTL" --hilo-instance answer-0
wait_http "http://127.0.0.1:$ANS_PORT/healthz" answer "$DIR/answer.log"

cat >"$DIR/env" <<ENV
CONTROLLER=$CTL
ADMIN_TOKEN_FILE=$DIR/admin.token
VECTOR=http://127.0.0.1:$VEC_PORT
ENGINE_LARGE=http://127.0.0.1:$ENG_L_PORT
ENGINE_SMALL=http://127.0.0.1:$ENG_S_PORT
GATEWAY=http://127.0.0.1:$GW_PORT
ANSWER=http://127.0.0.1:$ANS_PORT
ENV
echo "product: up in $DIR (controller $CTL, answer http://127.0.0.1:$ANS_PORT)" >&2
