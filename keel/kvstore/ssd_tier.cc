#include "keel/kvstore/ssd_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "keel/core/hash.h"
#include "keel/core/log.h"
#include "keel/kvstore/uring_batch.h"

namespace keel::kvstore {
namespace {

static_assert(std::endian::native == std::endian::little, "the on-disk integers are little-endian");

// Segment file header, 32 bytes:
//   0 u32 magic "KSSG"   4 u32 format version   8 u64 segment id   16 u64 reserved (0)
//   24 u64 XXH3-64 of bytes [0,24)
// Version 2 records carry the write's sequence number; version 1 segments (no sequence
// numbers: their records count as seq 0, ordered by position) are still read, never appended to.
constexpr uint32_t kSegmentMagic = 0x4753534B;  // "KSSG"
constexpr uint32_t kFormatVersion = 2;
constexpr uint32_t kOldestReadableVersion = 1;
constexpr size_t kSegmentHeaderBytes = 32;

// Record (version 2) = 56-byte header, key, value:
//   0 u32 magic "KSRC"   4 u8 type (1 PUT, 2 DELETE)   5..7 reserved (0)   8 u32 key_len
//   12 u32 reserved (0)   16 u64 value_len   24 i64 expires_at_ms (0 = never)
//   32 u64 seq: the write's sequence number (tier.h); recovery keeps each key's highest
//   40 u64 value_checksum: XXH3-64 of the value
//   48 u64 header_checksum: XXH3-64 of bytes [0,48) + key
// Version 1 had no seq field: value_checksum at 32, header_checksum at 40 over [0,40) + key.
// Why two checksums (as in the wire protocol): the header checksum makes the lengths
// trustworthy before they are used, so recovery can step over a record whose value rotted
// instead of losing the rest of the segment; and the value checksum is the Blob's own
// checksum, reused from Put (the server verified it on receipt) and handed back on Get, so a
// value is hashed once per write and once per read. Together they cover header, key and value.
constexpr uint32_t kRecordMagic = 0x4352534B;  // "KSRC"
constexpr size_t kRecordHeaderBytes = 56;       // what Append writes (version 2)
constexpr size_t kRecordHeaderBytesV1 = 48;

constexpr size_t RecordHeaderBytes(uint32_t version) {
  return version == 1 ? kRecordHeaderBytesV1 : kRecordHeaderBytes;
}
constexpr uint8_t kTypePut = 1;
constexpr uint8_t kTypeDelete = 2;

constexpr int64_t kMinSegmentBytes = 4096;

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
  uint64_t value_len = 0;
  int64_t expires_at_ms = 0;
  uint64_t seq = 0;
  uint64_t value_checksum = 0;
  uint64_t header_checksum = 0;
};

// Over the header up to its own checksum field, then the key.
uint64_t HeaderChecksum(const uint8_t* header, std::string_view key, uint32_t version) {
  Hasher64 h;
  h.update(header, RecordHeaderBytes(version) - 8);
  h.update(key);
  return h.digest();
}

void EncodeRecordHeader(const RecordHeader& r, std::string_view key, uint8_t* out) {
  std::memset(out, 0, kRecordHeaderBytes);
  Store<uint32_t>(out, kRecordMagic);
  out[4] = r.type;
  Store<uint32_t>(out + 8, r.key_len);
  Store<uint64_t>(out + 16, r.value_len);
  Store<int64_t>(out + 24, r.expires_at_ms);
  Store<uint64_t>(out + 32, r.seq);
  Store<uint64_t>(out + 40, r.value_checksum);
  Store<uint64_t>(out + 48, HeaderChecksum(out, key, kFormatVersion));
}

// Parses and bounds-checks a record header of a segment of `version`; nullptr when well-formed,
// else why not. The header checksum needs the key and is checked by the caller.
const char* DecodeRecordHeader(const uint8_t* p, uint32_t version, RecordHeader* r) {
  if (Load<uint32_t>(p) != kRecordMagic) return "bad record magic";
  r->type = p[4];
  if (r->type != kTypePut && r->type != kTypeDelete) return "unknown record type";
  if (p[5] != 0 || p[6] != 0 || p[7] != 0 || Load<uint32_t>(p + 12) != 0) return "reserved bytes set";
  r->key_len = Load<uint32_t>(p + 8);
  r->value_len = Load<uint64_t>(p + 16);
  r->expires_at_ms = Load<int64_t>(p + 24);
  if (version == 1) {
    r->seq = 0;
    r->value_checksum = Load<uint64_t>(p + 32);
    r->header_checksum = Load<uint64_t>(p + 40);
  } else {
    r->seq = Load<uint64_t>(p + 32);
    r->value_checksum = Load<uint64_t>(p + 40);
    r->header_checksum = Load<uint64_t>(p + 48);
  }
  if (r->key_len == 0 || r->key_len > kMaxKeyBytes) return "key length out of range";
  if (r->value_len > kSsdMaxValueBytes) return "value length over the limit";
  if (r->type == kTypeDelete && r->value_len != 0) return "tombstone with a value";
  return nullptr;
}

void EncodeSegmentHeader(uint64_t id, uint8_t* out) {
  std::memset(out, 0, kSegmentHeaderBytes);
  Store<uint32_t>(out, kSegmentMagic);
  Store<uint32_t>(out + 4, kFormatVersion);
  Store<uint64_t>(out + 8, id);
  Store<uint64_t>(out + 24, Xxh3_64(out, 24));
}

// nullptr and the segment's format version in *version when the header is sound.
const char* CheckSegmentHeader(const uint8_t* p, uint64_t id, uint32_t* version) {
  if (Load<uint32_t>(p) != kSegmentMagic) return "bad segment magic";
  if (Load<uint64_t>(p + 24) != Xxh3_64(p, 24)) return "segment header checksum mismatch";
  *version = Load<uint32_t>(p + 4);
  if (*version < kOldestReadableVersion || *version > kFormatVersion) return "unsupported format version";
  if (Load<uint64_t>(p + 8) != id) return "segment id does not match the file name";
  return nullptr;
}

std::string SegmentFileName(uint64_t id) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "seg-%08" PRIu64 ".kvs", id);
  return buf;
}

// "seg-00000042.kvs" -> 42; false for any other name.
bool ParseSegmentFileName(const std::string& name, uint64_t* id) {
  constexpr std::string_view kPrefix = "seg-", kSuffix = ".kvs";
  if (name.size() <= kPrefix.size() + kSuffix.size() || !name.starts_with(kPrefix) || !name.ends_with(kSuffix)) {
    return false;
  }
  std::string_view digits(name.data() + kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
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

Status WriteFully(int fd, const std::string& path, uint64_t offset, iovec* iov, int iovcnt) {
  AdvanceIov(iov, iovcnt, 0);
  while (iovcnt > 0) {
    const ssize_t n = ::pwritev(fd, iov, std::min(iovcnt, IOV_MAX), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::IOError(path + ": write at offset " + std::to_string(offset) + ": " + Errno(errno));
    }
    offset += static_cast<uint64_t>(n);
    AdvanceIov(iov, iovcnt, static_cast<size_t>(n));
  }
  return Status::Ok();
}

Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(dir + ": open: " + Errno(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::IOError(dir + ": fsync: " + Errno(err));
  return Status::Ok();
}

// Buffered forward reads over one segment file, for the recovery scan.
class ScanReader {
 public:
  ScanReader(int fd, std::string path, uint64_t file_size, size_t buffer_bytes)
      : fd_(fd), path_(std::move(path)), file_size_(file_size), buf_(buffer_bytes) {}

  // Copies [off, off+n) into dst; n must fit the buffer.
  Status Read(uint64_t off, size_t n, uint8_t* dst) {
    while (n > 0) {
      KEEL_RETURN_IF_ERROR(Window(off));
      const size_t take = std::min<uint64_t>(n, buf_off_ + buf_len_ - off);
      std::memcpy(dst, buf_.data() + (off - buf_off_), take);
      dst += take;
      off += take;
      n -= take;
    }
    return Status::Ok();
  }

  // XXH3-64 of [off, off+n), streamed through the buffer.
  Result<uint64_t> Hash(uint64_t off, uint64_t n) {
    Hasher64 h;
    while (n > 0) {
      KEEL_RETURN_IF_ERROR(Window(off));
      const size_t take = std::min<uint64_t>(n, buf_off_ + buf_len_ - off);
      h.update(buf_.data() + (off - buf_off_), take);
      off += take;
      n -= take;
    }
    return h.digest();
  }

 private:
  // Makes the buffer hold at least the byte at `off`.
  Status Window(uint64_t off) {
    if (off >= buf_off_ && off < buf_off_ + buf_len_) return Status::Ok();
    const size_t want = std::min<uint64_t>(buf_.size(), file_size_ - std::min(off, file_size_));
    size_t got = 0;
    while (got < want) {
      const ssize_t n = ::pread(fd_, buf_.data() + got, want - got, static_cast<off_t>(off + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::IOError(path_ + ": read at offset " + std::to_string(off + got) + ": " + Errno(errno));
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    if (got == 0) return Status::IOError(path_ + ": unexpected end of file at offset " + std::to_string(off));
    buf_off_ = off;
    buf_len_ = got;
    return Status::Ok();
  }

  int fd_;
  std::string path_;
  uint64_t file_size_;
  std::vector<uint8_t> buf_;
  uint64_t buf_off_ = 0;
  size_t buf_len_ = 0;
};

struct ScannedRecord {
  enum class State { kValid, kBadValue, kInvalid };
  State state = State::kInvalid;
  RecordHeader header;
  std::string key;
  uint64_t end = 0;  // offset just past the record (when the header is trustworthy)
  std::string why;   // for kBadValue / kInvalid
};

// Reads the record at `off`. kInvalid: no trustworthy record starts here (torn or garbage);
// kBadValue: header and key are sound but the value fails its checksum.
Result<ScannedRecord> ScanRecord(ScanReader& reader, uint64_t off, uint64_t file_size, uint32_t version,
                                 bool verify_value) {
  ScannedRecord rec;
  const uint64_t left = file_size - off;
  const size_t header_bytes = RecordHeaderBytes(version);
  if (left < header_bytes) {
    rec.why = "torn record header (" + std::to_string(left) + " bytes left)";
    return rec;
  }
  uint8_t hdr[kRecordHeaderBytes];
  KEEL_RETURN_IF_ERROR(reader.Read(off, header_bytes, hdr));
  if (const char* why = DecodeRecordHeader(hdr, version, &rec.header)) {
    rec.why = why;
    return rec;
  }
  const RecordHeader& h = rec.header;
  if (left < header_bytes + h.key_len) {
    rec.why = "torn key";
    return rec;
  }
  rec.key.resize(h.key_len);
  KEEL_RETURN_IF_ERROR(reader.Read(off + header_bytes, h.key_len, reinterpret_cast<uint8_t*>(rec.key.data())));
  if (HeaderChecksum(hdr, rec.key, version) != h.header_checksum) {
    rec.why = "record header checksum mismatch";
    return rec;
  }
  const uint64_t record_bytes = header_bytes + h.key_len + h.value_len;
  if (left < record_bytes) {
    rec.why = "torn value (record needs " + std::to_string(record_bytes) + " bytes, " + std::to_string(left) + " left)";
    return rec;
  }
  rec.end = off + record_bytes;
  if (verify_value) {
    KEEL_ASSIGN_OR_RETURN(uint64_t sum, reader.Hash(off + header_bytes + h.key_len, h.value_len));
    if (sum != h.value_checksum) {
      rec.state = ScannedRecord::State::kBadValue;
      rec.why = "value checksum mismatch";
      return rec;
    }
  }
  rec.state = ScannedRecord::State::kValid;
  return rec;
}

// The offset of the first record after `from` whose header and key are sound (magic and header
// checksum), or file_size. It tells damage (sound records follow) from a torn tail (none do).
Result<uint64_t> NextSoundRecord(ScanReader& reader, uint64_t from, uint64_t file_size, uint32_t version) {
  const size_t header_bytes = RecordHeaderBytes(version);
  for (uint64_t off = from; off + header_bytes <= file_size; ++off) {
    uint32_t magic = 0;
    KEEL_RETURN_IF_ERROR(reader.Read(off, sizeof(magic), reinterpret_cast<uint8_t*>(&magic)));
    if (magic != kRecordMagic) continue;
    KEEL_ASSIGN_OR_RETURN(ScannedRecord rec, ScanRecord(reader, off, file_size, version, /*verify_value=*/false));
    if (rec.state == ScannedRecord::State::kValid) return off;
  }
  return file_size;
}

}  // namespace

void DropCache(int fd, uint64_t offset, uint64_t len) {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page;
  const uint64_t end = (offset + len + page - 1) / page * page;
  // Dirty or under-writeback pages survive POSIX_FADV_DONTNEED, so wait for them first. After
  // StartWriteback on the append this is normally a no-op.
  (void)::sync_file_range(fd, static_cast<off_t>(begin), static_cast<off_t>(end - begin),
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
  (void)::posix_fadvise(fd, static_cast<off_t>(begin), static_cast<off_t>(end - begin), POSIX_FADV_DONTNEED);
}

void NoReadahead(int fd) { (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM); }

void StartWriteback(int fd, uint64_t offset, uint64_t len) {
  (void)::sync_file_range(fd, static_cast<off_t>(offset), static_cast<off_t>(len), SYNC_FILE_RANGE_WRITE);
}

struct SsdTier::Segment {
  Segment(uint64_t id, std::string path, int fd) : id(id), path(std::move(path)), fd(fd) {}
  ~Segment() { ::close(fd); }  // after the last in-flight read: readers hold a shared_ptr
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const uint64_t id;
  const std::string path;
  const int fd;
  uint32_t version = kFormatVersion;  // set by the recovery scan; only kFormatVersion is appended to
  // Below: guarded by append_mu_ once Open returns.
  uint64_t size = 0;              // bytes in the file
  bool appendable = true;         // false when its header is bad: never written to again
  std::vector<std::string> keys;  // keys put here, so eviction drops exactly its entries
};

SsdTier::SsdTier(SsdOptions options, DirLock lock) : options_(std::move(options)), lock_(std::move(lock)) {}

SsdTier::~SsdTier() = default;

Result<std::unique_ptr<SsdTier>> SsdTier::Open(const SsdOptions& options) {
  if (options.dir.empty()) return Status::InvalidArgument("ssd: no directory given");
  if (options.capacity_bytes < kMinSegmentBytes || options.segment_bytes < kMinSegmentBytes) {
    return Status::InvalidArgument("ssd: capacity_bytes and segment_bytes must be at least " +
                                   std::to_string(kMinSegmentBytes));
  }
  SsdOptions opts = options;
  // Eviction drops a whole segment, so a segment may hold at most a quarter of the capacity.
  opts.segment_bytes = std::max(kMinSegmentBytes, std::min(opts.segment_bytes, opts.capacity_bytes / 4));
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return Status::IOError(options.dir + ": create directory: " + ec.message());

  // Two tiers appending to one directory would interleave records.
  KEEL_ASSIGN_OR_RETURN(DirLock lock, DirLock::Acquire(options.dir, "LOCK", "SSD tier"));
  std::unique_ptr<SsdTier> tier(new SsdTier(std::move(opts), std::move(lock)));
  tier->use_io_uring_ = options.use_io_uring && ThreadHasIoUring();
  KEEL_RETURN_IF_ERROR(tier->Recover());
  Log().info("ssd: opened {}: {} segments, {} entries, {} bytes on disk, reads via {}", options.dir,
             tier->recovery_.segments, tier->index_.size(), tier->DiskBytes(),
             tier->use_io_uring_ ? "io_uring" : "pread");
  return tier;
}

// Open is single-threaded, so the *Locked helpers run here without their locks.
Status SsdTier::Recover() {
  std::vector<uint64_t> ids;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(options_.dir, ec), end; !ec && it != end; it.increment(ec)) {
    uint64_t id = 0;
    if (it->is_regular_file() && ParseSegmentFileName(it->path().filename().string(), &id)) ids.push_back(id);
  }
  if (ec) return Status::IOError(options_.dir + ": list: " + ec.message());
  std::sort(ids.begin(), ids.end());
  // Eviction only ever removes the oldest segment, so ids run without gaps. A missing one took
  // newer versions and tombstones of some keys with it: older ones in earlier segments would
  // resurface, so that is damage like an unreadable region.
  for (size_t i = 1; i < ids.size(); ++i) {
    if (ids[i] != ids[i - 1] + 1) {
      Log().warn("ssd: {}: segments {} to {} are missing between {} and {}", options_.dir, ids[i - 1] + 1,
                 ids[i] - 1, SegmentFileName(ids[i - 1]), SegmentFileName(ids[i]));
      recovery_.damaged_regions++;
    }
  }

  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string path = options_.dir + "/" + SegmentFileName(ids[i]);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return Status::IOError(path + ": open: " + Errno(errno));
    auto seg = std::make_shared<Segment>(ids[i], path, fd);
    KEEL_RETURN_IF_ERROR(ScanSegment(*seg, /*is_last=*/i + 1 == ids.size()));
    if (options_.uncached_reads) {
      DropCache(fd, 0, seg->size);  // what the scan read
      NoReadahead(fd);
    }
    segments_[seg->id] = seg;
    disk_bytes_ += static_cast<int64_t>(seg->size);
    recovery_.segments++;
  }
  recovered_seq_ = {};  // only the scan needs it
  next_segment_id_ = ids.empty() ? 1 : ids.back() + 1;
  if (recovery_.damaged_regions > 0) KEEL_RETURN_IF_ERROR(DropAfterDamageLocked());
  if (!segments_.empty() && segments_.rbegin()->second->appendable) {
    active_ = segments_.rbegin()->second;
  } else {
    KEEL_RETURN_IF_ERROR(RollLocked());
  }
  // A smaller capacity than last time: shed the oldest segments now.
  return EnforceCapacityLocked(0);
}

// Replays one segment into the index. Only the last segment can hold a torn append (a segment
// is fdatasynced before the next one is created), so only it has its values re-hashed here and
// its invalid tail cut off; in older segments headers and keys are verified and a rotted value
// is caught by the checksum on Get. That keeps Open to a header walk over most of the data.
Status SsdTier::ScanSegment(Segment& seg, bool is_last) {
  struct stat st {};
  if (::fstat(seg.fd, &st) != 0) return Status::IOError(seg.path + ": fstat: " + Errno(errno));
  uint64_t file_size = static_cast<uint64_t>(st.st_size);
  seg.size = file_size;
  ScanReader reader(seg.fd, seg.path, file_size, is_last ? (1u << 20) : (64u << 10));

  uint8_t seg_header[kSegmentHeaderBytes];
  const char* bad_header = "file shorter than a segment header";
  if (file_size >= kSegmentHeaderBytes) {
    KEEL_RETURN_IF_ERROR(reader.Read(0, kSegmentHeaderBytes, seg_header));
    bad_header = CheckSegmentHeader(seg_header, seg.id, &seg.version);
  }
  if (bad_header != nullptr) {
    // Kept (it ages out FIFO like any segment) but never read or appended to. If sound records
    // follow the header, their keys are known but the damage may have taken others with it:
    // that is damage that may hide newer writes of any key. Without any (a crash right after
    // the segment was created, a stray file) nothing was lost.
    seg.appendable = false;
    recovery_.corrupt_records++;
    bool holds_records = false;
    if (file_size > kSegmentHeaderBytes) {
      KEEL_ASSIGN_OR_RETURN(uint64_t next, NextSoundRecord(reader, kSegmentHeaderBytes, file_size, kFormatVersion));
      holds_records = next < file_size;
    }
    Log().warn("ssd: {}: {}; its {} bytes are ignored", seg.path, bad_header, file_size);
    if (holds_records) recovery_.damaged_regions++;
    return Status::Ok();
  }

  // Only the newest format is appended to; an older segment is read, then left to age out.
  if (seg.version != kFormatVersion) seg.appendable = false;
  const int64_t now_ms = NowUnixMs();
  uint64_t off = kSegmentHeaderBytes;
  while (off < file_size) {
    KEEL_ASSIGN_OR_RETURN(ScannedRecord rec, ScanRecord(reader, off, file_size, seg.version, /*verify_value=*/is_last));
    if (rec.state == ScannedRecord::State::kValid) {
      const Location loc{seg.id,         off, rec.header.key_len, rec.header.value_len, rec.header.expires_at_ms,
                         rec.header.seq, static_cast<uint32_t>(RecordHeaderBytes(seg.version))};
      ApplyRecovered(rec.header.type, rec.key, loc, seg, now_ms);
      recovery_.records++;
      off = rec.end;
      continue;
    }
    if (rec.state == ScannedRecord::State::kBadValue && rec.end < file_size) {
      // A rotted value with a sound record after it is damage, not a torn tail: drop the key
      // (an older version must not resurface) and go on.
      KEEL_ASSIGN_OR_RETURN(ScannedRecord next, ScanRecord(reader, rec.end, file_size, seg.version, is_last));
      if (next.state == ScannedRecord::State::kValid) {
        Log().warn("ssd: {}: record at offset {}: {}; dropped", seg.path, off, rec.why);
        recovery_.corrupt_records++;
        uint64_t& newest = recovered_seq_[rec.key];
        if (rec.header.seq >= newest) {  // an older rotted record hides nothing newer
          newest = rec.header.seq;
          IndexEraseLocked(rec.key);
        }
        off = rec.end;
        continue;
      }
    }
    recovery_.corrupt_records++;
    KEEL_ASSIGN_OR_RETURN(const uint64_t next, NextSoundRecord(reader, off + 1, file_size, seg.version));
    if (is_last && next == file_size) {
      // Nothing sound after it: the crash cut the last append short (never acknowledged).
      Log().warn("ssd: {}: invalid record at offset {} ({}); cutting the {} bytes from there", seg.path, off, rec.why,
                 file_size - off);
      if (::ftruncate(seg.fd, static_cast<off_t>(off)) != 0) {
        return Status::IOError(seg.path + ": truncate to " + std::to_string(off) + ": " + Errno(errno));
      }
      recovery_.truncated_bytes += static_cast<int64_t>(file_size - off);
      seg.size = off;
      break;
    }
    // Damage: whatever stood here (a put, a delete) is unknown. Scanning goes on past it so the
    // sequence numbers keep rising above every write on disk; the tier is dropped afterwards.
    Log().warn("ssd: {}: invalid record at offset {} ({}); {} bytes unreadable", seg.path, off, rec.why, next - off);
    recovery_.damaged_regions++;
    seg.appendable = false;
    off = next;
  }
  return Status::Ok();
}

// Records were lost where their keys cannot be read. Any key may have had a newer put or a delete
// there, and demotions append old writes late, so no sequence bound tells which surviving
// records are still the newest. Serving them could return an older value, which the store
// promises never to do; the tier is a cache, so it starts empty instead. The files go too:
// scanned again at the next start, they would drop what is written from now on.
Status SsdTier::DropAfterDamageLocked() {
  Log().warn("ssd: {}: {} damaged regions where keys cannot be read; an older version of any key could resurface, so "
             "the tier drops its {} entries and {} segment files and starts empty",
             options_.dir, recovery_.damaged_regions, index_.size(), segments_.size());
  recovery_.dropped_entries = static_cast<int64_t>(index_.size());
  index_.clear();
  live_bytes_ = 0;
  for (auto& [id, seg] : segments_) {
    if (::unlink(seg->path.c_str()) != 0 && errno != ENOENT) {
      return Status::IOError(seg->path + ": unlink: " + Errno(errno));
    }
  }
  segments_.clear();
  disk_bytes_ = 0;
  return SyncDir(options_.dir);
}

// Records of a key are applied in sequence order, not file order: a record older than one
// already seen (put, tombstone or expired put) is skipped, so a late append of an old write
// never wins. Equal numbers (seq 0 of version 1 segments) fall back to file order.
void SsdTier::ApplyRecovered(uint8_t type, const std::string& key, const Location& loc, Segment& seg,
                             int64_t now_ms) {
  max_seq_ = std::max(max_seq_, loc.seq);
  auto [newest, first] = recovered_seq_.try_emplace(key, loc.seq);
  if (!first) {
    if (loc.seq < newest->second) {
      recovery_.stale_records++;
      return;
    }
    newest->second = loc.seq;
  }
  if (type == kTypeDelete || (loc.expires_at_ms != 0 && loc.expires_at_ms <= now_ms)) {
    IndexEraseLocked(key);  // an expired put still hides whatever came before it
    return;
  }
  IndexPutLocked(key, loc);
  seg.keys.push_back(key);
}

Status SsdTier::Put(std::string_view key, const Entry& entry) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  return Append(kTypePut, key, entry.value.get(), entry.expires_at_ms, entry.seq);
}

Status SsdTier::Delete(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  std::optional<uint64_t> seq = SeqOf(key);
  return Append(kTypeDelete, key, nullptr, 0, seq.value_or(0));
}

Status SsdTier::DeleteAt(std::string_view key, uint64_t seq) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  return Append(kTypeDelete, key, nullptr, 0, seq);
}

std::optional<uint64_t> SsdTier::SeqOf(std::string_view key) {
  std::lock_guard<std::mutex> lock(index_mu_);
  auto it = index_.find(key);
  if (it == index_.end() || (it->second.expires_at_ms != 0 && it->second.expires_at_ms <= NowUnixMs())) {
    return std::nullopt;
  }
  return it->second.seq;
}

uint64_t SsdTier::max_seq() const {
  std::lock_guard<std::mutex> lock(index_mu_);
  return max_seq_;
}

Status SsdTier::Append(uint8_t type, std::string_view key, const Blob* value, int64_t expires_at_ms, uint64_t seq) {
  const uint64_t value_len = value != nullptr ? value->size() : 0;  // a null value stores as empty
  if (value_len > kSsdMaxValueBytes) {
    return Status::InvalidArgument("ssd: value of " + std::to_string(value_len) + " bytes exceeds the limit of " +
                                   std::to_string(kSsdMaxValueBytes));
  }
  const uint64_t record_bytes = kRecordHeaderBytes + key.size() + value_len;
  if (kSegmentHeaderBytes + record_bytes > static_cast<uint64_t>(options_.capacity_bytes)) {
    return Status::ResourceExhausted("ssd: value of " + std::to_string(value_len) +
                                     " bytes can never fit the capacity of " + std::to_string(options_.capacity_bytes));
  }
  RecordHeader h;
  h.type = type;
  h.key_len = static_cast<uint32_t>(key.size());
  h.value_len = value_len;
  h.expires_at_ms = expires_at_ms;
  h.seq = seq;
  h.value_checksum = value != nullptr ? value->checksum() : Xxh3_64(nullptr, 0);
  uint8_t hdr[kRecordHeaderBytes];
  EncodeRecordHeader(h, key, hdr);

  // append_mu_ serialises appends, so no other write of the key can land between this check
  // and the index update below.
  std::lock_guard<std::mutex> lock(append_mu_);
  {
    std::lock_guard<std::mutex> index_lock(index_mu_);
    auto it = index_.find(key);
    if (it != index_.end() && it->second.seq > seq) {
      stale_puts_++;  // a newer write of the key is already here (tier.h: ordering)
      return Status::Ok();
    }
  }
  if (Status s = MakeRoomLocked(record_bytes); !s.ok()) {
    errors_++;
    return s;
  }
  Segment& seg = *active_;
  const uint64_t off = seg.size;
  iovec iov[3] = {{hdr, kRecordHeaderBytes},
                  {const_cast<char*>(key.data()), key.size()},
                  {value != nullptr ? const_cast<uint8_t*>(value->data()) : nullptr, value_len}};
  if (Status s = WriteFully(seg.fd, seg.path, off, iov, 3); !s.ok()) {
    errors_++;
    // Cut the partial record so appends keep following valid data; failing that, move on.
    if (::ftruncate(seg.fd, static_cast<off_t>(off)) != 0) roll_before_next_append_ = true;
    return s;
  }
  seg.size += record_bytes;
  disk_bytes_ += static_cast<int64_t>(record_bytes);
  if (type == kTypePut) seg.keys.emplace_back(key);
  if (options_.uncached_reads) StartWriteback(seg.fd, off, record_bytes);
  if (options_.sync_each_put && ::fdatasync(seg.fd) != 0) {
    errors_++;
    return Status::IOError(seg.path + ": fdatasync: " + Errno(errno));  // not acknowledged, not indexed
  }
  if (type == kTypePut) puts_++;
  std::lock_guard<std::mutex> index_lock(index_mu_);
  max_seq_ = std::max(max_seq_, seq);
  if (type == kTypeDelete || (expires_at_ms != 0 && expires_at_ms <= NowUnixMs())) {
    IndexEraseLocked(key);
  } else {
    IndexPutLocked(key, Location{seg.id, off, h.key_len, value_len, expires_at_ms, seq,
                                 static_cast<uint32_t>(kRecordHeaderBytes)});
  }
  return Status::Ok();
}

Status SsdTier::MakeRoomLocked(uint64_t record_bytes) {
  const Segment& a = *active_;
  if (roll_before_next_append_ ||
      (a.size > kSegmentHeaderBytes && a.size + record_bytes > static_cast<uint64_t>(options_.segment_bytes))) {
    KEEL_RETURN_IF_ERROR(RollLocked());
  }
  return EnforceCapacityLocked(record_bytes);
}

Status SsdTier::EnforceCapacityLocked(uint64_t record_bytes) {
  const size_t max_records = static_cast<size_t>(std::max<int64_t>(1, options_.capacity_bytes / kSsdMinRecordCharge));
  auto index_full = [&] {
    std::lock_guard<std::mutex> lock(index_mu_);
    return index_.size() + (record_bytes > 0 ? 1 : 0) > max_records;  // room for the record appended
  };
  while (disk_bytes_.load() + static_cast<int64_t>(record_bytes) > options_.capacity_bytes || index_full()) {
    if (segments_.begin()->second != active_) {
      EvictOldestLocked();
    } else if (active_->size > kSegmentHeaderBytes) {
      KEEL_RETURN_IF_ERROR(RollLocked());  // the active segment itself has to go
    } else {
      break;  // only an empty active segment is left; Append checked that the record fits
    }
  }
  return Status::Ok();
}

Status SsdTier::RollLocked() {
  if (active_ != nullptr && ::fdatasync(active_->fd) != 0) {
    // The sync is what keeps torn tails confined to the last segment, so it is not optional.
    return Status::IOError(active_->path + ": fdatasync: " + Errno(errno));
  }
  // Segment ids on disk have no gaps (Recover reads a gap as a lost segment): an id is used up
  // only by a file that exists.
  const uint64_t id = next_segment_id_;
  const std::string path = options_.dir + "/" + SegmentFileName(id);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path + ": create: " + Errno(errno));
  next_segment_id_++;
  auto seg = std::make_shared<Segment>(id, path, fd);
  if (options_.uncached_reads) NoReadahead(fd);
  uint8_t header[kSegmentHeaderBytes];
  EncodeSegmentHeader(id, header);
  iovec iov{header, kSegmentHeaderBytes};
  Status s = WriteFully(fd, path, 0, &iov, 1);
  if (s.ok()) s = SyncDir(options_.dir);  // the new name must survive a crash with its records
  if (!s.ok()) {
    if (::unlink(path.c_str()) == 0) next_segment_id_--;  // left in place, it still holds its id
    return s;
  }
  seg->size = kSegmentHeaderBytes;
  disk_bytes_ += kSegmentHeaderBytes;
  {
    std::lock_guard<std::mutex> lock(index_mu_);
    segments_[id] = seg;
  }
  active_ = std::move(seg);
  roll_before_next_append_ = false;
  return Status::Ok();
}

void SsdTier::EvictOldestLocked() {
  std::shared_ptr<Segment> seg = segments_.begin()->second;
  int64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(index_mu_);
    segments_.erase(segments_.begin());
    for (const std::string& key : seg->keys) {
      auto it = index_.find(key);
      if (it != index_.end() && it->second.segment_id == seg->id) {
        live_bytes_ -= static_cast<int64_t>(it->second.value_len);
        index_.erase(it);
        dropped++;
      }
    }
  }
  evictions_ += dropped;
  disk_bytes_ -= static_cast<int64_t>(seg->size);
  // A Get still reading it holds the Segment (and so the fd); the data lives until it is done.
  if (::unlink(seg->path.c_str()) != 0) {
    errors_++;
    Log().warn("ssd: {}: unlink: {}", seg->path, Errno(errno));
  }
  Log().debug("ssd: evicted {} ({} bytes, {} entries)", seg->path, seg->size, dropped);
}

void SsdTier::IndexPutLocked(std::string_view key, const Location& loc) {
  auto it = index_.find(key);
  if (it == index_.end()) {
    index_.emplace(std::string(key), loc);
  } else {
    live_bytes_ -= static_cast<int64_t>(it->second.value_len);
    it->second = loc;
  }
  live_bytes_ += static_cast<int64_t>(loc.value_len);
}

void SsdTier::IndexEraseLocked(std::string_view key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  live_bytes_ -= static_cast<int64_t>(it->second.value_len);
  index_.erase(it);
}

void SsdTier::DropIfUnchanged(std::string_view key, const Location& loc) {
  std::lock_guard<std::mutex> lock(index_mu_);
  auto it = index_.find(key);
  if (it != index_.end() && it->second.segment_id == loc.segment_id && it->second.offset == loc.offset) {
    live_bytes_ -= static_cast<int64_t>(it->second.value_len);
    index_.erase(it);
  }
}

// Why a helper for the lookup and one for the check: Get and GetMany differ only in how the
// reads are issued (one, or all at once), so what a record must satisfy lives in one place.
Status SsdTier::LookupLocked(std::string_view key, Location* loc, std::shared_ptr<Segment>* seg) {
  auto it = index_.find(key);
  if (it == index_.end()) {
    misses_++;
    return Status::NotFound("ssd: key not found");
  }
  if (it->second.expires_at_ms != 0 && it->second.expires_at_ms <= NowUnixMs()) {
    live_bytes_ -= static_cast<int64_t>(it->second.value_len);
    index_.erase(it);
    expirations_++;
    misses_++;
    return Status::NotFound("ssd: key expired");
  }
  *loc = it->second;
  auto s = segments_.find(loc->segment_id);  // eviction drops a segment's entries with it
  if (s == segments_.end()) return Status::Internal("ssd: index names a deleted segment");
  *seg = s->second;
  return Status::Ok();
}

BatchRead SsdTier::RecordRead(const Location& loc, const Segment& seg, uint8_t* head, Blob& value) {
  BatchRead r;
  r.fd = seg.fd;
  r.path = &seg.path;
  r.offset = loc.offset;
  r.iov[0] = {head, loc.header_bytes + loc.key_len};
  r.iov[1] = {value.data(), loc.value_len};
  r.iovcnt = 2;
  return r;
}

Result<Entry> SsdTier::FinishRead(std::string_view key, const Location& loc, const Segment& seg, Status s,
                                  const uint8_t* head, std::shared_ptr<Blob> value) {
  const char* why = nullptr;
  RecordHeader h;
  if (s.ok()) {
    why = DecodeRecordHeader(head, seg.version, &h);
    const std::string_view stored_key(reinterpret_cast<const char*>(head + loc.header_bytes), loc.key_len);
    if (why == nullptr &&
        (h.type != kTypePut || h.key_len != loc.key_len || h.value_len != loc.value_len || h.seq != loc.seq)) {
      why = "record does not match the index";
    } else if (why == nullptr && HeaderChecksum(head, stored_key, seg.version) != h.header_checksum) {
      why = "record header checksum mismatch";
    } else if (why == nullptr && stored_key != key) {
      why = "record holds another key";
    } else if (why == nullptr && Xxh3_64(value->data(), value->size()) != h.value_checksum) {
      why = "value checksum mismatch";
    }
    if (why != nullptr) {
      s = Status::Corruption(seg.path + ": record at offset " + std::to_string(loc.offset) + ": " + why);
    }
  }
  if (options_.uncached_reads) DropCache(seg.fd, loc.offset, loc.header_bytes + loc.key_len + loc.value_len);
  if (!s.ok()) {
    errors_++;
    Log().warn("ssd: {}", s.message());
    if (s.code() == StatusCode::kCorruption) DropIfUnchanged(key, loc);
    return s;
  }
  value->set_checksum(h.value_checksum);
  hits_++;
  return Entry{std::move(value), loc.expires_at_ms, loc.seq};
}

Result<Entry> SsdTier::Get(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  Location loc;
  std::shared_ptr<Segment> seg;
  {
    std::lock_guard<std::mutex> lock(index_mu_);
    KEEL_RETURN_IF_ERROR(LookupLocked(key, &loc, &seg));
  }
  // The value is read straight into the Blob it is returned in; header and key into the stack.
  uint8_t head[kRecordHeaderBytes + kMaxKeyBytes];
  std::shared_ptr<Blob> value = Blob::Allocate(loc.value_len);
  BatchRead read = RecordRead(loc, *seg, head, *value);
  Status s;
  ReadBatch({&read, 1}, {&s, 1}, use_io_uring_);
  return FinishRead(key, loc, *seg, std::move(s), head, std::move(value));
}

// One index lookup pass under the lock, then every record read in one io_uring batch (the
// device sees the reads together and overlaps them), then each record is checked as Get checks
// it. Keys that fail the lookup take no read.
std::vector<Result<Entry>> SsdTier::GetMany(const std::vector<std::string_view>& keys) {
  constexpr size_t kHeadStride = kRecordHeaderBytes + kMaxKeyBytes;
  constexpr size_t kNoRead = ~size_t{0};
  struct Pending {
    Status status;  // the lookup's, when it failed
    Location loc;
    std::shared_ptr<Segment> seg;
    std::shared_ptr<Blob> value;
    size_t read = kNoRead;  // index into `reads`
  };
  std::vector<Pending> pending(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) pending[i].status = ValidateKey(keys[i]);
  size_t n_reads = 0;
  {
    std::lock_guard<std::mutex> lock(index_mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      Pending& p = pending[i];
      if (p.status.ok()) p.status = LookupLocked(keys[i], &p.loc, &p.seg);
      if (p.status.ok()) p.read = n_reads++;
    }
  }
  std::vector<uint8_t> heads(n_reads * kHeadStride);
  std::vector<BatchRead> reads;
  reads.reserve(n_reads);
  for (Pending& p : pending) {
    if (p.read == kNoRead) continue;
    p.value = Blob::Allocate(p.loc.value_len);
    reads.push_back(RecordRead(p.loc, *p.seg, heads.data() + p.read * kHeadStride, *p.value));
  }
  std::vector<Status> read_status(n_reads);
  ReadBatch(reads, read_status, use_io_uring_);

  std::vector<Result<Entry>> out;
  out.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    Pending& p = pending[i];
    if (p.read == kNoRead) {
      out.push_back(std::move(p.status));
    } else {
      out.push_back(FinishRead(keys[i], p.loc, *p.seg, std::move(read_status[p.read]),
                               heads.data() + p.read * kHeadStride, std::move(p.value)));
    }
  }
  return out;
}

Result<bool> SsdTier::Contains(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  std::lock_guard<std::mutex> lock(index_mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  if (it->second.expires_at_ms != 0 && it->second.expires_at_ms <= NowUnixMs()) {
    live_bytes_ -= static_cast<int64_t>(it->second.value_len);
    index_.erase(it);
    expirations_++;
    return false;
  }
  return true;
}

Status SsdTier::Sync() {
  std::lock_guard<std::mutex> lock(append_mu_);
  if (::fdatasync(active_->fd) != 0) {
    errors_++;
    return Status::IOError(active_->path + ": fdatasync: " + Errno(errno));
  }
  return Status::Ok();
}

TierStats SsdTier::Stats() const {
  TierStats s;
  s.name = "ssd";
  {
    std::lock_guard<std::mutex> lock(index_mu_);
    s.items = static_cast<int64_t>(index_.size());
    s.bytes = live_bytes_;
  }
  s.capacity_bytes = options_.capacity_bytes;
  s.hits = hits_.load();
  s.misses = misses_.load();
  s.puts = puts_.load();
  s.evictions = evictions_.load();
  s.expirations = expirations_.load();
  s.stale_puts = stale_puts_.load();
  s.errors = errors_.load();
  return s;
}

}  // namespace keel::kvstore
