#include "keel/vector/trust/audit.h"

#include <cmath>
#include <map>
#include <set>

namespace keel::vector::trust {

TamperCheck CheckAgainstHonest(const std::vector<SignedHit>& answer, int k, uint32_t shards,
                               const std::vector<std::vector<std::vector<SignedHit>>>& honest) {
  TamperCheck out;
  const float kth = answer.size() >= static_cast<size_t>(k) && !answer.empty() ? answer.back().text_distance : INFINITY;
  std::set<uint64_t> got;
  for (const SignedHit& h : answer) {
    got.insert(h.id);
    const uint32_t s = ShardOf(h.id, shards);
    bool vouched = false;
    if (s < honest.size()) {
      for (const auto& replica : honest[s]) {
        for (const SignedHit& x : replica) vouched |= x.id == h.id && x.text_distance == h.text_distance;
      }
    }
    if (!vouched) {
      out.tampered = true;
      out.why = "hit " + std::to_string(h.id) + " at distance " + std::to_string(h.text_distance) +
                " was returned by no honest replica of shard " + std::to_string(s);
      return out;
    }
  }
  for (uint32_t s = 0; s < honest.size(); ++s) {
    if (honest[s].empty()) continue;
    std::map<uint64_t, size_t> count;
    for (const auto& replica : honest[s]) {
      for (const SignedHit& x : replica) {
        if (x.text_distance < kth) ++count[x.id];
      }
    }
    for (const auto& [id, n] : count) {
      if (n == honest[s].size() && !got.count(id)) {
        out.tampered = true;
        out.why = "id " + std::to_string(id) + " of shard " + std::to_string(s) +
                  ", returned by every honest replica within the answer's range, is missing";
        return out;
      }
    }
  }
  return out;
}

}  // namespace keel::vector::trust
