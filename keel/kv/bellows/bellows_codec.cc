#include "keel/kv/bellows/bellows_codec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/core/aligned.h"
#include "keel/core/dtype.h"
#include "keel/kv/attention_math.h"
#include "keel/kv/rope.h"

namespace keel::kv::bellows {

namespace {

// out[t][c0, c0 + 8*NV) = mean + sum_j z[t*stride + j] * r[j][...] for t < m: one row's 8*NV
// outputs stay in registers while the latent walks past (r's rows come from L1).
template <int NV>
void RestoreTile(const float* z, int stride, int m, const float* r, int nk, int kvd, const float* mean, int c0,
                 float* out) {
  for (int t = 0; t < m; ++t) {
    __m256 acc[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_loadu_ps(mean + c0 + 8 * v);
    const float* zt = z + static_cast<size_t>(t) * stride;
    for (int j = 0; j < nk; ++j) {
      const __m256 zb = _mm256_set1_ps(zt[j]);
      const float* rj = r + static_cast<size_t>(j) * kvd + c0;
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(zb, _mm256_loadu_ps(rj + 8 * v), acc[v]);
    }
    float* o = out + static_cast<size_t>(t) * kvd + c0;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 8 * v, acc[v]);
  }
}

// Rows [m][kvd] = mean + z (m rows of `stride`, first nk used) * r [nk][kvd].
void RestoreRows(const float* z, int stride, int m, const float* r, int nk, int kvd, const float* mean, float* out) {
  if (kvd % 8 != 0) {
    for (int t = 0; t < m; ++t) {
      float* o = out + static_cast<size_t>(t) * kvd;
      std::memcpy(o, mean, sizeof(float) * kvd);
      for (int j = 0; j < nk; ++j) AxpyF32(z[static_cast<size_t>(t) * stride + j], r + static_cast<size_t>(j) * kvd, o, kvd);
    }
    return;
  }
  for (int c0 = 0; c0 < kvd; c0 += 64) {
    switch (std::min(64, kvd - c0) / 8) {
      case 8: RestoreTile<8>(z, stride, m, r, nk, kvd, mean, c0, out); break;
      case 7: RestoreTile<7>(z, stride, m, r, nk, kvd, mean, c0, out); break;
      case 6: RestoreTile<6>(z, stride, m, r, nk, kvd, mean, c0, out); break;
      case 5: RestoreTile<5>(z, stride, m, r, nk, kvd, mean, c0, out); break;
      case 4: RestoreTile<4>(z, stride, m, r, nk, kvd, mean, c0, out); break;
      case 3: RestoreTile<3>(z, stride, m, r, nk, kvd, mean, c0, out); break;
      case 2: RestoreTile<2>(z, stride, m, r, nk, kvd, mean, c0, out); break;
      default: RestoreTile<1>(z, stride, m, r, nk, kvd, mean, c0, out); break;
    }
  }
}

class BellowsCodec final : public Codec {
 public:
  BellowsCodec(Calibration cal, const KvShape& shape) : cal_(std::move(cal)), shape_(shape) {
    fingerprint_ = "bellows:v1;calibration=" + CalibrationFingerprint(cal_) + ";bt=" +
                   std::to_string(shape_.block_tokens) + ";latent=bf16";
    const int half = shape_.head_dim / 2;
    // cos/sin for every position of the context, computed as the engine computes them.
    rope_positions_ = std::max(0, shape_.max_positions);
    rope_cos_.resize(static_cast<size_t>(rope_positions_) * half);
    rope_sin_.resize(rope_cos_.size());
    for (int p = 0; p < rope_positions_; ++p) {
      RopeAngles(shape_.head_dim, p, shape_.rope_theta, &rope_cos_[static_cast<size_t>(p) * half],
                 &rope_sin_[static_cast<size_t>(p) * half]);
    }
    // Group 0 stores each token's id first when layer 0 comes from the token table.
    id_slots_ = cal_.vocab == 0 ? 0 : cal_.vocab <= 65536 ? 1 : 2;
  }

  std::string spec() const override { return "bellows"; }
  std::string fingerprint() const override { return fingerprint_; }
  const KvShape& shape() const override { return shape_; }
  int group_size() const override { return cal_.group_size; }
  size_t block_bytes(int group) const override { return RoundUp(2ull * shape_.block_tokens * Stride(group), 16); }
  bool stores_at_group_end() const override { return true; }

  void append(int, uint8_t*, int, const float*, const float*) const override {
    // Never called: the forward pass stores group-end codecs through store_group().
  }

  void store_group(int group, uint8_t* block, int slot, const TokenKv* layers) const override {
    const CalibrationGroup& g = cal_.groups[group];
    const int dim = cal_.dim, r = g.rank;
    thread_local std::vector<float> zbuf;
    zbuf.assign(r, 0.0f);
    float* z = zbuf.data();
    for (int i = 0; i < g.n_layers; ++i) {
      const float* x = layers[i].x;
      const float* mean = &g.x_mean[static_cast<size_t>(i) * dim];
      const float* c = &g.compress[static_cast<size_t>(i) * dim * r];
      for (int d = 0; d < dim; ++d) AxpyF32(x[d] - mean[d], c + static_cast<size_t>(d) * r, z, r);
    }
    uint16_t* out = reinterpret_cast<uint16_t*>(block) + static_cast<size_t>(slot) * Stride(group);
    const int ids = IdSlots(group);
    if (ids > 0) {
      const uint32_t id = static_cast<uint32_t>(layers[0].token);
      out[0] = static_cast<uint16_t>(id);
      if (ids == 2) out[1] = static_cast<uint16_t>(id >> 16);
    }
    for (int j = 0; j < r; ++j) out[ids + j] = F32ToBf16(z[j]);
  }

  void attend(int layer, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
              AttendScratch& scratch) const override {
    attend_pending(layer, blocks, n_tokens, q, nullptr, nullptr, 0, out, scratch);
  }

  void attend_pending(int layer, const uint8_t* const* blocks, int n_stored, const float* q, const float* pending_k,
                      const float* pending_v, int n_pending, float* out, AttendScratch& scratch) const override {
    const int group = group_of(layer), in_group = layer - first_layer(group);
    const CalibrationGroup& g = cal_.groups[group];
    const LayerRestore& lr = g.layers[in_group];
    const bool from_table = layer == 0 && cal_.vocab > 0;
    const int hd = shape_.head_dim, kvd = shape_.kv_dim(), nh = shape_.n_heads, bt = shape_.block_tokens;
    const int per_kv = nh / shape_.n_kv_heads, stride = Stride(group), ids = IdSlots(group);
    // Table layers read V rows directly; latent layers weight latents and restore V once per head.
    const int nk = g.k_end - g.k_begin, nv = from_table ? 0 : g.v_end - g.v_begin;
    const int n = n_stored + n_pending;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    // Scratch: scores [nh][n], restored keys (and table values) of one block [bt][kvd] each, its
    // records [bt][stride], weighted latent sums [nh][nv].
    const size_t n_pad = RoundUp(static_cast<size_t>(n), 8);
    const size_t nv_pad = RoundUp(static_cast<size_t>(nv), 8);
    float* p = scratch.get(nh * n_pad + 2 * static_cast<size_t>(bt) * kvd + static_cast<size_t>(bt) * stride +
                           (static_cast<size_t>(nh) + bt) * nv_pad + 64);
    float* kblk = p + nh * n_pad;
    float* vblk = kblk + static_cast<size_t>(bt) * kvd;
    float* zblk = vblk + static_cast<size_t>(bt) * kvd;
    float* zacc = zblk + static_cast<size_t>(bt) * stride;
    const int n_blocks = (n_stored + bt - 1) / bt;
    for (int b = 0; b < n_blocks; ++b) {
      const int t0 = b * bt, m = std::min(bt, n_stored - t0);
      if (from_table) {
        for (int t = 0; t < m; ++t) {
          const float* row = TableRow(blocks[b], t);
          std::memcpy(kblk + static_cast<size_t>(t) * kvd, row, sizeof(float) * kvd);
          Rope(kblk + static_cast<size_t>(t) * kvd, t0 + t);
        }
      } else {
        DecodeRecords(blocks[b], m, stride, zblk);
        RestoreRows(zblk + ids + g.k_begin, stride, m, lr.rk.data(), nk, kvd, lr.k_mean.data(), kblk);
        for (int t = 0; t < m; ++t) Rope(kblk + static_cast<size_t>(t) * kvd, t0 + t);
      }
      for (int h = 0; h < nh; ++h) {
        const float* qh = q + static_cast<size_t>(h) * hd;
        const int off = (h / per_kv) * hd;
        float* ph = p + h * n_pad + t0;
        for (int t = 0; t < m; ++t) ph[t] = DotF32(qh, kblk + static_cast<size_t>(t) * kvd + off, hd) * scale;
      }
    }
    for (int h = 0; h < nh; ++h) {
      const float* qh = q + static_cast<size_t>(h) * hd;
      const int off = (h / per_kv) * hd;
      float* ph = p + h * n_pad;
      for (int t = 0; t < n_pending; ++t) {
        ph[n_stored + t] = DotF32(qh, pending_k + static_cast<size_t>(t) * kvd + off, hd) * scale;
      }
      SoftmaxF32(ph, n);
    }
    for (int h = 0; h < nh; ++h) std::fill(out + static_cast<size_t>(h) * hd, out + static_cast<size_t>(h + 1) * hd, 0.0f);
    if (from_table) {
      for (int b = 0; b < n_blocks; ++b) {
        const int t0 = b * bt, m = std::min(bt, n_stored - t0);
        for (int h = 0; h < nh; ++h) {
          const int off = (h / per_kv) * hd;
          for (int t = 0; t < m; ++t) {
            AxpyF32(p[h * n_pad + t0 + t], TableRow(blocks[b], t) + kvd + off, out + static_cast<size_t>(h) * hd, hd);
          }
        }
      }
    } else {
      // Values: weight the latents (rows padded to whole vectors), restore once per head.
      const int nvp = static_cast<int>(RoundUp(static_cast<size_t>(nv), 8));
      float* zv = zacc + static_cast<size_t>(nh) * nvp;  // [bt][nvp]
      std::fill(zacc, zacc + static_cast<size_t>(nh) * nvp, 0.0f);
      for (int b = 0; b < n_blocks; ++b) {
        const int t0 = b * bt, m = std::min(bt, n_stored - t0);
        DecodeRecords(blocks[b], m, stride, zblk);
        for (int t = 0; t < m; ++t) {
          float* row = zv + static_cast<size_t>(t) * nvp;
          std::memcpy(row, zblk + static_cast<size_t>(t) * stride + ids + g.v_begin, sizeof(float) * nv);
          std::fill(row + nv, row + nvp, 0.0f);
        }
        for (int h = 0; h < nh; ++h) {
          const float* ph = p + h * n_pad + t0;
          float* acc = zacc + static_cast<size_t>(h) * nvp;
          for (int c = 0; c < nvp; c += 8) {
            __m256 a = _mm256_loadu_ps(acc + c);
            for (int t = 0; t < m; ++t) {
              a = _mm256_fmadd_ps(_mm256_set1_ps(ph[t]), _mm256_loadu_ps(zv + static_cast<size_t>(t) * nvp + c), a);
            }
            _mm256_storeu_ps(acc + c, a);
          }
        }
      }
      for (int h = 0; h < nh; ++h) {
        const float* ph = p + h * n_pad;
        const int off = (h / per_kv) * hd;
        float* o = out + static_cast<size_t>(h) * hd;
        float stored_mass = 0.0f;
        for (int t = 0; t < n_stored; ++t) stored_mass += ph[t];
        for (int d = 0; d < hd; ++d) o[d] = stored_mass * lr.v_mean[off + d];
        const float* acc = zacc + static_cast<size_t>(h) * RoundUp(static_cast<size_t>(nv), 8);
        if (n_stored > 0) {
          for (int j = 0; j < nv; ++j) AxpyF32(acc[j], &lr.rv[static_cast<size_t>(j) * kvd + off], o, hd);
        }
      }
    }
    for (int h = 0; h < nh; ++h) {
      const float* ph = p + h * n_pad;
      const int off = (h / per_kv) * hd;
      float* o = out + static_cast<size_t>(h) * hd;
      for (int t = 0; t < n_pending; ++t) AxpyF32(ph[n_stored + t], pending_v + static_cast<size_t>(t) * kvd + off, o, hd);
    }
  }

  // K and V of one stored token as restored; without its position K cannot be rotated, so K is
  // returned before RoPE (read_at() rotates).
  void read(int layer, const uint8_t* block, int slot, float* k, float* v) const override {
    Restore(layer, block, slot, -1, k, v);
  }
  void read_at(int layer, const uint8_t* block, int slot, int pos, float* k, float* v) const override {
    Restore(layer, block, slot, pos, k, v);
  }

  Result<size_t> validate_stored(int group, const uint8_t* data, size_t size) const override {
    const size_t want = block_bytes(group);
    if (size < want) {
      return Status::Corruption("bellows block of layer group " + std::to_string(group) + ": " + std::to_string(size) +
                                " bytes, expected " + std::to_string(want));
    }
    const auto* rec = reinterpret_cast<const uint16_t*>(data);
    const int stride = Stride(group), ids = IdSlots(group);
    for (int t = 0; t < shape_.block_tokens; ++t, rec += stride) {
      if (ids > 0 && TokenId(rec, ids) >= static_cast<uint32_t>(cal_.vocab)) {
        return Status::Corruption("bellows block of layer group " + std::to_string(group) + ": token id " +
                                  std::to_string(TokenId(rec, ids)) + " of slot " + std::to_string(t) +
                                  " outside the vocabulary of " + std::to_string(cal_.vocab));
      }
      for (int j = ids; j < stride; ++j) {
        if ((rec[j] & 0x7f80) == 0x7f80) {
          return Status::Corruption("bellows block of layer group " + std::to_string(group) + ": latent value at byte " +
                                    std::to_string(2 * (t * stride + j)) + " is not finite");
        }
      }
    }
    return want;
  }

 private:
  int IdSlots(int group) const { return group == 0 ? id_slots_ : 0; }
  // uint16 values per token: the token id (group 0 with a token table) then the bf16 latent.
  int Stride(int group) const { return IdSlots(group) + cal_.groups[group].rank; }
  static uint32_t TokenId(const uint16_t* rec, int ids) {
    return ids == 2 ? rec[0] | (static_cast<uint32_t>(rec[1]) << 16) : rec[0];
  }
  // Layer 0's table row (k_pre then v) of the token in `slot` of a group-0 block.
  const float* TableRow(const uint8_t* block, int slot) const {
    const auto* rec = reinterpret_cast<const uint16_t*>(block) + static_cast<size_t>(slot) * Stride(0);
    return &cal_.token_kv[static_cast<size_t>(TokenId(rec, id_slots_)) * 2 * shape_.kv_dim()];
  }
  // `m` records of `stride` uint16 values widened as bf16 (id slots included; callers skip them).
  void DecodeRecords(const uint8_t* block, int m, int stride, float* z) const {
    ConvertToF32(DType::kBF16, reinterpret_cast<const uint16_t*>(block), z, static_cast<size_t>(m) * stride);
  }
  void Rope(float* k, int pos) const {
    const int hd = shape_.head_dim, half = hd / 2;
    float cs_buf[256], sn_buf[256];
    const float *cs = cs_buf, *sn = sn_buf;
    if (pos < rope_positions_) {
      cs = &rope_cos_[static_cast<size_t>(pos) * half];
      sn = &rope_sin_[static_cast<size_t>(pos) * half];
    } else {
      RopeAngles(hd, pos, shape_.rope_theta, cs_buf, sn_buf);
    }
    for (int h = 0; h < shape_.n_kv_heads; ++h) RotatePairs(k + static_cast<size_t>(h) * hd, hd, cs, sn);
  }
  void Restore(int layer, const uint8_t* block, int slot, int pos, float* k, float* v) const {
    const int group = group_of(layer);
    const CalibrationGroup& g = cal_.groups[group];
    const LayerRestore& lr = g.layers[layer - first_layer(group)];
    const int kvd = shape_.kv_dim(), stride = Stride(group);
    if (layer == 0 && cal_.vocab > 0) {
      const float* row = TableRow(block, slot);
      std::memcpy(k, row, sizeof(float) * kvd);
      std::memcpy(v, row + kvd, sizeof(float) * kvd);
      if (pos >= 0) Rope(k, pos);
      return;
    }
    thread_local std::vector<float> rec;
    rec.resize(stride);
    DecodeRecords(block + static_cast<size_t>(slot) * stride * 2, 1, stride, rec.data());
    const float* z = rec.data() + IdSlots(group);
    std::memcpy(k, lr.k_mean.data(), sizeof(float) * kvd);
    std::memcpy(v, lr.v_mean.data(), sizeof(float) * kvd);
    for (int j = g.k_begin; j < g.k_end; ++j) AxpyF32(z[j], &lr.rk[static_cast<size_t>(j - g.k_begin) * kvd], k, kvd);
    for (int j = g.v_begin; j < g.v_end; ++j) AxpyF32(z[j], &lr.rv[static_cast<size_t>(j - g.v_begin) * kvd], v, kvd);
    if (pos >= 0) Rope(k, pos);
  }

  Calibration cal_;
  KvShape shape_;
  std::string fingerprint_;
  int rope_positions_ = 0;
  std::vector<float> rope_cos_, rope_sin_;  // [position][head_dim/2]
  int id_slots_ = 0;
};

}  // namespace

Result<std::unique_ptr<Codec>> MakeBellowsCodec(const Calibration& calibration, const KvShape& shape) {
  KEEL_RETURN_IF_ERROR(ValidateCalibration(calibration));
  if (calibration.n_layers != shape.n_layers || calibration.n_heads != shape.n_heads ||
      calibration.n_kv_heads != shape.n_kv_heads || calibration.head_dim != shape.head_dim ||
      (shape.dim > 0 && calibration.dim != shape.dim)) {
    return Status::InvalidArgument("bellows calibration is for another model shape (" +
                                   std::to_string(calibration.n_layers) + " layers, dim " +
                                   std::to_string(calibration.dim) + ", " + std::to_string(calibration.n_kv_heads) +
                                   " KV heads of " + std::to_string(calibration.head_dim) + ")");
  }
  if (shape.head_dim > 512) return Status::InvalidArgument("bellows: head_dim above 512 is not supported");
  if (calibration.vocab > 0 && calibration.vocab != shape.vocab_size) {
    return Status::InvalidArgument("bellows calibration's token table covers " + std::to_string(calibration.vocab) +
                                   " tokens, the model's vocabulary has " + std::to_string(shape.vocab_size));
  }
  KvShape s = shape;
  s.dim = calibration.dim;
  s.rope_theta = calibration.rope_theta;
  return std::unique_ptr<Codec>(new BellowsCodec(calibration, s));
}

Result<std::unique_ptr<Codec>> MakeBellowsCodec(std::string_view variant, const CodecContext& context) {
  if (!variant.empty()) {
    return Status::InvalidArgument("bellows takes no variant (got 'bellows:" + std::string(variant) +
                                   "'); the calibration file sets groups and ranks");
  }
  auto it = context.params.find("bellows");
  if (it == context.params.end() || it->second.empty()) {
    return Status::InvalidArgument(
        "--kv-codec bellows needs a calibration file: --bellows FILE (make one with `keel bellows calibrate`)");
  }
  KEEL_ASSIGN_OR_RETURN(Calibration cal, ReadCalibration(it->second));
  if (Status fits = CheckCalibrationFits(cal, context.shape, context.model_checksum); !fits.ok()) {
    return Status(fits.code(), it->second + ": " + fits.message());
  }
  return MakeBellowsCodec(cal, context.shape);
}

}  // namespace keel::kv::bellows
