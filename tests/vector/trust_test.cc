// The trust library on its own: signatures, digests, similarity, group selection, consensus, and
// Verify's escalation/deadline logic over an in-memory ReplicaSet (the HTTP replicas are exercised
// in router_test.cc and trust_cluster_test.cc).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "keel/vector/trust/adversary.h"
#include "keel/vector/trust/audit.h"
#include "keel/vector/trust/signed_reply.h"
#include "keel/vector/trust/verifier.h"

namespace keel::vector::trust {
namespace {

std::vector<SignedHit> Ranked(std::initializer_list<uint64_t> ids) {
  std::vector<SignedHit> hits;
  for (uint64_t id : ids) hits.push_back({id, static_cast<float>(id) * 0.5f, 0, 0});
  std::sort(hits.begin(), hits.end(), [](const SignedHit& a, const SignedHit& b) { return a.text_distance < b.text_distance; });
  return hits;
}

ReplyBody SampleBody(const QueryDigest& digest) {
  ReplyBody body;
  body.shard = 1;
  body.replica = "s1-a";
  body.zone = "a";
  body.index_version = 42;
  body.query = digest;
  body.hits = Ranked({3, 5, 9, 11});
  return body;
}

SearchRequest SampleRequest() {
  SearchRequest r;
  r.text_query = {1.0f, -2.5f, 0.0f, 3.25f};
  r.k = 4;
  r.filter["lang"] = "en";
  return r;
}

TEST(TrustSignature, TwoReplicasWithOneKeyAreRefused) {
  auto key = SigningKey::Generate();
  auto other = SigningKey::Generate();
  ASSERT_TRUE(key.ok() && other.ok());
  TrustStore store;
  ASSERT_TRUE(store.AddPem("s1-a", 1, "a", key->PublicKeyPem()).ok());
  ASSERT_TRUE(store.AddPem("s1-b", 1, "b", other->PublicKeyPem()).ok());
  Status s = store.AddPem("s1-c", 1, "c", key->PublicKeyPem());  // one holder could sign as two
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("same public key as replica s1-a"), std::string::npos) << s.message();
}

TEST(TrustSignature, SignedReplyVerifiesAndEveryTamperIsCaught) {
  auto key = SigningKey::Generate();
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  TrustStore store;
  ASSERT_TRUE(store.AddPem("s1-a", 1, "a", key->PublicKeyPem()).ok());
  const QueryDigest digest = DigestQuery(SampleRequest(), "nonce-1");
  const ReplyBody body = SampleBody(digest);
  const std::string sig = SignReply(*key, body);
  ASSERT_EQ(sig.size(), 128u);
  EXPECT_EQ(store.Verify(body, sig, 1, digest), ReplyFault::kNone);

  ReplyBody changed = body;
  changed.hits[0].text_distance += 0.001f;
  EXPECT_EQ(store.Verify(changed, sig, 1, digest), ReplyFault::kBadSignature);
  changed = body;
  std::swap(changed.hits[0], changed.hits[1]);
  EXPECT_EQ(store.Verify(changed, sig, 1, digest), ReplyFault::kBadSignature);
  changed = body;
  changed.index_version = 43;
  EXPECT_EQ(store.Verify(changed, sig, 1, digest), ReplyFault::kBadSignature);
  std::string bad_sig = sig;
  bad_sig[5] = bad_sig[5] == '0' ? '1' : '0';
  EXPECT_EQ(store.Verify(body, bad_sig, 1, digest), ReplyFault::kBadSignature);
  EXPECT_EQ(store.Verify(body, "zz", 1, digest), ReplyFault::kBadSignature);
  // The same signed reply presented for another query (another nonce): a replay.
  EXPECT_EQ(store.Verify(body, sig, 1, DigestQuery(SampleRequest(), "nonce-2")), ReplyFault::kReplay);
  // Asked shard 0: the replica is not one of its replicas.
  EXPECT_EQ(store.Verify(body, sig, 0, digest), ReplyFault::kUnknownReplica);
  changed = body;
  changed.replica = "s1-b";
  EXPECT_EQ(store.Verify(changed, sig, 1, digest), ReplyFault::kUnknownReplica);
  changed = body;
  changed.zone = "b";  // claims another failure domain than registered
  EXPECT_EQ(store.Verify(changed, sig, 1, digest), ReplyFault::kUnknownReplica);
  changed = body;
  changed.shard = 0;
  EXPECT_EQ(store.Verify(changed, sig, 1, digest), ReplyFault::kWrongShard);

  // A validly signed reply under another key (a replica not in the store speaking for s1-a).
  auto other = SigningKey::Generate();
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(store.Verify(body, SignReply(*other, body), 1, digest), ReplyFault::kBadSignature);
}

TEST(TrustSignature, DigestCoversEveryFieldAndTheNonce) {
  const SearchRequest base = SampleRequest();
  const QueryDigest d = DigestQuery(base, "n");
  EXPECT_EQ(d, DigestQuery(base, "n"));
  EXPECT_FALSE(d == DigestQuery(base, "m"));
  auto differs = [&](auto mutate) {
    SearchRequest r = base;
    mutate(r);
    return !(DigestQuery(r, "n") == d);
  };
  EXPECT_TRUE(differs([](SearchRequest& r) { r.k = 5; }));
  EXPECT_TRUE(differs([](SearchRequest& r) { r.ef = 10; }));
  EXPECT_TRUE(differs([](SearchRequest& r) { r.nprobe = 3; }));
  EXPECT_TRUE(differs([](SearchRequest& r) { r.text_query[2] = -0.0f; }));
  EXPECT_TRUE(differs([](SearchRequest& r) { r.kind = QueryKind::kMultimodal; }));
  EXPECT_TRUE(differs([](SearchRequest& r) { r.filter["lang"] = "de"; }));
  EXPECT_TRUE(differs([](SearchRequest& r) { r.include_vectors = true; }));
  EXPECT_TRUE(differs([](SearchRequest& r) { r.ids = {1}; }));
  // Moving a float between the text and image query changes the digest (lengths are encoded).
  EXPECT_TRUE(differs([](SearchRequest& r) {
    r.image_query = {r.text_query.back()};
    r.text_query.pop_back();
  }));
  auto hex = QueryDigest::FromHex(d.Hex());
  ASSERT_TRUE(hex.ok());
  EXPECT_EQ(*hex, d);
  EXPECT_FALSE(QueryDigest::FromHex("abc").ok());
  EXPECT_FALSE(QueryDigest::FromHex(std::string(64, 'g')).ok());
  EXPECT_NE(NewNonce(), NewNonce());
}

TEST(TrustSignature, KeyFilesRoundTripAndArePrivate) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("keel-trust-keys-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto key = SigningKey::Generate();
  ASSERT_TRUE(key.ok());
  const std::string priv = (dir / "r.key").string(), pub = (dir / "r.pub").string();
  ASSERT_TRUE(key->Save(priv, pub).ok());
  struct stat st {};
  ASSERT_EQ(::stat(priv.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // Refuses to overwrite an existing key.
  EXPECT_EQ(key->Save(priv, pub).code(), StatusCode::kInvalidArgument);

  auto loaded = SigningKey::Load(priv);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  TrustStore store;
  ASSERT_TRUE(store.AddFile("r", 0, "z", pub).ok());
  const QueryDigest digest = DigestQuery(SampleRequest(), "");
  ReplyBody body = SampleBody(digest);
  body.shard = 0;
  body.replica = "r";
  body.zone = "z";
  EXPECT_EQ(store.Verify(body, SignReply(*loaded, body), 0, digest), ReplyFault::kNone);
  EXPECT_EQ(store.AddFile("r", 0, "z", pub).code(), StatusCode::kInvalidArgument);  // duplicate id

  // A key readable by others is refused; a public key is not a private key; garbage is not a key.
  ::chmod(priv.c_str(), 0644);
  EXPECT_EQ(SigningKey::Load(priv).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SigningKey::Load((dir / "missing.key").string()).status().code(), StatusCode::kNotFound);
  const std::string junk = (dir / "junk.pub").string();
  std::ofstream(junk) << "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n";
  EXPECT_EQ(store.AddFile("j", 0, "z", junk).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.AddFile("k", 0, "z", priv).code(), StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

TEST(TrustSimilarity, OverlapRankAndScoreAgreement) {
  const auto a = Ranked({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  EXPECT_DOUBLE_EQ(Similarity(a, a, 10, 0.5), 1.0);
  // One id replaced at rank 10: overlap 0.9, ranks concordant.
  const auto b = Ranked({1, 2, 3, 4, 5, 6, 7, 8, 9, 12});
  EXPECT_NEAR(Similarity(a, b, 10, 0.5), 0.5 * 0.9 + 0.5, 1e-12);
  // Same ids, scores rewritten to reverse the order: the changed scores do not agree, so only the
  // ids whose score happens to match count as common.
  std::vector<SignedHit> reversed = a;
  std::reverse(reversed.begin(), reversed.end());
  for (size_t i = 0; i < reversed.size(); ++i) reversed[i].text_distance = a[i].text_distance;
  EXPECT_LT(Similarity(a, reversed, 10, 0.5), 0.6);
  // Same ids in another order with their true scores (an unsorted list): overlap 1, rank < 1.
  std::vector<SignedHit> shuffled = a;
  std::swap(shuffled[0], shuffled[9]);
  const double s = Similarity(a, shuffled, 10, 0.5);
  EXPECT_LT(s, 1.0);
  EXPECT_GT(s, 0.5);
  // Different vector digests for the same id: not common.
  std::vector<SignedHit> other_vec = a;
  other_vec[0].vector_digest = 77;
  EXPECT_NEAR(Similarity(a, other_vec, 10, 1.0), 0.9, 1e-12);
  // Only the first k hits matter.
  EXPECT_DOUBLE_EQ(Similarity(a, Ranked({1, 2, 3, 40, 50}), 3, 0.5), 1.0);
  EXPECT_DOUBLE_EQ(Similarity({}, {}, 10, 0.5), 1.0);
  EXPECT_DOUBLE_EQ(Similarity(a, {}, 10, 0.5), 0.5);  // no overlap; rank vacuous
}

TEST(TrustConsensus, KeepsOnlyIdsEveryMemberVouchesFor) {
  const auto h1 = Ranked({1, 2, 3, 4, 5, 6});
  const auto h2 = Ranked({1, 2, 3, 4, 5, 7});
  auto attacker = Ranked({1, 2, 3, 4, 5, 6});
  attacker[2].id = 999;  // injected, with the score of the hit it replaced
  auto c = Verifier::Consensus({&h1, &h2}, 5);
  ASSERT_EQ(c.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(c[i].id, i + 1);
  c = Verifier::Consensus({&h1, &attacker}, 10);
  for (const SignedHit& h : c) EXPECT_NE(h.id, 999u);
  EXPECT_EQ(c.size(), 5u);  // 3 dropped from the agreed set, 999 never added
  // A disagreeing score for an id removes it.
  auto liar = h1;
  liar[0].text_distance = 0.01f;
  c = Verifier::Consensus({&h1, &liar}, 10);
  for (const SignedHit& h : c) EXPECT_NE(h.id, 1u);
  // A member repeating an id does not duplicate it.
  auto dup = h1;
  dup.push_back(h1[0]);
  c = Verifier::Consensus({&dup, &h1}, 10);
  EXPECT_EQ(c.size(), h1.size());
}

TEST(TrustSelectGroup, QuorumZonesAndCollusion) {
  VerifierOptions o;
  o.quorum = 2;
  o.min_zones = 2;
  o.threshold = 0.8;
  Verifier v(o);
  const auto honest = Ranked({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto tampered = honest;
  for (int i = 0; i < 5; ++i) tampered[static_cast<size_t>(i * 2)].id = 1000 + static_cast<uint64_t>(i);
  double min_sim = 0;
  // Two colluders in zone a agree with each other; the honest replica in zone b agrees with neither.
  std::vector<Verifier::Candidate> c = {{"a", 7, &tampered}, {"a", 7, &tampered}, {"b", 7, &honest}};
  EXPECT_TRUE(v.SelectGroup(c, 10, &min_sim).empty());
  // An honest replica in zone c too: the honest pair (b, c) is chosen.
  c.push_back({"c", 7, &honest});
  auto g = v.SelectGroup(c, 10, &min_sim);
  EXPECT_EQ(g, (std::vector<int>{2, 3}));
  EXPECT_DOUBLE_EQ(min_sim, 1.0);
  // Two honest replicas in one zone are not enough when two zones are required...
  std::vector<Verifier::Candidate> one_zone = {{"a", 7, &honest}, {"a", 7, &honest}};
  EXPECT_TRUE(v.SelectGroup(one_zone, 10, &min_sim).empty());
  // ...and replies of different index versions never form a group.
  std::vector<Verifier::Candidate> versions = {{"a", 7, &honest}, {"b", 8, &honest}};
  EXPECT_TRUE(v.SelectGroup(versions, 10, &min_sim).empty());
  VerifierOptions one = o;
  one.min_zones = 1;
  EXPECT_EQ(Verifier(one).SelectGroup(one_zone, 10, &min_sim).size(), 2u);
}

// An in-memory ReplicaSet: each replica answers with a fixed reply after a delay on its own thread
// (or never answers within the test's deadline: a crashed replica whose call times out later).
class FixedReplicas final : public ReplicaSet {
 public:
  struct Replica {
    ReplicaInfo info;
    ReplicaReply reply;
    std::chrono::milliseconds delay{0};
  };
  explicit FixedReplicas(std::vector<Replica> replicas) : replicas_(std::move(replicas)) {}
  ~FixedReplicas() override {
    for (auto& t : threads_) t.join();
  }
  int size() const override { return static_cast<int>(replicas_.size()); }
  const ReplicaInfo& info(int i) const override { return replicas_[static_cast<size_t>(i)].info; }
  void Ask(int i, std::function<void(ReplicaReply)> done) override {
    asked_.fetch_add(1);
    Replica r = replicas_[static_cast<size_t>(i)];
    threads_.emplace_back([r, done = std::move(done)] {
      std::this_thread::sleep_for(r.delay);
      done(r.reply);
    });
  }
  int asked() const { return asked_.load(); }

 private:
  std::vector<Replica> replicas_;
  std::vector<std::thread> threads_;
  std::atomic<int> asked_{0};
};

ReplicaReply Reply(std::vector<SignedHit> hits, uint64_t version = 5) {
  ReplicaReply r;
  r.index_version = version;
  r.hits = std::move(hits);
  return r;
}

TEST(TrustVerify, EscalatesPastATamperedReplyToAFreshZone) {
  const auto honest = Ranked({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto injected = honest;
  for (size_t i = 0; i < 10; i += 3) injected[i].id = 5000 + i;
  FixedReplicas set({{{"t", "a"}, Reply(injected), {}}, {{"h1", "b"}, Reply(honest), {}}, {{"h2", "c"}, Reply(honest), {}}});
  VerifierOptions o;
  o.fanout = 2;
  o.deadline = std::chrono::milliseconds(5000);
  const ShardAnswer ans = Verifier(o).Verify(set, 10, 5);
  EXPECT_EQ(ans.verdict, Verdict::kVerified) << ans.reason;
  ASSERT_EQ(ans.hits.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(ans.hits[i].id, honest[i].id);
  for (int g : ans.group) EXPECT_NE(g, 0);
}

TEST(TrustVerify, TamperingWithinTheThresholdNeverReachesTheAnswer) {
  // A lax threshold lets the tampered reply into a group; its injected ids still cannot enter the
  // consensus, and the incomplete group makes Verify ask a fresh replica for a complete one.
  const auto honest = Ranked({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto injected = honest;
  for (size_t i = 0; i < 10; i += 3) injected[i].id = 5000 + i;
  VerifierOptions o;
  o.threshold = 0.5;
  o.fanout = 2;
  o.deadline = std::chrono::milliseconds(5000);
  {
    FixedReplicas set({{{"t", "a"}, Reply(injected), {}}, {{"h1", "b"}, Reply(honest), {}}, {{"h2", "c"}, Reply(honest), {}}});
    const ShardAnswer ans = Verifier(o).Verify(set, 10, 5);
    EXPECT_EQ(ans.verdict, Verdict::kVerified) << ans.reason;
    EXPECT_TRUE(ans.complete);
    ASSERT_EQ(ans.hits.size(), 10u);
    for (size_t i = 0; i < 10; ++i) EXPECT_EQ(ans.hits[i].id, honest[i].id);
    EXPECT_EQ(ans.escalations, 1);
  }
  {
    // No fresh replica to ask: the verified answer is the incomplete consensus, flagged so.
    FixedReplicas set({{{"t", "a"}, Reply(injected), {}}, {{"h1", "b"}, Reply(honest), {}}});
    const ShardAnswer ans = Verifier(o).Verify(set, 10, 5);
    EXPECT_EQ(ans.verdict, Verdict::kVerified);
    EXPECT_FALSE(ans.complete);
    EXPECT_EQ(ans.hits.size(), 6u);
    for (const SignedHit& h : ans.hits) EXPECT_LT(h.id, 5000u);
  }
}

TEST(TrustVerify, ColludingZoneIsUnverifiedNeverSilently) {
  const auto honest = Ranked({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto injected = honest;
  for (size_t i = 0; i < 10; i += 2) injected[i].id = 7000 + i;
  FixedReplicas set({{{"a1", "a"}, Reply(injected), {}}, {{"a2", "a"}, Reply(injected), {}}, {{"b1", "b"}, Reply(honest), {}}});
  VerifierOptions o;
  o.deadline = std::chrono::milliseconds(5000);
  const ShardAnswer ans = Verifier(o).Verify(set, 10, 5);
  EXPECT_EQ(ans.verdict, Verdict::kUnverified);
  EXPECT_FALSE(ans.reason.empty());
  EXPECT_EQ(ans.asked, 3);  // asked everyone before giving up
}

TEST(TrustVerify, StaleAndFaultyRepliesAreDiscardedAndCounted) {
  const auto honest = Ranked({1, 2, 3, 4, 5});
  ReplicaReply forged;
  forged.fault = ReplyFault::kBadSignature;
  FixedReplicas set({{{"old", "a"}, Reply(honest, 3), {}},
                     {{"forged", "b"}, forged, {}},
                     {{"h1", "c"}, Reply(honest, 5), {}},
                     {{"h2", "d"}, Reply(honest, 5), {}}});
  VerifierOptions o;
  o.deadline = std::chrono::milliseconds(5000);
  const ShardAnswer ans = Verifier(o).Verify(set, 5, 5);
  EXPECT_EQ(ans.verdict, Verdict::kVerified) << ans.reason;
  EXPECT_EQ(ans.group, (std::vector<int>{2, 3}));
  ASSERT_EQ(ans.faults.size(), 2u);
  std::set<ReplyFault> faults;
  for (auto& [i, f] : ans.faults) faults.insert(f);
  EXPECT_TRUE(faults.count(ReplyFault::kStale));
  EXPECT_TRUE(faults.count(ReplyFault::kBadSignature));
}

TEST(TrustVerify, AnUnverifiedReasonNamesTheRefusedReplies) {
  const auto honest = Ranked({1, 2, 3, 4, 5});
  ReplicaReply forged;
  forged.fault = ReplyFault::kBadSignature;
  FixedReplicas set({{{"old", "a"}, Reply(honest, 3), {}}, {{"forged", "b"}, forged, {}}, {{"h1", "c"}, Reply(honest, 5), {}}});
  VerifierOptions o;
  o.deadline = std::chrono::milliseconds(5000);
  const ShardAnswer ans = Verifier(o).Verify(set, 5, 5);
  ASSERT_EQ(ans.verdict, Verdict::kUnverified);
  EXPECT_NE(ans.reason.find("old stale"), std::string::npos) << ans.reason;
  EXPECT_NE(ans.reason.find("forged bad_signature"), std::string::npos) << ans.reason;
}

TEST(TrustVerify, DeadlineBoundsASilentReplica) {
  const auto honest = Ranked({1, 2, 3});
  // One replica answers after 1.5 s (crashed: its connection times out later); the deadline is 300 ms.
  FixedReplicas set({{{"h1", "a"}, Reply(honest), {}}, {{"dead", "b"}, Reply(honest), std::chrono::milliseconds(1500)}});
  VerifierOptions o;
  o.deadline = std::chrono::milliseconds(300);
  const auto t0 = std::chrono::steady_clock::now();
  const ShardAnswer ans = Verifier(o).Verify(set, 3, 5);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(ans.verdict, Verdict::kUnverified);
  EXPECT_NE(ans.reason.find("deadline"), std::string::npos) << ans.reason;
  EXPECT_LT(waited, std::chrono::milliseconds(1400));  // returned at the deadline, not with the slow replica
  EXPECT_EQ(ans.hits.size(), 3u);  // best effort is still returned, marked unverified
}

TEST(TrustVerify, HedgesPastAHungReplica) {
  // Two replicas asked first; one hangs for 1.5 s. After the hedge the verifier asks the third and
  // verifies with it, long before the hung reply or the deadline.
  const auto honest = Ranked({1, 2, 3, 4});
  FixedReplicas set({{{"hung", "a"}, Reply(honest), std::chrono::milliseconds(1500)},
                     {{"h1", "b"}, Reply(honest), {}},
                     {{"h2", "c"}, Reply(honest), {}}});
  VerifierOptions o;
  o.fanout = 2;
  o.hedge = std::chrono::milliseconds(50);
  o.deadline = std::chrono::milliseconds(5000);
  const auto t0 = std::chrono::steady_clock::now();
  const ShardAnswer ans = Verifier(o).Verify(set, 4, 5);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1400));
  EXPECT_EQ(ans.verdict, Verdict::kVerified) << ans.reason;
  EXPECT_EQ(ans.group, (std::vector<int>{1, 2}));
  EXPECT_GE(ans.escalations, 1);
  // Without hedging it waits for the hung replica.
  o.hedge = std::chrono::milliseconds(0);
  FixedReplicas again({{{"hung", "a"}, Reply(honest), std::chrono::milliseconds(300)},
                       {{"h1", "b"}, Reply(honest), {}},
                       {{"h2", "c"}, Reply(honest), {}}});
  const ShardAnswer waited = Verifier(o).Verify(again, 4, 5);
  EXPECT_EQ(waited.verdict, Verdict::kVerified);
  EXPECT_EQ(waited.escalations, 0);
}

TEST(TrustAudit, FlagsInjectedForgedAndDroppedButNotHonestDisagreement) {
  // One shard; two honest replicas that differ at rank 4 (ANN noise).
  const auto h1 = Ranked({2, 4, 6, 8});
  const auto h2 = Ranked({2, 4, 6, 10});
  const std::vector<std::vector<std::vector<SignedHit>>> honest = {{h1, h2}};
  EXPECT_FALSE(CheckAgainstHonest(h1, 4, 1, honest).tampered);
  EXPECT_FALSE(CheckAgainstHonest(h2, 4, 1, honest).tampered);
  EXPECT_FALSE(CheckAgainstHonest(Ranked({2, 4, 6}), 3, 1, honest).tampered);  // k = 3: 8/10 are beyond range
  auto injected = h1;
  injected[1].id = 999;
  EXPECT_TRUE(CheckAgainstHonest(injected, 4, 1, honest).tampered);
  auto forged = h1;
  forged[3].text_distance = 1.0f;  // id 8 with a distance no honest replica reported
  EXPECT_TRUE(CheckAgainstHonest(forged, 4, 1, honest).tampered);
  // Id 2 (returned by both honest replicas) dropped.
  const auto dropped = CheckAgainstHonest(Ranked({4, 6, 8}), 4, 1, honest);
  EXPECT_TRUE(dropped.tampered);
  EXPECT_NE(dropped.why.find("missing"), std::string::npos) << dropped.why;
  // An honest replica that also lacks id 2 makes its absence honest disagreement.
  EXPECT_FALSE(CheckAgainstHonest(Ranked({4, 6, 8}), 4, 1, {{h1, h2, Ranked({4, 6, 8, 12})}}).tampered);
}

TEST(TrustAdversary, ModesTamperDeterministicallyAndCollude) {
  const QueryDigest d = DigestQuery(SampleRequest(), "x");
  std::vector<SignedHit> base;
  for (uint64_t i = 0; i < 13; ++i) base.push_back({i * 2, static_cast<float>(i), 0, 0});  // shard 0 of 2 owns even ids
  auto in_shard = [](uint64_t id) { return ShardOf(id, 2) == 0; };
  auto run = [&](Adversary a, uint64_t* version) {
    std::vector<SignedHit> h = base;
    a.Apply(d, 10, in_shard, &h, version);
    return h;
  };
  uint64_t version = 9;
  Adversary drop{AdversaryMode::kDrop, 1, 3};
  auto h = run(drop, &version);
  ASSERT_EQ(h.size(), 10u);
  EXPECT_EQ(h[0].id, base[3].id);  // the best three are gone
  Adversary inject{AdversaryMode::kInject, 1, 3};
  h = run(inject, &version);
  int foreign = 0;
  for (const auto& x : h) {
    foreign += x.id >= (uint64_t{1} << 62);
    EXPECT_TRUE(in_shard(x.id));
  }
  EXPECT_EQ(foreign, 3);
  EXPECT_EQ(run(inject, &version), h);  // same seed, same digest: colluders agree
  Adversary other_seed = inject;
  other_seed.seed = 2;
  EXPECT_NE(run(other_seed, &version), h);
  Adversary reorder{AdversaryMode::kReorder, 1, 3};
  h = run(reorder, &version);
  EXPECT_EQ(h[0].id, base[9].id);
  EXPECT_EQ(h[0].text_distance, base[0].text_distance);  // scores still look sorted
  Adversary stale{AdversaryMode::kStale, 1, 3};
  version = 9;
  h = run(stale, &version);
  EXPECT_EQ(version, 6u);
  EXPECT_EQ(h.size(), 10u);
  Adversary none{AdversaryMode::kInject, 1, 3, 0.0};
  version = 9;
  EXPECT_EQ(run(none, &version), std::vector<SignedHit>(base.begin(), base.begin() + 10));
  EXPECT_FALSE(ParseAdversaryMode("evil").ok());
  Adversary bad{AdversaryMode::kDrop, 0, 0};
  EXPECT_FALSE(bad.Validate().ok());
}

}  // namespace
}  // namespace keel::vector::trust
