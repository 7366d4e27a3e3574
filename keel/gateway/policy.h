// The gateway's governance model and the wire protocol between `keel gateway` and
// `keel gateway-policy` (HTTP/1.1 + JSON over a local socket). Slow decisions (who is this key,
// what may it do, how much is left) are made by the policy service and cached by the gateway
// with a TTL; usage is reported back in batches after requests finish. Nothing here is on the
// per-chunk path of a stream.
//
// Endpoints of the policy service (see policy_service.h):
//   POST /v1/resolve  {"key_hash": "<hex sha256 of the API key>"}  -> KeyDecision
//   POST /v1/usage    {"records": [UsageRecord...]}  -> {"accepted": n, "duplicates": m}
//   GET  /healthz, GET /metrics
//   admin (header "Authorization: Bearer <admin key>"; 401 otherwise):
//   POST /admin/keys {"principal","team"} -> {"key_id","api_key"} (the key is shown only here)
//   POST /admin/keys/revoke {"key_id"}     GET /admin/keys
//   PUT  /admin/budgets {"scope":"key"|"team","subject","window":"daily"|"monthly",
//                        "limit_tokens"?, "limit_cost"?}  -> {"budget_id"}
//   DELETE /admin/budgets {"budget_id"}
//   PUT  /admin/policies {"team", "allowed_models"?, "max_tokens"?, "rewrites"?: {from: to},
//                         "deny"?: [{"model"?: glob, "contains"?: text, "message"?}]}
//   PUT  /admin/prices {"model", "input_per_mtok", "output_per_mtok"}   (USD per 1M tokens)
//   GET  /admin/spend?team=..|key_id=..      GET /admin/audit?limit=N
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/json_reader.h"
#include "keel/core/status.h"

namespace keel::gateway {

// Lowercase hex SHA-256 of an API key. Keys are 32 random bytes, so a fast hash is enough; only
// hashes are stored, sent between processes or compared.
std::string HashApiKey(std::string_view api_key);
// A new random API key: "sk-keel-" + 43 base64url characters (32 bytes from the OS CSPRNG).
std::string NewApiKey();

struct Price {
  double input_per_mtok = 0;   // USD per 1M input tokens
  double output_per_mtok = 0;
};

struct DenyRule {
  std::string model_glob;  // "" = any model; '*' and '?' wildcards
  std::string contains;    // "" = any request; else case-insensitive substring of the prompt
  std::string message;     // shown to the client in the 403
};

struct PolicyRules {
  std::vector<std::string> allowed_models;  // empty = every model; globs allowed
  int64_t max_tokens = -1;                  // cap on max_tokens; -1 = none
  std::map<std::string, std::string> rewrites;  // requested model -> model actually used
  std::vector<DenyRule> deny;
};

struct BudgetState {
  std::string budget_id;
  std::string scope;          // "key" or "team"
  std::string subject;        // key_id or team name
  std::string window;         // "daily" or "monthly" (UTC calendar windows)
  int64_t limit_tokens = -1;  // -1 = no token limit
  double limit_cost = -1;     // USD; -1 = no cost limit
  int64_t spent_tokens = 0;   // in the current window, as of the decision
  double spent_cost = 0;
  int64_t window_end_unix = 0;
};

struct KeyDecision {
  bool known = false;    // false: no such key (the gateway answers 401)
  bool revoked = false;  // true: the key was revoked (401)
  std::string key_id;
  std::string principal;
  std::string team;
  PolicyRules policy;
  std::vector<BudgetState> budgets;
  std::map<std::string, Price> prices;  // model -> price, for every model with a price
  int64_t ttl_ms = 5000;                // how long the gateway may cache this decision
};

struct UsageRecord {
  std::string request_id;  // unique; a record sent twice is counted once
  std::string key_id;
  std::string team;
  std::string model;       // the upstream model that served it
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  double cost = 0;         // USD, by the price table
  int64_t unix_ms = 0;
};

// JSON codecs. Parsers never throw: malformed JSON, a wrong type, a missing required field or
// an out-of-range value is InvalidArgument naming the field ("records[2].input_tokens: ...").
// Decoders of the wire messages ignore unknown fields (an older peer can read a newer one);
// PolicyRulesFromJson, which reads what an operator typed, rejects them (typos are errors).
std::string ToJson(const KeyDecision& decision);
Result<KeyDecision> KeyDecisionFromJson(std::string_view json);
std::string UsageBatchToJson(const std::vector<UsageRecord>& records);
Result<std::vector<UsageRecord>> UsageBatchFromJson(std::string_view json);
// {"allowed_models": [...], "max_tokens": n, "rewrites": {...}, "deny": [{"model", "contains",
// "message"}]}; every field optional on input, all written on output.
std::string ToJson(const PolicyRules& rules);
Result<PolicyRules> PolicyRulesFromJson(std::string_view json);
// True for 64 lowercase hex digits (what HashApiKey returns).
bool IsKeyHash(std::string_view text);
// Limits the decoders enforce (bounded work for any input).
inline constexpr size_t kMaxUsageBatch = 10000;     // records per POST /v1/usage
inline constexpr size_t kMaxJsonString = 4096;      // bytes in any one string field
inline constexpr size_t kMaxPolicyEntries = 1000;   // allowed_models, rewrites, deny each
inline constexpr int kMaxJsonDepth = 32;            // nesting of arrays and objects
inline constexpr size_t kMaxJsonValues = 1 << 18;   // values in one message; a full usage batch is ~170k
// Every JSON body the policy service and its clients read goes through ParseUntrustedJson with
// these, checked before parsing (keel/core/json_reader.h).
inline constexpr JsonLimits kPolicyJsonLimits{
    .max_depth = kMaxJsonDepth, .max_values = kMaxJsonValues, .require_object = true};

// Cost of a request under `prices` (0 when the model has no price).
double CostOf(const std::map<std::string, Price>& prices, const std::string& model,
              int64_t input_tokens, int64_t output_tokens);
// '*' and '?' glob match (case-sensitive), used for allowed_models and deny rules.
bool GlobMatch(std::string_view pattern, std::string_view text);

}  // namespace keel::gateway
