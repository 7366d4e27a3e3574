// The decode-attention core every codec shares. A codec supplies a row source that widens one
// stored K or V row (one token, one KV head) into fp32 lanes; the core does the arithmetic. Two
// codecs whose rows widen to the same fp32 values therefore produce bit-identical outputs, which
// is how lossless codecs (ZipFusion) are held to "equal to raw".
//
// Arithmetic, fixed: per (query head, token) one 8-lane FMA accumulator over the row's chunks in
// order, reduced exactly like DotF32, times 1/sqrt(head_dim); SoftmaxF32 per query head; then
// out += p_t * v_t per token in order (AxpyF32's FMA). GQA: each K/V row is widened once and used
// by every query head of its group, so the stored bytes are read once per token.
//
// A RowSource provides:
//   void Begin(int kv_head);              // rows of this head follow, tokens in increasing order
//   void K(int token, __m256* row);       // head_dim/8 chunks
//   void V(int token, __m256* row);
// K(t) is called for t = 0..n-1, then V(t) for t = 0..n-1, for each head.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/kv/attention_math.h"
#include "keel/kv/codec.h"

namespace keel::kv {

inline float ReduceLanes(__m256 acc) {  // the same reduction as DotF32
  __m128 lo = _mm256_castps256_ps128(acc);
  __m128 hi = _mm256_extractf128_ps(acc, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

inline constexpr int kMaxHeadDim = 512;

// One KV head: its `group` query heads attend over n_tokens rows from `src`.
template <class RowSource>
void AttendHead(const KvShape& s, RowSource& src, int kvh, int n_tokens, const float* q, float* out, float* scores) {
  const int hd = s.head_dim, chunks = hd / 8;
  const int group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  alignas(32) __m256 row[kMaxHeadDim / 8];
  src.Begin(kvh);
  for (int t = 0; t < n_tokens; ++t) {
    src.K(t, row);
    for (int g = 0; g < group; ++g) {
      const float* qh = q + static_cast<size_t>(kvh * group + g) * hd;
      __m256 acc = _mm256_setzero_ps();
      for (int c = 0; c < chunks; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), row[c], acc);
      scores[static_cast<size_t>(g) * n_tokens + t] = ReduceLanes(acc) * scale;
    }
  }
  for (int g = 0; g < group; ++g) {
    SoftmaxF32(scores + static_cast<size_t>(g) * n_tokens, n_tokens);
    std::memset(out + static_cast<size_t>(kvh * group + g) * hd, 0, sizeof(float) * hd);
  }
  for (int t = 0; t < n_tokens; ++t) {
    src.V(t, row);
    for (int g = 0; g < group; ++g) {
      float* oh = out + static_cast<size_t>(kvh * group + g) * hd;
      const __m256 w = _mm256_set1_ps(scores[static_cast<size_t>(g) * n_tokens + t]);
      for (int c = 0; c < chunks; ++c) {
        _mm256_storeu_ps(oh + 8 * c, _mm256_fmadd_ps(w, row[c], _mm256_loadu_ps(oh + 8 * c)));
      }
    }
  }
}

// All heads. `make_source()` builds one RowSource per thread. Long contexts split the KV heads
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

// Several queries of one sequence (a prompt chunk): each stored row is widened once and used by
// every query that can see it. Per (query, head) the arithmetic is exactly AttendHead's, so the
// result equals attending one query at a time. n_tokens is increasing; scores holds
// n_queries * group * n_tokens[n_queries-1] floats.
template <class RowSource>
void AttendHeadMany(const KvShape& s, RowSource& src, int kvh, int n_queries, const int* n_tokens, const float* q,
                    float* out, float* scores) {
  const int hd = s.head_dim, chunks = hd / 8;
  const int group = s.n_heads / s.n_kv_heads;
  const size_t stride = static_cast<size_t>(s.n_heads) * hd;
  const int max_n = n_tokens[n_queries - 1];
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto score = [&](int i, int g) { return scores + (static_cast<size_t>(i) * group + g) * max_n; };
  alignas(32) __m256 row[kMaxHeadDim / 8];
  src.Begin(kvh);
  int first = 0;  // first query that sees token t
  for (int t = 0; t < max_n; ++t) {
    while (n_tokens[first] <= t) ++first;
    src.K(t, row);
    for (int i = first; i < n_queries; ++i) {
      for (int g = 0; g < group; ++g) {
        const float* qh = q + i * stride + static_cast<size_t>(kvh * group + g) * hd;
        __m256 acc = _mm256_setzero_ps();
        for (int c = 0; c < chunks; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), row[c], acc);
        score(i, g)[t] = ReduceLanes(acc) * scale;
      }
    }
  }
  for (int i = 0; i < n_queries; ++i) {
    for (int g = 0; g < group; ++g) {
      SoftmaxF32(score(i, g), n_tokens[i]);
      std::memset(out + i * stride + static_cast<size_t>(kvh * group + g) * hd, 0, sizeof(float) * hd);
    }
  }
  first = 0;
  for (int t = 0; t < max_n; ++t) {
    while (n_tokens[first] <= t) ++first;
    src.V(t, row);
    for (int i = first; i < n_queries; ++i) {
      for (int g = 0; g < group; ++g) {
        float* oh = out + i * stride + static_cast<size_t>(kvh * group + g) * hd;
        const __m256 w = _mm256_set1_ps(score(i, g)[t]);
        for (int c = 0; c < chunks; ++c) {
          _mm256_storeu_ps(oh + 8 * c, _mm256_fmadd_ps(w, row[c], _mm256_loadu_ps(oh + 8 * c)));
        }
      }
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
      auto src = make_source();
      AttendHeadMany(s, src, kvh, m, n_tokens + q0, q + q0 * stride, out + q0 * stride, scores + kvh * per_head);
    }
  }
}

// Whether the vectorised core applies (head_dim a multiple of 8, within kMaxHeadDim).
inline bool CoreSupports(const KvShape& s) { return s.head_dim % 8 == 0 && s.head_dim <= kMaxHeadDim; }

}  // namespace keel::kv
