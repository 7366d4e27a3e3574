// BellowsKV offline solver: from calibration samples of one layer group to the compress matrix C
// and the per-layer restore matrices R (see calibration.h for how they are used at run time).
//
// Method: reduced-rank ridge regression. Per token, X = concat of the group's layer inputs
// (n*dim) and Y = concat over the group's layers of [k_pre_l, v_l] (2*n*kv_dim). Targets are
// centered and whitened by a block-diagonal M (the objective, below): Y~ = (Y - mean) M. Then
//   B  = (Xc^T Xc + lambda I)^-1 Xc^T Y~          lambda = ridge * mean diagonal of Xc^T Xc / N
//   Vr = top-r right singular vectors of Xc B    (rank-deficient X: pseudo-inverse, no NaN)
//   C  = B Vr,   R = Vr^T M^-1,   z = (X - x_mean) C,   Y ~ mean + z R
// which minimises ||(Y - mean - Xc C R) M||_F over rank-r C R (exactly so when ridge = 0).
// Split latent: K and V targets are solved as two such problems with ranks rank_k and rank_v
// and share one latent vector: K reads [0, rank_k), V reads [rank_k, rank_k + rank_v).
//
// Objectives (M per layer, each block scaled to mean weight 1 so that only the shape within a
// block changes; equalize_blocks additionally scales every (layer, K|V) block to the same
// weighted energy, which makes the objective a sum of relative errors):
//   kPlain           M = I.
//   kAttentionAware  K: per RoPE pair j of KV head g, weight w = E[q_2j^2 + q_2j+1^2] summed over
//                    the query heads reading g (the query energy; rotation-invariant, so pre-RoPE
//                    q and k serve), M = diag(sqrt(w)) on both elements of the pair.
//                    V: for KV head g, G_g = sum over the query heads h reading g of Wo_h^T Wo_h
//                    (Wo_h = the output-projection columns of head h), M = G_g^(1/2). The error
//                    ||dv M||^2 = dv G dv^T is the error the output projection sees.
//                    Weights below 1e-6 of a block's mean are raised to it, so M^-1 exists.
//
// Statistics are streamed (GroupStats): one pass over the samples accumulates the second moments
// of [X Y] in double (a BLAS rank-k update per 256 rows, data shifted by an early mean estimate
// against cancellation) and the query energies, so N need not fit in memory as doubles and the
// solve never touches the rows again. Cost: N (p+q)^2 flops for the statistics (p = n*dim,
// q = 2*n*kv_dim), O(p^3 + p^2 q + min(p,q)^3) for the solve.
//
// Thread safety: GroupStats is a value (not thread-safe to Add from several threads); SolveGroup
// is a pure function. LAPACK/BLAS run on their own (OpenMP) threads.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/kv/bellows/calibration.h"

namespace keel::kv::bellows {

// What the solver returns: one group of a Calibration (errors measured on the samples).
using GroupMatrices = CalibrationGroup;

struct GroupDims {
  int first_layer = 0;  // model layer index of the group's first layer (copied to the result)
  int n_layers = 0;     // layers in the group
  int dim = 0;          // model dim: width of a layer input x
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;     // even (RoPE pairs)
  int kv_dim() const { return n_kv_heads * head_dim; }
  int q_dim() const { return n_heads * head_dim; }
  int in_dim() const { return n_layers * dim; }            // p: width of X
  int out_dim() const { return 2 * n_layers * kv_dim(); }  // q: width of Y
};

// One layer's rows, all row-major with the same row count. Spans carry sizes, so a mismatch is
// an error and not a wild read.
struct LayerSamples {
  std::span<const float> x;      // [n_rows][dim]    layer input (after the attention RMSNorm)
  std::span<const float> k_pre;  // [n_rows][kv_dim] K before RoPE, interleaved pairs
  std::span<const float> v;      // [n_rows][kv_dim]
  std::span<const float> q_pre;  // [n_rows][q_dim]  Q before RoPE; may be empty for kPlain
  std::span<const float> wo;     // [dim][q_dim] row-major [out][in]; may be empty for kPlain
};

struct GroupSamples {
  GroupDims dims;
  int64_t n_rows = 0;
  std::vector<LayerSamples> layers;  // layers[i] is layer dims.first_layer + i
};

enum class Objective { kPlain, kAttentionAware };

struct SolveOptions {
  // Joint latent: rank > 0 and rank_k = rank_v = 0; K and V both restore from [0, rank).
  // Split latent: rank = 0, rank_k > 0, rank_v > 0.
  int rank = 0;
  int rank_k = 0;
  int rank_v = 0;
  double ridge = 1e-6;  // relative to the mean diagonal of Xc^T Xc / N; >= 0
  Objective objective = Objective::kPlain;
  bool equalize_blocks = false;  // every (layer, K|V) block to the same (weighted) energy
  bool center = true;            // false: no means (x_mean, k_mean, v_mean are zero)
};

// Progress of long steps: `stage` ("accumulate", "eigen", "solve", "errors") and the fraction
// of it done, 0..1. Called from the calling thread only.
using ProgressFn = std::function<void(std::string_view stage, double fraction)>;

// Streaming second moments of one group's samples.
class GroupStats {
 public:
  // InvalidArgument for bad dims (non-positive, odd head_dim, n_heads % n_kv_heads != 0, too big).
  static Result<GroupStats> Create(const GroupDims& dims);

  // Adds a batch (batch.dims must equal dims()). Every layer's x, k_pre, v must hold n_rows rows;
  // q_pre is either given for every batch (needed by kAttentionAware) or for none.
  // InvalidArgument naming the layer and the array otherwise, or for non-finite values.
  Status Add(const GroupSamples& batch, const ProgressFn& progress = {});

  const GroupDims& dims() const { return dims_; }
  int64_t n_rows() const { return n_rows_; }
  bool has_queries() const { return q_rows_ == n_rows_ && n_rows_ > 0; }

  // Internals for SolveGroup (column-major, upper triangle valid).
  const std::vector<double>& gram() const { return gram_; }
  const std::vector<double>& shift() const { return shift_; }
  const std::vector<double>& shifted_sum() const { return sum_; }
  const std::vector<double>& query_energy() const { return q_energy_; }  // [n_layers][q_dim] sums

 private:
  explicit GroupStats(const GroupDims& d);
  GroupDims dims_;
  int64_t n_rows_ = 0;
  int64_t q_rows_ = 0;
  std::vector<double> shift_;     // [p+q]
  std::vector<double> sum_;       // [p+q] sum of shifted rows
  std::vector<double> gram_;      // [(p+q)^2] sum of shifted outer products (column-major, upper)
  std::vector<double> q_energy_;  // [n_layers*q_dim] sum of q^2
};

// Solves one group from accumulated statistics. `wo` holds each layer's output projection
// ([dim][q_dim]) for kAttentionAware and may be empty for kPlain. InvalidArgument for bad
// options (ranks out of range, negative ridge, missing queries or Wo) with a message naming the
// option and its bounds, or when there are fewer than 2 sample rows.
Result<GroupMatrices> SolveGroup(const GroupStats& stats, const std::vector<std::span<const float>>& wo,
                                 const SolveOptions& opts, const ProgressFn& progress = {});

// Accumulates `samples` and solves (wo from samples.layers[i].wo).
Result<GroupMatrices> SolveGroup(const GroupSamples& samples, const SolveOptions& opts,
                                 const ProgressFn& progress = {});

// Baseline "store the layer input": a PCA of one layer's input x. z = (x - x_mean) C,
// x ~ x_mean + z R; the runtime restores K = x~ Wk^T, V = x~ Wv^T. Lossless at rank = dim.
// Per-layer low-rank K/V (Palu-style) is SolveGroup on a group of one layer, kPlain.
struct InputPca {
  std::vector<float> x_mean;  // [dim]
  std::vector<float> compress;  // C [dim][rank]
  std::vector<float> restore;   // R [rank][dim] (= C^T: the components are orthonormal)
  float rel_err = 0.f;          // relative reconstruction error of x on the samples (centered)
};
// `x` is [n_rows][dim]. InvalidArgument for rank outside [1, dim], a size mismatch, < 2 rows.
Result<InputPca> SolveInputPca(std::span<const float> x, int64_t n_rows, int dim, int rank,
                               const ProgressFn& progress = {});

}  // namespace keel::kv::bellows
