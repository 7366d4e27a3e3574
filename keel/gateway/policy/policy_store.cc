#include "keel/gateway/policy_store.h"

#include <fcntl.h>
#include <openssl/rand.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "keel/core/log.h"
#include "keel/gateway/policy_redis.h"

namespace keel::gateway {

using json = nlohmann::json;

namespace {

constexpr int kSchemaVersion = 1;

// Version 1. Times: *_unix in seconds, *_ms in milliseconds since the epoch (UTC).
constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS api_keys (
  key_id TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE, principal TEXT NOT NULL, team TEXT NOT NULL,
  created INTEGER NOT NULL, revoked_at INTEGER);
CREATE TABLE IF NOT EXISTS budgets (
  budget_id TEXT PRIMARY KEY, scope TEXT NOT NULL CHECK (scope IN ('key', 'team')), subject TEXT NOT NULL,
  window TEXT NOT NULL CHECK (window IN ('daily', 'monthly')), limit_tokens INTEGER NOT NULL,
  limit_cost REAL NOT NULL, updated INTEGER NOT NULL, UNIQUE (scope, subject, window));
CREATE TABLE IF NOT EXISTS policies (team TEXT PRIMARY KEY, rules TEXT NOT NULL, updated INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS prices (
  model TEXT PRIMARY KEY, input_per_mtok REAL NOT NULL, output_per_mtok REAL NOT NULL, updated INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS usage (
  request_id TEXT PRIMARY KEY, key_id TEXT NOT NULL, team TEXT NOT NULL, model TEXT NOT NULL,
  input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, cost REAL NOT NULL, unix_ms INTEGER NOT NULL,
  received_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS usage_by_key ON usage (key_id, unix_ms);
CREATE INDEX IF NOT EXISTS usage_by_team ON usage (team, unix_ms);
CREATE TABLE IF NOT EXISTS audit (
  id INTEGER PRIMARY KEY AUTOINCREMENT, unix_ms INTEGER NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
  target TEXT NOT NULL, detail TEXT NOT NULL);
)sql";

std::string RandomHex(size_t bytes) {
  unsigned char raw[32];
  if (bytes > sizeof(raw) || RAND_bytes(raw, static_cast<int>(bytes)) != 1) std::abort();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes; ++i) {
    out += kHex[raw[i] >> 4];
    out += kHex[raw[i] & 15];
  }
  return out;
}

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// A cached prepared statement, reset (bindings cleared) when the wrapper goes out of scope.
class Stmt {
 public:
  Stmt(sqlite3* db, sqlite3_stmt* s, const std::string* path) : db_(db), s_(s), path_(path) {}
  ~Stmt() {
    sqlite3_reset(s_);
    sqlite3_clear_bindings(s_);
  }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& Text(std::string_view v) {
    sqlite3_bind_text(s_, ++n_, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& Int(int64_t v) {
    sqlite3_bind_int64(s_, ++n_, v);
    return *this;
  }
  Stmt& Real(double v) {
    sqlite3_bind_double(s_, ++n_, v);
    return *this;
  }
  // true: a row is ready; false: done.
  Result<bool> Step() {
    int rc = sqlite3_step(s_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return Status::IOError(fmt::format("{}: {}", *path_, sqlite3_errmsg(db_)));
  }
  Status Run() {
    KEEL_ASSIGN_OR_RETURN(bool row, Step());
    (void)row;
    return Status::Ok();
  }
  int64_t ColInt(int c) const { return sqlite3_column_int64(s_, c); }
  double ColReal(int c) const { return sqlite3_column_double(s_, c); }
  bool ColNull(int c) const { return sqlite3_column_type(s_, c) == SQLITE_NULL; }
  std::string ColText(int c) const {
    const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(s_, c));
    return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(s_, c))) : std::string();
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* s_;
  const std::string* path_;
  int n_ = 0;
};

Status ValidateBudget(const BudgetSpec& b) {
  if (b.scope != "key" && b.scope != "team") return Status::InvalidArgument("scope: must be \"key\" or \"team\"");
  if (b.window != "daily" && b.window != "monthly") return Status::InvalidArgument("window: must be \"daily\" or \"monthly\"");
  if (!IsValidName(b.subject)) return Status::InvalidArgument("subject: must be a key_id or team name (1..128 of [A-Za-z0-9._:/@+-])");
  if (b.limit_tokens < -1) return Status::InvalidArgument("limit_tokens: must be >= 0 (or -1 for none)");
  if (!(b.limit_cost >= 0 || b.limit_cost == -1)) return Status::InvalidArgument("limit_cost: must be >= 0 (or -1 for none)");
  if (b.limit_tokens < 0 && b.limit_cost < 0) return Status::InvalidArgument("limit_tokens or limit_cost: a budget needs a limit");
  return Status::Ok();
}

}  // namespace

bool IsValidName(std::string_view name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '/' || c == '@' || c == '+' || c == '-';
    if (!ok) return false;
  }
  return true;
}

Result<Window> WindowAt(std::string_view window, int64_t t) {
  if (window == "daily") {
    int64_t start = t >= 0 ? t / 86400 * 86400 : -((-t + 86399) / 86400) * 86400;
    return Window{start, start + 86400};
  }
  if (window != "monthly") return Status::InvalidArgument(fmt::format("window: unknown '{}'", window));
  std::time_t tt = static_cast<std::time_t>(t);
  std::tm tm{};
  ::gmtime_r(&tt, &tm);
  std::tm first{};
  first.tm_year = tm.tm_year;
  first.tm_mon = tm.tm_mon;
  first.tm_mday = 1;
  std::tm next = first;
  if (++next.tm_mon == 12) {
    next.tm_mon = 0;
    ++next.tm_year;
  }
  return Window{static_cast<int64_t>(::timegm(&first)), static_cast<int64_t>(::timegm(&next))};
}

// The store holds key hashes, budgets, spend and the audit log: owner-only. SQLite creates a new
// database with 0644 less the umask, and its -wal/-shm/-journal files with the database file's
// mode, so the file is created 0600 here first (an empty file is an empty database), and any
// existing file or sidecar readable by others is narrowed to 0600, with a log line. No umask
// change: it is process-wide, and the gateway is multi-threaded.
namespace {
Status MakeDbOwnerOnly(const std::string& path) {
  if (path.empty() || path == ":memory:" || path.rfind("file:", 0) == 0) return Status::Ok();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IOError(fmt::format("{}: open: {}", path, std::strerror(errno)));
  ::close(fd);
  for (const char* suffix : {"", "-wal", "-shm", "-journal"}) {
    const std::string file = path + suffix;
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0 || (st.st_mode & 077) == 0) continue;
    if (::chmod(file.c_str(), st.st_mode & 0700) != 0) {
      return Status::IOError(fmt::format("{}: mode {:o} lets other users read it and chmod failed: {}", file,
                                         st.st_mode & 0777, std::strerror(errno)));
    }
    Log().warn("policy store: {} had mode {:o}; narrowed to {:o} (it holds key hashes and spend)", file,
               st.st_mode & 0777, st.st_mode & 0700);
  }
  return Status::Ok();
}
}  // namespace

struct PolicyStore::Impl {
  PolicyStoreOptions options;
  std::mutex mu;
  sqlite3* db = nullptr;
  std::map<std::string, sqlite3_stmt*, std::less<>> stmts;
  std::unique_ptr<SpendCounters> redis;

  ~Impl() {
    for (auto& [sql, s] : stmts) sqlite3_finalize(s);
    if (db != nullptr) sqlite3_close_v2(db);
  }

  Status Err(std::string_view what) const {
    return Status::IOError(fmt::format("{}: {}: {}", options.db_path, what, sqlite3_errmsg(db)));
  }
  int64_t NowMs() const { return options.now_ms ? options.now_ms() : SystemNowMs(); }

  Result<std::unique_ptr<Stmt>> Prepare(std::string_view sql) {
    auto it = stmts.find(sql);
    if (it == stmts.end()) {
      sqlite3_stmt* s = nullptr;
      if (sqlite3_prepare_v3(db, sql.data(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT, &s, nullptr) !=
          SQLITE_OK) {
        return Err("prepare");
      }
      it = stmts.emplace(std::string(sql), s).first;
    }
    return std::make_unique<Stmt>(db, it->second, &options.db_path);
  }

  Status Exec(const char* sql) {
    char* msg = nullptr;
    if (sqlite3_exec(db, sql, nullptr, nullptr, &msg) != SQLITE_OK) {
      Status s = Status::IOError(fmt::format("{}: {}", options.db_path, msg ? msg : sqlite3_errmsg(db)));
      sqlite3_free(msg);
      return s;
    }
    return Status::Ok();
  }

  Status OpenDb() {
    const int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX;
    KEEL_RETURN_IF_ERROR(MakeDbOwnerOnly(options.db_path));
    if (sqlite3_open_v2(options.db_path.c_str(), &db, flags, nullptr) != SQLITE_OK) return Err("open");
    sqlite3_extended_result_codes(db, 1);
    sqlite3_busy_timeout(db, options.busy_timeout_ms);
    if (Status s = Exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"); !s.ok()) {
      return Status::Corruption(fmt::format("{} (not a SQLite database?)", s.message()));
    }
    KEEL_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
    Status s = Migrate();
    KEEL_RETURN_IF_ERROR(Exec(s.ok() ? "COMMIT" : "ROLLBACK"));
    return s;
  }

  // Inside a write transaction, so two processes opening a new file do not both create it.
  Status Migrate() {
    KEEL_ASSIGN_OR_RETURN(auto version, Prepare("PRAGMA user_version"));
    KEEL_ASSIGN_OR_RETURN(bool row, version->Step());
    const int64_t v = row ? version->ColInt(0) : 0;
    version.reset();
    if (v == kSchemaVersion) return Status::Ok();
    if (v != 0) {
      return Status::Corruption(fmt::format("{}: schema version {}, this build reads version {}", options.db_path, v,
                                            kSchemaVersion));
    }
    KEEL_ASSIGN_OR_RETURN(auto tables, Prepare("SELECT count(*) FROM sqlite_master WHERE type = 'table'"));
    KEEL_ASSIGN_OR_RETURN(row, tables->Step());
    if (row && tables->ColInt(0) != 0) {
      return Status::Corruption(fmt::format("{}: has tables but no Keel schema version; not a gateway database",
                                            options.db_path));
    }
    tables.reset();
    KEEL_RETURN_IF_ERROR(Exec(kSchema));
    return Exec(fmt::format("PRAGMA user_version = {}", kSchemaVersion).c_str());
  }

  Status AuditLog(const std::string& actor, const char* action, const std::string& target, const json& detail) {
    KEEL_ASSIGN_OR_RETURN(auto st, Prepare("INSERT INTO audit (unix_ms, actor, action, target, detail) VALUES (?, ?, ?, ?, ?)"));
    return st->Int(NowMs()).Text(actor).Text(action).Text(target).Text(Dump(detail)).Run();
  }

  // Runs fn inside BEGIN IMMEDIATE ... COMMIT; rolls back when fn fails.
  template <typename Fn>
  Status InTransaction(Fn&& fn) {
    KEEL_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
    Status s = fn();
    if (!s.ok()) {
      (void)Exec("ROLLBACK");
      return s;
    }
    if (Status c = Exec("COMMIT"); !c.ok()) {
      (void)Exec("ROLLBACK");
      return c;
    }
    return Status::Ok();
  }

  // Spend of (scope, subject) in `window` containing now: Redis counters or the ledger.
  Result<SpendCounters::Totals> SpentIn(const std::string& scope, const std::string& subject,
                                        const std::string& window_name, const Window& w) {
    if (redis) {
      KEEL_ASSIGN_OR_RETURN(auto totals, redis->Get({redis->CounterKey(scope, subject, window_name, w.start_unix)}));
      return totals[0];
    }
    const char* sql = scope == "key"
        ? "SELECT COALESCE(SUM(input_tokens + output_tokens), 0), COALESCE(SUM(cost), 0) FROM usage "
          "WHERE key_id = ? AND unix_ms >= ? AND unix_ms < ?"
        : "SELECT COALESCE(SUM(input_tokens + output_tokens), 0), COALESCE(SUM(cost), 0) FROM usage "
          "WHERE team = ? AND unix_ms >= ? AND unix_ms < ?";
    KEEL_ASSIGN_OR_RETURN(auto st, Prepare(sql));
    st->Text(subject).Int(w.start_unix * 1000).Int(w.end_unix * 1000);
    KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
    SpendCounters::Totals t;
    if (row) {
      t.tokens = st->ColInt(0);
      t.cost = st->ColReal(1);
    }
    return t;
  }

  // Budgets matching the WHERE clause (two text parameters), with current spend filled in.
  Result<std::vector<BudgetState>> BudgetsWithSpend(const char* where, const std::string& a, const std::string& b) {
    std::vector<BudgetState> out;
    {
      KEEL_ASSIGN_OR_RETURN(auto st, Prepare(fmt::format("SELECT budget_id, scope, subject, window, limit_tokens, "
                                                         "limit_cost FROM budgets WHERE {} ORDER BY budget_id", where)));
      st->Text(a).Text(b);
      for (;;) {
        KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
        if (!row) break;
        BudgetState s;
        s.budget_id = st->ColText(0);
        s.scope = st->ColText(1);
        s.subject = st->ColText(2);
        s.window = st->ColText(3);
        s.limit_tokens = st->ColInt(4);
        s.limit_cost = st->ColReal(5);
        out.push_back(std::move(s));
      }
    }
    const int64_t now = NowMs() / 1000;
    for (BudgetState& s : out) {
      KEEL_ASSIGN_OR_RETURN(Window w, WindowAt(s.window, now));
      KEEL_ASSIGN_OR_RETURN(auto t, SpentIn(s.scope, s.subject, s.window, w));
      s.spent_tokens = t.tokens;
      s.spent_cost = t.cost;
      s.window_end_unix = w.end_unix;
    }
    return out;
  }

  Result<std::map<std::string, Price>> LoadPrices() {
    std::map<std::string, Price> out;
    KEEL_ASSIGN_OR_RETURN(auto st, Prepare("SELECT model, input_per_mtok, output_per_mtok FROM prices"));
    for (;;) {
      KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
      if (!row) break;
      out[st->ColText(0)] = Price{st->ColReal(1), st->ColReal(2)};
    }
    return out;
  }

  Result<PolicyRules> LoadPolicy(const std::string& team) {
    KEEL_ASSIGN_OR_RETURN(auto st, Prepare("SELECT rules FROM policies WHERE team = ?"));
    st->Text(team);
    KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
    if (!row) return PolicyRules{};
    auto rules = PolicyRulesFromJson(st->ColText(0));
    if (!rules.ok()) {
      return Status::Corruption(fmt::format("{}: policy of team {}: {}", options.db_path, team, rules.status().message()));
    }
    return std::move(rules).value();
  }
};

PolicyStore::PolicyStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PolicyStore::~PolicyStore() = default;

bool PolicyStore::uses_redis() const { return impl_->redis != nullptr; }

Result<std::unique_ptr<PolicyStore>> PolicyStore::Open(PolicyStoreOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  if (impl->options.decision_ttl_ms < 0) return Status::InvalidArgument("decision_ttl_ms: must be >= 0");
  KEEL_RETURN_IF_ERROR(impl->OpenDb());
  if (!impl->options.redis_url.empty()) {
    KEEL_ASSIGN_OR_RETURN(impl->redis, SpendCounters::Connect(impl->options.redis_url, impl->options.redis_prefix,
                                                              impl->options.redis_timeout_ms));
  }
  return std::unique_ptr<PolicyStore>(new PolicyStore(std::move(impl)));
}

Result<PolicyStore::NewKey> PolicyStore::CreateKey(const std::string& principal, const std::string& team,
                                                   const std::string& actor) {
  if (principal.empty() || principal.size() > 256) return Status::InvalidArgument("principal: must have 1..256 bytes");
  if (!IsValidName(team)) return Status::InvalidArgument("team: must be 1..128 of [A-Za-z0-9._:/@+-]");
  NewKey out{"key_" + RandomHex(8), NewApiKey()};
  std::lock_guard<std::mutex> lock(impl_->mu);
  KEEL_RETURN_IF_ERROR(impl_->InTransaction([&]() -> Status {
    KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare("INSERT INTO api_keys (key_id, key_hash, principal, team, created) "
                                                  "VALUES (?, ?, ?, ?, ?)"));
    KEEL_RETURN_IF_ERROR(st->Text(out.key_id).Text(HashApiKey(out.api_key)).Text(principal).Text(team)
                             .Int(impl_->NowMs() / 1000).Run());
    st.reset();
    return impl_->AuditLog(actor, "key.create", out.key_id, {{"principal", principal}, {"team", team}});
  }));
  return out;
}

Status PolicyStore::RevokeKey(const std::string& key_id, const std::string& actor) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->InTransaction([&]() -> Status {
    {
      KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare("SELECT revoked_at FROM api_keys WHERE key_id = ?"));
      st->Text(key_id);
      KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
      if (!row) return Status::NotFound(fmt::format("key_id: no key {}", key_id));
      if (!st->ColNull(0)) return Status::Ok();  // already revoked: keep the first time
    }
    KEEL_ASSIGN_OR_RETURN(auto up, impl_->Prepare("UPDATE api_keys SET revoked_at = ? WHERE key_id = ?"));
    KEEL_RETURN_IF_ERROR(up->Int(impl_->NowMs() / 1000).Text(key_id).Run());
    up.reset();
    return impl_->AuditLog(actor, "key.revoke", key_id, json::object());
  });
}

Result<std::vector<KeyInfo>> PolicyStore::ListKeys() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare("SELECT key_id, principal, team, created, revoked_at FROM api_keys "
                                                "ORDER BY created, key_id"));
  std::vector<KeyInfo> out;
  for (;;) {
    KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
    if (!row) break;
    out.push_back(KeyInfo{st->ColText(0), st->ColText(1), st->ColText(2), st->ColInt(3), st->ColNull(4) ? 0 : st->ColInt(4)});
  }
  return out;
}

Result<std::string> PolicyStore::PutBudget(const BudgetSpec& spec, const std::string& actor) {
  KEEL_RETURN_IF_ERROR(ValidateBudget(spec));
  std::string budget_id = "bud_" + RandomHex(8);
  std::lock_guard<std::mutex> lock(impl_->mu);
  KEEL_RETURN_IF_ERROR(impl_->InTransaction([&]() -> Status {
    KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare(
        "INSERT INTO budgets (budget_id, scope, subject, window, limit_tokens, limit_cost, updated) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (scope, subject, window) DO UPDATE SET "
        "limit_tokens = excluded.limit_tokens, limit_cost = excluded.limit_cost, updated = excluded.updated "
        "RETURNING budget_id"));
    st->Text(budget_id).Text(spec.scope).Text(spec.subject).Text(spec.window).Int(spec.limit_tokens)
        .Real(spec.limit_cost).Int(impl_->NowMs() / 1000);
    KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
    if (!row) return impl_->Err("upsert budget");
    budget_id = st->ColText(0);
    KEEL_RETURN_IF_ERROR(st->Run());  // finish the statement before the next one
    st.reset();
    return impl_->AuditLog(actor, "budget.put", budget_id,
                           {{"scope", spec.scope}, {"subject", spec.subject}, {"window", spec.window},
                            {"limit_tokens", spec.limit_tokens}, {"limit_cost", spec.limit_cost}});
  }));
  return budget_id;
}

Status PolicyStore::DeleteBudget(const std::string& budget_id, const std::string& actor) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->InTransaction([&]() -> Status {
    KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare("DELETE FROM budgets WHERE budget_id = ?"));
    KEEL_RETURN_IF_ERROR(st->Text(budget_id).Run());
    st.reset();
    if (sqlite3_changes(impl_->db) == 0) return Status::NotFound(fmt::format("budget_id: no budget {}", budget_id));
    return impl_->AuditLog(actor, "budget.delete", budget_id, json::object());
  });
}

Status PolicyStore::PutPolicy(const std::string& team, const PolicyRules& rules, const std::string& actor) {
  if (!IsValidName(team)) return Status::InvalidArgument("team: must be 1..128 of [A-Za-z0-9._:/@+-]");
  const std::string text = ToJson(rules);
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->InTransaction([&]() -> Status {
    KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare("INSERT INTO policies (team, rules, updated) VALUES (?, ?, ?) "
                                                  "ON CONFLICT (team) DO UPDATE SET rules = excluded.rules, "
                                                  "updated = excluded.updated"));
    KEEL_RETURN_IF_ERROR(st->Text(team).Text(text).Int(impl_->NowMs() / 1000).Run());
    st.reset();
    return impl_->AuditLog(actor, "policy.put", team, json::parse(text, nullptr, false));
  });
}

Result<PolicyRules> PolicyStore::GetPolicy(const std::string& team) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->LoadPolicy(team);
}

Status PolicyStore::PutPrice(const std::string& model, const Price& price, const std::string& actor) {
  if (!IsValidName(model)) return Status::InvalidArgument("model: must be 1..128 of [A-Za-z0-9._:/@+-]");
  if (!(price.input_per_mtok >= 0 && price.input_per_mtok < 1e9) ||
      !(price.output_per_mtok >= 0 && price.output_per_mtok < 1e9)) {
    return Status::InvalidArgument("input_per_mtok/output_per_mtok: must be in [0, 1e9)");
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->InTransaction([&]() -> Status {
    KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare(
        "INSERT INTO prices (model, input_per_mtok, output_per_mtok, updated) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (model) DO UPDATE SET input_per_mtok = excluded.input_per_mtok, "
        "output_per_mtok = excluded.output_per_mtok, updated = excluded.updated"));
    KEEL_RETURN_IF_ERROR(st->Text(model).Real(price.input_per_mtok).Real(price.output_per_mtok)
                             .Int(impl_->NowMs() / 1000).Run());
    st.reset();
    return impl_->AuditLog(actor, "price.put", model,
                           {{"input_per_mtok", price.input_per_mtok}, {"output_per_mtok", price.output_per_mtok}});
  });
}

Result<std::map<std::string, Price>> PolicyStore::Prices() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->LoadPrices();
}

Result<KeyDecision> PolicyStore::Resolve(std::string_view key_hash) {
  if (!IsKeyHash(key_hash)) return Status::InvalidArgument("key_hash: must be 64 lowercase hex digits");
  KeyDecision d;
  d.ttl_ms = impl_->options.decision_ttl_ms;
  std::lock_guard<std::mutex> lock(impl_->mu);
  {
    KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare("SELECT key_id, principal, team, revoked_at FROM api_keys "
                                                  "WHERE key_hash = ?"));
    st->Text(key_hash);
    KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
    if (!row) return d;
    d.known = true;
    d.key_id = st->ColText(0);
    d.principal = st->ColText(1);
    d.team = st->ColText(2);
    d.revoked = !st->ColNull(3);
  }
  if (d.revoked) return d;
  KEEL_ASSIGN_OR_RETURN(d.policy, impl_->LoadPolicy(d.team));
  KEEL_ASSIGN_OR_RETURN(d.budgets, impl_->BudgetsWithSpend("(scope = 'key' AND subject = ?) OR "
                                                           "(scope = 'team' AND subject = ?)", d.key_id, d.team));
  KEEL_ASSIGN_OR_RETURN(d.prices, impl_->LoadPrices());
  return d;
}

Result<UsageOutcome> PolicyStore::RecordUsage(const std::vector<UsageRecord>& records) {
  UsageOutcome out;
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int64_t now_ms = impl_->NowMs();
  KEEL_RETURN_IF_ERROR(impl_->InTransaction([&]() -> Status {
    out = UsageOutcome{};
    std::vector<SpendCounters::Add> adds;
    for (const UsageRecord& r : records) {
      const int64_t at_ms = r.unix_ms > 0 ? r.unix_ms : now_ms;
      KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare(
          "INSERT INTO usage (request_id, key_id, team, model, input_tokens, output_tokens, cost, unix_ms, "
          "received_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO NOTHING"));
      KEEL_RETURN_IF_ERROR(st->Text(r.request_id).Text(r.key_id).Text(r.team).Text(r.model).Int(r.input_tokens)
                               .Int(r.output_tokens).Real(r.cost).Int(at_ms).Int(now_ms).Run());
      st.reset();
      if (sqlite3_changes(impl_->db) == 0) {
        ++out.duplicates;
        continue;
      }
      ++out.accepted;
      if (!impl_->redis) continue;
      SpendCounters::Add add;
      add.request_id = r.request_id;
      add.tokens = r.input_tokens + r.output_tokens;
      add.cost = r.cost;
      for (const char* window : {"daily", "monthly"}) {
        KEEL_ASSIGN_OR_RETURN(Window w, WindowAt(window, at_ms / 1000));
        // A day past the window's end, so a late reader of the closing window still sees it.
        for (const auto& [scope, subject] : {std::pair<const char*, const std::string&>{"key", r.key_id},
                                             std::pair<const char*, const std::string&>{"team", r.team}}) {
          if (subject.empty()) continue;
          add.counters.push_back(impl_->redis->CounterKey(scope, subject, window, w.start_unix));
          add.expire_at.push_back(w.end_unix + 86400);
        }
      }
      adds.push_back(std::move(add));
    }
    if (adds.empty()) return Status::Ok();
    std::vector<bool> counted;
    KEEL_RETURN_IF_ERROR(impl_->redis->AddAll(adds, &counted));
    for (bool c : counted) {
      if (!c) {  // another instance (or an earlier, failed attempt) counted it already
        --out.accepted;
        ++out.duplicates;
      }
    }
    return Status::Ok();
  }));
  return out;
}

Result<SpendReport> PolicyStore::Spend(const std::string& scope, const std::string& subject) {
  if (scope != "key" && scope != "team") return Status::InvalidArgument("scope: must be \"key\" or \"team\"");
  if (!IsValidName(subject)) return Status::InvalidArgument(fmt::format("{}: not a valid name", scope == "key" ? "key_id" : "team"));
  SpendReport r;
  r.scope = scope;
  r.subject = subject;
  std::lock_guard<std::mutex> lock(impl_->mu);
  const int64_t now = impl_->NowMs() / 1000;
  KEEL_ASSIGN_OR_RETURN(Window day, WindowAt("daily", now));
  KEEL_ASSIGN_OR_RETURN(Window month, WindowAt("monthly", now));
  KEEL_ASSIGN_OR_RETURN(auto d, impl_->SpentIn(scope, subject, "daily", day));
  KEEL_ASSIGN_OR_RETURN(auto m, impl_->SpentIn(scope, subject, "monthly", month));
  r.daily_tokens = d.tokens;
  r.daily_cost = d.cost;
  r.daily_end_unix = day.end_unix;
  r.monthly_tokens = m.tokens;
  r.monthly_cost = m.cost;
  r.monthly_end_unix = month.end_unix;
  KEEL_ASSIGN_OR_RETURN(r.budgets, impl_->BudgetsWithSpend("scope = ? AND subject = ?", scope, subject));
  return r;
}

Result<std::vector<AuditEntry>> PolicyStore::Audit(int limit) {
  if (limit < 1 || limit > 1000) return Status::InvalidArgument("limit: must be in 1..1000");
  std::lock_guard<std::mutex> lock(impl_->mu);
  KEEL_ASSIGN_OR_RETURN(auto st, impl_->Prepare("SELECT id, unix_ms, actor, action, target, detail FROM audit "
                                                "ORDER BY id DESC LIMIT ?"));
  st->Int(limit);
  std::vector<AuditEntry> out;
  for (;;) {
    KEEL_ASSIGN_OR_RETURN(bool row, st->Step());
    if (!row) break;
    out.push_back(AuditEntry{st->ColInt(0), st->ColInt(1), st->ColText(2), st->ColText(3), st->ColText(4), st->ColText(5)});
  }
  return out;
}

}  // namespace keel::gateway
