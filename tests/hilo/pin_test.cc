// Pinning the product state (Controller::Pin, POST /v1/pin), GET /v1/services, and the binaries
// fingerprint. Real HTTP on loopback.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "keel/core/socket.h"
#include "keel/hilo/controller.h"
#include "keel/hilo/fingerprint.h"
#include "keel/hilo/report.h"
#include "keel/hilo/server.h"
#include "keel/vector/replica_client.h"
#include "tests/hilo/test_catalog.h"

namespace keel::hilo {
namespace {

using testing::TestCatalog;

constexpr char kToken[] = "s3cret-admin-token-0123456789";

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

LoadReport Load(Service s, double rate, int64_t at_ms, std::string applied = "") {
  LoadReport r;
  r.service = s;
  r.instance = std::string(ServiceName(s)) + "-0";
  r.unix_ms = at_ms;
  r.arrival_rate = rate;
  r.applied_state = std::move(applied);
  return r;
}

void ReportAll(Controller& c, double rate, int64_t at_ms) {
  for (Service s : kAllServices) c.Observe(Load(s, rate, at_ms));
}

TEST(HiloPin, PinnedControllerIgnoresLoadAndUnpinResumesTheRules) {
  ControllerOptions o;
  o.initial_state = "full";
  auto c = Controller::Create(TestCatalog(), o, nullptr);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  int64_t t = 1000000;
  ReportAll(*c, 10, t);
  EXPECT_EQ(c->Decide(t).state, "full");

  ASSERT_TRUE(c->Pin("fewer_docs").ok());
  EXPECT_EQ(c->pinned(), "fewer_docs");
  t += 500;
  ReportAll(*c, 10, t);  // light load: the rules would stay in full
  Decision d = c->Decide(t);
  EXPECT_TRUE(d.changed);
  EXPECT_EQ(d.state, "fewer_docs");
  EXPECT_EQ(d.reason, "pinned by operator");
  // Overload far beyond every state: still pinned.
  for (int i = 0; i < 10; ++i) {
    t += 500;
    ReportAll(*c, 100000, t);
    d = c->Decide(t);
    EXPECT_EQ(d.state, "fewer_docs");
    EXPECT_FALSE(d.changed);
  }
  // An unknown name is refused and changes nothing.
  Status bad = c->Pin("nope");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("nope"), std::string::npos);
  EXPECT_EQ(c->pinned(), "fewer_docs");
  // Unpinned under that overload: degrade at once to the lowest state.
  ASSERT_TRUE(c->Pin("").ok());
  EXPECT_EQ(c->pinned(), "");
  t += 500;
  ReportAll(*c, 100000, t);
  d = c->Decide(t);
  EXPECT_TRUE(d.changed);
  EXPECT_EQ(d.state, "bare");
}

struct Http {
  explicit Http(int port) : rc(vector::HttpEndpoint{"127.0.0.1", port}) {}
  vector::HttpReply Call(std::string_view method, std::string_view target, std::string_view body = "",
                         std::string auth = "") {
    std::string head_body(body);
    auto r = auth.empty() ? rc.Call(method, target, head_body, "application/json", DeadlineIn(20000))
                          : CallWithAuth(method, target, head_body, auth);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : vector::HttpReply{};
  }
  // ReplicaClient sends no custom headers: write the request by hand over a socket.
  Result<vector::HttpReply> CallWithAuth(std::string_view method, std::string_view target, const std::string& body,
                                         const std::string& auth);
  vector::ReplicaClient rc;
};

std::unique_ptr<ControllerServer> Start(std::string admin_token) {
  Catalog c = TestCatalog();
  for (State& s : c.states) s.figures->validated_at = NowMs() / 1000;
  ControllerServerOptions o;
  o.fingerprint = c.binaries;
  o.decide_interval_ms = 20;
  o.controller.initial_state = "full";
  o.controller.stale_fallback_s = 3600;
  o.admin_token = std::move(admin_token);
  auto s = ControllerServer::Create(std::move(c), std::move(o));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  EXPECT_TRUE((*s)->Start().ok());
  return std::move(*s);
}

Result<vector::HttpReply> Http::CallWithAuth(std::string_view method, std::string_view target, const std::string& body,
                                             const std::string& auth) {
  KEEL_ASSIGN_OR_RETURN(int fd, ConnectTcp("127.0.0.1", rc.endpoint().port, 5000));
  std::string req = std::string(method) + " " + std::string(target) + " HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " +
                    auth + "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                    "\r\nConnection: close\r\n\r\n" + body;
  iovec iov{req.data(), req.size()};
  Status w = WriteFullV(fd, &iov, 1, DeadlineIn(5000));
  std::string in;
  char buf[4096];
  while (w.ok()) {
    if (PollFd(fd, POLLIN, 5000) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    in.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (!w.ok()) return w;
  const size_t sp = in.find(' ');
  const size_t end = in.find("\r\n\r\n");
  if (sp == std::string::npos || end == std::string::npos) return Status::Unavailable("malformed reply: " + in);
  vector::HttpReply r;
  r.status = std::atoi(in.c_str() + sp + 1);
  r.body = in.substr(end + 4);
  return r;
}

TEST(HiloPin, PinOverHttpNeedsTheAdminToken) {
  auto server = Start(kToken);
  ASSERT_TRUE(server);
  Http h(server->port());
  const std::string bearer = std::string("Bearer ") + kToken;
  // No credentials, wrong ones, a prefix of the right one: 401, state unchanged.
  EXPECT_EQ(h.Call("POST", "/v1/pin", R"({"state":"bare"})").status, 401);
  EXPECT_EQ(h.Call("POST", "/v1/pin", R"({"state":"bare"})", "Bearer wrong-token-0123456789").status, 401);
  EXPECT_EQ(h.Call("POST", "/v1/pin", R"({"state":"bare"})", bearer.substr(0, bearer.size() - 1)).status, 401);
  EXPECT_EQ(server->state(), "full");
  // Bad bodies and unknown states: 400, unchanged.
  EXPECT_EQ(h.Call("POST", "/v1/pin", R"({"state":7})", bearer).status, 400);
  EXPECT_EQ(h.Call("POST", "/v1/pin", R"({"state":"bare","x":1})", bearer).status, 400);
  EXPECT_EQ(h.Call("POST", "/v1/pin", "not json", bearer).status, 400);
  vector::HttpReply unknown = h.Call("POST", "/v1/pin", R"({"state":"nope"})", bearer);
  EXPECT_EQ(unknown.status, 400);
  EXPECT_NE(unknown.body.find("nope"), std::string::npos);
  EXPECT_EQ(server->state(), "full");

  const int64_t before = server->version();
  vector::HttpReply ok = h.Call("POST", "/v1/pin", R"({"state":"no_rerank"})", bearer);
  ASSERT_EQ(ok.status, 200) << ok.body;
  auto j = nlohmann::json::parse(ok.body);
  EXPECT_EQ(j["state"], "no_rerank");
  EXPECT_EQ(j["pinned"], true);
  EXPECT_EQ(j["reason"], "pinned by operator");
  EXPECT_GT(j["version"].get<int64_t>(), before);
  EXPECT_EQ(server->state(), "no_rerank");
  // GET /v1/state says so too.
  auto st = nlohmann::json::parse(h.Call("GET", "/v1/state").body);
  EXPECT_EQ(st["state"], "no_rerank");
  EXPECT_EQ(st["pinned"], true);

  vector::HttpReply un = h.Call("POST", "/v1/pin", R"({"state":""})", bearer);
  ASSERT_EQ(un.status, 200) << un.body;
  EXPECT_EQ(nlohmann::json::parse(un.body)["pinned"], false);
}

TEST(HiloPin, PinOverHttpIsForbiddenWithoutAnAdminToken) {
  auto server = Start("");
  ASSERT_TRUE(server);
  Http h(server->port());
  vector::HttpReply r = h.Call("POST", "/v1/pin", R"({"state":"bare"})", "Bearer anything-at-all-here");
  EXPECT_EQ(r.status, 403);
  EXPECT_EQ(server->state(), "full");
  // In-process pinning still works (what keel hilo serve --pin uses).
  ASSERT_TRUE(server->Pin("bare").ok());
  EXPECT_EQ(server->state(), "bare");
}

TEST(HiloPin, ServicesListsEachInstanceWithItsAppliedState) {
  auto server = Start("");
  ASSERT_TRUE(server);
  Http h(server->port());
  EXPECT_EQ(nlohmann::json::parse(h.Call("GET", "/v1/services").body)["services"].size(), 0u);
  LoadReport a = Load(Service::kVector, 12.5, 1, "full");
  a.p99_ms = 7.25;
  a.queue_depth = 3;
  ASSERT_EQ(h.Call("POST", "/v1/report", WriteLoadReport(a)).status, 200);
  ASSERT_EQ(h.Call("POST", "/v1/report", WriteLoadReport(Load(Service::kEngine, 3, 1, "bare"))).status, 200);
  // A second report of the same instance replaces the first.
  a.applied_state = "fewer_docs";
  ASSERT_EQ(h.Call("POST", "/v1/report", WriteLoadReport(a)).status, 200);
  auto j = nlohmann::json::parse(h.Call("GET", "/v1/services").body);
  ASSERT_EQ(j["services"].size(), 2u) << j.dump();
  bool saw_vector = false, saw_engine = false;
  for (const auto& e : j["services"]) {
    if (e["service"] == "vector") {
      saw_vector = true;
      EXPECT_EQ(e["instance"], "vector-0");
      EXPECT_EQ(e["applied_state"], "fewer_docs");
      EXPECT_DOUBLE_EQ(e["arrival_rate"].get<double>(), 12.5);
      EXPECT_DOUBLE_EQ(e["p99_ms"].get<double>(), 7.25);
      EXPECT_EQ(e["queue_depth"], 3);
      EXPECT_GE(e["age_ms"].get<int64_t>(), 0);  // stamped with the server's receive time, not unix_ms 1
      EXPECT_LT(e["age_ms"].get<int64_t>(), 60000);
    } else if (e["service"] == "engine") {
      saw_engine = true;
      EXPECT_EQ(e["applied_state"], "bare");
    }
  }
  EXPECT_TRUE(saw_vector);
  EXPECT_TRUE(saw_engine);
}

TEST(HiloPin, HealthCarriesTheFingerprint) {
  auto server = Start("");
  ASSERT_TRUE(server);
  Http h(server->port());
  auto j = nlohmann::json::parse(h.Call("GET", "/health").body);
  EXPECT_EQ(j["status"], "ok");
  EXPECT_EQ(j["binaries"], TestCatalog().binaries);
}

TEST(HiloFingerprint, ContentHashOfAFile) {
  const auto dir = std::filesystem::temp_directory_path() / ("keel_fp_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const char* name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  };
  const std::string a = write("a", "one build");
  const std::string b = write("b", "one build");
  const std::string c = write("c", "one build!");
  auto fa = FileFingerprint(a), fb = FileFingerprint(b), fc = FileFingerprint(c);
  ASSERT_TRUE(fa.ok() && fb.ok() && fc.ok());
  EXPECT_EQ(*fa, *fb);  // the content, not the name
  EXPECT_NE(*fa, *fc);
  EXPECT_EQ(fa->rfind("keel-xxh3-", 0), 0u);
  EXPECT_EQ(fa->size(), std::string("keel-xxh3-").size() + 32);
  EXPECT_FALSE(FileFingerprint((dir / "missing").string()).ok());
  auto self = ExecutableFingerprint();
  ASSERT_TRUE(self.ok()) << self.status().ToString();
  EXPECT_NE(*self, *fa);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace keel::hilo

namespace keel::hilo {
namespace {

TEST(HiloPin, APinnedControllerRunsOnACatalogWithoutFiguresAndCannotBeUnpinned) {
  Catalog c = TestCatalog();
  for (State& s : c.states) s.figures.reset();
  ControllerOptions o;
  EXPECT_FALSE(Controller::Create(c, o, nullptr).ok());  // unpinned: it needs figures
  o.pin = "small_model";
  auto ctl = Controller::Create(c, o, nullptr);
  ASSERT_TRUE(ctl.ok()) << ctl.status().ToString();
  int64_t t = 5000;
  for (Service s : kAllServices) ctl->Observe(Load(s, 1e6, t));
  Decision d = ctl->Decide(t);
  EXPECT_EQ(d.state, "small_model");
  ASSERT_TRUE(ctl->Pin("bare").ok());  // moving between pins is fine
  EXPECT_EQ(ctl->Decide(t + 100).state, "bare");
  Status un = ctl->Pin("");
  EXPECT_EQ(un.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(un.message().find("not validated"), std::string::npos);
  EXPECT_EQ(ctl->pinned(), "bare");
  o.pin = "nope";
  EXPECT_FALSE(Controller::Create(c, o, nullptr).ok());
}

}  // namespace
}  // namespace keel::hilo
