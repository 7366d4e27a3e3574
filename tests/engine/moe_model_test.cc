// Mixture-of-experts checkpoints (Mixtral, OLMoE, Qwen2-MoE) through LoadSafetensors, make-model,
// convert and inspect: the views bound, the config fields read and written, byte-identical round
// trips, and errors that name the field or tensor at fault. The forward pass is not exercised here.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/core/mapped_file.h"
#include "keel/engine/convert.h"
#include "keel/engine/model.h"
#include "keel/engine/safetensors.h"
#include "tests/engine/test_util.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

#define EXPECT_CONTAINS(haystack, needle)                           \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected \"" << (needle) << "\" in: " << (haystack)

std::string MoeDir() { return test::ModelsDir() + "/en-moe8x"; }

using test::CmdResult;

CmdResult Keel(const std::string& args) { return test::RunKeel(args); }

// The bytes a view covers equal those of the named tensor in `file`.
void ExpectSameBytes(const SafetensorsFile& file, const std::string& name, const TensorView& v) {
  const SafetensorsTensor* t = nullptr;
  for (const auto& x : file.tensors()) {
    if (x.name == name) t = &x;
  }
  ASSERT_NE(t, nullptr) << name;
  ASSERT_EQ(t->size, v.bytes()) << name;
  EXPECT_EQ(t->dtype, v.dtype) << name;
  EXPECT_EQ(std::memcmp(t->data, v.data, t->size), 0) << name;
}

void ExpectShape(const TensorView& v, int64_t rows, int64_t cols, DType dtype, const std::string& what) {
  EXPECT_FALSE(v.empty()) << what;
  EXPECT_EQ(v.rows, rows) << what;
  EXPECT_EQ(v.cols, cols) << what;
  EXPECT_EQ(v.dtype, dtype) << what;
}

// ---- the real checkpoint ----------------------------------------------------------------------

TEST(MoeModelTest, EnMoe8xLoads) {
  if (!fs::exists(test::SharedDir())) GTEST_SKIP() << "no shared data at " << test::SharedDir();
  auto m = LoadSafetensors(MoeDir());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.arch, "mixtral");
  EXPECT_EQ(c.dim, 192);
  EXPECT_EQ(c.n_layers, 6);
  EXPECT_EQ(c.n_heads, 6);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.vocab_size, 354);
  EXPECT_EQ(c.max_seq_len, 256);
  EXPECT_EQ(c.hidden_dim, 192);
  EXPECT_EQ(c.moe.n_experts, 8);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.expert_hidden, 192);
  EXPECT_TRUE(c.moe.norm_topk);
  EXPECT_EQ(c.moe.shared_hidden, 0);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.rms_eps, 1e-5f);
  // data/README.md: 6,045,888 parameters. Active: 6 of the 8 experts' 3 x 192 x 192 per layer skipped.
  EXPECT_EQ(c.ParameterCount(), 6045888);
  EXPECT_EQ(c.ActiveParameterCount(), 6045888 - 6 * 6 * 3 * 192 * 192);

  auto file = SafetensorsFile::Open(MoeDir() + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  ASSERT_EQ(m->layers.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    const LayerWeights& l = m->layers[i];
    const std::string p = "model.layers." + std::to_string(i) + ".block_sparse_moe.";
    EXPECT_TRUE(l.w1.empty() && l.w2.empty() && l.w3.empty()) << "dense FFN views on an MoE layer";
    EXPECT_EQ(l.q_norm, nullptr);
    ExpectShape(l.moe.router, 8, 192, DType::kBF16, p + "gate");
    ASSERT_EQ(l.moe.experts.size(), 8u);
    for (const ExpertWeights& e : l.moe.experts) {
      ExpectShape(e.w1, 192, 192, DType::kBF16, p + "w1");
      ExpectShape(e.w2, 192, 192, DType::kBF16, p + "w2");
      ExpectShape(e.w3, 192, 192, DType::kBF16, p + "w3");
    }
    EXPECT_TRUE(l.moe.shared.w1.empty());
    EXPECT_TRUE(l.moe.shared_gate.empty());
  }
  // The views are the file's bytes, each under its own name (w1 gate, w2 down, w3 up).
  ExpectSameBytes(*file, "model.layers.0.block_sparse_moe.gate.weight", m->layers[0].moe.router);
  ExpectSameBytes(*file, "model.layers.5.block_sparse_moe.experts.7.w2.weight", m->layers[5].moe.experts[7].w2);
  ExpectSameBytes(*file, "model.layers.3.block_sparse_moe.experts.2.w1.weight", m->layers[3].moe.experts[2].w1);
  ExpectSameBytes(*file, "model.layers.3.block_sparse_moe.experts.2.w3.weight", m->layers[3].moe.experts[2].w3);
  // An expert can be found again in its file (what a slow tier re-reads).
  auto where = m->Locate(m->layers[5].moe.experts[7].w2);
  ASSERT_TRUE(where.ok()) << where.status().ToString();
  EXPECT_EQ(where->first->path, MoeDir() + "/model.safetensors");
}

TEST(MoeModelTest, InspectCliListsExperts) {
  if (!fs::exists(test::SharedDir())) GTEST_SKIP() << "no shared data at " << test::SharedDir();
  CmdResult r = Keel("inspect " + MoeDir());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "arch:           mixtral");
  EXPECT_CONTAINS(r.out, "n_experts:      8\n");
  EXPECT_CONTAINS(r.out, "top_k:          2\n");
  EXPECT_CONTAINS(r.out, "expert_hidden:  192\n");
  EXPECT_CONTAINS(r.out, "norm_topk:      true\n");
  EXPECT_CONTAINS(r.out, "shared_expert:  none\n");
  EXPECT_CONTAINS(r.out, "qk_norm:        false\n");
  EXPECT_CONTAINS(r.out, "parameters:     6045888\n");
  EXPECT_CONTAINS(r.out, "active params:  " + std::to_string(6045888 - 6 * 6 * 3 * 192 * 192) + " per token");
  EXPECT_CONTAINS(r.out, "model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_CONTAINS(r.out, "model.layers.5.block_sparse_moe.experts.7.w2.weight");
  EXPECT_CONTAINS(r.out, "tensors:        189\n");  // every tensor in the file, listed once
}

// ---- make-model -> load, for each architecture ------------------------------------------------

RandomModelOptions SmallMoe(const std::string& arch, const std::string& dir) {
  RandomModelOptions o;
  o.arch = arch;
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.vocab = 300;
  o.experts = 4;
  o.top_k = 2;
  o.expert_hidden = 48;
  if (arch == "qwen2_moe") o.shared_hidden = 80;
  o.norm_topk = arch == "olmoe";  // one non-default value, to see it travel
  o.dtype = DType::kBF16;
  o.seed = 7;
  o.out_dir = dir;
  return o;
}

class MoeArchTest : public testing::TestWithParam<std::string> {};

TEST_P(MoeArchTest, MakeModelLoadsBack) {
  const std::string arch = GetParam();
  test::TempDir dir("keel-moe");
  RandomModelOptions o = SmallMoe(arch, dir.path());
  ASSERT_TRUE(MakeRandomModel(o).ok());
  auto m = LoadSafetensors(dir.path());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const ModelConfig& c = m->config;
  const bool mixtral = arch == "mixtral", olmoe = arch == "olmoe", qwen = arch == "qwen2_moe";
  EXPECT_EQ(c.arch, arch);
  EXPECT_EQ(c.moe.n_experts, 4);
  EXPECT_EQ(c.moe.top_k, 2);
  EXPECT_EQ(c.moe.expert_hidden, 48);
  EXPECT_EQ(c.hidden_dim, 48);
  EXPECT_EQ(c.moe.norm_topk, mixtral || olmoe);
  EXPECT_EQ(c.moe.shared_hidden, qwen ? 80 : 0);
  EXPECT_EQ(c.qk_norm, olmoe);
  EXPECT_EQ(c.qkv_bias, qwen);
  auto want_config = RandomModelConfig(o);
  ASSERT_TRUE(want_config.ok());
  EXPECT_EQ(c.ParameterCount(), want_config->ParameterCount());

  // The HF names of each architecture.
  json cfg = json::parse(*ReadFileToString(dir.file("config.json")));
  EXPECT_EQ(cfg["num_experts_per_tok"], 2);
  EXPECT_EQ(cfg.contains("num_local_experts"), mixtral);
  EXPECT_EQ(cfg.contains("num_experts"), !mixtral);
  EXPECT_EQ(cfg.contains("norm_topk_prob"), !mixtral);
  EXPECT_EQ(cfg.contains("moe_intermediate_size"), qwen);
  EXPECT_EQ(cfg["intermediate_size"], qwen ? 80 : 48);
  auto file = SafetensorsFile::Open(dir.file("model.safetensors"));
  ASSERT_TRUE(file.ok());
  int64_t numel = 0;
  std::map<std::string, const SafetensorsTensor*> names;
  for (const auto& t : file->tensors()) {
    numel += t.numel();
    names[t.name] = &t;
  }
  EXPECT_EQ(c.ParameterCount(), numel);
  EXPECT_EQ(c.ActiveParameterCount(), numel - 2 * (4 - 2) * 3 * 48 * 64);
  const std::string block = mixtral ? "model.layers.1.block_sparse_moe." : "model.layers.1.mlp.";
  const std::string down = mixtral ? "w2.weight" : "down_proj.weight";
  ASSERT_TRUE(names.count(block + "experts.3." + down)) << block + "experts.3." + down;
  EXPECT_EQ(names[block + "experts.3." + down]->shape, (std::vector<int64_t>{64, 48}));
  EXPECT_EQ(names[block + "gate.weight"]->shape, (std::vector<int64_t>{4, 64}));
  EXPECT_FALSE(names.count("model.layers.1.mlp.gate_proj.weight")) << "a dense FFN in an MoE model";

  for (const LayerWeights& l : m->layers) {
    EXPECT_TRUE(l.w1.empty());
    ExpectShape(l.moe.router, 4, 64, DType::kBF16, "router");
    ASSERT_EQ(l.moe.experts.size(), 4u);
    for (const ExpertWeights& e : l.moe.experts) {
      ExpectShape(e.w1, 48, 64, DType::kBF16, "w1");
      ExpectShape(e.w2, 64, 48, DType::kBF16, "w2");
      ExpectShape(e.w3, 48, 64, DType::kBF16, "w3");
    }
    EXPECT_EQ(l.q_norm != nullptr, olmoe);
    EXPECT_EQ(l.k_norm != nullptr, olmoe);
    EXPECT_EQ(l.bq != nullptr, qwen);
    if (qwen) {
      ExpectShape(l.moe.shared.w1, 80, 64, DType::kBF16, "shared w1");
      ExpectShape(l.moe.shared.w2, 64, 80, DType::kBF16, "shared w2");
      ExpectShape(l.moe.shared.w3, 80, 64, DType::kBF16, "shared w3");
      ExpectShape(l.moe.shared_gate, 1, 64, DType::kBF16, "shared gate");
    } else {
      EXPECT_TRUE(l.moe.shared.w1.empty());
      EXPECT_TRUE(l.moe.shared_gate.empty());
    }
  }
  ExpectSameBytes(*file, block + "experts.3." + down, m->layers[1].moe.experts[3].w2);
  ExpectSameBytes(*file, block + "gate.weight", m->layers[1].moe.router);
  if (olmoe) {  // k_norm is [kv_dim], and its values are the file's (widened to fp32)
    EXPECT_EQ(names["model.layers.0.self_attn.k_norm.weight"]->shape, (std::vector<int64_t>{32}));
    std::vector<float> k(32);
    ConvertToF32(DType::kBF16, names["model.layers.0.self_attn.k_norm.weight"]->data, k.data(), 32);
    EXPECT_EQ(std::memcmp(k.data(), m->layers[0].k_norm, 32 * sizeof(float)), 0);
  }
  if (qwen) ExpectSameBytes(*file, "model.layers.1.mlp.shared_expert_gate.weight", m->layers[1].moe.shared_gate);

  std::string d = DescribeModel(*m);
  EXPECT_CONTAINS(d, "n_experts:      4\n");
  EXPECT_CONTAINS(d, "expert_hidden:  48\n");
  EXPECT_CONTAINS(d, std::string("qk_norm:        ") + (olmoe ? "true" : "false"));
  EXPECT_CONTAINS(d, std::string("norm_topk:      ") + (mixtral || olmoe ? "true" : "false"));
  EXPECT_CONTAINS(d, qwen ? "shared_expert:  hidden 80" : "shared_expert:  none");
  EXPECT_CONTAINS(d, "parameters:     " + std::to_string(numel) + "\n");
  EXPECT_CONTAINS(d, "active params:  " + std::to_string(c.ActiveParameterCount()));
  EXPECT_CONTAINS(d, block + "experts.3." + down);
  EXPECT_CONTAINS(d, "tensors:        " + std::to_string(names.size()) + "\n");
}

// Loaded MoE model -> ConvertToSafetensors -> load: the same tensors, bytes and config.json.
TEST_P(MoeArchTest, ConvertRoundTripIsIdentical) {
  test::TempDir a("keel-moe"), b("keel-moe"), f32("keel-moe");
  RandomModelOptions o = SmallMoe(GetParam(), a.path());
  ASSERT_TRUE(MakeRandomModel(o).ok());
  auto m1 = LoadSafetensors(a.path());
  ASSERT_TRUE(m1.ok()) << m1.status().ToString();
  ASSERT_TRUE(ConvertToSafetensors(*m1, "", b.path(), DType::kBF16).ok());
  auto m2 = LoadSafetensors(b.path());
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_EQ(m1->checksum, m2->checksum);
  EXPECT_EQ(*ReadFileToString(a.file("config.json")), *ReadFileToString(b.file("config.json")));
  EXPECT_EQ(*ReadFileToString(a.file("model.safetensors")), *ReadFileToString(b.file("model.safetensors")));

  // Widened to F32, every tensor holds the same values under the same name.
  ASSERT_TRUE(ConvertToSafetensors(*m1, "", f32.path(), DType::kF32).ok());
  ASSERT_TRUE(LoadSafetensors(f32.path()).ok());
  auto fa = SafetensorsFile::Open(a.file("model.safetensors"));
  auto ff = SafetensorsFile::Open(f32.file("model.safetensors"));
  ASSERT_TRUE(fa.ok() && ff.ok());
  ASSERT_EQ(fa->tensors().size(), ff->tensors().size());
  std::map<std::string, const SafetensorsTensor*> wide;
  for (const auto& t : ff->tensors()) wide[t.name] = &t;
  for (const auto& t : fa->tensors()) {
    ASSERT_TRUE(wide.count(t.name)) << t.name;
    ASSERT_EQ(wide[t.name]->shape, t.shape) << t.name;
    std::vector<float> v(t.numel());
    ConvertToF32(t.dtype, t.data, v.data(), v.size());
    EXPECT_EQ(std::memcmp(v.data(), wide[t.name]->data, v.size() * 4), 0) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, MoeArchTest, testing::Values("mixtral", "olmoe", "qwen2_moe"),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(MoeModelTest, ConvertRefusesInconsistentModels) {
  test::TempDir a("keel-moe"), out("keel-moe");
  ASSERT_TRUE(MakeRandomModel(SmallMoe("mixtral", a.path())).ok());
  auto m = LoadSafetensors(a.path());
  ASSERT_TRUE(m.ok());
  Model short_list = *m;
  short_list.layers[1].moe.experts.pop_back();
  Status s = ConvertToSafetensors(short_list, "", out.path());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "model.layers.1.block_sparse_moe.experts.3.w1.weight");
  Model llama = *m;
  llama.config.arch = "llama";  // config.json would describe a dense model
  s = ConvertToSafetensors(llama, "", out.path());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "has experts");
  EXPECT_FALSE(fs::exists(out.file("config.json")));
}

// ---- bad input ------------------------------------------------------------------------------

// A pristine generated model; each case corrupts its own copy.
class MoeBadInputTest : public testing::Test {
 protected:
  void Generate(const std::string& arch) { ASSERT_TRUE(MakeRandomModel(SmallMoe(arch, src_.path())).ok()); }

  // Copies the model, applies `corrupt` to the copy, loads it; the error must contain each needle.
  void ExpectError(const std::function<void(const std::string& dir)>& corrupt,
                   const std::vector<std::string>& needles) {
    test::TempDir copy("keel-moe-bad");
    fs::copy(src_.path(), copy.path(), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    corrupt(copy.path());
    auto r = LoadSafetensors(copy.path());
    ASSERT_FALSE(r.ok()) << needles[0];
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    for (const auto& n : needles) EXPECT_CONTAINS(r.status().message(), n);
  }

  void ExpectLoads(const std::function<void(const std::string& dir)>& edit) {
    test::TempDir copy("keel-moe-ok");
    fs::copy(src_.path(), copy.path(), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    edit(copy.path());
    auto r = LoadSafetensors(copy.path());
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }

  static std::function<void(const std::string&)> Config(std::function<void(json&)> edit) {
    return [edit](const std::string& dir) {
      json j = json::parse(*ReadFileToString(dir + "/config.json"));
      edit(j);
      ASSERT_TRUE(WriteFileAtomic(dir + "/config.json", j.dump()).ok());
    };
  }

  // Rewrites model.safetensors without `drop` (when non-empty), plus `extra` (replacing a tensor
  // of the same name).
  static std::function<void(const std::string&)> Weights(std::string drop, TensorSpec extra = {}) {
    return [drop, extra](const std::string& dir) {
      std::vector<char> zeros(extra.name.empty() ? 0 : extra.bytes(), 0);
      std::vector<TensorData> out;
      auto f = SafetensorsFile::Open(dir + "/model.safetensors");
      ASSERT_TRUE(f.ok());
      for (const auto& t : f->tensors()) {
        if (t.name == drop || t.name == extra.name) continue;
        out.push_back({{t.name, t.dtype, t.shape}, {reinterpret_cast<const char*>(t.data), t.size}});
      }
      if (!extra.name.empty()) out.push_back({extra, {zeros.data(), zeros.size()}});
      ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", out).ok());
    };
  }

  test::TempDir src_{"keel-moe-src"};
};

TEST_F(MoeBadInputTest, Mixtral) {
  Generate("mixtral");
  ExpectLoads([](const std::string&) {});
  ExpectError(Config([](json& j) { j["num_experts_per_tok"] = 5; }),
              {"config.json", "num_experts_per_tok 5", "num_local_experts 4"});
  ExpectError(Config([](json& j) { j["num_experts_per_tok"] = 0; }),
              {"config.json", "num_experts_per_tok", "positive"});
  ExpectError(Config([](json& j) { j.erase("num_local_experts"); }), {"missing \"num_local_experts\""});
  ExpectError(Config([](json& j) { j["num_local_experts"] = 2000; }), {"num_local_experts 2000", "1024"});
  // Fewer experts in config.json than in the file: the router's shape disagrees.
  ExpectError(Config([](json& j) { j["num_local_experts"] = 3; }),
              {"model.layers.0.block_sparse_moe.gate.weight", "[4, 64]", "[3, 64]"});
  ExpectError(Weights("model.layers.1.block_sparse_moe.experts.2.w3.weight"),
              {"missing tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight'"});
  ExpectError(Weights("", {"model.layers.0.block_sparse_moe.experts.1.w2.weight", DType::kBF16, {64, 40}}),
              {"model.safetensors", "model.layers.0.block_sparse_moe.experts.1.w2.weight", "[64, 40]", "[64, 48]"});
  ExpectError(Weights("", {"model.layers.1.block_sparse_moe.gate.weight", DType::kBF16, {3, 64}}),
              {"model.layers.1.block_sparse_moe.gate.weight", "[3, 64]", "[4, 64]"});
  // A fifth expert in the file that config.json does not declare.
  ExpectError(Weights("", {"model.layers.0.block_sparse_moe.experts.4.w1.weight", DType::kBF16, {48, 64}}),
              {"unexpected tensor 'model.layers.0.block_sparse_moe.experts.4.w1.weight'"});
  // OLMoE/Qwen2-MoE names in a Mixtral file.
  ExpectError(Config([](json& j) { j["model_type"] = "olmoe"; j["num_experts"] = 4; }),
              {"model.layers.0.self_attn.q_norm.weight"});
  ExpectError(Config([](json& j) { j["sliding_window"] = 16; }), {"sliding_window 16"});
  ExpectLoads(Config([](json& j) { j["sliding_window"] = 4096; }));  // covers the whole context
  ExpectLoads(Config([](json& j) { j["sliding_window"] = nullptr; }));
}

TEST_F(MoeBadInputTest, Olmoe) {
  Generate("olmoe");
  ExpectLoads([](const std::string&) {});
  ExpectError(Config([](json& j) { j["clip_qkv"] = 8.0; }), {"config.json", "clip_qkv"});
  ExpectError(Config([](json& j) { j["num_experts_per_tok"] = 9; }), {"num_experts_per_tok 9", "num_experts 4"});
  ExpectError(Weights("model.layers.1.self_attn.q_norm.weight"),
              {"missing tensor 'model.layers.1.self_attn.q_norm.weight'"});
  ExpectError(Weights("", {"model.layers.0.self_attn.k_norm.weight", DType::kBF16, {64}}),
              {"model.layers.0.self_attn.k_norm.weight", "[64]", "[32]"});
  ExpectError(Weights("model.layers.0.mlp.experts.0.up_proj.weight"),
              {"missing tensor 'model.layers.0.mlp.experts.0.up_proj.weight'"});
}

TEST_F(MoeBadInputTest, Qwen2Moe) {
  Generate("qwen2_moe");
  ExpectLoads([](const std::string&) {});
  ExpectLoads(Config([](json& j) { j["mlp_only_layers"] = nullptr; }));
  ExpectError(Config([](json& j) { j["decoder_sparse_step"] = 2; }), {"config.json", "decoder_sparse_step 2"});
  ExpectError(Config([](json& j) { j["mlp_only_layers"] = json::array({1}); }), {"mlp_only_layers [1]"});
  ExpectError(Config([](json& j) { j.erase("shared_expert_intermediate_size"); }),
              {"missing \"shared_expert_intermediate_size\""});
  ExpectError(Config([](json& j) { j["moe_intermediate_size"] = 40; }),
              {"model.layers.0.mlp.experts.0.gate_proj.weight", "[48, 64]", "[40, 64]"});
  ExpectError(Weights("model.layers.1.mlp.shared_expert_gate.weight"),
              {"missing tensor 'model.layers.1.mlp.shared_expert_gate.weight'"});
  ExpectError(Weights("", {"model.layers.0.mlp.shared_expert.down_proj.weight", DType::kBF16, {64, 48}}),
              {"model.layers.0.mlp.shared_expert.down_proj.weight", "[64, 48]", "[64, 80]"});
}

// ---- options and config checks ----------------------------------------------------------------

TEST(MoeModelTest, RandomModelRejectsBadMoeOptions) {
  test::TempDir dir("keel-moe");
  auto expect_bad = [&](RandomModelOptions o, const std::string& needle) {
    o.out_dir = dir.path();
    Status s = MakeRandomModel(o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << needle << ": " << s.ToString();
    EXPECT_CONTAINS(s.message(), needle);
  };
  RandomModelOptions o = SmallMoe("mixtral", "");
  o.top_k = 5;
  expect_bad(o, "top_k 5 is more than experts 4");
  o = SmallMoe("mixtral", "");
  o.experts = 2000;
  expect_bad(o, "n_experts 2000 is beyond 1024");
  o = SmallMoe("mixtral", "");
  o.shared_hidden = 32;
  expect_bad(o, "shared_hidden needs arch qwen2_moe");
  o = SmallMoe("olmoe", "");
  o.experts = -1;
  expect_bad(o, ">= 0");
  o = {};
  o.arch = "llama";
  o.experts = 4;
  expect_bad(o, "need arch mixtral, olmoe or qwen2_moe");
  EXPECT_TRUE(fs::is_empty(dir.path()));

  // Defaults: 8 experts, top 2, experts as wide as --hidden, a 4x shared expert for qwen2_moe.
  o = {};
  o.arch = "qwen2_moe";
  auto c = RandomModelConfig(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->moe.n_experts, 8);
  EXPECT_EQ(c->moe.top_k, 2);
  EXPECT_EQ(c->moe.expert_hidden, c->hidden_dim);
  EXPECT_EQ(c->moe.shared_hidden, 4 * c->hidden_dim);
}

TEST(MoeModelTest, ValidateChecksExperts) {
  ModelConfig c;
  c.arch = "mixtral";
  c.dim = 64;
  c.hidden_dim = 48;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 300;
  c.max_seq_len = 128;
  ModelConfig dense = c;
  ASSERT_TRUE(dense.Validate().ok());
  EXPECT_EQ(dense.ActiveParameterCount(), dense.ParameterCount());
  c.moe = MoeConfig{4, 2, 48, true, 0};
  ASSERT_TRUE(c.Validate().ok());
  EXPECT_EQ(c.ParameterCount() - c.ActiveParameterCount(), 2 * 2 * 3 * 48 * 64);
  EXPECT_EQ(c.ParameterCount() - dense.ParameterCount(), 2 * (4 * 64 + 3 * 3 * 48 * 64));

  auto expect_bad = [](ModelConfig x, const std::string& needle) {
    Status s = x.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << needle;
    EXPECT_CONTAINS(s.message(), needle);
  };
  ModelConfig x = c;
  x.moe.top_k = 0;
  expect_bad(x, "top_k 0");
  x = c;
  x.moe.top_k = 5;
  expect_bad(x, "top_k 5");
  x = c;
  x.moe.n_experts = 64;
  x.moe.top_k = 33;  // routing keeps a token's choices on the stack
  expect_bad(x, "top_k 33 is above the supported 32");
  x = c;
  x.moe.expert_hidden = 0;
  expect_bad(x, "expert_hidden 0");
  x = c;
  x.moe.n_experts = 1025;
  expect_bad(x, "1024");
  x = c;
  x.moe.n_experts = 1024;
  x.moe.expert_hidden = x.hidden_dim = 1 << 13;
  expect_bad(x, "2^22");
  x = c;
  x.hidden_dim = 64;
  expect_bad(x, "hidden_dim 64 != expert_hidden 48");
  x = dense;
  x.moe.top_k = 2;
  expect_bad(x, "a dense model has none");
}

TEST(MoeModelTest, MakeModelCliWritesMoeOptions) {
  test::TempDir dir("keel-moe");
  const std::string out = dir.file("q");
  CmdResult r = Keel("make-model --arch qwen2_moe --layers 1 --dim 64 --heads 4 --vocab 300 --experts 6 "
                     "--top-k 3 --expert-hidden 32 --shared-hidden 96 --norm-topk --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "active per token");
  auto m = LoadSafetensors(out);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->config.arch, "qwen2_moe");
  EXPECT_EQ(m->config.moe.n_experts, 6);
  EXPECT_EQ(m->config.moe.top_k, 3);
  EXPECT_EQ(m->config.moe.expert_hidden, 32);
  EXPECT_EQ(m->config.moe.shared_hidden, 96);
  EXPECT_TRUE(m->config.moe.norm_topk);
  CmdResult bad = Keel("make-model --arch llama --experts 4 --out " + dir.file("l"));
  EXPECT_NE(bad.code, 0);
  EXPECT_CONTAINS(bad.out, "need arch mixtral");
}

}  // namespace
}  // namespace keel::engine
