// CoLoc storage pieces: the compressed cold tier (zstd segments) and the SSD tier's uncached reads.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../kvstore/redis_process.h"
#include "keel/kvstore/ssd_tier.h"
#include "keel/kvstore/uring_batch.h"
#include "keel/vector/coloc/cold_tier.h"
#include "keel/vector/coloc/placement.h"
#include "keel/vector/coloc/tiered_store.h"
#include "tests/engine/test_util.h"

namespace keel::vector::coloc {
namespace {

namespace fs = std::filesystem;
using kvstore::Blob;
using kvstore::Entry;
using test::TempDir;

// The cold tier is an SsdTier of zstd frames: its on-disk layout is ssd_tier.cc's (segment and
// record headers); damage is aimed with these.
constexpr uint64_t kSegHeader = 32;
constexpr uint64_t kRecHeader = 56;  // the SSD tier's record header (format version 2)

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}


std::vector<std::string> ColdSegments(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("seg-") && name.ends_with(".kvs")) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Offsets of the records in a cold segment, walking the headers.
std::vector<uint64_t> RecordOffsets(const std::string& path) {
  std::string data;
  {
    FILE* f = std::fopen(path.c_str(), "rb");
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) data.append(buf, n);
    std::fclose(f);
  }
  std::vector<uint64_t> offs;
  uint64_t off = kSegHeader;
  while (off + kRecHeader <= data.size()) {
    uint32_t key_len;
    uint64_t stored_len;
    std::memcpy(&key_len, data.data() + off + 8, 4);
    std::memcpy(&stored_len, data.data() + off + 16, 8);
    offs.push_back(off);
    off += kRecHeader + key_len + stored_len;
  }
  return offs;
}

void FlipByte(const std::string& path, uint64_t off) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(off)), 1);
  b ^= 0x5A;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(off)), 1);
  ::close(fd);
}

std::string ValueOf(Result<Entry>& e) { return std::string(e->value->view()); }

// ---------------------------------------------------------------------------------------------
// ColdTier

TEST(ColdTier, RoundTripCompressesAndDeletes) {
  TempDir dir("coloc-cold");
  auto tier = ColdTier::Open({.dir = dir.path(), .zstd_level = 3});
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  std::map<std::string, std::string> want;
  int64_t raw_bytes = 0;
  for (int i = 0; i < 50; ++i) {
    const std::string key = "k" + std::to_string(i);
    want[key] = i % 2 == 0 ? RandomBytes(100 + i * 13, i) : std::string(4096, static_cast<char>(i));
    raw_bytes += static_cast<int64_t>(want[key].size());
    ASSERT_TRUE((*tier)->Put(key, Entry{Blob::Copy(want[key]), 0}).ok());
  }
  for (const auto& [k, v] : want) {
    auto e = (*tier)->Get(k);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    EXPECT_EQ(ValueOf(e), v);
  }
  // The 25 runs of one byte compress to almost nothing.
  EXPECT_LT((*tier)->StoredBytes(), raw_bytes / 4);
  EXPECT_EQ((*tier)->Stats().bytes, (*tier)->StoredBytes());
  ASSERT_TRUE((*tier)->Delete("k3").ok());
  EXPECT_EQ((*tier)->Get("k3").status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(*(*tier)->Contains("k3"));
  EXPECT_TRUE(*(*tier)->Contains("k4"));
  EXPECT_EQ((*tier)->Stats().items, 49);
  // A second tier on the same directory is refused.
  EXPECT_EQ(ColdTier::Open({.dir = dir.path()}).status().code(), StatusCode::kUnavailable);
}

TEST(ColdTier, RestartRecoversOverwritesAndTombstones) {
  TempDir dir("coloc-cold");
  ColdTierOptions opts{.dir = dir.path(), .segment_bytes = 4096};  // several segments
  std::map<std::string, std::string> want;
  {
    auto tier = ColdTier::Open(opts);
    ASSERT_TRUE(tier.ok());
    for (int i = 0; i < 40; ++i) {
      const std::string key = "k" + std::to_string(i);
      want[key] = RandomBytes(300, i);
      ASSERT_TRUE((*tier)->Put(key, Entry{Blob::Copy(want[key]), 0}).ok());
    }
    for (int i = 0; i < 40; i += 5) {
      const std::string key = "k" + std::to_string(i);
      want[key] = RandomBytes(200, 1000 + i);
      ASSERT_TRUE((*tier)->Put(key, Entry{Blob::Copy(want[key]), 0}).ok());
    }
    for (int i = 1; i < 40; i += 7) {
      ASSERT_TRUE((*tier)->Delete("k" + std::to_string(i)).ok());
      want.erase("k" + std::to_string(i));
    }
  }
  EXPECT_GT(ColdSegments(dir.path()).size(), 2u);
  auto tier = ColdTier::Open(opts);
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  EXPECT_EQ((*tier)->recovery().corrupt_records, 0);
  EXPECT_EQ((*tier)->Stats().items, static_cast<int64_t>(want.size()));
  for (int i = 0; i < 40; ++i) {
    const std::string key = "k" + std::to_string(i);
    auto e = (*tier)->Get(key);
    if (want.count(key) == 0) {
      EXPECT_EQ(e.status().code(), StatusCode::kNotFound) << key;
    } else {
      ASSERT_TRUE(e.ok()) << key << ": " << e.status().ToString();
      EXPECT_EQ(ValueOf(e), want[key]);
    }
  }
}

TEST(ColdTier, CorruptValueIsRejectedThenSkippedOnRecovery) {
  TempDir dir("coloc-cold");
  ColdTierOptions opts{.dir = dir.path()};
  const std::string v0 = RandomBytes(1000, 1), v1 = RandomBytes(1000, 2), v2 = RandomBytes(1000, 3);
  std::string seg;
  {
    auto tier = ColdTier::Open(opts);
    ASSERT_TRUE(tier.ok());
    ASSERT_TRUE((*tier)->Put("a", Entry{Blob::Copy(v0), 0}).ok());
    ASSERT_TRUE((*tier)->Put("b", Entry{Blob::Copy(v1), 0}).ok());
    ASSERT_TRUE((*tier)->Put("c", Entry{Blob::Copy(v2), 0}).ok());
    seg = ColdSegments(dir.path()).at(0);
    const std::vector<uint64_t> offs = RecordOffsets(seg);
    ASSERT_EQ(offs.size(), 3u);
    FlipByte(seg, offs[1] + kRecHeader + 1 + 100);  // inside b's compressed value
    auto e = (*tier)->Get("b");
    EXPECT_EQ(e.status().code(), StatusCode::kCorruption) << e.status().ToString();
    auto a = (*tier)->Get("a");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(ValueOf(a), v0);
  }
  auto tier = ColdTier::Open(opts);
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  EXPECT_EQ((*tier)->recovery().corrupt_records, 1);
  EXPECT_EQ((*tier)->recovery().truncated_bytes, 0);
  EXPECT_EQ((*tier)->Get("b").status().code(), StatusCode::kNotFound);
  auto a = (*tier)->Get("a");
  auto c = (*tier)->Get("c");
  ASSERT_TRUE(a.ok() && c.ok());
  EXPECT_EQ(ValueOf(a), v0);
  EXPECT_EQ(ValueOf(c), v2);  // the scan stepped over b and kept going
}

// GetMany against Get, key by key.
void ExpectGetManySameAsGet(ColdTier& t, const std::vector<std::string>& keys) {
  const std::vector<std::string_view> views(keys.begin(), keys.end());
  const std::vector<Result<Entry>> many = t.GetMany(views);
  ASSERT_EQ(many.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const Result<Entry> one = t.Get(keys[i]);
    ASSERT_EQ(many[i].ok(), one.ok()) << i << " " << keys[i] << ": " << many[i].status().ToString();
    if (!one.ok()) {
      EXPECT_EQ(many[i].status().code(), one.status().code()) << keys[i];
      continue;
    }
    EXPECT_TRUE(many[i]->value->view() == one->value->view()) << keys[i] << ": bytes differ";
    EXPECT_EQ(many[i]->expires_at_ms, one->expires_at_ms) << keys[i];
  }
}

TEST(ColdTier, GetManyMatchesGetForPresentAbsentDeletedAcrossSegments) {
  for (const bool uring : {true, false}) {
    for (const bool uncached : {true, false}) {
      SCOPED_TRACE(std::string(uring ? "io_uring" : "pread") + (uncached ? ", uncached" : ", cached"));
      TempDir dir("coloc-cold");
      const ColdTierOptions opts{
          .dir = dir.path(), .segment_bytes = 4096, .uncached_reads = uncached, .use_io_uring = uring};
      std::vector<std::string> keys;
      {
        auto tier = ColdTier::Open(opts);
        ASSERT_TRUE(tier.ok()) << tier.status().ToString();
        ColdTier& t = **tier;
        for (int i = 0; i < 40; ++i) {
          // Incompressible and compressible values, some empty.
          const std::string v = i % 5 == 0   ? std::string()
                                : i % 2 == 0 ? RandomBytes(200 + i * 31, i)
                                             : std::string(3000, static_cast<char>(i));
          ASSERT_TRUE(t.Put("k" + std::to_string(i), Entry{Blob::Copy(v), 0}).ok());
        }
        for (int i = 3; i < 40; i += 7) ASSERT_TRUE(t.Delete("k" + std::to_string(i)).ok());
        for (int i = 1; i < 40; i += 9) {
          ASSERT_TRUE(t.Put("k" + std::to_string(i), Entry{Blob::Copy(RandomBytes(500, 99 + i)), 0}).ok());
        }
        ASSERT_GT(ColdSegments(dir.path()).size(), 3u);
        for (int i = 39; i >= 0; --i) {
          keys.push_back("k" + std::to_string(i));
          if (i % 6 == 0) keys.push_back("absent" + std::to_string(i));
        }
        keys.push_back("k4");
        keys.push_back("k3");  // deleted
        keys.push_back("");    // InvalidArgument, like Get
        ExpectGetManySameAsGet(t, keys);
        const std::vector<std::string_view> views(keys.begin(), keys.end());
        const auto many = t.GetMany(views);
        ASSERT_TRUE(many[0].ok());  // k39
        EXPECT_EQ(std::string(many[0]->value->view()), std::string(3000, static_cast<char>(39)));
        EXPECT_TRUE(t.GetMany({}).empty());
        EXPECT_EQ(t.Stats().errors, 0);
      }
      auto tier = ColdTier::Open(opts);  // and after the index is rebuilt from the segments
      ASSERT_TRUE(tier.ok());
      ExpectGetManySameAsGet(**tier, keys);
    }
  }
}

TEST(ColdTier, GetManyCorruptRecordFailsOnlyItsKey) {
  for (const bool uring : {true, false}) {
    SCOPED_TRACE(uring ? "io_uring" : "pread");
    TempDir dir("coloc-cold");
    auto tier = ColdTier::Open({.dir = dir.path(), .use_io_uring = uring});
    ASSERT_TRUE(tier.ok());
    ColdTier& t = **tier;
    const std::string v0 = RandomBytes(1000, 1), v1 = RandomBytes(1000, 2), v2 = RandomBytes(1000, 3);
    ASSERT_TRUE(t.Put("a", Entry{Blob::Copy(v0), 0}).ok());
    ASSERT_TRUE(t.Put("b", Entry{Blob::Copy(v1), 0}).ok());
    ASSERT_TRUE(t.Put("c", Entry{Blob::Copy(v2), 0}).ok());
    const std::string seg = ColdSegments(dir.path()).at(0);
    const std::vector<uint64_t> offs = RecordOffsets(seg);
    ASSERT_EQ(offs.size(), 3u);
    FlipByte(seg, offs[1] + kRecHeader + 1 + 100);  // inside b's compressed value

    const auto many = t.GetMany({"c", "b", "nope", "a"});
    ASSERT_EQ(many.size(), 4u);
    ASSERT_TRUE(many[0].ok()) << many[0].status().ToString();
    EXPECT_EQ(std::string(many[0]->value->view()), v2);
    EXPECT_EQ(many[1].status().code(), StatusCode::kCorruption) << many[1].status().ToString();
    EXPECT_EQ(many[2].status().code(), StatusCode::kNotFound);
    ASSERT_TRUE(many[3].ok()) << many[3].status().ToString();
    EXPECT_EQ(std::string(many[3]->value->view()), v0);
    EXPECT_EQ(t.Stats().errors, 1);
    EXPECT_EQ(t.Get("b").status().code(), StatusCode::kNotFound);  // dropped, as Get drops it
  }
}

TEST(ColdTier, GetManyBatchLargerThanTheRing) {
  for (const bool uncached : {true, false}) {
    SCOPED_TRACE(uncached ? "uncached" : "cached");
    TempDir dir("coloc-cold");
    auto tier = ColdTier::Open({.dir = dir.path(), .segment_bytes = 16 << 10, .uncached_reads = uncached});
    ASSERT_TRUE(tier.ok());
    ColdTier& t = **tier;
    const int n = static_cast<int>(kvstore::kUringEntries) * 2 + 17;
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE(t.Put("k" + std::to_string(i), Entry{Blob::Copy(RandomBytes(300 + i % 200, i)), 0}).ok());
    }
    std::vector<std::string> keys;
    for (int i = 0; i < n; ++i) {
      keys.push_back("k" + std::to_string((i * 37) % n));
      if (i % 50 == 0) keys.push_back("absent" + std::to_string(i));
    }
    const std::vector<std::string_view> views(keys.begin(), keys.end());
    const auto many = t.GetMany(views);
    ASSERT_EQ(many.size(), keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].starts_with("absent")) {
        EXPECT_EQ(many[i].status().code(), StatusCode::kNotFound) << keys[i];
        continue;
      }
      ASSERT_TRUE(many[i].ok()) << keys[i] << ": " << many[i].status().ToString();
      const int k = std::stoi(keys[i].substr(1));
      EXPECT_EQ(std::string(many[i]->value->view()), RandomBytes(300 + k % 200, k)) << keys[i];
    }
    EXPECT_EQ(t.Stats().hits, n);
  }
}

TEST(ColdTier, CorruptHeaderOfLastRecordIsCut) {
  TempDir dir("coloc-cold");
  ColdTierOptions opts{.dir = dir.path()};
  const std::string v0 = RandomBytes(500, 1), v1 = RandomBytes(500, 2);
  {
    auto tier = ColdTier::Open(opts);
    ASSERT_TRUE(tier.ok());
    ASSERT_TRUE((*tier)->Put("a", Entry{Blob::Copy(v0), 0}).ok());
    ASSERT_TRUE((*tier)->Put("b", Entry{Blob::Copy(v1), 0}).ok());
  }
  const std::string seg = ColdSegments(dir.path()).at(0);
  FlipByte(seg, RecordOffsets(seg).at(1) + 16);  // b's raw_len: the header checksum catches it
  auto tier = ColdTier::Open(opts);
  ASSERT_TRUE(tier.ok());
  EXPECT_EQ((*tier)->recovery().corrupt_records, 1);
  EXPECT_GT((*tier)->recovery().truncated_bytes, 0);
  EXPECT_EQ((*tier)->Get("b").status().code(), StatusCode::kNotFound);
  auto a = (*tier)->Get("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(ValueOf(a), v0);
}

TEST(ColdTier, TruncatedTailIsCutAndAppendsFollowValidData) {
  TempDir dir("coloc-cold");
  ColdTierOptions opts{.dir = dir.path()};
  const std::string v0 = RandomBytes(800, 1), v1 = RandomBytes(800, 2), v2 = RandomBytes(800, 3);
  {
    auto tier = ColdTier::Open(opts);
    ASSERT_TRUE(tier.ok());
    ASSERT_TRUE((*tier)->Put("a", Entry{Blob::Copy(v0), 0}).ok());
    ASSERT_TRUE((*tier)->Put("b", Entry{Blob::Copy(v1), 0}).ok());
  }
  const std::string seg = ColdSegments(dir.path()).at(0);
  fs::resize_file(seg, fs::file_size(seg) - 10);
  {
    auto tier = ColdTier::Open(opts);
    ASSERT_TRUE(tier.ok());
    EXPECT_GT((*tier)->recovery().truncated_bytes, 0);
    EXPECT_EQ((*tier)->Get("b").status().code(), StatusCode::kNotFound);
    auto a = (*tier)->Get("a");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(ValueOf(a), v0);
    ASSERT_TRUE((*tier)->Put("c", Entry{Blob::Copy(v2), 0}).ok());
  }
  auto tier = ColdTier::Open(opts);
  ASSERT_TRUE(tier.ok());
  EXPECT_EQ((*tier)->recovery().corrupt_records, 0);
  auto c = (*tier)->Get("c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ValueOf(c), v2);
}

// ---------------------------------------------------------------------------------------------
// SsdTier with uncached_reads

TEST(ColocSsd, UncachedReadsRoundTripAndLeaveNothingInThePageCache) {
  TempDir dir("coloc-ssd");
  std::map<std::string, std::string> want;
  {
    auto ssd = kvstore::SsdTier::Open({.dir = dir.path(), .uncached_reads = true});
    ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
    for (int i = 0; i < 64; ++i) {
      want["k" + std::to_string(i)] = RandomBytes(3000, i);
      ASSERT_TRUE((*ssd)->Put("k" + std::to_string(i), Entry{Blob::Copy(want["k" + std::to_string(i)]), 0}).ok());
    }
    for (const auto& [k, v] : want) {
      auto e = (*ssd)->Get(k);
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      EXPECT_EQ(ValueOf(e), v);
    }
    // Every page a Get touched was dropped: after reading all records, no page of the segment
    // past its header page is resident. (tmpfs cannot drop pages, so only checked elsewhere.)
    struct statfs sfs {};
    ASSERT_EQ(::statfs(dir.path().c_str(), &sfs), 0);
    constexpr long kTmpfsMagic = 0x01021994;
    if (static_cast<long>(sfs.f_type) != kTmpfsMagic) {
      std::string seg;
      for (const auto& e : fs::directory_iterator(dir.path())) {
        if (e.path().filename().string().starts_with("seg-")) seg = e.path().string();
      }
      ASSERT_FALSE(seg.empty());
      const int fd = ::open(seg.c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      const size_t size = fs::file_size(seg);
      void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      ASSERT_NE(map, MAP_FAILED);
      const long page = ::sysconf(_SC_PAGESIZE);
      std::vector<unsigned char> resident((size + page - 1) / page);
      ASSERT_EQ(::mincore(map, size, resident.data()), 0);
      size_t cached = 0;
      for (size_t p = 1; p + 1 < resident.size(); ++p) cached += resident[p] & 1;
      EXPECT_EQ(cached, 0u) << "of " << resident.size() << " pages";
      ::munmap(map, size);
      ::close(fd);
    }
  }
  auto ssd = kvstore::SsdTier::Open({.dir = dir.path(), .uncached_reads = true});
  ASSERT_TRUE(ssd.ok());
  for (const auto& [k, v] : want) {
    auto e = (*ssd)->Get(k);
    ASSERT_TRUE(e.ok());
    EXPECT_EQ(ValueOf(e), v);
  }
}

}  // namespace
}  // namespace keel::vector::coloc
