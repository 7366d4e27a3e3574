#include "keel/vector/wal.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "keel/vector/records.h"
#include "tests/engine/test_util.h"

namespace keel::vector {
namespace {

using test::TempDir;

Result<std::unique_ptr<Wal>> OpenCollect(const std::string& path, std::vector<std::string>* got, WalReplay* r = nullptr) {
  got->clear();
  return Wal::Open(path, true, [got](std::string_view p) { got->emplace_back(p); return Status::Ok(); }, r);
}

void AppendN(const std::string& path, int n) {
  std::vector<std::string> got;
  auto wal = OpenCollect(path, &got);
  ASSERT_TRUE(wal.ok()) << wal.status().ToString();
  for (int i = 0; i < n; ++i) ASSERT_TRUE((*wal)->Append("record-" + std::to_string(i) + std::string(100, 'x')).ok());
}

void FlipByte(const std::string& path, size_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(offset);
  f.write(&c, 1);
}

constexpr size_t kRecordBytes = Wal::kHeaderBytes + 108;  // "record-N" + 100 x

TEST(WalTest, ReplaysEveryRecordInOrder) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 5);
  std::vector<std::string> got;
  WalReplay r;
  auto wal = OpenCollect(path, &got, &r);
  ASSERT_TRUE(wal.ok());
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[3].substr(0, 8), "record-3");
  EXPECT_EQ(r.records, 5);
  EXPECT_EQ(r.torn_bytes, 0);
  EXPECT_EQ((*wal)->bytes(), static_cast<int64_t>(5 * kRecordBytes));
  // Batched append: several records, one write.
  std::vector<std::string_view> batch = {"a", "bb", "ccc"};
  ASSERT_TRUE((*wal)->Append(batch).ok());
  wal->reset();
  ASSERT_TRUE(OpenCollect(path, &got).ok());
  ASSERT_EQ(got.size(), 8u);
  EXPECT_EQ(got[7], "ccc");
}

TEST(WalTest, TornTailIsCutAndReported) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 3);
  std::filesystem::resize_file(path, 3 * kRecordBytes - 5);
  std::vector<std::string> got;
  WalReplay r;
  auto wal = OpenCollect(path, &got, &r);
  ASSERT_TRUE(wal.ok()) << wal.status().ToString();
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(r.torn_bytes, static_cast<int64_t>(kRecordBytes - 5));
  EXPECT_EQ(std::filesystem::file_size(path), 2 * kRecordBytes);
  ASSERT_TRUE((*wal)->Append("after").ok());
  wal->reset();
  ASSERT_TRUE(OpenCollect(path, &got).ok());
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[2], "after");
}

TEST(WalTest, TornHeaderAndZeroTailAreCut) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 2);
  std::filesystem::resize_file(path, 2 * kRecordBytes + 4096);  // extended with zeros
  std::vector<std::string> got;
  WalReplay r;
  ASSERT_TRUE(OpenCollect(path, &got, &r).ok());
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(r.torn_bytes, 4096);
  std::filesystem::resize_file(path, kRecordBytes + 10);  // half a header
  ASSERT_TRUE(OpenCollect(path, &got, &r).ok());
  EXPECT_EQ(got.size(), 1u);
}

TEST(WalTest, DamagedLastRecordIsTornTail) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 3);
  FlipByte(path, 2 * kRecordBytes + Wal::kHeaderBytes + 3);
  std::vector<std::string> got;
  WalReplay r;
  ASSERT_TRUE(OpenCollect(path, &got, &r).ok());
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(r.torn_bytes, static_cast<int64_t>(kRecordBytes));
}

TEST(WalTest, CorruptMiddleRecordIsCorruptionNamingFileAndOffset) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 3);
  FlipByte(path, kRecordBytes + Wal::kHeaderBytes + 3);
  std::vector<std::string> got;
  auto wal = OpenCollect(path, &got);
  ASSERT_FALSE(wal.ok());
  EXPECT_EQ(wal.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wal.status().message().find(path), std::string::npos) << wal.status().message();
  EXPECT_NE(wal.status().message().find("offset " + std::to_string(kRecordBytes)), std::string::npos)
      << wal.status().message();
  // Bad magic in the middle is damage too.
  AppendN(dir.file("wal2.log"), 3);
  FlipByte(dir.file("wal2.log"), kRecordBytes);
  auto wal2 = OpenCollect(dir.file("wal2.log"), &got);
  ASSERT_FALSE(wal2.ok());
  EXPECT_EQ(wal2.status().code(), StatusCode::kCorruption);
}

// A damaged length field in mid-log runs "past the end" like a torn record; the valid records
// after it tell the two apart. Cutting there would drop every later acknowledged write.
TEST(WalTest, HugeLengthInMidLogIsCorruptionNotATornTail) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 4);
  const uint64_t huge = uint64_t{1} << 62;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(kRecordBytes + 8));  // record 1's length field
    f.write(reinterpret_cast<const char*>(&huge), sizeof(huge));
  }
  std::vector<std::string> got;
  auto wal = OpenCollect(path, &got);
  ASSERT_FALSE(wal.ok());
  EXPECT_EQ(wal.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wal.status().message().find("offset " + std::to_string(kRecordBytes)), std::string::npos)
      << wal.status().message();
  EXPECT_NE(wal.status().message().find("follows at offset " + std::to_string(2 * kRecordBytes)), std::string::npos)
      << wal.status().message();
  EXPECT_EQ(std::filesystem::file_size(path), 4 * kRecordBytes);  // nothing cut
  // The same length in the last record is a torn tail: nothing valid follows it.
  AppendN(dir.file("wal2.log"), 3);
  {
    std::fstream f(dir.file("wal2.log"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(2 * kRecordBytes + 8));
    f.write(reinterpret_cast<const char*>(&huge), sizeof(huge));
  }
  WalReplay r;
  ASSERT_TRUE(OpenCollect(dir.file("wal2.log"), &got, &r).ok());
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(r.torn_bytes, static_cast<int64_t>(kRecordBytes));
}

TEST(WalTest, ApplyErrorStopsReplay) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 3);
  int n = 0;
  auto wal = Wal::Open(path, false, [&](std::string_view) {
    return ++n == 2 ? Status::Internal("boom") : Status::Ok();
  });
  ASSERT_FALSE(wal.ok());
  EXPECT_NE(wal.status().message().find("boom"), std::string::npos) << wal.status().message();
  EXPECT_NE(wal.status().message().find("wal.log: record at offset"), std::string::npos) << wal.status().message();
}

TEST(WalTest, TruncateEmptiesTheLog) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  std::vector<std::string> got;
  auto wal = OpenCollect(path, &got);
  ASSERT_TRUE(wal.ok());
  ASSERT_TRUE((*wal)->Append("one").ok());
  ASSERT_TRUE((*wal)->Truncate().ok());
  EXPECT_EQ((*wal)->bytes(), 0);
  ASSERT_TRUE((*wal)->Append("two").ok());
  wal->reset();
  ASSERT_TRUE(OpenCollect(path, &got).ok());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0], "two");
}

TEST(WalTest, RecordsOfAnEarlierEpochAtTheHeadAreSkippedAndCounted) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 2);  // epoch 0
  std::vector<std::string> got;
  WalReplay r;
  {
    auto wal = Wal::Open(path, true, [&](std::string_view p) { got.emplace_back(p); return Status::Ok(); }, &r, 1);
    ASSERT_TRUE(wal.ok()) << wal.status().ToString();
    EXPECT_TRUE(got.empty());
    EXPECT_EQ(r.stale, 2);
    EXPECT_EQ((*wal)->epoch(), 1u);
    ASSERT_TRUE((*wal)->Append("current").ok());
  }
  got.clear();
  auto wal = Wal::Open(path, true, [&](std::string_view p) { got.emplace_back(p); return Status::Ok(); }, &r, 1);
  ASSERT_TRUE(wal.ok()) << wal.status().ToString();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0], "current");
  EXPECT_EQ(r.stale, 2);
  EXPECT_EQ(r.offsets, std::vector<int64_t>{static_cast<int64_t>(2 * kRecordBytes)});
  // The epoch tag is under the checksum: a flipped tag is damage, not a stale record to skip.
  ASSERT_TRUE((*wal)->Append("tail").ok());
  wal->reset();
  FlipByte(path, 2 * kRecordBytes + 4);
  auto damaged = Wal::Open(path, true, [](std::string_view) { return Status::Ok(); }, nullptr, 1);
  ASSERT_FALSE(damaged.ok());
  EXPECT_EQ(damaged.status().code(), StatusCode::kCorruption);
}

TEST(WalTest, AStaleRecordAfterACurrentOneIsCorruption) {
  TempDir dir("keel-wal");
  const std::string current = dir.file("current.log"), stale = dir.file("stale.log"), path = dir.file("wal.log");
  for (auto [file, epoch] : {std::pair{current, 4u}, std::pair{stale, 3u}}) {
    auto wal = Wal::Open(file, true, [](std::string_view) { return Status::Ok(); }, nullptr, epoch);
    ASSERT_TRUE(wal.ok());
    ASSERT_TRUE((*wal)->Append("epoch " + std::to_string(epoch)).ok());
  }
  {
    std::ofstream out(path, std::ios::binary);
    out << std::ifstream(current, std::ios::binary).rdbuf() << std::ifstream(stale, std::ios::binary).rdbuf();
  }
  auto wal = Wal::Open(path, true, [](std::string_view) { return Status::Ok(); }, nullptr, 4);
  ASSERT_FALSE(wal.ok());
  EXPECT_EQ(wal.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wal.status().message().find("earlier epoch"), std::string::npos) << wal.status().message();
}

TEST(WalTest, RecordsOfALaterEpochAreCorruptionNotSkipped) {
  // The snapshot that started epoch 4 is missing (or an older copy came back): its log must not
  // be read as stale and then emptied by the next snapshot.
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  {
    auto wal = Wal::Open(path, true, [](std::string_view) { return Status::Ok(); }, nullptr, 4);
    ASSERT_TRUE(wal.ok());
    ASSERT_TRUE((*wal)->Append("acknowledged").ok());
  }
  auto wal = Wal::Open(path, true, [](std::string_view) { return Status::Ok(); }, nullptr, 3);
  ASSERT_FALSE(wal.ok());
  EXPECT_EQ(wal.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wal.status().message().find("epoch 4, newer than the snapshot's epoch 3"), std::string::npos)
      << wal.status().message();
  EXPECT_EQ(std::filesystem::file_size(path), Wal::kHeaderBytes + 12);  // nothing cut
}

TEST(WalTest, ReadReturnsTheRecordsOfARangeAndRefusesDamage) {
  TempDir dir("keel-wal");
  const std::string path = dir.file("wal.log");
  AppendN(path, 4);
  std::vector<std::string> got;
  auto wal = OpenCollect(path, &got);
  ASSERT_TRUE(wal.ok());
  got.clear();
  auto collect = [&](std::string_view p) { got.emplace_back(p); return Status::Ok(); };
  ASSERT_TRUE((*wal)->Read(kRecordBytes, 3 * kRecordBytes, collect).ok());
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].substr(0, 8), "record-1");
  EXPECT_EQ(got[1].substr(0, 8), "record-2");
  EXPECT_FALSE((*wal)->Read(0, 5 * kRecordBytes, collect).ok());  // past the end
  EXPECT_EQ((*wal)->Read(0, kRecordBytes + 3, collect).code(), StatusCode::kCorruption);  // not a record boundary
  FlipByte(path, 2 * kRecordBytes + Wal::kHeaderBytes + 7);
  Status s = (*wal)->Read(kRecordBytes, 3 * kRecordBytes, collect);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("offset " + std::to_string(2 * kRecordBytes)), std::string::npos) << s.message();
}

TEST(RecordsTest, UpsertAndDeleteRoundTrip) {
  std::vector<Item> items(2);
  items[0].id = 5;
  items[0].text = {1, 2, 3};
  items[0].image = {4, 5};
  items[0].attributes = {{"lang", "en"}, {"src", "web"}};
  items[1].id = 9;
  items[1].text = {0.5f, -1, 2};
  auto rec = DecodeRecord(EncodeUpsert(items));
  ASSERT_TRUE(rec.ok());
  ASSERT_EQ(rec->type, RecordType::kUpsert);
  ASSERT_EQ(rec->items.size(), 2u);
  EXPECT_EQ(rec->items[0].attributes.at("src"), "web");
  EXPECT_EQ(rec->items[1].text, items[1].text);
  EXPECT_TRUE(rec->items[1].image.empty());
  std::vector<uint64_t> ids = {1, 2, 3};
  auto del = DecodeRecord(EncodeDelete(ids));
  ASSERT_TRUE(del.ok());
  EXPECT_EQ(del->ids, ids);
  std::string cut = EncodeUpsert(items);
  cut.resize(cut.size() - 3);
  EXPECT_EQ(DecodeRecord(cut).status().code(), StatusCode::kCorruption);
}

// Counts in a record are untrusted: one its bytes cannot hold is Corruption, decided before any
// allocation for it (an upsert of 2^32 - 1 items in 5 bytes asked for ~400 GiB before).
TEST(RecordsTest, ACountPastTheRecordsBytesIsCorruption) {
  for (const std::string& payload : {std::string("\x01\xff\xff\xff\xff", 5), std::string("\x02\xff\xff\xff\xff", 5),
                                     std::string("\x01\x02\x00\x00\x00", 5) + std::string(20, '\0')}) {
    auto r = DecodeRecord(payload);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  }
  // The least item (an id, no vectors, no attributes) is 20 bytes: two of them in 40 decode.
  auto two = DecodeRecord(std::string("\x01\x02\x00\x00\x00", 5) + std::string(40, '\0'));
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(two->items.size(), 2u);
}

}  // namespace
}  // namespace keel::vector
