#include "keel/vector/snapshot.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>

#include "keel/core/hash.h"
#include "keel/core/mapped_file.h"
#include "keel/vector/records.h"

namespace keel::vector {

namespace {

constexpr char kMagic[8] = {'K', 'V', 'S', 'N', 'A', 'P', '0', '1'};
constexpr uint32_t kVersion = 2;
constexpr size_t kFlushBytes = 8 << 20;

// Format version 1: everything up to items_hash. Version 2 adds index_version and log_epoch.
struct Header {
  uint32_t version, text_dim, image_dim, kind;
  uint64_t items, index_len, items_len, index_hash, items_hash;
  uint64_t index_version;
  uint32_t log_epoch, reserved;
};
constexpr size_t kV1Fields = 56;
static_assert(sizeof(Header) == 72 && offsetof(Header, index_version) == kV1Fields);
// magic + fields + XXH3-64 of both.
constexpr size_t HeaderBytes(uint32_t version) { return 8 + (version == 1 ? kV1Fields : sizeof(Header)) + 8; }
constexpr size_t kHeaderBytes = HeaderBytes(kVersion);

std::string EncodeHeader(const Header& h) {
  std::string out(kMagic, sizeof(kMagic));
  out.append(reinterpret_cast<const char*>(&h), sizeof(Header));
  const uint64_t self = Xxh3_64(out.data(), out.size());
  out.append(reinterpret_cast<const char*>(&self), sizeof(self));
  return out;
}

std::string Errno() { return std::strerror(errno); }



}  // namespace

struct SnapshotWriter::HashState {
  Hasher64 h;
};

Result<std::unique_ptr<SnapshotWriter>> SnapshotWriter::Create(const std::string& path, const SnapshotInfo& info,
                                                                std::string_view index_bytes) {
  std::unique_ptr<SnapshotWriter> w(new SnapshotWriter());
  w->path_ = path;
  w->tmp_ = path + ".tmp";
  w->info_ = info;
  w->items_hash_ = std::make_unique<HashState>();
  w->fd_ = ::open(w->tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return Status::IOError(w->tmp_ + ": open: " + Errno());
  // The header is written last, once the section checksums are known.
  if (::lseek(w->fd_, kHeaderBytes, SEEK_SET) < 0) return Status::IOError(w->tmp_ + ": lseek: " + Errno());
  KEEL_RETURN_IF_ERROR(WriteAllToFd(w->fd_, w->tmp_, index_bytes.data(), index_bytes.size()));
  w->index_len_ = index_bytes.size();
  w->index_hash_ = Xxh3_64(index_bytes.data(), index_bytes.size());
  return w;
}

SnapshotWriter::~SnapshotWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

Status SnapshotWriter::AddItem(int64_t label, const Item& item) {
  buf_.append(reinterpret_cast<const char*>(&label), sizeof(label));
  EncodeItem(item, &buf_);
  ++added_;
  return buf_.size() >= kFlushBytes ? Flush() : Status::Ok();
}

Status SnapshotWriter::Flush() {
  items_hash_->h.update(buf_);
  items_len_ += buf_.size();
  Status s = WriteAllToFd(fd_, tmp_, buf_.data(), buf_.size());
  buf_.clear();
  return s;
}

Status SnapshotWriter::Finish() {
  if (added_ != info_.items) {
    return Status::InvalidArgument("snapshot: " + std::to_string(added_) + " items added, " + std::to_string(info_.items) + " announced");
  }
  KEEL_RETURN_IF_ERROR(Flush());
  Header h{kVersion, static_cast<uint32_t>(info_.text_dim), static_cast<uint32_t>(info_.image_dim),
           static_cast<uint32_t>(info_.kind), info_.items, index_len_, items_len_, index_hash_, items_hash_->h.digest(),
           info_.index_version, info_.log_epoch, 0};
  std::string head = EncodeHeader(h);
  if (::pwrite(fd_, head.data(), head.size(), 0) != static_cast<ssize_t>(head.size())) {
    return Status::IOError(tmp_ + ": write header: " + Errno());
  }
  if (::fsync(fd_) != 0) return Status::IOError(tmp_ + ": fsync: " + Errno());
  ::close(fd_);
  fd_ = -1;
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) return Status::IOError(path_ + ": rename: " + Errno());
  finished_ = true;
  return SyncParentDir(path_);
}

Status ReadSnapshot(const std::string& path, SnapshotInfo* info,
                    const std::function<Status(std::string_view index_bytes)>& on_index,
                    const std::function<Status(int64_t label, Item&& item)>& on_item) {
  KEEL_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  auto bad = [&](const std::string& why) { return Status::Corruption(path + ": " + why); };
  std::string_view all(reinterpret_cast<const char*>(file->data()), file->size());
  if (all.size() < HeaderBytes(1)) return bad("truncated header (" + std::to_string(all.size()) + " bytes)");
  if (std::memcmp(all.data(), kMagic, sizeof(kMagic)) != 0) return bad("bad magic");
  Header h{};
  std::memcpy(&h.version, all.data() + 8, sizeof(h.version));
  if (h.version != 1 && h.version != kVersion) return bad("unsupported version " + std::to_string(h.version));
  const size_t header_bytes = HeaderBytes(h.version);
  if (all.size() < header_bytes) return bad("truncated header (" + std::to_string(all.size()) + " bytes)");
  const size_t fields = header_bytes - 16;
  std::memcpy(&h, all.data() + 8, fields);
  uint64_t self = 0;
  std::memcpy(&self, all.data() + 8 + fields, 8);
  if (Xxh3_64(all.data(), 8 + fields) != self) return bad("header checksum mismatch");
  if (h.kind > static_cast<uint32_t>(IndexKind::kIvfPq)) return bad("unknown index kind");
  if (all.size() - header_bytes != h.index_len + h.items_len) {
    return bad("size " + std::to_string(all.size()) + " does not match the header's sections");
  }
  std::string_view index_bytes = all.substr(header_bytes, h.index_len);
  std::string_view items = all.substr(header_bytes + h.index_len);
  if (Xxh3_64(index_bytes.data(), index_bytes.size()) != h.index_hash) {
    return bad("index section checksum mismatch at offset " + std::to_string(header_bytes));
  }
  if (Xxh3_64(items.data(), items.size()) != h.items_hash) {
    return bad("item section checksum mismatch at offset " + std::to_string(header_bytes + h.index_len));
  }
  info->text_dim = static_cast<int>(h.text_dim);
  info->image_dim = static_cast<int>(h.image_dim);
  info->kind = static_cast<IndexKind>(h.kind);
  info->items = h.items;
  info->index_version = h.index_version;  // 0 in a version 1 file (h was zeroed)
  info->log_epoch = h.log_epoch;
  KEEL_RETURN_IF_ERROR(on_index(index_bytes));
  for (uint64_t i = 0; i < h.items; ++i) {
    int64_t label = 0;
    if (items.size() < sizeof(label)) return bad("item section truncated at item " + std::to_string(i));
    std::memcpy(&label, items.data(), sizeof(label));
    items.remove_prefix(sizeof(label));
    Item item;
    if (Status s = DecodeItem(&items, &item); !s.ok()) return bad(s.message() + " at item " + std::to_string(i));
    KEEL_RETURN_IF_ERROR(on_item(label, std::move(item)));
  }
  if (!items.empty()) return bad("trailing bytes after the last item");
  return Status::Ok();
}

}  // namespace keel::vector
