// The shared attention core (keel/kv/attention.h) against its definition: for raw fp32 rows,
// scores are DotF32(q, k) * 1/sqrt(head_dim), SoftmaxF32, then AxpyF32(p_t, v_t) in token order
// from zero. The core blocks tokens, heads and output tiles in registers; this holds it to the
// same bits for every GQA ratio (powers of two and not), head dims with and without 16-element
// chunks, odd block sizes and every fill level; at every CPU level (each with its own order).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>

#include "tests/common/isa_scope.h"
#include "keel/kv/attention_math.h"
#include "keel/kv/codec.h"

namespace keel::kv {
namespace {

void Reference(const KvShape& s, const std::vector<std::vector<float>>& k, const std::vector<std::vector<float>>& v,
               int n, const float* q, float* out) {
  const int hd = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> sc(n);
  for (int h = 0; h < s.n_heads; ++h) {
    const int kvh = h / group;
    for (int t = 0; t < n; ++t) sc[t] = DotF32(q + h * hd, k[t].data() + kvh * hd, hd) * scale;
    SoftmaxF32(sc.data(), n);
    float* o = out + h * hd;
    std::memset(o, 0, sizeof(float) * hd);
    for (int t = 0; t < n; ++t) AxpyF32(sc[t], v[t].data() + kvh * hd, o, hd);
  }
}

TEST(AttentionCore, EqualsDotSoftmaxAxpyBitForBit) {
  test::ForEachIsa([&](cpu::Isa) {
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    int cases = 0;
    for (int group : {1, 2, 3, 4, 5, 6, 7, 8, 12}) {
      for (int hd : {8, 16, 24, 64, 128}) {
        for (int bt : {1, 5, 16}) {
          const KvShape s{1, 2 * group, 2, hd, bt};
          auto codec = MakeCodec("raw:f32", s);
          ASSERT_TRUE(codec.ok());
          const int max_n = 2 * bt + 19;
          std::vector<std::vector<uint8_t>> mem((max_n + bt - 1) / bt, std::vector<uint8_t>((*codec)->block_bytes(0)));
          std::vector<const uint8_t*> ptrs;
          for (auto& m : mem) ptrs.push_back(m.data());
          std::vector<std::vector<float>> k(max_n, std::vector<float>(s.kv_dim())), v = k;
          for (int t = 0; t < max_n; ++t) {
            for (int i = 0; i < s.kv_dim(); ++i) {
              k[t][i] = nd(rng) * (i % 5 == 0 ? 4.0f : 1.0f);
              v[t][i] = nd(rng);
            }
            (*codec)->append(0, mem[t / bt].data(), t % bt, k[t].data(), v[t].data());
          }
          std::vector<float> q(static_cast<size_t>(s.n_heads) * hd), got(q.size()), want(q.size());
          for (float& x : q) x = nd(rng);
          AttendScratch scratch;
          for (int n = 1; n <= max_n; n += (n < 20 ? 1 : 7)) {
            (*codec)->attend(0, ptrs.data(), n, q.data(), got.data(), scratch);
            Reference(s, k, v, n, q.data(), want.data());
            ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
                << "group " << group << " hd " << hd << " bt " << bt << " n " << n;
            ++cases;
          }
        }
      }
    }
    EXPECT_GT(cases, 1000);
  });
}

// A long context splits KV heads across threads; the result must not depend on how many.
TEST(AttentionCore, SameBitsOnOneThreadAndMany) {
  test::ForEachIsa([&](cpu::Isa) {
    const KvShape s{1, 32, 8, 128, 16};
    for (const char* spec : {"raw:bf16", "zipfusion"}) {
      auto codec = MakeCodec(spec, s);
      ASSERT_TRUE(codec.ok());
      const int n = 1024;  // past the threshold where the heads are split
      std::vector<std::vector<uint8_t>> mem(n / s.block_tokens, std::vector<uint8_t>((*codec)->block_bytes(0)));
      std::vector<const uint8_t*> ptrs;
      for (auto& m : mem) ptrs.push_back(m.data());
      std::mt19937 rng(9);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      std::vector<float> k(s.kv_dim()), v(s.kv_dim());
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < s.kv_dim(); ++i) {
          k[i] = nd(rng);
          v[i] = nd(rng);
        }
        (*codec)->append(0, mem[t / s.block_tokens].data(), t % s.block_tokens, k.data(), v.data());
      }
      std::vector<float> q(static_cast<size_t>(s.n_heads) * s.head_dim), one(q.size()), many(q.size());
      for (float& x : q) x = nd(rng);
      AttendScratch scratch;
      const int threads = omp_get_max_threads();
      omp_set_num_threads(1);
      (*codec)->attend(0, ptrs.data(), n, q.data(), one.data(), scratch);
      omp_set_num_threads(std::max(2, threads));
      (*codec)->attend(0, ptrs.data(), n, q.data(), many.data(), scratch);
      omp_set_num_threads(threads);
      EXPECT_EQ(0, std::memcmp(one.data(), many.data(), one.size() * sizeof(float))) << spec;
    }
  });
}

TEST(AttentionCore, ExpIsAccurateAndSoftmaxNormalises) {
  test::ForEachIsa([&](cpu::Isa) {
    double worst = 0;
    for (float x = -87.0f; x <= 0.0f; x += 0.01f) {
      const double want = std::exp(static_cast<double>(x));
      worst = std::max(worst, std::abs(ExpF32(x) - want) / want);
    }
    EXPECT_LT(worst, 5e-7);  // a few ulp of fp32
    EXPECT_EQ(ExpF32(0.0f), 1.0f);
    EXPECT_EQ(ExpF32(-200.0f), 0.0f);
    EXPECT_EQ(ExpF32(-std::numeric_limits<float>::infinity()), 0.0f);
    for (int n : {1, 3, 8, 13, 100}) {
      std::vector<float> x(n);
      for (int i = 0; i < n; ++i) x[i] = std::sin(0.7f * i) * 10.0f;
      std::vector<float> y = x;
      SoftmaxF32(y.data(), n);
      double sum = 0;
      for (int i = 0; i < n; ++i) {
        EXPECT_GE(y[i], 0.0f);
        sum += y[i];
      }
      EXPECT_NEAR(sum, 1.0, 1e-5) << n;
      // The same scores at another length give the same probabilities up to the normaliser.
      if (n > 1) {
        std::vector<float> z(x.begin(), x.end() - 1);
        SoftmaxF32(z.data(), n - 1);
        EXPECT_NEAR(z[0] / z[1], y[0] / y[1], 1e-5 * (y[0] / y[1]));
      }
    }
  });
}

}  // namespace
}  // namespace keel::kv
