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
// `tied` drops lm_head.
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
    vec(p + "post_attention_layernorm.weight", Kind::kNorm, d, l ? l->ffn_norm : nullptr, 0);
    mat(p + "mlp.gate_proj.weight", h, d, l ? &l->w1 : nullptr, 0);
    mat(p + "mlp.up_proj.weight", h, d, l ? &l->w3 : nullptr, 0);
    mat(p + "mlp.down_proj.weight", d, h, l ? &l->w2 : nullptr, 0);
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

void NarrowF32(DType t, const float* src, uint8_t* dst, size_t n) {
  if (t == DType::kF32) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) out[i] = t == DType::kF16 ? F32ToF16(src[i]) : F32ToBf16(src[i]);
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
      NarrowF32(dtype, f32.data(), bytes.data(), count);
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

std::string TorchDType(DType t) {
  return t == DType::kF32 ? "float32" : t == DType::kF16 ? "float16" : "bfloat16";
}

std::string HfConfigJson(const ModelConfig& c, bool tied, DType dtype) {
  const bool qwen = c.arch == "qwen2";
  json j = {{"architectures", json::array({qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"})},
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
  return j.dump(2) + "\n";
}

Status EnsureDir(const std::string& dir) {
  if (dir.empty()) return Status::InvalidArgument("output directory is empty");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    return Status::IOError(dir + ": cannot create directory: " + ec.message());
  }
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
  const bool tied = model.classifier.data == model.embedding.data;
  std::vector<HfTensor> tensors = HfTensors(c, &model, tied);
  KEEL_RETURN_IF_ERROR(CheckModelViews(model, tensors));
  KEEL_RETURN_IF_ERROR(EnsureDir(out_dir));

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
    if (t.kind == Kind::kBias) {  // a permuted vector: the permutation applies to elements
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
  if (o.arch != "llama" && o.arch != "qwen2") return bad("arch \"" + o.arch + "\" is not llama or qwen2");
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
  c.n_layers = o.layers;
  c.n_heads = o.heads;
  c.n_kv_heads = kv_heads;
  c.vocab_size = o.vocab;
  c.max_seq_len = o.max_seq_len;
  const bool qwen = o.arch == "qwen2";
  c.rope_theta = o.rope_theta > 0 ? o.rope_theta : (qwen ? 1e6f : 1e4f);
  c.rms_eps = qwen ? 1e-6f : 1e-5f;
  c.rope_style = RopeStyle::kHalf;
  c.tied_embeddings = o.tie_embeddings;
  c.qkv_bias = qwen;
  KEEL_RETURN_IF_ERROR(c.Validate());
  if (c.ParameterCount() > int64_t{20'000'000'000}) {
    return bad(std::to_string(c.ParameterCount()) + " parameters exceed the 20e9 limit");
  }
  return c;
}

Status MakeRandomModel(const RandomModelOptions& o) {
  KEEL_ASSIGN_OR_RETURN(ModelConfig c, RandomModelConfig(o));
  if (o.out_dir.empty()) return Status::InvalidArgument("random model: out_dir is empty");
  KEEL_RETURN_IF_ERROR(EnsureDir(o.out_dir));
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
  s += fmt::format("tensors:        {}\n", tensors.size());
  return s + list;
}

}  // namespace keel::engine
