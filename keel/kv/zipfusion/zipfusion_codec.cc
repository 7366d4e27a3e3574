#include "keel/kv/zipfusion/zipfusion_codec.h"

#include <cstring>
#include <vector>

#include "keel/kv/attention.h"
#include "keel/kv/zipfusion/blocks.h"
#include "keel/kv/zipfusion/format.h"

namespace keel::kv::zipfusion {

namespace {

using internal::Layout;
using internal::Blocks;

class ZipFusionCodec final : public Codec {
 public:
  ZipFusionCodec(const KvShape& shape, DType dtype)
      : layout_{shape, dtype, MaxEncodedBytes(shape.block_tokens * shape.head_dim, Fmt(dtype)) + internal::kTailPadding,
                Layout::DirBytes(shape)},
        n_(shape.block_tokens * shape.head_dim),
        n_regions_(2 * shape.n_kv_heads) {}

  std::string spec() const override { return dtype() == DType::kBF16 ? "zipfusion:bf16" : "zipfusion:f16"; }
  std::string fingerprint() const override {
    return spec() + ";format=2;block=" + std::to_string(shape().block_tokens) +
           ";layout=dir_kv_head_k_v;compact=16;rope=interleaved";
  }
  const KvShape& shape() const override { return layout_.shape; }
  size_t block_bytes(int) const override { return layout_.OpenOffset(n_regions_); }

  uint8_t* Region(uint8_t* block, int kvh, int which) const {
    return const_cast<uint8_t*>(layout_.Region(block, kvh, which));
  }
  const uint8_t* Region(const uint8_t* block, int kvh, int which) const { return layout_.Region(block, kvh, which); }

  void append(int, uint8_t* block, int slot, const float* k, const float* v) const override {
    const int hd = shape().head_dim;
    const bool bf = dtype() == DType::kBF16;
    if (slot == 0) {  // a new (or reused) block: the open layout's directory
      for (int r = 0; r < n_regions_; ++r) {
        const uint32_t off = static_cast<uint32_t>(layout_.OpenOffset(r));
        std::memcpy(block + 4 * r, &off, 4);
      }
    }
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      for (int which = 0; which < 2; ++which) {
        uint8_t* r = Region(block, kvh, which);
        if (slot == 0) r[0] = internal::kStaging;  // a reused block starts over
        uint16_t* vals = reinterpret_cast<uint16_t*>(r + kHeaderBytes) + static_cast<size_t>(slot) * hd;
        const float* src = (which == 0 ? k : v) + static_cast<size_t>(kvh) * hd;
        for (int d = 0; d < hd; ++d) vals[d] = bf ? F32ToBf16(src[d]) : F32ToF16(src[d]);
        if (slot == shape().block_tokens - 1) Seal(r);
      }
    }
  }

  void attend(int, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
              AttendScratch& scratch) const override {
    AttendAllHeads(shape(), [&] { return Blocks{&layout_, blocks, n_tokens}; }, n_tokens, q, out, scratch);
  }

  void attend_many(int, const uint8_t* const* blocks, int n_queries, const int* n_tokens, const float* q,
                   float* out, AttendScratch& scratch) const override {
    if (n_queries <= 0) return;
    auto make = [&] { return Blocks{&layout_, blocks, n_tokens[n_queries - 1]}; };
    AttendAllHeadsMany(shape(), make, n_queries, n_tokens, q, out, scratch);
  }

  void read(int, const uint8_t* block, int slot, float* k, float* v) const override {
    const int hd = shape().head_dim;
    const uint8_t* one[2] = {block, block};  // Visit may look at the next block's address
    Blocks src{&layout_, one, slot + 1};
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      src.Begin(kvh);
      for (int which = 0; which < 2; ++which) {
        float* dst = (which == 0 ? k : v) + static_cast<size_t>(kvh) * hd;
        src.Visit(which, 0, [&](const auto& r) {
          for (int c = 0; c < hd / 8; ++c) {
            __m256 x;
            r.template Load<8>(slot, c, &x);
            _mm256_storeu_ps(dst + 8 * c, x);
          }
        });
      }
    }
  }

  size_t RegionStoredBytes(const uint8_t* region, int tokens) const {
    if (region[0] == kMagic) return internal::ViewTrusted(region).bytes;
    return kHeaderBytes + static_cast<size_t>(tokens) * shape().head_dim * 2;
  }

  // Compact form of a full block: the directory, then each region at its stored size rounded up
  // to 16, back to back, then kTailPadding (the decoders may load 8 code bytes past a region's
  // end; inside the block that reads the next region, harmlessly).
  bool compacts() const override { return true; }
  // Never more than block_bytes(): a region at its worst case plus 8 rounds up to exactly its
  // open size.
  size_t compact_bytes(int, const uint8_t* block) const override {
    size_t end = layout_.dir_bytes;
    for (int r = 0; r < n_regions_; ++r) {
      end = Round16(end) + RegionStoredBytes(RegionAt(block, r), shape().block_tokens);
    }
    return Extent(end);
  }
  void compact(int, const uint8_t* block, uint8_t* out) const override {
    size_t end = layout_.dir_bytes;
    std::memset(out + 4 * n_regions_, 0, layout_.dir_bytes - 4 * n_regions_);
    for (int r = 0; r < n_regions_; ++r) {
      const size_t at = Round16(end);
      std::memset(out + end, 0, at - end);
      const uint8_t* src = RegionAt(block, r);
      const size_t bytes = RegionStoredBytes(src, shape().block_tokens);
      const uint32_t off = static_cast<uint32_t>(at);
      std::memcpy(out + 4 * r, &off, 4);
      std::memcpy(out + at, src, bytes);
      end = at + bytes;
    }
    std::memset(out + end, 0, Extent(end) - end);
  }
  Result<size_t> validate_stored(int layer, const uint8_t* data, size_t size) const override {
    auto bad = [&](const std::string& why) {
      return Status::Corruption("zipfusion block of layer " + std::to_string(layer) + ": " + why);
    };
    if (size < layout_.dir_bytes) return bad("shorter than its directory");
    const size_t staged = kHeaderBytes + static_cast<size_t>(n_) * 2;
    size_t end = 0;
    for (int r = 0; r < n_regions_; ++r) {
      uint32_t off;
      std::memcpy(&off, data + 4 * r, 4);
      if (off < layout_.dir_bytes || off % 16 != 0 || off >= size) {
        return bad("region " + std::to_string(r) + " at offset " + std::to_string(off) + " outside the block");
      }
      const size_t avail = size - off;
      size_t bytes;
      if (data[off] == kMagic) {
        KEEL_ASSIGN_OR_RETURN(BlockView v, ParseBlock(data + off, avail));
        if (v.dtype != Fmt(dtype()) || v.n != n_) return bad("region " + std::to_string(r) + " has the wrong dtype or size");
        bytes = v.bytes;
      } else if (data[off] == internal::kStaging) {
        bytes = staged;
      } else {
        return bad("region " + std::to_string(r) + " has an unknown state byte");
      }
      if (bytes + internal::kTailPadding > avail) return bad("region " + std::to_string(r) + " runs past the block");
      end = std::max(end, off + bytes);
    }
    return Extent(end);
  }

 private:
  DType dtype() const { return layout_.dtype; }
  static Dtype Fmt(DType t) { return t == DType::kBF16 ? Dtype::kBf16 : Dtype::kFp16; }

  // Encodes a full staging region in place. EncodeBlock cannot fail for our sizes (n is a
  // multiple of 8 within kMaxElements, capacity is the worst case); if it ever did, the region
  // stays staged, which attention reads correctly.
  void Seal(uint8_t* region) const {
    thread_local std::vector<uint16_t> tmp;
    tmp.resize(static_cast<size_t>(n_));
    std::memcpy(tmp.data(), region + kHeaderBytes, static_cast<size_t>(n_) * 2);
    thread_local std::vector<uint8_t> enc;
    enc.resize(layout_.region_bytes);
    Result<size_t> r = EncodeBlock(tmp.data(), n_, Fmt(dtype()), enc.data(), enc.size());
    if (r.ok()) std::memcpy(region, enc.data(), *r);
  }

  static size_t Round16(size_t x) { return RoundUp(x, 16); }
  // Bytes a compact block spans whose last region ends at `end`: tail padding included.
  static size_t Extent(size_t end) { return Round16(end + internal::kTailPadding); }
  const uint8_t* RegionAt(const uint8_t* block, int r) const { return layout_.Region(block, r / 2, r % 2); }

  Layout layout_;
  int n_;
  int n_regions_;
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
