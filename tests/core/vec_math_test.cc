// keel/core/vec_math.h: the batched 16-lane reduction gives ReduceLanes16's bits for every vector.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "keel/core/cpu.h"
#include "keel/core/vec_math.h"

KEEL_BEGIN_TARGET_AVX512
namespace keel::avx512 {
namespace {

// out[0..16): ReduceLanes16xN<N> of in's first N vectors; ref[0..N): ReduceLanes16 of each.
template <int N>
void ReduceBoth(const float* in, float* out, float* ref) {
  __m512 v[N];
  for (int k = 0; k < N; ++k) v[k] = _mm512_loadu_ps(in + 16 * k);
  _mm512_storeu_ps(out, ReduceLanes16xN<N>(v));
  for (int k = 0; k < N; ++k) ref[k] = ReduceLanes16(v[k]);
}

template <int... N>
void ReduceAll(std::integer_sequence<int, N...>, int n, const float* in, float* out, float* ref) {
  ((n == N + 1 ? ReduceBoth<N + 1>(in, out, ref) : void()), ...);
}

}  // namespace
}  // namespace keel::avx512
KEEL_END_TARGET

namespace keel {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(VecMath, ReduceLanes16xNGivesReduceLanes16sBits) {
  if (!cpu::Supports(cpu::Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512";
  std::mt19937 rng(7);
  // Magnitudes spread over 2^-20..2^20 so that the order of the additions shows in the bits; a
  // sum in another order differs in most trials.
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-20, 20);
  int differs_if_reordered = 0;
  for (int trial = 0; trial < 200; ++trial) {
    for (int n = 1; n <= 16; ++n) {
      float in[16 * 16], out[16], ref[16];
      for (float& x : in) x = std::ldexp(mant(rng), expo(rng));
      avx512::ReduceAll(std::make_integer_sequence<int, 16>{}, n, in, out, ref);
      for (int k = 0; k < n; ++k) {
        ASSERT_EQ(Bits(out[k]), Bits(ref[k])) << "n=" << n << " k=" << k << ": " << out[k] << " vs " << ref[k];
        float seq = 0.0f;  // the plain left-to-right sum, to show the test can tell orders apart
        for (int i = 0; i < 16; ++i) seq += in[16 * k + i];
        differs_if_reordered += Bits(seq) != Bits(ref[k]);
      }
      for (int k = n; k < 16; ++k) EXPECT_EQ(Bits(out[k]), 0u) << "n=" << n << " k=" << k;
    }
  }
  EXPECT_GT(differs_if_reordered, 100);
}

}  // namespace
}  // namespace keel
