// The layer-group seam of the KV cache and forward pass (kv::Codec groups, store_group,
// attend_pending, LayerTrace), checked with a lossless test codec that stores a whole group's
// post-RoPE K/V at group end: its logits must equal raw:f32 bit for bit, and prefill must leave
// the same cache as decode.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"
#include "keel/kv/rope.h"
#include "test_util.h"

namespace keel::engine {
namespace {

// Stores K and V (fp32, post-RoPE) of every layer of a group, row-major per token:
// [block_tokens][layers_in(group)][K kv_dim, V kv_dim]. `empty_group` (>= 0): that group claims
// zero bytes (only for allocation checks; such a cache cannot run a forward pass).
class GroupRawCodec final : public kv::Codec {
 public:
  GroupRawCodec(const kv::KvShape& shape, int group_size, int empty_group = -1)
      : shape_(shape), group_size_(group_size), empty_group_(empty_group) {}
  std::string spec() const override { return "test-group-raw"; }
  std::string fingerprint() const override { return "test-group-raw:" + std::to_string(group_size_); }
  const kv::KvShape& shape() const override { return shape_; }
  int group_size() const override { return group_size_; }
  size_t block_bytes(int group) const override {
    if (group == empty_group_) return 0;
    return sizeof(float) * shape_.block_tokens * layers_in(group) * 2 * shape_.kv_dim();
  }
  bool stores_at_group_end() const override { return true; }
  void append(int, uint8_t*, int, const float*, const float*) const override { ADD_FAILURE() << "append called"; }
  void store_group(int group, uint8_t* block, int slot, const kv::TokenKv* layers) const override {
    ++stores;
    const int kvd = shape_.kv_dim();
    for (int i = 0; i < layers_in(group); ++i) {
      float* row = Row(block, group, slot, i);
      std::memcpy(row, layers[i].k, sizeof(float) * kvd);
      std::memcpy(row + kvd, layers[i].v, sizeof(float) * kvd);
      // The seam's promise: k is k_pre rotated at the token's position.
      std::vector<float> k(layers[i].k_pre, layers[i].k_pre + kvd);
      for (int h = 0; h < shape_.n_kv_heads; ++h)
        kv::RopeInterleaved(&k[h * shape_.head_dim], shape_.head_dim, layers[i].pos, shape_.rope_theta);
      if (std::memcmp(k.data(), layers[i].k, sizeof(float) * kvd) != 0) ++rope_mismatches;
    }
  }
  void read(int layer, const uint8_t* block, int slot, float* k, float* v) const override {
    const int g = group_of(layer), kvd = shape_.kv_dim();
    const float* row = Row(const_cast<uint8_t*>(block), g, slot, layer - first_layer(g));
    std::memcpy(k, row, sizeof(float) * kvd);
    std::memcpy(v, row + kvd, sizeof(float) * kvd);
  }
  void attend(int layer, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
              kv::AttendScratch& scratch) const override {
    attend_pending(layer, blocks, n_tokens, q, nullptr, nullptr, 0, out, scratch);
  }
  mutable std::atomic<int> stores{0};
  mutable std::atomic<int> rope_mismatches{0};

 private:
  float* Row(uint8_t* block, int group, int slot, int in_group) const {
    const size_t per_token = static_cast<size_t>(layers_in(group)) * 2 * shape_.kv_dim();
    return reinterpret_cast<float*>(block) + slot * per_token + static_cast<size_t>(in_group) * 2 * shape_.kv_dim();
  }
  kv::KvShape shape_;
  int group_size_;
  int empty_group_;
};

class LayerGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::make_unique<Model>(std::move(m).value());
  }
  kv::KvShape Shape() const {
    const ModelConfig& c = model_->config;
    kv::KvShape s{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), 16};
    s.dim = c.dim;
    s.rope_theta = c.rope_theta;
    return s;
  }
  std::unique_ptr<KvCache> GroupCache(int group_size, GroupRawCodec** codec_out = nullptr) {
    auto codec = std::make_unique<GroupRawCodec>(Shape(), group_size);
    if (codec_out) *codec_out = codec.get();
    KvCacheOptions o;
    o.budget_bytes = 4 << 20;
    o.prefix_sharing = false;
    auto c = KvCache::Create(*model_, std::move(codec), o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(c).value();
  }
  std::unique_ptr<KvCache> RawCache() {
    KvCacheOptions o;
    o.budget_bytes = 4 << 20;
    o.prefix_sharing = false;
    return std::move(KvCache::Create(*model_, "raw:f32", o)).value();
  }
  static std::vector<int> Prompt(int n, int salt = 0) {
    std::vector<int> t(n);
    for (int i = 0; i < n; ++i) t[i] = 3 + (i * 37 + salt * 101) % 500;
    t[0] = 1;
    return t;
  }
  // Prefill `prompt` in chunks of `chunk` tokens (logits for every row), then `decode` greedy
  // steps; returns all logits in order.
  std::vector<float> Run(KvCache& cache, SeqId seq, const std::vector<int>& prompt, int chunk, int decode) {
    Transformer tf(*model_);
    std::vector<float> all, logits;
    EXPECT_TRUE(cache.BeginSequence(seq, {}).ok());
    EXPECT_TRUE(cache.Reserve(seq, static_cast<int>(prompt.size()) + decode).ok());
    std::vector<int> tokens = prompt;
    for (int p = 0; p < static_cast<int>(prompt.size()); p += chunk) {
      std::vector<BatchToken> batch;
      for (int i = p; i < std::min<int>(p + chunk, prompt.size()); ++i) batch.push_back({seq, tokens[i], i, true});
      EXPECT_TRUE(tf.Forward(batch, cache, logits).ok());
      cache.Commit(seq, tokens.data() + p, static_cast<int>(batch.size()));
      all.insert(all.end(), logits.begin(), logits.end());
    }
    const int vocab = model_->config.vocab_size;
    for (int d = 0; d < decode; ++d) {
      const float* last = &all[all.size() - vocab];
      const int next = static_cast<int>(std::max_element(last, last + vocab) - last);
      tokens.push_back(next);
      const int pos = static_cast<int>(tokens.size()) - 1;
      EXPECT_TRUE(tf.Forward({{seq, next, pos, true}}, cache, logits).ok());
      cache.Commit(seq, &tokens[pos], 1);
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  }
  std::unique_ptr<Model> model_;
};

TEST_F(LayerGroupTest, LosslessGroupCodecEqualsRawBitForBit) {
  const std::vector<int> prompt = Prompt(37);
  auto raw = RawCache();
  const std::vector<float> want = Run(*raw, 1, prompt, 37, 12);
  for (int group_size : {1, 2, 3, 4}) {
    GroupRawCodec* codec = nullptr;
    auto cache = GroupCache(group_size, &codec);
    EXPECT_EQ(codec->n_groups(), (4 + group_size - 1) / group_size);
    const std::vector<float> got = Run(*cache, 1, prompt, 37, 12);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * got.size()), 0) << "group size " << group_size;
    EXPECT_EQ(codec->stores.load(), (37 + 12) * codec->n_groups());
    EXPECT_EQ(codec->rope_mismatches.load(), 0);
  }
}

TEST_F(LayerGroupTest, PrefillChunksAndDecodeLeaveTheSameCache) {
  const std::vector<int> prompt = Prompt(40, 3);
  auto a = GroupCache(3), b = GroupCache(3);
  const std::vector<float> la = Run(*a, 7, prompt, 40, 5);  // one prefill batch
  const std::vector<float> lb = Run(*b, 7, prompt, 1, 5);   // token by token
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), sizeof(float) * la.size()), 0);
  const int kvd = model_->config.kv_dim();
  std::vector<float> ka(kvd), va(kvd), kb(kvd), vb(kvd);
  for (int l = 0; l < model_->config.n_layers; ++l) {
    for (int pos = 0; pos < 45; ++pos) {
      int sa, sb;
      const uint8_t* ba = a->BlockFor(7, l, pos, &sa);
      const uint8_t* bb = b->BlockFor(7, l, pos, &sb);
      a->codec().read(l, ba, sa, ka.data(), va.data());
      b->codec().read(l, bb, sb, kb.data(), vb.data());
      ASSERT_EQ(std::memcmp(ka.data(), kb.data(), sizeof(float) * kvd), 0) << "layer " << l << " pos " << pos;
      ASSERT_EQ(std::memcmp(va.data(), vb.data(), sizeof(float) * kvd), 0) << "layer " << l << " pos " << pos;
    }
  }
}

TEST_F(LayerGroupTest, MixedBatchOfSequencesAtDifferentStepsMatchesSeparateRuns) {
  auto raw = RawCache();
  const std::vector<int> p1 = Prompt(20, 1), p2 = Prompt(9, 2);
  const std::vector<float> want1 = Run(*raw, 1, p1, 20, 0);
  const std::vector<float> want2 = Run(*raw, 2, p2, 9, 0);
  auto cache = GroupCache(2);
  ASSERT_TRUE(cache->BeginSequence(1, {}).ok());
  ASSERT_TRUE(cache->BeginSequence(2, {}).ok());
  ASSERT_TRUE(cache->Reserve(1, 20).ok());
  ASSERT_TRUE(cache->Reserve(2, 9).ok());
  // Interleaved rows of two sequences of different lengths in one batch.
  std::vector<BatchToken> batch;
  for (int i = 0; i < 20; ++i) {
    batch.push_back({1, p1[i], i, true});
    if (i < 9) batch.push_back({2, p2[i], i, true});
  }
  Transformer tf(*model_);
  std::vector<float> logits;
  ASSERT_TRUE(tf.Forward(batch, *cache, logits).ok());
  const int vocab = model_->config.vocab_size;
  int i1 = 0, i2 = 0;
  for (size_t r = 0; r < batch.size(); ++r) {
    const float* got = &logits[r * vocab];
    const float* want = batch[r].seq == 1 ? &want1[(i1++) * vocab] : &want2[(i2++) * vocab];
    ASSERT_EQ(std::memcmp(got, want, sizeof(float) * vocab), 0) << "row " << r;
  }
}

TEST_F(LayerGroupTest, OneTransformerServesCachesOfDifferentGroupSizes) {
  Transformer tf(*model_);
  const std::vector<int> p = Prompt(20);
  std::vector<float> first;
  for (int group_size : {1, 2, 4, 3}) {
    auto cache = GroupCache(group_size);
    ASSERT_TRUE(cache->BeginSequence(1, {}).ok());
    ASSERT_TRUE(cache->Reserve(1, 20).ok());
    std::vector<BatchToken> batch;
    for (int i = 0; i < 20; ++i) batch.push_back({1, p[i], i, i == 19});
    std::vector<float> logits;
    ASSERT_TRUE(tf.Forward(batch, *cache, logits).ok());
    if (first.empty()) first = logits;
    EXPECT_EQ(std::memcmp(first.data(), logits.data(), sizeof(float) * logits.size()), 0) << group_size;
  }
}

TEST_F(LayerGroupTest, ObserverSeesEveryLayerBeforeRope) {
  Transformer tf(*model_);
  auto raw = RawCache();
  std::vector<int> seen;
  int mismatches = 0;
  const int kvd = model_->config.kv_dim(), hd = model_->config.head_dim();
  std::vector<float> k(kvd), v(kvd), stored_k(kvd), stored_v(kvd);
  std::vector<std::vector<float>> pending;  // k_pre rows of the last trace per layer
  tf.SetLayerObserver([&](const LayerTrace& t) {
    seen.push_back(t.layer);
    EXPECT_EQ(t.n_rows, 8);
    pending.resize(model_->config.n_layers);
    pending[t.layer].assign(t.k_pre, t.k_pre + static_cast<size_t>(t.n_rows) * kvd);
  });
  ASSERT_TRUE(raw->BeginSequence(1, {}).ok());
  ASSERT_TRUE(raw->Reserve(1, 8).ok());
  std::vector<BatchToken> batch;
  const std::vector<int> p = Prompt(8);
  for (int i = 0; i < 8; ++i) batch.push_back({1, p[i], i, false});
  std::vector<float> logits;
  ASSERT_TRUE(tf.Forward(batch, *raw, logits).ok());
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3}));
  // RoPE(k_pre) is exactly what raw:f32 stored.
  for (int l = 0; l < 4; ++l) {
    for (int pos = 0; pos < 8; ++pos) {
      std::copy(&pending[l][pos * kvd], &pending[l][(pos + 1) * kvd], k.begin());
      for (int h = 0; h < model_->config.n_kv_heads; ++h) kv::RopeInterleaved(&k[h * hd], hd, pos, model_->config.rope_theta);
      int slot;
      const uint8_t* b = raw->BlockFor(1, l, pos, &slot);
      raw->codec().read(l, b, slot, stored_k.data(), stored_v.data());
      if (std::memcmp(k.data(), stored_k.data(), sizeof(float) * kvd) != 0) ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_F(LayerGroupTest, StorageIsPerGroupAndEmptyGroupsTakeNoArena) {
  KvCacheOptions o;
  o.budget_bytes = 1 << 20;
  auto g2 = KvCache::Create(*model_, std::make_unique<GroupRawCodec>(Shape(), 2), o);
  ASSERT_TRUE(g2.ok());
  // Two groups of two layers: the same bytes per block as four layers of raw f32.
  EXPECT_EQ((*g2)->ChunkValueBytes(), 16u * 4 * 2 * 64 * 4);
  auto empty = KvCache::Create(*model_, std::make_unique<GroupRawCodec>(Shape(), 2, /*empty_group=*/1), o);
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ((*empty)->ChunkValueBytes(), 16u * 2 * 2 * 64 * 4);
  ASSERT_TRUE((*empty)->BeginSequence(1, {}).ok());
  ASSERT_TRUE((*empty)->Reserve(1, 32).ok());
  // Two blocks, each only its first group's bytes: no granule for the empty group.
  EXPECT_EQ((*empty)->Stats().bytes_used, static_cast<int64_t>(2 * 16u * 2 * 2 * 64 * 4));
  // A codec whose shape is not the model's is refused.
  kv::KvShape wrong = Shape();
  wrong.n_kv_heads = 2;
  EXPECT_FALSE(KvCache::Create(*model_, std::make_unique<GroupRawCodec>(wrong, 2), o).ok());
}

}  // namespace
}  // namespace keel::engine
