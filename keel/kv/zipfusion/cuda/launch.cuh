// Kernel launches and dynamic shared memory through one helper each, so that the same kernel
// source also builds against tests/kv/cuda_emu (a CPU emulation of the CUDA execution model used
// by the tests on machines without a GPU). With nvcc these are plain <<<>>> and extern __shared__.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace keel::cuda {

template <class... P, class... A>
void LaunchKernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
                  A... args) {
#ifdef KEEL_CUDA_EMULATION
  (void)stream;
  keel_cuda_emu::Launch(grid, block, dynamic_smem, [&] { kernel(args...); });
#else
  kernel<<<grid, block, dynamic_smem, stream>>>(args...);
#endif
}

// Launches `kernel` so that it may start while the previous kernel in `stream` is still running
// (Programmatic Dependent Launch, compute capability 9.0 and newer): its launch latency overlaps
// the previous kernel's tail. The kernel must call WaitForPrerequisiteGrid() before it reads what
// the previous kernel wrote. Elsewhere, or if the runtime refuses the attribute, a plain launch.
template <class... P, class... A>
void LaunchKernelAfterPrevious(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
                               A... args) {
#ifdef KEEL_CUDA_EMULATION
  LaunchKernel(kernel, grid, block, dynamic_smem, stream, args...);
#else
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = dynamic_smem;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    if (cudaLaunchKernelEx(&config, kernel, static_cast<P>(args)...) == cudaSuccess) return;
    (void)cudaGetLastError();  // refused: clear it and launch plainly
  }
  kernel<<<grid, block, dynamic_smem, stream>>>(args...);
#endif
}

// In a kernel launched after another: lets the next kernel in the stream, if launched with
// LaunchKernelAfterPrevious, begin launching (griddepcontrol.launch_dependents; a no-op before
// sm_90 and in the emulation).
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// In a kernel launched with LaunchKernelAfterPrevious: waits until the previous kernel in the
// stream has completed and its writes are visible (griddepcontrol.wait; a no-op before sm_90,
// where the launch was a plain one, and in the emulation, which runs kernels one after another).
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace keel::cuda

// Declares `type* name` pointing at the block's dynamic shared memory (16-byte aligned).
#ifdef KEEL_CUDA_EMULATION
#define KEEL_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::keel_cuda_emu::DynamicShared())
#else
#define KEEL_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif
