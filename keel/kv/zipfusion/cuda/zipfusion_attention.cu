// CUDA decode attention over ZipFusion blocks and over uncompressed bf16, one design for both.
// See zipfusion_attention.h for the API and layouts, keel/kv/zipfusion/format.h for the block
// format (and the CPU fused decoder this mirrors).
//
// Design
// ------
// Decode attention reads every K and V byte of the context once and does ~1 FMA per byte per
// query head, so it is memory bound; ZipFusion wins only if decoding costs fewer cycles than the
// bytes it saves. Everything below serves two goals: keep all SMs streaming, and keep the decode
// a handful of integer instructions per element.
//
// Split-K (flash-decoding). With one query token there is no parallelism over queries: a batch-1,
// 8-KV-head call has only 8 (seq, kv head) pairs, far fewer than the 132 SMs of an H100. So the
// context is cut into splits of `blocks_per_split` 16-token blocks and each CTA handles one
// (split, kv head, seq). A CTA writes its unnormalised partial output and its softmax max m and
// sum l per query head to a workspace; a second small kernel combines the splits of each
// (seq, q head) in split order: out = sum_s e^(m_s-M) o_s / sum_s e^(m_s-M) l_s. The split size
// is chosen so that ~4 CTAs per SM exist (at least 4 blocks, one per warp; at most 64).
//
// GQA. A CTA serves all `group` query heads of its KV head, so each K/V byte is read from memory
// once and used `group` times (the query vectors live in registers).
//
// Thread mapping. A CTA has 4 warps; warp w takes blocks w, w+4, ... of the split. Within a block
// (16 tokens x 128), each half-warp takes one token row at a time and each of its 16 lanes owns
// 8 consecutive elements (lane j: dims 8j..8j+7): lanes 0-15 take rows 0,2,...,14, lanes 16-31
// rows 1,3,...,15. Eight elements per lane is exactly a ZipFusion "chunk": its low bytes are one
// aligned 8-byte load and its codes are w bytes at codes + w*chunk (format.h), and for bf16 it is
// one 16-byte load. A warp owning a whole block also lets it handle the block's exception list
// alone. All rows of a block are loaded before any is used, to keep many bytes in flight.
//
//   QK:  each lane multiplies its 8 elements with its 8 query dims for each head (a fixed FMA
//        chain), then the 16 lanes of a row reduce the 8 rows x group partial dots with a
//        butterfly reduce-scatter (each xor step halves the values a lane keeps), ~8x fewer
//        shuffles than reducing each dot on its own. Scores go to shared memory.
//   softmax over the split's scores in shared memory (warp per head, fixed reduction tree).
//   PV:  each lane accumulates p * v into acc[group][8] for its 8 dims, over its rows; the 8
//        half-warp partials are summed through shared memory in a fixed order.
//
// Bit-identity. Both kernels are instantiations of one template; only the "Rows" policy that
// loads a block into fp32 registers differs. Every floating-point operation is an explicit
// __fmaf_rn/__fmul_rn/__fadd_rn (never contracted or reassociated), so the arithmetic and its
// order are the same in both, and so are the outputs, bit for bit.
//
// ZipFusion decode of one chunk (8 elements) in registers:
//   1. codes -> 8 exponent bytes in two words (w-specific bit spreading, + base per byte; no
//      carries since base + code <= 255);
//   2. if the block has exceptions (warp-uniform branch), the warp stages its exponent bytes in
//      shared memory (2 KB per warp), scatters the exception exponents in (one store per
//      exception, lanes in parallel) and reads them back: cheaper than every lane searching the
//      sorted list, and exceptions are rare but not absent (~2% of the elements of normally
//      distributed data at w = 3);
//   3. per element, one PRMT builds [e | sign x8 | low | -] and two ops give the fp32 bits:
//      (W & 0x007F0000) | (W << 23)  -- mantissa from the low byte, exponent from byte 0, and the
//      sign from bit 8 (the replicated sign byte) shifted to bit 31. Bit-exact with bf16 << 16.
#include "keel/kv/zipfusion/cuda/zipfusion_attention.h"

#include <cuda_runtime.h>

#include "keel/kv/zipfusion/cuda/launch.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace keel::kv::zipfusion::gpu {
namespace {

constexpr int kHeadDim = 128;
constexpr int kBlockTokens = 16;
constexpr int kBlockElems = kBlockTokens * kHeadDim;  // 2048
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kHalfWarps = 2 * kWarps;
constexpr int kRowsPerLane = kBlockTokens / 2;        // 8: a half-warp takes every other row
constexpr int kMaxBlocksPerSplit = 64;                // bounds shared memory and per-warp offsets
constexpr int kMinBlocksPerSplit = 4;                 // one block per warp
constexpr uint32_t kFull = 0xffffffffu;
constexpr uint8_t kMagic = 0x5A;

// ------------------------------------------------------------------------------------------------
// Error reporting.

thread_local std::string g_last_error;

int Fail(int code, const std::string& msg) {
  g_last_error = msg;
  return code;
}
int Ok() {
  g_last_error.clear();
  return kZfOk;
}
int CudaFail(cudaError_t e, const char* what) {
  return Fail(kZfCudaError, std::string(what) + ": " + cudaGetErrorString(e));
}
#define ZF_CUDA(call)                                   \
  do {                                                  \
    cudaError_t e_ = (call);                            \
    if (e_ != cudaSuccess) return CudaFail(e_, #call);  \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Device helpers.

// The bit-level helpers below are __host__ __device__ so that they can be checked on a CPU.
#define ZF_HD __host__ __device__ __forceinline__

template <class T>
ZF_HD T Ld(const T* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// PTX prmt.b32 in its generic mode: output byte i is byte (sel >> 4i) & 7 of {b:a}, or that
// byte's sign bit replicated when bit 3 of the selector nibble is set (CUDA's __byte_perm
// ignores that bit, hence inline PTX).
ZF_HD uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t src = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nib = (sel >> (4 * i)) & 0xF;
    uint32_t byte = (src >> (8 * (nib & 7))) & 0xFF;
    if (nib & 8) byte = (byte & 0x80) ? 0xFF : 0x00;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

ZF_HD uint32_t FunnelShiftRight(uint32_t lo, uint32_t hi, int sh) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, sh);
#else
  return static_cast<uint32_t>(((static_cast<uint64_t>(hi) << 32) | lo) >> (sh & 31));
#endif
}

ZF_HD float BitsToFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Element kk (0..3) of a 4-element group as fp32: PRMT builds
// [byte0 = exponent byte kk of e, byte1 = sign of low byte kk replicated, byte2 = low byte kk],
// then (W & 0x007F0000) | (W << 23) puts the 7 mantissa bits at 22..16, the exponent at 30..23
// and bit 8 (the sign) at 31. Bit-exact with widening the bf16 (bits << 16).
ZF_HD float AssembleBf16(uint32_t e, uint32_t low, uint32_t kk) {
  const uint32_t sel = ((4 + kk) << 12) | ((4 + kk) << 8) | ((0x8 | (4 + kk)) << 4) | kk;
  const uint32_t w = Prmt(e, low, sel);
  return BitsToFloat((w & 0x007F0000u) | (w << 23));
}

// ------------------------------------------------------------------------------------------------
// Rows policies: load one 16-token block of K or V for this (seq, kv head) and hand each lane its
// 8 rows x 8 elements as fp32. `Source` (kernel parameter) says where a tensor lives; a Rows
// object lives in registers. Interface (all calls warp-uniform):
//   Rows(src, b, kvh, n_kv_heads, stage, error)   bind to one (seq, kv head)
//   prepare(first, stride, count, lane)   the warp will visit blocks first + it*stride, it < count
//   fetch(blk, it, fill, lane)            load block blk (the it-th visit) holding `fill` rows
//   row(i, v)                             elements of row 2i + (lane >= 16), dims 8(lane&15)+0..7
// Rows >= fill are never used by the caller.

struct Bf16Rows {
  static constexpr int kStageBytes = 0;
  struct Source {
    const uint16_t* tensor;  // [batch][n_kv_heads][token_capacity][128]
    int64_t token_capacity;
  };
  const uint16_t* head;  // this (seq, kv head)
  uint4 raw[kRowsPerLane];

  __device__ Bf16Rows(const Source& src, int b, int kvh, int n_kv_heads, uint8_t* /*stage*/, int* /*error*/)
      : head(src.tensor + (static_cast<int64_t>(b) * n_kv_heads + kvh) * src.token_capacity * kHeadDim) {}
  __device__ void prepare(int, int, int, int) {}
  __device__ __forceinline__ void fetch(int blk, int /*it*/, int fill, int lane) {
    const int half = lane >> 4, j = lane & 15;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = 2 * i + half;
      const uint4* src = reinterpret_cast<const uint4*>(
          head + (static_cast<int64_t>(blk) * kBlockTokens + r) * kHeadDim + 8 * j);
      raw[i] = r < fill ? __ldg(src) : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ void row(int i, float (&v)[8]) const {
    const uint4 u = raw[i];
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  }
};

// Codes of one chunk (8 elements, W bits each, LSB-first) at byte offset W*c of `codes`, which is
// 8-byte aligned (block offset % 8 == 0, and 8 + n is a multiple of 8). Only words that hold
// needed bytes are loaded: the codes section ends on an 8-byte boundary, so no load leaves it.
template <int W>
ZF_HD uint64_t LoadCodes(const uint8_t* codes, int c) {
  if constexpr (W == 1) {
    return Ld(codes + c);
  } else if constexpr (W == 2) {
    return Ld(reinterpret_cast<const uint16_t*>(codes) + c);
  } else if constexpr (W == 4) {
    return Ld(reinterpret_cast<const uint32_t*>(codes) + c);
  } else if constexpr (W == 8) {
    return Ld(reinterpret_cast<const unsigned long long*>(codes) + c);
  } else if constexpr (W == 3) {
    const int o = 3 * c;
    const uint32_t* p = reinterpret_cast<const uint32_t*>(codes) + (o >> 2);
    const int sh = o & 3;
    const uint32_t lo = Ld(p);
    const uint32_t hi = sh + 3 > 4 ? Ld(p + 1) : 0u;
    return FunnelShiftRight(lo, hi, 8 * sh) & 0xFFFFFFu;
  } else {  // 5, 6, 7: W bytes somewhere in two aligned 8-byte words
    const int o = W * c;
    const unsigned long long* p = reinterpret_cast<const unsigned long long*>(codes) + (o >> 3);
    const int sh = o & 7;
    const unsigned long long lo = Ld(p);
    const unsigned long long hi = sh + W > 8 ? Ld(p + 1) : 0ull;
    const unsigned long long bits = sh ? (lo >> (8 * sh)) | (hi << (64 - 8 * sh)) : lo;
    return bits & ((1ull << (8 * W)) - 1);
  }
}

// Four W-bit codes (bits 0..4W-1 of g) -> one code per byte.
template <int W>
ZF_HD uint32_t SpreadFour(uint32_t g) {
  constexpr uint32_t m = (1u << W) - 1;
  constexpr uint32_t pair_mask = ((1u << (2 * W)) - 1) * 0x00010001u;
  constexpr uint32_t byte_mask = m * 0x01010101u;
  if constexpr (W <= 4) {
    // Codes {0,1} stay in bits 0..2W-1, {2,3} move to 16..16+2W-1; then within each 16-bit lane
    // the second code moves to bits 8..8+W-1. For W <= 4 the bits an OR drags along land outside
    // the mask, so each step is a shift plus one LOP3.
    const uint32_t p = (g | (g << (16 - 2 * W))) & pair_mask;
    return (p | (p << (8 - W))) & byte_mask;
  } else {
    const uint32_t p = (g & ((1u << (2 * W)) - 1)) | ((g >> (2 * W)) << 16);
    return (p & (m * 0x00010001u)) | (((p >> W) & (m * 0x00010001u)) << 8);
  }
}

// Eight codes -> exponent bytes (base added) of elements 0..3 (e0) and 4..7 (e1).
template <int W>
ZF_HD void ChunkExponents(uint64_t bits, uint32_t base4, uint32_t& e0, uint32_t& e1) {
  if constexpr (W == 0) {
    e0 = e1 = base4;
  } else if constexpr (W == 8) {
    e0 = static_cast<uint32_t>(bits) + base4;
    e1 = static_cast<uint32_t>(bits >> 32) + base4;
  } else {
    constexpr uint64_t m4 = (1ull << (4 * W)) - 1;
    e0 = SpreadFour<W>(static_cast<uint32_t>(bits & m4)) + base4;
    e1 = SpreadFour<W>(static_cast<uint32_t>(bits >> (4 * W))) + base4;
  }
}

struct ZfRows {
  static constexpr int kStageBytes = kBlockElems;  // one exponent byte per element, per warp
  struct Source {
    const uint8_t* buf;      // all blocks
    const uint64_t* table;   // [batch][n_kv_heads][block_capacity] byte offsets into buf
    int64_t block_capacity;
  };
  const uint8_t* buf;
  const uint64_t* offsets;  // this (seq, kv head)
  uint8_t* stage;           // this warp's 2 KB of shared memory
  int* error;
  uint64_t my_offset = 0;   // lane l: offset of the l-th block this warp visits
  uint2 low[kRowsPerLane];  // low bytes (sign | mantissa) of the lane's 8 elements per row
  uint32_t e0[kRowsPerLane], e1[kRowsPerLane];  // exponent bytes, elements 0-3 and 4-7

  __device__ ZfRows(const Source& src, int b, int kvh, int n_kv_heads, uint8_t* warp_stage, int* error_flag)
      : buf(src.buf),
        offsets(src.table + (static_cast<int64_t>(b) * n_kv_heads + kvh) * src.block_capacity),
        stage(warp_stage),
        error(error_flag) {}
  // All of the warp's offsets in one load (count <= kMaxBlocksPerSplit / kWarps <= 32): takes a
  // dependent global load off each block's critical path.
  __device__ void prepare(int first, int stride, int count, int lane) {
    my_offset = lane < count ? __ldg(reinterpret_cast<const unsigned long long*>(offsets) + first + lane * stride) : 0;
  }

  template <int W>
  __device__ __forceinline__ void Exponents(const uint8_t* codes, int fill, uint32_t base4, int lane) {
    const int half = lane >> 4, j = lane & 15;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = 2 * i + half;
      uint64_t bits = 0;
      if constexpr (W != 0) bits = r < fill ? LoadCodes<W>(codes, r * (kHeadDim / 8) + j) : 0;
      ChunkExponents<W>(bits, base4, e0[i], e1[i]);
    }
  }

  __device__ __forceinline__ void fetch(int blk, int it, int fill, int lane) {
    const int half = lane >> 4, j = lane & 15;
    const uint8_t* p = buf + __shfl_sync(kFull, static_cast<unsigned long long>(my_offset), it);
    // Low bytes do not depend on the header: issue them together with it.
    const uint2 hdr = __ldg(reinterpret_cast<const uint2*>(p));
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = 2 * i + half;
      low[i] = r < fill ? __ldg(reinterpret_cast<const uint2*>(p + 8 + r * kHeadDim + 8 * j)) : make_uint2(0, 0);
    }
    // Header: u8 magic, u8 dtype, u8 width, u8 base, u16 n, u16 n_exc.
    int w = (hdr.x >> 16) & 0xFF;
    const int base = hdr.x >> 24;
    const int n = fill * kHeadDim;
    int n_exc = hdr.y >> 16;
    const bool bad = (hdr.x & 0xFF) != kMagic || ((hdr.x >> 8) & 0xFF) != 0 || w > 8 ||
                     base + (1 << w) - 1 > 255 || static_cast<int>(hdr.y & 0xFFFF) != n || n_exc > n;
    if (bad) {
      if (lane == 0 && error) atomicOr(error, 1);
      w = 0;
      n_exc = 0;
    }
    const uint8_t* codes = p + 8 + n;
    const uint32_t base4 = static_cast<uint32_t>(base) * 0x01010101u;
    switch (w) {  // warp-uniform: one width per block
      case 0: Exponents<0>(codes, fill, base4, lane); break;
      case 1: Exponents<1>(codes, fill, base4, lane); break;
      case 2: Exponents<2>(codes, fill, base4, lane); break;
      case 3: Exponents<3>(codes, fill, base4, lane); break;
      case 4: Exponents<4>(codes, fill, base4, lane); break;
      case 5: Exponents<5>(codes, fill, base4, lane); break;
      case 6: Exponents<6>(codes, fill, base4, lane); break;
      case 7: Exponents<7>(codes, fill, base4, lane); break;
      default: Exponents<8>(codes, fill, base4, lane); break;
    }
    if (n_exc > 0) {  // warp-uniform
      // Stage exponent bytes (element t*128 + d at stage[t*128 + d]), scatter the exceptions'
      // exponents over them, read back.
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int r = 2 * i + half;
        if (r < fill) *reinterpret_cast<uint2*>(stage + r * kHeadDim + 8 * j) = make_uint2(e0[i], e1[i]);
      }
      __syncwarp();
      const uint8_t* exc_pos = codes + w * n / 8;  // even offset: u16 loads are aligned
      const uint8_t* exc_exp = exc_pos + 2 * n_exc;
      for (int x = lane; x < n_exc; x += 32) {
        const int pos = __ldg(reinterpret_cast<const uint16_t*>(exc_pos) + x);
        if (pos < n) stage[pos] = __ldg(exc_exp + x);
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int r = 2 * i + half;
        if (r < fill) {
          const uint2 e = *reinterpret_cast<const uint2*>(stage + r * kHeadDim + 8 * j);
          e0[i] = e.x;
          e1[i] = e.y;
        }
      }
    }
  }

  __device__ __forceinline__ void row(int i, float (&v)[8]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = AssembleBf16(e0[i], low[i].x, k);
      v[k + 4] = AssembleBf16(e1[i], low[i].y, k);
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Half-warp butterfly reduce-scatter of N values: after it each lane holds max(N/16, 1) finished
// sums, of values base .. base+count-1. At each xor step a lane keeps one half of its live values
// (upper half if its lane bit is set) and adds the partner's copy of that half. Fixed tree.
template <int C, int O, int N>
__device__ __forceinline__ void ReduceScatterStage(float (&v)[N], int lane, int& base) {
  if constexpr (O > 0) {
    if constexpr (C > 1) {
      constexpr int H = C / 2;
      const bool upper = (lane & O) != 0;
#pragma unroll
      for (int x = 0; x < H; ++x) {
        const float send = upper ? v[x] : v[x + H];
        const float keep = upper ? v[x + H] : v[x];
        v[x] = __fadd_rn(keep, __shfl_xor_sync(kFull, send, O));
      }
      if (upper) base += H;
      ReduceScatterStage<H, O / 2>(v, lane, base);
    } else {
      v[0] = __fadd_rn(v[0], __shfl_xor_sync(kFull, v[0], O));
      ReduceScatterStage<1, O / 2>(v, lane, base);
    }
  }
}

struct KernelArgs {
  const float* q;       // [batch][n_q_heads][128]
  float* part_out;      // [batch * n_q_heads][n_splits][128]
  float* part_ml;       // [batch * n_q_heads][n_splits][2]  (max, sum)
  int* error;
  int n_q_heads, n_kv_heads, n_tokens, blocks_per_split, n_splits;
  float scale;
};

// One CTA: one (split, kv head, seq). Dynamic shared memory: max(G * S, 8 * G * 128) floats,
// S = blocks_per_split * 16 (scores, later reused for the cross-warp reduction).
template <class Rows, int G>
__global__ void __launch_bounds__(kThreads) DecodeAttentionKernel(KernelArgs a, typename Rows::Source k_src,
                                                                  typename Rows::Source v_src) {
  KEEL_DYNAMIC_SHARED(float, smem);
  __shared__ __align__(16) uint8_t stage_mem[Rows::kStageBytes > 0 ? kWarps * Rows::kStageBytes : 16];

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane >> 4, j = lane & 15;
  const int n_blocks = (a.n_tokens + kBlockTokens - 1) / kBlockTokens;
  const int blk0 = split * a.blocks_per_split;
  const int blk_end = min(blk0 + a.blocks_per_split, n_blocks);
  const int n_tok = min(blk_end * kBlockTokens, a.n_tokens) - blk0 * kBlockTokens;
  const int S = a.blocks_per_split * kBlockTokens;
  const int my_blocks = max(0, (blk_end - blk0 - warp + kWarps - 1) / kWarps);
  uint8_t* stage = Rows::kStageBytes > 0 ? stage_mem + warp * Rows::kStageBytes : nullptr;
  const int q_head0 = kvh * G;
  const int64_t row0 = static_cast<int64_t>(b) * a.n_q_heads + q_head0;  // first (seq, q head) row

  // Query dims 8j..8j+7 of the group's heads.
  float q[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const float4* src = reinterpret_cast<const float4*>(a.q + (row0 + h) * kHeadDim + 8 * j);
    const float4 x = __ldg(src), y = __ldg(src + 1);
    q[h][0] = x.x; q[h][1] = x.y; q[h][2] = x.z; q[h][3] = x.w;
    q[h][4] = y.x; q[h][5] = y.y; q[h][6] = y.z; q[h][7] = y.w;
  }

  // ---- QK: scores[h][t] for the split's tokens.
  {
    Rows rows(k_src, b, kvh, a.n_kv_heads, stage, a.error);
    rows.prepare(blk0 + warp, kWarps, my_blocks, lane);
    for (int it = 0; it < my_blocks; ++it) {
      const int blk = blk0 + warp + it * kWarps;
      const int fill = min(kBlockTokens, a.n_tokens - blk * kBlockTokens);
      rows.fetch(blk, it, fill, lane);
      constexpr int N = kRowsPerLane * G;
      float part[N];  // part[i*G + h]: row 2i+half, head h, this lane's 8 dims
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        float v[8];
        rows.row(i, v);
#pragma unroll
        for (int h = 0; h < G; ++h) {
          float acc = __fmul_rn(q[h][0], v[0]);
#pragma unroll
          for (int e = 1; e < 8; ++e) acc = __fmaf_rn(q[h][e], v[e], acc);
          part[i * G + h] = acc;
        }
      }
      int base = 0;
      ReduceScatterStage<N, 8>(part, lane, base);
      constexpr int kHeld = N >= 16 ? N / 16 : 1;
      constexpr int kDupMask = N >= 16 ? 0 : 16 / N - 1;  // lanes holding copies of the same sums
      if ((lane & kDupMask) == 0) {
#pragma unroll
        for (int x = 0; x < kHeld; ++x) {
          const int idx = base + x, i = idx / G, h = idx % G, r = 2 * i + half;
          smem[h * S + (blk - blk0) * kBlockTokens + r] = r < fill ? __fmul_rn(part[x], a.scale) : -INFINITY;
        }
      }
    }
  }
  __syncthreads();

  // ---- Softmax over the split, one warp per head: m = max, p = e^(s-m) in place, l = sum p.
  for (int h = warp; h < G; h += kWarps) {
    float* s = smem + h * S;
    float m = -INFINITY;
    for (int t = lane; t < n_tok; t += 32) m = fmaxf(m, s[t]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    float l = 0.f;
    for (int t = lane; t < n_tok; t += 32) {
      const float e = expf(__fsub_rn(s[t], m));
      s[t] = e;
      l = __fadd_rn(l, e);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l = __fadd_rn(l, __shfl_xor_sync(kFull, l, o));
    if (lane == 0) {
      float* ml = a.part_ml + ((row0 + h) * a.n_splits + split) * 2;
      ml[0] = m;
      ml[1] = l;
    }
  }
  __syncthreads();

  // ---- PV: acc[h][e] += p[h][t] * v[t][8j+e] over this lane's rows.
  float acc[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
  {
    Rows rows(v_src, b, kvh, a.n_kv_heads, stage, a.error);
    rows.prepare(blk0 + warp, kWarps, my_blocks, lane);
    for (int it = 0; it < my_blocks; ++it) {
      const int blk = blk0 + warp + it * kWarps;
      const int fill = min(kBlockTokens, a.n_tokens - blk * kBlockTokens);
      rows.fetch(blk, it, fill, lane);
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int r = 2 * i + half;
        if (r < fill) {
          float v[8];
          rows.row(i, v);
          const int t = (blk - blk0) * kBlockTokens + r;
#pragma unroll
          for (int h = 0; h < G; ++h) {
            const float p = smem[h * S + t];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[h][e] = __fmaf_rn(p, v[e], acc[h][e]);
          }
        }
      }
    }
  }
  __syncthreads();  // probabilities no longer needed: reuse smem for the reduction

  // ---- Sum the 8 half-warp partials in a fixed order and write the split's partial output.
  const int hw = warp * 2 + half;
#pragma unroll
  for (int h = 0; h < G; ++h) {
    float4* dst = reinterpret_cast<float4*>(smem + (hw * G + h) * kHeadDim + 8 * j);
    dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * kHeadDim; idx += kThreads) {
    const int h = idx / kHeadDim, d = idx % kHeadDim;
    float o = smem[h * kHeadDim + d];
#pragma unroll
    for (int x = 1; x < kHalfWarps; ++x) o = __fadd_rn(o, smem[(x * G + h) * kHeadDim + d]);
    a.part_out[((row0 + h) * a.n_splits + split) * kHeadDim + d] = o;
  }
}

// Combines the splits of one (seq, q head): thread d writes out[d]. Shared by both paths.
__global__ void __launch_bounds__(kHeadDim) CombineSplitsKernel(const float* part_out, const float* part_ml,
                                                                float* out, int n_splits) {
  const int64_t row = blockIdx.x;
  const int d = threadIdx.x;
  const float* ml = part_ml + row * n_splits * 2;
  float m = -INFINITY;
  for (int s = 0; s < n_splits; ++s) m = fmaxf(m, ml[2 * s]);
  float l = 0.f, o = 0.f;
  for (int s = 0; s < n_splits; ++s) {
    const float w = expf(__fsub_rn(ml[2 * s], m));
    l = __fmaf_rn(w, ml[2 * s + 1], l);
    o = __fmaf_rn(w, part_out[(row * n_splits + s) * kHeadDim + d], o);
  }
  out[row * kHeadDim + d] = __fdiv_rn(o, l);
}

// Test hook: one warp per block, decode with ZfRows and write bf16 bits.
__global__ void __launch_bounds__(32) DecodeBlocksKernel(ZfRows::Source src, int n_kv_heads, int n_tokens,
                                                         uint16_t* out, int64_t token_capacity, int* error) {
  __shared__ __align__(16) uint8_t stage[ZfRows::kStageBytes];
  const int blk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
  const int half = lane >> 4, j = lane & 15;
  const int fill = min(kBlockTokens, n_tokens - blk * kBlockTokens);
  ZfRows rows(src, b, kvh, n_kv_heads, stage, error);
  rows.prepare(blk, 1, 1, lane);
  rows.fetch(blk, 0, fill, lane);
  uint16_t* head = out + (static_cast<int64_t>(b) * n_kv_heads + kvh) * token_capacity * kHeadDim;
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
    const int r = 2 * i + half;
    if (r < fill) {
      float v[8];
      rows.row(i, v);
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        w[k] = (__float_as_uint(v[2 * k]) >> 16) | (__float_as_uint(v[2 * k + 1]) & 0xFFFF0000u);
      *reinterpret_cast<uint4*>(head + (static_cast<int64_t>(blk) * kBlockTokens + r) * kHeadDim + 8 * j) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host side.

int SmCount(int* sms) {
  int dev = 0;
  ZF_CUDA(cudaGetDevice(&dev));
  ZF_CUDA(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
  return kZfOk;
}

bool Aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int CheckShape(const ZfAttnShape& s) {
  if (s.head_dim != kHeadDim) return Fail(kZfUnsupported, "head_dim " + std::to_string(s.head_dim) + " (only 128)");
  if (s.batch < 1 || s.n_kv_heads < 1 || s.n_q_heads < 1 || s.n_tokens < 1)
    return Fail(kZfInvalidArgument, "batch, heads and n_tokens must be >= 1");
  if (s.batch > 65535 || s.n_kv_heads > 65535) return Fail(kZfInvalidArgument, "batch or n_kv_heads > 65535");
  if (s.n_q_heads % s.n_kv_heads != 0)
    return Fail(kZfInvalidArgument, "n_q_heads " + std::to_string(s.n_q_heads) + " is not a multiple of n_kv_heads " +
                                        std::to_string(s.n_kv_heads));
  const int g = s.n_q_heads / s.n_kv_heads;
  if (g != 1 && g != 2 && g != 4 && g != 8)
    return Fail(kZfUnsupported, "GQA group " + std::to_string(g) + " (1, 2, 4, 8)");
  if (s.blocks_per_split < 0 || s.blocks_per_split > kMaxBlocksPerSplit)
    return Fail(kZfInvalidArgument, "blocks_per_split must be 0..64");
  return kZfOk;
}

template <class Rows>
int Launch(const ZfAttnShape& s, const ZfPlan& plan, const float* q, const typename Rows::Source& k_src,
           const typename Rows::Source& v_src,
           float* out, void* workspace, size_t workspace_bytes, int* error, void* stream) {
  if (workspace_bytes < plan.workspace_bytes || (plan.workspace_bytes > 0 && workspace == nullptr))
    return Fail(kZfInvalidArgument, "workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                                         std::to_string(plan.workspace_bytes));
  if (!Aligned(q, 16) || !Aligned(workspace, 16) || out == nullptr)
    return Fail(kZfInvalidArgument, "q and workspace must be 16-byte aligned, out non-null");
  const int g = s.n_q_heads / s.n_kv_heads;
  const int64_t rows = static_cast<int64_t>(s.batch) * s.n_q_heads;
  KernelArgs a;
  a.q = q;
  a.part_out = static_cast<float*>(workspace);
  a.part_ml = a.part_out + rows * plan.n_splits * kHeadDim;
  a.error = error;
  a.n_q_heads = s.n_q_heads;
  a.n_kv_heads = s.n_kv_heads;
  a.n_tokens = s.n_tokens;
  a.blocks_per_split = plan.blocks_per_split;
  a.n_splits = plan.n_splits;
  a.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  const dim3 grid(plan.n_splits, s.n_kv_heads, s.batch);
  const size_t S = static_cast<size_t>(plan.blocks_per_split) * kBlockTokens;
  const size_t smem = std::max<size_t>(g * S, static_cast<size_t>(kHalfWarps) * g * kHeadDim) * sizeof(float);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  using keel::cuda::LaunchKernel;
  switch (g) {
    case 1: LaunchKernel(DecodeAttentionKernel<Rows, 1>, grid, kThreads, smem, st, a, k_src, v_src); break;
    case 2: LaunchKernel(DecodeAttentionKernel<Rows, 2>, grid, kThreads, smem, st, a, k_src, v_src); break;
    case 4: LaunchKernel(DecodeAttentionKernel<Rows, 4>, grid, kThreads, smem, st, a, k_src, v_src); break;
    default: LaunchKernel(DecodeAttentionKernel<Rows, 8>, grid, kThreads, smem, st, a, k_src, v_src); break;
  }
  ZF_CUDA(cudaGetLastError());
  LaunchKernel(CombineSplitsKernel, dim3(static_cast<unsigned>(rows)), dim3(kHeadDim), 0, st,
               static_cast<const float*>(a.part_out), static_cast<const float*>(a.part_ml), out, plan.n_splits);
  ZF_CUDA(cudaGetLastError());
  return Ok();
}

uint16_t ReadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

}  // namespace

// ------------------------------------------------------------------------------------------------
// Public API.

const char* zf_last_error() { return g_last_error.c_str(); }

const char* zf_status_name(int status) {
  switch (status) {
    case kZfOk: return "ok";
    case kZfInvalidArgument: return "invalid argument";
    case kZfUnsupported: return "unsupported";
    case kZfCudaError: return "CUDA error";
    case kZfCorruptBlock: return "corrupt block";
    default: return "unknown status";
  }
}

int zf_make_plan(const ZfAttnShape& s, ZfPlan* plan) {
  if (int rc = CheckShape(s)) return rc;
  ZfPlan p;
  p.n_blocks = (s.n_tokens + kBlockTokens - 1) / kBlockTokens;
  if (s.blocks_per_split > 0) {
    p.blocks_per_split = s.blocks_per_split;
  } else {
    int sms = 0;
    if (int rc = SmCount(&sms)) return rc;
    // ~4 CTAs per SM in total, each between 4 and 64 blocks long.
    const int64_t total = static_cast<int64_t>(s.batch) * s.n_kv_heads * p.n_blocks;
    const int64_t want = std::max<int64_t>(1, 4LL * sms);
    p.blocks_per_split =
        static_cast<int>(std::clamp<int64_t>((total + want - 1) / want, kMinBlocksPerSplit, kMaxBlocksPerSplit));
  }
  p.n_splits = (p.n_blocks + p.blocks_per_split - 1) / p.blocks_per_split;
  p.workspace_bytes = static_cast<size_t>(s.batch) * s.n_q_heads * p.n_splits * (kHeadDim + 2) * sizeof(float);
  *plan = p;
  return Ok();
}

int zf_attention_bf16(const ZfAttnShape& s, const float* q, const uint16_t* k, const uint16_t* v, float* out,
                      void* workspace, size_t workspace_bytes, void* stream) {
  ZfPlan plan;
  if (int rc = zf_make_plan(s, &plan)) return rc;
  const int64_t cap = s.token_capacity > 0 ? s.token_capacity : s.n_tokens;
  if (cap < s.n_tokens) return Fail(kZfInvalidArgument, "token_capacity < n_tokens");
  if (!Aligned(k, 16) || !Aligned(v, 16)) return Fail(kZfInvalidArgument, "k and v must be 16-byte aligned");
  return Launch<Bf16Rows>(s, plan, q, {k, cap}, {v, cap}, out, workspace, workspace_bytes, nullptr, stream);
}

int zf_attention_zipfusion(const ZfAttnShape& s, const float* q, const uint8_t* k_blocks, const uint64_t* k_offsets,
                           const uint8_t* v_blocks, const uint64_t* v_offsets, float* out, void* workspace,
                           size_t workspace_bytes, int* error_flag, void* stream) {
  ZfPlan plan;
  if (int rc = zf_make_plan(s, &plan)) return rc;
  const int64_t cap = s.block_capacity > 0 ? s.block_capacity : plan.n_blocks;
  if (cap < plan.n_blocks) return Fail(kZfInvalidArgument, "block_capacity < ceil(n_tokens / 16)");
  if (!k_blocks || !v_blocks || !Aligned(k_blocks, 8) || !Aligned(v_blocks, 8) || !Aligned(k_offsets, 8) ||
      !Aligned(v_offsets, 8))
    return Fail(kZfInvalidArgument, "block buffers and offset tables must be non-null and 8-byte aligned");
  return Launch<ZfRows>(s, plan, q, {k_blocks, k_offsets, cap}, {v_blocks, v_offsets, cap}, out, workspace,
                        workspace_bytes, error_flag, stream);
}

int zf_decode_blocks(const ZfAttnShape& s, const uint8_t* blocks, const uint64_t* offsets, uint16_t* out,
                     int* error_flag, void* stream) {
  ZfPlan plan;
  ZfAttnShape s1 = s;
  s1.blocks_per_split = 1;  // no device query needed
  if (int rc = zf_make_plan(s1, &plan)) return rc;
  const int64_t tcap = s.token_capacity > 0 ? s.token_capacity : s.n_tokens;
  const int64_t bcap = s.block_capacity > 0 ? s.block_capacity : plan.n_blocks;
  if (tcap < s.n_tokens || bcap < plan.n_blocks) return Fail(kZfInvalidArgument, "capacity below n_tokens");
  if (!Aligned(blocks, 8) || !Aligned(offsets, 8) || !Aligned(out, 16))
    return Fail(kZfInvalidArgument, "misaligned pointer");
  const dim3 grid(plan.n_blocks, s.n_kv_heads, s.batch);
  keel::cuda::LaunchKernel(DecodeBlocksKernel, grid, dim3(32), 0, static_cast<cudaStream_t>(stream),
                           ZfRows::Source{blocks, offsets, bcap}, s.n_kv_heads, s.n_tokens, out, tcap, error_flag);
  ZF_CUDA(cudaGetLastError());
  return Ok();
}

int zf_validate_block(const uint8_t* d, size_t size, int n) {
  auto bad = [&](const std::string& why) { return Fail(kZfCorruptBlock, "zipfusion block: " + why); };
  if (size < 8) return bad("shorter than its 8-byte header");
  if (d[0] != kMagic) return bad("bad magic");
  if (d[1] != 0) return bad("dtype " + std::to_string(d[1]) + " (the CUDA kernels read bf16 only)");
  const int w = d[2], base = d[3], bn = ReadU16(d + 4), n_exc = ReadU16(d + 6);
  if (w > 8) return bad("width " + std::to_string(w));
  if (base + (1 << w) - 1 > 255) return bad("base + 2^width - 1 > 255");
  if (bn != n) return bad("n " + std::to_string(bn) + ", expected " + std::to_string(n));
  if (n_exc > n) return bad("more exceptions than elements");
  const size_t need = 8 + static_cast<size_t>(n) + static_cast<size_t>(w) * n / 8 + 3 * static_cast<size_t>(n_exc);
  if (size < need) return bad("truncated: " + std::to_string(size) + " bytes, header needs " + std::to_string(need));
  const uint8_t* pos = d + 8 + n + static_cast<size_t>(w) * n / 8;
  const uint8_t* exp = pos + 2 * n_exc;
  int prev = -1;
  for (int x = 0; x < n_exc; ++x) {
    const int p = ReadU16(pos + 2 * x);
    if (p <= prev || p >= n) return bad("exception positions not increasing or past n");
    prev = p;
    if (exp[x] >= base && exp[x] < base + (1 << w)) return bad("exception exponent representable by a code");
  }
  return Ok();
}

size_t zf_packed_bytes(const size_t* sizes, size_t count) {
  size_t total = 0;
  for (size_t i = 0; i < count; ++i) total += (sizes[i] + 7) & ~size_t{7};
  return total;
}

void zf_pack_blocks(const uint8_t* const* blocks, const size_t* sizes, size_t count, uint8_t* out, uint64_t* offsets) {
  size_t at = 0;
  for (size_t i = 0; i < count; ++i) {
    offsets[i] = at;
    std::memcpy(out + at, blocks[i], sizes[i]);
    const size_t padded = (sizes[i] + 7) & ~size_t{7};
    std::memset(out + at + sizes[i], 0, padded - sizes[i]);
    at += padded;
  }
}

int zf_upload_blocks(const uint8_t* const* blocks, const size_t* sizes, const int* n, size_t count, uint8_t** d_buf,
                     uint64_t** d_offsets) {
  for (size_t i = 0; i < count; ++i) {
    if (int rc = zf_validate_block(blocks[i], sizes[i], n[i])) {
      g_last_error = "block " + std::to_string(i) + ": " + g_last_error;
      return rc;
    }
  }
  const size_t total = zf_packed_bytes(sizes, count);
  std::vector<uint8_t> packed(total);
  std::vector<uint64_t> offsets(count);
  zf_pack_blocks(blocks, sizes, count, packed.data(), offsets.data());
  *d_buf = nullptr;
  *d_offsets = nullptr;
  ZF_CUDA(cudaMalloc(reinterpret_cast<void**>(d_buf), std::max<size_t>(total, 8)));
  ZF_CUDA(cudaMalloc(reinterpret_cast<void**>(d_offsets), std::max<size_t>(count, 1) * sizeof(uint64_t)));
  ZF_CUDA(cudaMemcpy(*d_buf, packed.data(), total, cudaMemcpyHostToDevice));
  ZF_CUDA(cudaMemcpy(*d_offsets, offsets.data(), count * sizeof(uint64_t), cudaMemcpyHostToDevice));
  return Ok();
}

int zf_malloc(void** ptr, size_t bytes) {
  ZF_CUDA(cudaMalloc(ptr, bytes));
  return Ok();
}
int zf_free(void* ptr) {
  ZF_CUDA(cudaFree(ptr));
  return Ok();
}
int zf_copy_to_device(void* dst, const void* src, size_t bytes) {
  ZF_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  return Ok();
}
int zf_copy_to_host(void* dst, const void* src, size_t bytes) {
  ZF_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return Ok();
}
int zf_memset(void* ptr, int value, size_t bytes) {
  ZF_CUDA(cudaMemset(ptr, value, bytes));
  return Ok();
}
int zf_synchronize() {
  ZF_CUDA(cudaDeviceSynchronize());
  return Ok();
}
int zf_device_info(char* name, size_t name_capacity, int* sm_count) {
  int dev = 0;
  ZF_CUDA(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  ZF_CUDA(cudaGetDeviceProperties(&prop, dev));
  if (name && name_capacity > 0) std::snprintf(name, name_capacity, "%s", prop.name);
  if (sm_count) *sm_count = prop.multiProcessorCount;
  return Ok();
}

}  // namespace keel::kv::zipfusion::gpu
