// The arithmetic every codec's attention shares. A lossless codec decodes into fp32 rows and
// calls these same functions in the same order, which is what makes its output bit-identical
// to the raw codec's.
#pragma once

#include <cstddef>

namespace keel::kv {

// Dot product with a fixed 8-lane AVX2 accumulation order (deterministic for a given n).
float DotF32(const float* a, const float* b, int n);
// out[i] += w * x[i]
void AxpyF32(float w, const float* x, float* out, int n);
// In-place softmax over n scores: exp(x - max) / sum, with a vectorised exp (ExpF32) and an
// 8-lane sum; deterministic for a given n and input.
void SoftmaxF32(float* x, int n);
// The exp the softmax uses (relative error ~1e-7; 0 below -87.3).
float ExpF32(float x);

}  // namespace keel::kv
