// The GPU harness compiled as C++ against the CPU emulation; the CTest runs its --check-only part.
#include "keel/kv/zipfusion/cuda/zipfusion_gpu_bench.cu"
