// zipfusion_gpu_bench: correctness and throughput of the CUDA ZipFusion decode-attention kernel
// against the uncompressed bf16 kernel of the same design (zipfusion_attention.h), and, given
// their times, against another implementation on the same shapes (PyTorch's SDPA: gpu.sh).
//
//   zipfusion_gpu_bench [--quick] [--iters N] [--contexts 1024,4096,...] [--batches 1,8]
//                       [--profiles measured,harsh] [--peer FILE] [--blocks-per-split N]
//                       [--no-ref] [--check-only]
//
// 1. Builds synthetic K/V (bf16) in two profiles: "measured", the exponent statistics of real
//    K/V (normal values of std 0.55 in every channel, as measured in docs/zipfusion.md), and
//    "harsh": K with a few large-magnitude channels, rare outliers (x8..x64), zeros and
//    subnormals. Encodes them with the self-contained host encoder below (format of
//    keel/kv/zipfusion/format.h: width and base per block minimising the size, exceptions),
//    checking every block decodes back on the host.
// 2. Correctness, all before any timing:
//    - the GPU block loader (zf_decode_blocks) reproduces every bf16 value in both register
//      layouts the kernel uses (K's and V's), on both profiles and on a "width sweep" set that
//      makes the encoder use every width 0..8 with exceptions;
//    - zf_attention_zipfusion and zf_attention_bf16 outputs are bit-identical (memcmp) for GQA
//      groups 1, 2, 4, 8, several split sizes, partial last blocks;
//    - both agree with a double-precision CPU reference within tolerance.
// 3. Throughput: head_dim 128, 8 KV heads, 32 query heads, batch 1 and 8, context 1K..128K, each
//    profile, median over iterations with the L2 cache flushed before each; prints a Markdown
//    table. --peer FILE adds other implementations' times on the same shapes: lines
//    "<name> <context> <batch> <microseconds>" (bench/zipfusion/torch_sdpa.py writes them), and
//    the ratio of ZipFusion to the fastest of bf16 and the peers. --blocks-per-split N (1..64)
//    times with that split size instead of the automatic plan, to tune it.
// Exits non-zero on any mismatch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "keel/kv/zipfusion/cuda/launch.cuh"
#include "keel/kv/zipfusion/cuda/zipfusion_attention.h"

namespace zf = keel::kv::zipfusion::gpu;

namespace {

constexpr int kHeadDim = 128;
constexpr int kBlockTokens = 16;

int g_failures = 0;
double g_worst_reference_error = 0;  // over all reference comparisons, relative to sum p|v|

void Check(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

#define ZF_OK(call)                                                                                     \
  do {                                                                                                  \
    int rc_ = (call);                                                                                   \
    if (rc_ != zf::kZfOk) {                                                                             \
      std::fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, zf::zf_status_name(rc_), \
                   zf::zf_last_error());                                                                \
      std::exit(2);                                                                                     \
    }                                                                                                   \
  } while (0)

void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i);
    });
  for (auto& th : pool) th.join();
}

// ------------------------------------------------------------------------------------------------
// Host ZipFusion encoder/decoder for bf16 (format.h). Self-contained on purpose: the harness
// must not depend on keel/kv/zipfusion/format.cc.

uint16_t ReadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Encodes n bf16 values (n a multiple of 8, <= 32768) into out (capacity >= 8 + 2n); returns the
// size. (w, base) minimise 8 + n + w*n/8 + 3*n_exc; ties go to the smaller w, then base.
size_t EncodeBlock(const uint16_t* v, int n, uint8_t* out, int* width_out = nullptr, int* n_exc_out = nullptr) {
  int hist[256] = {};
  for (int i = 0; i < n; ++i) ++hist[(v[i] >> 7) & 0xFF];
  int prefix[257] = {0};
  for (int e = 0; e < 256; ++e) prefix[e + 1] = prefix[e] + hist[e];
  int best_w = 8, best_base = 0;
  size_t best = SIZE_MAX;
  for (int w = 0; w <= 8; ++w) {
    const int span = 1 << w;
    for (int base = 0; base + span <= 256; ++base) {
      const int n_exc = n - (prefix[base + span] - prefix[base]);
      const size_t bytes = 8 + static_cast<size_t>(n) + static_cast<size_t>(w) * n / 8 + 3 * static_cast<size_t>(n_exc);
      if (bytes < best) {
        best = bytes;
        best_w = w;
        best_base = base;
      }
    }
  }
  const int w = best_w, base = best_base, span = 1 << w;
  uint8_t* low = out + 8;
  uint8_t* codes = low + n;
  std::memset(codes, 0, static_cast<size_t>(w) * n / 8);
  std::vector<uint16_t> exc_pos;
  std::vector<uint8_t> exc_exp;
  uint64_t acc = 0;
  int acc_bits = 0;
  uint8_t* code_out = codes;
  for (int i = 0; i < n; ++i) {
    const int e = (v[i] >> 7) & 0xFF;
    low[i] = static_cast<uint8_t>(((v[i] >> 8) & 0x80) | (v[i] & 0x7F));
    int code = 0;
    if (e >= base && e < base + span) {
      code = e - base;
    } else {
      exc_pos.push_back(static_cast<uint16_t>(i));
      exc_exp.push_back(static_cast<uint8_t>(e));
    }
    if (w > 0) {
      acc |= static_cast<uint64_t>(code) << acc_bits;
      acc_bits += w;
      while (acc_bits >= 8) {
        *code_out++ = static_cast<uint8_t>(acc);
        acc >>= 8;
        acc_bits -= 8;
      }
    }
  }
  const int n_exc = static_cast<int>(exc_pos.size());
  uint8_t* pos = codes + static_cast<size_t>(w) * n / 8;
  for (int x = 0; x < n_exc; ++x) {
    pos[2 * x] = static_cast<uint8_t>(exc_pos[x]);
    pos[2 * x + 1] = static_cast<uint8_t>(exc_pos[x] >> 8);
  }
  std::memcpy(pos + 2 * n_exc, exc_exp.data(), n_exc);
  out[0] = 0x5A;
  out[1] = 0;  // bf16
  out[2] = static_cast<uint8_t>(w);
  out[3] = static_cast<uint8_t>(base);
  out[4] = static_cast<uint8_t>(n);
  out[5] = static_cast<uint8_t>(n >> 8);
  out[6] = static_cast<uint8_t>(n_exc);
  out[7] = static_cast<uint8_t>(n_exc >> 8);
  if (width_out) *width_out = w;
  if (n_exc_out) *n_exc_out = n_exc;
  return 8 + static_cast<size_t>(n) + static_cast<size_t>(w) * n / 8 + 3 * static_cast<size_t>(n_exc);
}

// Scalar reference decoder.
void DecodeBlock(const uint8_t* b, uint16_t* out) {
  const int w = b[2], base = b[3], n = ReadU16(b + 4), n_exc = ReadU16(b + 6);
  const uint8_t* low = b + 8;
  const uint8_t* codes = low + n;
  const uint8_t* pos = codes + static_cast<size_t>(w) * n / 8;
  const uint8_t* exp = pos + 2 * n_exc;
  for (int i = 0; i < n; ++i) {
    int code = 0;
    for (int bit = 0; bit < w; ++bit) {
      const int at = w * i + bit;
      code |= ((codes[at >> 3] >> (at & 7)) & 1) << bit;
    }
    const int e = base + code;
    out[i] = static_cast<uint16_t>(((low[i] & 0x80) << 8) | (e << 7) | (low[i] & 0x7F));
  }
  for (int x = 0; x < n_exc; ++x) {
    const int p = ReadU16(pos + 2 * x);
    out[p] = static_cast<uint16_t>((out[p] & 0x807F) | (exp[x] << 7));
  }
}

// ------------------------------------------------------------------------------------------------
// Synthetic data.

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float FromBf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// kMeasured: the statistics measured on real K/V (docs/zipfusion.md, "Exponent statistics"; the CPU
// benchmark's `measured` profile): normal values of std 0.55 in every channel (w = 3, ~1.2 %
// exceptions, ~0.71x bf16). kHarsh: K with outlier channels and rare outliers, zeros and
// subnormals in both (more exceptions, wider codes). kWidthSweep: every width 0..8.
enum class Kind { kMeasured, kHarsh, kWidthSweep };

const char* KindName(Kind k) { return k == Kind::kMeasured ? "measured" : k == Kind::kHarsh ? "harsh" : "width sweep"; }

// Two values per hash: a Box-Muller pair of normals, std 0.55.
void MeasuredPair(uint64_t key, uint16_t* out) {
  const uint64_t h = Mix(key), h2 = Mix(key ^ 0xA5A5A5A5DEADBEEFull);
  const double u1 = (static_cast<double>(h >> 11) + 1.0) / 9007199254740993.0;
  const double u2 = static_cast<double>(h2 >> 11) / 9007199254740992.0;
  const double r = 0.55 * std::sqrt(-2.0 * std::log(u1));
  out[0] = ToBf16(static_cast<float>(r * std::cos(6.283185307179586 * u2)));
  out[1] = ToBf16(static_cast<float>(r * std::sin(6.283185307179586 * u2)));
}

// Two values per hash: a Box-Muller pair of normals, then the rare specials.
void HarshPair(uint64_t key, bool is_k, int d, uint16_t* out) {
  const uint64_t h = Mix(key), h2 = Mix(key ^ 0xA5A5A5A5DEADBEEFull);
  const double u1 = (static_cast<double>(h >> 11) + 1.0) / 9007199254740993.0;
  const double u2 = static_cast<double>(h2 >> 11) / 9007199254740992.0;
  const double r = std::sqrt(-2.0 * std::log(u1));
  double x[2] = {r * std::cos(6.283185307179586 * u2), r * std::sin(6.283185307179586 * u2)};
  for (int s = 0; s < 2; ++s) {
    const int dd = d + s;
    if (is_k && (dd == 3 || dd == 47 || dd == 90 || dd == 121)) x[s] *= 6.0;  // K outlier channels
    const uint32_t sp = static_cast<uint32_t>(h2 >> (s ? 24 : 0)) & 0xFFFFFu;        // 20 bits
    if (sp < 500) x[s] *= static_cast<double>(8 << (sp & 3));                    // ~1/2000: x8..x64
    else if (sp < 700) x[s] = 0.0;                                                // ~1/5000: zero
    else if (sp < 750) x[s] = (sp & 1 ? -1.0 : 1.0) * 3.0e-39 * (1 + (sp & 7));  // subnormal
    out[s] = ToBf16(static_cast<float>(x[s]));
  }
}

// Block-wise exponent ranges that make the encoder pick every width 0..8, with exceptions.
uint16_t SweepValue(uint64_t key, int block_class) {
  static const int kSpan[10] = {1, 2, 4, 8, 16, 32, 64, 128, 161, 12};
  const uint64_t h = Mix(key);
  const int span = kSpan[block_class];
  const int lo = span >= 161 ? 0 : 120 - span / 2;
  int e = lo + static_cast<int>((h >> 8) % static_cast<uint64_t>(span));
  const int sp = static_cast<int>((h >> 40) & 1023);
  if (block_class != 0 && sp < 12) e = (sp & 1) ? 0 : 165;  // ~1%: far-away exponents -> exceptions
  const uint16_t sign_mant = static_cast<uint16_t>(((h & 1) << 15) | ((h >> 1) & 0x7F));
  return static_cast<uint16_t>(sign_mant | (e << 7));
}

struct Dataset {
  std::string name;
  Kind kind = Kind::kHarsh;
  int batch = 0, n_kv_heads = 0, n_tokens = 0, n_blocks = 0;
  std::vector<uint16_t> k, v;                  // [b][h][n_tokens][128] bf16 bits
  std::vector<uint32_t> k_size, v_size;        // encoded size per block, [b][h][blk]
  std::vector<uint64_t> k_offset, v_offset;    // offsets into the shared device buffer
  int width_hist[9] = {};
  int64_t exceptions = 0;
  size_t encoded_bytes = 0;
  // Device copies.
  uint16_t* d_k = nullptr;
  uint16_t* d_v = nullptr;
  uint8_t* d_blocks = nullptr;
  uint64_t* d_k_off = nullptr;
  uint64_t* d_v_off = nullptr;

  int64_t head_elems() const { return static_cast<int64_t>(n_tokens) * kHeadDim; }
  size_t tensor_elems() const { return static_cast<size_t>(batch) * n_kv_heads * head_elems(); }
};

// Generates and encodes; each (tensor, seq, head) is one parallel unit.
void Build(Dataset& ds, uint64_t seed) {
  ds.n_blocks = (ds.n_tokens + kBlockTokens - 1) / kBlockTokens;
  ds.k.resize(ds.tensor_elems());
  ds.v.resize(ds.tensor_elems());
  const int units_per_tensor = ds.batch * ds.n_kv_heads;
  const int64_t table = static_cast<int64_t>(units_per_tensor) * ds.n_blocks;
  ds.k_size.resize(table);
  ds.v_size.resize(table);
  ds.k_offset.resize(table);
  ds.v_offset.resize(table);
  std::vector<std::vector<uint8_t>> unit_bytes(2 * units_per_tensor);
  std::vector<std::vector<uint64_t>> unit_off(2 * units_per_tensor);
  std::vector<std::array<int, 9>> unit_hist(2 * units_per_tensor);
  std::vector<int64_t> unit_exc(2 * units_per_tensor, 0);
  std::atomic<int> bad_roundtrip{0};
  ParallelFor(2 * units_per_tensor, [&](int64_t u) {
    const bool is_k = u < units_per_tensor;
    const int64_t uu = is_k ? u : u - units_per_tensor;
    uint16_t* vals = (is_k ? ds.k.data() : ds.v.data()) + uu * ds.head_elems();
    const uint64_t useed = Mix(seed * 1315423911ull + static_cast<uint64_t>(u));
    for (int64_t i = 0; i < ds.head_elems(); i += 2) {
      const uint64_t key = useed ^ static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
      if (ds.kind == Kind::kMeasured) {
        MeasuredPair(key, vals + i);
      } else if (ds.kind == Kind::kHarsh) {
        HarshPair(key, is_k, static_cast<int>(i % kHeadDim), vals + i);
      } else {
        const int blk = static_cast<int>(i / (kBlockTokens * kHeadDim));
        const int cls = static_cast<int>((blk + uu) % 10);
        vals[i] = SweepValue(key, cls);
        vals[i + 1] = SweepValue(key ^ 1, cls);
      }
    }
    auto& bytes = unit_bytes[u];
    auto& offs = unit_off[u];
    unit_hist[u].fill(0);
    std::vector<uint8_t> tmp(8 + 2 * kBlockTokens * kHeadDim);
    std::vector<uint16_t> back(kBlockTokens * kHeadDim);
    uint32_t* sizes = (is_k ? ds.k_size.data() : ds.v_size.data()) + uu * ds.n_blocks;
    for (int blk = 0; blk < ds.n_blocks; ++blk) {
      const int fill = std::min(kBlockTokens, ds.n_tokens - blk * kBlockTokens);
      const int n = fill * kHeadDim;
      const uint16_t* src = vals + static_cast<int64_t>(blk) * kBlockTokens * kHeadDim;
      int w = 0, n_exc = 0;
      const size_t size = EncodeBlock(src, n, tmp.data(), &w, &n_exc);
      DecodeBlock(tmp.data(), back.data());
      if (std::memcmp(back.data(), src, n * sizeof(uint16_t)) != 0) bad_roundtrip.fetch_add(1);
      if (zf::zf_validate_block(tmp.data(), size, n) != zf::kZfOk) bad_roundtrip.fetch_add(1);
      ++unit_hist[u][w];
      unit_exc[u] += n_exc;
      sizes[blk] = static_cast<uint32_t>(size);
      offs.push_back(bytes.size());
      bytes.insert(bytes.end(), tmp.begin(), tmp.begin() + size);
      bytes.resize((bytes.size() + 7) & ~size_t{7}, 0);  // keep every block 8-byte aligned
    }
  });
  Check(bad_roundtrip.load() == 0, ds.name + ": host encoder round trip / validation failed on " +
                                       std::to_string(bad_roundtrip.load()) + " blocks");
  // One device buffer: all K units, then all V units.
  size_t total = 0;
  std::vector<size_t> unit_base(2 * units_per_tensor);
  for (int u = 0; u < 2 * units_per_tensor; ++u) {
    unit_base[u] = total;
    total += unit_bytes[u].size();
    for (int w = 0; w < 9; ++w) ds.width_hist[w] += unit_hist[u][w];
    ds.exceptions += unit_exc[u];
  }
  ds.encoded_bytes = total;
  for (int u = 0; u < 2 * units_per_tensor; ++u) {
    const bool is_k = u < units_per_tensor;
    const int uu = is_k ? u : u - units_per_tensor;
    uint64_t* table_out = (is_k ? ds.k_offset.data() : ds.v_offset.data()) + static_cast<int64_t>(uu) * ds.n_blocks;
    for (int blk = 0; blk < ds.n_blocks; ++blk) table_out[blk] = unit_base[u] + unit_off[u][blk];
  }
  const size_t tensor_bytes = ds.tensor_elems() * sizeof(uint16_t);
  CUDA_OK(cudaMalloc(&ds.d_k, tensor_bytes));
  CUDA_OK(cudaMalloc(&ds.d_v, tensor_bytes));
  CUDA_OK(cudaMemcpy(ds.d_k, ds.k.data(), tensor_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(ds.d_v, ds.v.data(), tensor_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMalloc(&ds.d_blocks, std::max<size_t>(total, 8)));
  for (int u = 0; u < 2 * units_per_tensor; ++u) {
    CUDA_OK(cudaMemcpy(ds.d_blocks + unit_base[u], unit_bytes[u].data(), unit_bytes[u].size(), cudaMemcpyHostToDevice));
    std::vector<uint8_t>().swap(unit_bytes[u]);
  }
  CUDA_OK(cudaMalloc(&ds.d_k_off, table * sizeof(uint64_t)));
  CUDA_OK(cudaMalloc(&ds.d_v_off, table * sizeof(uint64_t)));
  CUDA_OK(cudaMemcpy(ds.d_k_off, ds.k_offset.data(), table * sizeof(uint64_t), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(ds.d_v_off, ds.v_offset.data(), table * sizeof(uint64_t), cudaMemcpyHostToDevice));
}

void Release(Dataset& ds) {
  cudaFree(ds.d_k);
  cudaFree(ds.d_v);
  cudaFree(ds.d_blocks);
  cudaFree(ds.d_k_off);
  cudaFree(ds.d_v_off);
  ds.d_k = ds.d_v = nullptr;
  ds.d_blocks = nullptr;
  ds.d_k_off = ds.d_v_off = nullptr;
}

__global__ void CountMismatches(const uint16_t* a, const uint16_t* b, size_t n, unsigned long long* count) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    local += a[i] != b[i];
  if (local) atomicAdd(count, local);
}

// The kernel's own block loader must reproduce every stored value.
void CheckDecode(const Dataset& ds, int* d_error) {
  zf::ZfAttnShape s;
  s.batch = ds.batch;
  s.n_kv_heads = ds.n_kv_heads;
  s.n_q_heads = ds.n_kv_heads;
  s.n_tokens = ds.n_tokens;
  const size_t n = ds.tensor_elems();
  uint16_t* d_out = nullptr;
  unsigned long long* d_count = nullptr;
  CUDA_OK(cudaMalloc(&d_out, n * sizeof(uint16_t)));
  CUDA_OK(cudaMalloc(&d_count, sizeof(unsigned long long)));
  // Each tensor in both register layouts of the attention kernel (K's and V's).
  for (int x = 0; x < 4; ++x) {
    const int t = x / 2;
    const zf::ZfOperand operand = x % 2 == 0 ? zf::kZfKeyOperand : zf::kZfValueOperand;
    CUDA_OK(cudaMemset(d_out, 0xFF, n * sizeof(uint16_t)));
    CUDA_OK(cudaMemset(d_count, 0, sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(d_error, 0, sizeof(int)));
    ZF_OK(zf::zf_decode_blocks(s, ds.d_blocks, t == 0 ? ds.d_k_off : ds.d_v_off, d_out, operand, d_error));
    keel::cuda::LaunchKernel(CountMismatches, dim3(1024), dim3(256), 0, nullptr, static_cast<const uint16_t*>(d_out),
                             static_cast<const uint16_t*>(t == 0 ? ds.d_k : ds.d_v), n, d_count);
    CUDA_OK(cudaGetLastError());
    unsigned long long count = 0;
    int err = 0;
    CUDA_OK(cudaMemcpy(&count, d_count, sizeof(count), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&err, d_error, sizeof(err), cudaMemcpyDeviceToHost));
    Check(count == 0 && err == 0, ds.name + ": GPU block decode of " + (t == 0 ? "K" : "V") +
                                      (x % 2 == 0 ? " (K layout)" : " (V layout)") + ": " +
                                      std::to_string(count) + " of " + std::to_string(n) +
                                      " values differ, error flag " + std::to_string(err));
  }
  cudaFree(d_out);
  cudaFree(d_count);
}

// ------------------------------------------------------------------------------------------------
// Attention runs.

struct Device {
  float* q = nullptr;  // [batch][n_q_heads][128], sized for the largest run
  float* out_bf16 = nullptr;
  float* out_zf = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  int* error = nullptr;
  size_t max_out = 0;
  std::vector<float> q_host;
};

void EnsureWorkspace(Device& dev, size_t bytes) {
  if (bytes <= dev.ws_bytes) return;
  cudaFree(dev.ws);
  CUDA_OK(cudaMalloc(&dev.ws, bytes));
  dev.ws_bytes = bytes;
}

zf::ZfAttnShape ShapeFor(const Dataset& ds, int batch, int n_tokens, int group, int bps) {
  zf::ZfAttnShape s;
  s.batch = batch;
  s.n_kv_heads = ds.n_kv_heads;
  s.n_q_heads = ds.n_kv_heads * group;
  s.n_tokens = n_tokens;
  s.token_capacity = ds.n_tokens;
  s.block_capacity = ds.n_blocks;
  s.blocks_per_split = bps;
  return s;
}

int RunBf16(Device& dev, const Dataset& ds, const zf::ZfAttnShape& s) {
  return zf::zf_attention_bf16(s, dev.q, ds.d_k, ds.d_v, dev.out_bf16, dev.ws, dev.ws_bytes);
}
int RunZf(Device& dev, const Dataset& ds, const zf::ZfAttnShape& s) {
  return zf::zf_attention_zipfusion(s, dev.q, ds.d_blocks, ds.d_k_off, ds.d_blocks, ds.d_v_off, dev.out_zf, dev.ws,
                                    dev.ws_bytes, dev.error);
}

// Double-precision reference; returns the number of elements outside tolerance and the worst
// error relative to sum_t p_t |v_td| (the scale fp32 rounding errors are relative to).
int64_t CompareWithReference(const Dataset& ds, const zf::ZfAttnShape& s, const std::vector<float>& q,
                             const std::vector<float>& got, double* worst) {
  const int group = s.n_q_heads / s.n_kv_heads;
  std::vector<int64_t> bad(static_cast<size_t>(s.batch) * s.n_kv_heads, 0);
  std::vector<double> worst_unit(bad.size(), 0.0);
  ParallelFor(static_cast<int64_t>(s.batch) * s.n_kv_heads, [&](int64_t unit) {
    const int b = static_cast<int>(unit / s.n_kv_heads), h = static_cast<int>(unit % s.n_kv_heads);
    const uint16_t* kh = ds.k.data() + (static_cast<int64_t>(b) * ds.n_kv_heads + h) * ds.head_elems();
    const uint16_t* vh = ds.v.data() + (static_cast<int64_t>(b) * ds.n_kv_heads + h) * ds.head_elems();
    std::vector<double> scores(s.n_tokens);
    std::vector<double> row(kHeadDim);
    for (int g = 0; g < group; ++g) {
      const int hq = h * group + g;
      const float* qh = q.data() + (static_cast<int64_t>(b) * s.n_q_heads + hq) * kHeadDim;
      double m = -INFINITY;
      for (int t = 0; t < s.n_tokens; ++t) {
        double dot = 0;
        for (int d = 0; d < kHeadDim; ++d) dot += static_cast<double>(qh[d]) * FromBf16(kh[t * kHeadDim + d]);
        scores[t] = dot / std::sqrt(static_cast<double>(kHeadDim));
        m = std::max(m, scores[t]);
      }
      double l = 0;
      std::vector<double> o(kHeadDim, 0.0), oabs(kHeadDim, 0.0);
      for (int t = 0; t < s.n_tokens; ++t) {
        const double p = std::exp(scores[t] - m);
        l += p;
        for (int d = 0; d < kHeadDim; ++d) {
          const double x = FromBf16(vh[t * kHeadDim + d]);
          o[d] += p * x;
          oabs[d] += p * std::fabs(x);
        }
      }
      const float* gh = got.data() + (static_cast<int64_t>(b) * s.n_q_heads + hq) * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d) {
        const double ref = o[d] / l, scale = oabs[d] / l;
        const double err = std::fabs(gh[d] - ref) / std::max(scale, 1e-30);
        worst_unit[unit] = std::max(worst_unit[unit], std::isfinite(err) ? err : INFINITY);
        if (!(err <= 1e-4)) ++bad[unit];
      }
    }
  });
  int64_t total = 0;
  *worst = 0;
  for (size_t i = 0; i < bad.size(); ++i) {
    total += bad[i];
    *worst = std::max(*worst, worst_unit[i]);
  }
  return total;
}

// Runs both kernels once and checks them; returns true when bit-identical.
bool CheckAttention(Device& dev, const Dataset& ds, const zf::ZfAttnShape& s, bool reference) {
  zf::ZfPlan plan;
  ZF_OK(zf::zf_make_plan(s, &plan));
  EnsureWorkspace(dev, plan.workspace_bytes);
  const size_t out_n = static_cast<size_t>(s.batch) * s.n_q_heads * kHeadDim;
  CUDA_OK(cudaMemset(dev.out_bf16, 0x7F, out_n * sizeof(float)));
  CUDA_OK(cudaMemset(dev.out_zf, 0x3F, out_n * sizeof(float)));
  CUDA_OK(cudaMemset(dev.error, 0, sizeof(int)));
  ZF_OK(RunBf16(dev, ds, s));
  ZF_OK(RunZf(dev, ds, s));
  std::vector<float> a(out_n), b(out_n);
  int err = 0;
  CUDA_OK(cudaMemcpy(a.data(), dev.out_bf16, out_n * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(b.data(), dev.out_zf, out_n * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&err, dev.error, sizeof(int), cudaMemcpyDeviceToHost));
  char what[256];
  std::snprintf(what, sizeof what, "%s: batch %d, %d tokens, %d/%d heads, %d blocks/split", ds.name.c_str(), s.batch,
                s.n_tokens, s.n_q_heads, s.n_kv_heads, plan.blocks_per_split);
  const bool identical = std::memcmp(a.data(), b.data(), out_n * sizeof(float)) == 0;
  if (!identical) {
    size_t diff = 0, first = out_n;
    for (size_t i = 0; i < out_n; ++i)
      if (std::memcmp(&a[i], &b[i], 4) != 0) {
        ++diff;
        first = std::min(first, i);
      }
    char more[128];
    std::snprintf(more, sizeof more, " (%zu differ; first at %zu: %.9g vs %.9g)", diff, first, a[first], b[first]);
    Check(false, std::string(what) + ": ZipFusion output not bit-identical to bf16" + more);
  }
  Check(err == 0, std::string(what) + ": kernel raised the corrupt-block flag");
  bool finite = true;
  for (float x : a) finite = finite && std::isfinite(x);
  Check(finite, std::string(what) + ": non-finite output");
  if (reference) {
    double worst = 0;
    const int64_t bad = CompareWithReference(ds, s, dev.q_host, a, &worst);
    g_worst_reference_error = std::max(g_worst_reference_error, worst);
    Check(bad == 0, std::string(what) + ": " + std::to_string(bad) + " outputs off the CPU reference (worst " +
                        std::to_string(worst) + " of sum p|v|)");
  }
  return identical;
}

// Median time in microseconds of `iters` runs, the L2 flushed before each.
double TimeKernel(const std::function<int()>& run, int iters, void* flush, size_t flush_bytes) {
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int i = -2; i < iters; ++i) {  // two warm-up runs
    CUDA_OK(cudaMemsetAsync(flush, i & 0xFF, flush_bytes));
    CUDA_OK(cudaEventRecord(start));
    ZF_OK(run());
    CUDA_OK(cudaEventRecord(stop));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 0) us.push_back(ms * 1000.0);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const long x = std::strtol(p, &end, 10);
    if (end == p || x <= 0) {
      std::fprintf(stderr, "bad list: %s\n", s);
      std::exit(2);
    }
    out.push_back(static_cast<int>(x));
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = s.find(',', at);
    out.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

// Another implementation's time on one shape (32 query heads over 8 KV heads, head_dim 128).
struct PeerTime {
  std::string name;
  int context = 0, batch = 0;
  double us = 0;
};

bool ReadPeers(const char* path, std::vector<PeerTime>* out) {
  FILE* f = std::fopen(path, "r");
  if (!f) {
    std::fprintf(stderr, "--peer %s: %s\n", path, std::strerror(errno));
    return false;
  }
  char line[512];
  int n = 0;
  while (std::fgets(line, sizeof line, f)) {
    ++n;
    if (line[0] == '#' || line[0] == '\n') continue;
    char name[128];
    PeerTime p;
    if (std::sscanf(line, "%127s %d %d %lf", name, &p.context, &p.batch, &p.us) != 4 || p.context <= 0 ||
        p.batch <= 0 || !(p.us > 0)) {
      std::fprintf(stderr, "--peer %s:%d: expected '<name> <context> <batch> <microseconds>'\n", path, n);
      std::fclose(f);
      return false;
    }
    p.name = name;
    out->push_back(p);
  }
  std::fclose(f);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> contexts = {1024, 4096, 8192, 32768, 131072};
  std::vector<int> batches = {1, 8};
  int iters = 15;
  bool reference = true;
  bool check_only = false;
  std::vector<Kind> profiles = {Kind::kMeasured, Kind::kHarsh};
  int blocks_per_split = 0;  // the timed runs' split size; 0 = the automatic plan
  std::vector<PeerTime> peers;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      contexts = {1024, 8192, 32768};
      iters = 5;
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--contexts" && i + 1 < argc) {
      contexts = ParseList(argv[++i]);
    } else if (a == "--batches" && i + 1 < argc) {
      batches = ParseList(argv[++i]);
    } else if (a == "--profiles" && i + 1 < argc) {
      profiles.clear();
      for (const std::string& name : SplitCommas(argv[++i])) {
        if (name == "measured") profiles.push_back(Kind::kMeasured);
        else if (name == "harsh") profiles.push_back(Kind::kHarsh);
        else {
          std::fprintf(stderr, "--profiles: unknown profile '%s' (measured, harsh)\n", name.c_str());
          return 2;
        }
      }
    } else if (a == "--peer" && i + 1 < argc) {
      if (!ReadPeers(argv[++i], &peers)) return 2;
    } else if (a == "--blocks-per-split" && i + 1 < argc) {
      blocks_per_split = std::atoi(argv[++i]);
      if (blocks_per_split < 0 || blocks_per_split > 64) {
        std::fprintf(stderr, "--blocks-per-split: expected 0 (automatic) to 64\n");
        return 2;
      }
    } else if (a == "--no-ref") {
      reference = false;
    } else if (a == "--check-only") {
      check_only = true;  // correctness on the small sets only (the CPU emulation runs this)
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--iters N] [--contexts 1024,4096,...] [--batches 1,8]\n"
                   "          [--profiles measured,harsh] [--peer FILE] [--blocks-per-split N] [--no-ref] [--check-only]\n",
                   argv[0]);
      return 2;
    }
  }
  for (int c : contexts)
    if (c % kBlockTokens != 0) {
      std::fprintf(stderr, "contexts must be multiples of 16\n");
      return 2;
    }

  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::fprintf(stderr, "zipfusion_gpu_bench: no CUDA device\n");
    return 3;
  }
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const auto t_start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  };

  const int max_ctx = *std::max_element(contexts.begin(), contexts.end());
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  constexpr int kMaxGroup = 8;

  Device dev;
  // Queries for the largest run (batch up to max(8, max_batch), up to 8 x 8 query heads).
  const int q_batch = std::max(8, max_batch);
  const size_t q_n = static_cast<size_t>(q_batch) * 8 * kMaxGroup * kHeadDim;
  dev.q_host.resize(q_n);
  for (size_t i = 0; i < q_n; ++i) {
    const uint64_t h = Mix(0xC0FFEEull + i);
    const double u1 = (static_cast<double>(h >> 11) + 1.0) / 9007199254740993.0;
    const double u2 = static_cast<double>(Mix(h) >> 11) / 9007199254740992.0;
    dev.q_host[i] = static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  CUDA_OK(cudaMalloc(&dev.q, q_n * sizeof(float)));
  CUDA_OK(cudaMemcpy(dev.q, dev.q_host.data(), q_n * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMalloc(&dev.out_bf16, q_n * sizeof(float)));
  CUDA_OK(cudaMalloc(&dev.out_zf, q_n * sizeof(float)));
  CUDA_OK(cudaMalloc(&dev.error, sizeof(int)));

  std::printf("## ZipFusion CUDA decode attention (%s, %d SMs, %.0f GiB, L2 %d MiB)\n\n", prop.name,
              prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0, prop.l2CacheSize >> 20);
  std::fflush(stdout);

  // ---- Correctness on small sets: every width, partial blocks, GQA 1..8, several split sizes.
  {
    struct Small {
      const char* name;
      Kind kind;
      int batch, kv, tokens;
    };
    const Small smalls[] = {
        {"harsh 1000 tok", Kind::kHarsh, 3, 4, 1000},
        {"harsh 37 tok", Kind::kHarsh, 2, 2, 37},
        {"measured 200 tok", Kind::kMeasured, 2, 2, 200},
        {"width sweep", Kind::kWidthSweep, 2, 4, 2000},
    };
    int64_t checks = 0;
    for (const Small& sm : smalls) {
      Dataset ds;
      ds.name = sm.name;
      ds.kind = sm.kind;
      ds.batch = sm.batch;
      ds.n_kv_heads = sm.kv;
      ds.n_tokens = sm.tokens;
      Build(ds, 7 + checks);
      CheckDecode(ds, dev.error);
      if (sm.kind == Kind::kWidthSweep) {
        for (int w = 0; w <= 8; ++w)
          Check(ds.width_hist[w] > 0, std::string(sm.name) + ": no block of width " + std::to_string(w));
        Check(ds.exceptions > 0, std::string(sm.name) + ": no exceptions");
      }
      const bool ref = reference && sm.kind != Kind::kWidthSweep;
      std::vector<int> lengths = {ds.n_tokens};
      if (ds.n_tokens > 64) lengths.insert(lengths.end(), {16, 48, (ds.n_tokens / 16) * 16});
      for (int group : {1, 2, 4, 8})
        for (int bps : {0, 1, 3, 64})
          for (int len : lengths) {
            CheckAttention(dev, ds, ShapeFor(ds, ds.batch, len, group, bps), ref);
            ++checks;
          }
      Release(ds);
    }
    std::printf("Correctness: %lld bf16-vs-ZipFusion runs on small sets, widths 0..8, partial blocks, GQA 1..8: %s; "
                "worst error against the double-precision reference %.2g of sum p|v| (limit 1e-4)\n",
                static_cast<long long>(checks), g_failures == 0 ? "bit-identical" : "FAILED", g_worst_reference_error);
    std::fflush(stdout);
  }

  if (check_only) {
    if (g_failures) std::fprintf(stderr, "zipfusion_gpu_bench: %d check(s) failed\n", g_failures);
    return g_failures ? 1 : 0;
  }

  // ---- Benchmark: per profile, one data set of the largest batch and context; smaller runs read
  // a prefix of it.
  size_t flush_bytes = std::max<size_t>(256u << 20, 4 * static_cast<size_t>(prop.l2CacheSize));
  void* flush = nullptr;
  CUDA_OK(cudaMalloc(&flush, flush_bytes));
  std::vector<std::string> peer_names;
  for (const PeerTime& p : peers)
    if (std::find(peer_names.begin(), peer_names.end(), p.name) == peer_names.end()) peer_names.push_back(p.name);
  auto peer_us = [&](const std::string& name, int ctx, int batch) {
    for (const PeerTime& p : peers)
      if (p.name == name && p.context == ctx && p.batch == batch) return p.us;
    return 0.0;
  };
  for (Kind profile : profiles) {
    Dataset big;
    big.name = std::string("bench, ") + KindName(profile);
    big.kind = profile;
    big.batch = max_batch;
    big.n_kv_heads = 8;
    big.n_tokens = max_ctx;
    Build(big, 1);
    CheckDecode(big, dev.error);
    const size_t raw_bytes = big.tensor_elems() * 2 * sizeof(uint16_t);
    int total_blocks = 0;
    for (int w = 0; w <= 8; ++w) total_blocks += big.width_hist[w];
    std::printf("\n### Profile: %s\n\nData: %d x %d KV heads x %d tokens x 128, K and V: %.1f MiB bf16 -> %.1f MiB "
                "ZipFusion (%.3fx); widths",
                KindName(profile), big.batch, big.n_kv_heads, big.n_tokens, raw_bytes / 1048576.0,
                big.encoded_bytes / 1048576.0, static_cast<double>(big.encoded_bytes) / raw_bytes);
    for (int w = 0; w <= 8; ++w)
      if (big.width_hist[w]) std::printf(" w%d %.1f%%", w, 100.0 * big.width_hist[w] / total_blocks);
    std::printf("; %.1f exceptions per 2048-value block; split: %s (setup %.0f s)\n\n",
                static_cast<double>(big.exceptions) / total_blocks,
                blocks_per_split > 0 ? (std::to_string(blocks_per_split) + " blocks").c_str() : "automatic", elapsed());
    std::printf("| context | batch | bf16 µs | bf16 GB/s | ZipFusion µs | ZipFusion GB/s | bytes ZF/bf16 | speed ZF/bf16 |");
    for (const std::string& n : peer_names) std::printf(" %s µs |", n.c_str());
    std::printf(" ZF vs fastest other |\n|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (size_t i = 0; i < peer_names.size(); ++i) std::printf("---:|");
    std::printf("---:|\n");
    std::fflush(stdout);
    for (int ctx : contexts)
      for (int batch : batches) {
        const zf::ZfAttnShape s = ShapeFor(big, batch, ctx, 4, blocks_per_split);  // 32 query heads over 8 KV heads
        const bool ok = CheckAttention(dev, big, s, reference);
        const int nb = ctx / kBlockTokens;
        size_t zf_bytes = 0;
        for (int b = 0; b < batch; ++b)
          for (int h = 0; h < big.n_kv_heads; ++h) {
            const int64_t at = (static_cast<int64_t>(b) * big.n_kv_heads + h) * big.n_blocks;
            for (int blk = 0; blk < nb; ++blk) zf_bytes += big.k_size[at + blk] + big.v_size[at + blk] + 16;
          }
        const size_t bf_bytes = static_cast<size_t>(batch) * big.n_kv_heads * ctx * kHeadDim * 2 * sizeof(uint16_t);
        const double t_bf = TimeKernel([&] { return RunBf16(dev, big, s); }, iters, flush, flush_bytes);
        const double t_zf = TimeKernel([&] { return RunZf(dev, big, s); }, iters, flush, flush_bytes);
        const std::string ctx_name = ctx % 1024 == 0 ? std::to_string(ctx / 1024) + "K" : std::to_string(ctx);
        std::printf("| %s | %d | %.1f | %.0f | %.1f | %.0f | %.3f | %.2fx |", ctx_name.c_str(), batch, t_bf,
                    bf_bytes / t_bf / 1e3, t_zf, zf_bytes / t_zf / 1e3, static_cast<double>(zf_bytes) / bf_bytes,
                    t_bf / t_zf);
        double fastest = t_bf;
        for (const std::string& n : peer_names) {
          const double us = peer_us(n, ctx, batch);
          if (us > 0) {
            std::printf(" %.1f |", us);
            fastest = std::min(fastest, us);
          } else {
            std::printf(" – |");
          }
        }
        std::printf(" %.2fx%s |\n", fastest / t_zf, ok ? "" : " (MISMATCH)");
        std::fflush(stdout);
      }
    Release(big);
  }
  std::printf("\nGB/s = bytes of K/V (and ZipFusion offset tables) read / median kernel time, L2 flushed before "
              "each run; the two Keel kernels are bit-identical. \"ZF vs fastest other\" = the fastest of Keel bf16 "
              "and the peers' times / ZipFusion's (above 1: ZipFusion is faster).%s Total %.0f s.\n",
              g_failures ? " FAILURES ABOVE." : "", elapsed());
  cudaFree(flush);
  if (g_failures) {
    std::fprintf(stderr, "zipfusion_gpu_bench: %d check(s) failed\n", g_failures);
    return 1;
  }
  return 0;
}
