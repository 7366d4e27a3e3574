#include "keel/kv/raw_codec.h"

#include <cmath>
#include <cstring>

#include "keel/kv/attention_math.h"

namespace keel::kv {

RawCodec::RawCodec(const KvShape& shape, DType dtype)
    : shape_(shape), dtype_(dtype), elem_(DTypeSize(dtype)) {}

std::string RawCodec::spec() const { return dtype_ == DType::kF32 ? "raw:f32" : "raw:bf16"; }

std::string RawCodec::fingerprint() const {
  return spec() + ";block=" + std::to_string(shape_.block_tokens) + ";layout=k_then_v;rope=interleaved";
}

size_t RawCodec::block_bytes(int) const {
  return 2 * static_cast<size_t>(shape_.block_tokens) * shape_.kv_dim() * elem_;
}

const uint8_t* RawCodec::row(const uint8_t* block, int which, int slot) const {
  size_t kv = shape_.kv_dim();
  return block + (static_cast<size_t>(which) * shape_.block_tokens + slot) * kv * elem_;
}

void RawCodec::append(int, uint8_t* block, int slot, const float* k, const float* v) const {
  const int kv = shape_.kv_dim();
  uint8_t* kd = const_cast<uint8_t*>(row(block, 0, slot));
  uint8_t* vd = const_cast<uint8_t*>(row(block, 1, slot));
  if (dtype_ == DType::kF32) {
    std::memcpy(kd, k, kv * 4);
    std::memcpy(vd, v, kv * 4);
    return;
  }
  auto* kb = reinterpret_cast<uint16_t*>(kd);
  auto* vb = reinterpret_cast<uint16_t*>(vd);
  for (int i = 0; i < kv; ++i) {
    kb[i] = F32ToBf16(k[i]);
    vb[i] = F32ToBf16(v[i]);
  }
}

void RawCodec::read(int, const uint8_t* block, int slot, float* k, float* v) const {
  const int kv = shape_.kv_dim();
  ConvertToF32(dtype_, row(block, 0, slot), k, kv);
  ConvertToF32(dtype_, row(block, 1, slot), v, kv);
}

void RawCodec::attend(int, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
                      AttendScratch& scratch) const {
  const int hd = shape_.head_dim;
  const int kv = shape_.kv_dim();
  const int bt = shape_.block_tokens;
  const int group = shape_.n_heads / shape_.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // scratch: scores[n_tokens] + one widened row (bf16 only)
  float* scores = scratch.get(static_cast<size_t>(n_tokens) + kv);
  float* wide = scores + n_tokens;
  const bool f32 = dtype_ == DType::kF32;

  for (int h = 0; h < shape_.n_heads; ++h) {
    const int kvh = h / group;
    const float* qh = q + h * hd;
    for (int t = 0; t < n_tokens; ++t) {
      const uint8_t* r = row(blocks[t / bt], 0, t % bt) + static_cast<size_t>(kvh) * hd * elem_;
      const float* kr;
      if (f32) {
        kr = reinterpret_cast<const float*>(r);
      } else {
        ConvertToF32(dtype_, r, wide, hd);
        kr = wide;
      }
      scores[t] = DotF32(qh, kr, hd) * scale;
    }
    SoftmaxF32(scores, n_tokens);
    float* oh = out + h * hd;
    std::memset(oh, 0, sizeof(float) * hd);
    for (int t = 0; t < n_tokens; ++t) {
      const uint8_t* r = row(blocks[t / bt], 1, t % bt) + static_cast<size_t>(kvh) * hd * elem_;
      const float* vr;
      if (f32) {
        vr = reinterpret_cast<const float*>(r);
      } else {
        ConvertToF32(dtype_, r, wide, hd);
        vr = wide;
      }
      AxpyF32(scores[t], vr, oh, hd);
    }
  }
  (void)kv;
}

}  // namespace keel::kv
