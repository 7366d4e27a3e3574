// HiLO levels in the vector tier (keel/vector/hilo_link.h): the clamping rules, a `keel vector`
// service on an IVF index of the 10k SIFT base following a pinned link (recall follows nprobe, k
// caps the answer, rerank off fetches only k candidates, a new pin applies to the next search,
// searches are metered and writes are not, the server's own 503s count as shed), a plain-mode
// router applying the level's fanout, and OpenHiloLink's refusals.
#include "keel/vector/hilo_link.h"

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "keel/hilo/server.h"
#include "keel/vector/service.h"
#include "tests/vector/cluster_fixture.h"
#include "tests/vector/sift_data.h"

namespace keel::vector {
namespace {

using json = nlohmann::json;
using test::HttpTestClient;
using test::LoadSift;
using test::RecallAt10;
using cluster_test::kReplicas;
using cluster_test::kShards;

// Four states; only the vector levels matter here. The figures make the catalog a valid,
// validated one (quality falls, capacity grows down the list, the safe state is the largest).
hilo::Catalog VectorCatalog() {
  auto state = [](std::string name, hilo::VectorLevel v, double quality, double capacity) {
    hilo::State s;
    s.name = std::move(name);
    s.answer = {true, 8};
    s.vector = v;
    s.engine = {"zipfusion", true, 4096, 256};
    s.gateway = {"large", 256};
    s.figures = hilo::Figures{quality, {100, capacity, 100, 1000}, 1764900000};
    return s;
  };
  hilo::Catalog c;
  c.states.push_back(state("full", {64, 10, true, 3}, 100, 400));
  c.states.push_back(state("no_rerank", {64, 10, false, 3}, 99.5, 500));
  c.states.push_back(state("narrow", {1, 10, true, 1}, 99, 600));
  c.states.push_back(state("short", {1, 5, false, 1}, 97, 800));
  c.safe_state = "short";
  c.max_quality_drop = 5;
  return c;
}

std::shared_ptr<hilo::ServiceLink> PinnedLink(const std::string& state, int workers, std::function<int64_t()> clock = {}) {
  hilo::ServiceLinkOptions o;
  o.service = hilo::Service::kVector;
  o.instance = "vector-test";
  o.workers = workers;
  o.clock = std::move(clock);
  auto link = hilo::ServiceLink::Pinned(VectorCatalog(), state, o);
  EXPECT_TRUE(link.ok()) << link.status().ToString();
  if (!link.ok()) return nullptr;
  EXPECT_TRUE((*link)->Start().ok());
  return std::shared_ptr<hilo::ServiceLink>(std::move(*link));
}

TEST(VectorLevelTest, RequestsMayAskForLessNeverMore) {
  const hilo::VectorLevel level{16, 5, false, 2};
  SearchRequest r;  // nprobe/ef 0 (index defaults), k 10, rerank -1
  ApplyVectorLevel(level, &r);
  EXPECT_EQ(r.nprobe, 16);
  EXPECT_EQ(r.ef, 16);
  EXPECT_EQ(r.k, 5);
  EXPECT_EQ(r.rerank, 0) << "rerank off: no candidates beyond k";

  SearchRequest less;
  less.nprobe = 4;
  less.ef = 8;
  less.k = 3;
  ApplyVectorLevel(level, &less);
  EXPECT_EQ(less.nprobe, 4);
  EXPECT_EQ(less.ef, 8);
  EXPECT_EQ(less.k, 3);

  SearchRequest more;
  more.nprobe = 1000;
  more.ef = 1000;
  more.k = 100;
  ApplyVectorLevel(level, &more);
  EXPECT_EQ(more.nprobe, 16);
  EXPECT_EQ(more.ef, 16);
  EXPECT_EQ(more.k, 5);

  SearchRequest keep;  // rerank on keeps the request's own (or the shard default)
  keep.rerank = 40;
  ApplyVectorLevel({16, 10, true, 2}, &keep);
  EXPECT_EQ(keep.rerank, 40);
  SearchRequest dflt;
  ApplyVectorLevel({16, 10, true, 2}, &dflt);
  EXPECT_EQ(dflt.rerank, -1);

  SearchRequest wide;  // ef has the shard's own bound
  ApplyVectorLevel({int64_t{1} << 20, 10, true, 1}, &wide);
  EXPECT_EQ(wide.nprobe, 1 << 20);
  EXPECT_EQ(wide.ef, 1 << 16);

  SearchRequest lookup;  // an id lookup has no ANN step
  lookup.kind = QueryKind::kImage;
  lookup.ids = {1, 2, 3};
  lookup.k = 10;
  ApplyVectorLevel(level, &lookup);
  EXPECT_EQ(lookup.k, 10);
  EXPECT_EQ(lookup.nprobe, 0);
}

TEST(VectorLevelTest, PlainFanoutIsTheLevelsWithinTheReplicas) {
  EXPECT_EQ(PlainFanout({64, 10, true, 2}, 3), 2);
  EXPECT_EQ(PlainFanout({64, 10, true, 4}, 3), 3);
  EXPECT_EQ(PlainFanout({64, 10, true, 1}, 3), 1);
}

// One `keel vector` service on an IVF-Flat index (100 lists) of the 10k SIFT base vectors.
class SiftServiceTest : public ::testing::Test {
 protected:
  void StartService(std::shared_ptr<hilo::ServiceLink> link, int max_active_requests = 256,
                    trust::AdversaryMode adversary = trust::AdversaryMode::kHonest) {
    link_ = link;
    ServiceOptions o;
    o.shard.dir = dir_.file("shard");
    o.shard.text_dim = 128;
    o.shard.image_dim = 128;
    o.shard.index.kind = IndexKind::kIvfFlat;
    o.shard.index.ivf_lists = 100;
    o.shard.index.ivf_nprobe = 16;
    o.shard.rerank = 32;
    o.shard.max_k = 100;
    o.shard.wal_sync = false;
    o.snapshot_on_stop = false;
    o.port = 0;
    o.max_active_requests = max_active_requests;
    o.identity.adversary.mode = adversary;
    o.identity.adversary.delay = std::chrono::milliseconds(1500);
    o.hilo = std::move(link);
    auto s = Service::Start(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    service_ = std::move(*s);
    const auto& sift = LoadSift();
    ASSERT_EQ(sift.base.count, 10000);
    std::vector<Item> items(static_cast<size_t>(sift.base.count));
    for (int64_t i = 0; i < sift.base.count; ++i) {
      items[static_cast<size_t>(i)].id = static_cast<uint64_t>(i);
      items[static_cast<size_t>(i)].text = sift.vec(i);
    }
    ASSERT_TRUE(service_->shard().Upsert(items).ok());  // one batch: trains 100 lists on all 10k
  }

  test::HttpTestResponse Search(int q, int k, json extra = json::object()) {
    json body = {{"kind", "text"}, {"text", LoadSift().vec(q)}, {"k", k}};
    for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
    HttpTestClient http(service_->port());
    return http.Request("POST", "/v1/search", body.dump());
  }

  std::vector<int64_t> Ids(const test::HttpTestResponse& res) {
    std::vector<int64_t> ids;
    json j = json::parse(res.body, nullptr, false);
    if (!j.is_object()) return ids;
    for (const auto& h : j["hits"]) ids.push_back(h["id"].get<int64_t>());
    return ids;
  }

  // Mean recall@10 over the 100 queries, each asking k = 10 (as the answer service does);
  // every answer must name `state` in its header.
  double MeanRecall(const std::string& state, json extra = json::object()) {
    double sum = 0;
    for (int q = 0; q < 100; ++q) {
      auto res = Search(q, 10, extra);
      EXPECT_EQ(res.status, 200) << res.body;
      EXPECT_EQ(res.Header("x-keel-hilo-state"), state);
      sum += RecallAt10(LoadSift(), q, Ids(res));
    }
    return sum / 100;
  }

  void TearDown() override {
    if (service_) service_->Stop();
    if (link_) link_->Stop();
  }

  test::TempDir dir_{"keel-hilo-vector"};
  std::shared_ptr<hilo::ServiceLink> link_;
  std::unique_ptr<Service> service_;
};

TEST_F(SiftServiceTest, RecallFollowsThePinnedNprobeAndARequestCannotAskMore) {
  StartService(PinnedLink("full", 256));
  const double full = MeanRecall("full");
  ASSERT_TRUE(link_->Pin("narrow").ok());
  const double narrow = MeanRecall("narrow");
  // Asking for 100 probes under a 1-probe level still gets 1 probe: the same answers.
  const double narrow_asking_more = MeanRecall("narrow", {{"nprobe", 100}, {"ef", 100}});
  std::printf("IVF-Flat 100 lists on SIFT10k: recall@10 nprobe 64 = %.3f, nprobe 1 = %.3f\n", full, narrow);
  EXPECT_LT(narrow, full);
  EXPECT_EQ(narrow_asking_more, narrow);
  // The stats say which state applies.
  HttpTestClient http(service_->port());
  json stats = json::parse(http.Request("GET", "/v1/stats").body, nullptr, false);
  EXPECT_EQ(stats["hilo_state"], "narrow");
}

TEST_F(SiftServiceTest, SwitchingThePinChangesTheNextSearch) {
  StartService(PinnedLink("full", 256));
  // A query that misses some of its true top 10 at nprobe 1.
  int q = -1;
  ASSERT_TRUE(link_->Pin("narrow").ok());
  for (int i = 0; i < 100 && q < 0; ++i) {
    if (RecallAt10(LoadSift(), i, Ids(Search(i, 10))) < 1.0) q = i;
  }
  ASSERT_GE(q, 0) << "no query loses recall at nprobe 1";
  ASSERT_TRUE(link_->Pin("full").ok());
  auto wide = Search(q, 10);
  EXPECT_EQ(wide.Header("x-keel-hilo-state"), "full");
  ASSERT_TRUE(link_->Pin("narrow").ok());
  auto narrow = Search(q, 10);
  EXPECT_EQ(narrow.Header("x-keel-hilo-state"), "narrow");
  EXPECT_GT(RecallAt10(LoadSift(), q, Ids(wide)), RecallAt10(LoadSift(), q, Ids(narrow)));
}

TEST_F(SiftServiceTest, LevelKCapsTheAnswer) {
  StartService(PinnedLink("short", 256));  // k 5
  EXPECT_EQ(Ids(Search(3, 10)).size(), 5u) << "k = 10 asked, the level's k = 5 returned: recall@10 <= 0.5";
  EXPECT_EQ(Ids(Search(3, 3)).size(), 3u) << "a request may ask for less";
  ASSERT_TRUE(link_->Pin("full").ok());
  EXPECT_EQ(Ids(Search(3, 10)).size(), 10u);
}

TEST_F(SiftServiceTest, RerankOffFetchesOnlyKCandidatesAndReturnsK) {
  StartService(PinnedLink("full", 256));
  auto& log = service_->shard().query_log();
  auto res = Search(11, 10);
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_EQ(Ids(res).size(), 10u);
  EXPECT_EQ(log.Snapshot().back().size(), 32u) << "rerank on: the shard's 32 candidates are fetched and reranked";
  ASSERT_TRUE(link_->Pin("no_rerank").ok());
  res = Search(11, 10, {{"rerank", 64}});  // a request's own rerank is overruled by the level
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_EQ(Ids(res).size(), 10u);
  EXPECT_EQ(log.Snapshot().back().size(), 10u) << "rerank off: only the k candidates are fetched";
  // A request's rerank beyond the shard's bound is refused with the field named.
  auto bad = Search(11, 10, {{"rerank", 5000}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("rerank"), std::string::npos) << bad.body;
}

TEST_F(SiftServiceTest, SearchesAreMeteredWritesAreNot) {
  std::atomic<int64_t> now_ms{1'000'000};
  StartService(PinnedLink("full", 256, [&now_ms] { return now_ms.load(); }));
  hilo::LoadMeter& meter = link_->meter();
  meter.Take(now_ms.load());  // a fresh window
  for (int q = 0; q < 6; ++q) ASSERT_EQ(Search(q, 10).status, 200);
  EXPECT_EQ(Search(0, 10, {{"nprobe", -3}}).status, 400);  // a bad search is still an arrival
  HttpTestClient http(service_->port());
  json item = {{"id", 20000}, {"text", LoadSift().vec(5)}};
  ASSERT_EQ(http.Request("POST", "/v1/upsert", json{{"items", {item}}}.dump()).status, 200);
  ASSERT_EQ(http.Request("GET", "/v1/stats").status, 200);
  now_ms += 1000;
  const hilo::LoadReport r = meter.Take(now_ms.load());
  EXPECT_DOUBLE_EQ(r.arrival_rate, 7.0) << "7 searches in 1 s; the write and the stats read are not metered";
  EXPECT_EQ(r.in_flight, 0);
  EXPECT_EQ(r.queue_depth, 0);
  EXPECT_GT(r.p99_ms, 0);
  EXPECT_GT(r.utilisation, 0);
  HttpTestClient metrics(service_->port());
  EXPECT_NE(metrics.Request("GET", "/metrics").body.find("keel_vector_hilo_state 0"), std::string::npos);
}

TEST_F(SiftServiceTest, ServerRejectionsAreMeteredAsShed) {
  std::atomic<int64_t> now_ms{1'000'000};
  // One handler thread; every search takes 1.5 s (the test adversary's slow mode, all queries).
  StartService(PinnedLink("full", 1, [&now_ms] { return now_ms.load(); }), 1, trust::AdversaryMode::kSlow);
  hilo::LoadMeter& meter = link_->meter();
  meter.Take(now_ms.load());
  std::thread first([&] { EXPECT_EQ(Search(1, 10).status, 200); });
  // Wait (bounded) until the first search holds the only handler thread, then send a second.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (service_->active_requests() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(service_->active_requests(), 1);
  EXPECT_EQ(Search(2, 10).status, 503) << "no free handler thread: the server refuses";
  first.join();
  // The handler may still be returning after its answer was read: wait (bounded) until it is free.
  const auto free_by = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (service_->active_requests() != 0 && std::chrono::steady_clock::now() < free_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(Search(3, 10).status, 200);  // folds the refusal in as it arrives
  now_ms += 1000;
  const hilo::LoadReport r = meter.Take(now_ms.load());
  EXPECT_DOUBLE_EQ(r.arrival_rate, 3.0) << "two served, one shed";
}

// Polls `done` up to 30 s (a bound, so a broken link fails the test instead of hanging it).
bool Eventually(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

TEST_F(SiftServiceTest, FollowsAControllerOverHttp) {
  hilo::ControllerServerOptions co;
  co.allow_unvalidated = true;  // the test catalog has no binaries fingerprint
  co.decide_interval_ms = 50;
  auto server = hilo::ControllerServer::Create(VectorCatalog(), co);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  ASSERT_TRUE((*server)->Pin("narrow").ok());
  HiloLinkFlags f;
  f.url = "http://127.0.0.1:" + std::to_string((*server)->port());
  f.instance = "vector-follow";
  auto link = OpenHiloLink(f, 256);  // fetches the controller's catalog, starts polling
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  ASSERT_NE(*link, nullptr);
  StartService(*link);
  EXPECT_TRUE(Eventually([&] { return Search(4, 10).Header("x-keel-hilo-state") == "narrow"; }));
  ASSERT_TRUE((*server)->Pin("full").ok());  // the controller moves the product: the next searches follow
  EXPECT_TRUE(Eventually([&] { return Search(4, 10).Header("x-keel-hilo-state") == "full"; }));
  EXPECT_TRUE(Eventually([&] { return link_->reports_ok() > 0; })) << "load reports reach the controller";
  link_->Stop();  // before the controller goes
  (*server)->Stop();
}

// A plain-mode router over 2 shards x 3 replicas: the level's fanout is how many replicas each
// shard's query goes to.
class HiloRouterTest : public cluster_test::RouterTest {
 protected:
  void StartRouterWithLink(std::shared_ptr<hilo::ServiceLink> link) {
    link_ = link;
    const std::string path = dir_.file("cluster.json");
    std::ofstream(path) << Config("plain").dump(2);
    auto o = LoadRouterConfig(path);
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    o->port = 0;
    o->sync_interval_ms = 100;
    o->hilo = std::move(link);
    auto router = Router::Start(*o);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    router_ = std::move(router).value();
  }
  int64_t ReplicaSearches() {
    int64_t n = 0;
    for (auto& shard : replicas_) {
      for (auto& r : shard) n += r->shard().Stats().searches;
    }
    return n;
  }
  void TearDown() override {
    RouterTest::TearDown();
    if (link_) link_->Stop();
  }
  std::shared_ptr<hilo::ServiceLink> link_;
};

TEST_F(HiloRouterTest, PlainModeAsksTheLevelsFanoutPerShard) {
  StartCluster();
  StartRouterWithLink(PinnedLink("narrow", 256));  // fanout 1
  LoadAll();
  std::mt19937 rng(9);
  const int64_t before = ReplicaSearches();
  constexpr int kQueries = 4;
  for (int q = 0; q < kQueries; ++q) {
    auto res = Post("/v1/search", {{"text", cluster_test::RandomVector(rng)}, {"k", 10}});
    ASSERT_EQ(res.status, 200) << res.body;
    EXPECT_EQ(res.Header("x-keel-hilo-state"), "narrow");
  }
  EXPECT_TRUE(Eventually([&] { return ReplicaSearches() - before == kShards * kQueries; }));
  EXPECT_EQ(ReplicaSearches() - before, kShards * kQueries) << "fanout 1: one replica per shard";

  ASSERT_TRUE(link_->Pin("full").ok());  // fanout 3
  const int64_t mid = ReplicaSearches();
  for (int q = 0; q < kQueries; ++q) {
    auto res = Post("/v1/search", {{"text", cluster_test::RandomVector(rng)}, {"k", 10}});
    ASSERT_EQ(res.status, 200) << res.body;
    EXPECT_EQ(res.Header("x-keel-hilo-state"), "full");
  }
  EXPECT_TRUE(Eventually([&] { return ReplicaSearches() - mid == kShards * kReplicas * kQueries; }))
      << ReplicaSearches() - mid;
  json stats = json::parse(Call(router_->port(), "GET", "/v1/stats").body, nullptr, false);
  EXPECT_EQ(stats["hilo_state"], "full");
}

TEST(OpenHiloLinkTest, NoFlagsNoLinkAndBadFlagsAreRefused) {
  auto none = OpenHiloLink({}, 4);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);

  test::TempDir dir("keel-hilo-flags");
  const std::string catalog = dir.file("catalog.json");
  std::ofstream(catalog) << hilo::WriteCatalog(VectorCatalog());
  auto flags = [](std::string url, std::string catalog, std::string state, std::string instance = "") {
    HiloLinkFlags f;
    f.url = std::move(url);
    f.catalog = std::move(catalog);
    f.state = std::move(state);
    f.instance = std::move(instance);
    return f;
  };
  auto refused = [](const HiloLinkFlags& f, const std::string& needle) {
    auto r = OpenHiloLink(f, 4);
    if (r.ok()) return ::testing::AssertionFailure() << "accepted";
    if (r.status().code() != StatusCode::kInvalidArgument || r.status().message().find(needle) == std::string::npos) {
      return ::testing::AssertionFailure() << r.status().ToString();
    }
    return ::testing::AssertionSuccess();
  };
  EXPECT_TRUE(refused(flags("", "", "full"), "--hilo-state"));
  HiloLinkFlags no_meter;
  no_meter.meter = false;
  EXPECT_TRUE(refused(no_meter, "--hilo-no-meter"));
  EXPECT_TRUE(refused(flags("", catalog, ""), "--hilo-state"));
  EXPECT_TRUE(refused(flags("http://127.0.0.1:1", catalog, "full"), "exclude"));
  EXPECT_TRUE(refused(flags("", catalog, "nope"), "nope"));
  EXPECT_TRUE(refused(flags("ftp://x", "", "full"), "http://"));
  const std::string broken = dir.file("broken.json");
  std::ofstream(broken) << "{\"format\": 1";
  EXPECT_TRUE(refused(flags("", broken, "full"), broken));

  auto pinned = OpenHiloLink(flags("", catalog, "narrow", "vec-1"), 4);
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  EXPECT_EQ((*pinned)->Current().name, "narrow");
  EXPECT_EQ((*pinned)->Current().vector.nprobe, 1);
  (*pinned)->Stop();
}

}  // namespace
}  // namespace keel::vector
