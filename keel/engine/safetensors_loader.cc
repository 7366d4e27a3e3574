// LoadSafetensors: a Hugging Face Llama or Qwen2 directory (config.json + model.safetensors or
// index-listed shards) as a Model. Matrices stay in the memory maps; norms and biases are widened
// to fp32 copies the Model owns, because the forward pass reads them as plain floats.
#include <climits>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "keel/core/hash.h"
#include "keel/core/mapped_file.h"
#include "keel/engine/model.h"
#include "keel/engine/safetensors.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

Result<json> ReadJson(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    return Status::Corruption(path + ": malformed JSON at byte offset " +
                              std::to_string(e.byte > 0 ? e.byte - 1 : 0) + ": " + e.what());
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": malformed JSON: " + e.what());
  }
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

Status ParseArch(const std::string& path, const json& j, std::string* arch) {
  ConfigReader r(path, j);
  std::string type = r.String("model_type");
  if (type.empty() && j.contains("architectures") && j["architectures"].is_array() &&
      !j["architectures"].empty() && j["architectures"][0].is_string()) {
    std::string a = j["architectures"][0].get<std::string>();
    if (a == "LlamaForCausalLM") type = "llama";
    if (a == "Qwen2ForCausalLM") type = "qwen2";
  }
  if (type != "llama" && type != "qwen2") {
    return Status::InvalidArgument(path + ": model_type \"" + type +
                                   "\" is not supported (Keel loads llama and qwen2)");
  }
  *arch = type;
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
  KEEL_RETURN_IF_ERROR(r.Int("hidden_size", &c.dim));
  KEEL_RETURN_IF_ERROR(r.Int("intermediate_size", &c.hidden_dim));
  KEEL_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.n_layers));
  KEEL_RETURN_IF_ERROR(r.Int("num_attention_heads", &c.n_heads));
  KEEL_RETURN_IF_ERROR(r.Int("num_key_value_heads", &c.n_kv_heads, c.n_heads));
  KEEL_RETURN_IF_ERROR(r.Int("vocab_size", &c.vocab_size));
  KEEL_RETURN_IF_ERROR(r.Int("max_position_embeddings", &c.max_seq_len, 2048));
  KEEL_RETURN_IF_ERROR(r.Float("rms_norm_eps", &c.rms_eps, 1e-6f));
  KEEL_RETURN_IF_ERROR(r.Float("rope_theta", &c.rope_theta, 10000.0f));
  KEEL_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c.tied_embeddings, false));
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
  KEEL_RETURN_IF_ERROR(b.Vector(p + "post_attention_layernorm.weight", dim, &l->ffn_norm));
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
  c.qkv_bias = c.arch == "qwen2" && tensors.count("model.layers.0.self_attn.q_proj.bias") > 0;
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
