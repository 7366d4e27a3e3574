// Compaction: full zipfusion blocks move to their stored size, so the same budget holds more
// tokens; attention over moved blocks is unchanged bit for bit; chunk values fetched from a KV
// store are validated before a single byte is adopted.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"
#include "test_util.h"

namespace keel::engine {
namespace {

class KvCacheCompactTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::make_unique<Model>(std::move(m).value());
  }
  std::unique_ptr<KvCache> Cache(const std::string& codec, size_t budget = 1 << 20, bool sharing = true) {
    KvCacheOptions o;
    o.budget_bytes = budget;
    o.prefix_sharing = sharing;
    auto c = KvCache::Create(*model_, codec, o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(c).value();
  }
  static std::vector<int> Prompt(int n, int salt = 0) {
    std::vector<int> t(n);
    for (int i = 0; i < n; ++i) t[i] = 3 + (i * 37 + salt * 101) % 500;
    t[0] = 1;
    return t;
  }
  // Prefill of tokens [from, size) as one batch; logits of the last position.
  std::vector<float> Run(Transformer& tf, KvCache& cache, SeqId seq, const std::vector<int>& tokens, int from) {
    std::vector<BatchToken> batch;
    for (int p = from; p < static_cast<int>(tokens.size()); ++p)
      batch.push_back({seq, tokens[p], p, p + 1 == static_cast<int>(tokens.size())});
    std::vector<float> logits;
    EXPECT_TRUE(tf.Forward(batch, cache, logits).ok());
    cache.Commit(seq, tokens.data() + from, static_cast<int>(tokens.size()) - from);
    return logits;
  }
  std::unique_ptr<Model> model_;
};

TEST_F(KvCacheCompactTest, FullBlocksCompactAndDecodeStaysBitIdenticalToRawBf16) {
  Transformer tf(*model_);
  auto zf = Cache("zipfusion");
  auto raw = Cache("raw:bf16");
  std::vector<int> tokens = Prompt(40);
  for (KvCache* c : {zf.get(), raw.get()}) {
    ASSERT_TRUE(c->BeginSequence(1, tokens).ok());
    ASSERT_TRUE(c->Reserve(1, 40).ok());
  }
  std::vector<float> a = Run(tf, *zf, 1, tokens, 0), b = Run(tf, *raw, 1, tokens, 0);
  ASSERT_EQ(a, b);
  EXPECT_EQ(zf->Stats().blocks_compacted, 2);  // 40 tokens: two full blocks of 16
  EXPECT_EQ(raw->Stats().blocks_compacted, 0);
  // Decode across two more block boundaries (48, 64): each step reads the moved blocks.
  for (int p = 40; p < 70; ++p) {
    const int next = 3 + (p * 53) % 500;
    tokens.push_back(next);
    for (KvCache* c : {zf.get(), raw.get()}) ASSERT_TRUE(c->Reserve(1, p + 1).ok());
    a = Run(tf, *zf, 1, tokens, p);
    b = Run(tf, *raw, 1, tokens, p);
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "position " << p;
  }
  const KvCacheStats st = zf->Stats();
  EXPECT_EQ(st.blocks_compacted, 4);
  EXPECT_EQ(st.blocks_used, 5);
  // Four compact blocks and one open one take less than five open ones.
  const int64_t open_block = st.bytes_total / st.blocks_total;
  EXPECT_LT(st.bytes_used, 4 * open_block * 85 / 100 + open_block) << st.bytes_used;
  zf->Release(1);
  EXPECT_EQ(zf->Stats().blocks_compacted, 4);  // cached (registered) blocks keep their form
  EXPECT_EQ(zf->Stats().blocks_used, 0);
}

// Sequences of real model K/V until the budget is spent: zipfusion holds more of them.
TEST_F(KvCacheCompactTest, CompactionTurnsCompressionIntoCapacity) {
  Transformer tf(*model_);
  auto count = [&](const std::string& codec) {
    auto c = Cache(codec, 1 << 20, /*sharing=*/false);
    int n = 0;
    for (;; ++n) {
      const std::vector<int> p = Prompt(64, n);
      EXPECT_TRUE(c->BeginSequence(n, p).ok());
      if (!c->Reserve(n, 64).ok()) break;
      Run(tf, *c, n, p, 0);
    }
    return n;
  };
  const int raw = count("raw:bf16"), zf = count("zipfusion");
  std::printf("[ capacity ] 1 MiB, 64-token sequences: raw:bf16 %d, zipfusion %d (%.2fx)\n", raw, zf,
              static_cast<double>(zf) / raw);
  EXPECT_GT(raw, 10);
  EXPECT_GE(zf * 100, raw * 120);
}

TEST_F(KvCacheCompactTest, FetchedChunksAreValidatedBeforeAdoption) {
  Transformer tf(*model_);
  auto src = Cache("zipfusion");
  const std::vector<int> prompt = Prompt(49);  // three full chunks + the token to compute
  ASSERT_TRUE(src->BeginSequence(1, prompt).ok());
  ASSERT_TRUE(src->Reserve(1, 49).ok());
  const std::vector<float> want = Run(tf, *src, 1, prompt, 0);
  auto pinned = src->PinChunks(1, 0, 3);
  ASSERT_EQ(pinned.size(), 3u);
  std::vector<std::string> values;
  for (const auto& [key, block] : pinned) {
    std::string v;
    for (const auto& [data, size] : src->ChunkPieces(block)) v.append(reinterpret_cast<const char*>(data), size);
    EXPECT_LT(v.size(), src->ChunkValueBytes());  // compact
    EXPECT_EQ(v.size() % 16, 0u);
    values.push_back(v);
  }
  for (const auto& [key, block] : pinned) src->Unpin(block);

  auto adopt = [&](KvCache& dst, const std::vector<std::string>& vals) {
    std::vector<std::string_view> views(vals.begin(), vals.end());
    return dst.AdoptChunks(7, prompt, 0, views);
  };
  // Hostile values: every one is refused with nothing adopted.
  struct Bad {
    const char* what;
    std::function<void(std::string&)> mutate;
  };
  const Bad bads[] = {
      {"truncated", [](std::string& v) { v.resize(v.size() - 16); }},
      {"empty", [](std::string& v) { v.clear(); }},
      {"oversized", [&](std::string& v) { v.resize(src->ChunkValueBytes() + 16); }},
      {"directory points past the end", [](std::string& v) { const uint32_t off = 1u << 30; std::memcpy(&v[4], &off, 4); }},
      {"directory misaligned", [](std::string& v) { uint32_t off; std::memcpy(&off, &v[0], 4); off += 1; std::memcpy(&v[0], &off, 4); }},
      {"region width 9", [](std::string& v) { uint32_t off; std::memcpy(&off, &v[0], 4); v[off + 2] = 9; }},
      {"region state byte", [](std::string& v) { uint32_t off; std::memcpy(&off, &v[0], 4); v[off] = 0x33; }},
      {"extra bytes", [](std::string& v) { v.append(16, '\0'); }},
  };
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.what);
    auto dst = Cache("zipfusion");
    ASSERT_TRUE(dst->BeginSequence(7, prompt).ok());
    std::vector<std::string> vals = values;
    bad.mutate(vals[1]);
    Result<int> got = adopt(*dst, vals);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find("chunk 1"), std::string::npos) << got.status().ToString();
    EXPECT_EQ(dst->Capacity(7), 0);
    EXPECT_EQ(dst->SequenceLength(7), 0);
    EXPECT_EQ(dst->Stats().blocks_used, 0);
  }
  // A raw cache's chunks do not pass as zipfusion ones.
  {
    auto dst = Cache("zipfusion");
    ASSERT_TRUE(dst->BeginSequence(7, prompt).ok());
    std::vector<std::string> raw_like(3, std::string(values[0].size(), '\0'));
    EXPECT_FALSE(adopt(*dst, raw_like).ok());
  }
  // The real values: adopted, and the last token computed over them equals the source's logits.
  auto dst = Cache("zipfusion");
  ASSERT_TRUE(dst->BeginSequence(7, prompt).ok());
  Result<int> got = adopt(*dst, values);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, 48);
  EXPECT_EQ(dst->Stats().blocks_compacted, 3);
  ASSERT_TRUE(dst->Reserve(7, 49).ok());
  const std::vector<float> logits = Run(tf, *dst, 7, prompt, 48);
  ASSERT_EQ(0, std::memcmp(logits.data(), want.data(), want.size() * sizeof(float)));
}

}  // namespace
}  // namespace keel::engine
