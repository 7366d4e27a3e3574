// Decode speed of KV codecs against raw bf16 K/V at a long context, every codec in the same run.
//
//   kv_decode_bench --model DIR [--context N] [--steps 64] [--repeats 5]
//                   [--codec [label=]spec[@name=value,...]]... [--json FILE]
//
// Meant for a generated larger model (keel make-model, see bench/bellows/README.md). Per codec a
// prompt of context-steps tokens is prefilled once (untimed) and its full blocks stay registered
// for prefix sharing. Each repeat starts a new sequence per codec on that prompt (the shared
// blocks, the last partial block recomputed, untimed), then runs `steps` decode steps of one
// token each (one Transformer::Forward with logits, then Commit, as the scheduler does), going
// round the codecs one step at a time so that load changes hit every codec alike; the last step
// attends over the whole context. The token ids are fixed, the same for every codec. raw:bf16 is
// always the first codec. Prints a Markdown table: KV bytes per token as the cache holds the
// prompt (KvCacheStats::bytes_used); median and best wall-clock tokens/s over repeats and the
// median over repeats of the ratio to raw:bf16's in the same repeat; the same by process CPU
// time. On a shared machine run with OMP_NUM_THREADS=1 and read the CPU columns: with several
// threads a preempted one stalls the others at every barrier (steps of 3 to 300 ms for the same
// work were seen on a loaded 2-core machine), and CPU time then also counts their spinning.
#include <CLI/CLI.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bellows/codec_arg.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/transformer.h"

using namespace keel;
using namespace keel::engine;

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model, json;
  int context = 0;  // 0: the model's max_seq_len
  int steps = 64;
  int repeats = 5;
  std::vector<std::string> codecs;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

struct Row {
  bench::CodecArg arg;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<Transformer> tf;  // its own forward pass and scratch, as a separate engine has
  double bytes_per_token = 0;
  std::vector<double> tok_s;  // one per repeat
  std::vector<double> ratio;  // per repeat: tokens/s over raw:bf16's in the same repeat
  std::vector<double> cpu_tok_s, cpu_ratio;  // the same by process CPU time

  double median() const { return Median(tok_s); }
  double best() const { return tok_s.empty() ? 0 : *std::max_element(tok_s.begin(), tok_s.end()); }
};

// Computes prompt[from, n) of sequence `id` (logits only for the last row) and commits it.
Status Fill(Transformer& tf, KvCache& cache, SeqId id, const std::vector<int>& prompt, int from) {
  std::vector<float> logits;
  const int n = static_cast<int>(prompt.size());
  std::vector<BatchToken> batch;
  for (int i = from; i < n; ++i) batch.push_back({id, prompt[i], i, i + 1 == n});
  KEEL_RETURN_IF_ERROR(tf.Forward(batch, cache, logits));
  cache.Commit(id, prompt.data() + from, n - from);
  return Status::Ok();
}

// Registers the prompt's full blocks (one untimed prefill) and records the KV bytes per token.
Status Warm(Row& r, SeqId id, const std::vector<int>& prompt, int context) {
  KvCache& cache = *r.cache;
  KEEL_ASSIGN_OR_RETURN(int cached, cache.BeginSequence(id, prompt));
  Status st = cache.Reserve(id, context);
  if (st.ok()) st = Fill(*r.tf, cache, id, prompt, cached);
  if (st.ok()) r.bytes_per_token = static_cast<double>(cache.Stats().bytes_used) / static_cast<double>(prompt.size());
  cache.Release(id);
  return st;
}

// Starts sequence `id` on the (shared) prompt, recomputing what is not shared; untimed.
Status Begin(Transformer& tf, KvCache& cache, SeqId id, const std::vector<int>& prompt, int context) {
  KEEL_ASSIGN_OR_RETURN(int cached, cache.BeginSequence(id, prompt));
  Status st = cache.Reserve(id, context);
  if (st.ok()) st = Fill(tf, cache, id, prompt, cached);
  if (!st.ok()) cache.Release(id);
  return st;
}

struct StepTime {
  double wall = 0, cpu = 0;  // seconds
};

double CpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// One decode step (token at `pos`) of sequence `id`: its wall-clock and process CPU seconds.
Result<StepTime> Step(Transformer& tf, KvCache& cache, SeqId id, int token, int pos, std::vector<float>& logits) {
  const auto t0 = Clock::now();
  const double c0 = CpuSeconds();
  KEEL_RETURN_IF_ERROR(tf.Forward({{id, token, pos, true}}, cache, logits));
  cache.Commit(id, &token, 1);
  return StepTime{std::chrono::duration<double>(Clock::now() - t0).count(), CpuSeconds() - c0};
}

int Run(const Options& o) {
  Result<Model> model_or = LoadModel(o.model);
  if (!model_or.ok()) {
    std::fprintf(stderr, "%s\n", model_or.status().ToString().c_str());
    return 1;
  }
  const Model& model = *model_or;
  const ModelConfig& c = model.config;
  const int context = o.context > 0 ? o.context : c.max_seq_len;
  if (context > c.max_seq_len || context <= o.steps + 1) {
    std::fprintf(stderr, "--context must be in (steps + 1, %d]\n", c.max_seq_len);
    return 2;
  }
  // Deterministic token ids (BOS, then a fixed walk over the vocabulary); the same for every codec.
  std::vector<int> prompt = {1}, decode;
  for (int i = 1; i < context - o.steps; ++i) prompt.push_back(3 + (i * 7919) % (c.vocab_size - 3));
  for (int i = 0; i < o.steps; ++i) decode.push_back(3 + (i * 104729 + 17) % (c.vocab_size - 3));

  std::vector<std::string> args = {"raw:bf16"};
  for (const std::string& a : o.codecs)
    if (a != "raw:bf16") args.push_back(a);
  std::vector<Row> rows;
  for (const std::string& a : args) {
    Result<bench::CodecArg> parsed = bench::ParseCodecArg(a);
    if (!parsed.ok()) {
      std::fprintf(stderr, "%s\n", parsed.status().ToString().c_str());
      return 2;
    }
    for (const Row& r : rows) {
      if (r.arg.label == parsed->label) {
        std::fprintf(stderr, "codec label '%s' given twice\n", parsed->label.c_str());
        return 2;
      }
    }
    KvCacheOptions ko;
    ko.prefix_sharing = true;  // the prompt is prefilled once per codec, not once per repeat
    // The registered prompt, one more sequence and the decode blocks left cached by earlier
    // repeats, at the fp32 size (no codec's worst case is larger), plus slack.
    ko.budget_bytes = 3 * static_cast<size_t>(context + 2 * ko.block_tokens) * c.n_layers * 2 * c.kv_dim() *
                          sizeof(float) + (16u << 20);
    Status st = bench::ApplyCodecParams(*parsed, ko);
    Result<std::unique_ptr<KvCache>> cache =
        st.ok() ? KvCache::Create(model, parsed->spec, ko) : Result<std::unique_ptr<KvCache>>(st);
    if (!cache.ok()) {
      std::fprintf(stderr, "%s: %s\n", parsed->label.c_str(), cache.status().ToString().c_str());
      return 1;
    }
    Row r;
    r.arg = std::move(*parsed);
    r.cache = std::move(*cache);
    r.tf = std::make_unique<Transformer>(model);
    rows.push_back(std::move(r));
  }

  SeqId next_id = 1;
  for (Row& r : rows) {
    std::fprintf(stderr, "prefill %s: %zu tokens\n", r.arg.label.c_str(), prompt.size());
    if (Status st = Warm(r, next_id++, prompt, context); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", r.arg.label.c_str(), st.ToString().c_str());
      return 1;
    }
  }
  // Each repeat: every codec gets a fresh sequence on the prompt, then the decode steps go round
  // the codecs one step at a time (the codec going first rotates), so that load changes on a
  // shared machine hit every codec alike.
  std::vector<float> logits;
  const int p = static_cast<int>(prompt.size());
  for (int rep = 0; rep < o.repeats; ++rep) {
    std::fprintf(stderr, "repeat %d/%d\n", rep + 1, o.repeats);
    std::vector<SeqId> ids;
    for (Row& r : rows) {
      ids.push_back(next_id++);
      if (Status st = Begin(*r.tf, *r.cache, ids.back(), prompt, context); !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", r.arg.label.c_str(), st.ToString().c_str());
        return 1;
      }
    }
    std::vector<StepTime> sum(rows.size());
    for (int i = 0; i < o.steps; ++i) {
      for (size_t k = 0; k < rows.size(); ++k) {
        const size_t ri = (k + static_cast<size_t>(i)) % rows.size();
        Result<StepTime> t = Step(*rows[ri].tf, *rows[ri].cache, ids[ri], decode[i], p + i, logits);
        if (!t.ok()) {
          std::fprintf(stderr, "%s: %s\n", rows[ri].arg.label.c_str(), t.status().ToString().c_str());
          return 1;
        }
        sum[ri].wall += t->wall;
        sum[ri].cpu += t->cpu;
      }
    }
    for (size_t ri = 0; ri < rows.size(); ++ri) {
      Row& r = rows[ri];
      r.cache->Release(ids[ri]);
      r.tok_s.push_back(o.steps / sum[ri].wall);
      r.ratio.push_back(sum[0].wall / sum[ri].wall);
      r.cpu_tok_s.push_back(o.steps / sum[ri].cpu);
      r.cpu_ratio.push_back(sum[0].cpu / sum[ri].cpu);
    }
  }

  std::printf("\n%s: %d layers, dim %d, %d heads, %d KV heads x head_dim %d; %d threads\n", o.model.c_str(),
              c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim(), omp_get_max_threads());
  std::printf("decode steps %d..%d (context %d), %d repeats; CPU: process CPU seconds, exact for 1 thread\n\n",
              context - o.steps + 1, context, context, o.repeats);
  std::printf("| codec | spec | KV bytes/token | decode tok/s | best | ratio to raw:bf16 | CPU tok/s | CPU ratio |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|\n");
  nlohmann::json j;
  j["model"] = o.model;
  j["context"] = context;
  j["steps"] = o.steps;
  j["repeats"] = o.repeats;
  j["threads"] = omp_get_max_threads();
  for (const Row& r : rows) {
    std::printf("| %s | %s | %.1f | %.1f | %.1f | %.3f | %.1f | %.3f |\n", r.arg.label.c_str(), r.arg.spec.c_str(),
                r.bytes_per_token, r.median(), r.best(), Median(r.ratio), Median(r.cpu_tok_s), Median(r.cpu_ratio));
    j["rows"].push_back({{"label", r.arg.label},
                         {"spec", r.arg.spec},
                         {"params", r.arg.params},
                         {"kv_bytes_per_token", r.bytes_per_token},
                         {"tok_s", r.tok_s},
                         {"tok_s_median", r.median()},
                         {"ratio_to_raw_bf16", r.ratio},
                         {"ratio_to_raw_bf16_median", Median(r.ratio)},
                         {"cpu_tok_s", r.cpu_tok_s},
                         {"cpu_ratio_to_raw_bf16", r.cpu_ratio},
                         {"cpu_ratio_to_raw_bf16_median", Median(r.cpu_ratio)}});
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << j.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"KV codec decode tokens/s against raw:bf16 at a long context (see the file's header)"};
  app.add_option("--model", o.model, "model (safetensors directory or .bin)")->required();
  app.add_option("--context", o.context, "context at the last decode step (0: the model's)")->capture_default_str();
  app.add_option("--steps", o.steps, "timed decode steps per repeat")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--repeats", o.repeats, "interleaved repeats per codec")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--codec", o.codecs, "[label=]spec[@name=value,...]; repeatable (default: zipfusion)");
  app.add_option("--json", o.json, "also write the results as JSON");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (o.codecs.empty()) o.codecs = {"zipfusion"};
  return Run(o);
}
