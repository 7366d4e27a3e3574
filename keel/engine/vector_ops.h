// Element-wise and per-row helpers of the forward pass, one kernel per CPU level
// (keel/core/cpu.h), chosen per call. Within a level each is deterministic: an element's result
// depends only on its inputs (and, for RmsNorm, on its row), never on the batch size or threads.
#pragma once

#include <cstdint>

namespace keel::engine {

// out[i] = weight[i] * x[i] / sqrt(mean(x^2) + eps) for one row of n values (out may alias x).
void RmsNorm(const float* x, const float* weight, int n, float eps, float* out);

// gate[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], i < n: SwiGLU's
// activation, with the vectorised exp of keel/core/vec_math.h. Threads for large n.
void SiluMul(float* gate, const float* up, int64_t n);

namespace vector_ops_detail {
void RmsNormAvx2(const float* x, const float* weight, int n, float eps, float* out);
void RmsNormAvx512(const float* x, const float* weight, int n, float eps, float* out);
void SiluMulAvx2(float* gate, const float* up, int64_t n);
void SiluMulAvx512(float* gate, const float* up, int64_t n);
}  // namespace vector_ops_detail

}  // namespace keel::engine
