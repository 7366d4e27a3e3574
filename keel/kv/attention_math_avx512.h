// AVX-512 variants of the attention arithmetic (attention_math.h), in their own namespace and
// compiled for AVX-512 wherever this header is included (its own target region), so that no
// baseline function ever shares a symbol or an inline body with them. Called only when
// cpu::ActiveIsa() is kAvx512: attention_math.cc dispatches, the AVX-512 core calls them directly.
#pragma once

#include <immintrin.h>

#include "keel/core/cpu.h"
#include "keel/core/vec_math.h"
#include "keel/kv/attention_math.h"

KEEL_BEGIN_TARGET_AVX512
namespace keel::kv::avx512 {

// Sum of 16 lanes: the two 8-lane halves added (low + high), then ReduceLanes' order. Every
// reduction at the AVX-512 level (DotF32, the core's scores, the softmax sum) uses this order.
// (keel::avx512::ReduceLanes16 of vec_math.h, under the name the core uses.)
inline float ReduceLanes(__m512 acc) {
  return keel::avx512::ReduceLanes16(acc);
}

// The AVX-512 level of DotF32 (n % 16 == 0 only), AxpyF32 and SoftmaxF32 (attention_math.h).
float DotF32(const float* a, const float* b, int n);
void AxpyF32(float w, const float* x, float* out, int n);
void SoftmaxF32(float* x, int n);

}  // namespace keel::kv::avx512
KEEL_END_TARGET
