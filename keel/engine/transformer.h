// Transformer: the Llama/Qwen2 forward pass over a flat batch of tokens from any number of
// sequences (prefill chunks and decode steps mixed), reading and writing K/V through the cache's
// codec. RMSNorm, RoPE, grouped-query attention, then each layer's FeedForward (feed_forward.h:
// dense SwiGLU, mixture of experts, or an offloaded MoE runtime); fp32 activations and accumulation;
// weights read in their stored dtype. Matmuls run every batch row against each weight row while
// it is in cache, parallel over output rows (OpenMP).
//
// Not thread-safe: one caller at a time (it owns scratch buffers).
#pragma once

#include <functional>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/status.h"
#include "keel/engine/feed_forward.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/matmul.h"
#include "keel/engine/vector_ops.h"
#include "keel/engine/model.h"
#include "keel/kv/codec.h"

namespace keel::engine {

struct BatchToken {
  SeqId seq = 0;
  int token = 0;
  int pos = 0;               // position in its sequence; K/V for [0, pos) are already stored
  bool want_logits = false;  // produce next-token logits for this row
};

// What one layer computed for the rows of a batch, before RoPE: for calibration (BellowsKV) and
// analysis. Row-major: x [n_rows][dim] (the layer input after RMSNorm), q_pre [n_rows][dim],
// k_pre and v [n_rows][kv_dim]; q and k heads in interleaved RoPE pair order (kv/rope.h). Rows are
// in batch order for per-layer codecs; codecs that store at group end see a group's rows a token
// step at a time.
struct LayerTrace {
  int layer = 0;
  int n_rows = 0;
  const BatchToken* rows = nullptr;
  const float* x = nullptr;
  const float* q_pre = nullptr;
  const float* k_pre = nullptr;
  const float* v = nullptr;
};
using LayerObserver = std::function<void(const LayerTrace&)>;

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
  // The feed-forward of every layer: by default the model's own (dense SwiGLU or in-memory MoE);
  // `stack` (not owned, outlives the Transformer; nullptr: back to the default) replaces it, e.g.
  // keel/moe's offloaded runtime.
  void SetFeedForward(FeedForwardStack* stack);
  FeedForwardStack& feed_forward() { return *ffn_; }
  // Called at every layer of every Forward (empty: none).
  void SetLayerObserver(LayerObserver observer) { observer_ = std::move(observer); }

 private:
  // How one layer's rows reach the cache.
  enum class KvMode { kAppend, kPending };
  void EnsureScratch(int n);
  // One decoder layer for `m` rows whose residual stream is x[0..m) (updated in place). kAppend:
  // K/V stored through the codec, then attention over the cache (consecutive rows of a sequence
  // attend together). kPending: nothing stored; each row attends over its stored predecessors
  // plus its own K/V, and the layer's TokenKv inputs are kept in group slot `in_group` for
  // store_group().
  Status RunLayer(int l, const BatchToken* rows, int m, float* x, KvCache& cache, KvMode mode, int in_group);
  void Attention(int l, const BatchToken* rows, int m, KvCache& cache, KvMode mode);
  // x += FFN(ffn_norm(x)) through the layer's FeedForward.
  Status FeedForwardLayer(int l, const BatchToken* rows, int m, float* x);
  // The codec stores at group end: each group runs one token step (one row per sequence) at a time.
  Status ForwardByGroupSteps(const std::vector<BatchToken>& batch, KvCache& cache);
  const Model& model_;
  std::unique_ptr<FeedForwardStack> own_ffn_;
  FeedForwardStack* ffn_;
  LayerObserver observer_;
  int cap_ = 0;
  AlignedFloats x_, xb_, q_, k_, v_, kpre_, att_, xo_;
  // Per layer of a group ([in_group][row]): the inputs store_group() needs.
  std::vector<AlignedFloats> gx_, gkpre_, gk_, gv_;
  std::vector<int> n_tokens_, runs_;
  std::vector<const uint8_t* const*> tables_;
  std::vector<kv::AttendScratch> attend_scratch_;
};


}  // namespace keel::engine
