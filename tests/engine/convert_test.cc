// Conversion and the safetensors loader, checked end to end through the forward pass:
// llama2.c -> safetensors must give identical logits (F32), random Llama/Qwen2 models must match
// a plain-loop reference implementation written here, and bad inputs must give clear errors.
#include "keel/engine/convert.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "keel/core/mapped_file.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/safetensors.h"
#include "keel/engine/tokenizer.h"
#include "keel/engine/transformer.h"
#include "tests/engine/test_util.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;

#define EXPECT_CONTAINS(haystack, needle)                           \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "expected \"" << (needle) << "\" in: " << (haystack)

// Logits for every position of `tokens`, run as one prefill batch through a fresh raw cache.
Status RunLogits(const Model& m, const std::vector<int>& tokens, std::vector<float>* logits) {
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(m, "raw", KvCacheOptions{}));
  KEEL_ASSIGN_OR_RETURN(int cached, cache->BeginSequence(1, tokens));
  if (cached != 0) return Status::Internal("fresh cache reported a prefix hit");
  const int n = static_cast<int>(tokens.size());
  KEEL_RETURN_IF_ERROR(cache->Reserve(1, n));
  std::vector<BatchToken> batch;
  for (int i = 0; i < n; ++i) batch.push_back({1, tokens[i], i, true});
  Transformer t(m);
  KEEL_RETURN_IF_ERROR(t.Forward(batch, *cache, *logits));
  cache->Commit(1, tokens.data(), n);
  if (logits->size() != static_cast<size_t>(n) * m.config.vocab_size) {
    return Status::Internal("Forward returned " + std::to_string(logits->size()) + " logits");
  }
  return Status::Ok();
}

// ---- reference forward pass: plain loops over fp32 copies of the safetensors tensors ----------

using Tensors = std::map<std::string, std::vector<float>>;

Tensors ReadTensors(const std::string& path) {
  Tensors out;
  auto f = SafetensorsFile::Open(path);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return out;
  for (const auto& t : f->tensors()) {
    std::vector<float> v(t.numel());
    ConvertToF32(t.dtype, t.data, v.data(), v.size());
    out[t.name] = std::move(v);
  }
  return out;
}

// y = W x (+ b); W is [out][in].
std::vector<float> Linear(const std::vector<float>& w, const std::vector<float>* b,
                          const std::vector<float>& x) {
  const size_t in = x.size(), out = w.size() / in;
  std::vector<float> y(out);
  for (size_t o = 0; o < out; ++o) {
    double s = b ? (*b)[o] : 0.0;
    for (size_t i = 0; i < in; ++i) s += static_cast<double>(w[o * in + i]) * x[i];
    y[o] = static_cast<float>(s);
  }
  return y;
}

std::vector<float> RmsNormRef(const std::vector<float>& x, const std::vector<float>& w, float eps) {
  double ss = 0;
  for (float v : x) ss += static_cast<double>(v) * v;
  const double scale = 1.0 / std::sqrt(ss / x.size() + eps);
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = static_cast<float>(x[i] * scale * w[i]);
  return y;
}

// HF rotate-half RoPE (pairs j, j + hd/2), or llama2.c's interleaved pairs (2j, 2j+1) when
// `interleaved` (used only to show the test can tell the two apart).
void RopeRef(std::vector<float>& v, int n_heads, int hd, int pos, float theta, bool interleaved) {
  for (int h = 0; h < n_heads; ++h) {
    float* x = v.data() + h * hd;
    for (int j = 0; j < hd / 2; ++j) {
      const double freq = std::pow(static_cast<double>(theta), -2.0 * j / hd);
      const double c = std::cos(pos * freq), s = std::sin(pos * freq);
      const int a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + hd / 2;
      const double x1 = x[a], x2 = x[b];
      x[a] = static_cast<float>(x1 * c - x2 * s);
      x[b] = static_cast<float>(x2 * c + x1 * s);
    }
  }
}

std::vector<float> ReferenceLogits(const ModelConfig& c, const Tensors& w,
                                   const std::vector<int>& tokens, bool interleaved = false) {
  const int n = static_cast<int>(tokens.size()), d = c.dim, hd = c.head_dim();
  const int group = c.n_heads / c.n_kv_heads;
  auto W = [&](const std::string& name) -> const std::vector<float>& { return w.at(name); };
  std::vector<std::vector<float>> x(n);
  for (int p = 0; p < n; ++p) {
    const auto& e = W("model.embed_tokens.weight");
    x[p].assign(e.begin() + static_cast<size_t>(tokens[p]) * d, e.begin() + static_cast<size_t>(tokens[p] + 1) * d);
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    auto bias = [&](const std::string& name) { return c.qkv_bias ? &W(pre + name) : nullptr; };
    std::vector<std::vector<float>> q(n), k(n), v(n);
    for (int p = 0; p < n; ++p) {
      auto xb = RmsNormRef(x[p], W(pre + "input_layernorm.weight"), c.rms_eps);
      q[p] = Linear(W(pre + "self_attn.q_proj.weight"), bias("self_attn.q_proj.bias"), xb);
      k[p] = Linear(W(pre + "self_attn.k_proj.weight"), bias("self_attn.k_proj.bias"), xb);
      v[p] = Linear(W(pre + "self_attn.v_proj.weight"), bias("self_attn.v_proj.bias"), xb);
      RopeRef(q[p], c.n_heads, hd, p, c.rope_theta, interleaved);
      RopeRef(k[p], c.n_kv_heads, hd, p, c.rope_theta, interleaved);
    }
    for (int p = 0; p < n; ++p) {
      std::vector<float> att(d, 0.0f);
      for (int h = 0; h < c.n_heads; ++h) {
        const int kh = h / group;
        std::vector<double> score(p + 1);
        double mx = -1e300;
        for (int t = 0; t <= p; ++t) {
          double s = 0;
          for (int i = 0; i < hd; ++i) s += static_cast<double>(q[p][h * hd + i]) * k[t][kh * hd + i];
          score[t] = s / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, score[t]);
        }
        double sum = 0;
        for (double& s : score) sum += (s = std::exp(s - mx));
        for (int i = 0; i < hd; ++i) {
          double acc = 0;
          for (int t = 0; t <= p; ++t) acc += score[t] / sum * v[t][kh * hd + i];
          att[h * hd + i] = static_cast<float>(acc);
        }
      }
      auto o = Linear(W(pre + "self_attn.o_proj.weight"), nullptr, att);
      for (int i = 0; i < d; ++i) x[p][i] += o[i];
      auto xb = RmsNormRef(x[p], W(pre + "post_attention_layernorm.weight"), c.rms_eps);
      auto g = Linear(W(pre + "mlp.gate_proj.weight"), nullptr, xb);
      auto u = Linear(W(pre + "mlp.up_proj.weight"), nullptr, xb);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      auto down = Linear(W(pre + "mlp.down_proj.weight"), nullptr, g);
      for (int i = 0; i < d; ++i) x[p][i] += down[i];
    }
  }
  const auto& head = w.count("lm_head.weight") ? W("lm_head.weight") : W("model.embed_tokens.weight");
  std::vector<float> logits;
  for (int p = 0; p < n; ++p) {
    auto y = Linear(head, nullptr, RmsNormRef(x[p], W("model.norm.weight"), c.rms_eps));
    logits.insert(logits.end(), y.begin(), y.end());
  }
  return logits;
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return a.size() == b.size() ? m : INFINITY;
}

// Makes the random model `o`, runs it through Keel and through the reference, and checks they
// agree within `tol` while a reference with the other RoPE layout clearly does not.
void CheckAgainstReference(const RandomModelOptions& o, float tol) {
  ASSERT_TRUE(MakeRandomModel(o).ok());
  auto m = LoadSafetensors(o.out_dir);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const std::vector<int> tokens = {1, 5, 77, 300 % o.vocab, 42, 9, 128, 7, 7, 258, 3, 64};
  std::vector<float> got;
  ASSERT_TRUE(RunLogits(*m, tokens, &got).ok());
  Tensors w = ReadTensors(o.out_dir + "/model.safetensors");
  auto want = ReferenceLogits(m->config, w, tokens);
  EXPECT_LT(MaxAbsDiff(got, want), tol);
  float scale = 0;
  for (float v : want) scale = std::max(scale, std::fabs(v));
  EXPECT_GT(scale, 0.1f) << "logits too small for the tolerance to mean anything";
  // The comparison must be able to see a RoPE layout mistake.
  EXPECT_GT(MaxAbsDiff(got, ReferenceLogits(m->config, w, tokens, /*interleaved=*/true)), 50 * tol);
}

std::string Aidreams() { return test::ModelsDir() + "/aidreams260K.bin"; }
std::string AidreamsTok() { return test::ModelsDir() + "/aidreams_tok512.bin"; }
const std::vector<int> kAidreamsTokens = {1, 319, 459, 355, 260, 275, 429, 339, 315, 374, 327};

TEST(ConvertTest, Aidreams260KF32GivesIdenticalLogits) {
  auto src = LoadLlama2c(Aidreams());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  test::TempDir dir("keel-conv");
  ASSERT_TRUE(ConvertToSafetensors(*src, AidreamsTok(), dir.path(), DType::kF32).ok());
  auto dst = LoadSafetensors(dir.path());
  ASSERT_TRUE(dst.ok()) << dst.status().ToString();

  const ModelConfig &a = src->config, &b = dst->config;
  EXPECT_EQ(b.arch, "llama");
  EXPECT_EQ(b.dim, a.dim);
  EXPECT_EQ(b.hidden_dim, a.hidden_dim);
  EXPECT_EQ(b.n_layers, a.n_layers);
  EXPECT_EQ(b.n_heads, a.n_heads);
  EXPECT_EQ(b.n_kv_heads, a.n_kv_heads);
  EXPECT_EQ(b.vocab_size, a.vocab_size);
  EXPECT_EQ(b.max_seq_len, a.max_seq_len);
  EXPECT_EQ(b.rope_theta, a.rope_theta);
  EXPECT_EQ(b.rms_eps, a.rms_eps);
  EXPECT_EQ(b.tied_embeddings, a.tied_embeddings);
  EXPECT_EQ(b.rope_style, RopeStyle::kHalf);
  EXPECT_EQ(dst->format, "safetensors");
  EXPECT_EQ(dst->source, dir.path());
  EXPECT_FALSE(dst->checksum == Hash128{});

  auto tok_src = ReadFileToString(AidreamsTok());
  auto tok_dst = ReadFileToString(dir.file("tokenizer.bin"));
  ASSERT_TRUE(tok_src.ok() && tok_dst.ok());
  EXPECT_EQ(*tok_src, *tok_dst);
  auto cfg = ReadFileToString(dir.file("config.json"));
  ASSERT_TRUE(cfg.ok());
  json j = json::parse(*cfg);
  EXPECT_EQ(j["model_type"], "llama");
  EXPECT_EQ(j["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(j["tie_word_embeddings"], a.tied_embeddings);

  std::vector<float> la, lb;
  ASSERT_TRUE(RunLogits(*src, kAidreamsTokens, &la).ok());
  ASSERT_TRUE(RunLogits(*dst, kAidreamsTokens, &lb).ok());
  ASSERT_EQ(la.size(), lb.size());
  size_t mismatches = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    if (std::memcmp(&la[i], &lb[i], 4) != 0 && mismatches++ < 5) {
      ADD_FAILURE() << "logit " << i << " (pos " << i / a.vocab_size << "): llama2.c " << la[i]
                    << " vs safetensors " << lb[i];
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(ConvertTest, Aidreams260KBf16LogitsClose) {
  auto src = LoadLlama2c(Aidreams());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  test::TempDir dir("keel-conv");
  ASSERT_TRUE(ConvertToSafetensors(*src, AidreamsTok(), dir.path(), DType::kBF16).ok());
  auto dst = LoadSafetensors(dir.path());
  ASSERT_TRUE(dst.ok()) << dst.status().ToString();
  EXPECT_EQ(dst->embedding.dtype, DType::kBF16);
  EXPECT_EQ(dst->layers[0].wq.dtype, DType::kBF16);
  std::vector<float> la, lb;
  ASSERT_TRUE(RunLogits(*src, kAidreamsTokens, &la).ok());
  ASSERT_TRUE(RunLogits(*dst, kAidreamsTokens, &lb).ok());
  float scale = 0;
  for (float v : la) scale = std::max(scale, std::fabs(v));
  // bf16 keeps 8 mantissa bits; aidreams stays well under 1% of the logit range (0.2% seen).
  EXPECT_LT(MaxAbsDiff(la, lb), 0.01f * scale);
  const int v = src->config.vocab_size;
  int same_argmax = 0;
  for (size_t p = 0; p < kAidreamsTokens.size(); ++p) {
    auto a = std::max_element(la.begin() + p * v, la.begin() + (p + 1) * v) - la.begin();
    auto b = std::max_element(lb.begin() + p * v, lb.begin() + (p + 1) * v) - lb.begin();
    same_argmax += a == b;
  }
  EXPECT_GE(same_argmax, static_cast<int>(kAidreamsTokens.size()) - 1);
}

TEST(ConvertTest, ReconvertingSafetensorsKeepsBytes) {
  auto src = LoadLlama2c(Aidreams());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  test::TempDir d1("keel-conv"), d2("keel-conv");
  ASSERT_TRUE(ConvertToSafetensors(*src, AidreamsTok(), d1.path()).ok());
  auto m1 = LoadSafetensors(d1.path());
  ASSERT_TRUE(m1.ok()) << m1.status().ToString();
  // Already in HF layout: no permutation, so the same tensor bytes and checksum come back.
  ASSERT_TRUE(ConvertToSafetensors(*m1, "", d2.path()).ok());
  auto m2 = LoadSafetensors(d2.path());
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_EQ(m1->checksum, m2->checksum);
  EXPECT_FALSE(std::filesystem::exists(d2.file("tokenizer.bin")));
}

// A directory that held a sharded model: its index would win over the new model.safetensors.
TEST(ConvertTest, ConvertingOverAShardedModelDropsItsIndex) {
  auto src = LoadLlama2c(Aidreams());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  test::TempDir dir("keel-conv");
  {
    std::ofstream(dir.file("model.safetensors.index.json")) << R"({"weight_map":{"lm_head.weight":"old-1.safetensors"}})";
    std::ofstream(dir.file("old-1.safetensors")) << "stale";
  }
  ASSERT_TRUE(ConvertToSafetensors(*src, AidreamsTok(), dir.path(), DType::kF32).ok());
  EXPECT_FALSE(std::filesystem::exists(dir.file("model.safetensors.index.json")));
  auto dst = LoadModel(dir.path());
  ASSERT_TRUE(dst.ok()) << dst.status().ToString();
  EXPECT_EQ(dst->config.vocab_size, src->config.vocab_size);
}

// float16 tops out at 65504: a larger weight became inf and the model answered <unk>.
TEST(ConvertTest, WeightsBeyondFloat16AreRefusedNotMadeInfinite) {
  auto bytes = ReadFileToString(Aidreams());
  ASSERT_TRUE(bytes.ok());
  const float big = 1e5f;
  std::memcpy(bytes->data() + 28, &big, 4);  // the first weight after the 7-int header: embeddings[0][0]
  test::TempDir dir("keel-conv");
  ASSERT_TRUE(WriteFileAtomic(dir.file("big.bin"), *bytes).ok());
  auto src = LoadLlama2c(dir.file("big.bin"));
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  Status f16 = ConvertToSafetensors(*src, "", dir.file("f16"), DType::kF16);
  ASSERT_FALSE(f16.ok());
  EXPECT_NE(f16.message().find("model.embed_tokens.weight: 1 values beyond the range of float16"), std::string::npos)
      << f16.message();
  EXPECT_FALSE(LoadModel(dir.file("f16")).ok());  // nothing loadable was left behind
  EXPECT_TRUE(ConvertToSafetensors(*src, "", dir.file("bf16"), DType::kBF16).ok());
}

// A path naming one .safetensors file stands for its directory only when it is that directory's
// weight file; any other name used to load model.safetensors in its place.
TEST(ConvertTest, LoadModelRefusesASafetensorsFileThatIsNotTheDirectorysModel) {
  auto src = LoadLlama2c(Aidreams());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  test::TempDir dir("keel-conv");
  ASSERT_TRUE(ConvertToSafetensors(*src, "", dir.path(), DType::kF32).ok());
  EXPECT_TRUE(LoadModel(dir.file("model.safetensors")).ok());
  EXPECT_TRUE(LoadModel(dir.file("config.json")).ok());
  std::filesystem::copy_file(dir.file("model.safetensors"), dir.file("other.safetensors"));
  auto other = LoadModel(dir.file("other.safetensors"));
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("pass the directory"), std::string::npos) << other.status().message();
}

TEST(ConvertTest, DescribeModelListsTensors) {
  auto src = LoadLlama2c(Aidreams());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  std::string d = DescribeModel(*src);
  EXPECT_CONTAINS(d, "format:         llama2c");
  EXPECT_CONTAINS(d, src->checksum.hex());
  EXPECT_CONTAINS(d, "model.layers.3.self_attn.q_proj.weight");
  EXPECT_CONTAINS(d, "[64, 64]");
  EXPECT_CONTAINS(d, "parameters:     " + std::to_string(src->config.ParameterCount()));
  EXPECT_EQ(d.find("lm_head.weight"), std::string::npos);  // aidreams shares its classifier
  EXPECT_CONTAINS(DescribeModel(Model{}), "not listed");   // an empty Model must not crash
}

// ---- random models --------------------------------------------------------------------------

RandomModelOptions SmallQwen(const std::string& dir) {
  RandomModelOptions o;
  o.arch = "qwen2";
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.vocab = 300;
  o.seed = 11;
  o.out_dir = dir;
  // Larger than the default 0.02 so attention is far from uniform and RoPE errors show.
  o.init_std = 0.15f;
  return o;
}

TEST(RandomModelTest, Qwen2MatchesReference) {
  test::TempDir dir("keel-rand");
  RandomModelOptions o = SmallQwen(dir.path());
  CheckAgainstReference(o, 1e-4f);
  auto m = LoadSafetensors(dir.path());
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->config.arch, "qwen2");
  EXPECT_TRUE(m->config.qkv_bias);
  EXPECT_NE(m->layers[1].bk, nullptr);
  EXPECT_EQ(m->config.rope_theta, 1e6f);
  EXPECT_FALSE(m->config.tied_embeddings);
  EXPECT_NE(m->classifier.data, m->embedding.data);
}

TEST(RandomModelTest, LlamaF16TiedMatchesReference) {
  test::TempDir dir("keel-rand");
  RandomModelOptions o;
  o.arch = "llama";
  o.layers = 2;
  o.dim = 64;
  o.heads = 8;
  o.kv_heads = 2;
  o.vocab = 320;
  o.seed = 5;
  o.dtype = DType::kF16;
  o.tie_embeddings = true;
  o.init_std = 0.15f;
  o.out_dir = dir.path();
  CheckAgainstReference(o, 1e-4f);
  auto m = LoadSafetensors(dir.path());
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->layers[0].w2.dtype, DType::kF16);
  EXPECT_EQ(m->classifier.data, m->embedding.data);
  EXPECT_EQ(m->config.hidden_dim, 192);  // 8*64/3 = 170, rounded up to a multiple of 32
  EXPECT_EQ(m->layers[0].bq, nullptr);
}

TEST(RandomModelTest, SameSeedSameBytes) {
  test::TempDir a("keel-rand"), b("keel-rand"), c("keel-rand");
  RandomModelOptions o = SmallQwen(a.path());
  o.init_std = 0.02f;
  ASSERT_TRUE(MakeRandomModel(o).ok());
  o.out_dir = b.path();
  ASSERT_TRUE(MakeRandomModel(o).ok());
  o.out_dir = c.path();
  o.seed += 1;
  ASSERT_TRUE(MakeRandomModel(o).ok());
  auto ma = LoadSafetensors(a.path()), mb = LoadSafetensors(b.path()), mc = LoadSafetensors(c.path());
  ASSERT_TRUE(ma.ok() && mb.ok() && mc.ok());
  EXPECT_EQ(ma->checksum, mb->checksum);
  EXPECT_FALSE(ma->checksum == mc->checksum);
  EXPECT_EQ(*ReadFileToString(a.file("model.safetensors")), *ReadFileToString(b.file("model.safetensors")));
  EXPECT_EQ(*ReadFileToString(a.file("config.json")), *ReadFileToString(c.file("config.json")));
}

TEST(RandomModelTest, TokenizerLayout) {
  test::TempDir dir("keel-rand");
  RandomModelOptions o = SmallQwen(dir.path());
  o.vocab = 1000;
  ASSERT_TRUE(MakeRandomModel(o).ok());
  auto tok = Tokenizer::Load(dir.file("tokenizer.bin"), o.vocab);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ(tok->piece(0), "<unk>");
  EXPECT_EQ(tok->piece(1), "\n<s>\n");
  EXPECT_EQ(tok->piece(2), "\n</s>\n");
  EXPECT_EQ(tok->piece(3), "<0x00>");
  EXPECT_EQ(tok->piece(258), "<0xFF>");
  EXPECT_EQ(tok->score(259), 0.0f);
  EXPECT_EQ(tok->score(260), -1.0f);
  std::set<std::string> distinct;
  for (int i = 0; i < o.vocab; ++i) distinct.insert(tok->piece(i));
  EXPECT_EQ(distinct.size(), static_cast<size_t>(o.vocab));
  // Text round-trips through the generated vocabulary.
  std::vector<int> ids = tok->Encode("the cat sat", /*bos=*/false);
  EXPECT_EQ(tok->DecodeAll(ids), "the cat sat");
  for (int id : ids) EXPECT_LT(id, o.vocab);
}

TEST(RandomModelTest, RejectsBadOptions) {
  test::TempDir dir("keel-rand");
  auto expect_bad = [&](RandomModelOptions o, const std::string& needle) {
    o.out_dir = dir.path();
    Status s = MakeRandomModel(o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << needle << ": " << s.ToString();
    EXPECT_CONTAINS(s.message(), needle);
  };
  RandomModelOptions o;
  o.vocab = 258;
  expect_bad(o, "259");
  o = {};
  o.dim = 66;
  expect_bad(o, "multiple of heads");
  o = {};
  o.heads = 4;
  o.kv_heads = 3;
  expect_bad(o, "kv_heads");
  o = {};
  o.dim = 12;
  o.heads = 4;
  expect_bad(o, "even");
  o = {};
  o.arch = "gpt2";
  expect_bad(o, "gpt2");
  o = {};
  o.layers = 0;
  expect_bad(o, "positive");
  o = {};
  o.dim = 32768;
  o.heads = 128;
  o.layers = 1000;
  o.vocab = 100000;
  expect_bad(o, "20e9");
  o = {};
  o.out_dir = "";
  EXPECT_FALSE(MakeRandomModel(o).ok());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// ---- loader errors and shards ------------------------------------------------------------------

void EditConfig(const std::string& dir, const std::function<void(json&)>& edit) {
  json j = json::parse(*ReadFileToString(dir + "/config.json"));
  edit(j);
  ASSERT_TRUE(WriteFileAtomic(dir + "/config.json", j.dump()).ok());
}

// Rewrites model.safetensors keeping the tensors `keep` accepts, plus `extra`.
void RewriteWeights(const std::string& dir, const std::function<bool(const std::string&)>& keep,
                    const std::vector<TensorData>& extra = {}) {
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<TensorData> out = extra;
  for (const auto& t : f->tensors()) {
    if (keep(t.name)) {
      out.push_back({{t.name, t.dtype, t.shape}, {reinterpret_cast<const char*>(t.data), t.size}});
    }
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", out).ok());
}

TEST(SafetensorsLoaderTest, ShardedMatchesSingleFile) {
  test::TempDir dir("keel-shard");
  RandomModelOptions o = SmallQwen(dir.path());
  ASSERT_TRUE(MakeRandomModel(o).ok());
  auto single = LoadSafetensors(dir.path());
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  std::vector<float> want;
  ASSERT_TRUE(RunLogits(*single, {1, 2, 3, 4}, &want).ok());

  auto f = SafetensorsFile::Open(dir.file("model.safetensors"));
  ASSERT_TRUE(f.ok());
  std::vector<TensorData> shard[2];
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  const char* names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  for (const auto& t : f->tensors()) {
    int s = t.name.rfind("model.layers.1.", 0) == 0 || t.name == "lm_head.weight";
    shard[s].push_back({{t.name, t.dtype, t.shape}, {reinterpret_cast<const char*>(t.data), t.size}});
    index["weight_map"][t.name] = names[s];
  }
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(WriteSafetensors(dir.file(names[s]), shard[s]).ok());
  ASSERT_TRUE(WriteFileAtomic(dir.file("model.safetensors.index.json"), index.dump()).ok());
  std::filesystem::remove(dir.file("model.safetensors"));

  auto sharded = LoadSafetensors(dir.path());
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
  EXPECT_EQ(sharded->checksum, single->checksum);
  std::vector<float> got;
  ASSERT_TRUE(RunLogits(*sharded, {1, 2, 3, 4}, &got).ok());
  EXPECT_EQ(got, want);

  // The index must not point outside the directory, and must name the file that holds a tensor.
  index["weight_map"]["model.norm.weight"] = "../model-00001-of-00002.safetensors";
  ASSERT_TRUE(WriteFileAtomic(dir.file("model.safetensors.index.json"), index.dump()).ok());
  auto r = LoadSafetensors(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "model.norm.weight");
  index["weight_map"]["model.norm.weight"] = names[1];
  ASSERT_TRUE(WriteFileAtomic(dir.file("model.safetensors.index.json"), index.dump()).ok());
  r = LoadSafetensors(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "model.norm.weight");
}

TEST(SafetensorsLoaderTest, ConfigAndTensorErrorsNameTheCulprit) {
  test::TempDir dir("keel-bad");
  RandomModelOptions o = SmallQwen(dir.path());
  ASSERT_TRUE(MakeRandomModel(o).ok());
  ASSERT_TRUE(LoadSafetensors(dir.path()).ok());
  auto expect_error = [&](const std::string& needle) {
    auto r = LoadSafetensors(dir.path());
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_CONTAINS(r.status().message(), needle);
  };
  const std::string cfg = *ReadFileToString(dir.file("config.json"));
  auto restore = [&] { ASSERT_TRUE(WriteFileAtomic(dir.file("config.json"), cfg).ok()); };

  EditConfig(dir.path(), [](json& j) { j["intermediate_size"] = 100; });
  expect_error("model.layers.0.mlp.gate_proj.weight");
  restore();
  EditConfig(dir.path(), [](json& j) { j["model_type"] = "gpt2"; });
  expect_error("gpt2");
  restore();
  EditConfig(dir.path(), [](json& j) { j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; });
  expect_error("rope_scaling");
  restore();
  EditConfig(dir.path(), [](json& j) { j.erase("vocab_size"); });
  expect_error("vocab_size");
  restore();
  EditConfig(dir.path(), [](json& j) { j["num_attention_heads"] = -4; });
  expect_error("num_attention_heads");
  restore();
  ASSERT_TRUE(WriteFileAtomic(dir.file("config.json"), "{\"model_type\": ").ok());
  expect_error("config.json");
  restore();
  // A huge config.json is refused before it is read (sparse: no 65 MB written).
  ASSERT_EQ(::truncate(dir.file("config.json").c_str(), off_t{65} << 20), 0);
  expect_error("limit for a model's JSON file");
  restore();
  ASSERT_TRUE(LoadSafetensors(dir.path()).ok());

  const std::string weights = *ReadFileToString(dir.file("model.safetensors"));
  RewriteWeights(dir.path(), [](const std::string& n) { return n != "model.norm.weight"; });
  expect_error("model.norm.weight");
  ASSERT_TRUE(WriteFileAtomic(dir.file("model.safetensors"), weights).ok());
  RewriteWeights(dir.path(), [](const std::string& n) { return n != "lm_head.weight"; });
  expect_error("lm_head.weight");
  ASSERT_TRUE(WriteFileAtomic(dir.file("model.safetensors"), weights).ok());
  std::vector<float> bias(64, 0.0f);
  RewriteWeights(dir.path(), [](const std::string&) { return true; },
                 {{{"model.layers.0.self_attn.o_proj.bias", DType::kF32, {64}},
                   {reinterpret_cast<const char*>(bias.data()), bias.size() * 4}}});
  expect_error("model.layers.0.self_attn.o_proj.bias");
  ASSERT_TRUE(WriteFileAtomic(dir.file("model.safetensors"), weights).ok());
  ASSERT_TRUE(LoadSafetensors(dir.path()).ok());

  // A deeply nested value must be an error, not a stack overflow in the message's dump().
  const size_t depth = size_t{1} << 20;
  ASSERT_TRUE(WriteFileAtomic(dir.file("config.json"), R"({"model_type": "qwen2", "hidden_size": )" +
                                                           std::string(depth, '[') + std::string(depth, ']') + "}")
                  .ok());
  expect_error("nested deeper than");
  expect_error("config.json");
  restore();
  ASSERT_TRUE(LoadSafetensors(dir.path()).ok());

  std::filesystem::remove(dir.file("model.safetensors"));
  expect_error("model.safetensors");
  std::filesystem::remove(dir.file("config.json"));
  auto r = LoadSafetensors(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace keel::engine
