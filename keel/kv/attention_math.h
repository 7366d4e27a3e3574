// The arithmetic every codec's attention shares. A lossless codec decodes into fp32 rows and
// calls these same functions in the same order, which is what makes its output bit-identical
// to the raw codec's. DotF32, AxpyF32 and SoftmaxF32 run at the CPU level in force
// (cpu::ActiveIsa(), one branch per call); each level has its own fixed order (below), so results
// are deterministic within a level and may differ in the last bits between levels.
#pragma once

#include <immintrin.h>

#include <cstddef>

#include "keel/core/vec_math.h"

namespace keel::kv {

// Sum of 8 lanes: (lo half + hi half), then two horizontal adds. Every reduction in attention
// (DotF32, the core's scores, the softmax sum) uses this order.
inline float ReduceLanes(__m256 acc) { return keel::ReduceLanes8(acc); }

// Dot product. AVX2: one 8-lane FMA accumulator over 8-element chunks in order, ReduceLanes,
// then the n % 8 rest added one by one. AVX-512 with n % 16 == 0: one 16-lane accumulator over
// 16-element chunks in order, avx512::ReduceLanes; other n at AVX-512 take the AVX2 order.
float DotF32(const float* a, const float* b, int n);
// out[i] += w * x[i]: element-wise, so the same bits at every level.
void AxpyF32(float w, const float* x, float* out, int n);
// In-place softmax over n scores: exp(x - max) / sum, with a vectorised exp (ExpF32; the same
// bits per element at every level) and a sum of 8 lanes (AVX2) or 16 lanes (AVX-512) over the
// chunks in order, the partial last chunk last; deterministic for a given n, input and level.
void SoftmaxF32(float* x, int n);
// The exp the softmax uses (relative error ~1e-7; 0 below -87.3).
float ExpF32(float x);

}  // namespace keel::kv
