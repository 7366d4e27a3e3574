// What a kvstore chunk's tag costs (keel/engine/kvstore_link.h): computing it when a chunk is
// published and checking it when one is fetched, unkeyed (XXH3-128) and keyed (HMAC-SHA256),
// against the copy an engine makes anyway when it adopts a fetched chunk (the baseline, in the
// same run). Chunks are a real model's raw f32 blocks (en-dense6L: 16 tokens x 6 layers x K and V).
//
//   build/chunk_tag_bench [--model PATH] [--codec raw] [--rounds 2000]   (from the checkout's root;
//   the model defaults to $KEEL_SHARED, else ../shared)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "keel/engine/kv_cache.h"
#include "keel/engine/kvstore_link.h"
#include "keel/engine/transformer.h"

namespace {

using Clock = std::chrono::steady_clock;

std::string SharedDir() {
  if (const char* s = std::getenv("KEEL_SHARED")) return s;
  return "../shared";  // run from the checkout's root
}

}  // namespace

int main(int argc, char** argv) {
  using namespace keel;
  std::string model_path = SharedDir() + "/data/models/en-dense6L.bin", codec = "raw";
  int rounds = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--model") model_path = argv[i + 1];
    else if (flag == "--codec") codec = argv[i + 1];
    else if (flag == "--rounds") rounds = std::max(1, std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "usage: %s [--model PATH] [--codec raw] [--rounds 2000]\n", argv[0]);
      return 2;
    }
  }
  auto model = engine::LoadLlama2c(model_path);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  auto cache = engine::KvCache::Create(*model, codec, engine::KvCacheOptions{});
  if (!cache.ok()) {
    std::fprintf(stderr, "%s\n", cache.status().ToString().c_str());
    return 1;
  }
  const size_t bytes = (*cache)->ChunkValueBytes();
  std::vector<uint8_t> blocks(bytes), copy(bytes);
  for (size_t i = 0; i < bytes; ++i) blocks[i] = static_cast<uint8_t>(i * 131 + 7);
  const Hash128 key{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  const std::string tag_key = "bench-kvstore-key-0123456789";
  const std::vector<std::pair<const uint8_t*, size_t>> pieces = {{blocks.data(), bytes}};

  auto time_us = [&](auto&& fn) {
    fn();  // warm
    const auto t0 = Clock::now();
    for (int r = 0; r < rounds; ++r) fn();
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / rounds;
  };
  volatile uint64_t sink = 0;
  const double copy_us = time_us([&] {
    std::memcpy(copy.data(), blocks.data(), bytes);
    sink = sink + copy[bytes / 2];
  });
  const double xxh_us = time_us([&] { sink = sink + engine::ChunkTag(key, pieces).lo; });
  const double hmac_us = time_us([&] { sink = sink + engine::ChunkTag(key, pieces, tag_key).lo; });

  std::printf("model=%s codec=%s chunk=%zu bytes rounds=%d\n", model_path.c_str(), codec.c_str(), bytes, rounds);
  std::printf("%-34s %10s %10s %12s\n", "per chunk", "us", "GB/s", "vs copy");
  auto row = [&](const char* what, double us) {
    std::printf("%-34s %10.2f %10.2f %11.2fx\n", what, us, bytes / us / 1e3, us / copy_us);
  };
  row("copy (adopting a fetched chunk)", copy_us);
  row("tag, unkeyed (XXH3-128)", xxh_us);
  row("tag, keyed (HMAC-SHA256)", hmac_us);
  return 0;
}
