#include "keel/engine/matmul.h"

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

namespace keel::engine {
namespace {

// The baseline level: 8 lanes, reduced as ReduceLanes8 (keel/core/vec_math.h).
struct Avx2 {
  using F = __m256;
  static constexpr bool kWide = false;  // 32 vector registers: bigger tiles
  static constexpr int kLanes = 8;
  static F Zero() { return _mm256_setzero_ps(); }
  static F LoadX(const float* p) { return _mm256_loadu_ps(p); }
  template <DType T>
  static F LoadW(const uint8_t* p) {
    if constexpr (T == DType::kF32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (T == DType::kF16) return _mm256_cvtph_ps(h);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float Reduce(F v) { return ReduceLanes8(v); }
  // The batched reduction (ReduceLanes8xN, the same bits as Reduce one at a time) and how Tile
  // stores a row's R sums from it (matmul_kernel.h, StoreSums).
  template <int R>
  static constexpr bool kBatchRows = R == 2 || R == 4 || R == 8;
  template <int N>
  [[gnu::always_inline]] static F ReduceN(const F* a) { return ReduceLanes8xN<N>(a); }
  // Lanes [k R, k R + R) of v to y[0..R).
  template <int R, int k>
  [[gnu::always_inline]] static void StoreRow(F v, float* y) { StoreLanes8<R, k * R>(v, y); }
};

}  // namespace
}  // namespace keel::engine

#include "keel/engine/matmul_kernel.h"

namespace keel::engine {

namespace matmul_detail {
void RunAvx2(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  RunAny<Avx2>(ws, ys, count, x, n_rows);
}
}  // namespace matmul_detail

namespace {
void Dispatch(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  if (cpu::ActiveIsa() == cpu::Isa::kAvx512) {
    matmul_detail::RunAvx512(ws, ys, count, x, n_rows);
  } else {
    matmul_detail::RunAvx2(ws, ys, count, x, n_rows);
  }
}
}  // namespace

void MatMul(const TensorView& w, const float* x, int n_rows, float* y) {
  if (n_rows <= 0 || w.rows <= 0) return;
  Dispatch(&w, &y, 1, x, n_rows);
}

void MatMulSameInput(std::span<const TensorView> ws, const float* x, int n_rows, std::span<float* const> ys) {
  if (n_rows <= 0 || ws.empty()) return;
  bool same = true;
  for (const TensorView& w : ws) same = same && w.cols == ws[0].cols && w.dtype == ws[0].dtype && w.rows > 0;
  if (!same) {
    for (size_t j = 0; j < ws.size(); ++j) MatMul(ws[j], x, n_rows, ys[j]);
    return;
  }
  Dispatch(ws.data(), ys.data(), static_cast<int>(ws.size()), x, n_rows);
}

}  // namespace keel::engine
