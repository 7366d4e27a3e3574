// The zipfusion codec against raw:bf16 / raw:f16: attention bit for bit, on random and real K/V,
// every fill level, GQA ratios 1-8 (powers of two and not), odd block sizes; and end to end through the engine.
// The attention properties hold at every CPU level (test::ForEachIsa).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>

#include "../engine/test_util.h"
#include "tests/common/isa_scope.h"
#include "keel/engine/engine.h"
#include "keel/engine/transformer.h"
#include "keel/kv/codec.h"
#include "keel/kv/zipfusion/zipfusion_codec.h"

namespace keel::kv {
namespace {

struct Pair {
  std::unique_ptr<Codec> raw, zf;
  std::vector<std::vector<uint8_t>> raw_mem, zf_mem;
  std::vector<const uint8_t*> raw_ptrs, zf_ptrs;
};

using TokenFn = std::function<void(int t, float* k, float* v)>;

// Fills n_tokens tokens of K/V (from gen) into both codecs' blocks.
Pair FillWith(const KvShape& s, const std::string& dtype, int n_tokens, const TokenFn& gen) {
  Pair p;
  auto raw = MakeCodec("raw:" + dtype, s);
  auto zf = MakeCodec("zipfusion:" + dtype, s);
  EXPECT_TRUE(raw.ok() && zf.ok());
  p.raw = std::move(raw).value();
  p.zf = std::move(zf).value();
  const int blocks = (n_tokens + s.block_tokens - 1) / s.block_tokens;
  for (int b = 0; b < blocks; ++b) {
    p.raw_mem.emplace_back(p.raw->block_bytes(0), 0xCD);  // garbage: codecs must not rely on zeros
    p.zf_mem.emplace_back(p.zf->block_bytes(0), 0xCD);
  }
  for (int b = 0; b < blocks; ++b) {
    p.raw_ptrs.push_back(p.raw_mem[b].data());
    p.zf_ptrs.push_back(p.zf_mem[b].data());
  }
  std::vector<float> k(s.kv_dim()), v(s.kv_dim());
  for (int t = 0; t < n_tokens; ++t) {
    gen(t, k.data(), v.data());
    int slot = t % s.block_tokens;
    p.raw->append(0, p.raw_mem[t / s.block_tokens].data(), slot, k.data(), v.data());
    p.zf->append(0, p.zf_mem[t / s.block_tokens].data(), slot, k.data(), v.data());
  }
  return p;
}

// Normal K/V (K with larger channels every 7th), optionally with zeros, subnormals and outliers.
Pair Fill(const KvShape& s, const std::string& dtype, int n_tokens, std::mt19937& rng, bool specials) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  return FillWith(s, dtype, n_tokens, [&](int t, float* k, float* v) {
    for (int i = 0; i < s.kv_dim(); ++i) {
      k[i] = nd(rng) * (i % 7 == 0 ? 8.0f : 1.0f);
      v[i] = nd(rng) * 0.5f;
    }
    if (specials && t % 5 == 1) {
      k[0] = 0.0f;
      k[1] = -0.0f;
      k[2] = 1e-40f;  // subnormal in fp32 (flushes to a bf16 subnormal)
      v[3] = 3.0e4f;  // far outlier exponent
      v[4] = -1e-30f;
    }
  });
}

// Attention of both codecs over `p` (max_tokens stored) at every fill level, and read-back.
void ExpectIdentical(const KvShape& s, const std::string& dtype, Pair& p, int max_tokens, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(s.n_heads) * s.head_dim);
  for (float& x : q) x = nd(rng);
  std::vector<float> a(q.size()), b(q.size());
  AttendScratch sa, sb;
  for (int n = 1; n <= max_tokens; ++n) {  // every fill level, partial and full blocks
    p.raw->attend(0, p.raw_ptrs.data(), n, q.data(), a.data(), sa);
    p.zf->attend(0, p.zf_ptrs.data(), n, q.data(), b.data(), sb);
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
        << dtype << " heads=" << s.n_heads << "/" << s.n_kv_heads << " hd=" << s.head_dim << " n=" << n;
  }
  // Stored values read back identically.
  std::vector<float> rk(s.kv_dim()), rv(s.kv_dim()), zk(s.kv_dim()), zv(s.kv_dim());
  for (int t = 0; t < max_tokens; ++t) {
    p.raw->read(0, p.raw_ptrs[t / s.block_tokens], t % s.block_tokens, rk.data(), rv.data());
    p.zf->read(0, p.zf_ptrs[t / s.block_tokens], t % s.block_tokens, zk.data(), zv.data());
    ASSERT_EQ(0, std::memcmp(rk.data(), zk.data(), rk.size() * 4)) << t;
    ASSERT_EQ(0, std::memcmp(rv.data(), zv.data(), rv.size() * 4)) << t;
  }
}

void ExpectIdenticalAttention(const KvShape& s, const std::string& dtype, bool specials) {
  std::mt19937 rng(s.n_heads * 131 + s.head_dim);
  const int max_tokens = 3 * s.block_tokens + 5;
  Pair p = Fill(s, dtype, max_tokens, rng, specials);
  ExpectIdentical(s, dtype, p, max_tokens, rng);
}

TEST(ZipFusionCodec, BitIdenticalToRawAcrossGqaRatiosAndFillLevels) {
  test::ForEachIsa([&](cpu::Isa) {
    for (const char* dtype : {"bf16", "f16"}) {
      for (int group : {1, 2, 3, 4, 5, 6, 7, 8}) {
        for (int hd : {8, 16, 24, 64, 128}) {
          for (int bt : {16, 5}) {  // 5: blocks of 5 rows, partial register-blocking steps
            KvShape s{1, 2 * group, 2, hd, bt};
            ExpectIdenticalAttention(s, dtype, false);
            ExpectIdenticalAttention(s, dtype, true);
          }
        }
      }
    }
  });
}

// Every bf16 code width 0..8, through both decoders (16 values at a time for GQA <= 4 and
// head_dim % 16 == 0, 8 at a time otherwise): exponents uniform over exactly 2^W values (checked
// through the stored size: no exceptions), then the same with exceptions at random positions.
TEST(ZipFusionCodec, EveryCodeWidthBothDecoders) {
  test::ForEachIsa([&](cpu::Isa) {
    for (int group : {1, 2, 4, 8}) {
      for (int hd : {16, 64, 24}) {
        for (int w = 0; w <= 8; ++w) {
          for (bool exceptions : {false, true}) {
            const KvShape s{1, 2 * group, 2, hd, 16};
            std::mt19937 rng(w * 1000 + group * 10 + hd + exceptions);
            // 2^W exponents centred on 127 (W = 8: 160 of them, more than a 7-bit window holds).
            const int span = w == 8 ? 160 : 1 << w, lo = 127 - span / 2;
            auto value = [&](bool outlier) {
              const uint32_t e = outlier ? 1 + rng() % 8 : static_cast<uint32_t>(lo) + rng() % span;
              uint32_t bits = (rng() & 1u) << 31 | e << 23 | (rng() & 0x7Fu) << 16;
              float f;
              std::memcpy(&f, &bits, 4);
              return f;
            };
            const int tokens = 3 * s.block_tokens;
            Pair p = FillWith(s, "bf16", tokens, [&](int, float* k, float* v) {
              for (int i = 0; i < s.kv_dim(); ++i) {
                k[i] = value(exceptions && w < 8 && rng() % 50 == 0);
                v[i] = value(exceptions && w < 8 && rng() % 50 == 0);
              }
            });
            if (!exceptions) {
              const size_t n = static_cast<size_t>(s.block_tokens) * hd;
              const size_t region = 8 + n + w * n / 8;
              ASSERT_EQ(zipfusion::StoredBytes(*p.zf, p.zf_ptrs.data(), tokens), 3 * s.n_kv_heads * 2 * region)
                  << "width " << w << " hd " << hd;
            }
            ExpectIdentical(s, "bf16", p, tokens, rng);
            if (HasFailure()) return;
          }
        }
      }
    }
  });
}

// Exact exception counts per block around the bf16 decoder's groups of 16 (the open path turns
// 16 exceptions at a time into words, then the rest one by one): 0, 1, 15, 16, 17, 31, 32, 33, 100.
// The count is checked through the stored size.
TEST(ZipFusionCodec, ExceptionCountsAroundVectorGroups) {
  test::ForEachIsa([&](cpu::Isa) {
    const KvShape s{1, 8, 2, 64, 16};  // GQA 4, head_dim 64: the 16-value decoder
    const int n = s.block_tokens * s.head_dim, blocks = 3, tokens = blocks * s.block_tokens;
    for (int count : {0, 1, 15, 16, 17, 31, 32, 33, 100}) {
      std::mt19937 rng(count + 1);
      // outlier[(b * n_kv + h) * 2 + which][i]: element i of that block's K or V is an exception.
      std::vector<std::vector<bool>> outlier(blocks * s.n_kv_heads * 2, std::vector<bool>(n, false));
      for (auto& o : outlier) {
        std::vector<int> idx(n);
        for (int i = 0; i < n; ++i) idx[i] = i;
        std::shuffle(idx.begin(), idx.end(), rng);
        for (int i = 0; i < count; ++i) o[idx[i]] = true;
      }
      auto value = [&](bool is_outlier) {  // exponents 124..127 (width 2), outliers at 1..8
        const uint32_t e = is_outlier ? 1 + rng() % 8 : 124 + rng() % 4;
        const uint32_t bits = (rng() & 1u) << 31 | e << 23 | (rng() & 0x7Fu) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
      };
      Pair p = FillWith(s, "bf16", tokens, [&](int t, float* k, float* v) {
        const int b = t / s.block_tokens, slot = t % s.block_tokens;
        for (int h = 0; h < s.n_kv_heads; ++h) {
          for (int d = 0; d < s.head_dim; ++d) {
            const int i = slot * s.head_dim + d;
            k[h * s.head_dim + d] = value(outlier[(b * s.n_kv_heads + h) * 2][i]);
            v[h * s.head_dim + d] = value(outlier[(b * s.n_kv_heads + h) * 2 + 1][i]);
          }
        }
      });
      const size_t region = 8 + n + 2 * n / 8 + 3 * static_cast<size_t>(count);
      ASSERT_EQ(zipfusion::StoredBytes(*p.zf, p.zf_ptrs.data(), tokens), blocks * s.n_kv_heads * 2 * region)
          << count << " exceptions per block";
      ExpectIdentical(s, "bf16", p, tokens, rng);
      if (HasFailure()) return;
    }
  });
}

// A prompt chunk attending together (attend_many) equals its tokens attending one at a time, for
// raw and zipfusion: head_dim 64 / 128 / 24 (whole output tiles of 8 chunks, two of them, none),
// blocks of 16 and 5 tokens (score groups of 4 with and without a remainder).
void ExpectManyEqualsOne(const char* dtype, const KvShape& s) {
  std::mt19937 rng(s.n_heads * 1000 + s.head_dim * 10 + s.block_tokens);
  const int n = 3 * 16 + 7;
  Pair p = Fill(s, dtype, n, rng, true);
  const int m = 40;  // queries at positions n-m .. n-1 (more than one slice of kManyQueries)
  const size_t stride = static_cast<size_t>(s.n_heads) * s.head_dim;
  std::vector<float> q(m * stride), many(m * stride), one(m * stride);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& x : q) x = nd(rng);
  std::vector<int> counts(m);
  for (int i = 0; i < m; ++i) counts[i] = n - m + 1 + i;
  AttendScratch scratch;
  for (Codec* c : {p.raw.get(), p.zf.get()}) {
    const auto& ptrs = c == p.raw.get() ? p.raw_ptrs : p.zf_ptrs;
    c->attend_many(0, ptrs.data(), m, counts.data(), q.data(), many.data(), scratch);
    for (int i = 0; i < m; ++i) c->attend(0, ptrs.data(), counts[i], q.data() + i * stride, one.data() + i * stride, scratch);
    ASSERT_EQ(0, std::memcmp(many.data(), one.data(), many.size() * 4))
        << c->spec() << " heads " << s.n_heads << "/" << s.n_kv_heads << " hd " << s.head_dim << " block "
        << s.block_tokens;
  }
}

TEST(ZipFusionCodec, AttendManyEqualsAttendPerQuery) {
  test::ForEachIsa([&](cpu::Isa) {
    for (const char* dtype : {"bf16", "f16"}) {
      for (int group : {1, 4, 8}) {
        for (int hd : {64, 128, 24}) {
          for (int bt : {16, 5}) {
            ExpectManyEqualsOne(dtype, KvShape{1, 2 * group, 2, hd, bt});
            if (HasFailure()) return;
          }
        }
      }
    }
  });
}

TEST(ZipFusionCodec, FullBlocksAreCompressed) {
  KvShape s{1, 8, 2, 64, 16};
  std::mt19937 rng(5);
  Pair p = Fill(s, "bf16", 64, rng, false);
  size_t stored = zipfusion::StoredBytes(*p.zf, p.zf_ptrs.data(), 64);
  size_t raw = 64ull * s.kv_dim() * 2 * 2;
  EXPECT_LT(stored, raw * 8 / 10) << stored << " of " << raw;
}

TEST(ZipFusionCodec, ReusedBlockStartsOver) {
  KvShape s{1, 4, 4, 16, 16};
  std::mt19937 rng(9);
  Pair p = Fill(s, "bf16", 16, rng, false);  // one full, sealed block
  // Rewrite the same memory with 3 new tokens, as the cache does when it recycles a block.
  std::vector<float> k(s.kv_dim(), 0.25f), v(s.kv_dim(), -2.0f);
  for (int t = 0; t < 3; ++t) {
    p.raw->append(0, p.raw_mem[0].data(), t, k.data(), v.data());
    p.zf->append(0, p.zf_mem[0].data(), t, k.data(), v.data());
  }
  std::vector<float> q(static_cast<size_t>(s.n_heads) * s.head_dim, 0.1f), a(q.size()), b(q.size());
  AttendScratch sa, sb;
  p.raw->attend(0, p.raw_ptrs.data(), 3, q.data(), a.data(), sa);
  p.zf->attend(0, p.zf_ptrs.data(), 3, q.data(), b.data(), sb);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  EXPECT_FLOAT_EQ(b[0], -2.0f);
}

TEST(ZipFusionCodec, RejectsUnsupportedShapes) {
  EXPECT_FALSE(MakeCodec("zipfusion", KvShape{1, 4, 4, 12, 16}).ok());   // head_dim % 8
  EXPECT_FALSE(MakeCodec("zipfusion", KvShape{1, 4, 4, 1024, 64}).ok()); // block too large
  EXPECT_TRUE(MakeCodec("zipfusion:f16", KvShape{1, 4, 4, 64, 16}).ok());
}

// End to end: the engine with --kv-codec zipfusion gives bitwise the logits of raw:bf16.
TEST(ZipFusionCodec, EngineLogitsAndTokensEqualRawBf16) {
  test::ForEachIsa([&](cpu::Isa) {
    auto model = engine::LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(model.ok());
    std::vector<int> tokens = {1};
    for (int i = 0; i < 60; ++i) tokens.push_back(3 + (i * 53) % 500);
    std::vector<std::vector<float>> logits(2);
    const char* specs[] = {"raw:bf16", "zipfusion"};
    for (int c = 0; c < 2; ++c) {
      auto cache = engine::KvCache::Create(*model, specs[c], {});
      ASSERT_TRUE(cache.ok());
      engine::Transformer tf(*model);
      ASSERT_TRUE((*cache)->BeginSequence(1, {}).ok());
      ASSERT_TRUE((*cache)->Reserve(1, 61).ok());
      // Prefill 40 tokens, then decode the rest one by one: sealed, partial and new blocks.
      std::vector<engine::BatchToken> batch;
      for (int p = 0; p < 40; ++p) batch.push_back({1, tokens[p], p, true});
      std::vector<float> out;
      ASSERT_TRUE(tf.Forward(batch, **cache, out).ok());
      logits[c].insert(logits[c].end(), out.begin(), out.end());
      for (int p = 40; p < 61; ++p) {
        ASSERT_TRUE(tf.Forward({{1, tokens[p], p, true}}, **cache, out).ok());
        logits[c].insert(logits[c].end(), out.begin(), out.end());
      }
    }
    ASSERT_EQ(logits[0].size(), logits[1].size());
    EXPECT_EQ(0, std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * 4));

    std::vector<std::vector<int>> ids(2);
    for (int c = 0; c < 2; ++c) {
      engine::EngineOptions o;
      o.model_path = test::ModelsDir() + "/aidreams260K.bin";
      o.kv_codec = specs[c];
      auto e = engine::Engine::Open(o);
      ASSERT_TRUE(e.ok());
      engine::GenerationParams gp;
      gp.sampling.temperature = 0.9f;
      gp.sampling.seed = 17;
      gp.max_tokens = 100;
      ASSERT_TRUE((*e)->Generate("Echoes of vectors", gp, {}, &ids[c]).ok());
    }
    EXPECT_EQ(ids[0], ids[1]);
    EXPECT_GT(ids[0].size(), 50u);
  });
}

}  // namespace
}  // namespace keel::kv
