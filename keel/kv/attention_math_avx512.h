// AVX-512 variants of the attention arithmetic (attention_math.h), in their own namespace and
// compiled for AVX-512 wherever this header is included (its own target region), so that no
// baseline function ever shares a symbol or an inline body with them. Called only when
// cpu::ActiveIsa() is kAvx512: attention_math.cc dispatches, the AVX-512 core calls them directly.
#pragma once

#include <immintrin.h>

#include "keel/core/cpu.h"
#include "keel/kv/attention_math.h"

KEEL_BEGIN_TARGET_AVX512
namespace keel::kv::avx512 {

// Sum of 16 lanes: the two 8-lane halves added (low + high), then ReduceLanes' order. Every
// reduction at the AVX-512 level (DotF32, the core's scores, the softmax sum) uses this order.
inline float ReduceLanes(__m512 acc) {
  return keel::kv::ReduceLanes(_mm256_add_ps(_mm512_extractf32x8_ps(acc, 0), _mm512_extractf32x8_ps(acc, 1)));
}

// Exp8 (keel/core/vec_math.h) in 16 lanes, operation for operation: the same bits per element.
inline __m512 Exp16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), p, _mm512_castsi512_ps(e));
}

// The AVX-512 level of DotF32 (n % 16 == 0 only), AxpyF32 and SoftmaxF32 (attention_math.h).
float DotF32(const float* a, const float* b, int n);
void AxpyF32(float w, const float* x, float* out, int n);
void SoftmaxF32(float* x, int n);

}  // namespace keel::kv::avx512
KEEL_END_TARGET
