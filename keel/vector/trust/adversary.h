// keel::vector::trust::Adversary — what a compromised replica does to its answer before signing
// it (for tests and the benchmark; every tampered reply is validly signed). Tampering is a
// deterministic function of (mode, seed, query digest), never of the replica's identity, so
// replicas given the same mode and seed collude: they return identical tampered answers.
//
//   drop    : removes the `strength` best hits (the true nearest neighbours) and fills the list
//             from the hits ranked below k (the replica asks its shard for k + strength)
//   inject  : replaces `strength` hits, spread over the ranks, by attacker ids of this shard,
//             each given the score of the hit it replaced
//   reorder : reverses the order of the first k hits and rewrites the scores so the list still
//             looks sorted (the k scores, ascending, assigned to the reversed ids)
//   stale   : reports an index version `strength` writes behind the real one
//   slow    : answers honestly after `delay` (tests deadlines and escalation)
// `fraction` of queries (chosen by the digest) are tampered; the rest are answered honestly.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/trust/signed_reply.h"

namespace keel::vector::trust {

enum class AdversaryMode { kHonest, kDrop, kInject, kReorder, kStale, kSlow };
Result<AdversaryMode> ParseAdversaryMode(std::string_view name);  // "honest|drop|inject|reorder|stale|slow"
std::string_view AdversaryModeName(AdversaryMode mode);

struct Adversary {
  AdversaryMode mode = AdversaryMode::kHonest;
  uint64_t seed = 0;
  int strength = 3;                         // hits dropped/injected; versions behind for stale
  double fraction = 1.0;                    // of queries tampered
  std::chrono::milliseconds delay{200};     // slow
  Status Validate() const;

  // Hits the replica must ask its shard for so drop can refill to k.
  int ExtraHits() const { return mode == AdversaryMode::kDrop ? strength : 0; }
  // Whether this query is tampered (deterministic in seed and digest).
  bool Targets(const QueryDigest& digest) const;
  // Tampers `hits` (sorted, at most k + ExtraHits()) and `index_version` in place, and cuts the
  // list to k. `in_shard(id)` tells which ids this replica's shard owns (attacker ids are drawn
  // among them so the reply is not rejected as out-of-shard). Honest/slow: only the cut.
  void Apply(const QueryDigest& digest, int k, const std::function<bool(uint64_t)>& in_shard,
             std::vector<SignedHit>* hits, uint64_t* index_version) const;
};

}  // namespace keel::vector::trust
