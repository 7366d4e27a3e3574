// CoLoc: the tiered store, placement (frequency and CoLoc) and the online placer, incl. a real Redis tier.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../kvstore/redis_process.h"
#include "keel/kvstore/ssd_tier.h"
#include "keel/kvstore/uring_batch.h"
#include "keel/vector/coloc/cold_tier.h"
#include "keel/vector/coloc/placement.h"
#include "keel/vector/coloc/tiered_store.h"
#include "tests/engine/test_util.h"

namespace keel::vector::coloc {
namespace {

namespace fs = std::filesystem;
using kvstore::Blob;
using kvstore::Entry;
using test::TempDir;

// Deterministic per-key vector (what every fetch is compared against).
std::vector<float> VectorFor(uint64_t key, int dim) {
  std::vector<float> v(static_cast<size_t>(dim));
  std::mt19937_64 rng(key * 0x9e3779b97f4a7c15ULL + 7);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  for (float& f : v) f = d(rng);
  return v;
}

bool SameBytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
// ---------------------------------------------------------------------------------------------
// TieredStore

constexpr int kDim = 16;
constexpr int64_t kVecBytes = kDim * sizeof(float);

TieredStoreOptions TwoTiers(const TempDir& dir, int64_t dram_vectors, int64_t ssd_vectors) {
  TieredStoreOptions o;
  o.dram_bytes = dram_vectors * kVecBytes;
  o.ssd_dir = dir.file("ssd");
  o.ssd_bytes = ssd_vectors * kVecBytes;
  return o;
}

TEST(TieredStore, PutFillsFastestTierFirstAndFetchReturnsTheBytes) {
  TempDir dir("coloc-store");
  auto store = TieredStore::Open(TwoTiers(dir, 10, 0));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore& s = **store;
  ASSERT_EQ(s.tier_count(), 2);
  EXPECT_EQ(s.tier_name(0), "dram");
  EXPECT_EQ(s.tier_name(1), "ssd");
  EXPECT_EQ(s.TierPosition(kSsd), 1);
  EXPECT_EQ(s.TierPosition(kCold), -1);
  std::vector<uint64_t> keys;
  for (uint64_t i = 0; i < 30; ++i) {
    keys.push_back(VectorKey(i, i % 2 ? Modality::kImage : Modality::kText));
    ASSERT_TRUE(s.Put(keys.back(), VectorFor(keys.back(), kDim)).ok());
  }
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(s.TierOf(keys[i]), i < 10 ? 0 : 1) << i;
  std::vector<std::vector<float>> out;
  FetchTrace trace;
  ASSERT_TRUE(s.Fetch(keys, &out, &trace).ok());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(SameBytes(out[i], VectorFor(keys[i], kDim))) << i;
  EXPECT_EQ(trace.tiers_touched, 2);
  EXPECT_EQ(trace.tier_mask, 3u);
  EXPECT_EQ(trace.keys_per_tier[0], 10);
  EXPECT_EQ(trace.keys_per_tier[1], 20);
  const auto usage = s.Usage();
  EXPECT_EQ(usage[0].items, 10);
  EXPECT_EQ(usage[0].bytes, 10 * kVecBytes);
  EXPECT_EQ(usage[1].items, 20);
  EXPECT_EQ(usage[0].reads, 10);

  // Replacing a key keeps its tier, and the new bytes are what a fetch sees.
  const std::vector<float> changed(kDim, 0.5f);
  ASSERT_TRUE(s.Put(keys[15], changed).ok());
  EXPECT_EQ(s.TierOf(keys[15]), 1);
  ASSERT_TRUE(s.Fetch(std::span(keys).subspan(15, 1), &out, &trace).ok());
  EXPECT_TRUE(SameBytes(out[0], changed));
  EXPECT_EQ(trace.tiers_touched, 1);
  EXPECT_EQ(trace.tier_mask, 2u);
}

TEST(TieredStore, CapacityMoveRemoveAndNotFound) {
  TempDir dir("coloc-store");
  auto store = TieredStore::Open(TwoTiers(dir, 4, 4));
  ASSERT_TRUE(store.ok());
  TieredStore& s = **store;
  for (uint64_t k = 0; k < 8; ++k) ASSERT_TRUE(s.Put(k, VectorFor(k, kDim)).ok());
  EXPECT_EQ(s.Put(8, VectorFor(8, kDim)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Put(8, VectorFor(8, kDim), 0).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Put(8, VectorFor(8, kDim), 7).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Move(5, 0).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.TierOf(5), 1);  // stayed where it was

  EXPECT_EQ(s.Move(0, 1).code(), StatusCode::kResourceExhausted);  // ssd is full too
  ASSERT_TRUE(s.Remove(4).ok());            // frees one ssd slot
  EXPECT_EQ(s.TierOf(4), -1);
  ASSERT_TRUE(s.Remove(4).ok());  // absent: still OK
  ASSERT_TRUE(s.Move(0, 1).ok());
  EXPECT_EQ(s.TierOf(0), 1);
  ASSERT_TRUE(s.Move(5, 0).ok());
  EXPECT_EQ(s.TierOf(5), 0);
  ASSERT_TRUE(s.Move(5, 0).ok());  // no-op
  EXPECT_EQ(s.Move(99, 0).code(), StatusCode::kNotFound);

  std::vector<std::vector<float>> out;
  const std::vector<uint64_t> keys = {0, 1, 2, 3, 5, 6, 7};
  ASSERT_TRUE(s.Fetch(keys, &out).ok());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(SameBytes(out[i], VectorFor(keys[i], kDim)));
  const auto usage = s.Usage();
  EXPECT_EQ(usage[0].items, 4);
  EXPECT_EQ(usage[1].items, 3);
  EXPECT_EQ(usage[0].bytes + usage[1].bytes, 7 * kVecBytes);

  const std::vector<uint64_t> missing = {1, 4, 2};
  Status st = s.Fetch(missing, &out);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("key 4"), std::string::npos) << st.message();
}

TEST(TieredStore, MeasureLatencyFillsUsage) {
  TempDir dir("coloc-store");
  TieredStoreOptions o = TwoTiers(dir, 100, 100);
  o.cold_dir = dir.file("cold");
  o.cold_bytes = 0;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_EQ((*store)->tier_count(), 3);
  ASSERT_TRUE((*store)->Put(1, VectorFor(1, 128)).ok());
  ASSERT_TRUE((*store)->MeasureLatency(20).ok());
  for (const TierUsage& u : (*store)->Usage()) {
    EXPECT_GT(u.measured_read_us, 0) << u.name;
    EXPECT_GT(u.measured_batch_us, 0) << u.name;
    std::printf("  %-6s single p50 %8.2f us   10-key batch p50 %8.2f us\n", u.name.c_str(), u.measured_read_us,
                u.measured_batch_us);
  }
  EXPECT_EQ((*store)->Usage()[0].items, 1);  // probes never enter the location map
}

// Synthetic multimodal log over `items`: text-only queries favour low item ids, multimodal
// queries (text_i, image_i) favour high ids, so each modality's ranking disagrees with the
// other's and a per-modality frequency placement splits the pairs.
std::vector<std::vector<uint64_t>> SplittingLog(uint64_t items) {
  std::vector<std::vector<uint64_t>> log;
  for (uint64_t i = 0; i < items; ++i) {
    for (uint64_t r = 0; r < items - i; ++r) log.push_back({VectorKey(i, Modality::kText)});
    for (uint64_t r = 0; r < 1 + i / 4; ++r) {
      log.push_back({VectorKey(i, Modality::kText), VectorKey(i, Modality::kImage)});
    }
  }
  return log;
}

std::vector<std::vector<uint64_t>> MultimodalOnly(const std::vector<std::vector<uint64_t>>& log) {
  std::vector<std::vector<uint64_t>> out;
  for (const auto& q : log) {
    if (q.size() > 1) out.push_back(q);
  }
  return out;
}

Status Apply(TieredStore& s, const Placement& p) {
  // Demotions first, so the promotions find room.
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& [key, tier] : p) {
      const int cur = s.TierOf(key);
      if ((pass == 0) != (tier > cur) || tier == cur) continue;
      KEEL_RETURN_IF_ERROR(s.Move(key, tier));
    }
  }
  return Status::Ok();
}

TEST(TieredStore, ResultsIdenticalUnderAnyPlacement) {
  TempDir dir("coloc-store");
  constexpr uint64_t kItems = 250;  // 500 vectors
  constexpr int dim = 32;
  TieredStoreOptions o;
  o.dram_bytes = 500 * dim * 4;
  o.ssd_dir = dir.file("ssd");
  o.ssd_bytes = 500 * dim * 4;
  o.cold_dir = dir.file("cold");
  o.cold_bytes = 0;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore& s = **store;
  std::vector<uint64_t> all;
  for (uint64_t i = 0; i < kItems; ++i) {
    for (Modality m : {Modality::kText, Modality::kImage}) {
      all.push_back(VectorKey(i, m));
      ASSERT_TRUE(s.Put(all.back(), VectorFor(all.back(), dim)).ok());
    }
  }
  std::mt19937_64 rng(5);
  std::vector<uint64_t> probe;
  for (int i = 0; i < 300; ++i) probe.push_back(all[rng() % all.size()]);

  std::vector<std::vector<std::vector<float>>> results;
  auto fetch = [&] {
    std::vector<std::vector<float>> out;
    Status st = s.Fetch(probe, &out);
    ASSERT_TRUE(st.ok()) << st.ToString();
    results.push_back(std::move(out));
  };
  auto tiers_used = [&] {
    std::set<int> used;
    for (const auto& [k, t] : s.Locations()) used.insert(t);
    return used.size();
  };

  // 1: all in DRAM.
  fetch();
  EXPECT_EQ(tiers_used(), 1u);
  // 2: random.
  Placement random;
  for (uint64_t k : all) random[k] = static_cast<int>(rng() % 3);
  ASSERT_TRUE(Apply(s, random).ok());
  EXPECT_EQ(tiers_used(), 3u);
  fetch();
  // 3: CoLoc against tighter capacities (100 and 150 vectors), from a synthetic log.
  PlacementInput in;
  for (uint64_t k : all) in.keys.emplace_back(k, dim * 4);
  in.capacities = {100 * dim * 4, 150 * dim * 4, 0};
  in.queries = SplittingLog(kItems);
  auto coloc = ComputePlacement(PlacementPolicy::kCoLoc, in);
  ASSERT_TRUE(coloc.ok()) << coloc.status().ToString();
  ASSERT_TRUE(Apply(s, *coloc).ok());
  EXPECT_EQ(tiers_used(), 3u);
  for (uint64_t k : all) ASSERT_EQ(s.TierOf(k), coloc->at(k));
  fetch();

  ASSERT_EQ(results.size(), 3u);
  for (size_t i = 0; i < probe.size(); ++i) {
    ASSERT_TRUE(SameBytes(results[0][i], VectorFor(probe[i], dim))) << i;
    ASSERT_TRUE(SameBytes(results[1][i], results[0][i])) << i;
    ASSERT_TRUE(SameBytes(results[2][i], results[0][i])) << i;
  }
}

TEST(TieredStore, FetchNeverFailsWhileThePlacerMigratesEverything) {
  TempDir dir("coloc-store");
  constexpr uint64_t kItems = 200;
  TieredStoreOptions o = TwoTiers(dir, kItems / 2, kItems / 2);
  o.cold_dir = dir.file("cold");
  o.cold_bytes = 0;
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok());
  TieredStore& s = **store;
  std::vector<uint64_t> all;
  for (uint64_t i = 0; i < kItems; ++i) {
    for (Modality m : {Modality::kText, Modality::kImage}) {
      all.push_back(VectorKey(i, m));
      ASSERT_TRUE(s.Put(all.back(), VectorFor(all.back(), kDim), 2).ok());  // all cold
    }
  }
  std::atomic<bool> done{false};
  std::atomic<int64_t> fetches{0}, failures{0};
  std::string first_failure;
  std::thread reader([&] {
    std::mt19937_64 rng(11);
    std::vector<std::vector<float>> out;
    while (!done.load()) {
      std::vector<uint64_t> keys;
      for (int i = 0; i < 12; ++i) keys.push_back(all[rng() % all.size()]);
      Status st = s.Fetch(keys, &out);
      bool ok = st.ok();
      for (size_t i = 0; ok && i < keys.size(); ++i) ok = SameBytes(out[i], VectorFor(keys[i], kDim));
      if (!ok && failures++ == 0) first_failure = st.ToString();
      fetches++;
    }
  });
  // Placer rounds (CoLoc, then Frequency) each move 200 of the 400 keys out of cold; between
  // them everything is sent back to cold, and finally everything moves key by key.
  QueryLog log;
  for (const auto& q : SplittingLog(kItems)) log.Append(q);
  uint64_t placer_moves = 0;
  for (PlacementPolicy p : {PlacementPolicy::kCoLoc, PlacementPolicy::kFrequency}) {
    Placer placer(&s, &log, PlacerOptions{.policy = p, .batch = 16, .measure_tiers = false});
    auto moved = placer.RunOnce();
    ASSERT_TRUE(moved.ok()) << moved.status().ToString();
    EXPECT_EQ(placer.stats().move_errors, 0u);
    placer_moves += *moved;
    for (uint64_t k : all) ASSERT_TRUE(s.Move(k, 2).ok());
  }
  EXPECT_EQ(placer_moves, 2 * 2 * kItems / 2);
  for (uint64_t k : all) ASSERT_TRUE(s.Move(k, 1).ok() || s.TierOf(k) == 2);
  done = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  EXPECT_GT(fetches.load(), 0);
  std::vector<std::vector<float>> out;
  ASSERT_TRUE(s.Fetch(all, &out).ok());
  for (size_t i = 0; i < all.size(); ++i) ASSERT_TRUE(SameBytes(out[i], VectorFor(all[i], kDim)));
}

// ---------------------------------------------------------------------------------------------
// Placement

TEST(Placement, ParsesPolicyNames) {
  EXPECT_EQ(*ParsePlacementPolicy("coloc"), PlacementPolicy::kCoLoc);
  EXPECT_EQ(*ParsePlacementPolicy("frequency"), PlacementPolicy::kFrequency);
  EXPECT_FALSE(ParsePlacementPolicy("lru").ok());
  EXPECT_EQ(PlacementPolicyName(PlacementPolicy::kCoLoc), "coloc");
}

TEST(Placement, QueryLogKeepsTheMostRecentWindow) {
  QueryLog log(3);
  for (uint64_t i = 0; i < 5; ++i) log.Append(std::vector<uint64_t>{i, i + 100});
  EXPECT_EQ(log.size(), 3u);
  EXPECT_EQ(log.total_appended(), 5u);
  const auto snap = log.Snapshot();
  ASSERT_EQ(snap.size(), 3u);
  EXPECT_EQ(snap.front(), (std::vector<uint64_t>{2, 102}));
  EXPECT_EQ(snap.back(), (std::vector<uint64_t>{4, 104}));
}

// Bounded in keys too: large searches must not hold the window's whole record count.
TEST(Placement, QueryLogKeepsAtMostItsKeyBound) {
  QueryLog log(1000, 10);
  log.Append(std::vector<uint64_t>{1, 2, 3, 4});
  log.Append(std::vector<uint64_t>{5, 6, 7, 8});
  log.Append(std::vector<uint64_t>{9, 10, 11});  // 11 keys: the oldest query leaves
  auto snap = log.Snapshot();
  ASSERT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap.front(), (std::vector<uint64_t>{5, 6, 7, 8}));
  log.Append(std::vector<uint64_t>(11, 7));  // larger than the bound: counted, not kept
  EXPECT_EQ(log.size(), 2u);
  EXPECT_EQ(log.total_appended(), 4u);
  log.Clear();
  log.Append(std::vector<uint64_t>(10, 1));  // the whole bound again after Clear
  EXPECT_EQ(log.size(), 1u);
}

TEST(Placement, EveryKeyPlacedWithinCapacities) {
  std::mt19937_64 rng(3);
  PlacementInput in;
  int64_t total = 0;
  for (uint64_t k = 0; k < 2000; ++k) {
    const int64_t b = 64 + static_cast<int64_t>(rng() % 512);
    in.keys.emplace_back(k, b);
    total += b;
  }
  for (int q = 0; q < 5000; ++q) {
    std::vector<uint64_t> keys;
    const int n = 1 + static_cast<int>(rng() % 20);
    for (int i = 0; i < n; ++i) keys.push_back((rng() % 2000) * (rng() % 3 == 0 ? 1 : 0) + rng() % 300);
    in.queries.push_back(keys);
  }
  for (const auto& caps : std::vector<std::vector<int64_t>>{{total / 10, total / 4, 0},
                                                            {total / 10, total / 3, total},
                                                            {total / 20, total / 20, total / 5, 0}}) {
    in.capacities = caps;
    for (PlacementPolicy p : {PlacementPolicy::kFrequency, PlacementPolicy::kCoLoc}) {
      auto placed = ComputePlacement(p, in);
      ASSERT_TRUE(placed.ok()) << placed.status().ToString();
      ASSERT_EQ(placed->size(), in.keys.size());
      std::vector<int64_t> used(caps.size(), 0);
      for (const auto& [k, b] : in.keys) {
        ASSERT_TRUE(placed->count(k));
        const int t = placed->at(k);
        ASSERT_GE(t, 0);
        ASSERT_LT(t, static_cast<int>(caps.size()));
        used[t] += b;
      }
      for (size_t t = 0; t < caps.size(); ++t) {
        if (caps[t] > 0) {
          EXPECT_LE(used[t], caps[t]) << PlacementPolicyName(p) << " tier " << t;
        }
      }
      // The fastest tier is used: both policies put hot keys there.
      EXPECT_GT(used[0], caps[0] / 2) << PlacementPolicyName(p);
    }
  }
  in.capacities = {total / 4, total / 4};
  EXPECT_EQ(ComputePlacement(PlacementPolicy::kCoLoc, in).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputePlacement(PlacementPolicy::kFrequency, in).status().code(), StatusCode::kInvalidArgument);
}

TEST(Placement, CoLocKeepsCoQueriedPairsTogetherWhereFrequencySplitsThem) {
  constexpr uint64_t kItems = 100;
  PlacementInput in;
  for (uint64_t i = 0; i < kItems; ++i) {
    in.keys.emplace_back(VectorKey(i, Modality::kText), 64);
    in.keys.emplace_back(VectorKey(i, Modality::kImage), 64);
  }
  in.capacities = {kItems * 64, kItems * 64 / 2, 0};  // DRAM: half the vectors
  in.queries = SplittingLog(kItems);
  const auto multimodal = MultimodalOnly(in.queries);

  auto freq = ComputePlacement(PlacementPolicy::kFrequency, in);
  auto coloc = ComputePlacement(PlacementPolicy::kCoLoc, in);
  ASSERT_TRUE(freq.ok() && coloc.ok());
  const double f = CrossTierFraction(*freq, multimodal);
  const double c = CrossTierFraction(*coloc, multimodal);
  EXPECT_GT(f, 0.3) << "the log is built so that frequency splits pairs";
  EXPECT_EQ(c, 0.0);
  EXPECT_LT(CrossTierFraction(*coloc, in.queries), CrossTierFraction(*freq, in.queries));
  // And CoLoc still puts hot data in the fast tier: the hottest pair (item 0's text is the
  // most queried key) is in DRAM.
  EXPECT_EQ(coloc->at(VectorKey(0, Modality::kText)), 0);
  EXPECT_EQ(coloc->at(VectorKey(0, Modality::kImage)), 0);
}

TEST(Placement, CoLocGroupsLargerQueriesWhenTheyFit) {
  // Queries of 6 keys over disjoint "topics"; each topic fits a quarter of DRAM.
  PlacementInput in;
  for (uint64_t k = 0; k < 600; ++k) in.keys.emplace_back(k, 100);
  std::mt19937_64 rng(9);
  for (int q = 0; q < 3000; ++q) {
    const uint64_t topic = rng() % 60;  // 10 keys per topic
    std::vector<uint64_t> keys;
    for (int i = 0; i < 6; ++i) keys.push_back(topic * 10 + rng() % 10);
    in.queries.push_back(keys);
  }
  in.capacities = {20000, 20000, 0};  // group cap 5000 bytes = 50 keys
  auto coloc = ComputePlacement(PlacementPolicy::kCoLoc, in);
  auto freq = ComputePlacement(PlacementPolicy::kFrequency, in);
  ASSERT_TRUE(coloc.ok() && freq.ok());
  EXPECT_EQ(CrossTierFraction(*coloc, in.queries), 0.0);
  EXPECT_GT(CrossTierFraction(*freq, in.queries), 0.0);
}

// Run by hand (--gtest_also_run_disabled_tests) for the compute cost on a full window:
// 200k keys, 100k queries of 42 keys (32 text candidates + 10 images), skewed popularity.
TEST(Placement, DISABLED_ComputeCostOnAFullWindow) {
  constexpr uint64_t kItems = 100000;
  PlacementInput in;
  for (uint64_t i = 0; i < kItems; ++i) {
    in.keys.emplace_back(VectorKey(i, Modality::kText), 512);
    in.keys.emplace_back(VectorKey(i, Modality::kImage), 512);
  }
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<double> u(0, 1);
  // ANN candidates are neighbours: a query hits one cluster of 64 items (popular clusters
  // more often) and takes its 32 candidates from there.
  constexpr uint64_t kCluster = 64;
  auto cluster = [&] { return static_cast<uint64_t>(std::pow(u(rng), 3.0) * (kItems / kCluster)); };
  for (int q = 0; q < 100000; ++q) {
    std::vector<uint64_t> keys;
    const uint64_t c = cluster();
    for (int i = 0; i < 32; ++i) keys.push_back(VectorKey(c * kCluster + rng() % kCluster, Modality::kText));
    for (int i = 0; i < 10; ++i) keys.push_back(keys[i] + 1);  // the top 10's images
    in.queries.push_back(std::move(keys));
  }
  in.capacities = {int64_t{kItems} * 512 / 5, int64_t{kItems} * 512 / 2, 0};
  for (PlacementPolicy p : {PlacementPolicy::kFrequency, PlacementPolicy::kCoLoc}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto placed = ComputePlacement(p, in);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(placed.ok());
    std::printf("  %-9s %.2f s   cross-tier %.3f\n", std::string(PlacementPolicyName(p)).c_str(), s,
                CrossTierFraction(*placed, in.queries));
  }
}

// ---------------------------------------------------------------------------------------------
// Placer

TEST(ColocPlacer, RunOnceMovesPairsIntoOneTier) {
  TempDir dir("coloc-placer");
  auto store = TieredStore::Open(TwoTiers(dir, 20, 0));
  ASSERT_TRUE(store.ok());
  TieredStore& s = **store;
  // Texts first: DRAM fills with 20 texts, every image lands on SSD.
  for (uint64_t i = 0; i < 20; ++i) ASSERT_TRUE(s.Put(VectorKey(i, Modality::kText), VectorFor(2 * i, kDim)).ok());
  for (uint64_t i = 0; i < 20; ++i) {
    ASSERT_TRUE(s.Put(VectorKey(i, Modality::kImage), VectorFor(2 * i + 1, kDim)).ok());
  }
  QueryLog log;
  for (int r = 0; r < 5; ++r) {
    for (uint64_t i = 0; i < 10; ++i) {
      log.Append(std::vector<uint64_t>{VectorKey(i, Modality::kText), VectorKey(i, Modality::kImage)});
    }
  }
  FetchTrace trace;
  std::vector<std::vector<float>> out;
  const std::vector<uint64_t> pair = {VectorKey(3, Modality::kText), VectorKey(3, Modality::kImage)};
  ASSERT_TRUE(s.Fetch(pair, &out, &trace).ok());
  EXPECT_EQ(trace.tiers_touched, 2);

  Placer placer(&s, &log, PlacerOptions{.policy = PlacementPolicy::kCoLoc, .batch = 4, .measure_tiers = false});
  auto moved = placer.RunOnce();
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_GT(*moved, 0u);
  EXPECT_EQ(placer.stats().rounds, 1u);
  EXPECT_EQ(placer.stats().moves, *moved);
  EXPECT_EQ(placer.stats().move_errors, 0u);
  for (uint64_t i = 0; i < 10; ++i) {
    EXPECT_EQ(s.TierOf(VectorKey(i, Modality::kText)), 0) << i;
    EXPECT_EQ(s.TierOf(VectorKey(i, Modality::kImage)), 0) << i;
  }
  ASSERT_TRUE(s.Fetch(pair, &out, &trace).ok());
  EXPECT_EQ(trace.tiers_touched, 1);
  EXPECT_TRUE(SameBytes(out[1], VectorFor(7, kDim)));
  // A second round on the same log has nothing left to do.
  EXPECT_EQ(*placer.RunOnce(), 0u);
}

// Every bounded tier starts full except cold's two free slots: the plan only works if moves
// out of a tier run before moves into it (SSD -> cold, then DRAM -> SSD, then cold -> DRAM).
TEST(ColocPlacer, OrdersMovesSoFullTiersMakeRoomFirst) {
  for (int64_t cold_vectors : {4, 2}) {
    TempDir dir("coloc-placer");
    TieredStoreOptions o = TwoTiers(dir, 2, 2);
    o.cold_dir = dir.file("cold");
    o.cold_bytes = cold_vectors * kVecBytes;
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok());
    TieredStore& s = **store;
    for (uint64_t k = 0; k < 6; ++k) ASSERT_TRUE(s.Put(k, VectorFor(k, kDim)).ok());
    ASSERT_EQ(s.TierOf(4), 2);
    QueryLog log;
    for (int r = 0; r < 10; ++r) log.Append(std::vector<uint64_t>{4, 5});
    for (int r = 0; r < 5; ++r) log.Append(std::vector<uint64_t>{0, 1});
    Placer placer(&s, &log, PlacerOptions{.policy = PlacementPolicy::kCoLoc, .batch = 1, .measure_tiers = false});
    auto moved = placer.RunOnce();
    ASSERT_TRUE(moved.ok()) << moved.status().ToString();
    if (cold_vectors == 4) {
      EXPECT_EQ(*moved, 6u);
      EXPECT_EQ(placer.stats().skipped_full, 0u);
      const std::vector<int> want = {1, 1, 2, 2, 0, 0};
      for (uint64_t k = 0; k < 6; ++k) EXPECT_EQ(s.TierOf(k), want[k]) << k;
    } else {
      // No free slot anywhere: nothing can move, and every planned move is counted as skipped.
      EXPECT_EQ(*moved, 0u);
      EXPECT_EQ(placer.stats().skipped_full, 6u);
      EXPECT_EQ(placer.stats().move_errors, 0u);
    }
    std::vector<std::vector<float>> out;
    const std::vector<uint64_t> keys = {0, 1, 2, 3, 4, 5};
    ASSERT_TRUE(s.Fetch(keys, &out).ok());
    for (uint64_t k = 0; k < 6; ++k) EXPECT_TRUE(SameBytes(out[k], VectorFor(k, kDim)));
  }
}

TEST(ColocPlacer, BackgroundThreadRunsRoundsAndStops) {
  TempDir dir("coloc-placer");
  auto store = TieredStore::Open(TwoTiers(dir, 4, 0));
  ASSERT_TRUE(store.ok());
  TieredStore& s = **store;
  for (uint64_t k = 0; k < 8; ++k) ASSERT_TRUE(s.Put(k, VectorFor(k, kDim)).ok());
  QueryLog log;
  Placer placer(&s, &log, PlacerOptions{.interval_ms = 10, .min_new_queries = 5});
  placer.Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_EQ(placer.stats().rounds, 0u);  // too few new queries
  for (int r = 0; r < 10; ++r) log.Append(std::vector<uint64_t>{6, 7});
  for (int i = 0; i < 500 && placer.stats().rounds == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  placer.Stop();
  EXPECT_GE(placer.stats().rounds, 1u);
  EXPECT_EQ(s.TierOf(6), 0);
  EXPECT_EQ(s.TierOf(7), 0);
}

// ---------------------------------------------------------------------------------------------
// Four tiers with Redis as the remote tier.

test::RedisProcess& SharedRedis() {
  static test::RedisProcess redis;
  return redis;
}

TEST(ColocRedis, FourTiersRoundTripMoveAndMeasure) {
  test::RedisProcess& redis = SharedRedis();
  ASSERT_TRUE(redis.ok()) << "no Redis: set KEEL_REDIS_URL or install redis-server";
  TempDir dir("coloc-redis");
  TieredStoreOptions o = TwoTiers(dir, 4, 4);
  o.cold_dir = dir.file("cold");
  o.cold_bytes = 4 * kVecBytes;
  o.redis_url = redis.host() + ":" + std::to_string(redis.port());
  o.redis_prefix = test::UniquePrefix("coloc");
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore& s = **store;
  ASSERT_EQ(s.tier_count(), 4);
  EXPECT_EQ(s.TierPosition(kRemote), 3);
  EXPECT_EQ(s.tier_name(3), "remote");
  std::vector<uint64_t> keys;
  for (uint64_t k = 0; k < 16; ++k) {
    keys.push_back(k);
    ASSERT_TRUE(s.Put(k, VectorFor(k, kDim)).ok());
  }
  for (uint64_t k = 0; k < 16; ++k) EXPECT_EQ(s.TierOf(k), static_cast<int>(k / 4));
  std::vector<std::vector<float>> out;
  FetchTrace trace;
  ASSERT_TRUE(s.Fetch(keys, &out, &trace).ok());
  EXPECT_EQ(trace.tiers_touched, 4);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(trace.keys_per_tier[t], 4);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(SameBytes(out[i], VectorFor(keys[i], kDim)));
  ASSERT_TRUE(s.Move(0, 3).ok());
  ASSERT_TRUE(s.Move(12, 0).ok());
  ASSERT_TRUE(s.Fetch(keys, &out).ok());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(SameBytes(out[i], VectorFor(keys[i], kDim)));
  ASSERT_TRUE(s.MeasureLatency(10).ok());
  for (const TierUsage& u : s.Usage()) {
    EXPECT_GT(u.measured_read_us, 0) << u.name;
    std::printf("  %-6s single p50 %8.2f us   10-key batch p50 %8.2f us\n", u.name.c_str(), u.measured_read_us,
                u.measured_batch_us);
  }
  for (uint64_t k : keys) ASSERT_TRUE(s.Remove(k).ok());
  EXPECT_EQ(s.Fetch(std::vector<uint64_t>{0}, &out).code(), StatusCode::kNotFound);
}

// A Redis restarted without persistence forgets what the store put there. A vector the store
// placed in Redis and never moved is lost data (500), not an unknown key (404).
TEST(ColocRedis, AVectorTheRemoteTierLostIsCorruptionNotNotFound) {
  test::RedisProcess redis("", /*force_private=*/true);
  ASSERT_TRUE(redis.ok());
  TempDir dir("coloc-redis-lost");
  TieredStoreOptions o = TwoTiers(dir, 1, 1);
  o.redis_url = redis.host() + ":" + std::to_string(redis.port());
  o.redis_prefix = test::UniquePrefix("coloc-lost");
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore& s = **store;
  for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(s.Put(k, VectorFor(k, kDim)).ok());
  ASSERT_EQ(s.TierOf(3), s.TierPosition(kRemote));
  ASSERT_EQ(test::RedisCommand(redis.port(), "FLUSHALL").substr(0, 3), "+OK");
  std::vector<std::vector<float>> out;
  const Status lost = s.Fetch(std::vector<uint64_t>{0, 3}, &out);
  EXPECT_EQ(lost.code(), StatusCode::kCorruption) << lost.ToString();
  EXPECT_NE(lost.message().find("lost"), std::string::npos) << lost.ToString();
  ASSERT_TRUE(s.Fetch(std::vector<uint64_t>{0}, &out).ok());  // what the local tiers hold still reads
}

}  // namespace
}  // namespace keel::vector::coloc
