// CheckReplicaAnswer on hostile replica answers: each is validly signed (a compromised replica
// holds its key) unless the test is about the signature, so the check under test is the one
// that must refuse it.
#include "keel/vector/replica_reply.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "keel/vector/wire.h"

namespace keel::vector {
namespace {

using json = nlohmann::json;
using trust::ReplyFault;

SearchHit Hit(uint64_t id, float text_distance, float image_distance = 0) {
  SearchHit h;
  h.id = id;
  h.text_distance = text_distance;
  h.image_distance = image_distance;
  return h;
}

class ReplicaReplyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(store_.AddPem("s0-a", 0, "a", key_a_.PublicKeyPem()).ok());
    ASSERT_TRUE(store_.AddPem("s0-b", 0, "b", key_b_.PublicKeyPem()).ok());
    request_.kind = QueryKind::kText;
    request_.text_query = {0.25f, -1.5f, 3.0f, 0.0f};
    request_.k = 3;
    expect_.request = &request_;
    expect_.shard = 0;
    expect_.shards = 2;  // shard 0 owns the even ids
    expect_.replica = "s0-a";
    expect_.digest = trust::DigestQuery(request_, "nonce-1");
    expect_.min_version = 5;
    expect_.store = &store_;
  }

  struct Signer {
    explicit Signer(const trust::SigningKey* k) : key(k) {}
    const trust::SigningKey* key;
    std::string replica = "s0-a", zone = "a";
    uint32_t shard = 0;
    uint64_t version = 5;
    std::optional<trust::QueryDigest> digest;
  };

  // A replica's answer to request_: `hits` as JSON, signed by `s` over exactly those hits.
  json Answer(const std::vector<SearchHit>& hits, const Signer& s) {
    trust::ReplyBody body{s.shard, s.replica, s.zone, s.version, s.digest.value_or(expect_.digest), {}};
    json out = {{"hits", json::array()}, {"tiers_touched", 1}};
    for (const SearchHit& h : hits) {
      body.hits.push_back(trust::ToSignedHit(h));
      out["hits"].push_back(wire::HitJson(h, request_));
    }
    out["trust"] = wire::TrustJson(body, trust::SignReply(*s.key, body));
    return out;
  }
  json Answer(const std::vector<SearchHit>& hits) { return Answer(hits, Signer{&key_a_}); }

  ReplyFault Check(const json& answer, int status = 200) {
    HttpReply reply;
    reply.status = status;
    reply.body = answer.dump();
    last_ = CheckReplicaAnswer(reply, expect_);
    return last_.reply.fault;
  }

  trust::SigningKey key_a_ = trust::SigningKey::Generate().value();
  trust::SigningKey key_b_ = trust::SigningKey::Generate().value();
  trust::TrustStore store_;
  SearchRequest request_;
  ReplyExpectation expect_;
  CheckedAnswer last_;
  const std::vector<SearchHit> honest_ = {Hit(2, 0.5f), Hit(4, 0.7f), Hit(8, 0.9f)};
};

TEST_F(ReplicaReplyTest, HonestSignedAnswerIsValid) {
  EXPECT_EQ(Check(Answer(honest_)), ReplyFault::kNone) << last_.reply.detail;
  EXPECT_EQ(last_.reply.index_version, 5u);
  ASSERT_EQ(last_.reply.hits.size(), 3u);
  EXPECT_EQ(last_.reply.hits[1], trust::ToSignedHit(honest_[1]));
  EXPECT_EQ(last_.hits[2].id, 8u);
  EXPECT_EQ(last_.tiers_touched, 1);
  EXPECT_EQ(Check(Answer({})), ReplyFault::kNone);  // an empty shard answers nothing, validly
}

TEST_F(ReplicaReplyTest, TransportFailuresAreUnreachable) {
  EXPECT_EQ(Check(Answer(honest_), 500), ReplyFault::kUnreachable);
  EXPECT_EQ(CheckReplicaAnswer(Status::Unavailable("refused"), expect_).reply.fault, ReplyFault::kUnreachable);
}

TEST_F(ReplicaReplyTest, MalformedAnswers) {
  HttpReply not_json{200, {}, "{\"hits\": ["};
  EXPECT_EQ(CheckReplicaAnswer(not_json, expect_).reply.fault, ReplyFault::kMalformed);
  // More hits than asked.
  EXPECT_EQ(Check(Answer({Hit(2, 0.1f), Hit(4, 0.2f), Hit(6, 0.3f), Hit(8, 0.4f)})), ReplyFault::kMalformed);
  // Duplicate ids.
  EXPECT_EQ(Check(Answer({Hit(2, 0.1f), Hit(2, 0.1f)})), ReplyFault::kMalformed);
  // Scores not in the shard's order, equal scores not by id, negative scores.
  EXPECT_EQ(Check(Answer({Hit(2, 0.7f), Hit(4, 0.5f)})), ReplyFault::kMalformed);
  EXPECT_EQ(Check(Answer({Hit(4, 0.5f), Hit(2, 0.5f)})), ReplyFault::kMalformed);
  EXPECT_EQ(Check(Answer({Hit(2, -0.5f)})), ReplyFault::kMalformed);
  // A score beyond float32 (inf once narrowed), a null (how NaN is written), a missing one.
  json a = Answer(honest_);
  a["hits"][2]["text_distance"] = 1e39;
  EXPECT_EQ(Check(a), ReplyFault::kMalformed);
  a = Answer(honest_);
  a["hits"][0]["text_distance"] = nullptr;
  EXPECT_EQ(Check(a), ReplyFault::kMalformed);
  a = Answer(honest_);
  a["hits"][1].erase("text_distance");
  EXPECT_EQ(Check(a), ReplyFault::kMalformed);
  a = Answer(honest_);
  a["hits"][1]["id"] = -4;
  EXPECT_EQ(Check(a), ReplyFault::kMalformed);
  a = Answer(honest_);
  a.erase("hits");
  EXPECT_EQ(Check(a), ReplyFault::kMalformed);
  a = Answer(honest_);
  a["trust"]["index_version"] = "5";
  EXPECT_EQ(Check(a), ReplyFault::kMalformed);
}

TEST_F(ReplicaReplyTest, IdsOfAnotherShard) {
  EXPECT_EQ(Check(Answer({Hit(2, 0.5f), Hit(3, 0.6f)})), ReplyFault::kWrongShard);
  // Signed as shard 1 by a replica of shard 0.
  Signer s{&key_a_};
  s.shard = 1;
  EXPECT_EQ(Check(Answer(honest_, s)), ReplyFault::kWrongShard);
}

TEST_F(ReplicaReplyTest, AuthenticityFaults) {
  json unsigned_answer = Answer(honest_);
  unsigned_answer.erase("trust");
  EXPECT_EQ(Check(unsigned_answer), ReplyFault::kUnsigned);
  unsigned_answer = Answer(honest_);
  unsigned_answer["trust"].erase("signature");
  EXPECT_EQ(Check(unsigned_answer), ReplyFault::kUnsigned);
  // Signed with a key the store does not hold for s0-a.
  EXPECT_EQ(Check(Answer(honest_, Signer{&key_b_})), ReplyFault::kBadSignature);
  // Content changed after signing.
  json tampered = Answer(honest_);
  tampered["hits"][2]["id"] = 10;
  EXPECT_EQ(Check(tampered), ReplyFault::kBadSignature);
  // A replica the store does not know.
  Signer stranger{&key_a_};
  stranger.replica = "s9-z";
  EXPECT_EQ(Check(Answer(honest_, stranger)), ReplyFault::kUnknownReplica);
  // Signed for another query (an old nonce).
  Signer old{&key_a_};
  old.digest = trust::DigestQuery(request_, "nonce-0");
  EXPECT_EQ(Check(Answer(honest_, old)), ReplyFault::kReplay);
  // s0-b's authentic reply presented by s0-a as its own: one vote, not two.
  Signer peer{&key_b_};
  peer.replica = "s0-b";
  peer.zone = "b";
  EXPECT_EQ(Check(Answer(honest_, peer)), ReplyFault::kReplay);
}

TEST_F(ReplicaReplyTest, OlderIndexIsStale) {
  Signer behind{&key_a_};
  behind.version = 4;
  EXPECT_EQ(Check(Answer(honest_, behind)), ReplyFault::kStale);
  behind.version = 6;  // ahead of the committed version: a write in flight
  EXPECT_EQ(Check(Answer(honest_, behind)), ReplyFault::kNone);
}

TEST_F(ReplicaReplyTest, PlainModeChecksContentButNoSignature) {
  expect_.store = nullptr;
  json a = Answer(honest_);
  a.erase("trust");  // no version to be stale with
  EXPECT_EQ(Check(a), ReplyFault::kNone);
  EXPECT_EQ(Check(Answer(honest_, Signer{&key_b_})), ReplyFault::kNone);
  EXPECT_EQ(Check(Answer({Hit(2, 0.5f), Hit(3, 0.6f)})), ReplyFault::kWrongShard);
  Signer behind{&key_a_};
  behind.version = 4;
  EXPECT_EQ(Check(Answer(honest_, behind)), ReplyFault::kStale);
}

TEST_F(ReplicaReplyTest, MultimodalRankingByImageWithImagelessItemsLast) {
  request_.kind = QueryKind::kMultimodal;
  request_.image_query = {1, 2, 3, 4};
  request_.k = 4;
  expect_.digest = trust::DigestQuery(request_, "nonce-1");
  // By image distance; item 6 has no image vector (written with 0) and comes last.
  EXPECT_EQ(Check(Answer({Hit(8, 0.9f, 0.1f), Hit(2, 0.5f, 0.3f), Hit(4, 0.7f, 0.6f), Hit(6, 0.2f, 0)})), ReplyFault::kNone)
      << last_.reply.detail;
  EXPECT_EQ(Check(Answer({Hit(2, 0.5f, 0.3f), Hit(8, 0.9f, 0.1f)})), ReplyFault::kMalformed);
  // A missing image distance.
  json a = Answer({Hit(2, 0.5f, 0.3f)});
  a["hits"][0].erase("image_distance");
  EXPECT_EQ(Check(a), ReplyFault::kMalformed);
}

TEST_F(ReplicaReplyTest, ImageLookupFollowsTheIdsAsked) {
  request_ = SearchRequest{};
  request_.kind = QueryKind::kImage;
  request_.ids = {8, 2, 4, 2};
  expect_.digest = trust::DigestQuery(request_, "nonce-1");
  EXPECT_EQ(Check(Answer({Hit(8, 0), Hit(4, 0)})), ReplyFault::kNone) << last_.reply.detail;
  EXPECT_EQ(Check(Answer({Hit(2, 0), Hit(8, 0)})), ReplyFault::kMalformed);  // out of the order asked
  EXPECT_EQ(Check(Answer({Hit(6, 0)})), ReplyFault::kMalformed);             // not asked for
  EXPECT_EQ(Check(Answer({Hit(8, 0), Hit(2, 0), Hit(4, 0), Hit(0, 0)})), ReplyFault::kMalformed);  // 3 distinct asked
}

}  // namespace
}  // namespace keel::vector
