// The vector service over HTTP: in process (bad input, metrics, stats), and `keel vector` as a
// real process killed with SIGKILL right after acknowledged upserts (nothing acknowledged may be
// lost) or stopped with SIGTERM (it snapshots).
#include "keel/vector/wal.h"
#include "keel/vector/service.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"
#include "tests/kvstore/redis_process.h"

namespace keel::vector {
namespace {

using json = nlohmann::json;
using test::HttpTestClient;
using test::TempDir;

constexpr int kDim = 8;

json ItemJson(uint64_t id) {
  json text = json::array(), image = json::array();
  for (int d = 0; d < kDim; ++d) {
    text.push_back(static_cast<double>((id * 31 + d * 7) % 97) / 4.0);
    image.push_back(static_cast<double>((id * 17 + d * 3) % 89) / 8.0);
  }
  return {{"id", id}, {"text", text}, {"image", image}, {"attributes", {{"group", id % 2 ? "odd" : "even"}}}};
}

json Items(uint64_t begin, uint64_t end) {
  json items = json::array();
  for (uint64_t i = begin; i < end; ++i) items.push_back(ItemJson(i));
  return {{"items", items}};
}

class VectorServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StartService(1 << 20);
    auto res = Post("/v1/upsert", Items(0, 200).dump());
    ASSERT_EQ(res.status, 200) << res.body;
  }

  // (Re)starts the service on this test's shard directory.
  void StartService(size_t max_body_bytes) {
    ServiceOptions o;
    o.shard.dir = dir_.path() + "/shard";
    o.shard.text_dim = kDim;
    o.shard.image_dim = kDim;
    o.shard.max_k = 100;
    o.port = 0;
    o.max_body_bytes = max_body_bytes;
    service_.reset();  // a stopped service still holds its directory until it is gone
    auto s = Service::Start(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    service_ = std::move(*s);
  }

  test::HttpTestResponse Post(const std::string& path, const std::string& body) {
    HttpTestClient http(service_->port());
    return http.Request("POST", path, body);
  }
  test::HttpTestResponse Get(const std::string& path) {
    HttpTestClient http(service_->port());
    return http.Request("GET", path);
  }
  json SearchFor(uint64_t id, int k = 5) {
    json q = {{"kind", "text"}, {"text", ItemJson(id)["text"]}, {"k", k}};
    auto res = Post("/v1/search", q.dump());
    EXPECT_EQ(res.status, 200) << res.body;
    return json::parse(res.body, nullptr, false);
  }

  TempDir dir_{"keel-vecsrv"};
  std::unique_ptr<Service> service_;
};

TEST_F(VectorServerTest, UpsertSearchDeleteStats) {
  json r = SearchFor(42);
  ASSERT_TRUE(r["hits"].is_array());
  EXPECT_EQ(r["hits"][0]["id"], 42);
  EXPECT_EQ(r["hits"][0]["text_distance"], 0.0);
  EXPECT_EQ(r["tiers_touched"], 1);
  EXPECT_TRUE(r.contains("search_us") && r.contains("fetch_us"));

  json mm = {{"kind", "multimodal"}, {"text", ItemJson(42)["text"]}, {"image", ItemJson(42)["image"]}, {"k", 3},
             {"filter", {{"group", "even"}}}, {"include_vectors", true}};
  auto res = Post("/v1/search", mm.dump());
  ASSERT_EQ(res.status, 200) << res.body;
  json m = json::parse(res.body);
  EXPECT_EQ(m["hits"][0]["id"], 42);
  EXPECT_EQ(m["hits"][0]["image_distance"], 0.0);
  EXPECT_EQ(m["hits"][0]["image"], ItemJson(42)["image"]);
  for (const auto& h : m["hits"]) EXPECT_EQ(h["id"].get<uint64_t>() % 2, 0u);

  auto look = Post("/v1/search", R"({"kind":"image","ids":[3,4,100000]})");
  ASSERT_EQ(look.status, 200) << look.body;
  json l = json::parse(look.body);
  ASSERT_EQ(l["hits"].size(), 2u);
  EXPECT_EQ(l["hits"][1]["image"], ItemJson(4)["image"]);

  ASSERT_EQ(Post("/v1/delete", R"({"ids":[42]})").status, 200);
  EXPECT_NE(SearchFor(42)["hits"][0]["id"], 42);

  auto stats = Get("/v1/stats");
  ASSERT_EQ(stats.status, 200);
  json st = json::parse(stats.body);
  EXPECT_EQ(st["items"], 199);
  EXPECT_EQ(st["index"], "hnsw");
  EXPECT_EQ(st["tiers"][0]["name"], "dram");
  EXPECT_EQ(st["tiers"][0]["items"], 199 * 2);

  ASSERT_EQ(Post("/v1/snapshot", "").status, 200);
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/shard/shard.snap"));
  EXPECT_EQ(Get("/healthz").status, 200);
}

TEST_F(VectorServerTest, BadInputIs400WithAMessageAndTheServerKeepsServing) {
  const std::string text8 = ItemJson(1)["text"].dump();
  struct Case {
    std::string path, body, fragment;
  };
  const std::vector<Case> cases = {
      {"/v1/upsert", "{", "not valid JSON"},
      {"/v1/upsert", "[1,2]", "must be a JSON object"},
      {"/v1/upsert", R"({"items":{}})", "items must be an array"},
      {"/v1/upsert", R"({"items":[{"id":1,"text":[1,2,3]}]})", "expected 8"},
      {"/v1/upsert", R"({"items":[{"id":1,"text":[1,2,3,4,5,6,7,"x"]}]})", "items[0].text[7] is not a number"},
      {"/v1/upsert", R"({"items":[{"id":1,"text":[1,2,3,4,5,6,7,1e300]}]})", "not a finite float32"},
      {"/v1/upsert", R"({"items":[{"id":-1,"text":)" + text8 + "}]}", "unsigned integer"},
      {"/v1/upsert", R"({"items":[{"id":1.5,"text":)" + text8 + "}]}", "unsigned integer"},
      {"/v1/upsert", R"({"items":[{"text":)" + text8 + "}]}", "id is missing"},
      {"/v1/upsert", R"({"items":[{"id":1,"text":)" + text8 + R"(,"image":[1]}]})", "image has 1 values"},
      {"/v1/upsert", R"({"items":[{"id":1,"text":)" + text8 + R"(,"attributes":{"a":1}}]})", "attributes.a must be a string"},
      {"/v1/upsert", R"({"items":[{"id":9,"text":)" + text8 + R"(},{"id":9,"text":)" + text8 + "}]}", "duplicate"},
      {"/v1/delete", R"({"ids":["7"]})", "ids[0] must be an unsigned integer"},
      {"/v1/search", R"({"text":)" + text8 + R"(,"k":100000000000000})", "k must be in [1, 100]"},
      {"/v1/search", R"({"text":)" + text8 + R"(,"k":0})", "k must be in [1, 100]"},
      {"/v1/search", R"({"text":)" + text8 + R"(,"k":"10"})", "k must be an integer"},
      {"/v1/search", R"({"text":)" + text8 + R"(,"ef":-3})", "ef must be in"},
      {"/v1/search", R"({"text":[1,2]})", "expected 8"},
      {"/v1/search", R"({"kind":"audio","text":)" + text8 + "}", "unknown query kind"},
      {"/v1/search", R"({"kind":"text"})", "text is required"},
      {"/v1/search", R"({"kind":"image"})", "needs ids"},
      {"/v1/search", R"({"text":)" + text8 + R"(,"filter":{"group":2}})", "filter.group must be a string"},
      {"/v1/search", R"({"text":)" + text8 + R"(,"include_vectors":"yes"})", "include_vectors"},
  };
  for (const auto& c : cases) {
    auto res = Post(c.path, c.body);
    EXPECT_EQ(res.status, 400) << c.path << " " << c.body << " -> " << res.body;
    EXPECT_NE(res.body.find(c.fragment), std::string::npos) << c.body << " -> " << res.body;
    json err = json::parse(res.body, nullptr, false);
    EXPECT_TRUE(err.contains("error")) << res.body;
    EXPECT_EQ(SearchFor(10)["hits"][0]["id"], 10) << "server stopped answering after " << c.body;
  }
  // Too large a body: 413 from the server, then business as usual.
  auto big = Post("/v1/upsert", std::string(2 << 20, ' '));
  EXPECT_EQ(big.status, 413);
  EXPECT_EQ(Get("/v1/search").status, 405);
  EXPECT_EQ(Get("/v1/nothing").status, 404);
  EXPECT_EQ(SearchFor(11)["hits"][0]["id"], 11);
  json st = json::parse(Get("/v1/stats").body);
  EXPECT_EQ(st["items"], 200);  // no rejected upsert wrote anything
}

// A depth bomb and a flat array past max_json_values, at sizes the body limit allows, are 400s
// on every JSON endpoint, refused before parsing (8 MiB of '[' once cost ~630 MiB and seconds).
TEST_F(VectorServerTest, JsonBombsAre400OnEveryEndpoint) {
  ASSERT_TRUE(service_->Stop().ok());
  StartService(16 << 20);
  if (HasFatalFailure()) return;
  const std::string depth_bomb(8 << 20, '[');
  std::string flat = R"({"ids":[)";
  for (size_t i = 0; i < ServiceOptions{}.max_json_values; ++i) flat += "1,";
  flat += "1]}";
  for (const char* path : {"/v1/upsert", "/v1/search", "/v1/delete"}) {
    auto res = Post(path, depth_bomb);
    EXPECT_EQ(res.status, 400) << path << " -> " << res.body;
    EXPECT_NE(res.body.find("request body: JSON nested deeper than 8 (byte 8)"), std::string::npos) << res.body;
    EXPECT_EQ(SearchFor(10)["hits"][0]["id"], 10) << "server stopped answering after a depth bomb on " << path;
    res = Post(path, flat);
    EXPECT_EQ(res.status, 400) << path << " -> " << res.body;
    EXPECT_NE(res.body.find("more than 4194304 values"), std::string::npos) << res.body;
    EXPECT_EQ(SearchFor(11)["hits"][0]["id"], 11) << "server stopped answering after a flat array on " << path;
  }
  // A batch within the limits still works: 200 items of 2 x 8 floats.
  EXPECT_EQ(Post("/v1/upsert", Items(200, 400).dump()).status, 200);
  EXPECT_EQ(json::parse(Get("/v1/stats").body)["items"], 400);
}

TEST_F(VectorServerTest, MetricsCountRequestsLatencyAndTiers) {
  SearchFor(1);
  Post("/v1/search", "{");
  auto res = Get("/metrics");
  ASSERT_EQ(res.status, 200);
  const std::string& m = res.body;
  EXPECT_NE(m.find(R"(keel_vector_requests_total{route="/v1/search",code="200"} 1)"), std::string::npos) << m;
  EXPECT_NE(m.find(R"(keel_vector_requests_total{route="/v1/search",code="400"} 1)"), std::string::npos) << m;
  EXPECT_NE(m.find(R"(keel_vector_requests_total{route="/v1/upsert",code="200"} 1)"), std::string::npos) << m;
  EXPECT_NE(m.find("keel_vector_search_seconds_count 1"), std::string::npos) << m;
  EXPECT_NE(m.find("keel_vector_cross_tier_searches_total 0"), std::string::npos) << m;
  EXPECT_NE(m.find(R"(keel_vector_tier_items{tier="dram"} 400)"), std::string::npos) << m;
  EXPECT_NE(m.find(R"(keel_vector_tier_bytes{tier="dram"} 12800)"), std::string::npos) << m;
  EXPECT_NE(m.find("keel_vector_items 200"), std::string::npos) << m;
}

TEST(VectorServiceTest, ALargeLogIsSnapshotted) {
  TempDir dir("keel-vecsrv");
  ServiceOptions o;
  o.shard.dir = dir.path() + "/shard";
  o.shard.text_dim = kDim;
  o.shard.image_dim = kDim;
  o.port = 0;
  o.snapshot_wal_bytes = 64 << 10;
  auto s = Service::Start(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  HttpTestClient http((*s)->port());
  ASSERT_EQ(http.Request("POST", "/v1/upsert", Items(0, 10).dump()).status, 200);
  EXPECT_GT((*s)->shard().Stats().wal_bytes, 0);
  ASSERT_EQ(http.Request("POST", "/v1/upsert", Items(10, 1000).dump()).status, 200);
  EXPECT_EQ((*s)->shard().Stats().wal_bytes, static_cast<int64_t>(Wal::kHeaderBytes));  // the epoch marker
  EXPECT_TRUE(std::filesystem::exists(o.shard.dir + "/shard.snap"));
}

// `keel vector` as a child process.
class VectorProcess {
 public:
  VectorProcess(const std::string& dir, int port) : port_(port) {
    const std::string cmd = std::string("exec ") + KEEL_BINARY + " vector --dir " + dir + " --port " +
                            std::to_string(port) + " --text-dim 8 --image-dim 8 --placement off 2>/dev/null";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 500 && !test::PortAccepts(port_); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ~VectorProcess() { Signal(SIGKILL); }
  bool up() const { return test::PortAccepts(port_); }
  // Sends `sig` and reaps the process; returns its wait status.
  int Signal(int sig) {
    int status = -1;
    if (pid_ > 0) {
      ::kill(pid_, sig);
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    return status;
  }

 private:
  int port_;
  pid_t pid_ = -1;
};

// Every id in [0, n) found by an image lookup (in chunks under max_k) and by its text vector.
void ExpectAllFound(int port, uint64_t n) {
  HttpTestClient http(port);
  uint64_t found = 0;
  for (uint64_t b = 0; b < n; b += 500) {
    json ids = json::array();
    for (uint64_t i = b; i < std::min(n, b + 500); ++i) ids.push_back(i);
    auto res = http.Request("POST", "/v1/search", json{{"kind", "image"}, {"ids", ids}}.dump());
    ASSERT_EQ(res.status, 200) << res.body;
    json r = json::parse(res.body);
    for (const auto& h : r["hits"]) {
      EXPECT_EQ(h["image"], ItemJson(h["id"].get<uint64_t>())["image"]);
      ++found;
    }
  }
  EXPECT_EQ(found, n);
  for (uint64_t id : {uint64_t{0}, n / 2, n - 1}) {
    auto res = http.Request("POST", "/v1/search", json{{"text", ItemJson(id)["text"]}, {"k", 1}}.dump());
    ASSERT_EQ(res.status, 200) << res.body;
    EXPECT_EQ(json::parse(res.body)["hits"][0]["text_distance"], 0.0);
  }
}

TEST(VectorProcessTest, SigkillAfterAcknowledgedUpsertsLosesNothing) {
  TempDir dir("keel-vecproc");
  const int port = test::FreeLoopbackPort();
  const uint64_t kItems = 3000;
  {
    VectorProcess p(dir.path(), port);
    ASSERT_TRUE(p.up());
    HttpTestClient http(port);
    for (uint64_t b = 0; b < kItems; b += 250) {
      auto res = http.Request("POST", "/v1/upsert", Items(b, b + 250).dump());
      ASSERT_EQ(res.status, 200) << res.body;  // acknowledged
    }
    auto del = http.Request("POST", "/v1/delete", R"({"ids":[100000]})");
    ASSERT_EQ(del.status, 200);
    p.Signal(SIGKILL);  // no snapshot, no flush: only the log survives
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/shard.snap"));
  VectorProcess again(dir.path(), port);
  ASSERT_TRUE(again.up());
  ExpectAllFound(port, kItems);
}

TEST(VectorProcessTest, SigtermSnapshotsAndRestartsFromIt) {
  TempDir dir("keel-vecproc");
  const int port = test::FreeLoopbackPort();
  {
    VectorProcess p(dir.path(), port);
    ASSERT_TRUE(p.up());
    HttpTestClient http(port);
    ASSERT_EQ(http.Request("POST", "/v1/upsert", Items(0, 500).dump()).status, 200);
    const int status = p.Signal(SIGTERM);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/shard.snap"));
  EXPECT_EQ(std::filesystem::file_size(dir.path() + "/wal.log"), Wal::kHeaderBytes);  // the epoch marker
  VectorProcess again(dir.path(), port);
  ASSERT_TRUE(again.up());
  ExpectAllFound(port, 500);
}

}  // namespace
}  // namespace keel::vector
