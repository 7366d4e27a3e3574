// A CPU stand-in for <cuda_runtime.h>, so that the ZipFusion CUDA kernels and their GPU harness
// (keel/kv/zipfusion/cuda/*.cu) compile as plain C++ and run on a machine without a GPU. Only the
// tests' include path puts this directory before the real toolkit; nothing else sees it.
//
// What it is: every CUDA thread of a block is a fiber (its own stack) on the calling OS thread;
// the fibers of a block run until each reaches a barrier (__syncthreads, __syncwarp, a warp
// shuffle), in an order chosen per pass (KEEL_CUDA_EMU_ORDER=forward|reverse|random, random
// by default; KEEL_CUDA_EMU_SEED), so code that reads what another thread wrote without a
// barrier between gives different results under different orders. Blocks run one at a time.
//
// What it checks, and aborts on with a message: lanes of one warp meeting at different
// collectives (a shuffle against a __syncwarp, or shuffles of different kinds), threads that
// never reach a barrier the others wait at (divergent __syncthreads), __ldg of a misaligned
// address, launches with more than 1024 threads or 48 KiB of dynamic shared memory. Device
// memory (cudaMalloc) ends where a PROT_NONE guard page begins (sizes rounded up to 16 bytes),
// so a read or write past its end faults at once; one before its start faults once it leaves
// the allocation's first page (a guard page lies below that too). Dynamic shared memory is filled with 0xFF (NaN) before each
// block, so reading scores or partials nobody wrote shows up in the results.
//
// What it does not model: timing, the memory model beyond barriers, __CUDA_ARCH__ code paths
// (inline PTX: the kernels' host fallbacks run instead, except mma.sync, which is emulated here
// as a warp collective: MmaM16N8K16Bf16), fast-math intrinsics (expf is the C library's). Arithmetic intrinsics (__fmaf_rn, __fadd_rn, ...) are exactly IEEE round to
// nearest, as on the GPU; build with -ffp-contract=off so the compiler does not fuse others.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define KEEL_CUDA_EMULATION 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static shared arrays: one copy shared by all fibers; blocks run one at a time.
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

namespace keel_cuda_emu {

const uint3& ThreadIdx();
const uint3& BlockIdx();
const dim3& BlockDim();
const dim3& GridDim();
// Barrier over the calling thread's warp (kind tells collectives apart) or over its block.
void WarpBarrier(int kind);
void BlockBarrier();
// Exchange slot of the calling lane's warp (shuffles).
uint64_t* WarpSlots();
unsigned LaneId();
// Dynamic shared memory of the running block.
void* DynamicShared();
[[noreturn]] void Die(const char* what, const void* address = nullptr);

enum BarrierKind : int { kSyncWarp = 1, kShfl = 2, kShflXor = 3, kMma = 4 };

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 over the calling lane's warp, with the
// fragment layout of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type"):
// lane = 4 * groupID + threadID_in_group; a[0..3] hold A(g, 2t..2t+1), A(g+8, 2t..), A(g, 2t+8..),
// A(g+8, 2t+8..); b0 holds B(2t..2t+1, g), b1 B(2t+8..2t+9, g); acc (C in, D out) holds
// D(g, 2t..2t+1), D(g+8, 2t..2t+1). Each register packs two bf16, the lower column or row in the
// low half. A warp collective: every lane of the warp must call it. Each output is C plus the 16
// exact products, added in k order with fp32 fmaf (the GPU's tensor cores add in an order of
// their own, so only results computed by the same instruction sequence compare bit for bit).
void MmaM16N8K16Bf16(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <class F>
void Launch(dim3 grid, dim3 block, size_t dynamic_smem, const F& body);
void LaunchErased(dim3 grid, dim3 block, size_t dynamic_smem, void (*call)(const void*), const void* body);
template <class F>
void Launch(dim3 grid, dim3 block, size_t dynamic_smem, const F& body) {
  LaunchErased(grid, block, dynamic_smem, [](const void* f) { (*static_cast<const F*>(f))(); }, &body);
}

template <class T>
T Shuffle(T v, unsigned src_lane, int kind) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t* slots = WarpSlots();
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  slots[LaneId()] = bits;
  WarpBarrier(kind);
  std::memcpy(&v, &slots[src_lane & 31], sizeof(T));
  WarpBarrier(kind);
  return v;
}

}  // namespace keel_cuda_emu

#define threadIdx (::keel_cuda_emu::ThreadIdx())
#define blockIdx (::keel_cuda_emu::BlockIdx())
#define blockDim (::keel_cuda_emu::BlockDim())
#define gridDim (::keel_cuda_emu::GridDim())

inline void __syncthreads() { keel_cuda_emu::BlockBarrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { keel_cuda_emu::WarpBarrier(keel_cuda_emu::kSyncWarp); }
template <class T>
T __shfl_sync(unsigned, T v, int src, int = 32) {
  return keel_cuda_emu::Shuffle(v, static_cast<unsigned>(src), keel_cuda_emu::kShfl);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return keel_cuda_emu::Shuffle(v, keel_cuda_emu::LaneId() ^ static_cast<unsigned>(mask), keel_cuda_emu::kShflXor);
}

template <class T>
T __ldg(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) keel_cuda_emu::Die("misaligned __ldg", p);
  return *p;
}

inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
// One OS thread runs every fiber, so plain read-modify-writes are atomic here.
inline int atomicOr(int* p, int v) {
  const int old = *p;
  *p = old | v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}

// ---- Runtime API (the subset the ZipFusion kernels and harness use).

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
};
enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};
enum cudaDeviceAttr : int { cudaDevAttrMultiProcessorCount = 16 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int multiProcessorCount;
  int l2CacheSize;
  int major, minor;
};

const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDevice(int* dev);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int dev);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int dev);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaMalloc(void** p, size_t bytes);
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaFree(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemset(void* p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop);
