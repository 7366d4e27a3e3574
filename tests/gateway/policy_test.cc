// Governance model and PolicyStore: codecs, globs, prices, keys, budgets and their windows,
// duplicate usage, persistence across reopen, and Redis-kept spend against a real redis-server.
#include "keel/gateway/policy.h"

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cctype>
#include <cstdio>
#include <string>
#include <vector>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>

#include "keel/gateway/policy_store.h"
#include "tests/kvstore/redis_process.h"

namespace keel::gateway {
namespace {

// 2024-03-15 12:00:00 UTC, and the windows around it.
constexpr int64_t kNoon = 1710504000;
constexpr int64_t kDayStart = 1710460800;    // 2024-03-15 00:00
constexpr int64_t kMonthStart = 1709251200;  // 2024-03-01 00:00
constexpr int64_t kMonthEnd = 1711929600;    // 2024-04-01 00:00

// Database files made by this binary, removed at exit.
struct TempFiles {
  std::vector<std::string> paths;
  ~TempFiles() {
    for (const std::string& p : paths) {
      for (const char* suffix : {"", "-wal", "-shm"}) std::remove((p + suffix).c_str());
    }
  }
};

std::string TempDb(const char* tag) {
  static TempFiles files;
  static std::atomic<int> n{0};
  std::string path = "/tmp/keel-policy-" + std::string(tag) + "-" + std::to_string(::getpid()) + "-" +
                     std::to_string(n++) + ".db";
  std::remove(path.c_str());
  std::remove((path + "-wal").c_str());
  std::remove((path + "-shm").c_str());
  files.paths.push_back(path);
  return path;
}

struct Clock {
  std::shared_ptr<std::atomic<int64_t>> ms = std::make_shared<std::atomic<int64_t>>(kNoon * 1000);
  std::function<int64_t()> fn() const {
    auto p = ms;
    return [p] { return p->load(); };
  }
};

std::unique_ptr<PolicyStore> OpenOrDie(PolicyStoreOptions o) {
  auto s = PolicyStore::Open(std::move(o));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

UsageRecord Usage(std::string id, std::string key_id, std::string team, int64_t in, int64_t out, double cost,
                  int64_t unix_ms) {
  return UsageRecord{std::move(id), std::move(key_id), std::move(team), "m", in, out, cost, unix_ms};
}

// ---- codecs and helpers --------------------------------------------------------------------------

TEST(PolicyModelTest, HashAndNewKey) {
  EXPECT_EQ(HashApiKey(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(HashApiKey("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_TRUE(IsKeyHash(HashApiKey("x")));
  EXPECT_FALSE(IsKeyHash("ABC"));
  std::string a = NewApiKey(), b = NewApiKey();
  EXPECT_NE(a, b);
  ASSERT_EQ(a.size(), 8u + 43u);
  EXPECT_EQ(a.rfind("sk-keel-", 0), 0u);
  for (char c : a.substr(8)) EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') << a;
}

TEST(PolicyModelTest, GlobMatch) {
  EXPECT_TRUE(GlobMatch("gpt-4*", "gpt-4o-mini"));
  EXPECT_TRUE(GlobMatch("*", ""));
  EXPECT_TRUE(GlobMatch("", ""));
  EXPECT_FALSE(GlobMatch("", "a"));
  EXPECT_TRUE(GlobMatch("claude-?-*", "claude-3-opus"));
  EXPECT_FALSE(GlobMatch("claude-?-*", "claude-35-opus"));
  EXPECT_TRUE(GlobMatch("*mini", "gpt-4o-mini"));
  EXPECT_FALSE(GlobMatch("*mini", "gpt-4o-minis"));
  EXPECT_TRUE(GlobMatch("a*b*c", "aXbYbZc"));
  EXPECT_FALSE(GlobMatch("GPT*", "gpt-4"));  // case-sensitive
  EXPECT_TRUE(GlobMatch("**a**", "bab"));
  EXPECT_FALSE(GlobMatch(std::string(50, '*') + "b", std::string(5000, 'a')));  // no blow-up
}

TEST(PolicyModelTest, CostOf) {
  std::map<std::string, Price> prices{{"m", {2.5, 10}}};
  EXPECT_DOUBLE_EQ(CostOf(prices, "m", 1000000, 500000), 2.5 + 5);
  EXPECT_DOUBLE_EQ(CostOf(prices, "m", 400, 0), 0.001);
  EXPECT_EQ(CostOf(prices, "other", 1000, 1000), 0);
}

TEST(PolicyModelTest, DecisionRoundTrip) {
  KeyDecision d;
  d.known = true;
  d.key_id = "key_1";
  d.principal = "alice \"quoted\" \xc3\xa9";
  d.team = "ml";
  d.policy.allowed_models = {"gpt-4*", "claude-*"};
  d.policy.max_tokens = 2048;
  d.policy.rewrites = {{"gpt-4", "gpt-4o"}};
  d.policy.deny = {{"gpt-*", "secret", "no secrets"}};
  d.budgets.push_back({"bud_1", "team", "ml", "monthly", 1000, 2.5, 10, 0.25, kMonthEnd});
  d.prices = {{"gpt-4o", {2.5, 10}}};
  d.ttl_ms = 1234;
  auto back = KeyDecisionFromJson(ToJson(d));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(ToJson(*back), ToJson(d));
  EXPECT_EQ(back->policy.deny[0].model_glob, "gpt-*");
  EXPECT_EQ(back->budgets[0].window_end_unix, kMonthEnd);
  EXPECT_EQ(back->principal, d.principal);
}

// The batch is written without a DOM: it must be the JSON value nlohmann would build (same
// members and values, doubles exact), for hostile strings and extreme numbers too.
TEST(PolicyModelTest, UsageBatchIsTheJsonValueADomWouldWrite) {
  std::mt19937_64 rng(7);
  const std::vector<std::string> strings = {"", "plain", "q\"uote\\back", std::string("nul\0byte", 8),
                                            "ctl\x01\x1f\n\t", "utf8 \xc3\xa9\xe2\x82\xac",
                                            "bad \xff\xfe utf8", "\xed\xa0\x80 surrogate"};
  const std::vector<double> costs = {0, 0.5, 1e-7, 123456789.123, 1e20, 5e-324, 0.1 + 0.2,
                                     std::numeric_limits<double>::max()};
  std::vector<UsageRecord> in;
  for (int i = 0; i < 400; ++i) {
    auto pick = [&](const auto& v) { return v[rng() % v.size()]; };
    in.push_back(UsageRecord{pick(strings) + std::to_string(i), pick(strings), pick(strings), pick(strings),
                             static_cast<int64_t>(rng() >> 1) * (i % 3 == 0 ? -1 : 1), static_cast<int64_t>(rng() % 100000),
                             pick(costs), static_cast<int64_t>(rng() >> 20)});
  }
  for (size_t n : {size_t{0}, size_t{1}, in.size()}) {
    const std::vector<UsageRecord> batch(in.begin(), in.begin() + n);
    nlohmann::json arr = nlohmann::json::array();
    for (const UsageRecord& r : batch) {
      arr.push_back({{"request_id", r.request_id}, {"key_id", r.key_id}, {"team", r.team}, {"model", r.model},
                     {"input_tokens", r.input_tokens}, {"output_tokens", r.output_tokens}, {"cost", r.cost},
                     {"unix_ms", r.unix_ms}});
    }
    const std::string dom = nlohmann::json{{"records", arr}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    const std::string ours = UsageBatchToJson(batch);
    EXPECT_EQ(nlohmann::json::parse(ours), nlohmann::json::parse(dom)) << ours.substr(0, 300);
    EXPECT_EQ(ours, dom);  // numbers and escapes written exactly as nlohmann writes them
  }
}

TEST(PolicyModelTest, UsageRoundTrip) {
  std::vector<UsageRecord> in = {Usage("r1", "key_a", "ml", 10, 20, 0.5, 1700000000000),
                                 Usage("r2", "key_b", "", 0, 0, 0, 0)};
  auto out = UsageBatchFromJson(UsageBatchToJson(in));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].request_id, "r1");
  EXPECT_EQ((*out)[0].output_tokens, 20);
  EXPECT_DOUBLE_EQ((*out)[0].cost, 0.5);
  EXPECT_EQ((*out)[0].unix_ms, 1700000000000);
  EXPECT_EQ((*out)[1].team, "");
}

TEST(PolicyModelTest, PolicyRoundTripAndStrictness) {
  auto p = PolicyRulesFromJson(R"({"allowed_models":["a*"],"max_tokens":5,"rewrites":{"x":"y"},
                                   "deny":[{"model":"a?","contains":"bad","message":"no"}]})");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  auto again = PolicyRulesFromJson(ToJson(*p));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(ToJson(*again), ToJson(*p));
  EXPECT_EQ(again->deny[0].contains, "bad");
  auto typo = PolicyRulesFromJson(R"({"allowed_model":["a"]})");
  EXPECT_EQ(typo.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(typo.status().message().find("allowed_model"), std::string::npos);
  auto empty = PolicyRulesFromJson("{}");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->max_tokens, -1);
}

// Each case: input and a field the error must name.
TEST(PolicyModelTest, HostileJsonIsInvalidArgumentNamingTheField) {
  struct Case {
    std::string json, field;
  };
  const std::vector<Case> usage_cases = {
      {"", "malformed"},
      {"{", "malformed"},
      {"[]", "object"},
      {"{\"records\":{}}", "records"},
      {"{}", "records"},
      {R"({"records":[1]})", "records[0]"},
      {R"({"records":[{"key_id":"k","model":"m","input_tokens":1,"output_tokens":1}]})", "records[0].request_id"},
      {R"({"records":[{"request_id":"r","key_id":"k","model":"m","input_tokens":-1,"output_tokens":1}]})",
       "records[0].input_tokens"},
      {R"({"records":[{"request_id":"r","key_id":"k","model":"m","input_tokens":1.5,"output_tokens":1}]})",
       "records[0].input_tokens"},
      {R"({"records":[{"request_id":"r","key_id":"k","model":"m","input_tokens":1,"output_tokens":"2"}]})",
       "records[0].output_tokens"},
      {R"({"records":[{"request_id":"r","key_id":"k","model":"m","input_tokens":1,"output_tokens":1,"cost":-1}]})",
       "records[0].cost"},
      {R"({"records":[{"request_id":"r","key_id":"k","model":"m","input_tokens":18446744073709551615,"output_tokens":1}]})",
       "records[0].input_tokens"},
      {R"({"records":[{"request_id":"r","key_id":"","model":"m","input_tokens":1,"output_tokens":1}]})",
       "records[0].key_id"},
      {std::string(100000, '[') + std::string(100000, ']'), "nested"},
      {"{\"records\":[\"\xff\xfe\"]}", "malformed"},
  };
  for (const Case& c : usage_cases) {
    auto r = UsageBatchFromJson(c.json);
    ASSERT_FALSE(r.ok()) << c.json.substr(0, 80);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status().message();
  }
  const std::vector<Case> decision_cases = {
      {"{}", "known"},
      {R"({"known":"yes"})", "known"},
      {R"({"known":true,"budgets":[{"budget_id":"b","scope":"planet","subject":"s","window":"daily"}]})",
       "budgets[0].scope"},
      {R"({"known":true,"prices":{"m":{"input_per_mtok":1}}})", "prices.m.output_per_mtok"},
      {R"({"known":true,"policy":{"max_tokens":-7}})", "policy.max_tokens"},
      {R"({"known":true,"policy":{"deny":[{"model":3}]}})", "policy.deny[0].model"},
  };
  for (const Case& c : decision_cases) {
    auto r = KeyDecisionFromJson(c.json);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status().message();
  }
  // A newer peer's extra fields are ignored on the wire.
  EXPECT_TRUE(KeyDecisionFromJson(R"({"known":false,"future":1})").ok());
}

TEST(PolicyModelTest, WindowsAreUtcCalendarWindows) {
  auto d = WindowAt("daily", kNoon);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->start_unix, kDayStart);
  EXPECT_EQ(d->end_unix, kDayStart + 86400);
  auto m = WindowAt("monthly", kNoon);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->start_unix, kMonthStart);
  EXPECT_EQ(m->end_unix, kMonthEnd);
  auto dec = WindowAt("monthly", 1703980800 + 5);  // 2023-12-31 00:00:05 -> into 2024-01-01
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(dec->end_unix, 1704067200);
  EXPECT_FALSE(WindowAt("weekly", kNoon).ok());
}

// ---- store ----------------------------------------------------------------------------------------

class PolicyStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = TempDb("store");
    options_.db_path = path_;
    options_.now_ms = clock_.fn();
    options_.decision_ttl_ms = 777;
    store_ = OpenOrDie(options_);
    ASSERT_NE(store_, nullptr);
  }
  PolicyStoreOptions options_;
  Clock clock_;
  std::string path_;
  std::unique_ptr<PolicyStore> store_;
};

TEST_F(PolicyStoreTest, CreateResolveRevoke) {
  auto key = store_->CreateKey("alice", "ml", "test");
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  auto d = store_->Resolve(HashApiKey(key->api_key));
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->known);
  EXPECT_FALSE(d->revoked);
  EXPECT_EQ(d->key_id, key->key_id);
  EXPECT_EQ(d->principal, "alice");
  EXPECT_EQ(d->team, "ml");
  EXPECT_EQ(d->ttl_ms, 777);

  auto unknown = store_->Resolve(HashApiKey("sk-keel-nope"));
  ASSERT_TRUE(unknown.ok());
  EXPECT_FALSE(unknown->known);
  EXPECT_EQ(store_->Resolve("not-a-hash").status().code(), StatusCode::kInvalidArgument);

  ASSERT_TRUE(store_->RevokeKey(key->key_id, "test").ok());
  EXPECT_TRUE(store_->RevokeKey(key->key_id, "test").ok());  // idempotent
  EXPECT_EQ(store_->RevokeKey("key_missing", "test").code(), StatusCode::kNotFound);
  d = store_->Resolve(HashApiKey(key->api_key));
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->known);
  EXPECT_TRUE(d->revoked);

  auto keys = store_->ListKeys();
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 1u);
  EXPECT_EQ((*keys)[0].revoked_unix, kNoon);
  EXPECT_EQ(store_->CreateKey("", "ml", "t").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->CreateKey("bob", "bad team!", "t").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(PolicyStoreTest, BudgetsDailyAndMonthlyFromTheLedger) {
  auto key = store_->CreateKey("alice", "ml", "t");
  ASSERT_TRUE(key.ok());
  auto daily = store_->PutBudget({"key", key->key_id, "daily", 1000, -1}, "t");
  auto monthly = store_->PutBudget({"team", "ml", "monthly", -1, 50.0}, "t");
  ASSERT_TRUE(daily.ok() && monthly.ok());
  (void)store_->PutBudget({"team", "other", "daily", 1, -1}, "t");  // does not apply to this key
  // Same (scope, subject, window): replaced in place, same id.
  auto again = store_->PutBudget({"key", key->key_id, "daily", 2000, -1}, "t");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *daily);
  EXPECT_EQ(store_->PutBudget({"key", key->key_id, "daily", -1, -1}, "t").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->PutBudget({"galaxy", "x", "daily", 1, -1}, "t").status().code(), StatusCode::kInvalidArgument);

  const int64_t now_ms = kNoon * 1000;
  auto r = store_->RecordUsage({
      Usage("today-1", key->key_id, "ml", 100, 50, 1.5, now_ms),
      Usage("today-2", key->key_id, "ml", 10, 0, 0.5, kDayStart * 1000),              // first ms of today
      Usage("yesterday", key->key_id, "ml", 1000, 0, 2.0, kDayStart * 1000 - 1),      // this month only
      Usage("last-month", key->key_id, "ml", 5000, 0, 9.0, kMonthStart * 1000 - 1),   // neither
      Usage("teammate", "key_other", "ml", 7, 0, 0.25, now_ms),                        // team only
      Usage("no-time", key->key_id, "ml", 1, 1, 0, 0),                                 // counted now
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->accepted, 6);
  EXPECT_EQ(r->duplicates, 0);

  auto d = store_->Resolve(HashApiKey(key->api_key));
  ASSERT_TRUE(d.ok());
  ASSERT_EQ(d->budgets.size(), 2u);
  for (const BudgetState& b : d->budgets) {
    if (b.scope == "key") {
      EXPECT_EQ(b.budget_id, *daily);
      EXPECT_EQ(b.limit_tokens, 2000);
      EXPECT_EQ(b.spent_tokens, 150 + 10 + 2);
      EXPECT_DOUBLE_EQ(b.spent_cost, 2.0);
      EXPECT_EQ(b.window_end_unix, kDayStart + 86400);
    } else {
      EXPECT_EQ(b.budget_id, *monthly);
      EXPECT_DOUBLE_EQ(b.limit_cost, 50.0);
      EXPECT_EQ(b.spent_tokens, 150 + 10 + 1000 + 7 + 2);
      EXPECT_DOUBLE_EQ(b.spent_cost, 1.5 + 0.5 + 2.0 + 0.25);
      EXPECT_EQ(b.window_end_unix, kMonthEnd);
    }
  }
  // The next day the daily window is empty; the month still counts.
  clock_.ms->store((kDayStart + 86400 + 60) * 1000);
  auto spend = store_->Spend("key", key->key_id);
  ASSERT_TRUE(spend.ok());
  EXPECT_EQ(spend->daily_tokens, 0);
  EXPECT_EQ(spend->monthly_tokens, 150 + 10 + 1000 + 2);
  ASSERT_EQ(spend->budgets.size(), 1u);
  EXPECT_EQ(spend->budgets[0].spent_tokens, 0);

  ASSERT_TRUE(store_->DeleteBudget(*daily, "t").ok());
  EXPECT_EQ(store_->DeleteBudget(*daily, "t").code(), StatusCode::kNotFound);
}

TEST_F(PolicyStoreTest, DuplicateRequestIdCountedOnce) {
  auto first = store_->RecordUsage({Usage("r1", "key_a", "ml", 10, 10, 1, kNoon * 1000),
                                    Usage("r1", "key_a", "ml", 10, 10, 1, kNoon * 1000)});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->accepted, 1);
  EXPECT_EQ(first->duplicates, 1);
  auto resent = store_->RecordUsage({Usage("r1", "key_a", "ml", 10, 10, 1, kNoon * 1000),
                                     Usage("r2", "key_a", "ml", 1, 0, 0, kNoon * 1000)});
  ASSERT_TRUE(resent.ok());
  EXPECT_EQ(resent->accepted, 1);
  EXPECT_EQ(resent->duplicates, 1);
  auto spend = store_->Spend("key", "key_a");
  ASSERT_TRUE(spend.ok());
  EXPECT_EQ(spend->daily_tokens, 21);
  EXPECT_DOUBLE_EQ(spend->daily_cost, 1);
}

TEST_F(PolicyStoreTest, PoliciesPricesAndAudit) {
  PolicyRules rules;
  rules.allowed_models = {"gpt-*"};
  rules.max_tokens = 100;
  rules.rewrites = {{"gpt-4", "gpt-4o"}};
  rules.deny = {{"", "password", "no"}};
  ASSERT_TRUE(store_->PutPolicy("ml", rules, "ops").ok());
  auto back = store_->GetPolicy("ml");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(ToJson(*back), ToJson(rules));
  auto none = store_->GetPolicy("nobody");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->allowed_models.empty());

  ASSERT_TRUE(store_->PutPrice("gpt-4o", {2.5, 10}, "ops").ok());
  ASSERT_TRUE(store_->PutPrice("gpt-4o", {3, 12}, "ops").ok());
  EXPECT_EQ(store_->PutPrice("gpt-4o", {-1, 12}, "ops").code(), StatusCode::kInvalidArgument);
  auto key = store_->CreateKey("alice", "ml", "ops");
  ASSERT_TRUE(key.ok());
  auto d = store_->Resolve(HashApiKey(key->api_key));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->policy.max_tokens, 100);
  EXPECT_EQ(d->policy.rewrites.at("gpt-4"), "gpt-4o");
  ASSERT_EQ(d->prices.count("gpt-4o"), 1u);
  EXPECT_DOUBLE_EQ(CostOf(d->prices, "gpt-4o", 1000000, 1000000), 15);

  auto audit = store_->Audit(10);
  ASSERT_TRUE(audit.ok());
  ASSERT_EQ(audit->size(), 4u);
  EXPECT_EQ((*audit)[0].action, "key.create");
  EXPECT_EQ((*audit)[0].target, key->key_id);
  EXPECT_EQ((*audit)[3].action, "policy.put");
  EXPECT_EQ((*audit)[3].actor, "ops");
  for (const AuditEntry& e : *audit) {
    EXPECT_EQ(e.detail.find(key->api_key), std::string::npos);
    EXPECT_EQ(e.detail.find(HashApiKey(key->api_key)), std::string::npos);
  }
}

TEST_F(PolicyStoreTest, ReopenKeepsKeysAndSpend) {
  auto key = store_->CreateKey("alice", "ml", "t");
  ASSERT_TRUE(key.ok());
  ASSERT_TRUE(store_->PutBudget({"key", key->key_id, "daily", 100, -1}, "t").ok());
  ASSERT_TRUE(store_->RecordUsage({Usage("r1", key->key_id, "ml", 30, 12, 0.5, kNoon * 1000)}).ok());
  store_.reset();
  store_ = OpenOrDie(options_);
  ASSERT_NE(store_, nullptr);
  auto d = store_->Resolve(HashApiKey(key->api_key));
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->known);
  ASSERT_EQ(d->budgets.size(), 1u);
  EXPECT_EQ(d->budgets[0].spent_tokens, 42);
  auto dup = store_->RecordUsage({Usage("r1", key->key_id, "ml", 30, 12, 0.5, kNoon * 1000)});
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(dup->duplicates, 1);
}

TEST(PolicyStoreOpenTest, RefusesForeignOrNewerDatabases) {
  const std::string garbage = TempDb("garbage");
  { FILE* f = std::fopen(garbage.c_str(), "wb"); std::fputs("this is not a database, just some bytes........", f); std::fclose(f); }
  PolicyStoreOptions o;
  o.db_path = garbage;
  auto s = PolicyStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find(garbage), std::string::npos) << s.status().ToString();

  const std::string newer = TempDb("newer");
  o.db_path = newer;
  ASSERT_TRUE(PolicyStore::Open(o).ok());
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(newer.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, "PRAGMA user_version = 99", nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(db);
  }
  s = PolicyStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kCorruption);
  EXPECT_NE(s.status().message().find("99"), std::string::npos);
}

int ModeOf(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int>(st.st_mode & 0777) : -1;
}

// The store holds key hashes, spend and the audit log: other local users must not read it, even
// under the common umask 022 (which would give SQLite's default 0644).
TEST(PolicyStoreOpenTest, NewDatabaseAndItsWalAndShmAreOwnerOnly) {
  const std::string path = TempDb("mode");
  const mode_t old_umask = ::umask(022);
  PolicyStoreOptions o;
  o.db_path = path;
  auto store = OpenOrDie(o);
  ::umask(old_umask);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->CreateKey("alice", "ml", "test").ok());  // a write: the WAL and SHM exist now
  EXPECT_EQ(ModeOf(path), 0600);
  EXPECT_EQ(ModeOf(path + "-wal"), 0600);
  EXPECT_EQ(ModeOf(path + "-shm"), 0600);
}

TEST(PolicyStoreOpenTest, ExistingWorldReadableDatabaseIsNarrowedTo0600) {
  const std::string path = TempDb("widemode");
  PolicyStoreOptions o;
  o.db_path = path;
  {
    auto store = OpenOrDie(o);
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->CreateKey("alice", "ml", "test").ok());
  }
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  const mode_t old_umask = ::umask(022);
  auto store = OpenOrDie(o);
  ::umask(old_umask);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->CreateKey("bob", "ml", "test").ok());
  EXPECT_EQ(ModeOf(path), 0600);
  EXPECT_EQ(ModeOf(path + "-wal"), 0600);
  EXPECT_EQ(ModeOf(path + "-shm"), 0600);
}

// ---- Redis-kept spend -----------------------------------------------------------------------------

keel::test::RedisProcess& SharedRedis() {
  static keel::test::RedisProcess redis;
  return redis;
}

class PolicyRedisTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(SharedRedis().ok()) << "no redis-server: install redis-server (scripts/setup) or set KEEL_REDIS_URL";
    prefix_ = keel::test::UniquePrefix("gwpolicy");
    url_ = SharedRedis().host() + ":" + std::to_string(SharedRedis().port());
    // Real time: counters expire (EXPIREAT) a day after their window, by Redis' clock.
    now_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(
                  std::chrono::system_clock::now().time_since_epoch()).count();
    clock_.ms->store(now_ms_);
  }
  PolicyStoreOptions Options(const char* tag) {
    PolicyStoreOptions o;
    o.db_path = TempDb(tag);
    o.redis_url = url_;
    o.redis_prefix = prefix_;
    o.now_ms = clock_.fn();
    return o;
  }
  Clock clock_;
  int64_t now_ms_ = 0;
  std::string prefix_, url_;
};

TEST_F(PolicyRedisTest, TwoStoresShareSpend) {
  auto a = OpenOrDie(Options("redis-a"));
  auto b = OpenOrDie(Options("redis-b"));
  ASSERT_TRUE(a && b);
  EXPECT_TRUE(a->uses_redis());
  auto key_b = b->CreateKey("bob", "ml", "t");
  ASSERT_TRUE(key_b.ok());
  ASSERT_TRUE(b->PutBudget({"team", "ml", "daily", 1000, -1}, "t").ok());

  auto r = a->RecordUsage({Usage("x1", "key_a", "ml", 100, 20, 0.75, now_ms_),
                           Usage("x2", "key_a", "ml", 5, 0, 0.25, now_ms_)});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->accepted, 2);
  // b's own ledger has nothing, yet it sees a's spend through Redis.
  auto d = b->Resolve(HashApiKey(key_b->api_key));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_EQ(d->budgets.size(), 1u);
  EXPECT_EQ(d->budgets[0].spent_tokens, 125);
  EXPECT_DOUBLE_EQ(d->budgets[0].spent_cost, 1.0);

  // The same request id reported to the other instance is a duplicate.
  auto dup = b->RecordUsage({Usage("x1", "key_a", "ml", 100, 20, 0.75, now_ms_),
                             Usage("x3", key_b->key_id, "ml", 1, 1, 0, now_ms_)});
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(dup->accepted, 1);
  EXPECT_EQ(dup->duplicates, 1);
  auto spend = a->Spend("team", "ml");
  ASSERT_TRUE(spend.ok());
  EXPECT_EQ(spend->daily_tokens, 127);
  EXPECT_EQ(spend->monthly_tokens, 127);

  // Counters are real Redis hashes with an expiry past the window's end.
  redisContext* c = redisConnect(SharedRedis().host().c_str(), SharedRedis().port());
  ASSERT_TRUE(c != nullptr && c->err == 0);
  auto day = WindowAt("daily", now_ms_ / 1000);
  ASSERT_TRUE(day.ok());
  const std::string k = prefix_ + "spend:team:ml:d:" + std::to_string(day->start_unix);
  auto* tokens = static_cast<redisReply*>(redisCommand(c, "HGET %s tokens", k.c_str()));
  ASSERT_NE(tokens, nullptr);
  EXPECT_EQ(std::string(tokens->str ? tokens->str : ""), "127");
  freeReplyObject(tokens);
  auto* ttl = static_cast<redisReply*>(redisCommand(c, "EXPIRETIME %s", k.c_str()));
  if (ttl != nullptr && ttl->type == REDIS_REPLY_INTEGER) {
    EXPECT_EQ(ttl->integer, day->end_unix + 86400);
  }
  if (ttl != nullptr) freeReplyObject(ttl);
  // Clean up (a shared server outlives the test).
  auto* keys = static_cast<redisReply*>(redisCommand(c, "KEYS %s*", prefix_.c_str()));
  for (size_t i = 0; keys != nullptr && i < keys->elements; ++i) {
    freeReplyObject(redisCommand(c, "DEL %b", keys->element[i]->str, keys->element[i]->len));
  }
  if (keys != nullptr) freeReplyObject(keys);
  redisFree(c);
}

TEST_F(PolicyRedisTest, RedisGoneFailsTheBatchAndCountsNothing) {
  keel::test::RedisProcess own("", /*force_private=*/true);
  ASSERT_TRUE(own.ok());
  PolicyStoreOptions o = Options("redis-gone");
  o.redis_url = "127.0.0.1:" + std::to_string(own.port());
  o.redis_timeout_ms = 300;
  auto store = OpenOrDie(o);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->RecordUsage({Usage("g1", "key_a", "ml", 5, 5, 0, now_ms_)}).ok());
  own.Stop();
  auto r = store->RecordUsage({Usage("g2", "key_a", "ml", 7, 0, 0, now_ms_)});
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_EQ(store->Spend("team", "ml").status().code(), StatusCode::kUnavailable);
  store.reset();
  // The failed batch left no ledger row, so sending it again later counts it.
  PolicyStoreOptions ledger_only = o;
  ledger_only.redis_url.clear();
  auto reopened = OpenOrDie(ledger_only);
  ASSERT_NE(reopened, nullptr);
  auto spend = reopened->Spend("team", "ml");
  ASSERT_TRUE(spend.ok());
  EXPECT_EQ(spend->daily_tokens, 10);
}

TEST_F(PolicyRedisTest, UnreachableRedisIsUnavailable) {
  PolicyStoreOptions o = Options("redis-down");
  o.redis_url = "127.0.0.1:" + std::to_string(keel::test::FreeLoopbackPort());
  o.redis_timeout_ms = 200;
  auto s = PolicyStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  o.redis_url = "redis://host:notaport";
  EXPECT_EQ(PolicyStore::Open(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace keel::gateway
