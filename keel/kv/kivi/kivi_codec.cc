#include "keel/kv/kivi/kivi_codec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/dtype.h"
#include "keel/kv/attention.h"

namespace keel::kv {

namespace {

constexpr uint8_t kOpen = 0x00;
constexpr uint8_t kPacked = 'Q';
constexpr size_t kHeader = 16;
enum ParamType : uint8_t { kParamF16 = 0, kParamBf16 = 1 };
// Inputs are clamped to +-kClamp before quantizing; validate_stored accepts dequantized values up
// to kMaxMagnitude (2^100, just above), so attention over an accepted block stays finite.
constexpr float kClamp = 1e30f;
constexpr float kMaxMagnitude = 0x1p100f;

// Where things are in a block of one layer (kivi_codec.h has the picture).
struct Layout {
  KvShape shape;
  int bits;

  int hd() const { return shape.head_dim; }
  int bt() const { return shape.block_tokens; }
  size_t codes_bytes() const { return static_cast<size_t>(bt()) * hd() * bits / 8; }
  // One KV head's K section (params then codes) or V section.
  size_t section_bytes(int which) const { return 4 * static_cast<size_t>(which == 0 ? hd() : bt()) + codes_bytes(); }
  size_t head_bytes() const { return section_bytes(0) + section_bytes(1); }
  size_t section(int kvh, int which) const {
    return kHeader + static_cast<size_t>(kvh) * head_bytes() + (which == 0 ? 0 : section_bytes(0));
  }
  size_t packed_end() const { return kHeader + static_cast<size_t>(shape.n_kv_heads) * head_bytes(); }
  size_t packed_bytes() const { return RoundUp(packed_end(), 16); }
  size_t open_bytes() const { return kHeader + 4 * static_cast<size_t>(bt()) * shape.kv_dim(); }
  // Row `slot` of KV head kvh of K (which=0) or V in an open block: bf16 values.
  size_t open_row(int which, int kvh, int slot) const {
    return kHeader + ((static_cast<size_t>(which) * shape.n_kv_heads + kvh) * bt() + slot) * hd() * 2;
  }
};

// ---- 16-bit float params: rounding in a chosen direction, and widening.

float ParamToF32(uint16_t h, ParamType t) { return t == kParamF16 ? F16ToF32(h) : Bf16ToF32(h); }
uint16_t ParamNearest(float f, ParamType t) { return t == kParamF16 ? F32ToF16(f) : F32ToBf16(f); }
bool ParamFinite(uint16_t h, ParamType t) {
  const uint16_t exp = t == kParamF16 ? 0x7C00 : 0x7F80;
  return (h & exp) != exp;
}
// Neighbours in value order (both formats are sign-magnitude).
uint16_t NextUp(uint16_t h) {
  if (h == 0x8000) return 0x0001;
  return (h & 0x8000) ? h - 1 : h + 1;
}
uint16_t NextDown(uint16_t h) {
  if (h == 0x0000) return 0x8001;
  return (h & 0x8000) ? h + 1 : h - 1;
}

// Widens n params at p (16-bit, type t) into out.
void WidenParams(const uint8_t* p, int n, ParamType t, float* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    const __m256 f = t == kParamF16 ? _mm256_cvtph_ps(h)
                                    : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    _mm256_storeu_ps(out + i, f);
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = ParamToF32(h, t);
  }
}

// Per-thread buffer for one section's widened params (attention and read run on many threads).
float* ParamScratch(size_t n) {
  thread_local AlignedFloats buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The dequantized value of code q: one FMA, exactly as the readers compute it in lanes.
inline float Dequant(int q, float scale, float min) { return std::fma(static_cast<float>(q), scale, min); }

// Quantization params of one group: min rounded down, scale rounded up, so that every value of
// [lo, hi] is within scale/2 of some q * scale + min. False when they do not fit type t.
bool ChooseParams(float lo, float hi, int max_q, ParamType t, uint16_t* scale_out, uint16_t* min_out) {
  uint16_t mn = ParamNearest(lo, t);
  while (ParamFinite(mn, t) && ParamToF32(mn, t) > lo) mn = NextDown(mn);
  if (!ParamFinite(mn, t)) return false;
  const float mn_f = ParamToF32(mn, t);
  const float want = static_cast<float>((static_cast<double>(hi) - mn_f) / max_q);
  uint16_t sc = ParamNearest(want, t);
  while (ParamFinite(sc, t) && ParamToF32(sc, t) < want) sc = NextUp(sc);
  while (ParamFinite(sc, t) && Dequant(max_q, ParamToF32(sc, t), mn_f) < hi) sc = NextUp(sc);
  if (!ParamFinite(sc, t) || !std::isfinite(Dequant(max_q, ParamToF32(sc, t), mn_f))) return false;
  *scale_out = sc;
  *min_out = mn;
  return true;
}

// The code whose dequantized value is nearest x (ties to the lower code).
int QuantizeOne(float x, float scale, float min, int max_q) {
  if (scale <= 0.0f) return 0;
  const int q0 = std::clamp(static_cast<int>(std::nearbyint((x - min) / scale)), 0, max_q);
  int best = q0;
  float err = std::fabs(Dequant(q0, scale, min) - x);
  for (int q : {q0 - 1, q0 + 1}) {
    if (q < 0 || q > max_q) continue;
    const float e = std::fabs(Dequant(q, scale, min) - x);
    if (e < err || (e == err && q < best)) {
      best = q;
      err = e;
    }
  }
  return best;
}

// ---- Readers for the attention core.

// 8 codes of `B` bits (element order, little-endian) at p as fp32 lanes.
template <int B>
[[gnu::always_inline]] inline __m256 Codes8(const uint8_t* p) {
  uint32_t w = 0;
  std::memcpy(&w, p, B);  // 8 codes are B bytes
  const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts),
                                     _mm256_set1_epi32((1 << B) - 1));
  return _mm256_cvtepi32_ps(q);
}

// Packed K of one head: element (slot, d) = code * scale[d] + min[d] (per channel).
template <int B>
struct PackedKReader {
  const uint8_t* codes;
  const float* scale;
  const float* min;
  int hd;
  NextBlock next;
  void Prefetch(int i, int n) const { next.Prefetch(i, n); }
  template <int CW>
  [[gnu::always_inline]] void Load(int slot, int c, __m256* v) const {
    KEEL_UNROLL
    for (int u = 0; u < CW / 8; ++u) {
      const int e0 = c * CW + 8 * u;
      const __m256 q = Codes8<B>(codes + (static_cast<size_t>(slot) * hd + e0) * B / 8);
      v[u] = _mm256_fmadd_ps(q, _mm256_loadu_ps(scale + e0), _mm256_loadu_ps(min + e0));
    }
  }
};

// Packed V of one head: element (slot, d) = code * scale[slot] + min[slot] (per token).
template <int B>
struct PackedVReader {
  const uint8_t* codes;
  const float* scale;
  const float* min;
  int hd;
  NextBlock next;
  void Prefetch(int i, int n) const { next.Prefetch(i, n); }
  template <int CW>
  [[gnu::always_inline]] void Load(int slot, int c, __m256* v) const {
    const __m256 s = _mm256_broadcast_ss(scale + slot), m = _mm256_broadcast_ss(min + slot);
    KEEL_UNROLL
    for (int u = 0; u < CW / 8; ++u) {
      const int e0 = c * CW + 8 * u;
      v[u] = _mm256_fmadd_ps(Codes8<B>(codes + (static_cast<size_t>(slot) * hd + e0) * B / 8), s, m);
    }
  }
};

// Block source: open blocks read as bf16 rows, packed ones through the readers above (a
// section's params are widened once per visit).
template <int B>
struct KiviBlocks {
  const Layout* layout;
  const uint8_t* const* blocks;
  int n_tokens;
  int kvh = 0;

  void Begin(int head) { kvh = head; }
  template <class F>
  void K(int b, F&& f) { Visit(0, b, f); }
  template <class F>
  void V(int b, F&& f) { Visit(1, b, f); }

  template <class F>
  void Visit(int which, int b, F& f) const {
    const Layout& l = *layout;
    const int hd = l.hd(), bt = l.bt();
    // The block kPrefetchBlocks ahead, where its section would be packed (the open block is
    // larger, so the address is inside it either way).
    NextBlock next;
    const int nb = b + kPrefetchBlocks;
    if (nb * bt < n_tokens) {
      next = {reinterpret_cast<const char*>(blocks[nb] + l.section(kvh, which)), l.section_bytes(which)};
    }
    const uint8_t* blk = blocks[b];
    if (blk[0] != kPacked) {
      f(PlainRowsReader<DType::kBF16>{blk + l.open_row(which, kvh, 0), hd, next});
      return;
    }
    const ParamType t = static_cast<ParamType>(blk[2]);
    const uint8_t* sec = blk + l.section(kvh, which);
    const int n = which == 0 ? hd : bt;  // params: scale[n], min[n]
    float* params = ParamScratch(2 * static_cast<size_t>(n));
    WidenParams(sec, 2 * n, t, params);
    if (which == 0) {
      f(PackedKReader<B>{sec + 4 * n, params, params + n, hd, next});
    } else {
      f(PackedVReader<B>{sec + 4 * n, params, params + n, hd, next});
    }
  }
};

class KiviCodec final : public Codec {
 public:
  KiviCodec(const KvShape& shape, int bits) : layout_{shape, bits} {}

  std::string spec() const override { return "kivi:" + std::to_string(bits()); }
  std::string fingerprint() const override {
    return spec() + ";block=" + std::to_string(layout_.bt()) +
           ";layout=hdr16,open_bf16_kv_head_major,packed_per_head_k_v;k=per_channel;v=per_token"
           ";params=f16_or_bf16,min_down,scale_up;rope=interleaved";
  }
  const KvShape& shape() const override { return layout_.shape; }
  size_t block_bytes(int) const override { return layout_.open_bytes(); }

  void append(int, uint8_t* block, int slot, const float* k, const float* v) const override {
    if (slot == 0) std::memset(block, 0, kHeader);  // a new or reused block starts open
    const int hd = layout_.hd();
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      for (int which = 0; which < 2; ++which) {
        const float* src = (which == 0 ? k : v) + static_cast<size_t>(kvh) * hd;
        uint8_t* dst = block + layout_.open_row(which, kvh, slot);
        for (int i = 0; i < hd; ++i) {
          const uint16_t h = F32ToBf16(src[i]);
          std::memcpy(dst + 2 * i, &h, 2);
        }
      }
    }
  }

  void attend(int, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
              AttendScratch& scratch) const override {
    WithBits([&](auto b) {
      constexpr int B = decltype(b)::value;
      AttendAllHeads(shape(), [&] { return KiviBlocks<B>{&layout_, blocks, n_tokens}; }, n_tokens, q, out, scratch);
    });
  }

  void attend_many(int, const uint8_t* const* blocks, int n_queries, const int* n_tokens, const float* q,
                   float* out, AttendScratch& scratch) const override {
    if (n_queries <= 0) return;
    WithBits([&](auto b) {
      constexpr int B = decltype(b)::value;
      auto make = [&] { return KiviBlocks<B>{&layout_, blocks, n_tokens[n_queries - 1]}; };
      AttendAllHeadsMany(shape(), make, n_queries, n_tokens, q, out, scratch);
    });
  }

  void read(int, const uint8_t* block, int slot, float* k, float* v) const override {
    const int hd = layout_.hd();
    // n_tokens = slot + 1 keeps Visit from prefetching a next block; the array is long enough
    // that the compiler can see it never reads past it.
    const uint8_t* one[kPrefetchBlocks + 1];
    std::fill(std::begin(one), std::end(one), block);
    WithBits([&](auto b) {
      KiviBlocks<decltype(b)::value> src{&layout_, one, slot + 1};
      for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
        src.Begin(kvh);
        for (int which = 0; which < 2; ++which) {
          float* dst = (which == 0 ? k : v) + static_cast<size_t>(kvh) * hd;
          auto widen = [&](const auto& r) {
            for (int c = 0; c < hd / 8; ++c) {
              __m256 x;
              r.template Load<8>(slot, c, &x);
              _mm256_storeu_ps(dst + 8 * c, x);
            }
          };
          src.Visit(which, 0, widen);
        }
      }
    });
  }

  bool compacts() const override { return true; }
  size_t compact_bytes(int, const uint8_t*) const override { return layout_.packed_bytes(); }
  void compact(int, const uint8_t* block, uint8_t* out) const override;
  Result<size_t> validate_stored(int layer, const uint8_t* data, size_t size) const override;

 private:
  int bits() const { return layout_.bits; }
  int max_q() const { return (1 << bits()) - 1; }
  template <class F>
  void WithBits(F&& f) const {
    if (bits() == 2) {
      f(std::integral_constant<int, 2>{});
    } else {
      f(std::integral_constant<int, 4>{});
    }
  }
  bool QuantizeBlock(const uint8_t* block, ParamType t, uint8_t* out) const;

  Layout layout_;
};

// One group's values, gathered: KIVI's K groups are a channel over the block's tokens, V groups
// a token's channels. Non-finite values (a model that overflowed) are clamped so that the params
// stay finite: the block must pass validate_stored like any other.
struct Group {
  std::vector<float> x;
  float lo = 0.0f, hi = 0.0f;
  void Finish() {
    for (float& f : x) f = std::isnan(f) ? 0.0f : std::clamp(f, -kClamp, kClamp);
    const auto [a, b] = std::minmax_element(x.begin(), x.end());
    lo = *a;
    hi = *b;
  }
};

// Writes the packed form with params of type t; false when a param does not fit t.
bool KiviCodec::QuantizeBlock(const uint8_t* block, ParamType t, uint8_t* out) const {
  const Layout& l = layout_;
  const int hd = l.hd(), bt = l.bt(), B = bits();
  std::memset(out, 0, l.packed_bytes());
  out[0] = kPacked;
  out[1] = static_cast<uint8_t>(B);
  out[2] = t;
  auto value = [&](int which, int kvh, int slot, int d) {
    uint16_t h;
    std::memcpy(&h, block + l.open_row(which, kvh, slot) + 2 * d, 2);
    return Bf16ToF32(h);
  };
  // Quantizes one group: params at index i of the section's scale/min arrays (n of each), the
  // code of its j-th value at element index elem(j) of the section's codes.
  Group g;
  auto quantize = [&](uint8_t* sec, int n, int i, auto&& elem) {
    g.Finish();
    uint16_t sc, mn;
    if (!ChooseParams(g.lo, g.hi, max_q(), t, &sc, &mn)) return false;
    std::memcpy(sec + 2 * i, &sc, 2);
    std::memcpy(sec + 2 * (n + i), &mn, 2);
    const float sc_f = ParamToF32(sc, t), mn_f = ParamToF32(mn, t);
    uint8_t* codes = sec + 4 * n;
    for (size_t j = 0; j < g.x.size(); ++j) {
      const size_t e = elem(static_cast<int>(j));
      codes[e * B / 8] |= static_cast<uint8_t>(QuantizeOne(g.x[j], sc_f, mn_f, max_q()) << (e * B % 8));
    }
    return true;
  };
  for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
    uint8_t* ks = out + l.section(kvh, 0);
    for (int d = 0; d < hd; ++d) {
      g.x.resize(bt);
      for (int s = 0; s < bt; ++s) g.x[s] = value(0, kvh, s, d);
      if (!quantize(ks, hd, d, [&](int s) { return static_cast<size_t>(s) * hd + d; })) return false;
    }
    uint8_t* vs = out + l.section(kvh, 1);
    for (int s = 0; s < bt; ++s) {
      g.x.resize(hd);
      for (int d = 0; d < hd; ++d) g.x[d] = value(1, kvh, s, d);
      if (!quantize(vs, bt, s, [&](int d) { return static_cast<size_t>(s) * hd + d; })) return false;
    }
  }
  return true;
}

void KiviCodec::compact(int, const uint8_t* block, uint8_t* out) const {
  // fp16 keeps 3 more significant bits than bf16; bf16 only when a block's range needs it.
  if (!QuantizeBlock(block, kParamF16, out)) QuantizeBlock(block, kParamBf16, out);
}

Result<size_t> KiviCodec::validate_stored(int layer, const uint8_t* data, size_t size) const {
  auto bad = [&](const std::string& why) {
    return Status::Corruption("kivi block of layer " + std::to_string(layer) + ": " + why);
  };
  const Layout& l = layout_;
  const size_t bytes = l.packed_bytes();
  if (size < bytes) return bad(std::to_string(size) + " bytes, a packed block is " + std::to_string(bytes));
  if (data[0] != kPacked) {
    return bad(data[0] == kOpen ? "an open (unquantized) block" : "unknown state byte " + std::to_string(data[0]));
  }
  if (data[1] != bits()) return bad("packed with " + std::to_string(data[1]) + " bits, expected " + std::to_string(bits()));
  if (data[2] != kParamF16 && data[2] != kParamBf16) return bad("unknown param type " + std::to_string(data[2]));
  const ParamType t = static_cast<ParamType>(data[2]);
  for (size_t i = 3; i < kHeader; ++i) {
    if (data[i] != 0) return bad("non-zero reserved header byte " + std::to_string(i));
  }
  for (size_t i = l.packed_end(); i < bytes; ++i) {
    if (data[i] != 0) return bad("non-zero padding at byte " + std::to_string(i));
  }
  // Every param finite, scales non-negative, and every code's value within +-2^100: attention
  // must not meet NaN or Inf (or overflow to them) that the model did not produce.
  for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
    for (int which = 0; which < 2; ++which) {
      const size_t at = l.section(kvh, which);
      const int n = which == 0 ? l.hd() : l.bt();
      for (int i = 0; i < n; ++i) {
        uint16_t sc, mn;
        std::memcpy(&sc, data + at + 2 * i, 2);
        std::memcpy(&mn, data + at + 2 * (n + i), 2);
        if (!ParamFinite(sc, t) || !ParamFinite(mn, t) || (sc & 0x8000) != 0 ||
            !(std::fabs(ParamToF32(mn, t)) <= kMaxMagnitude) ||
            !(std::fabs(Dequant(max_q(), ParamToF32(sc, t), ParamToF32(mn, t))) <= kMaxMagnitude)) {
          return bad(std::string(which == 0 ? "K" : "V") + " params " + std::to_string(i) + " of KV head " +
                     std::to_string(kvh) + " (byte " + std::to_string(at + 2 * i) +
                     "): not finite, a negative scale, or values beyond 2^100");
        }
      }
    }
  }
  return bytes;
}

}  // namespace

size_t KiviPackedBytes(const KvShape& shape, int bits) { return Layout{shape, bits}.packed_bytes(); }

Result<std::unique_ptr<Codec>> MakeKiviCodec(std::string_view variant, const KvShape& shape) {
  int bits;
  if (variant.empty() || variant == "2") {
    bits = 2;
  } else if (variant == "4") {
    bits = 4;
  } else {
    return Status::InvalidArgument("unknown kivi bits '" + std::string(variant) + "'; known: 2, 4");
  }
  if (!CoreSupports(shape)) {
    return Status::InvalidArgument("kivi: head_dim " + std::to_string(shape.head_dim) +
                                   " must be a multiple of 8 and at most " + std::to_string(kMaxHeadDim));
  }
  const Layout l{shape, bits};
  if (l.packed_bytes() >= l.open_bytes()) {
    return Status::InvalidArgument("kivi: block_tokens " + std::to_string(shape.block_tokens) +
                                   " too small: a packed block (" + std::to_string(l.packed_bytes()) +
                                   " bytes) would not be smaller than an open one");
  }
  return std::unique_ptr<Codec>(new KiviCodec(shape, bits));
}

}  // namespace keel::kv
