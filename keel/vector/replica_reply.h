// The router's check of one replica's /v1/search answer. A replica may be compromised, so its
// answer is hostile input: the check parses it under JSON limits and refuses, with the fault the
// metrics count (keel/vector/trust/signed_reply.h's ReplyFault):
//   unreachable    the call failed, timed out, or answered a status other than 200
//   malformed      not JSON, wrong types, a missing score, NaN/inf or negative scores, more hits
//                  than asked, duplicate ids, ids the shard request did not ask for (image
//                  lookups), hits not in the order the shard ranks them
//   unsigned       (trust mode) no "trust" object or no signature
//   unknown_replica / bad_signature / replay / wrong_shard: TrustStore::Verify; a reply signed by
//                  another replica of the shard than the one asked is a replay (otherwise one
//                  replica could present a peer's reply as its own second vote)
//   wrong_shard    ids another shard owns (ShardOf)
//   stale          an index version below the router's committed version
// Order of checks: parse, authenticity, content, version; the first fault found is reported.
// Stateless and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/replica_client.h"
#include "keel/vector/shard.h"
#include "keel/vector/trust/signed_reply.h"
#include "keel/vector/trust/verifier.h"

namespace keel::vector {

// What the router asked one replica, and so what it accepts back.
struct ReplyExpectation {
  const SearchRequest* request = nullptr;    // the shard request as sent (kind, k, ids, image query)
  uint32_t shard = 0;
  uint32_t shards = 1;
  std::string replica;                       // id of the replica asked
  trust::QueryDigest digest;                 // DigestQuery(*request, nonce sent)
  uint64_t min_version = 0;                  // the shard's committed version
  const trust::TrustStore* store = nullptr;  // null: signatures are not checked (plain mode)
  size_t max_json_values = size_t{4} << 20;
};

struct CheckedAnswer {
  trust::ReplicaReply reply;     // what the verifier sees: fault, or index version and signed hits
  std::vector<SearchHit> hits;   // the same hits with their vectors (empty when faulty); with an
                                 // image query, items without an image vector carry image
                                 // distance +inf (the signed hits keep the 0 the replica wrote)
  int tiers_touched = 0;
};

CheckedAnswer CheckReplicaAnswer(const Result<HttpReply>& call, const ReplyExpectation& expect);

}  // namespace keel::vector
