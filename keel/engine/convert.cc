#include "keel/engine/convert.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <numbers>
#include <random>
#include <set>

#include "keel/core/mapped_file.h"
#include "keel/engine/safetensors.h"
#include "keel/engine/tokenizer.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

enum class Kind { kMatrix, kNorm, kBias };

// One tensor of the HF layout. `view` is the source in a Model (empty when describing a model
// that does not exist yet); 1-D tensors have view.rows == 1. perm_heads > 0 means the source
// rows (or elements) are in llama2.c's interleaved RoPE order for that many heads.
struct HfTensor {
  std::string name;
  Kind kind = Kind::kMatrix;
  std::vector<int64_t> shape;
  TensorView view;
  int perm_heads = 0;
};

// The HF tensors of config `c` in forward-pass order, with views into `m` when given.
// `tied` drops lm_head. MoE layers: router, then each routed expert's gate, up and down, then
// Qwen2-MoE's shared expert and its gate; Mixtral's names are block_sparse_moe.experts.E.w1/w3/w2.
std::vector<HfTensor> HfTensors(const ModelConfig& c, const Model* m, bool tied) {
  std::vector<HfTensor> out;
  const int64_t d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  const bool inter = c.rope_style == RopeStyle::kInterleaved;
  auto mat = [&](std::string name, int64_t rows, int64_t cols, const TensorView* src, int perm) {
    out.push_back({std::move(name), Kind::kMatrix, {rows, cols}, src ? *src : TensorView{}, perm});
  };
  auto vec = [&](std::string name, Kind k, int64_t n, const float* src, int perm) {
    out.push_back({std::move(name), k, {n}, TensorView{src, DType::kF32, 1, n}, perm});
  };
  mat("model.embed_tokens.weight", v, d, m ? &m->embedding : nullptr, 0);
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const LayerWeights* l = m ? &m->layers[i] : nullptr;
    const int qp = inter ? c.n_heads : 0, kp = inter ? c.n_kv_heads : 0;
    vec(p + "input_layernorm.weight", Kind::kNorm, d, l ? l->attn_norm : nullptr, 0);
    mat(p + "self_attn.q_proj.weight", d, d, l ? &l->wq : nullptr, qp);
    mat(p + "self_attn.k_proj.weight", kv, d, l ? &l->wk : nullptr, kp);
    mat(p + "self_attn.v_proj.weight", kv, d, l ? &l->wv : nullptr, 0);
    mat(p + "self_attn.o_proj.weight", d, d, l ? &l->wo : nullptr, 0);
    if (c.qkv_bias) {
      vec(p + "self_attn.q_proj.bias", Kind::kBias, d, l ? l->bq : nullptr, qp);
      vec(p + "self_attn.k_proj.bias", Kind::kBias, kv, l ? l->bk : nullptr, kp);
      vec(p + "self_attn.v_proj.bias", Kind::kBias, kv, l ? l->bv : nullptr, 0);
    }
    if (c.qk_norm) {  // per-element weights over whole q / k rows: permuted like the biases
      vec(p + "self_attn.q_norm.weight", Kind::kNorm, d, l ? l->q_norm : nullptr, qp);
      vec(p + "self_attn.k_norm.weight", Kind::kNorm, kv, l ? l->k_norm : nullptr, kp);
    }
    vec(p + "post_attention_layernorm.weight", Kind::kNorm, d, l ? l->ffn_norm : nullptr, 0);
    if (!c.moe.enabled()) {
      mat(p + "mlp.gate_proj.weight", h, d, l ? &l->w1 : nullptr, 0);
      mat(p + "mlp.up_proj.weight", h, d, l ? &l->w3 : nullptr, 0);
      mat(p + "mlp.down_proj.weight", d, h, l ? &l->w2 : nullptr, 0);
      continue;
    }
    const bool mixtral = c.arch == "mixtral";
    const std::string block = p + (mixtral ? "block_sparse_moe." : "mlp.");
    // gate, up, down: the names after an expert's prefix, and its views (null: none to read).
    auto expert = [&](const std::string& prefix, bool w_names, int64_t eh, const ExpertWeights* e) {
      mat(prefix + (w_names ? "w1.weight" : "gate_proj.weight"), eh, d, e ? &e->w1 : nullptr, 0);
      mat(prefix + (w_names ? "w3.weight" : "up_proj.weight"), eh, d, e ? &e->w3 : nullptr, 0);
      mat(prefix + (w_names ? "w2.weight" : "down_proj.weight"), d, eh, e ? &e->w2 : nullptr, 0);
    };
    const MoeWeights* w = l ? &l->moe : nullptr;
    mat(block + "gate.weight", c.moe.n_experts, d, w ? &w->router : nullptr, 0);
    for (int x = 0; x < c.moe.n_experts; ++x) {
      // A Model whose expert list is short gets empty views, which CheckModelViews reports.
      const ExpertWeights* e = w && x < static_cast<int>(w->experts.size()) ? &w->experts[x] : nullptr;
      expert(block + "experts." + std::to_string(x) + ".", mixtral, c.moe.expert_hidden, e);
    }
    if (c.moe.shared_hidden > 0) {
      expert(block + "shared_expert.", false, c.moe.shared_hidden, w ? &w->shared : nullptr);
      mat(block + "shared_expert_gate.weight", 1, d, w ? &w->shared_gate : nullptr, 0);
    }
  }
  vec("model.norm.weight", Kind::kNorm, d, m ? m->final_norm : nullptr, 0);
  if (!tied) mat("lm_head.weight", v, d, m ? &m->classifier : nullptr, 0);
  return out;
}

// Meta -> HF rotate-half order inside each head: HF index j < hd/2 comes from interleaved
// index 2j, HF index j + hd/2 from 2j + 1.
int64_t InterleavedSource(int64_t r, int64_t head_dim) {
  int64_t head = r / head_dim, j = r % head_dim, half = head_dim / 2;
  return head * head_dim + (j < half ? 2 * j : 2 * (j - half) + 1);
}

std::string TorchDType(DType t) {
  return t == DType::kF32 ? "float32" : t == DType::kF16 ? "float16" : "bfloat16";
}

// Returns how many finite values became infinite (beyond the narrow type's range).
size_t NarrowF32(DType t, const float* src, uint8_t* dst, size_t n) {
  if (t == DType::kF32) {
    std::memcpy(dst, src, n * 4);
    return 0;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  size_t overflowed = 0;
  const uint16_t exp_mask = t == DType::kF16 ? 0x7C00 : 0x7F80;  // all-ones exponent: inf or NaN
  for (size_t i = 0; i < n; ++i) {
    out[i] = t == DType::kF16 ? F32ToF16(src[i]) : F32ToBf16(src[i]);
    overflowed += (out[i] & exp_mask) == exp_mask && std::isfinite(src[i]);
  }
  return overflowed;
}

// Fills `n` consecutive rows starting at `row` (each shape.back() floats) of one tensor.
using RowFill = std::function<void(int64_t row, int64_t n, float* dst)>;

// Writes `tensors` as `dtype`, asking `fill` for each tensor's fp32 rows a few MiB at a time.
Status WriteStreaming(const std::string& path, const std::vector<HfTensor>& tensors, DType dtype,
                      const std::function<RowFill(const HfTensor&)>& fill) {
  std::vector<TensorSpec> specs;
  for (const HfTensor& t : tensors) specs.push_back({t.name, dtype, t.shape});
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                        SafetensorsWriter::Create(path, specs, {{"format", "pt"}}));
  std::vector<float> f32;
  std::vector<uint8_t> bytes;
  for (const HfTensor& t : tensors) {
    const int64_t cols = t.shape.back();
    const int64_t rows = t.shape.size() == 2 ? t.shape[0] : 1;
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 20) / cols);
    RowFill rows_of = fill(t);
    for (int64_t r = 0; r < rows; r += chunk) {
      const int64_t n = std::min(chunk, rows - r);
      const size_t count = static_cast<size_t>(n * cols);
      f32.resize(count);
      bytes.resize(count * DTypeSize(dtype));
      rows_of(r, n, f32.data());
      if (const size_t over = NarrowF32(dtype, f32.data(), bytes.data(), count); over > 0) {
        return Status::InvalidArgument(fmt::format(
            "{}: {} values beyond the range of {} (they would become infinite); convert with --dtype {}", t.name,
            over, TorchDType(dtype), dtype == DType::kF16 ? "bf16 or f32" : "f32"));
      }
      KEEL_RETURN_IF_ERROR(w->Write(bytes.data(), bytes.size()));
    }
  }
  return w->Finish();
}

// A float as JSON with its shortest decimal spelling (1e-05, not 9.99999974737875e-06).
json ShortFloat(float f) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof(buf), f);
  return json::parse(std::string(buf, r.ptr));
}

// The transformers class of each arch Keel writes.
const char* ArchClass(const std::string& arch) {
  if (arch == "qwen2") return "Qwen2ForCausalLM";
  if (arch == "mixtral") return "MixtralForCausalLM";
  if (arch == "olmoe") return "OlmoeForCausalLM";
  if (arch == "qwen2_moe") return "Qwen2MoeForCausalLM";
  return "LlamaForCausalLM";
}

// The expert block's fields, named as each architecture's transformers config names them.
void MoeConfigJson(const ModelConfig& c, json* j) {
  const MoeConfig& e = c.moe;
  (*j)["num_experts_per_tok"] = e.top_k;
  (*j)["output_router_logits"] = false;
  if (c.arch == "mixtral") {
    (*j)["num_local_experts"] = e.n_experts;
    (*j)["router_aux_loss_coef"] = 0.02;
    (*j)["sliding_window"] = nullptr;
    return;
  }
  (*j)["num_experts"] = e.n_experts;
  (*j)["norm_topk_prob"] = e.norm_topk;
  (*j)["router_aux_loss_coef"] = 0.01;
  if (c.arch == "olmoe") {
    (*j)["clip_qkv"] = nullptr;
    return;
  }
  // Qwen2-MoE: intermediate_size is the width of dense layers, which these models do not have.
  (*j)["moe_intermediate_size"] = e.expert_hidden;
  (*j)["shared_expert_intermediate_size"] = e.shared_hidden;
  (*j)["intermediate_size"] = e.shared_hidden;
  (*j)["decoder_sparse_step"] = 1;
  (*j)["mlp_only_layers"] = json::array();
}

std::string HfConfigJson(const ModelConfig& c, bool tied, DType dtype) {
  const bool qwen = c.arch == "qwen2" || c.arch == "qwen2_moe";
  json j = {{"architectures", json::array({ArchClass(c.arch)})},
            {"model_type", c.arch},
            {"hidden_size", c.dim},
            {"intermediate_size", c.hidden_dim},
            {"num_hidden_layers", c.n_layers},
            {"num_attention_heads", c.n_heads},
            {"num_key_value_heads", c.n_kv_heads},
            {"vocab_size", c.vocab_size},
            {"max_position_embeddings", c.max_seq_len},
            {"rms_norm_eps", ShortFloat(c.rms_eps)},
            {"rope_theta", ShortFloat(c.rope_theta)},
            {"tie_word_embeddings", tied},
            {"hidden_act", "silu"},
            {"bos_token_id", 1},
            {"eos_token_id", 2},
            {"torch_dtype", TorchDType(dtype)}};
  if (qwen) j["use_sliding_window"] = false;
  else j["attention_bias"] = false;
  if (c.moe.enabled()) MoeConfigJson(c, &j);
  return j.dump(2) + "\n";
}

// Creates `dir` for a new one-file model. A shard index left there by another model would win
// over the new model.safetensors when loading, so it goes; config.json goes too and is written
// last, so a write that fails leaves a directory that does not load rather than a mixed model.
Status PrepareModelDir(const std::string& dir) {
  if (dir.empty()) return Status::InvalidArgument("output directory is empty");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    return Status::IOError(dir + ": cannot create directory: " + ec.message());
  }
  for (const char* stale : {"model.safetensors.index.json", "config.json"}) {
    const fs::path p = fs::path(dir) / stale;
    if (!fs::exists(p, ec)) continue;
    if (!fs::remove(p, ec) || ec) return Status::IOError(p.string() + ": cannot remove the old file: " + ec.message());
  }
  return Status::Ok();
}

// The MoE features must match the arch, or config.json would describe another model than the
// tensors (LoadSafetensors derives them from the arch).
Status CheckMoeArch(const ModelConfig& c) {
  const std::string& a = c.arch;
  const bool moe_arch = a == "mixtral" || a == "olmoe" || a == "qwen2_moe";
  auto bad = [&](const std::string& m) { return Status::InvalidArgument("arch " + a + ": " + m); };
  if (moe_arch != c.moe.enabled()) return bad(c.moe.enabled() ? "has experts" : "has no experts");
  if ((a == "qwen2_moe") != (c.moe.shared_hidden > 0)) {
    return bad("a shared expert is written for qwen2_moe, and only there");
  }
  if ((a == "olmoe") != c.qk_norm) return bad("q/k norms are written for olmoe, and only there");
  if (a == "mixtral" && !c.moe.norm_topk) return bad("Mixtral always renormalises its top-k weights");
  return Status::Ok();
}

Status CheckModelViews(const Model& m, const std::vector<HfTensor>& tensors) {
  if (static_cast<int>(m.layers.size()) != m.config.n_layers) {
    return Status::InvalidArgument(m.source + ": model has " + std::to_string(m.layers.size()) +
                                   " layers, config says " + std::to_string(m.config.n_layers));
  }
  for (const HfTensor& t : tensors) {
    const int64_t rows = t.shape.size() == 2 ? t.shape[0] : 1;
    if (t.view.empty() || t.view.rows != rows || t.view.cols != t.shape.back()) {
      return Status::InvalidArgument(m.source + ": tensor for " + t.name +
                                     " is missing or has the wrong shape");
    }
  }
  return Status::Ok();
}

// --- random models -----------------------------------------------------------------------------

// Standard normal samples via Box-Muller on mt19937_64's output. std::normal_distribution is not
// used because its algorithm differs between standard libraries; mt19937_64 is fully specified.
class NormalSource {
 public:
  explicit NormalSource(uint64_t seed) : rng_(seed) {}
  float Next() {
    if (has_spare_) {
      has_spare_ = false;
      return static_cast<float>(spare_);
    }
    // Both uniforms in (0, 1): log(0) never happens.
    double u1 = ((rng_() >> 11) + 0.5) * 0x1.0p-53;
    double u2 = ((rng_() >> 11) + 0.5) * 0x1.0p-53;
    double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * std::numbers::pi * u2;
    spare_ = r * std::sin(a);
    has_spare_ = true;
    return static_cast<float>(r * std::cos(a));
  }

 private:
  std::mt19937_64 rng_;
  bool has_spare_ = false;
  double spare_ = 0;
};

// <unk>, BOS, EOS, the 256 byte-fallback pieces, then distinct printable pieces: single ASCII
// characters, space+letter, frequent English bigrams and trigrams, then "tok<N>".
void RandomVocab(int vocab, std::vector<std::string>* pieces, std::vector<float>* scores) {
  *pieces = {"<unk>", "\n<s>\n", "\n</s>\n"};
  for (int b = 0; b < 256; ++b) pieces->push_back(fmt::format("<0x{:02X}>", b));
  scores->assign(pieces->size(), 0.0f);
  std::set<std::string> seen(pieces->begin(), pieces->end());
  std::vector<std::string> candidates;
  for (char ch = ' '; ch <= '~'; ++ch) candidates.emplace_back(1, ch);
  for (char ch = 'a'; ch <= 'z'; ++ch) candidates.push_back(std::string(" ") + ch);
  for (const char* s : {"th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es",
                        "or", "te", "of", "ed", "is", "it", "al", "ar", "st", "to", "nt", "ng",
                        "se", "ha", "as", "ou", "io", "le", "ve", "co", "me", "de", "hi", "ri",
                        "ro", "ic", "ne", "ea", "ra", "ce", "the", "and", "ing", "ion", "ent",
                        "her", "for", "tha", "nth", "int", "ere", "tio", "ter", "est", "ers",
                        " the", " and", " of", " to", " in", " a", " is", " it", " was", " he"}) {
    candidates.emplace_back(s);
  }
  float score = 0.0f;
  auto add = [&](const std::string& p) {
    if (static_cast<int>(pieces->size()) >= vocab || !seen.insert(p).second) return;
    pieces->push_back(p);
    scores->push_back(score);
    score -= 1.0f;
  };
  for (const auto& c : candidates) add(c);
  for (int n = 0; static_cast<int>(pieces->size()) < vocab; ++n) add("tok" + std::to_string(n));
}

}  // namespace

Status ConvertToSafetensors(const Model& model, const std::string& tokenizer_path,
                            const std::string& out_dir, DType dtype) {
  const ModelConfig& c = model.config;
  KEEL_RETURN_IF_ERROR(c.Validate());
  KEEL_RETURN_IF_ERROR(CheckMoeArch(c));
  const bool tied = model.classifier.data == model.embedding.data;
  std::vector<HfTensor> tensors = HfTensors(c, &model, tied);
  KEEL_RETURN_IF_ERROR(CheckModelViews(model, tensors));
  KEEL_RETURN_IF_ERROR(PrepareModelDir(out_dir));

  const int64_t head_dim = c.head_dim();
  auto fill = [&](const HfTensor& t) -> RowFill {
    const TensorView v = t.view;
    const size_t row_bytes = static_cast<size_t>(v.cols) * DTypeSize(v.dtype);
    const uint8_t* base = static_cast<const uint8_t*>(v.data);
    if (t.perm_heads == 0) {
      return [=](int64_t row, int64_t n, float* dst) {
        ConvertToF32(v.dtype, base + row * row_bytes, dst, static_cast<size_t>(n * v.cols));
      };
    }
    if (t.shape.size() == 1) {  // a permuted vector (bias, q/k norm): permute its elements
      return [=](int64_t, int64_t, float* dst) {
        const float* src = static_cast<const float*>(v.data);
        for (int64_t e = 0; e < v.cols; ++e) dst[e] = src[InterleavedSource(e, head_dim)];
      };
    }
    return [=](int64_t row, int64_t n, float* dst) {
      for (int64_t r = 0; r < n; ++r) {
        ConvertToF32(v.dtype, base + InterleavedSource(row + r, head_dim) * row_bytes,
                     dst + r * v.cols, static_cast<size_t>(v.cols));
      }
    };
  };
  KEEL_RETURN_IF_ERROR(WriteStreaming(out_dir + "/model.safetensors", tensors, dtype, fill));
  if (!tokenizer_path.empty()) {
    KEEL_ASSIGN_OR_RETURN(std::string tok, ReadFileToString(tokenizer_path));
    KEEL_RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/tokenizer.bin", tok));
  }
  // config.json last: a directory is only loadable once everything else is in place.
  return WriteFileAtomic(out_dir + "/config.json", HfConfigJson(c, tied, dtype));
}

Result<ModelConfig> RandomModelConfig(const RandomModelOptions& o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("random model: " + m); };
  const bool moe = o.arch == "mixtral" || o.arch == "olmoe" || o.arch == "qwen2_moe";
  if (o.arch != "llama" && o.arch != "qwen2" && !moe) {
    return bad("arch \"" + o.arch + "\" is not llama, qwen2, mixtral, olmoe or qwen2_moe");
  }
  if (o.experts < 0 || o.top_k < 0 || o.expert_hidden < 0 || o.shared_hidden < 0) {
    return bad("experts, top_k, expert_hidden and shared_hidden must be >= 0");
  }
  if (!moe && (o.experts || o.top_k || o.expert_hidden || o.shared_hidden || o.norm_topk)) {
    return bad("experts, top_k, expert_hidden, shared_hidden and norm_topk need arch mixtral, "
               "olmoe or qwen2_moe (not " + o.arch + ")");
  }
  if (o.shared_hidden > 0 && o.arch != "qwen2_moe") return bad("shared_hidden needs arch qwen2_moe");
  if (o.layers <= 0 || o.dim <= 0 || o.heads <= 0 || o.kv_heads < 0 || o.hidden < 0 ||
      o.max_seq_len <= 0) {
    return bad("layers, dim, heads and max_seq_len must be positive; kv_heads and hidden >= 0");
  }
  if (o.vocab < 259) {
    return bad("vocab " + std::to_string(o.vocab) +
               " is below 259 (3 special tokens + 256 byte-fallback pieces)");
  }
  const int kv_heads = o.kv_heads == 0 ? o.heads : o.kv_heads;
  if (o.dim % o.heads != 0) {
    return bad("dim " + std::to_string(o.dim) + " is not a multiple of heads " + std::to_string(o.heads));
  }
  if (o.heads % kv_heads != 0) {
    return bad("heads " + std::to_string(o.heads) + " is not a multiple of kv_heads " +
               std::to_string(kv_heads));
  }
  if ((o.dim / o.heads) % 2 != 0) {
    return bad("head_dim " + std::to_string(o.dim / o.heads) + " must be even for RoPE");
  }
  if (!(o.init_std >= 0.0f) || !std::isfinite(o.init_std)) return bad("init_std must be >= 0");
  if (o.rope_theta < 0.0f || !std::isfinite(o.rope_theta)) return bad("rope_theta must be >= 0");
  ModelConfig c;
  c.arch = o.arch;
  c.dim = o.dim;
  // Llama's SwiGLU width: 2/3 of 4*dim, rounded up so matmul rows stay SIMD-friendly.
  c.hidden_dim = o.hidden > 0 ? o.hidden : static_cast<int>((int64_t{8} * o.dim / 3 + 31) / 32 * 32);
  if (moe) {
    MoeConfig& e = c.moe;
    e.n_experts = o.experts > 0 ? o.experts : 8;
    e.top_k = o.top_k > 0 ? o.top_k : 2;
    if (e.top_k > e.n_experts) {
      return bad("top_k " + std::to_string(e.top_k) + " is more than experts " + std::to_string(e.n_experts));
    }
    if (o.expert_hidden > 0) c.hidden_dim = o.expert_hidden;
    e.expert_hidden = c.hidden_dim;
    e.norm_topk = o.arch == "mixtral" || o.norm_topk;
    if (o.arch == "qwen2_moe") {
      e.shared_hidden = o.shared_hidden > 0 ? o.shared_hidden : 4 * e.expert_hidden;
    }
  }
  c.n_layers = o.layers;
  c.n_heads = o.heads;
  c.n_kv_heads = kv_heads;
  c.vocab_size = o.vocab;
  c.max_seq_len = o.max_seq_len;
  const bool qwen = o.arch == "qwen2" || o.arch == "qwen2_moe";
  c.rope_theta = o.rope_theta > 0 ? o.rope_theta : (qwen || o.arch == "mixtral" ? 1e6f : 1e4f);
  c.rms_eps = qwen ? 1e-6f : 1e-5f;
  c.rope_style = RopeStyle::kHalf;
  c.tied_embeddings = o.tie_embeddings;
  c.qkv_bias = qwen;
  c.qk_norm = o.arch == "olmoe";
  KEEL_RETURN_IF_ERROR(c.Validate());
  if (c.ParameterCount() > int64_t{20'000'000'000}) {
    return bad(std::to_string(c.ParameterCount()) + " parameters exceed the 20e9 limit");
  }
  return c;
}

Status MakeRandomModel(const RandomModelOptions& o) {
  KEEL_ASSIGN_OR_RETURN(ModelConfig c, RandomModelConfig(o));
  if (o.out_dir.empty()) return Status::InvalidArgument("random model: out_dir is empty");
  KEEL_RETURN_IF_ERROR(PrepareModelDir(o.out_dir));
  std::vector<HfTensor> tensors = HfTensors(c, nullptr, c.tied_embeddings);
  // One generator drawn in file order: the bytes depend only on the options, not on chunking.
  NormalSource normal(o.seed);
  const float std_dev = o.init_std;
  auto fill = [&](const HfTensor& t) -> RowFill {
    const int64_t cols = t.shape.back();
    const float mean = t.kind == Kind::kNorm ? 1.0f : 0.0f;
    return [&normal, cols, mean, std_dev](int64_t, int64_t n, float* dst) {
      for (int64_t i = 0; i < n * cols; ++i) dst[i] = mean + std_dev * normal.Next();
    };
  };
  KEEL_RETURN_IF_ERROR(WriteStreaming(o.out_dir + "/model.safetensors", tensors, o.dtype, fill));
  std::vector<std::string> pieces;
  std::vector<float> scores;
  RandomVocab(c.vocab_size, &pieces, &scores);
  KEEL_RETURN_IF_ERROR(Tokenizer::Write(o.out_dir + "/tokenizer.bin", pieces, scores));
  return WriteFileAtomic(o.out_dir + "/config.json", HfConfigJson(c, c.tied_embeddings, o.dtype));
}

std::string DescribeModel(const Model& m) {
  const ModelConfig& c = m.config;
  const bool tied = m.classifier.data == m.embedding.data;
  std::string s;
  s += fmt::format("source:         {}\n", m.source);
  s += fmt::format("format:         {}\n", m.format);
  s += fmt::format("arch:           {}\n", c.arch);
  s += fmt::format("dim:            {}\n", c.dim);
  s += fmt::format("hidden_dim:     {}\n", c.hidden_dim);
  s += fmt::format("n_layers:       {}\n", c.n_layers);
  s += fmt::format("n_heads:        {}\n", c.n_heads);
  s += fmt::format("n_kv_heads:     {}\n", c.n_kv_heads);
  s += fmt::format("head_dim:       {}\n", c.n_heads > 0 ? c.head_dim() : 0);
  s += fmt::format("vocab_size:     {}\n", c.vocab_size);
  s += fmt::format("max_seq_len:    {}\n", c.max_seq_len);
  s += fmt::format("rope_theta:     {}\n", c.rope_theta);
  s += fmt::format("rope_style:     {}\n", c.rope_style == RopeStyle::kInterleaved
                                               ? "interleaved (llama2.c)" : "half (Hugging Face)");
  s += fmt::format("rms_eps:        {}\n", c.rms_eps);
  s += fmt::format("tied_embeddings: {}\n", tied ? "true" : "false");
  s += fmt::format("qkv_bias:       {}\n", c.qkv_bias ? "true" : "false");
  s += fmt::format("qk_norm:        {}\n", c.qk_norm ? "true" : "false");
  if (c.moe.enabled()) {
    s += fmt::format("n_experts:      {}\n", c.moe.n_experts);
    s += fmt::format("top_k:          {}\n", c.moe.top_k);
    s += fmt::format("expert_hidden:  {}\n", c.moe.expert_hidden);
    s += fmt::format("norm_topk:      {}\n", c.moe.norm_topk ? "true" : "false");
    s += c.moe.shared_hidden > 0
             ? fmt::format("shared_expert:  hidden {}, sigmoid-gated\n", c.moe.shared_hidden)
             : std::string("shared_expert:  none\n");
  }
  s += fmt::format("checksum:       {}\n", m.checksum.hex());
  // A half-built Model (no heads, or layers missing) is described without its tensor list
  // rather than dividing by zero or reading past `layers`.
  if (c.n_heads <= 0 || c.n_kv_heads <= 0 || static_cast<int>(m.layers.size()) != c.n_layers) {
    return s + fmt::format("(config and {} layers inconsistent; tensors not listed)\n", m.layers.size());
  }
  std::vector<HfTensor> tensors = HfTensors(c, &m, tied);
  int64_t params = 0;
  std::string list;
  for (const HfTensor& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    params += n;
    std::string shape = t.shape.size() == 2 ? fmt::format("[{}, {}]", t.shape[0], t.shape[1])
                                            : fmt::format("[{}]", t.shape[0]);
    list += fmt::format("  {:<48} {:<5} {}\n", t.name, DTypeName(t.view.dtype), shape);
  }
  s += fmt::format("parameters:     {}\n", params);
  if (c.moe.enabled()) {
    s += fmt::format("active params:  {} per token ({} of {} experts per layer)\n",
                     c.ActiveParameterCount(), c.moe.top_k, c.moe.n_experts);
  }
  s += fmt::format("tensors:        {}\n", tensors.size());
  return s + list;
}

}  // namespace keel::engine
