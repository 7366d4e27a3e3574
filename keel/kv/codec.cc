#include "keel/kv/codec.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "keel/kv/attention_math.h"

namespace keel::kv {

// The reference: every stored token read back through read_at(), then the shared arithmetic
// (DotF32, SoftmaxF32, AxpyF32) over stored then pending rows. Codecs that store at group end
// override it with something faster.
void Codec::attend_pending(int layer, const uint8_t* const* blocks, int n_stored, const float* q,
                           const float* pending_k, const float* pending_v, int n_pending, float* out,
                           AttendScratch& scratch) const {
  const KvShape& s = shape();
  const int hd = s.head_dim, kvd = s.kv_dim(), n = n_stored + n_pending, group = s.n_heads / s.n_kv_heads;
  float* k = scratch.get(static_cast<size_t>(n) * kvd * 2 + n);
  float* v = k + static_cast<size_t>(n) * kvd;
  float* p = v + static_cast<size_t>(n) * kvd;
  for (int t = 0; t < n_stored; ++t) {
    read_at(layer, blocks[t / s.block_tokens], t % s.block_tokens, t, k + static_cast<size_t>(t) * kvd,
            v + static_cast<size_t>(t) * kvd);
  }
  std::copy(pending_k, pending_k + static_cast<size_t>(n_pending) * kvd, k + static_cast<size_t>(n_stored) * kvd);
  std::copy(pending_v, pending_v + static_cast<size_t>(n_pending) * kvd, v + static_cast<size_t>(n_stored) * kvd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int h = 0; h < s.n_heads; ++h) {
    const int kvh = h / group;
    const float* qh = q + static_cast<size_t>(h) * hd;
    for (int t = 0; t < n; ++t) p[t] = DotF32(qh, k + static_cast<size_t>(t) * kvd + kvh * hd, hd) * scale;
    SoftmaxF32(p, n);
    float* o = out + static_cast<size_t>(h) * hd;
    std::fill(o, o + hd, 0.0f);
    for (int t = 0; t < n; ++t) AxpyF32(p[t], v + static_cast<size_t>(t) * kvd + kvh * hd, o, hd);
  }
}

}  // namespace keel::kv
