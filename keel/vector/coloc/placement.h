// Placement: which tier each vector key should live in, decided from the query log.
//
//   * Frequency (the baseline, how tiered vector stores place data today): each modality is a
//     collection of its own, ranked by its own access count, and fills the tiers fastest first
//     within its share of every tier's capacity (share = the modality's share of the bytes).
//   * CoLoc: builds the co-access graph (nodes = vector keys; an edge between two keys fetched
//     by the same query, weighted by how many queries did so), partitions it into groups that
//     should share a tier, and packs the hottest groups (by accesses per byte) into the fastest
//     tiers, subject to capacities. The heuristic used and why is documented in placement.cc and
//     docs/vector.md.
//
// A Placer re-places online: a background thread recomputes the placement from the log's
// recent window every `interval_ms` and migrates keys (TieredStore::Move) in small batches,
// never holding a lock that Fetch needs, so queries keep running during migration.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/coloc/tiered_store.h"

namespace keel::vector::coloc {

enum class PlacementPolicy { kFrequency, kCoLoc };
Result<PlacementPolicy> ParsePlacementPolicy(std::string_view name);  // "frequency" | "coloc"
std::string_view PlacementPolicyName(PlacementPolicy p);

// The keys one query fetched together. Thread-safe bounded window of the most recent queries.
// The window holds at most `capacity` queries and `max_keys` keys in all (a query logs up to
// 2,000 keys, so a record bound alone let 100,000 large searches hold ~1.6 GB); the oldest
// queries leave first.
class QueryLog {
 public:
  static constexpr size_t kDefaultMaxKeys = size_t{8} << 20;  // 64 MiB of keys
  explicit QueryLog(size_t capacity = 100000, size_t max_keys = kDefaultMaxKeys);
  void Append(std::span<const uint64_t> keys);
  std::vector<std::vector<uint64_t>> Snapshot() const;
  size_t size() const;
  void Clear();  // forget the window (total_appended keeps counting)
  uint64_t total_appended() const;

 private:
  mutable std::mutex mu_;
  size_t capacity_;
  size_t max_keys_;
  size_t keys_ = 0;  // in window_
  std::deque<std::vector<uint64_t>> window_;
  uint64_t total_ = 0;
};

struct PlacementInput {
  // Every stored key and its size in bytes (keys absent from the log are cold).
  std::vector<std::pair<uint64_t, int64_t>> keys;
  // Per tier capacity in bytes, fastest first; 0 = unbounded (only the last tier may be).
  std::vector<int64_t> capacities;
  std::vector<std::vector<uint64_t>> queries;  // the log window
  // Optional, parallel to `keys`: each key's current tier (-1 = unknown). Keys no query in the
  // window touched stay where they are when their tier still has room after the accessed keys
  // are placed (otherwise they move to the next slower tier with room), so a round migrates
  // what the log says should move, not the whole cold majority.
  std::vector<int> current;
  // Optional: tier indices fastest first (default: configured order). Hot data fills tiers in
  // this order, and "slower" means later in it.
  std::vector<int> order;
};

// key -> tier. Every input key gets a tier; no tier's capacity is exceeded (InvalidArgument
// when the keys cannot fit at all).
using Placement = std::unordered_map<uint64_t, int>;
Result<Placement> ComputePlacement(PlacementPolicy policy, const PlacementInput& input);

// Tier indices fastest first by each tier's measured 10-key read latency
// (TieredStore::MeasureLatency), or the configured order until every tier has been measured.
// Latency is measured, not assumed: on a loopback test machine Redis answers a batch faster
// than an uncached SSD read, and placement should know.
std::vector<int> TierOrder(const TieredStore& store);

// Of the non-empty queries, the fraction whose keys `placement` spreads over more than one tier
// (keys it does not place are ignored). What CoLoc minimises; for tests and benchmarks.
double CrossTierFraction(const Placement& placement, const std::vector<std::vector<uint64_t>>& queries);

struct PlacerOptions {
  PlacementPolicy policy = PlacementPolicy::kCoLoc;
  int64_t interval_ms = 5000;       // recompute period
  size_t min_new_queries = 1000;    // skip a round unless this many queries arrived since the last
  size_t batch = 256;               // keys moved per batch between yields
  // Order tiers by their measured read latency (measured on the first round) rather than as
  // configured (dram, ssd, cold). Tests that check exact placements turn it off: a measurement
  // on a loaded machine may rank the two disk tiers either way.
  bool measure_tiers = true;
};

struct PlacerStats {
  uint64_t rounds = 0;
  uint64_t moves = 0;
  uint64_t move_errors = 0;
  uint64_t skipped_full = 0;        // planned moves left undone because the target tier stayed full
  int64_t last_compute_ms = 0;
  int64_t last_migrate_ms = 0;
};

class Placer {
 public:
  Placer(TieredStore* store, QueryLog* log, PlacerOptions options);
  ~Placer();  // Stop()
  void Start();
  void Stop();
  // One synchronous round (compute + migrate), for tests and for the benchmark's initial
  // placement. Returns the number of keys moved.
  Result<uint64_t> RunOnce();
  PlacerStats stats() const;

 private:
  void Loop();
  // compute + migrate; round_mu_ held. `interruptible`: stop migrating once Stop() is called.
  Result<uint64_t> Round(bool interruptible);
  bool Stopping();
  TieredStore* store_;
  QueryLog* log_;
  PlacerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
  std::mutex round_mu_;  // one round at a time
  uint64_t last_total_ = 0;
  bool measured_ = false;  // tier latencies measured (first round)
  PlacerStats stats_;
};

}  // namespace keel::vector::coloc
