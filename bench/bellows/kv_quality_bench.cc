// KV codec quality on a real model: how much a lossy KV codec (bellows, KIVI-style quantisation,
// low rank, ...) hurts next-token prediction against raw fp32 K/V, every codec in the same run on
// the same windows of held-out text.
//
//   kv_quality_bench --model M --tokenizer T --text val.txt [--windows 64] [--context 256]
//                    [--codec [label=]spec[@name=value,...]]... [--chunk 1] [--json FILE]
//                    [--split-docs] [--spread] [--assert-lossless LABEL[=BASE]]...
//                    [--assert-agree LABEL=PCT]... [--assert-kept LABEL=PCT]...
//
// The text is encoded as llama2.c's run.c does (BOS, then the text; --split-docs: each
// blank-line-separated document with its own BOS, as the trainer streams text) and cut into
// non-overlapping windows of --context tokens (the first ones; --spread: spread evenly over the
// text). Each window runs through a KvCache of the codec (the engine's real path; nothing is
// shared between windows) with logits on every row, in Forwards of --chunk tokens, each followed
// by Commit. The default, 1, scores every prediction on the cache as a decode step reads it: a
// codec that compresses a block only when it fills (KIVI keeps its open block raw and compacts it
// at Commit) would score as lossless if the whole window were one prefill Forward (--chunk 0).
// Row i predicts token i+1; row 0 is not scored (it attends only to itself), so a window gives
// context-1 predictions (the last one's target is the next window's first token). raw:f32 is the
// reference and always runs first, on the same window, before the other codecs.
//
// Per codec: next-token accuracy, accuracy kept (acc / acc of raw:f32), top-1 agreement with the
// reference's argmax, mean NLL (nats) and its ratio to the reference, greedy continuation match
// (from the first 32 tokens of each of the first 8 windows, 64 greedy tokens with the codec and
// with the reference, one Forward per token; the mean count of identical leading tokens), and
// EFFECTIVE compression: the raw bf16 bytes of a window's K/V, context * n_layers * 2 * kv_dim * 2,
// over KvCacheStats::bytes_used once the window is committed (all the cache holds for it: open
// blocks, metadata, padding, raw windows), summed over windows. Prints a Markdown table.
//
// Assertions (exit code 3 when one fails; 1 for errors, 2 for usage):
//   --assert-lossless LABEL[=BASE]: LABEL's logits (every row of every window) and greedy tokens
//       are bit-identical to BASE's (default raw:bf16). This is the harness's own check: a
//       lossless codec must score exactly as the raw codec of its element type.
//   --assert-agree LABEL=PCT, --assert-kept LABEL=PCT: top-1 agreement / accuracy kept >= PCT.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bellows/codec_arg.h"
#include "keel/core/hash.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/tokenizer.h"
#include "keel/engine/transformer.h"

using namespace keel;
using namespace keel::engine;

namespace {

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitAssert = 3;

struct Options {
  std::string model, tokenizer, text, json;
  int windows = 64;
  int context = 256;
  int greedy_windows = 8;
  int greedy_prompt = 32;
  int greedy_tokens = 64;
  size_t budget_mb = 0;  // 0: sized from the model
  int chunk = 1;         // tokens per Forward over a window; 0: the whole window in one
  bool split_docs = false;
  bool spread = false;
  std::vector<std::string> codecs;
  std::vector<std::string> assert_lossless, assert_agree, assert_kept;
};

// One codec's cache and running totals.
struct Row {
  bench::CodecArg arg;
  std::unique_ptr<KvCache> cache;
  int64_t predictions = 0, correct = 0, agree = 0;
  double nll = 0;
  double raw_bytes = 0, used_bytes = 0;
  int64_t greedy_match = 0, greedy_runs = 0;
  std::vector<Hash128> window_digest;  // per window: logits of every row, then the greedy tokens

  double acc() const { return predictions ? static_cast<double>(correct) / predictions : 0; }
  double agreement() const { return predictions ? static_cast<double>(agree) / predictions : 0; }
  double mean_nll() const { return predictions ? nll / predictions : 0; }
  double effective_x() const { return used_bytes > 0 ? raw_bytes / used_bytes : 0; }
  double greedy() const { return greedy_runs ? static_cast<double>(greedy_match) / greedy_runs : 0; }
};

int Argmax(const float* l, int n) { return static_cast<int>(std::max_element(l, l + n) - l); }

double Nll(const float* l, int n, int target) {
  const float m = *std::max_element(l, l + n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(l[i]) - m);
  return std::log(sum) + m - l[target];
}

// The first `need` tokens of `text` encoded as run.c does. The tokenizer's merge loop is quadratic
// in the text length, so a growing prefix of the text (cut at a line end) is encoded until it
// gives `need` tokens plus a margin that keeps merges at the cut away from the tokens used.
std::vector<int> EncodePrefix(const Tokenizer& tok, const std::string& text, size_t need) {
  const size_t margin = 64;
  size_t chars = std::min(text.size(), (need + margin) * 3);
  while (true) {
    size_t cut = chars >= text.size() ? text.size() : text.find('\n', chars);
    if (cut == std::string::npos) cut = text.size();
    std::vector<int> t = tok.Encode(std::string_view(text).substr(0, cut), /*bos=*/true);
    if (t.size() >= need + margin || cut == text.size()) {
      if (t.size() > need) t.resize(need);
      return t;
    }
    const double per_token = static_cast<double>(cut) / static_cast<double>(std::max<size_t>(t.size(), 1));
    chars = std::max(cut + 1, static_cast<size_t>(per_token * static_cast<double>(need + 2 * margin)));
  }
}

// --split-docs: the text as the trainer (tools/trainer/train.py) streams it: split at every blank
// line ("\n\n"), documents of only whitespace dropped, each encoded as run.c does with its own BOS,
// concatenated until `need` tokens.
std::vector<int> EncodeDocs(const Tokenizer& tok, const std::string& text, size_t need) {
  std::vector<int> out;
  size_t at = 0;
  while (at <= text.size() && out.size() < need) {
    size_t end = text.find("\n\n", at);
    if (end == std::string::npos) end = text.size();
    std::string_view doc = std::string_view(text).substr(at, end - at);
    if (doc.find_first_not_of(" \t\r\n\v\f") != std::string_view::npos) {
      std::vector<int> t = tok.Encode(doc, /*bos=*/true);
      out.insert(out.end(), t.begin(), t.end());
    }
    at = end + 2;
  }
  if (out.size() > need) out.resize(need);
  return out;
}

// Runs `n` tokens as one sequence in Forwards of `chunk` tokens (0: all in one), each followed by
// Commit, with logits on every row; `bytes_used` is what the cache holds once all are committed.
// The sequence is released before returning.
Status RunWindow(Transformer& tf, KvCache& cache, SeqId id, const int* toks, int n, int chunk,
                 std::vector<float>& logits, int64_t* bytes_used) {
  const size_t vocab = static_cast<size_t>(tf.model().config.vocab_size);
  if (chunk <= 0 || chunk > n) chunk = n;
  std::vector<int> prompt(toks, toks + n);
  KEEL_ASSIGN_OR_RETURN(int cached, cache.BeginSequence(id, prompt));
  Status st = cached == 0 ? cache.Reserve(id, n) : Status::Internal("window found in the cache: sharing is off");
  logits.resize(n * vocab);
  std::vector<float> part;
  std::vector<BatchToken> batch;
  for (int at = 0; st.ok() && at < n; at += chunk) {
    const int m = std::min(chunk, n - at);
    batch.resize(m);
    for (int i = 0; i < m; ++i) batch[i] = {id, toks[at + i], at + i, true};
    st = tf.Forward(batch, cache, part);
    if (!st.ok()) break;
    std::copy(part.begin(), part.begin() + m * vocab, logits.begin() + at * vocab);
    cache.Commit(id, toks + at, m);
  }
  if (st.ok()) *bytes_used = cache.Stats().bytes_used;
  cache.Release(id);
  return st;
}

// Greedy continuation: `gen` tokens after `np` prompt tokens, one Forward per generated token.
Status Greedy(Transformer& tf, KvCache& cache, SeqId id, const int* prompt, int np, int gen, std::vector<int>& out) {
  const int vocab = tf.model().config.vocab_size;
  out.clear();
  std::vector<int> p(prompt, prompt + np);
  KEEL_ASSIGN_OR_RETURN(int cached, cache.BeginSequence(id, p));
  Status st = cached == 0 ? cache.Reserve(id, np + gen - 1) : Status::Internal("prompt found in the cache");
  std::vector<float> logits;
  if (st.ok()) {
    std::vector<BatchToken> batch(np);
    for (int i = 0; i < np; ++i) batch[i] = {id, prompt[i], i, i + 1 == np};
    st = tf.Forward(batch, cache, logits);
  }
  if (st.ok()) {
    cache.Commit(id, prompt, np);
    out.push_back(Argmax(logits.data(), vocab));
  }
  for (int i = 1; st.ok() && i < gen; ++i) {
    st = tf.Forward({{id, out.back(), np + i - 1, true}}, cache, logits);
    if (!st.ok()) break;
    cache.Commit(id, &out.back(), 1);
    out.push_back(Argmax(logits.data(), vocab));
  }
  cache.Release(id);
  return st;
}

int LeadingMatch(const std::vector<int>& a, const std::vector<int>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return static_cast<int>(i);
}

Row* FindRow(std::vector<Row>& rows, const std::string& label) {
  for (Row& r : rows)
    if (r.arg.label == label) return &r;
  return nullptr;
}

// "LABEL=VALUE" split at the last '=' (labels may not hold one, values never do).
bool SplitLast(const std::string& s, std::string* label, std::string* value) {
  size_t eq = s.rfind('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == s.size()) return false;
  *label = s.substr(0, eq);
  *value = s.substr(eq + 1);
  return true;
}

// Returns how many assertions failed (each is printed); -1 for a malformed one.
int CheckAssertions(const Options& o, std::vector<Row>& rows) {
  int failed = 0;
  for (const std::string& a : o.assert_lossless) {
    std::string label = a, base = "raw:bf16";
    if (size_t eq = a.rfind('='); eq != std::string::npos) {
      label = a.substr(0, eq);
      base = a.substr(eq + 1);
    }
    Row* r = FindRow(rows, label);
    Row* b = FindRow(rows, base);
    if (r == nullptr || b == nullptr) {
      std::fprintf(stderr, "--assert-lossless %s: no codec labelled '%s'\n", a.c_str(),
                   (r == nullptr ? label : base).c_str());
      return -1;
    }
    size_t w = 0;
    while (w < r->window_digest.size() && r->window_digest[w] == b->window_digest[w]) ++w;
    if (w < r->window_digest.size()) {
      std::fprintf(stderr, "FAIL lossless: %s differs from %s from window %zu on (logits or greedy tokens)\n",
                   label.c_str(), base.c_str(), w);
      ++failed;
    } else {
      std::fprintf(stderr, "ok   lossless: %s == %s bit for bit over %zu windows\n", label.c_str(), base.c_str(), w);
    }
  }
  auto at_least = [&](const std::vector<std::string>& list, const char* what,
                      const std::function<double(const Row&)>& get) {
    for (const std::string& a : list) {
      std::string label, value;
      Row* r = nullptr;
      if (!SplitLast(a, &label, &value) || (r = FindRow(rows, label)) == nullptr) {
        std::fprintf(stderr, "--assert-%s %s: want LABEL=PCT with LABEL one of the codecs\n", what, a.c_str());
        return false;
      }
      const double want = std::atof(value.c_str()), got = 100.0 * get(*r);
      const bool ok = got >= want;
      std::fprintf(stderr, "%s %s: %s %.3f%% (want >= %.3f%%)\n", ok ? "ok  " : "FAIL", what, label.c_str(), got, want);
      failed += ok ? 0 : 1;
    }
    return true;
  };
  const double ref_acc = rows[0].acc();
  if (!at_least(o.assert_agree, "agree", [](const Row& r) { return r.agreement(); })) return -1;
  if (!at_least(o.assert_kept, "kept", [&](const Row& r) { return ref_acc > 0 ? r.acc() / ref_acc : 0; })) return -1;
  return failed;
}

void PrintTable(const Options& o, const Model& model, const std::vector<Row>& rows, int windows) {
  const ModelConfig& c = model.config;
  std::printf("\n%s: %d layers, dim %d, %d heads, %d KV heads x head_dim %d; %s\n", o.model.c_str(), c.n_layers,
              c.dim, c.n_heads, c.n_kv_heads, c.head_dim(), o.text.c_str());
  std::printf("%d windows x %d tokens%s%s, %s (%lld predictions); greedy: %lld runs of %d tokens after %d\n\n",
              windows, o.context, o.split_docs ? ", documents split" : "", o.spread ? ", spread" : "",
              o.chunk == 1 ? "one token per Forward"
                           : (o.chunk == 0 || o.chunk >= o.context ? "one Forward per window"
                                                                   : ("Forwards of " + std::to_string(o.chunk)).c_str()),
              static_cast<long long>(rows[0].predictions), static_cast<long long>(rows[0].greedy_runs),
              o.greedy_tokens, o.greedy_prompt);
  std::printf("| codec | spec | effective x | acc | kept %% | top-1 agree %% | NLL | NLL ratio | greedy match |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  const Row& ref = rows[0];
  for (const Row& r : rows) {
    std::string spec = r.arg.spec;
    for (const auto& [k, v] : r.arg.params) spec += (spec.find('@') == std::string::npos ? "@" : ",") + k + "=" + v;
    std::printf("| %s | %s | %.2f | %.4f | %.2f | %.2f | %.4f | %.4f | %.1f / %d |\n", r.arg.label.c_str(), spec.c_str(),
                r.effective_x(), r.acc(), ref.acc() > 0 ? 100.0 * r.acc() / ref.acc() : 0, 100.0 * r.agreement(),
                r.mean_nll(), ref.mean_nll() > 0 ? r.mean_nll() / ref.mean_nll() : 0, r.greedy(), o.greedy_tokens);
  }
}

Status WriteJson(const Options& o, const Model& model, const std::vector<Row>& rows, int windows) {
  const ModelConfig& c = model.config;
  nlohmann::json j;
  j["model"] = o.model;
  j["tokenizer"] = o.tokenizer;
  j["text"] = o.text;
  j["config"] = {{"n_layers", c.n_layers}, {"dim", c.dim}, {"n_heads", c.n_heads}, {"n_kv_heads", c.n_kv_heads},
                 {"head_dim", c.head_dim()}, {"vocab_size", c.vocab_size}};
  j["windows"] = windows;
  j["context"] = o.context;
  j["chunk"] = o.chunk;
  j["split_docs"] = o.split_docs;
  j["spread"] = o.spread;
  j["predictions"] = rows[0].predictions;
  j["greedy"] = {{"runs", rows[0].greedy_runs}, {"prompt", o.greedy_prompt}, {"tokens", o.greedy_tokens}};
  const Row& ref = rows[0];
  for (const Row& r : rows) {
    j["rows"].push_back({{"label", r.arg.label},
                         {"spec", r.arg.spec},
                         {"params", r.arg.params},
                         {"effective_x", r.effective_x()},
                         {"raw_bf16_bytes_per_window", windows ? r.raw_bytes / windows : 0},
                         {"bytes_used_per_window", windows ? r.used_bytes / windows : 0},
                         {"acc", r.acc()},
                         {"kept", ref.acc() > 0 ? r.acc() / ref.acc() : 0},
                         {"top1_agree", r.agreement()},
                         {"nll", r.mean_nll()},
                         {"nll_ratio", ref.mean_nll() > 0 ? r.mean_nll() / ref.mean_nll() : 0},
                         {"greedy_match", r.greedy()}});
  }
  std::ofstream f(o.json);
  f << j.dump(2) << "\n";
  if (!f) return Status::IOError("cannot write " + o.json);
  return Status::Ok();
}

int Run(const Options& o) {
  Result<Model> model_or = LoadModel(o.model);
  if (!model_or.ok()) {
    std::fprintf(stderr, "%s\n", model_or.status().ToString().c_str());
    return kExitError;
  }
  const Model& model = *model_or;
  const ModelConfig& c = model.config;
  if (o.context < 2 || o.context > c.max_seq_len) {
    std::fprintf(stderr, "--context must be in [2, %d] for this model\n", c.max_seq_len);
    return kExitUsage;
  }
  Result<Tokenizer> tok = Tokenizer::Load(o.tokenizer, c.vocab_size);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return kExitError;
  }
  std::ifstream in(o.text, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", o.text.c_str());
    return kExitError;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  // One extra token: the last row of the last window needs its target. --spread needs it all.
  const size_t need = o.spread ? SIZE_MAX : static_cast<size_t>(o.windows) * o.context + 1;
  std::vector<int> tokens;
  if (o.split_docs) {
    tokens = EncodeDocs(*tok, text, need);
  } else if (o.spread) {
    tokens = tok->Encode(text, /*bos=*/true);  // quadratic in the text with a merge-heavy tokenizer
  } else {
    tokens = EncodePrefix(*tok, text, need);
  }
  const int grid = static_cast<int>((tokens.size() - 1) / o.context);  // whole windows in the text
  const int windows = std::min(o.windows, grid);
  // Window w starts at grid cell w (default) or at cells spread evenly over the whole text.
  auto window_start = [&](int w) {
    const int64_t cell = o.spread ? static_cast<int64_t>(w) * grid / windows : w;
    return tokens.data() + cell * o.context;
  };
  if (windows < 1) {
    std::fprintf(stderr, "%s holds fewer than %d tokens\n", o.text.c_str(), o.context + 1);
    return kExitError;
  }
  if (windows < o.windows) std::fprintf(stderr, "note: the text holds only %d windows of %d\n", windows, o.context);
  const int g_prompt = std::min(o.greedy_prompt, o.context);
  const int g_tokens = std::min(o.greedy_tokens, c.max_seq_len - g_prompt + 1);

  // Rows: the raw:f32 reference first, then the codecs in the order given.
  std::vector<Row> rows;
  std::vector<std::string> args = {"raw:f32"};
  for (const std::string& a : o.codecs)
    if (a != "raw:f32" && a != "raw") args.push_back(a);
  const int kv_dim = c.kv_dim();
  const int longest = std::max(o.context, g_prompt + g_tokens);
  for (const std::string& a : args) {
    Result<bench::CodecArg> parsed = bench::ParseCodecArg(a);
    if (!parsed.ok()) {
      std::fprintf(stderr, "%s\n", parsed.status().ToString().c_str());
      return kExitUsage;
    }
    if (FindRow(rows, parsed->label) != nullptr) {
      std::fprintf(stderr, "codec label '%s' given twice\n", parsed->label.c_str());
      return kExitUsage;
    }
    KvCacheOptions ko;
    ko.prefix_sharing = false;  // every window and greedy run is computed through the codec
    // Room for one sequence at raw fp32 size twice over, plus slack: no codec's worst case is
    // larger, and only one sequence lives at a time.
    ko.budget_bytes = o.budget_mb ? o.budget_mb << 20
                                  : 2 * static_cast<size_t>(longest + 2 * ko.block_tokens) * c.n_layers * 2 * kv_dim *
                                            sizeof(float) + (4u << 20);
    Status st = bench::ApplyCodecParams(*parsed, ko);
    Result<std::unique_ptr<KvCache>> cache =
        st.ok() ? KvCache::Create(model, parsed->spec, ko) : Result<std::unique_ptr<KvCache>>(st);
    if (!cache.ok()) {
      std::fprintf(stderr, "%s: %s\n", parsed->label.c_str(), cache.status().ToString().c_str());
      return kExitError;
    }
    Row r;
    r.arg = std::move(*parsed);
    r.cache = std::move(*cache);
    rows.push_back(std::move(r));
  }

  Transformer tf(model);
  const int V = c.vocab_size;
  std::vector<float> logits;
  std::vector<int> ref_argmax(o.context), ref_greedy, greedy;
  const double raw_bf16 = static_cast<double>(o.context) * c.n_layers * 2 * kv_dim * 2;
  SeqId next_id = 1;
  for (int w = 0; w < windows; ++w) {
    std::fprintf(stderr, "window %d/%d\n", w + 1, windows);
    const int* win = window_start(w);
    for (size_t ri = 0; ri < rows.size(); ++ri) {
      Row& r = rows[ri];
      int64_t used = 0;
      Status st = RunWindow(tf, *r.cache, next_id++, win, o.context, o.chunk, logits, &used);
      if (st.ok() && w < o.greedy_windows) st = Greedy(tf, *r.cache, next_id++, win, g_prompt, g_tokens, greedy);
      if (!st.ok()) {
        std::fprintf(stderr, "%s, window %d: %s\n", r.arg.label.c_str(), w, st.ToString().c_str());
        return kExitError;
      }
      Hasher128 digest;
      digest.update(logits.data(), logits.size() * sizeof(float));
      for (int i = 1; i < o.context; ++i) {
        const float* l = &logits[static_cast<size_t>(i) * V];
        const int target = win[i + 1], top = Argmax(l, V);
        if (ri == 0) ref_argmax[i] = top;
        r.correct += top == target;
        r.agree += top == ref_argmax[i];
        r.nll += Nll(l, V, target);
        ++r.predictions;
      }
      if (w < o.greedy_windows) {
        if (ri == 0) ref_greedy = greedy;
        r.greedy_match += LeadingMatch(greedy, ref_greedy);
        ++r.greedy_runs;
        digest.update(greedy.data(), greedy.size() * sizeof(int));
      }
      r.window_digest.push_back(digest.digest());
      r.raw_bytes += raw_bf16;
      r.used_bytes += static_cast<double>(used);
    }
  }
  PrintTable(o, model, rows, windows);
  if (!o.json.empty()) {
    if (Status st = WriteJson(o, model, rows, windows); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return kExitError;
    }
  }
  const int failed = CheckAssertions(o, rows);
  if (failed < 0) return kExitUsage;
  return failed > 0 ? kExitAssert : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"KV codec quality against raw fp32 K/V on held-out text (see the file's header)"};
  app.add_option("--model", o.model, "model (.bin or safetensors directory)")->required();
  app.add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer.bin")->required();
  app.add_option("--text", o.text, "held-out text")->required();
  app.add_option("--windows", o.windows, "most windows to evaluate")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--context", o.context, "tokens per window")->capture_default_str();
  app.add_option("--codec", o.codecs, "[label=]spec[@name=value,...]; repeatable (default: raw:bf16 zipfusion)");
  app.add_option("--greedy-windows", o.greedy_windows, "windows with a greedy continuation")->capture_default_str();
  app.add_option("--greedy-prompt", o.greedy_prompt, "prompt tokens of a greedy run")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--greedy-tokens", o.greedy_tokens, "tokens of a greedy run")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--chunk", o.chunk,
                 "tokens per Forward over a window, committed after each (1: as decode reads the cache; "
                 "0: the whole window in one prefill Forward)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_flag("--split-docs", o.split_docs,
               "encode each blank-line-separated document with its own BOS (the trainer's stream)");
  app.add_flag("--spread", o.spread, "windows spread evenly over the whole text instead of its start");
  app.add_option("--budget-mb", o.budget_mb, "KV cache budget per codec (0: sized from the model)");
  app.add_option("--json", o.json, "also write the results as JSON");
  app.add_option("--assert-lossless", o.assert_lossless, "LABEL[=BASE]: bit-identical to BASE (raw:bf16)");
  app.add_option("--assert-agree", o.assert_agree, "LABEL=PCT: top-1 agreement with raw:f32 >= PCT");
  app.add_option("--assert-kept", o.assert_kept, "LABEL=PCT: accuracy kept >= PCT");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }
  if (o.codecs.empty()) o.codecs = {"raw:bf16", "zipfusion"};
  return Run(o);
}
