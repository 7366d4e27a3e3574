// BellowsKV calibration: the matrices that let n adjacent layers share one stored vector per token,
// in memory and as a file.
//
// A model's layers are split into groups of `group_size` adjacent layers (the last group may be
// shorter). For one token and group g = layers [l0, l0+n):
//   X  = concat(x_l0, ..., x_l0+n-1)                     n*dim floats, x = the layer input
//   z  = (X - x_mean) * compress                          rank floats: the one vector stored
//   k_pre_l = k_mean_l + z[k_begin, k_end) * rk_l         kv_dim floats, before RoPE (interleaved
//   v_l     = v_mean_l + z[v_begin, v_end) * rv_l          pairs); the runtime re-applies RoPE
// Joint latent: k and v ranges are both [0, rank); split latent: [0, rk) and [rk, rank).
// All matrices are row-major f32. A Calibration is a plain value: copyable, no hidden state.
//
// File layout (".bkv", little-endian, no padding); every field is validated on read:
//   header
//     u8[8]  magic          "KEELBKV\0"
//     u32    version        1
//     u32    reserved       0
//     u64    total_bytes    size of the whole file, trailer included
//     u64    model.lo, model.hi   XXH3-128 of the model weights (Hash128)
//     u32    dim, n_layers, n_heads, n_kv_heads, head_dim
//     f32    rope_theta
//     u32    group_size, n_groups
//     u32    method_bytes, then that many bytes of text (UTF-8, free form)
//   per group (n_groups, in layer order)
//     u32    first_layer, n_layers, rank, k_begin, k_end, v_begin, v_end
//     f32    x_mean[n_layers*dim]
//     f32    compress[n_layers*dim][rank]
//     per layer of the group
//       f32  errors[4]      k_rel, v_rel, k_weighted_rel, v_weighted_rel (LayerErrors)
//       f32  k_mean[kv_dim], v_mean[kv_dim]
//       f32  rk[k_end-k_begin][kv_dim], rv[v_end-v_begin][kv_dim]
//   token table (layer 0 by token id; see Calibration::token_kv)
//     u32    vocab          0: none
//     f32    token_kv[vocab][2*kv_dim]
//   trailer
//     u64    lo, hi         XXH3-128 of every byte before the trailer
// Invariants checked by every reader and writer: groups are [i*group_size, ...) covering the
// layers exactly once in order, each of group_size layers except a shorter last one;
// 1 <= rank <= n_layers*dim; k and v ranges non-empty and inside [0, rank); head_dim even (RoPE
// pairs); every float finite; dims within sane limits (kMaxDim etc.).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/hash.h"
#include "keel/core/status.h"
#include "keel/kv/codec.h"

namespace keel::kv::bellows {

inline constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'B', 'K', 'V', '\0'};
inline constexpr uint32_t kVersion = 1;
// Sane limits: a reader refuses anything larger before allocating (hostile sizes).
inline constexpr int kMaxDim = 65536;        // model dim, kv_dim and n_layers*dim
inline constexpr int kMaxLayers = 1024;
inline constexpr int kMaxHeads = 4096;
inline constexpr int kMaxHeadDim = 4096;
inline constexpr int kMaxRank = 65536;
inline constexpr uint32_t kMaxMethodBytes = 1 << 16;
inline constexpr int kMaxVocab = 1 << 20;

// Reconstruction errors measured on the calibration samples, relative to the centered energy of
// the target (so 0 = exact, 1 = no better than the mean). "weighted" is the same under the
// solver's attention-aware weights (equal to the plain one for a plain-objective fit).
struct LayerErrors {
  float k_rel = 0.f;
  float v_rel = 0.f;
  float k_weighted_rel = 0.f;
  float v_weighted_rel = 0.f;
};

// Restore matrices of one layer of a group.
struct LayerRestore {
  std::vector<float> k_mean;  // [kv_dim]
  std::vector<float> v_mean;  // [kv_dim]
  std::vector<float> rk;      // [k_end-k_begin][kv_dim]
  std::vector<float> rv;      // [v_end-v_begin][kv_dim]
  LayerErrors errors;
};

// One group of adjacent layers sharing one latent vector per token. Also what the solver
// returns (GroupMatrices).
struct CalibrationGroup {
  int first_layer = 0;
  int n_layers = 0;
  int rank = 0;
  int k_begin = 0, k_end = 0;  // latent range restoring K
  int v_begin = 0, v_end = 0;  // latent range restoring V
  std::vector<float> x_mean;    // [n_layers*dim]
  std::vector<float> compress;  // [n_layers*dim][rank]
  std::vector<LayerRestore> layers;  // layers[i] is layer first_layer + i
};

struct Calibration {
  Hash128 model_checksum;  // XXH3-128 of the model weights (CodecContext::model_checksum is its hex)
  int dim = 0;             // model hidden size = width of a layer input x
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  float rope_theta = 10000.f;
  int group_size = 0;      // layers per group (the last group may be shorter)
  std::string method;      // how it was solved (objective, ranks, ridge, tokens): for people
  std::vector<CalibrationGroup> groups;
  // Layer 0's input is a function of the token id alone (its RMSNorm'd embedding), so its K
  // (before RoPE) and V are too: with this table (vocab > 0) the codec stores the token id and
  // reads layer 0 exactly from here instead of restoring it from the latent, and the latent is
  // fitted to the other layers only. token_kv[t] = k_pre (kv_dim) then v (kv_dim) of token t.
  int vocab = 0;
  std::vector<float> token_kv;

  int kv_dim() const { return n_kv_heads * head_dim; }
};

// Checks every invariant of the file layout above on an in-memory Calibration (sizes of every
// vector included). InvalidArgument naming the first violation.
Status ValidateCalibration(const Calibration& c);

// The file bytes of `c` (trailer included). InvalidArgument if ValidateCalibration fails.
Result<std::string> SerializeCalibration(const Calibration& c);

// Writes `c` to `path` durably: `path`.tmp, fsync, rename, fsync of the directory. A crash leaves
// either the old file or the new one. InvalidArgument if `c` is invalid, IOError on OS failures.
Status WriteCalibration(const std::string& path, const Calibration& c);

// Parses a whole file's bytes. Corruption "<name>: <what> at offset N" for bad magic, unknown
// version, truncation anywhere, trailing bytes, checksum mismatch, hostile or inconsistent sizes,
// NaN/Inf. Never allocates more than the input's size implies. The result re-serializes to the
// same bytes.
Result<Calibration> ParseCalibration(std::string_view bytes, const std::string& name_for_errors);

// Reads and parses `path` (NotFound / IOError from the OS, Corruption from the parser).
Result<Calibration> ReadCalibration(const std::string& path);

// OK when `c` was made for this model: same weights checksum (hex, case-insensitive) and the same
// shape (layers, heads, KV heads, head_dim, and dim / RoPE theta where `shape` has them).
// InvalidArgument naming both checksums or both shapes otherwise.
Status CheckCalibrationFits(const Calibration& c, const KvShape& shape, const std::string& model_checksum_hex);
// The same with the model dim and RoPE theta given explicitly (checked against the file too).
Status CheckCalibrationFits(const Calibration& c, const KvShape& shape, int dim, float rope_theta,
                            const std::string& model_checksum_hex);

// Hex of the file checksum (the trailer) that `c` serializes to: 32 lowercase hex digits. Part of
// the KV cache fingerprint, so two caches built from different calibrations never share blocks.
std::string CalibrationFingerprint(const Calibration& c);

// Bytes a latent vector of `rank` takes per token (bf16), for compression figures.
inline size_t LatentBytes(int rank) { return 2 * static_cast<size_t>(rank); }

}  // namespace keel::kv::bellows
