// Feed-forward: the second half of every decoder layer, behind one interface so that dense SwiGLU,
// a sparse mixture of experts held in memory, and an offloaded MoE runtime (keel/moe: expert
// slots, copy engine, logical expert cache) are interchangeable per layer.
//
// Contract for every implementation: the output for a row depends only on that row's input and on
// its own sequence's history (never on the other rows of a batch, nor on timing), so prefill ==
// decode bit for bit and a batch gives each sequence what it would get alone. Rows of one
// sequence come in increasing positions; a stateful implementation (routing on per-sequence
// history) processes them in that order.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/metrics.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"

namespace keel::engine {

struct BatchToken;

struct FeedForwardBatch {
  int layer = 0;
  int m = 0;                          // rows
  const BatchToken* rows = nullptr;   // sequence, token and position of each row
  const float* x = nullptr;           // [m][dim] residual stream after attention (before the FFN norm)
  const float* xn = nullptr;          // [m][dim] x after the layer's ffn_norm: the FFN's input
};

// One layer's feed-forward. Not thread-safe (the Transformer calls it from one thread).
class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // Writes the feed-forward output of every row into out [m][dim]; the caller adds it to x.
  // An error (an offloaded expert that could not be read) fails the whole Forward.
  virtual Status Run(const FeedForwardBatch& in, float* out) = 0;
};

// The feed-forward of every layer of one model, plus the hooks a stateful one needs.
class FeedForwardStack {
 public:
  virtual ~FeedForwardStack() = default;
  virtual FeedForward& layer(int l) = 0;
  // A sequence ended (its id may be reused later): drop its per-sequence state.
  virtual void EndSequence(SeqId) {}
  // Registers the stack's metrics (read through callbacks; `registry` may render them from any
  // thread for as long as the stack lives). Default: none.
  virtual void RegisterMetrics(MetricsRegistry&) {}
  // True when outputs depend on a sequence's whole token history through state the stack keeps
  // (PSR's logical expert cache): such a sequence cannot resume from KV blocks computed by
  // another sequence, so prefix reuse is off.
  virtual bool history_dependent() const { return false; }
};

// Dense SwiGLU or in-memory MoE per layer, as the model's config says.
std::unique_ptr<FeedForwardStack> MakeResidentFeedForward(const Model& model);

// --- MoE building blocks, shared by the in-memory stack and keel/moe's offloaded runtime. ---

struct ExpertChoice {
  int expert = -1;
  float weight = 0.0f;
};

// Mixtral-style top-k routing of one row. `logits` [n_experts] are the router's outputs;
// `bonus` (nullable, [n_experts]) is added to them for *selection only* (PSR's cached-expert
// bonus); weights come from the unbiased softmax over all experts, renormalised over the chosen
// ones when moe.norm_topk. Ties go to the lower expert id, so selection is deterministic. Writes
// moe.top_k choices in decreasing (biased) score order.
void SelectExperts(const float* logits, const float* bonus, const MoeConfig& moe, ExpertChoice* out);

// SwiGLU of one expert (or a dense layer) over m rows: out[m][dim] = w2 (silu(w1 x) * (w3 x)).
// h1, h3 are scratch of m * hidden floats.
void SwiGlu(const ExpertWeights& w, const float* x, int m, float* h1, float* h3, float* out);

// Runs a MoE layer over rows whose experts are chosen: gathers each expert's rows, runs it on the
// weights `expert_weights(e)` returns (called once per used expert, in the order given by
// `expert_order`, or by id when empty), and combines every row's outputs in rank order (so the
// sum does not depend on the order experts ran in). Adds the shared expert when the layer has one.
class MoeCombiner {
 public:
  explicit MoeCombiner(const Model& model) : model_(model) {}
  // choices: [m][top_k]. Returns the distinct experts used, in id order.
  std::vector<int> UsedExperts(const ExpertChoice* choices, int m) const;
  // Runs expert `e` for the rows that chose it, storing into the per-(row, rank) buffer.
  void RunExpert(int e, const ExpertWeights& w, const float* xn, const ExpertChoice* choices, int m);
  // out[row] = sum over ranks of weight * expert output (+ shared expert of layer `l`).
  void Combine(int l, const float* xn, const ExpertChoice* choices, int m, float* out);
  // Sizes the buffers for m rows; call before RunExpert.
  void Begin(int m);

 private:
  const Model& model_;
  AlignedFloats y_;        // [m][top_k][dim]
  AlignedFloats gx_, gy_;  // gathered rows of one expert, its outputs
  AlignedFloats h1_, h3_;
  std::vector<int> rows_, ranks_;
};

}  // namespace keel::engine
