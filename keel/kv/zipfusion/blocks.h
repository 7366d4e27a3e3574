// ZipFusion's block source and readers for the shared attention core (internal to the codec):
// how a region's rows are widened into fp32 lanes, per encoding state and code width.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
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

// Word (16-bit lane) of a 256-bit register that element e of a 16-value chunk occupies in the
// bf16 decoder: elements 0-7 in the even words, 8-15 in the odd ones, so that shifting each
// dword left by 16 widens elements 0-7 and masking its high half widens 8-15, both in order.
constexpr int Bf16WordOf(int e) { return e < 8 ? 2 * e : 2 * (e - 8) + 1; }
// The same as a table, for opening blocks.
inline constexpr std::array<uint8_t, 16> kBf16WordOf = [] {
  std::array<uint8_t, 16> t{};
  for (int e = 0; e < 16; ++e) t[e] = static_cast<uint8_t>(Bf16WordOf(e));
  return t;
}();

// Exceptions of the open block, as one value per element that the decoders fold in without a
// branch (the attention core walks K row by row but V column tile by column tile, so a cursor
// over the sorted exception list would not do):
//  * bf16: a word per element, (exponent - base) << 7 mod 2^16 at an exception and 0 elsewhere,
//    added to the bf16 word built from code + base (an exception's code is 0); each 16-element
//    chunk in the 16-value decoder's word order (Bf16WordOf);
//  * fp16: a byte per element, base ^ exponent at an exception, XORed into code + base.
// Only exception positions are ever non-zero: they are set when a block is opened and cleared
// when it is closed, with plain scalar stores (a few integer instructions per exception, which
// run beside the vector decode; ~1-3 % of values are exceptions on real K/V).
class Exceptions {
 public:
  Exceptions() : bytes_(Bytes()), words_(Words()), offsets_(Offsets()) {}
  void Open(const BlockView& v) {
    n_ = v.n_exc;
    if (v.dtype == Dtype::kBf16) {
      // 16 exceptions at a time: offsets and words in vector lanes, then 16 scalar stores (AVX2
      // has no scatter); ~4 instructions per exception instead of ~11.
      const __m256i word_of = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kBf16WordOf.data())));
      const __m256i base = _mm256_set1_epi16(static_cast<int16_t>(v.base));
      int i = 0;
      for (; i + 16 <= n_; i += 16) {
        const __m256i pos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.exc_pos + 2 * i));
        // Bf16WordOf(pos & 15) by a byte shuffle: the high byte of each lane indexes entry 0 = 0.
        const __m256i word = _mm256_shuffle_epi8(word_of, _mm256_and_si256(pos, _mm256_set1_epi16(15)));
        const __m256i off = _mm256_or_si256(_mm256_andnot_si256(_mm256_set1_epi16(15), pos), word);
        const __m256i exp = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v.exc_exp + i)));
        alignas(32) int16_t vals[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(vals), _mm256_slli_epi16(_mm256_sub_epi16(exp, base), 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(offsets_ + i), off);  // Close() clears these
        for (int j = 0; j < 16; ++j) words_[offsets_[i + j]] = vals[j];
      }
      for (; i < n_; ++i) {
        const int pos = ReadU16(v.exc_pos + 2 * i);
        const int off = (pos & ~15) + kBf16WordOf[pos & 15];
        words_[off] = static_cast<int16_t>(static_cast<uint16_t>((v.exc_exp[i] - v.base) << 7));
        offsets_[i] = static_cast<uint16_t>(off);
      }
      words_open_ = true;
    } else {
      for (int i = 0; i < n_; ++i) {
        const int pos = ReadU16(v.exc_pos + 2 * i);
        bytes_[pos] = static_cast<uint8_t>(v.base ^ v.exc_exp[i]);
        offsets_[i] = static_cast<uint16_t>(pos);
      }
      words_open_ = false;
    }
  }
  void Close() {
    if (words_open_) {
      for (int i = 0; i < n_; ++i) words_[offsets_[i]] = 0;
    } else {
      for (int i = 0; i < n_; ++i) bytes_[offsets_[i]] = 0;
    }
    n_ = 0;
  }
  const uint8_t* bytes() const { return bytes_; }
  const int16_t* words() const { return words_; }

 private:
  // One zeroed buffer of each kind per thread, reused by every attention call on it, and the
  // offsets the open block has set.
  static uint8_t* Bytes() {
    alignas(64) thread_local uint8_t buf[kMaxElements + 16] = {};
    return buf;
  }
  static int16_t* Words() {
    alignas(64) thread_local int16_t buf[kMaxElements + 16] = {};
    return buf;
  }
  static uint16_t* Offsets() {
    alignas(64) thread_local uint16_t buf[kMaxElements];
    return buf;
  }
  uint8_t* bytes_;
  int16_t* words_;
  uint16_t* offsets_;
  int n_ = 0;
  bool words_open_ = false;
};

// Sections of a sealed block plus its exceptions.
struct PackedBlock {
  const uint8_t* low;
  const uint8_t* hi;  // fp16 only
  const uint8_t* codes;
  const uint8_t* exc;         // Exceptions::bytes() (fp16)
  const int16_t* exc_words;   // Exceptions::words() (bf16)
  int base, width, hd;
  NextBlock next;

  // Codes of elements [e0, e0 + 8) as bytes.
  template <int W>
  [[gnu::always_inline]] __m128i Codes8(int e0) const {
    if constexpr (W == 0) {
      return _mm_setzero_si128();
    } else {
      uint64_t bits;
      std::memcpy(&bits, codes + W * (e0 / 8), 8);  // regions carry 8 bytes of tail padding
      const uint64_t mask = 0x0101010101010101ull * ((1u << W) - 1u);
      return _mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(bits, mask)));
    }
  }
  // Exponents of elements [e0, e0 + 8) as 32-bit lanes, exceptions (bytes) included.
  template <int W>
  [[gnu::always_inline]] __m256i Exponents8(int e0) const {
    __m128i x = _mm_add_epi8(Codes8<W>(e0), _mm_set1_epi8(static_cast<char>(base)));  // code + base <= 255
    x = _mm_xor_si128(x, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(exc + e0)));
    return _mm256_cvtepu8_epi32(x);
  }
  [[gnu::always_inline]] __m256i Low8(int e0) const {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(low + e0)));
  }
};

// Shuffle and multiplier constants of the 16-value bf16 decoder for code width W (see
// PackedBf16Reader); word w of its output holds the element e with Bf16WordOf(e) == w.
template <int W>
struct Bf16Consts {
  alignas(32) uint8_t low_idx[32];   // both bytes of word w <- low byte of element e
  alignas(32) uint8_t code_idx[32];  // word w <- the two code bytes holding element e's code
  alignas(32) uint16_t mul[16];      // 2^(7 - bit offset of e's code in those bytes)
  constexpr Bf16Consts() : low_idx{}, code_idx{}, mul{} {
    for (int e = 0; e < 16; ++e) {
      const int w = Bf16WordOf(e);
      const int bit = W * e, byte = bit / 8;
      low_idx[2 * w] = low_idx[2 * w + 1] = static_cast<uint8_t>(e);
      code_idx[2 * w] = static_cast<uint8_t>(byte);
      // Bytes past the 2W code bytes of the chunk hold no bits of this code: zero them.
      code_idx[2 * w + 1] = byte + 1 < 16 ? static_cast<uint8_t>(byte + 1) : 0x80;
      mul[w] = static_cast<uint16_t>(1u << (7 - bit % 8));
    }
  }
};
template <int W>
inline constexpr Bf16Consts<W> kBf16Consts{};

// bf16 block with code width W. 8 values: the bf16 words built in 32-bit lanes. 16 values
// (the hot path, ~10 vector instructions): build the 16 bf16 words in 16-bit lanes as
//   ((low | low << 8) & 0x807F)  +  ((code bytes * 2^(7-offset)) & mask) + base << 7  +  exception
// — one byte shuffle places each element's low byte, another the two bytes holding its code, a
// 16-bit multiply moves each code to bits 7.. whatever its offset — then widen them with one
// shift and one mask (the word order makes both halves come out in element order).
template <int W>
struct PackedBf16Reader {
  PackedBlock b;
  void Prefetch(int i, int n) const { b.next.Prefetch(i, n); }

  template <int CW>
  [[gnu::always_inline]] void Load(int slot, int c, __m256* v) const {
    if constexpr (CW == 8) {
      const int e0 = slot * b.hd + c * CW;
      const __m256i low = b.Low8(e0);
      const __m256i code = _mm256_cvtepu8_epi32(b.Codes8<W>(e0));
      // This half's exception words: the low (elements 0-7) or high (8-15) word of each dword of
      // its 16-element chunk; bits above the low word vanish in the final shift.
      const __m256i exc = _mm256_srl_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(b.exc_words + (e0 & ~15))),
                                           _mm_cvtsi32_si128(e0 & 8 ? 16 : 0));
      __m256i h = _mm256_and_si256(_mm256_or_si256(low, _mm256_slli_epi32(low, 8)), _mm256_set1_epi32(0x807F));
      h = _mm256_add_epi32(h, _mm256_slli_epi32(_mm256_add_epi32(code, _mm256_set1_epi32(b.base)), 7));
      v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, exc), 16));
    } else {
      // Unsigned, so that e0 / 16 is a shift and the compiler can step addresses along c.
      const size_t e0 = static_cast<size_t>(static_cast<unsigned>(slot) * static_cast<unsigned>(b.hd)) + static_cast<unsigned>(c) * CW;
      const Bf16Consts<W>& k = kBf16Consts<W>;
      const __m256i low = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.low + e0)));
      __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(low, _mm256_load_si256(reinterpret_cast<const __m256i*>(k.low_idx))),
                                   _mm256_set1_epi16(static_cast<int16_t>(0x807F)));
      if constexpr (W > 0) {
        // The chunk's codes are 2W bytes at codes + 2W * (e0 / 16); regions carry 8 bytes of tail
        // padding, so 8 bytes (W <= 4) or 16 bytes (W >= 5) may be loaded there.
        const uint8_t* cp = b.codes + 2 * W * (e0 / 16);
        __m256i codes;
        if constexpr (W <= 4) {
          uint64_t bits;
          std::memcpy(&bits, cp, 8);
          codes = _mm256_set1_epi64x(static_cast<long long>(bits));
        } else {
          codes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cp)));
        }
        __m256i cw = _mm256_shuffle_epi8(codes, _mm256_load_si256(reinterpret_cast<const __m256i*>(k.code_idx)));
        cw = _mm256_mullo_epi16(cw, _mm256_load_si256(reinterpret_cast<const __m256i*>(k.mul)));
        h = _mm256_add_epi16(h, _mm256_and_si256(cw, _mm256_set1_epi16(static_cast<int16_t>(((1 << W) - 1) << 7))));
      }
      const __m256i exc = _mm256_load_si256(reinterpret_cast<const __m256i*>(b.exc_words + e0));
      h = _mm256_add_epi16(h, _mm256_add_epi16(exc, _mm256_set1_epi16(static_cast<int16_t>(b.base << 7))));
      v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
      v[1] = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
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

// Where a codec's regions are. A block (one layer) starts with a directory: one u32 byte
// offset per (KV head, K or V) region, padded to dir_bytes. A block being filled has its regions
// region_bytes apart (room for the worst case); a full block the cache compacted has them packed
// back to back, each at its stored size rounded up to 16, with kTailPadding after the last.
struct Layout {
  KvShape shape;
  DType dtype;
  size_t region_bytes;  // worst-case region + kTailPadding, a multiple of 16
  size_t dir_bytes;     // 4 bytes per region, rounded up to 64
  static size_t DirBytes(const KvShape& s) { return RoundUp(static_cast<uint64_t>(s.n_kv_heads) * 2 * 4, 64); }
  size_t OpenOffset(int r) const { return dir_bytes + static_cast<size_t>(r) * region_bytes; }
  const uint8_t* Region(const uint8_t* block, int kvh, int which) const {
    uint32_t off;
    std::memcpy(&off, block + 4 * (2 * static_cast<size_t>(kvh) + which), 4);
    return block + off;
  }
};

// Block source for the attention core: hands out a reader typed by the region's state (filling,
// or sealed with its code width), so the decode loops have no per-value branches.
struct Blocks {
  const Layout* layout;
  const uint8_t* const* blocks;
  int n_tokens;
  int kvh = 0;
  Exceptions exc{};

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
    // The block kPrefetchBlocks ahead: about as many bytes as this one (its own size is in its
    // header, which is not in cache yet).
    NextBlock next;
    // The directory of the block after that one, so that its region address is in cache when
    // that block's turn comes to be prefetched.
    if ((b + 2 * kPrefetchBlocks) * s.block_tokens < n_tokens) PrefetchL2(blocks[b + 2 * kPrefetchBlocks]);
    if ((b + kPrefetchBlocks) * s.block_tokens < n_tokens) {
      next = {reinterpret_cast<const char*>(layout->Region(blocks[b + kPrefetchBlocks], kvh, which)),
              packed ? std::min(v.bytes + 64, layout->region_bytes) : layout->region_bytes, packed};
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
    const PackedBlock pb{v.low, v.hi, v.codes, exc.bytes(), exc.words(), v.base, v.width, s.head_dim, next};
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
