// The arithmetic every codec's attention shares. A lossless codec decodes into fp32 rows and
// calls these same functions in the same order, which is what makes its output bit-identical
// to the raw codec's.
#pragma once

#include <immintrin.h>

#include <cstddef>

namespace keel::kv {

// Sum of 8 lanes: (lo half + hi half), then two horizontal adds. Every reduction in attention
// (DotF32, the core's scores, the softmax sum) uses this order.
inline float ReduceLanes(__m256 acc) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// Dot product with a fixed 8-lane AVX2 accumulation order (deterministic for a given n).
float DotF32(const float* a, const float* b, int n);
// out[i] += w * x[i]
void AxpyF32(float w, const float* x, float* out, int n);
// In-place softmax over n scores: exp(x - max) / sum, with a vectorised exp (ExpF32) and an
// 8-lane sum; deterministic for a given n and input.
void SoftmaxF32(float* x, int n);
// The exp the softmax uses (relative error ~1e-7; 0 below -87.3).
float ExpF32(float x);

}  // namespace keel::kv
