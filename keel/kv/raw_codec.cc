#include "keel/kv/raw_codec.h"

#include <cmath>
#include <cstring>

#include "keel/kv/attention.h"
#include "keel/kv/attention_math.h"

namespace keel::kv {

RawCodec::RawCodec(const KvShape& shape, DType dtype)
    : shape_(shape), dtype_(dtype), elem_(DTypeSize(dtype)) {}

std::string RawCodec::spec() const {
  switch (dtype_) {
    case DType::kF32: return "raw:f32";
    case DType::kBF16: return "raw:bf16";
    case DType::kF16: return "raw:f16";
  }
  return "raw";
}

std::string RawCodec::fingerprint() const {
  return spec() + ";block=" + std::to_string(shape_.block_tokens) + ";layout=kv_head_major;rope=interleaved";
}

Result<size_t> RawCodec::validate_stored(int layer, const uint8_t* data, size_t size) const {
  KEEL_ASSIGN_OR_RETURN(const size_t bytes, Codec::validate_stored(layer, data, size));
  // An element is non-finite when its exponent bits are all ones.
  auto first_bad = [&]<typename U>(U exponent_mask) -> size_t {
    const size_t n = bytes / sizeof(U);
    for (size_t i = 0; i < n; ++i) {
      U e;
      std::memcpy(&e, data + i * sizeof(U), sizeof(U));
      if ((e & exponent_mask) == exponent_mask) return i;
    }
    return n;
  };
  const size_t n = bytes / elem_;
  const size_t bad = dtype_ == DType::kF32    ? first_bad(uint32_t{0x7F800000})
                     : dtype_ == DType::kBF16 ? first_bad(uint16_t{0x7F80})
                                              : first_bad(uint16_t{0x7C00});
  if (bad < n) {
    return Status::Corruption("kv block of layer " + std::to_string(layer) + ": element " + std::to_string(bad) +
                              " is not finite");
  }
  return bytes;
}

size_t RawCodec::block_bytes(int) const {
  return 2 * static_cast<size_t>(shape_.block_tokens) * shape_.kv_dim() * elem_;
}

const uint8_t* RawCodec::row(const uint8_t* block, int which, int kvh, int slot) const {
  const size_t index = (static_cast<size_t>(which) * shape_.n_kv_heads + kvh) * shape_.block_tokens + slot;
  return block + index * shape_.head_dim * elem_;
}

void RawCodec::append(int, uint8_t* block, int slot, const float* k, const float* v) const {
  const int hd = shape_.head_dim;
  for (int kvh = 0; kvh < shape_.n_kv_heads; ++kvh) {
    for (int which = 0; which < 2; ++which) {
      const float* src = (which == 0 ? k : v) + static_cast<size_t>(kvh) * hd;
      uint8_t* dst = const_cast<uint8_t*>(row(block, which, kvh, slot));
      switch (dtype_) {
        case DType::kF32: std::memcpy(dst, src, sizeof(float) * hd); break;
        case DType::kBF16:
          for (int i = 0; i < hd; ++i) reinterpret_cast<uint16_t*>(dst)[i] = F32ToBf16(src[i]);
          break;
        case DType::kF16:
          for (int i = 0; i < hd; ++i) reinterpret_cast<uint16_t*>(dst)[i] = F32ToF16(src[i]);
          break;
      }
    }
  }
}

namespace {

// Blocks of a raw codec as a block source for the shared attention core: K rows of all heads,
// then V rows, each head's rows contiguous.
template <DType T>
struct RawBlocks {
  static constexpr size_t kElem = T == DType::kF32 ? 4 : 2;
  const uint8_t* const* blocks;
  int bt, hd, n_kv, n_tokens;
  int kvh = 0;

  void Begin(int head) { kvh = head; }
  const uint8_t* Rows(int which, int b) const {
    return blocks[b] + (static_cast<size_t>(which) * n_kv + kvh) * bt * hd * kElem;
  }
  template <class F>
  void Visit(int which, int b, F& f) const {
    NextBlock next;
    const int nb = b + kPrefetchBlocks;
    if (nb * bt < n_tokens) next = {reinterpret_cast<const char*>(Rows(which, nb)), static_cast<size_t>(bt) * hd * kElem};
    f(PlainRowsReader<T>{Rows(which, b), hd, next});
  }
  template <class F>
  void K(int b, F&& f) const { Visit(0, b, f); }
  template <class F>
  void V(int b, F&& f) const { Visit(1, b, f); }
};

template <DType T>
void AttendRawMany(const KvShape& s, const uint8_t* const* blocks, int n_queries, const int* n_tokens,
                   const float* q, float* out, AttendScratch& scratch) {
  auto make = [&] {
    return RawBlocks<T>{blocks, s.block_tokens, s.head_dim, s.n_kv_heads, n_tokens[n_queries - 1]};
  };
  AttendAllHeadsMany(s, make, n_queries, n_tokens, q, out, scratch);
}

template <DType T>
void AttendRaw(const KvShape& s, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
               AttendScratch& scratch) {
  auto make = [&] {
    return RawBlocks<T>{blocks, s.block_tokens, s.head_dim, s.n_kv_heads, n_tokens};
  };
  AttendAllHeads(s, make, n_tokens, q, out, scratch);
}

}  // namespace

void RawCodec::read(int, const uint8_t* block, int slot, float* k, float* v) const {
  const int hd = shape_.head_dim;
  for (int kvh = 0; kvh < shape_.n_kv_heads; ++kvh) {
    ConvertToF32(dtype_, row(block, 0, kvh, slot), k + static_cast<size_t>(kvh) * hd, hd);
    ConvertToF32(dtype_, row(block, 1, kvh, slot), v + static_cast<size_t>(kvh) * hd, hd);
  }
}

void RawCodec::attend_many(int layer, const uint8_t* const* blocks, int n_queries, const int* n_tokens,
                           const float* q, float* out, AttendScratch& scratch) const {
  if (!CoreSupports(shape_) || n_queries <= 0) {
    Codec::attend_many(layer, blocks, n_queries, n_tokens, q, out, scratch);
    return;
  }
  switch (dtype_) {
    case DType::kF32: return AttendRawMany<DType::kF32>(shape_, blocks, n_queries, n_tokens, q, out, scratch);
    case DType::kBF16: return AttendRawMany<DType::kBF16>(shape_, blocks, n_queries, n_tokens, q, out, scratch);
    case DType::kF16: return AttendRawMany<DType::kF16>(shape_, blocks, n_queries, n_tokens, q, out, scratch);
  }
}

void RawCodec::attend(int, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
                      AttendScratch& scratch) const {
  if (CoreSupports(shape_)) {
    switch (dtype_) {
      case DType::kF32: return AttendRaw<DType::kF32>(shape_, blocks, n_tokens, q, out, scratch);
      case DType::kBF16: return AttendRaw<DType::kBF16>(shape_, blocks, n_tokens, q, out, scratch);
      case DType::kF16: return AttendRaw<DType::kF16>(shape_, blocks, n_tokens, q, out, scratch);
    }
  }
  // Head dims that are not a multiple of 8: the same arithmetic, one head at a time.
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
      const uint8_t* r = row(blocks[t / bt], 0, kvh, t % bt);
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
      const uint8_t* r = row(blocks[t / bt], 1, kvh, t % bt);
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
