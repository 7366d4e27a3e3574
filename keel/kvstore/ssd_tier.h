// SsdTier: the local-SSD tier of the KV cache service. Values live in append-only segment files
// (dir/seg-00000001.kvs, ...); an in-memory index maps each key to its newest record and is rebuilt
// by scanning the segments on Open. Capacity is enforced FIFO at segment granularity: when the
// files would exceed capacity_bytes the oldest segment is deleted with every entry it still holds.
//
// Durability: a Put is in the page cache when it returns; Sync() (or sync_each_put) makes every
// acknowledged Put durable. After an unclean shutdown Open keeps every complete record and cuts
// the torn tail of the last segment (logged with file and offset), so appends follow valid data.
//
// Ordering: every record carries its Entry's sequence number (tier.h). A Put or DeleteAt older
// than the key's indexed entry is ignored (counted in stale_puts), and recovery keeps each key's
// highest-numbered record whatever the file order, so a late append of an old write never wins.
//
// Reads go through io_uring (one ring per thread) or pread, without holding the index lock, so
// Gets run in parallel with each other and with Puts; GetMany submits all its reads to the ring
// at once (uring_batch.h), so a batch costs about one device round trip. Every read is verified
// against the record's checksums; a mismatch is Corruption and the entry is dropped. Thread-safe.
//
//   KEEL_ASSIGN_OR_RETURN(auto ssd, SsdTier::Open({.dir = "/nvme/keel-kv"}));
//   KEEL_RETURN_IF_ERROR(ssd->Put(key, {Blob::Copy(bytes), /*expires_at_ms=*/0}));
//   Result<Entry> e = ssd->Get(key);
#pragma once

#include <atomic>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/core/dir_lock.h"
#include "keel/core/status.h"
#include "keel/kvstore/tier.h"
#include "keel/kvstore/uring_batch.h"

namespace keel::kvstore {

// Values above this are rejected on write and treated as corruption on read.
inline constexpr uint64_t kSsdMaxValueBytes = uint64_t{1} << 30;

// The in-memory index holds ~kEntryOverheadBytes per record whatever the record's size, so it is
// bounded too: at most capacity_bytes / kSsdMinRecordCharge records (a flood of empty values
// once built an index ~3.4x the size of the files). Past that, the oldest segments go, as for
// bytes.
inline constexpr int64_t kSsdMinRecordCharge = 1024;

struct SsdOptions {
  std::string dir;                            // created if missing; holds only this tier's files
  int64_t capacity_bytes = int64_t{8} << 30;  // bound on the segment files' total size (and the
                                              // index: see kSsdMinRecordCharge)
  // Roll to a new segment at this size (>= 4 KiB; at most capacity_bytes / 4, since eviction
  // drops a whole segment at a time).
  int64_t segment_bytes = int64_t{64} << 20;
  bool sync_each_put = false;                 // fdatasync before Put/Delete return
  bool use_io_uring = true;                   // false, or io_uring unavailable: pread
  // Drop what each read touched from the page cache (and start writeback of each append, so
  // the pages are clean by the time they are read) and turn readahead off, so reads measure
  // the device, not DRAM.
  // For tiering experiments (keel::vector::coloc); costs a syscall or two per read.
  bool uncached_reads = false;
};

// Makes [offset, offset+len) of `fd` reach the device (waits for its writeback) and drops those
// pages from the page cache. Whole pages are dropped (the range is widened to page bounds), so
// neighbouring records may be dropped too; harmless. Best effort: errors are ignored.
void DropCache(int fd, uint64_t offset, uint64_t len);
// Turns off readahead on `fd`: with reads dropped from the cache, readahead would still pull
// the neighbouring records in, and reading those would then measure DRAM.
void NoReadahead(int fd);
// Starts (does not wait for) writeback of a just-written range, so a later DropCache is cheap.
void StartWriteback(int fd, uint64_t offset, uint64_t len);

// What the last Open found on disk.
struct SsdRecovery {
  int64_t segments = 0;         // segment files scanned
  int64_t records = 0;          // valid records replayed (puts and tombstones)
  int64_t corrupt_records = 0;  // records skipped or cut: bad checksum, torn tail, bad segment header
  int64_t truncated_bytes = 0;  // bytes cut from the end of the last segment
  int64_t stale_records = 0;    // records skipped because a newer write of their key was seen
  // Damage whose keys cannot be read (not a torn tail): a bad segment header over records, an
  // unreadable record with sound ones after it, or one in an older segment. Any makes the tier
  // drop everything it recovered (dropped_entries) and start empty: see DropAfterDamageLocked.
  int64_t damaged_regions = 0;
  int64_t dropped_entries = 0;
};

class SsdTier : public Tier {
 public:
  // Opens (or creates) the tier in options.dir and rebuilds the index. InvalidArgument for bad
  // options; Unavailable when another SsdTier holds the directory; IOError when the OS refuses.
  static Result<std::unique_ptr<SsdTier>> Open(const SsdOptions& options);
  ~SsdTier() override;
  SsdTier(const SsdTier&) = delete;
  SsdTier& operator=(const SsdTier&) = delete;

  std::string_view name() const override { return "ssd"; }
  Status Put(std::string_view key, const Entry& entry) override;
  Result<Entry> Get(std::string_view key) override;
  // Every record in one io_uring submission (chunked at kUringEntries), each checked as Get
  // checks it; one result per key, in order.
  std::vector<Result<Entry>> GetMany(const std::vector<std::string_view>& keys) override;
  Result<bool> Contains(std::string_view key) override;
  // Appends a tombstone (ordered as the key's current entry), so the delete survives a restart.
  Status Delete(std::string_view key) override;
  // A delete ordered as write `seq`: ignored when the key holds a newer write; its tombstone
  // hides every older record of the key on recovery.
  Status DeleteAt(std::string_view key, uint64_t seq);
  // The sequence number of the key's live entry; nullopt when absent or expired.
  std::optional<uint64_t> SeqOf(std::string_view key);
  // The highest sequence number recovered or written (a restarted Store continues above it).
  uint64_t max_seq() const;
  TierStats Stats() const override;

  // fdatasyncs the active segment: every Put/Delete acknowledged before the call is durable.
  Status Sync();
  // Total size of the segment files.
  int64_t DiskBytes() const { return disk_bytes_.load(std::memory_order_relaxed); }
  const SsdRecovery& recovery() const { return recovery_; }
  // Whether reads use io_uring (asked for and available), else pread.
  bool uses_io_uring() const { return use_io_uring_; }

 private:
  struct Segment;
  struct Location {  // where a key's newest record lives
    uint64_t segment_id = 0;
    uint64_t offset = 0;  // of the record header in the segment file
    uint32_t key_len = 0;
    uint64_t value_len = 0;
    int64_t expires_at_ms = 0;
    uint64_t seq = 0;
    uint32_t header_bytes = 0;  // of the record's format version
  };

  struct KeyHash {  // lets lookups take a string_view without building a std::string
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  SsdTier(SsdOptions options, DirLock lock);
  Status Recover();
  Status ScanSegment(Segment& seg, bool is_last);
  Status DropAfterDamageLocked();
  void ApplyRecovered(uint8_t type, const std::string& key, const Location& loc, Segment& seg, int64_t now_ms);
  Status Append(uint8_t type, std::string_view key, const Blob* value, int64_t expires_at_ms, uint64_t seq);
  Status MakeRoomLocked(uint64_t record_bytes);
  Status EnforceCapacityLocked(uint64_t record_bytes);
  Status RollLocked();
  void EvictOldestLocked();
  void IndexPutLocked(std::string_view key, const Location& loc);
  void IndexEraseLocked(std::string_view key);
  // Finds `key`'s newest record; NotFound when absent or expired (an expired entry is dropped).
  Status LookupLocked(std::string_view key, Location* loc, std::shared_ptr<Segment>* seg);
  // The read of `loc`'s record: header and key into `head`, the value into `value`.
  static BatchRead RecordRead(const Location& loc, const Segment& seg, uint8_t* head, Blob& value);
  // Checks a record read by RecordRead (`s`: the read's outcome) and makes Get's result:
  // Corruption (the entry dropped) when it fails its checksums or does not match the index.
  Result<Entry> FinishRead(std::string_view key, const Location& loc, const Segment& seg, Status s,
                           const uint8_t* head, std::shared_ptr<Blob> value);
  // Drops `key` if its index entry still points at `loc` (a concurrent Put may have replaced it).
  void DropIfUnchanged(std::string_view key, const Location& loc);

  const SsdOptions options_;
  DirLock lock_;  // dir/LOCK: one SsdTier per directory
  bool use_io_uring_ = false;
  SsdRecovery recovery_;

  // Appends: the active segment, rolling and eviction. Taken before index_mu_.
  std::mutex append_mu_;
  std::shared_ptr<Segment> active_;
  uint64_t next_segment_id_ = 1;
  bool roll_before_next_append_ = false;  // the active segment's tail may hold a failed write

  // The index and the segment table; held only for lookups and updates, never across I/O.
  mutable std::mutex index_mu_;
  std::unordered_map<std::string, Location, KeyHash, std::equal_to<>> index_;
  // By id, oldest first. Changed only with append_mu_ held as well, so either lock reads it.
  std::map<uint64_t, std::shared_ptr<Segment>> segments_;
  int64_t live_bytes_ = 0;
  uint64_t max_seq_ = 0;
  // During Recover only: each key's highest sequence number seen so far, tombstones included.
  std::unordered_map<std::string, uint64_t> recovered_seq_;

  std::atomic<int64_t> disk_bytes_{0};
  std::atomic<int64_t> hits_{0}, misses_{0}, puts_{0}, evictions_{0}, expirations_{0}, errors_{0}, stale_puts_{0};
};

}  // namespace keel::kvstore
