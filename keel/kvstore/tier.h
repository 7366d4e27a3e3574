// keel::kvstore tiers: where a stored KV chunk lives. A value is an immutable, refcounted Blob
// (the codec's stored bytes of one chunk), so a reader (a socket send, a promotion to another
// tier) keeps it alive while a tier evicts or replaces the key. Keys are opaque bytes
// (chunk keys are 16 bytes; any key up to kMaxKeyBytes is accepted).
//
// Every Tier is thread-safe. Get/Contains of an expired entry behave as if it were absent and
// drop it. Tiers never change the bytes of a value.
//
// Ordering: each Entry carries the sequence number of the write that made it (Store assigns
// them, increasing per key in acknowledgement order). A tier never lets a Put replace an entry
// with a higher sequence number: the stale Put is accepted and ignored, so a write that reaches a
// tier late (write-behind, a demotion, a promotion racing a newer write, another instance's
// older write to a shared Redis) cannot bring back an older value. Equal numbers replace, so
// seq 0 everywhere (users that do not order writes) keeps last-writer-wins. Tiers that persist
// (SSD, Redis) store the number with the value, and SSD recovery keeps each key's highest.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"

namespace keel::kvstore {

inline constexpr size_t kMaxKeyBytes = 256;

// Immutable bytes once published; Allocate() leaves them uninitialised for the writer to fill.
class Blob {
 public:
  static std::shared_ptr<Blob> Allocate(size_t size) { return std::shared_ptr<Blob>(new Blob(size)); }
  static std::shared_ptr<Blob> Copy(const void* data, size_t size);
  static std::shared_ptr<Blob> Copy(std::string_view s) { return Copy(s.data(), s.size()); }
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  std::string_view view() const { return {reinterpret_cast<const char*>(data_.get()), size_}; }

  // XXH3-64 of the bytes, computed on first use and remembered; whoever has already verified
  // the bytes against a checksum (a frame's value checksum) records it with set_checksum, so
  // replies reuse it instead of hashing again. Call only once the bytes are final.
  uint64_t checksum() const;
  void set_checksum(uint64_t c) const {
    checksum_.store(c, std::memory_order_relaxed);
    has_checksum_.store(true, std::memory_order_release);
  }

 private:
  // Buffers of values (>= 16 KiB) go back to a process-wide pool, by exact size and at most 32 MiB
  // in all, and Allocate takes from it first: an overwrite then lands in memory that is already
  // mapped. Without it, a freed value went back to the malloc arena of the thread that allocated
  // it while the next came from another thread's, so every PUT page-faulted fresh memory and arenas
  // trimmed with madvise (64 KiB PUT, 4 clients overwriting: 0.27-0.38 -> 1.04-1.14 GB/s). Pooled
  // bytes are not counted in any tier's capacity.
  struct ReturnBuffer {
    size_t size = 0;
    void operator()(uint8_t* p) const;
  };
  explicit Blob(size_t size);
  std::unique_ptr<uint8_t[], ReturnBuffer> data_;
  size_t size_;
  mutable std::atomic<uint64_t> checksum_{0};
  mutable std::atomic<bool> has_checksum_{false};
};
using BlobPtr = std::shared_ptr<const Blob>;

struct Entry {
  BlobPtr value;
  int64_t expires_at_ms = 0;  // Unix time in ms; 0 = never
  uint64_t seq = 0;           // the write's sequence number (see above); 0 = unordered
};

// What an entry costs in memory besides its key and value bytes: map and queue nodes, the
// eviction policy's node, the shared value's control block (measured ~250-300 bytes per entry).
// Memory bounds charge it per entry, so a flood of tiny values cannot hold many times the
// configured bytes (an empty value charged 0 bytes once let a 16 MiB DRAM tier reach ~1 GB).
inline constexpr int64_t kEntryOverheadBytes = 256;

// Milliseconds since the Unix epoch (system clock: expiry times survive restarts).
int64_t NowUnixMs();
inline bool Expired(const Entry& e, int64_t now_ms) { return e.expires_at_ms != 0 && e.expires_at_ms <= now_ms; }

struct TierStats {
  std::string name;
  int64_t items = -1;           // -1 when the tier cannot tell cheaply (Redis)
  int64_t bytes = 0;            // value bytes held
  int64_t capacity_bytes = 0;   // 0 = unbounded / not ours to bound
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t puts = 0;
  int64_t evictions = 0;        // dropped for capacity
  int64_t expirations = 0;      // dropped for TTL
  int64_t stale_puts = 0;       // Puts ignored because the tier held a newer write of the key
  int64_t errors = 0;           // I/O, corruption, connection failures
};

class Tier {
 public:
  virtual ~Tier() = default;
  virtual std::string_view name() const = 0;

  // Stores or replaces `key`. InvalidArgument for an empty/oversized key; ResourceExhausted
  // when the value can never fit the tier's capacity; Unavailable/IOError when the backing
  // store fails.
  virtual Status Put(std::string_view key, const Entry& entry) = 0;
  // NotFound when absent or expired; Corruption when stored bytes fail their checksum (the
  // entry is dropped); Unavailable/IOError when the backing store fails.
  virtual Result<Entry> Get(std::string_view key) = 0;
  virtual Result<bool> Contains(std::string_view key) = 0;
  // OK whether or not the key existed.
  virtual Status Delete(std::string_view key) = 0;
  virtual TierStats Stats() const = 0;

  // Batched forms, one result per key in order. Tiers with round trips override them to
  // pipeline; the defaults loop.
  virtual std::vector<Result<Entry>> GetMany(const std::vector<std::string_view>& keys);
  virtual std::vector<Result<bool>> ContainsMany(const std::vector<std::string_view>& keys);
};

// InvalidArgument unless 1 <= key.size() <= kMaxKeyBytes.
Status ValidateKey(std::string_view key);

}  // namespace keel::kvstore
