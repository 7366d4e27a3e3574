#include "keel/vector/wal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "keel/core/hash.h"
#include "keel/core/log.h"
#include "keel/core/mapped_file.h"

namespace keel::vector {

namespace {

constexpr uint32_t kRecordMagic = 0x4C57564B;  // "KVWL"

std::string Errno() { return std::strerror(errno); }

// Covers the epoch tag too, except tag 0, whose records predate tags (their checksums stay valid).
uint64_t RecordChecksum(uint32_t tag, uint64_t len, std::string_view payload) {
  Hasher64 h;
  if (tag != 0) h.update(&tag, sizeof(tag));
  h.update(&len, sizeof(len));
  h.update(payload);
  return h.digest();
}

// One record's header fields at `off` (at least kHeaderBytes readable there).
struct RecordHeader {
  uint32_t magic = 0, tag = 0;
  uint64_t len = 0, sum = 0;
};
RecordHeader ReadHeader(const char* p) {
  RecordHeader h;
  std::memcpy(&h.magic, p, 4);
  std::memcpy(&h.tag, p + 4, 4);
  std::memcpy(&h.len, p + 8, 8);
  std::memcpy(&h.sum, p + 16, 8);
  return h;
}

// The offset of the first whole, checksum-valid record that starts after `from`, or npos. A record
// whose length runs past the end is a torn tail only if nothing valid follows it: a damaged length
// field in mid-log must not pass for a crash and cut every later acknowledged write.
size_t FindValidRecordAfter(std::string_view data, size_t from) {
  const std::string_view magic(reinterpret_cast<const char*>(&kRecordMagic), 4);
  for (size_t p = data.find(magic, from + 1); p != std::string_view::npos; p = data.find(magic, p + 1)) {
    if (data.size() - p < Wal::kHeaderBytes) break;
    const RecordHeader h = ReadHeader(data.data() + p);
    if (h.len > data.size() - p - Wal::kHeaderBytes) continue;
    if (RecordChecksum(h.tag, h.len, data.substr(p + Wal::kHeaderBytes, h.len)) == h.sum) return p;
  }
  return std::string_view::npos;
}

Status ReadAll(int fd, const std::string& path, std::string* out) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::IOError(path + ": fstat: " + Errno());
  out->resize(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out->size()) {
    ssize_t n = ::pread(fd, out->data() + done, out->size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IOError(path + ": read: " + (n == 0 ? std::string("unexpected end") : Errno()));
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}


}  // namespace

Result<std::unique_ptr<Wal>> Wal::Open(const std::string& path, bool sync, const Apply& apply, WalReplay* replay,
                                       uint32_t epoch) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path + ": open: " + Errno());
  std::unique_ptr<Wal> wal(new Wal(path, fd, sync, 0, epoch));
  std::string data;
  KEEL_RETURN_IF_ERROR(ReadAll(fd, path, &data));

  WalReplay r;
  size_t off = 0;
  while (off < data.size()) {
    const size_t left = data.size() - off;
    if (left < kHeaderBytes) break;  // torn header
    const RecordHeader h = ReadHeader(data.data() + off);
    const bool whole = h.len <= left - kHeaderBytes;
    const bool last = whole && h.len == left - kHeaderBytes;
    std::string_view payload = whole ? std::string_view(data).substr(off + kHeaderBytes, h.len) : std::string_view();
    auto corrupt = [&](const std::string& why) {
      return Status::Corruption(path + ": bad WAL record at offset " + std::to_string(off) + " (" + why + "), " +
                                std::to_string(left) + " bytes from there to the end");
    };
    if (h.magic != kRecordMagic) {
      // A crash can leave the file extended with zeros; anything else here is damage.
      if (data.find_first_not_of('\0', off) == std::string::npos) break;
      return corrupt("bad magic");
    }
    if (!whole) {
      const size_t next = FindValidRecordAfter(data, off);
      if (next == std::string_view::npos) break;  // the crash cut this record short: torn tail
      return corrupt("length " + std::to_string(h.len) + " runs past the end of the file, but a valid record " +
                     "follows at offset " + std::to_string(next));
    }
    if (RecordChecksum(h.tag, h.len, payload) != h.sum) {
      if (last) break;  // the last record's bytes never all reached the disk
      return corrupt("checksum mismatch");
    }
    if (h.tag > epoch) {
      // Written after a snapshot newer than the one this log is opened with: that snapshot is
      // missing or was replaced by an older copy, and skipping would drop acknowledged writes.
      return corrupt("record of epoch " + std::to_string(h.tag) + ", newer than the snapshot's epoch " +
                     std::to_string(epoch) + ": the snapshot it belongs to is missing or older than the log");
    }
    if (h.len == 0) {
      // An epoch marker (Reset): no write. An earlier epoch's is stale like its records.
      if (h.tag < epoch && r.records > 0) return corrupt("record of an earlier epoch after current ones");
    } else if (h.tag < epoch) {
      if (r.records > 0) return corrupt("record of an earlier epoch after current ones");
      ++r.stale;  // held by the snapshot that started this epoch
    } else {
      const Status applied = apply(payload);
      if (!applied.ok()) {
        return Status(applied.code(), path + ": record at offset " + std::to_string(off) + ": " + applied.message());
      }
      r.offsets.push_back(static_cast<int64_t>(off));
      ++r.records;
    }
    off += kHeaderBytes + h.len;
  }
  r.bytes = static_cast<int64_t>(off);
  r.torn_bytes = static_cast<int64_t>(data.size() - off);
  if (r.torn_bytes > 0) {
    Log().warn("{}: cut a torn tail of {} bytes at offset {} ({} records replayed)", path, r.torn_bytes, off, r.records);
    if (::ftruncate(fd, static_cast<off_t>(off)) != 0) return Status::IOError(path + ": ftruncate: " + Errno());
    if (sync && ::fsync(fd) != 0) return Status::IOError(path + ": fsync: " + Errno());
  }
  if (r.stale > 0) Log().warn("{}: skipped {} records of an earlier epoch (already in the snapshot)", path, r.stale);
  if (::lseek(fd, static_cast<off_t>(off), SEEK_SET) < 0) return Status::IOError(path + ": lseek: " + Errno());
  wal->size_ = r.bytes;
  if (replay != nullptr) *replay = std::move(r);
  return wal;
}

Wal::~Wal() {
  if (fd_ >= 0) ::close(fd_);
}

Status Wal::Append(std::span<const std::string_view> payloads) {
  std::lock_guard<std::mutex> lock(mu_);
  return AppendLocked(payloads);
}

Status Wal::AppendLocked(std::span<const std::string_view> payloads) {
  size_t total = 0;
  for (auto p : payloads) total += kHeaderBytes + p.size();
  std::string buf;
  buf.reserve(total);
  for (auto p : payloads) {
    const uint64_t len = p.size();
    const uint64_t sum = RecordChecksum(epoch_, len, p);
    buf.append(reinterpret_cast<const char*>(&kRecordMagic), 4);
    buf.append(reinterpret_cast<const char*>(&epoch_), 4);
    buf.append(reinterpret_cast<const char*>(&len), 8);
    buf.append(reinterpret_cast<const char*>(&sum), 8);
    buf.append(p);
  }
  Status s = WriteAllToFd(fd_, path_, buf.data(), buf.size());
  if (s.ok() && sync_ && ::fdatasync(fd_) != 0) s = Status::IOError(path_ + ": fdatasync: " + Errno());
  if (!s.ok()) {
    // Leave no partial record behind: the next append must start on a record boundary.
    if (::ftruncate(fd_, static_cast<off_t>(size_)) == 0) ::lseek(fd_, static_cast<off_t>(size_), SEEK_SET);
    return s;
  }
  size_ += static_cast<int64_t>(buf.size());
  return Status::Ok();
}

Status Wal::TruncateTo(int64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  return TruncateLocked(size);
}

Status Wal::Reset(uint32_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  epoch_ = epoch;
  KEEL_RETURN_IF_ERROR(TruncateLocked(0));
  if (epoch == 0) return Status::Ok();
  // The epoch marker: an empty log still says which snapshot it follows, so a missing or older
  // snapshot is caught even before the first write after it.
  const std::string_view marker;
  return AppendLocked(std::span<const std::string_view>(&marker, 1));
}

Status Wal::TruncateLocked(int64_t size) {
  if (size < 0 || size > size_) return Status::InvalidArgument(path_ + ": cannot truncate to " + std::to_string(size));
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) return Status::IOError(path_ + ": ftruncate: " + Errno());
  if (::lseek(fd_, static_cast<off_t>(size), SEEK_SET) < 0) return Status::IOError(path_ + ": lseek: " + Errno());
  if (sync_ && ::fsync(fd_) != 0) return Status::IOError(path_ + ": fsync: " + Errno());
  size_ = size;
  return Status::Ok();
}

Status Wal::Read(int64_t begin, int64_t end, const Apply& fn) const {
  std::string data;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (begin < 0 || end < begin || end > size_) {
      return Status::InvalidArgument(path_ + ": cannot read bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
    }
    data.resize(static_cast<size_t>(end - begin));
    size_t done = 0;
    while (done < data.size()) {
      ssize_t n = ::pread(fd_, data.data() + done, data.size() - done, static_cast<off_t>(begin + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Status::IOError(path_ + ": read: " + (n == 0 ? std::string("unexpected end") : Errno()));
      done += static_cast<size_t>(n);
    }
  }
  size_t off = 0;
  while (off < data.size()) {
    auto corrupt = [&](const char* why) {
      return Status::Corruption(path_ + ": bad WAL record at offset " + std::to_string(begin + static_cast<int64_t>(off)) + " (" + why + ")");
    };
    if (data.size() - off < kHeaderBytes) return corrupt("truncated header");
    const RecordHeader h = ReadHeader(data.data() + off);
    if (h.magic != kRecordMagic) return corrupt("bad magic");
    if (h.len > data.size() - off - kHeaderBytes) return corrupt("truncated payload");
    std::string_view payload = std::string_view(data).substr(off + kHeaderBytes, h.len);
    if (RecordChecksum(h.tag, h.len, payload) != h.sum) return corrupt("checksum mismatch");
    if (h.len > 0) KEEL_RETURN_IF_ERROR(fn(payload));  // an empty record is an epoch marker
    off += kHeaderBytes + h.len;
  }
  return Status::Ok();
}

int64_t Wal::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_;
}

uint32_t Wal::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

}  // namespace keel::vector
