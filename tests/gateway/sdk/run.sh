#!/usr/bin/env bash
# The official npm clients (openai, @anthropic-ai/sdk, @google/genai) against `keel gateway`, and
# the openai client against `keel answer` in front of it.
#
# Starts, on loopback, one `keel fake-vendor` per kind, a `keel gateway-policy` (SQLite in a temp
# dir) with a key and a key whose team budget is spent, and `keel gateway` routing virtual models
# to the fakes; then runs openai.mjs, anthropic.mjs, gemini.mjs (every check must pass) and
# pending.mjs (features landing now: only those listed as required there fail the run).
# Exits non-zero if a check failed; each failure is printed with its name.
#
#   tests/gateway/sdk/run.sh [openai|anthropic|gemini|answer|pending ...]   (default: all five)
#
# Needs: a built build/keel (or $KEEL_BINARY), node >= 18, `npm ci` run in tests/gateway/sdk,
# curl. $KEEL_SDK_KEEP=1 keeps the temp dir (logs, config) for a look afterwards.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
KEEL=${KEEL_BINARY:-$ROOT/build/keel}
NODE=${NODE:-node}
SUITES=("$@")
[ ${#SUITES[@]} -gt 0 ] || SUITES=(openai anthropic gemini answer pending)

die() { echo "sdk/run.sh: $*" >&2; exit 2; }
[ -x "$KEEL" ] || die "no keel binary at $KEEL (build it: ninja -C build keel)"
command -v "$NODE" >/dev/null || die "node is missing (apt-get install nodejs npm)"
command -v curl >/dev/null || die "curl is missing"
[ -d "$HERE/node_modules/openai" ] && [ -d "$HERE/node_modules/@anthropic-ai/sdk" ] && [ -d "$HERE/node_modules/@google/genai" ] ||
  die "the SDKs are not installed: (cd tests/gateway/sdk && npm ci)"

WORK=$(mktemp -d /tmp/keel-sdk-XXXXXX)
PIDS=()
cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "${KEEL_SDK_KEEP:-0}" = 1 ]; then echo "sdk/run.sh: logs and config in $WORK" >&2; else rm -rf "$WORK"; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Waits until `file` has a line with "listening on <url>" and prints the url.
listening_url() {
  local file=$1 name=$2
  for _ in $(seq 1 300); do
    local url
    url=$(grep -o 'listening on http://[^ ]*' "$file" 2>/dev/null | head -1 | cut -d' ' -f3) || true
    if [ -n "$url" ]; then echo "$url"; return 0; fi
    sleep 0.05
  done
  tail -20 "$file" >&2
  die "$name did not start"
}

declare -A FAKE
for kind in openai anthropic gemini; do
  "$KEEL" fake-vendor --kind "$kind" --port 0 --reply-tokens 12 --api-key "vendor-$kind" >"$WORK/fake-$kind.out" 2>"$WORK/fake-$kind.log" &
  PIDS+=($!)
done
for kind in openai anthropic gemini; do FAKE[$kind]=$(listening_url "$WORK/fake-$kind.out" "fake-vendor $kind"); done

SOCK=$WORK/policy.sock
ADMIN_KEY=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')
(umask 077 && printf '%s' "$ADMIN_KEY" >"$WORK/admin.key")
"$KEEL" gateway-policy --socket "$SOCK" --db "$WORK/gw.db" --admin-key-file "$WORK/admin.key" >"$WORK/policy.log" 2>&1 &
PIDS+=($!)
admin() {  # METHOD PATH [BODY]: the policy service's admin API; prints the body, fails on non-2xx
  curl -sS --fail-with-body --max-time 10 --unix-socket "$SOCK" -X "$1" -H "Authorization: Bearer $ADMIN_KEY" \
       -H 'Content-Type: application/json' ${3:+--data-binary "$3"} "http://localhost$2"
}
for _ in $(seq 1 300); do admin GET /healthz >/dev/null 2>&1 && break; sleep 0.05; done
admin GET /healthz >/dev/null || { tail -20 "$WORK/policy.log" >&2; die "gateway-policy did not start"; }
json_field() { "$NODE" -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>console.log(JSON.parse(s)[process.argv[1]]))' "$1"; }
KEY=$(admin POST /admin/keys '{"principal":"sdk","team":"sdk"}' | json_field api_key)
BUDGET_KEY=$(admin POST /admin/keys '{"principal":"sdk-broke","team":"sdk-broke"}' | json_field api_key)
admin PUT /admin/budgets '{"scope":"team","subject":"sdk-broke","window":"daily","limit_tokens":1}' >/dev/null

PORT=$("$NODE" -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')
cat >"$WORK/gateway.json" <<EOF
{
  "listen": {"host": "127.0.0.1", "port": $PORT, "max_body_bytes": 1048576, "client_timeout_s": 30},
  "policy": {"socket": "$SOCK", "timeout_s": 1, "usage_flush_s": 0.05},
  "upstreams": [
    {"name": "oa", "format": "openai",    "base_url": "${FAKE[openai]}",    "api_key": "vendor-openai"},
    {"name": "an", "format": "anthropic", "base_url": "${FAKE[anthropic]}", "api_key": "vendor-anthropic"},
    {"name": "ge", "format": "gemini",    "base_url": "${FAKE[gemini]}",    "api_key": "vendor-gemini"}
  ],
  "models": [
    {"name": "sdk-openai",          "targets": [{"upstream": "oa", "model": "gpt-4o"}]},
    {"name": "sdk-anthropic",       "targets": [{"upstream": "an", "model": "claude-sonnet-4"}]},
    {"name": "sdk-gemini",          "targets": [{"upstream": "ge", "model": "gemini-2.0-flash"}]},
    {"name": "sdk-openai-tools",    "targets": [{"upstream": "oa", "model": "gpt-4o-tools"}]},
    {"name": "sdk-anthropic-tools", "targets": [{"upstream": "an", "model": "claude-tools"}]},
    {"name": "sdk-gemini-tools",    "targets": [{"upstream": "ge", "model": "gemini-tools"}]},
    {"name": "sdk-embed",           "targets": [{"upstream": "oa", "model": "text-embedding-3-small"}]},
    {"name": "sdk-only-429",        "targets": [{"upstream": "oa", "model": "gpt-error-429"}]},
    {"name": "sdk-truncate",        "targets": [{"upstream": "oa", "model": "gpt-truncate"}]},
    {"name": "sdk-fallback",        "targets": [{"upstream": "oa", "model": "gpt-error-429"},
                                                {"upstream": "an", "model": "claude-ok"}]}
  ]
}
EOF
"$KEEL" gateway --config "$WORK/gateway.json" >"$WORK/gateway.out" 2>"$WORK/gateway.log" &
GW_PID=$!
PIDS+=($GW_PID)
GW=$(listening_url "$WORK/gateway.out" "keel gateway")

# keel answer in front of the gateway: a two-document corpus, no vector service behind it.
printf 'one document\n\nanother document\n' >"$WORK/corpus.txt"
ANSWER_PORT=$("$NODE" -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')
"$KEEL" answer serve --port "$ANSWER_PORT" --vector http://127.0.0.1:9 --gateway "$GW" --model sdk-openai \
  --corpus "$WORK/corpus.txt" >"$WORK/answer.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$ANSWER_PORT/healthz" >/dev/null 2>&1 && break; sleep 0.05; done
curl -sf "http://127.0.0.1:$ANSWER_PORT/healthz" >/dev/null || { tail -20 "$WORK/answer.log" >&2; die "keel answer did not start"; }

export KEEL_GW_URL=$GW KEEL_GW_KEY=$KEY KEEL_GW_BUDGET_KEY=$BUDGET_KEY KEEL_ANSWER_URL=http://127.0.0.1:$ANSWER_PORT
export KEEL_FAKE_OPENAI_URL=${FAKE[openai]} KEEL_FAKE_ANTHROPIC_URL=${FAKE[anthropic]} KEEL_FAKE_GEMINI_URL=${FAKE[gemini]}
echo "sdk/run.sh: gateway $GW; node $("$NODE" --version); $(cd "$HERE" && "$NODE" -p '["openai","@anthropic-ai/sdk","@google/genai"].map(p=>p+"@"+JSON.parse(require("fs").readFileSync("node_modules/"+p+"/package.json")).version).join(", ")')"

failed=()
for suite in "${SUITES[@]}"; do
  [ -f "$HERE/$suite.mjs" ] || die "no suite $suite (openai, anthropic, gemini, answer, pending)"
  echo "== $suite"
  if ! (cd "$HERE" && timeout 600 "$NODE" "$suite.mjs"); then failed+=("$suite"); fi
  kill -0 "$GW_PID" 2>/dev/null || { failed+=("gateway-died"); echo "keel gateway exited:"; tail -20 "$WORK/gateway.log"; break; }
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "sdk/run.sh: FAILED: ${failed[*]} (gateway log: $WORK/gateway.log with KEEL_SDK_KEEP=1)"
  exit 1
fi
echo "sdk/run.sh: all SDK checks passed"
