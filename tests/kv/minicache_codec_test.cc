// The minicache codec (cross-layer merging after MiniCache): a pair whose layers share a
// direction restores to bf16 precision, norms are stored exactly, the block sizes of
// minicache_codec.h, retention and compaction (the compact form reads like the full one),
// validation of untrusted blocks, and prefill == decode bit for bit through the real forward
// pass on the reference model (attention properties at every CPU level).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../engine/test_util.h"
#include "tests/common/isa_scope.h"
#include "keel/core/dtype.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"
#include "keel/kv/codec.h"

namespace keel::kv {
namespace {

KvShape Shape(int layers = 2) {
  KvShape s{layers, 4, 2, 32, 16};  // 2 KV heads of 32: kv_dim 64
  s.dim = 128;
  return s;
}

std::unique_ptr<Codec> Make(std::string_view spec, const KvShape& s) {
  auto c = MakeCodec(spec, s);
  EXPECT_TRUE(c.ok()) << spec << ": " << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// One token's K/V for both layers of a pair: [layer][kv_dim].
struct PairToken {
  std::vector<float> k[2], v[2];
};

void Store(const Codec& c, int group, uint8_t* block, int slot, const PairToken& t) {
  TokenKv tk[2];
  for (int i = 0; i < 2; ++i) {
    tk[i].pos = slot;
    tk[i].k = t.k[i].data();
    tk[i].v = t.v[i].data();
  }
  c.store_group(group, block, slot, tk);
}

std::vector<float> Normal(std::mt19937& rng, int n, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> x(n);
  for (float& e : x) e = nd(rng);
  return x;
}

double Norm(const float* x, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}

// Layer 1 = layer 0 scaled per head (a different positive factor per head and for K and V).
PairToken SameDirections(std::mt19937& rng, const KvShape& s) {
  PairToken t;
  t.k[0] = Normal(rng, s.kv_dim());
  t.v[0] = Normal(rng, s.kv_dim(), 0.5f);
  t.k[1] = t.k[0];
  t.v[1] = t.v[0];
  for (int h = 0; h < s.n_kv_heads; ++h) {
    for (int j = 0; j < s.head_dim; ++j) {
      t.k[1][h * s.head_dim + j] *= 3.5f + h;
      t.v[1][h * s.head_dim + j] *= 0.25f + h;
    }
  }
  return t;
}

PairToken Independent(std::mt19937& rng, const KvShape& s) {
  PairToken t;
  for (int i = 0; i < 2; ++i) {
    t.k[i] = Normal(rng, s.kv_dim(), 1.0f + i);
    t.v[i] = Normal(rng, s.kv_dim(), 0.5f);
  }
  return t;
}

TEST(MiniCacheCodec, SameDirectionRestoresToBf16) {
  const KvShape s = Shape();
  auto c = Make("minicache", s);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->group_size(), 2);
  EXPECT_TRUE(c->stores_at_group_end());
  std::mt19937 rng(1);
  std::vector<uint8_t> block(c->block_bytes(0), 0xCD);
  std::vector<PairToken> toks;
  for (int slot = 0; slot < s.block_tokens; ++slot) {
    toks.push_back(SameDirections(rng, s));
    Store(*c, 0, block.data(), slot, toks.back());
  }
  std::vector<float> k(s.kv_dim()), v(s.kv_dim());
  for (int slot = 0; slot < s.block_tokens; ++slot) {
    for (int layer = 0; layer < 2; ++layer) {
      c->read(layer, block.data(), slot, k.data(), v.data());
      for (int i = 0; i < s.kv_dim(); ++i) {
        // bf16 keeps 8 significant bits: within 2^-8 of each element (plus fp32 rounding).
        const float wk = toks[slot].k[layer][i], wv = toks[slot].v[layer][i];
        ASSERT_NEAR(k[i], wk, std::abs(wk) / 256 + 1e-6f) << "slot " << slot << " layer " << layer << " i " << i;
        ASSERT_NEAR(v[i], wv, std::abs(wv) / 256 + 1e-6f) << "slot " << slot << " layer " << layer << " i " << i;
      }
    }
  }
  // Directions that differ are merged, not kept: the same check fails for them.
  const PairToken apart = Independent(rng, s);
  Store(*c, 0, block.data(), 0, apart);
  c->read(1, block.data(), 0, k.data(), v.data());
  double err = 0;
  for (int i = 0; i < s.kv_dim(); ++i) err = std::max(err, std::abs(static_cast<double>(k[i] - apart.k[1][i])));
  EXPECT_GT(err, 0.5);
}

TEST(MiniCacheCodec, NormsAreExact) {
  const KvShape s = Shape();
  for (const char* spec : {"minicache", "minicache:q4", "minicache:keep0.3"}) {
    auto c = Make(spec, s);
    ASSERT_TRUE(c);
    std::mt19937 rng(2);
    std::vector<uint8_t> block(c->block_bytes(0), 0);
    const PairToken t = Independent(rng, s);
    Store(*c, 0, block.data(), 0, t);
    std::vector<float> k[2], v[2];
    for (int layer = 0; layer < 2; ++layer) {
      k[layer].resize(s.kv_dim());
      v[layer].resize(s.kv_dim());
      c->read(layer, block.data(), 0, k[layer].data(), v[layer].data());
    }
    // The records (minicache_codec.h): after the flags (2 words with keep), per row norm0, norm1
    // as fp32, each exactly the fp32-rounded length of what the layer computed.
    const size_t flags = std::string_view(spec).find("keep") != std::string_view::npos ? 8 : 0;
    const size_t rec = 8 + (std::string_view(spec) == "minicache:q4" ? 4 + s.head_dim / 2 : 2 * s.head_dim);
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < s.n_kv_heads; ++h) {
        const int row = kv * s.n_kv_heads + h;
        for (int layer = 0; layer < 2; ++layer) {
          const float* x = (kv == 0 ? t.k[layer] : t.v[layer]).data() + h * s.head_dim;
          float stored;
          std::memcpy(&stored, block.data() + flags + row * rec + 4 * layer, 4);
          EXPECT_EQ(stored, static_cast<float>(Norm(x, s.head_dim))) << spec << " row " << row;
        }
        // Merged rows restore as norm_l * e: the two layers' rows are proportional with the
        // exact ratio of the norms (bf16 norms would be off by up to 2^-9).
        const float* r0 = (kv == 0 ? k[0] : v[0]).data() + h * s.head_dim;
        const float* r1 = (kv == 0 ? k[1] : v[1]).data() + h * s.head_dim;
        const float* x0 = (kv == 0 ? t.k[0] : t.v[0]).data() + h * s.head_dim;
        const float* x1 = (kv == 0 ? t.k[1] : t.v[1]).data() + h * s.head_dim;
        const double ratio = Norm(x1, s.head_dim) / Norm(x0, s.head_dim);
        const bool kept = std::string_view(spec).find("keep") != std::string_view::npos;  // random pairs: ~90 deg apart
        for (int j = 0; j < s.head_dim && !kept; ++j) {
          if (r0[j] == 0) continue;
          EXPECT_NEAR(r1[j] / r0[j], ratio, ratio * 1e-6) << spec << " row " << row << " j " << j;
        }
        if (kept) EXPECT_NEAR(Norm(r1, s.head_dim), Norm(x1, s.head_dim), Norm(x1, s.head_dim) / 128) << spec;
      }
    }
  }
}

TEST(MiniCacheCodec, BytesPerTokenAsDocumented) {
  const KvShape s = Shape(3);  // pairs (0,1) and a group of one: layer 2
  auto bf16 = Make("minicache", s), q4 = Make("minicache:q4", s), keep = Make("minicache:keep0.3", s);
  ASSERT_TRUE(bf16 && q4 && keep);
  EXPECT_EQ(bf16->n_groups(), 2);
  EXPECT_EQ(bf16->layers_in(1), 1);
  // 2 * n_kv_heads * (8 + direction) per token of a pair: 288 (bf16) and 112 (q4) bytes against
  // 512 for two layers of raw:bf16.
  EXPECT_EQ(bf16->block_bytes(0), 16u * 2 * 2 * (8 + 64));
  EXPECT_EQ(q4->block_bytes(0), 16u * 2 * 2 * (8 + 4 + 16));
  // The lone last layer: raw bf16 K and V.
  EXPECT_EQ(bf16->block_bytes(1), 16u * 2 * 64 * 2);
  EXPECT_EQ(q4->block_bytes(1), 16u * 2 * 64 * 2);
  // With retention: 64 flag bits, the records, and room for every row's second direction.
  EXPECT_EQ(keep->block_bytes(0), RoundUp(8 + 16u * 2 * 2 * (8 + 64) + 64 * 64, 16));
  EXPECT_FALSE(bf16->compacts());
  EXPECT_TRUE(keep->compacts());
  EXPECT_EQ(keep->compact_bytes(1, nullptr), 0u);  // the lone layer stays as it is
  std::mt19937 rng(3);
  std::vector<uint8_t> block(keep->block_bytes(0), 0xCD);
  for (int slot = 0; slot < 16; ++slot) Store(*keep, 0, block.data(), slot, SameDirections(rng, s));
  EXPECT_EQ(keep->compact_bytes(0, block.data()), RoundUp(8 + 16u * 2 * 2 * (8 + 64), 16));
  for (int slot = 0; slot < 16; ++slot) Store(*keep, 0, block.data(), slot, Independent(rng, s));
  EXPECT_EQ(keep->compact_bytes(0, block.data()), keep->block_bytes(0));
}

TEST(MiniCacheCodec, RetentionKeepsDivergentPairsAndCompactFormReadsTheSame) {
  test::ForEachIsa([&](cpu::Isa) {
    const KvShape s = Shape();
    for (const char* spec : {"minicache:keep0.3", "minicache:q4,keep0.3"}) {
      auto c = Make(spec, s), merged = Make("minicache", s);
      ASSERT_TRUE(c && merged);
      EXPECT_EQ(c->spec(), spec);
      std::mt19937 rng(4);
      const int n = 3 * s.block_tokens;
      std::vector<PairToken> toks;
      std::vector<std::vector<uint8_t>> full, compact;
      for (int t = 0; t < n; ++t) {
        // Every third token's layers are unrelated (~90 degrees apart per head), the rest nearly
        // parallel: only the unrelated ones are kept unmerged.
        PairToken p = t % 3 == 0 ? Independent(rng, s) : SameDirections(rng, s);
        if (t % 3 != 0) {
          for (float& x : p.k[1]) x += 0.01f;
        }
        toks.push_back(p);
        if (t % s.block_tokens == 0) full.emplace_back(c->block_bytes(0), 0xCD);
        Store(*c, 0, full.back().data(), t % s.block_tokens, p);
      }
      const bool is_q4 = std::string_view(spec).find("q4") != std::string_view::npos;
      const size_t dir = is_q4 ? 4 + s.head_dim / 2 : 2 * s.head_dim;
      for (size_t b = 0; b < full.size(); ++b) {
        const size_t bytes = c->compact_bytes(0, full[b].data());
        // The unrelated tokens' 4 rows each (K, V x 2 heads) keep a second direction.
        int unrelated = 0;
        for (int t = 0; t < s.block_tokens; ++t) unrelated += (b * s.block_tokens + t) % 3 == 0;
        ASSERT_EQ(bytes, RoundUp(8 + 64 * (8 + dir) + 4 * unrelated * dir, 16)) << spec << " block " << b;
        ASSERT_LT(bytes, c->block_bytes(0));
        compact.emplace_back(bytes, 0xEE);
        c->compact(0, full[b].data(), compact.back().data());
        auto valid = c->validate_stored(0, compact.back().data(), bytes);
        ASSERT_TRUE(valid.ok()) << valid.status().ToString();
        EXPECT_EQ(*valid, bytes);
      }
      std::vector<float> k(s.kv_dim()), v(s.kv_dim()), kc(s.kv_dim()), vc(s.kv_dim());
      double worst_kept = 0, worst_merged_apart = 0;
      for (int t = 0; t < n; ++t) {
        const int b = t / s.block_tokens, slot = t % s.block_tokens;
        for (int layer = 0; layer < 2; ++layer) {
          c->read(layer, full[b].data(), slot, k.data(), v.data());
          c->read(layer, compact[b].data(), slot, kc.data(), vc.data());
          ASSERT_EQ(std::memcmp(k.data(), kc.data(), sizeof(float) * k.size()), 0) << spec << " token " << t;
          ASSERT_EQ(std::memcmp(v.data(), vc.data(), sizeof(float) * v.size()), 0) << spec << " token " << t;
          if (t % 3 == 0) {
            for (int i = 0; i < s.kv_dim(); ++i) {
              const double head_norm = Norm(&toks[t].k[layer][i / s.head_dim * s.head_dim], s.head_dim);
              worst_kept = std::max(worst_kept, std::abs(k[i] - toks[t].k[layer][i]) / head_norm);
            }
          }
        }
      }
      // Kept rows restore each layer from its own direction, within that direction's precision
      // relative to the head's norm: bf16 2^-9, q4 half a step of at most 2/15.
      EXPECT_LT(worst_kept, is_q4 ? 0.07 : 0.003) << spec;
      // Without retention the same unrelated pairs come back far off.
      std::vector<uint8_t> mb(merged->block_bytes(0), 0);
      Store(*merged, 0, mb.data(), 0, toks[0]);
      merged->read(1, mb.data(), 0, k.data(), v.data());
      for (int i = 0; i < s.kv_dim(); ++i) {
        worst_merged_apart = std::max(worst_merged_apart, std::abs(static_cast<double>(k[i] - toks[0].k[1][i])));
      }
      EXPECT_GT(worst_merged_apart, 0.5);
      // Attention over the compact blocks equals attention over the full ones bit for bit.
      std::vector<const uint8_t*> fp, cp;
      for (size_t b = 0; b < full.size(); ++b) {
        fp.push_back(full[b].data());
        cp.push_back(compact[b].data());
      }
      std::mt19937 qrng(5);
      const std::vector<float> q = Normal(qrng, s.n_heads * s.head_dim);
      std::vector<float> of(s.n_heads * s.head_dim), oc(of.size());
      AttendScratch scratch;
      for (int layer = 0; layer < 2; ++layer) {
        c->attend(layer, fp.data(), n - 5, q.data(), of.data(), scratch);
        c->attend(layer, cp.data(), n - 5, q.data(), oc.data(), scratch);
        EXPECT_EQ(std::memcmp(of.data(), oc.data(), sizeof(float) * of.size()), 0) << spec << " layer " << layer;
      }
    }
  });
}

TEST(MiniCacheCodec, ValidateRejectsGarbage) {
  const KvShape s = Shape(3);
  auto c = Make("minicache:keep0.3", s), q4 = Make("minicache:q4", s);
  ASSERT_TRUE(c && q4);
  std::mt19937 rng(6);
  std::vector<uint8_t> block(c->block_bytes(0), 0xCD), lone(c->block_bytes(1), 0xCD), qb(q4->block_bytes(0), 0xCD);
  for (int slot = 0; slot < 16; ++slot) {
    const PairToken t = slot == 5 ? Independent(rng, s) : SameDirections(rng, s);
    Store(*c, 0, block.data(), slot, t);
    Store(*q4, 0, qb.data(), slot, t);
    Store(*c, 1, lone.data(), slot, t);
  }
  std::vector<uint8_t> packed(c->compact_bytes(0, block.data()));
  c->compact(0, block.data(), packed.data());
  ASSERT_TRUE(c->validate_stored(0, packed.data(), packed.size()).ok());
  ASSERT_TRUE(c->validate_stored(1, lone.data(), lone.size()).ok());
  ASSERT_TRUE(q4->validate_stored(0, qb.data(), qb.size()).ok());
  const auto corrupt = [](const Result<size_t>& r) { return !r.ok() && r.status().code() == StatusCode::kCorruption; };
  // Too short: cut before the kept directions end, and before the records end.
  EXPECT_TRUE(corrupt(c->validate_stored(0, packed.data(), packed.size() - 16)));
  EXPECT_TRUE(corrupt(c->validate_stored(0, packed.data(), 100)));
  EXPECT_TRUE(corrupt(c->validate_stored(1, lone.data(), lone.size() - 2)));
  // A NaN norm, a negative norm, an infinite bf16 direction element.
  auto bad = packed;
  const float nan = std::numeric_limits<float>::quiet_NaN(), neg = -1.0f;
  std::memcpy(bad.data() + 8 + 3 * 72 + 4, &nan, 4);
  EXPECT_TRUE(corrupt(c->validate_stored(0, bad.data(), bad.size())));
  bad = packed;
  std::memcpy(bad.data() + 8 + 3 * 72, &neg, 4);
  EXPECT_TRUE(corrupt(c->validate_stored(0, bad.data(), bad.size())));
  bad = packed;
  const uint16_t inf = 0x7f80;
  std::memcpy(bad.data() + 8 + 7 * 72 + 8 + 10, &inf, 2);
  EXPECT_TRUE(corrupt(c->validate_stored(0, bad.data(), bad.size())));
  // Flags claiming every row kept: the compact block is too short for their directions.
  bad = packed;
  std::memset(bad.data(), 0xff, 8);
  EXPECT_TRUE(corrupt(c->validate_stored(0, bad.data(), bad.size())));
  // q4: an infinite scale; a NaN in the lone layer.
  auto qbad = qb;
  const uint16_t f16inf = 0x7c00;
  std::memcpy(qbad.data() + 9 * 28 + 8 + 2, &f16inf, 2);
  EXPECT_TRUE(corrupt(q4->validate_stored(0, qbad.data(), qbad.size())));
  auto lbad = lone;
  const uint16_t bnan = 0x7fc0;
  std::memcpy(lbad.data() + 300, &bnan, 2);
  EXPECT_TRUE(corrupt(c->validate_stored(1, lbad.data(), lbad.size())));
}

TEST(MiniCacheCodec, LoneLastLayerIsBf16) {
  const KvShape s = Shape(3);
  auto c = Make("minicache:q4", s);
  ASSERT_TRUE(c);
  std::mt19937 rng(7);
  std::vector<uint8_t> block(c->block_bytes(1), 0xCD);
  const PairToken t = Independent(rng, s);
  TokenKv tk;
  tk.k = t.k[0].data();
  tk.v = t.v[0].data();
  c->store_group(1, block.data(), 4, &tk);
  std::vector<float> k(s.kv_dim()), v(s.kv_dim());
  c->read(2, block.data(), 4, k.data(), v.data());
  for (int i = 0; i < s.kv_dim(); ++i) {
    ASSERT_EQ(k[i], Bf16ToF32(F32ToBf16(t.k[0][i])));
    ASSERT_EQ(v[i], Bf16ToF32(F32ToBf16(t.v[0][i])));
  }
}

TEST(MiniCacheCodec, PairsBeforeTheFirstMergedLayerAreBf16) {
  const KvShape s = Shape(4);
  auto c = Make("minicache:from2", s);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->block_bytes(0), 16u * 2 * 2 * 64 * 2);  // two layers of bf16 K and V
  EXPECT_EQ(c->block_bytes(1), 16u * 2 * 2 * (8 + 64));
  std::mt19937 rng(8);
  std::vector<uint8_t> b0(c->block_bytes(0), 0xCD), b1(c->block_bytes(1), 0xCD);
  const PairToken t = Independent(rng, s);
  Store(*c, 0, b0.data(), 3, t);
  Store(*c, 1, b1.data(), 3, t);
  std::vector<float> k(s.kv_dim()), v(s.kv_dim());
  for (int layer = 0; layer < 2; ++layer) {
    c->read(layer, b0.data(), 3, k.data(), v.data());
    for (int i = 0; i < s.kv_dim(); ++i) {
      ASSERT_EQ(k[i], Bf16ToF32(F32ToBf16(t.k[layer][i]))) << layer;
      ASSERT_EQ(v[i], Bf16ToF32(F32ToBf16(t.v[layer][i]))) << layer;
    }
    // The same unrelated pair in a merged group does not come back.
    c->read(2 + layer, b1.data(), 3, k.data(), v.data());
    double err = 0;
    for (int i = 0; i < s.kv_dim(); ++i) err = std::max(err, std::abs(static_cast<double>(k[i] - t.k[layer][i])));
    EXPECT_GT(err, 0.5) << layer;
  }
}

TEST(MiniCacheCodec, VariantsParse) {
  const KvShape s = Shape();
  for (const char* ok : {"minicache", "minicache:q4", "minicache:keep0.25", "minicache:q4,keep0.25", "minicache:from1",
                         "minicache:q4,keep0.25,from1"}) {
    auto c = MakeCodec(ok, s);
    ASSERT_TRUE(c.ok()) << ok << ": " << c.status().ToString();
    EXPECT_EQ((*c)->spec(), ok);
  }
  EXPECT_NE(Make("minicache", s)->fingerprint(), Make("minicache:q4", s)->fingerprint());
  EXPECT_NE(Make("minicache:keep0.25", s)->fingerprint(), Make("minicache:keep0.3", s)->fingerprint());
  for (const char* bad : {"minicache:q8", "minicache:keep", "minicache:keep1.5", "minicache:keep0", "minicache:q4,q4",
                          "minicache:keep0.2x", "minicache:,", "minicache:from2", "minicache:from",
                          "minicache:from-1"}) {
    auto c = MakeCodec(bad, s);
    EXPECT_FALSE(c.ok()) << bad;
    if (!c.ok()) EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

// Through the real forward pass: the cache a prompt leaves must not depend on how it was
// split into chunks (kv/codec.h), compaction at block ends included.
class MiniCacheModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = engine::LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::make_unique<engine::Model>(std::move(m).value());
  }
  std::unique_ptr<engine::KvCache> Cache(const std::string& spec) {
    engine::KvCacheOptions o;
    o.budget_bytes = 4 << 20;
    o.prefix_sharing = false;
    auto c = engine::KvCache::Create(*model_, spec, o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  // Prefill in chunks of `chunk` tokens (logits for every row), then greedy decode steps.
  std::vector<float> Run(engine::KvCache& cache, const std::vector<int>& prompt, int chunk, int decode) {
    engine::Transformer tf(*model_);
    std::vector<float> all, logits;
    EXPECT_TRUE(cache.BeginSequence(1, {}).ok());
    EXPECT_TRUE(cache.Reserve(1, static_cast<int>(prompt.size()) + decode).ok());
    std::vector<int> tokens = prompt;
    for (int p = 0; p < static_cast<int>(prompt.size()); p += chunk) {
      std::vector<engine::BatchToken> batch;
      for (int i = p; i < std::min<int>(p + chunk, prompt.size()); ++i) batch.push_back({1, tokens[i], i, true});
      EXPECT_TRUE(tf.Forward(batch, cache, logits).ok());
      cache.Commit(1, tokens.data() + p, static_cast<int>(batch.size()));
      all.insert(all.end(), logits.begin(), logits.end());
    }
    const int vocab = model_->config.vocab_size;
    for (int d = 0; d < decode; ++d) {
      const float* last = &all[all.size() - vocab];
      const int next = static_cast<int>(std::max_element(last, last + vocab) - last);
      tokens.push_back(next);
      const int pos = static_cast<int>(tokens.size()) - 1;
      EXPECT_TRUE(tf.Forward({{1, next, pos, true}}, cache, logits).ok());
      cache.Commit(1, &tokens[pos], 1);
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  }
  std::unique_ptr<engine::Model> model_;
};

TEST_F(MiniCacheModelTest, PrefillEqualsDecodeBitForBit) {
  test::ForEachIsa([&](cpu::Isa) {
    std::vector<int> prompt(40);
    for (int i = 0; i < 40; ++i) prompt[i] = 3 + (i * 37 + 303) % 500;
    prompt[0] = 1;
    const int kvd = model_->config.kv_dim(), total = 40 + 6;
    for (const char* spec : {"minicache", "minicache:q4", "minicache:keep0.3", "minicache:q4,keep0.3",
                             "minicache:q4,keep0.3,from2"}) {
      auto a = Cache(spec), b = Cache(spec), raw = Cache("raw:f32");
      ASSERT_TRUE(a && b && raw);
      const std::vector<float> la = Run(*a, prompt, 40, 6);  // one prefill batch
      const std::vector<float> lb = Run(*b, prompt, 1, 6);   // token by token
      const std::vector<float> lr = Run(*raw, prompt, 40, 6);
      ASSERT_EQ(la.size(), lb.size());
      EXPECT_EQ(std::memcmp(la.data(), lb.data(), sizeof(float) * la.size()), 0) << spec;
      // ... and the codec does change the result (it is lossy): the check above can fail.
      EXPECT_NE(std::memcmp(la.data(), lr.data(), sizeof(float) * la.size()), 0) << spec;
      std::vector<float> ka(kvd), va(kvd), kb(kvd), vb(kvd);
      for (int l = 0; l < model_->config.n_layers; ++l) {
        for (int pos = 0; pos < total; ++pos) {
          int sa, sb;
          const uint8_t* ba = a->BlockFor(1, l, pos, &sa);
          const uint8_t* bb = b->BlockFor(1, l, pos, &sb);
          a->codec().read(l, ba, sa, ka.data(), va.data());
          b->codec().read(l, bb, sb, kb.data(), vb.data());
          ASSERT_EQ(std::memcmp(ka.data(), kb.data(), sizeof(float) * kvd), 0)
              << spec << " layer " << l << " pos " << pos;
          ASSERT_EQ(std::memcmp(va.data(), vb.data(), sizeof(float) * kvd), 0)
              << spec << " layer " << l << " pos " << pos;
        }
      }
      // With retention, the two full blocks were compacted (and read the same above).
      if (std::string_view(spec).find("keep") != std::string_view::npos) {
        EXPECT_EQ(a->Stats().blocks_compacted, 2) << spec;
        EXPECT_EQ(b->Stats().blocks_compacted, 2) << spec;
        EXPECT_EQ(a->Stats().bytes_used, b->Stats().bytes_used) << spec;
      }
    }
  });
}

}  // namespace
}  // namespace keel::kv
