// The attention core every codec shares. A codec supplies a block source (attention_readers.h):
// for one KV head and one cache block it hands the core a reader that widens 8 or 16 consecutive
// elements of a stored K or V row into fp32 lanes; the core does all the arithmetic. Two codecs
// whose rows widen to the same fp32 values therefore produce bit-identical outputs, which is how
// lossless codecs (ZipFusion) are held to "equal to raw".
//
// Two levels (keel/core/cpu.h), chosen per call at the entry points (AttendAllHeads,
// AttendAllHeadsMany) from cpu::ActiveIsa(); each has its own fixed arithmetic, so results may
// differ in the last bits between levels but never within one:
//  * AVX2 (and AVX-512 when head_dim % 16 != 0): per (query head, token) one 8-lane FMA
//    accumulator over the row's 8-element chunks in order, reduced exactly like DotF32
//    (ReduceLanes), times 1/sqrt(head_dim); SoftmaxF32 per query head; then
//    out = fma(p_t, v_t, out) per token in order, starting from zero.
//  * AVX-512 with head_dim % 16 == 0 (attention_avx512.h): per (query head, token) one 16-lane FMA
//    accumulator over the row's 16-element chunks in order, reduced as avx512::ReduceLanes (the
//    two 8-lane halves added, then ReduceLanes' order), times 1/sqrt(head_dim); SoftmaxF32 at the
//    AVX-512 level (its sum in 16 lanes); the weighted sum of V as above (element-wise, so the
//    same bits as AVX2's given the same probabilities).
// SoftmaxF32, DotF32 and AxpyF32 (attention_math.h) dispatch on the same level, so the core always
// equals DotF32 / SoftmaxF32 / AxpyF32 applied per head at the level in force. How the work is
// blocked (tokens per step, output tiles kept in registers) never changes the order.
//
// Decode blocking: scores are computed for TB tokens x G query heads at a time (G*TB
// accumulators in registers, each K chunk widened once for all of them); the weighted sum of V
// keeps a tile of G query heads x a few output chunks in registers while it walks the tokens of
// one cache block, so V is widened once per block and output tiles are loaded and stored once
// per block instead of once per token.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "keel/core/cpu.h"
#include "keel/kv/attention_avx512.h"
#include "keel/kv/attention_math.h"
#include "keel/kv/attention_readers.h"
#include "keel/kv/codec.h"

namespace keel::kv {

// Whether a call runs the AVX-512 core: the level in force, and whole 16-element chunks.
inline bool UseAvx512Core(const KvShape& s) {
  return s.head_dim % 16 == 0 && cpu::ActiveIsa() == cpu::Isa::kAvx512;
}

namespace attention_detail {

// Scores of tokens [slot, slot+TB) of one block for G query heads (q: G rows of hd floats).
template <int G, int TB, int CW, class Reader>
inline void ScoreTokens(const Reader& r, int slot, int hd, const float* q, float* sc, size_t stride, float scale) {
  constexpr int V = CW / 8;
  __m256 acc[G][TB];
  KEEL_UNROLL
  for (int g = 0; g < G; ++g)
    KEEL_UNROLL
    for (int j = 0; j < TB; ++j) acc[g][j] = _mm256_setzero_ps();
  // Each widened chunk is used at once by all G heads (query chunks come from L1 as FMA
  // operands), so only one token's chunk is live next to the accumulators: decoders that need
  // registers of their own (ZipFusion) do not spill.
  for (int c = 0; c < hd / CW; ++c) {
    KEEL_UNROLL
    for (int j = 0; j < TB; ++j) {
      __m256 k[V];
      r.template Load<CW>(slot + j, c, k);
      KEEL_UNROLL
      for (int u = 0; u < V; ++u) {
        KEEL_UNROLL
        for (int g = 0; g < G; ++g) {
          const __m256 qv = _mm256_loadu_ps(q + static_cast<size_t>(g) * hd + c * CW + u * 8);
          acc[g][j] = _mm256_fmadd_ps(qv, k[u], acc[g][j]);
        }
      }
    }
  }
  if constexpr (G * TB >= 4) {
    // All G*TB sums at once (the same bits as one at a time, keel/core/vec_math.h).
    __m256 t[G * TB];
    KEEL_UNROLL
    for (int g = 0; g < G; ++g)
      KEEL_UNROLL
      for (int j = 0; j < TB; ++j) t[g * TB + j] = acc[g][j];
    const __m256 v = _mm256_mul_ps(ReduceLanes8xN<G * TB>(t), _mm256_set1_ps(scale));
    [&]<int... g>(std::integer_sequence<int, g...>) {
      (StoreLanes8<TB, g * TB>(v, sc + g * stride + slot), ...);
    }(std::make_integer_sequence<int, G>{});
  } else {
    KEEL_UNROLL
    for (int g = 0; g < G; ++g)
      KEEL_UNROLL
      for (int j = 0; j < TB; ++j) sc[g * stride + slot + j] = ReduceLanes(acc[g][j]) * scale;
  }
}

// out tile [c, c + TC) (in CW-element chunks) += p_t * v_t over the m tokens of one block.
template <int G, int TC, int CW, class Reader>
inline void AccumulateTile(const Reader& r, int m, int c, int hd, const float* p, size_t stride, float* o) {
  constexpr int V = CW / 8;
  __m256 acc[G][TC * V];
  KEEL_UNROLL
  for (int g = 0; g < G; ++g)
    KEEL_UNROLL
    for (int i = 0; i < TC * V; ++i) acc[g][i] = _mm256_loadu_ps(o + static_cast<size_t>(g) * hd + c * CW + i * 8);
  for (int slot = 0; slot < m; ++slot) {
    const float* ps = p + slot;
    if constexpr (TC * V <= G) {
      // Few output vectors, many heads: keep the widened values, broadcast one weight at a time.
      __m256 v[TC * V];
      KEEL_UNROLL
      for (int i = 0; i < TC; ++i) r.template Load<CW>(slot, c + i, v + i * V);
      KEEL_UNROLL
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_broadcast_ss(ps + g * stride);
        KEEL_UNROLL
        for (int i = 0; i < TC * V; ++i) acc[g][i] = _mm256_fmadd_ps(w, v[i], acc[g][i]);
      }
    } else {
      // Many output vectors, few heads: keep the weights, widen one chunk at a time.
      __m256 w[G];
      KEEL_UNROLL
      for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(ps + g * stride);
      KEEL_UNROLL
      for (int i = 0; i < TC; ++i) {
        __m256 v[V];
        r.template Load<CW>(slot, c + i, v);
        KEEL_UNROLL
        for (int u = 0; u < V; ++u) {
          KEEL_UNROLL
          for (int g = 0; g < G; ++g) acc[g][i * V + u] = _mm256_fmadd_ps(w[g], v[u], acc[g][i * V + u]);
        }
      }
    }
  }
  KEEL_UNROLL
  for (int g = 0; g < G; ++g)
    KEEL_UNROLL
    for (int i = 0; i < TC * V; ++i) _mm256_storeu_ps(o + static_cast<size_t>(g) * hd + c * CW + i * 8, acc[g][i]);
}

// Register budget (16 ymm): 8 accumulators in both phases (enough independent FMA chains to
// cover the FMA latency on two pipes), leaving room for a decoder's own registers: scores keep
// G*TB accumulators + one widened chunk; the weighted sum keeps G x TC*CW/8 accumulators + the
// widened chunks or the G weights, whichever is fewer.
template <int G>
inline constexpr int kScoreTokens = std::max(1, 8 / G);
template <int G, int CW>
inline constexpr int kTileChunks = std::max(1, 8 / G / (CW / 8));

// Scores of the m tokens of one block (sc: the block's first token) for G query heads.
template <int G, int CW, class Reader>
inline void ScoreBlock(const Reader& r, int m, int hd, const float* q, float* sc, size_t stride, float scale) {
  constexpr int TB = kScoreTokens<G>;
  int slot = 0;
  for (; slot + TB <= m; slot += TB) {
    r.Prefetch(slot / TB, (m + TB - 1) / TB);
    ScoreTokens<G, TB, CW>(r, slot, hd, q, sc, stride, scale);
  }
  for (; slot < m; ++slot) ScoreTokens<G, 1, CW>(r, slot, hd, q, sc, stride, scale);
}

// out += p_t * v_t over the m tokens of one block (p: the block's first token) for G query heads,
// a column tile at a time. One prefetch slice per tile: the requests spread over the whole block
// (asking for all of it during the first tile made V 10-30 % slower).
template <int G, int CW, class Reader>
inline void AccumulateBlock(const Reader& r, int m, int hd, const float* p, size_t stride, float* o) {
  constexpr int TC = kTileChunks<G, CW>;
  const int nc = hd / CW, tiles = nc / TC + nc % TC;
  int c = 0, tile = 0;
  for (; c + TC <= nc; c += TC) {
    r.Prefetch(tile++, tiles);
    AccumulateTile<G, TC, CW>(r, m, c, hd, p, stride, o);
  }
  for (; c < nc; ++c) {
    r.Prefetch(tile++, tiles);
    AccumulateTile<G, 1, CW>(r, m, c, hd, p, stride, o);
  }
}

// Query heads [g0, g0+G) of KV head kvh: scores, softmax, weighted sum of V.
template <int G, int CW, class Source>
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
  for (int b = 0; b < n_blocks; ++b) {
    const int m = std::min(bt, n_tokens - b * bt);
    src.K(b, [&](const auto& r) { ScoreBlock<G, CW>(r, m, hd, qh, sc + b * bt, stride, scale); });
  }
  for (int g = 0; g < G; ++g) {
    SoftmaxF32(sc + g * stride, n_tokens);
    std::memset(oh + static_cast<size_t>(g) * hd, 0, sizeof(float) * hd);
  }
  for (int b = 0; b < n_blocks; ++b) {
    const int m = std::min(bt, n_tokens - b * bt);
    src.V(b, [&](const auto& r) { AccumulateBlock<G, CW>(r, m, hd, sc + b * bt, stride, oh); });
  }
}

// Calls f(G, CW, g0) (G and CW as std::integral_constant) for the query heads of one KV head in
// power-of-two pieces [g0, g0 + G) (each query head's arithmetic is independent of the others);
// CW = 16 when head_dim allows and G <= 4 (register budget), else 8.
template <class F>
inline void ForEachGroupPiece(int group, int hd, F&& f) {
  auto with_width = [&](auto g, int g0) {
    if constexpr (decltype(g)::value <= 4) {
      if (hd % 16 == 0) {
        f(g, std::integral_constant<int, 16>{}, g0);
        return;
      }
    }
    f(g, std::integral_constant<int, 8>{}, g0);
  };
  for (int g0 = 0; g0 < group;) {
    const int left = group - g0;
    if (left >= 8) {
      with_width(std::integral_constant<int, 8>{}, g0);
      g0 += 8;
    } else if (left >= 4) {
      with_width(std::integral_constant<int, 4>{}, g0);
      g0 += 4;
    } else if (left >= 2) {
      with_width(std::integral_constant<int, 2>{}, g0);
      g0 += 2;
    } else {
      with_width(std::integral_constant<int, 1>{}, g0);
      g0 += 1;
    }
  }
}

}  // namespace attention_detail

// One KV head: its query heads attend over n_tokens rows from `src`.
template <class Source>
void AttendHead(const KvShape& s, Source& src, int kvh, int n_tokens, const float* q, float* out, float* scores) {
  attention_detail::ForEachGroupPiece(s.n_heads / s.n_kv_heads, s.head_dim, [&](auto g, auto cw, int g0) {
    attention_detail::AttendGroup<decltype(g)::value, decltype(cw)::value>(s, src, kvh, g0, n_tokens, q, out, scores);
  });
}

// All heads. `make_source()` builds one block source per thread. Long contexts split the KV heads
// across threads when not already inside a parallel region (the forward pass parallelises over
// batch rows first).
template <class MakeSource>
void AttendAllHeads(const KvShape& s, MakeSource make_source, int n_tokens, const float* q, float* out,
                    AttendScratch& scratch) {
  if (UseAvx512Core(s)) {
    avx512::AttendAllHeads(s, std::move(make_source), n_tokens, q, out, scratch);
    return;
  }
  const int group = s.n_heads / s.n_kv_heads;
  float* scores = scratch.get(static_cast<size_t>(s.n_heads) * n_tokens);
  const bool par = omp_get_active_level() == 0 && s.n_kv_heads > 1 &&
                   static_cast<int64_t>(n_tokens) * s.head_dim * s.n_kv_heads >= kParallelAttendElements;
#pragma omp parallel for schedule(static) if (par)
  for (int kvh = 0; kvh < s.n_kv_heads; ++kvh) {
    auto src = make_source();
    AttendHead(s, src, kvh, n_tokens, q, out, scores + static_cast<size_t>(kvh) * group * n_tokens);
  }
}

// Several queries of one sequence (a prompt chunk): each stored block is widened once into fp32
// rows and used by every query that can see it, through the decode loops (ScoreBlock,
// AccumulateBlock) over those rows. Per (query, head) the arithmetic is exactly AttendHead's, so
// the result equals attending one query at a time. n_tokens is increasing; scores holds
// n_queries * group * n_tokens[n_queries-1] floats.
template <class Rows>
void AttendHeadMany(const KvShape& s, Rows& src, int kvh, int n_queries, const int* n_tokens, const float* q,
                    float* out, float* scores) {
  using namespace attention_detail;
  const int hd = s.head_dim, bt = s.block_tokens;
  const int group = s.n_heads / s.n_kv_heads;
  const size_t stride = static_cast<size_t>(s.n_heads) * hd;
  const int max_n = n_tokens[n_queries - 1];
  const int n_blocks = (max_n + bt - 1) / bt;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto score = [&](int i, int g) { return scores + (static_cast<size_t>(i) * group + g) * max_n; };
  auto head = [&](int i, int g) { return static_cast<size_t>(i) * stride + static_cast<size_t>(kvh * group + g) * hd; };
  // Widened rows of one block, read like plain fp32 rows (nothing to prefetch: they are in L1).
  auto reader = [&](const __m256* rows) {
    return PlainRowsReader<DType::kF32>{reinterpret_cast<const uint8_t*>(rows), hd, NextBlock{}};
  };
  src.Begin(kvh);
  int first = 0;  // first query that sees the block's first token
  for (int b = 0; b < n_blocks; ++b) {
    const int t0 = b * bt;
    while (n_tokens[first] <= t0) ++first;
    const auto r = reader(src.K(b));
    for (int i = first; i < n_queries; ++i) {
      const int m = std::min(bt, n_tokens[i] - t0);  // tokens of this block query i sees
      ForEachGroupPiece(group, hd, [&](auto g, auto cw, int g0) {
        ScoreBlock<decltype(g)::value, decltype(cw)::value>(r, m, hd, q + head(i, g0), score(i, g0) + t0, max_n, scale);
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
      ForEachGroupPiece(group, hd, [&](auto g, auto cw, int g0) {
        AccumulateBlock<decltype(g)::value, decltype(cw)::value>(r, m, hd, score(i, g0) + t0, max_n, out + head(i, g0));
      });
    }
  }
}

// All KV heads for a prompt chunk, in slices of kManyQueries queries to bound the scores buffer.
template <class MakeSource>
void AttendAllHeadsMany(const KvShape& s, MakeSource make_source, int n_queries, const int* n_tokens, const float* q,
                        float* out, AttendScratch& scratch) {
  const int group = s.n_heads / s.n_kv_heads;
  if (UseAvx512Core(s)) {
    avx512::AttendAllHeadsMany(s, std::move(make_source), n_queries, n_tokens, q, out, scratch);
    return;
  }
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
      AttendHeadMany(s, src, kvh, m, n_tokens + q0, q + q0 * stride, out + q0 * stride, scores + kvh * per_head);
    }
  }
}

}  // namespace keel::kv
