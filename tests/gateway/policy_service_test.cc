// PolicyService over a real Unix socket: admin auth, the full admin flow, resolve and usage,
// error answers (400/401/404/413), socket permissions, metrics, logs free of secrets, restart.
#include "keel/gateway/policy_service.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <spdlog/sinks/base_sink.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "keel/core/log.h"

namespace keel::gateway {
namespace {

using json = nlohmann::json;

const std::string kAdminKey = "test-admin-key-0123456789";

struct Response {
  int status = 0;
  std::string head;
  json body;
  std::string raw_body;
};

// One request per connection (Connection: close), read to EOF; every wait bounded.
Response Call(const std::string& socket_path, const std::string& method, const std::string& target,
              const std::string& body = "", const std::string& auth = "", const std::string& extra_headers = "") {
  Response out;
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, socket_path.c_str(), sizeof(a.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return out;
  }
  std::string req = method + " " + target + " HTTP/1.1\r\nHost: policy\r\nConnection: close\r\n";
  if (!auth.empty()) req += "Authorization: Bearer " + auth + "\r\n";
  req += extra_headers;
  req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  size_t sent = 0;
  while (sent < req.size()) {
    ssize_t n = ::send(fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may answer (413) and close before reading everything
    sent += static_cast<size_t>(n);
  }
  std::string resp;
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20000) <= 0) break;
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  size_t end = resp.find("\r\n\r\n");
  if (resp.size() < 12 || end == std::string::npos) return out;
  out.status = std::atoi(resp.substr(9, 3).c_str());
  out.head = resp.substr(0, end);
  out.raw_body = resp.substr(end + 4);
  out.body = json::parse(out.raw_body, nullptr, false);
  return out;
}

std::string ErrorMessage(const Response& r) {
  if (!r.body.is_object() || !r.body.contains("error")) return "";
  return r.body["error"].value("message", "");
}

// Collects log lines; Contents() reads them under the sink's own mutex, since the service's worker
// threads may still be logging (a handler logs after its response is sent).
class CaptureSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::string Contents() {
    std::lock_guard<std::mutex> lock(mutex_);
    return out_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    out_.append(formatted.data(), formatted.size());
  }
  void flush_() override {}

 private:
  std::string out_;
};

class PolicyServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> n{0};
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(n++);
    socket_ = "/tmp/keel-policy-svc-" + tag + ".sock";
    db_ = "/tmp/keel-policy-svc-" + tag + ".db";
    std::remove(db_.c_str());
    log_sink_ = std::make_shared<CaptureSink>();
    Log().sinks().push_back(log_sink_);
    StartService();
  }
  void TearDown() override {
    service_.reset();
    auto& sinks = Log().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), log_sink_), sinks.end());
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((db_ + suffix).c_str());
  }
  void StartService() {
    PolicyServiceOptions o;
    o.socket_path = socket_;
    o.admin_key = kAdminKey;
    o.store.db_path = db_;
    o.max_body_bytes = max_body_bytes_;
    auto s = PolicyService::Start(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    service_ = std::move(s).value();
  }
  Response Admin(const std::string& method, const std::string& target, const json& body = nullptr) {
    return Call(socket_, method, target, body.is_null() ? "" : body.dump(), kAdminKey, "X-Keel-Actor: ops-alice\r\n");
  }

  std::string socket_, db_;
  size_t max_body_bytes_ = 64 << 10;
  std::shared_ptr<CaptureSink> log_sink_;
  std::unique_ptr<PolicyService> service_;
};

TEST_F(PolicyServiceTest, SocketIsOwnerOnlyAndHealthy) {
  struct stat st{};
  ASSERT_EQ(::lstat(socket_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  Response h = Call(socket_, "GET", "/healthz");
  EXPECT_EQ(h.status, 200);
  EXPECT_EQ(h.body["status"], "ok");
  service_->Stop();
  EXPECT_NE(::access(socket_.c_str(), F_OK), 0) << "Stop removes the socket file";
}

TEST_F(PolicyServiceTest, AdminNeedsTheAdminKey) {
  for (const auto& [method, target] : std::vector<std::pair<std::string, std::string>>{
           {"GET", "/admin/keys"}, {"POST", "/admin/keys"}, {"GET", "/admin/audit"}, {"PUT", "/admin/prices"}}) {
    Response none = Call(socket_, method, target, R"({"principal":"x","team":"t"})");
    EXPECT_EQ(none.status, 401) << method << " " << target;
    EXPECT_NE(ErrorMessage(none).find("admin key"), std::string::npos);
    Response wrong = Call(socket_, method, target, R"({"principal":"x","team":"t"})", kAdminKey + "x");
    EXPECT_EQ(wrong.status, 401);
    Response basic = Call(socket_, method, target, "", "", "Authorization: Basic " + kAdminKey + "\r\n");
    EXPECT_EQ(basic.status, 401);
  }
  EXPECT_EQ(Admin("GET", "/admin/keys").status, 200);
  // Nothing was created by the refused calls.
  EXPECT_TRUE(Admin("GET", "/admin/keys").body["keys"].empty());
}

TEST_F(PolicyServiceTest, FullAdminFlow) {
  Response created = Admin("POST", "/admin/keys", {{"principal", "alice@example.com"}, {"team", "ml"}});
  ASSERT_EQ(created.status, 200) << created.raw_body;
  const std::string key_id = created.body["key_id"], api_key = created.body["api_key"];
  const std::string hash = HashApiKey(api_key);
  ASSERT_EQ(api_key.rfind("sk-keel-", 0), 0u);

  Response budget = Admin("PUT", "/admin/budgets",
                          {{"scope", "team"}, {"subject", "ml"}, {"window", "monthly"}, {"limit_cost", 100.0}});
  ASSERT_EQ(budget.status, 200) << budget.raw_body;
  const std::string budget_id = budget.body["budget_id"];
  ASSERT_EQ(Admin("PUT", "/admin/budgets", {{"scope", "key"}, {"subject", key_id}, {"window", "daily"},
                                            {"limit_tokens", 5000}}).status, 200);
  Response policy = Admin("PUT", "/admin/policies", {{"team", "ml"}, {"allowed_models", {"gpt-4*"}}, {"max_tokens", 512},
                                                     {"rewrites", {{"gpt-4", "gpt-4o"}}},
                                                     {"deny", {{{"contains", "password"}, {"message", "no secrets"}}}}});
  ASSERT_EQ(policy.status, 200) << policy.raw_body;
  ASSERT_EQ(Admin("PUT", "/admin/prices", {{"model", "gpt-4o"}, {"input_per_mtok", 2.5}, {"output_per_mtok", 10}}).status,
            200);

  Response resolved = Call(socket_, "POST", "/v1/resolve", json{{"key_hash", hash}}.dump());
  ASSERT_EQ(resolved.status, 200) << resolved.raw_body;
  auto d = KeyDecisionFromJson(resolved.raw_body);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->known);
  EXPECT_FALSE(d->revoked);
  EXPECT_EQ(d->key_id, key_id);
  EXPECT_EQ(d->team, "ml");
  EXPECT_EQ(d->policy.max_tokens, 512);
  EXPECT_EQ(d->policy.deny.at(0).message, "no secrets");
  EXPECT_EQ(d->budgets.size(), 2u);
  EXPECT_EQ(d->ttl_ms, 5000);
  ASSERT_EQ(d->prices.count("gpt-4o"), 1u);

  const double cost = CostOf(d->prices, "gpt-4o", 1000, 500);
  std::vector<UsageRecord> batch = {{"req-1", key_id, "ml", "gpt-4o", 1000, 500, cost, 0},
                                    {"req-2", key_id, "ml", "gpt-4o", 10, 5, 0.001, 0}};
  Response usage = Call(socket_, "POST", "/v1/usage", UsageBatchToJson(batch));
  ASSERT_EQ(usage.status, 200) << usage.raw_body;
  EXPECT_EQ(usage.body["accepted"], 2);
  Response again = Call(socket_, "POST", "/v1/usage", UsageBatchToJson(batch));
  EXPECT_EQ(again.body["accepted"], 0);
  EXPECT_EQ(again.body["duplicates"], 2);

  Response spend = Admin("GET", "/admin/spend?team=ml");
  ASSERT_EQ(spend.status, 200) << spend.raw_body;
  EXPECT_EQ(spend.body["daily"]["tokens"], 1515);
  EXPECT_DOUBLE_EQ(spend.body["monthly"]["cost"].get<double>(), cost + 0.001);
  ASSERT_EQ(spend.body["budgets"].size(), 1u);
  EXPECT_EQ(spend.body["budgets"][0]["budget_id"], budget_id);
  Response by_key = Admin("GET", "/admin/spend?key_id=" + key_id);
  ASSERT_EQ(by_key.status, 200);
  EXPECT_EQ(by_key.body["budgets"][0]["spent_tokens"], 1515);
  EXPECT_EQ(Admin("GET", "/admin/spend").status, 400);
  EXPECT_EQ(Admin("GET", "/admin/spend?team=ml&key_id=x").status, 400);

  ASSERT_EQ(Admin("POST", "/admin/keys/revoke", {{"key_id", key_id}}).status, 200);
  EXPECT_EQ(Admin("POST", "/admin/keys/revoke", {{"key_id", "key_nope"}}).status, 404);
  auto revoked = KeyDecisionFromJson(Call(socket_, "POST", "/v1/resolve", json{{"key_hash", hash}}.dump()).raw_body);
  ASSERT_TRUE(revoked.ok());
  EXPECT_TRUE(revoked->revoked);
  Response keys = Admin("GET", "/admin/keys");
  ASSERT_EQ(keys.body["keys"].size(), 1u);
  EXPECT_EQ(keys.body["keys"][0]["revoked"], true);
  ASSERT_EQ(Admin("DELETE", "/admin/budgets", {{"budget_id", budget_id}}).status, 200);
  EXPECT_EQ(Admin("DELETE", "/admin/budgets", {{"budget_id", budget_id}}).status, 404);

  Response audit = Admin("GET", "/admin/audit?limit=50");
  ASSERT_EQ(audit.status, 200);
  std::vector<std::string> actions;
  for (const json& e : audit.body["entries"]) {
    actions.push_back(e["action"]);
    EXPECT_EQ(e["actor"].get<std::string>().rfind("ops-alice via unix:pid=", 0), 0u) << e.dump();
    EXPECT_GT(e["unix_ms"].get<int64_t>(), 0);
  }
  const std::vector<std::string> expected = {"budget.delete", "key.revoke", "price.put", "policy.put",
                                             "budget.put", "budget.put", "key.create"};
  EXPECT_EQ(actions, expected);
  EXPECT_EQ(audit.raw_body.find(api_key), std::string::npos);
  EXPECT_EQ(audit.raw_body.find(hash), std::string::npos);
  EXPECT_EQ(Admin("GET", "/admin/audit?limit=0").status, 400);
  EXPECT_EQ(Admin("GET", "/admin/audit?limit=1").body["entries"].size(), 1u);

  // Neither the key nor its hash (nor the admin key) ever reaches the log.
  const std::string logs = log_sink_->Contents();
  EXPECT_NE(logs.find("key.create"), std::string::npos) << "admin actions are logged";
  EXPECT_EQ(logs.find(api_key), std::string::npos);
  EXPECT_EQ(logs.find(hash), std::string::npos);
  EXPECT_EQ(logs.find(kAdminKey), std::string::npos);

  Response metrics = Call(socket_, "GET", "/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.raw_body.find("keel_gateway_policy_resolves_total{result=\"known\"} 1"), std::string::npos);
  EXPECT_NE(metrics.raw_body.find("keel_gateway_policy_usage_records_total{outcome=\"accepted\"} 2"), std::string::npos);
  EXPECT_NE(metrics.raw_body.find("keel_gateway_policy_usage_records_total{outcome=\"duplicate\"} 2"), std::string::npos);
  EXPECT_NE(metrics.raw_body.find("keel_gateway_policy_admin_calls_total{action=\"key.create\"} 1"), std::string::npos);
  EXPECT_NE(metrics.raw_body.find("keel_gateway_policy_errors_total{kind=\"not_found\"} 2"), std::string::npos);
}

TEST_F(PolicyServiceTest, BadRequestsNameTheProblem) {
  Response r = Call(socket_, "POST", "/v1/resolve", "{not json");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(ErrorMessage(r).find("malformed JSON"), std::string::npos) << r.raw_body;
  r = Call(socket_, "POST", "/v1/resolve", R"({"key_hash": 7})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(ErrorMessage(r).find("key_hash"), std::string::npos);
  r = Call(socket_, "POST", "/v1/resolve", R"({"key_hash": "sk-keel-plaintext"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.raw_body.find("sk-keel-plaintext"), std::string::npos) << "errors do not echo what might be a key";
  r = Call(socket_, "POST", "/v1/resolve", json{{"key_hash", HashApiKey("unknown")}}.dump());
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body["known"], false);
  r = Call(socket_, "POST", "/v1/usage", R"({"records":[{"request_id":"a","key_id":"k","model":"m","input_tokens":"1"}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(ErrorMessage(r).find("records[0].input_tokens"), std::string::npos) << r.raw_body;
  r = Admin("POST", "/admin/keys", {{"principal", "x"}, {"team", "ml"}, {"admin", true}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(ErrorMessage(r).find("admin: unknown field"), std::string::npos);
  r = Admin("PUT", "/admin/budgets", {{"scope", "team"}, {"subject", "ml"}, {"window", "hourly"}, {"limit_tokens", 1}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(ErrorMessage(r).find("window"), std::string::npos);
  r = Admin("PUT", "/admin/policies", {{"team", "ml"}, {"max_tokens", "lots"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(ErrorMessage(r).find("max_tokens"), std::string::npos);
  r = Admin("PUT", "/admin/prices", {{"model", "m"}, {"input_per_mtok", 1}});
  EXPECT_EQ(r.status, 400);
  r = Call(socket_, "POST", "/v1/resolve", std::string(10000, '[') + std::string(10000, ']'));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(Call(socket_, "GET", "/v1/resolve").status, 405);
  EXPECT_EQ(Call(socket_, "GET", "/nope").status, 404);
}

TEST_F(PolicyServiceTest, OversizedBodyIs413) {
  std::string big = R"({"records":[)" + std::string(200 << 10, ' ') + "]}";
  Response r = Call(socket_, "POST", "/v1/usage", big);
  EXPECT_EQ(r.status, 413) << r.head;
  EXPECT_EQ(Call(socket_, "GET", "/healthz").status, 200) << "the server survives";
}

// Every JSON endpoint, wire and admin, at the production body limit: a depth bomb and a flat
// array past kMaxJsonValues are 400s naming the limit, refused before parsing; the service goes on.
TEST_F(PolicyServiceTest, JsonBombsAre400OnEveryEndpoint) {
  service_.reset();
  max_body_bytes_ = PolicyServiceOptions{}.max_body_bytes;
  StartService();
  const std::string depth_bomb(max_body_bytes_ - 1024, '[');
  std::string flat = R"({"records":[)";
  for (size_t i = 0; i < kMaxJsonValues; ++i) flat += "1,";
  flat += "1]}";
  ASSERT_LT(flat.size(), max_body_bytes_);
  const std::pair<const char*, const char*> endpoints[] = {
      {"POST", "/v1/resolve"},     {"POST", "/v1/usage"},       {"POST", "/admin/keys"},
      {"POST", "/admin/keys/revoke"}, {"PUT", "/admin/budgets"}, {"DELETE", "/admin/budgets"},
      {"PUT", "/admin/policies"},  {"PUT", "/admin/prices"}};
  for (const auto& [method, path] : endpoints) {
    Response r = Call(socket_, method, path, depth_bomb, kAdminKey);
    EXPECT_EQ(r.status, 400) << method << " " << path << " -> " << r.raw_body;
    EXPECT_NE(ErrorMessage(r).find(": JSON nested deeper than 32 (byte 32)"), std::string::npos)
        << method << " " << path << " -> " << r.raw_body;
    r = Call(socket_, method, path, flat, kAdminKey);
    EXPECT_EQ(r.status, 400) << method << " " << path << " -> " << r.raw_body;
    EXPECT_NE(ErrorMessage(r).find("more than 262144 values"), std::string::npos) << method << " " << path << " -> "
                                                                                 << r.raw_body;
    EXPECT_EQ(Call(socket_, "GET", "/healthz").status, 200) << "after " << method << " " << path;
  }
  EXPECT_EQ(Admin("POST", "/admin/keys", {{"principal", "carol"}, {"team", "web"}}).status, 200);
}

TEST_F(PolicyServiceTest, RestartKeepsKeysAndSpend) {
  Response created = Admin("POST", "/admin/keys", {{"principal", "bob"}, {"team", "web"}});
  ASSERT_EQ(created.status, 200);
  const std::string key_id = created.body["key_id"], api_key = created.body["api_key"];
  ASSERT_EQ(Call(socket_, "POST", "/v1/usage",
                 UsageBatchToJson({{"r1", key_id, "web", "m", 40, 2, 0.5, 0}})).status, 200);
  service_.reset();
  StartService();
  auto d = KeyDecisionFromJson(Call(socket_, "POST", "/v1/resolve", json{{"key_hash", HashApiKey(api_key)}}.dump()).raw_body);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->known);
  EXPECT_EQ(d->key_id, key_id);
  Response spend = Admin("GET", "/admin/spend?key_id=" + key_id);
  EXPECT_EQ(spend.body["daily"]["tokens"], 42);
}

TEST(PolicyServiceStartTest, AdminKeyRequiredAndLoaded) {
  PolicyServiceOptions o;
  o.socket_path = "/tmp/keel-policy-nokey-" + std::to_string(::getpid()) + ".sock";
  o.store.db_path = ":memory:";
  o.admin_key = "short";
  EXPECT_EQ(PolicyService::Start(o).status().code(), StatusCode::kInvalidArgument);

  const std::string file = "/tmp/keel-policy-adminkey-" + std::to_string(::getpid());
  { std::ofstream(file) << "  file-admin-key-0123456789\n"; }
  auto k = LoadAdminKey(file);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, "file-admin-key-0123456789");
  std::remove(file.c_str());
  EXPECT_EQ(LoadAdminKey(file).status().code(), StatusCode::kNotFound);
  // A device is refused, not read (it used to start with a key of megabytes of NUL bytes).
  EXPECT_EQ(LoadAdminKey("/dev/zero").status().code(), StatusCode::kInvalidArgument);
  ::setenv("KEEL_GATEWAY_ADMIN_KEY", "env-admin-key-0123456789", 1);
  k = LoadAdminKey("");
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, "env-admin-key-0123456789");
  ::unsetenv("KEEL_GATEWAY_ADMIN_KEY");
  EXPECT_EQ(LoadAdminKey("").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace keel::gateway
