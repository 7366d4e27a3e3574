#include "keel/engine/throughput.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>

#include "keel/core/aligned.h"
#include "keel/core/cpu.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"

namespace keel::engine {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
}  // namespace

double MeasureReadBandwidth(size_t bytes) {
  const size_t n = bytes / sizeof(float);
  std::unique_ptr<float[]> buf(new float[n]);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(i & 1023);
  double best = 0;
  volatile float sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
      // Four independent vector sums per thread keep enough loads in flight to saturate memory.
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static) nowait
      for (size_t i = 0; i < n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(&buf[i]));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(&buf[i + 8]));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(&buf[i + 16]));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(&buf[i + 24]));
      }
      float t[8];
      _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
      total += t[0] + t[7];
    }
    double secs = Seconds(t0, Clock::now());
    sink = sink + total;
    best = std::max(best, static_cast<double>(n * sizeof(float)) / secs / 1e9);
  }
  return best;
}

double MeasureMatMulPeak() {
  const int out = 2048, in = 768, rows = 64;
  AlignedFloats w(static_cast<size_t>(out) * in), x(static_cast<size_t>(rows) * in), y(static_cast<size_t>(rows) * out);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 97) * 1e-3f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 89) * 1e-3f;
  TensorView tv{w.data(), DType::kF32, out, in};
  double best = 1e30;
  for (int r = 0; r < 10; ++r) {
    auto t0 = Clock::now();
    MatMul(tv, x.data(), rows, y.data());
    best = std::min(best, Seconds(t0, Clock::now()));
  }
  return 2.0 * out * in * rows / best / 1e9;
}

Result<ThroughputReport> MeasureThroughput(const Model& model, const ThroughputOptions& o) {
  const ModelConfig& c = model.config;
  if (o.prompt_tokens < 1 || o.decode_tokens < 1 || o.prompt_tokens + o.decode_tokens > c.max_seq_len) {
    return Status::InvalidArgument("bench: prompt + decode tokens must fit the context of " +
                                   std::to_string(c.max_seq_len));
  }
  ThroughputReport rep;
  rep.threads = omp_get_max_threads();
  rep.bandwidth_gb_s = MeasureReadBandwidth();
  rep.matmul_gflops = MeasureMatMulPeak();
  double weights = 0;
  for (const LayerWeights& w : model.layers) {
    for (const TensorView* t : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3}) weights += t->bytes();
    if (c.moe.enabled()) {
      // A token reads the router and its top_k experts (a batch may read more: a lower bound).
      weights += w.moe.router.bytes() + w.moe.shared.bytes() + w.moe.shared_gate.bytes() +
                 static_cast<double>(c.moe.top_k) * w.moe.experts[0].bytes();
    }
  }
  weights += model.classifier.bytes();
  rep.weight_bytes = weights;
  const int len = o.prompt_tokens + o.decode_tokens;

  for (int seqs : o.concurrency) {
    KvCacheOptions ko;
    ko.prefix_sharing = false;  // measure compute, not cache hits
    ko.codec_params = o.kv_codec_params;
    // Room for every sequence plus slack.
    KEEL_ASSIGN_OR_RETURN(std::unique_ptr<kv::Codec> codec, MakeCacheCodec(model, o.kv_codec, ko));
    size_t per_block = 0;
    for (int g = 0; g < codec->n_groups(); ++g) per_block += codec->block_bytes(g);
    const double per_token = static_cast<double>(per_block) / ko.block_tokens;
    ko.budget_bytes = static_cast<size_t>(per_block) * static_cast<size_t>((len + 31) / 16 + 1) * seqs;
    ThroughputRow row;
    row.sequences = seqs;
    // One Transformer for every repeat: its scratch buffers are grown (first-touched) by the
    // first, as a server's are by its first requests (llama-bench warms up the same way).
    Transformer tf(model);
    for (int r = 0; r < o.repeats; ++r) {
      KEEL_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(model, o.kv_codec, ko));
      std::vector<float> logits;
      std::vector<std::vector<int>> prompts(seqs);
      for (int s = 0; s < seqs; ++s) {
        prompts[s].push_back(1);
        for (int i = 1; i < o.prompt_tokens; ++i) prompts[s].push_back(3 + (s * 131 + i * 17) % (c.vocab_size - 3));
        KEEL_RETURN_IF_ERROR(cache->BeginSequence(s, prompts[s]).status());
        KEEL_RETURN_IF_ERROR(cache->Reserve(s, len));
      }
      // Prefill: each sequence's prompt as one batch.
      auto t0 = Clock::now();
      std::vector<int> next(seqs);
      for (int s = 0; s < seqs; ++s) {
        std::vector<BatchToken> batch;
        for (int i = 0; i < o.prompt_tokens; ++i) batch.push_back({s, prompts[s][i], i, i + 1 == o.prompt_tokens});
        KEEL_RETURN_IF_ERROR(tf.Forward(batch, *cache, logits));
        cache->Commit(s, prompts[s].data(), o.prompt_tokens);
        next[s] = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      }
      auto t1 = Clock::now();
      // Decode: every sequence advances one token per step.
      for (int step = 0; step < o.decode_tokens; ++step) {
        std::vector<BatchToken> batch;
        for (int s = 0; s < seqs; ++s) batch.push_back({s, next[s], o.prompt_tokens + step, true});
        KEEL_RETURN_IF_ERROR(tf.Forward(batch, *cache, logits));
        for (int s = 0; s < seqs; ++s) {
          cache->Commit(s, &next[s], 1);
          const float* l = &logits[static_cast<size_t>(s) * c.vocab_size];
          next[s] = static_cast<int>(std::max_element(l, l + c.vocab_size) - l);
        }
      }
      auto t2 = Clock::now();
      row.prefill_tok_s = std::max(row.prefill_tok_s, seqs * o.prompt_tokens / Seconds(t0, t1));
      row.decode_tok_s = std::max(row.decode_tok_s, seqs * o.decode_tokens / Seconds(t1, t2));
    }
    const double mid = o.prompt_tokens + o.decode_tokens / 2.0;
    row.bytes_per_step = weights + static_cast<double>(seqs) * mid * per_token;
    row.roofline_tok_s = seqs * rep.bandwidth_gb_s * 1e9 / row.bytes_per_step;
    // Matmul FLOPs per token: two per weight element read (the embedding lookup is free).
    const double flops = 2.0 * (weights / DTypeSize(model.layers[0].wq.dtype));
    row.compute_bound_tok_s = rep.matmul_gflops * 1e9 / flops;
    rep.rows.push_back(row);
  }
  return rep;
}

std::string ThroughputReport::Table(const std::string& title) const {
  char buf[512];
  std::string out = "### " + title + "\n\n";
  std::snprintf(buf, sizeof(buf),
                "weights read per step: %.1f MB; measured read bandwidth: %.1f GB/s; measured matmul peak: "
                "%.1f GFLOP/s; threads: %d; kernels: %s\n\n",
                weight_bytes / 1e6, bandwidth_gb_s, matmul_gflops, threads,
                std::string(cpu::IsaName(cpu::ActiveIsa())).c_str());
  out += buf;
  out += "| sequences | prefill tok/s | decode tok/s | memory roofline tok/s | decode / memory roofline | "
         "compute bound tok/s | decode / min(bounds) |\n";
  out += "|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const ThroughputRow& r : rows) {
    const double bound = std::min(r.roofline_tok_s, r.compute_bound_tok_s);
    std::snprintf(buf, sizeof(buf), "| %d | %.0f | %.1f | %.1f | %.2f | %.1f | %.2f |\n", r.sequences, r.prefill_tok_s,
                  r.decode_tok_s, r.roofline_tok_s, r.decode_tok_s / r.roofline_tok_s, r.compute_bound_tok_s,
                  r.decode_tok_s / bound);
    out += buf;
  }
  return out;
}

}  // namespace keel::engine
