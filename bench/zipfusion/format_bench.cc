// ZipFusion block format throughput: encode (EncodeBlock), reference decode (ParseBlock +
// DecodeBlock) and fused decode (ParseBlock + DecodeChunkF32 over every chunk, summed so the
// work is not optimised away) on K/V-like data, against memcpy of the same raw bytes and a plain
// bf16/fp16 -> fp32 widening as baselines. GB/s always counts raw 16-bit bytes (2 per element),
// so rows compare directly. Prints a Markdown table.
//
//   build/format_bench [--blocks N] [--reps R]
// Each block is 16 tokens x head_dim 128 (2048 values) with its own scale drawn from 0.5..2,
// like one layer/KV-head cache block. Two working sets: L2-resident (64 blocks, 256 KiB raw) and
// DRAM-resident (default 8192 blocks, 32 MiB raw).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/kv/zipfusion/format.h"

namespace zf = keel::kv::zipfusion;

namespace {

constexpr int kBlockElems = 16 * 128;

struct Data {
  zf::Dtype dtype;
  int blocks = 0;
  std::vector<uint16_t> raw;       // blocks x kBlockElems
  std::vector<uint8_t> enc;        // blocks x MaxEncodedBytes, one slot per block
  std::vector<size_t> enc_bytes;
  size_t slot = 0;
  size_t total_enc = 0;
};

Data MakeData(zf::Dtype t, int blocks, uint32_t seed) {
  Data d;
  d.dtype = t;
  d.blocks = blocks;
  d.raw.resize(static_cast<size_t>(blocks) * kBlockElems);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(0.5f, 2.0f);
  for (int b = 0; b < blocks; ++b) {
    std::normal_distribution<float> nd(0.0f, scale(rng));
    for (int i = 0; i < kBlockElems; ++i) {
      const float x = nd(rng);
      d.raw[static_cast<size_t>(b) * kBlockElems + i] = t == zf::Dtype::kBf16 ? keel::F32ToBf16(x) : keel::F32ToF16(x);
    }
  }
  d.slot = zf::MaxEncodedBytes(kBlockElems, t);
  d.enc.resize(d.slot * blocks);
  d.enc_bytes.resize(blocks);
  return d;
}

// Best of `reps` runs of fn, in seconds.
double Time(int reps, const std::function<void()>& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

void EncodeAll(Data& d) {
  d.total_enc = 0;
  for (int b = 0; b < d.blocks; ++b) {
    auto r = zf::EncodeBlock(d.raw.data() + static_cast<size_t>(b) * kBlockElems, kBlockElems, d.dtype,
                             d.enc.data() + d.slot * b, d.slot);
    if (!r.ok()) std::abort();
    d.enc_bytes[b] = *r;
    d.total_enc += *r;
  }
}

volatile float g_sink;
volatile uint16_t g_sink16;

struct Row {
  std::string what;
  double gbps;
};

void Bench(zf::Dtype t, int blocks, int reps, std::vector<Row>& rows, double* ratio) {
  Data d = MakeData(t, blocks, 42);
  const double raw_bytes = 2.0 * d.raw.size();
  const char* tn = t == zf::Dtype::kBf16 ? "bf16" : "fp16";
  const std::string ws = blocks * kBlockElems * 2 <= (1 << 20) ? "L2" : "DRAM";
  auto add = [&](const std::string& what, double s) { rows.push_back({std::string(tn) + " " + ws + ": " + what, raw_bytes / s / 1e9}); };

  std::vector<uint16_t> copy(d.raw.size());
  add("memcpy (baseline)", Time(reps, [&] { std::memcpy(copy.data(), d.raw.data(), raw_bytes); g_sink16 = copy[7]; }));
  add("encode", Time(reps, [&] { EncodeAll(d); }));
  *ratio = static_cast<double>(d.total_enc) / raw_bytes;

  std::vector<uint16_t> out(kBlockElems);
  add("decode reference (parse + DecodeBlock)", Time(reps, [&] {
        for (int b = 0; b < d.blocks; ++b) {
          auto v = zf::ParseBlock(d.enc.data() + d.slot * b, d.enc_bytes[b]);
          zf::DecodeBlock(*v, out.data());
        }
        g_sink16 = out[3];
      }));
  add("widen raw to fp32 (baseline)", Time(reps, [&] {
        __m256 acc = _mm256_setzero_ps();
        for (size_t i = 0; i < d.raw.size(); i += 8) {
          const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d.raw.data() + i));
          acc = _mm256_add_ps(acc, t == zf::Dtype::kBf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16))
                                                        : _mm256_cvtph_ps(x));
        }
        alignas(32) float f[8];
        _mm256_store_ps(f, acc);
        g_sink = f[0];
      }));
  add("fused decode to fp32 (parse + DecodeChunkF32)", Time(reps, [&] {
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < d.blocks; ++b) {
          auto v = zf::ParseBlock(d.enc.data() + d.slot * b, d.enc_bytes[b]);
          zf::ExceptionCursor cur;
          for (int s = 0; s < kBlockElems; s += 8) acc = _mm256_add_ps(acc, zf::DecodeChunkF32(*v, s, cur));
        }
        alignas(32) float f[8];
        _mm256_store_ps(f, acc);
        g_sink = f[0];
      }));
  // Verify while we are here: a benchmark of a wrong decoder is worthless.
  for (int b = 0; b < d.blocks; ++b) {
    auto v = zf::ParseBlock(d.enc.data() + d.slot * b, d.enc_bytes[b]);
    zf::DecodeBlock(*v, out.data());
    if (std::memcmp(out.data(), d.raw.data() + static_cast<size_t>(b) * kBlockElems, 2 * kBlockElems) != 0) {
      std::fprintf(stderr, "format_bench: round trip mismatch in block %d\n", b);
      std::exit(1);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int blocks = 8192, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--blocks") == 0) blocks = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--reps") == 0) reps = std::atoi(argv[i + 1]);
  }
  std::vector<Row> rows;
  double ratio_bf16 = 0, ratio_fp16 = 0, r = 0;
  for (zf::Dtype t : {zf::Dtype::kBf16, zf::Dtype::kFp16}) {
    Bench(t, 64, reps * 20, rows, &r);
    Bench(t, blocks, reps, rows, t == zf::Dtype::kBf16 ? &ratio_bf16 : &ratio_fp16);
  }
  std::printf("ZipFusion format throughput, blocks of 16 tokens x 128 (2048 values), N(0, s) with s in 0.5..2\n");
  std::printf("compressed/raw: bf16 %.3f, fp16 %.3f\n\n", ratio_bf16, ratio_fp16);
  std::printf("| operation | GB/s (raw 16-bit bytes) | vs memcpy |\n|---|---:|---:|\n");
  double base = 1;
  for (const Row& row : rows) {
    if (row.what.find("memcpy") != std::string::npos) base = row.gbps;
    std::printf("| %s | %.1f | %.2fx |\n", row.what.c_str(), row.gbps, row.gbps / base);
  }
  return 0;
}
