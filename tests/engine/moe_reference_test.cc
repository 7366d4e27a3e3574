// The engine's forward pass on MoE architectures against an independent, naive reference written
// from the Hugging Face model definitions (double precision, one token at a time, no shared code
// with the engine): Mixtral (top-k renormalised), OLMoE (q/k RMSNorm over whole projections,
// plain softmax weights) and Qwen2-MoE (q/k/v biases, shared expert behind a sigmoid gate).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "keel/engine/convert.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"
#include "test_util.h"

namespace keel::engine {
namespace {

using Vec = std::vector<double>;

double At(const TensorView& t, int64_t r, int64_t c) { return static_cast<const float*>(t.data)[r * t.cols + c]; }

Vec MatVec(const TensorView& w, const Vec& x) {
  Vec y(static_cast<size_t>(w.rows), 0.0);
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t c = 0; c < w.cols; ++c) y[r] += At(w, r, c) * x[c];
  return y;
}

Vec Norm(const Vec& x, const float* w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double s = 1.0 / std::sqrt(ss / x.size() + eps);
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = w[i] * x[i] * s;
  return y;
}

void AddTo(Vec& y, const Vec& x, double scale = 1.0) {
  for (size_t i = 0; i < y.size(); ++i) y[i] += scale * x[i];
}

Vec SwiGlu(const ExpertWeights& e, const Vec& x) {
  Vec g = MatVec(e.w1, x), u = MatVec(e.w3, x);
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
  return MatVec(e.w2, g);
}

// HF rotate_half RoPE on one head.
void Rope(double* h, int hd, int pos, double theta) {
  for (int j = 0; j < hd / 2; ++j) {
    const double f = pos / std::pow(theta, 2.0 * j / hd);
    const double a = h[j], b = h[j + hd / 2];
    h[j] = a * std::cos(f) - b * std::sin(f);
    h[j + hd / 2] = b * std::cos(f) + a * std::sin(f);
  }
}

// Logits of every position of `tokens`, the reference way.
std::vector<Vec> Reference(const Model& m, const std::vector<int>& tokens) {
  const ModelConfig& c = m.config;
  const int hd = c.head_dim(), group = c.n_heads / c.n_kv_heads;
  std::vector<std::vector<Vec>> keys(c.n_layers), values(c.n_layers);
  std::vector<Vec> out;
  for (size_t t = 0; t < tokens.size(); ++t) {
    Vec x(c.dim);
    for (int i = 0; i < c.dim; ++i) x[i] = At(m.embedding, tokens[t], i);
    for (int l = 0; l < c.n_layers; ++l) {
      const LayerWeights& w = m.layers[l];
      Vec xn = Norm(x, w.attn_norm, c.rms_eps);
      Vec q = MatVec(w.wq, xn), k = MatVec(w.wk, xn), v = MatVec(w.wv, xn);
      if (w.bq) for (int i = 0; i < c.dim; ++i) q[i] += w.bq[i];
      if (w.bk) for (int i = 0; i < c.kv_dim(); ++i) k[i] += w.bk[i];
      if (w.bv) for (int i = 0; i < c.kv_dim(); ++i) v[i] += w.bv[i];
      if (c.qk_norm) {
        q = Norm(q, w.q_norm, c.rms_eps);
        k = Norm(k, w.k_norm, c.rms_eps);
      }
      for (int h = 0; h < c.n_heads; ++h) Rope(&q[h * hd], hd, static_cast<int>(t), c.rope_theta);
      for (int h = 0; h < c.n_kv_heads; ++h) Rope(&k[h * hd], hd, static_cast<int>(t), c.rope_theta);
      keys[l].push_back(k);
      values[l].push_back(v);
      Vec att(c.dim, 0.0);
      for (int h = 0; h < c.n_heads; ++h) {
        const int kvh = h / group;
        Vec s(t + 1);
        for (size_t p = 0; p <= t; ++p) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += q[h * hd + i] * keys[l][p][kvh * hd + i];
          s[p] = d / std::sqrt(static_cast<double>(hd));
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (size_t p = 0; p <= t; ++p)
          for (int i = 0; i < hd; ++i) att[h * hd + i] += s[p] / z * values[l][p][kvh * hd + i];
      }
      AddTo(x, MatVec(w.wo, att));
      const Vec fx = Norm(x, w.ffn_norm, c.rms_eps);
      Vec logits = MatVec(w.moe.router, fx);
      const double mx = *std::max_element(logits.begin(), logits.end());
      Vec p(logits.size());
      double z = 0;
      for (size_t e = 0; e < p.size(); ++e) z += (p[e] = std::exp(logits[e] - mx));
      for (double& e : p) e /= z;
      std::vector<int> order(p.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
      double chosen = 0;
      for (int r = 0; r < c.moe.top_k; ++r) chosen += p[order[r]];
      Vec ffn(c.dim, 0.0);
      for (int r = 0; r < c.moe.top_k; ++r) {
        const int e = order[r];
        AddTo(ffn, SwiGlu(w.moe.experts[e], fx), c.moe.norm_topk ? p[e] / chosen : p[e]);
      }
      if (!w.moe.shared.w1.empty()) {
        double g = 0;
        for (int i = 0; i < c.dim; ++i) g += At(w.moe.shared_gate, 0, i) * fx[i];
        AddTo(ffn, SwiGlu(w.moe.shared, fx), 1.0 / (1.0 + std::exp(-g)));
      }
      AddTo(x, ffn);
    }
    out.push_back(MatVec(m.classifier, Norm(x, m.final_norm, c.rms_eps)));
  }
  return out;
}

class MoeReference : public ::testing::TestWithParam<const char*> {};

TEST_P(MoeReference, EngineMatchesTheNaiveReference) {
  test::TempDir dir("moe-ref");
  RandomModelOptions o;
  o.arch = GetParam();
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.vocab = 300;
  o.max_seq_len = 64;
  o.experts = 6;
  o.top_k = 2;
  o.expert_hidden = 48;
  o.init_std = 0.2f;  // routing far from ties, so float and double choose the same experts
  o.seed = 11;
  o.out_dir = dir.path();
  ASSERT_TRUE(MakeRandomModel(o).ok());
  auto m = LoadModel(dir.path());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->embedding.dtype, DType::kF32);
  const std::vector<int> tokens = {1, 270, 15, 99, 281, 4, 200, 42};
  const std::vector<Vec> want = Reference(*m, tokens);

  KvCacheOptions ko;
  ko.prefix_sharing = false;
  auto cache = KvCache::Create(*m, "raw:f32", ko);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  ASSERT_TRUE((*cache)->BeginSequence(1, {}).ok());
  ASSERT_TRUE((*cache)->Reserve(1, static_cast<int>(tokens.size())).ok());
  Transformer tf(*m);
  std::vector<BatchToken> batch;
  for (size_t i = 0; i < tokens.size(); ++i) batch.push_back({1, tokens[i], static_cast<int>(i), true});
  std::vector<float> logits;
  ASSERT_TRUE(tf.Forward(batch, **cache, logits).ok());
  const int vocab = m->config.vocab_size;
  double worst = 0, scale = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int v = 0; v < vocab; ++v) {
      worst = std::max(worst, std::abs(logits[t * vocab + v] - want[t][v]));
      scale = std::max(scale, std::abs(want[t][v]));
    }
  }
  EXPECT_LT(worst, 1e-4 * std::max(1.0, scale)) << GetParam() << ": max |engine - reference| " << worst
                                                 << " (logits up to " << scale << ")";
}

INSTANTIATE_TEST_SUITE_P(Archs, MoeReference, ::testing::Values("mixtral", "olmoe", "qwen2_moe"));

}  // namespace
}  // namespace keel::engine
