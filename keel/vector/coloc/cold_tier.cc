#include "keel/vector/coloc/cold_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "keel/core/hash.h"
#include "keel/core/log.h"
#include "keel/kvstore/ssd_tier.h"  // DropCache, NoReadahead, StartWriteback
#include "keel/kvstore/uring_batch.h"

namespace keel::vector::coloc {
namespace {

static_assert(std::endian::native == std::endian::little, "the on-disk integers are little-endian");

using kvstore::Blob;
using kvstore::Entry;

// Segment header, 32 bytes:
//   0 u32 magic "KCSG"   4 u32 version   8 u64 segment id   16 u64 reserved (0)
//   24 u64 XXH3-64 of bytes [0,24)
constexpr uint32_t kSegmentMagic = 0x4753434B;  // "KCSG"
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kSegmentHeaderBytes = 32;

// Record = 48-byte header, key, stored (zstd-compressed) value:
//   0 u32 magic "KCRC"   4 u8 type (1 PUT, 2 DELETE)   5..7 reserved (0)   8 u32 key_len
//   12 u32 stored_len   16 u64 raw_len   24 i64 expires_at_ms (0 = never)
//   32 u64 XXH3-64 of the stored bytes   40 u64 XXH3-64 of bytes [0,40) + key
// As in SsdTier, the header checksum makes the lengths trustworthy before they are used (so a
// rotted value is stepped over instead of ending the scan), and the value checksum is checked
// before the bytes reach the decompressor.
constexpr uint32_t kRecordMagic = 0x4352434B;  // "KCRC"
constexpr size_t kRecordHeaderBytes = 48;
constexpr uint8_t kTypePut = 1;
constexpr uint8_t kTypeDelete = 2;

template <typename T>
void Store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

struct RecordHeader {
  uint8_t type = 0;
  uint32_t key_len = 0;
  uint32_t stored_len = 0;
  uint64_t raw_len = 0;
  int64_t expires_at_ms = 0;
  uint64_t value_checksum = 0;
  uint64_t header_checksum = 0;
};

uint64_t HeaderChecksum(const uint8_t* header, std::string_view key) {
  Hasher64 h;
  h.update(header, 40);
  h.update(key);
  return h.digest();
}

void EncodeRecordHeader(const RecordHeader& r, std::string_view key, uint8_t* out) {
  std::memset(out, 0, kRecordHeaderBytes);
  Store<uint32_t>(out, kRecordMagic);
  out[4] = r.type;
  Store<uint32_t>(out + 8, r.key_len);
  Store<uint32_t>(out + 12, r.stored_len);
  Store<uint64_t>(out + 16, r.raw_len);
  Store<int64_t>(out + 24, r.expires_at_ms);
  Store<uint64_t>(out + 32, r.value_checksum);
  Store<uint64_t>(out + 40, HeaderChecksum(out, key));
}

// nullptr when well-formed (the header checksum needs the key: the caller checks it).
const char* DecodeRecordHeader(const uint8_t* p, RecordHeader* r) {
  if (Load<uint32_t>(p) != kRecordMagic) return "bad record magic";
  r->type = p[4];
  if (r->type != kTypePut && r->type != kTypeDelete) return "unknown record type";
  if (p[5] != 0 || p[6] != 0 || p[7] != 0) return "reserved bytes set";
  r->key_len = Load<uint32_t>(p + 8);
  r->stored_len = Load<uint32_t>(p + 12);
  r->raw_len = Load<uint64_t>(p + 16);
  r->expires_at_ms = Load<int64_t>(p + 24);
  r->value_checksum = Load<uint64_t>(p + 32);
  r->header_checksum = Load<uint64_t>(p + 40);
  if (r->key_len == 0 || r->key_len > kvstore::kMaxKeyBytes) return "key length out of range";
  if (r->raw_len > kColdMaxValueBytes || r->stored_len > ZSTD_compressBound(kColdMaxValueBytes)) {
    return "value length over the limit";
  }
  if (r->type == kTypeDelete && (r->raw_len != 0 || r->stored_len != 0)) return "tombstone with a value";
  return nullptr;
}

void EncodeSegmentHeader(uint64_t id, uint8_t* out) {
  std::memset(out, 0, kSegmentHeaderBytes);
  Store<uint32_t>(out, kSegmentMagic);
  Store<uint32_t>(out + 4, kFormatVersion);
  Store<uint64_t>(out + 8, id);
  Store<uint64_t>(out + 24, Xxh3_64(out, 24));
}

const char* CheckSegmentHeader(const uint8_t* p, uint64_t id) {
  if (Load<uint32_t>(p) != kSegmentMagic) return "bad segment magic";
  if (Load<uint64_t>(p + 24) != Xxh3_64(p, 24)) return "segment header checksum mismatch";
  if (Load<uint32_t>(p + 4) != kFormatVersion) return "unsupported format version";
  if (Load<uint64_t>(p + 8) != id) return "segment id does not match the file name";
  return nullptr;
}

std::string SegmentFileName(uint64_t id) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "cold-%08" PRIu64 ".seg", id);
  return buf;
}

bool ParseSegmentFileName(const std::string& name, uint64_t* id) {
  constexpr std::string_view kPrefix = "cold-", kSuffix = ".seg";
  if (name.size() <= kPrefix.size() + kSuffix.size() || !name.starts_with(kPrefix) || !name.ends_with(kSuffix)) {
    return false;
  }
  const std::string_view digits(name.data() + kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  if (digits.size() > 18) return false;
  uint64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v == 0) return false;
  *id = v;
  return true;
}

std::string Errno(int err) { return std::strerror(err); }

Status PreadFully(int fd, const std::string& path, uint64_t offset, uint8_t* dst, size_t n) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, dst, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::IOError(path + ": read at offset " + std::to_string(offset) + ": " + Errno(errno));
    if (r == 0) return Status::Corruption(path + ": record at offset " + std::to_string(offset) + " runs past the end");
    dst += r;
    offset += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
  return Status::Ok();
}

Status PwriteFully(int fd, const std::string& path, uint64_t offset, const uint8_t* src, size_t n) {
  while (n > 0) {
    const ssize_t r = ::pwrite(fd, src, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::IOError(path + ": write at offset " + std::to_string(offset) + ": " + Errno(errno));
    src += r;
    offset += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
  return Status::Ok();
}

enum class ScanState { kValid, kBadValue, kInvalid };

// Classifies the record at `off` of a segment held in memory.
ScanState ScanRecord(const std::vector<uint8_t>& buf, uint64_t off, RecordHeader* h, std::string* key,
                     uint64_t* end, const char** why) {
  const uint64_t left = buf.size() - off;
  if (left < kRecordHeaderBytes) {
    *why = "torn record header";
    return ScanState::kInvalid;
  }
  if ((*why = DecodeRecordHeader(buf.data() + off, h)) != nullptr) return ScanState::kInvalid;
  if (left < kRecordHeaderBytes + h->key_len) {
    *why = "torn key";
    return ScanState::kInvalid;
  }
  key->assign(reinterpret_cast<const char*>(buf.data() + off + kRecordHeaderBytes), h->key_len);
  if (HeaderChecksum(buf.data() + off, *key) != h->header_checksum) {
    *why = "record header checksum mismatch";
    return ScanState::kInvalid;
  }
  const uint64_t record_bytes = kRecordHeaderBytes + h->key_len + h->stored_len;
  if (left < record_bytes) {
    *why = "torn value";
    return ScanState::kInvalid;
  }
  *end = off + record_bytes;
  if (Xxh3_64(buf.data() + off + kRecordHeaderBytes + h->key_len, h->stored_len) != h->value_checksum) {
    *why = "value checksum mismatch";
    return ScanState::kBadValue;
  }
  return ScanState::kValid;
}

}  // namespace

struct ColdTier::Segment {
  Segment(uint64_t id, std::string path, int fd) : id(id), path(std::move(path)), fd(fd) {}
  ~Segment() { ::close(fd); }  // after the last reader lets go of its shared_ptr
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  const uint64_t id;
  const std::string path;
  const int fd;
  uint64_t size = 0;  // guarded by append_mu_ once Open returns
  bool appendable = true;
};

ColdTier::ColdTier(ColdTierOptions options, int lock_fd) : options_(std::move(options)), lock_fd_(lock_fd) {}

ColdTier::~ColdTier() {
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

Result<std::unique_ptr<ColdTier>> ColdTier::Open(const ColdTierOptions& options) {
  if (options.dir.empty()) return Status::InvalidArgument("cold: no directory given");
  if (options.segment_bytes < 4096) return Status::InvalidArgument("cold: segment_bytes must be at least 4096");
  if (options.zstd_level < ZSTD_minCLevel() || options.zstd_level > ZSTD_maxCLevel()) {
    return Status::InvalidArgument("cold: zstd level " + std::to_string(options.zstd_level) + " out of range");
  }
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return Status::IOError(options.dir + ": create directory: " + ec.message());
  const std::string lock_path = options.dir + "/LOCK";
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0) return Status::IOError(lock_path + ": open: " + Errno(errno));
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(lock_fd);
    if (err == EWOULDBLOCK) return Status::Unavailable(options.dir + ": in use by another ColdTier");
    return Status::IOError(lock_path + ": flock: " + Errno(err));
  }
  std::unique_ptr<ColdTier> tier(new ColdTier(options, lock_fd));
  KEEL_RETURN_IF_ERROR(tier->Recover());
  return tier;
}

// Open is single-threaded, so the *Locked helpers run here without their locks.
Status ColdTier::Recover() {
  std::vector<uint64_t> ids;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(options_.dir, ec), end; !ec && it != end; it.increment(ec)) {
    uint64_t id = 0;
    if (it->is_regular_file() && ParseSegmentFileName(it->path().filename().string(), &id)) ids.push_back(id);
  }
  if (ec) return Status::IOError(options_.dir + ": list: " + ec.message());
  std::sort(ids.begin(), ids.end());
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string path = options_.dir + "/" + SegmentFileName(ids[i]);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return Status::IOError(path + ": open: " + Errno(errno));
    auto seg = std::make_shared<Segment>(ids[i], path, fd);
    KEEL_RETURN_IF_ERROR(ScanSegment(*seg, i + 1 == ids.size()));
    if (options_.uncached_reads) kvstore::NoReadahead(fd);  // after the sequential scan
    segments_[seg->id] = seg;
    disk_bytes_ += static_cast<int64_t>(seg->size);
    recovery_.segments++;
  }
  next_segment_id_ = ids.empty() ? 1 : ids.back() + 1;
  if (!ids.empty() && segments_.rbegin()->second->appendable) {
    active_ = segments_.rbegin()->second;
    return Status::Ok();
  }
  return RollLocked();
}

// Reads the whole segment (at most segment_bytes plus one record) and replays it. Unlike
// SsdTier every value is verified here: a cold tier is opened rarely and read rarely, so
// finding rot at Open is worth one sequential pass.
Status ColdTier::ScanSegment(Segment& seg, bool is_last) {
  struct stat st {};
  if (::fstat(seg.fd, &st) != 0) return Status::IOError(seg.path + ": fstat: " + Errno(errno));
  std::vector<uint8_t> buf(static_cast<size_t>(st.st_size));
  KEEL_RETURN_IF_ERROR(PreadFully(seg.fd, seg.path, 0, buf.data(), buf.size()));
  if (options_.uncached_reads) kvstore::DropCache(seg.fd, 0, buf.size());
  seg.size = buf.size();
  const char* bad = buf.size() < kSegmentHeaderBytes ? "file shorter than a segment header"
                                                      : CheckSegmentHeader(buf.data(), seg.id);
  if (bad != nullptr) {
    Log().warn("cold: {}: {}; its {} bytes are ignored", seg.path, bad, buf.size());
    recovery_.corrupt_records++;
    seg.appendable = false;
    return Status::Ok();
  }
  const int64_t now_ms = kvstore::NowUnixMs();
  uint64_t off = kSegmentHeaderBytes;
  while (off < buf.size()) {
    RecordHeader h;
    std::string key;
    uint64_t end = 0;
    const char* why = nullptr;
    const ScanState state = ScanRecord(buf, off, &h, &key, &end, &why);
    if (state == ScanState::kValid) {
      if (h.type == kTypeDelete || (h.expires_at_ms != 0 && h.expires_at_ms <= now_ms)) {
        IndexEraseLocked(key);
      } else {
        IndexPutLocked(key, Location{seg.id, off, h.key_len, h.stored_len, h.raw_len, h.expires_at_ms});
      }
      recovery_.records++;
      off = end;
      continue;
    }
    recovery_.corrupt_records++;
    if (state == ScanState::kBadValue && end < buf.size()) {
      // Damage in the middle, not a torn tail: forget the key (an older version must not come
      // back) and step over the record, whose lengths the header checksum vouches for.
      Log().warn("cold: {}: record at offset {}: {}; skipped", seg.path, off, why);
      IndexEraseLocked(key);
      off = end;
      continue;
    }
    if (is_last) {
      Log().warn("cold: {}: invalid record at offset {} ({}); cutting {} bytes", seg.path, off, why, buf.size() - off);
      if (::ftruncate(seg.fd, static_cast<off_t>(off)) != 0) {
        return Status::IOError(seg.path + ": truncate: " + Errno(errno));
      }
      recovery_.truncated_bytes += static_cast<int64_t>(buf.size() - off);
      seg.size = off;
    } else {
      Log().warn("cold: {}: invalid record at offset {} ({}); the rest is ignored", seg.path, off, why);
    }
    break;
  }
  return Status::Ok();
}

Status ColdTier::Put(std::string_view key, const Entry& entry) {
  KEEL_RETURN_IF_ERROR(kvstore::ValidateKey(key));
  if (entry.value == nullptr) return Status::InvalidArgument("cold: null value");
  KEEL_RETURN_IF_ERROR(Append(kTypePut, key, entry.value.get(), entry.expires_at_ms));
  puts_++;
  return Status::Ok();
}

Status ColdTier::Delete(std::string_view key) {
  KEEL_RETURN_IF_ERROR(kvstore::ValidateKey(key));
  {
    std::shared_lock lock(index_mu_);
    if (index_.find(key) == index_.end()) return Status::Ok();  // nothing on disk to hide
  }
  return Append(kTypeDelete, key, nullptr, 0);
}

Status ColdTier::Append(uint8_t type, std::string_view key, const Blob* value, int64_t expires_at_ms) {
  const size_t raw_len = value != nullptr ? value->size() : 0;
  if (raw_len > kColdMaxValueBytes) {
    return Status::InvalidArgument("cold: value of " + std::to_string(raw_len) + " bytes exceeds the limit");
  }
  // Compress outside the lock: it is the expensive part of a Put.
  std::vector<uint8_t> rec(kRecordHeaderBytes + key.size() + (raw_len > 0 ? ZSTD_compressBound(raw_len) : 0));
  uint8_t* stored = rec.data() + kRecordHeaderBytes + key.size();
  size_t stored_len = 0;
  if (raw_len > 0) {
    stored_len = ZSTD_compress(stored, rec.size() - kRecordHeaderBytes - key.size(), value->data(), raw_len,
                               options_.zstd_level);
    if (ZSTD_isError(stored_len)) return Status::Internal(std::string("cold: zstd: ") + ZSTD_getErrorName(stored_len));
  }
  rec.resize(kRecordHeaderBytes + key.size() + stored_len);
  std::memcpy(rec.data() + kRecordHeaderBytes, key.data(), key.size());
  RecordHeader h;
  h.type = type;
  h.key_len = static_cast<uint32_t>(key.size());
  h.stored_len = static_cast<uint32_t>(stored_len);
  h.raw_len = raw_len;
  h.expires_at_ms = expires_at_ms;
  h.value_checksum = Xxh3_64(rec.data() + kRecordHeaderBytes + key.size(), stored_len);
  EncodeRecordHeader(h, key, rec.data());

  std::lock_guard<std::mutex> lock(append_mu_);
  if (active_->size > kSegmentHeaderBytes && active_->size + rec.size() > static_cast<uint64_t>(options_.segment_bytes)) {
    if (Status s = RollLocked(); !s.ok()) {
      errors_++;
      return s;
    }
  }
  Segment& seg = *active_;
  const uint64_t off = seg.size;
  if (Status s = PwriteFully(seg.fd, seg.path, off, rec.data(), rec.size()); !s.ok()) {
    errors_++;
    // Cut the partial record so later appends follow valid data.
    (void)::ftruncate(seg.fd, static_cast<off_t>(off));
    return s;
  }
  if (options_.sync_each_put && ::fdatasync(seg.fd) != 0) {
    errors_++;
    return Status::IOError(seg.path + ": fdatasync: " + Errno(errno));
  }
  if (options_.uncached_reads) kvstore::StartWriteback(seg.fd, off, rec.size());
  seg.size += rec.size();
  disk_bytes_ += static_cast<int64_t>(rec.size());
  std::unique_lock index_lock(index_mu_);
  if (type == kTypeDelete || (expires_at_ms != 0 && expires_at_ms <= kvstore::NowUnixMs())) {
    IndexEraseLocked(key);
  } else {
    IndexPutLocked(key, Location{seg.id, off, h.key_len, h.stored_len, h.raw_len, expires_at_ms});
  }
  return Status::Ok();
}

Status ColdTier::RollLocked() {
  // Synced so torn appends can only be in the last segment (recovery cuts only there).
  if (active_ != nullptr && ::fdatasync(active_->fd) != 0) {
    return Status::IOError(active_->path + ": fdatasync: " + Errno(errno));
  }
  const uint64_t id = next_segment_id_++;
  const std::string path = options_.dir + "/" + SegmentFileName(id);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path + ": create: " + Errno(errno));
  auto seg = std::make_shared<Segment>(id, path, fd);
  if (options_.uncached_reads) kvstore::NoReadahead(fd);
  uint8_t header[kSegmentHeaderBytes];
  EncodeSegmentHeader(id, header);
  if (Status s = PwriteFully(fd, path, 0, header, kSegmentHeaderBytes); !s.ok()) {
    ::unlink(path.c_str());
    return s;
  }
  seg->size = kSegmentHeaderBytes;
  disk_bytes_ += kSegmentHeaderBytes;
  {
    std::unique_lock lock(index_mu_);
    segments_[id] = seg;
  }
  active_ = std::move(seg);
  return Status::Ok();
}

void ColdTier::IndexPutLocked(std::string_view key, const Location& loc) {
  auto it = index_.find(key);
  if (it == index_.end()) {
    it = index_.emplace(std::string(key), loc).first;
  } else {
    live_raw_bytes_ -= static_cast<int64_t>(it->second.raw_len);
    live_stored_bytes_ -= it->second.stored_len;
    it->second = loc;
  }
  live_raw_bytes_ += static_cast<int64_t>(loc.raw_len);
  live_stored_bytes_ += loc.stored_len;
}

void ColdTier::IndexEraseLocked(std::string_view key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  live_raw_bytes_ -= static_cast<int64_t>(it->second.raw_len);
  live_stored_bytes_ -= it->second.stored_len;
  index_.erase(it);
}

// Get and GetMany differ only in how the reads are issued; the lookup and every check a record
// must pass live in these two helpers.
Status ColdTier::LookupLocked(std::string_view key, Location* loc, std::shared_ptr<Segment>* seg) {
  auto it = index_.find(key);
  if (it == index_.end() || (it->second.expires_at_ms != 0 && it->second.expires_at_ms <= kvstore::NowUnixMs())) {
    misses_++;
    return Status::NotFound("cold: key not found");
  }
  *loc = it->second;
  auto s = segments_.find(loc->segment_id);
  if (s == segments_.end()) return Status::Internal("cold: index names a missing segment");
  *seg = s->second;
  return Status::Ok();
}

Result<Entry> ColdTier::FinishRead(std::string_view key, const Location& loc, const Segment& seg, Status s,
                                   const uint8_t* rec) {
  const size_t record_bytes = kRecordHeaderBytes + loc.key_len + loc.stored_len;
  if (options_.uncached_reads) kvstore::DropCache(seg.fd, loc.offset, record_bytes);
  std::shared_ptr<Blob> value;
  if (s.ok()) {
    RecordHeader h;
    const char* why = DecodeRecordHeader(rec, &h);
    const std::string_view stored_key(reinterpret_cast<const char*>(rec + kRecordHeaderBytes), loc.key_len);
    const uint8_t* stored = rec + kRecordHeaderBytes + loc.key_len;
    if (why == nullptr && (h.type != kTypePut || h.key_len != loc.key_len || h.stored_len != loc.stored_len ||
                           h.raw_len != loc.raw_len)) {
      why = "record does not match the index";
    } else if (why == nullptr && HeaderChecksum(rec, stored_key) != h.header_checksum) {
      why = "record header checksum mismatch";
    } else if (why == nullptr && stored_key != key) {
      why = "record holds another key";
    } else if (why == nullptr && Xxh3_64(stored, loc.stored_len) != h.value_checksum) {
      why = "value checksum mismatch";
    }
    if (why == nullptr) {
      value = Blob::Allocate(loc.raw_len);
      if (loc.raw_len > 0) {
        const size_t n = ZSTD_decompress(value->data(), loc.raw_len, stored, loc.stored_len);
        if (ZSTD_isError(n) || n != loc.raw_len) why = "value does not decompress to its recorded size";
      }
    }
    if (why != nullptr) {
      s = Status::Corruption(seg.path + ": record at offset " + std::to_string(loc.offset) + ": " + why);
    }
  }
  if (!s.ok()) {
    errors_++;
    Log().warn("cold: {}", s.message());
    if (s.code() == StatusCode::kCorruption) {
      std::unique_lock lock(index_mu_);  // drop the entry unless a Put replaced it meanwhile
      auto it = index_.find(key);
      if (it != index_.end() && it->second.segment_id == loc.segment_id && it->second.offset == loc.offset) {
        IndexEraseLocked(key);
      }
    }
    return s;
  }
  hits_++;
  return Entry{std::move(value), loc.expires_at_ms};
}

namespace {

kvstore::BatchRead RecordRead(int fd, const std::string& path, uint64_t offset, uint8_t* rec, size_t record_bytes) {
  kvstore::BatchRead r;
  r.fd = fd;
  r.path = &path;
  r.offset = offset;
  r.iov[0] = {rec, record_bytes};
  r.iovcnt = 1;
  return r;
}

}  // namespace

Result<Entry> ColdTier::Get(std::string_view key) {
  KEEL_RETURN_IF_ERROR(kvstore::ValidateKey(key));
  Location loc;
  std::shared_ptr<Segment> seg;
  {
    std::shared_lock lock(index_mu_);
    KEEL_RETURN_IF_ERROR(LookupLocked(key, &loc, &seg));
  }
  std::vector<uint8_t> rec(kRecordHeaderBytes + loc.key_len + loc.stored_len);
  kvstore::BatchRead read = RecordRead(seg->fd, seg->path, loc.offset, rec.data(), rec.size());
  Status s;
  kvstore::ReadBatch({&read, 1}, {&s, 1}, options_.use_io_uring);
  return FinishRead(key, loc, *seg, std::move(s), rec.data());
}

// Lookups under one shared lock, every record read in one io_uring batch, then each verified
// and decompressed. Keys that fail the lookup take no read.
std::vector<Result<Entry>> ColdTier::GetMany(const std::vector<std::string_view>& keys) {
  constexpr size_t kNoRead = ~size_t{0};
  struct Pending {
    Status status;  // the lookup's, when it failed
    Location loc;
    std::shared_ptr<Segment> seg;
    size_t read = kNoRead;  // index into `reads`
    size_t buf_offset = 0;  // of the record's bytes in `buf`
  };
  std::vector<Pending> pending(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) pending[i].status = kvstore::ValidateKey(keys[i]);
  size_t n_reads = 0;
  size_t buf_bytes = 0;
  {
    std::shared_lock lock(index_mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      Pending& p = pending[i];
      if (p.status.ok()) p.status = LookupLocked(keys[i], &p.loc, &p.seg);
      if (!p.status.ok()) continue;
      p.read = n_reads++;
      p.buf_offset = buf_bytes;
      buf_bytes += kRecordHeaderBytes + p.loc.key_len + p.loc.stored_len;
    }
  }
  std::vector<uint8_t> buf(buf_bytes);  // every record, back to back
  std::vector<kvstore::BatchRead> reads;
  reads.reserve(n_reads);
  for (const Pending& p : pending) {
    if (p.read == kNoRead) continue;
    reads.push_back(RecordRead(p.seg->fd, p.seg->path, p.loc.offset, buf.data() + p.buf_offset,
                               kRecordHeaderBytes + p.loc.key_len + p.loc.stored_len));
  }
  std::vector<Status> read_status(n_reads);
  kvstore::ReadBatch(reads, read_status, options_.use_io_uring);

  std::vector<Result<Entry>> out;
  out.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    Pending& p = pending[i];
    if (p.read == kNoRead) {
      out.push_back(std::move(p.status));
    } else {
      out.push_back(FinishRead(keys[i], p.loc, *p.seg, std::move(read_status[p.read]), buf.data() + p.buf_offset));
    }
  }
  return out;
}

Result<bool> ColdTier::Contains(std::string_view key) {
  KEEL_RETURN_IF_ERROR(kvstore::ValidateKey(key));
  std::shared_lock lock(index_mu_);
  auto it = index_.find(key);
  return it != index_.end() && (it->second.expires_at_ms == 0 || it->second.expires_at_ms > kvstore::NowUnixMs());
}

int64_t ColdTier::StoredBytes() const {
  std::shared_lock lock(index_mu_);
  return live_stored_bytes_;
}

kvstore::TierStats ColdTier::Stats() const {
  kvstore::TierStats s;
  s.name = "cold";
  {
    std::shared_lock lock(index_mu_);
    s.items = static_cast<int64_t>(index_.size());
    s.bytes = live_raw_bytes_;
  }
  s.hits = hits_.load();
  s.misses = misses_.load();
  s.puts = puts_.load();
  s.errors = errors_.load();
  return s;
}

}  // namespace keel::vector::coloc
