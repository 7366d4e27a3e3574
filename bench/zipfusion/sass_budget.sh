#!/usr/bin/env bash
# Instruction budget of the ZipFusion CUDA decode-attention loaders, from the sm_90 (or given)
# build, on any machine with nvcc: no GPU and no cuobjdump needed. Compiles
# bench/zipfusion/sass_budget.cu (one warp, one 16-token block of K through QK and of V through
# PV, for the bf16 and ZipFusion loaders) to a cubin, and a set of one-operation probe kernels that
# name the SASS opcodes; bench/zipfusion/sass_budget.py then prints a Markdown table.
#
#   bench/zipfusion/sass_budget.sh [ARCH]      ARCH: 90 (default), 80, ...
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCH=${1:-90}
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
[ -x "$NVCC" ] || { echo "sass_budget.sh: nvcc not found" >&2; exit 2; }
command -v python3 >/dev/null || { echo "sass_budget.sh: python3 not found" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

cat >"$TMP/probe.cu" <<'PROBE'
#include <cstdint>
#define PROBE(name, body)                                                              \
  extern "C" __global__ void probe_##name(uint32_t* o, const uint32_t* in) {           \
    uint32_t a = in[threadIdx.x], b = in[threadIdx.x + 32], c = in[threadIdx.x + 64];  \
    _Pragma("unroll") for (int i = 0; i < 64; ++i) { body; }                           \
    o[threadIdx.x] = a ^ b ^ c;                                                        \
  }
PROBE(PRMT, asm volatile("prmt.b32 %0, %1, %2, %3;" : "=r"(a) : "r"(a), "r"(b), "r"(c)))
PROBE(SHF, asm volatile("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(a) : "r"(a), "r"(b), "r"(c)))
PROBE(LOP3, asm volatile("lop3.b32 %0, %1, %2, %3, 0xE8;" : "=r"(a) : "r"(a), "r"(b), "r"(c)))
PROBE(IADD3, asm volatile("add.u32 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(b)))
PROBE(IMAD, asm volatile("mad.lo.u32 %0, %1, %2, %3;" : "=r"(a) : "r"(a), "r"(b), "r"(c)))
PROBE(LDG, a ^= __ldg(in + threadIdx.x + 96 + i * 32))
PROBE(SHFL, asm volatile("shfl.sync.idx.b32 %0, %1, %2, 31, -1;" : "=r"(a) : "r"(a), "r"(b)))
PROBE(FADD, asm volatile("add.f32 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(b)))
PROBE(HMMA, asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};" : "+r"(a), "+r"(b), "+r"(c), "+r"(c)
                         : "r"(a), "r"(b), "r"(c), "r"(a), "r"(b), "r"(c)))
extern "C" __global__ void probe_STS(uint32_t* o, const uint32_t* in) {
  __shared__ uint32_t s[4096];
  const uint32_t a = in[threadIdx.x];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[threadIdx.x + i * 32] = a;
  __syncwarp();
  o[threadIdx.x] = s[threadIdx.x ^ 1];
}
extern "C" __global__ void probe_LDS(uint32_t* o, const uint32_t* in) {
  __shared__ uint32_t s[4096];
  s[threadIdx.x] = in[threadIdx.x];
  __syncwarp();
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < 64; ++i) x ^= s[threadIdx.x + i * 32];
  o[threadIdx.x] = x;
}
extern "C" __global__ void probe_STG(uint32_t* o, const uint32_t* in) {
  const uint32_t a = in[threadIdx.x];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[threadIdx.x + i * 32] = a;
}
PROBE
"$NVCC" -O3 -std=c++17 -arch="sm_$ARCH" -cubin -o "$TMP/probe.cubin" "$TMP/probe.cu"
"$NVCC" -O3 -std=c++17 -I. -arch="sm_$ARCH" -cubin -o "$TMP/budget.cubin" bench/zipfusion/sass_budget.cu
echo "_sm_${ARCH}, $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/CUDA \1/p'), $(git rev-parse --short HEAD 2>/dev/null || echo '?')_"
echo
python3 bench/zipfusion/sass_budget.py "$TMP/budget.cubin" "$TMP/probe.cubin"
