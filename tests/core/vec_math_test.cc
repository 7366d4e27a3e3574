// keel/core/vec_math.h: the batched reductions give ReduceLanes8's and ReduceLanes16's bits for
// every vector; StoreLanes8 and StoreLanes16 store the lanes they name and nothing else.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
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

// StoreLanes16<n, k> of 0..15 to out.
template <int n, int k>
void Store16(float* out) {
  StoreLanes16<n, k>(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), out);
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

// reduce(n, in, out, ref): the batched reduction of in's first n vectors of `lanes` floats into
// out[0..lanes), and the one-at-a-time reduction of each into ref[0..n).
using ReduceFn = std::function<void(int n, const float* in, float* out, float* ref)>;

void ExpectOneAtATimesBits(int lanes, uint32_t seed, const ReduceFn& reduce) {
  std::mt19937 rng(seed);
  // Magnitudes spread over 2^-20..2^20 so that the order of the additions shows in the bits; a
  // sum in another order differs in most trials.
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-20, 20);
  int differs_if_reordered = 0;
  for (int trial = 0; trial < 200; ++trial) {
    for (int n = 1; n <= lanes; ++n) {
      float in[16 * 16], out[16], ref[16];
      for (float& x : in) x = std::ldexp(mant(rng), expo(rng));
      reduce(n, in, out, ref);
      for (int k = 0; k < n; ++k) {
        ASSERT_EQ(Bits(out[k]), Bits(ref[k])) << "n=" << n << " k=" << k << ": " << out[k] << " vs " << ref[k];
        float seq = 0.0f;  // the plain left-to-right sum, to show the test can tell orders apart
        for (int i = 0; i < lanes; ++i) seq += in[lanes * k + i];
        differs_if_reordered += Bits(seq) != Bits(ref[k]);
      }
      for (int k = n; k < lanes; ++k) EXPECT_EQ(Bits(out[k]), 0u) << "n=" << n << " k=" << k;
    }
  }
  EXPECT_GT(differs_if_reordered, 100);
}

TEST(VecMath, ReduceLanes16xNGivesReduceLanes16sBits) {
  if (!cpu::Supports(cpu::Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512";
  ExpectOneAtATimesBits(16, 7, [](int n, const float* in, float* out, float* ref) {
    avx512::ReduceAll(std::make_integer_sequence<int, 16>{}, n, in, out, ref);
  });
}

TEST(VecMath, ReduceLanes8xNGivesReduceLanes8sBits) {
  ExpectOneAtATimesBits(8, 11, [](int n, const float* in, float* out, float* ref) {
    ReduceAll8(std::make_integer_sequence<int, 8>{}, n, in, out, ref);
  });
}

// store(out) stores lanes [k, k + n) of the vector 0, 1, 2, ... to out: exactly those land, in
// order, and the sentinels around them stay.
void ExpectLanesStored(int n, int k, const std::function<void(float*)>& store) {
  float out[18];
  for (float& x : out) x = -1.0f;
  store(out + 1);
  EXPECT_EQ(out[0], -1.0f) << n << " " << k;
  for (int i = 0; i < n; ++i) EXPECT_EQ(out[1 + i], static_cast<float>(k + i)) << n << " " << k << " " << i;
  for (int i = n + 1; i < 18; ++i) EXPECT_EQ(out[i], -1.0f) << n << " " << k << " " << i;
}

template <int n, int k>
void CheckStoreLanes8() {
  ExpectLanesStored(n, k, [](float* out) { StoreLanes8<n, k>(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), out); });
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

TEST(VecMath, StoreLanes16StoresTheNamedLanesOnly) {
  if (!cpu::Supports(cpu::Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512";
  // The shapes MatMul (rows of 4 or 6 sums) and attention (1 to 16 scores per head) store.
  ExpectLanesStored(16, 0, avx512::Store16<16, 0>);
  ExpectLanesStored(6, 0, avx512::Store16<6, 0>);
  ExpectLanesStored(6, 6, avx512::Store16<6, 6>);
  ExpectLanesStored(4, 12, avx512::Store16<4, 12>);
  ExpectLanesStored(8, 8, avx512::Store16<8, 8>);
  ExpectLanesStored(2, 14, avx512::Store16<2, 14>);
  ExpectLanesStored(1, 0, avx512::Store16<1, 0>);
  ExpectLanesStored(1, 15, avx512::Store16<1, 15>);
  ExpectLanesStored(3, 5, avx512::Store16<3, 5>);
}

}  // namespace
}  // namespace keel
