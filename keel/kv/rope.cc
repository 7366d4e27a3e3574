#include "keel/kv/rope.h"

namespace keel::kv {

void RotatePairs(float* v, int head_dim, const float* cos, const float* sin) {
  for (int j = 0; j < head_dim / 2; ++j) {
    const float v0 = v[2 * j], v1 = v[2 * j + 1];
    v[2 * j] = v0 * cos[j] - v1 * sin[j];
    v[2 * j + 1] = v0 * sin[j] + v1 * cos[j];
  }
}

}  // namespace keel::kv
