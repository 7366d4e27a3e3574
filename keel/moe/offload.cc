#include "keel/moe/offload.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "keel/core/aligned.h"
#include "keel/engine/transformer.h"

namespace keel::moe {

using engine::BatchToken;
using engine::ExpertChoice;
using engine::FeedForwardBatch;

Result<Policy> ParsePolicy(std::string_view name) {
  if (name == "lru") return Policy::kLru;
  if (name == "prefetch") return Policy::kPrefetch;
  if (name == "psr") return Policy::kPsr;
  if (name == "resident-bias") return Policy::kResidentBias;
  return Status::InvalidArgument("unknown MoE policy \"" + std::string(name) +
                                 "\" (lru, prefetch, psr, resident-bias)");
}

const char* PolicyName(Policy p) {
  switch (p) {
    case Policy::kLru: return "lru";
    case Policy::kPrefetch: return "prefetch";
    case Policy::kPsr: return "psr";
    case Policy::kResidentBias: return "resident-bias";
  }
  return "?";
}

Status ValidateOffloadOptions(const engine::ModelConfig& c, const OffloadOptions& o) {
  const engine::MoeConfig& moe = c.moe;
  if (!moe.enabled()) {
    return Status::InvalidArgument("expert offloading needs a mixture-of-experts model; this " + c.arch +
                                   " model is dense");
  }
  if (o.slots < moe.top_k || o.slots > moe.n_experts) {
    return Status::InvalidArgument(fmt::format("--moe-slots {} must be between top_k {} and the number of experts {}",
                                               o.slots, moe.top_k, moe.n_experts));
  }
  if (o.lookahead < 0 || o.lookahead > moe.top_k) {
    return Status::InvalidArgument(fmt::format("--moe-lookahead {} must be between 0 and top_k {}", o.lookahead, moe.top_k));
  }
  if (!(o.decay > 0.0f && o.decay < 1.0f)) {
    return Status::InvalidArgument(fmt::format("--moe-decay {} must be in (0, 1)", o.decay));
  }
  if (!(o.bonus >= 0.0f) || !std::isfinite(o.bonus)) {
    return Status::InvalidArgument(fmt::format("--moe-bonus {} must be finite and >= 0", o.bonus));
  }
  if (o.source != "dram" && o.source != "file-direct") {
    return Status::InvalidArgument("--moe-source \"" + o.source + "\" is not dram or file-direct");
  }
  if (!(o.copy.bandwidth_bytes_per_s >= 0) || !(o.copy.latency_s >= 0) || !(o.copy.jitter_s >= 0)) {
    return Status::InvalidArgument("copy model: bandwidth, latency and jitter must be >= 0");
  }
  return Status::Ok();
}

class OffloadedMoe::Layer final : public engine::FeedForward {
 public:
  Layer(OffloadedMoe* owner, int l) : owner_(owner), l_(l) {}
  Status Run(const FeedForwardBatch& in, float* out) override { return owner_->Run(l_, in, out); }

 private:
  OffloadedMoe* owner_;
  int l_;
};

OffloadedMoe::OffloadedMoe(const engine::Model& model, const OffloadOptions& options)
    : model_(model), options_(options), combiner_(model) {}

OffloadedMoe::~OffloadedMoe() {
  copies_.reset();  // joins the copy thread before the slots it writes are freed
}

Result<std::unique_ptr<OffloadedMoe>> OffloadedMoe::Create(const engine::Model& model, const OffloadOptions& options) {
  const engine::ModelConfig& c = model.config;
  KEEL_RETURN_IF_ERROR(ValidateOffloadOptions(c, options));
  std::unique_ptr<OffloadedMoe> o(new OffloadedMoe(model, options));
  if (options.source == "dram") {
    KEEL_ASSIGN_OR_RETURN(o->source_, MakeDramSource(model));
  } else {
    KEEL_ASSIGN_OR_RETURN(o->source_, MakeDirectFileSource(model));
  }
  o->layout_ = LayoutOf(model.layers[0].moe.experts[0]);
  o->copies_ = std::make_unique<CopyEngine>(*o->source_, o->layout_.bytes, options.copy);
  const int n = c.moe.n_experts, s = options.slots;
  o->slots_.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    Slots& sl = o->slots_[static_cast<size_t>(l)];
    // Page-aligned, and not zeroed: a slot is only read after a copy filled it.
    const size_t bytes = RoundUp(static_cast<uint64_t>(s) * o->layout_.bytes, 4096);
    sl.mem.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes)));
    if (sl.mem == nullptr) return Status::ResourceExhausted(fmt::format("expert slots: cannot allocate {} bytes", bytes));
    sl.expert.assign(static_cast<size_t>(s), -1);
    sl.ticket.assign(static_cast<size_t>(s), 0);
    sl.last_use.assign(static_cast<size_t>(s), 0);
    sl.slot_of.assign(static_cast<size_t>(n), -1);
    o->layers_.push_back(std::make_unique<Layer>(o.get(), l));
  }
  return o;
}

engine::FeedForward& OffloadedMoe::layer(int l) { return *layers_[static_cast<size_t>(l)]; }

std::vector<int> OffloadedMoe::resident(int l) const { return slots_[static_cast<size_t>(l)].expert; }

OffloadStats OffloadedMoe::stats() const {
  OffloadStats s;
  s.tokens = tokens_.load();
  s.lookups = lookups_.load();
  s.hits = hits_.load();
  s.demand_copies = demand_.load();
  s.prefetch_copies = prefetch_.load();
  const CopyStats cs = copies_->stats();
  s.bytes = cs.bytes;
  s.stall_s = cs.stall_s;
  return s;
}

void OffloadedMoe::RegisterMetrics(MetricsRegistry& r) {
  const std::string policy = PolicyName(options_.policy);
  auto stat = [this](auto field) { return [this, field] { return static_cast<double>(field(stats())); }; };
  r.AddCounter("keel_moe_expert_lookups_total", "Experts a layer step needed (distinct per step).", {"policy"})
      .WithLabels({policy}).SetCallback(stat([](const OffloadStats& s) { return s.lookups; }));
  r.AddCounter("keel_moe_expert_hits_total", "Needed experts already resident or in flight.", {"policy"})
      .WithLabels({policy}).SetCallback(stat([](const OffloadStats& s) { return s.hits; }));
  r.AddGauge("keel_moe_hit_ratio", "Expert hits / lookups since start.", {"policy"})
      .WithLabels({policy}).SetCallback(stat([](const OffloadStats& s) { return s.hit_ratio(); }));
  auto& copies = r.AddCounter("keel_moe_copies_total", "Expert copies into fast-memory slots, by cause.", {"policy", "cause"});
  copies.WithLabels({policy, "demand"}).SetCallback(stat([](const OffloadStats& s) { return s.demand_copies; }));
  copies.WithLabels({policy, "prefetch"}).SetCallback(stat([](const OffloadStats& s) { return s.prefetch_copies; }));
  r.AddCounter("keel_moe_copy_bytes_total", "Bytes copied into expert slots.", {"policy"})
      .WithLabels({policy}).SetCallback(stat([](const OffloadStats& s) { return s.bytes; }));
  r.AddCounter("keel_moe_stall_seconds_total", "Time compute waited for expert copies.", {"policy"})
      .WithLabels({policy}).SetCallback(stat([](const OffloadStats& s) { return s.stall_s; }));
  r.AddCounter("keel_moe_tokens_total", "Tokens computed through the offloaded experts.", {"policy"})
      .WithLabels({policy}).SetCallback(stat([](const OffloadStats& s) { return s.tokens; }));
  r.AddGauge("keel_moe_slots_per_layer", "Resident expert slots per layer.", {"policy"})
      .WithLabels({policy}).Set(options_.slots);
}

OffloadedMoe::SeqState& OffloadedMoe::StateOf(int l, const BatchToken& row) {
  auto it = sequences_.find(row.seq);
  if (it == sequences_.end() || (l == 0 && row.pos == 0)) {
    // A sequence's routing state starts with its first token (and restarts if it is recomputed).
    const engine::ModelConfig& c = model_.config;
    SeqState fresh;
    fresh.caches.assign(static_cast<size_t>(c.n_layers), LogicalCache(c.moe.n_experts, options_.slots, options_.decay));
    fresh.pending.resize(static_cast<size_t>(c.n_layers));
    it = sequences_.insert_or_assign(row.seq, std::move(fresh)).first;
  }
  return it->second;
}

void OffloadedMoe::ApplyPending(std::deque<Prediction>& pending, int pos, int n, LogicalCache& cache) {
  while (!pending.empty() && pending.front().pos <= pos) {
    const Prediction p = pending.front();
    pending.pop_front();
    if (p.pos != pos) continue;  // a row that never reached this layer (a failed Forward)
    for (int r = 0; r < n; ++r) cache.Insert(p.experts[r], p.experts, n);
  }
}

// Routes every row of layer l into choices_ (and, for psr, advances each sequence's logical
// caches in row order).
void OffloadedMoe::Route(int l, const FeedForwardBatch& in) {
  const engine::ModelConfig& c = model_.config;
  const int n = c.moe.n_experts, k = c.moe.top_k, dim = c.dim, m = in.m;
  const bool has_next = l + 1 < c.n_layers;
  logits_.resize(static_cast<size_t>(m) * n);
  choices_.resize(static_cast<size_t>(m) * k);
  bonus_.resize(static_cast<size_t>(n));
  engine::MatMul(model_.layers[static_cast<size_t>(l)].moe.router, in.xn, m, logits_.data());
  const bool predicts = has_next && options_.policy != Policy::kLru &&
                        !(options_.policy == Policy::kPsr && options_.lookahead == 0);
  if (predicts) {
    // The next layer's router on this layer's hidden state, under the next layer's norm.
    if (xnext_.size() < static_cast<size_t>(m) * dim) xnext_.resize(static_cast<size_t>(m) * dim);
    const engine::LayerWeights& nw = model_.layers[static_cast<size_t>(l + 1)];
    for (int i = 0; i < m; ++i) engine::RmsNorm(in.x + static_cast<size_t>(i) * dim, nw.ffn_norm, dim, c.rms_eps, &xnext_[static_cast<size_t>(i) * dim]);
    next_logits_.resize(static_cast<size_t>(m) * n);
    engine::MatMul(nw.moe.router, xnext_.data(), m, next_logits_.data());
  }
  const Slots& sl = slots_[static_cast<size_t>(l)];
  for (int i = 0; i < m; ++i) {
    const float* lg = &logits_[static_cast<size_t>(i) * n];
    ExpertChoice* ch = &choices_[static_cast<size_t>(i) * k];
    switch (options_.policy) {
      case Policy::kLru:
      case Policy::kPrefetch:
        engine::SelectExperts(lg, nullptr, c.moe, ch);
        break;
      case Policy::kResidentBias:
        for (int e = 0; e < n; ++e) {
          const int s = sl.slot_of[static_cast<size_t>(e)];
          bonus_[static_cast<size_t>(e)] = s >= 0 && copies_->Ready(sl.ticket[static_cast<size_t>(s)]) ? options_.bonus : 0.0f;
        }
        engine::SelectExperts(lg, bonus_.data(), c.moe, ch);
        break;
      case Policy::kPsr: {
        SeqState& state = StateOf(l, in.rows[i]);
        LogicalCache& cache = state.caches[static_cast<size_t>(l)];
        ApplyPending(state.pending[static_cast<size_t>(l)], in.rows[i].pos, options_.lookahead, cache);
        cache.Bonus(options_.bonus, bonus_.data());
        engine::SelectExperts(lg, bonus_.data(), c.moe, ch);
        int chosen[engine::kMaxTopK];
        for (int r = 0; r < k; ++r) chosen[r] = ch[r].expert;
        cache.Observe(chosen, k);
        // A chosen expert becomes resident to be computed: the logical cache mirrors that.
        for (int r = 0; r < k; ++r) cache.Insert(chosen[r], chosen, k);
        if (predicts) {
          ExpertChoice predicted[engine::kMaxTopK];
          engine::MoeConfig pick = c.moe;
          pick.top_k = options_.lookahead;
          engine::SelectExperts(&next_logits_[static_cast<size_t>(i) * n], nullptr, pick, predicted);
          Prediction p{in.rows[i].pos, {}};
          for (int r = 0; r < options_.lookahead; ++r) p.experts[r] = predicted[r].expert;
          state.pending[static_cast<size_t>(l + 1)].push_back(p);
        }
        break;
      }
    }
  }
}

int OffloadedMoe::Victim(int l, const std::vector<int>& pinned, const std::vector<uint8_t>* wanted) {
  Slots& sl = slots_[static_cast<size_t>(l)];
  int best = -1;
  auto rank = [&](int s) {
    // Lower is a better victim: empty, then unwanted, then wanted; LRU within each.
    const int e = sl.expert[static_cast<size_t>(s)];
    if (e < 0) return 0;
    return wanted != nullptr && (*wanted)[static_cast<size_t>(e)] ? 2 : 1;
  };
  for (int s = 0; s < static_cast<int>(sl.expert.size()); ++s) {
    const int e = sl.expert[static_cast<size_t>(s)];
    if (e >= 0 && std::find(pinned.begin(), pinned.end(), e) != pinned.end()) continue;
    if (best < 0 || rank(s) < rank(best) ||
        (rank(s) == rank(best) && sl.last_use[static_cast<size_t>(s)] < sl.last_use[static_cast<size_t>(best)])) {
      best = s;
    }
  }
  if (best >= 0 && sl.ticket[static_cast<size_t>(best)] != 0) {
    // The slot's memory may still be written by an earlier copy: it must land first.
    (void)copies_->Wait(sl.ticket[static_cast<size_t>(best)]);  // the slot is overwritten: its status is moot
    sl.ticket[static_cast<size_t>(best)] = 0;
  }
  return best;
}

void OffloadedMoe::Load(int l, int e, int slot, bool prefetch) {
  Slots& sl = slots_[static_cast<size_t>(l)];
  const int old = sl.expert[static_cast<size_t>(slot)];
  if (old >= 0) sl.slot_of[static_cast<size_t>(old)] = -1;
  sl.expert[static_cast<size_t>(slot)] = e;
  sl.slot_of[static_cast<size_t>(e)] = slot;
  sl.last_use[static_cast<size_t>(slot)] = ++clock_;
  sl.ticket[static_cast<size_t>(slot)] =
      copies_->Submit(l, e, SlotMem(l, slot), prefetch ? CopyEngine::Priority::kPrefetch : CopyEngine::Priority::kDemand);
  (prefetch ? prefetch_ : demand_).fetch_add(1, std::memory_order_relaxed);
}

void OffloadedMoe::Prefetch(int l, const std::vector<int>& experts, const std::vector<uint8_t>* wanted) {
  const Slots& sl = slots_[static_cast<size_t>(l)];
  for (int e : experts) {
    if (sl.slot_of[static_cast<size_t>(e)] >= 0) continue;
    // Never evict another expert this prefetch wants.
    const int s = Victim(l, experts, wanted);
    if (s < 0) return;
    const int victim = sl.expert[static_cast<size_t>(s)];
    if (victim >= 0 && wanted != nullptr && (*wanted)[static_cast<size_t>(victim)]) return;
    Load(l, e, s, /*prefetch=*/true);
  }
}

std::vector<int> OffloadedMoe::Needed(int l, int m) {
  std::vector<int> used = combiner_.UsedExperts(choices_.data(), m);
  const Slots& sl = slots_[static_cast<size_t>(l)];
  // Resident (landed first, then in flight) before missing: compute overlaps the copies.
  auto key = [&](int e) {
    const int s = sl.slot_of[static_cast<size_t>(e)];
    if (s < 0) return 2;
    return copies_->Ready(sl.ticket[static_cast<size_t>(s)]) ? 0 : 1;
  };
  std::stable_sort(used.begin(), used.end(), [&](int a, int b) { return key(a) < key(b); });
  int64_t hits = 0;
  for (int e : used) hits += sl.slot_of[static_cast<size_t>(e)] >= 0;
  lookups_.fetch_add(static_cast<int64_t>(used.size()), std::memory_order_relaxed);
  hits_.fetch_add(hits, std::memory_order_relaxed);
  return used;
}

void OffloadedMoe::PsrWanted(int l, const FeedForwardBatch& in) {
  const engine::ModelConfig& c = model_.config;
  const bool has_next = l + 1 < c.n_layers;
  wanted_here_.assign(static_cast<size_t>(c.moe.n_experts), 0);
  wanted_next_.assign(static_cast<size_t>(c.moe.n_experts), 0);
  for (int i = 0; i < in.m; ++i) {
    if (i + 1 < in.m && in.rows[i + 1].seq == in.rows[i].seq) continue;  // a sequence's last row has its final state
    SeqState& state = sequences_[in.rows[i].seq];
    for (int e : state.caches[static_cast<size_t>(l)].members()) wanted_here_[static_cast<size_t>(e)] = 1;
    if (!has_next) continue;
    // The next layer's cache as this row will find it: its predictions applied.
    LogicalCache next = state.caches[static_cast<size_t>(l + 1)];
    std::deque<Prediction> pending = state.pending[static_cast<size_t>(l + 1)];
    ApplyPending(pending, in.rows[i].pos, options_.lookahead, next);
    for (int e : next.members()) wanted_next_[static_cast<size_t>(e)] = 1;
  }
}

void OffloadedMoe::PrefetchNext(int l, int m) {
  const engine::MoeConfig& moe = model_.config.moe;
  const int n = moe.n_experts;
  if (options_.policy == Policy::kPsr) {
    std::vector<int> want;
    for (int e = 0; e < n; ++e) {
      if (wanted_next_[static_cast<size_t>(e)]) want.push_back(e);
    }
    Prefetch(l + 1, want, &wanted_next_);
  } else if (options_.policy != Policy::kLru) {
    // The next layer's router on this layer's hidden state (Route computed it).
    std::vector<int> predicted;
    engine::ExpertChoice p[engine::kMaxTopK];
    for (int i = 0; i < m; ++i) {
      engine::SelectExperts(&next_logits_[static_cast<size_t>(i) * n], nullptr, moe, p);
      for (int r = 0; r < moe.top_k; ++r) predicted.push_back(p[r].expert);
    }
    std::sort(predicted.begin(), predicted.end());
    predicted.erase(std::unique(predicted.begin(), predicted.end()), predicted.end());
    if (static_cast<int>(predicted.size()) > options_.slots) predicted.resize(static_cast<size_t>(options_.slots));
    Prefetch(l + 1, predicted, nullptr);
  }
}

Status OffloadedMoe::ComputeResident(int l, int e, const FeedForwardBatch& in) {
  Slots& sl = slots_[static_cast<size_t>(l)];
  const int s = sl.slot_of[static_cast<size_t>(e)];
  CopyEngine::Ticket& t = sl.ticket[static_cast<size_t>(s)];
  if (t != 0) {
    Status st = copies_->Wait(t);
    t = 0;
    if (!st.ok()) {
      // The slot holds garbage: forget it, and fail this Forward rather than compute with it.
      sl.slot_of[static_cast<size_t>(e)] = -1;
      sl.expert[static_cast<size_t>(s)] = -1;
      return Status(st.code(), fmt::format("expert {} of layer {}: {}", e, l, st.message()));
    }
  }
  sl.last_use[static_cast<size_t>(s)] = ++clock_;
  const engine::ExpertWeights& like = model_.layers[static_cast<size_t>(l)].moe.experts[static_cast<size_t>(e)];
  combiner_.RunExpert(e, ViewsIn(SlotMem(l, s), like, layout_), in.xn, choices_.data(), in.m);
  return Status::Ok();
}

Status OffloadedMoe::Run(int l, const FeedForwardBatch& in, float* out) {
  const bool psr = options_.policy == Policy::kPsr;
  if (l == 0) tokens_.fetch_add(in.m, std::memory_order_relaxed);
  Route(l, in);
  const std::vector<int> used = Needed(l, in.m);
  if (psr) PsrWanted(l, in);
  const Slots& sl = slots_[static_cast<size_t>(l)];
  combiner_.Begin(in.m);
  for (size_t next = 0; next < used.size();) {
    // A wave: at most `slots` experts resident at once (a batch may need more than fit).
    const size_t end = std::min(used.size(), next + static_cast<size_t>(options_.slots));
    const std::vector<int> wave(used.begin() + static_cast<std::ptrdiff_t>(next), used.begin() + static_cast<std::ptrdiff_t>(end));
    for (int e : wave) {
      if (sl.slot_of[static_cast<size_t>(e)] >= 0) continue;
      const int s = Victim(l, wave, psr ? &wanted_here_ : nullptr);
      // A wave holds at most `slots` experts, so an unpinned slot always exists.
      if (s < 0) return Status::Internal(fmt::format("layer {}: no free expert slot for expert {}", l, e));
      Load(l, e, s, /*prefetch=*/false);
    }
    // Queued behind the first wave's demand copies, ahead of the next layer's need.
    if (next == 0 && l + 1 < model_.config.n_layers) PrefetchNext(l, in.m);
    for (int e : wave) KEEL_RETURN_IF_ERROR(ComputeResident(l, e, in));
    next = end;
  }
  combiner_.Combine(l, in.xn, choices_.data(), in.m, out);
  return Status::Ok();
}

}  // namespace keel::moe
