// KV capacity at a fixed memory budget: how many tokens of real model K/V a cache holds with
// each codec, same run. Sequences of --seq-tokens tokens (distinct, so nothing is shared) are
// prefilled through the model until the cache cannot reserve the next one; ZipFusion blocks are
// compacted as they fill (kv_cache.h), raw ones keep their size.
//
//   kv_capacity_bench --model PATH [--budget-mb 64] [--seq-tokens 512] [--codecs raw:bf16,zipfusion]
//                     [--churn STEPS]
//
// Prints a Markdown table: sequences and tokens held, bytes per token, capacity relative to the
// first codec.
//
// --churn STEPS: memory use under a serving-like churn instead (no model forward: K/V are
// synthetic normals with per-channel scales, written through the codec as the forward pass
// writes them). Up to 32 sequences of random length (64..4096 tokens) grow a block per step;
// finished ones are released and new ones start while the cache admits them. Reports how full
// the arena was, on average, when a sequence could not grow, and how many of those failures had
// enough free bytes in total (fragmentation) — the cost of moving blocks to variable sizes.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/transformer.h"

using namespace keel;
using namespace keel::engine;

namespace {

// Serving-like churn with synthetic K/V; prints one table row for `codec`.
int Churn(const Model& model, const std::string& codec, size_t budget_mb, int steps) {
  const ModelConfig& c = model.config;
  KvCacheOptions o;
  o.budget_bytes = budget_mb << 20;
  o.prefix_sharing = false;
  Result<std::unique_ptr<KvCache>> made = KvCache::Create(model, codec, o);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
    return 1;
  }
  KvCache& kv = **made;
  const int bt = kv.block_tokens(), kvd = c.n_kv_heads * c.head_dim();
  std::mt19937_64 rng(42);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> kscale(kvd), vscale(kvd), k(kvd), v(kvd);
  for (int i = 0; i < kvd; ++i) {
    kscale[i] = std::exp(0.8f * nd(rng));
    vscale[i] = 0.3f * std::exp(0.3f * nd(rng));
  }
  struct Seq {
    SeqId id;
    int len = 0, target = 0;
  };
  std::vector<Seq> live;
  SeqId next_id = 0;
  int64_t fails = 0, fragmented = 0, tokens_done = 0;
  double used_at_fail = 0, used_sum = 0, held_sum = 0;
  const uint64_t open_bytes = kv.budget_bytes() / static_cast<uint64_t>(kv.TotalBlocks());
  std::vector<int> toks(bt, 5);
  for (int step = 0; step < steps; ++step) {
    // Start sequences while there is room.
    while (live.size() < 32) {
      Seq s{next_id++, 0, 64 + static_cast<int>(rng() % (4096 - 64 + 1))};
      if (!kv.BeginSequence(s.id, {}).ok()) return 1;
      if (!kv.Reserve(s.id, bt).ok()) {
        kv.Release(s.id);
        break;
      }
      live.push_back(s);
    }
    // Grow every live sequence by one block; one that cannot grow is preempted (released).
    for (size_t i = 0; i < live.size();) {
      Seq& s = live[i];
      const int n = std::min(bt, s.target - s.len);
      if (!kv.Reserve(s.id, s.len + n).ok()) {
        const KvCacheStats st = kv.Stats();
        ++fails;
        used_at_fail += static_cast<double>(st.bytes_used) / st.bytes_total;
        if (static_cast<uint64_t>(st.bytes_total - st.bytes_used) >= open_bytes) ++fragmented;
        kv.Release(s.id);
        live[i] = live.back();
        live.pop_back();
        continue;
      }
      for (int t = 0; t < n; ++t) {
        for (int d = 0; d < kvd; ++d) {
          k[d] = kscale[d] * nd(rng);
          v[d] = vscale[d] * nd(rng);
        }
        for (int l = 0; l < c.n_layers; ++l) {
          int slot;
          uint8_t* block = kv.BlockFor(s.id, l, s.len + t, &slot);
          kv.codec().append(l, block, slot, k.data(), v.data());
        }
      }
      kv.Commit(s.id, toks.data(), n);
      s.len += n;
      tokens_done += n;
      if (s.len >= s.target) {
        kv.Release(s.id);
        live[i] = live.back();
        live.pop_back();
        continue;
      }
      ++i;
    }
    const KvCacheStats st = kv.Stats();
    used_sum += static_cast<double>(st.bytes_used) / st.bytes_total;
    for (const Seq& s : live) held_sum += s.len;
  }
  std::printf("| %s | %d | %lld | %.0f | %.1f %% | %lld | %.1f %% | %lld |\n", codec.c_str(), steps,
              static_cast<long long>(tokens_done), held_sum / steps, 100.0 * used_sum / steps,
              static_cast<long long>(fails),
              fails ? 100.0 * used_at_fail / fails : 0.0, static_cast<long long>(fragmented));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, codecs = "raw:bf16,zipfusion";
  size_t budget_mb = 64;
  int seq_tokens = 512, churn = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--model") model_path = argv[i + 1];
    else if (a == "--budget-mb") budget_mb = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--seq-tokens") seq_tokens = std::atoi(argv[i + 1]);
    else if (a == "--codecs") codecs = argv[i + 1];
    else if (a == "--churn") churn = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (model_path.empty() || seq_tokens < 2 || budget_mb == 0) {
    std::fprintf(stderr, "usage: %s --model PATH [--budget-mb 64] [--seq-tokens 512] [--codecs a,b]\n", argv[0]);
    return 2;
  }
  Result<Model> model = LoadModel(model_path);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const ModelConfig& c = model->config;
  if (churn > 0) {
    std::printf("%s: churn, budget %zu MiB, up to 32 sequences of 64..4096 tokens\n\n", model_path.c_str(), budget_mb);
    std::printf("| KV codec | steps | tokens written | tokens held (mean) | arena used (mean) | sequences that could not grow | arena used then | of those, with enough free bytes |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    std::stringstream list(codecs);
    std::string codec;
    while (std::getline(list, codec, ','))
      if (int rc = Churn(*model, codec, budget_mb, churn)) return rc;
    return 0;
  }
  if (seq_tokens > c.max_seq_len) seq_tokens = c.max_seq_len;
  Transformer tf(*model);
  std::printf("%s: %d layers, %d KV heads x head_dim %d; budget %zu MiB, %d-token sequences\n\n", model_path.c_str(),
              c.n_layers, c.n_kv_heads, c.head_dim(), budget_mb, seq_tokens);
  std::printf("| KV codec | sequences | tokens held | bytes / token | blocks compacted | capacity |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  std::stringstream list(codecs);
  std::string codec;
  int64_t first_tokens = 0;
  while (std::getline(list, codec, ',')) {
    KvCacheOptions o;
    o.budget_bytes = budget_mb << 20;
    o.prefix_sharing = false;
    Result<std::unique_ptr<KvCache>> cache = KvCache::Create(*model, codec, o);
    if (!cache.ok()) {
      std::fprintf(stderr, "%s\n", cache.status().ToString().c_str());
      return 1;
    }
    KvCache& kv = **cache;
    int64_t tokens = 0;
    int seqs = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (;; ++seqs) {
      std::vector<int> prompt(seq_tokens);
      prompt[0] = 1;
      for (int i = 1; i < seq_tokens; ++i) prompt[i] = 3 + (i * 7919 + seqs * 104729) % (c.vocab_size - 3);
      if (!kv.BeginSequence(seqs, prompt).ok()) return 1;
      if (!kv.Reserve(seqs, seq_tokens).ok()) break;
      // Prefill in chunks, as the scheduler does.
      for (int from = 0; from < seq_tokens; from += 256) {
        const int to = std::min(seq_tokens, from + 256);
        std::vector<BatchToken> batch;
        for (int p = from; p < to; ++p) batch.push_back({seqs, prompt[p], p, p + 1 == to});
        std::vector<float> logits;
        Status st = tf.Forward(batch, kv, logits);
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          return 1;
        }
        kv.Commit(seqs, prompt.data() + from, to - from);
      }
      tokens += seq_tokens;
    }
    const KvCacheStats st = kv.Stats();
    if (first_tokens == 0) first_tokens = tokens;
    std::printf("| %s | %d | %lld | %.0f | %lld | %.2fx |\n", codec.c_str(), seqs, static_cast<long long>(tokens),
                tokens ? static_cast<double>(st.bytes_used) / tokens : 0.0,
                static_cast<long long>(st.blocks_compacted), first_tokens ? static_cast<double>(tokens) / first_tokens : 0.0);
    std::fflush(stdout);
    std::fprintf(stderr, "%s: %.1f s\n", codec.c_str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 0;
}
