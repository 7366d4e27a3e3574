// Sampler: picks the next token from logits. Greedy when temperature == 0; otherwise
// temperature, then top-k, then top-p (nucleus) over the softmax, drawn with a per-sequence
// seeded generator so a (seed, prompt) pair always gives the same text.
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace keel::engine {

struct SamplingOptions {
  float temperature = 1.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off (0 keeps only the most likely token)
  uint64_t seed = 0;
  // OpenAI's penalties over the tokens this sampler has drawn (the completion so far): each
  // token's logit less presence_penalty once it has appeared and frequency_penalty per time.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<std::pair<int, float>> logit_bias;  // (token id, added to its logit)
};

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options);
  // Picks a token from `logits` (vocab floats), after logit_bias and the penalties; may modify
  // `logits` in place. Greedy picks are penalised and biased too, as OpenAI's are.
  int Sample(float* logits, int vocab);

 private:
  int Pick(float* logits, int vocab);
  SamplingOptions opt_;
  std::vector<std::pair<int, int>> drawn_;  // (token, times drawn), for the penalties
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int>> cand_;
};

int Argmax(const float* x, int n);

// Log-probabilities of the model's own distribution: the softmax of the raw logits, before
// temperature, top-k or top-p (what vLLM and OpenAI report). LogNormalizer returns
// log sum_i exp(x_i), taken from the maximum (8-lane float exp, summed in double), so
// log p_i = x_i - LogNormalizer.
double LogNormalizer(const float* logits, int vocab);
// The `k` most likely tokens of `logits` with their log-probabilities, most likely first (ties:
// smaller id first), into *out. `log_norm` is LogNormalizer(logits, vocab).
void TopLogprobs(const float* logits, int vocab, int k, double log_norm,
                 std::vector<std::pair<int, float>>* out);

}  // namespace keel::engine
