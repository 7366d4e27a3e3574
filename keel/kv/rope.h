// RoPE as the engine applies it, shared with codecs that store keys before RoPE and re-apply it
// on restore (bellows). Pairs are interleaved (2j, 2j+1): the engine moves half-style heads
// (Hugging Face's (j, j + head_dim/2)) into that order first (ToInterleavedPairs), so one rotation
// serves both layouts and its results equal the engine's bit for bit.
#pragma once

#include <cmath>
#include <cstring>

namespace keel::kv {

// Angle step of pair j: theta^(-2j/head_dim), in float as the engine computes it.
inline float RopeFrequency(int j, int head_dim, float theta) {
  return 1.0f / std::pow(theta, static_cast<float>(2 * j) / static_cast<float>(head_dim));
}

// cos and sin of pair j's angle at `pos` (head_dim/2 each), as every RoPE here computes them.
inline void RopeAngles(int head_dim, int pos, float theta, float* cos_out, float* sin_out) {
  for (int j = 0; j < head_dim / 2; ++j) {
    const float val = static_cast<float>(pos) * RopeFrequency(j, head_dim, theta);
    cos_out[j] = std::cos(val);
    sin_out[j] = std::sin(val);
  }
}

// Rotates one head's interleaved pairs by precomputed angles. One out-of-line copy (rope.cc): the
// compiler may fuse a*b - c*d into an FMA differently wherever it is inlined, and codecs that
// rotate restored keys must match the forward pass bit for bit.
void RotatePairs(float* v, int head_dim, const float* cos, const float* sin);

// Rotates one head (interleaved pairs) in place for position `pos`.
inline void RopeInterleaved(float* v, int head_dim, int pos, float theta) {
  float c[256], s[256];  // head_dim <= 512 (attention.h kMaxHeadDim)
  RopeAngles(head_dim, pos, theta, c, s);
  RotatePairs(v, head_dim, c, s);
}

// Moves one half-style head (pairs (j, j + head_dim/2)) into interleaved pair order in place;
// `tmp` holds head_dim floats.
inline void ToInterleavedPairs(float* v, int head_dim, float* tmp) {
  const int half = head_dim / 2;
  for (int j = 0; j < half; ++j) {
    tmp[2 * j] = v[j];
    tmp[2 * j + 1] = v[j + half];
  }
  std::memcpy(v, tmp, sizeof(float) * head_dim);
}

}  // namespace keel::kv
