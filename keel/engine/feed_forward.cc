#include "keel/engine/feed_forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/engine/transformer.h"

namespace keel::engine {

void SwiGlu(const ExpertWeights& w, const float* x, int m, float* h1, float* h3, float* out) {
  const int64_t hidden = w.w1.rows;
  const TensorView gate_up[2] = {w.w1, w.w3};
  float* const out_gate_up[2] = {h1, h3};
  MatMulSameInput(gate_up, x, m, out_gate_up);
  SiluMul(h1, h3, m * hidden);
  MatMul(w.w2, h1, m, out);
}

void SelectExperts(const float* logits, const float* bonus, const MoeConfig& moe, ExpertChoice* out) {
  const int n = moe.n_experts, k = moe.top_k;
  float mx = logits[0];
  for (int e = 1; e < n; ++e) mx = std::max(mx, logits[e]);
  float prob[kMaxExperts];
  float sum = 0.0f;
  for (int e = 0; e < n; ++e) sum += (prob[e] = std::exp(logits[e] - mx));
  bool taken[kMaxExperts] = {};
  float chosen_sum = 0.0f;
  for (int r = 0; r < k; ++r) {
    int best = -1;
    float best_score = 0.0f;
    for (int e = 0; e < n; ++e) {
      if (taken[e]) continue;
      const float s = logits[e] + (bonus != nullptr ? bonus[e] : 0.0f);
      if (best < 0 || s > best_score) best = e, best_score = s;  // strict >: ties to the lower id
    }
    taken[best] = true;
    out[r] = ExpertChoice{best, prob[best] / sum};
    chosen_sum += out[r].weight;
  }
  if (moe.norm_topk) {
    for (int r = 0; r < k; ++r) out[r].weight /= chosen_sum;
  }
}

void MoeCombiner::Begin(int m) {
  const ModelConfig& c = model_.config;
  const size_t need = static_cast<size_t>(m) * c.moe.top_k * c.dim;
  if (y_.size() < need) y_.resize(need);
  const size_t hidden = static_cast<size_t>(std::max(c.moe.expert_hidden, c.moe.shared_hidden));
  if (gx_.size() < static_cast<size_t>(m) * c.dim) {
    gx_.resize(static_cast<size_t>(m) * c.dim);
    gy_.resize(static_cast<size_t>(m) * c.dim);
  }
  if (h1_.size() < static_cast<size_t>(m) * hidden) {
    h1_.resize(static_cast<size_t>(m) * hidden);
    h3_.resize(static_cast<size_t>(m) * hidden);
  }
}

std::vector<int> MoeCombiner::UsedExperts(const ExpertChoice* choices, int m) const {
  const int k = model_.config.moe.top_k;
  std::vector<int> used;
  for (int i = 0; i < m * k; ++i) used.push_back(choices[i].expert);
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  return used;
}

void MoeCombiner::RunExpert(int e, const ExpertWeights& w, const float* xn, const ExpertChoice* choices, int m) {
  const int dim = model_.config.dim, k = model_.config.moe.top_k;
  rows_.clear();
  ranks_.clear();
  for (int i = 0; i < m; ++i) {
    for (int r = 0; r < k; ++r) {
      if (choices[i * k + r].expert == e) {
        rows_.push_back(i);
        ranks_.push_back(r);
      }
    }
  }
  const int n = static_cast<int>(rows_.size());
  if (n == 0) return;
  for (int j = 0; j < n; ++j) {
    std::memcpy(&gx_[static_cast<size_t>(j) * dim], xn + static_cast<size_t>(rows_[j]) * dim, sizeof(float) * dim);
  }
  SwiGlu(w, gx_.data(), n, h1_.data(), h3_.data(), gy_.data());
  for (int j = 0; j < n; ++j) {
    std::memcpy(&y_[(static_cast<size_t>(rows_[j]) * k + ranks_[j]) * dim], &gy_[static_cast<size_t>(j) * dim],
                sizeof(float) * dim);
  }
}

void MoeCombiner::Combine(int l, const float* xn, const ExpertChoice* choices, int m, float* out) {
  const ModelConfig& c = model_.config;
  const int dim = c.dim, k = c.moe.top_k;
  for (int i = 0; i < m; ++i) {
    float* o = out + static_cast<size_t>(i) * dim;
    for (int r = 0; r < k; ++r) {
      const float w = choices[i * k + r].weight;
      const float* y = &y_[(static_cast<size_t>(i) * k + r) * dim];
      if (r == 0) {
        for (int d = 0; d < dim; ++d) o[d] = w * y[d];
      } else {
        for (int d = 0; d < dim; ++d) o[d] += w * y[d];
      }
    }
  }
  const MoeWeights& mw = model_.layers[l].moe;
  if (mw.shared.w1.empty()) return;
  // Qwen2-MoE: out += sigmoid(xn . shared_gate) * SwiGLU_shared(xn).
  SwiGlu(mw.shared, xn, m, h1_.data(), h3_.data(), gy_.data());
  float gate[1];
  for (int i = 0; i < m; ++i) {
    MatMul(mw.shared_gate, xn + static_cast<size_t>(i) * dim, 1, gate);
    const float s = 1.0f / (1.0f + std::exp(-gate[0]));
    float* o = out + static_cast<size_t>(i) * dim;
    const float* y = &gy_[static_cast<size_t>(i) * dim];
    for (int d = 0; d < dim; ++d) o[d] += s * y[d];
  }
}

namespace {

// SwiGLU's hidden activations, shared by every dense layer of a stack: they run one at a time, so
// one buffer (grown once to the largest batch) serves all of them instead of one per layer.
struct SwiGluScratch {
  AlignedFloats h1, h3;
};

class DenseFeedForward final : public FeedForward {
 public:
  DenseFeedForward(const Model& model, int layer, SwiGluScratch* scratch)
      : w_{model.layers[layer].w1, model.layers[layer].w2, model.layers[layer].w3}, scratch_(scratch) {}
  Status Run(const FeedForwardBatch& in, float* out) override {
    const size_t need = static_cast<size_t>(in.m) * w_.w1.rows;
    if (scratch_->h1.size() < need) {
      scratch_->h1.resize(need);
      scratch_->h3.resize(need);
    }
    SwiGlu(w_, in.xn, in.m, scratch_->h1.data(), scratch_->h3.data(), out);
    return Status::Ok();
  }

 private:
  ExpertWeights w_;
  SwiGluScratch* scratch_;
};

// Every expert resident (the model's own views): exact routing.
class MoeFeedForward final : public FeedForward {
 public:
  MoeFeedForward(const Model& model, int layer, MoeCombiner* combiner)
      : model_(model), layer_(layer), combiner_(combiner) {}
  Status Run(const FeedForwardBatch& in, float* out) override {
    const MoeConfig& moe = model_.config.moe;
    const MoeWeights& w = model_.layers[layer_].moe;
    logits_.resize(static_cast<size_t>(in.m) * moe.n_experts);
    choices_.resize(static_cast<size_t>(in.m) * moe.top_k);
    MatMul(w.router, in.xn, in.m, logits_.data());
    for (int i = 0; i < in.m; ++i) {
      SelectExperts(&logits_[static_cast<size_t>(i) * moe.n_experts], nullptr, moe, &choices_[static_cast<size_t>(i) * moe.top_k]);
    }
    combiner_->Begin(in.m);
    for (int e : combiner_->UsedExperts(choices_.data(), in.m)) {
      combiner_->RunExpert(e, w.experts[e], in.xn, choices_.data(), in.m);
    }
    combiner_->Combine(layer_, in.xn, choices_.data(), in.m, out);
    return Status::Ok();
  }

 private:
  const Model& model_;
  int layer_;
  MoeCombiner* combiner_;
  std::vector<float> logits_;
  std::vector<ExpertChoice> choices_;
};

class ResidentStack final : public FeedForwardStack {
 public:
  explicit ResidentStack(const Model& model) : combiner_(model) {
    for (int l = 0; l < model.config.n_layers; ++l) {
      if (model.config.moe.enabled()) {
        layers_.push_back(std::make_unique<MoeFeedForward>(model, l, &combiner_));
      } else {
        layers_.push_back(std::make_unique<DenseFeedForward>(model, l, &swiglu_));
      }
    }
  }
  FeedForward& layer(int l) override { return *layers_[static_cast<size_t>(l)]; }

 private:
  MoeCombiner combiner_;  // scratch shared by the layers: they run one at a time
  SwiGluScratch swiglu_;
  std::vector<std::unique_ptr<FeedForward>> layers_;
};

}  // namespace

std::unique_ptr<FeedForwardStack> MakeResidentFeedForward(const Model& model) {
  return std::make_unique<ResidentStack>(model);
}

}  // namespace keel::engine
