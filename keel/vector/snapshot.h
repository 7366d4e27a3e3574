// The shard's snapshot file: the serialised text index plus every item (id, index label,
// vectors, attributes), so a restart needs neither a rebuild nor the tiers' old contents.
//
// Layout: an 88-byte header (magic "KVSNAP01", format version 2, text/image dims, index kind,
// item count, index and item section lengths, XXH3-64 of each section, the shard's index version
// (writes applied), the write-ahead log epoch that starts after this snapshot, XXH3-64 of the
// header itself), the index section (TextIndex::Save), the item section (per item: i64 label,
// EncodeItem). Format version 1 (a 72-byte header without index version and epoch) still reads,
// as index version 0 and epoch 0. Written
// to "<path>.tmp", fsynced, renamed over `path`, directory fsynced: a crash leaves either the old
// snapshot or the new one, never a mix.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/vector/shard.h"

namespace keel::vector {

struct SnapshotInfo {
  int text_dim = 0;
  int image_dim = 0;
  IndexKind kind = IndexKind::kHnsw;
  uint64_t items = 0;
  uint64_t index_version = 0;  // writes applied when the snapshot was taken
  uint32_t log_epoch = 0;      // tag of the write-ahead log records that follow this snapshot
};

class SnapshotWriter {
 public:
  // IOError naming the temp file when it cannot be created.
  static Result<std::unique_ptr<SnapshotWriter>> Create(const std::string& path, const SnapshotInfo& info,
                                                         std::string_view index_bytes);
  ~SnapshotWriter();  // an unfinished snapshot's temp file is removed
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  Status AddItem(int64_t label, const Item& item);
  // InvalidArgument when fewer or more items were added than info.items; IOError on write.
  Status Finish();
  // True once Finish renamed the file over `path`, even when syncing the directory then failed:
  // from then on the new snapshot may be the one a restart reads.
  bool installed() const { return finished_; }

 private:
  SnapshotWriter() = default;
  Status Flush();
  std::string path_, tmp_;
  int fd_ = -1;
  SnapshotInfo info_;
  uint64_t added_ = 0, index_len_ = 0, items_len_ = 0, index_hash_ = 0;
  std::string buf_;
  struct HashState;
  std::unique_ptr<HashState> items_hash_;
  bool finished_ = false;
};

// Reads and verifies a snapshot: NotFound when `path` does not exist, Corruption naming the file
// and what is wrong (magic, version, checksum, truncation). `on_index` gets the index bytes, then
// `on_item` every item in file order; their errors stop the read and are returned.
Status ReadSnapshot(const std::string& path, SnapshotInfo* info,
                    const std::function<Status(std::string_view index_bytes)>& on_index,
                    const std::function<Status(int64_t label, Item&& item)>& on_item);

}  // namespace keel::vector
