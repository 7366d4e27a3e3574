// Offloaded MoE decoding (issue 19): decode speed and quality of the expert-slot policies lru,
// prefetch and psr (keel/moe/offload.h) against each other and against the fully resident model,
// every configuration in the same process, on the same prompts and windows.
//
//   moe_offload_bench [--model DIR] [--text FILE] [--slots 2,4] [--decode 64] [--prompts 4]
//                     [--prompt-tokens 32] [--link-ratio 40] [--latency-us 10] [--bonus 2]
//                     [--lookahead 1] [--decay 0.9] [--windows 64] [--window 128]
//                     [--sweep-bonus 0.5,1,2,4] [--source file-direct] [--json FILE]
//
// 1. Compute reference: greedy decoding with every expert resident (the model's own feed-forward).
//    Its weight-streaming rate = active weight bytes per token (attention + router + top_k experts
//    per layer + classifier, as stored) / seconds per token (median decode step).
// 2. The link stands in for PCIe: bandwidth = that rate / --link-ratio (default 40: an RTX 4090's
//    ~1000 GB/s memory over PCIe 4.0 x16's ~25 GB/s), plus --latency-us per copy.
// 3. Decode: per resident-slot count and policy (psr at --bonus and at every --sweep-bonus), a
//    fresh OffloadedMoe (empty slots) on the paced link decodes --decode greedy tokens after each
//    of --prompts prompts (the first --prompt-tokens tokens of documents of the text at fixed,
//    evenly spread offsets). Prefill is untimed (the first prompt's prefill is the warm-up);
//    only decode steps (Forward + Commit) are timed, and the OffloadStats counted are those of
//    the decode steps. The configurations take turns prompt by prompt (the first one rotating),
//    so load changes on a shared machine hit each alike; never step by step, which would let one
//    configuration's copies land during another's compute.
// 4. Quality, teacher-forced: --windows windows of --window tokens spread evenly over the text
//    (documents split at blank lines, each encoded with its own BOS, as the trainer streams text);
//    each window is a fresh sequence, one Forward with logits on every row (PSR's routing is the
//    same in a prefill as token by token: tests/moe/offload_test.cc), row i predicting token i+1,
//    row 0 unscored. Copies are unpaced here: with these policies outputs never depend on copy
//    timing. Per configuration: accuracy, mean NLL, top-1 agreement with lru's argmax at the same
//    slots, relative changes vs lru, and whether the logits are bit-identical to the resident
//    model's (the exact policies must be: the harness's own check).
// 5. --source file-direct: the decode rows again with experts read by O_DIRECT from the model
//    file, unpaced (real disk I/O).
// Markdown tables on stdout (docs/results.md), progress on stderr, and a last stdout line
// "summary {json}" for scripts. Issue 19's goal: psr >= 2.2x lru's decode speed at the same slots
// with accuracy and NLL within 1% of lru's; every psr row says whether it meets it.
#include <CLI/CLI.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "keel/core/hash.h"
#include "keel/core/mapped_file.h"
#include "keel/engine/engine.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/tokenizer.h"
#include "keel/engine/transformer.h"
#include "keel/moe/expert_source.h"
#include "keel/moe/offload.h"

using namespace keel;
using namespace keel::engine;
using keel::moe::OffloadedMoe;
using keel::moe::OffloadOptions;
using keel::moe::OffloadStats;
using keel::moe::Policy;

namespace {

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr double kGoalSpeedup = 2.2;
constexpr double kGoalQualityPct = 1.0;

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model, text, source = "dram", json, command;
  std::vector<int> slots = {2, 4};
  int decode = 64;
  int prompts = 4;
  int prompt_tokens = 32;
  double link_ratio = 40;
  double latency_us = 10;
  float bonus = 2.0f;
  int lookahead = 1;
  float decay = 0.9f;
  int windows = 64;
  int window = 128;
  std::vector<float> sweep = {0.5f, 1.0f, 2.0f, 4.0f};
};

// One measured configuration: the resident model (slots 0) or an OffloadedMoe.
struct Config {
  int slots = 0;
  Policy policy = Policy::kLru;
  float bonus = 0;
  bool resident() const { return slots == 0; }
  std::string name() const {
    if (resident()) return "resident";
    char b[64];
    if (policy == Policy::kPsr) {
      std::snprintf(b, sizeof b, "psr b=%g", bonus);
      return b;
    }
    return moe::PolicyName(policy);
  }
};

struct DecodeRow {
  Config cfg;
  std::unique_ptr<OffloadedMoe> moe;
  double seconds = 0;  // decode steps only
  int64_t tokens = 0;
  OffloadStats d;      // stats of the decode steps
  int64_t leading = 0; // greedy tokens equal to the resident model's before the first difference
  std::string error;   // creation failed (e.g. O_DIRECT refused): the row is reported, not run
  double tok_s() const { return seconds > 0 ? static_cast<double>(tokens) / seconds : 0; }
  double per_token(double v) const { return tokens > 0 ? v / static_cast<double>(tokens) : 0; }
};

struct QualityRow {
  Config cfg;
  int64_t predictions = 0, correct = 0, agree = 0;
  double nll = 0;
  std::vector<int> argmax;       // every scored row of every window
  std::vector<Hash128> digests;  // per window, of all its logits
  double acc() const { return predictions ? static_cast<double>(correct) / predictions : 0; }
  double mean_nll() const { return predictions ? nll / static_cast<double>(predictions) : 0; }
  double agreement() const { return predictions ? static_cast<double>(agree) / predictions : 0; }
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

int Argmax(const float* l, int n) { return static_cast<int>(std::max_element(l, l + n) - l); }

double Nll(const float* l, int n, int target) {
  const float m = *std::max_element(l, l + n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(l[i]) - m);
  return std::log(sum) + m - l[target];
}

OffloadStats Minus(const OffloadStats& a, const OffloadStats& b) {
  OffloadStats d;
  d.tokens = a.tokens - b.tokens;
  d.lookups = a.lookups - b.lookups;
  d.hits = a.hits - b.hits;
  d.demand_copies = a.demand_copies - b.demand_copies;
  d.prefetch_copies = a.prefetch_copies - b.prefetch_copies;
  d.bytes = a.bytes - b.bytes;
  d.stall_s = a.stall_s - b.stall_s;
  return d;
}

void Add(OffloadStats& a, const OffloadStats& d) {
  a.tokens += d.tokens;
  a.lookups += d.lookups;
  a.hits += d.hits;
  a.demand_copies += d.demand_copies;
  a.prefetch_copies += d.prefetch_copies;
  a.bytes += d.bytes;
  a.stall_s += d.stall_s;
}

// The weights one decode token reads, in stored dtype: attention, router and top_k experts per
// layer, and the classifier (norms and the one embedding row are negligible and left out).
int64_t ActiveBytes(const Model& m) {
  int64_t b = static_cast<int64_t>(m.classifier.bytes());
  const int k = m.config.moe.top_k;
  for (const LayerWeights& l : m.layers) {
    b += static_cast<int64_t>(l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes());
    b += static_cast<int64_t>(l.moe.router.bytes() + l.moe.shared.bytes() + l.moe.shared_gate.bytes());
    b += static_cast<int64_t>(k) * static_cast<int64_t>(l.moe.experts[0].bytes());
  }
  return b;
}

// The text's documents (split at blank lines, whitespace-only ones dropped), each encoded as
// run.c does with its own BOS: how the trainer streams text.
std::vector<std::vector<int>> EncodeDocs(const Tokenizer& tok, const std::string& text) {
  std::vector<std::vector<int>> docs;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find("\n\n", at);
    if (end == std::string::npos) end = text.size();
    std::string_view doc = std::string_view(text).substr(at, end - at);
    if (doc.find_first_not_of(" \t\r\n\v\f") != std::string_view::npos) docs.push_back(tok.Encode(doc, /*bos=*/true));
    at = end + 2;
  }
  return docs;
}

// Prompt i: the first n tokens of the first document of at least n tokens from document
// (i + 1/2) * docs / count on.
std::vector<std::vector<int>> PickPrompts(const std::vector<std::vector<int>>& docs, int count, int n) {
  std::vector<std::vector<int>> out;
  for (int i = 0; i < count; ++i) {
    for (size_t d = (2 * static_cast<size_t>(i) + 1) * docs.size() / (2 * static_cast<size_t>(count)); d < docs.size(); ++d) {
      if (static_cast<int>(docs[d].size()) >= n) {
        out.emplace_back(docs[d].begin(), docs[d].begin() + n);
        break;
      }
    }
  }
  return out;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Greedy-decodes `decode` tokens after `prompt` as sequence `id` through `stack` (nullptr: the
// model's own feed-forward). The prefill is one untimed Forward; each decode step (Forward +
// Commit) is timed into `step_s`. `moe`'s stats over the decode steps are added to `stats`.
Status DecodeOne(Transformer& tf, KvCache& cache, OffloadedMoe* moe, SeqId id, const std::vector<int>& prompt,
                 int decode, std::vector<int>& out, std::vector<double>& step_s, OffloadStats& stats) {
  tf.SetFeedForward(moe);
  const int n = static_cast<int>(prompt.size()), vocab = tf.model().config.vocab_size;
  Status st = cache.BeginSequence(id, {}).status();
  if (st.ok()) st = cache.Reserve(id, n + decode);
  std::vector<float> logits;
  std::vector<BatchToken> batch;
  for (int i = 0; i < n; ++i) batch.push_back({id, prompt[i], i, i + 1 == n});
  if (st.ok()) st = tf.Forward(batch, cache, logits);
  if (st.ok()) cache.Commit(id, prompt.data(), n);
  out.clear();
  const OffloadStats before = moe ? moe->stats() : OffloadStats{};
  for (int d = 0; st.ok() && d < decode; ++d) {
    int token = Argmax(logits.data(), vocab);
    out.push_back(token);
    const auto t0 = Clock::now();
    st = tf.Forward({{id, token, n + d, true}}, cache, logits);
    if (st.ok()) cache.Commit(id, &token, 1);
    step_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (moe) {
    Add(stats, Minus(moe->stats(), before));
    moe->EndSequence(id);
  }
  cache.Release(id);
  tf.SetFeedForward(nullptr);
  return st;
}

int64_t LeadingMatch(const std::vector<int>& a, const std::vector<int>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

OffloadOptions MakeOptions(const Options& o, const Config& c, const std::string& source, const moe::CopyModel& link) {
  OffloadOptions oo;
  oo.slots = c.slots;
  oo.policy = c.policy;
  oo.bonus = c.policy == Policy::kPsr ? c.bonus : o.bonus;
  oo.lookahead = o.lookahead;
  oo.decay = o.decay;
  oo.source = source;
  oo.copy = link;
  return oo;
}

// Runs every row over every prompt, the rows taking turns prompt by prompt.
Status RunDecodeRows(const Model& model, KvCache& cache, std::vector<DecodeRow>& rows,
                     const std::vector<std::vector<int>>& prompts, int decode,
                     const std::vector<std::vector<int>>& resident_out, SeqId& next_id, const char* what) {
  Transformer tf(model);
  std::vector<int> out;
  for (size_t p = 0; p < prompts.size(); ++p) {
    std::fprintf(stderr, "%s: prompt %zu/%zu, %zu configurations\n", what, p + 1, prompts.size(), rows.size());
    for (size_t k = 0; k < rows.size(); ++k) {
      DecodeRow& r = rows[(k + p) % rows.size()];
      if (!r.error.empty()) continue;
      std::vector<double> steps;
      const SeqId id = next_id++;
      Status st = DecodeOne(tf, cache, r.moe.get(), id, prompts[p], decode, out, steps, r.d);
      if (!st.ok()) return Status(st.code(), r.cfg.name() + ": " + st.message());
      for (double s : steps) r.seconds += s;
      r.tokens += static_cast<int64_t>(steps.size());
      r.leading += LeadingMatch(out, resident_out[p]);
    }
  }
  return Status::Ok();
}

const DecodeRow* FindDecode(const std::vector<DecodeRow>& rows, int slots, Policy p, float bonus = 0) {
  for (const DecodeRow& r : rows) {
    if (r.cfg.slots == slots && r.cfg.policy == p && (p != Policy::kPsr || r.cfg.bonus == bonus)) return &r;
  }
  return nullptr;
}

const QualityRow* FindQuality(const std::vector<QualityRow>& rows, int slots, Policy p, float bonus = 0) {
  for (const QualityRow& r : rows) {
    if (r.cfg.slots == slots && r.cfg.policy == p && (p != Policy::kPsr || r.cfg.bonus == bonus)) return &r;
  }
  return nullptr;
}

double Pct(double v, double base) { return base != 0 ? (v - base) / base * 100.0 : 0; }

// The rows `show` accepts; "vs lru" against lru at the same slots in `rows`.
void PrintDecodeTable(const std::vector<DecodeRow>& rows, int n_experts, int decode,
                      const std::function<bool(const Config&)>& show) {
  std::printf("| slots | policy | decode tok/s | vs lru | demand copies/tok | prefetch copies/tok | KB copied/tok | "
              "stall ms/tok | hit ratio | greedy = resident |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const DecodeRow& r : rows) {
    if (!show(r.cfg)) continue;
    char slots[32];
    if (r.cfg.resident()) {
      std::snprintf(slots, sizeof slots, "%d (all)", n_experts);
    } else {
      std::snprintf(slots, sizeof slots, "%d (%.0f%%)", r.cfg.slots, 100.0 * r.cfg.slots / n_experts);
    }
    if (!r.error.empty()) {
      std::printf("| %s | %s | not run: %s |||||||\n", slots, r.cfg.name().c_str(), r.error.c_str());
      continue;
    }
    const DecodeRow* lru = FindDecode(rows, r.cfg.slots, Policy::kLru);
    const std::string vs = r.cfg.resident() || lru == nullptr || lru->tok_s() <= 0
                               ? "" : fmt::format("{:.2f}x", r.tok_s() / lru->tok_s());
    const double runs = r.tokens > 0 ? static_cast<double>(r.tokens) / decode : 1;
    std::printf("| %s | %s | %.1f | %s | %.2f | %.2f | %.0f | %.2f | %.3f | %.1f/%d |\n", slots, r.cfg.name().c_str(),
                r.tok_s(), vs.c_str(), r.per_token(static_cast<double>(r.d.demand_copies)),
                r.per_token(static_cast<double>(r.d.prefetch_copies)), r.per_token(static_cast<double>(r.d.bytes)) / 1024,
                r.per_token(r.d.stall_s) * 1e3, r.cfg.resident() ? 1.0 : r.d.hit_ratio(),
                static_cast<double>(r.leading) / runs, decode);
  }
}

// Issue 19's goal for a psr row: speed >= 2.2x lru at the same slots, accuracy and NLL within 1%.
bool MeetsGoal(const DecodeRow& d, const DecodeRow& lru, const QualityRow& q, const QualityRow& qlru) {
  return lru.tok_s() > 0 && d.tok_s() / lru.tok_s() >= kGoalSpeedup && Pct(q.acc(), qlru.acc()) >= -kGoalQualityPct &&
         Pct(q.mean_nll(), qlru.mean_nll()) <= kGoalQualityPct;
}

int Run(const Options& o) {
  Result<Model> model_or = LoadModel(o.model);
  if (!model_or.ok()) {
    std::fprintf(stderr, "%s\n", model_or.status().ToString().c_str());
    return kExitError;
  }
  const Model& model = *model_or;
  const ModelConfig& c = model.config;
  if (!c.moe.enabled()) {
    std::fprintf(stderr, "%s is not a mixture-of-experts model\n", o.model.c_str());
    return kExitUsage;
  }
  if (o.prompt_tokens + o.decode > c.max_seq_len || o.window + 1 > c.max_seq_len) {
    std::fprintf(stderr, "--prompt-tokens + --decode and --window must fit the context %d\n", c.max_seq_len);
    return kExitUsage;
  }
  for (int s : o.slots) {
    if (std::count(o.slots.begin(), o.slots.end(), s) > 1) {
      std::fprintf(stderr, "--slots: %d given twice\n", s);
      return kExitUsage;
    }
    OffloadOptions probe;
    probe.slots = s;
    if (Status st = moe::ValidateOffloadOptions(c, probe); !st.ok()) {
      std::fprintf(stderr, "--slots: %s\n", st.message().c_str());
      return kExitUsage;
    }
  }
  Result<std::string> tok_path = TokenizerFor(o.model, "");
  Result<Tokenizer> tok = tok_path.ok() ? Tokenizer::Load(*tok_path, c.vocab_size) : Result<Tokenizer>(tok_path.status());
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return kExitError;
  }
  Result<std::string> text = ReadFileToString(o.text);
  if (!text.ok()) {
    std::fprintf(stderr, "%s\n", text.status().ToString().c_str());
    return kExitError;
  }
  const std::vector<std::vector<int>> docs = EncodeDocs(*tok, *text);
  const std::vector<std::vector<int>> prompts = PickPrompts(docs, o.prompts, o.prompt_tokens);
  if (static_cast<int>(prompts.size()) < o.prompts) {
    std::fprintf(stderr, "%s: fewer than %d documents of %d tokens\n", o.text.c_str(), o.prompts, o.prompt_tokens);
    return kExitError;
  }
  std::vector<int> stream;
  for (const auto& d : docs) stream.insert(stream.end(), d.begin(), d.end());
  if (static_cast<int>(stream.size()) < o.window + 1) {
    std::fprintf(stderr, "%s holds fewer than %d tokens\n", o.text.c_str(), o.window + 1);
    return kExitError;
  }

  KvCacheOptions ko;
  ko.prefix_sharing = false;  // psr's routing depends on the whole history: every run computes everything
  // One sequence at a time, at fp32 K/V, twice over, plus slack.
  ko.budget_bytes = 2 * static_cast<size_t>(std::max(o.prompt_tokens + o.decode, o.window) + 2 * ko.block_tokens) *
                        c.n_layers * 2 * c.kv_dim() * sizeof(float) + (4u << 20);
  Result<std::unique_ptr<KvCache>> cache_or = KvCache::Create(model, "raw", ko);
  if (!cache_or.ok()) {
    std::fprintf(stderr, "%s\n", cache_or.status().ToString().c_str());
    return kExitError;
  }
  KvCache& cache = **cache_or;
  SeqId next_id = 1;

  // 1. Compute reference, which also gives the resident model's greedy tokens.
  std::vector<std::vector<int>> resident_out(prompts.size());
  std::vector<double> ref_steps;
  {
    Transformer tf(model);
    OffloadStats unused;
    for (size_t p = 0; p < prompts.size(); ++p) {
      std::fprintf(stderr, "compute reference: prompt %zu/%zu\n", p + 1, prompts.size());
      Status st = DecodeOne(tf, cache, nullptr, next_id++, prompts[p], o.decode, resident_out[p], ref_steps, unused);
      if (!st.ok()) {
        std::fprintf(stderr, "resident: %s\n", st.ToString().c_str());
        return kExitError;
      }
    }
  }
  const double step_s = Median(ref_steps);
  const int64_t active = ActiveBytes(model);
  const double compute_rate = static_cast<double>(active) / step_s;
  moe::CopyModel link;
  link.bandwidth_bytes_per_s = compute_rate / o.link_ratio;
  link.latency_s = o.latency_us * 1e-6;
  const size_t expert_bytes = moe::LayoutOf(model.layers[0].moe.experts[0]).bytes;  // what one copy moves
  const double copy_s = link.latency_s + static_cast<double>(expert_bytes) / link.bandwidth_bytes_per_s;

  // 2-3. Decode rows: the resident model, then per slot count lru, prefetch, psr at --bonus and
  // at each sweep bonus.
  std::vector<float> bonuses = {o.bonus};
  for (float b : o.sweep)
    if (std::find(bonuses.begin(), bonuses.end(), b) == bonuses.end()) bonuses.push_back(b);
  std::vector<Config> configs;
  for (int s : o.slots) {
    configs.push_back({s, Policy::kLru, 0});
    configs.push_back({s, Policy::kPrefetch, 0});
    for (float b : bonuses) configs.push_back({s, Policy::kPsr, b});
  }
  std::vector<DecodeRow> decode_rows;
  decode_rows.emplace_back();  // the resident model: Config{}
  for (const Config& cf : configs) {
    DecodeRow r;
    r.cfg = cf;
    auto m = OffloadedMoe::Create(model, MakeOptions(o, cf, "dram", link));
    if (!m.ok()) {
      std::fprintf(stderr, "%s: %s\n", cf.name().c_str(), m.status().ToString().c_str());
      return kExitUsage;
    }
    r.moe = std::move(*m);
    decode_rows.push_back(std::move(r));
  }
  if (Status st = RunDecodeRows(model, cache, decode_rows, prompts, o.decode, resident_out, next_id, "decode");
      !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return kExitError;
  }
  for (DecodeRow& r : decode_rows) r.moe.reset();  // joins the copy threads: no idle link beside later runs

  // 4. Quality, teacher-forced, unpaced copies.
  std::vector<const int*> windows;
  const int64_t span = static_cast<int64_t>(stream.size()) - o.window - 1;
  for (int w = 0; w < o.windows; ++w) windows.push_back(stream.data() + (o.windows > 1 ? span * w / (o.windows - 1) : 0));
  std::vector<QualityRow> quality;
  quality.emplace_back();  // the resident model
  for (const Config& cf : configs) quality.emplace_back().cfg = cf;
  {
    Transformer tf(model);
    std::vector<float> logits;
    const int V = c.vocab_size;
    for (QualityRow& q : quality) {
      std::fprintf(stderr, "quality: %s%s\n", q.cfg.name().c_str(),
                   q.cfg.resident() ? "" : fmt::format(", {} slots", q.cfg.slots).c_str());
      std::unique_ptr<OffloadedMoe> moe;
      if (!q.cfg.resident()) {
        auto m = OffloadedMoe::Create(model, MakeOptions(o, q.cfg, "dram", moe::CopyModel{}));
        if (!m.ok()) {
          std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
          return kExitError;
        }
        moe = std::move(*m);
      }
      tf.SetFeedForward(moe.get());
      const QualityRow* lru = q.cfg.resident() ? nullptr : FindQuality(quality, q.cfg.slots, Policy::kLru);
      for (const int* win : windows) {
        const SeqId id = next_id++;
        std::vector<BatchToken> batch;
        for (int i = 0; i < o.window; ++i) batch.push_back({id, win[i], i, true});
        Status st = cache.BeginSequence(id, {}).status();
        if (st.ok()) st = cache.Reserve(id, o.window);
        if (st.ok()) st = tf.Forward(batch, cache, logits);
        if (st.ok()) cache.Commit(id, win, o.window);
        cache.Release(id);
        if (moe) moe->EndSequence(id);
        if (!st.ok()) {
          std::fprintf(stderr, "%s: %s\n", q.cfg.name().c_str(), st.ToString().c_str());
          return kExitError;
        }
        q.digests.push_back(Xxh3_128(logits.data(), logits.size() * sizeof(float)));
        for (int i = 1; i < o.window; ++i) {
          const float* l = &logits[static_cast<size_t>(i) * V];
          const int top = Argmax(l, V);
          q.correct += top == win[i + 1];
          q.nll += Nll(l, V, win[i + 1]);
          // lru's row comes before psr's and prefetch's; lru agrees with itself.
          q.agree += (lru == nullptr || lru == &q) ? 1 : top == lru->argmax[q.argmax.size()];
          q.argmax.push_back(top);
          ++q.predictions;
        }
      }
      tf.SetFeedForward(nullptr);
    }
  }

  // 5. Optional: the decode rows again with the O_DIRECT file source, unpaced.
  std::vector<DecodeRow> direct_rows;
  if (o.source == "file-direct") {
    for (const Config& cf : configs) {
      if (cf.policy == Policy::kPsr && cf.bonus != o.bonus) continue;
      DecodeRow r;
    r.cfg = cf;
      auto m = OffloadedMoe::Create(model, MakeOptions(o, cf, "file-direct", moe::CopyModel{}));
      if (m.ok()) {
        r.moe = std::move(*m);
      } else {
        r.error = m.status().message();
      }
      direct_rows.push_back(std::move(r));
    }
    if (Status st = RunDecodeRows(model, cache, direct_rows, prompts, o.decode, resident_out, next_id, "file-direct");
        !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return kExitError;
    }
    for (DecodeRow& r : direct_rows) r.moe.reset();
  }

  // 6. Report.
  const QualityRow& qres = quality[0];
  std::printf("## Offloaded MoE decoding: %s\n\n", o.model.c_str());
  std::printf("- machine: %s, %u cores; %d OpenMP threads\n", CpuModel().c_str(), std::thread::hardware_concurrency(),
              omp_get_max_threads());
  std::printf("- command: `%s`\n", o.command.c_str());
  std::printf("- model: %s, %d layers, dim %d, %d experts of hidden %d, top-%d; one expert (w1, w2, w3 as stored) "
              "%zu bytes; active weights %.2f MB per token\n",
              c.arch.c_str(), c.n_layers, c.dim, c.moe.n_experts, c.moe.expert_hidden, c.moe.top_k, expert_bytes,
              static_cast<double>(active) / 1e6);
  std::printf("- compute reference (every expert resident): median decode step %.3f ms (%.1f tok/s), so the "
              "compute streams weights at %.2f GB/s\n",
              step_s * 1e3, 1.0 / step_s, compute_rate / 1e9);
  std::printf("- copy model (stands in for PCIe): bandwidth %.1f MB/s = %.2f GB/s / %g (--link-ratio; RTX 4090 "
              "~1000 GB/s vs PCIe 4.0 x16 ~25 GB/s), latency %g us; one expert copy %.3f ms = %.2f tokens of "
              "compute\n",
              link.bandwidth_bytes_per_s / 1e6, compute_rate / 1e9, o.link_ratio, o.latency_us, copy_s * 1e3,
              copy_s / step_s);
  std::printf("- policies: psr lookahead %d, decay %g, bonus %g (default) and the sweep; prefetch predicts with the "
              "next layer's router\n",
              o.lookahead, o.decay, o.bonus);
  std::printf("\n### Decode speed\n\n");
  std::printf("%d prompts of %d tokens (documents of the text at evenly spread offsets), %d greedy tokens each; a "
              "fresh OffloadedMoe (empty slots) per row on the paced link; prefill untimed (the first prompt's is "
              "the warm-up), decode steps (Forward + Commit) timed, copies and stalls counted over decode steps "
              "only; rows take turns prompt by prompt. \"greedy = resident\": mean count of leading decoded tokens "
              "equal to the resident model's.\n\n",
              o.prompts, o.prompt_tokens, o.decode);
  PrintDecodeTable(decode_rows, c.moe.n_experts, o.decode,
                   [&](const Config& cf) { return cf.policy != Policy::kPsr || cf.bonus == o.bonus; });

  std::printf("\n### Quality on held-out text (teacher-forced)\n\n");
  std::printf("%d windows of %d tokens spread evenly over %s (documents each with its own BOS, as trained); "
              "one sequence per window; copies unpaced (outputs of these policies never depend on copy timing). "
              "Agreement: top-1 equal to lru's at the same slots; changes relative to lru; \"= resident\": logits "
              "bit-identical to the resident model's in every window.\n\n",
              static_cast<int>(windows.size()), o.window, o.text.c_str());
  std::printf("| slots | policy | accuracy | acc change | NLL nats/tok | NLL change | top-1 agree w/ lru | = resident |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---|\n");
  for (const QualityRow& q : quality) {
    if (q.cfg.policy == Policy::kPsr && q.cfg.bonus != o.bonus) continue;
    const QualityRow* lru = q.cfg.resident() ? &q : FindQuality(quality, q.cfg.slots, Policy::kLru);
    std::printf("| %s | %s | %.4f | %+.2f%% | %.4f | %+.2f%% | %.2f%% | %s |\n",
                q.cfg.resident() ? fmt::format("{} (all)", c.moe.n_experts).c_str() : std::to_string(q.cfg.slots).c_str(),
                q.cfg.name().c_str(), q.acc(), Pct(q.acc(), lru->acc()), q.mean_nll(), Pct(q.mean_nll(), lru->mean_nll()),
                100.0 * q.agreement(), q.digests == qres.digests ? "yes" : "no");
  }

  std::printf("\n### PSR bonus sweep: speed against quality\n\n");
  std::printf("Decode figures from the decode run above, quality from the windows above. Goal (issue 19): speed >= "
              "%.1fx lru at the same slots AND accuracy and NLL within %.0f%% of lru's.\n\n",
              kGoalSpeedup, kGoalQualityPct);
  std::printf("| slots | bonus | decode tok/s | vs lru | copies/tok | hit ratio | accuracy | acc change | NLL change | "
              "top-1 agree | goal |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  nlohmann::json summary;
  summary["compute_tok_s"] = 1.0 / step_s;
  summary["link_bytes_per_s"] = link.bandwidth_bytes_per_s;
  summary["expert_copy_ms"] = copy_s * 1e3;
  int goals_met = 0;
  std::vector<float> sorted = bonuses;
  std::sort(sorted.begin(), sorted.end());
  for (int s : o.slots) {
    const DecodeRow* dl = FindDecode(decode_rows, s, Policy::kLru);
    const QualityRow* ql = FindQuality(quality, s, Policy::kLru);
    for (float b : sorted) {
      const DecodeRow* d = FindDecode(decode_rows, s, Policy::kPsr, b);
      const QualityRow* q = FindQuality(quality, s, Policy::kPsr, b);
      const double speedup = dl->tok_s() > 0 ? d->tok_s() / dl->tok_s() : 0;
      const bool goal = MeetsGoal(*d, *dl, *q, *ql);
      goals_met += goal;
      std::printf("| %d | %g%s | %.1f | %.2fx | %.2f | %.3f | %.4f | %+.2f%% | %+.2f%% | %.2f%% | %s |\n", s, b,
                  b == o.bonus ? " (default)" : "", d->tok_s(), speedup,
                  d->per_token(static_cast<double>(d->d.demand_copies + d->d.prefetch_copies)), d->d.hit_ratio(), q->acc(),
                  Pct(q->acc(), ql->acc()), Pct(q->mean_nll(), ql->mean_nll()), 100.0 * q->agreement(),
                  goal ? "**met**" : "no");
      summary["psr"].push_back({{"slots", s}, {"bonus", b}, {"tok_s", d->tok_s()}, {"speedup_vs_lru", speedup},
                                {"acc_change_pct", Pct(q->acc(), ql->acc())},
                                {"nll_change_pct", Pct(q->mean_nll(), ql->mean_nll())}, {"goal", goal}});
    }
    for (Policy p : {Policy::kLru, Policy::kPrefetch}) {
      const DecodeRow* d = FindDecode(decode_rows, s, p);
      summary["exact"].push_back({{"slots", s}, {"policy", moe::PolicyName(p)}, {"tok_s", d->tok_s()},
                                  {"stall_ms_per_tok", d->per_token(d->d.stall_s) * 1e3}});
    }
  }
  std::printf("\n%d of %zu psr configurations meet the goal.\n", goals_met, o.slots.size() * bonuses.size());

  if (!direct_rows.empty()) {
    std::printf("\n### Decode with experts read from the model file by O_DIRECT (unpaced: real disk I/O)\n\n");
    PrintDecodeTable(direct_rows, c.moe.n_experts, o.decode, [](const Config&) { return true; });
  }
  summary["goals_met"] = goals_met;
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << summary.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return kExitError;
    }
  }
  std::printf("\nsummary %s\n", summary.dump().c_str());
  return 0;
}

std::string SharedDir() {
  const char* env = std::getenv("KEEL_SHARED");
  return env != nullptr && *env != '\0' ? env : "../shared";
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.model = SharedDir() + "/data/models/en-moe8x";
  o.text = SharedDir() + "/data/text/val.txt";
  for (int i = 0; i < argc; ++i) o.command += (i ? " " : "") + std::string(argv[i]);
  CLI::App app{"Offloaded MoE decoding: speed and quality of lru / prefetch / psr expert slots (see the file's header)"};
  app.add_option("--model", o.model, "MoE model directory (default $KEEL_SHARED/data/models/en-moe8x)")->capture_default_str();
  app.add_option("--text", o.text, "held-out text (default $KEEL_SHARED/data/text/val.txt)")->capture_default_str();
  app.add_option("--slots", o.slots, "resident experts per layer, comma-separated")->delimiter(',')->capture_default_str();
  app.add_option("--decode", o.decode, "greedy tokens decoded per prompt")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--prompts", o.prompts, "prompts from the text")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--prompt-tokens", o.prompt_tokens, "tokens per prompt")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--link-ratio", o.link_ratio, "compute weight rate / copy bandwidth")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--latency-us", o.latency_us, "fixed cost per copy, microseconds")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bonus", o.bonus, "psr: router-logit bonus of cached experts (the default row)")->capture_default_str();
  app.add_option("--lookahead", o.lookahead, "psr: predicted experts entering the next layer's cache")->capture_default_str();
  app.add_option("--decay", o.decay, "psr: moving-average decay of router choices")->capture_default_str();
  app.add_option("--windows", o.windows, "quality windows")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--window", o.window, "tokens per quality window")->capture_default_str()->check(CLI::Range(2, 1 << 20));
  app.add_option("--sweep-bonus", o.sweep, "psr bonuses for the speed/quality sweep, comma-separated")->delimiter(',')
      ->capture_default_str();
  app.add_option("--source", o.source, "also measure decode with this slow tier, unpaced (file-direct)")
      ->check(CLI::IsMember({"dram", "file-direct"}))->capture_default_str();
  app.add_option("--json", o.json, "also write the summary as JSON");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }
  return Run(o);
}
