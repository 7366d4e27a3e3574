// BellowsKV solver: streamed second moments, then reduced-rank ridge regression through LAPACK
// (the method and objectives are specified in solver.h). Matrices here are column-major doubles
// (Fortran order, as BLAS/LAPACK want them); results are converted to row-major floats at the end.
#include "keel/kv/bellows/solver.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <tuple>
#include <utility>

namespace {
// Reference BLAS/LAPACK (OpenBLAS provides them), LP64. The trailing size_t arguments are the
// hidden lengths of character arguments in the gfortran calling convention.
extern "C" {
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha, const double* a,
            const int* lda, const double* beta, double* c, const int* ldc, size_t, size_t);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc, size_t, size_t);
void dsyevr_(const char* jobz, const char* range, const char* uplo, const int* n, double* a, const int* lda,
             const double* vl, const double* vu, const int* il, const int* iu, const double* abstol, int* m,
             double* w, double* z, const int* ldz, int* isuppz, double* work, const int* lwork, int* iwork,
             const int* liwork, int* info, size_t, size_t, size_t);
}
}  // namespace

namespace keel::kv::bellows {
namespace {

constexpr int kBlockRows = 256;         // rows per BLAS rank-k update
constexpr double kWeightFloor = 1e-6;   // weights relative to a block's mean weight (M^-1 exists)
constexpr double kRelTol = 1e-12;       // eigenvalues below this times the largest count as zero

// Column-major dense matrix.
struct Mat {
  int rows = 0, cols = 0;
  std::vector<double> a;
  Mat() = default;
  Mat(int r, int c) : rows(r), cols(c), a(static_cast<size_t>(r) * c, 0.0) {}
  double& operator()(int i, int j) { return a[i + static_cast<size_t>(j) * rows]; }
  double operator()(int i, int j) const { return a[i + static_cast<size_t>(j) * rows]; }
  double* col(int j) { return a.data() + static_cast<size_t>(j) * rows; }
  const double* col(int j) const { return a.data() + static_cast<size_t>(j) * rows; }
};

// C = op(A) op(B).
Mat Gemm(char ta, const Mat& A, char tb, const Mat& B) {
  const int m = ta == 'N' ? A.rows : A.cols;
  const int k = ta == 'N' ? A.cols : A.rows;
  const int n = tb == 'N' ? B.cols : B.rows;
  Mat C(m, n);
  if (m == 0 || n == 0 || k == 0) return C;
  const double one = 1.0, zero = 0.0;
  const int lda = std::max(1, A.rows), ldb = std::max(1, B.rows), ldc = std::max(1, m);
  dgemm_(&ta, &tb, &m, &n, &k, &one, A.a.data(), &lda, B.a.data(), &ldb, &zero, C.a.data(), &ldc, 1, 1);
  return C;
}

// The top `k` eigenpairs of a symmetric matrix (upper triangle read), largest first.
Status TopEigen(Mat a, int k, std::vector<double>* values, Mat* vectors) {
  const int n = a.rows;
  const char jobz = 'V', uplo = 'U';
  const char range = k >= n ? 'A' : 'I';
  const int il = n - k + 1, iu = n;
  const double vl = 0, vu = 0, abstol = 0;
  int m = 0, info = 0;
  std::vector<double> w(n);
  Mat z(n, std::max(k, 1));
  std::vector<int> isuppz(2 * static_cast<size_t>(std::max(n, 1)));
  double work_query = 0;
  int iwork_query = 0, lwork = -1, liwork = -1;
  dsyevr_(&jobz, &range, &uplo, &n, a.a.data(), &n, &vl, &vu, &il, &iu, &abstol, &m, w.data(), z.a.data(), &n,
          isuppz.data(), &work_query, &lwork, &iwork_query, &liwork, &info, 1, 1, 1);
  if (info != 0) return Status::Internal("bellows solver: dsyevr workspace query failed (info " + std::to_string(info) + ")");
  lwork = static_cast<int>(work_query);
  liwork = iwork_query;
  std::vector<double> work(static_cast<size_t>(std::max(lwork, 1)));
  std::vector<int> iwork(static_cast<size_t>(std::max(liwork, 1)));
  dsyevr_(&jobz, &range, &uplo, &n, a.a.data(), &n, &vl, &vu, &il, &iu, &abstol, &m, w.data(), z.a.data(), &n,
          isuppz.data(), work.data(), &lwork, iwork.data(), &liwork, &info, 1, 1, 1);
  if (info != 0 || m != std::min(k, n)) {
    return Status::Internal("bellows solver: dsyevr failed (info " + std::to_string(info) + ", " + std::to_string(m) +
                            " of " + std::to_string(k) + " eigenpairs)");
  }
  values->assign(m, 0.0);
  *vectors = Mat(n, m);
  for (int j = 0; j < m; ++j) {  // LAPACK returns ascending order
    (*values)[j] = w[m - 1 - j];
    std::copy(z.col(m - 1 - j), z.col(m - 1 - j) + n, vectors->col(j));
  }
  return Status::Ok();
}

// Flips each column so that its largest-magnitude entry is positive: eigenvectors have no sign,
// and a fixed one makes the same samples give the same file bytes.
void FixSigns(Mat* v) {
  for (int j = 0; j < v->cols; ++j) {
    const double* c = v->col(j);
    int best = 0;
    for (int i = 1; i < v->rows; ++i) {
      if (std::abs(c[i]) > std::abs(c[best])) best = i;
    }
    if (c[best] < 0) {
      for (int i = 0; i < v->rows; ++i) (*v)(i, j) = -(*v)(i, j);
    }
  }
}

// Adds `rows` raw rows (row-major in `buf`, `cols` doubles each; shifted in place) to shifted
// moments: gram += (a - s)(a - s)^T (upper triangle, column-major), sum += a - s. With
// `set_shift` the shift becomes this block's mean first, so that centering later subtracts
// small numbers (no cancellation when the data sit far from zero).
void AccumulateBlock(double* buf, int rows, int cols, bool set_shift, std::vector<double>& shift,
                     std::vector<double>& sum, std::vector<double>& gram) {
  if (rows <= 0) return;
  if (set_shift) {
    std::fill(shift.begin(), shift.end(), 0.0);
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) shift[c] += buf[static_cast<size_t>(r) * cols + c];
    }
    for (double& x : shift) x /= rows;
  }
  for (int r = 0; r < rows; ++r) {
    double* row = buf + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) {
      row[c] -= shift[c];
      sum[c] += row[c];
    }
  }
  // Row-major [rows][cols] is column-major [cols][rows] = A: gram += A A^T.
  const char uplo = 'U', trans = 'N';
  const double one = 1.0;
  dsyrk_(&uplo, &trans, &cols, &rows, &one, buf, &cols, &one, gram.data(), &cols, 1, 1);
}

// Second moments over n rows: centered covariance, or raw second moments when !center; and the
// means (zero when !center). Inputs as kept by AccumulateBlock (upper triangle of gram valid).
void SecondMoments(int cols, int64_t n, const std::vector<double>& shift, const std::vector<double>& sum,
                   const std::vector<double>& gram, bool center, Mat* cov, std::vector<double>* mean) {
  *cov = Mat(cols, cols);
  mean->assign(cols, 0.0);
  const double inv_n = 1.0 / static_cast<double>(n);
  for (int j = 0; j < cols; ++j) {
    for (int i = 0; i <= j; ++i) {
      double v = gram[i + static_cast<size_t>(j) * cols];
      if (center) {
        v -= sum[i] * sum[j] * inv_n;
      } else {  // sum (d + s)(d + s)^T with d the shifted rows
        v += shift[i] * sum[j] + sum[i] * shift[j] + static_cast<double>(n) * shift[i] * shift[j];
      }
      (*cov)(i, j) = (*cov)(j, i) = v * inv_n;
    }
  }
  if (center) {
    for (int c = 0; c < cols; ++c) (*mean)[c] = shift[c] + sum[c] * inv_n;
  }
}

Status CheckFinite(std::span<const float> v, const std::string& what) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      return Status::InvalidArgument("bellows solver: " + what + "[" + std::to_string(i) + "] is not finite");
    }
  }
  return Status::Ok();
}

Status CheckDims(const GroupDims& d) {
  auto bad = [&](const std::string& m) { return Status::InvalidArgument("bellows solver: " + m); };
  if (d.n_layers < 1 || d.dim < 1 || d.n_heads < 1 || d.n_kv_heads < 1 || d.head_dim < 2 || d.first_layer < 0) {
    return bad("group dims must be positive (n_layers " + std::to_string(d.n_layers) + ", dim " +
               std::to_string(d.dim) + ", n_heads " + std::to_string(d.n_heads) + ", n_kv_heads " +
               std::to_string(d.n_kv_heads) + ", head_dim " + std::to_string(d.head_dim) + ")");
  }
  if (d.head_dim % 2 != 0) return bad("head_dim " + std::to_string(d.head_dim) + " is odd (RoPE pairs)");
  if (d.n_heads % d.n_kv_heads != 0) {
    return bad("n_heads " + std::to_string(d.n_heads) + " is not a multiple of n_kv_heads " +
               std::to_string(d.n_kv_heads));
  }
  const long long p = static_cast<long long>(d.n_layers) * d.dim;
  const long long kv = static_cast<long long>(d.n_kv_heads) * d.head_dim;
  const long long q = static_cast<long long>(d.n_heads) * d.head_dim;
  if (p > kMaxDim || kv > kMaxDim || q > kMaxDim || d.n_layers > kMaxLayers) {
    return bad("group too large (n_layers*dim " + std::to_string(p) + ", kv_dim " + std::to_string(kv) +
               ", q_dim " + std::to_string(q) + "; limit " + std::to_string(kMaxDim) + ")");
  }
  return Status::Ok();
}

// The whitening of one target block (one layer's K or V): Y~_b = Y_b m, Y_b = Y~_b minv.
struct Block {
  int col0 = 0;  // first column in Y
  Mat m, minv;   // kv x kv
};

Mat Identity(int n) {
  Mat m(n, n);
  for (int i = 0; i < n; ++i) m(i, i) = 1.0;
  return m;
}

// K block of layer l: diag(sqrt(w)) with w = query energy per RoPE pair of each KV head.
void QueryWeights(const GroupDims& d, const double* q_energy, Block* b) {
  const int kv = d.kv_dim(), hd = d.head_dim, per_kv = d.n_heads / d.n_kv_heads;
  std::vector<double> w(kv, 0.0);
  for (int h = 0; h < d.n_heads; ++h) {
    const int g = h / per_kv;
    for (int j = 0; j < hd / 2; ++j) {
      const double e = q_energy[h * hd + 2 * j] + q_energy[h * hd + 2 * j + 1];
      w[g * hd + 2 * j] += e;
      w[g * hd + 2 * j + 1] += e;
    }
  }
  double mean = 0;
  for (double x : w) mean += x;
  mean /= kv;
  b->m = Mat(kv, kv);
  b->minv = Mat(kv, kv);
  for (int e = 0; e < kv; ++e) {
    const double rel = mean > 0 ? std::max(w[e] / mean, kWeightFloor) : 1.0;
    b->m(e, e) = std::sqrt(rel);
    b->minv(e, e) = 1.0 / std::sqrt(rel);
  }
}

// V block of layer l: block-diagonal G_g^(1/2), G_g = sum over heads h reading g of Wo_h^T Wo_h.
Status OutputWeights(const GroupDims& d, std::span<const float> wo, Block* b) {
  const int kv = d.kv_dim(), hd = d.head_dim, per_kv = d.n_heads / d.n_kv_heads, qd = d.q_dim();
  std::vector<Mat> gs(d.n_kv_heads, Mat(hd, hd));
  double trace = 0;
  for (int h = 0; h < d.n_heads; ++h) {
    Mat& g = gs[h / per_kv];
    for (int o = 0; o < d.dim; ++o) {
      const float* row = wo.data() + static_cast<size_t>(o) * qd + h * hd;
      for (int a = 0; a < hd; ++a) {
        for (int c = 0; c <= a; ++c) g(c, a) += static_cast<double>(row[a]) * row[c];
      }
    }
  }
  for (const Mat& g : gs) {
    for (int a = 0; a < hd; ++a) trace += g(a, a);
  }
  const double mean = trace / kv;
  b->m = Mat(kv, kv);
  b->minv = Mat(kv, kv);
  for (int gi = 0; gi < d.n_kv_heads; ++gi) {
    std::vector<double> s;
    Mat u;
    KEEL_RETURN_IF_ERROR(TopEigen(gs[gi], hd, &s, &u));
    const int o = gi * hd;
    for (int k = 0; k < hd; ++k) {
      const double rel = mean > 0 ? std::max(s[k] / mean, kWeightFloor) : 1.0;
      const double r = std::sqrt(rel), ir = 1.0 / r;
      for (int a = 0; a < hd; ++a) {
        for (int c = 0; c < hd; ++c) {
          b->m(o + a, o + c) += u(a, k) * r * u(c, k);
          b->minv(o + a, o + c) += u(a, k) * ir * u(c, k);
        }
      }
    }
  }
  return Status::Ok();
}

// Sum over i, j of A(i,j) * B(i,j).
double Dot(const Mat& a, const Mat& b) {
  double s = 0;
  for (size_t i = 0; i < a.a.size(); ++i) s += a.a[i] * b.a[i];
  return s;
}

Mat Columns(const Mat& m, int col0, int n) {
  Mat out(m.rows, n);
  std::copy(m.col(col0), m.col(col0) + static_cast<size_t>(m.rows) * n, out.a.data());
  return out;
}

Mat SubMatrix(const Mat& m, int r0, int nr, int c0, int nc) {
  Mat out(nr, nc);
  for (int j = 0; j < nc; ++j) {
    for (int i = 0; i < nr; ++i) out(i, j) = m(r0 + i, c0 + j);
  }
  return out;
}

// One reduced-rank problem: targets are the columns `cols` of Y~ (whitened), rank r.
struct Part {
  std::vector<int> cols;  // columns of Y in this part (blocks whole, in order)
  int rank = 0;
  int latent0 = 0;        // first latent index
  Mat c;                  // p x rank
  Mat vt;                 // rank x |cols|: R~ = Vr^T
};

// Solves one part given G's eigenpairs (s, u), W = U^T Sxy~ and the ridge.
Status SolvePart(const std::vector<double>& s, const Mat& u, const Mat& w, double lambda, Part* part) {
  const int p = u.rows, qp = static_cast<int>(part->cols.size()), r = part->rank;
  const double tol = (s.empty() ? 0.0 : s[0]) * kRelTol;
  std::vector<double> inv(p), dsq(p);
  for (int i = 0; i < p; ++i) {
    const bool keep = s[i] > tol && s[i] > 0;
    inv[i] = keep ? 1.0 / (s[i] + lambda) : 0.0;
    dsq[i] = keep ? std::sqrt(s[i]) * inv[i] : 0.0;
  }
  Mat wp(p, qp);  // the part's columns of W
  for (int j = 0; j < qp; ++j) std::copy(w.col(part->cols[j]), w.col(part->cols[j]) + p, wp.col(j));
  Mat t = wp;  // T' = diag(dsq) W_part: U T' = Xc B / sqrt(N) in the basis of G's eigenvectors
  for (int j = 0; j < qp; ++j) {
    for (int i = 0; i < p; ++i) t(i, j) *= dsq[i];
  }
  std::vector<double> sig2;
  Mat vr;  // qp x r: top right singular vectors of T'
  if (qp <= p) {
    KEEL_RETURN_IF_ERROR(TopEigen(Gemm('T', t, 'N', t), r, &sig2, &vr));
  } else {
    Mat a;
    KEEL_RETURN_IF_ERROR(TopEigen(Gemm('N', t, 'T', t), r, &sig2, &a));
    vr = Gemm('T', t, 'N', a);
    for (int j = 0; j < r; ++j) {
      const double sg = sig2[j] > 0 ? std::sqrt(sig2[j]) : 0.0;
      for (int i = 0; i < qp; ++i) vr(i, j) = sg > 0 ? vr(i, j) / sg : 0.0;
    }
  }
  // Components that explain nothing get zero vectors: they cannot lower the error, and their
  // eigenvectors would be arbitrary.
  const double tol2 = (sig2.empty() ? 0.0 : sig2[0]) * kRelTol;
  for (int j = 0; j < r; ++j) {
    if (!(sig2[j] > tol2 && sig2[j] > 0)) std::fill(vr.col(j), vr.col(j) + qp, 0.0);
  }
  FixSigns(&vr);
  Mat z = Gemm('N', wp, 'N', vr);  // p x r
  for (int j = 0; j < r; ++j) {
    for (int i = 0; i < p; ++i) z(i, j) *= inv[i];
  }
  part->c = Gemm('N', u, 'N', z);  // C = B Vr = U diag(inv) U^T Sxy~ Vr
  part->vt = Mat(r, qp);
  for (int j = 0; j < qp; ++j) {
    for (int i = 0; i < r; ++i) part->vt(i, j) = vr(j, i);
  }
  return Status::Ok();
}

std::vector<float> RowMajor(const Mat& m) {
  std::vector<float> out(static_cast<size_t>(m.rows) * m.cols);
  for (int i = 0; i < m.rows; ++i) {
    for (int j = 0; j < m.cols; ++j) out[static_cast<size_t>(i) * m.cols + j] = static_cast<float>(m(i, j));
  }
  return out;
}

std::vector<float> ToFloat(const double* v, int n) { return std::vector<float>(v, v + n); }

Status CheckOptions(const GroupDims& d, const SolveOptions& o) {
  auto bad = [&](const std::string& m) { return Status::InvalidArgument("bellows solver: " + m); };
  const int p = d.in_dim(), per = d.n_layers * d.kv_dim();
  const bool joint = o.rank != 0 || (o.rank_k == 0 && o.rank_v == 0);
  if (joint) {
    if (o.rank_k != 0 || o.rank_v != 0) {
      return bad("set either rank (joint latent) or rank_k and rank_v (split latent), not both: rank " +
                 std::to_string(o.rank) + ", rank_k " + std::to_string(o.rank_k) + ", rank_v " +
                 std::to_string(o.rank_v));
    }
    const int max_rank = std::min({p, 2 * per, kMaxRank});
    if (o.rank < 1 || o.rank > max_rank) {
      return bad("rank " + std::to_string(o.rank) + " outside [1, " + std::to_string(max_rank) +
                 "] (min of the group input width n*dim " + std::to_string(p) + " and the K+V width " +
                 std::to_string(2 * per) + ")");
    }
  } else {
    const int max_rank = std::min(p, per);
    for (auto [name, r] : {std::pair{"rank_k", o.rank_k}, std::pair{"rank_v", o.rank_v}}) {
      if (r < 1 || r > max_rank) {
        return bad(std::string(name) + " " + std::to_string(r) + " outside [1, " + std::to_string(max_rank) +
                   "] (min of the group input width n*dim " + std::to_string(p) + " and the K (or V) width " +
                   std::to_string(per) + ")");
      }
    }
    if (o.rank_k + o.rank_v > kMaxRank) return bad("rank_k + rank_v above " + std::to_string(kMaxRank));
  }
  if (!std::isfinite(o.ridge) || o.ridge < 0) return bad("ridge must be a finite number >= 0");
  return Status::Ok();
}

// Relative error of one target block from second moments: E = tr(Syy) - 2 <H, R> + <R, F R>,
// with H = C^T Sxy_b and F = C^T G C; relative to tr(Syy) (0 when the block is constant).
double RelError(double trace_yy, const Mat& h, const Mat& r, const Mat& f) {
  if (!(trace_yy > 0)) return 0.0;
  const double e = trace_yy - 2.0 * Dot(h, r) + Dot(r, Gemm('N', f, 'N', r));
  return std::max(0.0, e) / trace_yy;
}

double Trace(const Mat& m) {
  double t = 0;
  for (int i = 0; i < std::min(m.rows, m.cols); ++i) t += m(i, i);
  return t;
}

}  // namespace

// ---- GroupStats ----------------------------------------------------------------------------

GroupStats::GroupStats(const GroupDims& d) : dims_(d) {
  const int cols = d.in_dim() + d.out_dim();
  shift_.assign(cols, 0.0);
  sum_.assign(cols, 0.0);
  gram_.assign(static_cast<size_t>(cols) * cols, 0.0);
  q_energy_.assign(static_cast<size_t>(d.n_layers) * d.q_dim(), 0.0);
}

Result<GroupStats> GroupStats::Create(const GroupDims& dims) {
  KEEL_RETURN_IF_ERROR(CheckDims(dims));
  return GroupStats(dims);
}

Status GroupStats::Add(const GroupSamples& b, const ProgressFn& progress) {
  const GroupDims& d = dims_;
  auto bad = [&](const std::string& m) { return Status::InvalidArgument("bellows solver: " + m); };
  if (b.dims.n_layers != d.n_layers || b.dims.dim != d.dim || b.dims.n_heads != d.n_heads ||
      b.dims.n_kv_heads != d.n_kv_heads || b.dims.head_dim != d.head_dim) {
    return bad("batch dims differ from the group's");
  }
  if (b.n_rows < 0) return bad("negative row count");
  if (static_cast<int>(b.layers.size()) != d.n_layers) {
    return bad(std::to_string(b.layers.size()) + " layers of samples for a group of " + std::to_string(d.n_layers));
  }
  const size_t n = static_cast<size_t>(b.n_rows);
  bool any_q = false, all_q = true;
  for (int l = 0; l < d.n_layers; ++l) {
    const LayerSamples& s = b.layers[l];
    const std::string at = "layer " + std::to_string(d.first_layer + l) + " ";
    for (auto [name, span, width] : {std::tuple{"x", s.x, d.dim}, std::tuple{"k_pre", s.k_pre, d.kv_dim()},
                                     std::tuple{"v", s.v, d.kv_dim()}}) {
      if (span.size() != n * width) {
        return bad(at + name + " has " + std::to_string(span.size()) + " values, expected " + std::to_string(n) +
                   " rows x " + std::to_string(width));
      }
      KEEL_RETURN_IF_ERROR(CheckFinite(span, at + name));
    }
    if (!s.q_pre.empty()) {
      if (s.q_pre.size() != n * d.q_dim()) {
        return bad(at + "q_pre has " + std::to_string(s.q_pre.size()) + " values, expected " + std::to_string(n) +
                   " rows x " + std::to_string(d.q_dim()));
      }
      KEEL_RETURN_IF_ERROR(CheckFinite(s.q_pre, at + "q_pre"));
    }
    any_q |= !s.q_pre.empty();
    all_q &= !s.q_pre.empty();
  }
  if (any_q && !all_q) return bad("q_pre given for some layers of the batch and not for others");
  if (n == 0) return Status::Ok();
  if (any_q != (q_rows_ == n_rows_) && n_rows_ > 0) {
    return bad("q_pre must be given for every batch or for none");
  }

  const int p = d.in_dim(), kv = d.kv_dim(), cols = p + d.out_dim();
  std::vector<double> buf(static_cast<size_t>(kBlockRows) * cols);
  const bool first = n_rows_ == 0;
  for (size_t r0 = 0; r0 < n; r0 += kBlockRows) {
    const int rows = static_cast<int>(std::min<size_t>(kBlockRows, n - r0));
    for (int r = 0; r < rows; ++r) {
      double* row = buf.data() + static_cast<size_t>(r) * cols;
      const size_t src = r0 + r;
      for (int l = 0; l < d.n_layers; ++l) {
        const LayerSamples& s = b.layers[l];
        const float* x = s.x.data() + src * d.dim;
        const float* k = s.k_pre.data() + src * kv;
        const float* v = s.v.data() + src * kv;
        std::copy(x, x + d.dim, row + static_cast<size_t>(l) * d.dim);
        std::copy(k, k + kv, row + p + static_cast<size_t>(l) * 2 * kv);
        std::copy(v, v + kv, row + p + static_cast<size_t>(l) * 2 * kv + kv);
      }
    }
    AccumulateBlock(buf.data(), rows, cols, first && r0 == 0, shift_, sum_, gram_);
    if (progress) progress("accumulate", static_cast<double>(r0 + rows) / static_cast<double>(n));
  }
  if (any_q) {
    const int qd = d.q_dim();
    for (int l = 0; l < d.n_layers; ++l) {
      double* e = q_energy_.data() + static_cast<size_t>(l) * qd;
      const float* q = b.layers[l].q_pre.data();
      for (size_t r = 0; r < n; ++r) {
        for (int i = 0; i < qd; ++i) e[i] += static_cast<double>(q[r * qd + i]) * q[r * qd + i];
      }
    }
    q_rows_ += static_cast<int64_t>(n);
  }
  n_rows_ += static_cast<int64_t>(n);
  return Status::Ok();
}

// ---- SolveGroup ----------------------------------------------------------------------------

Result<GroupMatrices> SolveGroup(const GroupStats& st, const std::vector<std::span<const float>>& wo,
                                 const SolveOptions& o, const ProgressFn& progress) {
  const GroupDims& d = st.dims();
  KEEL_RETURN_IF_ERROR(CheckOptions(d, o));
  auto bad = [&](const std::string& m) { return Status::InvalidArgument("bellows solver: " + m); };
  if (st.n_rows() < 2) return bad(std::to_string(st.n_rows()) + " sample rows; need at least 2");
  const bool aware = o.objective == Objective::kAttentionAware;
  if (aware) {
    if (!st.has_queries()) return bad("the attention-aware objective needs q_pre for every sample");
    if (static_cast<int>(wo.size()) != d.n_layers) {
      return bad("the attention-aware objective needs Wo for each of the " + std::to_string(d.n_layers) +
                 " layers, got " + std::to_string(wo.size()));
    }
    for (int l = 0; l < d.n_layers; ++l) {
      const size_t want = static_cast<size_t>(d.dim) * d.q_dim();
      if (wo[l].size() != want) {
        return bad("layer " + std::to_string(d.first_layer + l) + " Wo has " + std::to_string(wo[l].size()) +
                   " values, expected " + std::to_string(d.dim) + " x " + std::to_string(d.q_dim()));
      }
      KEEL_RETURN_IF_ERROR(CheckFinite(wo[l], "layer " + std::to_string(d.first_layer + l) + " Wo"));
    }
  }
  auto report = [&](std::string_view stage, double f) {
    if (progress) progress(stage, f);
  };

  const int p = d.in_dim(), q = d.out_dim(), kv = d.kv_dim(), nl = d.n_layers, cols = p + q;
  Mat cov;
  std::vector<double> mean;
  SecondMoments(cols, st.n_rows(), st.shift(), st.shifted_sum(), st.gram(), o.center, &cov, &mean);
  const Mat g = SubMatrix(cov, 0, p, 0, p);
  const Mat sxy = SubMatrix(cov, 0, p, p, q);

  // Whitening per target block: blocks[2l] = K of layer l, blocks[2l+1] = V.
  std::vector<Block> blocks(2 * nl);
  for (int l = 0; l < nl; ++l) {
    Block& bk = blocks[2 * l];
    Block& bv = blocks[2 * l + 1];
    bk.col0 = 2 * l * kv;
    bv.col0 = 2 * l * kv + kv;
    if (aware) {
      QueryWeights(d, st.query_energy().data() + static_cast<size_t>(l) * d.q_dim(), &bk);
      KEEL_RETURN_IF_ERROR(OutputWeights(d, wo[l], &bv));
    } else {
      bk.m = bk.minv = bv.m = bv.minv = Identity(kv);
    }
  }
  std::vector<double> syy_trace(2 * nl), syyw_trace(2 * nl);
  for (int b = 0; b < 2 * nl; ++b) {
    const Mat syy = SubMatrix(cov, p + blocks[b].col0, kv, p + blocks[b].col0, kv);
    syy_trace[b] = Trace(syy);
    syyw_trace[b] = Dot(Gemm('N', syy, 'N', blocks[b].m), blocks[b].m);  // tr(M^T Syy M)
  }
  if (o.equalize_blocks) {
    double mean_e = 0;
    for (double e : syyw_trace) mean_e += e;
    mean_e /= 2 * nl;
    for (int b = 0; b < 2 * nl; ++b) {
      if (!(syyw_trace[b] > 0) || !(mean_e > 0)) continue;
      const double sc = std::sqrt(mean_e / syyw_trace[b]);
      for (double& x : blocks[b].m.a) x *= sc;
      for (double& x : blocks[b].minv.a) x /= sc;
      syyw_trace[b] *= sc * sc;
    }
  }
  Mat sxyw(p, q);  // Sxy M
  for (const Block& b : blocks) {
    const Mat part = Gemm('N', Columns(sxy, b.col0, kv), 'N', b.m);
    std::copy(part.a.begin(), part.a.end(), sxyw.col(b.col0));
  }

  report("eigen", 0.0);
  std::vector<double> s;
  Mat u;
  KEEL_RETURN_IF_ERROR(TopEigen(g, p, &s, &u));
  double mean_diag = 0;
  for (int i = 0; i < p; ++i) mean_diag += g(i, i);
  mean_diag /= p;
  const double lambda = o.ridge * mean_diag;
  const Mat w = Gemm('T', u, 'N', sxyw);
  report("eigen", 1.0);

  // Parts: joint = one problem over every column; split = K columns, then V columns.
  std::vector<Part> parts;
  const bool joint = o.rank > 0;
  if (joint) {
    Part all;
    for (int c = 0; c < q; ++c) all.cols.push_back(c);
    all.rank = o.rank;
    parts.push_back(std::move(all));
  } else {
    Part pk, pv;
    for (int l = 0; l < nl; ++l) {
      for (int e = 0; e < kv; ++e) {
        pk.cols.push_back(2 * l * kv + e);
        pv.cols.push_back(2 * l * kv + kv + e);
      }
    }
    pk.rank = o.rank_k;
    pv.rank = o.rank_v;
    pv.latent0 = o.rank_k;
    parts.push_back(std::move(pk));
    parts.push_back(std::move(pv));
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    report("solve", static_cast<double>(i) / parts.size());
    KEEL_RETURN_IF_ERROR(SolvePart(s, u, w, lambda, &parts[i]));
  }
  report("solve", 1.0);

  GroupMatrices out;
  out.first_layer = d.first_layer;
  out.n_layers = nl;
  out.rank = joint ? o.rank : o.rank_k + o.rank_v;
  out.k_begin = 0;
  out.k_end = joint ? o.rank : o.rank_k;
  out.v_begin = joint ? 0 : o.rank_k;
  out.v_end = out.rank;
  Mat c(p, out.rank);
  for (const Part& pt : parts) {
    std::copy(pt.c.a.begin(), pt.c.a.end(), c.col(pt.latent0));
  }
  out.compress = RowMajor(c);
  out.x_mean = ToFloat(mean.data(), p);
  out.layers.resize(nl);

  // Restore matrices and errors, block by block.
  for (int b = 0; b < 2 * nl; ++b) {
    report("errors", static_cast<double>(b) / (2 * nl));
    const int l = b / 2;
    const bool is_k = b % 2 == 0;
    const Part& pt = parts.size() == 1 ? parts[0] : parts[is_k ? 0 : 1];
    // The block's columns inside the part: joint = its Y columns; split = layer-major K or V.
    const int pc0 = parts.size() == 1 ? blocks[b].col0 : l * kv;
    const Mat rw = Columns(pt.vt, pc0, kv);         // R~_b: rank_part x kv
    const Mat r = Gemm('N', rw, 'N', blocks[b].minv);  // R_b = R~_b M_b^-1
    const Mat f = Gemm('T', pt.c, 'N', Gemm('N', g, 'N', pt.c));
    const Mat h = Gemm('T', pt.c, 'N', Columns(sxy, blocks[b].col0, kv));
    const Mat hw = Gemm('N', h, 'N', blocks[b].m);
    const float plain = static_cast<float>(RelError(syy_trace[b], h, r, f));
    const float weighted = static_cast<float>(RelError(syyw_trace[b], hw, rw, f));
    LayerRestore& lr = out.layers[l];
    const double* mu = mean.data() + p + blocks[b].col0;
    if (is_k) {
      lr.k_mean = ToFloat(mu, kv);
      lr.rk = RowMajor(r);
      lr.errors.k_rel = plain;
      lr.errors.k_weighted_rel = weighted;
    } else {
      lr.v_mean = ToFloat(mu, kv);
      lr.rv = RowMajor(r);
      lr.errors.v_rel = plain;
      lr.errors.v_weighted_rel = weighted;
    }
  }
  report("errors", 1.0);
  return out;
}

Result<GroupMatrices> SolveGroup(const GroupSamples& samples, const SolveOptions& opts, const ProgressFn& progress) {
  KEEL_ASSIGN_OR_RETURN(GroupStats st, GroupStats::Create(samples.dims));
  // Options first: a bad rank should not cost a pass over the samples.
  KEEL_RETURN_IF_ERROR(CheckOptions(samples.dims, opts));
  KEEL_RETURN_IF_ERROR(st.Add(samples, progress));
  std::vector<std::span<const float>> wo;
  for (const LayerSamples& l : samples.layers) wo.push_back(l.wo);
  if (opts.objective == Objective::kPlain) wo.clear();
  return SolveGroup(st, wo, opts, progress);
}

// ---- Input PCA (baseline) ------------------------------------------------------------------

Result<InputPca> SolveInputPca(std::span<const float> x, int64_t n_rows, int dim, int rank,
                               const ProgressFn& progress) {
  auto bad = [&](const std::string& m) { return Status::InvalidArgument("bellows input PCA: " + m); };
  if (dim < 1 || dim > kMaxDim) return bad("dim " + std::to_string(dim) + " outside [1, " + std::to_string(kMaxDim) + "]");
  if (rank < 1 || rank > dim) return bad("rank " + std::to_string(rank) + " outside [1, " + std::to_string(dim) + "]");
  if (n_rows < 2) return bad(std::to_string(n_rows) + " sample rows; need at least 2");
  if (x.size() != static_cast<size_t>(n_rows) * dim) {
    return bad("x has " + std::to_string(x.size()) + " values, expected " + std::to_string(n_rows) + " rows x " +
               std::to_string(dim));
  }
  KEEL_RETURN_IF_ERROR(CheckFinite(x, "x"));
  std::vector<double> shift(dim, 0.0), sum(dim, 0.0), gram(static_cast<size_t>(dim) * dim, 0.0);
  std::vector<double> buf(static_cast<size_t>(kBlockRows) * dim);
  for (int64_t r0 = 0; r0 < n_rows; r0 += kBlockRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, n_rows - r0));
    std::copy(x.data() + r0 * dim, x.data() + (r0 + rows) * dim, buf.data());
    AccumulateBlock(buf.data(), rows, dim, r0 == 0, shift, sum, gram);
    if (progress) progress("accumulate", static_cast<double>(r0 + rows) / static_cast<double>(n_rows));
  }
  Mat cov;
  std::vector<double> mean;
  SecondMoments(dim, n_rows, shift, sum, gram, true, &cov, &mean);
  std::vector<double> s;
  Mat u;
  KEEL_RETURN_IF_ERROR(TopEigen(cov, dim, &s, &u));
  Mat vr = Columns(u, 0, rank);
  FixSigns(&vr);
  InputPca out;
  out.x_mean = ToFloat(mean.data(), dim);
  out.compress = RowMajor(vr);
  Mat vt(rank, dim);
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < rank; ++j) vt(j, i) = vr(i, j);
  }
  out.restore = RowMajor(vt);
  double total = 0, kept = 0;
  for (int i = 0; i < dim; ++i) {
    total += std::max(0.0, s[i]);
    if (i < rank) kept += std::max(0.0, s[i]);
  }
  out.rel_err = total > 0 ? static_cast<float>(std::max(0.0, total - kept) / total) : 0.f;
  return out;
}

}  // namespace keel::kv::bellows
