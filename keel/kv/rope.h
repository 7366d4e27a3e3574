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

// Rotates one head (interleaved pairs) in place for position `pos`.
inline void RopeInterleaved(float* v, int head_dim, int pos, float theta) {
  for (int j = 0; j < head_dim / 2; ++j) {
    const float val = static_cast<float>(pos) * RopeFrequency(j, head_dim, theta);
    const float c = std::cos(val), s = std::sin(val);
    const float v0 = v[2 * j], v1 = v[2 * j + 1];
    v[2 * j] = v0 * c - v1 * s;
    v[2 * j + 1] = v0 * s + v1 * c;
  }
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
