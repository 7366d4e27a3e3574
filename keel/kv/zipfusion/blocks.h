// ZipFusion's block source and readers for the shared attention core (internal to the codec):
// how a region's rows are widened into fp32 lanes, per encoding state and code width.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "keel/kv/attention.h"
#include "keel/kv/zipfusion/format.h"

namespace keel::kv::zipfusion::internal {

constexpr uint8_t kStaging = 0x00;  // region holds plain 16-bit values after the 8-byte header
// Bytes after each region's largest possible block, so the decoder may load 8 code bytes at any
// chunk without a bounds check.
constexpr size_t kTailPadding = 8;

// Header fields and section pointers of a block this codec encoded itself (so already valid).
inline BlockView ViewTrusted(const uint8_t* p) {
  BlockView b;
  b.dtype = static_cast<Dtype>(p[1]);
  b.width = p[2];
  b.base = p[3];
  b.n = ReadU16(p + 4);
  b.n_exc = ReadU16(p + 6);
  const size_t n = static_cast<size_t>(b.n);
  b.low = p + kHeaderBytes;
  b.hi = b.low + n;
  b.codes = b.hi + (b.dtype == Dtype::kFp16 ? 3 * n / 8 : 0);
  b.exc_pos = b.codes + static_cast<size_t>(b.width) * n / 8;
  b.exc_exp = b.exc_pos + 2 * static_cast<size_t>(b.n_exc);
  b.bytes = static_cast<size_t>(b.exc_exp + b.n_exc - p);
  return b;
}

// Exceptions of one block as a byte per element: base ^ exponent at an exception, 0 elsewhere.
// The decoders XOR it into (code + base) — an exception's code is 0 — so exceptions cost one
// load and one XOR per chunk and no branch, in any decode order (the attention core walks K row
// by row but V column tile by column tile). Only exception positions are ever non-zero: they are
// set when a block is opened and cleared when it is closed.
// Loading 16 bytes at kOneHot8 + 16 - i gives 0xFF in byte i only.
alignas(64) inline constexpr uint8_t kOneHot8[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                     0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

class ExceptionBytes {
 public:
  ExceptionBytes() : bytes_(Buffer()) {}
  // Each exception rewrites its 16-byte chunk with one 16-byte load and store (no branches on
  // the data): the decoders read the bytes with 16- and 8-byte loads right away, and a wide load
  // overlapping recent single-byte stores cannot be forwarded from the store buffer.
  void Open(const BlockView& v) {
    view_ = v;
    for (int i = 0; i < v.n_exc; ++i) {
      const int pos = ReadU16(v.exc_pos + 2 * i);
      const uint8_t val = static_cast<uint8_t>(v.base ^ v.exc_exp[i]);
      __m128i* chunk = reinterpret_cast<__m128i*>(bytes_ + (pos & ~15));
      const __m128i lane = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kOneHot8 + 16 - (pos & 15)));
      _mm_store_si128(chunk, _mm_blendv_epi8(_mm_load_si128(chunk), _mm_set1_epi8(static_cast<char>(val)), lane));
    }
  }
  void Close() {
    for (int i = 0; i < view_.n_exc; ++i) {
      _mm_store_si128(reinterpret_cast<__m128i*>(bytes_ + (ReadU16(view_.exc_pos + 2 * i) & ~15)), _mm_setzero_si128());
    }
    view_.n_exc = 0;
  }
  const uint8_t* data() const { return bytes_; }

 private:
  // One zeroed buffer per thread, reused by every attention call on it.
  static uint8_t* Buffer() {
    alignas(64) thread_local uint8_t buf[kMaxElements + 16] = {};
    return buf;
  }
  uint8_t* bytes_;
  BlockView view_;
};

// Sections of a sealed block plus its exception bytes.
struct PackedBlock {
  const uint8_t* low;
  const uint8_t* hi;  // fp16 only
  const uint8_t* codes;
  const uint8_t* exc;  // ExceptionBytes
  int base, width, hd;
  NextBlock next;

  // Exponents of elements [e0, e0 + 8) as 32-bit lanes, exceptions included.
  template <int W>
  [[gnu::always_inline]] __m256i Exponents8(int e0) const {
    __m128i x = _mm_setzero_si128();
    if constexpr (W > 0) {
      uint64_t bits;
      std::memcpy(&bits, codes + W * (e0 / 8), 8);  // regions carry 8 bytes of tail padding
      const uint64_t mask = 0x0101010101010101ull * ((1u << W) - 1u);
      x = _mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(bits, mask)));
    }
    x = _mm_add_epi8(x, _mm_set1_epi8(static_cast<char>(base)));  // code + base <= 255
    x = _mm_xor_si128(x, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(exc + e0)));
    return _mm256_cvtepu8_epi32(x);
  }
  [[gnu::always_inline]] __m256i Low8(int e0) const {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(low + e0)));
  }
};

// 16 bytes at p + 0..15 in the order [0-3, 8-11, 4-7, 12-15] (see PackedBf16Reader).
inline __m128i LoadInterleaved16(const uint8_t* p) {
  return _mm_unpacklo_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
}

// bf16 block with code width W, widened 16 values at a time in 16-bit lanes. The 16 values are
// assembled in the word order [0-3, 8-11 | 4-7, 12-15] so that one unpack per half widens them
// to fp32 in natural order.
template <int W>
struct PackedBf16Reader {
  PackedBlock b;
  void Prefetch(int i, int n) const { b.next.Prefetch(i, n); }

  template <int CW>
  [[gnu::always_inline]] void Load(int slot, int c, __m256* v) const {
    const int e0 = slot * b.hd + c * CW;
    if constexpr (CW == 8) {
      v[0] = Bf16LanesF32(b.Low8(e0), b.Exponents8<W>(e0));
    } else {
      __m128i cb = _mm_setzero_si128();
      if constexpr (W > 0) {
        const uint64_t mask = 0x0101010101010101ull * ((1u << W) - 1u);
        uint64_t lo, hi;
        std::memcpy(&lo, b.codes + W * (e0 / 8), 8);
        std::memcpy(&hi, b.codes + W * (e0 / 8) + W, 8);
        cb = _mm_unpacklo_epi32(_mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(lo, mask))),
                                _mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(hi, mask))));
      }
      cb = _mm_add_epi8(cb, _mm_set1_epi8(static_cast<char>(b.base)));  // code + base <= 255
      cb = _mm_xor_si128(cb, LoadInterleaved16(b.exc + e0));
      const __m256i e16 = _mm256_slli_epi16(_mm256_cvtepu8_epi16(cb), 7);
      const __m128i lb = LoadInterleaved16(b.low + e0);
      const __m256i l16 = _mm256_cvtepu8_epi16(lb);
      // bf16 = sign<<15 | exp<<7 | mant7, from low = sign<<7 | mant7
      const __m256i sm = _mm256_and_si256(_mm256_or_si256(l16, _mm256_slli_epi16(l16, 8)), _mm256_set1_epi16(static_cast<int16_t>(0x807F)));
      const __m256i h = _mm256_or_si256(sm, e16);
      const __m256i zero = _mm256_setzero_si256();
      v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h));
      v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h));
    }
  }
};

// fp16 block (any width), 8 values at a time.
struct PackedF16Reader {
  PackedBlock b;
  void Prefetch(int i, int n) const { b.next.Prefetch(i, n); }

  __m256i Exponents8(int e0) const {
    switch (b.width) {
      case 0: return b.Exponents8<0>(e0);
      case 1: return b.Exponents8<1>(e0);
      case 2: return b.Exponents8<2>(e0);
      case 3: return b.Exponents8<3>(e0);
      case 4: return b.Exponents8<4>(e0);
      default: return b.Exponents8<5>(e0);
    }
  }
  template <int CW>
  [[gnu::always_inline]] void Load(int slot, int c, __m256* v) const {
    KEEL_UNROLL
    for (int u = 0; u < CW / 8; ++u) {
      const int e0 = slot * b.hd + c * CW + 8 * u;
      v[u] = Fp16LanesF32(b.hi, e0, b.Low8(e0), Exponents8(e0));
    }
  }
};

// Where a codec's regions are: one per (block, KV head, K or V), region_bytes apart.
struct Layout {
KvShape shape;
DType dtype;
size_t region_bytes;
const uint8_t* Region(const uint8_t* block, int kvh, int which) const {
  return block + (static_cast<size_t>(kvh) * 2 + which) * region_bytes;
}
};

// Block source for the attention core: hands out a reader typed by the region's state (filling,
// or sealed with its code width), so the decode loops have no per-value branches.
struct Blocks {
  const Layout* layout;
  const uint8_t* const* blocks;
  int n_tokens;
  int kvh = 0;
  ExceptionBytes exc{};

  void Begin(int head) { kvh = head; }
  template <class F>
  void K(int b, F&& f) { Visit(0, b, f); }
  template <class F>
  void V(int b, F&& f) { Visit(1, b, f); }

  template <class F>
  void Visit(int which, int b, F&& f) {
    const KvShape& s = layout->shape;
    const uint8_t* r = layout->Region(blocks[b], kvh, which);
    const bool bf16 = layout->dtype == DType::kBF16;
    const bool packed = r[0] == kMagic;
    const BlockView v = packed ? ViewTrusted(r) : BlockView{};
    // The next block: about as many bytes as this one (its own size is in its header, which
    // is not in cache yet).
    NextBlock next;
    if ((b + 1) * s.block_tokens < n_tokens) {
      next = {reinterpret_cast<const char*>(layout->Region(blocks[b + 1], kvh, which)),
              packed ? std::min(v.bytes + 64, layout->region_bytes) : layout->region_bytes};
    }
    if (!packed) {  // still filling: plain 16-bit rows after the header
      if (bf16) {
        f(PlainRowsReader<DType::kBF16>{r + kHeaderBytes, s.head_dim, next});
      } else {
        f(PlainRowsReader<DType::kF16>{r + kHeaderBytes, s.head_dim, next});
      }
      return;
    }
    exc.Open(v);
    const PackedBlock pb{v.low, v.hi, v.codes, exc.data(), v.base, v.width, s.head_dim, next};
    if (!bf16) {
      f(PackedF16Reader{pb});
    } else {
      switch (v.width) {
        case 0: f(PackedBf16Reader<0>{pb}); break;
        case 1: f(PackedBf16Reader<1>{pb}); break;
        case 2: f(PackedBf16Reader<2>{pb}); break;
        case 3: f(PackedBf16Reader<3>{pb}); break;
        case 4: f(PackedBf16Reader<4>{pb}); break;
        case 5: f(PackedBf16Reader<5>{pb}); break;
        case 6: f(PackedBf16Reader<6>{pb}); break;
        case 7: f(PackedBf16Reader<7>{pb}); break;
        default: f(PackedBf16Reader<8>{pb}); break;
      }
    }
    exc.Close();
  }
};


}  // namespace keel::kv::zipfusion::internal
