// The controller server and the agent client over real HTTP on loopback. No test asserts a
// duration: waits use generous deadlines only so that a broken server fails instead of hanging.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include <nlohmann/json.hpp>

#include "keel/core/http_client.h"
#include "keel/hilo/agent_client.h"
#include "keel/hilo/report.h"
#include "keel/hilo/server.h"
#include "tests/hilo/test_catalog.h"

namespace keel::hilo {
namespace {

using testing::TestCatalog;

constexpr int kTimeoutMs = 20000;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A usable catalog: validated just now by the fingerprint the server runs with.
Catalog FreshCatalog() {
  Catalog c = TestCatalog();
  for (State& s : c.states) s.figures->validated_at = NowMs() / 1000;
  return c;
}

ControllerServerOptions TestOptions() {
  ControllerServerOptions o;
  o.fingerprint = TestCatalog().binaries;
  o.decide_interval_ms = 20;
  o.controller.initial_state = "full";
  o.controller.stale_fallback_s = 3600;  // services not reporting in a test must not force the safe state
  return o;
}

struct Client {
  explicit Client(int port) : rc(HttpEndpoint{"127.0.0.1", port}) {}
  HttpReply Call(std::string_view method, std::string_view target, std::string_view body = "") {
    auto r = rc.Call(method, target, body, "application/json", DeadlineIn(kTimeoutMs));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : HttpReply{};
  }
  HttpClient rc;
};

LoadReport Report(Service s, double rate) {
  LoadReport r;
  r.service = s;
  r.instance = "i0";
  r.unix_ms = 1;  // a badly skewed clock: the server stamps its own receive time
  r.arrival_rate = rate;
  return r;
}

std::unique_ptr<ControllerServer> StartServer(ControllerServerOptions o = TestOptions()) {
  auto s = ControllerServer::Create(FreshCatalog(), std::move(o));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  EXPECT_TRUE((*s)->Start().ok());
  return std::move(*s);
}

TEST(HiloServer, ReportDrivesDecisionAndLongPollSeesIt) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  Client c(server->port());
  auto first = c.Call("GET", "/v1/state");
  ASSERT_EQ(first.status, 200);
  auto j0 = nlohmann::json::parse(first.body);
  EXPECT_EQ(j0["state"], "full");
  EXPECT_EQ(j0["index"], 0);
  EXPECT_EQ(j0["levels"]["gateway"]["model"], "large");
  const int64_t v0 = j0["version"];
  EXPECT_GE(v0, NowMs() - 600000);  // numbered from the start time

  // 300 req/s at the answer service, x 1.1 headroom = 330: only bare (500) covers it. The
  // report's unix_ms of 1 would be hopelessly stale if the server trusted it.
  auto rep = c.Call("POST", "/v1/report", WriteLoadReport(Report(Service::kAnswer, 300)));
  ASSERT_EQ(rep.status, 200) << rep.body;

  auto polled = c.Call("GET", "/v1/state?version=" + std::to_string(v0) + "&wait_ms=" + std::to_string(kTimeoutMs));
  ASSERT_EQ(polled.status, 200);
  auto j1 = nlohmann::json::parse(polled.body);
  EXPECT_EQ(j1["state"], "bare") << polled.body;
  EXPECT_EQ(j1["index"], 4);
  EXPECT_GT(j1["version"].get<int64_t>(), v0);
  EXPECT_EQ(j1["levels"]["answer"]["retrieval"], false);
  EXPECT_NE(j1["reason"].get<std::string>(), "initial state");

  auto metrics = c.Call("GET", "/metrics");
  EXPECT_NE(metrics.body.find("keel_hilo_transitions_total{from=\"full\",to=\"bare\"} 1"), std::string::npos)
      << metrics.body;
  EXPECT_NE(metrics.body.find("keel_hilo_reports_total{service=\"answer\"} 1"), std::string::npos);
  EXPECT_NE(metrics.body.find("keel_hilo_state 4"), std::string::npos);
  server->Stop();
}

TEST(HiloServer, LongPollReturnsOnChangeBeforeWait) {
  auto o = TestOptions();
  o.decide_interval_ms = 60000;  // only DecideNow decides
  o.max_wait_ms = 300000;
  auto server = StartServer(o);
  ASSERT_TRUE(server);
  const int64_t v0 = server->version();
  // A poll that would wait 5 minutes if nothing changed; the test's own deadline is 20 s.
  auto poll = std::async(std::launch::async, [&] {
    Client c(server->port());
    return c.Call("GET", "/v1/state?version=" + std::to_string(v0) + "&wait_ms=300000");
  });
  Client c(server->port());
  // The poll is waiting (same version): it must not have answered yet.
  EXPECT_EQ(poll.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  ASSERT_EQ(c.Call("POST", "/v1/report", WriteLoadReport(Report(Service::kEngine, 180))).status, 200);
  Decision d = server->DecideNow();
  ASSERT_TRUE(d.changed);
  EXPECT_EQ(d.state, "fewer_docs");  // 180 x 1.1 = 198 <= 200
  ASSERT_EQ(poll.wait_for(std::chrono::milliseconds(kTimeoutMs)), std::future_status::ready);
  auto j = nlohmann::json::parse(poll.get().body);
  EXPECT_EQ(j["state"], "fewer_docs");
  EXPECT_EQ(j["version"].get<int64_t>(), server->version());
  EXPECT_GT(server->version(), v0);
  // A poll with a version the server does not hold answers at once, whatever wait_ms says.
  auto now = nlohmann::json::parse(c.Call("GET", "/v1/state?version=" + std::to_string(v0) + "&wait_ms=300000").body);
  EXPECT_EQ(now["state"], "fewer_docs");
  server->Stop();
}

TEST(HiloServer, BadReportsNameTheField) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  Client c(server->port());
  auto r = c.Call("POST", "/v1/report", R"({"service":"answer","instance":"a","unix_ms":1,"arrival_rate":-5,
      "in_flight":0,"queue_depth":0,"utilisation":0,"p99_ms":0,"applied_state":""})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("arrival_rate"), std::string::npos) << r.body;
  r = c.Call("POST", "/v1/report", R"({"service":"teapot"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("service"), std::string::npos) << r.body;
  r = c.Call("POST", "/v1/report", "not json");
  EXPECT_EQ(r.status, 400);
  r = c.Call("GET", "/v1/state?version=abc");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("version"), std::string::npos) << r.body;
  auto metrics = c.Call("GET", "/metrics").body;
  EXPECT_NE(metrics.find("keel_hilo_report_errors_total 3"), std::string::npos) << metrics;
  EXPECT_EQ(metrics.find("keel_hilo_reports_total{"), std::string::npos);
  server->Stop();
}

TEST(HiloServer, HostileSizesAre413) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  Client c(server->port());
  std::string big = WriteLoadReport(Report(Service::kAnswer, 1));
  big.insert(1, "\"pad\":\"" + std::string(kMaxReportBytes, 'x') + "\",");
  EXPECT_EQ(c.Call("POST", "/v1/report", big).status, 413);
  Client c2(server->port());
  EXPECT_EQ(c2.Call("POST", "/v1/report", std::string(10 << 20, '{')).status, 413);
  Client c3(server->port());
  EXPECT_EQ(c3.Call("GET", "/health").status, 200);
  server->Stop();
}

// One long-poll beyond the bound gets the current state at once: a heartbeat. It was a 503,
// which agents count as not hearing the controller, so anyone able to hold 128 polls open put
// every service in its safe state after fallback_s.
TEST(HiloServer, WaitersBeyondTheBoundGetTheCurrentStateAtOnce) {
  auto o = TestOptions();
  o.decide_interval_ms = 60000;
  o.max_waiters = 2;
  auto server = StartServer(o);
  ASSERT_TRUE(server);
  const std::string target = "/v1/state?version=" + std::to_string(server->version()) + "&wait_ms=30000";
  std::vector<std::future<HttpReply>> polls;
  for (int i = 0; i < 2; ++i) {
    polls.push_back(std::async(std::launch::async, [&] { return Client(server->port()).Call("GET", target); }));
  }
  Client c(server->port());
  // Wait (bounded) until both waiters hold their slot, as the metric says.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kTimeoutMs);
  while (c.Call("GET", "/metrics").body.find("keel_hilo_waiters 2") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto third = c.Call("GET", target);
  EXPECT_EQ(third.status, 200) << third.body;
  EXPECT_NE(third.body.find("\"version\":" + std::to_string(server->version())), std::string::npos) << third.body;
  // Reports still get a thread while the waiters hold theirs.
  EXPECT_EQ(c.Call("POST", "/v1/report", WriteLoadReport(Report(Service::kVector, 1))).status, 200);
  server->Stop();  // wakes the waiters: they answer the current state
  for (auto& p : polls) {
    ASSERT_EQ(p.wait_for(std::chrono::milliseconds(kTimeoutMs)), std::future_status::ready);
    EXPECT_EQ(p.get().status, 200);
  }
}

TEST(HiloServer, CatalogAndHealth) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  Client c(server->port());
  auto cat = c.Call("GET", "/v1/catalog");
  ASSERT_EQ(cat.status, 200);
  auto parsed = ParseCatalog(cat.body);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->states.size(), 5u);
  EXPECT_EQ(c.Call("GET", "/health").status, 200);
  EXPECT_EQ(c.Call("GET", "/healthz").status, 200);
  server->Stop();
}

// A service running other binaries than the catalog's is not covered by its figures: its reports
// are refused (409, named, counted) and it counts as silent; the same binaries or none (an older
// service) are accepted; --allow-unvalidated accepts them all.
TEST(HiloServer, ReportsFromOtherBinariesAreRefused) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  Client c(server->port());
  LoadReport r = Report(Service::kEngine, 5);
  r.binaries = "keel-xxh3-ffffffffffffffffffffffffffffffff";
  auto refused = c.Call("POST", "/v1/report", WriteLoadReport(r));
  EXPECT_EQ(refused.status, 409) << refused.body;
  EXPECT_NE(refused.body.find("engine instance 'i0' runs binaries 'keel-xxh3-ffffffffffffffffffffffffffffffff', not '" +
                              TestCatalog().binaries + "'"),
            std::string::npos)
      << refused.body;
  auto services = nlohmann::json::parse(c.Call("GET", "/v1/services").body);
  EXPECT_TRUE(services["services"].empty()) << services.dump();  // not heard: silent
  auto metrics = c.Call("GET", "/metrics").body;
  EXPECT_NE(metrics.find("keel_hilo_reports_foreign_binaries_total{service=\"engine\"} 1"), std::string::npos) << metrics;
  EXPECT_EQ(metrics.find("keel_hilo_reports_total{service=\"engine\"}"), std::string::npos);

  r.binaries = TestCatalog().binaries;
  EXPECT_EQ(c.Call("POST", "/v1/report", WriteLoadReport(r)).status, 200);
  r.binaries.clear();
  EXPECT_EQ(c.Call("POST", "/v1/report", WriteLoadReport(r)).status, 200);
  server->Stop();

  auto o = TestOptions();
  o.allow_unvalidated = true;
  auto dev = StartServer(o);
  ASSERT_TRUE(dev);
  r.binaries = "keel-xxh3-ffffffffffffffffffffffffffffffff";
  Client d(dev->port());
  EXPECT_EQ(d.Call("POST", "/v1/report", WriteLoadReport(r)).status, 200);
  EXPECT_NE(d.Call("GET", "/metrics").body.find("keel_hilo_reports_foreign_binaries_total{service=\"engine\"} 1"),
            std::string::npos);
  dev->Stop();
}

// A controller that outlives max_age_s keeps acting on its figures but shows their age.
TEST(HiloServer, CatalogAgeIsExportedWhileRunning) {
  auto now_ms = std::make_shared<std::atomic<int64_t>>(NowMs());
  auto o = TestOptions();
  o.max_age_s = 3600;
  o.clock = [now_ms] { return now_ms->load(); };
  auto server = StartServer(o);
  ASSERT_TRUE(server);
  Client c(server->port());
  auto age = [&] {
    const std::string m = c.Call("GET", "/metrics").body;
    const size_t at = m.find("\nkeel_hilo_catalog_age_seconds ");
    return at == std::string::npos ? -1.0 : std::stod(m.substr(at + 31));
  };
  EXPECT_GE(age(), 0);
  EXPECT_LT(age(), 60);
  *now_ms += 7200 * 1000;
  for (int i = 0; i < 200 && age() < 7200; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GE(age(), 7200);
  EXPECT_LT(age(), 7300);
  EXPECT_EQ(c.Call("GET", "/v1/state").status, 200);  // still serving
  server->Stop();
}

TEST(HiloServer, UnusableCatalogRefusesToStart) {
  // Stale figures (TestCatalog was validated in 2025), then a foreign fingerprint, then a state
  // without figures.
  auto o = TestOptions();
  o.max_age_s = 3600;
  auto stale = ControllerServer::Create(TestCatalog(), o);
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.status().message().find("catalog not usable"), std::string::npos) << stale.status().ToString();
  EXPECT_NE(stale.status().message().find("validated"), std::string::npos);

  o = TestOptions();
  o.fingerprint = "other-binaries";
  auto foreign = ControllerServer::Create(FreshCatalog(), o);
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("other-binaries"), std::string::npos);

  Catalog unvalidated = FreshCatalog();
  unvalidated.states[2].figures.reset();
  auto missing = ControllerServer::Create(unvalidated, TestOptions());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("fewer_docs"), std::string::npos);

  // --allow-unvalidated starts on the stale / foreign catalog (the controller still needs figures).
  o.allow_unvalidated = true;
  o.max_age_s = 3600;
  auto dev = ControllerServer::Create(TestCatalog(), o);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  ASSERT_TRUE((*dev)->Start().ok());
  EXPECT_EQ(Client((*dev)->port()).Call("GET", "/health").status, 200);
  (*dev)->Stop();
}

TEST(HiloAgentClient, FollowsThenHoldsThenFallsBack) {
  auto o = TestOptions();
  o.decide_interval_ms = 60000;
  auto server = StartServer(o);
  ASSERT_TRUE(server);
  AgentClientOptions ao;
  ao.agent.hold_s = 3;
  ao.agent.fallback_s = 30;
  ao.wait_ms = 5000;
  ao.retry_ms = 20;
  auto made = AgentClient::Create(FreshCatalog(), HttpControllerCall({"127.0.0.1", server->port()}), ao);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  auto& agent = **made;
  EXPECT_EQ(agent.Current(NowMs()).mode, StateAgent::Mode::kNeverHeard);
  ASSERT_TRUE(agent.Start().ok());

  auto wait_for = [](const std::function<bool()>& cond) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kTimeoutMs);
    while (!cond() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return cond();
  };
  // The first poll takes the initial state.
  ASSERT_TRUE(wait_for([&] { return agent.version() == server->version(); }));
  EXPECT_EQ(agent.Current(NowMs()).state->name, "full");

  // A report through the client, a decision, and the pushed state arrives.
  ASSERT_TRUE(agent.Report(Report(Service::kAnswer, 120)).ok());
  ASSERT_TRUE(server->DecideNow().changed);
  EXPECT_EQ(server->state(), "small_model");  // 120 x 1.1 = 132 <= 150
  ASSERT_TRUE(wait_for([&] { return agent.version() == server->version(); }));
  StateAgent::View v = agent.Current(NowMs());
  EXPECT_EQ(v.mode, StateAgent::Mode::kFollowing);
  EXPECT_EQ(v.state->name, "small_model");
  // The controller refuses a bad report; the client says so without throwing.
  LoadReport bad = Report(Service::kAnswer, 1);
  bad.utilisation = 7;
  EXPECT_FALSE(agent.Report(bad).ok());

  // Lose the controller. Once a poll has failed, nothing can refresh the heard time; then drive
  // the agent's clock explicitly.
  server->Stop();
  const uint64_t errors = agent.poll_errors();
  ASSERT_TRUE(wait_for([&] { return agent.poll_errors() > errors; }));
  EXPECT_FALSE(agent.Report(Report(Service::kAnswer, 1)).ok());
  const int64_t t = NowMs();
  EXPECT_EQ(agent.Current(t + 3500).mode, StateAgent::Mode::kHolding);
  EXPECT_EQ(agent.Current(t + 3500).state->name, "small_model");
  EXPECT_EQ(agent.Current(t + 31000).mode, StateAgent::Mode::kFallback);
  EXPECT_EQ(agent.Current(t + 31000).state->name, "bare");
  agent.Stop();
}

}  // namespace
}  // namespace keel::hilo
