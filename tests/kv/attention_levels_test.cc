// Attention of every codec at every CPU level this machine supports (keel/core/cpu.h): each level
// has its own fixed arithmetic (attention.h), so each is held to a double-precision reference
// over the rows the codec reads back (read_at), and the levels are checked to differ only in
// rounding. The bit-identity properties (lossless codecs equal raw, attend_many equals attend,
// thread count) are checked per level by the codecs' own tests (test::ForEachIsa).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/common/isa_scope.h"
#include "keel/core/cpu.h"
#include "keel/kv/bellows/bellows_codec.h"
#include "keel/kv/codec.h"

namespace keel::kv {
namespace {

// A random but well-conditioned BellowsKV calibration for `s` (two layers in one group, split
// latent: K from z[0, 8), V from z[4, 12)), so that restored K and V are O(1).
bellows::Calibration RandomCalibration(const KvShape& s, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  auto fill = [&](size_t n, float sd) {
    std::vector<float> v(n);
    for (float& x : v) x = sd * nd(rng);
    return v;
  };
  bellows::Calibration c;
  c.dim = s.dim;
  c.n_layers = s.n_layers;
  c.n_heads = s.n_heads;
  c.n_kv_heads = s.n_kv_heads;
  c.head_dim = s.head_dim;
  c.rope_theta = s.rope_theta;
  c.group_size = 2;
  c.method = "random, for tests";
  bellows::CalibrationGroup g;
  g.first_layer = 0;
  g.n_layers = 2;
  g.rank = 12;
  g.k_begin = 0;
  g.k_end = 8;
  g.v_begin = 4;
  g.v_end = 12;
  g.x_mean = fill(2 * static_cast<size_t>(s.dim), 0.1f);
  g.compress = fill(2 * static_cast<size_t>(s.dim) * g.rank, 1.0f / std::sqrt(2.0f * s.dim));
  for (int l = 0; l < 2; ++l) {
    bellows::LayerRestore lr;
    lr.k_mean = fill(s.kv_dim(), 0.3f);
    lr.v_mean = fill(s.kv_dim(), 0.3f);
    lr.rk = fill(8 * static_cast<size_t>(s.kv_dim()), 0.35f);
    lr.rv = fill(8 * static_cast<size_t>(s.kv_dim()), 0.35f);
    g.layers.push_back(lr);
  }
  c.groups.push_back(g);
  return c;
}

std::unique_ptr<Codec> Make(const std::string& spec, const KvShape& s, std::mt19937& rng) {
  auto c = spec == "bellows" ? bellows::MakeBellowsCodec(RandomCalibration(s, rng), s) : MakeCodec(spec, s);
  EXPECT_TRUE(c.ok()) << spec << ": " << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

// n tokens of random K/V (and layer inputs) stored in layer group 0 of `c`, full blocks
// compacted as the engine's cache compacts them.
struct Stored {
  std::vector<std::vector<uint8_t>> mem;
  std::vector<const uint8_t*> ptrs;
};

Stored StoreRandom(const Codec& c, int n, std::mt19937& rng) {
  const KvShape& s = c.shape();
  const int bt = s.block_tokens, layers = c.layers_in(0);
  Stored st;
  const int blocks = (n + bt - 1) / bt;
  for (int b = 0; b < blocks; ++b) st.mem.emplace_back(c.block_bytes(0), 0xCD);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> x(layers), k(layers), v(layers);
  for (int t = 0; t < n; ++t) {
    std::vector<TokenKv> tk(layers);
    for (int l = 0; l < layers; ++l) {
      x[l].resize(s.dim);
      k[l].resize(s.kv_dim());
      v[l].resize(s.kv_dim());
      for (float& e : x[l]) e = nd(rng);
      for (int i = 0; i < s.kv_dim(); ++i) {
        k[l][i] = nd(rng) * (i % 7 == 0 ? 3.0f : 1.0f);
        v[l][i] = nd(rng);
      }
      tk[l] = TokenKv{t, 1 + t % 100, x[l].data(), k[l].data(), k[l].data(), v[l].data()};
    }
    uint8_t* block = st.mem[t / bt].data();
    if (c.stores_at_group_end()) {
      c.store_group(0, block, t % bt, tk.data());
    } else {
      c.append_token(0, block, t % bt, tk[0]);
    }
  }
  for (int b = 0; b < blocks; ++b) {
    if (c.compacts() && (b + 1) * bt <= n) {
      std::vector<uint8_t> small(c.compact_bytes(0, st.mem[b].data()));
      if (!small.empty()) {
        c.compact(0, st.mem[b].data(), small.data());
        st.mem[b] = std::move(small);
      }
    }
    st.ptrs.push_back(st.mem[b].data());
  }
  return st;
}

// softmax(q k^T / sqrt(head_dim)) v per query head in double precision, over the rows `c` reads
// back for `layer` (keys rotated for their positions).
std::vector<double> Reference(const Codec& c, int layer, const Stored& st, int n, const float* q) {
  const KvShape& s = c.shape();
  const int hd = s.head_dim, kvd = s.kv_dim(), group = s.n_heads / s.n_kv_heads;
  std::vector<float> k(static_cast<size_t>(n) * kvd), v(k.size());
  for (int t = 0; t < n; ++t) {
    c.read_at(layer, st.ptrs[t / s.block_tokens], t % s.block_tokens, t, &k[static_cast<size_t>(t) * kvd],
              &v[static_cast<size_t>(t) * kvd]);
  }
  std::vector<double> out(static_cast<size_t>(s.n_heads) * hd, 0.0), p(n);
  for (int h = 0; h < s.n_heads; ++h) {
    const int off = (h / group) * hd;
    double mx = -INFINITY;
    for (int t = 0; t < n; ++t) {
      double d = 0;
      for (int i = 0; i < hd; ++i) d += static_cast<double>(q[h * hd + i]) * k[static_cast<size_t>(t) * kvd + off + i];
      p[t] = d / std::sqrt(static_cast<double>(hd));
      mx = std::max(mx, p[t]);
    }
    double sum = 0;
    for (int t = 0; t < n; ++t) sum += p[t] = std::exp(p[t] - mx);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < hd; ++i) out[h * hd + i] += p[t] / sum * v[static_cast<size_t>(t) * kvd + off + i];
    }
  }
  return out;
}

const char* const kSpecs[] = {"raw:f32", "raw:bf16", "raw:f16", "zipfusion:bf16", "zipfusion:f16", "kivi:2",
                              "kivi:4",  "minicache", "minicache:q4,keep0.3", "bellows"};

// Every codec, at every level, GQA 1 / 4 / 8 (the AVX-512 core's head pieces), head_dim 24 (the
// AVX2 core at every level), 64 and 128; every layer of the codec's first group; fill levels
// with partial and compacted blocks; attend() and attend_many().
TEST(AttentionLevels, EveryCodecNearDoublePrecisionReference) {
  test::ForEachIsa([&](cpu::Isa) {
    int checked = 0;
    for (const char* spec : kSpecs) {
      for (int group : {1, 4, 8}) {
        for (int hd : {24, 64, 128}) {
          KvShape s{2, 2 * group, 2, hd, 16};
          s.dim = 48;
          std::mt19937 rng(group * 1000 + hd);
          auto c = Make(spec, s, rng);
          ASSERT_NE(c, nullptr);
          const int n = 3 * s.block_tokens + 5;
          const Stored st = StoreRandom(*c, n, rng);
          const size_t qd = static_cast<size_t>(s.n_heads) * hd;
          std::normal_distribution<float> nd;
          std::vector<float> q(qd * n), out(qd), many(qd * n);
          for (float& x : q) x = nd(rng);
          std::vector<int> counts(n);
          for (int i = 0; i < n; ++i) counts[i] = i + 1;
          AttendScratch scratch;
          for (int layer = 0; layer < c->layers_in(0); ++layer) {
            c->attend_many(layer, st.ptrs.data(), n, counts.data(), q.data(), many.data(), scratch);
            for (int m : {1, 15, 16, 17, 40, n}) {
              c->attend(layer, st.ptrs.data(), m, q.data() + (m - 1) * qd, out.data(), scratch);
              const std::vector<double> want = Reference(*c, layer, st, m, q.data() + (m - 1) * qd);
              double worst = 0, scale = 1;
              for (size_t i = 0; i < qd; ++i) {
                worst = std::max(worst, std::abs(out[i] - want[i]));
                worst = std::max(worst, std::abs(many[(m - 1) * qd + i] - want[i]));
                scale = std::max(scale, std::abs(want[i]));
              }
              ASSERT_LT(worst, 2e-5 * scale) << spec << " GQA " << group << " hd " << hd << " layer " << layer
                                            << " tokens " << m;
              ++checked;
            }
          }
        }
      }
    }
    EXPECT_GT(checked, 500);
  });
}

// Where both levels run here: the AVX-512 core really runs (other bits than AVX2 for head_dim
// % 16 == 0, summing in another order) and agrees with AVX2 to rounding, for plain and
// ZipFusion blocks, decode and prompt chunks.
TEST(AttentionLevels, Avx512DiffersFromAvx2OnlyInRounding) {
  if (!cpu::Supports(cpu::Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512";
  for (const char* spec : {"raw:f32", "raw:bf16", "zipfusion"}) {
    const KvShape s{1, 32, 8, 128, 16};
    std::mt19937 rng(3);
    auto c = Make(spec, s, rng);
    ASSERT_NE(c, nullptr);
    const int n = 300;
    const Stored st = StoreRandom(*c, n, rng);
    const size_t qd = static_cast<size_t>(s.n_heads) * s.head_dim;
    const int m = 8;  // a prompt chunk of the last m positions
    std::normal_distribution<float> nd;
    std::vector<float> q(qd * m);
    for (float& x : q) x = nd(rng);
    std::vector<int> counts(m);
    for (int i = 0; i < m; ++i) counts[i] = n - m + 1 + i;
    std::vector<float> one[2], many[2];
    AttendScratch scratch;
    for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
      test::IsaScope scope(isa);
      const int l = static_cast<int>(isa);
      one[l].resize(qd);
      many[l].resize(qd * m);
      c->attend(0, st.ptrs.data(), n, q.data() + (m - 1) * qd, one[l].data(), scratch);
      c->attend_many(0, st.ptrs.data(), m, counts.data(), q.data(), many[l].data(), scratch);
    }
    for (auto* pair : {one, many}) {
      EXPECT_NE(0, std::memcmp(pair[0].data(), pair[1].data(), pair[0].size() * 4)) << spec;
      for (size_t i = 0; i < pair[0].size(); ++i) {
        ASSERT_NEAR(pair[0][i], pair[1][i], 1e-5f * std::max(1.0f, std::abs(pair[0][i]))) << spec << " " << i;
      }
    }
  }
}

}  // namespace
}  // namespace keel::kv
