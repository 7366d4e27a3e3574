#include "keel/engine/sampler.h"

#include <algorithm>
#include <cmath>

namespace keel::engine {

int Argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

Sampler::Sampler(const SamplingOptions& options) : opt_(options), rng_(options.seed) {}

int Sampler::Sample(float* logits, int vocab) {
  if (opt_.temperature <= 0.0f) return Argmax(logits, vocab);
  const float inv_t = 1.0f / opt_.temperature;
  float mx = logits[0];
  for (int i = 1; i < vocab; ++i) mx = std::max(mx, logits[i]);
  cand_.clear();
  cand_.reserve(vocab);
  for (int i = 0; i < vocab; ++i) cand_.emplace_back(std::exp((logits[i] - mx) * inv_t), i);
  // Highest probability first; ties broken by id so the order is deterministic.
  auto by_prob = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = cand_.size();
  if (opt_.top_k > 0 && static_cast<size_t>(opt_.top_k) < keep) {
    keep = static_cast<size_t>(opt_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + static_cast<std::ptrdiff_t>(keep), cand_.end(), by_prob);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_prob);
  }
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += cand_[i].first;
  if (opt_.top_p < 1.0f) {
    double cum = 0.0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += cand_[i].first / total;
      if (cum >= opt_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    total = 0.0;
    for (size_t i = 0; i < keep; ++i) total += cand_[i].first;
  }
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += cand_[i].first;
    if (r < cum) return cand_[i].second;
  }
  return cand_[keep - 1].second;
}

}  // namespace keel::engine
