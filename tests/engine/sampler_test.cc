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

}  // namespace
}  // namespace keel::engine
