// The attention core every codec shares. A codec supplies a block source: for one KV head and
// one cache block it hands the core a reader that widens 8 or 16 consecutive elements of a
// stored K or V row into fp32 lanes; the core does all the arithmetic. Two codecs whose rows
// widen to the same fp32 values therefore produce bit-identical outputs, which is how lossless
// codecs (ZipFusion) are held to "equal to raw".
//
// Arithmetic, fixed: per (query head, token) one 8-lane FMA accumulator over the row's 8-element
// chunks in order, reduced exactly like DotF32, times 1/sqrt(head_dim); SoftmaxF32 per query
// head; then out = fma(p_t, v_t, out) per token in order, starting from zero. How the work is
// blocked (tokens per step, output tiles kept in registers) never changes that order.
//
// Decode blocking: scores are computed for TB tokens x G query heads at a time (G*TB
// accumulators in registers, each K chunk widened once for all of them); the weighted sum of V
// keeps a tile of G query heads x a few output chunks in registers while it walks the tokens of
// one cache block, so V is widened once per block and output tiles are loaded and stored once
// per block instead of once per token.
//
// A block source provides:
//   void Begin(int kv_head);
//   template <class F> void K(int block, F&& f);  // f(reader) over that block's K rows
//   template <class F> void V(int block, F&& f);  // (blocks are visited in increasing order)
// and a reader:
//   template <int CW> void Load(int slot, int c, __m256* v) const;
//   void Prefetch(int i, int n) const;  // ask for the i-th of n slices of the next block
//     CW = 8: v[0] = elements [8c, 8c+8) of row `slot`;
//     CW = 16: v[0], v[1] = elements [16c, 16c+16) (only used when head_dim % 16 == 0).
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "keel/core/aligned.h"
#include "keel/core/dtype.h"
#include "keel/core/prefetch.h"
#include "keel/kv/attention_math.h"
#include "keel/kv/codec.h"

// Register-blocked loops have compile-time trip counts; they must be fully unrolled for their
// accumulators to live in registers (GCC at -O2 keeps them in memory otherwise).
#define KEEL_UNROLL _Pragma("GCC unroll 16")

namespace keel::kv {

inline constexpr int kMaxHeadDim = 512;

// A later block's bytes for one reader, asked for a slice at a time while the current block is
// being read, so that the requests spread over the block: blocks are scattered in the arena and
// the hardware prefetcher does not cross from one to the next. Readers ask for the block
// kPrefetchBlocks ahead, into L2. (Until this was measured with prefetches that reach
// the binary — see keel/core/prefetch.h — none did; with them, decode attention at 8 K context
// from DRAM went from ~190 to ~110 cycles per (token, KV head) for bf16 and ~320 to ~195 for
// ZipFusion on one Zen 3 core; distances 1-4 and an L1 hint were all within noise of this.)
inline constexpr int kPrefetchBlocks = 2;

// tail_first: the block is read from its end first (ZipFusion opens a block by reading its
// exception list, the last section), so slices go from the end, and the first also asks for the
// header line.
struct NextBlock {
  const char* p = nullptr;  // null: no next block
  size_t bytes = 0;
  bool tail_first = false;
  void Prefetch(int i, int n) const {
    if (p == nullptr) return;
    if (tail_first) {
      if (i == 0) PrefetchL2(p);
      i = n - 1 - i;
    }
    // Whole lines, 32-bit: two 64-bit divisions per call cost more than the prefetches.
    const unsigned lines = static_cast<unsigned>((bytes + 63) / 64), un = static_cast<unsigned>(n);
    const unsigned from = lines * static_cast<unsigned>(i) / un, to = lines * static_cast<unsigned>(i + 1) / un;
    for (unsigned l = from; l < to; ++l) PrefetchL2(p + static_cast<size_t>(l) * 64);
  }
};

// 8 stored values of type T widened to fp32 lanes.
template <DType T>
inline __m256 Widen8(const uint8_t* p) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (T == DType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
}

// Reader over plain rows of type T (row `slot` at rows + slot * head_dim values): raw blocks,
// and ZipFusion regions that are still filling.
template <DType T>
struct PlainRowsReader {
  static constexpr size_t kElem = T == DType::kF32 ? 4 : 2;
  const uint8_t* rows;
  int hd;
  NextBlock next;
  void Prefetch(int i, int n) const { next.Prefetch(i, n); }
  template <int CW>
  [[gnu::always_inline]] void Load(int slot, int c, __m256* v) const {
    const uint8_t* p = rows + (static_cast<size_t>(slot) * hd + c * CW) * kElem;
    KEEL_UNROLL
    for (int u = 0; u < CW / 8; ++u) v[u] = Widen8<T>(p + u * 8 * kElem);
  }
};

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
  KEEL_UNROLL
  for (int g = 0; g < G; ++g)
    KEEL_UNROLL
    for (int j = 0; j < TB; ++j) sc[g * stride + slot + j] = ReduceLanes(acc[g][j]) * scale;
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
  const int group = s.n_heads / s.n_kv_heads;
  float* scores = scratch.get(static_cast<size_t>(s.n_heads) * n_tokens);
  const bool par = omp_get_active_level() == 0 && s.n_kv_heads > 1 &&
                   static_cast<int64_t>(n_tokens) * s.head_dim * s.n_kv_heads >= (1 << 18);
#pragma omp parallel for schedule(static) if (par)
  for (int kvh = 0; kvh < s.n_kv_heads; ++kvh) {
    auto src = make_source();
    AttendHead(s, src, kvh, n_tokens, q, out, scores + static_cast<size_t>(kvh) * group * n_tokens);
  }
}

// A block source's blocks widened to fp32 rows, one block at a time, for the prompt-chunk path
// below: a block is visited once and its rows widened into a buffer (block_tokens x head_dim
// floats, L1-sized for usual shapes), so a ZipFusion block's exceptions are set up once per block
// instead of once per row, and the next blocks are prefetched while it is read.
template <class Source>
class WidenedBlocks {
 public:
  WidenedBlocks(Source src, int block_tokens, int head_dim, int n_tokens)
      : src_(std::move(src)), bt_(block_tokens), chunks_(head_dim / 8), n_tokens_(n_tokens),
        rows_(static_cast<size_t>(block_tokens) * head_dim) {}
  void Begin(int kvh) {
    src_.Begin(kvh);
    block_ = -1;
  }
  // Rows of K or V block b (tokens [b * block_tokens, ...) below n_tokens): row j is head_dim / 8
  // vectors at + j * head_dim / 8. Valid until the next call.
  const __m256* K(int b) { return Block(0, b); }
  const __m256* V(int b) { return Block(1, b); }

 private:
  const __m256* Block(int which, int b) {
    if (b != block_ || which != which_) Fill(which, b);
    return Rows();
  }
  void Fill(int which, int b) {
    const int m = std::min(bt_, n_tokens_ - b * bt_);
    auto widen = [&](const auto& r) {
      for (int slot = 0; slot < m; ++slot) {
        r.Prefetch(slot, m);
        __m256* row = Rows() + static_cast<size_t>(slot) * chunks_;
        for (int c = 0; c < chunks_; ++c) r.template Load<8>(slot, c, row + c);
      }
    };
    if (which == 0) {
      src_.K(b, widen);
    } else {
      src_.V(b, widen);
    }
    block_ = b;
    which_ = which;
  }

  __m256* Rows() { return reinterpret_cast<__m256*>(rows_.data()); }

  Source src_;
  int bt_, chunks_, n_tokens_;
  AlignedFloats rows_;
  int block_ = -1, which_ = 0;
};

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
inline constexpr int kManyQueries = 32;

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
                     static_cast<int64_t>(m) * n_tokens[q0 + m - 1] * s.head_dim * s.n_kv_heads >= (1 << 18);
#pragma omp parallel for schedule(static) if (par)
    for (int kvh = 0; kvh < s.n_kv_heads; ++kvh) {
      WidenedBlocks<decltype(make_source())> src(make_source(), s.block_tokens, s.head_dim, n_tokens[q0 + m - 1]);
      AttendHeadMany(s, src, kvh, m, n_tokens + q0, q + q0 * stride, out + q0 * stride, scores + kvh * per_head);
    }
  }
}

// Whether the vectorised core applies (head_dim a multiple of 8, within kMaxHeadDim).
inline bool CoreSupports(const KvShape& s) { return s.head_dim % 8 == 0 && s.head_dim <= kMaxHeadDim; }

}  // namespace keel::kv
