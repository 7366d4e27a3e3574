// Decode attention: ZipFusion blocks versus uncompressed bf16 blocks, same shared attention core,
// same run. head_dim 128, 8 KV heads, 32 query heads, batch 1 and 8, contexts 1K..128K. Full
// ZipFusion blocks are compacted as in the engine's cache. Every CPU level this machine supports
// (keel/core/cpu.h) runs in the same loop, side by side: a Markdown table per level pair with the
// time ratio avx512 / avx2 of each codec, and ZipFusion's speed-up over bf16 at each level. Two
// K/V profiles (--kv, default both):
//  * measured: the statistics measured on real K/V (docs/zipfusion.md): normal values of std
//    0.55 in every channel, as the generated 110M model's K and V (~1.2 % exceptions, w = 3,
//    0.709x bf16; aidreams260K's are alike: 1.1-1.4 %, w = 3.0, 0.72x);
//  * outliers: harsher, K with per-channel scales spread log-normally like the outlier channels
//    of large trained models (1.8 % exceptions, mean w 3.5, 0.733x).
//
//   zipfusion_attention_bench [--max-context 131072] [--reps 11] [--kv measured|outliers|both]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "keel/core/cpu.h"
#include "keel/core/page_arena.h"
#include "keel/kv/codec.h"
#include "keel/kv/zipfusion/zipfusion_codec.h"

namespace {

using namespace keel::kv;
using Clock = std::chrono::steady_clock;

// Standard normal draws (xorshift64 + Box-Muller): the K/V fill dominated the run time with
// std::normal_distribution at 128K context.
struct FastNormal {
  uint64_t x;
  double Uniform() {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return (static_cast<double>(x >> 11) + 0.5) * 0x1.0p-53;
  }
  float operator()() {
    return static_cast<float>(std::sqrt(-2.0 * std::log(Uniform())) * std::cos(6.283185307179586 * Uniform()));
  }
};

// Blocks live in one huge-page-advised arena, one after another, as in a fresh engine KV cache;
// full blocks of a codec that compacts (zipfusion) are then moved to a second arena at their
// compact size, 64-byte aligned, as the engine's cache moves them when they fill.
struct Cache {
  std::unique_ptr<Codec> codec;
  keel::PageArena arena;
  keel::PageArena compact;
  std::vector<const uint8_t*> ptrs;
};

Cache Build(const std::string& spec, const KvShape& s, int tokens, uint64_t seed, bool outliers) {
  Cache c;
  c.codec = std::move(MakeCodec(spec, s)).value();
  const int blocks = (tokens + s.block_tokens - 1) / s.block_tokens;
  const size_t block_bytes = c.codec->block_bytes(0);
  c.arena = std::move(keel::PageArena::Map(block_bytes * blocks)).value();
  for (int b = 0; b < blocks; ++b) c.ptrs.push_back(c.arena.data() + block_bytes * b);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> kscale(s.kv_dim()), vscale(s.kv_dim());
  for (int i = 0; i < s.kv_dim(); ++i) {
    if (outliers) {
      kscale[i] = std::exp(0.8f * nd(rng));  // a few channels an order of magnitude larger
      vscale[i] = 0.3f * std::exp(0.3f * nd(rng));
    } else {
      kscale[i] = vscale[i] = 0.55f;
    }
  }
  std::vector<float> k(s.kv_dim()), v(s.kv_dim());
  FastNormal fast{seed * 0x9E3779B97F4A7C15ull + 1};
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < s.kv_dim(); ++i) {
      k[i] = kscale[i] * fast();
      v[i] = vscale[i] * fast();
    }
    c.codec->append(0, const_cast<uint8_t*>(c.ptrs[t / s.block_tokens]), t % s.block_tokens, k.data(), v.data());
  }
  if (c.codec->compacts()) {
    const int full = tokens / s.block_tokens;
    std::vector<size_t> at(full + 1, 0);
    for (int b = 0; b < full; ++b) at[b + 1] = at[b] + (c.codec->compact_bytes(0, c.ptrs[b]) + 63) / 64 * 64;
    c.compact = std::move(keel::PageArena::Map(std::max<size_t>(at[full], 64))).value();
    for (int b = 0; b < full; ++b) {
      c.codec->compact(0, c.ptrs[b], c.compact.data() + at[b]);
      c.ptrs[b] = c.compact.data() + at[b];
    }
  }
  return c;
}

// One decode-attention step over every sequence; seconds.
double TimeOnce(std::vector<Cache>& seqs, const KvShape& s, int tokens, const std::vector<float>& q,
                std::vector<float>& out, std::vector<AttendScratch>& scratch) {
  const int batch = static_cast<int>(seqs.size());
  auto one = [&](int b) {
    const size_t qo = static_cast<size_t>(b) * s.n_heads * s.head_dim;
    seqs[b].codec->attend(0, seqs[b].ptrs.data(), tokens, q.data() + qo, out.data() + qo, scratch[b]);
  };
  auto t0 = Clock::now();
  // Like the forward pass: sequences in parallel; one sequence alone splits its KV heads.
  if (batch == 1) {
    one(0);
  } else {
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < batch; ++b) one(b);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int max_context = 131072, reps = 11;
  std::string kv = "both";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--max-context") == 0) max_context = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--kv") == 0) kv = argv[i + 1];
  }
  if (kv != "both" && kv != "measured" && kv != "outliers") {
    std::fprintf(stderr, "--kv must be measured, outliers or both\n");
    return 2;
  }
  const KvShape s{1, 32, 8, 128, 16};
  const std::vector<keel::cpu::Isa> levels = keel::cpu::SupportedIsas();
  const int nl = static_cast<int>(levels.size());
  std::printf("%s\n\n", keel::cpu::Describe().c_str());
  // Header: per codec, ms and GB/s at each level, then (two levels) the avx512 / avx2 time ratio.
  std::string head = "| K/V | batch | context |", rule = "|---|---:|---:|";
  for (const char* codec : {"bf16", "zipfusion"}) {
    for (keel::cpu::Isa isa : levels) {
      const std::string l(keel::cpu::IsaName(isa));
      head += std::string(" ") + codec + " " + l + " ms | " + codec + " " + l + " GB/s |";
      rule += "---:|---:|";
    }
    if (nl == 2) {
      head += std::string(" ") + codec + " avx512/avx2 time |";
      rule += "---:|";
    }
  }
  head += " stored bytes / bf16 |";
  rule += "---:|";
  for (keel::cpu::Isa isa : levels) {
    head += " zipfusion speed-up " + std::string(keel::cpu::IsaName(isa)) + " |";
    rule += "---:|";
  }
  head += " identical |";
  rule += ":---:|";
  std::printf("%s\n%s\n", head.c_str(), rule.c_str());
  for (const char* profile : {"measured", "outliers"}) {
    if (kv != "both" && kv != profile) continue;
    const bool outliers = std::strcmp(profile, "outliers") == 0;
    for (int batch : {1, 8}) {
      for (int ctx : {1024, 4096, 8192, 32768, 131072}) {
        if (ctx > max_context || (batch == 8 && ctx > 32768)) continue;  // 8 x 128K bf16 = 4 GiB per codec
        std::vector<Cache> raw, zf;
        for (int b = 0; b < batch; ++b) {
          raw.push_back(Build("raw:bf16", s, ctx, 100 + b, outliers));
          zf.push_back(Build("zipfusion", s, ctx, 100 + b, outliers));
        }
        std::mt19937 rng(7);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> q(static_cast<size_t>(batch) * s.n_heads * s.head_dim);
        for (float& x : q) x = nd(rng);
        // out[codec][level]
        std::vector<std::vector<std::vector<float>>> out(2, std::vector<std::vector<float>>(nl, std::vector<float>(q.size())));
        std::vector<AttendScratch> scratch(batch);
        auto step = [&](int codec, int level) {
          if (!keel::cpu::SetActiveIsa(levels[level]).ok()) std::abort();
          return TimeOnce(codec == 0 ? raw : zf, s, ctx, q, out[codec][level], scratch);
        };
        // Alternate every (codec, level) so all see the same machine state; medians of many steps
        // (at least `reps`, and about half a second per kernel).
        double once = 0;
        for (int c = 0; c < 2; ++c)
          for (int l = 0; l < nl; ++l) once += step(c, l);  // warm-up
        const int steps = std::max(reps, std::min(1000, static_cast<int>(2.0 * nl / std::max(once, 1e-6))));
        std::vector<std::vector<std::vector<double>>> times(2, std::vector<std::vector<double>>(nl));
        for (int r = 0; r < steps; ++r)
          for (int c = 0; c < 2; ++c)
            for (int l = 0; l < nl; ++l) times[c][l].push_back(step(c, l));
        const double raw_bytes = static_cast<double>(batch) * ctx * s.kv_dim() * 2 * 2;
        double zf_bytes = 0;
        for (auto& c : zf) zf_bytes += static_cast<double>(zipfusion::StoredBytes(*c.codec, c.ptrs.data(), ctx));
        std::printf("| %s | %d | %dK |", profile, batch, ctx / 1024);
        double med[2][2] = {};
        for (int c = 0; c < 2; ++c) {
          for (int l = 0; l < nl; ++l) {
            med[c][l] = Median(times[c][l]);
            std::printf(" %.3f | %.1f |", med[c][l] * 1e3, (c == 0 ? raw_bytes : zf_bytes) / med[c][l] / 1e9);
          }
          if (nl == 2) std::printf(" %.2f |", med[c][1] / med[c][0]);
        }
        std::printf(" %.3f |", zf_bytes / raw_bytes);
        for (int l = 0; l < nl; ++l) std::printf(" %.2fx |", med[0][l] / med[1][l]);
        // Lossless at each level: ZipFusion's output equals bf16's bit for bit.
        bool same = true;
        for (int l = 0; l < nl; ++l) same = same && std::memcmp(out[0][l].data(), out[1][l].data(), q.size() * 4) == 0;
        std::printf(" %s |\n", same ? "yes" : "NO");
        std::fflush(stdout);
        if (!same) return 1;
      }
    }
  }
  return 0;
}
