// 8-lane float math shared by attention (keel/kv) and sampling (keel/engine). Inline so each
// caller's loop keeps it in registers; deterministic: the same inputs give the same bits on any
// AVX2/FMA CPU, which the codecs' bit-identity relies on.
#pragma once

#include <immintrin.h>

#include "keel/core/cpu.h"

namespace keel {

// Sum of 8 lanes: (low half + high half), then two horizontal adds. The one 8-lane reduction order
// (attention's ReduceLanes, MatMul and RmsNorm at the AVX2 level).
inline float ReduceLanes8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// ReduceLanes8 of N <= 8 vectors at once: lane k of the result is ReduceLanes8(v[k]), bit for bit
// (the same additions in the same order), lanes k >= N are 0: a transpose of 7 folds (two
// shuffles and an add each) where 8 reductions cost about 7 instructions each. The AVX-512
// level's is avx512::ReduceLanes16xN.
template <int N>
[[gnu::always_inline]] inline __m256 ReduceLanes8xN(const __m256* v) {
  static_assert(N >= 1 && N <= 8);
  __m256 a[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) a[k] = k < N ? v[k] : _mm256_setzero_ps();
  // (low 4 + high 4): 128-bit lane j of c[k] holds a[2k + j]'s 4 sums.
  __m256 c[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    c[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x31));
  }
  // The two horizontal adds within 128-bit lanes: lane j of f holds a[j], a[2 + j], a[4 + j], a[6 + j].
  const __m256 e0 = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
  const __m256 e1 = _mm256_add_ps(_mm256_shuffle_ps(c[2], c[3], 0x88), _mm256_shuffle_ps(c[2], c[3], 0xDD));
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(e0, e1, 0x88), _mm256_shuffle_ps(e0, e1, 0xDD));
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Lanes [k, k + n) of v to out[0..n), n in 1, 2, 4, 8 (k a multiple of n).
template <int n, int k>
[[gnu::always_inline]] inline void StoreLanes8(__m256 v, float* out) {
  static_assert(n == 1 || n == 2 || n == 4 || n == 8);
  static_assert(k % n == 0 && k + n <= 8);
  if constexpr (n == 8) {
    _mm256_storeu_ps(out, v);
  } else {
    const __m128 h = k < 4 ? _mm256_castps256_ps128(v) : _mm256_extractf128_ps(v, 1);
    constexpr int j = k % 4;
    if constexpr (n == 4) {
      _mm_storeu_ps(out, h);
    } else if constexpr (n == 2) {
      _mm_storel_pi(reinterpret_cast<__m64*>(out), j == 0 ? h : _mm_movehl_ps(h, h));
    } else {
      _mm_store_ss(out, _mm_shuffle_ps(h, h, j));
    }
  }
}

// exp(x) for 8 lanes: Cephes' expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp);
// lanes below -87.3 give 0.
inline __m256 Exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

}  // namespace keel

// The AVX-512 level (keel/core/cpu.h): compiled for AVX-512 wherever this is included, called only
// from AVX-512 kernels.
KEEL_BEGIN_TARGET_AVX512
namespace keel::avx512 {

// Exp8 in 16 lanes, operation for operation: the same bits per element as Exp8.
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

// Sum of 16 lanes: low + high 8-lane halves, then (low + high 4), then two horizontal adds.
inline float ReduceLanes16(__m512 v) {
  return ReduceLanes8(_mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1)));
}

// 128-bit lanes of a and b picked by kImm (vshuff32x4; the maskz form with every lane kept,
// because GCC 12 warns of its own undefined source operand in the unmasked one).
template <int kImm>
[[gnu::always_inline]] inline __m512 Shuffle128(__m512 a, __m512 b) {
  return _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, kImm);
}

// Lanes [k, k + n) of v to out[0..n) (the AVX-512 twin of StoreLanes8): one masked store, after
// a rotation when k > 0.
template <int n, int k>
[[gnu::always_inline]] inline void StoreLanes16(__m512 v, float* out) {
  static_assert(n >= 1 && k >= 0 && k + n <= 16);
  __m512i u = _mm512_castps_si512(v);
  if constexpr (k > 0) u = _mm512_maskz_alignr_epi32(0xFFFF, u, u, k);  // maskz: see Shuffle128
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), _mm512_castsi512_ps(u));
}

// ReduceLanes16 of N <= 16 vectors at once: lane k of the result is ReduceLanes16(v[k]), bit for
// bit (each sum takes the same additions in the same order), lanes k >= N are 0. A transpose:
// four levels of folding two vectors into one (15 folds of two shuffles and an add), where 16
// separate reductions cost about 10 instructions each. Tiles that reduce many accumulators at the
// end (MatMul's, attention's scores) spent a third of their instructions there at small widths.
template <int N>
[[gnu::always_inline]] inline __m512 ReduceLanes16xN(const __m512* v) {
  static_assert(N >= 1 && N <= 16);
  __m512 a[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) a[k] = k < N ? v[k] : _mm512_setzero_ps();
  // Level 1, ReduceLanes16's halves: c[k] = a[2k] lanes i + i+8 | a[2k+1]'s.
  __m512 c[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    c[k] = _mm512_add_ps(Shuffle128<0x44>(a[2 * k], a[2 * k + 1]),
                         Shuffle128<0xEE>(a[2 * k], a[2 * k + 1]));
  }
  // Level 2, ReduceLanes8's (low + high 4): 128-bit lane j of d[m] holds a[4m + j]'s 4 sums.
  __m512 d[4];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    d[m] = _mm512_add_ps(Shuffle128<0x88>(c[2 * m], c[2 * m + 1]),
                         Shuffle128<0xDD>(c[2 * m], c[2 * m + 1]));
  }
  // Levels 3 and 4, the two horizontal adds (x0 + x1, x2 + x3; then their sum), within 128-bit
  // lanes: lane j of f holds a[j], a[4 + j], a[8 + j], a[12 + j].
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_ps(d[2], d[3], 0x88), _mm512_shuffle_ps(d[2], d[3], 0xDD));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e0, e1, 0x88), _mm512_shuffle_ps(e0, e1, 0xDD));
  // (maskz with every lane kept: see Shuffle128.)
  return _mm512_maskz_permutexvar_ps(0xFFFF, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

}  // namespace keel::avx512
KEEL_END_TARGET
