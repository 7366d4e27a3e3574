#include "keel/vector/shard.h"

#include <gtest/gtest.h>

#include "keel/vector/wal.h"

#include <filesystem>
#include <fstream>
#include <faiss/utils/distances.h>

#include <random>
#include <thread>

#include "tests/vector/sift_data.h"

namespace keel::vector {
namespace {

using test::LoadSift;
using test::RecallAt10;
using test::TempDir;

// Item i: SIFT base vector i as text, another base vector as image, parity as an attribute.
Item MakeItem(int64_t i) {
  const auto& s = LoadSift();
  Item it;
  it.id = static_cast<uint64_t>(i);
  it.text = s.vec(i % s.base.count);
  it.image = s.vec((i * 7 + 3) % s.base.count);
  it.attributes = {{"parity", i % 2 == 0 ? "even" : "odd"}, {"bucket", std::to_string(i % 10)}};
  return it;
}

ShardOptions Options(const std::string& dir, IndexKind kind = IndexKind::kHnsw) {
  ShardOptions o;
  o.dir = dir + "/shard";
  o.index.kind = kind;
  o.index.ivf_lists = kind == IndexKind::kIvfPq ? 64 : 100;
  return o;
}

std::unique_ptr<Shard> OpenShard(const ShardOptions& o) {
  auto s = Shard::Open(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

void Load(Shard& shard, int64_t begin, int64_t end, int64_t batch = 2500) {
  for (int64_t b = begin; b < end; b += batch) {
    std::vector<Item> items;
    for (int64_t i = b; i < std::min(end, b + batch); ++i) items.push_back(MakeItem(i));
    ASSERT_TRUE(shard.Upsert(items).ok());
  }
}

SearchRequest TextQuery(int64_t q, int k = 10) {
  SearchRequest r;
  r.text_query = LoadSift().vec(q);
  r.k = k;
  return r;
}

std::vector<uint64_t> Ids(const SearchResult& r) {
  std::vector<uint64_t> ids;
  for (const auto& h : r.hits) ids.push_back(h.id);
  return ids;
}

double ShardRecall(Shard& shard) {
  const auto& s = LoadSift();
  double sum = 0;
  for (int q = 0; q < 100; ++q) {
    auto r = shard.Search(TextQuery(q));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    std::vector<int64_t> got;
    for (const auto& h : r->hits) got.push_back(static_cast<int64_t>(h.id));
    sum += RecallAt10(s, q, got);
  }
  return sum / 100;
}

TEST(ShardTest, RecallThroughTheShardForEveryIndexKind) {
  for (IndexKind kind : {IndexKind::kHnsw, IndexKind::kIvfFlat, IndexKind::kIvfPq}) {
    TempDir dir("keel-shard");
    ShardOptions o = Options(dir.path(), kind);
    o.rerank = 100;
    o.wal_sync = false;
    auto shard = OpenShard(o);
    Load(*shard, 0, 10000);
    EXPECT_EQ(shard->Stats().items, 10000);
    const double r = ShardRecall(*shard);
    std::printf("shard %s (rerank 100) recall@10 = %.3f\n", std::string(IndexKindName(kind)).c_str(), r);
    EXPECT_GE(r, 0.9) << IndexKindName(kind);
  }
}

TEST(ShardTest, BadInputIsInvalidArgumentAndChangesNothing) {
  TempDir dir("keel-shard");
  auto shard = OpenShard(Options(dir.path()));
  Load(*shard, 0, 10, 10);
  auto expect_invalid = [&](std::vector<Item> items, const std::string& fragment) {
    Status s = shard->Upsert(items);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s.message();
  };
  Item short_text = MakeItem(100);
  short_text.text.pop_back();
  expect_invalid({MakeItem(50), short_text}, "expected 128");
  Item nan = MakeItem(101);
  nan.text[3] = std::numeric_limits<float>::quiet_NaN();
  expect_invalid({nan}, "text[3] is not finite");
  Item inf = MakeItem(102);
  inf.image[0] = std::numeric_limits<float>::infinity();
  expect_invalid({inf}, "image[0]");
  Item huge = MakeItem(105);  // finite, but its distances to anything overflow float32
  std::fill(huge.text.begin(), huge.text.end(), 3.4e38f);
  expect_invalid({huge}, "distances would overflow");
  expect_invalid({MakeItem(103), MakeItem(103)}, "duplicate");
  Item big = MakeItem(104);
  big.id = ~uint64_t{0};
  expect_invalid({big}, "2^63");
  EXPECT_EQ(shard->Stats().items, 10);  // item 50 of the rejected batch was not written

  SearchRequest r = TextQuery(1);
  r.k = 0;
  EXPECT_EQ(shard->Search(r).status().code(), StatusCode::kInvalidArgument);
  r.k = 1001;
  EXPECT_NE(shard->Search(r).status().message().find("k must be in [1, 1000]"), std::string::npos);
  r = TextQuery(1);
  std::fill(r.text_query.begin(), r.text_query.end(), 3.4e38f);
  EXPECT_NE(shard->Search(r).status().message().find("distances would overflow"), std::string::npos);
  r = TextQuery(1);
  r.text_query.resize(64);
  EXPECT_EQ(shard->Search(r).status().code(), StatusCode::kInvalidArgument);
  r = TextQuery(1);
  r.ef = -1;
  EXPECT_EQ(shard->Search(r).status().code(), StatusCode::kInvalidArgument);
  r = TextQuery(1);
  r.kind = QueryKind::kImage;
  r.text_query.clear();
  EXPECT_EQ(shard->Search(r).status().code(), StatusCode::kInvalidArgument);  // no ids
}

class ShardKindTest : public ::testing::TestWithParam<IndexKind> {};
INSTANTIATE_TEST_SUITE_P(Kinds, ShardKindTest, ::testing::Values(IndexKind::kHnsw, IndexKind::kIvfFlat, IndexKind::kIvfPq),
                         [](const auto& info) { return std::string(info.param == IndexKind::kHnsw ? "Hnsw" : info.param == IndexKind::kIvfFlat ? "IvfFlat" : "IvfPq"); });

TEST_P(ShardKindTest, FiltersReturnOnlyMatchingItems) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path(), GetParam());
  o.index.ivf_lists = 64;
  auto shard = OpenShard(o);
  Load(*shard, 0, GetParam() == IndexKind::kIvfPq ? 10000 : 5000);
  for (int q = 0; q < 20; ++q) {
    SearchRequest r = TextQuery(q);
    r.filter = {{"parity", "odd"}, {"bucket", "3"}};
    auto res = shard->Search(r);
    ASSERT_TRUE(res.ok());
    EXPECT_EQ(res->hits.size(), 10u);
    for (const auto& h : res->hits) EXPECT_EQ(h.id % 10, 3u);
  }
  // A filter matching 0.4% of the items still fills k.
  std::vector<Item> rare;
  for (int64_t i = 5000; i < 5020; ++i) {
    rare.push_back(MakeItem(i));
    rare.back().attributes["rare"] = "yes";
  }
  ASSERT_TRUE(shard->Upsert(rare).ok());
  for (int q = 0; q < 10; ++q) {
    SearchRequest r = TextQuery(q);
    r.filter = {{"rare", "yes"}};
    auto res = shard->Search(r);
    ASSERT_TRUE(res.ok());
    EXPECT_EQ(res->hits.size(), 10u) << q;
    for (const auto& h : res->hits) EXPECT_GE(h.id, 5000u);
  }
  SearchRequest none = TextQuery(0);
  none.filter = {{"parity", "neither"}};
  EXPECT_TRUE(shard->Search(none)->hits.empty());
}

TEST(ShardTest, DeletedItemsAreNeverReturnedAndUpsertReplaces) {
  for (IndexKind kind : {IndexKind::kHnsw, IndexKind::kIvfFlat}) {
    TempDir dir("keel-shard");
    auto shard = OpenShard(Options(dir.path(), kind));
    Load(*shard, 0, 10000);
    std::vector<uint64_t> gone;
    for (uint64_t i = 0; i < 10000; i += 4) gone.push_back(i);  // 2500: enough to force a rebuild
    ASSERT_TRUE(shard->Delete(gone).ok());
    ASSERT_TRUE(shard->Delete(std::vector<uint64_t>{123456789}).ok());  // unknown: ignored
    EXPECT_EQ(shard->Stats().items, 7500);
    EXPECT_EQ(shard->Stats().deleted_pending, 0) << "the delete should have triggered a rebuild";
    for (int q = 0; q < 100; ++q) {
      auto r = shard->Search(TextQuery(q, 50));
      ASSERT_TRUE(r.ok());
      for (uint64_t id : Ids(*r)) EXPECT_NE(id % 4, 0u) << IndexKindName(kind);
      if (q % 4 != 0) {
        EXPECT_EQ(r->hits[0].id, static_cast<uint64_t>(q));
      }
    }
    // Replacing item 1's text with item 2's vector: a query for vector 1 no longer finds it at 0.
    Item moved = MakeItem(1);
    moved.text = LoadSift().vec(2);
    ASSERT_TRUE(shard->Upsert(std::vector<Item>{moved}).ok());
    auto r = shard->Search(TextQuery(2, 2));
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->hits.size(), 2u);
    EXPECT_EQ(r->hits[0].text_distance, 0.0f);
    EXPECT_EQ(r->hits[1].text_distance, 0.0f);
    auto r1 = shard->Search(TextQuery(1, 1));
    EXPECT_NE(r1->hits[0].id, 1u);
    EXPECT_EQ(shard->Stats().items, 7500);
  }
}

TEST(ShardTest, WalReplayRestoresEverythingAfterReopen) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  std::vector<std::vector<uint64_t>> before;
  {
    auto shard = OpenShard(o);
    Load(*shard, 0, 3000, 500);
    ASSERT_TRUE(shard->Delete(std::vector<uint64_t>{5, 6, 7}).ok());
    for (int q = 0; q < 30; ++q) before.push_back(Ids(*shard->Search(TextQuery(q))));
    EXPECT_GT(shard->Stats().wal_bytes, 0);
  }  // no snapshot: everything comes back from the log
  auto shard = OpenShard(o);
  EXPECT_EQ(shard->Stats().items, 2997);
  for (int q = 0; q < 30; ++q) EXPECT_EQ(Ids(*shard->Search(TextQuery(q))), before[q]) << q;
}

TEST(ShardTest, SnapshotAndReopenGiveIdenticalResults) {
  for (IndexKind kind : {IndexKind::kHnsw, IndexKind::kIvfFlat, IndexKind::kIvfPq}) {
    TempDir dir("keel-shard");
    ShardOptions o = Options(dir.path(), kind);
    o.wal_sync = false;
    std::vector<SearchResult> before;
    {
      auto shard = OpenShard(o);
      Load(*shard, 0, 10000);
      ASSERT_TRUE(shard->Delete(std::vector<uint64_t>{1, 2, 3}).ok());
      ASSERT_TRUE(shard->Snapshot().ok());
      EXPECT_EQ(shard->Stats().wal_bytes, static_cast<int64_t>(Wal::kHeaderBytes));  // the epoch marker
      Load(*shard, 10000, 10100, 100);  // after the snapshot: from the log
      for (int q = 0; q < 50; ++q) {
        SearchRequest r = TextQuery(q);
        r.kind = QueryKind::kMultimodal;
        r.include_vectors = true;
        before.push_back(*shard->Search(r));
      }
    }
    auto shard = OpenShard(o);
    ASSERT_TRUE(shard);
    EXPECT_EQ(shard->Stats().items, 10097);
    for (int q = 0; q < 50; ++q) {
      SearchRequest r = TextQuery(q);
      r.kind = QueryKind::kMultimodal;
      r.include_vectors = true;
      auto after = shard->Search(r);
      ASSERT_TRUE(after.ok());
      ASSERT_EQ(after->hits.size(), before[q].hits.size());
      for (size_t i = 0; i < after->hits.size(); ++i) {
        EXPECT_EQ(after->hits[i].id, before[q].hits[i].id) << IndexKindName(kind) << " q " << q;
        EXPECT_EQ(after->hits[i].text_distance, before[q].hits[i].text_distance);
        EXPECT_EQ(after->hits[i].text, before[q].hits[i].text);
        EXPECT_EQ(after->hits[i].image, before[q].hits[i].image);
      }
    }
  }
}

TEST(ShardTest, DamagedSnapshotOrLogFailsOpen) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  {
    auto shard = OpenShard(o);
    Load(*shard, 0, 300, 100);
  }
  // A flipped byte inside the first of three log records: Corruption, not silent loss.
  const std::string wal = o.dir + "/wal.log";
  {
    std::fstream f(wal, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  auto bad = Shard::Open(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("wal.log"), std::string::npos) << bad.status().message();

  TempDir dir2("keel-shard");
  ShardOptions o2 = Options(dir2.path());
  {
    auto shard = OpenShard(o2);
    Load(*shard, 0, 300, 100);
    ASSERT_TRUE(shard->Snapshot().ok());
  }
  const std::string snap = o2.dir + "/shard.snap";
  {
    std::fstream f(snap, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(snap) - 10));
    f.put('\x01');
  }
  auto bad2 = Shard::Open(o2);
  ASSERT_FALSE(bad2.ok());
  EXPECT_EQ(bad2.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad2.status().message().find("checksum"), std::string::npos) << bad2.status().message();
}

TEST(ShardTest, MultimodalImageLookupAndQueryLog) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  o.rerank = 20;
  auto shard = OpenShard(o);
  Load(*shard, 0, 2000, 1000);
  Item no_image = MakeItem(5000);
  no_image.image.clear();
  ASSERT_TRUE(shard->Upsert(std::vector<Item>{no_image}).ok());

  const size_t log_before = shard->query_log().size();
  SearchRequest r = TextQuery(10, 5);
  r.kind = QueryKind::kMultimodal;
  r.image_query = MakeItem(10).image;
  r.include_vectors = true;
  auto res = shard->Search(r);
  ASSERT_TRUE(res.ok());
  ASSERT_EQ(res->hits.size(), 5u);
  EXPECT_EQ(res->hits[0].id, 10u);  // both its text and its image match exactly
  EXPECT_EQ(res->hits[0].image_distance, 0.0f);
  for (size_t i = 1; i < res->hits.size(); ++i) EXPECT_LE(res->hits[i - 1].image_distance, res->hits[i].image_distance);
  for (const auto& h : res->hits) EXPECT_EQ(h.image, MakeItem(h.id).image);
  // One log record for the query: 20 rerank text keys plus the top 5's image keys.
  ASSERT_EQ(shard->query_log().size(), log_before + 1);
  auto window = shard->query_log().Snapshot();
  const auto& keys = window.back();
  EXPECT_EQ(keys.size(), 25u);
  int images = 0;
  for (uint64_t k : keys) images += coloc::ModalityOf(k) == coloc::Modality::kImage;
  EXPECT_EQ(images, 5);

  SearchRequest look;
  look.kind = QueryKind::kImage;
  look.ids = {7, 5000, 999999, 3};
  auto got = shard->Search(look);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->hits.size(), 2u);  // 5000 has no image, 999999 does not exist
  EXPECT_EQ(got->hits[0].id, 7u);
  EXPECT_EQ(got->hits[0].image, MakeItem(7).image);
  EXPECT_EQ(got->hits[1].id, 3u);
  EXPECT_EQ(shard->Stats().searches, 2);
}

TEST(ShardTest, SameResultsWhereverTheVectorsLive) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  o.tiers.ssd_dir = dir.path() + "/ssd";
  auto shard = OpenShard(o);
  Load(*shard, 0, 3000, 1000);
  auto& store = shard->store();
  ASSERT_EQ(store.tier_count(), 2);
  auto run = [&] {
    std::vector<SearchResult> out;
    for (int q = 0; q < 40; ++q) {
      SearchRequest r = TextQuery(q);
      r.kind = QueryKind::kMultimodal;
      r.image_query = MakeItem(q).image;
      r.include_vectors = true;
      out.push_back(*shard->Search(r));
    }
    return out;
  };
  auto same = [](const std::vector<SearchResult>& a, const std::vector<SearchResult>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t q = 0; q < a.size(); ++q) {
      ASSERT_EQ(a[q].hits.size(), b[q].hits.size());
      for (size_t i = 0; i < a[q].hits.size(); ++i) {
        EXPECT_EQ(a[q].hits[i].id, b[q].hits[i].id);
        EXPECT_EQ(a[q].hits[i].text_distance, b[q].hits[i].text_distance);
        EXPECT_EQ(a[q].hits[i].image_distance, b[q].hits[i].image_distance);
        EXPECT_EQ(a[q].hits[i].text, b[q].hits[i].text);
        EXPECT_EQ(a[q].hits[i].image, b[q].hits[i].image);
      }
    }
  };
  auto in_dram = run();
  for (const auto& r : in_dram) EXPECT_EQ(r.trace.tiers_touched, 1);
  EXPECT_EQ(shard->Stats().cross_tier_searches, 0);

  for (const auto& [key, tier] : store.Locations()) ASSERT_TRUE(store.Move(key, 1).ok());
  auto in_ssd = run();
  same(in_dram, in_ssd);
  for (const auto& r : in_ssd) EXPECT_EQ(r.trace.tier_mask, 2u);

  // Images back in DRAM, texts on SSD: every query now reads both tiers.
  for (const auto& [key, tier] : store.Locations()) {
    if (coloc::ModalityOf(key) == coloc::Modality::kImage) {
      ASSERT_TRUE(store.Move(key, 0).ok());
    }
  }
  auto split = run();
  same(in_dram, split);
  for (const auto& r : split) EXPECT_EQ(r.trace.tiers_touched, 2);
  EXPECT_EQ(shard->Stats().cross_tier_searches, 40);
}

TEST(ShardTest, AFullTierRejectsTheBatchAndTheShardStillReopens) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  o.tiers.dram_bytes = 4096;  // four items of 128+128 floats
  {
    auto shard = OpenShard(o);
    Load(*shard, 0, 3, 3);
    std::vector<Item> more;
    for (int64_t i = 3; i < 8; ++i) more.push_back(MakeItem(i));
    Status s = shard->Upsert(more);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
    EXPECT_EQ(shard->Stats().items, 3);
    SearchRequest look;
    look.kind = QueryKind::kImage;
    look.ids = {0, 1, 2, 3};
    EXPECT_EQ(shard->Search(look)->hits.size(), 3u);
  }
  auto shard = OpenShard(o);  // the refused batch is not in the log
  ASSERT_TRUE(shard);
  EXPECT_EQ(shard->Stats().items, 3);
}

TEST(ShardTest, ARefusedBatchLeavesReplacedItemsVectorsAsTheyWere) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  o.tiers.dram_bytes = 4096;  // four items of 128+128 floats
  auto shard = OpenShard(o);
  Load(*shard, 0, 3, 3);
  // Item 0 replaced with new vectors and an image-less item 1, then a new item that does not fit:
  // the batch is refused, so items 0 and 1 must keep their old bytes.
  std::vector<Item> batch = {MakeItem(100), MakeItem(101), MakeItem(3), MakeItem(4), MakeItem(5)};
  batch[0].id = 0;
  batch[1].id = 1;
  batch[1].image.clear();
  Status s = shard->Upsert(batch);
  ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  for (uint64_t id : {0, 1}) {
    SearchRequest look;
    look.kind = QueryKind::kImage;
    look.ids = {id};
    look.include_vectors = true;
    auto r = shard->Search(look);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->hits.size(), 1u);
    EXPECT_EQ(r->hits[0].image, MakeItem(static_cast<int64_t>(id)).image) << id;
    // A text search finds the item by its old vector at distance 0 (rerank reads the tier).
    SearchRequest by_text;
    by_text.text_query = MakeItem(static_cast<int64_t>(id)).text;
    by_text.k = 1;
    by_text.include_vectors = true;
    auto t = shard->Search(by_text);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_EQ(t->hits.size(), 1u);
    EXPECT_EQ(t->hits[0].id, id);
    EXPECT_EQ(t->hits[0].text_distance, 0.0f);
    EXPECT_EQ(t->hits[0].text, MakeItem(static_cast<int64_t>(id)).text) << id;
  }
}

TEST(ShardTest, ALogWithoutItsSnapshotOrWithOtherDimsIsRefusedNotReplayedWrong) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  {
    auto shard = OpenShard(o);
    Load(*shard, 0, 100, 50);
    ASSERT_TRUE(shard->Snapshot().ok());
    Load(*shard, 100, 130, 10);  // logged under the snapshot's epoch
  }
  const std::string snap = o.dir + "/shard.snap", wal = o.dir + "/wal.log";
  // Snapshot gone: the log's records are of a newer epoch than "no snapshot" (they were
  // skipped as stale, and the next snapshot emptied the log: 30 acknowledged writes lost).
  std::filesystem::rename(snap, snap + ".away");
  auto no_snap = Shard::Open(o);
  ASSERT_FALSE(no_snap.ok());
  EXPECT_EQ(no_snap.status().code(), StatusCode::kCorruption);
  EXPECT_NE(no_snap.status().message().find("newer than the snapshot"), std::string::npos)
      << no_snap.status().message();
  std::filesystem::rename(snap + ".away", snap);
  // Log gone beside the snapshot: refused with the way out named.
  std::filesystem::rename(wal, wal + ".away");
  auto no_log = Shard::Open(o);
  ASSERT_FALSE(no_log.ok());
  EXPECT_NE(no_log.status().message().find("create an empty"), std::string::npos) << no_log.status().message();
  std::filesystem::rename(wal + ".away", wal);
  {
    auto shard = OpenShard(o);
    ASSERT_TRUE(shard);
    EXPECT_EQ(shard->Stats().items, 130);
  }
  // Right after a snapshot the log is empty but for its epoch marker: a lost snapshot is still
  // caught there (it started empty, and the next snapshot wrote the emptiness over the data).
  {
    auto shard = OpenShard(o);
    ASSERT_TRUE(shard);
    ASSERT_TRUE(shard->Snapshot().ok());
  }
  std::filesystem::copy_file(snap, snap + ".older");
  {
    auto shard = OpenShard(o);
    ASSERT_TRUE(shard);
    ASSERT_TRUE(shard->Snapshot().ok());  // the next epoch; its log is empty but for the marker
  }
  std::filesystem::remove(snap);
  auto lost = Shard::Open(o);
  ASSERT_FALSE(lost.ok());
  EXPECT_NE(lost.status().message().find("newer than the snapshot"), std::string::npos) << lost.status().message();
  std::filesystem::rename(snap + ".older", snap);
  auto older = Shard::Open(o);
  ASSERT_FALSE(older.ok());
  EXPECT_NE(older.status().message().find("newer than the snapshot"), std::string::npos) << older.status().message();

  // A log with no snapshot yet, reopened with another text dim: the 128-float records would be
  // read as 256-float vectors.
  TempDir dir2("keel-shard");
  ShardOptions o2 = Options(dir2.path());
  {
    auto shard = OpenShard(o2);
    Load(*shard, 0, 10, 10);
  }
  o2.text_dim = 256;
  auto wide = Shard::Open(o2);
  ASSERT_FALSE(wide.ok());
  EXPECT_EQ(wide.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wide.status().message().find("wal.log"), std::string::npos) << wide.status().message();
  EXPECT_NE(wide.status().message().find("text"), std::string::npos) << wide.status().message();
}

TEST(ShardTest, ASecondShardOnTheSameDirectoryIsRefused) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  auto first = OpenShard(o);
  ASSERT_TRUE(first);
  auto second = Shard::Open(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status().message();
  first.reset();  // the lock goes with its owner
  EXPECT_TRUE(OpenShard(o));
}

TEST(ShardTest, PlacerRoundsNeverChangeResults) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  o.tiers.dram_bytes = 1 << 20;  // a third of the vectors
  o.tiers.ssd_dir = dir.path() + "/ssd";
  o.tiers.ssd_bytes = 0;
  o.wal_sync = false;
  auto shard = OpenShard(o);
  Load(*shard, 0, 1500, 500);
  auto run = [&] {
    std::vector<std::vector<uint64_t>> out;
    for (int q = 0; q < 300; ++q) {
      SearchRequest r = TextQuery(q % 60);
      r.kind = QueryKind::kMultimodal;
      r.image_query = MakeItem(q % 60).image;
      auto res = shard->Search(r);
      EXPECT_TRUE(res.ok()) << res.status().ToString();
      out.push_back(Ids(*res));
    }
    return out;
  };
  const auto before = run();
  for (auto policy : {coloc::PlacementPolicy::kCoLoc, coloc::PlacementPolicy::kFrequency}) {
    coloc::PlacerOptions po;
    po.policy = policy;
    po.min_new_queries = 0;
    coloc::Placer placer(&shard->store(), &shard->query_log(), po);
    auto moved = placer.RunOnce();
    ASSERT_TRUE(moved.ok()) << moved.status().ToString();
    const int64_t cross0 = shard->Stats().cross_tier_searches;
    EXPECT_EQ(run(), before) << coloc::PlacementPolicyName(policy);
    std::printf("%s: %llu keys moved; %lld of 300 searches cross-tier afterwards\n",
                std::string(coloc::PlacementPolicyName(policy)).c_str(), static_cast<unsigned long long>(*moved),
                static_cast<long long>(shard->Stats().cross_tier_searches - cross0));
  }
}

TEST(ShardTest, SearchesRunWhileWritesAndDeletesHappen) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path());
  o.wal_sync = false;
  auto shard = OpenShard(o);
  Load(*shard, 0, 2000, 1000);
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0}, done{0};
  std::thread reader([&] {
    while (!stop) {
      auto r = shard->Search(TextQuery(done % 100));
      if (!r.ok()) ++errors;
      ++done;
    }
  });
  for (int64_t b = 2000; b < 6000; b += 500) {
    Load(*shard, b, b + 500, 500);
    std::vector<uint64_t> del;
    for (int64_t i = b - 2000; i < b - 1500; ++i) del.push_back(i);
    ASSERT_TRUE(shard->Delete(del).ok());
  }
  stop = true;
  reader.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_GT(done.load(), 0);
  EXPECT_EQ(shard->Stats().items, 2000);
}

// IVF training runs outside the shard's lock (searches go on over the exact buffer): searches
// racing the upsert that crosses the training size all succeed, and each finds its own vector
// first (SIFT query q is base vector q, distance 0) before, during and after training.
TEST(ShardTest, SearchesRaceTheUpsertThatTrainsAnIvfIndex) {
  TempDir dir("keel-shard");
  ShardOptions o = Options(dir.path(), IndexKind::kIvfFlat);  // 100 lists: trains at 3,900 items
  o.wal_sync = false;
  auto shard = OpenShard(o);
  Load(*shard, 0, 3000, 1000);
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0}, wrong{0}, done{0};
  std::thread reader([&] {
    while (!stop) {
      const int64_t q = done % 100;
      auto r = shard->Search(TextQuery(q, 1));
      if (!r.ok()) {
        ++errors;
      } else if (r->hits.empty() || r->hits[0].id != static_cast<uint64_t>(q)) {
        ++wrong;
      }
      ++done;
    }
  });
  Load(*shard, 3000, 10000, 1000);
  stop = true;
  reader.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(done.load(), 0);
  EXPECT_EQ(shard->Stats().items, 10000);
  EXPECT_GE(ShardRecall(*shard), 0.9);
}

// The bulk path at scale: KEEL_BULK_ITEMS (default 1,000,000) random 128+128-float items into an
// IVF-Flat shard in batches of 10,000, one fsync per batch. Disabled by default (minutes, GiBs);
// run with --gtest_also_run_disabled_tests --gtest_filter='*BulkLoad*'.
TEST(ShardTest, DISABLED_BulkLoadIvfFlat) {
  const char* env = std::getenv("KEEL_BULK_ITEMS");
  const int64_t n = env != nullptr ? std::atoll(env) : 1000000;
  if (std::getenv("KEEL_NO_BLAS")) faiss::distance_compute_blas_threshold = 1 << 30;
  TempDir dir("keel-bulk");
  ShardOptions o = Options(dir.path(), IndexKind::kIvfFlat);
  o.index.ivf_lists = 1024;
  o.tiers.dram_bytes = 0;  // the only tier: unbounded
  auto shard = OpenShard(o);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<Item> batch(10000);
  double load_s = 0;
  for (int64_t b = 0; b < n; b += 10000) {
    for (int64_t i = 0; i < 10000; ++i) {
      Item& it = batch[i];
      it.id = static_cast<uint64_t>(b + i);
      it.text.resize(128);
      it.image.resize(128);
      for (auto& x : it.text) x = u(rng);
      for (auto& x : it.image) x = u(rng);
    }
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(shard->Upsert(batch).ok());
    load_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::printf("bulk load: %lld items (IVF-Flat, 1024 lists) in %.1f s = %.0f items/s\n", static_cast<long long>(n), load_s,
              n / load_s);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(shard->Snapshot().ok());
  std::printf("snapshot: %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  SearchRequest r;
  r.text_query = batch[17].text;
  auto res = shard->Search(r);
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(res->hits[0].id, batch[17].id);
}

}  // namespace
}  // namespace keel::vector
