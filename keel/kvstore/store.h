// Store: the kvstore's tiers composed into one cache.
//
//   PUT   -> DRAM (admission is the eviction policy's job: S3-FIFO lets one-hit wonders leave
//            early), then queued for the lower tiers (write-behind: SSD, Redis). With `persist`
//            the SSD write and its fdatasync happen before PUT returns.
//   GET   -> DRAM, else SSD, else Redis; a lower-tier hit is promoted into DRAM.
//   DRAM eviction -> demoted to SSD when SSD does not already hold the key.
//   PREFIX -> how many leading keys of a chain are present anywhere (local tiers first, then
//            one pipelined round trip to Redis for the rest).
// TTL: per PUT (or the store default); every tier honours the same absolute expiry.
//
// The write-behind queue is bounded in bytes; a PUT that finds it full waits up to
// `write_behind_wait_ms` and then skips the lower tiers for that value (counted), so a slow SSD
// or Redis never stalls the DRAM tier indefinitely. Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "keel/core/metrics.h"
#include "keel/core/status.h"
#include "keel/kvstore/dram_tier.h"
#include "keel/kvstore/tier.h"

namespace keel::kvstore {

class SsdTier;
class RedisTier;

struct StoreOptions {
  int64_t dram_bytes = 1ll << 30;
  EvictionKind eviction = DramOptions{}.eviction;
  std::string ssd_dir;                  // empty: no SSD tier
  int64_t ssd_bytes = 8ll << 30;
  int64_t ssd_segment_bytes = 64ll << 20;
  std::string redis_url;                // empty: no Redis tier ("host:port", "redis://...")
  int64_t default_ttl_ms = 0;           // 0: entries never expire unless a PUT says so
  uint64_t max_value_bytes = 64ull << 20;
  int64_t write_behind_bytes = 256ll << 20;
  int write_behind_wait_ms = 1000;
};

struct StoredValue {
  BlobPtr value;
  std::string_view tier;  // which tier answered ("dram", "ssd", "redis")
};

struct StoreStats {
  std::vector<TierStats> tiers;
  int64_t promotions = 0;
  int64_t demotions = 0;
  int64_t write_behind_queued_bytes = 0;
  int64_t write_behind_skipped = 0;
  int64_t lower_tier_errors = 0;
};

class Store {
 public:
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // ttl_ms < 0: the store default; 0: never expires.
  Status Put(std::string_view key, BlobPtr value, int64_t ttl_ms = -1, bool persist = false);
  Result<StoredValue> Get(std::string_view key);
  Result<bool> Contains(std::string_view key);
  // Number of leading keys present in some tier (stops at the first absent one).
  int LongestPrefix(const std::vector<std::string_view>& keys);
  Status Delete(std::string_view key);
  // Waits until the write-behind queue is empty (tests, shutdown).
  void Flush();

  StoreStats Stats() const;
  std::string StatsJson() const;
  // Registers gauges computed from Stats() on every scrape.
  void RegisterMetrics(MetricsRegistry& registry);
  const StoreOptions& options() const { return options_; }

 private:
  explicit Store(const StoreOptions& options);
  struct Pending {
    std::string key;
    Entry entry;
    bool to_ssd;
    bool to_redis;
  };
  void Enqueue(Pending p);
  void WriteBehindLoop();
  void OnDramEvict(std::string key, Entry entry);
  int64_t ExpiryFor(int64_t ttl_ms) const;

  StoreOptions options_;
  std::unique_ptr<DramTier> dram_;
  std::unique_ptr<SsdTier> ssd_;
  std::unique_ptr<RedisTier> redis_;

  mutable std::mutex mu_;
  std::condition_variable cv_;        // queue non-empty / stop
  std::condition_variable space_cv_;  // room in the queue / drained
  std::deque<Pending> queue_;
  int64_t queued_bytes_ = 0;
  int in_flight_ = 0;
  bool stop_ = false;
  std::thread writer_;

  std::atomic<int64_t> promotions_{0}, demotions_{0}, skipped_{0}, lower_errors_{0};
};

}  // namespace keel::kvstore
