// The AVX-512 level of the attention core (attention.h states both levels' arithmetic): the
// same decode and prompt-chunk loops with 16-lane accumulators over 16-element chunks, for
// head_dim % 16 == 0. attention.h's entry points call AttendAllHeads / AttendAllHeadsMany here
// when cpu::ActiveIsa() is kAvx512.
//
// Everything below is defined inside an AVX-512 target region and in namespace keel::kv::avx512:
// templates take the target of their definition, so every codec that includes attention.h gets
// its AVX-512 instantiations compiled for AVX-512 (and only those: the readers, block sources and
// everything else from headers stay baseline, and are inlined into these loops), and no
// instantiation here can share a symbol name with a baseline one.
//
// Readers keep their 8-lane interface (attention_readers.h): Load16 joins a reader's two halves
// of a 16-element chunk, except for plain rows (raw codecs, filling blocks, the prompt-chunk
// path's widened rows), which are widened with one 16-lane load.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "keel/core/cpu.h"
#include "keel/core/dtype.h"
#include "keel/kv/attention_math_avx512.h"
#include "keel/kv/attention_readers.h"
#include "keel/kv/codec.h"

KEEL_BEGIN_TARGET_AVX512
namespace keel::kv::avx512 {

// Elements [16c, 16c + 16) of row `slot` as 16 fp32 lanes.
template <class Reader>
[[gnu::always_inline]] inline __m512 Load16(const Reader& r, int slot, int c) {
  __m256 h[2];
  r.template Load<16>(slot, c, h);
  return _mm512_insertf32x8(_mm512_castps256_ps512(h[0]), h[1], 1);
}

template <DType T>
[[gnu::always_inline]] inline __m512 Load16(const PlainRowsReader<T>& r, int slot, int c) {
  const uint8_t* p = r.rows + (static_cast<size_t>(slot) * r.hd + c * 16) * PlainRowsReader<T>::kElem;
  if constexpr (T == DType::kF32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (T == DType::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

namespace detail {

// Scores of tokens [slot, slot+TB) of one block for G query heads (q: G rows of hd floats).
template <int G, int TB, class Reader>
inline void ScoreTokens(const Reader& r, int slot, int hd, const float* q, float* sc, size_t stride, float scale) {
  __m512 acc[G][TB];
  KEEL_UNROLL
  for (int g = 0; g < G; ++g)
    KEEL_UNROLL
    for (int j = 0; j < TB; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int c = 0; c < hd / 16; ++c) {
    KEEL_UNROLL
    for (int j = 0; j < TB; ++j) {
      const __m512 k = Load16(r, slot + j, c);
      KEEL_UNROLL
      for (int g = 0; g < G; ++g) {
        acc[g][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + static_cast<size_t>(g) * hd + c * 16), k, acc[g][j]);
      }
    }
  }
  if constexpr (G * TB >= 4) {
    // All G*TB sums at once (the same bits as one at a time, keel/core/vec_math.h), each head's
    // TB scores stored by one masked store.
    __m512 t[G * TB];
    KEEL_UNROLL
    for (int g = 0; g < G; ++g)
      KEEL_UNROLL
      for (int j = 0; j < TB; ++j) t[g * TB + j] = acc[g][j];
    const __m512 v = _mm512_mul_ps(keel::avx512::ReduceLanes16xN<G * TB>(t), _mm512_set1_ps(scale));
    [&]<int... g>(std::integer_sequence<int, g...>) {
      (keel::avx512::StoreLanes16<TB, g * TB>(v, sc + g * stride + slot), ...);
    }(std::make_integer_sequence<int, G>{});
  } else {
    KEEL_UNROLL
    for (int g = 0; g < G; ++g)
      KEEL_UNROLL
      for (int j = 0; j < TB; ++j) sc[g * stride + slot + j] = ReduceLanes(acc[g][j]) * scale;
  }
}

// out tile [c, c + TC) (in 16-element chunks) += p_t * v_t over the m tokens of one block.
template <int G, int TC, class Reader>
inline void AccumulateTile(const Reader& r, int m, int c, int hd, const float* p, size_t stride, float* o) {
  __m512 acc[G][TC];
  KEEL_UNROLL
  for (int g = 0; g < G; ++g)
    KEEL_UNROLL
    for (int i = 0; i < TC; ++i) acc[g][i] = _mm512_loadu_ps(o + static_cast<size_t>(g) * hd + (c + i) * 16);
  for (int slot = 0; slot < m; ++slot) {
    const float* ps = p + slot;
    if constexpr (TC <= G) {
      __m512 v[TC];
      KEEL_UNROLL
      for (int i = 0; i < TC; ++i) v[i] = Load16(r, slot, c + i);
      KEEL_UNROLL
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(ps[g * stride]);
        KEEL_UNROLL
        for (int i = 0; i < TC; ++i) acc[g][i] = _mm512_fmadd_ps(w, v[i], acc[g][i]);
      }
    } else {
      __m512 w[G];
      KEEL_UNROLL
      for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(ps[g * stride]);
      KEEL_UNROLL
      for (int i = 0; i < TC; ++i) {
        const __m512 v = Load16(r, slot, c + i);
        KEEL_UNROLL
        for (int g = 0; g < G; ++g) acc[g][i] = _mm512_fmadd_ps(w[g], v, acc[g][i]);
      }
    }
  }
  KEEL_UNROLL
  for (int g = 0; g < G; ++g)
    KEEL_UNROLL
    for (int i = 0; i < TC; ++i) _mm512_storeu_ps(o + static_cast<size_t>(g) * hd + (c + i) * 16, acc[g][i]);
}

// Register budget (32 zmm): 16 accumulators in both phases (twice AVX2's 8; 8 measured ~10 %
// slower on Zen 5), leaving room for a decoder's registers and constants (12 for a piece of 3
// heads). Both counts are powers of two; what is left of a block (tokens) or a row (chunks) goes
// in halving steps.
template <int G>
inline constexpr int kScoreTokens = G == 3 ? 4 : std::max(1, 16 / G);
template <int G>
inline constexpr int kTileChunks = G == 3 ? 4 : std::max(1, 16 / G);

// Scores of tokens [slot, m) of one block, TB at a time, then in halving steps.
template <int G, int TB, class Reader>
inline void ScoreRest(const Reader& r, int slot, int m, int hd, const float* q, float* sc, size_t stride, float scale) {
  for (; slot + TB <= m; slot += TB) ScoreTokens<G, TB>(r, slot, hd, q, sc, stride, scale);
  if constexpr (TB > 1) ScoreRest<G, TB / 2>(r, slot, m, hd, q, sc, stride, scale);
}

template <int G, class Reader>
inline void ScoreBlock(const Reader& r, int m, int hd, const float* q, float* sc, size_t stride, float scale) {
  constexpr int TB = kScoreTokens<G>;
  int slot = 0;
  for (; slot + TB <= m; slot += TB) {
    r.Prefetch(slot / TB, (m + TB - 1) / TB);
    ScoreTokens<G, TB>(r, slot, hd, q, sc, stride, scale);
  }
  if constexpr (TB > 1) ScoreRest<G, TB / 2>(r, slot, m, hd, q, sc, stride, scale);
}

// Output tiles of TC chunks from chunk c on, then in halving steps; one prefetch slice per tile.
template <int G, int TC, class Reader>
inline void AccumulateTiles(const Reader& r, int m, int c, int nc, int tile, int tiles, int hd, const float* p,
                            size_t stride, float* o) {
  for (; c + TC <= nc; c += TC) {
    r.Prefetch(tile++, tiles);
    AccumulateTile<G, TC>(r, m, c, hd, p, stride, o);
  }
  if constexpr (TC > 1) AccumulateTiles<G, TC / 2>(r, m, c, nc, tile, tiles, hd, p, stride, o);
}

template <int G, class Reader>
inline void AccumulateBlock(const Reader& r, int m, int hd, const float* p, size_t stride, float* o) {
  const int nc = hd / 16;
  int tiles = 0;
  for (int tc = kTileChunks<G>, left = nc; tc >= 1; tc /= 2) {
    tiles += left / tc;
    left %= tc;
  }
  AccumulateTiles<G, kTileChunks<G>>(r, m, 0, nc, 0, tiles, hd, p, stride, o);
}

// Query heads [g0, g0+G) of KV head kvh: scores, softmax, weighted sum of V.
template <int G, class Source>
void AttendGroup(const KvShape& s, Source& src, int kvh, int g0, int n_tokens, const float* q, float* out,
                 float* scores) {
  const int hd = s.head_dim, bt = s.block_tokens;
  const int group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qh = q + static_cast<size_t>(kvh * group + g0) * hd;
  float* oh = out + static_cast<size_t>(kvh * group + g0) * hd;
  float* sc = scores + static_cast<size_t>(g0) * n_tokens;
  const size_t stride = static_cast<size_t>(n_tokens);
  const int n_blocks = (n_tokens + bt - 1) / bt;
  src.Begin(kvh);
  // The block source is baseline code and calls these lambdas out of line, once per block; a
  // local copy of the reader lets its fields live in registers.
  for (int b = 0; b < n_blocks; ++b) {
    const int m = std::min(bt, n_tokens - b * bt);
    src.K(b, [&](const auto& r) {
      const auto rr = r;
      ScoreBlock<G>(rr, m, hd, qh, sc + b * bt, stride, scale);
    });
  }
  for (int g = 0; g < G; ++g) {
    SoftmaxF32(sc + g * stride, n_tokens);
    std::memset(oh + static_cast<size_t>(g) * hd, 0, sizeof(float) * hd);
  }
  for (int b = 0; b < n_blocks; ++b) {
    const int m = std::min(bt, n_tokens - b * bt);
    src.V(b, [&](const auto& r) {
      const auto rr = r;
      AccumulateBlock<G>(rr, m, hd, sc + b * bt, stride, oh);
    });
  }
}

// Calls f(G, g0) (G as std::integral_constant) for the query heads of one KV head in pieces
// [g0, g0 + G) of 8, 4, 3, 2 or 1: a group of 3 (6 query heads over 2 KV heads, 12 over 4) reads
// its K and V rows once instead of twice (2 + 1).
template <class F>
inline void ForEachGroupPiece(int group, F&& f) {
  for (int g0 = 0; g0 < group;) {
    const int left = group - g0;
    if (left >= 8) {
      f(std::integral_constant<int, 8>{}, g0);
      g0 += 8;
    } else if (left >= 4) {
      f(std::integral_constant<int, 4>{}, g0);
      g0 += 4;
    } else if (left == 3) {
      f(std::integral_constant<int, 3>{}, g0);
      g0 += 3;
    } else if (left >= 2) {
      f(std::integral_constant<int, 2>{}, g0);
      g0 += 2;
    } else {
      f(std::integral_constant<int, 1>{}, g0);
      g0 += 1;
    }
  }
}

template <class Source>
void AttendHead(const KvShape& s, Source& src, int kvh, int n_tokens, const float* q, float* out, float* scores) {
  ForEachGroupPiece(s.n_heads / s.n_kv_heads, [&](auto g, int g0) {
    AttendGroup<decltype(g)::value>(s, src, kvh, g0, n_tokens, q, out, scores);
  });
}

// attention.h's AttendHeadMany at this level.
template <class Rows>
void AttendHeadMany(const KvShape& s, Rows& src, int kvh, int n_queries, const int* n_tokens, const float* q,
                    float* out, float* scores) {
  const int hd = s.head_dim, bt = s.block_tokens;
  const int group = s.n_heads / s.n_kv_heads;
  const size_t stride = static_cast<size_t>(s.n_heads) * hd;
  const int max_n = n_tokens[n_queries - 1];
  const int n_blocks = (max_n + bt - 1) / bt;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto score = [&](int i, int g) { return scores + (static_cast<size_t>(i) * group + g) * max_n; };
  auto head = [&](int i, int g) { return static_cast<size_t>(i) * stride + static_cast<size_t>(kvh * group + g) * hd; };
  auto reader = [&](const __m256* rows) {
    return PlainRowsReader<DType::kF32>{reinterpret_cast<const uint8_t*>(rows), hd, NextBlock{}};
  };
  src.Begin(kvh);
  int first = 0;
  for (int b = 0; b < n_blocks; ++b) {
    const int t0 = b * bt;
    while (n_tokens[first] <= t0) ++first;
    const auto r = reader(src.K(b));
    for (int i = first; i < n_queries; ++i) {
      const int m = std::min(bt, n_tokens[i] - t0);
      ForEachGroupPiece(group, [&](auto g, int g0) {
        ScoreBlock<decltype(g)::value>(r, m, hd, q + head(i, g0), score(i, g0) + t0, max_n, scale);
      });
    }
  }
  for (int i = 0; i < n_queries; ++i) {
    for (int g = 0; g < group; ++g) {
      SoftmaxF32(score(i, g), n_tokens[i]);
      std::memset(out + head(i, g), 0, sizeof(float) * hd);
    }
  }
  first = 0;
  for (int b = 0; b < n_blocks; ++b) {
    const int t0 = b * bt;
    while (n_tokens[first] <= t0) ++first;
    const auto r = reader(src.V(b));
    for (int i = first; i < n_queries; ++i) {
      const int m = std::min(bt, n_tokens[i] - t0);
      ForEachGroupPiece(group, [&](auto g, int g0) {
        AccumulateBlock<decltype(g)::value>(r, m, hd, score(i, g0) + t0, max_n, out + head(i, g0));
      });
    }
  }
}

}  // namespace detail

// attention.h's AttendAllHeads / AttendAllHeadsMany at this level (head_dim % 16 == 0).
template <class MakeSource>
void AttendAllHeads(const KvShape& s, MakeSource make_source, int n_tokens, const float* q, float* out,
                    AttendScratch& scratch) {
  const int group = s.n_heads / s.n_kv_heads;
  float* scores = scratch.get(static_cast<size_t>(s.n_heads) * n_tokens);
  const bool par = omp_get_active_level() == 0 && s.n_kv_heads > 1 &&
                   static_cast<int64_t>(n_tokens) * s.head_dim * s.n_kv_heads >= kParallelAttendElements;
#pragma omp parallel for schedule(static) if (par)
  for (int kvh = 0; kvh < s.n_kv_heads; ++kvh) {
    auto src = make_source();
    detail::AttendHead(s, src, kvh, n_tokens, q, out, scores + static_cast<size_t>(kvh) * group * n_tokens);
  }
}

template <class MakeSource>
void AttendAllHeadsMany(const KvShape& s, MakeSource make_source, int n_queries, const int* n_tokens, const float* q,
                        float* out, AttendScratch& scratch) {
  const int group = s.n_heads / s.n_kv_heads;
  const size_t stride = static_cast<size_t>(s.n_heads) * s.head_dim;
  for (int q0 = 0; q0 < n_queries; q0 += kManyQueries) {
    const int m = std::min(kManyQueries, n_queries - q0);
    const size_t per_head = static_cast<size_t>(m) * group * n_tokens[q0 + m - 1];
    float* scores = scratch.get(per_head * s.n_kv_heads);
    const bool par = omp_get_active_level() == 0 && s.n_kv_heads > 1 &&
                     static_cast<int64_t>(m) * n_tokens[q0 + m - 1] * s.head_dim * s.n_kv_heads >= kParallelAttendElements;
#pragma omp parallel for schedule(static) if (par)
    for (int kvh = 0; kvh < s.n_kv_heads; ++kvh) {
      WidenedBlocks<decltype(make_source())> src(make_source(), s.block_tokens, s.head_dim, n_tokens[q0 + m - 1]);
      detail::AttendHeadMany(s, src, kvh, m, n_tokens + q0, q + q0 * stride, out + q0 * stride, scores + kvh * per_head);
    }
  }
}

}  // namespace keel::kv::avx512
KEEL_END_TARGET
