// LoadMeter arithmetic on fixed clock values, and ServiceLink against a real ControllerServer on
// loopback. No test asserts a duration: waits poll a condition under a generous deadline so that a
// broken link fails instead of hanging.
#include "keel/hilo/service_link.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "keel/core/http_client.h"
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

bool WaitFor(const std::function<bool()>& cond) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kTimeoutMs);
  while (!cond() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return cond();
}

// ---- LoadMeter

TEST(LoadMeter, CountsOneWindow) {
  LoadMeter m(2, 1000);
  for (int i = 0; i < 10; ++i) m.Arrive();
  m.Shed();
  m.Shed();
  for (int i = 0; i < 6; ++i) m.Started();
  for (int i = 1; i <= 4; ++i) m.Finish(0.010 * i, 0.5);
  LoadReport r = m.Take(3000);  // a 2 s window
  EXPECT_DOUBLE_EQ(r.arrival_rate, 5);  // 10 arrivals, the 2 shed ones included
  EXPECT_EQ(r.queue_depth, 2);          // 10 - 2 shed - 6 started
  EXPECT_EQ(r.in_flight, 2);            // 6 started - 4 finished
  EXPECT_DOUBLE_EQ(r.utilisation, 0.5);  // 2 busy s / (2 s x 2 workers)
  EXPECT_NEAR(r.p99_ms, 40, 1e-3);      // nearest rank of {10, 20, 30, 40}
  EXPECT_EQ(r.unix_ms, 3000);

  // The next window starts where the last ended; what is still queued or in service stays.
  LoadReport quiet = m.Take(4000);
  EXPECT_EQ(quiet.arrival_rate, 0);
  EXPECT_EQ(quiet.p99_ms, 0);  // nothing finished
  EXPECT_EQ(quiet.utilisation, 0);
  EXPECT_EQ(quiet.queue_depth, 2);
  EXPECT_EQ(quiet.in_flight, 2);

  // Filled in by the caller, the report is one the controller accepts.
  quiet.service = Service::kVector;
  quiet.instance = "vector-0";
  EXPECT_TRUE(ParseLoadReport(WriteLoadReport(quiet)).ok());
}

TEST(LoadMeter, UtilisationIsClampedAndProbesWin) {
  LoadMeter m(1, 0);
  m.Arrive();
  m.Started();
  m.Finish(5, 5);  // 5 busy seconds in a 1 s window on one worker
  LoadReport r = m.Take(1000);
  EXPECT_EQ(r.utilisation, 1);
  EXPECT_NEAR(r.p99_ms, 5000, 1e-3);

  m.SetQueueDepthProbe([] { return int64_t{7}; });
  m.SetUtilisationProbe([] { return 1.5; });
  r = m.Take(2000);
  EXPECT_EQ(r.queue_depth, 7);
  EXPECT_EQ(r.utilisation, 1);
  m.SetUtilisationProbe([] { return std::nan(""); });
  m.SetQueueDepthProbe([] { return int64_t{-3}; });
  r = m.Take(3000);
  EXPECT_EQ(r.utilisation, 0);  // a broken probe must not make the report unacceptable
  EXPECT_EQ(r.queue_depth, 0);
}

TEST(LoadMeter, ShedAndGarbageNeverGoNegative) {
  LoadMeter m(4, 0);
  m.Shed();     // without an Arrive
  m.Started();  // likewise
  m.Finish(-1, std::nan(""));
  m.Finish(0.001, 0.001);  // one more Finish than Started
  LoadReport r = m.Take(1000);
  EXPECT_EQ(r.queue_depth, 0);
  EXPECT_EQ(r.in_flight, 0);
  EXPECT_GE(r.utilisation, 0);
  EXPECT_GE(r.p99_ms, 0);
  r.service = Service::kEngine;
  r.instance = "e";
  EXPECT_TRUE(ParseLoadReport(WriteLoadReport(r)).ok());
  // A clock that went back: no window, rates of 0.
  m.Arrive();
  LoadReport back = m.Take(500);
  EXPECT_EQ(back.arrival_rate, 0);
  EXPECT_EQ(back.queue_depth, 1);
}

TEST(LoadMeter, P99OfManyLatenciesFromABoundedSample) {
  LoadMeter m(8, 0);
  for (int i = 1; i <= 1000; ++i) m.Finish(i / 1000.0, 0);
  EXPECT_NEAR(m.Take(1000).p99_ms, 990, 1e-3);  // exact while everything fits the sample

  // 20000 latencies 1..20000 ms: only kMaxSamples are kept, uniformly, so the p99 is close to
  // 19800 (a sample of 4096 puts it within ~1% with overwhelming odds; the generator is seeded).
  for (int i = 1; i <= 20000; ++i) m.Finish(i / 1000.0, 0);
  const double p99 = m.Take(2000).p99_ms;
  EXPECT_GT(p99, 19000);
  EXPECT_LE(p99, 20000);
}

// ---- ServiceLink against a controller

Catalog FreshCatalog() {
  Catalog c = TestCatalog();
  for (State& s : c.states) s.figures->validated_at = NowMs() / 1000;
  return c;
}

std::unique_ptr<ControllerServer> StartServer() {
  ControllerServerOptions o;
  o.fingerprint = TestCatalog().binaries;
  o.decide_interval_ms = 60000;  // only DecideNow decides
  o.controller.initial_state = "full";
  o.controller.stale_fallback_s = 3600;  // services not reporting in a test must not force the safe state
  auto s = ControllerServer::Create(FreshCatalog(), std::move(o));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  EXPECT_TRUE((*s)->Start().ok());
  return std::move(*s);
}

// Another service's load, posted straight to the controller.
void PostLoad(int port, Service s, double rate) {
  LoadReport r;
  r.service = s;
  r.instance = "other-0";
  r.unix_ms = NowMs();
  r.arrival_rate = rate;
  HttpClient c({"127.0.0.1", port});
  auto reply = c.Call("POST", "/v1/report", WriteLoadReport(r), "application/json", DeadlineIn(kTimeoutMs));
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  ASSERT_EQ(reply->status, 200) << reply->body;
}

std::string Metrics(int port) {
  HttpClient c({"127.0.0.1", port});
  auto reply = c.Call("GET", "/metrics", "", "", DeadlineIn(kTimeoutMs));
  EXPECT_TRUE(reply.ok());
  return reply.ok() ? reply->body : "";
}

// Records OnChange calls.
struct Changes {
  std::mutex mu;
  std::vector<std::pair<std::string, std::string>> seen;
  void Attach(ServiceLink& link) {
    link.OnChange([this](const State& from, const State& to) {
      std::lock_guard<std::mutex> lock(mu);
      seen.emplace_back(from.name, to.name);
    });
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size();
  }
  std::vector<std::pair<std::string, std::string>> Get() {
    std::lock_guard<std::mutex> lock(mu);
    return seen;
  }
};

ServiceLinkOptions FastOptions(Service s) {
  ServiceLinkOptions o;
  o.service = s;
  o.report_interval_ms = 20;
  o.client.retry_ms = 20;
  return o;
}

TEST(ServiceLink, FollowsThePushedStateAndReports) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  // Every report the link sends, as the controller received it.
  auto bodies = std::make_shared<std::pair<std::mutex, std::vector<std::string>>>();
  ControllerCall http = HttpControllerCall({"127.0.0.1", server->port()});
  ControllerCall recording = [http, bodies](std::string_view method, std::string_view target, std::string_view body,
                                            std::string_view ctype, Deadline deadline) {
    if (target == "/v1/report") {
      std::lock_guard<std::mutex> lock(bodies->first);
      bodies->second.emplace_back(body);
    }
    return http(method, target, body, ctype, deadline);
  };
  MetricsRegistry metrics;
  ServiceLinkOptions o = FastOptions(Service::kAnswer);
  o.metrics = &metrics;
  auto made = ServiceLink::Connect(recording, o, DeadlineIn(kTimeoutMs));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ServiceLink& link = **made;
  EXPECT_EQ(link.catalog().states.size(), 5u);  // the controller's catalog
  EXPECT_EQ(link.Current().name, "bare");       // nothing heard yet: the safe state
  Changes changes;
  changes.Attach(link);
  ASSERT_TRUE(link.Start().ok());
  EXPECT_FALSE(link.Start().ok());  // twice is a bug

  // The first poll takes the controller's initial state.
  ASSERT_TRUE(WaitFor([&] { return changes.size() == 1; }));
  EXPECT_EQ(link.Current().name, "full");
  EXPECT_EQ(link.CurrentIndex(), 0);

  // The engine's load exceeds full's and small_model's capacity (180 x 1.1 = 198 <= 200).
  PostLoad(server->port(), Service::kEngine, 180);
  ASSERT_TRUE(server->DecideNow().changed);
  ASSERT_EQ(server->state(), "fewer_docs");
  ASSERT_TRUE(WaitFor([&] { return changes.size() == 2; }));
  EXPECT_EQ(link.Current().name, "fewer_docs");
  const auto seen = changes.Get();
  EXPECT_EQ(seen[0], std::make_pair(std::string("bare"), std::string("full")));
  EXPECT_EQ(seen[1], std::make_pair(std::string("full"), std::string("fewer_docs")));

  // Reports reach the controller, and carry the state the link applies.
  link.meter().Arrive();
  const uint64_t before = link.reports_ok();
  ASSERT_TRUE(WaitFor([&] { return link.reports_ok() >= before + 2; }));
  EXPECT_NE(Metrics(server->port()).find("keel_hilo_reports_total{service=\"answer\"}"), std::string::npos);
  EXPECT_EQ(link.report_errors(), 0u);
  {
    std::lock_guard<std::mutex> lock(bodies->first);
    ASSERT_FALSE(bodies->second.empty());
    auto last = ParseLoadReport(bodies->second.back());
    ASSERT_TRUE(last.ok()) << last.status().ToString();
    EXPECT_EQ(last->service, Service::kAnswer);
    EXPECT_EQ(last->instance, "answer-" + std::to_string(::getpid()));
    EXPECT_EQ(last->applied_state, "fewer_docs");
  }
  // The controller first: a stopping controller answers the link's long-poll at once, so Stop
  // need not wait for it.
  server->Stop();
  link.Stop();
  link.Stop();  // idempotent
  const std::string text = metrics.Render();
  EXPECT_NE(text.find("keel_hilo_applied_state{service=\"answer\"} 2"), std::string::npos) << text;
  EXPECT_NE(text.find("keel_hilo_link_reports_total{result=\"ok\"} " + std::to_string(link.reports_ok())),
            std::string::npos)
      << text;
}

TEST(ServiceLink, PinnedLinkIgnoresTheControllerButStillReports) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  ServiceLinkOptions o = FastOptions(Service::kVector);
  o.instance = "vector-a";
  o.client.wait_ms = 30000;  // no heartbeat within the test: every push counted is a real answer
  std::atomic<int> pushes{0};
  o.client.on_push = [&] { ++pushes; };  // the link keeps a caller's on_push
  auto made = ServiceLink::Create(FreshCatalog(), HttpControllerCall({"127.0.0.1", server->port()}), o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ServiceLink& link = **made;
  const Status unknown = link.Pin("turbo");
  EXPECT_EQ(unknown.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.message().find("turbo"), std::string::npos) << unknown.message();
  ASSERT_TRUE(link.Pin("no_rerank").ok());
  EXPECT_EQ(link.Current().name, "no_rerank");
  ASSERT_TRUE(link.Start().ok());
  ASSERT_TRUE(WaitFor([&] { return pushes.load() >= 1; }));

  PostLoad(server->port(), Service::kEngine, 120);  // 132 <= 150: small_model
  ASSERT_TRUE(server->DecideNow().changed);
  ASSERT_TRUE(WaitFor([&] { return pushes.load() >= 2; }));  // the change was heard...
  EXPECT_EQ(link.Current().name, "no_rerank");                 // ...and ignored
  ASSERT_TRUE(WaitFor([&] { return link.reports_ok() >= 1; }));  // pinned, it still reports

  ASSERT_TRUE(link.Pin("").ok());  // unpinned: the controller's state at once
  EXPECT_EQ(link.Current().name, "small_model");
  server->Stop();
  link.Stop();
}

TEST(ServiceLink, PinnedWithoutControllerAndBadOptions) {
  Catalog c = FreshCatalog();
  auto unknown = ServiceLink::Pinned(c, "nope", {});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("nope"), std::string::npos) << unknown.status().ToString();

  auto made = ServiceLink::Pinned(c, "fewer_docs", FastOptions(Service::kGateway));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ServiceLink& link = **made;
  EXPECT_EQ(link.Current().name, "fewer_docs");
  Changes changes;
  changes.Attach(link);
  ASSERT_TRUE(link.Start().ok());
  ASSERT_TRUE(link.Pin("small_model").ok());
  EXPECT_EQ(link.Current().name, "small_model");
  ASSERT_TRUE(WaitFor([&] { return changes.size() == 1; }));
  EXPECT_EQ(changes.Get()[0], std::make_pair(std::string("fewer_docs"), std::string("small_model")));
  ASSERT_TRUE(link.Pin("").ok());  // no controller to follow: the safe state
  EXPECT_EQ(link.Current().name, "bare");
  link.Stop();
  EXPECT_EQ(link.reports_ok() + link.report_errors(), 0u);  // nobody to report to

  ServiceLinkOptions bad = FastOptions(Service::kAnswer);
  bad.instance = "has space";
  EXPECT_EQ(ServiceLink::Pinned(c, "full", bad).status().code(), StatusCode::kInvalidArgument);
  bad = FastOptions(Service::kAnswer);
  bad.report_interval_ms = 0;
  EXPECT_EQ(ServiceLink::Pinned(c, "full", bad).status().code(), StatusCode::kInvalidArgument);
  bad = FastOptions(Service::kAnswer);
  bad.workers = 0;
  EXPECT_EQ(ServiceLink::Pinned(c, "full", bad).status().code(), StatusCode::kInvalidArgument);
  Catalog broken = c;
  broken.safe_state = "missing";
  EXPECT_FALSE(ServiceLink::Pinned(broken, "full", {}).ok());
  EXPECT_FALSE(ServiceLink::Create(c, nullptr, {}).ok());
  EXPECT_EQ(HttpControllerCallForUrl("https://127.0.0.1:1").status().code(), StatusCode::kInvalidArgument);
}

TEST(ServiceLink, ConnectFailsClearly) {
  // Nothing listens on a freshly closed port.
  auto listener = ListenTcp("127.0.0.1", 0, 1);
  ASSERT_TRUE(listener.ok());
  const int port = listener->port;
  ::close(listener->fd);
  auto call = HttpControllerCallForUrl("http://127.0.0.1:" + std::to_string(port));
  ASSERT_TRUE(call.ok());
  auto gone = ServiceLink::Connect(*call, {}, DeadlineIn(kTimeoutMs));
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable);

  // A peer that answers far more than any catalog: bounded, not read whole.
  HttpServerOptions ho;
  ho.host = "127.0.0.1";
  ho.port = 0;
  HttpServer huge(ho, [](const HttpRequest&, HttpResponder& res) {
    res.Send(200, "application/json", std::string(3 << 20, ' '));
  });
  ASSERT_TRUE(huge.Start().ok());
  auto big = ServiceLink::Connect(HttpControllerCall({"127.0.0.1", huge.port()}), {}, DeadlineIn(kTimeoutMs));
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kUnavailable) << big.status().ToString();
  huge.Stop();

  // A controller that answers something that is not a catalog.
  ControllerCall liar = [](std::string_view, std::string_view, std::string_view, std::string_view,
                           Deadline) -> Result<ControllerReply> { return ControllerReply{200, "{\"states\": 3}"}; };
  auto bad = ServiceLink::Connect(liar, {}, DeadlineIn(kTimeoutMs));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("catalog"), std::string::npos) << bad.status().ToString();
  ControllerCall missing = [](std::string_view, std::string_view, std::string_view, std::string_view,
                              Deadline) -> Result<ControllerReply> { return ControllerReply{404, "no"}; };
  EXPECT_EQ(ServiceLink::Connect(missing, {}, DeadlineIn(kTimeoutMs)).status().code(), StatusCode::kUnavailable);
}

// A new controller instance (a new epoch) is followed even when it numbers below the old one
// (its clock stepped back); the same instance going back is still ignored.
TEST(ServiceLink, ANewControllerInstanceIsFollowedWhateverItsVersions) {
  auto reply = std::make_shared<std::string>(R"({"version":2000,"epoch":"a","state":"full"})");
  auto mu = std::make_shared<std::mutex>();
  ControllerCall call = [reply, mu](std::string_view method, std::string_view, std::string_view, std::string_view,
                                    Deadline) -> Result<ControllerReply> {
    if (method != "GET") return ControllerReply{200, "{}"};  // a report
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::lock_guard<std::mutex> lock(*mu);
    return ControllerReply{200, *reply};
  };
  auto set = [reply, mu](const std::string& body) {
    std::lock_guard<std::mutex> lock(*mu);
    *reply = body;
  };
  auto made = ServiceLink::Create(FreshCatalog(), call, FastOptions(Service::kEngine));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ServiceLink& link = **made;
  ASSERT_TRUE(link.Start().ok());
  ASSERT_TRUE(WaitFor([&] { return link.Current().name == "full"; }));
  set(R"({"version":1000,"epoch":"a","state":"small_model"})");  // same instance, older: ignored
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(link.Current().name, "full");
  set(R"({"version":1000,"epoch":"b","state":"small_model"})");  // a new instance: followed
  EXPECT_TRUE(WaitFor([&] { return link.Current().name == "small_model"; }));
  link.Stop();
}

TEST(ServiceLink, LostControllerHoldsThenFallsBackToTheSafeState) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  // The link's clock (and so its agent's) is driven by the test; the report thread still ticks
  // every 20 ms of real time and re-reads the agent each tick.
  auto clock = std::make_shared<std::atomic<int64_t>>(NowMs());
  ServiceLinkOptions o = FastOptions(Service::kEngine);
  o.clock = [clock] { return clock->load(); };
  o.client.agent.hold_s = 0.2;
  o.client.agent.fallback_s = 0.6;
  auto made = ServiceLink::Create(FreshCatalog(), HttpControllerCall({"127.0.0.1", server->port()}), o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ServiceLink& link = **made;
  Changes changes;
  changes.Attach(link);
  ASSERT_TRUE(link.Start().ok());
  ASSERT_TRUE(WaitFor([&] { return changes.size() == 1; }));
  EXPECT_EQ(link.Current().name, "full");
  PostLoad(server->port(), Service::kEngine, 120);  // 132 <= 150: small_model
  ASSERT_TRUE(server->DecideNow().changed);
  ASSERT_TRUE(WaitFor([&] { return link.Current().name == "small_model"; }));

  server->Stop();
  const uint64_t errors = link.report_errors();
  ASSERT_TRUE(WaitFor([&] { return link.report_errors() >= errors + 2; }));
  const int64_t t0 = clock->load();
  // Past hold_s, before fallback_s: the last state is held through several report ticks.
  clock->store(t0 + 300);
  const uint64_t held = link.report_errors();
  ASSERT_TRUE(WaitFor([&] { return link.report_errors() >= held + 3; }));
  EXPECT_EQ(link.Current().name, "small_model");
  // Far past fallback_s (even if the last answer was heard at t0 + 300): the safe state.
  clock->store(t0 + 10000);
  ASSERT_TRUE(WaitFor([&] { return link.Current().name == "bare"; }));
  ASSERT_TRUE(WaitFor([&] { return changes.size() == 3; }));
  const auto seen = changes.Get();
  EXPECT_EQ(seen[1], std::make_pair(std::string("full"), std::string("small_model")));
  EXPECT_EQ(seen[2], std::make_pair(std::string("small_model"), std::string("bare")));
  link.Stop();
}

}  // namespace
}  // namespace keel::hilo
