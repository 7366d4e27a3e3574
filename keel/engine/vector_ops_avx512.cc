// The AVX-512 level of vector_ops.h: 16 lanes; the sum of squares reduces 16 -> 8 lanes (low +
// high), then as the AVX2 level does.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "keel/core/cpu.h"
#include "keel/engine/vector_ops.h"
#include "keel/core/vec_math.h"

KEEL_BEGIN_TARGET_AVX512

namespace keel::engine::vector_ops_detail {

void RmsNormAvx512(const float* x, const float* weight, int n, float eps, float* out) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float ss = avx512::ReduceLanes16(acc);
  for (int j = i; j < n; ++j) ss += x[j] * x[j];
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m512 s = _mm512_set1_ps(scale);
  for (i = 0; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(weight + i), _mm512_mul_ps(s, _mm512_loadu_ps(x + i))));
  }
  for (; i < n; ++i) out[i] = weight[i] * (scale * x[i]);
}

void SiluMulAvx512(float* gate, const float* up, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 16) {
    // A masked tail: the same lanes, so every element's bits are the same wherever it sits.
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, avx512::Exp16(_mm512_xor_ps(g, sign))));
    _mm512_mask_storeu_ps(gate + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, up + i)));
  }
}

}  // namespace keel::engine::vector_ops_detail

KEEL_END_TARGET
