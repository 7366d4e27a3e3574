// Wal: the vector shard's write-ahead log, an append-only file of checksummed records. A write
// is acknowledged only after its records are in the file (and fsynced, when `sync`), so a crash
// loses nothing that was acknowledged.
//
// Record layout (little-endian): u32 magic "KVWL", u32 epoch tag, u64 payload length,
// u64 XXH3-64 of the length and payload, payload bytes. Replay reads records in order:
//   * a record cut short by the end of the file (a crash mid-append) is a torn tail: the file is
//     truncated back to the last whole record and the cut is reported in WalReplay;
//   * a checksum mismatch is a torn tail when it is the file's last record (the crash left the
//     length written but not all the bytes), and Corruption naming the file and the record's
//     offset when more data follows (the log was damaged, and skipping would lose writes);
//   * records tagged with an earlier epoch than the one the log is opened with, before the first
//     record of that epoch, are stale: the owner reset the log to a new epoch (after a snapshot
//     that holds them) but a crash kept the truncation from reaching the disk. They are skipped
//     and counted. A stale record after one of the current epoch is Corruption, and so is a
//     record of a later epoch (the snapshot that started it is missing or older than the log).
// Logs written before epochs existed carry tag 0, which is the default epoch.
//
// Thread-safe: Append, Truncate, Reset and Read serialise on an internal mutex.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"

namespace keel::vector {

struct WalReplay {
  int64_t records = 0;     // applied
  int64_t stale = 0;       // skipped: tagged with another epoch (see above)
  std::vector<int64_t> offsets;  // byte offset of each applied record, in order
  int64_t bytes = 0;       // valid bytes kept
  int64_t torn_bytes = 0;  // cut from the tail (0 when the log ended cleanly)
};

class Wal {
 public:
  using Apply = std::function<Status(std::string_view payload)>;

  // Opens (creating) the log at `path`, replays every whole record through `apply` (the first
  // error it returns stops the replay and is returned, with the file and offset), cuts a torn tail, and leaves the log
  // open for appending at its end. `replay` (optional) receives what happened. `epoch` is the tag
  // of current records (appends carry it).
  static Result<std::unique_ptr<Wal>> Open(const std::string& path, bool sync, const Apply& apply,
                                           WalReplay* replay = nullptr, uint32_t epoch = 0);
  ~Wal();
  Wal(const Wal&) = delete;
  Wal& operator=(const Wal&) = delete;

  // Appends the records with one write and (when sync) one fsync. IOError naming the file; on
  // error the file is cut back to where it was, so a failed append leaves no partial record.
  Status Append(std::span<const std::string_view> payloads);
  Status Append(std::string_view payload) { return Append(std::span<const std::string_view>(&payload, 1)); }
  // Empties the log (after a snapshot made its records redundant); fsynced when sync.
  Status Truncate() { return TruncateTo(0); }
  // Cuts the log back to `size` bytes (a value bytes() returned earlier): takes back records
  // whose write failed to apply, so they are never replayed.
  Status TruncateTo(int64_t size);
  // Empties the log and tags later appends with `epoch`; for epoch > 0 it then holds one empty
  // record of that epoch (a marker: replay and Read pass no payload for it), so an empty log
  // still names its epoch. The tag changes even when the truncation fails, so records appended
  // afterwards are never mistaken for stale ones. Payloads must not be empty.
  Status Reset(uint32_t epoch);
  // Reads the whole records in bytes [begin, end) (offsets of record starts, end <= bytes())
  // and passes each payload to `fn` in order. Corruption naming the file and offset when a
  // record there is damaged; the first error from `fn` stops the read and is returned.
  Status Read(int64_t begin, int64_t end, const Apply& fn) const;

  int64_t bytes() const;
  uint32_t epoch() const;
  const std::string& path() const { return path_; }

  static constexpr size_t kHeaderBytes = 24;

 private:
  Wal(std::string path, int fd, bool sync, int64_t size, uint32_t epoch)
      : path_(std::move(path)), fd_(fd), sync_(sync), size_(size), epoch_(epoch) {}
  Status TruncateLocked(int64_t size);
  Status AppendLocked(std::span<const std::string_view> payloads);
  std::string path_;
  int fd_;
  bool sync_;
  mutable std::mutex mu_;
  int64_t size_;
  uint32_t epoch_;
};

}  // namespace keel::vector
