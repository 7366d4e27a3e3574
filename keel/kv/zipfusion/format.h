// ZipFusion block format: lossless exponent coding of 16-bit floats (bf16 or fp16).
//
// One ZipFusion block holds `n` 16-bit values: one layer's K (or V) for one KV head over one
// cache block, token-major (element t*head_dim + d). Sign and fraction bits are stored verbatim;
// exponents are stored as w-bit offsets from a per-block base, with w chosen per block from the
// block's exponent histogram; values whose exponent falls outside [base, base + 2^w) are listed
// as exceptions (position, exponent). Lossless for every input (zeros, subnormals, inf, NaN).
//
// Byte layout (little-endian), all sections back to back, no padding:
//   header (8 bytes)
//     u8  magic        0x5A
//     u8  dtype        0 = bf16, 1 = fp16
//     u8  width        w: 0..8 (bf16), 0..5 (fp16)
//     u8  base         base exponent; base + 2^w - 1 <= 255 (bf16) or 31 (fp16), so no code
//                      can produce an exponent outside the dtype's field
//     u16 n            element count, 1..kMaxElements, a multiple of 8
//     u16 n_exc        exception count, 0..n
//   low   [n] bytes         bf16: sign<<7 | mantissa[6:0]        fp16: mantissa[7:0]
//   hi    [3n/8] bytes      fp16 only: 3 bits per element, sign<<2 | mantissa[9:8],
//                           packed LSB-first (element i at bits 3i..3i+2)
//   codes [w*n/8] bytes     w bits per element, packed LSB-first (element i at bits wi..wi+w-1);
//                           exponent = base + code; the code of an exception is 0
//   exc_pos [n_exc] u16     strictly increasing positions
//   exc_exp [n_exc] u8      the exponent at that position: outside [base, base + 2^w) (else
//                           a code would have held it) and inside the dtype's exponent range
// Because n is a multiple of 8, every run of 8 elements starting at a multiple of 8 begins on a
// byte boundary in every section: element 8k's low byte is at low + 8k, its hi bits at hi + 3k,
// its codes at codes + w*k. The fused decoder reads 8 elements at a time that way.
//
// Size: 8 + n + (fp16 ? 3n/8 : 0) + w*n/8 + 3*n_exc. The encoder picks the (w, base) of least
// size; w = 8 (bf16) or 5 (fp16) covers every exponent with no exceptions, so a block is never
// larger than MaxEncodedBytes(n, dtype) = 8 + 2n (bf16) or 8 + 2n (fp16: n + 3n/8 + 5n/8).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "keel/core/status.h"

namespace keel::kv::zipfusion {

inline constexpr uint8_t kMagic = 0x5A;
inline constexpr size_t kHeaderBytes = 8;
inline constexpr int kMaxElements = 32768;

enum class Dtype : uint8_t { kBf16 = 0, kFp16 = 1 };

inline int ExponentBits(Dtype t) { return t == Dtype::kBf16 ? 8 : 5; }
inline size_t MaxEncodedBytes(int n, Dtype) { return kHeaderBytes + 2 * static_cast<size_t>(n); }

// A validated block: pointers into its sections. Cheap to build (ParseBlock), no copies.
struct BlockView {
  Dtype dtype = Dtype::kBf16;
  int width = 0;
  int base = 0;
  int n = 0;
  int n_exc = 0;
  const uint8_t* low = nullptr;
  const uint8_t* hi = nullptr;      // fp16 only
  const uint8_t* codes = nullptr;
  const uint8_t* exc_pos = nullptr; // u16 little-endian, may be unaligned
  const uint8_t* exc_exp = nullptr;
  size_t bytes = 0;                 // total encoded size
};

// Encodes `n` values (raw 16-bit patterns) into `out` (capacity >= MaxEncodedBytes). Returns the
// encoded size. InvalidArgument if n is not a positive multiple of 8 up to kMaxElements.
Result<size_t> EncodeBlock(const uint16_t* values, int n, Dtype dtype, uint8_t* out, size_t capacity);

// Validates `bytes` as a block: header fields in range, sections inside `size`, exception
// positions strictly increasing and < n, exception exponents not representable by a code.
// Corruption with the offset of the first bad byte otherwise. Never reads outside [data, size).
Result<BlockView> ParseBlock(const uint8_t* data, size_t size);

// Reference decoder (scalar): writes the n raw 16-bit values.
void DecodeBlock(const BlockView& b, uint16_t* out);

// Size the encoder would choose for these values, and the (width, base) it would pick.
struct WidthChoice {
  int width = 0;
  int base = 0;
  int n_exc = 0;
  size_t bytes = 0;
};
WidthChoice ChooseWidth(const uint16_t* values, int n, Dtype dtype);

// ---- Fused decoding: 8 elements at a time into fp32 lanes, exceptions patched via a cursor.

// Walks the exception list in position order while a row is decoded chunk by chunk.
struct ExceptionCursor {
  int next = 0;  // index of the first exception not yet passed
};

inline uint16_t ReadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Reads n (0..8) bytes little-endian without reading past p + n. Built from whole 1/2/4/8-byte
// loads: odd-sized memcpy compiles to partial stack stores plus a wide reload, a store-forwarding
// stall on every chunk of the decode path.
inline uint64_t LoadLe(const uint8_t* p, int n) {
  uint16_t h;
  uint32_t w;
  uint64_t d;
  switch (n) {
    case 8: std::memcpy(&d, p, 8); return d;
    case 7: std::memcpy(&w, p, 4); std::memcpy(&h, p + 4, 2); return w | (uint64_t{h} << 32) | (uint64_t{p[6]} << 48);
    case 6: std::memcpy(&w, p, 4); std::memcpy(&h, p + 4, 2); return w | (uint64_t{h} << 32);
    case 5: std::memcpy(&w, p, 4); return w | (uint64_t{p[4]} << 32);
    case 4: std::memcpy(&w, p, 4); return w;
    case 3: std::memcpy(&h, p, 2); return h | (uint64_t{p[2]} << 16);
    case 2: std::memcpy(&h, p, 2); return h;
    case 1: return p[0];
    default: return 0;
  }
}

// Exponents of elements [start, start+8) (start a multiple of 8) as 8 x i32, exceptions patched.
// `cur` must not be past `start` (rows are decoded in increasing element order; to jump
// backwards reset it to 0).
inline __m256i ChunkExponents(const BlockView& b, int start, ExceptionCursor& cur) {
  __m256i e;
  if (b.width == 0) {
    e = _mm256_set1_epi32(b.base);
  } else {
    const uint64_t bits = LoadLe(b.codes + static_cast<size_t>(b.width) * (start / 8), b.width);
    const uint64_t mask = 0x0101010101010101ull * ((1u << b.width) - 1u);
    const uint64_t bytes = _pdep_u64(bits, mask);  // one code per byte
    e = _mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes))),
                         _mm256_set1_epi32(b.base));
  }
  // Skip exceptions before this chunk (possible after a forward jump), then patch ours.
  while (cur.next < b.n_exc && ReadU16(b.exc_pos + 2 * cur.next) < start) ++cur.next;
  if (cur.next < b.n_exc && ReadU16(b.exc_pos + 2 * cur.next) < start + 8) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), e);
    while (cur.next < b.n_exc) {
      const int pos = ReadU16(b.exc_pos + 2 * cur.next);
      if (pos >= start + 8) break;
      lanes[pos - start] = b.exc_exp[cur.next];
      ++cur.next;
    }
    e = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  }
  return e;
}

// 8 bf16 values rebuilt from their low bytes (sign<<7 | mantissa) and exponents, as fp32 lanes:
// fp32 bits = (sign<<15 | exp<<7 | mant7) << 16.
inline __m256 Bf16LanesF32(__m256i low, __m256i e) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(low, _mm256_set1_epi32(0x80)), 24);
  const __m256i mant = _mm256_slli_epi32(_mm256_and_si256(low, _mm256_set1_epi32(0x7F)), 16);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_or_si256(sign, _mm256_slli_epi32(e, 23)), mant));
}

// 8 fp16 values rebuilt from their low bytes, their 3-bit sign/mantissa-high fields (the `hi`
// section) and exponents, as fp32 lanes (F16C).
inline __m256 Fp16LanesF32(const uint8_t* hi_section, int start, __m256i low, __m256i e) {
  // fp16 = sign<<15 | exp<<10 | mhi<<8 | low
  const uint64_t hi24 = LoadLe(hi_section + 3 * (start / 8), 3);
  const uint64_t hib = _pdep_u64(hi24, 0x0707070707070707ull);
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(hib)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(4)), 13);
  const __m256i mhi = _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 8);
  const __m256i h = _mm256_or_si256(_mm256_or_si256(sign, _mm256_slli_epi32(e, 10)), _mm256_or_si256(mhi, low));
  // Pack 8 x i32 (all < 65536) into 8 x u16 in order.
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  return _mm256_cvtph_ps(packed);
}

// Elements [start, start+8) widened to fp32, bit-exact with widening the original 16-bit values.
inline __m256 DecodeChunkF32(const BlockView& b, int start, ExceptionCursor& cur) {
  const __m256i e = ChunkExponents(b, start, cur);
  uint64_t low8;
  std::memcpy(&low8, b.low + start, 8);
  const __m256i low = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(low8)));
  if (b.dtype == Dtype::kBf16) return Bf16LanesF32(low, e);
  return Fp16LanesF32(b.hi, start, low, e);
}

}  // namespace keel::kv::zipfusion
