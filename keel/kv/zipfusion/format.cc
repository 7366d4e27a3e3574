// ZipFusion block encoder, validator and scalar reference decoder. The layout is specified in
// format.h; this file follows it field by field.
//
// The encoder runs on the decode path (a cache block is encoded when it fills), so it is two
// linear passes: a histogram of the exponents (which fixes width, base and the exception count,
// hence every section offset), then one pass that writes all sections 8 elements at a time with
// SSE/BMI2 — 8 elements are exactly one byte-aligned unit in every section.
#include "keel/kv/zipfusion/format.h"

#include <algorithm>
#include <array>
#include <string>

namespace keel::kv::zipfusion {
namespace {

// Field extraction for the two dtypes. bf16: s[15] e[14:7] m[6:0]; fp16: s[15] e[14:10] m[9:0].
inline int ExponentOf(uint16_t v, Dtype t) { return t == Dtype::kBf16 ? (v >> 7) & 0xFF : (v >> 10) & 0x1F; }
inline int MaxExponent(Dtype t) { return (1 << ExponentBits(t)) - 1; }
inline int MaxWidth(Dtype t) { return ExponentBits(t); }

size_t SizeFor(int n, Dtype t, int width, int n_exc) {
  const size_t un = static_cast<size_t>(n);
  return kHeaderBytes + un + (t == Dtype::kFp16 ? 3 * un / 8 : 0) + static_cast<size_t>(width) * un / 8 +
         3 * static_cast<size_t>(n_exc);
}

bool ValidCount(int n) { return n > 0 && n % 8 == 0 && n <= kMaxElements; }

// Exponent histogram. Exponents are extracted 8 at a time with SSE into a small byte buffer,
// then counted into four interleaved tables so that runs of equal exponents (the common case in
// KV data) do not serialise on one counter's store-to-load forwarding. (~1 cycle per element;
// eight u16 tables measured no faster.)
std::array<int, 256> Histogram(const uint16_t* values, int n, Dtype t) {
  std::array<std::array<int, 256>, 4> h{};
  const bool bf16 = t == Dtype::kBf16;
  const __m128i mask = _mm_set1_epi16(static_cast<int16_t>(MaxExponent(t)));
  constexpr int kChunk = 256;
  alignas(16) uint8_t exps[kChunk];
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int len = std::min(kChunk, n - c0);  // a multiple of 8
    for (int i = 0; i < len; i += 16) {
      // len is a multiple of 8; an odd final unit is paired with zeros that are not counted.
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + c0 + i));
      const __m128i b = i + 8 < len ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + c0 + i + 8))
                                    : _mm_setzero_si128();
      const __m128i ea = _mm_and_si128(bf16 ? _mm_srli_epi16(a, 7) : _mm_srli_epi16(a, 10), mask);
      const __m128i eb = _mm_and_si128(bf16 ? _mm_srli_epi16(b, 7) : _mm_srli_epi16(b, 10), mask);
      _mm_store_si128(reinterpret_cast<__m128i*>(exps + i), _mm_packus_epi16(ea, eb));
    }
    for (int i = 0; i < len; i += 4) {
      ++h[0][exps[i]];
      ++h[1][exps[i + 1]];
      ++h[2][exps[i + 2]];
      ++h[3][exps[i + 3]];
    }
  }
  for (int e = 0; e < 256; ++e) h[0][e] += h[1][e] + h[2][e] + h[3][e];
  return h[0];
}

// The search is exact over all (w, base) with base + 2^w - 1 <= max_e, but skips what cannot
// matter: a window holding none of [lo, hi] (the occupied exponents) never has the most elements,
// and once a width covers [lo, hi] without exceptions every wider one is strictly larger. So
// clustered data costs a few dozen window evaluations instead of 9 x 256.
WidthChoice ChooseFromHistogram(const std::array<int, 256>& hist, int n, Dtype t) {
  const int max_e = MaxExponent(t);
  int lo = 0, hi = max_e;
  while (hist[lo] == 0) ++lo;  // n > 0, so some bin is occupied
  while (hist[hi] == 0) --hi;
  // prefix[e] = count of exponents < e, so a window [b, b+2^w) holds prefix[b+2^w] - prefix[b].
  std::array<int, 257> prefix;
  prefix[0] = 0;
  for (int e = 0; e <= max_e; ++e) prefix[e + 1] = prefix[e] + hist[e];
  WidthChoice best;
  best.bytes = ~size_t{0};
  for (int w = 0; w <= MaxWidth(t); ++w) {
    const int span = 1 << w;
    const int last = max_e - span + 1;  // largest legal base
    int best_base = 0, best_in = -1;
    for (int b = std::max(0, std::min(lo - span + 1, last)); b <= std::min(hi, last); ++b) {
      const int in = prefix[b + span] - prefix[b];
      if (in > best_in) best_in = in, best_base = b;  // strict: ties keep the smaller base
    }
    const int n_exc = n - best_in;
    const size_t bytes = SizeFor(n, t, w, n_exc);
    if (bytes < best.bytes) best = WidthChoice{w, best_base, n_exc, bytes};  // ties keep the smaller w
    if (n_exc == 0) break;
  }
  return best;
}

inline void PutU16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

struct Sections {
  uint8_t* low;
  uint8_t* hi;
  uint8_t* codes;
  uint8_t* exc_pos;
  uint8_t* exc_exp;
};

// Writes every section, one 8-element unit per iteration. Codes and hi bits are stored with a
// full 8-/4-byte store (its excess bytes are overwritten by the next unit) except for the last
// units, where that store would leave the section: no variable-length memcpy in the hot loop,
// and no byte is written outside the block. Returns the number of exceptions written.
template <Dtype T>
int EncodeUnits(const uint16_t* v, int n, int width, int base, const Sections& s) {
  const size_t code_bytes = static_cast<size_t>(width) * static_cast<size_t>(n) / 8;
  const int wide_code_units = width == 0 || code_bytes < 8 ? 0 : static_cast<int>((code_bytes - 8) / width) + 1;
  const int wide_hi_units = 3 * n / 8 < 4 ? 0 : (3 * n / 8 - 4) / 3 + 1;
  const __m128i base16 = _mm_set1_epi16(static_cast<int16_t>(base));
  const __m128i high_bits = _mm_set1_epi16(static_cast<int16_t>(~((1 << width) - 1)));
  const uint64_t code_mask = 0x0101010101010101ull * ((1u << width) - 1u);
  int exc = 0;
  for (int k = 0, start = 0; start < n; ++k, start += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + start));
    __m128i low16, exp16;
    if constexpr (T == Dtype::kBf16) {
      low16 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x, 8), _mm_set1_epi16(0x80)),
                           _mm_and_si128(x, _mm_set1_epi16(0x7F)));
      exp16 = _mm_and_si128(_mm_srli_epi16(x, 7), _mm_set1_epi16(0xFF));
    } else {
      low16 = _mm_and_si128(x, _mm_set1_epi16(0xFF));
      exp16 = _mm_and_si128(_mm_srli_epi16(x, 10), _mm_set1_epi16(0x1F));
      // hi: sign<<2 | mantissa[9:8], 3 bits per element, 24 bits per unit.
      const __m128i hi16 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(x, 13), _mm_set1_epi16(4)),
                                        _mm_and_si128(_mm_srli_epi16(x, 8), _mm_set1_epi16(3)));
      const uint64_t hib = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(hi16, hi16)));
      const uint32_t hi24 = static_cast<uint32_t>(_pext_u64(hib, 0x0707070707070707ull));
      std::memcpy(s.hi + 3 * k, &hi24, k < wide_hi_units ? 4 : 3);
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(s.low + start), _mm_packus_epi16(low16, low16));

    // code = exponent - base; anything with bits above the width (including negative
    // differences, which wrap to large u16) is an exception and gets code 0.
    const __m128i d = _mm_sub_epi16(exp16, base16);
    const __m128i inside = _mm_cmpeq_epi16(_mm_and_si128(d, high_bits), _mm_setzero_si128());
    if (width > 0) {
      const __m128i codes16 = _mm_and_si128(inside, d);
      const uint64_t bytes = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(codes16, codes16)));
      const uint64_t packed = _pext_u64(bytes, code_mask);
      uint8_t* dst = s.codes + static_cast<size_t>(width) * k;
      if (k < wide_code_units) {
        std::memcpy(dst, &packed, 8);
      } else {
        std::memcpy(dst, &packed, static_cast<size_t>(width));
      }
    }
    // One bit per element outside the window (16-bit masks packed to bytes, byte sign bits).
    unsigned m = ~static_cast<unsigned>(_mm_movemask_epi8(_mm_packs_epi16(inside, inside))) & 0xFF;
    while (m != 0) {
      const int lane = __builtin_ctz(m);
      m &= m - 1;
      PutU16(s.exc_pos + 2 * exc, static_cast<uint16_t>(start + lane));
      s.exc_exp[exc] = static_cast<uint8_t>(ExponentOf(v[start + lane], T));
      ++exc;
    }
  }
  return exc;
}

Status Corrupt(size_t offset, const std::string& what) {
  return Status::Corruption("zipfusion block: " + what + " at offset " + std::to_string(offset));
}

}  // namespace

WidthChoice ChooseWidth(const uint16_t* values, int n, Dtype dtype) {
  if (!ValidCount(n)) return WidthChoice{};
  return ChooseFromHistogram(Histogram(values, n, dtype), n, dtype);
}

Result<size_t> EncodeBlock(const uint16_t* values, int n, Dtype dtype, uint8_t* out, size_t capacity) {
  if (!ValidCount(n)) {
    return Status::InvalidArgument("zipfusion: element count " + std::to_string(n) +
                                   " is not a positive multiple of 8 up to " + std::to_string(kMaxElements));
  }
  if (dtype != Dtype::kBf16 && dtype != Dtype::kFp16) return Status::InvalidArgument("zipfusion: bad dtype");
  const WidthChoice c = ChooseWidth(values, n, dtype);
  if (capacity < c.bytes) {
    return Status::InvalidArgument("zipfusion: output capacity " + std::to_string(capacity) + " < " +
                                   std::to_string(c.bytes) + " bytes needed");
  }
  out[0] = kMagic;
  out[1] = static_cast<uint8_t>(dtype);
  out[2] = static_cast<uint8_t>(c.width);
  out[3] = static_cast<uint8_t>(c.base);
  PutU16(out + 4, static_cast<uint16_t>(n));
  PutU16(out + 6, static_cast<uint16_t>(c.n_exc));

  const size_t un = static_cast<size_t>(n);
  Sections s;
  s.low = out + kHeaderBytes;
  s.hi = s.low + un;
  s.codes = s.hi + (dtype == Dtype::kFp16 ? 3 * un / 8 : 0);
  s.exc_pos = s.codes + static_cast<size_t>(c.width) * un / 8;
  s.exc_exp = s.exc_pos + 2 * static_cast<size_t>(c.n_exc);
  const int exc = dtype == Dtype::kBf16 ? EncodeUnits<Dtype::kBf16>(values, n, c.width, c.base, s)
                                        : EncodeUnits<Dtype::kFp16>(values, n, c.width, c.base, s);
  // The histogram and the unit pass classify with the same rule, so the counts agree.
  if (exc != c.n_exc) return Status::Internal("zipfusion: exception count mismatch");
  return c.bytes;
}

Result<BlockView> ParseBlock(const uint8_t* data, size_t size) {
  if (data == nullptr || size < kHeaderBytes) {
    return Corrupt(size, "truncated header (" + std::to_string(size) + " of 8 bytes)");
  }
  BlockView b;
  if (data[0] != kMagic) return Corrupt(0, "bad magic " + std::to_string(data[0]));
  if (data[1] > 1) return Corrupt(1, "bad dtype " + std::to_string(data[1]));
  b.dtype = static_cast<Dtype>(data[1]);
  b.width = data[2];
  if (b.width > MaxWidth(b.dtype)) return Corrupt(2, "width " + std::to_string(b.width) + " out of range");
  b.base = data[3];
  const int max_e = MaxExponent(b.dtype);
  if (b.base + (1 << b.width) - 1 > max_e) {
    return Corrupt(3, "base " + std::to_string(b.base) + " + 2^" + std::to_string(b.width) +
                          " - 1 exceeds the exponent range");
  }
  b.n = ReadU16(data + 4);
  if (!ValidCount(b.n)) {
    return Corrupt(4, "element count " + std::to_string(b.n) + " not a positive multiple of 8 up to " +
                          std::to_string(kMaxElements));
  }
  b.n_exc = ReadU16(data + 6);
  if (b.n_exc > b.n) return Corrupt(6, "exception count " + std::to_string(b.n_exc) + " > n");

  // All sizes below are bounded by ~2 * 2^16 * 3, so size_t arithmetic cannot overflow.
  const size_t un = static_cast<size_t>(b.n);
  const size_t low_off = kHeaderBytes;
  const size_t hi_off = low_off + un;
  const size_t codes_off = hi_off + (b.dtype == Dtype::kFp16 ? 3 * un / 8 : 0);
  const size_t pos_off = codes_off + static_cast<size_t>(b.width) * un / 8;
  const size_t exp_off = pos_off + 2 * static_cast<size_t>(b.n_exc);
  const size_t end = exp_off + static_cast<size_t>(b.n_exc);
  if (end > size) {
    return Corrupt(size, "block truncated (" + std::to_string(size) + " bytes, sections need " +
                             std::to_string(end) + ")");
  }
  b.low = data + low_off;
  b.hi = b.dtype == Dtype::kFp16 ? data + hi_off : nullptr;
  b.codes = data + codes_off;
  b.exc_pos = data + pos_off;
  b.exc_exp = data + exp_off;
  b.bytes = end;

  int prev = -1;
  const int lo = b.base, hi = b.base + (1 << b.width);  // representable exponents: [lo, hi)
  for (int i = 0; i < b.n_exc; ++i) {
    const int pos = ReadU16(b.exc_pos + 2 * i);
    if (pos >= b.n) return Corrupt(pos_off + 2 * i, "exception position " + std::to_string(pos) + " >= n");
    if (pos <= prev) return Corrupt(pos_off + 2 * i, "exception positions not strictly increasing");
    prev = pos;
    const int e = b.exc_exp[i];
    if (e > max_e) return Corrupt(exp_off + i, "exception exponent " + std::to_string(e) + " out of range");
    if (e >= lo && e < hi) {
      return Corrupt(exp_off + i, "exception exponent " + std::to_string(e) + " is representable by a code");
    }
    // The encoder writes code 0 for exceptions; anything else is not a block it produced.
    if (b.width > 0) {
      const size_t bit = static_cast<size_t>(b.width) * static_cast<size_t>(pos);
      const uint8_t* p = b.codes + bit / 8;
      const unsigned two = p[0] | (bit % 8 + b.width > 8 ? p[1] << 8 : 0);
      if (((two >> (bit % 8)) & ((1u << b.width) - 1u)) != 0) {
        return Corrupt(codes_off + bit / 8, "nonzero code at exception position " + std::to_string(pos));
      }
    }
  }
  return b;
}

void DecodeBlock(const BlockView& b, uint16_t* out) {
  // Plain scalar code on purpose: the reference the fused decoder is tested against.
  const bool bf16 = b.dtype == Dtype::kBf16;
  for (int i = 0; i < b.n; ++i) {
    unsigned code = 0;
    if (b.width > 0) {
      const size_t bit = static_cast<size_t>(b.width) * static_cast<size_t>(i);
      const uint8_t* p = b.codes + bit / 8;
      // A code spans at most two bytes; the second is only read when the code reaches into it.
      const unsigned two = p[0] | (bit % 8 + b.width > 8 ? p[1] << 8 : 0);
      code = (two >> (bit % 8)) & ((1u << b.width) - 1u);
    }
    const unsigned e = static_cast<unsigned>(b.base) + code;
    const unsigned low = b.low[i];
    if (bf16) {
      out[i] = static_cast<uint16_t>(((low & 0x80) << 8) | (e << 7) | (low & 0x7F));
    } else {
      const size_t bit = 3 * static_cast<size_t>(i);
      const uint8_t* p = b.hi + bit / 8;
      const unsigned two = p[0] | (bit % 8 + 3 > 8 ? p[1] << 8 : 0);
      const unsigned h = (two >> (bit % 8)) & 7u;
      out[i] = static_cast<uint16_t>(((h & 4) << 13) | (e << 10) | ((h & 3) << 8) | low);
    }
  }
  for (int j = 0; j < b.n_exc; ++j) {
    const int pos = ReadU16(b.exc_pos + 2 * j);
    const unsigned e = b.exc_exp[j];
    out[pos] = bf16 ? static_cast<uint16_t>((out[pos] & ~0x7F80u) | (e << 7))
                    : static_cast<uint16_t>((out[pos] & ~0x7C00u) | (e << 10));
  }
}

}  // namespace keel::kv::zipfusion
