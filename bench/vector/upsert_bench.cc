// upsert_bench: what replacing items costs against writing new ones, on one shard. A replacing
// upsert reads the items' old vectors first, so that a batch a tier refuses can put them back
// (Shard::Impl::ApplyUpsert), and tombstones their old index entries. Both kinds of batch run in
// the same process on the same shard: the SIFT10k base ($KEEL_SHARED/data/vectors), its first
// half written once, then per pass the second half written under new ids and the same vectors
// written again under ids that exist. Prints microseconds per item (median of --repeats passes)
// and the ratio replace / new, for a DRAM-only store and for DRAM + SSD with the DRAM tier too
// small to hold everything (old vectors are then read from the SSD tier).
//
//   upsert_bench [--shared DIR] [--batch 100] [--repeats 5] [--index ivf-flat]
//
// The log is written without fsync (wal_sync off): an fsync per batch would dominate both kinds
// alike and hide the difference measured here.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include "keel/core/log.h"
#include "keel/vector/shard.h"
#include "keel/vector/texmex.h"

namespace {

using namespace keel;
using namespace keel::vector;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string shared;
  int batch = 100;
  int repeats = 5;
  std::string index = "ivf-flat";
};

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr, "upsert_bench: %s\nusage: upsert_bench [--shared DIR] [--batch N] [--repeats N] [--index KIND]\n", why);
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  if (const char* env = std::getenv("KEEL_SHARED"); env != nullptr && *env != '\0') a.shared = env;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") Usage("replacing upserts against new ones");
    if (i + 1 >= argc) Usage(("missing value for " + flag).c_str());
    const std::string value = argv[i + 1];
    if (flag == "--shared") a.shared = value;
    else if (flag == "--batch") a.batch = std::atoi(value.c_str());
    else if (flag == "--repeats") a.repeats = std::atoi(value.c_str());
    else if (flag == "--index") a.index = value;
    else Usage(("unknown flag " + flag).c_str());
  }
  if (a.batch < 1 || a.repeats < 1) Usage("--batch and --repeats must be at least 1");
  if (a.shared.empty()) Usage("set KEEL_SHARED or pass --shared DIR (holding data/vectors/bigann10k_*)");
  return a;
}

// Microseconds per item to upsert `items` in batches.
Result<double> UpsertAll(Shard& shard, std::span<const Item> items, int batch) {
  const auto t0 = Clock::now();
  for (size_t at = 0; at < items.size(); at += static_cast<size_t>(batch)) {
    const size_t n = std::min(items.size() - at, static_cast<size_t>(batch));
    KEEL_RETURN_IF_ERROR(shard.Upsert(std::vector<Item>(items.begin() + at, items.begin() + at + n)));
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / static_cast<double>(items.size());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  SetLogLevel("warn");
  auto base = ReadBvecs(a.shared + "/data/vectors/bigann10k_base.bvecs");
  if (!base.ok()) {
    std::fprintf(stderr, "%s\n", base.status().ToString().c_str());
    return 1;
  }
  auto kind = ParseIndexKind(a.index);
  if (!kind.ok()) Usage(kind.status().ToString().c_str());
  const size_t half = static_cast<size_t>(base->count) / 2;
  std::vector<Item> first(half), second(half), fresh(half);
  for (size_t i = 0; i < 2 * half; ++i) {
    const float* row = base->values.data() + i * static_cast<size_t>(base->dim);
    Item& it = i < half ? first[i] : second[i - half];
    it.id = i;
    it.text.assign(row, row + base->dim);
  }
  std::printf("SIFT10k, %zu items written once, then per pass %zu new ids and the same %zu ids again; batch %d, %s, "
              "no fsync, one thread\n\n",
              half, half, half, a.batch, a.index.c_str());
  std::printf("| store | new ids us/item | replacing us/item | replace / new |\n|---|---:|---:|---:|\n");
  const std::string tmp =
      (std::filesystem::temp_directory_path() / ("keel-upsert-bench-" + std::to_string(::getpid()))).string();
  for (bool ssd : {false, true}) {
    std::filesystem::remove_all(tmp);
    ShardOptions o;
    o.dir = tmp + "/shard";
    o.text_dim = base->dim;
    o.image_dim = base->dim;
    o.index.kind = *kind;
    o.wal_sync = false;
    if (ssd) {
      // DRAM holds a tenth of the vectors: most old vectors come from the SSD tier.
      o.tiers.dram_bytes = static_cast<int64_t>(2 * half) * base->dim * 4 / 10;
      o.tiers.ssd_dir = tmp + "/ssd";
    }
    auto shard = Shard::Open(o);
    if (!shard.ok()) {
      std::fprintf(stderr, "%s\n", shard.status().ToString().c_str());
      return 1;
    }
    if (auto s = UpsertAll(**shard, first, a.batch); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    std::vector<double> new_us, replace_us;
    for (int rep = 0; rep < a.repeats; ++rep) {
      // New ids each pass (second's vectors under ids past everything written so far).
      for (size_t i = 0; i < half; ++i) {
        fresh[i] = second[i];
        fresh[i].id = 2 * half + static_cast<uint64_t>(rep) * half + i;
      }
      auto n = UpsertAll(**shard, fresh, a.batch);
      auto r = n.ok() ? UpsertAll(**shard, first, a.batch) : n;
      if (!n.ok() || !r.ok()) {
        std::fprintf(stderr, "%s\n", (!n.ok() ? n.status() : r.status()).ToString().c_str());
        return 1;
      }
      new_us.push_back(*n);
      replace_us.push_back(*r);
    }
    const double n = Median(new_us), r = Median(replace_us);
    std::printf("| %s | %.2f | %.2f | %.2fx |\n", ssd ? "DRAM (1/10) + SSD" : "DRAM", n, r, r / n);
    std::fflush(stdout);
    shard->reset();
  }
  std::filesystem::remove_all(tmp);
  return 0;
}
