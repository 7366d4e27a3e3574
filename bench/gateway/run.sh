#!/usr/bin/env bash
# Gateway overhead, side by side in one run: the same open-loop load (gateway_bench) against
#   direct   client -> keel fake-vendor (OpenAI kind, 16-token reply, no TTFT, no stream pacing)
#   nginx    client -> nginx (Debian nginx-light, plain reverse proxy) -> fake vendor
#   gateway  client -> keel gateway (auth + budget + team policy enforced) -> fake vendor
# for {non-stream, stream} x {100, 1000} requests/s, interleaved. Prints Markdown for
# docs/results.md: latency percentiles, what each proxy adds over direct, time to first chunk,
# proxy CPU per request, and the gateway's added median over nginx's. Loopback only.
#
#   BUILD=build-gw bench/gateway/run.sh      (builds nothing: needs $BUILD/keel, $BUILD/gateway_bench)
#
# Knobs (environment): BUILD (default build), DURATION_S (10), WARMUP_S (2), CONNECTIONS (32),
# RATES ("100 1000"), ROUNDS (1; >1 repeats the whole interleaved sweep), PORT_BASE (18600),
# NGINX (/usr/sbin/nginx), GW_THREADS (gateway io threads, 1 = its default), NGINX_WORKERS (default GW_THREADS), KEEP_RESULTS
# (a file to copy the raw JSON lines to), PROFILE (a directory: `perf record -g` of the proxy
# for every nginx/gateway point, <mode>-<rate>-<target>.data; perturbs the CPU figures),
# PERF_CALLGRAPH (perf's call-graph option, default -g; "--call-graph dwarf,16384" gives callers
# in this frame-pointer-less build), GW_PRELOAD (a library LD_PRELOADed into the gateway only,
# e.g. another malloc, to compare allocators in paired runs).
# Progress goes to stderr, the Markdown to stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
KEEL=$BUILD/keel
LOAD=$BUILD/gateway_bench
NGINX=${NGINX:-/usr/sbin/nginx}
GW_THREADS=${GW_THREADS:-1}
NGINX_WORKERS=${NGINX_WORKERS:-$GW_THREADS}
DURATION_S=${DURATION_S:-10}
WARMUP_S=${WARMUP_S:-2}
CONNECTIONS=${CONNECTIONS:-32}
RATES=${RATES:-"100 1000"}
ROUNDS=${ROUNDS:-1}
PORT_BASE=${PORT_BASE:-18600}
VENDOR_PORT=$((PORT_BASE + 1))
NGINX_PORT=$((PORT_BASE + 2))
GATEWAY_PORT=$((PORT_BASE + 3))
MODEL=gpt-4o-mini
VENDOR_KEY=sk-vendor-bench

# nginx is only needed here (not by the tests), so it is installed here rather than by scripts/setup.
if [ ! -x "$NGINX" ] && [ "$NGINX" = /usr/sbin/nginx ]; then
  echo "run.sh: installing nginx-light" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
fi
for f in "$KEEL" "$LOAD" "$NGINX"; do
  [ -x "$f" ] || { echo "run.sh: $f missing (build keel and gateway_bench; apt-get install nginx-light)" >&2; exit 1; }
done

TMP=$(mktemp -d /tmp/keel-gw-bench.XXXXXX)
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_http() {  # url: waits up to 10 s for any HTTP answer
  for _ in $(seq 1 100); do
    curl -s -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "run.sh: nothing answers at $1" >&2
  return 1
}

cpu_ticks() {  # pid...: utime + stime of the processes (clock ticks)
  local total=0 pid f
  for pid in "$@"; do
    # Fields after the ")" that ends the command name: utime and stime are the 12th and 13th.
    f=$(sed 's/.*) //' "/proc/$pid/stat")
    total=$((total + $(echo "$f" | awk '{print $12 + $13}')))
  done
  echo "$total"
}

# ---- fake vendor
"$KEEL" --log-level warn fake-vendor --kind openai --port "$VENDOR_PORT" --reply-tokens 16 \
  --ttft-ms 0 --tokens-per-second 0 --api-key "$VENDOR_KEY" >"$TMP/vendor.log" 2>&1 &
VENDOR_PID=$!
PIDS+=("$VENDOR_PID")
wait_http "http://127.0.0.1:$VENDOR_PORT/v1/models"

# ---- policy service with a real key, budgets and a team policy
ADMIN_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s' "$ADMIN_KEY" >"$TMP/admin.key"
chmod 600 "$TMP/admin.key"
SOCK=$TMP/policy.sock
"$KEEL" --log-level warn gateway-policy --socket "$SOCK" --db "$TMP/policy.db" \
  --admin-key-file "$TMP/admin.key" >"$TMP/policy.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
admin() {  # method path [body] -> response body; fails on non-2xx
  local data=()
  [ $# -ge 3 ] && data=(-H 'Content-Type: application/json' -d "$3")
  curl -sf --unix-socket "$SOCK" -X "$1" "http://localhost$2" \
    -H "Authorization: Bearer $ADMIN_KEY" "${data[@]}"
}
KEY_JSON=$(admin POST /admin/keys '{"principal":"bench-client","team":"bench"}')
API_KEY=$(echo "$KEY_JSON" | sed -n 's/.*"api_key" *: *"\([^"]*\)".*/\1/p')
KEY_ID=$(echo "$KEY_JSON" | sed -n 's/.*"key_id" *: *"\([^"]*\)".*/\1/p')
[ -n "$API_KEY" ] && [ -n "$KEY_ID" ] || { echo "run.sh: key creation failed: $KEY_JSON" >&2; exit 1; }
# Budgets far above what the run spends (~50k requests x ~60 tokens), so they are checked and
# charged on every request but never refuse one.
admin PUT /admin/prices "{\"model\":\"$MODEL\",\"input_per_mtok\":0.15,\"output_per_mtok\":0.6}" >/dev/null
admin PUT /admin/budgets "{\"scope\":\"key\",\"subject\":\"$KEY_ID\",\"window\":\"daily\",\"limit_tokens\":1000000000000}" >/dev/null
admin PUT /admin/budgets '{"scope":"team","subject":"bench","window":"monthly","limit_cost":1000000}' >/dev/null
admin PUT /admin/policies "{\"team\":\"bench\",\"allowed_models\":[\"gpt-4o*\"],\"max_tokens\":1024,\"deny\":[{\"contains\":\"forbidden-benchmark-word\",\"message\":\"denied by policy\"}]}" >/dev/null

# ---- keel gateway ($GW_THREADS listener threads)
cat >"$TMP/gw.json" <<EOF
{
  "listen": {"host": "127.0.0.1", "port": $GATEWAY_PORT, "threads": $GW_THREADS},
  "policy": {"socket": "$SOCK"},
  "upstreams": [{"name": "fake", "format": "openai", "base_url": "http://127.0.0.1:$VENDOR_PORT", "api_key": "$VENDOR_KEY"}],
  "models": [{"name": "$MODEL", "targets": [{"upstream": "fake", "model": "$MODEL"}]}]
}
EOF
${GW_PRELOAD:+env LD_PRELOAD=$GW_PRELOAD} "$KEEL" --log-level warn gateway --config "$TMP/gw.json" --port "$GATEWAY_PORT" >"$TMP/gateway.log" 2>&1 &
GATEWAY_PID=$!
PIDS+=("$GATEWAY_PID")
wait_http "http://127.0.0.1:$GATEWAY_PORT/healthz"

# ---- nginx as a plain reverse proxy (keep-alive both sides, no buffering so SSE flows through)
mkdir -p "$TMP/nginx/tmp"
cat >"$TMP/nginx/nginx.conf" <<EOF
worker_processes $NGINX_WORKERS;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx/tmp/body;
  proxy_temp_path $TMP/nginx/tmp/proxy;
  fastcgi_temp_path $TMP/nginx/tmp/fastcgi;
  uwsgi_temp_path $TMP/nginx/tmp/uwsgi;
  scgi_temp_path $TMP/nginx/tmp/scgi;
  keepalive_requests 1000000;
  upstream vendor {
    server 127.0.0.1:$VENDOR_PORT;
    keepalive 64;
    keepalive_requests 1000000;
  }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://vendor;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
EOF
"$NGINX" -p "$TMP/nginx" -c "$TMP/nginx/nginx.conf" -g 'daemon off;' >"$TMP/nginx.log" 2>&1 &
NGINX_PID=$!
PIDS+=("$NGINX_PID")
wait_http "http://127.0.0.1:$NGINX_PORT/v1/models"
nginx_pids() { echo "$NGINX_PID" $(ps -o pid= --ppid "$NGINX_PID"); }

# ---- sanity: every path answers 200; the gateway refuses a missing key and a denied prompt
body() {  # stream(true|false) [content]
  local content=${2:-Say hello to the benchmark and then count slowly.}
  echo "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"},{\"role\":\"user\",\"content\":\"$content\"}],\"max_tokens\":64,\"temperature\":0,\"stream\":$1}"
}
body false >"$TMP/body.json"
body true >"$TMP/body-stream.json"
code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
for t in "$VENDOR_PORT:$VENDOR_KEY" "$NGINX_PORT:$VENDOR_KEY" "$GATEWAY_PORT:$API_KEY"; do
  c=$(code "http://127.0.0.1:${t%%:*}/v1/chat/completions" -H "Authorization: Bearer ${t#*:}" \
    -H 'Content-Type: application/json' --data-binary @"$TMP/body.json")
  [ "$c" = 200 ] || { echo "run.sh: port ${t%%:*} answered $c" >&2; cat "$TMP"/*.log >&2; exit 1; }
done
NOKEY=$(code "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  --data-binary @"$TMP/body.json" || true)

# ---- idle CPU of each proxy (timers, background refresh), to read the per-request CPU against
IDLE_S=3
idle_cpu() {  # pid... -> CPU µs per second of wall time while no request arrives
  local before after
  before=$(cpu_ticks "$@"); sleep "$IDLE_S"; after=$(cpu_ticks "$@")
  awk -v b="$before" -v a="$after" -v hz="$(getconf CLK_TCK)" -v s="$IDLE_S" 'BEGIN { printf "%.0f", (a - b) / hz * 1e6 / s }'
}
IDLE_GATEWAY=$(idle_cpu "$GATEWAY_PID")
IDLE_NGINX=$(idle_cpu $(nginx_pids))

# ---- the sweep
HZ=$(getconf CLK_TCK)
RESULTS=$TMP/results.jsonl
: >"$RESULTS"
run_one() {  # mode rate target
  local mode=$1 rate=$2 target=$3 port key bodyf flags=() pids=() before after vbefore vafter n out cpu vcpu
  case $target in
    direct) port=$VENDOR_PORT; key=$VENDOR_KEY ;;
    nginx) port=$NGINX_PORT; key=$VENDOR_KEY; pids=($(nginx_pids)) ;;
    gateway) port=$GATEWAY_PORT; key=$API_KEY; pids=("$GATEWAY_PID") ;;
  esac
  bodyf=$TMP/body.json
  if [ "$mode" = stream ]; then bodyf=$TMP/body-stream.json; flags=(--stream); fi
  for pid in "$VENDOR_PID" "$NGINX_PID" "$GATEWAY_PID"; do
    kill -0 "$pid" 2>/dev/null || { echo "run.sh: process $pid exited; logs:" >&2; tail -n 5 "$TMP"/*.log >&2; exit 1; }
  done
  before=0; [ ${#pids[@]} -gt 0 ] && before=$(cpu_ticks "${pids[@]}")
  vbefore=$(cpu_ticks "$VENDOR_PID")
  local perf_pid=""
  if [ -n "${PROFILE:-}" ] && [ ${#pids[@]} -gt 0 ]; then
    mkdir -p "$PROFILE"
    perf record -q ${PERF_CALLGRAPH:--g} -F 2999 -p "$(IFS=,; echo "${pids[*]}")" -o "$PROFILE/$mode-$rate-$target.data" \
      >/dev/null 2>&1 &
    perf_pid=$!
  fi
  out=$("$LOAD" --port "$port" --path /v1/chat/completions --body-file "$bodyf" \
    --header "Authorization: Bearer $key" --rate "$rate" --duration-s "$DURATION_S" \
    --warmup-s "$WARMUP_S" --connections "$CONNECTIONS" --label "$target" "${flags[@]}")
  if [ -n "$perf_pid" ]; then kill -INT "$perf_pid" 2>/dev/null || true; wait "$perf_pid" 2>/dev/null || true; fi
  after=0; [ ${#pids[@]} -gt 0 ] && after=$(cpu_ticks "${pids[@]}")
  vafter=$(cpu_ticks "$VENDOR_PID")
  # CPU over warmup + measured requests, per scheduled request; -1 = not measured (direct).
  n=$(awk -v r="$rate" -v d="$DURATION_S" -v w="$WARMUP_S" 'BEGIN { print r * (d + w) }')
  cpu=$(awk -v b="$before" -v a="$after" -v hz="$HZ" -v n="$n" -v m=${#pids[@]} \
    'BEGIN { if (m == 0) print -1; else printf "%.1f", (a - b) / hz * 1e6 / n }')
  vcpu=$(awk -v b="$vbefore" -v a="$vafter" -v hz="$HZ" -v n="$n" 'BEGIN { printf "%.1f", (a - b) / hz * 1e6 / n }')
  echo "${out%\}},\"mode\":\"$mode\",\"cpu_us_per_req\":$cpu,\"vendor_cpu_us_per_req\":$vcpu}" >>"$RESULTS"
  echo "  $mode $rate rps $target: $(echo "$out" | sed 's/.*"count":\([0-9]*\),"errors":\([0-9]*\).*"p50_us":\([0-9.]*\).*"p99_us":\([0-9.]*\),.*/n=\1 err=\2 p50=\3us p99=\4us/')" >&2
}
echo "running: ${DURATION_S}s per point after ${WARMUP_S}s warmup, $CONNECTIONS connections, rates $RATES" >&2
for _ in $(seq 1 "$ROUNDS"); do
  for mode in nonstream stream; do
    for rate in $RATES; do
      for target in direct nginx gateway; do run_one "$mode" "$rate" "$target"; done
    done
  done
done

# The policy is live: a prompt the team's deny rule matches is refused (checked after the sweep
# so that a gateway failure on this path cannot cut the measurement short).
DENIED=$(code "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" -H "Authorization: Bearer $API_KEY" \
  -H 'Content-Type: application/json' -d "$(body false 'say forbidden-benchmark-word')" || true)
sleep 0.5
kill -0 "$GATEWAY_PID" 2>/dev/null || DENIED="$DENIED, then the gateway exited: $(tail -n 1 "$TMP/gateway.log")"
SPEND=$( (admin GET "/admin/spend?key_id=$KEY_ID" 2>/dev/null || true) | sed -n 's/.*"daily":{"cost":\([0-9.e-]*\),"tokens":\([0-9]*\).*/\2 tokens, $\1/p' || true)
cp "$RESULTS" "${KEEP_RESULTS:-/dev/null}" 2>/dev/null || true

echo "### Gateway overhead ($(date -u +%Y-%m-%d), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
echo
echo "Open-loop load, ${DURATION_S} s per point after ${WARMUP_S} s warmup, $CONNECTIONS keep-alive client"
echo "connections; latency from each request's scheduled send time. Fake vendor: OpenAI kind,"
echo "16-token reply, TTFT 0, stream unpaced. Gateway: $GW_THREADS thread(s), nginx: $NGINX_WORKERS worker(s), real key with key + team budgets"
echo "and a team policy (no key -> $NOKEY, denied prompt -> $DENIED). nginx: $NGINX_WORKERS workers,"
echo "keep-alive to client and upstream, proxy_buffering off. CPU from /proc/<pid>/stat utime + stime"
echo "($HZ ticks/s) over warmup + run, per scheduled request; cores busy = (client + vendor + proxy"
echo "CPU per request) x rate."
echo
"$LOAD" --report "$RESULTS"
echo
echo "Idle CPU (no load, ${IDLE_S} s): gateway $IDLE_GATEWAY µs/s, nginx $IDLE_NGINX µs/s. Spend the policy service"
echo "recorded for the bench key (every gateway request, warmup and sanity checks included): ${SPEND:-?}."
