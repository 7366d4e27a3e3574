#include "keel/kv/minicache/minicache_codec.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numbers>
#include <string>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/dtype.h"

namespace keel::kv::minicache {

namespace {

constexpr double kSlerpT = 0.5;  // MiniCache's interpolation parameter

uint32_t LoadU32(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}
float LoadF32(const uint8_t* p) {
  float x;
  std::memcpy(&x, p, 4);
  return x;
}
uint16_t LoadU16(const uint8_t* p) {
  uint16_t x;
  std::memcpy(&x, p, 2);
  return x;
}
bool Bf16Finite(uint16_t h) { return (h & 0x7f80) != 0x7f80; }
bool F16Finite(uint16_t h) { return (h & 0x7c00) != 0x7c00; }

class MiniCacheCodec final : public Codec {
 public:
  MiniCacheCodec(const KvShape& shape, bool q4, float keep, std::string keep_text, int from)
      : shape_(shape), q4_(q4), keep_(keep), keep_text_(std::move(keep_text)), from_(from) {
    const int hd = shape_.head_dim;
    dir_bytes_ = q4_ ? 4 + static_cast<size_t>(hd) / 2 : 2 * static_cast<size_t>(hd);
    rec_bytes_ = 8 + dir_bytes_;
    rows_ = shape_.block_tokens * 2 * shape_.n_kv_heads;
    flag_words_ = keep_ > 0 ? (rows_ + 31) / 32 : 0;
    kept_at_ = 4 * static_cast<size_t>(flag_words_) + static_cast<size_t>(rows_) * rec_bytes_;
    spec_ = "minicache";
    std::string variant = q4_ ? "q4" : "";
    if (keep_ > 0) variant += (variant.empty() ? "keep" : ",keep") + keep_text_;
    if (from_ > 0) variant += (variant.empty() ? "from" : ",from") + std::to_string(from_);
    if (!variant.empty()) spec_ += ":" + variant;
    fingerprint_ = "minicache:v1;dir=" + std::string(q4_ ? "q4f16" : "bf16") + ";norm=f32;t=0.5;keep=" +
                   (keep_ > 0 ? keep_text_ : "none") + ";from=" + std::to_string(from_) +
                   ";bt=" + std::to_string(shape_.block_tokens) + ";pairs";
  }

  std::string spec() const override { return spec_; }
  std::string fingerprint() const override { return fingerprint_; }
  const KvShape& shape() const override { return shape_; }
  int group_size() const override { return 2; }
  bool stores_at_group_end() const override { return true; }

  size_t block_bytes(int group) const override {
    if (!Paired(group)) return RoundUp(4ull * layers_in(group) * shape_.block_tokens * shape_.kv_dim(), 16);
    return RoundUp(kept_at_ + (keep_ > 0 ? rows_ * dir_bytes_ : 0), 16);
  }

  void append(int, uint8_t*, int, const float*, const float*) const override {
    // Never called: the forward pass stores group-end codecs through store_group().
  }

  void store_group(int group, uint8_t* block, int slot, const TokenKv* layers) const override {
    const int hd = shape_.head_dim, kvh_n = shape_.n_kv_heads;
    if (!Paired(group)) {
      for (int l = 0; l < layers_in(group); ++l) {
        uint16_t* k = RawRow(block, l, slot);
        uint16_t* v = k + static_cast<size_t>(shape_.block_tokens) * shape_.kv_dim();
        for (int i = 0; i < shape_.kv_dim(); ++i) {
          k[i] = F32ToBf16(layers[l].k[i]);
          v[i] = F32ToBf16(layers[l].v[i]);
        }
      }
      return;
    }
    const int first_row = slot * 2 * kvh_n;
    // Slots are stored in order, so slot 0 comes first into a (possibly reused) range: clear
    // every flag, padding bits included, then each row sets its own.
    if (keep_ > 0 && slot == 0) std::memset(block, 0, 4 * static_cast<size_t>(flag_words_));
    int kept = keep_ > 0 ? KeptBefore(block, first_row) : 0;
    thread_local std::vector<float> buf;
    buf.resize(3 * static_cast<size_t>(hd));
    float *u0 = buf.data(), *u1 = u0 + hd, *e = u1 + hd;
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < kvh_n; ++h) {
        const int r = first_row + kv * kvh_n + h;
        const float* x0 = (kv == 0 ? layers[0].k : layers[0].v) + static_cast<size_t>(h) * hd;
        const float* x1 = (kv == 0 ? layers[1].k : layers[1].v) + static_cast<size_t>(h) * hd;
        uint8_t* rec = block + 4 * static_cast<size_t>(flag_words_) + static_cast<size_t>(r) * rec_bytes_;
        const float n0 = Direction(x0, u0), n1 = Direction(x1, u1);
        std::memcpy(rec, &n0, 4);
        std::memcpy(rec + 4, &n1, 4);
        double dot = 0;
        for (int j = 0; j < hd; ++j) dot += static_cast<double>(u0[j]) * u1[j];
        const double w = std::acos(std::clamp(dot, -1.0, 1.0));
        if (keep_ > 0) SetFlag(block, r, false);
        if (keep_ > 0 && n0 > 0 && n1 > 0 && w / std::numbers::pi > keep_) {
          SetFlag(block, r, true);
          WriteDirection(u0, rec + 8);
          WriteDirection(u1, block + kept_at_ + static_cast<size_t>(kept) * dir_bytes_);
          ++kept;
          continue;
        }
        Slerp(u0, n0 > 0, u1, n1 > 0, w, e);
        WriteDirection(e, rec + 8);
      }
    }
  }

  void attend(int layer, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
              AttendScratch& scratch) const override {
    attend_pending(layer, blocks, n_tokens, q, nullptr, nullptr, 0, out, scratch);
  }

  // Keys are stored after RoPE: read() and read_at() are the same.
  void read(int layer, const uint8_t* block, int slot, float* k, float* v) const override {
    const int group = group_of(layer), hd = shape_.head_dim, kvh_n = shape_.n_kv_heads;
    if (!Paired(group)) {
      const uint16_t* src = RawRow(const_cast<uint8_t*>(block), layer - first_layer(group), slot);
      ConvertToF32(DType::kBF16, src, k, shape_.kv_dim());
      ConvertToF32(DType::kBF16, src + static_cast<size_t>(shape_.block_tokens) * shape_.kv_dim(), v, shape_.kv_dim());
      return;
    }
    const int in_group = layer - first_layer(group), first_row = slot * 2 * kvh_n;
    int kept = keep_ > 0 ? KeptBefore(block, first_row) : 0;
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < kvh_n; ++h) {
        const int r = first_row + kv * kvh_n + h;
        const uint8_t* rec = block + 4 * static_cast<size_t>(flag_words_) + static_cast<size_t>(r) * rec_bytes_;
        const float norm = LoadF32(rec + 4 * in_group);
        const uint8_t* dir = rec + 8;
        if (keep_ > 0 && Flag(block, r)) {
          if (in_group == 1) dir = block + kept_at_ + static_cast<size_t>(kept) * dir_bytes_;
          ++kept;
        }
        ReadDirection(dir, norm, (kv == 0 ? k : v) + static_cast<size_t>(h) * hd);
      }
    }
  }

  bool compacts() const override { return keep_ > 0; }
  size_t compact_bytes(int group, const uint8_t* full_block) const override {
    if (!Paired(group) || keep_ <= 0) return 0;  // nothing to gain: the cache keeps the block
    return RoundUp(kept_at_ + static_cast<size_t>(KeptBefore(full_block, rows_)) * dir_bytes_, 16);
  }
  void compact(int group, const uint8_t* full_block, uint8_t* out) const override {
    const size_t bytes = compact_bytes(group, full_block);
    const size_t used = kept_at_ + static_cast<size_t>(KeptBefore(full_block, rows_)) * dir_bytes_;
    std::memcpy(out, full_block, used);
    std::memset(out + used, 0, bytes - used);
  }

  Result<size_t> validate_stored(int group, const uint8_t* data, size_t size) const override {
    const std::string where = "minicache block of layer group " + std::to_string(group) + ": ";
    if (!Paired(group)) {
      const size_t want = block_bytes(group);
      if (size < want) {
        return Status::Corruption(where + std::to_string(size) + " bytes, expected " + std::to_string(want));
      }
      for (size_t i = 0; i < 2ull * layers_in(group) * shape_.block_tokens * shape_.kv_dim(); ++i) {
        if (!Bf16Finite(LoadU16(data + 2 * i))) {
          return Status::Corruption(where + "value at byte " + std::to_string(2 * i) + " is not finite");
        }
      }
      return want;
    }
    if (size < kept_at_) {
      return Status::Corruption(where + std::to_string(size) + " bytes, expected at least " + std::to_string(kept_at_));
    }
    if (flag_words_ > 0 && rows_ % 32 != 0 && (LoadU32(data + 4 * (flag_words_ - 1)) >> (rows_ % 32)) != 0) {
      return Status::Corruption(where + "flag bits set past the last row");
    }
    const int kept = keep_ > 0 ? KeptBefore(data, rows_) : 0;
    const size_t want = RoundUp(kept_at_ + static_cast<size_t>(kept) * dir_bytes_, 16);
    if (size < want) {
      return Status::Corruption(where + std::to_string(size) + " bytes, but " + std::to_string(kept) +
                                " unmerged rows need " + std::to_string(want));
    }
    for (int r = 0; r < rows_; ++r) {
      const size_t at = 4 * static_cast<size_t>(flag_words_) + static_cast<size_t>(r) * rec_bytes_;
      for (int i = 0; i < 2; ++i) {
        const float norm = LoadF32(data + at + 4 * i);
        if (!std::isfinite(norm) || norm < 0) {
          return Status::Corruption(where + "norm at byte " + std::to_string(at + 4 * i) + " is not a finite length");
        }
      }
      if (!DirectionValid(data + at + 8)) {
        return Status::Corruption(where + "direction at byte " + std::to_string(at + 8) + " is not finite");
      }
    }
    for (int i = 0; i < kept; ++i) {
      const size_t at = kept_at_ + static_cast<size_t>(i) * dir_bytes_;
      if (!DirectionValid(data + at)) {
        return Status::Corruption(where + "direction at byte " + std::to_string(at) + " is not finite");
      }
    }
    return want;
  }

 private:
  bool Paired(int group) const { return layers_in(group) == 2 && first_layer(group) >= from_; }
  // K row of `slot` for the group's `in_group`-th layer in a bf16 group; its V row follows
  // block_tokens rows later.
  uint16_t* RawRow(uint8_t* block, int in_group, int slot) const {
    return reinterpret_cast<uint16_t*>(block) +
           (2 * static_cast<size_t>(in_group) * shape_.block_tokens + slot) * shape_.kv_dim();
  }

  bool Flag(const uint8_t* block, int r) const { return (LoadU32(block + 4 * (r / 32)) >> (r % 32)) & 1u; }
  void SetFlag(uint8_t* block, int r, bool on) const {
    uint32_t w = LoadU32(block + 4 * (r / 32));
    w = on ? (w | (1u << (r % 32))) : (w & ~(1u << (r % 32)));
    std::memcpy(block + 4 * (r / 32), &w, 4);
  }
  // Kept (unmerged) rows among rows [0, r): where row r's second direction goes.
  int KeptBefore(const uint8_t* block, int r) const {
    int n = 0;
    for (int w = 0; w < r / 32; ++w) n += std::popcount(LoadU32(block + 4 * w));
    if (r % 32 != 0) n += std::popcount(LoadU32(block + 4 * (r / 32)) & ((1u << (r % 32)) - 1));
    return n;
  }

  // u = x / |x| (zeros when x is zero); returns |x|.
  float Direction(const float* x, float* u) const {
    const int hd = shape_.head_dim;
    double s = 0;
    for (int j = 0; j < hd; ++j) s += static_cast<double>(x[j]) * x[j];
    const float norm = static_cast<float>(std::sqrt(s));
    for (int j = 0; j < hd; ++j) u[j] = norm > 0 ? static_cast<float>(x[j] / static_cast<double>(norm)) : 0.0f;
    return norm;
  }

  // SLERP of unit directions u0, u1 at angle w. A zero vector has no direction: the other one is
  // used (its layer restores to 0 * e = 0 either way). Where sin(w) vanishes, linear
  // interpolation: near-parallel directions merge to their mean; opposite ones have no
  // meaningful merge (they come out near zero), which is what retention is for.
  void Slerp(const float* u0, bool has0, const float* u1, bool has1, double w, float* e) const {
    const int hd = shape_.head_dim;
    double a = 1.0 - kSlerpT, b = kSlerpT;
    if (!has0 || !has1) {
      a = has0 ? 1.0 : 0.0;
      b = has1 ? 1.0 : 0.0;
    } else if (std::sin(w) > 1e-6) {
      a = std::sin((1.0 - kSlerpT) * w) / std::sin(w);
      b = std::sin(kSlerpT * w) / std::sin(w);
    }
    for (int j = 0; j < hd; ++j) e[j] = static_cast<float>(a * u0[j] + b * u1[j]);
  }

  void WriteDirection(const float* e, uint8_t* out) const {
    const int hd = shape_.head_dim;
    if (!q4_) {
      for (int j = 0; j < hd; ++j) {
        const uint16_t h = F32ToBf16(e[j]);
        std::memcpy(out + 2 * j, &h, 2);
      }
      return;
    }
    const auto [lo_it, hi_it] = std::minmax_element(e, e + hd);
    // Min rounded down and scale up to fp16, so [min, min + 15 * scale] covers every element.
    const uint16_t min16 = _cvtss_sh(*lo_it, _MM_FROUND_TO_NEG_INF);
    const float mn = F16ToF32(min16);
    const uint16_t scale16 = _cvtss_sh((*hi_it - mn) / 15.0f, _MM_FROUND_TO_POS_INF);
    const float scale = F16ToF32(scale16);
    std::memcpy(out, &min16, 2);
    std::memcpy(out + 2, &scale16, 2);
    for (int j = 0; j < hd; j += 2) {
      uint8_t byte = 0;
      for (int i = 0; i < 2; ++i) {
        const float q = scale > 0 ? std::nearbyint((e[j + i] - mn) / scale) : 0.0f;
        byte |= static_cast<uint8_t>(std::clamp(q, 0.0f, 15.0f)) << (4 * i);
      }
      out[4 + j / 2] = byte;
    }
  }

  void ReadDirection(const uint8_t* dir, float norm, float* out) const {
    const int hd = shape_.head_dim;
    if (!q4_) {
      for (int j = 0; j < hd; ++j) out[j] = norm * Bf16ToF32(LoadU16(dir + 2 * j));
      return;
    }
    const float mn = F16ToF32(LoadU16(dir)), scale = F16ToF32(LoadU16(dir + 2));
    for (int j = 0; j < hd; ++j) {
      const int q = (dir[4 + j / 2] >> (4 * (j & 1))) & 0xf;
      out[j] = norm * (mn + static_cast<float>(q) * scale);
    }
  }

  bool DirectionValid(const uint8_t* dir) const {
    if (q4_) {
      const uint16_t scale = LoadU16(dir + 2);
      return F16Finite(LoadU16(dir)) && F16Finite(scale) && (scale & 0x8000) == 0;
    }
    for (int j = 0; j < shape_.head_dim; ++j) {
      if (!Bf16Finite(LoadU16(dir + 2 * j))) return false;
    }
    return true;
  }

  KvShape shape_;
  bool q4_;
  float keep_;  // 0: every row merged
  std::string keep_text_;
  int from_;  // pairs starting before this layer are stored as bf16
  std::string spec_, fingerprint_;
  size_t dir_bytes_ = 0, rec_bytes_ = 0, kept_at_ = 0;
  int rows_ = 0, flag_words_ = 0;
};

}  // namespace

Result<std::unique_ptr<Codec>> MakeMiniCacheCodec(std::string_view variant, const KvShape& shape) {
  bool q4 = false;
  float keep = 0;
  std::string keep_text;
  int from = -1;
  const auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("minicache variant '" + std::string(variant) + "': " + why +
                                   "; known: minicache, minicache:q4, with ',keepD' (0 < D < 1) and "
                                   "',fromL' (first merged layer), e.g. minicache:q4,keep0.3,from2");
  };
  std::string_view rest = variant;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (item == "q4" && !q4) {
      q4 = true;
    } else if (item.substr(0, 4) == "keep" && keep_text.empty()) {
      keep_text = std::string(item.substr(4));
      char* end = nullptr;
      keep = std::strtof(keep_text.c_str(), &end);
      if (keep_text.empty() || end != keep_text.c_str() + keep_text.size() || !(keep > 0 && keep < 1)) {
        return bad("keep threshold '" + keep_text + "' is not a number in (0, 1)");
      }
    } else if (item.substr(0, 4) == "from" && from < 0) {
      const std::string text(item.substr(4));
      char* end = nullptr;
      const long l = std::strtol(text.c_str(), &end, 10);
      if (text.empty() || end != text.c_str() + text.size() || l < 0 || l >= std::max(shape.n_layers, 1)) {
        return bad("first merged layer '" + text + "' is not a layer index");
      }
      from = static_cast<int>(l);
    } else {
      return bad("unknown or repeated option '" + std::string(item) + "'");
    }
  }
  if (shape.head_dim <= 0 || shape.head_dim % 2 != 0) {
    return Status::InvalidArgument("minicache: head_dim " + std::to_string(shape.head_dim) + " must be even");
  }
  return std::unique_ptr<Codec>(new MiniCacheCodec(shape, q4, keep, keep_text, std::max(from, 0)));
}

Result<std::unique_ptr<Codec>> MakeMiniCacheCodec(std::string_view variant, const CodecContext& context) {
  return MakeMiniCacheCodec(variant, context.shape);
}

}  // namespace keel::kv::minicache
