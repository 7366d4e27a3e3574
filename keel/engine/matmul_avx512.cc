// The AVX-512 MatMul kernel (keel/engine/matmul.h): 16 lanes, reduced as ReduceLanes16
// (keel/core/vec_math.h).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

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
  // The batched reduction (avx512::ReduceLanes16xN, the same bits as Reduce one at a time) and how
  // Tile stores a row's R sums from it: one masked store (matmul_kernel.h, StoreSums). Rows of
  // fewer than 4 sums (the row-tail tiles) would leave most lanes empty.
  template <int R>
  static constexpr bool kBatchRows = R >= 4 && R <= 16;
  template <int N>
  [[gnu::always_inline]] static F ReduceN(const F* a) { return avx512::ReduceLanes16xN<N>(a); }
  // Lanes [k R, k R + R) of v to y[0..R).
  template <int R, int k>
  [[gnu::always_inline]] static void StoreRow(F v, float* y) { avx512::StoreLanes16<R, k * R>(v, y); }
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
