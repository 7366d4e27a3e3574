#include "keel/engine/kv_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <cstring>
#include <numeric>

#include "keel/engine/transformer.h"
#include "test_util.h"

namespace keel::engine {
namespace {

class KvCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::make_unique<Model>(std::move(m).value());
  }
  std::unique_ptr<KvCache> Cache(size_t budget = 1 << 20, const std::string& codec = "raw", bool sharing = true) {
    KvCacheOptions o;
    o.budget_bytes = budget;
    o.prefix_sharing = sharing;
    auto c = KvCache::Create(*model_, codec, o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(c).value();
  }
  // Runs `tokens` through the model as one batch and returns the logits of the last position.
  std::vector<float> LastLogits(Transformer& tf, KvCache& cache, SeqId seq, const std::vector<int>& tokens, int from) {
    std::vector<BatchToken> batch;
    for (int p = from; p < static_cast<int>(tokens.size()); ++p)
      batch.push_back({seq, tokens[p], p, p + 1 == static_cast<int>(tokens.size())});
    std::vector<float> logits;
    EXPECT_TRUE(tf.Forward(batch, cache, logits).ok());
    cache.Commit(seq, tokens.data() + from, static_cast<int>(tokens.size()) - from);
    return logits;
  }
  static std::vector<int> Prompt(int n, int salt = 0) {
    std::vector<int> t(n);
    for (int i = 0; i < n; ++i) t[i] = 3 + (i * 37 + salt * 101) % 500;
    t[0] = 1;
    return t;
  }
  std::unique_ptr<Model> model_;
};

TEST_F(KvCacheTest, BlockSizeAndBudget) {
  auto c = Cache(1 << 20);
  // raw f32: 16 tokens * (K + V) * 64 floats * 4 bytes * 4 layers = 32 KiB per block
  EXPECT_EQ(c->codec().block_bytes(0), 16u * 2 * 64 * 4);
  EXPECT_EQ(c->Stats().blocks_total, 32);
  auto small = KvCache::Create(*model_, "raw", KvCacheOptions{100, 16, true});
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), StatusCode::kResourceExhausted);
  auto bad = KvCache::Create(*model_, "zip:nope", KvCacheOptions{});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("raw:bf16"), std::string::npos);
}

TEST_F(KvCacheTest, EqualPrefixesShareBlocksAndGiveIdenticalLogits) {
  auto c = Cache();
  Transformer tf(*model_);
  std::vector<int> prompt = Prompt(40);
  auto r1 = c->BeginSequence(1, prompt);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(*r1, 0);
  ASSERT_TRUE(c->Reserve(1, 40).ok());
  std::vector<float> first = LastLogits(tf, *c, 1, prompt, 0);
  EXPECT_EQ(c->Stats().blocks_used, 3);

  // Same prompt: the two full chunks (32 tokens) come from sequence 1's blocks.
  auto r2 = c->BeginSequence(2, prompt);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(*r2, 32);
  ASSERT_TRUE(c->Reserve(2, 40).ok());
  EXPECT_EQ(c->Stats().blocks_used, 4);  // 2 shared + 1 private each
  std::vector<float> second = LastLogits(tf, *c, 2, prompt, 32);
  ASSERT_EQ(first.size(), second.size());
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * sizeof(float)));

  // Released prefixes stay findable until the space is needed.
  c->Release(1);
  c->Release(2);
  EXPECT_EQ(c->Stats().blocks_used, 0);
  EXPECT_EQ(c->Stats().blocks_cached, 2);
  auto r3 = c->BeginSequence(3, prompt);
  ASSERT_TRUE(r3.ok());
  EXPECT_EQ(*r3, 32);
  EXPECT_EQ(c->Stats().prefix_hit_tokens, 64);
}

TEST_F(KvCacheTest, AtLeastOnePromptTokenIsAlwaysComputed) {
  auto c = Cache();
  Transformer tf(*model_);
  std::vector<int> prompt = Prompt(32);  // exactly two chunks
  ASSERT_TRUE(c->BeginSequence(1, prompt).ok());
  ASSERT_TRUE(c->Reserve(1, 32).ok());
  LastLogits(tf, *c, 1, prompt, 0);
  auto r = c->BeginSequence(2, prompt);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 16);  // the last chunk holds the final token, whose logits are needed
}

TEST_F(KvCacheTest, BudgetExhaustionIsAClearErrorAndCachedBlocksAreEvicted) {
  auto c = Cache(4 * 16 * 2 * 64 * 4 * 4);  // exactly 4 blocks
  Transformer tf(*model_);
  std::vector<int> a = Prompt(48);
  ASSERT_TRUE(c->BeginSequence(1, a).ok());
  ASSERT_TRUE(c->Reserve(1, 48).ok());
  LastLogits(tf, *c, 1, a, 0);
  std::vector<int> b = Prompt(20);
  b[1] = 11;  // shares nothing with `a`
  ASSERT_TRUE(c->BeginSequence(2, b).ok());
  Status st = c->Reserve(2, 20);  // needs 2 blocks, 1 left
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("budget"), std::string::npos) << st.ToString();
  c->Release(2);
  c->Release(1);  // 3 registered blocks become cached
  EXPECT_EQ(c->Stats().blocks_cached, 3);
  std::vector<int> other = Prompt(64);
  other[1] = 7;  // different first chunk
  ASSERT_TRUE(c->BeginSequence(3, other).ok());
  ASSERT_TRUE(c->Reserve(3, 64).ok());  // evicts all cached blocks
  EXPECT_EQ(c->Stats().blocks_cached, 0);
  auto r = c->BeginSequence(4, a);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 0);  // the old prefix is gone
}

TEST_F(KvCacheTest, ChunkKeysAreDeterministicAndCoverTheFingerprint) {
  auto c1 = Cache();
  auto c2 = Cache();
  auto c3 = Cache(1 << 20, "raw:bf16");
  std::vector<int> t = Prompt(50);
  auto k1 = c1->ChunkKeys(t.data(), 50);
  ASSERT_EQ(k1.size(), 3u);
  EXPECT_EQ(k1, c2->ChunkKeys(t.data(), 50));
  EXPECT_NE(k1, c3->ChunkKeys(t.data(), 50));
  // A chain: changing chunk 0 changes every later key.
  std::vector<int> u = t;
  u[3] = 99;
  auto k2 = c1->ChunkKeys(u.data(), 50);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(k1[i], k2[i]);
  // The documented recipe, recomputed independently: other instances (and the kvstore) rely on it.
  Hash128 fp = Xxh3_128(c1->fingerprint());
  Hasher128 h;
  h.update_pod(fp.lo);
  h.update_pod(fp.hi);
  for (int i = 0; i < 16; ++i) h.update_pod(static_cast<int32_t>(t[i]));
  h.update_pod(fp.lo);
  h.update_pod(fp.hi);
  EXPECT_EQ(k1[0], h.digest());
  EXPECT_NE(c1->fingerprint().find(model_->checksum.hex()), std::string::npos);
  EXPECT_NE(c1->fingerprint().find("raw:f32"), std::string::npos);
}

TEST_F(KvCacheTest, BatchedPrefillEqualsTokenByToken) {
  Transformer tf(*model_);
  std::vector<int> prompt = Prompt(20);
  auto ca = Cache();
  ASSERT_TRUE(ca->BeginSequence(1, prompt).ok());
  ASSERT_TRUE(ca->Reserve(1, 20).ok());
  std::vector<float> batched = LastLogits(tf, *ca, 1, prompt, 0);

  auto cb = Cache();
  ASSERT_TRUE(cb->BeginSequence(1, {}).ok());
  ASSERT_TRUE(cb->Reserve(1, 20).ok());
  std::vector<float> logits;
  for (int p = 0; p < 20; ++p) {
    ASSERT_TRUE(tf.Forward({{1, prompt[p], p, true}}, *cb, logits).ok());
    cb->Commit(1, &prompt[p], 1);
  }
  ASSERT_EQ(batched.size(), logits.size());
  EXPECT_EQ(0, std::memcmp(batched.data(), logits.data(), logits.size() * sizeof(float)));
}

TEST_F(KvCacheTest, ForwardRejectsBadInput) {
  Transformer tf(*model_);
  auto c = Cache();
  ASSERT_TRUE(c->BeginSequence(1, {}).ok());
  ASSERT_TRUE(c->Reserve(1, 16).ok());
  std::vector<float> logits;
  EXPECT_EQ(tf.Forward({{1, 600, 0, true}}, *c, logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tf.Forward({{1, -1, 0, true}}, *c, logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tf.Forward({{1, 5, 16, true}}, *c, logits).code(), StatusCode::kInvalidArgument);  // no block
  EXPECT_EQ(tf.Forward({{9, 5, 0, true}}, *c, logits).code(), StatusCode::kInvalidArgument);   // no sequence
  EXPECT_EQ(tf.Forward({{1, 5, 500, true}}, *c, logits).code(), StatusCode::kInvalidArgument); // past context
}

TEST_F(KvCacheTest, Bf16CodecStoresRoundedValuesAndAttendsClosely) {
  kv::KvShape shape{1, 2, 1, 8, 4};
  auto f32 = kv::MakeCodec("raw:f32", shape);
  auto bf = kv::MakeCodec("raw:bf16", shape);
  ASSERT_TRUE(f32.ok() && bf.ok());
  std::vector<uint8_t> b32((*f32)->block_bytes(0) * 2), b16((*bf)->block_bytes(0) * 2);
  const uint8_t* p32[2] = {b32.data(), b32.data() + (*f32)->block_bytes(0)};
  const uint8_t* p16[2] = {b16.data(), b16.data() + (*bf)->block_bytes(0)};
  for (int t = 0; t < 6; ++t) {
    float k[8], v[8];
    for (int i = 0; i < 8; ++i) {
      k[i] = std::sin(0.3f * (t * 8 + i));
      v[i] = std::cos(0.7f * (t * 8 + i));
    }
    (*f32)->append(0, const_cast<uint8_t*>(p32[t / 4]), t % 4, k, v);
    (*bf)->append(0, const_cast<uint8_t*>(p16[t / 4]), t % 4, k, v);
    float rk[8], rv[8];
    (*f32)->read(0, p32[t / 4], t % 4, rk, rv);
    EXPECT_EQ(0, std::memcmp(rk, k, sizeof(k)));
  }
  float q[16], o32[16], o16[16];
  for (int i = 0; i < 16; ++i) q[i] = 0.1f * i - 0.5f;
  kv::AttendScratch s;
  (*f32)->attend(0, p32, 6, q, o32, s);
  (*bf)->attend(0, p16, 6, q, o16, s);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(o32[i], o16[i], 2e-2f);
  // Query heads 0 and 1 share the single K/V head but see different scores.
  EXPECT_NE(0, std::memcmp(o32, o32 + 8, 8 * sizeof(float)));
}

// ---- Compaction: full zipfusion blocks move to their stored size, so the same budget holds
// more tokens; attention over moved blocks is unchanged bit for bit; chunk values fetched from a
// KV store are validated before a single byte is adopted.

TEST_F(KvCacheTest, FullBlocksCompactAndDecodeStaysBitIdenticalToRawBf16) {
  Transformer tf(*model_);
  auto zf = Cache(1 << 20, "zipfusion");
  auto raw = Cache(1 << 20, "raw:bf16");
  std::vector<int> tokens = Prompt(40);
  for (KvCache* c : {zf.get(), raw.get()}) {
    ASSERT_TRUE(c->BeginSequence(1, tokens).ok());
    ASSERT_TRUE(c->Reserve(1, 40).ok());
  }
  std::vector<float> a = LastLogits(tf, *zf, 1, tokens, 0), b = LastLogits(tf, *raw, 1, tokens, 0);
  ASSERT_EQ(a, b);
  EXPECT_EQ(zf->Stats().blocks_compacted, 2);  // 40 tokens: two full blocks of 16
  EXPECT_EQ(raw->Stats().blocks_compacted, 0);
  // Decode across two more block boundaries (48, 64): each step reads the moved blocks.
  for (int p = 40; p < 70; ++p) {
    const int next = 3 + (p * 53) % 500;
    tokens.push_back(next);
    for (KvCache* c : {zf.get(), raw.get()}) ASSERT_TRUE(c->Reserve(1, p + 1).ok());
    a = LastLogits(tf, *zf, 1, tokens, p);
    b = LastLogits(tf, *raw, 1, tokens, p);
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
TEST_F(KvCacheTest, CompactionTurnsCompressionIntoCapacity) {
  Transformer tf(*model_);
  auto count = [&](const std::string& codec) {
    auto c = Cache(1 << 20, codec, /*sharing=*/false);
    int n = 0;
    for (;; ++n) {
      const std::vector<int> p = Prompt(64, n);
      EXPECT_TRUE(c->BeginSequence(n, p).ok());
      if (!c->Reserve(n, 64).ok()) break;
      LastLogits(tf, *c, n, p, 0);
    }
    return n;
  };
  const int raw = count("raw:bf16"), zf = count("zipfusion");
  std::printf("[ capacity ] 1 MiB, 64-token sequences: raw:bf16 %d, zipfusion %d (%.2fx)\n", raw, zf,
              static_cast<double>(zf) / raw);
  EXPECT_GT(raw, 10);
  EXPECT_GE(zf * 100, raw * 120);
}

TEST_F(KvCacheTest, FetchedChunksAreValidatedBeforeAdoption) {
  Transformer tf(*model_);
  auto src = Cache(1 << 20, "zipfusion");
  const std::vector<int> prompt = Prompt(49);  // three full chunks + the token to compute
  ASSERT_TRUE(src->BeginSequence(1, prompt).ok());
  ASSERT_TRUE(src->Reserve(1, 49).ok());
  const std::vector<float> want = LastLogits(tf, *src, 1, prompt, 0);
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
    auto dst = Cache(1 << 20, "zipfusion");
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
    auto dst = Cache(1 << 20, "zipfusion");
    ASSERT_TRUE(dst->BeginSequence(7, prompt).ok());
    std::vector<std::string> raw_like(3, std::string(values[0].size(), '\0'));
    EXPECT_FALSE(adopt(*dst, raw_like).ok());
  }
  // The real values: adopted, and the last token computed over them equals the source's logits.
  auto dst = Cache(1 << 20, "zipfusion");
  ASSERT_TRUE(dst->BeginSequence(7, prompt).ok());
  Result<int> got = adopt(*dst, values);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, 48);
  EXPECT_EQ(dst->Stats().blocks_compacted, 3);
  ASSERT_TRUE(dst->Reserve(7, 49).ok());
  const std::vector<float> logits = LastLogits(tf, *dst, 7, prompt, 48);
  ASSERT_EQ(0, std::memcmp(logits.data(), want.data(), want.size() * sizeof(float)));
}

}  // namespace
}  // namespace keel::engine
