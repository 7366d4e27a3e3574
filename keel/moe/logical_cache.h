// LogicalCache: PSR's deterministic expert cache for one layer of one sequence. It decides which
// experts get the router bonus, and is a pure function of the sequence's token history (the
// router choices and lookahead predictions fed to it), never of when physical copies finish: so a
// model routed on it gives the same outputs offline and deployed, whatever the copy timing.
//
// Capacity = the layer's physical slots. A moving average of past router choices ranks members;
// when full, an insert evicts the member with the lowest average (ties: the lower expert id) that
// is not protected. Not thread-safe; copyable (a sequence's state is a vector of these).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace keel::moe {

class LogicalCache {
 public:
  LogicalCache(int n_experts, int capacity, float decay);

  int capacity() const { return capacity_; }
  bool Contains(int e) const { return member_[static_cast<size_t>(e)] != 0; }
  // Members in insertion order (eviction reuses the evicted member's place).
  const std::vector<int>& members() const { return members_; }
  float average(int e) const { return avg_[static_cast<size_t>(e)]; }

  // out[e] = bonus for members, 0 otherwise (n_experts floats).
  void Bonus(float bonus, float* out) const;
  // One routing step: every expert's average moves towards 1 if chosen, 0 if not.
  void Observe(const int* chosen, int k);
  // Makes `e` a member; when full, evicts the lowest-average member not in protect[0..n_protect).
  // Returns the evicted expert, or -1 (already a member, or a free place was used). When every
  // member is protected, nothing is inserted and -2 is returned.
  int Insert(int e, const int* protect, int n_protect);

 private:
  int capacity_;
  float decay_;
  std::vector<float> avg_;
  std::vector<uint8_t> member_;
  std::vector<int> members_;
};

}  // namespace keel::moe
