// The CPU emulation of CUDA (cuda_runtime.h here) does what the ZipFusion kernel checks rely on:
// shuffles and barriers exchange data, a missing barrier changes results with the thread order,
// mma.sync follows the PTX fragment layout, and misuse (divergent barriers, overruns, misaligned
// loads, bad launches) is reported.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "keel/kv/zipfusion/cuda/launch.cuh"

namespace {

using keel::cuda::LaunchKernel;

__global__ void WarpSums(int* out) {
  const unsigned lane = threadIdx.x & 31;
  int v = static_cast<int>(threadIdx.x);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int from5 = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) * 3, 5);
  out[blockIdx.x * blockDim.x + threadIdx.x] = v * 1000 + from5 + static_cast<int>(lane) * 0;
}

// Each thread reads its neighbour's shared-memory value; `barrier` decides whether a
// __syncthreads separates the write from the read.
__global__ void Neighbour(int* out, int barrier) {
  KEEL_DYNAMIC_SHARED(int, smem);
  const int n = static_cast<int>(blockDim.x), t = static_cast<int>(threadIdx.x);
  smem[t] = t * 7 + static_cast<int>(blockIdx.x);
  if (barrier) __syncthreads();
  out[blockIdx.x * n + t] = smem[(t + 1) % n];
}

__global__ void DivergentBarrier(int* out) {
  if (threadIdx.x < 32) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void MixedCollectives(int* out) {
  if (threadIdx.x & 1) __syncwarp();
  else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}

__global__ void ReadAt(const int* p, int index, int* out) { out[threadIdx.x] = __ldg(p + index); }

__global__ void LoadPair(const uint8_t* p, int offset, unsigned* out) {
  out[threadIdx.x] = __ldg(reinterpret_cast<const uint2*>(p + offset)).x;
}

// One m16n8k16 MMA: each lane gathers its fragments from row-major A (16 x 16 bf16 bits),
// B (16 x 8, [k][n]) and C (16 x 8 float) with the PTX ISA's formulas for element i of a
// fragment, written out here independently of the emulator, and scatters D the same way.
__global__ void OneMma(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  const int lane = static_cast<int>(threadIdx.x), group = lane >> 2, tig = lane % 4;
  uint16_t ai[8], bi[4];
  for (int i = 0; i < 8; ++i) {
    const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
    const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
    ai[i] = a[row * 16 + col];
  }
  for (int i = 0; i < 4; ++i) {
    const int row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
    bi[i] = b[row * 8 + group];
  }
  const uint32_t regs[4] = {ai[0] | (uint32_t{ai[1]} << 16), ai[2] | (uint32_t{ai[3]} << 16),
                            ai[4] | (uint32_t{ai[5]} << 16), ai[6] | (uint32_t{ai[7]} << 16)};
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = c[(group + (i >= 2 ? 8 : 0)) * 8 + tig * 2 + (i & 1)];
  keel_cuda_emu::MmaM16N8K16Bf16(acc, regs, bi[0] | (uint32_t{bi[1]} << 16), bi[2] | (uint32_t{bi[3]} << 16));
  for (int i = 0; i < 4; ++i) d[(group + (i >= 2 ? 8 : 0)) * 8 + tig * 2 + (i & 1)] = acc[i];
}

__global__ void MmaAgainstShuffle(float* out) {
  float acc[4] = {0, 0, 0, 0};
  const uint32_t a[4] = {0, 0, 0, 0};
  if (threadIdx.x & 1) keel_cuda_emu::MmaM16N8K16Bf16(acc, a, 0, 0);
  else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.f, 0);
}

int* DeviceInts(size_t n) {
  int* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(int)), cudaSuccess);
  return p;
}

// Runs `f` on a fresh thread, whose emulator reads KEEL_CUDA_EMU_ORDER when it starts.
template <class F>
void WithOrder(const char* order, F f) {
  setenv("KEEL_CUDA_EMU_ORDER", order, 1);
  std::thread(f).join();
  unsetenv("KEEL_CUDA_EMU_ORDER");
}

TEST(CudaEmu, ShufflesExchangeLaneValues) {
  int* d = DeviceInts(128);
  LaunchKernel(WarpSums, dim3(2), dim3(64), 0, nullptr, d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<int> h(128);
  ASSERT_EQ(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 64; ++t) {
      const int warp = t / 32;
      const int sum = 32 * 32 * warp + 31 * 32 / 2;  // lanes 32w .. 32w+31
      EXPECT_EQ(h[b * 64 + t], sum * 1000 + (32 * warp + 5) * 3) << "block " << b << " thread " << t;
    }
  cudaFree(d);
}

TEST(CudaEmu, BarrierMakesWritesVisibleInEveryOrder) {
  for (const char* order : {"forward", "reverse", "random"}) {
    WithOrder(order, [&] {
      int* d = DeviceInts(3 * 96);
      LaunchKernel(Neighbour, dim3(3), dim3(96), 96 * sizeof(int), nullptr, d, 1);
      std::vector<int> h(3 * 96);
      ASSERT_EQ(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
      for (int b = 0; b < 3; ++b)
        for (int t = 0; t < 96; ++t) EXPECT_EQ(h[b * 96 + t], (t + 1) % 96 * 7 + b) << order;
      cudaFree(d);
    });
  }
}

TEST(CudaEmu, MissingBarrierShowsAsOrderDependence) {
  std::vector<int> forward(96), reverse(96);
  for (auto* run : {&forward, &reverse}) {
    WithOrder(run == &forward ? "forward" : "reverse", [&] {
      int* d = DeviceInts(96);
      LaunchKernel(Neighbour, dim3(1), dim3(96), 96 * sizeof(int), nullptr, d, 0);
      ASSERT_EQ(cudaMemcpy(run->data(), d, 96 * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
      cudaFree(d);
    });
  }
  EXPECT_NE(forward, reverse);
  EXPECT_EQ(forward[0], -1);  // thread 1 had not written yet: the 0xFF fill of shared memory
}

uint16_t Bf16Of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>(u >> 16);  // exact for the small integers used here
}

TEST(CudaEmu, MmaFollowsThePtxFragmentLayout) {
  // Small integers: every product and sum is exact in fp32, so D must equal A * B + C exactly.
  std::vector<uint16_t> a(16 * 16), b(16 * 8);
  std::vector<float> c(16 * 8), want(16 * 8);
  for (int i = 0; i < 16 * 16; ++i) a[i] = Bf16Of(static_cast<float>((i * 7) % 11 - 5));
  for (int i = 0; i < 16 * 8; ++i) b[i] = Bf16Of(static_cast<float>((i * 5) % 9 - 4));
  for (int i = 0; i < 16 * 8; ++i) c[i] = static_cast<float>(i % 13 - 6);
  auto value = [](uint16_t bits) {
    const uint32_t u = uint32_t{bits} << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  };
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float sum = c[m * 8 + n];
      for (int k = 0; k < 16; ++k) sum += value(a[m * 16 + k]) * value(b[k * 8 + n]);
      want[m * 8 + n] = sum;
    }
  for (const char* order : {"forward", "reverse", "random"}) {
    WithOrder(order, [&] {
      uint16_t *da = nullptr, *db = nullptr;
      float *dc = nullptr, *dd = nullptr;
      ASSERT_EQ(cudaMalloc(&da, a.size() * 2), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&db, b.size() * 2), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&dc, c.size() * 4), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&dd, c.size() * 4), cudaSuccess);
      cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice);
      LaunchKernel(OneMma, dim3(1), dim3(32), 0, nullptr, static_cast<const uint16_t*>(da),
                   static_cast<const uint16_t*>(db), static_cast<const float*>(dc), dd);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      std::vector<float> got(c.size());
      cudaMemcpy(got.data(), dd, got.size() * 4, cudaMemcpyDeviceToHost);
      EXPECT_EQ(got, want) << order;
      for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dc), static_cast<void*>(dd)})
        cudaFree(p);
    });
  }
}

TEST(CudaEmu, BadLaunchesSetTheLastError) {
  int* d = DeviceInts(64);
  LaunchKernel(ReadAt, dim3(1), dim3(2048), 0, nullptr, static_cast<const int*>(d), 0, d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // read and cleared
  LaunchKernel(Neighbour, dim3(1), dim3(32), 64 << 10, nullptr, d, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  int host[4];
  EXPECT_EQ(cudaMemcpy(host, host + 1, sizeof(int), cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host, d + 63, 2 * sizeof(int), cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(host), cudaErrorInvalidDevicePointer);
  cudaFree(d);
}

TEST(CudaEmuDeathTest, DivergentSyncthreadsIsReported) {
  int* d = DeviceInts(64);
  EXPECT_DEATH(LaunchKernel(DivergentBarrier, dim3(1), dim3(64), 0, nullptr, d), "deadlock");
  cudaFree(d);
}

TEST(CudaEmuDeathTest, LanesAtDifferentCollectivesAreReported) {
  int* d = DeviceInts(32);
  EXPECT_DEATH(LaunchKernel(MixedCollectives, dim3(1), dim3(32), 0, nullptr, d), "different collectives");
  cudaFree(d);
}

TEST(CudaEmuDeathTest, MmaAgainstAShuffleIsReported) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 32 * sizeof(float)), cudaSuccess);
  EXPECT_DEATH(LaunchKernel(MmaAgainstShuffle, dim3(1), dim3(32), 0, nullptr, d), "different collectives");
  cudaFree(d);
}

TEST(CudaEmuDeathTest, ReadsPastAnAllocationFault) {
  int* d = DeviceInts(10);  // rounded to 12 ints; the guard page starts right after
  int* out = DeviceInts(1);
  LaunchKernel(ReadAt, dim3(1), dim3(1), 0, nullptr, static_cast<const int*>(d), 11, out);  // in bounds
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_DEATH(LaunchKernel(ReadAt, dim3(1), dim3(1), 0, nullptr, static_cast<const int*>(d), 12, out), "");
  EXPECT_DEATH(LaunchKernel(ReadAt, dim3(1), dim3(1), 0, nullptr, static_cast<const int*>(d), -1025, out), "");
  cudaFree(d);
  cudaFree(out);
}

TEST(CudaEmuDeathTest, MisalignedVectorLoadsAreReported) {
  uint8_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64), cudaSuccess);
  unsigned* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 4), cudaSuccess);
  LaunchKernel(LoadPair, dim3(1), dim3(1), 0, nullptr, static_cast<const uint8_t*>(d), 8, out);
  EXPECT_DEATH(LaunchKernel(LoadPair, dim3(1), dim3(1), 0, nullptr, static_cast<const uint8_t*>(d), 4, out),
               "misaligned __ldg");
  cudaFree(d);
  cudaFree(out);
}

}  // namespace
