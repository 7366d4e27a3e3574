// Placement details the benchmark depends on: cold keys stay put, tiers are used in measured
// latency order, and swaps between full bounded tiers complete through the unbounded tier.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "keel/vector/coloc/placement.h"
#include "keel/vector/coloc/tiered_store.h"
#include "tests/engine/test_util.h"

namespace keel::vector::coloc {
namespace {

using test::TempDir;

constexpr int kDim = 8;
constexpr int64_t kBytes = kDim * sizeof(float);

std::vector<float> Vec(uint64_t key) {
  std::vector<float> v(kDim);
  std::mt19937_64 rng(key + 11);
  for (float& f : v) f = static_cast<float>(rng() % 1000) / 7.f;
  return v;
}

TEST(PlacementStability, UnaccessedKeysKeepTheirTierWhenItHasRoom) {
  for (PlacementPolicy policy : {PlacementPolicy::kFrequency, PlacementPolicy::kCoLoc}) {
    PlacementInput in;
    in.capacities = {10 * kBytes, 10 * kBytes, 0};
    // 30 keys: 0..9 in tier 2, 10..19 in tier 1, 20..29 in tier 0 (the reverse of key order,
    // which is how a placement without stability would refill them).
    for (uint64_t k = 0; k < 30; ++k) {
      in.keys.emplace_back(k, kBytes);
      in.current.push_back(k < 10 ? 2 : k < 20 ? 1 : 0);
    }
    // Two hot keys from the slowest tier.
    for (int r = 0; r < 5; ++r) in.queries.push_back({0, 1});
    auto p = ComputePlacement(policy, in);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->at(0), 0);
    EXPECT_EQ(p->at(1), 0);
    int moved = 0;
    for (uint64_t k = 2; k < 30; ++k) moved += p->at(k) != in.current[k];
    // The two hot keys take two DRAM slots: two DRAM keys go to the next tier with room (SSD
    // is still full, so the unbounded one); no other key moves.
    EXPECT_EQ(moved, 2) << PlacementPolicyName(policy);
    for (uint64_t k = 2; k < 10; ++k) EXPECT_EQ(p->at(k), 2) << k;
  }
}

TEST(PlacementOrder, HotKeysFillTiersInTheGivenOrder) {
  PlacementInput in;
  in.capacities = {2 * kBytes, 4 * kBytes, 0};
  in.order = {0, 2, 1};  // the unbounded tier measured faster than tier 1
  for (uint64_t k = 0; k < 10; ++k) {
    in.keys.emplace_back(k, kBytes);
    in.current.push_back(1);
  }
  for (int r = 0; r < 3; ++r) in.queries.push_back({0, 1, 2, 3, 4, 5});
  for (PlacementPolicy policy : {PlacementPolicy::kFrequency, PlacementPolicy::kCoLoc}) {
    auto p = ComputePlacement(policy, in);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    int in_fast = 0, in_second = 0;
    for (uint64_t k = 0; k < 6; ++k) {
      in_fast += p->at(k) == 0;
      in_second += p->at(k) == 2;
    }
    EXPECT_EQ(in_fast, 2) << PlacementPolicyName(policy);
    EXPECT_EQ(in_second, 4) << PlacementPolicyName(policy);
    for (uint64_t k = 6; k < 10; ++k) EXPECT_EQ(p->at(k), 1) << k;  // cold keys stay put
  }
}

TEST(PlacementOrder, TierOrderFollowsMeasuredLatencyOnceMeasured) {
  TempDir dir("placement-order");
  TieredStoreOptions o;
  o.dram_bytes = 4 * kBytes;
  o.ssd_dir = dir.file("ssd");
  o.ssd_bytes = 0;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(TierOrder(**store), (std::vector<int>{0, 1}));  // configured order before measuring
  for (uint64_t k = 0; k < 8; ++k) ASSERT_TRUE((*store)->Put(k, Vec(k)).ok());
  ASSERT_TRUE((*store)->MeasureLatency(5).ok());
  const auto usage = (*store)->Usage();
  ASSERT_EQ(usage.size(), 2u);
  const std::vector<int> order = TierOrder(**store);
  ASSERT_EQ(order.size(), 2u);
  EXPECT_LE(usage[order[0]].measured_batch_us, usage[order[1]].measured_batch_us);
}

// DRAM and SSD both full; the log wants the SSD keys in DRAM and the DRAM keys out. Without a
// free slot in either, the swap only completes by parking demoted keys in the unbounded tier.
TEST(PlacerSwap, SwapBetweenFullTiersCompletesThroughTheUnboundedTier) {
  TempDir dir("placer-swap");
  TieredStoreOptions o;
  o.dram_bytes = 4 * kBytes;
  o.ssd_dir = dir.file("ssd");
  o.ssd_bytes = 4 * kBytes;
  o.cold_dir = dir.file("cold");
  o.cold_bytes = 0;  // unbounded last tier
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore& s = **store;
  for (uint64_t k = 0; k < 12; ++k) ASSERT_TRUE(s.Put(k, Vec(k)).ok());
  for (uint64_t k = 0; k < 4; ++k) ASSERT_EQ(s.TierOf(k), 0);
  for (uint64_t k = 4; k < 8; ++k) ASSERT_EQ(s.TierOf(k), 1);
  QueryLog log;
  for (int r = 0; r < 5; ++r) log.Append(std::vector<uint64_t>{4, 5, 6, 7});
  Placer placer(&s, &log, PlacerOptions{.policy = PlacementPolicy::kCoLoc, .batch = 1, .measure_tiers = false});
  auto moved = placer.RunOnce();
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_EQ(placer.stats().skipped_full, 0u);
  EXPECT_EQ(placer.stats().move_errors, 0u);
  for (uint64_t k = 4; k < 8; ++k) EXPECT_EQ(s.TierOf(k), 0) << k;
  for (uint64_t k = 0; k < 4; ++k) EXPECT_EQ(s.TierOf(k), 1) << k;  // demoted one tier, not parked
  for (uint64_t k = 8; k < 12; ++k) EXPECT_EQ(s.TierOf(k), 2) << k;
  std::vector<uint64_t> keys(12);
  for (uint64_t k = 0; k < 12; ++k) keys[k] = k;
  std::vector<std::vector<float>> out;
  ASSERT_TRUE(s.Fetch(keys, &out).ok());
  for (uint64_t k = 0; k < 12; ++k) EXPECT_EQ(std::memcmp(out[k].data(), Vec(k).data(), kBytes), 0) << k;
}

}  // namespace
}  // namespace keel::vector::coloc
