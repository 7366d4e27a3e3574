// The MatMul driver and register tile, written once over a vector-width policy V (matmul.cc:
// AVX2, matmul_avx512.cc: AVX-512). Included by exactly those two files, the second inside its
// AVX-512 target region; everything here has internal linkage so the two copies never share a
// symbol (keel/core/cpu.h). Includes nothing: its includers bring immintrin, omp and the types.
#ifndef KEEL_ENGINE_MATMUL_KERNEL_H_
#define KEEL_ENGINE_MATMUL_KERNEL_H_

namespace keel::engine {
namespace {

// R weight rows x B activation rows: R*B accumulators, each weight vector widened once and used
// by every activation row. `pf` (may be null): the next group's first row, prefetched into L1 a
// line per row per step so the next group's DRAM traffic overlaps this group's FMAs.
template <class V, DType T, int R, int B>
[[gnu::always_inline]] inline void Tile(const uint8_t* const* w, const float* const* x, int64_t n, float* y,
                                        int64_t y_stride, const uint8_t* pf, int64_t row_bytes) {
  constexpr int64_t kElem = T == DType::kF32 ? 4 : 2;
  typename V::F acc[R][B];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[r][b] = V::Zero();
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    if (pf != nullptr && ((i * kElem) & 63) == 0) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) PrefetchL1(pf + r * row_bytes + i * kElem);
    }
    typename V::F wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = V::template LoadW<T>(w[r] + i * kElem);
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      const typename V::F xv = V::LoadX(x[b] + i);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][b] = V::Fma(wv[r], xv, acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      float s = V::Reduce(acc[r][b]);
      for (int64_t j = i; j < n; ++j) s += V::template ScalarW<T>(w[r], j) * x[b][j];
      y[b * y_stride + r] = s;
    }
  }
}

template <class V, DType T, int R>
[[gnu::always_inline]] inline void TileB(int nb, const uint8_t* const* w, const float* const* x, int64_t n, float* y,
                                         int64_t y_stride, const uint8_t* pf, int64_t row_bytes) {
  switch (nb) {
    case 4: Tile<V, T, R, 4>(w, x, n, y, y_stride, pf, row_bytes); break;
    case 3: Tile<V, T, R, 3>(w, x, n, y, y_stride, pf, row_bytes); break;
    case 2: Tile<V, T, R, 2>(w, x, n, y, y_stride, pf, row_bytes); break;
    default: Tile<V, T, R, 1>(w, x, n, y, y_stride, pf, row_bytes); break;
  }
}

template <class V, DType T>
void Tiles(int nr, int nb, const uint8_t* const* w, const float* const* x, int64_t n, float* y, int64_t y_stride,
           const uint8_t* pf, int64_t row_bytes) {
  switch (nr) {
    case 4: TileB<V, T, 4>(nb, w, x, n, y, y_stride, pf, row_bytes); break;
    case 3: TileB<V, T, 3>(nb, w, x, n, y, y_stride, pf, row_bytes); break;
    case 2: TileB<V, T, 2>(nb, w, x, n, y, y_stride, pf, row_bytes); break;
    default: TileB<V, T, 1>(nb, w, x, n, y, y_stride, pf, row_bytes); break;
  }
}

constexpr int kGroupRows = 4;  // weight rows per group (and per tile)
constexpr int kTileActs = 4;   // activation rows per tile
// Activation rows per chunk: about this many bytes of them stay in L2 while weights stream past.
constexpr int64_t kChunkBytes = 192 * 1024;

template <class V, DType T>
void Run(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  const int64_t in_dim = ws[0].cols;
  const int64_t row_bytes = in_dim * static_cast<int64_t>(DTypeSize(T));
  int64_t total_groups = 0, work = 0;
  for (int j = 0; j < count; ++j) {
    total_groups += (ws[j].rows + kGroupRows - 1) / kGroupRows;
    work += ws[j].rows * in_dim * n_rows;
  }
  const int64_t chunk = std::max<int64_t>(kTileActs, kChunkBytes / (in_dim * 4) / kTileActs * kTileActs);
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
      while (g_in >= (ws[j].rows + kGroupRows - 1) / kGroupRows) g_in -= (ws[j++].rows + kGroupRows - 1) / kGroupRows;
      for (int64_t g = g_begin; g < g_end; ++g) {
        const TensorView& w = ws[j];
        const int64_t o = g_in * kGroupRows;
        const int nr = static_cast<int>(std::min<int64_t>(kGroupRows, w.rows - o));
        const auto* base = static_cast<const uint8_t*>(w.data);
        const uint8_t* rows[kGroupRows];
        for (int r = 0; r < nr; ++r) rows[r] = base + (o + r) * row_bytes;
        // The next group: the rest of this matrix, else the next matrix's first rows.
        const uint8_t* pf = nullptr;
        if (g + 1 < total_groups) {
          pf = o + kGroupRows < w.rows ? base + (o + kGroupRows) * row_bytes : static_cast<const uint8_t*>(ws[j + 1].data);
        }
        float* y = ys[j];
        for (int64_t b = c0; b < c1; b += kTileActs) {
          const int nb = static_cast<int>(std::min<int64_t>(kTileActs, c1 - b));
          const float* xs[kTileActs];
          for (int k = 0; k < nb; ++k) xs[k] = x + (b + k) * in_dim;
          // Only the first tile of a group prefetches (later tiles find the weights in L1);
          // the next group's rows are at most kGroupRows (a shorter last group still fits).
          Tiles<V, T>(nr, nb, rows, xs, in_dim, y + b * w.rows + o, w.rows, b == c0 ? pf : nullptr, row_bytes);
        }
        if (++g_in == (w.rows + kGroupRows - 1) / kGroupRows) {
          g_in = 0;
          ++j;
        }
      }
    }
  }
}

template <class V>
void RunAny(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows) {
  switch (ws[0].dtype) {
    case DType::kF32: return Run<V, DType::kF32>(ws, ys, count, x, n_rows);
    case DType::kF16: return Run<V, DType::kF16>(ws, ys, count, x, n_rows);
    case DType::kBF16: return Run<V, DType::kBF16>(ws, ys, count, x, n_rows);
  }
}

}  // namespace
}  // namespace keel::engine

#endif  // KEEL_ENGINE_MATMUL_KERNEL_H_
