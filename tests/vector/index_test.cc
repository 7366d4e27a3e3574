#include "keel/vector/index.h"

#include <gtest/gtest.h>

#include <cstdio>

#include "tests/vector/sift_data.h"

namespace keel::vector {
namespace {

using test::LoadSift;
using test::RecallAt10;

std::unique_ptr<TextIndex> Build(const IndexOptions& o, int64_t n = -1) {
  const auto& s = LoadSift();
  auto ix = TextIndex::Create(o, s.dim());
  EXPECT_TRUE(ix.ok()) << ix.status().ToString();
  if (n < 0) n = s.base.count;
  EXPECT_TRUE((*ix)->Add(s.row(0), n).ok());
  return std::move(*ix);
}

// Mean recall@10 over the 100 queries, taking the first 10 of `k` results.
double MeanRecall(const TextIndex& ix, IndexSearchParams p) {
  const auto& s = LoadSift();
  double sum = 0;
  for (int q = 0; q < 100; ++q) {
    auto hits = ix.Search(s.row(q), p);
    EXPECT_TRUE(hits.ok()) << hits.status().ToString();
    std::vector<int64_t> got;
    for (const auto& h : *hits) {
      if (got.size() < 10) got.push_back(h.label);
    }
    sum += RecallAt10(s, q, got);
  }
  return sum / 100;
}

// Fraction of the true top 10 among the first `k` candidates (what a reranking shard can reach).
double CandidateRecall(const TextIndex& ix, int k) {
  const auto& s = LoadSift();
  double sum = 0;
  IndexSearchParams p;
  p.k = k;
  for (int q = 0; q < 100; ++q) {
    auto hits = ix.Search(s.row(q), p);
    std::vector<int64_t> got;
    for (const auto& h : *hits) got.push_back(h.label);
    sum += RecallAt10(s, q, got);
  }
  return sum / 100;
}

TEST(TextIndexTest, SiftDataLoads) {
  const auto& s = LoadSift();
  ASSERT_EQ(s.base.count, 10000);
  ASSERT_EQ(s.dim(), 128);
  ASSERT_EQ(s.truth.count, 100);
  EXPECT_EQ(s.truth.values[0], 0);  // query i is base i
}

TEST(TextIndexTest, HnswRecall) {
  auto ix = Build(IndexOptions{});
  IndexSearchParams p;
  p.k = 10;
  const double r = MeanRecall(*ix, p);
  std::printf("HNSW (M 32, ef 64) recall@10 = %.3f\n", r);
  EXPECT_GE(r, 0.9);
  p.ef = 256;
  const double r2 = MeanRecall(*ix, p);
  std::printf("HNSW (M 32, ef 256) recall@10 = %.3f\n", r2);
  EXPECT_GE(r2, r - 0.01);
}

TEST(TextIndexTest, IvfFlatRecall) {
  IndexOptions o;
  o.kind = IndexKind::kIvfFlat;
  o.ivf_lists = 100;
  auto ix = Build(o);
  ASSERT_TRUE(ix->trained());
  EXPECT_EQ(ix->lists(), 100);
  IndexSearchParams p;
  p.k = 10;
  p.nprobe = 16;
  const double r = MeanRecall(*ix, p);
  std::printf("IVF-Flat (100 lists, nprobe 16) recall@10 = %.3f\n", r);
  EXPECT_GE(r, 0.9);
  p.nprobe = 100;  // every list: exact
  EXPECT_GE(MeanRecall(*ix, p), 0.999);
}

TEST(TextIndexTest, IvfPqRecallWithRerankCandidates) {
  IndexOptions o;
  o.kind = IndexKind::kIvfPq;
  o.ivf_lists = 64;
  o.pq_m = 16;
  auto ix = Build(o);
  ASSERT_TRUE(ix->trained());
  IndexSearchParams p;
  p.k = 10;
  p.nprobe = 16;
  const double raw = MeanRecall(*ix, p);
  const double cand = CandidateRecall(*ix, 100);
  std::printf("IVF-PQ (64 lists, PQ16x8, nprobe 16) recall@10 = %.3f; true top-10 among 100 candidates = %.3f\n", raw, cand);
  EXPECT_GE(raw, 0.3);
  EXPECT_GE(cand, 0.85);
}

TEST(TextIndexTest, UntrainedIvfSearchesExactly) {
  IndexOptions o;
  o.kind = IndexKind::kIvfFlat;
  o.ivf_lists = 1024;
  auto ix = Build(o, 500);
  EXPECT_FALSE(ix->trained());
  EXPECT_EQ(ix->TrainSize(), 39 * 1024);
  const auto& s = LoadSift();
  IndexSearchParams p;
  p.k = 5;
  auto hits = ix->Search(s.row(7), p);
  ASSERT_TRUE(hits.ok());
  ASSERT_EQ(hits->size(), 5u);
  EXPECT_EQ((*hits)[0].label, 7);
  EXPECT_EQ((*hits)[0].distance, 0.0f);
}

TEST(TextIndexTest, TombstonesAndFiltersAreNeverReturned) {
  for (IndexKind kind : {IndexKind::kHnsw, IndexKind::kIvfFlat}) {
    IndexOptions o;
    o.kind = kind;
    o.ivf_lists = 50;
    auto ix = Build(o, 5000);
    const auto& s = LoadSift();
    for (int64_t l = 0; l < 5000; l += 3) ix->Tombstone(l);
    EXPECT_EQ(ix->tombstones(), 1667);
    std::function<bool(int64_t)> even = [](int64_t l) { return l % 2 == 0; };
    IndexSearchParams p;
    p.k = 20;
    p.accept = &even;
    for (int q = 0; q < 30; ++q) {
      auto hits = ix->Search(s.row(q), p);
      ASSERT_TRUE(hits.ok());
      EXPECT_FALSE(hits->empty());
      for (const auto& h : *hits) {
        EXPECT_NE(h.label % 3, 0) << IndexKindName(kind);
        EXPECT_EQ(h.label % 2, 0) << IndexKindName(kind);
      }
    }
  }
}

TEST(TextIndexTest, SaveLoadGivesIdenticalResults) {
  for (IndexKind kind : {IndexKind::kHnsw, IndexKind::kIvfFlat, IndexKind::kIvfPq}) {
    IndexOptions o;
    o.kind = kind;
    o.ivf_lists = 40;
    auto ix = Build(o);
    ix->Tombstone(3);
    auto bytes = ix->Save();
    ASSERT_TRUE(bytes.ok());
    auto back = TextIndex::Load(o, 128, *bytes);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ((*back)->size(), ix->size());
    EXPECT_EQ((*back)->tombstones(), 1);
    const auto& s = LoadSift();
    IndexSearchParams p;
    p.k = 10;
    for (int q = 0; q < 20; ++q) {
      auto a = ix->Search(s.row(q), p);
      auto b = (*back)->Search(s.row(q), p);
      ASSERT_EQ(a->size(), b->size());
      for (size_t i = 0; i < a->size(); ++i) {
        EXPECT_EQ((*a)[i].label, (*b)[i].label);
        EXPECT_EQ((*a)[i].distance, (*b)[i].distance);
      }
    }
    // Damaged bytes are Corruption, never a crash.
    std::string cut = bytes->substr(0, bytes->size() / 2);
    auto bad = TextIndex::Load(o, 128, cut);
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  }
}

TEST(TextIndexTest, BadOptionsAreInvalidArgument) {
  IndexOptions o;
  o.kind = IndexKind::kIvfPq;
  o.pq_m = 7;
  auto ix = TextIndex::Create(o, 128);
  ASSERT_FALSE(ix.ok());
  EXPECT_EQ(ix.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(TextIndex::Create(IndexOptions{}, 0).ok());
  EXPECT_FALSE(ParseIndexKind("lsh").ok());
  EXPECT_EQ(*ParseIndexKind("ivf-pq"), IndexKind::kIvfPq);
}

}  // namespace
}  // namespace keel::vector
