// The CPU emulation of CUDA (cuda_runtime.h here) does what the ZipFusion kernel checks rely on:
// shuffles and barriers exchange data, a missing barrier changes results with the thread order,
// and misuse (divergent barriers, overruns, misaligned loads, bad launches) is reported.
#include <gtest/gtest.h>

#include <cstdlib>
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
