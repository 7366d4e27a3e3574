// CoLoc vs frequency placement on a four-tier vector shard (issue 3), same run, same data, same
// query stream.
//
// Data. Text vectors: the 10,000 real SIFT descriptors from $KEEL_SHARED/data/vectors/ plus
// generated ones that follow their distribution: item i >= 10,000 is a random real vector plus
// Gaussian noise of 0.3x that dimension's standard deviation, rounded and clipped to [0, 255]
// like SIFT (a kernel-density sample of the real set). Image vectors (the paired modality): a
// fixed random orthogonal map of the item's text vector plus small Gaussian noise, so image
// neighbourhoods follow text neighbourhoods as in a joint embedding space while the vectors
// themselves differ. 128 + 128 float dimensions, 1 KiB of vectors per item.
//
// Queries. Anchors: --topics random items; the query vector is its anchor's text vector (a
// popular query repeats verbatim, as in search logs), plus per-query Gaussian noise of
// --query-noise sigma when given (distinct but similar queries). Anchor popularity is Zipf(--zipf) over a random ranking; the hot set shifts
// halfway through the measured queries (a second random ranking). A query is multimodal
// (text search, then the top k's image vectors fetched) with probability mix %, text-only
// otherwise; both fetch their rerank candidates' text vectors from the tiers.
//
// Per (mix, policy): the shard's query log is cleared, --warm queries fill it, one synchronous
// placement round places every vector, then --queries are measured while the Placer re-places
// online in the background (every 2 s once 1,000 new queries arrived). Reported: % of queries touching more than one tier,
// p50/p99 end-to-end latency of Shard::Search, recall@10 against exact search (flat L2 over all
// items), and whether both policies returned identical hits.
//
//   coloc_bench [--items 1000000] [--warm 3000] [--queries 3000] [--mixes 0,25,50,75,100]
//               [--topics 20000] [--zipf 1.0] [--query-noise 0] [--dram-pct 5] [--ssd-pct 15] [--cold-pct 30]
//               [--lists 1024] [--nprobe 16] [--rerank 10] [--seed 1] [--dir /tmp/...]
//               [--redis host:port | --redis-server redis-server] [--remote-delay-us 0]
//
// --remote-delay-us N puts a DelayProxy (bench/common/delay_proxy.h) between the shard and Redis,
// holding every chunk N us in each direction: an emulated network round trip for the remote tier,
// because this kernel has no sch_netem for `tc qdisc ... netem delay`.
#include <faiss/IndexFlat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/common/delay_proxy.h"
#include "bench/common/redis_server.h"
#include "keel/vector/coloc/placement.h"
#include "keel/vector/shard.h"
#include "keel/vector/texmex.h"

namespace {

using Clock = std::chrono::steady_clock;
using keel::vector::coloc::PlacementPolicy;

constexpr int kDim = 128;

struct Args {
  int64_t items = 1000000;
  int warm = 5000;
  int queries = 3000;
  std::vector<int> mixes = {0, 25, 50, 75, 100};
  int topics = 20000;
  double zipf = 1.0;
  double query_noise = 0.0;
  double dram_pct = 5, ssd_pct = 15, cold_pct = 30;
  int lists = 1024, nprobe = 16, rerank = 10;
  uint64_t seed = 1;
  std::string dir;
  std::string redis;  // host:port of an existing server
  std::string redis_server = "redis-server";
  int remote_delay_us = 0;  // > 0: reach Redis through a DelayProxy (emulated network)
};

std::string SharedDir() {
  if (const char* env = std::getenv("KEEL_SHARED"); env && *env) return env;
  for (const char* c : {"../shared", "shared", "../../shared"})
    if (std::filesystem::exists(std::string(c) + "/data/vectors")) return c;
  return "../shared";
}

// Random orthogonal matrix (Gram-Schmidt on a Gaussian one), row-major.
std::vector<float> RandomOrthogonal(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g;
  std::vector<double> m(static_cast<size_t>(d) * d);
  for (auto& v : m) v = g(rng);
  for (int i = 0; i < d; ++i) {
    double* r = &m[static_cast<size_t>(i) * d];
    for (int j = 0; j < i; ++j) {
      const double* q = &m[static_cast<size_t>(j) * d];
      double dot = 0;
      for (int t = 0; t < d; ++t) dot += r[t] * q[t];
      for (int t = 0; t < d; ++t) r[t] -= dot * q[t];
    }
    double n = 0;
    for (int t = 0; t < d; ++t) n += r[t] * r[t];
    n = std::sqrt(n);
    for (int t = 0; t < d; ++t) r[t] /= n;
  }
  return {m.begin(), m.end()};
}

struct Dataset {
  int64_t n = 0;
  std::vector<float> text;     // n * kDim
  std::vector<float> rotation; // kDim * kDim
  std::vector<float> sigma;    // per-dimension std of the real set
};

void ImageOf(const Dataset& ds, int64_t item, float* out) {
  std::mt19937_64 rng(0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(item));
  std::normal_distribution<float> g(0.f, 2.f);
  const float* t = &ds.text[static_cast<size_t>(item) * kDim];
  for (int i = 0; i < kDim; ++i) {
    const float* r = &ds.rotation[static_cast<size_t>(i) * kDim];
    float s = 0;
    for (int j = 0; j < kDim; ++j) s += r[j] * t[j];
    out[i] = s + g(rng);
  }
}

Dataset MakeDataset(const keel::vector::VectorSet& real, int64_t n, uint64_t seed) {
  Dataset ds;
  ds.n = n;
  ds.rotation = RandomOrthogonal(kDim, seed + 7);
  ds.sigma.assign(kDim, 0.f);
  std::vector<double> mean(kDim, 0.0), sq(kDim, 0.0);
  for (int64_t i = 0; i < real.count; ++i)
    for (int d = 0; d < kDim; ++d) {
      double v = real.values[i * kDim + d];
      mean[d] += v;
      sq[d] += v * v;
    }
  for (int d = 0; d < kDim; ++d) {
    double m = mean[d] / real.count;
    ds.sigma[d] = static_cast<float>(std::sqrt(std::max(0.0, sq[d] / real.count - m * m)));
  }
  ds.text.resize(static_cast<size_t>(n) * kDim);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g;
  std::uniform_int_distribution<int64_t> pick(0, real.count - 1);
  for (int64_t i = 0; i < n; ++i) {
    float* out = &ds.text[static_cast<size_t>(i) * kDim];
    if (i < real.count) {
      std::copy_n(&real.values[i * kDim], kDim, out);
      continue;
    }
    const float* base = &real.values[pick(rng) * kDim];
    for (int d = 0; d < kDim; ++d)
      out[d] = std::clamp(std::round(base[d] + 0.3f * ds.sigma[d] * g(rng)), 0.f, 255.f);
  }
  return ds;
}

struct Query {
  int64_t anchor;
  bool multimodal_draw;  // compared against the mix
  double mm_u;
  std::vector<float> vec;
};

// Zipf sampler over ranks 0..n-1 (inverse CDF on a precomputed table).
class Zipf {
 public:
  Zipf(int n, double s) : cdf_(n) {
    double acc = 0;
    for (int i = 0; i < n; ++i) cdf_[i] = (acc += 1.0 / std::pow(i + 1.0, s));
    for (auto& c : cdf_) c /= acc;
  }
  int operator()(std::mt19937_64& rng) const {
    double u = std::uniform_real_distribution<double>(0, 1)(rng);
    return static_cast<int>(std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
  }

 private:
  std::vector<double> cdf_;
};

std::vector<Query> MakeQueries(const Dataset& ds, const Args& a) {
  std::mt19937_64 rng(a.seed * 31 + 5);
  std::vector<int64_t> anchors(a.topics);
  std::uniform_int_distribution<int64_t> item(0, ds.n - 1);
  for (auto& x : anchors) x = item(rng);
  std::vector<int> rank0(a.topics), rank1(a.topics);
  for (int i = 0; i < a.topics; ++i) rank0[i] = rank1[i] = i;
  std::shuffle(rank0.begin(), rank0.end(), rng);
  std::shuffle(rank1.begin(), rank1.end(), rng);
  Zipf zipf(a.topics, a.zipf);
  std::normal_distribution<float> g;
  std::uniform_real_distribution<double> u(0, 1);
  const int total = a.warm + a.queries;
  std::vector<Query> qs(total);
  for (int q = 0; q < total; ++q) {
    bool shifted = q >= a.warm + a.queries / 2;
    int r = zipf(rng);
    qs[q].anchor = anchors[(shifted ? rank1 : rank0)[r]];
    qs[q].mm_u = u(rng);
    qs[q].vec.resize(kDim);
    const float* t = &ds.text[static_cast<size_t>(qs[q].anchor) * kDim];
    for (int d = 0; d < kDim; ++d) qs[q].vec[d] = t[d] + static_cast<float>(a.query_noise) * ds.sigma[d] * g(rng);
  }
  return qs;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

struct RunResult {
  double cross_pct = 0, p50_ms = 0, p99_ms = 0, recall = 0, mean_tiers = 0;
  double search_ms = 0, fetch_ms = 0;           // means
  double seen_pct = 0, cross_seen_pct = 0, cross_unseen_pct = 0;
  uint64_t moves = 0, move_errors = 0;
  int errors = 0;
  std::vector<std::vector<uint64_t>> hits;  // measured queries' ids
};

RunResult RunOne(keel::vector::Shard& shard, const std::vector<Query>& qs, const Args& a, int mix,
                 PlacementPolicy policy, const std::vector<std::vector<int64_t>>& truth) {
  using namespace keel::vector;
  RunResult rr;
  shard.query_log().Clear();
  auto make_request = [&](const Query& q) {
    SearchRequest req;
    req.kind = q.mm_u * 100.0 < mix ? QueryKind::kMultimodal : QueryKind::kText;
    req.text_query = q.vec;
    req.k = 10;
    req.nprobe = a.nprobe;
    return req;
  };
  // Anchors already queried in this run: a log-driven placement can only co-locate those.
  std::set<int64_t> seen;
  for (int i = 0; i < a.warm; ++i) {
    auto r = shard.Search(make_request(qs[i]));
    if (!r.ok()) ++rr.errors;
    seen.insert(qs[i].anchor);
  }
  coloc::PlacerOptions po;
  po.policy = policy;
  po.interval_ms = 2000;
  po.min_new_queries = 1000;
  coloc::Placer placer(&shard.store(), &shard.query_log(), po);
  auto moved = placer.RunOnce();
  if (!moved.ok()) std::fprintf(stderr, "placement round failed: %s\n", moved.status().ToString().c_str());
  placer.Start();
  std::vector<double> lat;
  // Anchors that were in the log when the latest placement round ran (approximately: the set is
  // refreshed when the placer's round count changes): CoLoc's steady state is measured on these.
  std::set<int64_t> placed = seen;
  uint64_t rounds_seen = placer.stats().rounds;
  int cross = 0, n_seen = 0, cross_seen = 0, cross_unseen = 0;
  double tiers_sum = 0, recall_sum = 0, search_sum = 0, fetch_sum = 0;
  for (int i = 0; i < a.queries; ++i) {
    const Query& q = qs[a.warm + i];
    auto t0 = Clock::now();
    auto r = shard.Search(make_request(q));
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (!r.ok()) {
      ++rr.errors;
      rr.hits.emplace_back();
      continue;
    }
    lat.push_back(ms);
    if (uint64_t rounds = placer.stats().rounds; rounds != rounds_seen) {
      rounds_seen = rounds;
      placed = seen;
    }
    const bool was_seen = placed.count(q.anchor) > 0;
    seen.insert(q.anchor);
    const bool crossed = r->trace.tiers_touched > 1;
    cross += crossed;
    n_seen += was_seen;
    (was_seen ? cross_seen : cross_unseen) += crossed;
    search_sum += r->search_ns / 1e6;
    fetch_sum += r->fetch_ns / 1e6;
    tiers_sum += r->trace.tiers_touched;
    std::vector<uint64_t> ids;
    for (const auto& h : r->hits) ids.push_back(h.id);
    std::set<int64_t> gt(truth[i].begin(), truth[i].end());
    int found = 0;
    for (uint64_t id : ids) found += gt.count(static_cast<int64_t>(id));
    recall_sum += found / 10.0;
    rr.hits.push_back(std::move(ids));
  }
  placer.Stop();
  auto st = placer.stats();
  rr.moves = st.moves;
  rr.move_errors = st.move_errors;
  rr.cross_pct = 100.0 * cross / std::max<size_t>(1, lat.size());
  const double n = static_cast<double>(std::max<size_t>(1, lat.size()));
  rr.search_ms = search_sum / n;
  rr.fetch_ms = fetch_sum / n;
  rr.seen_pct = 100.0 * n_seen / n;
  rr.cross_seen_pct = n_seen ? 100.0 * cross_seen / n_seen : 0;
  rr.cross_unseen_pct = lat.size() > static_cast<size_t>(n_seen) ? 100.0 * cross_unseen / (lat.size() - n_seen) : 0;
  rr.mean_tiers = tiers_sum / std::max<size_t>(1, lat.size());
  rr.p50_ms = Percentile(lat, 0.50);
  rr.p99_ms = Percentile(lat, 0.99);
  rr.recall = recall_sum / std::max(1, a.queries);
  return rr;
}

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  size_t at = 0;
  while (at <= s.size()) {
    size_t c = s.find(',', at);
    if (c == std::string::npos) c = s.size();
    if (c > at) out.push_back(std::stoi(s.substr(at, c - at)));
    at = c + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace keel::vector;
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--items") a.items = std::stoll(next());
    else if (k == "--warm") a.warm = std::stoi(next());
    else if (k == "--queries") a.queries = std::stoi(next());
    else if (k == "--mixes") a.mixes = ParseInts(next());
    else if (k == "--topics") a.topics = std::stoi(next());
    else if (k == "--zipf") a.zipf = std::stod(next());
    else if (k == "--query-noise") a.query_noise = std::stod(next());
    else if (k == "--dram-pct") a.dram_pct = std::stod(next());
    else if (k == "--ssd-pct") a.ssd_pct = std::stod(next());
    else if (k == "--cold-pct") a.cold_pct = std::stod(next());
    else if (k == "--lists") a.lists = std::stoi(next());
    else if (k == "--nprobe") a.nprobe = std::stoi(next());
    else if (k == "--rerank") a.rerank = std::stoi(next());
    else if (k == "--seed") a.seed = std::stoull(next());
    else if (k == "--dir") a.dir = next();
    else if (k == "--redis") a.redis = next();
    else if (k == "--redis-server") a.redis_server = next();
    else if (k == "--remote-delay-us") a.remote_delay_us = std::stoi(next());
    else {
      std::fprintf(stderr, "unknown flag %s (see the comment at the top of bench/vector/coloc_bench.cc)\n", k.c_str());
      return 2;
    }
  }
  if (a.items < 10000 || a.topics < 1 || a.topics > a.items || a.queries < 2) {
    std::fprintf(stderr, "need --items >= 10000, 1 <= --topics <= --items, --queries >= 2\n");
    return 2;
  }
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
  std::printf("command: %s\n", cmd.c_str());

  const std::string shared = SharedDir();
  auto real = ReadBvecs(shared + "/data/vectors/bigann10k_base.bvecs");
  if (!real.ok()) {
    std::fprintf(stderr, "%s\n", real.status().ToString().c_str());
    return 1;
  }
  if (real->dim != kDim) {
    std::fprintf(stderr, "expected %d-dim SIFT vectors, got %d\n", kDim, real->dim);
    return 1;
  }

  pid_t redis_pid = -1;
  std::string redis = a.redis;
  if (redis.empty()) {
    int port = keel::bench::FreeLoopbackPort();
    redis_pid = keel::bench::StartRedis(a.redis_server, port);
    if (!keel::bench::WaitRedis(port)) {
      std::fprintf(stderr, "redis-server (%s) did not come up on port %d\n", a.redis_server.c_str(), port);
      keel::bench::StopRedis(redis_pid);
      return 1;
    }
    redis = "127.0.0.1:" + std::to_string(port);
  }
  std::unique_ptr<keel::bench::DelayProxy> proxy;
  if (a.remote_delay_us > 0) {
    const int upstream = std::stoi(redis.substr(redis.rfind(':') + 1));
    proxy = std::make_unique<keel::bench::DelayProxy>(upstream, std::chrono::microseconds(a.remote_delay_us));
    if (!proxy->ok()) {
      std::fprintf(stderr, "delay proxy: cannot listen\n");
      return 1;
    }
    redis = "127.0.0.1:" + std::to_string(proxy->port());
    std::printf("remote tier through a delay proxy: +%d us per direction\n", a.remote_delay_us);
  }

  std::string dir = a.dir;
  bool own_dir = dir.empty();
  if (own_dir) {
    char tmpl[] = "/tmp/keel-coloc-bench-XXXXXX";
    if (!mkdtemp(tmpl)) {
      std::perror("mkdtemp");
      return 1;
    }
    dir = tmpl;
  }

  auto t0 = Clock::now();
  Dataset ds = MakeDataset(*real, a.items, a.seed);
  std::printf("dataset: %lld items (%lld real SIFT + generated), %.1f s\n", static_cast<long long>(a.items),
              static_cast<long long>(real->count),
              std::chrono::duration<double>(Clock::now() - t0).count());

  const double total_bytes = static_cast<double>(a.items) * 2 * kDim * sizeof(float);
  ShardOptions so;
  so.dir = dir + "/shard";
  so.text_dim = kDim;
  so.image_dim = kDim;
  so.index.kind = IndexKind::kIvfFlat;
  so.index.ivf_lists = a.lists;
  so.index.ivf_nprobe = a.nprobe;
  so.rerank = a.rerank;
  so.wal_sync = false;  // bulk load; durability is tested in tests/vector, not measured here
  so.tiers.dram_bytes = static_cast<int64_t>(total_bytes * a.dram_pct / 100);
  so.tiers.ssd_dir = dir + "/ssd";
  so.tiers.ssd_bytes = static_cast<int64_t>(total_bytes * a.ssd_pct / 100);
  so.tiers.cold_dir = dir + "/cold";
  so.tiers.cold_bytes = static_cast<int64_t>(total_bytes * a.cold_pct / 100);
  so.tiers.redis_url = redis;
  so.tiers.redis_prefix = "keel:colocbench:";
  so.tiers.remote_bytes = 0;
  auto shard_or = Shard::Open(so);
  if (!shard_or.ok()) {
    std::fprintf(stderr, "%s\n", shard_or.status().ToString().c_str());
    return 1;
  }
  auto& shard = **shard_or;

  t0 = Clock::now();
  const int64_t batch = 10000;
  std::vector<Item> items;
  for (int64_t start = 0; start < a.items; start += batch) {
    int64_t end = std::min(a.items, start + batch);
    items.assign(end - start, Item{});
    for (int64_t i = start; i < end; ++i) {
      Item& it = items[i - start];
      it.id = static_cast<uint64_t>(i);
      it.text.assign(&ds.text[static_cast<size_t>(i) * kDim], &ds.text[static_cast<size_t>(i + 1) * kDim]);
      it.image.resize(kDim);
      ImageOf(ds, i, it.image.data());
    }
    if (auto s = shard.Upsert(items); !s.ok()) {
      std::fprintf(stderr, "upsert at %lld: %s\n", static_cast<long long>(start), s.ToString().c_str());
      return 1;
    }
    if ((end % 100000) == 0 || end == a.items) {
      double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      std::fprintf(stderr, "loaded %lld/%lld items (%.0f items/s)\n", static_cast<long long>(end),
                   static_cast<long long>(a.items), end / secs);
    }
  }
  std::printf("load: %.1f s\n", std::chrono::duration<double>(Clock::now() - t0).count());

  // Exact ground truth for the measured queries (same for every mix and policy).
  auto qs = MakeQueries(ds, a);
  t0 = Clock::now();
  std::vector<std::vector<int64_t>> truth(a.queries);
  {
    faiss::IndexFlatL2 flat(kDim);
    flat.add(a.items, ds.text.data());
    std::vector<float> x(static_cast<size_t>(a.queries) * kDim);
    for (int i = 0; i < a.queries; ++i) std::copy(qs[a.warm + i].vec.begin(), qs[a.warm + i].vec.end(), &x[i * kDim]);
    std::vector<float> dist(static_cast<size_t>(a.queries) * 10);
    std::vector<faiss::Index::idx_t> lab(static_cast<size_t>(a.queries) * 10);
    flat.search(a.queries, x.data(), 10, dist.data(), lab.data());
    for (int i = 0; i < a.queries; ++i) truth[i].assign(lab.begin() + i * 10, lab.begin() + (i + 1) * 10);
  }
  std::printf("exact ground truth: %.1f s\n", std::chrono::duration<double>(Clock::now() - t0).count());

  if (auto s = shard.store().MeasureLatency(100); !s.ok())
    std::fprintf(stderr, "MeasureLatency: %s\n", s.ToString().c_str());
  std::printf("\ntiers (measured, p50):\n| tier | capacity MiB | items | 1-key read us | 10-key read us |\n|---|---:|---:|---:|---:|\n");
  for (const auto& u : shard.store().Usage())
    std::printf("| %s | %s | %lld | %.1f | %.1f |\n", u.name.c_str(),
                u.capacity_bytes ? std::to_string(u.capacity_bytes >> 20).c_str() : "unbounded",
                static_cast<long long>(u.items), u.measured_read_us, u.measured_batch_us);

  std::printf("\n| mix %% multimodal | placement | cross-tier %% | cross-tier %% (anchor placed / not yet) | mean tiers/query | p50 ms | p99 ms | mean search / fetch ms | recall@10 | keys moved | errors |\n");
  std::printf("|---:|---|---:|---|---:|---:|---:|---|---:|---:|---:|\n");
  std::vector<std::string> summary;
  bool printed_seen = false;
  for (int mix : a.mixes) {
    RunResult base = RunOne(shard, qs, a, mix, PlacementPolicy::kFrequency, truth);
    RunResult co = RunOne(shard, qs, a, mix, PlacementPolicy::kCoLoc, truth);
    for (auto* r : {&base, &co}) {
      std::printf("| %d | %s | %.2f | %.1f / %.1f | %.2f | %.3f | %.3f | %.3f / %.3f | %.4f | %llu | %d |\n", mix,
                  r == &base ? "frequency" : "coloc", r->cross_pct, r->cross_seen_pct, r->cross_unseen_pct,
                  r->mean_tiers, r->p50_ms, r->p99_ms, r->search_ms, r->fetch_ms, r->recall,
                  static_cast<unsigned long long>(r->moves), r->errors + static_cast<int>(r->move_errors));
    }
    if (!printed_seen) {
      std::printf("(queries whose anchor was in the log at the latest placement round: %.1f%% frequency, %.1f%% coloc)\n",
                  base.seen_pct, co.seen_pct);
      printed_seen = true;
    }
    std::fflush(stdout);
    bool identical = base.hits == co.hits;
    char line[256];
    std::snprintf(line, sizeof line, "| %d | %.2f -> %.2f | %.2fx | %.2fx | %s |", mix, base.cross_pct, co.cross_pct,
                  base.p50_ms > 0 ? co.p50_ms / base.p50_ms : 0, base.p99_ms > 0 ? co.p99_ms / base.p99_ms : 0,
                  identical ? "yes" : "NO");
    summary.push_back(line);
  }
  std::printf("\n| mix %% | cross-tier %% frequency -> coloc | p50 coloc/frequency | p99 coloc/frequency | identical hits |\n|---:|---|---:|---:|:---:|\n");
  for (const auto& l : summary) std::printf("%s\n", l.c_str());

  shard_or->reset();  // close the shard before its directory goes
  proxy.reset();
  if (own_dir) std::filesystem::remove_all(dir);
  keel::bench::StopRedis(redis_pid);
  return 0;
}
