// Transformer: the Llama/Qwen2 forward pass over a flat batch of tokens from any number of
// sequences (prefill chunks and decode steps mixed), reading and writing K/V through the cache's
// codec. RMSNorm, RoPE, grouped-query attention, SwiGLU; fp32 activations and accumulation;
// weights read in their stored dtype. Matmuls run every batch row against each weight row while
// it is in cache, parallel over output rows (OpenMP).
//
// Not thread-safe: one caller at a time (it owns scratch buffers).
#pragma once

#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/status.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/kv/codec.h"

namespace keel::engine {

struct BatchToken {
  SeqId seq = 0;
  int token = 0;
  int pos = 0;               // position in its sequence; K/V for [0, pos) are already stored
  bool want_logits = false;  // produce next-token logits for this row
};

class Transformer {
 public:
  explicit Transformer(const Model& model);
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  // Runs the batch. Tokens of one sequence must be in increasing, contiguous positions, and the
  // cache must have blocks reserved for them. Writes one row of vocab_size logits per token with
  // want_logits, in batch order, into `logits` (resized). InvalidArgument for bad ids/positions.
  Status Forward(const std::vector<BatchToken>& batch, KvCache& cache, std::vector<float>& logits);

  const Model& model() const { return model_; }

 private:
  void EnsureScratch(int n);
  const Model& model_;
  int cap_ = 0;
  AlignedFloats x_, xb_, q_, k_, v_, att_, hb_, hb2_, xo_;
  std::vector<kv::AttendScratch> attend_scratch_;
};

// y[b][o] = sum_i W[o][i] * x[b][i] for b < n_rows; W in its stored dtype. Exposed for tests
// and benchmarks.
void MatMul(const TensorView& w, const float* x, int n_rows, float* y);
void RmsNorm(const float* x, const float* weight, int n, float eps, float* out);

}  // namespace keel::engine
