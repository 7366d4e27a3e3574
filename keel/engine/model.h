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

// Sparse mixture-of-experts feed-forward (Mixtral; OLMoE and Qwen2-MoE variants). A dense model
// has n_experts == 0. Routing: softmax over the router logits, the top_k experts, their weights
// renormalised to sum 1 when norm_topk (Mixtral always; OLMoE/Qwen2-MoE: norm_topk_prob).
inline constexpr int kMaxTopK = 32;      // experts per token at most (routing keeps them on the stack)
inline constexpr int kMaxExperts = 1024;  // experts per layer at most (likewise)

struct MoeConfig {
  int n_experts = 0;
  int top_k = 0;
  int expert_hidden = 0;       // each expert's SwiGLU width
  bool norm_topk = true;
  int shared_hidden = 0;       // Qwen2-MoE shared expert's width (0: none); gated by sigmoid(x . g)
  bool enabled() const { return n_experts > 0; }
};

struct ModelConfig {
  std::string arch = "llama";  // "llama", "qwen2", "mixtral", "olmoe" or "qwen2_moe"
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
  bool qk_norm = false;        // OLMoE: RMSNorm over the whole q [dim] and k [kv_dim] projections
  MoeConfig moe;               // n_experts == 0: dense SwiGLU of width hidden_dim

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
  // Checks the numbers are consistent (divisibility, positivity, sane bounds).
  Status Validate() const;
  // Every weight, all experts included (embedding and classifier counted once each when untied).
  int64_t ParameterCount() const;
  // The weights one token's forward pass reads: as ParameterCount but only top_k of the routed
  // experts per layer (the router and any shared expert count in full). Equals ParameterCount for
  // dense models. Counts the whole embedding table, as Mixtral's "12.9B active" does.
  int64_t ActiveParameterCount() const;
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

// One SwiGLU block: gate w1 [hidden][dim], down w2 [dim][hidden], up w3 [hidden][dim].
struct ExpertWeights {
  TensorView w1, w2, w3;
  size_t bytes() const { return w1.bytes() + w2.bytes() + w3.bytes(); }
};

struct MoeWeights {
  TensorView router;                   // [n_experts][dim]
  std::vector<ExpertWeights> experts;  // n_experts
  ExpertWeights shared;                // Qwen2-MoE shared expert (empty when none)
  TensorView shared_gate;              // [1][dim] (empty when none)
};

struct LayerWeights {
  const float* attn_norm = nullptr;  // [dim], always fp32
  TensorView wq, wk, wv, wo;         // [dim][dim], [kv_dim][dim], [kv_dim][dim], [dim][dim]
  const float* bq = nullptr;         // optional biases [dim], [kv_dim], [kv_dim] (fp32)
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* ffn_norm = nullptr;   // [dim]
  TensorView w1, w2, w3;             // gate [hidden][dim], down [dim][hidden], up [hidden][dim]; empty for MoE
  const float* q_norm = nullptr;     // qk_norm models: [dim] and [kv_dim]
  const float* k_norm = nullptr;
  MoeWeights moe;                    // MoE models only
};

// A file the weights are mapped from: lets a slow tier re-read a tensor's bytes from disk.
struct WeightFile {
  std::string path;
  const uint8_t* base = nullptr;
  size_t size = 0;
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
  // The mapped weight files (empty for models built in memory).
  std::vector<WeightFile> weight_files;
  // The file and byte offset `view`'s data was mapped from; NotFound when it is not in a mapped
  // file (a widened or in-memory tensor).
  Result<std::pair<const WeightFile*, uint64_t>> Locate(const TensorView& view) const;
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
