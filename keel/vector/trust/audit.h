// keel::vector::trust audit: whether an answer a router served differs from what the honest
// replicas of each shard returned for the same query — the measure of "tampered" used by the
// tests and bench/trust (docs/trust.md). An answer (merged over shards, ranked, at most k hits) is
// tampered when
//   (a) it holds a hit that no honest replica of the hit's shard returned with that distance
//       (an injected id, or a true id with a forged distance), or
//   (b) it leaves out an id that *every* honest replica of some shard returned closer than the
//       answer's k-th distance (or at any distance, when the answer is shorter than k): a dropped
//       true neighbour that honest disagreement cannot explain.
// Order needs no check of its own: hits are ranked by their distances, and (a) pins the distances.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "keel/vector/trust/signed_reply.h"

namespace keel::vector::trust {

struct TamperCheck {
  bool tampered = false;
  std::string why;  // the first difference found, for test failure messages
};

// `honest[s]` holds the answers of shard s's honest replicas (each ranked, at least k hits when
// the shard holds that many). Hits are compared on (id, text_distance).
TamperCheck CheckAgainstHonest(const std::vector<SignedHit>& answer, int k, uint32_t shards,
                               const std::vector<std::vector<std::vector<SignedHit>>>& honest);

}  // namespace keel::vector::trust
