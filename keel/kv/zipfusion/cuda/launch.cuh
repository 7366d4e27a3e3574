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

}  // namespace keel::cuda

// Declares `type* name` pointing at the block's dynamic shared memory (16-byte aligned).
#ifdef KEEL_CUDA_EMULATION
#define KEEL_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::keel_cuda_emu::DynamicShared())
#else
#define KEEL_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif
