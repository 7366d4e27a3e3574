// The MatMul driver and register tile, written once over a vector-width policy V (matmul.cc:
// AVX2, matmul_avx512.cc: AVX-512). Included by exactly those two files, the second inside its
// AVX-512 target region; everything here has internal linkage so the two copies never share a
// symbol (keel/core/cpu.h). Includes nothing: its includers bring immintrin, omp and the types.
#ifndef KEEL_ENGINE_MATMUL_KERNEL_H_
#define KEEL_ENGINE_MATMUL_KERNEL_H_

namespace keel::engine {
namespace {

// Element i of a stored weight row (rows may sit at odd byte offsets in a safetensors map).
template <DType T>
[[gnu::always_inline]] inline float WeightAt(const uint8_t* row, int64_t i) {
  if constexpr (T == DType::kF32) {
    float f;
    std::memcpy(&f, row + 4 * i, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    return T == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h);
  }
}

// y[b * y_stride + r] = V::Reduce(acc[r][b]), the same bits: the sums of as many activation rows
// as fit one batched reduction (V::ReduceN, a third of the instructions of one at a time), each
// row's R sums stored by V::StoreRow; shapes V does not batch (V::kBatchRows) one at a time.
template <class V, int R, int B, int B0, int kPer>
[[gnu::always_inline]] inline void StoreRows(const typename V::F (&acc)[R][B], float* y, int64_t y_stride) {
  if constexpr (B0 < B) {
    constexpr int nb = std::min(kPer, B - B0);
    typename V::F t[nb * R];
#pragma GCC unroll 16
    for (int b = 0; b < nb; ++b)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) t[b * R + r] = acc[r][B0 + b];
    const typename V::F v = V::template ReduceN<nb * R>(t);
    [&]<int... b>(std::integer_sequence<int, b...>) {
      (V::template StoreRow<R, b>(v, y + (B0 + b) * y_stride), ...);
    }(std::make_integer_sequence<int, nb>{});
    StoreRows<V, R, B, B0 + nb, kPer>(acc, y, y_stride);
  }
}

template <class V, int R, int B>
[[gnu::always_inline]] inline void StoreSums(const typename V::F (&acc)[R][B], float* y, int64_t y_stride) {
  if constexpr (V::template kBatchRows<R>) {
    StoreRows<V, R, B, 0, std::min(B, V::kLanes / R)>(acc, y, y_stride);
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) y[b * y_stride + r] = V::Reduce(acc[r][b]);
  }
}

// R weight rows x B activation rows: R*B accumulators, each weight vector widened once and used
// by every activation row. pf_delta (0: none): the distance from a row of this group to the same
// row of the next group; that row is prefetched into L1 a line per step so the next group's DRAM
// traffic overlaps this group's FMAs. Not inlined: on its own the accumulators stay in registers.
template <class V, DType T, int R, int B>
[[gnu::noinline]] void Tile(const uint8_t* const* w, const float* const* x, int64_t n, float* y, int64_t y_stride,
                            int64_t pf_delta) {
  constexpr int64_t kElem = T == DType::kF32 ? 4 : 2;
  typename V::F acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[r][b] = V::Zero();
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    if (pf_delta != 0 && ((i * kElem) & 63) == 0) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) PrefetchL1(w[r] + pf_delta + i * kElem);
    }
    // B activation vectors live, one weight vector at a time: R*B + B + 1 registers.
    typename V::F xv[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) xv[b] = V::LoadX(x[b] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const typename V::F wv = V::template LoadW<T>(w[r] + i * kElem);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[r][b] = V::Fma(wv, xv[b], acc[r][b]);
    }
  }
  if (i == n) return StoreSums<V, R, B>(acc, y, y_stride);
  // Unrolled too: an accumulator indexed at run time would live in memory all along.
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      float s = V::Reduce(acc[r][b]);
      for (int64_t j = i; j < n; ++j) s += WeightAt<T>(w[r], j) * x[b][j];
      y[b * y_stride + r] = s;
    }
  }
}

// Activation-row tails of a tile (nb < TA) get their own instantiations; weight-row tails (the
// last group of a matrix with fewer than GR rows) run one row at a time.
template <class V, DType T, int R, int TA>
[[gnu::always_inline]] inline void TileB(int nb, const uint8_t* const* w, const float* const* x, int64_t n, float* y,
                                         int64_t y_stride, int64_t pf_delta) {
  if (nb == TA) return Tile<V, T, R, TA>(w, x, n, y, y_stride, pf_delta);
  if constexpr (TA > 1) TileB<V, T, R, TA - 1>(nb, w, x, n, y, y_stride, pf_delta);
}

// Activation rows per chunk: about this many bytes of them stay in L2 while weights stream past.
constexpr int64_t kChunkBytes = 192 * 1024;

// GR weight rows per group (they stay in L1 while a chunk of activation rows streams past them
// from L2, TA rows per tile): every tile loads TA activation vectors per GR*TA FMAs.
template <class V, DType T, int GR, int TA>
void Run(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  const int64_t in_dim = ws[0].cols;
  const int64_t row_bytes = in_dim * static_cast<int64_t>(DTypeSize(T));
  int64_t total_groups = 0, work = 0;
  for (int j = 0; j < count; ++j) {
    total_groups += (ws[j].rows + GR - 1) / GR;
    work += ws[j].rows * in_dim * n_rows;
  }
  const int64_t chunk = std::max<int64_t>(TA, kChunkBytes / (in_dim * 4) / TA * TA);
  // Threads only pay off once there is real work per call (tiny models run single-threaded).
  const bool parallel = work >= (1 << 18);
#pragma omp parallel if (parallel)
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t g_begin = total_groups * tid / nt, g_end = total_groups * (tid + 1) / nt;
    for (int64_t c0 = 0; c0 < n_rows; c0 += chunk) {
      const int64_t c1 = std::min<int64_t>(n_rows, c0 + chunk);
      // Walk this thread's groups: matrix j, first row o.
      int j = 0;
      int64_t g_in = g_begin;
      while (g_in >= (ws[j].rows + GR - 1) / GR) g_in -= (ws[j++].rows + GR - 1) / GR;
      for (int64_t g = g_begin; g < g_end; ++g) {
        const TensorView& w = ws[j];
        const int64_t o = g_in * GR;
        const int nr = static_cast<int>(std::min<int64_t>(GR, w.rows - o));
        const auto* base = static_cast<const uint8_t*>(w.data);
        const uint8_t* rows[GR];
        for (int r = 0; r < nr; ++r) rows[r] = base + (o + r) * row_bytes;
        // The next group: the rest of this matrix, else the next matrix's first rows.
        const uint8_t* pf = nullptr;
        if (g + 1 < total_groups) {
          pf = o + GR < w.rows ? base + (o + GR) * row_bytes : static_cast<const uint8_t*>(ws[j + 1].data);
        }
        float* y = ys[j];
        for (int64_t b = c0; b < c1; b += TA) {
          const int nb = static_cast<int>(std::min<int64_t>(TA, c1 - b));
          const float* xs[TA];
          for (int k = 0; k < nb; ++k) xs[k] = x + (b + k) * in_dim;
          // Only the first tile of a group prefetches (later tiles find the weights in L1).
          const int64_t pf_delta = b == c0 && pf != nullptr ? pf - rows[0] : 0;
          if (nr == GR) {
            TileB<V, T, GR, TA>(nb, rows, xs, in_dim, y + b * w.rows + o, w.rows, pf_delta);
          } else {
            for (int r = 0; r < nr; ++r)
              TileB<V, T, 1, TA>(nb, rows + r, xs, in_dim, y + b * w.rows + o + r, w.rows, 0);
          }
        }
        if (++g_in == (w.rows + GR - 1) / GR) {
          g_in = 0;
          ++j;
        }
      }
    }
  }
}

// The tile shape, measured on Zen 5 (bench/engine/matmul_bench, one thread, 2048x768 x 64 rows):
// AVX-512 6x4 ~185 GFLOP/s, 4x6 ~175, 4x4 ~170, 8x3 ~150; AVX2 (16 registers) 4x2 ~80, 4x4 ~68
// (spills). The group's weight rows should stay in L1 next to the activation tile.
template <class V, DType T>
void RunShaped(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  const int64_t row_bytes = ws[0].cols * static_cast<int64_t>(DTypeSize(T));
  if constexpr (V::kWide) {
    if (6 * row_bytes <= 40 * 1024) return Run<V, T, 6, 4>(ws, ys, count, x, n_rows);
    return Run<V, T, 4, 6>(ws, ys, count, x, n_rows);
  } else {
    return Run<V, T, 4, 2>(ws, ys, count, x, n_rows);
  }
}

template <class V>
void RunAny(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  switch (ws[0].dtype) {
    case DType::kF32: return RunShaped<V, DType::kF32>(ws, ys, count, x, n_rows);
    case DType::kF16: return RunShaped<V, DType::kF16>(ws, ys, count, x, n_rows);
    case DType::kBF16: return RunShaped<V, DType::kBF16>(ws, ys, count, x, n_rows);
  }
}

}  // namespace
}  // namespace keel::engine

#endif  // KEEL_ENGINE_MATMUL_KERNEL_H_
