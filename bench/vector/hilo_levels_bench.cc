// hilo_levels_bench: what each HiLO vector level (keel/hilo/catalog.h VectorLevel: nprobe, rerank)
// buys and costs on one shard, the figures a catalog's vector levels need. Loads the 10k SIFT base
// ($KEEL_SHARED/data/vectors) into a keel::vector::Shard per index kind, then for each nprobe and
// rerank on/off runs the 100 queries (k = 10, as the answer service asks) through
// ApplyVectorLevel and Shard::Search (ANN, tier fetch, exact rerank: the service's work without
// HTTP/JSON), and prints recall@10 against the exact ground truth and microseconds per query
// (median of --repeats passes over the 100 queries, single thread).
//
//   hilo_levels_bench [--shared DIR] [--index ivf-flat,ivf-pq,hnsw] [--nprobe 1,4,16,64]
//                     [--lists 100] [--rerank 32] [--repeats 5]
//
// For HNSW the level's nprobe is efSearch, which FAISS raises to the candidates asked
// (max(k, rerank)), so small values coincide.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "keel/core/log.h"
#include "keel/vector/hilo_link.h"
#include "keel/vector/shard.h"
#include "keel/vector/texmex.h"

namespace {

using namespace keel;
using namespace keel::vector;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string shared;
  std::vector<std::string> indexes = {"ivf-flat", "ivf-pq", "hnsw"};
  std::vector<int> nprobes = {1, 4, 16, 64};
  int lists = 100;
  int rerank = 32;
  int repeats = 5;
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

Args Parse(int argc, char** argv) {
  Args a;
  if (const char* env = std::getenv("KEEL_SHARED"); env != nullptr && *env != '\0') a.shared = env;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--shared") a.shared = value;
    else if (flag == "--index") a.indexes = Split(value);
    else if (flag == "--lists") a.lists = std::atoi(value.c_str());
    else if (flag == "--rerank") a.rerank = std::atoi(value.c_str());
    else if (flag == "--repeats") a.repeats = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--nprobe") {
      a.nprobes.clear();
      for (const std::string& v : Split(value)) a.nprobes.push_back(std::atoi(v.c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  if (a.shared.empty()) {
    std::fprintf(stderr, "set KEEL_SHARED or pass --shared DIR (holding data/vectors/bigann10k_*)\n");
    std::exit(2);
  }
  return a;
}

double Recall10(const IdSet& truth, int q, const std::vector<SearchHit>& hits) {
  std::set<int64_t> want(truth.values.begin() + q * truth.dim, truth.values.begin() + q * truth.dim + 10);
  int found = 0;
  for (const SearchHit& h : hits) found += static_cast<int>(want.count(static_cast<int64_t>(h.id)));
  return found / 10.0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  SetLogLevel("warn");
  const std::string dir = a.shared + "/data/vectors/";
  auto base = ReadBvecs(dir + "bigann10k_base.bvecs");
  auto truth = ReadIvecs(dir + "bigann10k_groundtruth.ivecs");
  if (!base.ok() || !truth.ok()) {
    std::fprintf(stderr, "%s\n", (!base.ok() ? base.status() : truth.status()).ToString().c_str());
    return 1;
  }
  const int queries = static_cast<int>(std::min<int64_t>(100, truth->count));
  std::vector<Item> items(static_cast<size_t>(base->count));
  for (int64_t i = 0; i < base->count; ++i) {
    items[static_cast<size_t>(i)].id = static_cast<uint64_t>(i);
    const float* row = base->values.data() + i * base->dim;
    items[static_cast<size_t>(i)].text.assign(row, row + base->dim);
  }
  std::vector<SearchRequest> asked(static_cast<size_t>(queries));  // the queries are base vectors 0..99
  for (int q = 0; q < queries; ++q) {
    asked[static_cast<size_t>(q)].text_query = items[static_cast<size_t>(q)].text;
    asked[static_cast<size_t>(q)].k = 10;
  }
  std::printf("SIFT10k (%lld base, %d queries), k = 10, one thread; IVF %d lists, IVF-PQ 16x8, HNSW M 32; "
              "rerank on = %d candidates, off = k\n\n",
              static_cast<long long>(base->count), queries, a.lists, a.rerank);
  std::printf("| index | nprobe (ef) | rerank | recall@10 | us/query (median of %d) |\n|---|---|---|---|---|\n", a.repeats);
  const std::string tmp = (std::filesystem::temp_directory_path() / ("keel-hilo-bench-" + std::to_string(::getpid()))).string();
  for (const std::string& name : a.indexes) {
    auto kind = ParseIndexKind(name);
    if (!kind.ok()) {
      std::fprintf(stderr, "%s\n", kind.status().ToString().c_str());
      return 2;
    }
    std::filesystem::remove_all(tmp);
    ShardOptions o;
    o.dir = tmp;
    o.text_dim = base->dim;
    o.image_dim = base->dim;
    o.index.kind = *kind;
    o.index.ivf_lists = a.lists;
    o.rerank = a.rerank;
    o.wal_sync = false;
    auto shard = Shard::Open(o);
    if (!shard.ok()) {
      std::fprintf(stderr, "%s\n", shard.status().ToString().c_str());
      return 1;
    }
    if (Status s = (*shard)->Upsert(items); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    for (int nprobe : a.nprobes) {
      for (bool rerank : {true, false}) {
        const hilo::VectorLevel level{nprobe, 10, rerank, 1};
        double recall = 0;
        std::vector<double> pass_us;
        for (int rep = 0; rep < a.repeats; ++rep) {
          const auto t0 = Clock::now();
          for (int q = 0; q < queries; ++q) {
            SearchRequest r = asked[static_cast<size_t>(q)];
            ApplyVectorLevel(level, &r);
            auto res = (*shard)->Search(r);
            if (!res.ok()) {
              std::fprintf(stderr, "%s\n", res.status().ToString().c_str());
              return 1;
            }
            if (rep == 0) recall += Recall10(*truth, q, res->hits);
          }
          pass_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / queries);
        }
        std::sort(pass_us.begin(), pass_us.end());
        std::printf("| %s | %d | %s | %.3f | %.1f |\n", name.c_str(), nprobe, rerank ? "on" : "off", recall / queries,
                    pass_us[pass_us.size() / 2]);
        std::fflush(stdout);
      }
    }
    shard->reset();
  }
  std::filesystem::remove_all(tmp);
  return 0;
}
