// ColdTier: the "compressed cold segment" tier of a TieredStore (tiered_store.h). Values are
// zstd-compressed and appended to segment files (dir/cold-00000001.seg, ...); an in-memory index
// maps each key to its newest record and is rebuilt by scanning every segment on Open.
//
// Why a tier of its own rather than SsdTier plus a codec: cold vectors are the bulk of a shard
// and are read rarely, so they trade CPU (decompression) for bytes on disk, and reads go around
// the page cache (posix_fadvise DONTNEED on every range read) so a cold read costs what a cold
// read costs on the device, not a DRAM copy.
//
// Recovery: a torn tail of the last segment is cut; a record whose value fails its checksum is
// skipped and counted (and its key dropped, so an older version never resurfaces). Reads verify
// the stored bytes' checksum before decompressing and the decompressed size after; a mismatch is
// Corruption, never wrong data. Delete appends a tombstone.
//
// Not done (kept small): no compaction and no capacity enforcement. Space of replaced and
// deleted records is never reclaimed while the tier is open; the owning TieredStore bounds the
// live bytes and starts from empty segments on each Open.
//
// Thread-safe: appends serialise on one mutex; reads look the key up under a shared lock and
// then read without any lock (io_uring, else pread), so Gets run in parallel with each other and
// with Puts. GetMany submits all its reads at once, about one device round trip per batch.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/core/status.h"
#include "keel/kvstore/tier.h"

namespace keel::vector::coloc {

// Values above this are rejected on write and treated as corruption on read.
inline constexpr uint64_t kColdMaxValueBytes = uint64_t{256} << 20;

struct ColdTierOptions {
  std::string dir;                            // created if missing; holds only this tier's files
  int zstd_level = 3;
  int64_t segment_bytes = int64_t{64} << 20;  // roll to a new segment file past this size
  bool uncached_reads = true;                 // drop read ranges from the page cache
  bool sync_each_put = false;                 // fdatasync before Put/Delete return
  bool use_io_uring = true;                   // false, or io_uring unavailable: pread
};

// What the last Open found on disk.
struct ColdRecovery {
  int64_t segments = 0;
  int64_t records = 0;          // valid records replayed (puts and tombstones)
  int64_t corrupt_records = 0;  // skipped (bad value checksum) or cut (torn/garbage tail)
  int64_t truncated_bytes = 0;  // cut from the end of the last segment
};

class ColdTier : public kvstore::Tier {
 public:
  // Opens (or creates) the tier in options.dir and rebuilds the index. InvalidArgument for bad
  // options; Unavailable when another ColdTier holds the directory; IOError when the OS refuses.
  static Result<std::unique_ptr<ColdTier>> Open(const ColdTierOptions& options);
  ~ColdTier() override;
  ColdTier(const ColdTier&) = delete;
  ColdTier& operator=(const ColdTier&) = delete;

  std::string_view name() const override { return "cold"; }
  Status Put(std::string_view key, const kvstore::Entry& entry) override;
  Result<kvstore::Entry> Get(std::string_view key) override;
  // Every record in one io_uring submission (chunked at kvstore::kUringEntries), then each is
  // verified and decompressed as Get does; one result per key, in order.
  std::vector<Result<kvstore::Entry>> GetMany(const std::vector<std::string_view>& keys) override;
  Result<bool> Contains(std::string_view key) override;
  Status Delete(std::string_view key) override;
  kvstore::TierStats Stats() const override;

  const ColdRecovery& recovery() const { return recovery_; }
  int64_t DiskBytes() const { return disk_bytes_.load(std::memory_order_relaxed); }
  // Compressed bytes of the live records (for the compression ratio).
  int64_t StoredBytes() const;

 private:
  struct Segment;
  struct Location {
    uint64_t segment_id = 0;
    uint64_t offset = 0;       // of the record header
    uint32_t key_len = 0;
    uint32_t stored_len = 0;   // compressed bytes
    uint64_t raw_len = 0;      // decompressed bytes
    int64_t expires_at_ms = 0;
  };
  struct KeyHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  ColdTier(ColdTierOptions options, int lock_fd);
  Status Recover();
  Status ScanSegment(Segment& seg, bool is_last);
  Status Append(uint8_t type, std::string_view key, const kvstore::Blob* value, int64_t expires_at_ms);
  Status RollLocked();
  void IndexPutLocked(std::string_view key, const Location& loc);
  void IndexEraseLocked(std::string_view key);
  // Finds `key`'s newest live record; NotFound when absent or expired.
  Status LookupLocked(std::string_view key, Location* loc, std::shared_ptr<Segment>* seg);
  // Checks the record read into `rec` (`s`: the read's outcome), decompresses it and makes
  // Get's result: Corruption (the entry dropped) when it fails a check.
  Result<kvstore::Entry> FinishRead(std::string_view key, const Location& loc, const Segment& seg, Status s,
                                    const uint8_t* rec);

  const ColdTierOptions options_;
  const int lock_fd_;
  ColdRecovery recovery_;

  std::mutex append_mu_;  // taken before index_mu_
  std::shared_ptr<Segment> active_;
  uint64_t next_segment_id_ = 1;

  mutable std::shared_mutex index_mu_;  // never held across I/O
  std::unordered_map<std::string, Location, KeyHash, std::equal_to<>> index_;
  std::map<uint64_t, std::shared_ptr<Segment>> segments_;
  int64_t live_raw_bytes_ = 0;
  int64_t live_stored_bytes_ = 0;

  std::atomic<int64_t> disk_bytes_{0};
  std::atomic<int64_t> hits_{0}, misses_{0}, puts_{0}, errors_{0};
};

}  // namespace keel::vector::coloc
