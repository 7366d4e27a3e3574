// Exponent statistics of real K/V and the ZipFusion ratio they give.
//
//   build/kv_histogram_bench --model PATH [--tokenizer PATH] [--tokens N]
//                            [--prompt TEXT | --prompt-file PATH | --builtin-prompt]
//                            [--kv-codec raw:bf16]
//                            [--block-tokens 16] [--hist]
//
// Runs the model on BOS + the prompt (prefill; cut to `--tokens`) and then generates greedily
// until the sequence holds `--tokens` tokens (or the context is full), with K/V stored by `--kv-codec` (raw:bf16 by
// default, so what is read back is exactly what a bf16 cache holds). Then reads every stored K and
// V back through kv::Codec::read and, per layer and K/V, reports: the bf16 exponent histogram
// (top exponents with their share), the exponent entropy, and the ZipFusion size — the sum of
// EncodeBlock sizes over (layer, KV head, full block of block_tokens tokens, K or V), each block
// token-major as the codec stores it — relative to raw 16-bit bytes, for bf16 and for the same
// values as fp16. Partial last blocks are left out (the cache encodes a block when it fills).
// Prints Markdown.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/engine/engine.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/tokenizer.h"
#include "keel/engine/transformer.h"
#include "keel/kv/zipfusion/format.h"

namespace zf = keel::kv::zipfusion;
using namespace keel;
using namespace keel::engine;

namespace {

// A fixed prose prompt (Dickens, public domain) so runs are reproducible without a text file.
constexpr const char* kBuiltinPrompt =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us, we were all going direct to "
    "Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for good "
    "or for evil, in the superlative degree of comparison only.";

struct Args {
  std::string model, tokenizer, prompt, codec = "raw:bf16";
  int tokens = 0;  // 0: fill the context
  int block_tokens = 16;
  bool hist = false;
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "kv_histogram_bench: %s\n", what.c_str());
  std::exit(1);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value for " + k);
      return argv[++i];
    };
    if (k == "--model") a.model = next();
    else if (k == "--tokenizer") a.tokenizer = next();
    else if (k == "--tokens") a.tokens = std::atoi(next().c_str());
    else if (k == "--prompt") a.prompt = next();
    else if (k == "--builtin-prompt") a.prompt = kBuiltinPrompt;
    else if (k == "--prompt-file") {
      const std::string path = next();
      std::FILE* f = std::fopen(path.c_str(), "rb");
      if (f == nullptr) Die("cannot open " + path);
      char buf[4096];
      size_t got;
      while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) a.prompt.append(buf, got);
      std::fclose(f);
    }
    else if (k == "--kv-codec") a.codec = next();
    else if (k == "--block-tokens") a.block_tokens = std::atoi(next().c_str());
    else if (k == "--hist") a.hist = true;
    else Die("unknown argument " + k);
  }
  if (a.model.empty()) Die("--model is required");
  return a;
}

// Statistics of one (layer, K or V) tensor over all its blocks.
struct Stats {
  std::vector<int64_t> hist = std::vector<int64_t>(256, 0);  // bf16 exponent field
  std::vector<int64_t> hist16 = std::vector<int64_t>(32, 0); // fp16 exponent field
  int64_t values = 0;
  int64_t bf16_bytes = 0, fp16_bytes = 0;  // ZipFusion encoded sizes
  int64_t bf16_exc = 0, fp16_exc = 0;
  int64_t width_sum = 0, blocks = 0;
  void Add(const Stats& o) {
    for (int e = 0; e < 256; ++e) hist[e] += o.hist[e];
    for (int e = 0; e < 32; ++e) hist16[e] += o.hist16[e];
    values += o.values;
    bf16_bytes += o.bf16_bytes, fp16_bytes += o.fp16_bytes;
    bf16_exc += o.bf16_exc, fp16_exc += o.fp16_exc;
    width_sum += o.width_sum, blocks += o.blocks;
  }
};

double Entropy(const std::vector<int64_t>& h) {
  int64_t total = 0;
  for (int64_t c : h) total += c;
  double bits = 0;
  for (int64_t c : h) {
    if (c > 0) bits -= static_cast<double>(c) / total * std::log2(static_cast<double>(c) / total);
  }
  return bits;
}

// "126:31.0% 125:22.4% ..." for the `top` most frequent exponents (bf16 field values; the value
// 2^(e-127) is the magnitude class).
std::string TopExponents(const std::vector<int64_t>& h, int top) {
  std::vector<int> order(h.size());
  for (size_t i = 0; i < h.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return h[a] > h[b]; });
  int64_t total = 0;
  for (int64_t c : h) total += c;
  std::string s;
  char buf[32];
  for (int i = 0; i < top && h[order[i]] > 0; ++i) {
    std::snprintf(buf, sizeof buf, "%s%d:%.1f%%", s.empty() ? "" : " ", order[i], 100.0 * h[order[i]] / total);
    s += buf;
  }
  return s;
}

void EncodeInto(const std::vector<uint16_t>& v, zf::Dtype t, Stats& st) {
  std::vector<uint8_t> out(zf::MaxEncodedBytes(static_cast<int>(v.size()), t));
  auto r = zf::EncodeBlock(v.data(), static_cast<int>(v.size()), t, out.data(), out.size());
  if (!r.ok()) Die(r.status().ToString());
  auto b = zf::ParseBlock(out.data(), *r);
  if (!b.ok()) Die(b.status().ToString());
  std::vector<uint16_t> back(v.size());
  zf::DecodeBlock(*b, back.data());
  if (back != v) Die("round trip mismatch");
  if (t == zf::Dtype::kBf16) {
    st.bf16_bytes += static_cast<int64_t>(*r);
    st.bf16_exc += b->n_exc;
    st.width_sum += b->width;
    ++st.blocks;
  } else {
    st.fp16_bytes += static_cast<int64_t>(*r);
    st.fp16_exc += b->n_exc;
  }
}

// Runs prompt + greedy generation; returns the sequence length and sets the prompt length.
int Generate(const Model& model, const Tokenizer& tok, KvCache& cache, const Args& a, SeqId seq, int* prompt_len) {
  std::vector<int> tokens = tok.Encode(a.prompt, /*bos=*/true);
  const int limit = std::min(a.tokens > 0 ? a.tokens : model.config.max_seq_len, model.config.max_seq_len);
  if (static_cast<int>(tokens.size()) > limit) tokens.resize(limit);
  *prompt_len = static_cast<int>(tokens.size());
  auto begun = cache.BeginSequence(seq, tokens);
  if (!begun.ok()) Die(begun.status().ToString());
  if (Status s = cache.Reserve(seq, limit); !s.ok()) Die(s.ToString());
  Transformer tf(model);
  std::vector<float> logits;
  std::vector<BatchToken> batch;
  for (int p = 0; p < static_cast<int>(tokens.size()); ++p) {
    batch.push_back({seq, tokens[p], p, p + 1 == static_cast<int>(tokens.size())});
  }
  int len = 0;
  while (true) {
    if (Status s = tf.Forward(batch, cache, logits); !s.ok()) Die(s.ToString());
    std::vector<int> done;
    for (const BatchToken& bt : batch) done.push_back(bt.token);
    cache.Commit(seq, done.data(), static_cast<int>(done.size()));
    len = batch.back().pos + 1;
    if (len >= limit) break;
    const int next = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    batch = {{seq, next, len, true}};
  }
  return len;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  auto model = LoadModel(a.model);
  if (!model.ok()) Die(model.status().ToString());
  std::string tok_path = a.tokenizer;
  if (tok_path.empty()) {
    auto found = FindTokenizer(a.model);
    if (!found.ok()) Die(found.status().ToString());
    tok_path = *found;
  }
  auto tok = Tokenizer::Load(tok_path, model->config.vocab_size);
  if (!tok.ok()) Die(tok.status().ToString());
  KvCacheOptions opts;
  opts.block_tokens = a.block_tokens;
  opts.prefix_sharing = false;
  const int context = a.tokens > 0 ? std::min(a.tokens, model->config.max_seq_len) : model->config.max_seq_len;
  // Enough for the whole sequence even as fp32 (4 bytes), plus slack for block rounding.
  opts.budget_bytes = static_cast<size_t>(model->config.n_layers) * 2 * model->config.kv_dim() * 4 *
                      (context + 2 * a.block_tokens);
  auto cache = KvCache::Create(*model, a.codec, opts);
  if (!cache.ok()) Die(cache.status().ToString());

  const SeqId seq = 1;
  int prompt_len = 0;
  const int len = Generate(*model, *tok, **cache, a, seq, &prompt_len);
  const ModelConfig& c = model->config;
  const int hd = c.head_dim(), kvd = c.kv_dim(), bt = a.block_tokens;
  const int full_blocks = len / bt;
  if (full_blocks == 0) Die("sequence shorter than one block");
  if ((bt * hd) % 8 != 0) Die("block_tokens * head_dim must be a multiple of 8");

  std::printf("## %s\n\n", a.model.c_str());
  std::printf("%d layers, %d KV heads x head_dim %d; %d tokens (%d full blocks of %d) stored with %s; "
              "%d prompt tokens (BOS included), %d generated greedily.\n\n", c.n_layers, c.n_kv_heads, hd, len,
              full_blocks, bt, a.codec.c_str(), prompt_len, len - prompt_len);
  std::printf("| layer | K/V | top bf16 exponents (field:share) | H bf16 (bits) | H fp16 (bits) | mean w | exc %% | "
              "bf16 ratio | fp16 ratio |\n|---|---|---|---:|---:|---:|---:|---:|---:|\n");
  Stats all[2];
  std::vector<Stats> per_layer;
  const kv::Codec& codec = (*cache)->codec();
  std::vector<float> k(kvd), v(kvd);
  for (int layer = 0; layer < c.n_layers; ++layer) {
    const uint8_t* const* blocks = (*cache)->LayerBlocks(seq, layer);
    // rows[kv][t][kvd] as bf16 bits
    std::vector<uint16_t> rows[2] = {std::vector<uint16_t>(static_cast<size_t>(len) * kvd),
                                     std::vector<uint16_t>(static_cast<size_t>(len) * kvd)};
    std::vector<float> f32[2] = {std::vector<float>(static_cast<size_t>(len) * kvd),
                                 std::vector<float>(static_cast<size_t>(len) * kvd)};
    for (int t = 0; t < len; ++t) {
      codec.read(layer, blocks[t / bt], t % bt, k.data(), v.data());
      for (int i = 0; i < kvd; ++i) {
        rows[0][static_cast<size_t>(t) * kvd + i] = F32ToBf16(k[i]);
        rows[1][static_cast<size_t>(t) * kvd + i] = F32ToBf16(v[i]);
        f32[0][static_cast<size_t>(t) * kvd + i] = k[i];
        f32[1][static_cast<size_t>(t) * kvd + i] = v[i];
      }
    }
    for (int which = 0; which < 2; ++which) {
      Stats st;
      std::vector<uint16_t> blk(static_cast<size_t>(bt) * hd), blk16(blk.size());
      for (int h = 0; h < c.n_kv_heads; ++h) {
        for (int b = 0; b < full_blocks; ++b) {
          for (int t = 0; t < bt; ++t) {
            for (int d = 0; d < hd; ++d) {
              const size_t src = static_cast<size_t>(b * bt + t) * kvd + h * hd + d;
              const uint16_t x = rows[which][src];
              const uint16_t x16 = F32ToF16(f32[which][src]);
              blk[t * hd + d] = x;
              blk16[t * hd + d] = x16;
              ++st.hist[(x >> 7) & 0xFF];
              ++st.hist16[(x16 >> 10) & 0x1F];
            }
          }
          st.values += static_cast<int64_t>(blk.size());
          EncodeInto(blk, zf::Dtype::kBf16, st);
          EncodeInto(blk16, zf::Dtype::kFp16, st);
        }
      }
      const double raw = 2.0 * st.values;
      std::printf("| %d | %s | %s | %.2f | %.2f | %.2f | %.2f | %.3f | %.3f |\n", layer, which ? "V" : "K",
                  TopExponents(st.hist, 5).c_str(), Entropy(st.hist), Entropy(st.hist16),
                  static_cast<double>(st.width_sum) / st.blocks, 100.0 * st.bf16_exc / st.values,
                  st.bf16_bytes / raw, st.fp16_bytes / raw);
      if (a.hist) {
        std::printf("|   | %s full | ", which ? "V" : "K");
        for (int e = 0; e < 256; ++e) {
          if (st.hist[e] > 0) std::printf("%d:%lld ", e, static_cast<long long>(st.hist[e]));
        }
        std::printf("| | | | | | |\n");
      }
      all[which].Add(st);
    }
  }
  Stats total = all[0];
  total.Add(all[1]);
  std::printf("\n| scope | H bf16 | H fp16 | exc %% | bf16 ratio | fp16 ratio | entropy bound bf16 | entropy bound fp16 |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|\n");
  const char* names[3] = {"all K", "all V", "all K+V"};
  const Stats* scopes[3] = {&all[0], &all[1], &total};
  for (int i = 0; i < 3; ++i) {
    const Stats& s = *scopes[i];
    const double raw = 2.0 * s.values;
    // Entropy bound: raw sign+mantissa bits plus the exponent's (order-0) entropy, per 16 bits.
    std::printf("| %s | %.2f | %.2f | %.2f | %.3f | %.3f | %.3f | %.3f |\n", names[i], Entropy(s.hist),
                Entropy(s.hist16), 100.0 * s.bf16_exc / s.values, s.bf16_bytes / raw, s.fp16_bytes / raw,
                (8 + Entropy(s.hist)) / 16, (11 + Entropy(s.hist16)) / 16);
  }
  return 0;
}
