// OffloadedMoe: a feed-forward stack for mixture-of-experts models whose experts do not fit in fast
// memory. Expert weights stay in a slow tier (ExpertSource: DRAM or the model file read with
// O_DIRECT); each layer has `slots` resident copies in fast memory, filled by a CopyEngine that
// stands in for PCIe; compute only ever reads resident copies.
//
// Policies (OffloadOptions::policy):
//   lru           exact routing; a needed expert that is not resident is copied on demand into
//                 the least recently used slot.
//   prefetch      exact routing; in addition, each layer applies the next layer's router to its
//                 hidden state and prefetches the predicted top-k experts (Mixtral-offloading's
//                 speculative loading).
//   psr           routing on a deterministic logical cache per sequence and layer (LogicalCache):
//                 cached experts get `bonus` added to their router logits; the next layer's router
//                 on the current hidden state predicts `lookahead` experts that enter that layer's
//                 logical cache; eviction by a moving average (`decay`) of past router choices.
//                 Physical slots follow the logical caches as prefetches: outputs depend only on
//                 token history, never on copy timing.
//   resident-bias the timing-dependent counter-example: the bonus goes to experts whose copies
//                 have *physically* landed at routing time (with prefetch as above), so outputs
//                 change with copy timing. For tests and comparison only.
// Exact policies (lru, prefetch) give the same outputs as the in-memory model, bit for bit.
//
// Not thread-safe (the Transformer drives it from one thread); stats() and MetricsText() may be
// read from any thread.
#pragma once

#include <atomic>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/core/status.h"
#include "keel/engine/feed_forward.h"
#include "keel/moe/copy_engine.h"
#include "keel/moe/expert_source.h"
#include "keel/moe/logical_cache.h"

namespace keel::moe {

enum class Policy { kLru, kPrefetch, kPsr, kResidentBias };
Result<Policy> ParsePolicy(std::string_view name);
const char* PolicyName(Policy p);

struct OffloadOptions {
  int slots = 0;                 // resident experts per layer: top_k <= slots <= n_experts
  Policy policy = Policy::kPsr;
  float bonus = 2.0f;            // psr / resident-bias: added to cached experts' router logits
  int lookahead = 1;             // psr: predicted experts entering the next layer's cache (0..top_k;
                                 // 0: no lookahead, the bonus alone on the logical cache)
  float decay = 0.9f;            // psr: moving-average decay of router choices, in (0, 1)
  std::string source = "dram";   // slow tier: "dram" (mapped model) or "file-direct" (O_DIRECT reads)
  CopyModel copy;                // the link's bandwidth, latency and injected faults
};
// Checks ranges against the model (InvalidArgument naming the option).
Status ValidateOffloadOptions(const engine::ModelConfig& c, const OffloadOptions& o);

struct OffloadStats {
  int64_t tokens = 0;           // rows routed at layer 0 (one per token computed)
  int64_t lookups = 0;          // experts a layer step needed (distinct per step)
  int64_t hits = 0;             // of those, resident or already in flight when needed
  int64_t demand_copies = 0;    // copies issued because a needed expert was missing
  int64_t prefetch_copies = 0;  // copies issued ahead of need
  int64_t bytes = 0;            // bytes of copies that have landed
  double stall_s = 0;           // time compute waited for copies
  double hit_ratio() const { return lookups > 0 ? static_cast<double>(hits) / lookups : 0.0; }
};

class OffloadedMoe final : public engine::FeedForwardStack {
 public:
  static Result<std::unique_ptr<OffloadedMoe>> Create(const engine::Model& model, const OffloadOptions& options);
  ~OffloadedMoe() override;

  engine::FeedForward& layer(int l) override;
  void EndSequence(engine::SeqId seq) override { sequences_.erase(seq); }
  void RegisterMetrics(MetricsRegistry& registry) override;
  bool history_dependent() const override { return options_.policy == Policy::kPsr; }

  OffloadStats stats() const;
  const OffloadOptions& options() const { return options_; }
  size_t expert_bytes() const { return layout_.bytes; }
  // The experts resident (or in flight) in layer l's slots, -1 for an empty slot.
  std::vector<int> resident(int l) const;

 private:
  class Layer;
  friend class Layer;
  struct Slots {
    struct Free {
      void operator()(uint8_t* p) const { std::free(p); }
    };
    std::unique_ptr<uint8_t, Free> mem;  // slots * layout.bytes, page-aligned (aligned_alloc)
    std::vector<int> expert;              // per slot, -1 empty
    std::vector<CopyEngine::Ticket> ticket;
    std::vector<uint64_t> last_use;
    std::vector<int> slot_of;             // per expert, -1 not resident
  };
  OffloadedMoe(const engine::Model& model, const OffloadOptions& options);
  Status Run(int l, const engine::FeedForwardBatch& in, float* out);
  // The distinct experts layer l's rows chose, resident ones first; counts lookups and hits.
  std::vector<int> Needed(int l, int m);
  // psr: wanted_here_ / wanted_next_ = the union of the rows' logical caches at l and l + 1.
  void PsrWanted(int l, const engine::FeedForwardBatch& in);
  // Prefetches for layer l + 1: psr its logical caches, prefetch the next router's top-k.
  void PrefetchNext(int l, int m);
  // Waits for expert e's copy in layer l (if in flight) and runs it on the rows that chose it.
  Status ComputeResident(int l, int e, const engine::FeedForwardBatch& in);
  void Route(int l, const engine::FeedForwardBatch& in);
  // A sequence's routing state: per layer its logical cache, and the lookahead predictions made
  // for it by the layer below, applied just before the row routes there (so a prefill chunk and
  // token-by-token decoding evolve the caches identically).
  struct Prediction {
    int pos;
    int experts[engine::kMaxTopK];
  };
  struct SeqState {
    std::vector<LogicalCache> caches;
    std::vector<std::deque<Prediction>> pending;
  };
  SeqState& StateOf(int l, const engine::BatchToken& row);
  static void ApplyPending(std::deque<Prediction>& pending, int pos, int n, LogicalCache& cache);
  // A slot of layer l to load into: empty first, then not pinned and (psr) not wanted, then LRU.
  // Waits for an in-flight copy into the chosen slot before returning it. -1 when all are pinned.
  int Victim(int l, const std::vector<int>& pinned, const std::vector<uint8_t>* wanted);
  void Load(int l, int e, int slot, bool prefetch);
  void Prefetch(int l, const std::vector<int>& experts, const std::vector<uint8_t>* wanted);
  uint8_t* SlotMem(int l, int slot) { return slots_[static_cast<size_t>(l)].mem.get() + static_cast<size_t>(slot) * layout_.bytes; }

  const engine::Model& model_;
  OffloadOptions options_;
  ExpertLayout layout_;
  std::unique_ptr<ExpertSource> source_;
  std::unique_ptr<CopyEngine> copies_;
  std::vector<Slots> slots_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unordered_map<engine::SeqId, SeqState> sequences_;
  engine::MoeCombiner combiner_;
  uint64_t clock_ = 0;
  // Scratch for one layer step.
  std::vector<float> logits_, next_logits_, bonus_;
  std::vector<engine::ExpertChoice> choices_;
  std::vector<uint8_t> wanted_here_, wanted_next_;
  AlignedFloats xnext_;
  std::atomic<int64_t> tokens_{0}, lookups_{0}, hits_{0}, demand_{0}, prefetch_{0};
};

}  // namespace keel::moe
