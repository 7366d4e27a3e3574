// Model conversion and synthesis: a loaded Model written out as a Hugging Face directory
// (config.json + model.safetensors + tokenizer.bin), seeded random Llama/Qwen2 and MoE
// (Mixtral/OLMoE/Qwen2-MoE) models of any size for tests and benchmarks, and a human-readable
// description for `keel inspect`.
//
// All functions are free functions with no shared state; safe to call from any thread as long
// as two calls do not write the same directory.
#pragma once

#include <cstdint>
#include <string>

#include "keel/core/dtype.h"
#include "keel/core/status.h"
#include "keel/engine/model.h"

namespace keel::engine {

// Writes `model` to out_dir (created if missing) as config.json (HF style; model_type the model's
// arch, with that architecture's field names for experts) and model.safetensors with HF tensor
// names, every tensor stored as `dtype`; copies the
// llama2.c tokenizer at `tokenizer_path` to out_dir/tokenizer.bin (skipped when empty).
// Models in llama2.c's interleaved RoPE layout get the rows of q_proj and k_proj permuted within
// each head into HF's rotate-half order (transformers' convert_llama_weights_to_hf `permute`), so
// LoadSafetensors of the result computes the same function; with F32 the logits are identical.
// Each file is written atomically; tensors are converted one at a time. InvalidArgument when
// the model's MoE features do not fit its arch (experts without an MoE arch, a shared expert
// outside qwen2_moe, q/k norms outside olmoe, Mixtral without top-k renormalisation).
Status ConvertToSafetensors(const Model& model, const std::string& tokenizer_path,
                            const std::string& out_dir, DType dtype = DType::kF32);

struct RandomModelOptions {
  // "llama"; "qwen2" (q/k/v biases); MoE: "mixtral", "olmoe" (q/k norms) or "qwen2_moe" (q/k/v
  // biases and a shared expert).
  std::string arch = "llama";
  int layers = 2;
  int dim = 64;
  int heads = 4;
  int kv_heads = 0;            // 0: same as heads
  int hidden = 0;              // 0: Llama-style 8*dim/3 rounded up to a multiple of 32
  int vocab = 512;             // at least 259 (3 specials + 256 byte pieces)
  int max_seq_len = 2048;
  uint64_t seed = 0;
  DType dtype = DType::kF32;
  std::string out_dir;
  float rope_theta = 0.0f;     // 0: 10000 for llama, 1000000 for qwen2
  float init_std = 0.02f;      // matrices and biases ~ N(0, init_std); norms ~ 1 + N(0, init_std)
  bool tie_embeddings = false; // true: no lm_head tensor; the classifier is the embedding
  // MoE archs only (InvalidArgument on a dense arch when set):
  int experts = 0;             // routed experts per layer (0: 8)
  int top_k = 0;               // experts per token (0: 2)
  int expert_hidden = 0;       // each expert's width (0: as `hidden`); the model's hidden_dim
  int shared_hidden = 0;       // qwen2_moe only: shared expert width (0: 4 * expert_hidden)
  bool norm_topk = false;      // olmoe/qwen2_moe norm_topk_prob; Mixtral always renormalises
};

// The ModelConfig MakeRandomModel would write (defaults resolved), or InvalidArgument naming the
// first bad option.
Result<ModelConfig> RandomModelConfig(const RandomModelOptions& o);

// Writes out_dir/config.json, out_dir/model.safetensors (weights from std::mt19937_64 seeded with
// o.seed; the same options give the same bytes on every machine) and out_dir/tokenizer.bin (a
// llama2.c tokenizer: <unk>, BOS, EOS, 256 byte pieces, then printable pieces). Streams tensor by
// tensor, so memory stays at one tensor's worth whatever the model size.
Status MakeRandomModel(const RandomModelOptions& o);

// Multi-line text: source, format, every config field (MoE models: experts, top_k, expert width,
// norm_topk, shared expert), checksum, parameter count (MoE: also active per token), then one
// line per tensor (HF name, dtype, shape; every expert's), in the order the forward pass uses them.
std::string DescribeModel(const Model& m);

}  // namespace keel::engine
