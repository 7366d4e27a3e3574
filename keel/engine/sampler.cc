#include "keel/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "keel/core/vec_math.h"

namespace keel::engine {

int Argmax(const float* x, int n) {
  int best = 0;
  while (best + 1 < n && std::isnan(x[best])) ++best;  // NaN never compares greater: skip it
  for (int i = best + 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

double LogNormalizer(const float* logits, int vocab) {
  float mx = logits[0];
  for (int i = 1; i < vocab; ++i) mx = std::max(mx, logits[i]);
  // exp in 8 float lanes (~1 ulp), summed in double lanes: ~10x faster than scalar double exp
  // (it runs per generated token over the whole vocabulary when logprobs are asked for), and
  // the logprobs come out as floats anyway.
  const __m256 vmax = _mm256_set1_ps(mx);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(logits + i), vmax));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < vocab; ++i) total += std::exp(static_cast<double>(logits[i]) - mx);
  return mx + std::log(total);
}

void TopLogprobs(const float* logits, int vocab, int k, double log_norm,
                 std::vector<std::pair<int, float>>* out) {
  out->clear();
  k = std::clamp(k, 0, vocab);
  if (k == 0) return;
  // A k-element min-heap (k is at most a few tens): one pass, no copy of the vocab. NaN ranks
  // lowest, so the order stays strict-weak whatever a corrupt model produces.
  auto value = [&](int i) { return std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i]; };
  auto better = [&](int a, int b) { return value(a) > value(b) || (value(a) == value(b) && a < b); };
  std::vector<int> heap;
  heap.reserve(static_cast<size_t>(k));
  for (int i = 0; i < vocab; ++i) {
    if (static_cast<int>(heap.size()) < k) {
      heap.push_back(i);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (better(i, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = i;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
  std::sort(heap.begin(), heap.end(), better);
  for (int id : heap) out->emplace_back(id, static_cast<float>(logits[id] - log_norm));
}

Sampler::Sampler(const SamplingOptions& options) : opt_(options), rng_(options.seed) {}

int Sampler::Sample(float* logits, int vocab) {
  for (const auto& [id, bias] : opt_.logit_bias) {
    if (id >= 0 && id < vocab) logits[id] += bias;
  }
  const bool penalised = opt_.presence_penalty != 0.0f || opt_.frequency_penalty != 0.0f;
  if (penalised) {
    for (const auto& [id, times] : drawn_) {
      if (id < vocab) logits[id] -= opt_.presence_penalty + opt_.frequency_penalty * static_cast<float>(times);
    }
  }
  const int token = Pick(logits, vocab);
  if (penalised) {
    // A completion draws few distinct tokens: a short list beats a vocab-sized table.
    auto it = std::find_if(drawn_.begin(), drawn_.end(), [token](const auto& d) { return d.first == token; });
    if (it == drawn_.end()) drawn_.emplace_back(token, 1);
    else ++it->second;
  }
  return token;
}

int Sampler::Pick(float* logits, int vocab) {
  if (opt_.temperature <= 0.0f) return Argmax(logits, vocab);
  const float inv_t = 1.0f / opt_.temperature;
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < vocab; ++i) mx = logits[i] > mx ? logits[i] : mx;  // NaN is passed over
  // Unnormalised probabilities, in place.
  double total = 0.0;
  for (int i = 0; i < vocab; ++i) {
    // NaN (a corrupt model's logits) weighs nothing: the sorts below need a strict weak order.
    const float p = std::exp((logits[i] - mx) * inv_t);
    logits[i] = std::isnan(p) ? 0.0f : p;
    total += logits[i];
  }
  const bool top_k = opt_.top_k > 0 && opt_.top_k < vocab;
  const bool top_p = opt_.top_p < 1.0f;
  if (!top_k && !top_p) {
    // Plain temperature sampling needs no ordering: one scan in id order (no sort of the vocab,
    // which would cost milliseconds per token at 32k+ entries).
    std::uniform_real_distribution<double> uni(0.0, total);
    double r = uni(rng_), cum = 0.0;
    for (int i = 0; i < vocab; ++i) {
      cum += logits[i];
      if (r < cum) return i;
    }
    return Argmax(logits, vocab);
  }
  // Highest probability first; ties broken by id so the order is deterministic.
  auto by_prob = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  cand_.clear();
  if (top_p && !top_k) {
    // Tokens below (1 - top_p) / (vocab - 1) of the mass can never be inside the nucleus
    // (llama2.c's cut), so only the few above it are sorted.
    const double cutoff = (1.0 - opt_.top_p) / (vocab - 1) * total;
    for (int i = 0; i < vocab; ++i)
      if (logits[i] >= cutoff) cand_.emplace_back(logits[i], i);
    // The cut can pass nothing: with equal logits and top_p < 1/vocab it lies above every token,
    // and NaN logits (a corrupt model) compare false. The most likely token is always in the
    // nucleus.
    if (cand_.empty()) return Argmax(logits, vocab);
  } else {
    for (int i = 0; i < vocab; ++i) cand_.emplace_back(logits[i], i);
  }
  size_t keep = cand_.size();
  if (top_k && static_cast<size_t>(opt_.top_k) < keep) {
    keep = static_cast<size_t>(opt_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + static_cast<std::ptrdiff_t>(keep), cand_.end(), by_prob);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_prob);
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) kept += cand_[i].first;
  if (top_p) {
    // The nucleus: the smallest prefix holding top_p of the (top-k restricted) mass.
    const double target = opt_.top_p * kept;
    double cum = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      cum += cand_[i].first;
      if (cum >= target) {
        keep = i + 1;
        break;
      }
    }
    kept = 0.0;
    for (size_t i = 0; i < keep; ++i) kept += cand_[i].first;
  }
  std::uniform_real_distribution<double> uni(0.0, kept);
  double r = uni(rng_), cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += cand_[i].first;
    if (r < cum) return cand_[i].second;
  }
  return cand_[keep - 1].second;  // r rounded up to kept
}

}  // namespace keel::engine
