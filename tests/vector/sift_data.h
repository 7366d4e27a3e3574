// The SIFT test set under $KEEL_SHARED/data/vectors (10,000 base vectors, 100 queries that are
// base vectors 0..99, exact top-100 ground truth), loaded once per test binary.
#pragma once

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "keel/vector/texmex.h"
#include "tests/engine/test_util.h"

namespace keel::test {

struct Sift {
  vector::VectorSet base;
  vector::IdSet truth;
  int dim() const { return base.dim; }
  const float* row(int64_t i) const { return base.values.data() + i * base.dim; }
  std::vector<float> vec(int64_t i) const { return {row(i), row(i) + base.dim}; }
};

inline const Sift& LoadSift() {
  static const Sift sift = [] {
    Sift s;
    const std::string dir = SharedDir() + "/data/vectors/";
    auto base = vector::ReadBvecs(dir + "bigann10k_base.bvecs");
    auto truth = vector::ReadIvecs(dir + "bigann10k_groundtruth.ivecs");
    EXPECT_TRUE(base.ok()) << base.status().ToString();
    EXPECT_TRUE(truth.ok()) << truth.status().ToString();
    if (base.ok()) s.base = std::move(*base);
    if (truth.ok()) s.truth = std::move(*truth);
    return s;
  }();
  return sift;
}

// Fraction of the true 10 nearest neighbours of query q found in `got` (ids).
inline double RecallAt10(const Sift& s, int q, const std::vector<int64_t>& got) {
  std::set<int64_t> want(s.truth.values.begin() + q * s.truth.dim, s.truth.values.begin() + q * s.truth.dim + 10);
  int found = 0;
  for (int64_t id : got) found += want.count(id);
  return found / 10.0;
}

}  // namespace keel::test
