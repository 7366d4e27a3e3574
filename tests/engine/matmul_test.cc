// MatMul at every CPU level this machine supports (keel/core/cpu.h): against a double-precision
// reference for each weight dtype and odd shapes, batch-independence (decode == prefill bit for
// bit), MatMulSameInput == separate calls, and the level switch itself.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/cpu.h"
#include "tests/common/isa_scope.h"
#include "keel/core/dtype.h"
#include "keel/engine/matmul.h"

namespace keel::engine {
namespace {

struct Weights {
  DType dtype;
  int rows, cols;
  std::vector<uint8_t> bytes;
  std::vector<double> values;  // what the stored values mean, widened
  TensorView view() const { return TensorView{bytes.data(), dtype, rows, cols}; }
};

Weights MakeWeights(DType t, int rows, int cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  Weights w{t, rows, cols, std::vector<uint8_t>(static_cast<size_t>(rows) * cols * DTypeSize(t)), {}};
  w.values.resize(static_cast<size_t>(rows) * cols);
  for (size_t i = 0; i < w.values.size(); ++i) {
    const float f = nd(rng);
    if (t == DType::kF32) {
      std::memcpy(&w.bytes[4 * i], &f, 4);
      w.values[i] = f;
    } else {
      const uint16_t h = t == DType::kF16 ? F32ToF16(f) : F32ToBf16(f);
      std::memcpy(&w.bytes[2 * i], &h, 2);
      w.values[i] = t == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h);
    }
  }
  return w;
}

std::vector<float> MakeActs(int n_rows, int cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n_rows) * cols);
  for (float& v : x) v = nd(rng);
  return x;
}

std::string Name(cpu::Isa isa) { return std::string(cpu::IsaName(isa)); }

TEST(MatMul, MatchesDoubleReferenceAtEveryLevel) {
  const test::IsaScope restore(cpu::ActiveIsa());
  // Shapes: multiples of 16, of 8 only, odd; fewer rows than a group; batch sizes around tiles.
  const int shapes[][2] = {{64, 64}, {37, 24}, {5, 19}, {1, 7}, {130, 200}, {3, 1}};
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    ASSERT_TRUE(cpu::SetActiveIsa(isa).ok());
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (const auto& s : shapes) {
        const int rows = s[0], cols = s[1];
        Weights w = MakeWeights(t, rows, cols, 7 + rows);
        for (int n : {1, 2, 5, 9}) {
          std::vector<float> x = MakeActs(n, cols, 11 + n), y(static_cast<size_t>(n) * rows, -1.0f);
          MatMul(w.view(), x.data(), n, y.data());
          for (int b = 0; b < n; ++b) {
            for (int o = 0; o < rows; ++o) {
              double ref = 0, mag = 0;
              for (int i = 0; i < cols; ++i) {
                ref += w.values[static_cast<size_t>(o) * cols + i] * x[static_cast<size_t>(b) * cols + i];
                mag += std::fabs(w.values[static_cast<size_t>(o) * cols + i] * x[static_cast<size_t>(b) * cols + i]);
              }
              ASSERT_NEAR(y[static_cast<size_t>(b) * rows + o], ref, 1e-6 * mag + 1e-7)
                  << Name(isa) << " " << DTypeName(t) << " " << rows << "x" << cols << " n=" << n << " b=" << b
                  << " o=" << o;
            }
          }
        }
      }
    }
  }
}

TEST(MatMul, ARowsResultDoesNotDependOnItsBatchAtEveryLevel) {
  const test::IsaScope restore(cpu::ActiveIsa());
  // Big enough to run threaded and chunked (prompt-sized batch), with a ragged last group; two
  // widths, so both tile shapes of a level run (matmul_kernel.h picks by row bytes).
  const int rows = 259, n = 70;
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    ASSERT_TRUE(cpu::SetActiveIsa(isa).ok());
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16})
    for (int cols : {768, 2048}) {
      Weights w = MakeWeights(t, rows, cols, 3);
      std::vector<float> x = MakeActs(n, cols, 5), all(static_cast<size_t>(n) * rows), one(rows);
      MatMul(w.view(), x.data(), n, all.data());
      for (int b : {0, 3, 41, n - 1}) {
        MatMul(w.view(), x.data() + static_cast<size_t>(b) * cols, 1, one.data());
        ASSERT_EQ(0, std::memcmp(one.data(), all.data() + static_cast<size_t>(b) * rows, rows * sizeof(float)))
            << Name(isa) << " " << DTypeName(t) << " cols " << cols << " row " << b;
      }
    }
  }
}

TEST(MatMul, SameInputEqualsSeparateCalls) {
  const test::IsaScope restore(cpu::ActiveIsa());
  const int cols = 96, n = 6;
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    ASSERT_TRUE(cpu::SetActiveIsa(isa).ok());
    Weights a = MakeWeights(DType::kF16, 130, cols, 1), b = MakeWeights(DType::kF16, 6, cols, 2),
            c = MakeWeights(DType::kF16, 33, cols, 3);
    std::vector<float> x = MakeActs(n, cols, 9);
    std::vector<float> ya(n * 130), yb(n * 6), yc(n * 33), sa(ya.size()), sb(yb.size()), sc(yc.size());
    const TensorView ws[3] = {a.view(), b.view(), c.view()};
    float* const ys[3] = {ya.data(), yb.data(), yc.data()};
    MatMulSameInput(ws, x.data(), n, ys);
    MatMul(a.view(), x.data(), n, sa.data());
    MatMul(b.view(), x.data(), n, sb.data());
    MatMul(c.view(), x.data(), n, sc.data());
    EXPECT_EQ(ya, sa) << Name(isa);
    EXPECT_EQ(yb, sb) << Name(isa);
    EXPECT_EQ(yc, sc) << Name(isa);
  }
}

TEST(MatMul, LevelsAgreeToRoundingAndDifferOnlyThere) {
  if (!cpu::Supports(cpu::Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512: one level only";
  const int rows = 64, cols = 768;
  Weights w = MakeWeights(DType::kF32, rows, cols, 4);
  std::vector<float> x = MakeActs(1, cols, 8), y2(rows), y5(rows);
  const TensorView v = w.view();
  float* out2[1] = {y2.data()};
  float* out5[1] = {y5.data()};
  matmul_detail::RunAvx2(&v, out2, 1, x.data(), 1);
  matmul_detail::RunAvx512(&v, out5, 1, x.data(), 1);
  int differ = 0;
  for (int o = 0; o < rows; ++o) {
    EXPECT_NEAR(y2[o], y5[o], 1e-5f * (1 + std::fabs(y2[o])));
    differ += y2[o] != y5[o];
  }
  // 16 lanes sum in another order than 8: some outputs must differ in the last bits, else the
  // AVX-512 kernel did not run.
  EXPECT_GT(differ, 0);
}

TEST(CpuIsa, RefusesUnknownAndUnsupportedLevels) {
  const test::IsaScope restore(cpu::ActiveIsa());
  Status s = cpu::SetActiveIsa("sse2");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("auto, avx2, avx512"), std::string::npos) << s.message();
  EXPECT_TRUE(cpu::SetActiveIsa("avx2").ok());
  EXPECT_EQ(cpu::ActiveIsa(), cpu::Isa::kAvx2);
  EXPECT_NE(cpu::Describe().find("kernels avx2"), std::string::npos) << cpu::Describe();
  if (!cpu::Supports(cpu::Isa::kAvx512)) {
    EXPECT_EQ(cpu::SetActiveIsa("avx512").code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(cpu::ActiveIsa(), cpu::Isa::kAvx2);
  }
  EXPECT_TRUE(cpu::SetActiveIsa("auto").ok());
  EXPECT_EQ(cpu::ActiveIsa(), cpu::SupportedIsas().back());
  EXPECT_FALSE(cpu::Detected().model.empty());
}

}  // namespace
}  // namespace keel::engine
