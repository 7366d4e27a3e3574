// The MoE feed-forward in the forward pass: en-moe8x (a trained Mixtral-format model) reproduces
// the reference greedy continuations recorded in the data README (PyTorch, float64); routing
// follows Mixtral (softmax, top-k, renormalise; ties to the lower id; a selection bonus never
// changes the weights); prefill equals decode bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "keel/engine/engine.h"
#include "keel/engine/feed_forward.h"
#include "keel/engine/transformer.h"
#include "test_util.h"

namespace keel::engine {
namespace {

std::unique_ptr<Engine> OpenMoe() {
  EngineOptions o;
  o.model_path = test::ModelsDir() + "/en-moe8x";
  auto e = Engine::Open(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

struct Reference {
  const char* prompt;
  const char* continuation;
};

// ../shared/data/README.md, "models/en-moe8x/".
const Reference kReferences[] = {
    {"The ", "construction of the construction of the construction of the constitution of the constitution of the constitution of the "},
    {"Once upon a time", ", on the police, on the police, police, police, police, police, police, police, police, police, police, police, police, "},
    {"A computer is", " a computer computer computer computer computer computer computer computer computer computers and computers and computer"},
};

TEST(MoeForward, EnMoe8xMatchesTheReferenceGreedyContinuations) {
  auto e = OpenMoe();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->model().config.moe.n_experts, 8);
  EXPECT_EQ(e->model().config.moe.top_k, 2);
  for (const Reference& r : kReferences) {
    GenerationParams p;
    p.sampling.temperature = 0.0f;
    p.max_tokens = static_cast<int>(std::strlen(r.continuation));  // one token per ASCII character
    std::string text;
    auto done = e->Generate(r.prompt, p, [&](const std::string& t) { text += t; });
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    EXPECT_EQ(text, r.continuation) << "prompt \"" << r.prompt << "\"";
  }
}

TEST(MoeForward, PrefillEqualsDecodeBitForBit) {
  auto m = LoadModel(test::ModelsDir() + "/en-moe8x");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto run = [&](int chunk) {
    KvCacheOptions o;
    o.prefix_sharing = false;
    auto cache = KvCache::Create(*m, "raw", o);
    EXPECT_TRUE(cache.ok());
    Transformer tf(*m);
    const std::vector<int> tokens = {1, 259, 292, 259, 323, 339, 337, 341, 340, 335, 346, 327, 340};
    EXPECT_TRUE((*cache)->BeginSequence(1, {}).ok());
    EXPECT_TRUE((*cache)->Reserve(1, static_cast<int>(tokens.size())).ok());
    std::vector<float> all, logits;
    for (size_t p = 0; p < tokens.size(); p += chunk) {
      std::vector<BatchToken> batch;
      for (size_t i = p; i < std::min(tokens.size(), p + chunk); ++i) batch.push_back({1, tokens[i], static_cast<int>(i), true});
      EXPECT_TRUE(tf.Forward(batch, **cache, logits).ok());
      (*cache)->Commit(1, tokens.data() + p, static_cast<int>(batch.size()));
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  };
  const std::vector<float> decode = run(1), prefill = run(13), chunks = run(5);
  ASSERT_EQ(decode.size(), prefill.size());
  EXPECT_EQ(std::memcmp(decode.data(), prefill.data(), decode.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(decode.data(), chunks.data(), decode.size() * sizeof(float)), 0);
}

TEST(MoeRouting, SoftmaxTopKRenormalised) {
  MoeConfig moe;
  moe.n_experts = 4;
  moe.top_k = 2;
  const float logits[] = {0.5f, 2.0f, -1.0f, 1.0f};
  ExpertChoice out[2];
  SelectExperts(logits, nullptr, moe, out);
  EXPECT_EQ(out[0].expert, 1);
  EXPECT_EQ(out[1].expert, 3);
  const double p1 = std::exp(2.0), p3 = std::exp(1.0);
  EXPECT_NEAR(out[0].weight, p1 / (p1 + p3), 1e-6);
  EXPECT_NEAR(out[1].weight, p3 / (p1 + p3), 1e-6);
  moe.norm_topk = false;  // OLMoE / Qwen2-MoE default: plain softmax probabilities
  SelectExperts(logits, nullptr, moe, out);
  const double z = std::exp(0.5) + std::exp(2.0) + std::exp(-1.0) + std::exp(1.0);
  EXPECT_NEAR(out[0].weight, p1 / z, 1e-6);
}

TEST(MoeRouting, BonusChangesSelectionButNotWeightsAndTiesGoToTheLowerId) {
  MoeConfig moe;
  moe.n_experts = 4;
  moe.top_k = 2;
  const float logits[] = {0.5f, 2.0f, -1.0f, 1.0f};
  const float bonus[] = {0.0f, 0.0f, 3.5f, 0.0f};  // expert 2 is "cached"
  ExpertChoice out[2];
  SelectExperts(logits, bonus, moe, out);
  EXPECT_EQ(out[0].expert, 2);  // -1 + 3.5 = 2.5 > 2.0
  EXPECT_EQ(out[1].expert, 1);
  const double p1 = std::exp(2.0), p2 = std::exp(-1.0);
  EXPECT_NEAR(out[0].weight, p2 / (p1 + p2), 1e-6);  // from the unbiased logits
  const float tied[] = {1.0f, 3.0f, 3.0f, 3.0f};
  SelectExperts(tied, nullptr, moe, out);
  EXPECT_EQ(out[0].expert, 1);
  EXPECT_EQ(out[1].expert, 2);
}

TEST(MoeForward, DenseModelsKeepTheirDenseFeedForward) {
  // The golden tests pin dense numbers; this checks the seam picks dense for a dense model.
  auto m = LoadModel(test::ModelsDir() + "/en-dense6L.bin");
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(m->config.moe.enabled());
  EXPECT_TRUE(m->layers[0].moe.experts.empty());
  EXPECT_FALSE(m->layers[0].w1.empty());
}

}  // namespace
}  // namespace keel::engine
