#include "keel/kvstore/ssd_tier.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "keel/core/hash.h"
#include "tests/engine/test_util.h"

namespace keel::kvstore {
namespace {

namespace fs = std::filesystem;

// The on-disk layout, as documented in ssd_tier.cc; tests that damage files aim with these.
constexpr uint64_t kSegHeader = 32;
constexpr uint64_t kRecHeader = 56;  // format version 2 (with the write's sequence number)

std::string MakeValue(size_t size, uint64_t seed) {
  std::string v(size, '\0');
  uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (size_t i = 0; i < size; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<char>(x);
  }
  return v;
}

std::string Key(int i) { return "key-" + std::to_string(i); }

Entry MakeEntry(std::string_view bytes, int64_t expires_at_ms = 0) { return Entry{Blob::Copy(bytes), expires_at_ms}; }

bool KernelHasIoUring() {
  io_uring ring;
  if (io_uring_queue_init(2, &ring, 0) != 0) return false;
  io_uring_queue_exit(&ring);
  return true;
}

std::vector<std::string> SegmentFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("seg-") && name.ends_with(".kvs")) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

int64_t FileBytes(const std::vector<std::string>& files) {
  int64_t total = 0;
  for (const auto& f : files) total += static_cast<int64_t>(fs::file_size(f));
  return total;
}

void AppendBytes(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::app);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

void OverwriteByte(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x5a;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

class SsdTierTest : public ::testing::Test {
 protected:
  SsdOptions Options() const {
    SsdOptions o;
    o.dir = dir_.path() + "/ssd";
    o.capacity_bytes = int64_t{64} << 20;
    o.segment_bytes = int64_t{4} << 20;
    return o;
  }
  std::unique_ptr<SsdTier> MustOpen(const SsdOptions& o) {
    auto r = SsdTier::Open(o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : nullptr;
  }
  static void ExpectValue(SsdTier& t, const std::string& key, const std::string& want) {
    auto got = t.Get(key);
    ASSERT_TRUE(got.ok()) << key << ": " << got.status().ToString();
    ASSERT_EQ(got->value->size(), want.size()) << key;
    EXPECT_TRUE(got->value->view() == want) << key << ": bytes differ";
  }
  static void ExpectNotFound(SsdTier& t, const std::string& key) {
    auto got = t.Get(key);
    ASSERT_FALSE(got.ok()) << key << " unexpectedly present";
    EXPECT_EQ(got.status().code(), StatusCode::kNotFound) << key << ": " << got.status().ToString();
  }

  test::TempDir dir_{"ssd-tier"};
};

// Both read paths: io_uring (param true) and pread (false).
class SsdTierIoTest : public SsdTierTest, public ::testing::WithParamInterface<bool> {
 protected:
  SsdOptions Options() const {
    SsdOptions o = SsdTierTest::Options();
    o.use_io_uring = GetParam();
    return o;
  }
};

TEST_P(SsdTierIoTest, RoundTripSizes) {
  auto t = MustOpen(Options());
  ASSERT_NE(t, nullptr);
  if (GetParam()) {
    EXPECT_EQ(t->uses_io_uring(), KernelHasIoUring());
  } else {
    EXPECT_FALSE(t->uses_io_uring());
  }
  const std::vector<size_t> sizes = {0, 1, 64 << 10, 2 << 20};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(t->Put(Key(static_cast<int>(i)), MakeEntry(MakeValue(sizes[i], i))).ok());
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string want = MakeValue(sizes[i], i);
    ExpectValue(*t, Key(static_cast<int>(i)), want);
    auto e = t->Get(Key(static_cast<int>(i)));
    ASSERT_TRUE(e.ok());
    EXPECT_EQ(e->value->checksum(), Xxh3_64(want.data(), want.size()));  // handed back from the record
    EXPECT_EQ(e->expires_at_ms, 0);
  }
  ExpectNotFound(*t, "absent");
  TierStats s = t->Stats();
  EXPECT_EQ(s.name, "ssd");
  EXPECT_EQ(s.items, 4);
  EXPECT_EQ(s.bytes, static_cast<int64_t>(1 + (64 << 10) + (2 << 20)));
  EXPECT_EQ(s.puts, 4);
  EXPECT_EQ(s.hits, 8);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.errors, 0);
  EXPECT_EQ(t->DiskBytes(), FileBytes(SegmentFiles(Options().dir)));
  auto c = t->Contains(Key(3));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(*c);
  c = t->Contains("absent");
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(*c);
}

TEST_P(SsdTierIoTest, ConcurrentReadersAndWriter) {
  // Small segments and capacity, so segments roll and get deleted while readers are in them.
  SsdOptions o = Options();
  o.capacity_bytes = 2 << 20;
  o.segment_bytes = 256 << 10;
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  constexpr int kKeys = 64;
  // A value names its key and version in its first 16 bytes; the rest follows from them.
  auto value_of = [](int key, int version) {
    const uint64_t seed = static_cast<uint64_t>(key) * 1000003 + static_cast<uint64_t>(version);
    std::string v = MakeValue(512 + (seed % 7) * 1000, seed);
    const uint64_t k = static_cast<uint64_t>(key), ver = static_cast<uint64_t>(version);
    std::memcpy(v.data(), &k, 8);
    std::memcpy(v.data() + 8, &ver, 8);
    return v;
  };
  for (int k = 0; k < kKeys; ++k) ASSERT_TRUE(t->Put(Key(k), MakeEntry(value_of(k, 0))).ok());

  std::atomic<bool> stop{false};
  std::atomic<int64_t> verified{0}, failures{0};
  std::vector<std::thread> readers;
  auto check = [&](int k, const Result<Entry>& got) {
    if (!got.ok()) {
      if (got.status().code() != StatusCode::kNotFound) failures++;  // evicted is fine, damage is not
      return;
    }
    std::string_view v = got->value->view();
    uint64_t gk = 0, gv = 0;
    if (v.size() < 16) {
      failures++;
      return;
    }
    std::memcpy(&gk, v.data(), 8);
    std::memcpy(&gv, v.data() + 8, 8);
    if (gk != static_cast<uint64_t>(k) || v != value_of(k, static_cast<int>(gv))) {
      failures++;
    } else {
      verified++;
    }
  };
  for (int r = 0; r < 4; ++r) {
    readers.emplace_back([&, r] {
      std::mt19937 rng(r);
      while (!stop.load()) {
        if (r % 2 == 0) {
          const int k = static_cast<int>(rng() % kKeys);
          check(k, t->Get(Key(k)));
          continue;
        }
        // Half the readers batch, so GetMany also reads segments that are rolled and deleted.
        std::vector<int> ks(8);
        std::vector<std::string> keys;
        for (int& k : ks) {
          k = static_cast<int>(rng() % kKeys);
          keys.push_back(Key(k));
        }
        const auto got = t->GetMany(std::vector<std::string_view>(keys.begin(), keys.end()));
        if (got.size() != ks.size()) {
          failures++;
          continue;
        }
        for (size_t i = 0; i < ks.size(); ++i) check(ks[i], got[i]);
      }
    });
  }
  for (int version = 1; version <= 40; ++version) {
    for (int k = 0; k < kKeys; ++k) ASSERT_TRUE(t->Put(Key(k), MakeEntry(value_of(k, version))).ok());
  }
  stop = true;
  for (auto& th : readers) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(verified.load(), 0);
  EXPECT_LE(t->DiskBytes(), o.capacity_bytes);
  // Old segments were deleted under the readers (their entries had all been overwritten, so
  // no live entry was evicted).
  EXPECT_FALSE(fs::exists(o.dir + "/seg-00000001.kvs"));
  EXPECT_GT(SegmentFiles(o.dir).size(), 1u);
  // The newest version of every key was written last, so it is still on disk.
  for (int k = 0; k < kKeys; ++k) ExpectValue(*t, Key(k), value_of(k, 40));
  EXPECT_EQ(t->Stats().errors, 0);
}

INSTANTIATE_TEST_SUITE_P(Ssd, SsdTierIoTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "IoUring" : "Pread"; });

// GetMany against Get, on both read paths and with uncached_reads on and off: (io_uring, uncached).
class SsdTierGetManyTest : public SsdTierTest, public ::testing::WithParamInterface<std::tuple<bool, bool>> {
 protected:
  SsdOptions Options() const {
    SsdOptions o = SsdTierTest::Options();
    o.use_io_uring = std::get<0>(GetParam());
    o.uncached_reads = std::get<1>(GetParam());
    o.segment_bytes = 8 << 10;  // a few records per segment, so a batch spans segments
    return o;
  }
  // What each key must read as: its value, or the code Get returns.
  static void ExpectSameAsGet(SsdTier& t, const std::vector<std::string>& keys) {
    const std::vector<std::string_view> views(keys.begin(), keys.end());
    const std::vector<Result<Entry>> many = t.GetMany(views);
    ASSERT_EQ(many.size(), keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const Result<Entry> one = t.Get(keys[i]);
      ASSERT_EQ(many[i].ok(), one.ok()) << i << " " << keys[i] << ": " << many[i].status().ToString() << " vs "
                                        << one.status().ToString();
      if (!one.ok()) {
        EXPECT_EQ(many[i].status().code(), one.status().code()) << keys[i];
        continue;
      }
      EXPECT_TRUE(many[i]->value->view() == one->value->view()) << keys[i] << ": bytes differ";
      EXPECT_EQ(many[i]->expires_at_ms, one->expires_at_ms) << keys[i];
      EXPECT_EQ(many[i]->value->checksum(), Xxh3_64(one->value->data(), one->value->size())) << keys[i];
    }
  }
};

TEST_P(SsdTierGetManyTest, MatchesGetForPresentAbsentDeletedAcrossSegments) {
  const SsdOptions o = Options();
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  if (o.use_io_uring) {
    EXPECT_EQ(t->uses_io_uring(), KernelHasIoUring());
  }
  const int64_t later = NowUnixMs() + 3'600'000;
  for (int i = 0; i < 40; ++i) {
    const size_t size = i % 5 == 0 ? 0 : i % 3 == 0 ? 3000 : 100 + i * 7;  // some empty values
    ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(size, i), i % 4 == 0 ? later : 0)).ok());
  }
  for (int i = 0; i < 40; i += 7) ASSERT_TRUE(t->Delete(Key(i)).ok());
  for (int i = 1; i < 40; i += 9) ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(500, 1000 + i))).ok());
  ASSERT_GT(SegmentFiles(o.dir).size(), 3u);

  // Present, absent, deleted, overwritten, repeated and invalid keys, interleaved.
  std::vector<std::string> keys;
  for (int i = 39; i >= 0; --i) {
    keys.push_back(Key(i));
    if (i % 6 == 0) keys.push_back("absent-" + std::to_string(i));
  }
  keys.push_back(Key(5));
  keys.push_back(Key(7));  // deleted
  keys.push_back("");      // InvalidArgument, like Get
  keys.push_back(std::string(kMaxKeyBytes + 1, 'x'));
  ExpectSameAsGet(*t, keys);
  {
    const std::vector<std::string_view> views(keys.begin(), keys.end());
    const auto many = t->GetMany(views);
    EXPECT_EQ(many[0].ok(), true);  // key-39
    EXPECT_TRUE(many[0]->value->view() == MakeValue(3000, 39));
  }
  const std::vector<Result<Entry>> none = t->GetMany({});
  EXPECT_TRUE(none.empty());

  t.reset();  // and the same after the index is rebuilt from the segments
  t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  ExpectSameAsGet(*t, keys);
}

TEST_P(SsdTierGetManyTest, CorruptRecordFailsOnlyItsKey) {
  const SsdOptions o = Options();
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(1000, i))).ok());
  const std::string seg = SegmentFiles(o.dir).back();
  const uint64_t second = kSegHeader + kRecHeader + 5 + 1000;
  OverwriteByte(seg, second + kRecHeader + 5 + 123);  // inside key-1's value

  const auto many = t->GetMany({Key(2), Key(1), "absent", Key(0)});
  ASSERT_EQ(many.size(), 4u);
  ASSERT_TRUE(many[0].ok()) << many[0].status().ToString();
  EXPECT_TRUE(many[0]->value->view() == MakeValue(1000, 2));
  ASSERT_FALSE(many[1].ok());
  EXPECT_EQ(many[1].status().code(), StatusCode::kCorruption);
  EXPECT_NE(many[1].status().message().find("offset " + std::to_string(second)), std::string::npos)
      << many[1].status().message();
  EXPECT_EQ(many[2].status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(many[3].ok()) << many[3].status().ToString();
  EXPECT_TRUE(many[3]->value->view() == MakeValue(1000, 0));
  EXPECT_EQ(t->Stats().errors, 1);
  EXPECT_EQ(t->Stats().hits, 2);
  ExpectNotFound(*t, Key(1));  // dropped from the index, as Get drops it
}

TEST_P(SsdTierGetManyTest, BatchLargerThanTheRing) {
  const SsdOptions o = Options();
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  const int n = static_cast<int>(kUringEntries) * 2 + 17;
  for (int i = 0; i < n; ++i) ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(700 + i % 300, i))).ok());
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) {
    keys.push_back(Key((i * 37) % n));  // scattered over the segments
    if (i % 50 == 0) keys.push_back("absent-" + std::to_string(i));
  }
  const std::vector<std::string_view> views(keys.begin(), keys.end());
  const auto many = t->GetMany(views);
  ASSERT_EQ(many.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].starts_with("absent-")) {
      EXPECT_EQ(many[i].status().code(), StatusCode::kNotFound) << keys[i];
      continue;
    }
    ASSERT_TRUE(many[i].ok()) << keys[i] << ": " << many[i].status().ToString();
    const int k = std::stoi(keys[i].substr(4));
    EXPECT_TRUE(many[i]->value->view() == MakeValue(700 + k % 300, k)) << keys[i];
  }
  EXPECT_EQ(t->Stats().hits, n);
  EXPECT_EQ(t->Stats().errors, 0);
}

INSTANTIATE_TEST_SUITE_P(Ssd, SsdTierGetManyTest, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "IoUring" : "Pread") +
                                  (std::get<1>(info.param) ? "Uncached" : "Cached");
                         });

// The index holds memory per record whatever its size: tiny records are bounded by count too
// (capacity / kSsdMinRecordCharge), the oldest segments going first, as for bytes.
TEST_F(SsdTierTest, TinyRecordsAreBoundedByCountNotOnlyBytes) {
  SsdOptions o = Options();
  o.capacity_bytes = 256 << 10;
  o.segment_bytes = 8 << 10;
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  const int64_t max_records = o.capacity_bytes / kSsdMinRecordCharge;
  for (int i = 0; i < 2000; ++i) ASSERT_TRUE(t->Put(Key(i), MakeEntry("")).ok()) << i;
  const TierStats s = t->Stats();
  EXPECT_LE(s.items, max_records) << "2,000 empty values on a " << o.capacity_bytes << "-byte tier";
  EXPECT_GT(s.items, max_records / 2) << "eviction is by whole segments, not everything";
  EXPECT_GT(s.evictions, 0);
  auto newest = t->Get(Key(1999));
  ASSERT_TRUE(newest.ok()) << newest.status().ToString();
  EXPECT_EQ(newest->value->size(), 0u);
  EXPECT_EQ(t->Get(Key(0)).status().code(), StatusCode::kNotFound);
  // A restart keeps the bound.
  t.reset();
  t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  EXPECT_LE(t->Stats().items, max_records);
}

TEST_F(SsdTierTest, OverwriteKeepsNewestAcrossRestart) {
  {
    auto t = MustOpen(Options());
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->Put("k", MakeEntry(MakeValue(1000, 1))).ok());
    ASSERT_TRUE(t->Put("k", MakeEntry(MakeValue(300, 2))).ok());
    ExpectValue(*t, "k", MakeValue(300, 2));
    EXPECT_EQ(t->Stats().items, 1);
    EXPECT_EQ(t->Stats().bytes, 300);
  }
  auto t = MustOpen(Options());
  ASSERT_NE(t, nullptr);
  ExpectValue(*t, "k", MakeValue(300, 2));
  EXPECT_EQ(t->Stats().items, 1);
  EXPECT_EQ(t->Stats().bytes, 300);
}

TEST_F(SsdTierTest, DeleteSurvivesRestart) {
  {
    auto t = MustOpen(Options());
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->Put("a", MakeEntry("alpha")).ok());
    ASSERT_TRUE(t->Put("b", MakeEntry("beta")).ok());
    ASSERT_TRUE(t->Delete("a").ok());
    ASSERT_TRUE(t->Delete("never-existed").ok());
    ExpectNotFound(*t, "a");
    ExpectValue(*t, "b", "beta");
  }
  auto t = MustOpen(Options());
  ASSERT_NE(t, nullptr);
  ExpectNotFound(*t, "a");
  ExpectValue(*t, "b", "beta");
  EXPECT_EQ(t->Stats().items, 1);
  EXPECT_EQ(t->recovery().records, 4);  // 2 puts + 2 tombstones
}

TEST_F(SsdTierTest, RestartRebuildsIndex) {
  SsdOptions o = Options();
  o.segment_bytes = 64 << 10;  // several segments
  constexpr int kKeys = 100;
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    for (int i = 0; i < kKeys; ++i) ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(2000 + i, i))).ok());
  }
  EXPECT_GT(SegmentFiles(o.dir).size(), 2u);
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->recovery().records, kKeys);
  EXPECT_EQ(t->recovery().corrupt_records, 0);
  EXPECT_EQ(t->recovery().truncated_bytes, 0);
  EXPECT_EQ(t->recovery().segments, static_cast<int64_t>(SegmentFiles(o.dir).size()));
  EXPECT_EQ(t->Stats().items, kKeys);
  for (int i = 0; i < kKeys; ++i) ExpectValue(*t, Key(i), MakeValue(2000 + i, i));
  EXPECT_EQ(t->DiskBytes(), FileBytes(SegmentFiles(o.dir)));
}

// Writes ten records ("key-0".."key-9", value_bytes each) into one segment, closes the tier,
// and returns the segment's path.
std::string WriteTenRecords(const SsdOptions& o, size_t value_bytes) {
  auto r = SsdTier::Open(o);
  EXPECT_TRUE(r.ok());
  for (int i = 0; i < 10; ++i) EXPECT_TRUE((*r)->Put(Key(i), MakeEntry(MakeValue(value_bytes, i))).ok());
  (*r).reset();
  auto files = SegmentFiles(o.dir);
  EXPECT_EQ(files.size(), 1u);
  return files.back();
}

void ExpectReopenAcceptsNewPuts(const SsdOptions& o, int first_live) {
  {
    auto r = SsdTier::Open(o);
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE((*r)->Put("after-crash", MakeEntry("fresh")).ok());
  }
  auto r = SsdTier::Open(o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->recovery().corrupt_records, 0);
  auto got = (*r)->Get("after-crash");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->value->view(), "fresh");
  for (int i = 0; i < first_live; ++i) {
    auto e = (*r)->Get(Key(i));
    ASSERT_TRUE(e.ok()) << Key(i) << ": " << e.status().ToString();
    EXPECT_TRUE(e->value->view() == MakeValue(1000, i));
  }
}

TEST_F(SsdTierTest, UncleanRestartTornLastRecord) {
  const SsdOptions o = Options();
  const std::string seg = WriteTenRecords(o, 1000);
  const uint64_t size = fs::file_size(seg);
  fs::resize_file(seg, size - 500);  // the last record lost half its value
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->recovery().records, 9);
    EXPECT_EQ(t->recovery().corrupt_records, 1);
    const uint64_t record = kRecHeader + 5 + 1000;
    EXPECT_EQ(t->recovery().truncated_bytes, static_cast<int64_t>(record - 500));
    EXPECT_EQ(fs::file_size(seg), size - record);  // cut back to the last whole record
    for (int i = 0; i < 9; ++i) ExpectValue(*t, Key(i), MakeValue(1000, i));
    ExpectNotFound(*t, Key(9));
  }
  ExpectReopenAcceptsNewPuts(o, 9);
}

TEST_F(SsdTierTest, UncleanRestartGarbageTail) {
  const SsdOptions o = Options();
  const std::string seg = WriteTenRecords(o, 1000);
  const uint64_t size = fs::file_size(seg);
  AppendBytes(seg, MakeValue(777, 99));  // random bytes after the last record
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->recovery().records, 10);
    EXPECT_EQ(t->recovery().corrupt_records, 1);
    EXPECT_EQ(t->recovery().truncated_bytes, 777);
    EXPECT_EQ(fs::file_size(seg), size);
    for (int i = 0; i < 10; ++i) ExpectValue(*t, Key(i), MakeValue(1000, i));
  }
  ExpectReopenAcceptsNewPuts(o, 10);
}

TEST_F(SsdTierTest, UncleanRestartTornRecordThenGarbage) {
  const SsdOptions o = Options();
  const std::string seg = WriteTenRecords(o, 1000);
  fs::resize_file(seg, fs::file_size(seg) - 1000 - 5 - 20);  // mid-header of the last record
  AppendBytes(seg, MakeValue(4096, 7));
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->recovery().records, 9);
    EXPECT_EQ(t->recovery().corrupt_records, 1);
    for (int i = 0; i < 9; ++i) ExpectValue(*t, Key(i), MakeValue(1000, i));
    ExpectNotFound(*t, Key(9));
  }
  ExpectReopenAcceptsNewPuts(o, 9);
}

TEST_F(SsdTierTest, RecordWithOversizedValueLengthIsRejectedOnRead) {
  const SsdOptions o = Options();
  const std::string seg = WriteTenRecords(o, 1000);
  // A record whose header is self-consistent (valid checksum) but claims a 2 GiB value.
  uint8_t hdr[kRecHeader] = {};
  const uint32_t magic = 0x4352534B, key_len = 3;
  const uint64_t value_len = uint64_t{2} << 30;
  std::memcpy(hdr, &magic, 4);
  hdr[4] = 1;
  std::memcpy(hdr + 8, &key_len, 4);
  std::memcpy(hdr + 16, &value_len, 8);
  Hasher64 h;
  h.update(hdr, 48);
  h.update("big");
  const uint64_t sum = h.digest();
  std::memcpy(hdr + 48, &sum, 8);
  AppendBytes(seg, std::string(reinterpret_cast<char*>(hdr), kRecHeader) + "big" + MakeValue(100, 1));
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->recovery().records, 10);
  EXPECT_EQ(t->recovery().corrupt_records, 1);
  ExpectNotFound(*t, "big");
}

TEST_F(SsdTierTest, FlippedValueByteIsCorruption) {
  const SsdOptions o = Options();
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(1000, i))).ok());
  const std::string seg = SegmentFiles(o.dir).back();
  const uint64_t record = kRecHeader + 5 + 1000;
  const uint64_t second = kSegHeader + record;
  OverwriteByte(seg, second + kRecHeader + 5 + 123);  // inside key-1's value

  auto got = t->Get(Key(1));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption);
  EXPECT_NE(got.status().message().find(seg), std::string::npos) << got.status().message();
  EXPECT_NE(got.status().message().find("offset " + std::to_string(second)), std::string::npos)
      << got.status().message();
  EXPECT_EQ(t->Stats().errors, 1);
  ExpectNotFound(*t, Key(1));  // dropped from the index
  ExpectValue(*t, Key(0), MakeValue(1000, 0));
  ExpectValue(*t, Key(2), MakeValue(1000, 2));
  t.reset();

  // Recovery steps over the damaged record and keeps the one after it.
  t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->recovery().records, 2);
  EXPECT_EQ(t->recovery().corrupt_records, 1);
  EXPECT_EQ(t->recovery().truncated_bytes, 0);
  ExpectNotFound(*t, Key(1));
  ExpectValue(*t, Key(0), MakeValue(1000, 0));
  ExpectValue(*t, Key(2), MakeValue(1000, 2));
}

TEST_F(SsdTierTest, FlippedByteInOlderSegmentIsCorruptionOnGet) {
  SsdOptions o = Options();
  o.segment_bytes = 8 << 10;
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(3000, i))).ok());
  const auto files = SegmentFiles(o.dir);
  ASSERT_GT(files.size(), 2u);
  OverwriteByte(files.front(), kSegHeader + kRecHeader + 5 + 10);  // key-0's value
  t.reset();
  t = MustOpen(o);  // older segments are not re-hashed on Open...
  ASSERT_NE(t, nullptr);
  auto got = t->Get(Key(0));  // ...so the damage surfaces on Get
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption);
  for (int i = 1; i < 20; ++i) ExpectValue(*t, Key(i), MakeValue(3000, i));
}

TEST_F(SsdTierTest, SegmentRollingAndCapacityEviction) {
  SsdOptions o = Options();
  o.capacity_bytes = 256 << 10;
  o.segment_bytes = 64 << 10;
  constexpr int kKeys = 100;
  constexpr size_t kValue = 10 << 10;
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  for (int i = 0; i < kKeys; ++i) {
    ASSERT_TRUE(t->Put(Key(i), MakeEntry(MakeValue(kValue, i))).ok());
    ASSERT_LE(t->DiskBytes(), o.capacity_bytes);
  }
  const auto files = SegmentFiles(o.dir);
  EXPECT_GE(files.size(), 3u);
  EXPECT_LE(files.size(), 5u);
  EXPECT_EQ(t->DiskBytes(), FileBytes(files));
  EXPECT_NE(files.front(), o.dir + "/seg-00000001.kvs");  // the oldest segment is gone
  ExpectNotFound(*t, Key(0));
  for (int i = kKeys - 10; i < kKeys; ++i) ExpectValue(*t, Key(i), MakeValue(kValue, i));
  TierStats s = t->Stats();
  EXPECT_GT(s.evictions, 0);
  EXPECT_EQ(s.items + s.evictions, kKeys);
  EXPECT_EQ(s.bytes, s.items * static_cast<int64_t>(kValue));
  const int64_t items = s.items;
  t.reset();
  t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Stats().items, items);
  ExpectValue(*t, Key(kKeys - 1), MakeValue(kValue, kKeys - 1));
}

TEST_F(SsdTierTest, ValueLargerThanCapacityIsResourceExhausted) {
  SsdOptions o = Options();
  o.capacity_bytes = 64 << 10;
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  Status s = t->Put("big", MakeEntry(MakeValue(64 << 10, 1)));
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  ExpectNotFound(*t, "big");
  // A value over the format's limit is refused before anything is read from it.
  Entry huge{Blob::Allocate(kSsdMaxValueBytes + 1), 0};
  EXPECT_EQ(t->Put("huge", huge).code(), StatusCode::kInvalidArgument);
  // What fits, fits.
  EXPECT_TRUE(t->Put("small", MakeEntry(MakeValue(8 << 10, 2))).ok());
}

TEST_F(SsdTierTest, TtlExpiry) {
  const int64_t now = NowUnixMs();
  {
    auto t = MustOpen(Options());
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->Put("past", MakeEntry("x", now - 1000)).ok());
    ASSERT_TRUE(t->Put("future", MakeEntry("y", now + 3600 * 1000)).ok());
    ASSERT_TRUE(t->Put("soon", MakeEntry("z", now + 150)).ok());
    ASSERT_TRUE(t->Put("hidden", MakeEntry("old")).ok());
    ASSERT_TRUE(t->Put("hidden", MakeEntry("new", now - 1)).ok());  // an expired put still replaces

    ExpectNotFound(*t, "past");
    ExpectNotFound(*t, "hidden");
    auto c = t->Contains("past");
    ASSERT_TRUE(c.ok());
    EXPECT_FALSE(*c);
    auto f = t->Get("future");
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->expires_at_ms, now + 3600 * 1000);
    ExpectValue(*t, "soon", "z");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const int64_t expirations_before = t->Stats().expirations;
    ExpectNotFound(*t, "soon");
    EXPECT_EQ(t->Stats().expirations, expirations_before + 1);
  }
  auto t = MustOpen(Options());
  ASSERT_NE(t, nullptr);
  ExpectNotFound(*t, "past");
  ExpectNotFound(*t, "soon");
  ExpectNotFound(*t, "hidden");
  auto f = t->Get("future");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->expires_at_ms, now + 3600 * 1000);  // the expiry was persisted
  EXPECT_EQ(t->Stats().items, 1);
}

TEST_F(SsdTierTest, BadKeysRejected) {
  auto t = MustOpen(Options());
  ASSERT_NE(t, nullptr);
  const std::string long_key(kMaxKeyBytes + 1, 'k');
  EXPECT_EQ(t->Put(long_key, MakeEntry("v")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Put("", MakeEntry("v")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Get(long_key).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Delete(long_key).code(), StatusCode::kInvalidArgument);
  const std::string max_key(kMaxKeyBytes, 'm');
  ASSERT_TRUE(t->Put(max_key, MakeEntry("v")).ok());
  ExpectValue(*t, max_key, "v");
  EXPECT_EQ(t->Stats().items, 1);
}

TEST_F(SsdTierTest, SyncEachPutAndSync) {
  SsdOptions o = Options();
  o.sync_each_put = true;
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->Put("durable", MakeEntry(MakeValue(4096, 3))).ok());
    EXPECT_TRUE(t->Sync().ok());
  }
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  ExpectValue(*t, "durable", MakeValue(4096, 3));
}

TEST_F(SsdTierTest, DirectoryHeldByOneTier) {
  auto t = MustOpen(Options());
  ASSERT_NE(t, nullptr);
  auto second = SsdTier::Open(Options());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  t.reset();
  EXPECT_TRUE(SsdTier::Open(Options()).ok());
}

TEST_F(SsdTierTest, BadSegmentHeaderIsSkipped) {
  const SsdOptions o = Options();
  fs::create_directories(o.dir);
  AppendBytes(o.dir + "/seg-00000001.kvs", MakeValue(100, 5));
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->recovery().corrupt_records, 1);
    ASSERT_TRUE(t->Put("k", MakeEntry("v")).ok());
  }
  EXPECT_TRUE(fs::exists(o.dir + "/seg-00000002.kvs"));  // appends went to a fresh segment
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  ExpectValue(*t, "k", "v");
}

// A damaged header in mid-segment with sound records after it is not a torn tail: cutting there
// would lose later persisted writes and bring back what they overwrote or deleted. The keys of
// the damaged records are unknown, so the tier drops everything and starts empty (a cache may
// forget; it may not serve an older value), and removes the files so the next start is clean.
TEST_F(SsdTierTest, DamagedHeaderBeforeSoundRecordsDropsTheTierInsteadOfCutting) {
  const SsdOptions o = Options();
  const std::string seg = WriteTenRecords(o, 1000);
  const uint64_t record = kRecHeader + 5 + 1000;
  OverwriteByte(seg, kSegHeader + 3 * record + 20);  // key-3's value length: header checksum fails
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->recovery().damaged_regions, 1);
    EXPECT_EQ(t->recovery().dropped_entries, 9);  // key-0..2 and key-4..9
    EXPECT_EQ(t->recovery().truncated_bytes, 0);
    EXPECT_EQ(t->Stats().items, 0);
    for (int i = 0; i < 10; ++i) ExpectNotFound(*t, Key(i));
    EXPECT_FALSE(fs::exists(seg));
    ASSERT_TRUE(t->Put("after", MakeEntry("fresh")).ok());
  }
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->recovery().damaged_regions, 0);
  ExpectValue(*t, "after", "fresh");
}

// A newer segment damaged (a bad record header, a bad segment header) or missing altogether
// (eviction only ever removes the oldest, so a gap is loss): its newer values and tombstones are
// gone, so nothing older may come back.
TEST_F(SsdTierTest, DamageInANewerSegmentNeverBringsBackAnOlderValueOrADeletedKey) {
  enum Damage { kRecordHeader, kSegmentHeader, kMissingSegment };
  for (const Damage damage : {kRecordHeader, kSegmentHeader, kMissingSegment}) {
    SCOPED_TRACE(damage == kRecordHeader ? "first record header" : damage == kSegmentHeader ? "segment header" : "missing segment");
    SsdOptions o = Options();
    o.dir += "-" + std::to_string(damage);
    o.segment_bytes = 8 << 10;
    const bool third = damage != kRecordHeader;
    {
      auto t = MustOpen(o);
      ASSERT_NE(t, nullptr);
      ASSERT_TRUE(t->Put("k", MakeEntry(MakeValue(3000, 1))).ok());
      ASSERT_TRUE(t->Put("d", MakeEntry(MakeValue(3000, 2))).ok());
      ASSERT_TRUE(t->Put("k", MakeEntry(MakeValue(3000, 3))).ok());  // rolls: the newer segment's first record
      ASSERT_TRUE(t->Delete("d").ok());
      ASSERT_TRUE(t->Put("f", MakeEntry(MakeValue(100, 4))).ok());
      if (third) ASSERT_TRUE(t->Put("g", MakeEntry(MakeValue(6000, 5))).ok());  // a third segment
    }
    const auto files = SegmentFiles(o.dir);
    ASSERT_EQ(files.size(), third ? 3u : 2u);
    if (damage == kMissingSegment) {
      fs::remove(files[1]);
    } else {
      OverwriteByte(files[1], damage == kSegmentHeader ? 0 : kSegHeader + 20);
    }
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->recovery().damaged_regions, 1);
    ExpectNotFound(*t, "k");  // not the older value from the first segment
    ExpectNotFound(*t, "d");  // not brought back
    EXPECT_EQ(t->Stats().items, 0);
  }
}

TEST_F(SsdTierTest, InvalidOptions) {
  SsdOptions o = Options();
  o.dir = "";
  EXPECT_EQ(SsdTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options();
  o.segment_bytes = 100;
  EXPECT_EQ(SsdTier::Open(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace keel::kvstore

namespace keel::kvstore {
namespace {

Entry SeqEntry(std::string_view bytes, uint64_t seq) { return Entry{Blob::Copy(bytes), 0, seq}; }

TEST_F(SsdTierTest, AnOlderWriteNeverReplacesANewerOne) {
  const SsdOptions o = Options();
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->Put("k", SeqEntry("newer", 20)).ok());
    ASSERT_TRUE(t->Put("k", SeqEntry("older", 10)).ok());  // accepted, ignored
    ExpectValue(*t, "k", "newer");
    EXPECT_EQ(t->Stats().stale_puts, 1);
    EXPECT_EQ(t->SeqOf("k"), std::optional<uint64_t>(20));
    ASSERT_TRUE(t->DeleteAt("k", 15).ok());  // older than the value: ignored too
    ExpectValue(*t, "k", "newer");
    ASSERT_TRUE(t->Put("k", SeqEntry("same", 20)).ok());  // equal numbers replace
    ExpectValue(*t, "k", "same");
    EXPECT_EQ(t->max_seq(), 20u);
  }
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  ExpectValue(*t, "k", "same");
  EXPECT_EQ(t->max_seq(), 20u);
  Result<Entry> e = t->Get("k");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->seq, 20u);
}

TEST_F(SsdTierTest, RecoveryKeepsTheHighestSequenceNumberNotTheLastRecord) {
  const SsdOptions o = Options();
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    // File order: put 30, tombstone 30, put 12 (the tier accepts it: nothing is indexed after
    // the delete), put 40 for another key then an older put 35 of it straight after a delete.
    ASSERT_TRUE(t->Put("a", SeqEntry("a30", 30)).ok());
    ASSERT_TRUE(t->DeleteAt("a", 30).ok());
    ASSERT_TRUE(t->Put("a", SeqEntry("a12", 12)).ok());
    ExpectValue(*t, "a", "a12");
    ASSERT_TRUE(t->Put("b", SeqEntry("b40", 40)).ok());
    ASSERT_TRUE(t->Put("c", SeqEntry("c5", 5)).ok());
    ASSERT_TRUE(t->Put("c", SeqEntry("c7", 7)).ok());
  }
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  ExpectNotFound(*t, "a");  // the tombstone at 30 hides the later-written put at 12
  ExpectValue(*t, "b", "b40");
  ExpectValue(*t, "c", "c7");
  EXPECT_EQ(t->recovery().stale_records, 1);
  EXPECT_EQ(t->max_seq(), 40u);
}

// A segment in format version 1 (no sequence numbers), as Keel wrote it before: read on Open
// (file order decides between its records), never appended to, and older than any new write.
void AppendV1Record(std::string* seg, uint8_t type, std::string_view key, std::string_view value) {
  uint8_t hdr[48] = {};
  const uint32_t magic = 0x4352534B, key_len = static_cast<uint32_t>(key.size());
  const uint64_t value_len = value.size(), value_sum = Xxh3_64(value.data(), value.size());
  std::memcpy(hdr, &magic, 4);
  hdr[4] = type;
  std::memcpy(hdr + 8, &key_len, 4);
  std::memcpy(hdr + 16, &value_len, 8);
  std::memcpy(hdr + 32, &value_sum, 8);
  Hasher64 h;
  h.update(hdr, 40);
  h.update(key);
  const uint64_t sum = h.digest();
  std::memcpy(hdr + 40, &sum, 8);
  seg->append(reinterpret_cast<const char*>(hdr), 48);
  seg->append(key);
  seg->append(value);
}

TEST_F(SsdTierTest, ReadsVersion1SegmentsAndAppendsOnlyToNewOnes) {
  const SsdOptions o = Options();
  fs::create_directories(o.dir);
  std::string seg(32, '\0');
  const uint32_t magic = 0x4753534B, version = 1;
  const uint64_t id = 1;
  std::memcpy(seg.data(), &magic, 4);
  std::memcpy(seg.data() + 4, &version, 4);
  std::memcpy(seg.data() + 8, &id, 8);
  const uint64_t header_sum = Xxh3_64(seg.data(), 24);
  std::memcpy(seg.data() + 24, &header_sum, 8);
  AppendV1Record(&seg, 1, "old", "first");
  AppendV1Record(&seg, 1, "old", "second");  // same key: the later record wins in version 1
  AppendV1Record(&seg, 1, "gone", "x");
  AppendV1Record(&seg, 2, "gone", "");
  const std::string path = o.dir + "/seg-00000001.kvs";
  AppendBytes(path, seg);
  {
    auto t = MustOpen(o);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->recovery().records, 4);
    EXPECT_EQ(t->recovery().corrupt_records, 0);
    ExpectValue(*t, "old", "second");
    ExpectNotFound(*t, "gone");
    ASSERT_TRUE(t->Put("new", SeqEntry("v2", 1)).ok());
    ASSERT_TRUE(t->Put("old", SeqEntry("third", 1)).ok());
  }
  EXPECT_EQ(fs::file_size(path), seg.size()) << "a version 1 segment must not be appended to";
  auto t = MustOpen(o);
  ASSERT_NE(t, nullptr);
  ExpectValue(*t, "old", "third");
  ExpectValue(*t, "new", "v2");
}

}  // namespace
}  // namespace keel::kvstore
