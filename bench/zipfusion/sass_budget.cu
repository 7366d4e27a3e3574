// Straight-line kernels that do one 16-token block of the decode-attention kernels' per-block
// work for one warp: K through the QK step, V through the PV step, for the bf16 and the ZipFusion
// loaders (ZipFusion at a fixed code width, with the exception patch). Compiled to a cubin by
// bench/zipfusion/sass_budget.sh, which reads each kernel's SASS size (16 bytes an instruction on
// sm_90) and subtracts an empty kernel's: instructions per warp per block, the budget that
// decides whether decoding fits under the memory time. Never run; nothing here needs a GPU.
#include "keel/kv/zipfusion/cuda/zipfusion_attention.cu"

namespace keel::kv::zipfusion::gpu {
namespace {

// The same parameters and final stores as the others, no per-block work: the baseline.
__global__ void BudgetEmpty(ZfSource src, const uint32_t* frags, float* out) {
  const int lane = threadIdx.x & 31;
  float acc[4] = {__uint_as_float(frags[lane]), 0.f, 0.f, 0.f};
  (void)src;
  reinterpret_cast<float4*>(out)[lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
}

// fetch() of block 0 with the width fixed at W (fetch dispatches on the header's width).
template <class Tensors, int W, class Rows>
__device__ __forceinline__ void Load(Rows& rows, int lane) {
  rows.prepare(0, 1, 1, kBlockTokens, lane);
  if constexpr (Tensors::kStageBytes == 0) {
    rows.fetch(0, 0, kBlockTokens, lane);
  } else {
    const auto o = rows.Open(0, kBlockTokens, lane);
    rows.template Exponents<W>(o.codes, kBlockTokens, o.base4, lane);
    rows.Patch(o, kBlockTokens, lane);
  }
}

// QK for one block: fetch K, 2 x 8 x 2 MMAs against given Q fragments.
template <class Tensors, int W>
__global__ void BudgetKeyBlock(typename Tensors::Source src, const uint32_t* frags, float* out) {
  __shared__ __align__(16) uint8_t stage[kBlockElems];
  const int lane = threadIdx.x & 31;
  typename Tensors::template Rows<KOperand> rows(src, 0, 0, 1, stage, nullptr);
  Load<Tensors, W>(rows, lane);
  float acc[2][2][4] = {};
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t a[4] = {frags[s * 4 * 32 + lane], frags[(s * 4 + 1) * 32 + lane], frags[(s * 4 + 2) * 32 + lane],
                             frags[(s * 4 + 3) * 32 + lane]};
      const uint32_t lo[4] = {a[0] ^ 1u, 0u, a[2] ^ 1u, 0u};
      const uint32_t b0 = rows.Word(i, 2 * s), b1 = rows.Word(i, 2 * s + 1);
      Mma(acc[i][s & 1], a, b0, b1);
      Mma(acc[i][s & 1], lo, b0, b1);
    }
  reinterpret_cast<float4*>(out)[lane] =
      make_float4(acc[0][0][0] + acc[0][1][0], acc[0][0][1] + acc[1][1][1], acc[1][0][2], acc[1][1][3]);
}

// PV for one block: fetch V, 16 MMAs against given P fragments.
template <class Tensors, int W>
__global__ void BudgetValueBlock(typename Tensors::Source src, const uint32_t* frags, float* out) {
  __shared__ __align__(16) uint8_t stage[kBlockElems];
  const int lane = threadIdx.x & 31;
  typename Tensors::template Rows<VOperand> rows(src, 0, 0, 1, stage, nullptr);
  Load<Tensors, W>(rows, lane);
  const uint32_t pa[4] = {frags[lane], frags[32 + lane], frags[64 + lane], frags[96 + lane]};
  float o[16][4] = {};
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) Mma(o[nt], pa, rows.Pair(0, 1, nt), rows.Pair(2, 3, nt));
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(nt * 4 + e) * 32 + lane] = o[nt][e];
}

}  // namespace

// Instantiations, each its own .text section in the cubin.
void* budget_kernels[] = {
    reinterpret_cast<void*>(&BudgetEmpty),
    reinterpret_cast<void*>(&BudgetKeyBlock<Bf16Tensors, 0>),
    reinterpret_cast<void*>(&BudgetValueBlock<Bf16Tensors, 0>),
    reinterpret_cast<void*>(&BudgetKeyBlock<ZfTensors, 2>),
    reinterpret_cast<void*>(&BudgetValueBlock<ZfTensors, 2>),
    reinterpret_cast<void*>(&BudgetKeyBlock<ZfTensors, 3>),
    reinterpret_cast<void*>(&BudgetValueBlock<ZfTensors, 3>),
    reinterpret_cast<void*>(&BudgetKeyBlock<ZfTensors, 4>),
    reinterpret_cast<void*>(&BudgetValueBlock<ZfTensors, 4>),
};

}  // namespace keel::kv::zipfusion::gpu
