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

// Whether the vectorised core applies (head_dim a multiple of 8, within kMaxHeadDim).
inline bool CoreSupports(const KvShape& s) { return s.head_dim % 8 == 0 && s.head_dim <= kMaxHeadDim; }

}  // namespace keel::kv
