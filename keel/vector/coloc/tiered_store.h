// keel::vector::coloc: where each stored vector lives. A TieredStore holds the full-precision
// vectors of a vector shard (every item's text vector and image vector) across storage tiers,
// fastest first: DRAM, local SSD segment, compressed cold segment, Redis (remote). Which tier
// holds which vector is the placement's business (placement.h); the store never changes a
// vector's bytes, and a query's results never depend on where its vectors are.
//
// Tiers are keel::kvstore::Tier implementations (one way to store bytes in Keel): DRAM is a
// kvstore::DramTier sized so it never evicts (capacity is enforced here, by placement), SSD a
// kvstore::SsdTier reading around the page cache, cold a ColdTier (zstd segments, cold_tier.h),
// remote a kvstore::RedisTier.
//
// Keys are 64-bit vector keys, VectorKey(item, modality); a tier stores them as 8 little-endian
// bytes. Thread-safe: Fetch runs concurrently with Put/Remove/Move (migration in the
// background never blocks queries: a moved vector is written to its new tier, the location
// switches, then the old copy is deleted; a reader holding the old location still finds it or
// retries once at the new one).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/kvstore/tier.h"

namespace keel::vector::coloc {

enum class Modality : uint8_t { kText = 0, kImage = 1 };

inline constexpr uint64_t VectorKey(uint64_t item, Modality m) {
  return (item << 1) | static_cast<uint64_t>(m);
}
inline constexpr uint64_t ItemOf(uint64_t key) { return key >> 1; }
inline constexpr Modality ModalityOf(uint64_t key) { return static_cast<Modality>(key & 1); }

inline constexpr int kMaxTiers = 4;
// The canonical tier kinds, fastest first. A store holds only the tiers that are configured,
// in this order, and every tier index in its API (Put/Move/TierOf/FetchTrace/Usage) is a
// position in that configured list: with DRAM + cold only, index 1 is the cold tier.
// TieredStore::TierPosition maps a kind to its configured index.
enum TierIndex : int { kDram = 0, kSsd = 1, kCold = 2, kRemote = 3 };

struct TieredStoreOptions {
  // Capacities in vector bytes (payload, not overhead). 0 for the last configured tier means
  // unbounded (0 means unbounded for any tier, but placement expects only the last to be). A tier whose directory/URL is empty is left out (tests use DRAM + SSD only);
  // DRAM is always present unless dram_bytes < 0.
  //
  // Contents do not survive a restart: the location map lives in memory, so Open clears the
  // segment files it finds in ssd_dir/cold_dir (the shard repopulates the store from its own
  // snapshot). Those directories must belong to this store alone.
  int64_t dram_bytes = int64_t{256} << 20;
  std::string ssd_dir;
  int64_t ssd_bytes = int64_t{1} << 30;
  bool ssd_uncached_reads = true;  // drop the page cache for what a read touched (see ssd tier)
  std::string cold_dir;
  int64_t cold_bytes = int64_t{1} << 30;
  int cold_zstd_level = 3;
  std::string redis_url;           // "" = no remote tier; "host:port" otherwise
  std::string redis_prefix = "keel:vec:";
  int64_t remote_bytes = 0;
};

// What one Fetch touched: a query "touches more than one tier" when tiers_touched > 1.
struct FetchTrace {
  uint32_t tier_mask = 0;   // bit t set when tier t served at least one key
  int tiers_touched = 0;
  std::array<int, kMaxTiers> keys_per_tier{};
  std::array<int64_t, kMaxTiers> ns_per_tier{};  // wall time of each tier's batched read
  int64_t total_ns = 0;
};

struct TierUsage {
  std::string name;
  int64_t items = 0;
  int64_t bytes = 0;           // vector payload bytes placed here
  int64_t capacity_bytes = 0;  // 0 = unbounded
  double measured_read_us = 0; // p50 of a single-key read, from MeasureLatency (0 before)
  double measured_batch_us = 0;// p50 of a 10-key batched read
  int64_t reads = 0;           // keys served
};

class TieredStore {
 public:
  // Opens the configured tiers (creating directories). IOError/Unavailable naming the tier
  // that failed.
  static Result<std::unique_ptr<TieredStore>> Open(const TieredStoreOptions& options);
  ~TieredStore();

  int tier_count() const;
  std::string_view tier_name(int tier) const;

  // Stores a vector in `tier`, or (tier < 0) in the fastest tier with room. ResourceExhausted
  // when no tier has room. Replacing a key keeps it in its current tier unless `tier` is given.
  Status Put(uint64_t key, std::span<const float> values, int tier = -1);
  // OK whether or not the key existed.
  Status Remove(uint64_t key);
  // Reads every key (one batched read per tier touched, tiers in order). out->at(i) is the
  // vector of keys[i]. NotFound naming the first missing key; the trace says what was touched
  // (a key that a concurrent Move took away is re-read once at its new tier, counted there too).
  Status Fetch(std::span<const uint64_t> keys, std::vector<std::vector<float>>* out,
               FetchTrace* trace = nullptr);
  // -1 when absent.
  int TierOf(uint64_t key) const;
  // Moves one key to `to_tier` (no-op when already there). ResourceExhausted when the target
  // tier is full; the vector stays where it was on any error.
  Status Move(uint64_t key, int to_tier);
  // Every stored key with its tier (for placement).
  std::vector<std::pair<uint64_t, int>> Locations() const;
  // Every stored key with its tier and vector bytes (what placement needs as input).
  struct StoredKey {
    uint64_t key = 0;
    int tier = -1;
    int64_t bytes = 0;
  };
  std::vector<StoredKey> Inventory() const;
  // Configured index of a tier kind, -1 when that tier is not configured.
  int TierPosition(TierIndex kind) const;
  // Per configured tier: capacity in bytes, 0 = unbounded.
  std::vector<int64_t> Capacities() const;

  // Per configured tier, fastest first. bytes includes writes in flight (reserved first).
  std::vector<TierUsage> Usage() const;
  // Measures each tier's read latency with `probes` single-key and batched reads of a stored
  // vector (or a probe vector written and removed again). Numbers land in Usage().
  Status MeasureLatency(int probes = 50);

 private:
  TieredStore() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::vector::coloc
