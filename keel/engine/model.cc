#include "keel/engine/model.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>

#include "keel/kv/attention_readers.h"

namespace keel::engine {
namespace {

// The MoE part of ModelConfig::Validate.
Status ValidateMoe(const ModelConfig& c) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("model config: " + m); };
  const MoeConfig& e = c.moe;
  if (!e.enabled()) {
    if (e.n_experts < 0 || e.top_k != 0 || e.expert_hidden != 0 || e.shared_hidden != 0) {
      return bad("n_experts " + std::to_string(e.n_experts) +
                 " but top_k/expert_hidden/shared_hidden set (a dense model has none)");
    }
    return Status::Ok();
  }
  // Bounded like the dense sizes: n_experts * n_layers expert views are allocated up front.
  if (e.n_experts > kMaxExperts) {
    return bad("n_experts " + std::to_string(e.n_experts) + " is beyond " + std::to_string(kMaxExperts));
  }
  if (e.top_k > kMaxTopK) {
    return bad("top_k " + std::to_string(e.top_k) + " is above the supported " + std::to_string(kMaxTopK) +
               " experts per token");
  }
  if (e.top_k < 1 || e.top_k > e.n_experts) {
    return bad("top_k " + std::to_string(e.top_k) + " must be in 1..n_experts (" +
               std::to_string(e.n_experts) + ")");
  }
  if (e.expert_hidden <= 0 || e.expert_hidden > (1 << 18) || e.shared_hidden < 0 ||
      e.shared_hidden > (1 << 18)) {
    return bad("expert_hidden " + std::to_string(e.expert_hidden) + " must be in 1..2^18, shared_hidden " +
               std::to_string(e.shared_hidden) + " in 0..2^18");
  }
  // Keeps ParameterCount within int64 at the other bounds; real models are far below it
  // (Mixtral 8x22B: 8 x 16384, DeepSeek-V3: 256 x 2048).
  if (int64_t{e.n_experts} * e.expert_hidden > (int64_t{1} << 22)) {
    return bad("n_experts x expert_hidden " + std::to_string(e.n_experts) + " x " +
               std::to_string(e.expert_hidden) + " is beyond 2^22");
  }
  if (c.hidden_dim != e.expert_hidden) {
    return bad("hidden_dim " + std::to_string(c.hidden_dim) + " != expert_hidden " +
               std::to_string(e.expert_hidden) + " (an MoE model's FFN width is its experts')");
  }
  return Status::Ok();
}

// One layer's weights outside the feed-forward block: norms, attention, optional biases/norms.
int64_t AttentionParameters(const ModelConfig& c) {
  const int64_t d = c.dim, kv = c.kv_dim();
  return 2 * d + d * d * 2 + 2 * kv * d + (c.qkv_bias ? d + 2 * kv : 0) + (c.qk_norm ? d + kv : 0);
}

// One layer's feed-forward weights with `experts` routed experts present.
int64_t FeedForwardParameters(const ModelConfig& c, int64_t experts) {
  const int64_t d = c.dim;
  if (!c.moe.enabled()) return 3 * int64_t{c.hidden_dim} * d;
  const int64_t shared = c.moe.shared_hidden > 0 ? 3 * int64_t{c.moe.shared_hidden} * d + d : 0;
  return int64_t{c.moe.n_experts} * d + experts * 3 * c.moe.expert_hidden * d + shared;
}

int64_t CountWith(const ModelConfig& c, int64_t experts) {
  const int64_t d = c.dim, v = c.vocab_size;
  const int64_t per_layer = AttentionParameters(c) + FeedForwardParameters(c, experts);
  return v * d * (c.tied_embeddings ? 1 : 2) + d + per_layer * c.n_layers;
}

}  // namespace

Status ModelConfig::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("model config: " + m); };
  if (dim <= 0 || hidden_dim <= 0 || n_layers <= 0 || n_heads <= 0 || n_kv_heads <= 0 ||
      vocab_size <= 0 || max_seq_len <= 0) {
    return bad("every size must be positive (dim=" + std::to_string(dim) + " hidden_dim=" +
               std::to_string(hidden_dim) + " n_layers=" + std::to_string(n_layers) + " n_heads=" +
               std::to_string(n_heads) + " n_kv_heads=" + std::to_string(n_kv_heads) +
               " vocab_size=" + std::to_string(vocab_size) + " seq_len=" + std::to_string(max_seq_len) + ")");
  }
  if (dim % n_heads != 0) return bad("dim " + std::to_string(dim) + " is not a multiple of n_heads " + std::to_string(n_heads));
  if (n_heads % n_kv_heads != 0) return bad("n_heads " + std::to_string(n_heads) + " is not a multiple of n_kv_heads " + std::to_string(n_kv_heads));
  if (head_dim() % 2 != 0) return bad("head_dim " + std::to_string(head_dim()) + " must be even for RoPE");
  // Hostile headers must not turn into multi-terabyte allocations.
  if (dim > (1 << 16) || hidden_dim > (1 << 18) || n_layers > 1024 || vocab_size > (1 << 22) ||
      max_seq_len > (1 << 22) || n_heads > 1024) {
    return bad("sizes beyond supported bounds");
  }
  // The forward pass keeps one head's rotation and scores in fixed stack buffers (kv::kMaxHeadDim).
  if (head_dim() > kv::kMaxHeadDim) {
    return bad("head_dim " + std::to_string(head_dim()) + " (dim / n_heads) is above the supported " +
               std::to_string(kv::kMaxHeadDim));
  }
  if (!(rms_eps > 0.0f) || !(rope_theta > 0.0f) || !std::isfinite(rms_eps) || !std::isfinite(rope_theta)) {
    return bad("rms_eps and rope_theta must be positive and finite (rms_eps=" + std::to_string(rms_eps) +
               " rope_theta=" + std::to_string(rope_theta) + ")");
  }
  return ValidateMoe(*this);
}

int64_t ModelConfig::ParameterCount() const { return CountWith(*this, moe.n_experts); }

int64_t ModelConfig::ActiveParameterCount() const { return CountWith(*this, moe.top_k); }

Result<std::pair<const WeightFile*, uint64_t>> Model::Locate(const TensorView& view) const {
  const auto* p = static_cast<const uint8_t*>(view.data);
  for (const WeightFile& f : weight_files) {
    if (p >= f.base && p + view.bytes() <= f.base + f.size) {
      return std::make_pair(&f, static_cast<uint64_t>(p - f.base));
    }
  }
  return Status::NotFound(source + ": tensor is not in a mapped weight file");
}

const float* Model::OwnF32(const TensorView& v) {
  size_t n = static_cast<size_t>(v.rows * v.cols);
  auto buf = std::shared_ptr<float[]>(new float[n]);
  ConvertToF32(v.dtype, v.data, buf.get(), n);
  const float* p = buf.get();
  storage.push_back(std::shared_ptr<const void>(buf, p));
  return p;
}

Result<Model> LoadModel(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;  // e.g. ELOOP for a symlink loop, EACCES
    if (err == ENOENT) return Status::NotFound(path + ": no such file or directory");
    return Status::IOError(path + ": " + std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) return LoadSafetensors(path);
  auto ends_with = [&](const char* suffix) {
    size_t n = std::strlen(suffix);
    return path.size() >= n && path.compare(path.size() - n, n, suffix) == 0;
  };
  if (ends_with(".safetensors") || ends_with("config.json")) {
    size_t slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
    const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
    // A safetensors model is its directory (config.json + model.safetensors or an index of
    // shards). Naming one file of it is a shorthand for the directory; naming any other file
    // would load model.safetensors in its place.
    struct stat index {};
    const bool sharded = ::stat((dir + "/model.safetensors.index.json").c_str(), &index) == 0;
    if (name != "config.json" && name != "model.safetensors" && !sharded) {
      return Status::InvalidArgument(path + ": a safetensors model loads from its directory (config.json with "
                                            "model.safetensors or model.safetensors.index.json); this file is "
                                            "neither: pass the directory");
    }
    return LoadSafetensors(dir);
  }
  return LoadLlama2c(path);
}

}  // namespace keel::engine
