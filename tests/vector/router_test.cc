// keel vector-router against real replicas: 2 shards x 3 replicas (zones a, b, c), each a
// keel::vector::Service on a loopback port with its own Ed25519 key and HNSW seed. Writes go
// through the router; searches are compared with exact L2 over everything written (what one
// shard holding every item answers).
#include "keel/vector/wal.h"
#include "tests/vector/cluster_fixture.h"

namespace keel::vector {
namespace {

using namespace cluster_test;  // NOLINT: the fixture and its helpers

TEST_F(RouterTest, SearchesEqualOneShardHoldingEverythingAndAreVerified) {
  StartCluster();
  StartRouter(Config("trust"));
  LoadAll();
  std::mt19937 rng(42);
  for (int q = 0; q < 20; ++q) {
    const std::vector<float> query = RandomVector(rng);
    json answer = Search({{"kind", "text"}, {"text", query}, {"k", 10}, {"ef", 512}});
    ASSERT_TRUE(answer["verified"].get<bool>()) << answer.dump();
    EXPECT_EQ(Ids(answer), Nearest(query, 10, written_)) << answer.dump();
    for (const auto& h : answer["hits"]) {
      EXPECT_NEAR(h["text_distance"].get<double>(), L2(TextOf(h["id"].get<uint64_t>()), query), 1e-4);
    }
    ASSERT_EQ(answer["shards"].size(), 2u);
    for (const auto& s : answer["shards"]) {
      EXPECT_EQ(s["status"], "verified");
      EXPECT_EQ(s["index_version"], 4);
      std::set<std::string> zones;
      for (const auto& id : s["replicas"]) zones.insert(id.get<std::string>().substr(3));
      EXPECT_GE(zones.size(), 2u) << s.dump();  // a quorum from two failure domains
    }
  }
}

TEST_F(RouterTest, MultimodalAndImageLookupsMergeAsOneShardRanks) {
  StartCluster();
  StartRouter(Config("trust"));
  LoadAll();
  std::mt19937 rng(9);
  const std::vector<float> text = RandomVector(rng), image = RandomVector(rng);
  json answer = Search({{"kind", "multimodal"}, {"text", text}, {"image", image}, {"k", 10}, {"ef", 512}});
  ASSERT_TRUE(answer["verified"].get<bool>()) << answer.dump();
  // One shard: the 10 nearest by text, re-ranked by image distance.
  std::vector<uint64_t> expected = Nearest(text, 10, written_);
  std::sort(expected.begin(), expected.end(), [&](uint64_t a, uint64_t b) { return L2(ImageOf(a), image) < L2(ImageOf(b), image); });
  EXPECT_EQ(Ids(answer), expected) << answer.dump();

  const std::vector<uint64_t> asked = {1999, 4, 77, 1000, 5};
  json lookup = Search({{"kind", "image"}, {"ids", asked}});
  ASSERT_TRUE(lookup["verified"].get<bool>()) << lookup.dump();
  EXPECT_EQ(Ids(lookup), asked);
  for (const auto& h : lookup["hits"]) EXPECT_EQ(h["image"].get<std::vector<float>>(), ImageOf(h["id"].get<uint64_t>()));
  // Ids 1999 and 77 are shard 1's, 4, 1000 and 5 shard 0's: both asked.
  EXPECT_EQ(lookup["shards"].size(), 2u);
  json one_shard = Search({{"kind", "image"}, {"ids", {4, 6}}});
  EXPECT_EQ(one_shard["shards"].size(), 1u) << one_shard.dump();
}

TEST_F(RouterTest, MultimodalItemsWithoutAnImageRankLastAsOneShardRanks) {
  StartCluster();
  StartRouter(Config("trust"));
  LoadAll();
  std::mt19937 rng(77);
  const std::vector<float> text = RandomVector(rng), image = RandomVector(rng);
  // Six items without an image vector, nearer the query's text than anything else, on both shards.
  json items = json::array();
  for (uint64_t j = 0; j < 6; ++j) {
    std::vector<float> v = text;
    v[0] += 0.001f * static_cast<float>(j + 1);
    items.push_back({{"id", 5000 + j}, {"text", v}});
  }
  ASSERT_EQ(Post("/v1/upsert", {{"items", items}}).status, 200);
  json answer = Search({{"kind", "multimodal"}, {"text", text}, {"image", image}, {"k", 10}, {"ef", 512}});
  ASSERT_TRUE(answer["verified"].get<bool>()) << answer.dump();
  // One shard: the 10 nearest by text (the six, then the four nearest others), the ones with an
  // image by image distance, then the six in text order.
  std::vector<uint64_t> expected = Nearest(text, 4, written_);
  std::sort(expected.begin(), expected.end(), [&](uint64_t a, uint64_t b) { return L2(ImageOf(a), image) < L2(ImageOf(b), image); });
  for (uint64_t j = 0; j < 6; ++j) expected.push_back(5000 + j);
  EXPECT_EQ(Ids(answer), expected) << answer.dump();
  for (size_t i = 4; i < answer["hits"].size(); ++i) EXPECT_EQ(answer["hits"][i]["image_distance"], 0.0);
}

TEST_F(RouterTest, ReplicaStoppedDuringWritesCatchesUpAfterRestart) {
  StartCluster();
  StartRouter(Config("trust"), /*sync_interval_ms=*/100);
  LoadAll();
  StopReplica(1, 1);  // s1-b misses the next two writes
  HttpTestResponse up = Post("/v1/upsert", Batch(2000, 2100));
  ASSERT_EQ(up.status, 200) << up.body;
  json shard1 = json::parse(up.body)["shards"][1];
  EXPECT_EQ(shard1["applied"].size(), 2u) << up.body;
  HttpTestResponse del = Post("/v1/delete", {{"ids", {1, 3, 5}}});
  ASSERT_EQ(del.status, 200) << del.body;
  EXPECT_EQ(ReplicaVersion(1, 0), 6u);

  StartReplica(1, 1);
  ASSERT_TRUE(Eventually([&] { return ReplicaVersion(1, 1) == 6; })) << "s1-b still at version " << ReplicaVersion(1, 1);
  // Its own answers now hold what it missed: item 2001 is there, item 3 is gone.
  HttpTestResponse res = Call(options_[1][1].port, "POST", "/v1/search",
                              json{{"text", TextOf(2001)}, {"k", 1}, {"ef", 512}}.dump());
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_EQ(Ids(json::parse(res.body)), std::vector<uint64_t>{2001});
  res = Call(options_[1][1].port, "POST", "/v1/search", json{{"text", TextOf(3)}, {"k", 1}, {"ef", 512}}.dump());
  EXPECT_NE(Ids(json::parse(res.body)), std::vector<uint64_t>{3});
  EXPECT_GE(MetricValue(Call(router_->port(), "GET", "/metrics").body, "keel_router_catch_ups_total"), 1);
}

// Snapshotting truncates every replica's log, after which a replica that missed writes cannot
// copy them from its peers: the router refuses while one is down or behind, says which, and
// snapshots once it caught up (or when forced).
TEST_F(RouterTest, SnapshotIsRefusedWhileAReplicaIsDownOrBehind) {
  StartCluster();
  StartRouter(Config("trust"), /*sync_interval_ms=*/0);
  LoadAll();
  StopReplica(0, 2);
  ASSERT_EQ(Post("/v1/upsert", Batch(2000, 2050)).status, 200);
  const int64_t wal_before = replicas_[0][0]->shard().Stats().wal_bytes;
  HttpTestResponse res = Call(router_->port(), "POST", "/v1/snapshot", "{}");
  EXPECT_EQ(res.status, 409) << res.body;
  EXPECT_NE(res.body.find("s0-c (unreachable)"), std::string::npos) << res.body;
  EXPECT_EQ(replicas_[0][0]->shard().Stats().wal_bytes, wal_before) << "nothing is snapshotted";
  EXPECT_EQ(Call(router_->port(), "POST", "/v1/snapshot", "{\"force\": 1}").status, 400);
  EXPECT_EQ(Call(router_->port(), "POST", "/v1/snapshot", "[1]").status, 400);

  // Back up: the snapshot catches it up first, then every replica snapshots.
  StartReplica(0, 2);
  res = Call(router_->port(), "POST", "/v1/snapshot", "");
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_EQ(ReplicaVersion(0, 2), ReplicaVersion(0, 0));
  EXPECT_EQ(replicas_[0][2]->shard().Stats().wal_bytes, static_cast<int64_t>(Wal::kHeaderBytes));

  // Gone for good: forced, the others snapshot and the answer names the one that failed.
  StopReplica(1, 0);
  res = Call(router_->port(), "POST", "/v1/snapshot", "{\"force\": true}");
  EXPECT_EQ(res.status, 503) << res.body;
  EXPECT_NE(res.body.find("s1-a"), std::string::npos) << res.body;
  EXPECT_EQ(replicas_[1][1]->shard().Stats().wal_bytes, static_cast<int64_t>(Wal::kHeaderBytes));
}

TEST_F(RouterTest, WriteCatchesALaggingReplicaUpBeforeApplyingIt) {
  StartCluster();
  StartRouter(Config("trust"), /*sync_interval_ms=*/0);  // no background loop: the write must do it
  LoadAll();
  StopReplica(0, 2);
  ASSERT_EQ(Post("/v1/upsert", Batch(2000, 2050)).status, 200);
  StartReplica(0, 2);
  HttpTestResponse up = Post("/v1/upsert", Batch(2050, 2100));
  ASSERT_EQ(up.status, 200) << up.body;
  json shard0 = json::parse(up.body)["shards"][0];
  EXPECT_EQ(shard0["version"], 6);
  EXPECT_EQ(shard0["applied"].size(), 3u) << up.body;  // s0-c answered 409, got version 5, then 6
  EXPECT_EQ(ReplicaVersion(0, 2), 6u);
}

TEST_F(RouterTest, WriteWithoutAMajorityIs503NamingTheReplicas) {
  StartCluster();
  StartRouter(Config("trust"), /*sync_interval_ms=*/0);
  LoadAll();
  StopReplica(0, 0);
  StopReplica(0, 1);
  HttpTestResponse res = Post("/v1/upsert", Batch(3000, 3002));  // one item per shard
  ASSERT_EQ(res.status, 503) << res.body;
  const std::string message = json::parse(res.body)["error"]["message"];
  EXPECT_NE(message.find("s0-a"), std::string::npos) << message;
  EXPECT_NE(message.find("s0-b"), std::string::npos) << message;
  EXPECT_EQ(message.find("s0-c:"), std::string::npos) << message;
  // Shard 1 alone still takes writes.
  EXPECT_EQ(Post("/v1/upsert", Batch(3001, 3002)).status, 200);
  EXPECT_EQ(Post("/v1/delete", {{"ids", {3001}}}).status, 200);
}

// A compromised replica writes on its own (its version runs ahead of the router's): the sync
// loop must not copy that write to its honest peers, nor let it into a verified answer, and
// the router's next writes still commit on the others.
TEST_F(RouterTest, AWriteAReplicaMadeUpIsNeverCopiedToItsPeers) {
  StartCluster();
  StartRouter(Config("trust"), /*sync_interval_ms=*/50);
  LoadAll();
  const uint64_t forged = 6666;  // even: shard 0
  const json item = {{"items", {{{"id", forged}, {"text", TextOf(forged)}, {"image", ImageOf(forged)}}}}};
  ASSERT_EQ(Call(options_[0][0].port, "POST", "/v1/upsert", item.dump()).status, 200);
  ASSERT_EQ(ReplicaVersion(0, 0), 5u);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // ten sync rounds
  EXPECT_EQ(ReplicaVersion(0, 1), 4u);
  EXPECT_EQ(ReplicaVersion(0, 2), 4u);
  json answer = Search({{"kind", "text"}, {"text", TextOf(forged)}, {"k", 1}, {"ef", 512}});
  if (!Ids(answer).empty() && Ids(answer)[0] == forged) EXPECT_FALSE(answer["verified"].get<bool>()) << answer.dump();

  // The router's own version 5: s0-a already holds a version 5 and is not counted.
  StopReplica(0, 2);
  HttpTestResponse up = Post("/v1/upsert", Batch(3000, 3001));  // id 3000: shard 0
  ASSERT_EQ(up.status, 503) << up.body;  // only s0-b applied it
  EXPECT_NE(up.body.find("already held version 5"), std::string::npos) << up.body;
  // s0-c comes back at 4: its peers both hold a version 5, but different writes: nothing copied.
  StartReplica(0, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(ReplicaVersion(0, 2), 4u);
  HttpTestResponse res = Call(options_[0][2].port, "POST", "/v1/search",
                              json{{"text", TextOf(forged)}, {"k", 1}, {"ef", 512}}.dump());
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_NE(Ids(json::parse(res.body)), std::vector<uint64_t>{forged});
}

TEST_F(RouterTest, PlainModeAnswersWithTheFirstValidReply) {
  StartCluster([](int, int r, ServiceOptions& o) {
    if (r == 0) {  // every shard's zone-a replica answers searches after 1.5 s
      o.identity.adversary.mode = trust::AdversaryMode::kSlow;
      o.identity.adversary.delay = std::chrono::milliseconds(1500);
    }
  });
  StartRouter(Config("plain"));  // no public keys: plain mode checks no signature
  LoadAll();
  std::mt19937 rng(5);
  for (int q = 0; q < 5; ++q) {
    const std::vector<float> query = RandomVector(rng);
    json answer = Search({{"text", query}, {"k", 10}, {"ef", 512}});
    EXPECT_FALSE(answer["verified"].get<bool>());
    EXPECT_EQ(Ids(answer), Nearest(query, 10, written_));
    for (const auto& s : answer["shards"]) {
      EXPECT_EQ(s["status"], "unchecked");
      ASSERT_EQ(s["replicas"].size(), 1u);
      EXPECT_NE(s["replicas"][0].get<std::string>().substr(3), "a") << "the slow replica cannot be first";
    }
  }
  const std::string metrics = Call(router_->port(), "GET", "/metrics").body;
  EXPECT_EQ(MetricValue(metrics, "keel_trust_verdicts_total{verdict=\"verified\"}"), 0);
}

TEST_F(RouterTest, ForgedReplyIsDiscardedAndCounted) {
  StartCluster([](int s, int r, ServiceOptions& o) {
    if (s == 0 && r == 2) {  // s0-c signs with a key the router does not know
      o.identity.signing_key = std::make_shared<const trust::SigningKey>(trust::SigningKey::Generate().value());
    }
  });
  json config = Config("trust");
  config["trust"] = {{"fanout", 3}};  // ask every replica, so s0-c is asked every time
  StartRouter(config);
  LoadAll();
  constexpr int kSearches = 5;
  std::mt19937 rng(11);
  for (int q = 0; q < kSearches; ++q) {
    const std::vector<float> query = RandomVector(rng);
    json answer = Search({{"text", query}, {"k", 10}, {"ef", 512}});
    ASSERT_TRUE(answer["verified"].get<bool>()) << answer.dump();
    EXPECT_EQ(Ids(answer), Nearest(query, 10, written_));
    for (const auto& id : answer["shards"][0]["replicas"]) EXPECT_NE(id, "s0-c");
  }
  const std::string sample = "keel_trust_replies_total{outcome=\"bad_signature\"}";
  ASSERT_TRUE(Eventually([&] { return MetricValue(Call(router_->port(), "GET", "/metrics").body, sample) == kSearches; }))
      << Call(router_->port(), "GET", "/metrics").body;
}

TEST_F(RouterTest, StatsHealthAndBadRequests) {
  StartCluster();
  StartRouter(Config("trust"));
  LoadAll();
  EXPECT_EQ(Call(router_->port(), "GET", "/healthz").status, 200);
  json stats = json::parse(Call(router_->port(), "GET", "/v1/stats").body);
  EXPECT_EQ(stats["mode"], "trust");
  EXPECT_EQ(stats["shards"][1]["committed_version"], 4);
  EXPECT_EQ(stats["shards"][1]["replicas"].size(), 3u);
  HttpTestResponse res = Post("/v1/search", {{"text", std::vector<float>(kDim + 1, 0.5f)}});
  EXPECT_EQ(res.status, 400);
  EXPECT_NE(res.body.find("expected 16"), std::string::npos) << res.body;
  res = Post("/v1/search", {{"text", std::vector<float>(kDim, 0.5f)}, {"nonce", std::string(100, 'x')}});
  EXPECT_EQ(res.status, 400) << res.body;
  res = Post("/v1/upsert", {{"items", {{{"id", 1}, {"text", {1, 2}}}}}});
  EXPECT_EQ(res.status, 400);
  EXPECT_NE(res.body.find("items[0]: text has 2 values"), std::string::npos) << res.body;
  res = Post("/v1/search", {{"text", std::vector<float>(kDim, 1e38f)}});  // every replica refuses it
  EXPECT_EQ(res.status, 400) << res.body;
  EXPECT_NE(res.body.find("overflow"), std::string::npos) << res.body;
  res = Post("/v1/upsert", json{{"items", json::array({Batch(7, 8)["items"][0], Batch(7, 8)["items"][0]})}});
  EXPECT_EQ(res.status, 400) << res.body;
  const std::string metrics = Call(router_->port(), "GET", "/metrics").body;
  EXPECT_GE(MetricValue(metrics, "keel_router_requests_total{route=\"/v1/search\",code=\"400\"}"), 2);
  EXPECT_NE(metrics.find("keel_router_replica_version{replica=\"s1-c\"} 4"), std::string::npos) << metrics;
  // Snapshot through the router: every replica writes one and empties its log.
  res = Call(router_->port(), "POST", "/v1/snapshot", "{}");
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_EQ(json::parse(res.body)["replicas"], kShards * kReplicas);
  for (int s = 0; s < kShards; ++s) {
    for (int r = 0; r < kReplicas; ++r) EXPECT_EQ(replicas_[s][r]->shard().Stats().wal_bytes, static_cast<int64_t>(Wal::kHeaderBytes)) << ReplicaId(s, r);
  }
}

// ---- config

json ValidConfig() {
  return {{"mode", "trust"},
          {"shards",
           {{{"id", 0}, {"replicas", {{{"id", "s0-a"}, {"url", "http://127.0.0.1:7410"}, {"zone", "a"}, {"public_key", "k/a.pub"}},
                                      {{"id", "s0-b"}, {"url", "http://127.0.0.1:7411"}, {"zone", "b"}, {"public_key", "k/b.pub"}}}}},
            {{"id", 1}, {"replicas", {{{"id", "s1-a"}, {"url", "http://127.0.0.1:7412"}, {"zone", "a"}, {"public_key", "k/c.pub"}},
                                      {{"id", "s1-b"}, {"url", "http://127.0.0.1:7413"}, {"zone", "b"}, {"public_key", "k/d.pub"}}}}}}}};
}

std::string ConfigError(const std::function<void(json&)>& edit) {
  json c = ValidConfig();
  edit(c);
  auto o = ParseRouterConfig(c.dump(), "/etc/keel");
  return o.ok() ? "accepted" : o.status().message();
}

TEST(RouterConfigTest, ValidConfigResolvesKeysAgainstItsDirectory) {
  auto o = ParseRouterConfig(ValidConfig().dump(), "/etc/keel");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->shards.size(), 2u);
  EXPECT_EQ(o->shards[0].replicas[1].public_key, "/etc/keel/k/b.pub");
  EXPECT_EQ(o->trust.quorum, 2);
  json tuned_config = ValidConfig();
  tuned_config["trust"] = {{"hedge_ms", 0}, {"depth", 1.5}, {"fanout", 3}};
  auto tuned = ParseRouterConfig(tuned_config.dump(), "");
  ASSERT_TRUE(tuned.ok()) << tuned.status().ToString();
  EXPECT_EQ(tuned->trust.hedge.count(), 0);
  EXPECT_EQ(tuned->trust.depth, 1.5);
  EXPECT_EQ(tuned->trust.fanout, 3);
  EXPECT_EQ(tuned->shards[0].replicas[0].public_key, "k/a.pub");  // no directory: as written
  EXPECT_EQ(o->mode, RouterMode::kTrust);
}

TEST(RouterConfigTest, ErrorsNameTheField) {
  auto has = [](const std::string& message, const std::string& field) {
    return message.find(field) != std::string::npos ? ::testing::AssertionSuccess()
                                                    : ::testing::AssertionFailure() << "'" << message << "' does not name " << field;
  };
  EXPECT_TRUE(has(ConfigError([](json& c) { c.erase("shards"); }), "shards"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["shards"][1]["id"] = 2; }), "shards[1].id"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["shards"][0]["replicas"][1]["url"] = "127.0.0.1:7411"; }), "shards[0].replicas[1].url"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["shards"][0]["replicas"][1].erase("zone"); }), "shards[0].replicas[1].zone"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["shards"][1]["replicas"][0]["id"] = "s0-a"; }), "shards[1].replicas[0].id"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["shards"][1]["replicas"][0].erase("public_key"); }), "shards[1].replicas[0].public_key"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["trust"] = {{"quorum", 0}}; }), "trust.quorum"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["trust"] = {{"threshold", 2.0}}; }), "trust.threshold"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["trust"] = {{"deadline_ms", "fast"}}; }), "trust.deadline_ms"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["trust"] = {{"hedge_ms", -1}}; }), "trust.hedge_ms"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["tust"] = json::object(); }), "tust"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["mode"] = "fast"; }), "mode"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["plain"] = {{"fanout", -1}}; }), "plain.fanout"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["text_dim"] = 0; }), "text_dim"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["shards"][0]["replicas"] = json::array(); }), "shards[0].replicas"));
  // Shards that could never give a verified answer.
  EXPECT_TRUE(has(ConfigError([](json& c) { c["trust"] = {{"quorum", 3}}; }), "shards[0]: 2 replicas in 2 zones can never"));
  EXPECT_TRUE(has(ConfigError([](json& c) { c["shards"][1]["replicas"][1]["zone"] = "a"; }), "shards[1]: 2 replicas in 1 zones"));
  // Plain mode needs no keys.
  EXPECT_EQ(ConfigError([](json& c) {
              c["mode"] = "plain";
              c["shards"][1]["replicas"][0].erase("public_key");
            }),
            "accepted");
}

TEST(RouterConfigTest, FileErrorsNameTheFileAndMissingKeysTheReplica) {
  test::TempDir dir("keel-router-config");
  EXPECT_EQ(LoadRouterConfig(dir.file("absent.json")).status().code(), StatusCode::kNotFound);
  std::ofstream(dir.file("bad.json")) << "{\"shards\": [";
  auto bad = LoadRouterConfig(dir.file("bad.json"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(dir.file("bad.json")), std::string::npos) << bad.status().message();
  std::ofstream(dir.file("c.json")) << ValidConfig().dump();
  auto o = LoadRouterConfig(dir.file("c.json"));
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  o->port = 0;
  auto router = Router::Start(*o);  // k/a.pub does not exist
  ASSERT_FALSE(router.ok());
  EXPECT_NE(router.status().message().find("s0-a"), std::string::npos) << router.status().message();
  EXPECT_NE(router.status().message().find("public_key"), std::string::npos) << router.status().message();
}

}  // namespace
}  // namespace keel::vector
