#include "keel/engine/vector_ops.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "keel/core/cpu.h"
#include "keel/core/vec_math.h"

namespace keel::engine {

namespace vector_ops_detail {

void RmsNormAvx2(const float* x, const float* weight, int n, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = ReduceLanes8(acc);
  for (int j = i; j < n; ++j) ss += x[j] * x[j];
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 s = _mm256_set1_ps(scale);
  for (i = 0; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(s, _mm256_loadu_ps(x + i))));
  }
  for (; i < n; ++i) out[i] = weight[i] * (scale * x[i]);
}

void SiluMulAvx2(float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, Exp8(_mm256_xor_ps(g, sign))));
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    // The tail through the same lanes, so every element's bits are the same wherever it sits.
    alignas(32) float g[8] = {}, u[8] = {};
    for (int64_t j = i; j < n; ++j) g[j - i] = gate[j], u[j - i] = up[j];
    const __m256 gv = _mm256_load_ps(g);
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, Exp8(_mm256_xor_ps(gv, sign))));
    _mm256_store_ps(g, _mm256_mul_ps(silu, _mm256_load_ps(u)));
    for (int64_t j = i; j < n; ++j) gate[j] = g[j - i];
  }
}

}  // namespace vector_ops_detail

void RmsNorm(const float* x, const float* weight, int n, float eps, float* out) {
  if (cpu::ActiveIsa() == cpu::Isa::kAvx512) return vector_ops_detail::RmsNormAvx512(x, weight, n, eps, out);
  vector_ops_detail::RmsNormAvx2(x, weight, n, eps, out);
}

void SiluMul(float* gate, const float* up, int64_t n) {
  const bool avx512 = cpu::ActiveIsa() == cpu::Isa::kAvx512;
  // Chunks are multiples of 16 lanes, so splitting never moves an element into a tail.
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks >= 4)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t from = c * kChunk, len = std::min(kChunk, n - from);
    if (avx512) {
      vector_ops_detail::SiluMulAvx512(gate + from, up + from, len);
    } else {
      vector_ops_detail::SiluMulAvx2(gate + from, up + from, len);
    }
  }
}

}  // namespace keel::engine
