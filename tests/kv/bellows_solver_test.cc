// BellowsKV solver on synthetic data with known answers: exact recovery of exactly low-rank
// targets, the Eckart-Young error on a known spectrum, the attention-aware objective beating the
// plain one on the error it weights, rank-deficient inputs, bad options, streaming, and the
// input-PCA baseline. Every error figure is recomputed here from the returned float matrices,
// independently of the solver's own bookkeeping.
#include "keel/kv/bellows/solver.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace keel::kv::bellows {
namespace {

using Rng = std::mt19937_64;

std::vector<double> Gaussian(Rng& rng, size_t n, double scale = 1.0) {
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = nd(rng);
  return v;
}

// Row-major matrix product: [n][k] x [k][m].
std::vector<double> MatMul(const std::vector<double>& a, const std::vector<double>& b, size_t n, size_t k, size_t m) {
  std::vector<double> c(n * m, 0.0);
  for (size_t i = 0; i < n; ++i) {
    for (size_t t = 0; t < k; ++t) {
      const double av = a[i * k + t];
      for (size_t j = 0; j < m; ++j) c[i * m + j] += av * b[t * m + j];
    }
  }
  return c;
}

std::vector<float> ToF(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// Samples of one group, owned.
struct Data {
  GroupDims dims;
  int64_t n = 0;
  std::vector<std::vector<float>> x, k, v, q, wo;

  GroupSamples Samples() const {
    GroupSamples s;
    s.dims = dims;
    s.n_rows = n;
    for (int l = 0; l < dims.n_layers; ++l) {
      LayerSamples ls;
      ls.x = x[l];
      ls.k_pre = k[l];
      ls.v = v[l];
      if (!q.empty()) ls.q_pre = q[l];
      if (!wo.empty()) ls.wo = wo[l];
      s.layers.push_back(ls);
    }
    return s;
  }
};

GroupDims Dims(int n_layers, int dim, int n_heads, int n_kv_heads, int head_dim) {
  GroupDims d;
  d.n_layers = n_layers;
  d.dim = dim;
  d.n_heads = n_heads;
  d.n_kv_heads = n_kv_heads;
  d.head_dim = head_dim;
  return d;
}

// Group input X [n][p] (row-major) from the per-layer x.
std::vector<double> GroupInput(const Data& d) {
  const int p = d.dims.in_dim(), dim = d.dims.dim;
  std::vector<double> X(static_cast<size_t>(d.n) * p);
  for (int64_t r = 0; r < d.n; ++r) {
    for (int l = 0; l < d.dims.n_layers; ++l) {
      for (int i = 0; i < dim; ++i) X[r * p + l * dim + i] = d.x[l][r * dim + i];
    }
  }
  return X;
}

// Restores every row of layer l as the runtime will (float math from the stored float matrices)
// and returns, per target, sum over rows of e W e^T and of c W c^T, e = target - restored,
// c = target - its sample mean, for a symmetric per-row weight W (kv x kv, row-major; empty = I).
struct ErrSums {
  double err = 0, energy = 0;
  double rel() const { return energy > 0 ? err / energy : 0.0; }
};

void Restore(const Data& d, const GroupMatrices& m, int l, bool want_k, const std::vector<double>& w, ErrSums* out) {
  const int p = d.dims.in_dim(), kv = d.dims.kv_dim(), dim = d.dims.dim;
  const int b = want_k ? m.k_begin : m.v_begin, e = want_k ? m.k_end : m.v_end;
  const std::vector<float>& R = want_k ? m.layers[l].rk : m.layers[l].rv;
  const std::vector<float>& mean = want_k ? m.layers[l].k_mean : m.layers[l].v_mean;
  const std::vector<float>& Y = want_k ? d.k[l] : d.v[l];
  std::vector<double> ymean(kv, 0.0);
  for (int64_t r = 0; r < d.n; ++r) {
    for (int j = 0; j < kv; ++j) ymean[j] += Y[r * kv + j];
  }
  for (double& y : ymean) y /= static_cast<double>(d.n);
  std::vector<float> xin(p), z(m.rank), y(kv);
  std::vector<double> err(kv), cen(kv);
  auto quad = [&](const std::vector<double>& a) {
    double s = 0;
    for (int i = 0; i < kv; ++i) {
      if (w.empty()) {
        s += a[i] * a[i];
      } else {
        for (int j = 0; j < kv; ++j) s += a[i] * w[i * kv + j] * a[j];
      }
    }
    return s;
  };
  for (int64_t r = 0; r < d.n; ++r) {
    for (int ll = 0; ll < d.dims.n_layers; ++ll) {
      for (int i = 0; i < dim; ++i) xin[ll * dim + i] = d.x[ll][r * dim + i] - m.x_mean[ll * dim + i];
    }
    for (int j = 0; j < m.rank; ++j) {
      float s = 0;
      for (int i = 0; i < p; ++i) s += xin[i] * m.compress[static_cast<size_t>(i) * m.rank + j];
      z[j] = s;
    }
    for (int c = 0; c < kv; ++c) {
      float s = mean[c];
      for (int j = b; j < e; ++j) s += z[j] * R[static_cast<size_t>(j - b) * kv + c];
      y[c] = s;
    }
    for (int c = 0; c < kv; ++c) {
      err[c] = static_cast<double>(Y[r * kv + c]) - y[c];
      cen[c] = Y[r * kv + c] - ymean[c];
    }
    out->err += quad(err);
    out->energy += quad(cen);
  }
}

double RelErr(const Data& d, const GroupMatrices& m, int l, bool k, const std::vector<double>& w = {}) {
  ErrSums s;
  Restore(d, m, l, k, w, &s);
  return s.rel();
}

// Targets exactly linear in X through a rank-`rank_k` map for K and `rank_v` for V (or one
// joint rank-`rank` map over [K V] when rank > 0). X has non-zero means; so do the targets.
Data LinearData(Rng& rng, const GroupDims& dims, int64_t n, int rank, int rank_k, int rank_v) {
  Data d;
  d.dims = dims;
  d.n = n;
  const int p = dims.in_dim(), kv = dims.kv_dim(), q = dims.out_dim();
  std::vector<double> X = Gaussian(rng, n * p);
  const std::vector<double> xoff = Gaussian(rng, p, 3.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < p; ++i) X[r * p + i] += xoff[i];
  }
  std::vector<double> Y;  // [n][q], layer-major [K V]
  if (rank > 0) {
    Y = MatMul(MatMul(X, Gaussian(rng, p * rank), n, p, rank), Gaussian(rng, rank * q), n, rank, q);
  } else {
    const int per = dims.n_layers * kv;
    const std::vector<double> K = MatMul(MatMul(X, Gaussian(rng, p * rank_k), n, p, rank_k),
                                         Gaussian(rng, rank_k * per), n, rank_k, per);
    const std::vector<double> V = MatMul(MatMul(X, Gaussian(rng, p * rank_v), n, p, rank_v),
                                         Gaussian(rng, rank_v * per), n, rank_v, per);
    Y.resize(n * q);
    for (int64_t r = 0; r < n; ++r) {
      for (int l = 0; l < dims.n_layers; ++l) {
        for (int j = 0; j < kv; ++j) {
          Y[r * q + l * 2 * kv + j] = K[r * per + l * kv + j];
          Y[r * q + l * 2 * kv + kv + j] = V[r * per + l * kv + j];
        }
      }
    }
  }
  const std::vector<double> yoff = Gaussian(rng, q, 2.0);
  d.x.assign(dims.n_layers, std::vector<float>(n * dims.dim));
  d.k.assign(dims.n_layers, std::vector<float>(n * kv));
  d.v.assign(dims.n_layers, std::vector<float>(n * kv));
  for (int64_t r = 0; r < n; ++r) {
    for (int l = 0; l < dims.n_layers; ++l) {
      for (int i = 0; i < dims.dim; ++i) d.x[l][r * dims.dim + i] = static_cast<float>(X[r * p + l * dims.dim + i]);
      for (int j = 0; j < kv; ++j) {
        d.k[l][r * kv + j] = static_cast<float>(Y[r * q + l * 2 * kv + j] + yoff[l * 2 * kv + j]);
        d.v[l][r * kv + j] = static_cast<float>(Y[r * q + l * 2 * kv + kv + j] + yoff[l * 2 * kv + kv + j]);
      }
    }
  }
  return d;
}

SolveOptions Joint(int rank, double ridge = 0.0) {
  SolveOptions o;
  o.rank = rank;
  o.ridge = ridge;
  return o;
}

SolveOptions Split(int rank_k, int rank_v, double ridge = 0.0) {
  SolveOptions o;
  o.rank_k = rank_k;
  o.rank_v = rank_v;
  o.ridge = ridge;
  return o;
}

TEST(BellowsSolver, ExactlyLowRankJointIsReconstructed) {
  Rng rng(1);
  const Data d = LinearData(rng, Dims(2, 16, 2, 1, 4), 3000, /*rank=*/5, 0, 0);
  auto m = SolveGroup(d.Samples(), Joint(5));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->rank, 5);
  EXPECT_EQ(m->k_begin, 0);
  EXPECT_EQ(m->k_end, 5);
  EXPECT_EQ(m->v_begin, 0);
  EXPECT_EQ(m->v_end, 5);
  ASSERT_EQ(m->compress.size(), 32u * 5);
  for (int l = 0; l < 2; ++l) {
    EXPECT_LT(RelErr(d, *m, l, true), 1e-9) << "layer " << l;   // squared: ~1e-5 in norm
    EXPECT_LT(RelErr(d, *m, l, false), 1e-9) << "layer " << l;
    EXPECT_LT(m->layers[l].errors.k_rel, 1e-6);
    EXPECT_LT(m->layers[l].errors.v_rel, 1e-6);
  }
  // One rank short cannot be exact.
  auto m4 = SolveGroup(d.Samples(), Joint(4));
  ASSERT_TRUE(m4.ok());
  EXPECT_GT(RelErr(d, *m4, 0, true) + RelErr(d, *m4, 0, false) + RelErr(d, *m4, 1, true) + RelErr(d, *m4, 1, false),
            1e-3);
}

TEST(BellowsSolver, ExactlyLowRankSplitIsReconstructed) {
  Rng rng(2);
  const Data d = LinearData(rng, Dims(3, 12, 4, 2, 4), 2500, 0, /*rank_k=*/3, /*rank_v=*/2);
  auto m = SolveGroup(d.Samples(), Split(3, 2));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->rank, 5);
  EXPECT_EQ(m->k_begin, 0);
  EXPECT_EQ(m->k_end, 3);
  EXPECT_EQ(m->v_begin, 3);
  EXPECT_EQ(m->v_end, 5);
  for (int l = 0; l < 3; ++l) {
    ASSERT_EQ(m->layers[l].rk.size(), 3u * 8);
    ASSERT_EQ(m->layers[l].rv.size(), 2u * 8);
    EXPECT_LT(RelErr(d, *m, l, true), 1e-9) << "layer " << l;
    EXPECT_LT(RelErr(d, *m, l, false), 1e-9) << "layer " << l;
  }
  // K squeezed into 2 dimensions loses something; V is untouched by it.
  auto m2 = SolveGroup(d.Samples(), Split(2, 2));
  ASSERT_TRUE(m2.ok());
  EXPECT_GT(RelErr(d, *m2, 0, true), 1e-3);
  EXPECT_LT(RelErr(d, *m2, 0, false), 1e-9);
}

// X with orthogonal, centered columns (X^T X = N I), Y = X A with A's singular values known:
// the best rank-r fit leaves exactly the tail of A's squared singular values.
TEST(BellowsSolver, RankTooSmallGivesTheEckartYoungError) {
  Rng rng(3);
  const GroupDims dims = Dims(1, 12, 2, 2, 2);  // p = 12, kv = 4, q = 8
  const int64_t n = 4000;
  const int p = 12, q = 8;
  std::vector<double> X = Gaussian(rng, n * p);
  // Center and orthonormalise the columns (modified Gram-Schmidt), then scale by sqrt(n).
  for (int j = 0; j < p; ++j) {
    double mu = 0;
    for (int64_t r = 0; r < n; ++r) mu += X[r * p + j];
    mu /= n;
    for (int64_t r = 0; r < n; ++r) X[r * p + j] -= mu;
  }
  for (int j = 0; j < p; ++j) {
    for (int i = 0; i < j; ++i) {
      double dot = 0;
      for (int64_t r = 0; r < n; ++r) dot += X[r * p + i] * X[r * p + j];
      for (int64_t r = 0; r < n; ++r) X[r * p + j] -= dot * X[r * p + i];
    }
    double nn = 0;
    for (int64_t r = 0; r < n; ++r) nn += X[r * p + j] * X[r * p + j];
    for (int64_t r = 0; r < n; ++r) X[r * p + j] /= std::sqrt(nn);
  }
  for (double& x : X) x *= std::sqrt(static_cast<double>(n));
  // A = U diag(sigma) V^T with U (p x q) and V (q x q) orthonormal (QR by Gram-Schmidt again).
  auto orthonormal_cols = [&](int rows, int cols) {
    std::vector<double> a = Gaussian(rng, static_cast<size_t>(rows) * cols);
    for (int j = 0; j < cols; ++j) {
      for (int i = 0; i < j; ++i) {
        double dot = 0;
        for (int r = 0; r < rows; ++r) dot += a[r * cols + i] * a[r * cols + j];
        for (int r = 0; r < rows; ++r) a[r * cols + j] -= dot * a[r * cols + i];
      }
      double nn = 0;
      for (int r = 0; r < rows; ++r) nn += a[r * cols + j] * a[r * cols + j];
      for (int r = 0; r < rows; ++r) a[r * cols + j] /= std::sqrt(nn);
    }
    return a;
  };
  const std::vector<double> sigma = {8, 4, 2, 1, 0.5, 0.25, 0.1, 0.05};
  std::vector<double> U = orthonormal_cols(p, q), V = orthonormal_cols(q, q);
  for (int r = 0; r < p; ++r) {
    for (int j = 0; j < q; ++j) U[r * q + j] *= sigma[j];
  }
  std::vector<double> Vt(q * q);
  for (int i = 0; i < q; ++i) {
    for (int j = 0; j < q; ++j) Vt[i * q + j] = V[j * q + i];
  }
  const std::vector<double> Y = MatMul(X, MatMul(U, Vt, p, q, q), n, p, q);
  Data d;
  d.dims = dims;
  d.n = n;
  d.x = {ToF(X)};
  d.k = {std::vector<float>(n * 4)};
  d.v = {std::vector<float>(n * 4)};
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < 4; ++j) {
      d.k[0][r * 4 + j] = static_cast<float>(Y[r * q + j]);
      d.v[0][r * 4 + j] = static_cast<float>(Y[r * q + 4 + j]);
    }
  }
  for (int rank : {1, 3, 6}) {
    double total = 0, tail = 0;
    for (int i = 0; i < q; ++i) {
      total += sigma[i] * sigma[i];
      if (i >= rank) tail += sigma[i] * sigma[i];
    }
    auto m = SolveGroup(d.Samples(), Joint(rank));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ErrSums s;
    Restore(d, *m, 0, true, {}, &s);
    Restore(d, *m, 0, false, {}, &s);
    EXPECT_NEAR(s.rel(), tail / total, 1e-4 * tail / total + 1e-7) << "rank " << rank;
    // The solver's own figures, recombined over K and V, say the same.
    ErrSums sk, sv;
    Restore(d, *m, 0, true, {}, &sk);
    Restore(d, *m, 0, false, {}, &sv);
    const double reported =
        (m->layers[0].errors.k_rel * sk.energy + m->layers[0].errors.v_rel * sv.energy) / (sk.energy + sv.energy);
    EXPECT_NEAR(reported, tail / total, 1e-3 * tail / total) << "rank " << rank;
  }
}

// Eigenvalues of a small symmetric matrix (cyclic Jacobi), largest first: an independent check.
std::vector<double> JacobiEigenvalues(std::vector<double> a, int n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int i = 0; i < n; ++i) {
      for (int j = i + 1; j < n; ++j) off += a[i * n + j] * a[i * n + j];
    }
    if (off < 1e-30) break;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        if (std::abs(a[p * n + q]) < 1e-300) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * a[p * n + q]);
        const double t = (theta >= 0 ? 1 : -1) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // A = J^T A J
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
      }
    }
  }
  std::vector<double> ev(n);
  for (int i = 0; i < n; ++i) ev[i] = a[i * n + i];
  std::sort(ev.rbegin(), ev.rend());
  return ev;
}

// X far from isotropic (column scales over 3 decades, correlated), Y = X A exactly: the fitted
// values are Y itself, so the best rank-r map leaves the tail of Y's own spectrum. This fails
// if the truncation ranks directions by anything but their energy in X B (e.g. by B alone).
TEST(BellowsSolver, RankTooSmallIsOptimalForAnisotropicInput) {
  Rng rng(16);
  const GroupDims dims = Dims(1, 10, 2, 2, 2);  // p = 10, kv = 4, q = 8
  const int64_t n = 3000;
  const int p = 10, q = 8;
  std::vector<double> X = MatMul(Gaussian(rng, n * p), Gaussian(rng, p * p), n, p, p);
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < p; ++j) X[r * p + j] *= std::pow(10.0, j / 3.0);
  }
  std::vector<double> A = Gaussian(rng, p * q);
  for (int i = 0; i < p; ++i) {
    for (int j = 0; j < q; ++j) A[i * q + j] *= std::pow(10.0, -i / 3.0) * (1 + 3 * (i == 1));
  }
  const std::vector<double> Y = MatMul(X, A, n, p, q);
  Data d;
  d.dims = dims;
  d.n = n;
  d.x = {ToF(X)};
  d.k = {std::vector<float>(n * 4)};
  d.v = {std::vector<float>(n * 4)};
  std::vector<double> mean(q, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < 4; ++j) {
      d.k[0][r * 4 + j] = static_cast<float>(Y[r * q + j]);
      d.v[0][r * 4 + j] = static_cast<float>(Y[r * q + 4 + j]);
    }
    for (int j = 0; j < q; ++j) mean[j] += (j < 4 ? d.k[0][r * 4 + j] : d.v[0][r * 4 + j - 4]) / static_cast<double>(n);
  }
  std::vector<double> yty(q * q, 0.0);  // centered, of the float targets the solver sees
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < q; ++i) {
      const double yi = (i < 4 ? d.k[0][r * 4 + i] : d.v[0][r * 4 + i - 4]) - mean[i];
      for (int j = 0; j < q; ++j) {
        const double yj = (j < 4 ? d.k[0][r * 4 + j] : d.v[0][r * 4 + j - 4]) - mean[j];
        yty[i * q + j] += yi * yj;
      }
    }
  }
  const std::vector<double> ev = JacobiEigenvalues(yty, q);
  double total = 0;
  for (double e : ev) total += e;
  for (int rank : {2, 4}) {
    double tail = 0;
    for (int i = rank; i < q; ++i) tail += ev[i];
    auto m = SolveGroup(d.Samples(), Joint(rank));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ErrSums s;
    Restore(d, *m, 0, true, {}, &s);
    Restore(d, *m, 0, false, {}, &s);
    ASSERT_GT(tail / total, 1e-4) << "rank " << rank << ": the test needs a lossy rank";
    EXPECT_NEAR(s.rel(), tail / total, 1e-3 * tail / total) << "rank " << rank;
  }
}

// Query energy skewed to the first RoPE pairs, output projection skewed to the first V columns of
// each head: the attention-aware fit must have the smaller error under those weights, and the
// plain fit the smaller plain error (each is optimal for its own objective).
TEST(BellowsSolver, AttentionAwareLowersTheWeightedError) {
  Rng rng(4);
  const GroupDims dims = Dims(1, 16, 2, 1, 8);  // GQA 2:1, kv = 8, q_dim = 16
  const int64_t n = 4000;
  const int kv = 8, qd = 16, dim = 16;
  Data d = LinearData(rng, dims, n, 0, 8, 8);  // full-rank K and V
  const double pair_scale[4] = {10, 3, 1, 0.3};
  std::vector<double> q = Gaussian(rng, n * qd);
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < qd; ++i) q[r * qd + i] *= pair_scale[(i % 8) / 2];
  }
  d.q = {ToF(q)};
  std::vector<double> wo = Gaussian(rng, dim * qd);
  const double col_scale[8] = {5, 5, 1, 1, 0.2, 0.2, 0.2, 0.2};
  for (int o = 0; o < dim; ++o) {
    for (int i = 0; i < qd; ++i) wo[o * qd + i] *= col_scale[i % 8];
  }
  d.wo = {ToF(wo)};

  // The weights as solver.h defines them, computed here from the raw data.
  std::vector<double> wk(kv * kv, 0.0), wv(kv * kv, 0.0);
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 4; ++j) {
      double e = 0;
      for (int64_t r = 0; r < n; ++r) {
        e += std::pow(d.q[0][r * qd + h * 8 + 2 * j], 2) + std::pow(d.q[0][r * qd + h * 8 + 2 * j + 1], 2);
      }
      wk[(2 * j) * kv + 2 * j] += e;
      wk[(2 * j + 1) * kv + 2 * j + 1] += e;
    }
    for (int a = 0; a < 8; ++a) {
      for (int c = 0; c < 8; ++c) {
        for (int o = 0; o < dim; ++o) wv[a * kv + c] += static_cast<double>(d.wo[0][o * qd + h * 8 + a]) * d.wo[0][o * qd + h * 8 + c];
      }
    }
  }

  SolveOptions plain = Split(3, 3, 1e-6);
  SolveOptions aware = plain;
  aware.objective = Objective::kAttentionAware;
  auto mp = SolveGroup(d.Samples(), plain);
  auto ma = SolveGroup(d.Samples(), aware);
  ASSERT_TRUE(mp.ok()) << mp.status().ToString();
  ASSERT_TRUE(ma.ok()) << ma.status().ToString();
  const double kw_plain = RelErr(d, *mp, 0, true, wk), kw_aware = RelErr(d, *ma, 0, true, wk);
  const double vw_plain = RelErr(d, *mp, 0, false, wv), vw_aware = RelErr(d, *ma, 0, false, wv);
  EXPECT_LT(kw_aware, 0.5 * kw_plain) << "K weighted: aware " << kw_aware << " plain " << kw_plain;
  EXPECT_LT(vw_aware, 0.5 * vw_plain) << "V weighted: aware " << vw_aware << " plain " << vw_plain;
  EXPECT_LE(RelErr(d, *mp, 0, true), RelErr(d, *ma, 0, true) + 1e-6);
  EXPECT_LE(RelErr(d, *mp, 0, false), RelErr(d, *ma, 0, false) + 1e-6);
  // The solver's reported figures match the ones measured here.
  EXPECT_NEAR(ma->layers[0].errors.k_weighted_rel, kw_aware, 1e-3);
  EXPECT_NEAR(ma->layers[0].errors.v_weighted_rel, vw_aware, 1e-3);
  EXPECT_NEAR(ma->layers[0].errors.k_rel, RelErr(d, *ma, 0, true), 1e-3);
  EXPECT_NEAR(mp->layers[0].errors.k_weighted_rel, mp->layers[0].errors.k_rel, 1e-6);  // plain: M = I
}

TEST(BellowsSolver, EqualizedBlocksBalanceRelativeErrorsAcrossLayers) {
  // Layer 1's targets are 100x layer 0's: the plain fit spends the rank on layer 1; equalized
  // blocks give layer 0 its share (a lower sum of relative errors).
  Rng rng(5);
  Data d = LinearData(rng, Dims(2, 16, 2, 2, 4), 3000, 0, 8, 8);
  for (float& v : d.k[1]) v *= 100.f;
  for (float& v : d.v[1]) v *= 100.f;
  SolveOptions o = Joint(8, 1e-6);
  auto raw = SolveGroup(d.Samples(), o);
  o.equalize_blocks = true;
  auto eq = SolveGroup(d.Samples(), o);
  ASSERT_TRUE(raw.ok() && eq.ok());
  auto sum_rel = [&](const GroupMatrices& m) {
    double s = 0;
    for (int l = 0; l < 2; ++l) s += RelErr(d, m, l, true) + RelErr(d, m, l, false);
    return s;
  };
  EXPECT_LT(sum_rel(*eq), 0.9 * sum_rel(*raw));
  EXPECT_LT(RelErr(d, *eq, 0, true), RelErr(d, *raw, 0, true));
}

TEST(BellowsSolver, RankDeficientInputHasNoNaN) {
  // Two layers with identical inputs (adjacent layers often nearly are), and a duplicated column
  // inside each: X^T X is singular.
  Rng rng(6);
  Data d = LinearData(rng, Dims(2, 8, 2, 2, 2), 2000, 4, 0, 0);
  for (int64_t r = 0; r < d.n; ++r) d.x[0][r * 8 + 7] = d.x[0][r * 8 + 6];
  d.x[1] = d.x[0];
  // Targets stay exactly linear in the (now deficient) X.
  Rng rng2(7);
  const std::vector<double> A = Gaussian(rng2, 8 * 4);
  for (int l = 0; l < 2; ++l) {
    for (int64_t r = 0; r < d.n; ++r) {
      for (int j = 0; j < 4; ++j) {
        double s = 0;
        for (int i = 0; i < 8; ++i) s += d.x[0][r * 8 + i] * A[i * 4 + j];
        d.k[l][r * 4 + j] = static_cast<float>(s * (l + 1));
        d.v[l][r * 4 + j] = static_cast<float>(-s);
      }
    }
  }
  for (double ridge : {0.0, 1e-6, 1e-2}) {
    auto m = SolveGroup(d.Samples(), Joint(4, ridge));
    ASSERT_TRUE(m.ok()) << "ridge " << ridge << ": " << m.status().ToString();
    for (float c : m->compress) ASSERT_TRUE(std::isfinite(c)) << "ridge " << ridge;
    for (const LayerRestore& l : m->layers) {
      for (float r : l.rk) ASSERT_TRUE(std::isfinite(r));
      for (float r : l.rv) ASSERT_TRUE(std::isfinite(r));
      EXPECT_TRUE(std::isfinite(l.errors.k_rel) && std::isfinite(l.errors.v_weighted_rel));
    }
    // The targets span 4 dimensions (one map, scaled per block): rank 4 recovers them; a
    // larger ridge shrinks the fit a little.
    const double tol = ridge == 0.0 ? 1e-9 : ridge <= 1e-6 ? 1e-6 : 1e-2;
    EXPECT_LT(RelErr(d, *m, 0, true), tol) << "ridge " << ridge;
    EXPECT_LT(RelErr(d, *m, 1, false), tol) << "ridge " << ridge;
  }
  // More rank than the data has: the extra latent components are zero, not noise.
  auto m = SolveGroup(d.Samples(), Joint(12, 0.0));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (float c : m->compress) ASSERT_TRUE(std::isfinite(c));
  EXPECT_LT(RelErr(d, *m, 0, true), 1e-9);
}

TEST(BellowsSolver, BadOptionsAreInvalidArgument) {
  Rng rng(8);
  const Data d = LinearData(rng, Dims(2, 8, 2, 1, 4), 100, 3, 0, 0);  // p = 16, q = 16
  auto expect_bad = [&](const GroupSamples& s, const SolveOptions& o, const std::string& words) {
    auto m = SolveGroup(s, o);
    ASSERT_FALSE(m.ok()) << words;
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().ToString();
    EXPECT_NE(m.status().message().find(words), std::string::npos) << m.status().ToString();
  };
  const GroupSamples s = d.Samples();
  expect_bad(s, Joint(0), "rank 0 outside [1, 16]");
  expect_bad(s, Joint(17), "rank 17 outside [1, 16]");
  expect_bad(s, Joint(-1), "rank -1 outside");
  expect_bad(s, Split(9, 2), "rank_k 9 outside [1, 8]");
  expect_bad(s, Split(2, 0), "rank_v 0 outside");
  SolveOptions both = Joint(4);
  both.rank_k = 2;
  expect_bad(s, both, "not both");
  expect_bad(s, Joint(4, -1.0), "ridge");
  SolveOptions aware = Joint(4);
  aware.objective = Objective::kAttentionAware;
  expect_bad(s, aware, "needs q_pre");

  GroupSamples short_x = s;
  short_x.layers[1].x = short_x.layers[1].x.subspan(1);
  expect_bad(short_x, Joint(4), "layer 1 x has 799 values, expected 100 rows x 8");
  GroupSamples short_v = s;
  short_v.layers[0].v = short_v.layers[0].v.first(399);
  expect_bad(short_v, Joint(4), "layer 0 v has 399 values");
  GroupSamples one_layer = s;
  one_layer.layers.pop_back();
  expect_bad(one_layer, Joint(4), "1 layers of samples for a group of 2");
  GroupSamples one_row = s;
  one_row.n_rows = 1;
  for (auto& l : one_row.layers) {
    l.x = l.x.first(8);
    l.k_pre = l.k_pre.first(4);
    l.v = l.v.first(4);
  }
  expect_bad(one_row, Joint(4), "need at least 2");
  GroupSamples bad_dims = s;
  bad_dims.dims.head_dim = 3;
  expect_bad(bad_dims, Joint(4), "head_dim 3 is odd");

  Data nan = d;
  nan.x[0][17] = std::nanf("");
  expect_bad(nan.Samples(), Joint(4), "layer 0 x[17] is not finite");

  // Attention-aware with queries but a Wo of the wrong size.
  Data withq = d;
  withq.q = {std::vector<float>(100 * 8, 1.f), std::vector<float>(100 * 8, 1.f)};
  withq.wo = {std::vector<float>(64, 1.f), std::vector<float>(63, 1.f)};
  expect_bad(withq.Samples(), aware, "layer 1 Wo has 63 values, expected 8 x 8");
}

TEST(BellowsSolver, StreamingBatchesMatchOneShot) {
  Rng rng(9);
  const Data d = LinearData(rng, Dims(2, 8, 2, 1, 4), 1500, 6, 0, 0);
  auto one = SolveGroup(d.Samples(), Joint(3, 1e-4));
  ASSERT_TRUE(one.ok());
  auto st = GroupStats::Create(d.dims);
  ASSERT_TRUE(st.ok());
  const int64_t cuts[] = {0, 700, 701, 1500};
  for (int c = 0; c < 3; ++c) {
    GroupSamples b = d.Samples();
    const int64_t r0 = cuts[c], r1 = cuts[c + 1];
    b.n_rows = r1 - r0;
    for (auto& l : b.layers) {
      l.x = l.x.subspan(r0 * 8, (r1 - r0) * 8);
      l.k_pre = l.k_pre.subspan(r0 * 4, (r1 - r0) * 4);
      l.v = l.v.subspan(r0 * 4, (r1 - r0) * 4);
    }
    ASSERT_TRUE(st->Add(b).ok());
  }
  EXPECT_EQ(st->n_rows(), 1500);
  auto streamed = SolveGroup(*st, {}, Joint(3, 1e-4));
  ASSERT_TRUE(streamed.ok());
  ASSERT_EQ(streamed->compress.size(), one->compress.size());
  for (size_t i = 0; i < one->compress.size(); ++i) {
    EXPECT_NEAR(streamed->compress[i], one->compress[i], 1e-4 * (1 + std::abs(one->compress[i]))) << i;
  }
  EXPECT_NEAR(streamed->layers[1].errors.v_rel, one->layers[1].errors.v_rel, 1e-5);
}

TEST(BellowsSolver, SameSamplesGiveTheSameMatrices) {
  Rng rng(10);
  const Data d = LinearData(rng, Dims(2, 8, 2, 1, 4), 1000, 0, 3, 3);
  auto a = SolveGroup(d.Samples(), Split(2, 2, 1e-5));
  auto b = SolveGroup(d.Samples(), Split(2, 2, 1e-5));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->compress, b->compress);
  EXPECT_EQ(a->layers[1].rv, b->layers[1].rv);
}

TEST(BellowsSolver, UncenteredFitHasZeroMeans) {
  Rng rng(11);
  Data d = LinearData(rng, Dims(1, 8, 2, 2, 2), 1000, 3, 0, 0);
  // Remove the target offsets so that Y = X A exactly (no intercept needed).
  Rng rng2(12);
  const std::vector<double> A = Gaussian(rng2, 8 * 8);
  for (int64_t r = 0; r < d.n; ++r) {
    for (int j = 0; j < 4; ++j) {
      double sk = 0, sv = 0;
      for (int i = 0; i < 8; ++i) {
        sk += d.x[0][r * 8 + i] * A[i * 8 + j];
        sv += d.x[0][r * 8 + i] * A[i * 8 + 4 + j];
      }
      d.k[0][r * 4 + j] = static_cast<float>(sk);
      d.v[0][r * 4 + j] = static_cast<float>(sv);
    }
  }
  SolveOptions o = Joint(8);
  o.center = false;
  auto m = SolveGroup(d.Samples(), o);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (float v : m->x_mean) EXPECT_EQ(v, 0.f);
  for (float v : m->layers[0].k_mean) EXPECT_EQ(v, 0.f);
  EXPECT_LT(RelErr(d, *m, 0, true), 1e-9);
  EXPECT_LT(RelErr(d, *m, 0, false), 1e-9);
}

TEST(BellowsSolver, ProgressReachesTheEndOfEveryStage) {
  Rng rng(13);
  const Data d = LinearData(rng, Dims(1, 8, 2, 2, 2), 1000, 3, 0, 0);
  std::vector<std::pair<std::string, double>> seen;
  auto m = SolveGroup(d.Samples(), Joint(3), [&](std::string_view s, double f) { seen.emplace_back(s, f); });
  ASSERT_TRUE(m.ok());
  for (const char* stage : {"accumulate", "eigen", "solve", "errors"}) {
    bool done = false;
    for (const auto& [s, f] : seen) done |= s == stage && f == 1.0;
    EXPECT_TRUE(done) << stage;
  }
}

TEST(BellowsSolver, SolvedGroupsMakeAValidCalibrationFile) {
  Rng rng(14);
  Calibration c;
  c.dim = 8;
  c.n_layers = 3;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.group_size = 2;
  c.method = "test";
  for (int g = 0; g < 2; ++g) {
    GroupDims dims = Dims(g == 0 ? 2 : 1, 8, 2, 1, 4);
    dims.first_layer = 2 * g;
    Data d = LinearData(rng, dims, 500, 0, 2, 2);
    auto m = SolveGroup(d.Samples(), Split(2, 2, 1e-6));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->first_layer, 2 * g);
    c.groups.push_back(*m);
  }
  auto bytes = SerializeCalibration(c);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto back = ParseCalibration(*bytes, "solved.bkv");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->groups[1].layers[0].rv, c.groups[1].layers[0].rv);
}

TEST(BellowsInputPca, LowRankInputIsExactAndTheTailIsTheError) {
  Rng rng(15);
  const int dim = 8;
  const int64_t n = 3000;
  // x = mean + z P with z having variances 16, 4, 1, 0.25 along 4 orthogonal directions.
  std::vector<double> x(n * dim, 0.0);
  const double var[4] = {16, 4, 1, 0.25};
  for (int64_t r = 0; r < n; ++r) {
    const std::vector<double> z = Gaussian(rng, 4);
    for (int c = 0; c < 4; ++c) {
      // Directions: (e0+e1)/sqrt2, (e0-e1)/sqrt2, e2, e5.
      const double a = z[c] * std::sqrt(var[c]);
      if (c == 0) x[r * dim + 0] += a / std::sqrt(2.0), x[r * dim + 1] += a / std::sqrt(2.0);
      if (c == 1) x[r * dim + 0] += a / std::sqrt(2.0), x[r * dim + 1] -= a / std::sqrt(2.0);
      if (c == 2) x[r * dim + 2] += a;
      if (c == 3) x[r * dim + 5] += a;
    }
    for (int i = 0; i < dim; ++i) x[r * dim + i] += 1.0 + i;
  }
  const std::vector<float> xf = ToF(x);
  auto exact = SolveInputPca(xf, n, dim, 4);
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  double err = 0, energy = 0;
  for (int64_t r = 0; r < n; ++r) {
    float z[4];
    for (int j = 0; j < 4; ++j) {
      z[j] = 0;
      for (int i = 0; i < dim; ++i) z[j] += (xf[r * dim + i] - exact->x_mean[i]) * exact->compress[i * 4 + j];
    }
    for (int i = 0; i < dim; ++i) {
      float y = exact->x_mean[i];
      for (int j = 0; j < 4; ++j) y += z[j] * exact->restore[j * dim + i];
      err += std::pow(xf[r * dim + i] - y, 2);
      energy += std::pow(xf[r * dim + i] - (1.0 + i), 2);
    }
  }
  EXPECT_LT(err / energy, 1e-10);
  EXPECT_LT(exact->rel_err, 1e-6);
  // Rank 2 keeps the two largest directions; the sample variances are near 16, 4, 1, 0.25.
  auto two = SolveInputPca(xf, n, dim, 2);
  ASSERT_TRUE(two.ok());
  EXPECT_NEAR(two->rel_err, 1.25 / 21.25, 0.01);
  auto bad = SolveInputPca(xf, n, dim, 9);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("rank 9 outside [1, 8]"), std::string::npos);
  auto mismatch = SolveInputPca(std::span<const float>(xf).first(100), n, dim, 2);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_EQ(mismatch.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace keel::kv::bellows
