#include "keel/engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace keel::engine {
namespace {

std::vector<float> Logits() { return {0.1f, 2.0f, 1.5f, -1.0f, 1.9f, 0.0f}; }

TEST(Sampler, GreedyIsArgmax) {
  Sampler s({0.0f, 0, 1.0f, 7});
  auto l = Logits();
  EXPECT_EQ(s.Sample(l.data(), 6), 1);
}

TEST(Sampler, SameSeedSameSequence) {
  Sampler a({1.0f, 0, 1.0f, 42}), b({1.0f, 0, 1.0f, 42}), c({1.0f, 0, 1.0f, 43});
  std::vector<int> ra, rb, rc;
  for (int i = 0; i < 64; ++i) {
    auto l1 = Logits(), l2 = Logits(), l3 = Logits();
    ra.push_back(a.Sample(l1.data(), 6));
    rb.push_back(b.Sample(l2.data(), 6));
    rc.push_back(c.Sample(l3.data(), 6));
  }
  EXPECT_EQ(ra, rb);
  EXPECT_NE(ra, rc);
}

TEST(Sampler, TopKOneAndTinyTopPAreGreedy) {
  Sampler k1({5.0f, 1, 1.0f, 1}), p0({5.0f, 0, 1e-6f, 1});
  for (int i = 0; i < 32; ++i) {
    auto l = Logits();
    EXPECT_EQ(k1.Sample(l.data(), 6), 1);
    l = Logits();
    EXPECT_EQ(p0.Sample(l.data(), 6), 1);
  }
}

TEST(Sampler, TopKRestrictsSupport) {
  Sampler s({10.0f, 3, 1.0f, 9});
  std::set<int> seen;
  for (int i = 0; i < 500; ++i) {
    auto l = Logits();
    seen.insert(s.Sample(l.data(), 6));
  }
  // Only the three largest logits (ids 1, 4, 2) may ever be drawn; a high temperature reaches all.
  EXPECT_EQ(seen, (std::set<int>{1, 2, 4}));
}

TEST(Sampler, TopPKeepsSmallestNucleus) {
  // Probabilities ~ {0.5, 0.3, 0.2}: top_p = 0.7 keeps the first two.
  std::vector<float> base = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  Sampler s({1.0f, 0, 0.7f, 3});
  std::set<int> seen;
  for (int i = 0; i < 500; ++i) {
    auto l = base;
    seen.insert(s.Sample(l.data(), 3));
  }
  EXPECT_EQ(seen, (std::set<int>{0, 1}));
}

TEST(Sampler, LogitBiasMovesTheGreedyPick) {
  SamplingOptions o{0.0f, 0, 1.0f, 1};
  o.logit_bias = {{1, -100.0f}, {99, 5.0f}};  // 99 is outside this vocabulary: ignored
  Sampler s(o);
  auto l = Logits();
  EXPECT_EQ(s.Sample(l.data(), 6), 4);  // 1 banned: the next best, 1.9
  o.logit_bias = {{3, 10.0f}};
  Sampler t(o);
  l = Logits();
  EXPECT_EQ(t.Sample(l.data(), 6), 3);
}

// OpenAI's penalties count what this sampler drew: presence once per token, frequency per draw.
TEST(Sampler, PresenceAndFrequencyPenaltiesCountTheTokensDrawn) {
  const std::vector<float> base = {1.0f, 0.9f, 0.0f};
  SamplingOptions presence{0.0f, 0, 1.0f, 1};
  presence.presence_penalty = 0.5f;
  Sampler p(presence);
  std::vector<int> got;
  for (int i = 0; i < 3; ++i) {
    auto l = base;
    got.push_back(p.Sample(l.data(), 3));
  }
  EXPECT_EQ(got, (std::vector<int>{0, 1, 0}));  // 1.0 | 0.5 < 0.9 | 0.5 > 0.4: each drawn token loses 0.5 once
  SamplingOptions frequency{0.0f, 0, 1.0f, 1};
  frequency.frequency_penalty = 0.06f;
  Sampler f(frequency);
  got.clear();
  for (int i = 0; i < 3; ++i) {
    auto l = base;
    got.push_back(f.Sample(l.data(), 3));
  }
  EXPECT_EQ(got, (std::vector<int>{0, 0, 1}));  // 1.0, then 0.94 > 0.9, then 0.88 < 0.9
  Sampler plain({0.0f, 0, 1.0f, 1});
  for (int i = 0; i < 3; ++i) {
    auto l = base;
    EXPECT_EQ(plain.Sample(l.data(), 3), 0);
  }
}

TEST(Sampler, TopPZeroIsGreedy) {
  Sampler s({1.0f, 0, 0.0f, 11});
  for (int i = 0; i < 32; ++i) {
    auto l = Logits();
    EXPECT_EQ(s.Sample(l.data(), 6), 1);
  }
}

// Equal logits with top_p below 1/vocab used to leave the candidate list empty, and the draw read
// before its start (a crash of `keel serve` from one request).
TEST(Sampler, TopPBelowOneOverVocabOnEqualLogitsIsTheFirstToken) {
  Sampler s({1.0f, 0, 0.001f, 5});
  for (int i = 0; i < 16; ++i) {
    std::vector<float> l(512, 0.25f);
    EXPECT_EQ(s.Sample(l.data(), 512), 0);
  }
}

// A corrupt model's NaN or infinite logits: every path still returns a token id, never crashes.
TEST(Sampler, NonFiniteLogitsStillGiveATokenInRange) {
  const float nan = std::nanf(""), inf = INFINITY;
  const std::vector<std::vector<float>> cases = {
      std::vector<float>(64, nan), {nan, 1.0f, 2.0f, nan, 0.5f}, {1.0f, inf, 2.0f}, {inf, inf, -inf}, {nan, inf}};
  for (const SamplingOptions& opt : {SamplingOptions{0.0f, 0, 1.0f, 1}, SamplingOptions{1.0f, 0, 1.0f, 1},
                                     SamplingOptions{1.0f, 2, 1.0f, 1}, SamplingOptions{1.0f, 0, 0.5f, 1},
                                     SamplingOptions{1.0f, 3, 0.9f, 1}}) {
    Sampler s(opt);
    for (const auto& c : cases) {
      for (int i = 0; i < 8; ++i) {
        auto l = c;
        const int id = s.Sample(l.data(), static_cast<int>(l.size()));
        EXPECT_GE(id, 0);
        EXPECT_LT(id, static_cast<int>(c.size()));
      }
    }
  }
  // A finite token beside NaNs keeps its weight: with top_p the NaNs are never drawn.
  Sampler s({1.0f, 0, 0.5f, 1});
  for (int i = 0; i < 32; ++i) {
    std::vector<float> l = {nan, 1.0f, nan};
    EXPECT_EQ(s.Sample(l.data(), 3), 1);
  }
}

}  // namespace
}  // namespace keel::engine

namespace keel::engine {
namespace {

TEST(Logprobs, NormalizerAndTopK) {
  const std::vector<float> x = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f};
  double sum = 0;
  for (float v : x) sum += std::exp(static_cast<double>(v));
  const double norm = LogNormalizer(x.data(), 5);
  EXPECT_NEAR(norm, std::log(sum), 1e-6);  // float exp lanes, double sum
  // Longer than one vector, with a tail: the lanes and the scalar tail agree with double exp.
  std::vector<float> many(1003);
  double many_sum = 0;
  for (size_t i = 0; i < many.size(); ++i) {
    many[i] = static_cast<float>(std::sin(0.37 * i) * 12.0);
    many_sum += std::exp(static_cast<double>(many[i]));
  }
  EXPECT_NEAR(LogNormalizer(many.data(), static_cast<int>(many.size())), std::log(many_sum), 1e-6);
  // Huge logits do not overflow: the maximum is taken out first.
  const std::vector<float> big = {1000.0f, 1000.0f};
  EXPECT_NEAR(LogNormalizer(big.data(), 2), 1000.0 + std::log(2.0), 1e-9);

  std::vector<std::pair<int, float>> top;
  TopLogprobs(x.data(), 5, 3, norm, &top);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].first, 1);  // ties: the smaller id first
  EXPECT_EQ(top[1].first, 3);
  EXPECT_EQ(top[2].first, 0);
  EXPECT_FLOAT_EQ(top[0].second, static_cast<float>(3.0 - norm));
  EXPECT_FLOAT_EQ(top[2].second, static_cast<float>(1.0 - norm));
  TopLogprobs(x.data(), 5, 0, norm, &top);
  EXPECT_TRUE(top.empty());
  TopLogprobs(x.data(), 5, 99, norm, &top);  // clamped to the vocabulary
  EXPECT_EQ(top.size(), 5u);
  EXPECT_EQ(top.back().first, 2);

  // NaN (a corrupt model) ranks last instead of breaking the ordering.
  const std::vector<float> nan = {std::nanf(""), 2.0f, 1.0f};
  TopLogprobs(nan.data(), 3, 3, 0.0, &top);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].first, 1);
  EXPECT_EQ(top[1].first, 2);
  EXPECT_EQ(top[2].first, 0);
}

}  // namespace
}  // namespace keel::engine
