// The ZipFusion CUDA kernels compiled as C++ against the CPU emulation (cuda_runtime.h here).
#include "keel/kv/zipfusion/cuda/zipfusion_attention.cu"
