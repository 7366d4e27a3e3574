// keel/core/vec_math.h: the batched reductions give ReduceLanes8's and ReduceLanes16's bits for
// every vector; StoreLanes8 stores the lanes it names.
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

template <int N>
void ReduceBoth8(const float* in, float* out, float* ref) {
  __m256 v[N];
  for (int k = 0; k < N; ++k) v[k] = _mm256_loadu_ps(in + 8 * k);
  _mm256_storeu_ps(out, ReduceLanes8xN<N>(v));
  for (int k = 0; k < N; ++k) ref[k] = ReduceLanes8(v[k]);
}

template <int... N>
void ReduceAll8(std::integer_sequence<int, N...>, int n, const float* in, float* out, float* ref) {
  ((n == N + 1 ? ReduceBoth8<N + 1>(in, out, ref) : void()), ...);
}

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

TEST(VecMath, ReduceLanes8xNGivesReduceLanes8sBits) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-20, 20);
  int differs_if_reordered = 0;
  for (int trial = 0; trial < 200; ++trial) {
    for (int n = 1; n <= 8; ++n) {
      float in[8 * 8], out[8], ref[8];
      for (float& x : in) x = std::ldexp(mant(rng), expo(rng));
      ReduceAll8(std::make_integer_sequence<int, 8>{}, n, in, out, ref);
      for (int k = 0; k < n; ++k) {
        ASSERT_EQ(Bits(out[k]), Bits(ref[k])) << "n=" << n << " k=" << k << ": " << out[k] << " vs " << ref[k];
        float seq = 0.0f;
        for (int i = 0; i < 8; ++i) seq += in[8 * k + i];
        differs_if_reordered += Bits(seq) != Bits(ref[k]);
      }
      for (int k = n; k < 8; ++k) EXPECT_EQ(Bits(out[k]), 0u) << "n=" << n << " k=" << k;
    }
  }
  EXPECT_GT(differs_if_reordered, 100);
}

// Stores lanes [k, k + n) of 0..7 into a buffer of sentinels and checks exactly those were written.
template <int n, int k>
void CheckStoreLanes8() {
  const __m256 v = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  float out[10];
  for (float& x : out) x = -1.0f;
  StoreLanes8<n, k>(v, out + 1);
  EXPECT_EQ(out[0], -1.0f) << n << " " << k;
  for (int i = 0; i < n; ++i) EXPECT_EQ(out[1 + i], static_cast<float>(k + i)) << n << " " << k << " " << i;
  for (int i = n + 1; i < 10; ++i) EXPECT_EQ(out[i], -1.0f) << n << " " << k << " " << i;
}

TEST(VecMath, StoreLanes8StoresTheNamedLanesOnly) {
  CheckStoreLanes8<8, 0>();
  CheckStoreLanes8<4, 0>();
  CheckStoreLanes8<4, 4>();
  CheckStoreLanes8<2, 0>();
  CheckStoreLanes8<2, 2>();
  CheckStoreLanes8<2, 4>();
  CheckStoreLanes8<2, 6>();
  CheckStoreLanes8<1, 0>();
  CheckStoreLanes8<1, 1>();
  CheckStoreLanes8<1, 2>();
  CheckStoreLanes8<1, 3>();
  CheckStoreLanes8<1, 5>();
  CheckStoreLanes8<1, 7>();
}

}  // namespace
}  // namespace keel
