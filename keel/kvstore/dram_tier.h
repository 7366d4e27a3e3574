// DramTier: the in-memory tier of the shared KV cache, bounded in bytes, with a pluggable
// eviction policy (keel/kvstore/eviction.h).
//
// Each entry is charged its value bytes plus its key bytes plus kEntryOverheadBytes (tier.h: the
// memory an entry holds besides them, so tiny values cannot exceed the bound many times). A Put that pushes the tier over
// capacity evicts victims chosen by the policy; each evicted entry that has not expired is
// handed to `on_evict` (the store demotes it to the SSD tier) after the tier's lock is released,
// so the callback may call back into the tier. Expired entries are dropped lazily: on Get or
// Contains, or when the policy picks them as victims (counted as expirations, never passed to
// `on_evict`).
//
// Get is a hit/miss and refreshes the key in the policy; Contains is a probe (the engine asks it
// for whole prefixes before fetching) and touches neither the stats nor the policy.
//
// Thread-safe behind one mutex: each op is a hash lookup plus O(1) policy work (value bytes are
// never copied under it), so striping is not worth splitting the policy's global order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "keel/kvstore/eviction.h"
#include "keel/kvstore/tier.h"

namespace keel::kvstore {

struct DramOptions {
  int64_t capacity_bytes = int64_t{1} << 30;
  // ARC, from bench/kvstore/eviction_bench.cc (an LLM-serving prefix trace: shared system
  // prompts, Zipf documents, multi-turn chats, one-off long scans; alpha 0.9-1.1, two seeds).
  // ARC and S3-FIFO both beat LRU by 5-7 points of hit ratio at 1% of the unique bytes, where a
  // DRAM tier usually sits; ARC leads S3-FIFO there by 0.4-0.7 points and trails it by at most
  // 0.1 at 10-25%. S3-FIFO (no list move on a hit) is the near-tie alternative.
  EvictionKind eviction = EvictionKind::kArc;
  // Run on_evict with the tier's lock held, so no reader can see the key gone from this tier
  // before the callback has put it somewhere else (the Store's write-behind queue). The callback
  // must then be quick and must not call into this tier.
  bool evict_callback_under_lock = false;
};

class DramTier : public Tier {
 public:
  // Called once per entry evicted for capacity, outside the tier's lock (unless
  // evict_callback_under_lock), on the thread whose Put caused the eviction.
  using EvictCallback = std::function<void(std::string key, Entry entry)>;

  explicit DramTier(DramOptions options = {}, EvictCallback on_evict = nullptr);
  ~DramTier() override;
  DramTier(const DramTier&) = delete;
  DramTier& operator=(const DramTier&) = delete;

  std::string_view name() const override { return "dram"; }
  // ResourceExhausted when value plus key bytes exceed the capacity; InvalidArgument for a bad
  // key or a null value. Putting an already-expired entry removes the key.
  Status Put(std::string_view key, const Entry& entry) override;
  Result<Entry> Get(std::string_view key) override;
  Result<bool> Contains(std::string_view key) override;
  Status Delete(std::string_view key) override;
  TierStats Stats() const override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace keel::kvstore
