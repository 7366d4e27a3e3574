#include "keel/engine/model.h"

#include <sys/stat.h>

#include <cstring>

namespace keel::engine {

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
  if (!(rms_eps > 0.0f) || !(rope_theta > 0.0f)) return bad("rms_eps and rope_theta must be positive");
  return Status::Ok();
}

int64_t ModelConfig::ParameterCount() const {
  int64_t d = dim, h = hidden_dim, kv = kv_dim(), v = vocab_size;
  int64_t per_layer = 2 * d + d * d * 2 + 2 * kv * d + 3 * h * d + (qkv_bias ? d + 2 * kv : 0);
  return v * d * (tied_embeddings ? 1 : 2) + d + per_layer * n_layers;
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
  if (::stat(path.c_str(), &st) != 0) return Status::NotFound(path + ": no such file or directory");
  if (S_ISDIR(st.st_mode)) return LoadSafetensors(path);
  auto ends_with = [&](const char* suffix) {
    size_t n = std::strlen(suffix);
    return path.size() >= n && path.compare(path.size() - n, n, suffix) == 0;
  };
  if (ends_with(".safetensors") || ends_with("config.json")) {
    size_t slash = path.find_last_of('/');
    return LoadSafetensors(slash == std::string::npos ? "." : path.substr(0, slash));
  }
  return LoadLlama2c(path);
}

}  // namespace keel::engine
