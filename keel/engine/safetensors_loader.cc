// LoadSafetensors: a Hugging Face Llama, Qwen2, Mixtral, OLMoE or Qwen2-MoE directory (config.json
// + model.safetensors or index-listed shards) as a Model. Matrices (experts and routers included)
// stay in the memory maps; norms and biases are widened to fp32 copies the Model owns, because the
// forward pass reads them as plain floats.
#include <climits>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "keel/core/hash.h"
#include "keel/core/json_reader.h"
#include "keel/core/mapped_file.h"
#include "keel/engine/model.h"
#include "keel/engine/safetensors.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// config.json and the shard index come from whoever made the model: nesting and value count are
// bounded before parsing (error messages dump() values, which recurses once per level).
// config.json and the shard index are a few KB to a few MB; anything far beyond is not one.
constexpr uintmax_t kMaxJsonFileBytes = uintmax_t{64} << 20;

Result<json> ReadJson(const std::string& path) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size > kMaxJsonFileBytes) {
    return Status::Corruption(path + ": " + std::to_string(size) + " bytes is beyond the " +
                              std::to_string(kMaxJsonFileBytes) + "-byte limit for a model's JSON file");
  }
  KEEL_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  Result<json> j = ParseUntrustedJson(text, JsonLimits{});
  if (!j.ok()) return Status::Corruption(path + ": " + j.status().message());
  return j;
}

// Reads config fields with HF defaults, naming the file and field in every error.
class ConfigReader {
 public:
  ConfigReader(const std::string& path, const json& j) : path_(path), j_(j) {}

  Status Int(const char* key, int* out, int fallback = -1) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) {
      if (fallback >= 0) {
        *out = fallback;
        return Status::Ok();
      }
      return Status::InvalidArgument(path_ + ": missing \"" + key + "\"");
    }
    if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > INT_MAX) {
      return Status::InvalidArgument(path_ + ": \"" + key + "\" must be a positive integer, got " +
                                     it->dump());
    }
    *out = static_cast<int>(it->get<int64_t>());
    return Status::Ok();
  }

  Status Float(const char* key, float* out, float fallback) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) {
      *out = fallback;
      return Status::Ok();
    }
    if (!it->is_number() || it->get<double>() <= 0) {
      return Status::InvalidArgument(path_ + ": \"" + key + "\" must be a positive number, got " +
                                     it->dump());
    }
    *out = static_cast<float>(it->get<double>());
    return Status::Ok();
  }

  Status Bool(const char* key, bool* out, bool fallback) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) {
      *out = fallback;
      return Status::Ok();
    }
    if (!it->is_boolean()) {
      return Status::InvalidArgument(path_ + ": \"" + key + "\" must be true or false");
    }
    *out = it->get<bool>();
    return Status::Ok();
  }

  std::string String(const char* key) const {
    auto it = j_.find(key);
    return it != j_.end() && it->is_string() ? it->get<std::string>() : std::string();
  }

  bool Present(const char* key) const {
    auto it = j_.find(key);
    return it != j_.end() && !it->is_null();
  }

 private:
  const std::string& path_;
  const json& j_;
};

bool IsMoeArch(const std::string& arch) {
  return arch == "mixtral" || arch == "olmoe" || arch == "qwen2_moe";
}

Status ParseArch(const std::string& path, const json& j, std::string* arch) {
  // model_type and the transformers class that `architectures` names for it.
  static const std::pair<const char*, const char*> kArchs[] = {
      {"llama", "LlamaForCausalLM"},     {"qwen2", "Qwen2ForCausalLM"},
      {"mixtral", "MixtralForCausalLM"}, {"olmoe", "OlmoeForCausalLM"},
      {"qwen2_moe", "Qwen2MoeForCausalLM"}};
  ConfigReader r(path, j);
  std::string type = r.String("model_type");
  if (type.empty() && j.contains("architectures") && j["architectures"].is_array() &&
      !j["architectures"].empty() && j["architectures"][0].is_string()) {
    std::string a = j["architectures"][0].get<std::string>();
    for (const auto& [t, cls] : kArchs) {
      if (a == cls) type = t;
    }
  }
  for (const auto& [t, cls] : kArchs) {
    if (type == t) {
      *arch = type;
      return Status::Ok();
    }
  }
  return Status::InvalidArgument(path + ": model_type \"" + type +
                                 "\" is not supported (Keel loads llama, qwen2, mixtral, olmoe "
                                 "and qwen2_moe)");
}

// The expert block's fields, which each MoE architecture names differently. Sets hidden_dim to
// the expert width. Needs max_seq_len already read (Mixtral's sliding window is checked against it).
Status ParseMoe(const std::string& path, const json& j, ModelConfig* c) {
  ConfigReader r(path, j);
  MoeConfig& e = c->moe;
  const bool mixtral = c->arch == "mixtral", qwen = c->arch == "qwen2_moe";
  const char* experts_key = mixtral ? "num_local_experts" : "num_experts";
  const char* width_key = qwen ? "moe_intermediate_size" : "intermediate_size";
  KEEL_RETURN_IF_ERROR(r.Int(experts_key, &e.n_experts));
  KEEL_RETURN_IF_ERROR(r.Int("num_experts_per_tok", &e.top_k));
  KEEL_RETURN_IF_ERROR(r.Int(width_key, &e.expert_hidden));
  if (e.top_k > e.n_experts) {
    return Status::InvalidArgument(path + ": num_experts_per_tok " + std::to_string(e.top_k) +
                                   " is more than " + experts_key + " " + std::to_string(e.n_experts));
  }
  if (e.n_experts > 1024) {
    return Status::InvalidArgument(path + ": " + experts_key + " " + std::to_string(e.n_experts) +
                                   " is beyond the supported 1024");
  }
  c->hidden_dim = e.expert_hidden;
  if (mixtral) {
    e.norm_topk = true;  // Mixtral always renormalises its top-k weights; it has no such field
    // HF Mixtral applies sliding_window whenever it is set; one that covers the whole context
    // changes nothing.
    if (r.Present("sliding_window")) {
      int window = 0;
      KEEL_RETURN_IF_ERROR(r.Int("sliding_window", &window));
      if (window < c->max_seq_len) {
        return Status::InvalidArgument(path + ": sliding_window " + std::to_string(window) +
                                       " < max_position_embeddings " +
                                       std::to_string(c->max_seq_len) + " is not supported");
      }
    }
    return Status::Ok();
  }
  KEEL_RETURN_IF_ERROR(r.Bool("norm_topk_prob", &e.norm_topk, false));
  if (c->arch == "olmoe") {
    if (r.Present("clip_qkv")) {
      return Status::InvalidArgument(path + ": clip_qkv " + j["clip_qkv"].dump() + " is not supported");
    }
    c->qk_norm = true;
    return Status::Ok();
  }
  // Qwen2-MoE: every layer sparse, each with one gated shared expert.
  KEEL_RETURN_IF_ERROR(r.Int("shared_expert_intermediate_size", &e.shared_hidden));
  int step = 1;
  KEEL_RETURN_IF_ERROR(r.Int("decoder_sparse_step", &step, 1));
  if (step != 1) {
    return Status::InvalidArgument(path + ": decoder_sparse_step " + std::to_string(step) +
                                   " is not supported (dense layers between MoE layers; only 1)");
  }
  if (r.Present("mlp_only_layers") && (!j["mlp_only_layers"].is_array() || !j["mlp_only_layers"].empty())) {
    return Status::InvalidArgument(path + ": mlp_only_layers " + j["mlp_only_layers"].dump() +
                                   " is not supported (dense layers among MoE layers; only [])");
  }
  return Status::Ok();
}

// Features the forward pass does not implement are refused here rather than silently giving
// different numbers from the reference implementation.
Status RejectUnsupported(const std::string& path, const ConfigReader& r) {
  std::string act = r.String("hidden_act");
  if (!act.empty() && act != "silu") {
    return Status::InvalidArgument(path + ": hidden_act \"" + act + "\" is not supported (silu)");
  }
  if (r.Present("rope_scaling")) {
    return Status::InvalidArgument(path + ": rope_scaling is not supported");
  }
  bool sliding = false;
  KEEL_RETURN_IF_ERROR(r.Bool("use_sliding_window", &sliding, false));
  if (sliding) return Status::InvalidArgument(path + ": use_sliding_window is not supported");
  bool attention_bias = false;
  KEEL_RETURN_IF_ERROR(r.Bool("attention_bias", &attention_bias, false));
  if (attention_bias) return Status::InvalidArgument(path + ": attention_bias is not supported");
  return Status::Ok();
}

Result<ModelConfig> ParseConfig(const std::string& path, const json& j) {
  if (!j.is_object()) return Status::InvalidArgument(path + ": not a JSON object");
  ModelConfig c;
  KEEL_RETURN_IF_ERROR(ParseArch(path, j, &c.arch));
  ConfigReader r(path, j);
  KEEL_RETURN_IF_ERROR(RejectUnsupported(path, r));
  const bool moe = IsMoeArch(c.arch);
  KEEL_RETURN_IF_ERROR(r.Int("hidden_size", &c.dim));
  if (!moe) KEEL_RETURN_IF_ERROR(r.Int("intermediate_size", &c.hidden_dim));
  KEEL_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.n_layers));
  KEEL_RETURN_IF_ERROR(r.Int("num_attention_heads", &c.n_heads));
  KEEL_RETURN_IF_ERROR(r.Int("num_key_value_heads", &c.n_kv_heads, c.n_heads));
  KEEL_RETURN_IF_ERROR(r.Int("vocab_size", &c.vocab_size));
  KEEL_RETURN_IF_ERROR(r.Int("max_position_embeddings", &c.max_seq_len, 2048));
  // Fallbacks are transformers' defaults for each architecture.
  const bool eps5 = c.arch == "mixtral" || c.arch == "olmoe";
  KEEL_RETURN_IF_ERROR(r.Float("rms_norm_eps", &c.rms_eps, eps5 ? 1e-5f : 1e-6f));
  KEEL_RETURN_IF_ERROR(r.Float("rope_theta", &c.rope_theta, c.arch == "mixtral" ? 1e6f : 10000.0f));
  KEEL_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c.tied_embeddings, false));
  if (moe) KEEL_RETURN_IF_ERROR(ParseMoe(path, j, &c));
  if (c.dim % c.n_heads != 0) {
    return Status::InvalidArgument(path + ": hidden_size " + std::to_string(c.dim) +
                                   " is not a multiple of num_attention_heads " +
                                   std::to_string(c.n_heads));
  }
  int head_dim = 0;
  if (r.Present("head_dim")) {
    KEEL_RETURN_IF_ERROR(r.Int("head_dim", &head_dim));
    if (head_dim != c.dim / c.n_heads) {
      return Status::InvalidArgument(path + ": head_dim " + std::to_string(head_dim) +
                                     " != hidden_size / num_attention_heads is not supported");
    }
  }
  c.rope_style = RopeStyle::kHalf;
  Status v = c.Validate();
  if (!v.ok()) return Status::InvalidArgument(path + ": " + v.message());
  return c;
}

// The weight files of `dir`: the shards named by the index, or model.safetensors.
Result<std::vector<std::string>> WeightFiles(const std::string& dir, json* weight_map) {
  std::string index = dir + "/model.safetensors.index.json";
  if (!fs::exists(index)) {
    std::string single = dir + "/model.safetensors";
    if (!fs::exists(single)) {
      return Status::NotFound(dir + ": neither model.safetensors nor model.safetensors.index.json");
    }
    return std::vector<std::string>{single};
  }
  KEEL_ASSIGN_OR_RETURN(json j, ReadJson(index));
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return Status::Corruption(index + ": no \"weight_map\" object");
  }
  std::set<std::string> files;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it->is_string()) return Status::Corruption(index + ": weight_map['" + it.key() + "'] is not a string");
    std::string f = it->get<std::string>();
    // Shards live next to the index; anything else could read files outside the model.
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
      return Status::Corruption(index + ": weight_map['" + it.key() + "'] names \"" + f +
                                "\", not a file in the model directory");
    }
    files.insert(f);
  }
  if (files.empty()) return Status::Corruption(index + ": weight_map is empty");
  *weight_map = j["weight_map"];
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(dir + "/" + f);
  return out;
}

// Binds HF tensor names to Model fields, checking each shape against the config.
class Binder {
 public:
  Binder(Model* m, std::map<std::string, std::pair<const SafetensorsTensor*, std::string>> tensors)
      : m_(m), tensors_(std::move(tensors)) {}

  bool Has(const std::string& name) const { return tensors_.count(name) > 0; }

  Status Matrix(const std::string& name, int64_t rows, int64_t cols, TensorView* out) {
    KEEL_ASSIGN_OR_RETURN(const SafetensorsTensor* t, Get(name, {rows, cols}));
    *out = TensorView{t->data, t->dtype, rows, cols};
    return Status::Ok();
  }

  Status Vector(const std::string& name, int64_t n, const float** out) {
    KEEL_ASSIGN_OR_RETURN(const SafetensorsTensor* t, Get(name, {n}));
    *out = m_->OwnF32(TensorView{t->data, t->dtype, 1, n});
    return Status::Ok();
  }

  void MarkUsed(const std::string& name) { used_.insert(name); }

  // Every tensor must have a place in the model: a stray one means an architecture variant
  // (o_proj bias, q/k norms, MoE) that would otherwise be silently ignored.
  Status CheckAllUsed() const {
    for (const auto& [name, t] : tensors_) {
      if (used_.count(name)) continue;
      if (name.size() > 24 && name.ends_with(".rotary_emb.inv_freq")) continue;  // derived data
      return Status::InvalidArgument(t.second + ": unexpected tensor '" + name +
                                     "' (not part of a " + m_->config.arch + " model)");
    }
    return Status::Ok();
  }

  // XXH3-128 over every tensor's bytes in sorted-name order, across all shards, so the
  // checksum does not depend on how the weights are split into files.
  Hash128 Checksum() const {
    Hasher128 h;
    for (const auto& [name, t] : tensors_) h.update(t.first->data, t.first->size);
    return h.digest();
  }

 private:
  Result<const SafetensorsTensor*> Get(const std::string& name, std::vector<int64_t> shape) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      return Status::InvalidArgument(m_->source + ": missing tensor '" + name + "'");
    }
    const SafetensorsTensor* t = it->second.first;
    if (t->shape != shape) {
      auto str = [](const std::vector<int64_t>& s) {
        std::string r = "[";
        for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
        return r + "]";
      };
      return Status::InvalidArgument(it->second.second + ": tensor '" + name + "' has shape " +
                                     str(t->shape) + " but config.json implies " + str(shape));
    }
    used_.insert(name);
    return t;
  }

  Model* m_;
  std::map<std::string, std::pair<const SafetensorsTensor*, std::string>> tensors_;
  std::set<std::string> used_;
};

// One SwiGLU block: `names` are the gate, down and up projections' tensor names after `prefix`.
Status BindExpert(Binder& b, const std::string& prefix, const char* const (&names)[3], int64_t dim,
                  int64_t hidden, ExpertWeights* e) {
  KEEL_RETURN_IF_ERROR(b.Matrix(prefix + names[0], hidden, dim, &e->w1));
  KEEL_RETURN_IF_ERROR(b.Matrix(prefix + names[1], dim, hidden, &e->w2));
  return b.Matrix(prefix + names[2], hidden, dim, &e->w3);
}

// Mixtral: block_sparse_moe.{gate, experts.E.w1/w2/w3}; OLMoE and Qwen2-MoE: mlp.{gate,
// experts.E.gate_proj/down_proj/up_proj} (Qwen2-MoE adds mlp.shared_expert{,_gate}).
Status BindMoe(Binder& b, const ModelConfig& c, const std::string& p, MoeWeights* w) {
  static const char* const kMixtral[3] = {"w1.weight", "w2.weight", "w3.weight"};
  static const char* const kHf[3] = {"gate_proj.weight", "down_proj.weight", "up_proj.weight"};
  const bool mixtral = c.arch == "mixtral";
  const std::string block = p + (mixtral ? "block_sparse_moe." : "mlp.");
  const MoeConfig& e = c.moe;
  KEEL_RETURN_IF_ERROR(b.Matrix(block + "gate.weight", e.n_experts, c.dim, &w->router));
  w->experts.resize(e.n_experts);
  for (int x = 0; x < e.n_experts; ++x) {
    KEEL_RETURN_IF_ERROR(BindExpert(b, block + "experts." + std::to_string(x) + ".",
                                    mixtral ? kMixtral : kHf, c.dim, e.expert_hidden, &w->experts[x]));
  }
  if (e.shared_hidden > 0) {
    KEEL_RETURN_IF_ERROR(BindExpert(b, block + "shared_expert.", kHf, c.dim, e.shared_hidden, &w->shared));
    KEEL_RETURN_IF_ERROR(b.Matrix(block + "shared_expert_gate.weight", 1, c.dim, &w->shared_gate));
  }
  return Status::Ok();
}

Status BindLayer(Binder& b, const ModelConfig& c, int i, LayerWeights* l) {
  const std::string p = "model.layers." + std::to_string(i) + ".";
  const int64_t dim = c.dim, kv = c.kv_dim(), hidden = c.hidden_dim;
  KEEL_RETURN_IF_ERROR(b.Vector(p + "input_layernorm.weight", dim, &l->attn_norm));
  KEEL_RETURN_IF_ERROR(b.Matrix(p + "self_attn.q_proj.weight", dim, dim, &l->wq));
  KEEL_RETURN_IF_ERROR(b.Matrix(p + "self_attn.k_proj.weight", kv, dim, &l->wk));
  KEEL_RETURN_IF_ERROR(b.Matrix(p + "self_attn.v_proj.weight", kv, dim, &l->wv));
  KEEL_RETURN_IF_ERROR(b.Matrix(p + "self_attn.o_proj.weight", dim, dim, &l->wo));
  if (c.qkv_bias) {
    KEEL_RETURN_IF_ERROR(b.Vector(p + "self_attn.q_proj.bias", dim, &l->bq));
    KEEL_RETURN_IF_ERROR(b.Vector(p + "self_attn.k_proj.bias", kv, &l->bk));
    KEEL_RETURN_IF_ERROR(b.Vector(p + "self_attn.v_proj.bias", kv, &l->bv));
  }
  if (c.qk_norm) {
    KEEL_RETURN_IF_ERROR(b.Vector(p + "self_attn.q_norm.weight", dim, &l->q_norm));
    KEEL_RETURN_IF_ERROR(b.Vector(p + "self_attn.k_norm.weight", kv, &l->k_norm));
  }
  KEEL_RETURN_IF_ERROR(b.Vector(p + "post_attention_layernorm.weight", dim, &l->ffn_norm));
  if (c.moe.enabled()) return BindMoe(b, c, p, &l->moe);
  KEEL_RETURN_IF_ERROR(b.Matrix(p + "mlp.gate_proj.weight", hidden, dim, &l->w1));
  KEEL_RETURN_IF_ERROR(b.Matrix(p + "mlp.down_proj.weight", dim, hidden, &l->w2));
  KEEL_RETURN_IF_ERROR(b.Matrix(p + "mlp.up_proj.weight", hidden, dim, &l->w3));
  return Status::Ok();
}

}  // namespace

Result<Model> LoadSafetensors(const std::string& dir) {
  Model m;
  m.source = dir;
  m.format = "safetensors";
  const std::string config_path = dir + "/config.json";
  KEEL_ASSIGN_OR_RETURN(json config_json, ReadJson(config_path));
  KEEL_ASSIGN_OR_RETURN(m.config, ParseConfig(config_path, config_json));

  json weight_map;
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> paths, WeightFiles(dir, &weight_map));
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::pair<const SafetensorsTensor*, std::string>> tensors;
  files.reserve(paths.size());  // tensors point into files' vectors: no reallocation
  for (const std::string& path : paths) {
    KEEL_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(path));
    files.push_back(std::move(f));
  }
  for (const SafetensorsFile& f : files) {
    m.storage.push_back(f.file());
    m.weight_files.push_back(WeightFile{f.path(), f.file()->data(), f.file()->size()});
    for (const SafetensorsTensor& t : f.tensors()) {
      if (!tensors.emplace(t.name, std::make_pair(&t, f.path())).second) {
        return Status::Corruption(f.path() + ": tensor '" + t.name + "' at byte offset " +
                                  std::to_string(t.offset) + " also appears in " +
                                  tensors[t.name].second);
      }
    }
  }
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    auto t = tensors.find(it.key());
    std::string want = dir + "/" + it->get<std::string>();
    if (t == tensors.end() || t->second.second != want) {
      return Status::Corruption(dir + "/model.safetensors.index.json: tensor '" + it.key() +
                                "' is not in " + want);
    }
  }

  ModelConfig& c = m.config;
  c.qkv_bias = (c.arch == "qwen2" || c.arch == "qwen2_moe") &&
               tensors.count("model.layers.0.self_attn.q_proj.bias") > 0;
  Binder b(&m, std::move(tensors));
  KEEL_RETURN_IF_ERROR(b.Matrix("model.embed_tokens.weight", c.vocab_size, c.dim, &m.embedding));
  m.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) KEEL_RETURN_IF_ERROR(BindLayer(b, c, i, &m.layers[i]));
  KEEL_RETURN_IF_ERROR(b.Vector("model.norm.weight", c.dim, &m.final_norm));
  if (c.tied_embeddings) {
    // HF ignores a stored lm_head when the embeddings are tied; so does Keel.
    m.classifier = m.embedding;
    b.MarkUsed("lm_head.weight");
  } else {
    KEEL_RETURN_IF_ERROR(b.Matrix("lm_head.weight", c.vocab_size, c.dim, &m.classifier));
  }
  KEEL_RETURN_IF_ERROR(b.CheckAllUsed());
  m.checksum = b.Checksum();
  return m;
}

}  // namespace keel::engine
