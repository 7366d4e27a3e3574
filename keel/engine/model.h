// A model is data plus a forward pass: this header is the data. ModelConfig holds the
// hyper-parameters, Model holds views of the weight tensors. Weights point into a memory map
// (or, for small tensors widened at load, into buffers the Model owns), so a Model is cheap to
// move and immutable after loading: safe to read from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/core/hash.h"
#include "keel/core/status.h"

namespace keel::engine {

// How RoPE pairs dimensions inside a head. llama2.c (Meta layout) rotates (2j, 2j+1);
// Hugging Face Llama/Qwen2 rotate (j, j + head_dim/2). Either way the engine writes rotated
// q/k in the interleaved order, so both layouts of the same weights give bit-identical results.
enum class RopeStyle : uint8_t { kInterleaved, kHalf };

struct ModelConfig {
  std::string arch = "llama";  // "llama" or "qwen2"
  int dim = 0;                 // hidden size
  int hidden_dim = 0;          // FFN inner size
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int max_seq_len = 0;         // context length
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  RopeStyle rope_style = RopeStyle::kInterleaved;
  bool tied_embeddings = true;
  bool qkv_bias = false;       // Qwen2 has q/k/v biases

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
  // Checks the numbers are consistent (divisibility, positivity, sane bounds).
  Status Validate() const;
  int64_t ParameterCount() const;
};

// A 2-D row-major tensor view [rows][cols] (1-D tensors have rows == 1). Matrices are [out][in].
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  bool empty() const { return data == nullptr; }
  size_t bytes() const { return static_cast<size_t>(rows * cols) * DTypeSize(dtype); }
};

struct LayerWeights {
  const float* attn_norm = nullptr;  // [dim], always fp32
  TensorView wq, wk, wv, wo;         // [dim][dim], [kv_dim][dim], [kv_dim][dim], [dim][dim]
  const float* bq = nullptr;         // optional biases [dim], [kv_dim], [kv_dim] (fp32)
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* ffn_norm = nullptr;   // [dim]
  TensorView w1, w2, w3;             // gate [hidden][dim], down [dim][hidden], up [hidden][dim]
};

struct Model {
  ModelConfig config;
  TensorView embedding;   // [vocab][dim]
  const float* final_norm = nullptr;  // [dim]
  TensorView classifier;  // [vocab][dim]; equals `embedding` when tied
  std::vector<LayerWeights> layers;

  std::string source;     // path the model was loaded from
  std::string format;     // "llama2c" or "safetensors"
  Hash128 checksum;       // XXH3-128 of the weight bytes as stored; part of every cache fingerprint

  // Keeps the memory maps and widened small tensors alive for as long as the views are used.
  std::vector<std::shared_ptr<const void>> storage;
  // Copies `n` values of `v` widened to fp32 into storage owned by the model; returns them.
  const float* OwnF32(const TensorView& v);
};

// Loads a llama2.c checkpoint (.bin, legacy version 0: 7 int32 header, fp32 weights; negative
// vocab_size means an unshared classifier follows the legacy freq_cis tables).
// Errors name the file and the byte offset where the data stopped making sense.
Result<Model> LoadLlama2c(const std::string& path);

// Loads a Hugging Face model directory: config.json plus model.safetensors (or the shards named
// in model.safetensors.index.json). Llama and Qwen2; F32, F16 and BF16 tensors.
Result<Model> LoadSafetensors(const std::string& dir);

// Picks the loader: a directory (or a .safetensors file / config.json inside one) goes to
// LoadSafetensors, anything else to LoadLlama2c.
Result<Model> LoadModel(const std::string& path);

}  // namespace keel::engine
