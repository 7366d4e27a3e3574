#include "keel/moe/logical_cache.h"

#include <algorithm>

namespace keel::moe {

LogicalCache::LogicalCache(int n_experts, int capacity, float decay)
    : capacity_(capacity), decay_(decay), avg_(static_cast<size_t>(n_experts), 0.0f),
      member_(static_cast<size_t>(n_experts), 0) {
  members_.reserve(static_cast<size_t>(capacity));
}

void LogicalCache::Bonus(float bonus, float* out) const {
  for (size_t e = 0; e < member_.size(); ++e) out[e] = member_[e] ? bonus : 0.0f;
}

void LogicalCache::Observe(const int* chosen, int k) {
  for (float& a : avg_) a *= decay_;
  for (int r = 0; r < k; ++r) avg_[static_cast<size_t>(chosen[r])] += 1.0f - decay_;
}

int LogicalCache::Insert(int e, const int* protect, int n_protect) {
  if (Contains(e)) return -1;
  if (static_cast<int>(members_.size()) < capacity_) {
    members_.push_back(e);
    member_[static_cast<size_t>(e)] = 1;
    return -1;
  }
  int victim_at = -1;
  for (int i = 0; i < static_cast<int>(members_.size()); ++i) {
    const int m = members_[static_cast<size_t>(i)];
    if (std::find(protect, protect + n_protect, m) != protect + n_protect) continue;
    if (victim_at < 0) {
      victim_at = i;
      continue;
    }
    const int v = members_[static_cast<size_t>(victim_at)];
    if (avg_[static_cast<size_t>(m)] < avg_[static_cast<size_t>(v)] ||
        (avg_[static_cast<size_t>(m)] == avg_[static_cast<size_t>(v)] && m < v)) {
      victim_at = i;
    }
  }
  if (victim_at < 0) return -2;
  const int victim = members_[static_cast<size_t>(victim_at)];
  member_[static_cast<size_t>(victim)] = 0;
  members_[static_cast<size_t>(victim_at)] = e;
  member_[static_cast<size_t>(e)] = 1;
  return victim;
}

}  // namespace keel::moe
