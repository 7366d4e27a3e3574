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
      : layout_{shape, dtype, MaxEncodedBytes(shape.block_tokens * shape.head_dim, Fmt(dtype)) + internal::kTailPadding},
        n_(shape.block_tokens * shape.head_dim) {}

  std::string spec() const override { return dtype() == DType::kBF16 ? "zipfusion:bf16" : "zipfusion:f16"; }
  std::string fingerprint() const override {
    return spec() + ";format=2;block=" + std::to_string(shape().block_tokens) + ";layout=kv_head_k_v;rope=interleaved";
  }
  const KvShape& shape() const override { return layout_.shape; }
  size_t block_bytes(int) const override { return static_cast<size_t>(shape().n_kv_heads) * 2 * layout_.region_bytes; }

  uint8_t* Region(uint8_t* block, int kvh, int which) const {
    return const_cast<uint8_t*>(layout_.Region(block, kvh, which));
  }
  const uint8_t* Region(const uint8_t* block, int kvh, int which) const { return layout_.Region(block, kvh, which); }

  void append(int, uint8_t* block, int slot, const float* k, const float* v) const override {
    const int hd = shape().head_dim;
    const bool bf = dtype() == DType::kBF16;
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

  Layout layout_;
  int n_;
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
