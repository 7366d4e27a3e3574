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
// The write-behind queue is bounded in bytes (keys, values and kEntryOverheadBytes per entry); a
// PUT that finds it full waits up to
// `write_behind_wait_ms` and then skips the lower tiers for that value (counted), so a slow SSD
// or Redis never stalls the DRAM tier indefinitely. Thread-safe.
//
// Ordering: the newest acknowledged write of a key wins in every tier. Each PUT and DELETE gets
// a sequence number (a hybrid clock: above every number this store has issued, recovered from
// SSD or read from Redis, and at least the wall clock in microseconds), assigned under a
// per-key lock together with the writes that must not interleave, so per key the numbers follow
// acknowledgement order. Tiers refuse writes older than what they hold (tier.h), SSD recovery
// keeps the highest-numbered record, write-behind entries overtaken by a newer write or a
// delete are dropped, a GET looks at values still waiting for write-behind before the lower
// tiers, and when a value could not be queued for the lower tiers (queue full) their older
// copies of the key are hidden from GET until a newer write reaches them. So a GET returns
// the newest acknowledged value or nothing (a cache may miss), never an older one; and after a
// crash a persisted PUT is read back unless a newer write of the key replaced it.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
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
  int64_t write_behind_stale = 0;  // queued writes dropped: a newer write or a delete overtook them
  int64_t hidden_keys = 0;         // keys whose lower-tier copies are hidden (their newest write was skipped)
  int64_t lower_tier_errors = 0;
};

class Store {
 public:
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // ttl_ms < 0: the store default; 0: never expires; above kMaxTtlMs: InvalidArgument.
  Status Put(std::string_view key, BlobPtr value, int64_t ttl_ms = -1, bool persist = false);
  static constexpr int64_t kMaxTtlMs = int64_t{100} * 366 * 24 * 3600 * 1000;  // 100 years: no overflow
  Result<StoredValue> Get(std::string_view key);
  Result<bool> Contains(std::string_view key);
  // Number of leading keys present in some tier (stops at the first absent one).
  int LongestPrefix(const std::vector<std::string_view>& keys);
  Status Delete(std::string_view key);
  // Waits until the write-behind queue is empty (tests, shutdown).
  void Flush();
  // Flush for shutdown: waits for the queue to drain, but past `redis_limit` the writes still
  // queued skip Redis (their SSD part is still written): a Redis that stopped answering would
  // otherwise hold the exit for 500 ms per queued write. Returns the writes that skipped Redis.
  int64_t FlushForShutdown(std::chrono::milliseconds redis_limit);
  // Holds (true) or releases (false) the write-behind writer before its next entry, so tests
  // can interleave writes with a queue that is not draining. Flush waits while it is held.
  void PauseWriteBehindForTesting(bool paused);

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
    bool in_ssd;  // persisted before it was queued (for Redis only)
  };
  // The newest write of a key that is queued or being written down; a null value is a delete.
  struct PendingKey {
    Entry newest;
    int queued = 0;  // Pending entries of the key in the queue or in flight
  };
  static constexpr size_t kKeyLockStripes = 4096;
  static constexpr size_t kMaxHiddenKeys = size_t{1} << 20;

  static size_t Stripe(std::string_view key);
  uint64_t NextSeq();
  void ObserveSeq(uint64_t seq);
  // Waits up to write_behind_wait_ms for `bytes` of room in the queue and reserves them.
  bool ReserveQueue(int64_t bytes, int wait_ms);
  void ReleaseQueue(int64_t bytes);
  // Queues `p` into reserved room (mu_ held), registering it as the key's newest write.
  void PushLocked(Pending p);
  // `entry`, the key's newest write, could not be queued for the lower tiers: queued older
  // writes become stale and the lower tiers' older copies are hidden.
  void NoteUnqueuedLocked(const std::string& key, const Entry& entry);
  void HideLowerLocked(const std::string& key, uint64_t seq);
  enum class WriteDownResult { kWritten, kOvertaken, kFailed };  // kFailed: a lower tier refused it
  WriteDownResult WriteDown(const Pending& p);
  void WriteBehindLoop();
  void OnDramEvict(std::string key, Entry entry);
  int64_t ExpiryFor(int64_t ttl_ms) const;
  // What GET may answer from a lower tier: not older than a write still queued or hidden.
  bool LowerEntryCurrent(std::string_view key, const Entry& e) const;
  void Promote(std::string_view key, size_t stripe, uint64_t writes_before, const Entry& e);
  // kQueued: a value of the key waits for write-behind; kHidden: deleted while queued, or its
  // lower-tier copies are hidden.
  enum class KeyState { kNone, kQueued, kHidden };
  KeyState LocalState(std::string_view key) const;

  StoreOptions options_;
  std::unique_ptr<DramTier> dram_;
  std::unique_ptr<SsdTier> ssd_;
  std::unique_ptr<RedisTier> redis_;

  mutable std::mutex mu_;
  std::condition_variable cv_;        // queue non-empty / stop
  std::condition_variable space_cv_;  // room in the queue / drained
  std::deque<Pending> queue_;
  int64_t queued_bytes_ = 0;  // reserved or queued
  int in_flight_ = 0;
  bool stop_ = false;
  bool paused_ = false;
  std::unordered_map<std::string, PendingKey> pending_;  // guarded by mu_
  std::unordered_map<std::string, uint64_t> hidden_;     // key -> lowest seq the lower tiers may answer
  std::thread writer_;

  std::array<std::mutex, kKeyLockStripes> key_locks_;  // taken before mu_, never while holding it
  // PUTs and DELETEs so far per stripe: a GET promotes only if none happened while it read.
  std::array<std::atomic<uint64_t>, kKeyLockStripes> key_writes_{};
  // The newest DELETE per stripe: a late eviction callback must not resurrect a deleted key.
  std::array<std::atomic<uint64_t>, kKeyLockStripes> deleted_seq_{};
  std::atomic<uint64_t> last_seq_{0};

  std::atomic<int64_t> promotions_{0}, demotions_{0}, skipped_{0}, stale_{0}, lower_errors_{0};
  std::atomic<bool> skip_redis_{false};        // set by FlushForShutdown past its limit
  std::atomic<int64_t> redis_writes_skipped_{0};
};

}  // namespace keel::kvstore
