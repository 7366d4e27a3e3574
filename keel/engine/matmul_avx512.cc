// The AVX-512 MatMul kernel (keel/engine/matmul.h): 16 lanes, reduced as ReduceLanes16
// (keel/core/vec_math.h).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "keel/core/cpu.h"
#include "keel/core/dtype.h"
#include "keel/core/prefetch.h"
#include "keel/core/vec_math.h"
#include "keel/engine/matmul.h"

KEEL_BEGIN_TARGET_AVX512

namespace keel::engine {
namespace {

struct Avx512 {
  using F = __m512;
  static constexpr bool kWide = true;  // 32 vector registers: bigger tiles
  static constexpr int kLanes = 16;
  static F Zero() { return _mm512_setzero_ps(); }
  static F LoadX(const float* p) { return _mm512_loadu_ps(p); }
  template <DType T>
  static F LoadW(const uint8_t* p) {
    if constexpr (T == DType::kF32) {
      return _mm512_loadu_ps(p);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if constexpr (T == DType::kF16) return _mm512_cvtph_ps(h);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float Reduce(F v) { return avx512::ReduceLanes16(v); }
  // y[b * y_stride + r] = Reduce(acc[r][b]), the same bits, for as many activation rows at once as
  // fit 16 lanes (avx512::ReduceLanes16xN), each row's R sums stored by one masked store: a third
  // fewer instructions than R*B reductions, and no store-to-load round trip through a buffer.
  template <int R, int B>
  [[gnu::always_inline]] static void StoreSums(const F (&acc)[R][B], float* y, int64_t y_stride) {
    if constexpr (R < 4 || R > 16) {
      // Too few sums per row to fill a reduction's lanes (the row-tail tiles).
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) y[b * y_stride + r] = Reduce(acc[r][b]);
    } else {
      StoreRows<R, B, 0, std::min(B, 16 / R)>(acc, y, y_stride);
    }
  }
  template <int R, int B, int B0, int kPer>
  [[gnu::always_inline]] static void StoreRows(const F (&acc)[R][B], float* y, int64_t y_stride) {
    if constexpr (B0 < B) {
      constexpr int nb = std::min(kPer, B - B0);
      F t[nb * R];
#pragma GCC unroll 16
      for (int b = 0; b < nb; ++b)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) t[b * R + r] = acc[r][B0 + b];
      const __m512i v = _mm512_castps_si512(avx512::ReduceLanes16xN<nb * R>(t));
      StoreRow<R, 0>(v, y + B0 * y_stride);
      if constexpr (nb > 1) StoreRow<R, 1>(v, y + (B0 + 1) * y_stride);
      if constexpr (nb > 2) StoreRow<R, 2>(v, y + (B0 + 2) * y_stride);
      if constexpr (nb > 3) StoreRow<R, 3>(v, y + (B0 + 3) * y_stride);
      static_assert(nb <= 4, "R >= 4: at most four rows per reduction");
      StoreRows<R, B, B0 + nb, kPer>(acc, y, y_stride);
    }
  }
  // Lanes [k R, k R + R) of v to y[0..R).
  template <int R, int k>
  [[gnu::always_inline]] static void StoreRow(__m512i v, float* y) {
    if constexpr (k > 0) v = _mm512_maskz_alignr_epi32(0xFFFF, v, v, k * R);
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << R) - 1), _mm512_castsi512_ps(v));
  }
};

}  // namespace
}  // namespace keel::engine

#include "keel/engine/matmul_kernel.h"

namespace keel::engine::matmul_detail {
void RunAvx512(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  RunAny<Avx512>(ws, ys, count, x, n_rows);
}
}  // namespace keel::engine::matmul_detail

KEEL_END_TARGET
