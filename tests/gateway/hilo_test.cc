// The gateway under HiLO (docs/gateway.md "HiLO"): a real gateway on loopback, in process, with the
// policy service on a Unix socket and an OpenAI-format fake vendor that records what it was sent.
// The product state comes from a catalog file (pinned) or from a real controller server; each test
// asserts what the upstream received (its model, its max_completion_tokens) and what the client
// saw (the x-keel-hilo-* headers).
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "keel/gateway/fake_vendor.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/policy_service.h"
#include "keel/hilo/report.h"
#include "keel/hilo/server.h"
#include "keel/hilo/service_link.h"
#include "tests/core/http_test_client.h"
#include "tests/hilo/test_catalog.h"

namespace keel::gateway {
namespace {

using nlohmann::json;

// The test catalog (tests/hilo/test_catalog.h: full, small_model, fewer_docs, no_rerank, bare;
// tiers large/small) with clamps the fake's 16-word answers show: 200 in every state but bare's 5.
hilo::Catalog GatewayCatalog() {
  hilo::Catalog c = hilo::testing::TestCatalog();
  for (hilo::State& s : c.states) s.gateway.max_tokens_clamp = s.name == "bare" ? 5 : 200;
  return c;
}

bool WaitFor(const std::function<bool()>& ready, int ms = 10000) {
  for (int i = 0; i < ms / 20; ++i) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ready();
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "keel-gw-hilo-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct Reply {
  int status = 0;
  std::string state_header, tier_header;
  json body;
};

class GatewayHilo : public ::testing::Test {
 protected:
  void SetUp() override {
    catalog_path_ = dir_.file("catalog.json");
    std::ofstream(catalog_path_) << hilo::WriteCatalog(GatewayCatalog());

    PolicyServiceOptions po;
    po.socket_path = dir_.file("policy.sock");
    po.admin_key = "test-admin-key-0123456789";
    po.store.db_path = dir_.file("policy.db");
    auto policy = PolicyService::Start(po);
    ASSERT_TRUE(policy.ok()) << policy.status().ToString();
    policy_ = std::move(policy).value();
    auto key = policy_->store().CreateKey("alice", "product", "test");
    ASSERT_TRUE(key.ok()) << key.status().ToString();
    api_key_ = key->api_key;

    auto vendor = FakeVendor::Start(FakeVendorOptions{});
    ASSERT_TRUE(vendor.ok()) << vendor.status().ToString();
    vendor_ = std::move(vendor).value();
  }
  void TearDown() override {
    gateway_.reset();
    vendor_.reset();
    policy_.reset();
  }

  // The gateway config: "answer" tiered to answer-large / answer-small, "plain" untiered, with
  // `hilo` as the config's hilo member.
  std::string Config(const json& hilo) const {
    json c = {
        {"listen", {{"port", 0}}},
        {"policy", {{"socket", dir_.file("policy.sock")}, {"usage_flush_s", 0.05}}},
        {"upstreams", json::array({{{"name", "fake"}, {"format", "openai"}, {"base_url", vendor_->url()}, {"api_key", "sk-fake-upstream"}}})},
        {"models", json::array({
                       {{"name", "answer-large"}, {"targets", json::array({{{"upstream", "fake"}, {"model", "big-model"}}})}},
                       {{"name", "answer-small"}, {"targets", json::array({{{"upstream", "fake"}, {"model", "tiny-model"}}})}},
                       {{"name", "plain"}, {"targets", json::array({{{"upstream", "fake"}, {"model", "plain-model"}}})}},
                   })},
    };
    if (!hilo.is_null()) c["hilo"] = hilo;
    return c.dump();
  }
  json Pinned(const std::string& state) const {
    return {{"catalog", catalog_path_},
            {"state", state},
            {"instance", "gw-test"},
            {"tiers", {{"answer", {{"large", "answer-large"}, {"small", "answer-small"}}}}}};
  }
  void StartGateway(const json& hilo) {
    auto config = ParseGatewayConfig(Config(hilo));
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    auto gw = Gateway::Start(std::move(config).value());
    ASSERT_TRUE(gw.ok()) << gw.status().ToString();
    gateway_ = std::move(gw).value();
  }
  // What Gateway::Start says about `hilo` ("" when it starts).
  std::string StartError(const json& hilo) {
    auto config = ParseGatewayConfig(Config(hilo));
    if (!config.ok()) return config.status().message();
    auto gw = Gateway::Start(std::move(config).value());
    return gw.ok() ? "" : gw.status().message();
  }

  Reply Send(const std::string& path, const json& body, const std::string& key,
             std::vector<std::pair<std::string, std::string>> extra = {}) {
    test::HttpTestClient c(gateway_->port(), 30);
    extra.emplace_back("Authorization", "Bearer " + key);
    EXPECT_TRUE(c.SendRaw(test::HttpTestClient::BuildRequest("POST", path, body.dump(), "application/json", extra)));
    test::HttpTestResponse r;
    EXPECT_TRUE(c.ReadResponse(&r));
    Reply out;
    out.status = r.status;
    out.state_header = r.Header("x-keel-hilo-state");
    out.tier_header = r.Header("x-keel-hilo-tier");
    out.body = json::parse(r.body, nullptr, false);
    return out;
  }
  Reply Chat(const std::string& model, std::optional<int> max_tokens = std::nullopt, const std::string& key = "") {
    json body = {{"model", model}, {"messages", json::array({{{"role", "user"}, {"content", "say hello"}}})}};
    if (max_tokens) body["max_tokens"] = *max_tokens;
    return Send("/v1/chat/completions", body, key.empty() ? api_key_ : key);
  }
  // The body the fake vendor last received.
  json Upstream() {
    test::HttpTestClient c(vendor_->port(), 10);
    test::HttpTestResponse r = c.Request("GET", "/_fake/last_request");
    EXPECT_EQ(r.status, 200) << r.body;
    json j = json::parse(r.body, nullptr, false);
    return j.is_object() && j["body"].is_string() ? json::parse(j["body"].get<std::string>(), nullptr, false) : json();
  }

  TempDir dir_;
  std::string catalog_path_;
  std::unique_ptr<PolicyService> policy_;
  std::unique_ptr<FakeVendor> vendor_;
  std::unique_ptr<Gateway> gateway_;
  std::string api_key_;
};

TEST_F(GatewayHilo, PinnedSmallTierRoutesAnswerToTheSmallModel) {
  StartGateway(Pinned("small_model"));
  ASSERT_TRUE(gateway_);
  ASSERT_NE(gateway_->hilo_link(), nullptr);
  const Reply r = Chat("answer", 50);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  EXPECT_EQ(r.state_header, "small_model");
  EXPECT_EQ(r.tier_header, "small");
  EXPECT_EQ(r.body["model"], "answer");  // the client sees the name it asked for
  const json up = Upstream();
  EXPECT_EQ(up["model"], "tiny-model");
  EXPECT_EQ(up["max_completion_tokens"], 50);  // under the clamp (200): left alone

  // An untiered model is routed as configured, with the state header but no tier header.
  const Reply plain = Chat("plain", 50);
  ASSERT_EQ(plain.status, 200);
  EXPECT_EQ(plain.state_header, "small_model");
  EXPECT_EQ(plain.tier_header, "");
  EXPECT_EQ(Upstream()["model"], "plain-model");
}

TEST_F(GatewayHilo, ClampIsAppliedUpstreamInEveryClientFormat) {
  StartGateway(Pinned("bare"));  // tier small, clamp 5
  ASSERT_TRUE(gateway_);
  const Reply r = Chat("answer", 1000);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  EXPECT_EQ(r.state_header, "bare");
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);
  EXPECT_EQ(r.body["usage"]["completion_tokens"], 5);  // the fake cut its 16 words at 5
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "length");

  // No max_tokens at all: the clamp sets one. A smaller one is kept.
  ASSERT_EQ(Chat("answer").status, 200);
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);
  ASSERT_EQ(Chat("answer", 3).status, 200);
  EXPECT_EQ(Upstream()["max_completion_tokens"], 3);

  // OpenAI's newer field, an Anthropic client, a Gemini client: one neutral clamp.
  json newer = {{"model", "plain"}, {"max_completion_tokens", 900},
                {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  ASSERT_EQ(Send("/v1/chat/completions", newer, api_key_).status, 200);
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);
  json anthropic = {{"model", "answer"}, {"max_tokens", 900}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  const Reply a = Send("/v1/messages", anthropic, api_key_, {{"anthropic-version", "2023-06-01"}});
  ASSERT_EQ(a.status, 200) << a.body.dump();
  EXPECT_EQ(a.tier_header, "small");
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);
  EXPECT_EQ(Upstream()["model"], "tiny-model");
  json gemini = {{"contents", json::array({{{"role", "user"}, {"parts", json::array({{{"text", "hi"}}})}}})},
                 {"generationConfig", {{"maxOutputTokens", 900}}}};
  const Reply g = Send("/v1beta/models/answer:generateContent", gemini, api_key_);
  ASSERT_EQ(g.status, 200) << g.body.dump();
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);

  // Streamed: the same clamp.
  json stream = {{"model", "answer"}, {"stream", true}, {"max_tokens", 400},
                 {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  const Reply s = Send("/v1/chat/completions", stream, api_key_);
  EXPECT_EQ(s.status, 200);
  EXPECT_EQ(s.state_header, "bare");
  EXPECT_EQ(s.tier_header, "small");
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);
}

TEST_F(GatewayHilo, SwitchingThePinSwitchesRoutingOnTheNextRequest) {
  StartGateway(Pinned("full"));
  ASSERT_TRUE(gateway_);
  hilo::ServiceLink* link = gateway_->hilo_link();
  ASSERT_NE(link, nullptr);
  Reply r = Chat("answer", 1000);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.tier_header, "large");
  EXPECT_EQ(Upstream()["model"], "big-model");
  EXPECT_EQ(Upstream()["max_completion_tokens"], 200);

  ASSERT_TRUE(link->Pin("bare").ok());
  r = Chat("answer", 1000);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.state_header, "bare");
  EXPECT_EQ(r.tier_header, "small");
  EXPECT_EQ(Upstream()["model"], "tiny-model");
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);

  ASSERT_TRUE(link->Pin("fewer_docs").ok());
  r = Chat("answer", 1000);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.state_header, "fewer_docs");
  EXPECT_EQ(Upstream()["model"], "big-model");
  EXPECT_FALSE(link->Pin("no_such_state").ok());
  EXPECT_EQ(Chat("answer").state_header, "fewer_docs");
}

TEST_F(GatewayHilo, BudgetReservesTheClampedMaxTokensAndItsRefusalIsShed) {
  // A key whose whole daily budget is 60 tokens: max_tokens 1000 fits only once clamped to 5.
  auto key = policy_->store().CreateKey("bob", "product", "test");
  ASSERT_TRUE(key.ok());
  BudgetSpec budget{"key", key->key_id, "daily", 60, -1};
  ASSERT_TRUE(policy_->store().PutBudget(budget, "test").ok());
  StartGateway(Pinned("full"));  // clamp 200: 1000 -> 200, over the budget
  ASSERT_TRUE(gateway_);
  hilo::ServiceLink* link = gateway_->hilo_link();
  link->meter().Take(hilo::testing::kValidatedAt * 1000);  // start a window now-ish (any time)

  const Reply refused = Chat("answer", 1000, key->api_key);
  EXPECT_EQ(refused.status, 429) << refused.body.dump();
  EXPECT_EQ(refused.state_header, "full");
  ASSERT_TRUE(link->Pin("bare").ok());  // clamp 5: input + 5 fits
  const Reply served = Chat("answer", 1000, key->api_key);
  EXPECT_EQ(served.status, 200) << served.body.dump();
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);
  const Reply unauthenticated = Chat("answer", 10, "sk-keel-not-a-key");
  EXPECT_EQ(unauthenticated.status, 401);
  EXPECT_EQ(unauthenticated.state_header, "bare");

  // Three arrivals (the 429 shed, one served, one refused 401), counted before their answers.
  int64_t t = hilo::testing::kValidatedAt * 1000 + 1000;
  const hilo::LoadReport report = link->meter().Take(t);
  EXPECT_NEAR(report.arrival_rate, 3.0, 1e-9);
  // None is left queued or in service once the gateway is done with them (it meters a request
  // after its answer is written, so the last one may still be finishing now).
  hilo::LoadReport later = report;
  EXPECT_TRUE(WaitFor([&] {
    later = link->meter().Take(++t);
    return later.queue_depth == 0 && later.in_flight == 0;
  })) << "queue_depth " << later.queue_depth << ", in_flight " << later.in_flight;
}

TEST_F(GatewayHilo, TieredNameIsListedRetrievedAndCounted) {
  StartGateway(Pinned("small_model"));
  ASSERT_TRUE(gateway_);
  auto get = [&](const std::string& target) {
    test::HttpTestClient c(gateway_->port(), 10);
    EXPECT_TRUE(c.SendRaw(test::HttpTestClient::BuildRequest("GET", target, "", "", {{"Authorization", "Bearer " + api_key_}})));
    test::HttpTestResponse r;
    EXPECT_TRUE(c.ReadResponse(&r));
    return r;
  };
  const test::HttpTestResponse list = get("/v1/models");
  ASSERT_EQ(list.status, 200) << list.body;
  std::vector<std::string> ids;
  const json listed = json::parse(list.body);
  for (const json& m : listed["data"]) ids.push_back(m["id"]);
  EXPECT_EQ(ids, (std::vector<std::string>{"answer", "answer-large", "answer-small", "plain"}));
  EXPECT_EQ(get("/v1/models/answer").status, 200);
  EXPECT_EQ(get("/v1/models/answer-medium").status, 404);
  const json count = {{"model", "answer"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  const Reply counted = Send("/v1/messages/count_tokens", count, api_key_, {{"anthropic-version", "2023-06-01"}});
  EXPECT_EQ(counted.status, 200) << counted.body.dump();
  EXPECT_GT(counted.body.value("input_tokens", 0), 0);
  EXPECT_EQ(counted.tier_header, "small");
}

TEST_F(GatewayHilo, MetricsShowTheAppliedState) {
  StartGateway(Pinned("no_rerank"));
  ASSERT_TRUE(gateway_);
  test::HttpTestClient c(gateway_->port(), 10);
  const test::HttpTestResponse m = c.Request("GET", "/metrics");
  ASSERT_EQ(m.status, 200);
  EXPECT_NE(m.body.find("keel_hilo_applied_state{service=\"gateway\"} 3"), std::string::npos) << m.body;
}

TEST_F(GatewayHilo, ConfigErrorsNameThePath) {
  auto parse_error = [&](const json& hilo) {
    auto c = ParseGatewayConfig(Config(hilo));
    return c.ok() ? std::string() : c.status().message();
  };
  const json tiers = {{"answer", {{"large", "answer-large"}, {"small", "answer-small"}}}};
  EXPECT_NE(parse_error({{"controller", "ftp://127.0.0.1:7500"}}).find("hilo.controller"), std::string::npos);
  EXPECT_NE(parse_error({{"controller", "http://127.0.0.1:notaport"}}).find("hilo.controller"), std::string::npos);
  EXPECT_NE(parse_error({{"controller", 7500}}).find("hilo.controller: expected a string"), std::string::npos);
  EXPECT_NE(parse_error({{"catalog", catalog_path_}}).find("hilo.state: missing"), std::string::npos);
  EXPECT_NE(parse_error({{"catalog", catalog_path_}, {"controller", "http://127.0.0.1:1"}, {"state", "full"}}).find("hilo: give either"),
            std::string::npos);
  EXPECT_NE(parse_error({{"catalog", catalog_path_}, {"state", "full"}, {"contoller", "x"}}).find("hilo.contoller: unknown member"),
            std::string::npos);
  EXPECT_NE(parse_error({{"catalog", catalog_path_}, {"state", "full"}, {"instance", "a b"}}).find("hilo.instance"),
            std::string::npos);
  EXPECT_NE(parse_error({{"catalog", catalog_path_}, {"state", "full"}, {"tiers", {{"answer", {{"small", "nope"}}}}}})
                .find("hilo.tiers.answer.small: no model named \"nope\""),
            std::string::npos);
  EXPECT_NE(parse_error({{"catalog", catalog_path_}, {"state", "full"}, {"tiers", {{"plain", {{"small", "answer-small"}}}}}})
                .find("hilo.tiers.plain: \"plain\" is also in models"),
            std::string::npos);
  EXPECT_NE(parse_error({{"catalog", catalog_path_}, {"state", "full"}, {"tiers", {{"answer", json::object()}}}})
                .find("hilo.tiers.answer: expected a non-empty object"),
            std::string::npos);
  EXPECT_NE(parse_error(json::array()).find("hilo: expected an object"), std::string::npos);

  // At start: a catalog tier with no model in a tiers entry, an unknown pinned state, a missing
  // or broken catalog, an unreachable controller.
  std::string e = StartError({{"catalog", catalog_path_}, {"state", "full"}, {"tiers", {{"answer", {{"large", "answer-large"}}}}}});
  EXPECT_NE(e.find("hilo.tiers.answer: no model for tier \"small\""), std::string::npos) << e;
  e = StartError({{"catalog", catalog_path_}, {"state", "medium"}, {"tiers", tiers}});
  EXPECT_NE(e.find("hilo.state"), std::string::npos) << e;
  e = StartError({{"catalog", dir_.file("missing.json")}, {"state", "full"}});
  EXPECT_NE(e.find("hilo.catalog: "), std::string::npos) << e;
  EXPECT_NE(e.find("missing.json"), std::string::npos) << e;
  std::ofstream(dir_.file("broken.json")) << R"({"format": "keel-hilo-catalog", "version": 1, "states": 3})";
  e = StartError({{"catalog", dir_.file("broken.json")}, {"state", "full"}});
  EXPECT_NE(e.find("hilo.catalog: " + dir_.file("broken.json") + ": "), std::string::npos) << e;
  e = StartError({{"controller", "http://127.0.0.1:1"}, {"tiers", tiers}});  // nothing listens on port 1
  EXPECT_NE(e.find("hilo.controller: http://127.0.0.1:1"), std::string::npos) << e;
}

TEST_F(GatewayHilo, FollowsARealControllerAndReportsItsLoad) {
  hilo::ControllerServerOptions o;
  o.fingerprint = hilo::testing::TestCatalog().binaries;
  o.max_age_s = int64_t{1} << 40;
  o.decide_interval_ms = 20;
  o.controller.initial_state = "full";
  o.controller.stale_fallback_s = 3600;  // services not reporting here must not force the safe state
  auto server = hilo::ControllerServer::Create(GatewayCatalog(), o);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  const std::string url = "http://127.0.0.1:" + std::to_string((*server)->port());
  StartGateway({{"controller", url},
                {"instance", "gw-follow"},
                {"tiers", {{"answer", {{"large", "answer-large"}, {"small", "answer-small"}}}}}});
  ASSERT_TRUE(gateway_);
  // The link starts in the safe state until its first push: wait for the controller's "full".
  ASSERT_TRUE(WaitFor([&] { return gateway_->hilo_link()->Current().name == "full"; }));
  Reply r = Chat("answer", 1000);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.state_header, "full");
  EXPECT_EQ(Upstream()["model"], "big-model");

  // An engine reporting far more demand than any state covers: the controller degrades at once
  // to the lowest state (bare: tier small, clamp 5), and the gateway follows on its next request.
  hilo::LoadReport engine;
  engine.service = hilo::Service::kEngine;
  engine.instance = "engine-0";
  engine.unix_ms = 1;
  engine.arrival_rate = 1e6;
  {
    test::HttpTestClient c((*server)->port(), 5);
    ASSERT_EQ(c.Request("POST", "/v1/report", hilo::WriteLoadReport(engine)).status, 200);
  }
  ASSERT_TRUE(WaitFor([&] { return Chat("answer", 1000).state_header == "bare"; }));
  EXPECT_EQ(Upstream()["model"], "tiny-model");
  EXPECT_EQ(Upstream()["max_completion_tokens"], 5);

  // The controller hears the gateway's load reports.
  ASSERT_TRUE(WaitFor([&] {
    test::HttpTestClient c((*server)->port(), 5);
    return c.Request("GET", "/metrics").body.find("keel_hilo_reports_total{service=\"gateway\"}") != std::string::npos;
  }));
  // The controller counts a report before the link has read its answer: wait for the link too.
  EXPECT_TRUE(WaitFor([&] { return gateway_->hilo_link()->reports_ok() > 0u; }));
  gateway_.reset();  // before the controller: the link's long-poll ends with the gateway
  (*server)->Stop();
}

}  // namespace
}  // namespace keel::gateway
