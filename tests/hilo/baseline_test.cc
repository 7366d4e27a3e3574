// The per-service baseline: ServicePolicy's rules on a fixed clock, and the controller server's
// per_service policy over real HTTP on loopback (a real ControllerServer on port 0, real reports,
// a real ServiceLink). No test asserts a duration: waits have generous deadlines only so that a
// broken server fails instead of hanging.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <thread>

#include <nlohmann/json.hpp>

#include "keel/core/http_client.h"
#include "keel/hilo/agent.h"
#include "keel/hilo/agent_client.h"
#include "keel/hilo/baseline.h"
#include "keel/hilo/report.h"
#include "keel/hilo/server.h"
#include "keel/hilo/service_link.h"
#include "tests/hilo/test_catalog.h"

namespace keel::hilo {
namespace {

using testing::TestCatalog;

constexpr int kTimeoutMs = 20000;
constexpr int kLevels = 5;  // TestCatalog's states
constexpr int64_t kT0 = 1764900000000;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

LoadReport Load(Service s, double utilisation, int64_t queue_depth = 0, double rate = 100, double p99_ms = 0) {
  LoadReport r;
  r.service = s;
  r.instance = std::string(ServiceName(s)) + "-0";
  r.unix_ms = 1;
  r.arrival_rate = rate;
  r.queue_depth = queue_depth;
  r.utilisation = utilisation;
  r.p99_ms = p99_ms;
  return r;
}
LoadReport Hot(Service s = Service::kEngine) { return Load(s, 0.95); }
LoadReport Cool(Service s = Service::kEngine) { return Load(s, 0.2); }

ServicePolicy MakePolicy(ServicePolicyOptions o = {}) {
  auto p = ServicePolicy::Create(kLevels, o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(*p);
}

// ---- ServicePolicy on a fixed clock

TEST(ServicePolicy, StartsFullAndDegradesOneStepPerGapWhileOverloaded) {
  ServicePolicy p = MakePolicy();
  EXPECT_EQ(p.level(), 0);
  ServiceStep s = p.Observe(Hot(), kT0);
  EXPECT_TRUE(s.changed);
  EXPECT_EQ(s.from, 0);
  EXPECT_EQ(s.to, 1);
  EXPECT_NE(s.reason.find("utilisation 0.950 >= 0.9"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("engine-0"), std::string::npos) << s.reason;
  // A second report within degrade_gap_s (another instance, or the next window before the step
  // was applied) does not step again.
  EXPECT_FALSE(p.Observe(Hot(), kT0 + 250).changed);
  EXPECT_EQ(p.level(), 1);
  EXPECT_TRUE(p.Observe(Hot(), kT0 + 500).changed);
  EXPECT_EQ(p.level(), 2);
  for (int i = 1; i <= 10; ++i) p.Observe(Hot(), kT0 + 500 + 500 * i);
  EXPECT_EQ(p.level(), kLevels - 1);  // the cheapest, and no further
  EXPECT_FALSE(p.Observe(Hot(), kT0 + 60000).changed);
  EXPECT_EQ(p.level(), kLevels - 1);
}

TEST(ServicePolicy, OverloadSignals) {
  ServicePolicy p = MakePolicy();
  // Queueing delay by Little's law: 10 waiting at 100 req/s is ~100 ms > 20 ms.
  EXPECT_DOUBLE_EQ(ServicePolicy::QueueDelayMs(Load(Service::kVector, 0.1, 10, 100)), 100);
  EXPECT_TRUE(p.Overloaded(Load(Service::kVector, 0.1, 10, 100)));
  // 5 waiting at 1000 req/s is ~5 ms: a fast service with a small queue is not overloaded, but
  // not calm either (the 5..20 ms hysteresis band).
  EXPECT_FALSE(p.Overloaded(Load(Service::kVector, 0.1, 5, 1000)));
  EXPECT_FALSE(p.Calm(Load(Service::kVector, 0.1, 5, 1000)));
  EXPECT_TRUE(p.Calm(Load(Service::kVector, 0.1, 1, 1000)));  // 1 ms
  // A queue with no arrivals in the window: nothing drains it; unbounded.
  EXPECT_TRUE(std::isinf(ServicePolicy::QueueDelayMs(Load(Service::kEngine, 0.1, 2, 0))));
  EXPECT_TRUE(p.Overloaded(Load(Service::kEngine, 0.1, 2, 0)));
  // Utilisation: at the threshold is overloaded, below is not.
  EXPECT_TRUE(p.Overloaded(Load(Service::kEngine, 0.9)));
  EXPECT_FALSE(p.Overloaded(Load(Service::kEngine, 0.89)));
  // Utilisation 0 turns that signal off: full slots alone are not overload, a queue still is.
  ServicePolicyOptions queue_only;
  queue_only.utilisation_threshold = 0;
  ServicePolicy dagor = MakePolicy(queue_only);
  EXPECT_FALSE(dagor.Overloaded(Load(Service::kEngine, 1.0)));
  EXPECT_TRUE(dagor.Calm(Load(Service::kEngine, 1.0)));
  EXPECT_TRUE(dagor.Overloaded(Load(Service::kEngine, 1.0, 10, 100)));
  // p99 is off by default; with a bound, over it is overloaded.
  EXPECT_FALSE(p.Overloaded(Load(Service::kEngine, 0.1, 0, 100, 5000)));
  ServicePolicyOptions o;
  o.p99_bound_ms = 500;
  ServicePolicy bounded = MakePolicy(o);
  std::string why;
  EXPECT_TRUE(bounded.Overloaded(Load(Service::kEngine, 0.1, 0, 100, 600), &why));
  EXPECT_EQ(why, "p99 600.0 ms > 500 ms");
  EXPECT_FALSE(bounded.Overloaded(Load(Service::kEngine, 0.1, 0, 100, 500)));
}

TEST(ServicePolicy, NoRecoveryBeforeTheCalmDwellThenOneStepPerDwell) {
  ServicePolicy p = MakePolicy();
  p.Observe(Hot(), kT0);
  p.Observe(Hot(), kT0 + 500);
  ASSERT_EQ(p.level(), 2);
  // Calm from 1.0 s on, every 250 ms. recover_dwell_s = 10: no step before 11.0 s.
  int64_t t = kT0 + 1000;
  for (; t < kT0 + 11000; t += 250) {
    ASSERT_FALSE(p.Observe(Cool(), t).changed) << "at " << (t - kT0) << " ms";
  }
  ServiceStep s = p.Observe(Cool(), t);  // 11.0 s: calm for 10 s, last change 10.5 s ago
  EXPECT_TRUE(s.changed);
  EXPECT_EQ(s.to, 1);
  EXPECT_EQ(s.reason, "calm for 10.0 s");
  // The next step needs another full dwell from that recovery.
  for (t += 250; t < kT0 + 21000; t += 250) ASSERT_FALSE(p.Observe(Cool(), t).changed) << (t - kT0);
  EXPECT_TRUE(p.Observe(Cool(), t).changed);
  EXPECT_EQ(p.level(), 0);
  EXPECT_FALSE(p.Observe(Cool(), t + 60000).changed);  // never above full
}

TEST(ServicePolicy, ANonCalmReportRestartsTheDwell) {
  ServicePolicy p = MakePolicy();
  p.Observe(Hot(), kT0);
  ASSERT_EQ(p.level(), 1);
  for (int64_t t = kT0 + 1000; t <= kT0 + 9000; t += 1000) p.Observe(Cool(), t);
  // One report in the hysteresis band (10 ms queueing: not overloaded, not calm) at 9.5 s.
  EXPECT_FALSE(p.Observe(Load(Service::kEngine, 0.2, 1, 100), kT0 + 9500).changed);
  EXPECT_EQ(p.level(), 1);
  // Calm again from 10 s: 11 s would have recovered without it; now only at 20 s.
  for (int64_t t = kT0 + 10000; t < kT0 + 20000; t += 500) ASSERT_FALSE(p.Observe(Cool(), t).changed) << (t - kT0);
  EXPECT_TRUE(p.Observe(Cool(), kT0 + 20000).changed);
  EXPECT_EQ(p.level(), 0);
}

TEST(ServicePolicy, MinDwellHoldsARecoveryAfterAChange) {
  ServicePolicyOptions o;
  o.baseline.recover_dwell_s = 1;
  o.baseline.min_dwell_s = 5;
  ServicePolicy p = MakePolicy(o);
  p.Observe(Hot(), kT0);
  ASSERT_EQ(p.level(), 1);
  // Calm for well over recover_dwell_s, but within min_dwell_s of the change.
  for (int64_t t = kT0 + 250; t < kT0 + 5000; t += 250) ASSERT_FALSE(p.Observe(Cool(), t).changed) << (t - kT0);
  EXPECT_TRUE(p.Observe(Cool(), kT0 + 5000).changed);
  EXPECT_EQ(p.level(), 0);
}

TEST(ServicePolicy, RefusesBadOptions) {
  auto expect_bad = [](int levels, ServicePolicyOptions o, std::string_view what) {
    auto p = ServicePolicy::Create(levels, o);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(what), std::string::npos) << p.status().message();
  };
  expect_bad(0, {}, "num_levels");
  ServicePolicyOptions o;
  o.baseline.recover_queue_ms = 30;  // above degrade_queue_ms
  expect_bad(kLevels, o, "recover_queue_ms <= degrade_queue_ms");
  o = {};
  o.utilisation_threshold = -0.1;
  expect_bad(kLevels, o, "utilisation_threshold");
  o.utilisation_threshold = 1.5;
  expect_bad(kLevels, o, "utilisation_threshold");
  o = {};
  o.p99_bound_ms = std::nan("");
  expect_bad(kLevels, o, "p99_bound_ms");
  o = {};
  o.baseline.min_dwell_s = -1;
  expect_bad(kLevels, o, "min_dwell_s");
  o = {};
  o.degrade_gap_s = INFINITY;
  expect_bad(kLevels, o, "degrade_gap_s");
  o = {};
  o.initial_level = kLevels;
  expect_bad(kLevels, o, "initial_level");
}

// ---- ControllerServer, per_service policy, over HTTP

Catalog FreshCatalog() {
  Catalog c = TestCatalog();
  for (State& s : c.states) s.figures->validated_at = NowMs() / 1000;
  return c;
}

// The server's clock, moved by the test: the policies' dwells run on it.
struct TestClock {
  std::shared_ptr<std::atomic<int64_t>> now = std::make_shared<std::atomic<int64_t>>(NowMs());
  std::function<int64_t()> fn() const {
    return [n = now] { return n->load(); };
  }
  void Advance(int64_t ms) { now->fetch_add(ms); }
};

ControllerServerOptions PerServiceOptions(const TestClock& clock) {
  ControllerServerOptions o;
  o.fingerprint = TestCatalog().binaries;
  o.decide_interval_ms = 60000;  // the product controller only decides on DecideNow
  o.controller.initial_state = "full";
  o.controller.stale_fallback_s = 3600;
  o.policy = StatePolicy::kPerService;
  o.clock = clock.fn();
  return o;
}

std::unique_ptr<ControllerServer> StartServer(ControllerServerOptions o) {
  auto s = ControllerServer::Create(FreshCatalog(), std::move(o));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  EXPECT_TRUE((*s)->Start().ok());
  return std::move(*s);
}

struct Client {
  explicit Client(int port) : rc(HttpEndpoint{"127.0.0.1", port}) {}
  HttpReply Call(std::string_view method, std::string_view target, std::string_view body = "") {
    auto r = rc.Call(method, target, body, "application/json", DeadlineIn(kTimeoutMs));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : HttpReply{};
  }
  void Post(const LoadReport& r) {
    auto reply = Call("POST", "/v1/report", WriteLoadReport(r));
    EXPECT_EQ(reply.status, 200) << reply.body;
  }
  nlohmann::json State(std::string_view service) {
    auto reply = Call("GET", "/v1/state?service=" + std::string(service));
    EXPECT_EQ(reply.status, 200) << reply.body;
    return nlohmann::json::parse(reply.body, nullptr, false);
  }
  HttpClient rc;
};

TEST(PerServiceServer, AnOverloadedEngineMovesOnlyTheEngine) {
  TestClock clock;
  auto server = StartServer(PerServiceOptions(clock));
  ASSERT_TRUE(server);
  Client c(server->port());
  for (const char* s : {"answer", "vector", "engine", "gateway"}) {
    auto j = c.State(s);
    EXPECT_EQ(j["index"], 0) << s;
    EXPECT_EQ(j["state"], "full") << s;
    EXPECT_EQ(j["service"], s);
  }
  const int64_t vector_v0 = c.State("vector")["version"];
  const int64_t engine_v0 = c.State("engine")["version"];

  c.Post(Hot(Service::kEngine));
  c.Post(Cool(Service::kVector));
  auto engine = c.State("engine");
  EXPECT_EQ(engine["index"], 1) << engine;
  EXPECT_EQ(engine["state"], "small_model");
  EXPECT_EQ(engine["levels"]["engine"]["kv_codec"], "zipfusion");  // small_model's levels
  EXPECT_GT(engine["version"].get<int64_t>(), engine_v0);
  EXPECT_NE(engine["reason"].get<std::string>().find("overloaded"), std::string::npos) << engine;
  auto vector = c.State("vector");
  EXPECT_EQ(vector["index"], 0) << vector;
  EXPECT_EQ(vector["version"].get<int64_t>(), vector_v0);  // its version did not move either
  EXPECT_EQ(c.State("answer")["index"], 0);
  EXPECT_EQ(c.State("gateway")["index"], 0);
  EXPECT_EQ(server->service_index(Service::kEngine), 1);
  EXPECT_EQ(server->service_index(Service::kVector), 0);

  // The engine keeps degrading, a step per gap of the server's clock; the vector stays put.
  for (int i = 0; i < 3; ++i) {
    clock.Advance(600);
    c.Post(Hot(Service::kEngine));
    c.Post(Cool(Service::kVector));
  }
  EXPECT_EQ(c.State("engine")["index"], 4);
  EXPECT_EQ(c.State("engine")["state"], "bare");
  EXPECT_EQ(c.State("vector")["index"], 0);

  const std::string metrics = c.Call("GET", "/metrics").body;
  EXPECT_NE(metrics.find("keel_hilo_service_level{service=\"engine\"} 4"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("keel_hilo_service_level{service=\"vector\"} 0"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("keel_hilo_service_transitions_total{service=\"engine\"} 4"), std::string::npos) << metrics;
  auto health = nlohmann::json::parse(c.Call("GET", "/health").body);
  EXPECT_EQ(health["policy"], "per_service");

  // Calm engine reports on the server's clock: one step back after the 10 s dwell.
  for (int i = 0; i <= 40; ++i) {
    clock.Advance(250);
    c.Post(Cool(Service::kEngine));
  }
  EXPECT_EQ(c.State("engine")["index"], 3);
  EXPECT_EQ(c.State("engine")["reason"], "calm for 10.0 s");
  server->Stop();
}

TEST(PerServiceServer, RefusesAStatePollWithoutAKnownService) {
  TestClock clock;
  auto server = StartServer(PerServiceOptions(clock));
  ASSERT_TRUE(server);
  Client c(server->port());
  auto none = c.Call("GET", "/v1/state?version=1&wait_ms=0");
  EXPECT_EQ(none.status, 400);
  EXPECT_NE(none.body.find("service: required under the per_service policy"), std::string::npos) << none.body;
  auto empty = c.Call("GET", "/v1/state?service=");
  EXPECT_EQ(empty.status, 400);
  auto bad = c.Call("GET", "/v1/state?service=database");
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("unknown service 'database'"), std::string::npos) << bad.body;
  server->Stop();
}

TEST(PerServiceServer, ALongPollWakesOnlyForItsOwnService) {
  TestClock clock;
  auto o = PerServiceOptions(clock);
  o.max_wait_ms = 300000;
  auto server = StartServer(o);
  ASSERT_TRUE(server);
  const int64_t v_engine = server->service_version(Service::kEngine);
  const int64_t v_vector = server->service_version(Service::kVector);
  // The engine's poll would wait 5 minutes without a change of the engine's own level.
  auto engine_poll = std::async(std::launch::async, [&] {
    Client c(server->port());
    return c.Call("GET", "/v1/state?service=engine&version=" + std::to_string(v_engine) + "&wait_ms=300000");
  });
  // The vector's poll: whether the engine's change comes before, during or after its wait, it
  // answers the vector's own version (it is not woken by, nor numbered by, another service).
  auto vector_poll = std::async(std::launch::async, [&] {
    Client c(server->port());
    return c.Call("GET", "/v1/state?service=vector&version=" + std::to_string(v_vector) + "&wait_ms=300");
  });
  Client c(server->port());
  c.Post(Hot(Service::kEngine));
  ASSERT_EQ(engine_poll.wait_for(std::chrono::milliseconds(kTimeoutMs)), std::future_status::ready);
  auto e = nlohmann::json::parse(engine_poll.get().body);
  EXPECT_EQ(e["index"], 1);
  EXPECT_GT(e["version"].get<int64_t>(), v_engine);
  ASSERT_EQ(vector_poll.wait_for(std::chrono::milliseconds(kTimeoutMs)), std::future_status::ready);
  auto v = nlohmann::json::parse(vector_poll.get().body);
  EXPECT_EQ(v["index"], 0);
  EXPECT_EQ(v["version"].get<int64_t>(), v_vector);
  server->Stop();
}

TEST(PerServiceServer, APinBeatsEveryServicesOwnLevel) {
  TestClock clock;
  auto server = StartServer(PerServiceOptions(clock));
  ASSERT_TRUE(server);
  Client c(server->port());
  c.Post(Hot(Service::kEngine));
  ASSERT_EQ(c.State("engine")["index"], 1);
  ASSERT_TRUE(server->Pin("no_rerank").ok());
  for (const char* s : {"answer", "vector", "engine", "gateway"}) {
    auto j = c.State(s);
    EXPECT_EQ(j["index"], 3) << s;
    EXPECT_EQ(j["pinned"], true);
    EXPECT_EQ(j["reason"], "pinned to 'no_rerank'");
  }
  ASSERT_TRUE(server->Pin("").ok());
  EXPECT_EQ(c.State("engine")["index"], 1);
  EXPECT_EQ(c.State("vector")["index"], 0);
  server->Stop();
}

TEST(PerServiceServer, HiloPolicyIgnoresTheServiceParameter) {
  ControllerServerOptions o;
  o.fingerprint = TestCatalog().binaries;
  o.decide_interval_ms = 60000;
  o.controller.initial_state = "full";
  o.controller.stale_fallback_s = 3600;
  auto server = StartServer(o);
  ASSERT_TRUE(server);
  Client c(server->port());
  for (const char* target : {"/v1/state?service=engine", "/v1/state?service=database", "/v1/state"}) {
    auto reply = c.Call("GET", target);
    ASSERT_EQ(reply.status, 200) << target << ": " << reply.body;
    auto j = nlohmann::json::parse(reply.body);
    EXPECT_EQ(j["state"], "full");
    EXPECT_FALSE(j.contains("service")) << j;
    EXPECT_EQ(j["version"].get<int64_t>(), server->version());
  }
  EXPECT_EQ(nlohmann::json::parse(c.Call("GET", "/health").body)["policy"], "hilo");
  EXPECT_EQ(c.Call("GET", "/metrics").body.find("keel_hilo_service_level"), std::string::npos);
  server->Stop();
}

TEST(PerServiceServer, RefusesBadPerServiceOptions) {
  TestClock clock;
  auto o = PerServiceOptions(clock);
  o.per_service[static_cast<int>(Service::kEngine)].utilisation_threshold = 2;
  auto s = ControllerServer::Create(FreshCatalog(), o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("per_service.engine: "), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("utilisation_threshold"), std::string::npos);
}

// ---- A real ServiceLink following a per_service server

bool WaitFor(const std::function<bool()>& pred) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kTimeoutMs);
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

ServiceLinkOptions LinkOptions(Service s) {
  ServiceLinkOptions o;
  o.service = s;
  o.report_interval_ms = 20;
  o.client.retry_ms = 20;
  return o;
}

TEST(PerServiceServer, AServiceLinkAppliesItsOwnLevel) {
  TestClock clock;  // frozen unless moved: the links' own calm reports never complete a dwell
  auto server = StartServer(PerServiceOptions(clock));
  ASSERT_TRUE(server);
  const HttpEndpoint ep{"127.0.0.1", server->port()};
  auto engine = ServiceLink::Connect(HttpControllerCall(ep), LinkOptions(Service::kEngine), DeadlineIn(kTimeoutMs));
  auto vector = ServiceLink::Connect(HttpControllerCall(ep), LinkOptions(Service::kVector), DeadlineIn(kTimeoutMs));
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE(vector.ok()) << vector.status().ToString();
  ASSERT_TRUE((*engine)->Start().ok());
  ASSERT_TRUE((*vector)->Start().ok());
  // Before any push both apply the safe state; the first answer is each one's own level, 0.
  ASSERT_TRUE(WaitFor([&] { return (*engine)->CurrentIndex() == 0 && (*vector)->CurrentIndex() == 0; }));
  // Both links report (their polls carry service=, or the server would have refused them).
  ASSERT_TRUE(WaitFor([&] { return (*engine)->reports_ok() > 0 && (*vector)->reports_ok() > 0; }));

  // Another engine instance overloaded: the engine's level steps; the engine link applies it.
  Client c(server->port());
  LoadReport hot = Hot(Service::kEngine);
  hot.instance = "engine-other";
  c.Post(hot);
  ASSERT_TRUE(WaitFor([&] { return (*engine)->CurrentIndex() == 1; }));
  EXPECT_EQ((*engine)->Current().name, "small_model");
  EXPECT_EQ(server->service_index(Service::kVector), 0);
  EXPECT_EQ((*vector)->CurrentIndex(), 0);
  EXPECT_GT((*vector)->reports_ok(), 0u);
  (*engine)->Stop();
  (*vector)->Stop();
  server->Stop();
}

// Under per_service a service's version moves only with its own answer, but a newer version with
// the same state (a controller restart, or any future numbering) must not disturb a service.
TEST(StateAgent, ANewerVersionWithTheSameStateChangesNothing) {
  auto agent = StateAgent::Create(TestCatalog(), AgentOptions{});
  ASSERT_TRUE(agent.ok());
  ASSERT_TRUE(agent->Push(100, "small_model", kT0).value());
  const auto taken = agent->Push(101, "small_model", kT0 + 10);
  ASSERT_TRUE(taken.ok());
  EXPECT_TRUE(*taken);  // the version is taken...
  EXPECT_EQ(agent->version(), 101);
  EXPECT_EQ(agent->Current(kT0 + 10).index, 1);  // ...and the applied state is the same
  EXPECT_EQ(agent->Current(kT0 + 10).mode, StateAgent::Mode::kFollowing);
}

TEST(AgentClient, RefusesAnUnknownService) {
  AgentClientOptions o;
  o.service = "database";
  auto c = AgentClient::Create(TestCatalog(), HttpControllerCall({"127.0.0.1", 1}), o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("service 'database'"), std::string::npos) << c.status().message();
}

}  // namespace
}  // namespace keel::hilo
