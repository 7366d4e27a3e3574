// TrustANN end to end: keel vector-router in trust mode over real replicas (in-process
// keel::vector::Service, and one `keel vector` process for the crash test), some of them
// compromised. Every tampered reply is validly signed by a registered key; what must hold:
//   - with fewer compromised replicas per shard than the quorum, no answer served as verified is
//     tampered (audited against the honest replicas' own answers), over thousands of queries;
//   - a colluding majority inside one zone gives "unverified", never a silent answer;
//   - a replica that crashes during a query costs an escalation, and the answer is verified
//     before the deadline;
//   - hostile replies (oversized, NaN distances, duplicate or out-of-shard ids) are refused and
//     counted, and the answer is still the exact one.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "keel/vector/replica_client.h"
#include "keel/vector/trust/audit.h"
#include "keel/vector/wire.h"
#include "tests/kvstore/redis_process.h"  // PortAccepts
#include "tests/vector/cluster_fixture.h"

namespace keel::vector {
namespace {

using namespace cluster_test;  // NOLINT: the fixture and its helpers

class TrustClusterTest : public RouterTest {
 protected:
  // Replica 0 (zone a) of every shard runs `mode`.
  void StartWithAttacker(trust::AdversaryMode mode, int strength) {
    StartCluster([&](int, int r, ServiceOptions& o) {
      if (r != 0) return;
      o.identity.adversary.mode = mode;
      o.identity.adversary.seed = 7;
      o.identity.adversary.strength = strength;
    });
  }

  // The honest replicas' own answers to `query` per shard (in-process, as the router asks them).
  std::vector<std::vector<std::vector<trust::SignedHit>>> HonestAnswers(const std::vector<float>& query, int k,
                                                                       const std::set<int>& compromised) {
    std::vector<std::vector<std::vector<trust::SignedHit>>> out(kShards);
    SearchRequest req;
    req.text_query = query;
    req.k = k;
    req.ef = 512;
    for (int s = 0; s < kShards; ++s) {
      for (int r = 0; r < kReplicas; ++r) {
        if (compromised.count(r)) continue;
        auto res = replicas_[s][r]->shard().Search(req);
        EXPECT_TRUE(res.ok()) << res.status().ToString();
        std::vector<trust::SignedHit> hits;
        if (res.ok()) {
          for (const SearchHit& h : res->hits) hits.push_back(trust::ToSignedHit(h));
        }
        out[static_cast<size_t>(s)].push_back(std::move(hits));
      }
    }
    return out;
  }

  // `queries` searches; every verified answer audited. Returns the verified count.
  int AuditQueries(int queries, uint32_t seed, const std::set<int>& compromised) {
    std::mt19937 rng(seed);
    int verified = 0;
    for (int q = 0; q < queries; ++q) {
      const std::vector<float> query = RandomVector(rng);
      const json answer = Search({{"kind", "text"}, {"text", query}, {"k", 10}, {"ef", 512}});
      if (!answer.is_object() || !answer.value("verified", false)) continue;
      ++verified;
      std::vector<trust::SignedHit> got;
      for (const auto& h : answer["hits"]) got.push_back({h["id"].get<uint64_t>(), h["text_distance"].get<float>(), 0, 0});
      const trust::TamperCheck check = trust::CheckAgainstHonest(got, 10, kShards, HonestAnswers(query, 10, compromised));
      EXPECT_FALSE(check.tampered) << "query " << q << ": " << check.why << "\n" << answer.dump();
      if (check.tampered) break;  // one failure says enough
    }
    return verified;
  }

  std::string Metrics() { return Call(router_->port(), "GET", "/metrics").body; }
};

// 600 queries per attack mode, 2,400 in all; the honest pair (zones b, c) is always there, so
// nearly every answer should be verified, and none of the verified ones tampered.
struct Attack {
  trust::AdversaryMode mode;
  int strength;
  const char* counted;  // a metric sample the attack must have moved
};

void PrintTo(const Attack& a, std::ostream* os) { *os << trust::AdversaryModeName(a.mode) << " strength " << a.strength; }

class TrustAttackTest : public TrustClusterTest, public ::testing::WithParamInterface<Attack> {};

TEST_P(TrustAttackTest, NoTamperedAnswerIsVerified) {
  StartWithAttacker(GetParam().mode, GetParam().strength);
  StartRouter(Config("trust"));
  LoadAll();
  EXPECT_GE(AuditQueries(600, static_cast<uint32_t>(GetParam().mode), {0}), 594);
  // The attacker's replies were authentic (validly signed), and still kept out.
  EXPECT_GT(MetricValue(Metrics(), GetParam().counted), 0) << Metrics();
}

INSTANTIATE_TEST_SUITE_P(
    Modes, TrustAttackTest,
    ::testing::Values(Attack{trust::AdversaryMode::kDrop, 3, "keel_trust_escalations_total"},
                      Attack{trust::AdversaryMode::kInject, 3, "keel_trust_escalations_total"},
                      Attack{trust::AdversaryMode::kReorder, 3, "keel_trust_escalations_total"},
                      Attack{trust::AdversaryMode::kStale, 1, "keel_trust_replies_total{outcome=\"stale\"}"}),
    [](const ::testing::TestParamInfo<Attack>& info) { return std::string(trust::AdversaryModeName(info.param.mode)); });

TEST_F(TrustClusterTest, ColludingMajorityInOneZoneIsUnverified) {
  // Zones a, a, b: the two replicas of zone a inject the same ids (same seed) and agree with each
  // other; zone b's honest replica agrees with neither. No group spans two zones.
  StartCluster([&](int, int r, ServiceOptions& o) {
    o.identity.zone = r < 2 ? "a" : "b";
    if (r < 2) {
      o.identity.adversary.mode = trust::AdversaryMode::kInject;
      o.identity.adversary.seed = 11;
      o.identity.adversary.strength = 4;
    }
  });
  StartRouter(Config("trust"));
  LoadAll();
  std::mt19937 rng(5);
  for (int q = 0; q < 50; ++q) {
    const json answer = Search({{"kind", "text"}, {"text", RandomVector(rng)}, {"k", 10}, {"ef", 512}});
    ASSERT_TRUE(answer.is_object());
    EXPECT_FALSE(answer["verified"].get<bool>()) << answer.dump();
    for (const auto& s : answer["shards"]) {
      EXPECT_EQ(s["status"], "unverified") << s.dump();
      EXPECT_FALSE(s.value("reason", "").empty()) << s.dump();
    }
  }
  EXPECT_LE(MetricValue(Metrics(), "keel_trust_verdicts_total{verdict=\"verified\"}"), 0);  // never one
}

// A `keel vector` process for replica s0-a, answering its searches after 3 s; SIGKILLed 300 ms
// into a query. The verifier (hedging off, so only the crash can make it escalate) must get the
// failed call back, ask zone c's replica and verify with b and c — well before the slow reply
// would have come and before the 2.5 s deadline.
TEST_F(TrustClusterTest, ReplicaCrashDuringAQueryEscalatesWithinTheDeadline) {
  StartCluster();
  StopReplica(0, 0);
  const ServiceOptions& o = options_[0][0];
  const std::string cmd = std::string("exec ") + KEEL_BINARY + " vector --dir " + o.shard.dir + " --port " + std::to_string(o.port) +
                          " --text-dim " + std::to_string(kDim) + " --image-dim " + std::to_string(kDim) +
                          " --hnsw-seed " + std::to_string(o.shard.index.hnsw_seed) + " --shard-id 0 --shards " + std::to_string(kShards) +
                          " --replica-id " + ReplicaId(0, 0) + " --zone a --signing-key " + dir_.file("keys/" + ReplicaId(0, 0) + ".key") +
                          " --adversary slow --adversary-delay-ms 3000 2>/dev/null";
  const pid_t child = ::fork();
  if (child == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(child, 0);
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  } reap{child};
  ASSERT_TRUE(Eventually([&] { return test::PortAccepts(o.port); }));
  json config = Config("trust");
  config["trust"] = {{"quorum", 2}, {"min_zones", 2}, {"fanout", 2}, {"hedge_ms", 0}, {"deadline_ms", 2500}};
  StartRouter(config);
  LoadAll();
  // A fresh router, so the verifier's rotation starts at replica 0: the first search of shard 0
  // asks replicas 0 (the process) and 1. An image lookup of shard 0's ids touches only shard 0.
  StartRouter(config);
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::kill(child, SIGKILL);
  });
  const auto t0 = std::chrono::steady_clock::now();
  const json answer = Search({{"kind", "image"}, {"ids", {0, 2, 4}}});
  const auto took = std::chrono::steady_clock::now() - t0;
  killer.join();
  ASSERT_TRUE(answer.is_object());
  EXPECT_TRUE(answer["verified"].get<bool>()) << answer.dump();
  EXPECT_EQ(Ids(answer), (std::vector<uint64_t>{0, 2, 4}));
  ASSERT_EQ(answer["shards"].size(), 1u);
  EXPECT_EQ(answer["shards"][0]["replicas"], json({ReplicaId(0, 1), ReplicaId(0, 2)})) << answer.dump();
  EXPECT_LT(took, std::chrono::milliseconds(2500));
  const std::string metrics = Metrics();
  EXPECT_GE(MetricValue(metrics, "keel_trust_escalations_total"), 1) << metrics;
  EXPECT_GE(MetricValue(metrics, "keel_trust_replies_total{outcome=\"unreachable\"}"), 1) << metrics;
}

// A compromised s0-a that relays everything to its real replica but rewrites search answers into
// one of the hostile shapes, re-signed with s0-a's registered key so that only the content checks
// can refuse them.
class HostileReplica {
 public:
  enum class Shape { kOversized, kNanDistance, kDuplicateIds, kOutOfShardId };

  HostileReplica(int real_port, std::shared_ptr<const trust::SigningKey> key, Shape shape)
      : client_(HttpEndpoint{"127.0.0.1", real_port}), key_(std::move(key)), shape_(shape) {
    HttpServerOptions o;
    o.max_body_bytes = 64 << 20;
    server_ = std::make_unique<HttpServer>(o, [this](const HttpRequest& req, HttpResponder& res) { Handle(req, res); });
    EXPECT_TRUE(server_->Start().ok());
  }
  ~HostileReplica() { server_->Stop(); }
  int port() const { return server_->port(); }
  int tampered() const { return tampered_.load(); }

 private:
  void Handle(const HttpRequest& req, HttpResponder& res) {
    if (req.path != "/v1/search") {
      auto r = client_.Call(req.method, req.target, req.body, "application/json", DeadlineIn(30000));
      if (!r.ok()) return (void)res.Send(502, "application/json", "{}");
      res.Send(r->status, "application/json", r->body);
      return;
    }
    json body = json::parse(req.body);
    SearchRequest parsed;
    std::string nonce;
    ASSERT_TRUE(wire::ParseSearchRequest(body, 1000, &parsed).ok());
    ASSERT_TRUE(wire::ParseNonce(body, &nonce).ok());
    if (shape_ == Shape::kOversized) body["k"] = parsed.k + 5;  // more hits than the router asked for
    auto r = client_.Call("POST", "/v1/search", body.dump(), "application/json", DeadlineIn(30000));
    ASSERT_TRUE(r.ok() && r->status == 200);
    json answer = json::parse(r->body);
    json& hits = answer["hits"];
    if (parsed.kind != QueryKind::kImage && hits.size() >= 3) {
      switch (shape_) {
        case Shape::kOversized: break;
        case Shape::kNanDistance: hits[1]["text_distance"] = std::nan(""); break;  // JSON writes null
        case Shape::kDuplicateIds: hits[2]["id"] = hits[0]["id"]; break;
        case Shape::kOutOfShardId: hits[1]["id"] = hits[1]["id"].get<uint64_t>() | 1; break;  // odd: shard 1's
      }
      tampered_.fetch_add(1);
    }
    // Re-sign what is now in the answer, for the query the router asked (its digest).
    trust::ReplyBody signed_body;
    std::string sig;
    if (wire::ParseSignedReply(answer, 100000, &signed_body, &sig).ok()) {
      signed_body.query = trust::DigestQuery(parsed, nonce);
      answer["trust"] = wire::TrustJson(signed_body, trust::SignReply(*key_, signed_body));
    }
    res.Send(200, "application/json", answer.dump());
  }

  ReplicaClient client_;
  std::shared_ptr<const trust::SigningKey> key_;
  Shape shape_;
  std::atomic<int> tampered_{0};
  std::unique_ptr<HttpServer> server_;
};

TEST_F(TrustClusterTest, HostileRepliesAreRefusedWithoutHarmingTheAnswer) {
  StartCluster();
  const int real_port = options_[0][0].port;
  for (auto [shape, outcome] : {std::pair{HostileReplica::Shape::kOversized, "malformed"},
                                std::pair{HostileReplica::Shape::kNanDistance, "malformed"},
                                std::pair{HostileReplica::Shape::kDuplicateIds, "malformed"},
                                std::pair{HostileReplica::Shape::kOutOfShardId, "wrong_shard"}}) {
    HostileReplica hostile(real_port, options_[0][0].identity.signing_key, shape);
    options_[0][0].port = hostile.port();  // the router's config points s0-a at the hostile relay
    json config = Config("trust");
    config["trust"] = {{"fanout", 3}};  // every replica answers every query
    StartRouter(config);
    if (written_.empty()) LoadAll();
    std::mt19937 rng(21);
    for (int q = 0; q < 20; ++q) {
      const std::vector<float> query = RandomVector(rng);
      const json answer = Search({{"kind", "text"}, {"text", query}, {"k", 10}, {"ef", 512}});
      ASSERT_TRUE(answer.is_object());
      EXPECT_TRUE(answer["verified"].get<bool>()) << outcome << ": " << answer.dump();
      EXPECT_EQ(Ids(answer), Nearest(query, 10, written_)) << outcome;
    }
    EXPECT_GT(hostile.tampered(), 0);
    EXPECT_GE(MetricValue(Metrics(), "keel_trust_replies_total{outcome=\"" + std::string(outcome) + "\"}"), 1)
        << outcome << "\n" << Metrics();
    router_->Stop();
    router_.reset();
  }
  options_[0][0].port = real_port;
}

}  // namespace
}  // namespace keel::vector
