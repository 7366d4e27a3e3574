// PolicyStore: the policy service's state — API keys (hashes only), budgets, team policies,
// prices, the usage ledger and the audit log — in one SQLite file (WAL mode, schema version in
// PRAGMA user_version). Spend per budget window comes from the ledger, or, when a Redis URL is
// given, from Redis counters that every store sharing that Redis adds to, so several policy
// instances enforce one budget. The ledger stays in SQLite either way.
//
// Windows are UTC calendar days and months; a usage record counts in the window holding its
// unix_ms (the time it was received when 0). Tokens counted against a budget are
// input + output tokens.
//
// Redis layout (prefix from options, default "keel:gw:"):
//   <prefix>spend:<scope>:<subject>:<d|m>:<window_start_unix>  hash {tokens, cost}, expires a
//       day after the window ends; scope "key" (subject key_id) and "team" (subject team name)
//   <prefix>req:<request_id>  set once per request id (2 days): duplicates across instances are
//       counted once. One Lua script per record does the check and the increments atomically.
//
// Thread-safe: every method may be called from any thread (one connection behind a mutex).
// Nothing here logs or stores an API key; key hashes live only in api_keys.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/gateway/policy.h"

namespace keel::gateway {

struct PolicyStoreOptions {
  // ":memory:" for a throwaway store. Created owner-only (0600), as are its -wal/-shm files; an
  // existing file that others can read is narrowed to 0600 on open (logged).
  std::string db_path = "keel-gateway.db";
  std::string redis_url;                     // "" = spend from the ledger; "host:port" or redis://host:port
  std::string redis_prefix = "keel:gw:";
  int redis_timeout_ms = 1000;
  int busy_timeout_ms = 5000;                // SQLite waits this long for another writer
  int64_t decision_ttl_ms = 5000;            // KeyDecision::ttl_ms
  std::function<int64_t()> now_ms;           // wall clock, ms since the epoch (tests pin it)
};

// [start, end) of the UTC window ("daily" or "monthly") holding unix second `t`.
struct Window {
  int64_t start_unix = 0;
  int64_t end_unix = 0;
};
Result<Window> WindowAt(std::string_view window, int64_t t);

struct KeyInfo {
  std::string key_id, principal, team;
  int64_t created_unix = 0;
  int64_t revoked_unix = 0;  // 0 = active
};

struct BudgetSpec {
  std::string scope;    // "key" or "team"
  std::string subject;  // key_id or team
  std::string window;   // "daily" or "monthly"
  int64_t limit_tokens = -1;
  double limit_cost = -1;
};

struct SpendReport {
  std::string scope, subject;
  int64_t daily_tokens = 0, monthly_tokens = 0;
  double daily_cost = 0, monthly_cost = 0;
  int64_t daily_end_unix = 0, monthly_end_unix = 0;
  std::vector<BudgetState> budgets;  // budgets on this subject, with current spend
};

struct AuditEntry {
  int64_t id = 0;
  int64_t unix_ms = 0;
  std::string actor;   // who (the admin's label and the peer, never a credential)
  std::string action;  // "key.create", "key.revoke", "budget.put", ...
  std::string target;  // key_id, budget_id, team or model
  std::string detail;  // JSON of the change, without secrets
};

struct UsageOutcome {
  int64_t accepted = 0;
  int64_t duplicates = 0;
};

// Team and model names: 1..128 bytes of [A-Za-z0-9._:/@+-] (they appear in Redis keys and logs).
bool IsValidName(std::string_view name);

class PolicyStore {
 public:
  // Opens or creates the database and, with a Redis URL, connects (Unavailable if Redis does not
  // answer). IOError/Corruption naming the file when SQLite cannot open it or its schema version
  // is not one this build knows.
  static Result<std::unique_ptr<PolicyStore>> Open(PolicyStoreOptions options);
  ~PolicyStore();
  PolicyStore(const PolicyStore&) = delete;
  PolicyStore& operator=(const PolicyStore&) = delete;

  struct NewKey {
    std::string key_id;
    std::string api_key;  // shown once; only its hash is stored
  };
  Result<NewKey> CreateKey(const std::string& principal, const std::string& team, const std::string& actor);
  // NotFound for an unknown key_id; revoking a revoked key keeps the first revocation time.
  Status RevokeKey(const std::string& key_id, const std::string& actor);
  Result<std::vector<KeyInfo>> ListKeys();

  // Creates or replaces the budget for (scope, subject, window); returns its budget_id (stable
  // across replacements). InvalidArgument for a bad scope/window/subject or no limit at all.
  Result<std::string> PutBudget(const BudgetSpec& spec, const std::string& actor);
  Status DeleteBudget(const std::string& budget_id, const std::string& actor);  // NotFound if none
  Status PutPolicy(const std::string& team, const PolicyRules& rules, const std::string& actor);
  Result<PolicyRules> GetPolicy(const std::string& team);  // default rules when none is set
  Status PutPrice(const std::string& model, const Price& price, const std::string& actor);
  Result<std::map<std::string, Price>> Prices();

  // The decision for the key with this hash (known=false when there is none).
  Result<KeyDecision> Resolve(std::string_view key_hash);
  // Adds records to the ledger (and Redis counters); a request_id seen before is a duplicate.
  // All or nothing: on an error nothing was counted and the batch may be sent again.
  Result<UsageOutcome> RecordUsage(const std::vector<UsageRecord>& records);
  // Spend of a key ("key", key_id) or team ("team", name) in the current windows.
  Result<SpendReport> Spend(const std::string& scope, const std::string& subject);
  // Newest first, at most `limit` (1..1000).
  Result<std::vector<AuditEntry>> Audit(int limit);

  bool uses_redis() const;

 private:
  struct Impl;
  explicit PolicyStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::gateway
