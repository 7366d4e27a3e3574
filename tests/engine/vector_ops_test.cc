// RmsNorm and SiluMul at every CPU level this machine supports: against double references, and an
// element's bits not depending on where it sits (tails, thread chunks).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "keel/core/cpu.h"
#include "tests/common/isa_scope.h"
#include "keel/engine/vector_ops.h"

namespace keel::engine {
namespace {

std::vector<float> Random(size_t n, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

TEST(VectorOps, SiluMulMatchesReferenceAndIsPositionIndependent) {
  const test::IsaScope restore(cpu::ActiveIsa());
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    ASSERT_TRUE(cpu::SetActiveIsa(isa).ok());
    // Large enough for threads and several chunks, with a ragged tail; extremes included.
    const int64_t n = 3 * 4096 + 4096 * 2 + 13;
    std::vector<float> gate = Random(n, 4.0f, 1), up = Random(n, 1.0f, 2);
    gate[0] = -100.0f, gate[1] = 100.0f, gate[2] = 0.0f, gate[n - 1] = -90.0f;
    std::vector<float> out = gate;
    SiluMul(out.data(), up.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const double g = gate[i], ref = g / (1.0 + std::exp(-g)) * up[i];
      ASSERT_NEAR(out[i], ref, 2e-6 * std::fabs(ref) + 1e-30) << cpu::IsaName(isa) << " i=" << i << " g=" << g;
    }
    // The same element alone (a tail of one) and at another offset gives the same bits.
    for (int64_t i : {int64_t{5}, int64_t{4099}, n - 1}) {
      float g = gate[i];
      SiluMul(&g, &up[i], 1);
      EXPECT_EQ(g, out[i]) << cpu::IsaName(isa) << " i=" << i;
    }
  }
}

TEST(VectorOps, RmsNormMatchesReference) {
  const test::IsaScope restore(cpu::ActiveIsa());
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    ASSERT_TRUE(cpu::SetActiveIsa(isa).ok());
    for (int n : {7, 64, 200, 768}) {
      std::vector<float> x = Random(n, 2.0f, n), w = Random(n, 1.0f, n + 1), out(n);
      RmsNorm(x.data(), w.data(), n, 1e-5f, out.data());
      double ss = 0;
      for (float v : x) ss += static_cast<double>(v) * v;
      const double scale = 1.0 / std::sqrt(ss / n + 1e-5);
      for (int i = 0; i < n; ++i) {
        const double ref = w[i] * scale * x[i];
        ASSERT_NEAR(out[i], ref, 1e-5 * std::fabs(ref) + 1e-7) << cpu::IsaName(isa) << " n=" << n << " i=" << i;
      }
      // In place gives the same bits.
      std::vector<float> in_place = x;
      RmsNorm(in_place.data(), w.data(), n, 1e-5f, in_place.data());
      EXPECT_EQ(in_place, out) << cpu::IsaName(isa);
    }
  }
}

}  // namespace
}  // namespace keel::engine
