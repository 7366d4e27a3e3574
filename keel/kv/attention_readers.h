// Readers for the attention core (attention.h): how a codec's stored rows reach the core's fp32
// lanes, shared by every CPU level. A codec supplies a block source: for one KV head and one cache
// block it hands the core a reader that widens 8 or 16 consecutive elements of a stored K or V row
// into fp32 lanes.
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
// Everything here is compiled for the baseline (AVX2): the AVX-512 core (attention_avx512.h)
// inlines these readers into its own code, and has native 16-lane loads for plain rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "keel/core/aligned.h"
#include "keel/core/dtype.h"
#include "keel/core/prefetch.h"
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

// Queries per slice of a prompt chunk (AttendAllHeadsMany): bounds the scores buffer.
inline constexpr int kManyQueries = 32;

// Stored K/V elements (queries x tokens x head_dim x KV heads) from which attention splits its KV
// heads across threads. A fork and join costs a few microseconds; 32 K elements are ~128 KB of
// fp32 K/V, tens of microseconds to read. (It was 256 K: decode at contexts under ~340 tokens of a
// 12-head model ran on one thread while the other waited; single-sequence decode of a 110M model
// got ~5% faster with the split.)
inline constexpr int64_t kParallelAttendElements = 1 << 15;

// Whether the vectorised core applies (head_dim a multiple of 8, within kMaxHeadDim).
inline bool CoreSupports(const KvShape& s) { return s.head_dim % 8 == 0 && s.head_dim <= kMaxHeadDim; }

}  // namespace keel::kv
