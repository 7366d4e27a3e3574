#include "keel/engine/transformer.h"

#include "keel/kv/attention.h"
#include "keel/kv/rope.h"

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <unordered_map>

namespace keel::engine {

namespace {

void AddBias(float* x, const float* bias, int rows, int cols) {
  if (bias == nullptr) return;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < cols; ++i) x[r * cols + i] += bias[i];
}

}  // namespace

Transformer::Transformer(const Model& model)
    : model_(model), own_ffn_(MakeResidentFeedForward(model)), ffn_(own_ffn_.get()) {
  attend_scratch_.resize(static_cast<size_t>(omp_get_max_threads()));
}

void Transformer::SetFeedForward(FeedForwardStack* stack) { ffn_ = stack != nullptr ? stack : own_ffn_.get(); }

void Transformer::EnsureScratch(int n) {
  if (n <= cap_) return;
  const ModelConfig& c = model_.config;
  cap_ = n;
  x_.resize(static_cast<size_t>(n) * c.dim);
  xb_.resize(static_cast<size_t>(n) * c.dim);
  xo_.resize(static_cast<size_t>(n) * c.dim);
  q_.resize(static_cast<size_t>(n) * c.dim);
  att_.resize(static_cast<size_t>(n) * c.dim);
  k_.resize(static_cast<size_t>(n) * c.kv_dim());
  kpre_.resize(static_cast<size_t>(n) * c.kv_dim());
  v_.resize(static_cast<size_t>(n) * c.kv_dim());
}

Status Transformer::Forward(const std::vector<BatchToken>& batch, KvCache& cache, std::vector<float>& logits) {
  const ModelConfig& c = model_.config;
  const int n = static_cast<int>(batch.size());
  const int dim = c.dim;
  if (n == 0) {
    logits.clear();
    return Status::Ok();
  }
  for (const BatchToken& t : batch) {
    if (t.token < 0 || t.token >= c.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(t.token) + " outside vocabulary of " +
                                     std::to_string(c.vocab_size));
    }
    if (t.pos < 0 || t.pos >= c.max_seq_len) {
      return Status::InvalidArgument("position " + std::to_string(t.pos) + " outside context of " +
                                     std::to_string(c.max_seq_len));
    }
    if (cache.Capacity(t.seq) <= t.pos) {
      return Status::InvalidArgument("sequence " + std::to_string(t.seq) + " has no KV blocks reserved for position " +
                                     std::to_string(t.pos));
    }
  }
  EnsureScratch(n);
  const size_t row = DTypeSize(model_.embedding.dtype) * dim;
  for (int i = 0; i < n; ++i) {
    ConvertToF32(model_.embedding.dtype, static_cast<const uint8_t*>(model_.embedding.data) + row * batch[i].token,
                 &x_[static_cast<size_t>(i) * dim], dim);
  }

  if (cache.codec().stores_at_group_end()) {
    KEEL_RETURN_IF_ERROR(ForwardByGroupSteps(batch, cache));
  } else {
    for (int l = 0; l < c.n_layers; ++l) {
      KEEL_RETURN_IF_ERROR(RunLayer(l, batch.data(), n, x_.data(), cache, KvMode::kAppend, 0));
    }
  }

  int n_out = 0;
  for (int i = 0; i < n; ++i) {
    if (!batch[i].want_logits) continue;
    RmsNorm(&x_[i * dim], model_.final_norm, dim, c.rms_eps, &xb_[n_out * dim]);
    ++n_out;
  }
  logits.resize(static_cast<size_t>(n_out) * c.vocab_size);
  if (n_out > 0) MatMul(model_.classifier, xb_.data(), n_out, logits.data());
  return Status::Ok();
}

Status Transformer::ForwardByGroupSteps(const std::vector<BatchToken>& batch, KvCache& cache) {
  const ModelConfig& c = model_.config;
  const kv::Codec& codec = cache.codec();
  const int n = static_cast<int>(batch.size()), dim = c.dim, kvd = c.kv_dim();
  const int gs = codec.group_size();
  // Step of a row: its offset from its sequence's first row in the batch. Rows are reordered by
  // step (stably), so each step's rows (at most one per sequence) are contiguous.
  std::vector<int> step(n), order(n);
  std::unordered_map<SeqId, int> first_pos;
  for (int i = 0; i < n; ++i) {
    auto [it, fresh] = first_pos.emplace(batch[i].seq, batch[i].pos);
    if (!fresh) it->second = std::min(it->second, batch[i].pos);
  }
  int n_steps = 0;
  for (int i = 0; i < n; ++i) {
    step[i] = batch[i].pos - first_pos[batch[i].seq];
    n_steps = std::max(n_steps, step[i] + 1);
  }
  std::vector<int> step_begin(n_steps + 1, 0);
  for (int i = 0; i < n; ++i) ++step_begin[step[i] + 1];
  for (int s = 0; s < n_steps; ++s) step_begin[s + 1] += step_begin[s];
  {
    std::vector<int> at(step_begin.begin(), step_begin.end() - 1);
    for (int i = 0; i < n; ++i) order[at[step[i]]++] = i;
  }
  std::vector<BatchToken> rows(n);
  AlignedFloats xs(static_cast<size_t>(n) * dim);
  for (int j = 0; j < n; ++j) {
    rows[j] = batch[order[j]];
    std::memcpy(&xs[static_cast<size_t>(j) * dim], &x_[static_cast<size_t>(order[j]) * dim], sizeof(float) * dim);
  }
  // Sized per call: one Transformer may serve caches of different group sizes.
  if (static_cast<int>(gx_.size()) < gs) {
    gx_.resize(gs);
    gkpre_.resize(gs);
    gk_.resize(gs);
    gv_.resize(gs);
  }
  for (int i = 0; i < gs; ++i) {
    if (gx_[i].size() < static_cast<size_t>(n) * dim) gx_[i].resize(static_cast<size_t>(n) * dim);
    if (gkpre_[i].size() < static_cast<size_t>(n) * kvd) {
      gkpre_[i].resize(static_cast<size_t>(n) * kvd);
      gk_[i].resize(static_cast<size_t>(n) * kvd);
      gv_[i].resize(static_cast<size_t>(n) * kvd);
    }
  }
  std::vector<kv::TokenKv> tk(gs);
  for (int g = 0; g < codec.n_groups(); ++g) {
    const int l0 = codec.first_layer(g), nl = codec.layers_in(g);
    for (int s = 0; s < n_steps; ++s) {
      const int b = step_begin[s], m = step_begin[s + 1] - b;
      for (int li = 0; li < nl; ++li) {
        KEEL_RETURN_IF_ERROR(
            RunLayer(l0 + li, rows.data() + b, m, &xs[static_cast<size_t>(b) * dim], cache, KvMode::kPending, li));
      }
      for (int j = 0; j < m; ++j) {
        const BatchToken& t = rows[b + j];
        for (int li = 0; li < nl; ++li) {
          tk[li].pos = t.pos;
          tk[li].token = t.token;
          tk[li].x = &gx_[li][static_cast<size_t>(j) * dim];
          tk[li].k_pre = &gkpre_[li][static_cast<size_t>(j) * kvd];
          tk[li].k = &gk_[li][static_cast<size_t>(j) * kvd];
          tk[li].v = &gv_[li][static_cast<size_t>(j) * kvd];
        }
        int slot;
        uint8_t* block = cache.BlockFor(t.seq, l0, t.pos, &slot);
        codec.store_group(g, block, slot, tk.data());
      }
    }
  }
  for (int j = 0; j < n; ++j) {
    std::memcpy(&x_[static_cast<size_t>(order[j]) * dim], &xs[static_cast<size_t>(j) * dim], sizeof(float) * dim);
  }
  return Status::Ok();
}

Status Transformer::RunLayer(int l, const BatchToken* rows, int m, float* x, KvCache& cache, KvMode mode,
                           int in_group) {
  const ModelConfig& c = model_.config;
  const int dim = c.dim, kvd = c.kv_dim(), hd = c.head_dim();
  const LayerWeights& w = model_.layers[l];
  const kv::Codec& codec = cache.codec();
  for (int i = 0; i < m; ++i) RmsNorm(&x[i * dim], w.attn_norm, dim, c.rms_eps, &xb_[i * dim]);
  {
    const TensorView qkv[3] = {w.wq, w.wk, w.wv};
    float* const out[3] = {q_.data(), k_.data(), v_.data()};
    MatMulSameInput(qkv, xb_.data(), m, out);
  }
  AddBias(q_.data(), w.bq, m, dim);
  AddBias(k_.data(), w.bk, m, kvd);
  AddBias(v_.data(), w.bv, m, kvd);
  if (c.qk_norm) {
    // OLMoE normalises the whole q and k projections (before heads are split and rotated).
    for (int i = 0; i < m; ++i) {
      RmsNorm(&q_[i * dim], w.q_norm, dim, c.rms_eps, &q_[i * dim]);
      RmsNorm(&k_[i * kvd], w.k_norm, kvd, c.rms_eps, &k_[i * kvd]);
    }
  }
  float rope_tmp[kv::kMaxHeadDim];
  // Heads in interleaved pair order from here on; kpre_ keeps K before RoPE.
  if (c.rope_style == RopeStyle::kHalf) {
    for (int i = 0; i < m; ++i) {
      for (int h = 0; h < c.n_heads; ++h) kv::ToInterleavedPairs(&q_[i * dim + h * hd], hd, rope_tmp);
      for (int h = 0; h < c.n_kv_heads; ++h) kv::ToInterleavedPairs(&k_[i * kvd + h * hd], hd, rope_tmp);
    }
  }
  std::memcpy(kpre_.data(), k_.data(), sizeof(float) * static_cast<size_t>(m) * kvd);
  if (observer_) observer_(LayerTrace{l, m, rows, xb_.data(), q_.data(), kpre_.data(), v_.data()});
  // One row's angles serve all its q and k heads (RopeInterleaved = RopeAngles + RotatePairs).
  float rope_cos[kv::kMaxHeadDim / 2], rope_sin[kv::kMaxHeadDim / 2];
  for (int i = 0; i < m; ++i) {
    kv::RopeAngles(hd, rows[i].pos, c.rope_theta, rope_cos, rope_sin);
    for (int h = 0; h < c.n_heads; ++h) kv::RotatePairs(&q_[i * dim + h * hd], hd, rope_cos, rope_sin);
    for (int h = 0; h < c.n_kv_heads; ++h) kv::RotatePairs(&k_[i * kvd + h * hd], hd, rope_cos, rope_sin);
  }
  if (mode == KvMode::kAppend) {
    for (int i = 0; i < m; ++i) {
      const BatchToken& t = rows[i];
      int slot;
      uint8_t* block = cache.BlockFor(t.seq, l, t.pos, &slot);
      codec.append_token(l, block, slot,
                         kv::TokenKv{t.pos, t.token, &xb_[i * dim], &kpre_[i * kvd], &k_[i * kvd], &v_[i * kvd]});
    }
  } else {
    const size_t bytes_x = sizeof(float) * static_cast<size_t>(m) * dim, bytes_kv = sizeof(float) * m * kvd;
    std::memcpy(gx_[in_group].data(), xb_.data(), bytes_x);
    std::memcpy(gkpre_[in_group].data(), kpre_.data(), bytes_kv);
    std::memcpy(gk_[in_group].data(), k_.data(), bytes_kv);
    std::memcpy(gv_[in_group].data(), v_.data(), bytes_kv);
  }
  Attention(l, rows, m, cache, mode);
  MatMul(w.wo, att_.data(), m, xo_.data());
  for (size_t j = 0; j < static_cast<size_t>(m) * dim; ++j) x[j] += xo_[j];
  return FeedForwardLayer(l, rows, m, x);
}

void Transformer::Attention(int l, const BatchToken* rows, int m, KvCache& cache, KvMode mode) {
  const ModelConfig& c = model_.config;
  const int dim = c.dim, kvd = c.kv_dim();
  const kv::Codec& codec = cache.codec();
  tables_.resize(m);
  n_tokens_.resize(m);
  for (int i = 0; i < m; ++i) tables_[i] = cache.LayerBlocks(rows[i].seq, l);
  // Runs of consecutive positions of one sequence, at most kManyQueries long: runs[r]..runs[r+1].
  // Pending rows are one per sequence: each row is its own run.
  runs_.assign(1, 0);
  for (int i = 0; i < m; ++i) {
    n_tokens_[i] = rows[i].pos + 1;
    const bool extends = mode == KvMode::kAppend && i > 0 && rows[i].seq == rows[i - 1].seq &&
                         rows[i].pos == rows[i - 1].pos + 1 && i - runs_.back() < kv::kManyQueries;
    if (i > 0 && !extends) runs_.push_back(i);
  }
  runs_.push_back(m);
  // Every K/V of this layer for this batch is stored before any token attends, so tokens of
  // one sequence see their predecessors in the same batch (causal by n_tokens = pos + 1).
  // Consecutive tokens of one sequence attend together (attend_many reads each stored row once
  // for all of them); results equal attending one token at a time.
  const int n_runs = static_cast<int>(runs_.size()) - 1;
  int max_pos = 0;
  for (int i = 0; i < m; ++i) max_pos = std::max(max_pos, rows[i].pos);
  const bool par = n_runs > 1 && static_cast<int64_t>(m) * (max_pos + 1) * dim >= (1 << 14);
  auto attend_run = [&](int r) {
    kv::AttendScratch& scratch = attend_scratch_[static_cast<size_t>(omp_get_thread_num())];
    const int i = runs_[r], len = runs_[r + 1] - runs_[r];
    const size_t at = static_cast<size_t>(i) * dim;
    if (mode == KvMode::kPending) {
      codec.attend_pending(l, tables_[i], rows[i].pos, &q_[at], &k_[static_cast<size_t>(i) * kvd],
                           &v_[static_cast<size_t>(i) * kvd], 1, &att_[at], scratch);
    } else if (len == 1) {
      codec.attend(l, tables_[i], rows[i].pos + 1, &q_[at], &att_[at], scratch);
    } else {
      codec.attend_many(l, tables_[i], len, &n_tokens_[i], &q_[at], &att_[at], scratch);
    }
  };
  // Not `parallel for if (par)`: an inactive region still counts as a nesting level, and the
  // codec's own split across KV heads would then start a second thread team next to the
  // pool's spinning workers (three threads on two cores).
  if (par) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int r = 0; r < n_runs; ++r) attend_run(r);
  } else {
    for (int r = 0; r < n_runs; ++r) attend_run(r);
  }
}

Status Transformer::FeedForwardLayer(int l, const BatchToken* rows, int m, float* x) {
  const ModelConfig& c = model_.config;
  const int dim = c.dim;
  const LayerWeights& w = model_.layers[l];
  for (int i = 0; i < m; ++i) RmsNorm(&x[i * dim], w.ffn_norm, dim, c.rms_eps, &xb_[i * dim]);
  KEEL_RETURN_IF_ERROR(ffn_->layer(l).Run(FeedForwardBatch{l, m, rows, x, xb_.data()}, xo_.data()));
  for (size_t j = 0; j < static_cast<size_t>(m) * dim; ++j) x[j] += xo_[j];
  return Status::Ok();
}

}  // namespace keel::engine
