// Hit-ratio comparison of the DRAM tier's eviction policies (LRU, S3-FIFO, ARC) on a synthetic
// trace shaped like LLM serving with prefix caching. This is what DramOptions' default eviction
// kind is chosen from.
//
// The trace: KV chunks of 256 KiB whose keys are hash chains (key = H(parent key, chunk content)),
// so a prompt is a chain of chunk keys and two prompts share keys exactly as far as they share a
// prefix. Requests mix
//   - document QA: an app's system prompt + a Zipf-popular document + a fresh question chunk;
//   - multi-turn chats: each turn re-requests the whole history chain plus the previous answer
//     and a new user message (a pool of interleaved live conversations, geometric lengths);
//   - one-off long scans: a system prompt + a big document never seen again;
//   - short one-off prompts: a system prompt + a few fresh chunks.
// Replay: each request looks its chunks up in order; a hit touches the key, a miss inserts it
// (evicting down to capacity). Chunk hit ratio = hits / lookups. Prefix hit ratio = chunks
// served from the longest cached prefix / lookups, since the engine reuses only a contiguous
// prefix. Capacities are fractions of the trace's unique bytes.
//
// Deterministic: its own RNG (splitmix64) and samplers, so the table is the same on every
// machine and standard library. Only the timing line at the end varies.
//
//   eviction_bench [--requests N] [--seed S] [--alpha A[,A...]] [--docs N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/core/hash.h"
#include "keel/kvstore/eviction.h"

namespace {

using keel::Hash128;
using keel::kvstore::EvictionKind;
using keel::kvstore::EvictionKindName;
using keel::kvstore::MakeEvictionPolicy;

constexpr int64_t kChunkBytes = 256 << 10;
constexpr int64_t kKeyBytes = 16;
// What DramTier charges a chunk, less its 256 bytes of entry bookkeeping (kEntryOverheadBytes,
// 0.1 % of a chunk here).
constexpr int64_t kChargedBytes = kChunkBytes + kKeyBytes;

struct Options {
  int64_t requests = 15000;
  uint64_t seed = 1;
  std::vector<double> alphas = {0.9, 1.0, 1.1};
  int64_t docs = 3000;
};

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  int64_t Range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1)); }
  bool Chance(double p) { return Uniform() < p; }
  // Geometric number of trials >= 1 with the given mean.
  int64_t Geometric(double mean) {
    int64_t n = 1;
    while (n < 64 && Uniform() > 1.0 / mean) ++n;
    return n;
  }

 private:
  uint64_t s_;
};

// Samples ranks 0..n-1 with P(k) proportional to 1 / (k+1)^alpha (inverse CDF).
class Zipf {
 public:
  Zipf(int64_t n, double alpha) : cdf_(static_cast<size_t>(n)) {
    double sum = 0;
    for (int64_t k = 0; k < n; ++k) cdf_[k] = (sum += 1.0 / std::pow(static_cast<double>(k + 1), alpha));
    for (double& c : cdf_) c /= sum;
  }
  int64_t Sample(Rng& rng) const {
    auto it = std::lower_bound(cdf_.begin(), cdf_.end(), rng.Uniform());
    return std::min<int64_t>(it - cdf_.begin(), static_cast<int64_t>(cdf_.size()) - 1);
  }

 private:
  std::vector<double> cdf_;
};

// The trace: requests as runs of chunk ids; id -> 16-byte chain key.
struct Trace {
  std::vector<uint32_t> chunks;     // all requests' chunk ids, back to back
  std::vector<size_t> request_end;  // end offset of each request in `chunks`
  std::vector<std::string> keys;    // chunk id -> key
  int64_t scan_requests = 0, qa_requests = 0, chat_turns = 0, short_requests = 0;
};

// Content of one chunk: (source kind, source id, position).
uint64_t Content(uint64_t kind, uint64_t id, uint64_t pos) {
  const uint64_t parts[3] = {kind, id, pos};
  return keel::Xxh3_64(parts, sizeof(parts));
}

class TraceBuilder {
 public:
  // Appends a request made of `contents`, chained from the root.
  void AddRequest(const std::vector<uint64_t>& contents) {
    Hash128 parent;
    for (uint64_t c : contents) {
      uint64_t buf[3] = {parent.lo, parent.hi, c};
      parent = keel::Xxh3_128(buf, sizeof(buf));
      auto [it, inserted] = ids_.try_emplace(parent, static_cast<uint32_t>(trace_.keys.size()));
      if (inserted) trace_.keys.emplace_back(reinterpret_cast<const char*>(&parent), sizeof(parent));
      trace_.chunks.push_back(it->second);
    }
    trace_.request_end.push_back(trace_.chunks.size());
  }
  Trace Take() { return std::move(trace_); }
  Trace& trace() { return trace_; }

 private:
  std::unordered_map<Hash128, uint32_t, keel::Hash128Hasher> ids_;
  Trace trace_;
};

Trace BuildTrace(const Options& opt, double alpha) {
  Rng rng(opt.seed);
  TraceBuilder b;
  enum : uint64_t { kSys = 1, kDoc, kFresh };

  // Four apps, each with its own system prompt; traffic share 50/25/15/10 %.
  const int64_t sys_len[4] = {8, 12, 16, 24};
  const double app_cdf[4] = {0.50, 0.75, 0.90, 1.00};
  auto pick_app = [&] {
    const double u = rng.Uniform();
    int a = 0;
    while (a < 3 && u >= app_cdf[a]) ++a;
    return a;
  };
  uint64_t fresh = 0;  // never-repeated content
  auto push_sys = [&](std::vector<uint64_t>& v, int app) {
    for (int64_t j = 0; j < sys_len[app]; ++j) v.push_back(Content(kSys, app, j));
  };

  // Documents: 4..32 chunks (1..8 MiB of KV), each belonging to one app; popularity is Zipf
  // over a random permutation so rank is unrelated to id, length or app.
  std::vector<int64_t> doc_len(opt.docs), doc_app(opt.docs), doc_of_rank(opt.docs);
  for (int64_t d = 0; d < opt.docs; ++d) {
    doc_len[d] = rng.Range(4, 32);
    doc_app[d] = pick_app();
    doc_of_rank[d] = d;
  }
  for (int64_t i = opt.docs - 1; i > 0; --i) std::swap(doc_of_rank[i], doc_of_rank[rng.Range(0, i)]);
  const Zipf doc_zipf(opt.docs, alpha);
  auto push_doc = [&](std::vector<uint64_t>& v, int64_t d) {
    for (int64_t j = 0; j < doc_len[d]; ++j) v.push_back(Content(kDoc, d, j));
  };

  // Live conversations: each holds its whole history as chunk contents.
  constexpr size_t kLiveChats = 48;
  struct Chat {
    std::vector<uint64_t> history;
    int64_t turns_left;
  };
  std::vector<Chat> chats;

  std::vector<uint64_t> req;
  for (int64_t r = 0; r < opt.requests; ++r) {
    req.clear();
    const double u = rng.Uniform();
    if (u < 0.45) {  // document QA
      const int64_t d = doc_of_rank[doc_zipf.Sample(rng)];
      push_sys(req, static_cast<int>(doc_app[d]));
      push_doc(req, d);
      req.push_back(Content(kFresh, ++fresh, 0));
      ++b.trace().qa_requests;
    } else if (u < 0.80) {  // a chat turn
      if (chats.size() < kLiveChats || rng.Chance(0.05)) {
        Chat c;
        const int app = pick_app();
        push_sys(c.history, app);
        if (rng.Chance(0.3)) push_doc(c.history, doc_of_rank[doc_zipf.Sample(rng)]);
        c.turns_left = rng.Geometric(6.0);
        chats.push_back(std::move(c));
      }
      const size_t i = static_cast<size_t>(rng.Range(0, static_cast<int64_t>(chats.size()) - 1));
      Chat& c = chats[i];
      const int64_t user_chunks = rng.Range(1, 2);
      for (int64_t j = 0; j < user_chunks; ++j) c.history.push_back(Content(kFresh, ++fresh, 0));
      req = c.history;
      // The answer joins the history the next turn re-requests.
      const int64_t answer_chunks = rng.Range(1, 2);
      for (int64_t j = 0; j < answer_chunks; ++j) c.history.push_back(Content(kFresh, ++fresh, 0));
      if (--c.turns_left == 0) {
        std::swap(chats[i], chats.back());
        chats.pop_back();
      }
      ++b.trace().chat_turns;
    } else if (u < 0.83) {  // one-off long scan: 32..128 MiB of KV seen once
      push_sys(req, pick_app());
      const int64_t n = rng.Range(128, 512);
      for (int64_t j = 0; j < n; ++j) req.push_back(Content(kFresh, ++fresh, 0));
      ++b.trace().scan_requests;
    } else {  // short one-off prompt
      push_sys(req, pick_app());
      const int64_t n = rng.Range(1, 4);
      for (int64_t j = 0; j < n; ++j) req.push_back(Content(kFresh, ++fresh, 0));
      ++b.trace().short_requests;
    }
    b.AddRequest(req);
  }
  return b.Take();
}

struct Ratios {
  double chunk = 0, prefix = 0;
};

Ratios Replay(const Trace& t, EvictionKind kind, int64_t capacity_bytes) {
  auto policy = MakeEvictionPolicy(kind, capacity_bytes);
  std::unordered_map<std::string_view, uint32_t> id_of;
  id_of.reserve(t.keys.size());
  for (uint32_t i = 0; i < t.keys.size(); ++i) id_of.emplace(t.keys[i], i);
  std::vector<uint8_t> resident(t.keys.size(), 0);

  int64_t lookups = 0, hits = 0, prefix_hits = 0;
  size_t begin = 0;
  for (size_t end : t.request_end) {
    bool prefix_intact = true;
    for (size_t i = begin; i < end; ++i) {
      const uint32_t id = t.chunks[i];
      const std::string& key = t.keys[id];
      ++lookups;
      if (resident[id]) {
        ++hits;
        if (prefix_intact) ++prefix_hits;
        policy->Access(key);
        continue;
      }
      prefix_intact = false;
      policy->Insert(key, kChargedBytes);
      resident[id] = 1;
      while (policy->bytes() > capacity_bytes) {
        std::optional<std::string> victim = policy->Victim();
        if (!victim) break;
        resident[id_of.at(*victim)] = 0;
      }
    }
    begin = end;
  }
  return {static_cast<double>(hits) / lookups, static_cast<double>(prefix_hits) / lookups};
}

bool ParseArgs(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--help" || a == "-h") return false;
    if (v == nullptr) return false;
    if (a == "--requests") {
      opt->requests = std::atoll(v);
    } else if (a == "--seed") {
      opt->seed = std::strtoull(v, nullptr, 10);
    } else if (a == "--docs") {
      opt->docs = std::atoll(v);
    } else if (a == "--alpha") {
      opt->alphas.clear();
      for (const char* p = v; *p != '\0';) {
        char* next = nullptr;
        opt->alphas.push_back(std::strtod(p, &next));
        if (next == p) return false;
        p = *next == ',' ? next + 1 : next;
      }
    } else {
      return false;
    }
    ++i;
  }
  return opt->requests > 0 && opt->docs > 0 && !opt->alphas.empty();
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) {
    std::fprintf(stderr,
                 "usage: eviction_bench [--requests N (15000)] [--seed S (1)] [--alpha A[,A...] (0.9,1.0,1.1)]\n"
                 "                      [--docs N (3000)]\n");
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  std::printf("eviction_bench --requests %lld --seed %llu --docs %lld --alpha", static_cast<long long>(opt.requests),
              static_cast<unsigned long long>(opt.seed), static_cast<long long>(opt.docs));
  for (size_t i = 0; i < opt.alphas.size(); ++i) std::printf("%s%.2f", i ? "," : " ", opt.alphas[i]);
  std::printf("\n");

  const EvictionKind kinds[] = {EvictionKind::kLru, EvictionKind::kS3Fifo, EvictionKind::kArc};
  const double fractions[] = {0.01, 0.05, 0.10, 0.25, 0.50};
  for (double alpha : opt.alphas) {
    const Trace trace = BuildTrace(opt, alpha);
    const int64_t lookups = static_cast<int64_t>(trace.chunks.size());
    const int64_t unique = static_cast<int64_t>(trace.keys.size());
    const int64_t unique_bytes = unique * kChargedBytes;
    std::printf("\ntrace: zipf alpha %.2f, %lld requests (%lld doc QA, %lld chat turns, %lld scans, %lld short), "
                "%lld chunk lookups, %lld unique chunks = %.1f GiB; infinite-cache hit ratio %.3f\n",
                alpha, static_cast<long long>(opt.requests), static_cast<long long>(trace.qa_requests),
                static_cast<long long>(trace.chat_turns), static_cast<long long>(trace.scan_requests),
                static_cast<long long>(trace.short_requests), static_cast<long long>(lookups),
                static_cast<long long>(unique), static_cast<double>(unique_bytes) / (1 << 30),
                1.0 - static_cast<double>(unique) / lookups);
    std::printf("%-9s %9s", "capacity", "GiB");
    for (EvictionKind k : kinds) std::printf("  %8s chunk/prefix", std::string(EvictionKindName(k)).c_str());
    std::printf("\n");
    for (double f : fractions) {
      const int64_t capacity = static_cast<int64_t>(f * static_cast<double>(unique_bytes));
      std::printf("%8.0f%% %9.2f", f * 100, static_cast<double>(capacity) / (1 << 30));
      for (EvictionKind k : kinds) {
        const Ratios r = Replay(trace, k, capacity);
        std::printf("  %13.3f / %5.3f", r.chunk, r.prefix);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "\n(ran in %.1f s)\n", secs);
  return 0;
}
