#include "keel/kv/zipfusion/zipfusion_codec.h"

#include <cstring>
#include <vector>

#include "keel/kv/attention.h"
#include "keel/kv/zipfusion/format.h"

namespace keel::kv::zipfusion {

namespace {

constexpr uint8_t kStaging = 0x00;  // region holds plain 16-bit values after the 8-byte header

// Header fields and section pointers of a block this codec encoded itself (so already valid).
BlockView ViewTrusted(const uint8_t* p) {
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

// Fast path for a row with no exceptions: the code width is a compile-time constant, so the
// per-chunk loads have fixed sizes and no exception checks run.
template <int W>
void DecodeRowNoExceptions(const BlockView& v, int start, int hd, __m256* row) {
  const uint64_t mask = 0x0101010101010101ull * ((1u << W) - 1u);
  const __m256i base = _mm256_set1_epi32(v.base);
  const bool bf16 = v.dtype == Dtype::kBf16;
  for (int c = 0; c < hd / 8; ++c) {
    const int e0 = start + 8 * c;
    __m256i e = base;
    if constexpr (W > 0) {
      const uint64_t bits = LoadLe(v.codes + static_cast<size_t>(W) * (e0 / 8), W);
      e = _mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(bits, mask)))), base);
    }
    uint64_t low8;
    std::memcpy(&low8, v.low + e0, 8);
    const __m256i low = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(low8)));
    if (bf16) {
      row[c] = Bf16LanesF32(low, e);
    } else {
      ExceptionCursor none{v.n_exc};  // past every exception
      row[c] = DecodeChunkF32(v, e0, none);
    }
  }
}

using RowDecoder = void (*)(const BlockView&, int, int, __m256*);
constexpr RowDecoder kNoExceptionDecoders[9] = {
    DecodeRowNoExceptions<0>, DecodeRowNoExceptions<1>, DecodeRowNoExceptions<2>,
    DecodeRowNoExceptions<3>, DecodeRowNoExceptions<4>, DecodeRowNoExceptions<5>,
    DecodeRowNoExceptions<6>, DecodeRowNoExceptions<7>, DecodeRowNoExceptions<8>};

inline void WidenStaged(const uint16_t* v, int hd, bool bf16, __m256* row) {
  for (int c = 0; c < hd / 8; ++c) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v) + c);
    row[c] = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
  }
}

class ZipFusionCodec final : public Codec {
 public:
  ZipFusionCodec(const KvShape& shape, DType dtype)
      : shape_(shape), dtype_(dtype), n_(shape.block_tokens * shape.head_dim),
        region_(MaxEncodedBytes(n_, Fmt())) {}

  std::string spec() const override { return dtype_ == DType::kBF16 ? "zipfusion:bf16" : "zipfusion:f16"; }
  std::string fingerprint() const override {
    return spec() + ";format=1;block=" + std::to_string(shape_.block_tokens) + ";layout=kv_head_k_v;rope=interleaved";
  }
  const KvShape& shape() const override { return shape_; }
  size_t block_bytes(int) const override { return static_cast<size_t>(shape_.n_kv_heads) * 2 * region_; }

  uint8_t* Region(uint8_t* block, int kvh, int which) const {
    return block + (static_cast<size_t>(kvh) * 2 + which) * region_;
  }
  const uint8_t* Region(const uint8_t* block, int kvh, int which) const {
    return block + (static_cast<size_t>(kvh) * 2 + which) * region_;
  }

  void append(int, uint8_t* block, int slot, const float* k, const float* v) const override {
    const int hd = shape_.head_dim;
    const bool bf = dtype_ == DType::kBF16;
    for (int kvh = 0; kvh < shape_.n_kv_heads; ++kvh) {
      for (int which = 0; which < 2; ++which) {
        uint8_t* r = Region(block, kvh, which);
        if (slot == 0) r[0] = kStaging;  // a reused block starts over
        uint16_t* vals = reinterpret_cast<uint16_t*>(r + kHeaderBytes) + static_cast<size_t>(slot) * hd;
        const float* src = (which == 0 ? k : v) + static_cast<size_t>(kvh) * hd;
        for (int d = 0; d < hd; ++d) vals[d] = bf ? F32ToBf16(src[d]) : F32ToF16(src[d]);
        if (slot == shape_.block_tokens - 1) Seal(r);
      }
    }
  }

  void attend(int, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
              AttendScratch& scratch) const override {
    auto make = [&] {
      Rows r{this, blocks};
      r.n_tokens = n_tokens;
      return r;
    };
    AttendAllHeads(shape_, make, n_tokens, q, out, scratch);
  }

  void attend_many(int, const uint8_t* const* blocks, int n_queries, const int* n_tokens, const float* q,
                   float* out, AttendScratch& scratch) const override {
    if (n_queries <= 0) return;
    auto make = [&] {
      Rows r{this, blocks};
      r.n_tokens = n_tokens[n_queries - 1];
      return r;
    };
    AttendAllHeadsMany(shape_, make, n_queries, n_tokens, q, out, scratch);
  }

  void read(int, const uint8_t* block, int slot, float* k, float* v) const override {
    const int hd = shape_.head_dim;
    alignas(32) __m256 row[kMaxHeadDim / 8];
    for (int kvh = 0; kvh < shape_.n_kv_heads; ++kvh) {
      for (int which = 0; which < 2; ++which) {
        RowState st;
        DecodeRow(Region(block, kvh, which), slot, st, row);
        float* dst = (which == 0 ? k : v) + static_cast<size_t>(kvh) * hd;
        for (int c = 0; c < hd / 8; ++c) _mm256_storeu_ps(dst + 8 * c, row[c]);
      }
    }
  }

  // Decoding state for one region while its rows are read in order.
  struct RowState {
    const uint8_t* region = nullptr;
    bool packed = false;
    BlockView view;
    ExceptionCursor cursor;
  };

  void DecodeRow(const uint8_t* region, int slot, RowState& st, __m256* row) const {
    const int hd = shape_.head_dim;
    if (region != st.region) {
      st.region = region;
      st.packed = region[0] == kMagic;
      if (st.packed) st.view = ViewTrusted(region);
      st.cursor = ExceptionCursor{};
    }
    if (!st.packed) {
      WidenStaged(reinterpret_cast<const uint16_t*>(region + kHeaderBytes) + static_cast<size_t>(slot) * hd, hd,
                  dtype_ == DType::kBF16, row);
      return;
    }
    // Locals, not st's fields: __m256 stores may alias anything, so decoding straight from st
    // would reload every header field after each chunk is written.
    const BlockView view = st.view;
    ExceptionCursor cursor = st.cursor;
    const int start = slot * hd;
    // Exceptions are rare: skip the ones before this row and, if none falls inside it, take the
    // specialised path. Both paths produce the same bits (tested against raw).
    while (cursor.next < view.n_exc && ReadU16(view.exc_pos + 2 * cursor.next) < start) ++cursor.next;
    if (cursor.next >= view.n_exc || ReadU16(view.exc_pos + 2 * cursor.next) >= start + hd) {
      kNoExceptionDecoders[view.width](view, start, hd, row);
    } else {
      for (int c = 0; c < hd / 8; ++c) row[c] = DecodeChunkF32(view, start + 8 * c, cursor);
    }
    st.cursor = cursor;
  }

  // Row source for the attention core.
  struct Rows {
    const ZipFusionCodec* codec;
    const uint8_t* const* blocks;
    int kvh = 0;
    RowState k_state, v_state;
    void Begin(int head) {
      kvh = head;
      k_state = RowState{};
      v_state = RowState{};
    }
    void K(int t, __m256* row) { Step(0, t, k_state, row); }
    void V(int t, __m256* row) { Step(1, t, v_state, row); }
    int n_tokens = 0;
    void Step(int which, int t, RowState& st, __m256* row) {
      const int bt = codec->shape_.block_tokens;
      const int b = t / bt, slot = t % bt;
      // Blocks are scattered in the arena: while this block decodes, pull in the next block's
      // region a slice per row.
      if ((b + 1) * bt < n_tokens) {
        const char* next = reinterpret_cast<const char*>(codec->Region(blocks[b + 1], kvh, which));
        const size_t slice = (codec->region_ / bt + 63) & ~size_t{63};
        for (size_t off = slot * slice; off < (slot + 1) * slice && off < codec->region_; off += 64) {
          _mm_prefetch(next + off, _MM_HINT_T0);
        }
      }
      codec->DecodeRow(codec->Region(blocks[b], kvh, which), slot, st, row);
    }
  };

  size_t RegionStoredBytes(const uint8_t* region, int tokens) const {
    if (region[0] == kMagic) return ViewTrusted(region).bytes;
    return kHeaderBytes + static_cast<size_t>(tokens) * shape_.head_dim * 2;
  }

 private:
  Dtype Fmt() const { return dtype_ == DType::kBF16 ? Dtype::kBf16 : Dtype::kFp16; }

  // Encodes a full staging region in place. EncodeBlock cannot fail for our sizes (n is a
  // multiple of 8 within kMaxElements, capacity is the worst case); if it ever did, the region
  // stays staged, which attention reads correctly.
  void Seal(uint8_t* region) const {
    thread_local std::vector<uint16_t> tmp;
    tmp.resize(static_cast<size_t>(n_));
    std::memcpy(tmp.data(), region + kHeaderBytes, static_cast<size_t>(n_) * 2);
    thread_local std::vector<uint8_t> enc;
    enc.resize(region_);
    Result<size_t> r = EncodeBlock(tmp.data(), n_, Fmt(), enc.data(), enc.size());
    if (r.ok()) std::memcpy(region, enc.data(), *r);
  }

  KvShape shape_;
  DType dtype_;
  int n_;
  size_t region_;
};

}  // namespace

Result<std::unique_ptr<Codec>> MakeZipFusionCodec(const KvShape& shape, DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return Status::InvalidArgument("zipfusion: only bf16 and f16 storage are supported");
  }
  if (!CoreSupports(shape)) {
    return Status::InvalidArgument("zipfusion: head_dim " + std::to_string(shape.head_dim) +
                                   " must be a multiple of 8 and at most " + std::to_string(kMaxHeadDim));
  }
  if (static_cast<int64_t>(shape.block_tokens) * shape.head_dim > kMaxElements) {
    return Status::InvalidArgument("zipfusion: block_tokens * head_dim exceeds " + std::to_string(kMaxElements));
  }
  return std::unique_ptr<Codec>(new ZipFusionCodec(shape, dtype));
}

size_t StoredBytes(const Codec& codec, const uint8_t* const* blocks, int n_tokens) {
  const auto* zf = dynamic_cast<const ZipFusionCodec*>(&codec);
  if (zf == nullptr) return 0;
  const KvShape& s = codec.shape();
  size_t total = 0;
  for (int b = 0; b * s.block_tokens < n_tokens; ++b) {
    const int tokens = std::min(s.block_tokens, n_tokens - b * s.block_tokens);
    for (int kvh = 0; kvh < s.n_kv_heads; ++kvh)
      for (int which = 0; which < 2; ++which) total += zf->RegionStoredBytes(zf->Region(blocks[b], kvh, which), tokens);
  }
  return total;
}

}  // namespace keel::kv::zipfusion
