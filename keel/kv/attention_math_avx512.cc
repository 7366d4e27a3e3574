// The AVX-512 level of the attention arithmetic (attention_math_avx512.h has the contract).
#include "keel/kv/attention_math_avx512.h"

#include <immintrin.h>

#include "keel/core/cpu.h"
#include "keel/core/vec_math.h"
#include "keel/kv/attention_math.h"

KEEL_BEGIN_TARGET_AVX512
namespace keel::kv::avx512 {

float DotF32(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return ReduceLanes(acc);
}

// The same per-element operations as the AVX2 AxpyF32 (FMA in lanes, the n % 8 rest scalar),
// hence the same bits.
void AxpyF32(float w, const float* x, float* out, int n) {
  int i = 0;
  const __m512 w16 = _mm512_set1_ps(w);
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(w16, _mm512_loadu_ps(x + i), _mm512_loadu_ps(out + i)));
  }
  if (i + 8 <= n) {
    const __m256 w8 = _mm256_set1_ps(w);
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(w8, _mm256_loadu_ps(x + i), _mm256_loadu_ps(out + i)));
    i += 8;
  }
  for (; i < n; ++i) out[i] += w * x[i];
}

void SoftmaxF32(float* x, int n) {
  if (n <= 0) return;
  // A partial last chunk goes through the same 16-lane code (masked), so every element's bits
  // depend only on its own value, the maximum and the sum, as at the AVX2 level.
  const int full = n / 16 * 16, rest = n - full;
  const __mmask16 tail = static_cast<__mmask16>((1u << rest) - 1u);
  const __m512 tail_x = _mm512_mask_loadu_ps(_mm512_set1_ps(x[0]), tail, x + full);
  __m512 mx = tail_x;
  for (int i = 0; i < full; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + i));
  // (Not _mm512_reduce_max_ps: GCC 12 warns inside it.) The maximum is exact in any order.
  const __m256 m8 = _mm256_max_ps(_mm512_extractf32x8_ps(mx, 0), _mm512_extractf32x8_ps(mx, 1));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const __m512 vmax = _mm512_broadcastss_ps(m4);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < full; i += 16) {
    const __m512 e = keel::avx512::Exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmax));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (rest > 0) {
    const __m512 e = _mm512_maskz_mov_ps(tail, keel::avx512::Exp16(_mm512_sub_ps(tail_x, vmax)));
    _mm512_mask_storeu_ps(x + full, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / ReduceLanes(sum));
  for (int i = 0; i < full; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
  if (rest > 0) _mm512_mask_storeu_ps(x + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + full), inv));
}

}  // namespace keel::kv::avx512
KEEL_END_TARGET
