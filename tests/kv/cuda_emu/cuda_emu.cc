// CPU emulation of the CUDA execution model for tests: see cuda_runtime.h beside this file.
//
// Fibers switch with a small x86-64 routine (callee-saved registers, MXCSR and the x87 control
// word, then the stack pointer): a switch costs a few nanoseconds, where swapcontext makes two
// system calls. A kernel's warp shuffle is two barriers, and the ZipFusion harness runs
// millions of them.
#include "cuda_runtime.h"

#include <sys/mman.h>
#include <unistd.h>
#include <xmmintrin.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#error "the CUDA emulation's fiber switch is written for x86-64"
#endif

extern "C" void keel_emu_switch(void** save_sp, void* load_sp);
extern "C" void keel_emu_trampoline();

asm(R"(
    .text
    .globl keel_emu_switch
    .type keel_emu_switch, @function
keel_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw (%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    fldcw (%rsp)
    ldmxcsr 8(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size keel_emu_switch, .-keel_emu_switch

    .globl keel_emu_trampoline
    .type keel_emu_trampoline, @function
keel_emu_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size keel_emu_trampoline, .-keel_emu_trampoline
)");

namespace keel_cuda_emu {
namespace {

constexpr size_t kStackBytes = 256 << 10;
constexpr size_t kPage = 4096;
constexpr size_t kMaxDynamicShared = 48 << 10;  // without cudaFuncSetAttribute opt-in

struct Fiber {
  void* sp = nullptr;
  uint8_t* stack_top = nullptr;
  uint3 tid{};
  unsigned lane = 0, warp = 0;
  bool done = false;
  const uint64_t* wait_gen = nullptr;  // blocked until *wait_gen != wait_value
  uint64_t wait_value = 0;
  const char* wait_what = nullptr;
};

struct Barrier {
  int expected = 0;
  int count = 0;
  uint64_t gen = 0;
  int kind = 0;
};

enum class Order { kForward, kReverse, kRandom };

struct Emulator {
  // Launch state.
  dim3 grid, block;
  uint3 block_idx{};
  std::vector<Fiber> fibers;
  std::vector<Barrier> warp_barriers;
  Barrier block_barrier;
  std::vector<std::array<uint64_t, 32>> warp_slots;
  std::vector<std::array<uint32_t, 32 * 6>> warp_mma;  // per lane: a[0..3], b0, b1
  std::vector<uint8_t> smem_storage;
  void* smem = nullptr;
  void* scheduler_sp = nullptr;
  Fiber* current = nullptr;
  void (*call)(const void*) = nullptr;
  const void* body = nullptr;
  // Reused fiber stacks (each with a guard page below it).
  std::vector<uint8_t*> stacks;
  Order order = Order::kRandom;
  std::mt19937_64 rng;
  cudaError_t last_error = cudaSuccess;

  Emulator() {
    const char* o = std::getenv("KEEL_CUDA_EMU_ORDER");
    if (o && std::string(o) == "forward") order = Order::kForward;
    else if (o && std::string(o) == "reverse") order = Order::kReverse;
    const char* s = std::getenv("KEEL_CUDA_EMU_SEED");
    rng.seed(s ? std::strtoull(s, nullptr, 10) : 1);
  }
};

Emulator& Emu() {
  static thread_local Emulator emu;
  return emu;
}

Fiber& Current() {
  Fiber* f = Emu().current;
  if (!f) Die("device function called outside a kernel");
  return *f;
}

void FiberMain(Fiber* f) {
  Emulator& e = Emu();
  e.call(e.body);
  f->done = true;
  keel_emu_switch(&f->sp, e.scheduler_sp);
  __builtin_trap();  // a finished fiber is never resumed
}

uint8_t* NewStack() {
  void* p = mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) Die("mmap of a fiber stack failed");
  mprotect(p, kPage, PROT_NONE);  // overflow faults instead of corrupting the next stack
  return static_cast<uint8_t*>(p) + kPage + kStackBytes;
}

// Lays out a frame that keel_emu_switch "returns" from into the trampoline, which calls
// FiberMain(f) with a 16-byte aligned stack.
void InitFiber(Fiber& f) {
  auto* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(f.stack_top) & ~uintptr_t{15});
  uint64_t* ret = top - 3;  // ret slot at 8 mod 16: after `ret`, rsp is 16-byte aligned
  ret[0] = reinterpret_cast<uint64_t>(&keel_emu_trampoline);
  ret[-1] = 0;                                                   // rbp
  ret[-2] = 0;                                                   // rbx
  ret[-3] = reinterpret_cast<uint64_t>(&f);                      // r12: argument
  ret[-4] = reinterpret_cast<uint64_t>(&FiberMain);              // r13: entry
  ret[-5] = 0;                                                   // r14
  ret[-6] = 0;                                                   // r15
  uint64_t* sp = ret - 8;
  uint16_t cw;
  asm volatile("fnstcw %0" : "=m"(cw));
  sp[0] = cw;
  sp[1] = _mm_getcsr();
  f.sp = sp;
}

void Yield() {
  Emulator& e = Emu();
  Fiber* f = e.current;
  keel_emu_switch(&f->sp, e.scheduler_sp);
}

void Arrive(Barrier& b, int kind, const char* what) {
  Fiber& f = Current();
  if (b.count == 0) {
    b.kind = kind;
  } else if (b.kind != kind) {
    Die(kind == kSyncWarp || b.kind == kSyncWarp
            ? "lanes of one warp met at different collectives (__syncwarp against a shuffle)"
            : "lanes of one warp met at different collectives (shuffles of different kinds, or a shuffle "
              "against an mma.sync)");
  }
  if (++b.count == b.expected) {
    b.count = 0;
    ++b.gen;
    return;
  }
  f.wait_gen = &b.gen;
  f.wait_value = b.gen;
  f.wait_what = what;
  Yield();
}

void RunBlock(Emulator& e, int n_threads) {
  std::vector<int> order(n_threads);
  for (int i = 0; i < n_threads; ++i) order[i] = i;
  int alive = n_threads;
  while (alive > 0) {
    if (e.order == Order::kReverse) std::reverse(order.begin(), order.end());
    if (e.order == Order::kRandom) std::shuffle(order.begin(), order.end(), e.rng);
    bool progressed = false;
    for (int i : order) {
      Fiber& f = e.fibers[i];
      if (f.done || (f.wait_gen && *f.wait_gen == f.wait_value)) continue;
      f.wait_gen = nullptr;
      e.current = &f;
      keel_emu_switch(&e.scheduler_sp, f.sp);
      e.current = nullptr;
      progressed = true;
      if (f.done) --alive;
    }
    if (!progressed) {
      int waiting = 0;
      const char* what = "";
      for (const Fiber& f : e.fibers)
        if (!f.done) {
          ++waiting;
          what = f.wait_what;
        }
      std::fprintf(stderr,
                   "cuda-emu: deadlock in block (%u,%u,%u): %d of %d threads wait at a %s that the others "
                   "never reach (divergent barrier, or threads that exited)\n",
                   e.block_idx.x, e.block_idx.y, e.block_idx.z, waiting, n_threads, what);
      std::abort();
    }
  }
}

struct Allocation {
  uint8_t* map;
  size_t map_bytes;
  size_t bytes;
};
std::mutex g_alloc_mu;
std::map<uintptr_t, Allocation> g_allocs;  // by user pointer

// Whether [p, p + n) lies inside one cudaMalloc allocation.
bool IsDevice(const void* p, size_t n) {
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return false;
  --it;
  return a >= it->first && a + n <= it->first + it->second.bytes;
}

struct Event {
  std::chrono::steady_clock::time_point t;
};

}  // namespace

const uint3& ThreadIdx() { return Current().tid; }
const uint3& BlockIdx() { return Emu().block_idx; }
const dim3& BlockDim() { return Emu().block; }
const dim3& GridDim() { return Emu().grid; }
unsigned LaneId() { return Current().lane; }
uint64_t* WarpSlots() { return Emu().warp_slots[Current().warp].data(); }
void* DynamicShared() { return Emu().smem; }

void WarpBarrier(int kind) {
  Emulator& e = Emu();
  Arrive(e.warp_barriers[Current().warp], kind, kind == kSyncWarp ? "__syncwarp" : "warp shuffle");
}
void BlockBarrier() { Arrive(Emu().block_barrier, 0, "__syncthreads"); }

void MmaM16N8K16Bf16(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Emulator& e = Emu();
  Fiber& f = Current();
  uint32_t* all = e.warp_mma[f.warp].data();
  const unsigned lane = f.lane;
  for (int i = 0; i < 4; ++i) all[lane * 6 + i] = a[i];
  all[lane * 6 + 4] = b0;
  all[lane * 6 + 5] = b1;
  Arrive(e.warp_barriers[f.warp], kMma, "mma.sync");
  auto half = [](uint32_t reg, int k) {
    const uint32_t bits = (k & 1) ? (reg & 0xFFFF0000u) : (reg << 16);
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  };
  // A(row, k) sits in lane 4 * (row % 8) + (k % 8) / 2, register (row >= 8) + 2 * (k >= 8);
  // B(k, col) in lane 4 * col + (k % 8) / 2, register b0 for k < 8 and b1 otherwise.
  auto A = [&](int row, int k) { return half(all[((row & 7) * 4 + ((k & 7) >> 1)) * 6 + (row >> 3) + 2 * (k >> 3)], k); };
  auto B = [&](int k, int col) { return half(all[(col * 4 + ((k & 7) >> 1)) * 6 + 4 + (k >> 3)], k); };
  const int g = static_cast<int>(lane >> 2), t = static_cast<int>(lane & 3);
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float sum = acc[i];
    for (int k = 0; k < 16; ++k) sum = std::fma(A(row, k), B(k, col), sum);
    out[i] = sum;
  }
  Arrive(e.warp_barriers[f.warp], kMma, "mma.sync");
  for (int i = 0; i < 4; ++i) acc[i] = out[i];
}

void Die(const char* what, const void* address) {
  Emulator& e = Emu();
  std::fprintf(stderr, "cuda-emu: %s", what);
  if (address) std::fprintf(stderr, " (address %p)", address);
  if (e.current)
    std::fprintf(stderr, " in block (%u,%u,%u) thread (%u,%u,%u)", e.block_idx.x, e.block_idx.y, e.block_idx.z,
                 e.current->tid.x, e.current->tid.y, e.current->tid.z);
  std::fprintf(stderr, "\n");
  std::abort();
}

void LaunchErased(dim3 grid, dim3 block, size_t dynamic_smem, void (*call)(const void*), const void* body) {
  Emulator& e = Emu();
  if (e.current) Die("kernel launched from device code (dynamic parallelism is not emulated)");
  const uint64_t n = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (n == 0 || n > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535) {
    e.last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (dynamic_smem > kMaxDynamicShared) {
    e.last_error = cudaErrorInvalidValue;
    return;
  }
  const int n_threads = static_cast<int>(n);
  const int n_warps = (n_threads + 31) / 32;
  e.grid = grid;
  e.block = block;
  e.call = call;
  e.body = body;
  e.fibers.assign(n_threads, Fiber{});
  while (e.stacks.size() < static_cast<size_t>(n_threads)) e.stacks.push_back(NewStack());
  e.warp_slots.assign(n_warps, {});
  e.warp_mma.assign(n_warps, {});
  e.smem_storage.resize(dynamic_smem + 64);
  e.smem = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(e.smem_storage.data()) + 63) & ~uintptr_t{63});
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        e.block_idx = {x, y, z};
        std::memset(e.smem, 0xFF, dynamic_smem);
        e.warp_barriers.assign(n_warps, Barrier{});
        for (int w = 0; w < n_warps; ++w) e.warp_barriers[w].expected = std::min(32, n_threads - 32 * w);
        e.block_barrier = Barrier{};
        e.block_barrier.expected = n_threads;
        for (int t = 0; t < n_threads; ++t) {
          Fiber& f = e.fibers[t];
          f = Fiber{};
          f.stack_top = e.stacks[t];
          f.tid = {static_cast<unsigned>(t % block.x), static_cast<unsigned>(t / block.x % block.y),
                   static_cast<unsigned>(t / (block.x * block.y))};
          f.lane = t % 32;
          f.warp = t / 32;
          InitFiber(f);
        }
        RunBlock(e, n_threads);
      }
}

}  // namespace keel_cuda_emu

using keel_cuda_emu::Emu;

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
  }
  return "unrecognized error code";
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = Emu().last_error;
  Emu().last_error = cudaSuccess;
  return e;
}

cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}

static int EmulatedSms() {
  const char* s = std::getenv("KEEL_CUDA_EMU_SMS");
  const int n = s ? std::atoi(s) : 0;
  return n > 0 ? n : 132;  // an H100 SXM / H200
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int dev) {
  if (dev != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = EmulatedSms();
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int dev) {
  if (dev != 0) return cudaErrorInvalidValue;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "CPU emulation (keel tests/kv/cuda_emu)");
  prop->totalGlobalMem = size_t{16} << 30;
  prop->multiProcessorCount = EmulatedSms();
  prop->l2CacheSize = 4 << 20;
  prop->major = 9;
  prop->minor = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

cudaError_t cudaMalloc(void** p, size_t bytes) {
  using namespace keel_cuda_emu;
  const size_t data = std::max<size_t>(16, (bytes + 15) & ~size_t{15});
  const size_t span = (data + kPage - 1) & ~(kPage - 1);
  const size_t map_bytes = span + 2 * kPage;
  void* m = mmap(nullptr, map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return cudaErrorMemoryAllocation;
  auto* base = static_cast<uint8_t*>(m);
  if (mprotect(base + kPage, span, PROT_READ | PROT_WRITE) != 0) {
    munmap(m, map_bytes);
    return cudaErrorMemoryAllocation;
  }
  // The allocation ends where the upper guard page begins, so overruns fault immediately.
  uint8_t* user = base + kPage + span - data;
  std::memset(user, 0xA5, data);  // like uninitialised device memory: not zeros
  {
    std::lock_guard<std::mutex> lock(g_alloc_mu);
    g_allocs[reinterpret_cast<uintptr_t>(user)] = {base, map_bytes, data};
  }
  *p = user;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  using namespace keel_cuda_emu;
  if (!p) return cudaSuccess;
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(g_alloc_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocs.end()) return cudaErrorInvalidDevicePointer;
    a = it->second;
    g_allocs.erase(it);
  }
  munmap(a.map, a.map_bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  using namespace keel_cuda_emu;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if (bytes == 0) return cudaSuccess;
  if ((src_dev && !IsDevice(src, bytes)) || (dst_dev && !IsDevice(dst, bytes))) return cudaErrorInvalidValue;
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  if (!keel_cuda_emu::IsDevice(p, bytes)) return cudaErrorInvalidValue;
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) { return cudaMemset(p, value, bytes); }

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = reinterpret_cast<cudaEvent_t>(new keel_cuda_emu::Event());
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<keel_cuda_emu::Event*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  reinterpret_cast<keel_cuda_emu::Event*>(e)->t = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop) {
  *ms = std::chrono::duration<float, std::milli>(reinterpret_cast<keel_cuda_emu::Event*>(stop)->t -
                                                 reinterpret_cast<keel_cuda_emu::Event*>(start)->t)
            .count();
  return cudaSuccess;
}
