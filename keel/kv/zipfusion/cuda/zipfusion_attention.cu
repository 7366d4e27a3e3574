// CUDA decode attention over ZipFusion blocks and over uncompressed bf16, one design for both.
// See zipfusion_attention.h for the API and layouts (zipfusion_attention_c.h for C callers),
// keel/kv/zipfusion/format.h for the block format (and the CPU fused decoder this mirrors).
//
// Design
// ------
// Decode attention reads every K and V byte of the context once, so it is memory bound, and
// ZipFusion wins only if decoding costs less than the bytes it saves. At 4.4 TB/s an H200 has
// ~11 thread instructions per ZipFusion element (1.44 bytes) in all; scalar FMAs alone took ~8 of
// them with 4 query heads per KV head (the first design: 0.34-0.60x of bf16). So the arithmetic
// goes to the tensor cores and the decode writes their operands directly.
//
// Split-K (flash-decoding). With one query token there is no parallelism over queries: a batch-1,
// 8-KV-head call has only 8 (seq, kv head) pairs, far fewer than the 132 SMs of an H100. So the
// context is cut into splits of `blocks_per_split` 16-token blocks and each CTA handles one
// (split, kv head, seq). A CTA writes its unnormalised partial output and its softmax max m and
// sum l per query head to a workspace; a second small kernel combines the splits of each
// (seq, q head) in split order: out = sum_s e^(m_s-M) o_s / sum_s e^(m_s-M) l_s. The split size
// is chosen so that ~4 CTAs per SM exist (at least 4 blocks, one per warp; at most 64). On sm_90
// the combine kernel is launched with Programmatic Dependent Launch, so its launch overlaps the
// attention kernel's tail (it waits for the grid's completion before reading).
//
// GQA on tensor cores. A CTA serves all `group` (G <= 8) query heads of its KV head, each K/V
// byte read once. mma.sync m16n8k16 (bf16 in, fp32 accumulate) has 16 rows: query head g uses
// rows g and g + 8 for two bf16 parts of its fp32 values, so the queries keep ~24 bits (Q split
// hi/mid/lo: [Q_hi; Q_mid] and [Q_lo; 0], two MMAs per k-step) and the probabilities ~16
// (P = [P_hi; P_lo]); rows of heads >= G are zero. Per 16-token block and warp:
//   QK:  S^T = Q' K^T: 2 token halves x 8 k-steps x 2 = 32 MMAs, K as the B operand;
//   PV:  O^T += P' V: 16 MMAs (8 dims each), V as the B operand.
// Scores go to shared memory; the softmax runs over the split's scores there (warp per head,
// fixed reduction tree); the 4 warps' partial outputs are summed in a fixed order.
//
// Operand layouts (KOperand, VOperand below). A warp owns whole blocks (warp w: blocks w, w+4, ...
// of the split), so it handles a block's exception list alone. The MMA fragment layout fixes which
// tokens a lane holds; the order of the reduced dimension (K: head dims) and of the output
// columns (V: head dims) is ours to permute, and it is permuted so that every lane holds whole
// ZipFusion chunks (8 consecutive dims of one token: one 8-byte load of low bytes and W bytes of
// codes) and the bf16 loader whole 16-byte loads.
//
// ZipFusion decode straight into the B registers (bf16 pairs):
//   1. codes -> exponent bytes, four per word (W-specific bit spreading, + base per byte; no
//      carries since base + code <= 255);
//   2. if the block has exceptions (warp-uniform branch), the warp stages its exponent bytes in
//      shared memory (2 KB per warp), scatters the exception exponents in (one store per
//      exception, lanes in parallel; the first 32 are loaded with the codes) and reads them back:
//      8 16-byte shared accesses per lane per block, against searching the sorted list per
//      element or patching registers by index (a loop per exception); real K/V has exceptions in
//      nearly every block (~1.2% of elements);
//   3. per bf16 pair, one shift puts two exponents of a word at bits 7 and 23, one PRMT gathers
//      the two low bytes with their signs replicated, one LOP3 joins them (JoinBf16x2).
// Headers are loaded and checked once per warp (prepare, for K and V at the kernel's start), so a
// block's low bytes, codes and first exceptions all go out in one round trip. bench/zipfusion/sass_budget.sh counts the SASS.
//
// Bit-identity. Both kernels are instantiations of one template; only the "Rows" policy that
// produces a block's B operands differs, and both produce the same bf16 bits. Every other
// floating-point operation is an explicit __fmaf_rn/__fmul_rn/__fadd_rn or the same mma.sync
// sequence, so the outputs are the same bit for bit.
#include "keel/kv/zipfusion/cuda/zipfusion_attention.h"
#include "keel/kv/zipfusion/cuda/zipfusion_attention_c.h"

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
// 4 CTAs (16 warps) per SM: caps registers at 128 per thread, which the kernels fit without spills.
constexpr int kMinCtasPerSm = 4;
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
// `#pragma unroll` for __host__ __device__ code (the host compiler does not know it).
#ifdef __CUDA_ARCH__
#define ZF_UNROLL _Pragma("unroll")
#else
#define ZF_UNROLL
#endif

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


// ------------------------------------------------------------------------------------------------
// Tensor-core operands.

// mma.sync m16n8k16 with bf16 inputs and fp32 accumulation: acc = A * B + acc. Fragment layouts
// as in the PTX ISA (tests/kv/cuda_emu/cuda_runtime.h spells them out; the emulation implements
// them as a warp collective).
__device__ __forceinline__ void Mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(KEEL_CUDA_EMULATION)
  keel_cuda_emu::MmaM16N8K16Bf16(acc, a, b0, b1);
#else
  (void)acc, (void)a, (void)b0, (void)b1;  // nvcc's host pass: never called there
#endif
}

// Two floats rounded to bf16 (nearest, ties to even), `lo` in the low half: cvt.rn.bf16x2.f32.
ZF_HD uint32_t PackBf16x2(float lo, float hi) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  auto round = [](float x) -> uint32_t {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;  // NaN: the canonical NaN, as cvt gives
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  };
  return round(lo) | (round(hi) << 16);
#endif
}

// x0, x1 as hi + lo, each a bf16 pair: hi = bf16(x), lo = bf16(x - hi) (the difference is exact in
// fp32). Two MMAs, one with each, carry x to ~16 significant bits instead of bf16's 8: enough for
// the probabilities, whose errors the output sees relative to sum p |v|.
ZF_HD void SplitBf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = PackBf16x2(x0, x1);
  lo = PackBf16x2(x0 - BitsToFloat(hi << 16), x1 - BitsToFloat(hi & 0xFFFF0000u));
}

// The same in three parts, hi + mid + lo, ~24 significant bits (fp32's): for the queries, whose
// rounding errors a score sees multiplied by the keys, and keys have outlier channels.
ZF_HD void SplitBf16x2x3(float x0, float x1, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  hi = PackBf16x2(x0, x1);
  const float r0 = x0 - BitsToFloat(hi << 16), r1 = x1 - BitsToFloat(hi & 0xFFFF0000u);
  SplitBf16x2(r0, r1, mid, lo);
}

// A bf16 pair from ZipFusion bytes, in one LOP3: `exps` holds the two exponents at bits 7..14 and
// 23..30, `lows` the two low bytes (sign | mantissa) at bytes 0 and 2, each followed by a byte
// holding its sign bit replicated (PRMT's sign mode). bf16 = sign << 15 | exponent << 7 | mantissa.
// The exponent positions come from one shift of a word of exponent bytes: << 7 puts bytes 0 and
// 2 there, >> 1 bytes 1 and 3, so each shift serves a pair; other bits of either input are ignored.
constexpr uint32_t kExpBits = 0x7F807F80u;
ZF_HD uint32_t JoinBf16x2(uint32_t exps, uint32_t lows) { return (lows & ~kExpBits) | (exps & kExpBits); }

// PRMT selector: byte x of the first word, then its sign, byte y of the second word, its sign.
ZF_HD constexpr uint32_t LowsSelector(uint32_t x, uint32_t y) {
  return x | ((8 | x) << 4) | ((4 + y) << 8) | ((8 | (4 + y)) << 12);
}

// ------------------------------------------------------------------------------------------------
// Which elements of a 16-token block lane (g = lane / 4, t = lane % 4) holds as an MMA operand.
//
// K is the B operand of S = [Q_hi; Q_mid] K^T (k = head dims, n = 8 tokens per MMA): the fragment
// layout gives a lane tokens g and g + 8 and four k slots per MMA; the k order is permuted (the
// same way in Q) so that over the 8 k-steps a lane holds dims 32t..32t+31: four whole ZipFusion
// chunks, contiguous codes, and 16-byte bf16 loads. K-step s uses dims 32t + 4s .. 32t + 4s + 3,
// register b0 dims 4s and 4s + 2, b1 dims 4s + 1 and 4s + 3 (pairs that one shift of a word of
// exponent bytes serves: JoinBf16x2).
//
// V is the B operand of O = [P_hi; P_lo] V (k = the 16 tokens, n = 8 dims per MMA): the layout
// gives a lane tokens 2t, 2t+1, 2t+8, 2t+9; the n order is permuted so that a lane holds dims
// 16g..16g+15 (two chunks): MMA nt's column g is dim 16g + nt.
struct KOperand {
  static constexpr int kRows = 2, kDims = 32;
  static __device__ __forceinline__ int Row(int i, int lane) { return (lane >> 2) + 8 * i; }
  static __device__ __forceinline__ int Dim0(int lane) { return 32 * (lane & 3); }
};
struct VOperand {
  static constexpr int kRows = 4, kDims = 16;
  static __device__ __forceinline__ int Row(int i, int lane) { return 2 * (lane & 3) + (i & 1) + 8 * (i >> 1); }
  static __device__ __forceinline__ int Dim0(int lane) { return 16 * (lane >> 2); }
};

// The row a lane reads for its row i of a block holding `fill` rows: rows past the end read row
// 0, so that no per-element selects are needed (K: their score columns are dropped; V: their
// probabilities are 0, times finite values) and both loaders read the same values.
template <class Op>
__device__ __forceinline__ int LoadedRow(int i, int lane, int fill) {
  const int r = Op::Row(i, lane);
  return r < fill ? r : 0;
}

// ------------------------------------------------------------------------------------------------
// Rows policies: load one 16-token block of K or V for this (seq, kv head) and hand the lane its
// operand elements (rows Op::Row(i), dims Op::Dim0 .. + Op::kDims) as bf16 pairs. `Source`
// (kernel parameter) says where a tensor lives; a Rows object lives in registers. Interface (all
// calls warp-uniform):
//   Rows(src, b, kvh, n_kv_heads, stage, error)   bind to one (seq, kv head)
//   prepare(first, stride, count, n_tokens, lane)   the warp will visit blocks first + it*stride, it < count
//   fetch(blk, it, fill, lane)            load block blk (the it-th visit) holding `fill` rows
//   Word(i, w)        dims Dim0 + 4(w/2) + (w%2) and that + 2 of row i, the lower in the low half
//   Pair(i0, i1, d)   dim Dim0 + d of rows i0 (low half) and i1
// Rows >= fill read as row 0 (LoadedRow).

struct Bf16Source {
  const uint16_t* tensor;  // [batch][n_kv_heads][token_capacity][128]
  int64_t token_capacity;
};

template <class Op>
struct Bf16Rows {
  using Source = Bf16Source;
  const uint16_t* head;  // this (seq, kv head)
  uint4 raw[Op::kRows][Op::kDims / 8];

  __device__ Bf16Rows(const Source& src, int b, int kvh, int n_kv_heads, uint8_t* /*stage*/, int* /*error*/)
      : head(src.tensor + (static_cast<int64_t>(b) * n_kv_heads + kvh) * src.token_capacity * kHeadDim) {}
  __device__ void prepare(int, int, int, int, int) {}
  __device__ __forceinline__ void fetch(int blk, int /*it*/, int fill, int lane) {
#pragma unroll
    for (int i = 0; i < Op::kRows; ++i) {
      const int r = LoadedRow<Op>(i, lane, fill);
      const uint4* src = reinterpret_cast<const uint4*>(
          head + (static_cast<int64_t>(blk) * kBlockTokens + r) * kHeadDim + Op::Dim0(lane));
#pragma unroll
      for (int c = 0; c < Op::kDims / 8; ++c) raw[i][c] = __ldg(src + c);
    }
  }
  // Dims 2k, 2k + 1 of row i, as stored.
  __device__ __forceinline__ uint32_t Raw(int i, int k) const {
    const uint4& u = raw[i][k >> 2];
    const int x = k & 3;
    return x == 0 ? u.x : x == 1 ? u.y : x == 2 ? u.z : u.w;
  }
  __device__ __forceinline__ uint32_t Word(int i, int w) const {
    return Prmt(Raw(i, 2 * (w >> 1)), Raw(i, 2 * (w >> 1) + 1), (w & 1) ? 0x7632u : 0x5410u);
  }
  __device__ __forceinline__ uint32_t Pair(int i0, int i1, int d) const {
    return Prmt(Raw(i0, d >> 1), Raw(i1, d >> 1), (d & 1) ? 0x7632u : 0x5410u);
  }
};

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

// Eight codes (bits 0..8W-1 of `bits`, nothing above) -> exponent bytes (base added) of elements
// 0..3 (e0) and 4..7 (e1).
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

// Codes of kChunks consecutive chunks (8 elements, W bits each, LSB-first), starting with chunk
// `chunk0` of the codes section `codes` (8-byte aligned; it ends on an 8-byte boundary), one
// 64-bit value per chunk. The strip is W * kChunks bytes at byte W * chunk0: 4-byte aligned for
// the K operand (4 chunks) and for even W, 2 mod 4 for the V operand (2 chunks) with odd W, where
// W * kChunks is 2 mod 4 too; so ceil(W * kChunks / 4) aligned words from the aligned address
// below the strip cover it exactly and never leave the codes section.
template <int W, int kChunks>
ZF_HD void StripCodes(const uint8_t* codes, int chunk0, uint64_t (&bits)[kChunks]) {
  constexpr int kWords = (W * kChunks + 3) / 4;
  constexpr bool kAligned = (W * kChunks) % 4 == 0;  // then W * chunk0 is a multiple of 4 too
  const int off = W * chunk0;
  const uint32_t* p = reinterpret_cast<const uint32_t*>(codes + (off & ~3));
  uint32_t u[kWords + 3];
ZF_UNROLL
  for (int k = 0; k < kWords; ++k) u[k] = Ld(p + k);
ZF_UNROLL
  for (int k = kWords; k < kWords + 3; ++k) u[k] = 0;
  if constexpr (!kAligned) {
    const int sh = 8 * (off & 3);
ZF_UNROLL
    for (int k = 0; k < kWords + 2; ++k) u[k] = FunnelShiftRight(u[k], u[k + 1], sh);
  }
  constexpr uint64_t kMask = W == 8 ? ~0ull : (1ull << (8 * W)) - 1;
ZF_UNROLL
  for (int c = 0; c < kChunks; ++c) {
    const int o = 8 * W * c, q = o / 32, r = o % 32;
    const uint32_t lo = FunnelShiftRight(u[q], u[q + 1], r), hi = FunnelShiftRight(u[q + 1], u[q + 2], r);
    bits[c] = ((static_cast<uint64_t>(hi) << 32) | lo) & kMask;
  }
}

struct ZfSource {
  const uint8_t* buf;      // all blocks
  const uint64_t* table;   // [batch][n_kv_heads][block_capacity] byte offsets into buf
  int64_t block_capacity;
};

template <class Op>
struct ZfRows {
  static constexpr int kStageBytes = kBlockElems;  // shared memory per warp: one exponent byte per element
  static constexpr int kWords = Op::kDims / 4;     // 4 elements per word
  static constexpr int kChunks = Op::kDims / 8;
  using Source = ZfSource;
  const uint8_t* buf;
  const uint64_t* offsets;  // this (seq, kv head)
  uint8_t* stage;           // this warp's 2 KB of shared memory
  int* error;
  uint64_t my_offset = 0;   // lane l: offset of the l-th block this warp visits
  uint32_t my_header = 0;   // and its header, checked: width | base << 4 | n_exc << 12
  uint32_t low[Op::kRows][kWords];  // sign | mantissa bytes
  uint32_t exp[Op::kRows][kWords];  // exponent bytes

  __device__ ZfRows(const Source& src, int b, int kvh, int n_kv_heads, uint8_t* warp_stage, int* error_flag)
      : buf(src.buf),
        offsets(src.table + (static_cast<int64_t>(b) * n_kv_heads + kvh) * src.block_capacity),
        stage(warp_stage),
        error(error_flag) {}
  // All of the warp's offsets and block headers in two loads (count <= kMaxBlocksPerSplit / kWarps
  // <= 32), each lane checking its block's header: takes two dependent global loads and the
  // checks off each block's critical path, so that a block's low bytes, codes and exceptions all
  // go out at once. A bad header (magic, dtype, width, base, n, exception count) raises *error
  // and reads the block as width 0 without exceptions.
  __device__ void prepare(int first, int stride, int count, int n_tokens, int lane) {
    if (lane >= count) return;
    const int blk = first + lane * stride;
    my_offset = __ldg(reinterpret_cast<const unsigned long long*>(offsets) + blk);
    const uint2 hdr = __ldg(reinterpret_cast<const uint2*>(buf + my_offset));
    // Header: u8 magic, u8 dtype, u8 width, u8 base, u16 n, u16 n_exc.
    const int w = (hdr.x >> 16) & 0xFF, base = hdr.x >> 24, n_exc = hdr.y >> 16;
    const int n = min(kBlockTokens, n_tokens - blk * kBlockTokens) * kHeadDim;
    const bool bad = (hdr.x & 0xFF) != kMagic || ((hdr.x >> 8) & 0xFF) != 0 || w > 8 || base + (1 << w) - 1 > 255 ||
                     static_cast<int>(hdr.y & 0xFFFF) != n || n_exc > n;
    if (bad && error) atomicOr(error, 1);
    my_header = bad ? static_cast<uint32_t>(base) << 4 : w | (base << 4) | (n_exc << 12);
  }

  template <int W>
  __device__ __forceinline__ void Exponents(const uint8_t* codes, int fill, uint32_t base4, int lane) {
    const int chunk0 = Op::Dim0(lane) / 8;
#pragma unroll
    for (int i = 0; i < Op::kRows; ++i) {
      const int r = LoadedRow<Op>(i, lane, fill);
      uint64_t bits[kChunks] = {};
      if constexpr (W != 0) StripCodes<W, kChunks>(codes, r * (kHeadDim / 8) + chunk0, bits);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) ChunkExponents<W>(bits[c], base4, exp[i][2 * c], exp[i][2 * c + 1]);
    }
  }

  // What fetch learns from a block's header (and the first exceptions, loaded with the codes).
  struct Opened {
    const uint8_t* codes;
    const uint8_t* exc_pos;  // u16 positions, then u8 exponents
    int w, n, n_exc, pos0;
    uint32_t base4;
    uint8_t exp0;
  };

  __device__ __forceinline__ void fetch(int blk, int it, int fill, int lane) {
    const Opened o = Open(it, fill, lane);
    switch (o.w) {  // warp-uniform: one width per block
      case 0: Exponents<0>(o.codes, fill, o.base4, lane); break;
      case 1: Exponents<1>(o.codes, fill, o.base4, lane); break;
      case 2: Exponents<2>(o.codes, fill, o.base4, lane); break;
      case 3: Exponents<3>(o.codes, fill, o.base4, lane); break;
      case 4: Exponents<4>(o.codes, fill, o.base4, lane); break;
      case 5: Exponents<5>(o.codes, fill, o.base4, lane); break;
      case 6: Exponents<6>(o.codes, fill, o.base4, lane); break;
      case 7: Exponents<7>(o.codes, fill, o.base4, lane); break;
      default: Exponents<8>(o.codes, fill, o.base4, lane); break;
    }
    (void)blk;
    Patch(o, fill, lane);
  }

  // The block's (checked) header and the loads that do not depend on the width's decoder: low
  // bytes and the first 32 exceptions.
  __device__ __forceinline__ Opened Open(int it, int fill, int lane) {
    const int d0 = Op::Dim0(lane);
    const uint8_t* p = buf + __shfl_sync(kFull, static_cast<unsigned long long>(my_offset), it);
    const uint32_t hdr = __shfl_sync(kFull, my_header, it);
#pragma unroll
    for (int i = 0; i < Op::kRows; ++i) {
      const int r = LoadedRow<Op>(i, lane, fill);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const uint2 l = __ldg(reinterpret_cast<const uint2*>(p + 8 + r * kHeadDim + d0 + 8 * c));
        low[i][2 * c] = l.x;
        low[i][2 * c + 1] = l.y;
      }
    }
    Opened o;
    o.w = hdr & 15;
    o.n = fill * kHeadDim;
    o.n_exc = hdr >> 12;
    const uint32_t base = (hdr >> 4) & 0xFF;
    o.codes = p + 8 + o.n;
    o.base4 = base * 0x01010101u;
    o.exc_pos = o.codes + o.w * o.n / 8;  // even offset: u16 loads are aligned
    o.pos0 = lane < o.n_exc ? __ldg(reinterpret_cast<const uint16_t*>(o.exc_pos) + lane) : o.n;
    o.exp0 = lane < o.n_exc ? __ldg(o.exc_pos + 2 * o.n_exc + lane) : 0;
    return o;
  }

  // Exceptions: stage the exponent bytes (element t*128 + d at stage[t*128 + d]), scatter the
  // exceptions' exponents over them, read back. Per lane 4 16-byte stores and loads plus
  // ~n_exc/32 byte stores, where searching the sorted list per element would cost far more.
  __device__ __forceinline__ void Patch(const Opened& o, int fill, int lane) {
    if (o.n_exc == 0) return;  // warp-uniform
    const int d0 = Op::Dim0(lane);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < Op::kRows; ++i) {
      const int r = Op::Row(i, lane);
      if (r < fill) {
#pragma unroll
        for (int q = 0; q < kWords / 4; ++q)
          *reinterpret_cast<uint4*>(stage + r * kHeadDim + d0 + 16 * q) =
              make_uint4(exp[i][4 * q], exp[i][4 * q + 1], exp[i][4 * q + 2], exp[i][4 * q + 3]);
      }
    }
    __syncwarp();
    if (o.pos0 < o.n) stage[o.pos0] = o.exp0;
#pragma unroll 1  // rare (a block with more than 32 exceptions): keep it small
    for (int x = lane + 32; x < o.n_exc; x += 32) {
      const int pos = __ldg(reinterpret_cast<const uint16_t*>(o.exc_pos) + x);
      if (pos < o.n) stage[pos] = __ldg(o.exc_pos + 2 * o.n_exc + x);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < Op::kRows; ++i) {
      const int r = LoadedRow<Op>(i, lane, fill);  // rows past the end: row 0, patched like the rest
#pragma unroll
      for (int q = 0; q < kWords / 4; ++q) {
        const uint4 e = *reinterpret_cast<const uint4*>(stage + r * kHeadDim + d0 + 16 * q);
        exp[i][4 * q] = e.x;
        exp[i][4 * q + 1] = e.y;
        exp[i][4 * q + 2] = e.z;
        exp[i][4 * q + 3] = e.w;
      }
    }
  }

  __device__ __forceinline__ uint32_t Word(int i, int w) const {
    const uint32_t e = exp[i][w >> 1], l = low[i][w >> 1];
    return (w & 1) ? JoinBf16x2(e >> 1, Prmt(l, l, LowsSelector(1, 3))) : JoinBf16x2(e << 7, Prmt(l, l, LowsSelector(0, 2)));
  }
  __device__ __forceinline__ uint32_t Pair(int i0, int i1, int d) const {
    const int w = d >> 2;
    const uint32_t x = d & 3, even = d & 2;
    // Exponents of dims even, even + 1 of both rows in one PRMT, shared by the pairs of d and d ^ 1.
    const uint32_t e = Prmt(exp[i0][w], exp[i1][w], even | ((even + 1) << 4) | ((4 + even) << 8) | ((5 + even) << 12));
    const uint32_t lows = Prmt(low[i0][w], low[i1][w], LowsSelector(x, x));
    return JoinBf16x2((d & 1) ? e >> 1 : e << 7, lows);
  }
};

// A kernel's choice of Rows policy. (A tag with a member template rather than a template template
// parameter: nvcc's host stubs do not handle the latter for kernels.)
struct Bf16Tensors {
  static constexpr int kStageBytes = 0;
  using Source = Bf16Source;
  template <class Op>
  using Rows = Bf16Rows<Op>;
};
struct ZfTensors {
  static constexpr int kStageBytes = kBlockElems;
  using Source = ZfSource;
  template <class Op>
  using Rows = ZfRows<Op>;
};

// ------------------------------------------------------------------------------------------------

struct KernelArgs {
  const float* q;       // [batch][n_q_heads][128]
  float* part_out;      // [batch * n_q_heads][n_splits][128]
  float* part_ml;       // [batch * n_q_heads][n_splits][2]  (max, sum)
  int* error;
  int n_q_heads, n_kv_heads, n_tokens, blocks_per_split, n_splits;
  float scale;
};

// Per-warp partial outputs in shared memory, padded so that the lanes' 16-byte stores spread
// over the banks: (warp, head) rows of kOutRow floats, lane t's 32 dims at 36 t.
constexpr int kOutLane = 36;
constexpr int kOutRow = 4 * kOutLane;

// Dynamic shared memory (floats) of one CTA: the split's scores, later the warps' partial outputs.
size_t SharedFloats(int group, int blocks_per_split) {
  return std::max<size_t>(static_cast<size_t>(group) * blocks_per_split * kBlockTokens,
                          static_cast<size_t>(kWarps) * group * kOutRow);
}

// One CTA: one (split, kv head, seq); warp w takes blocks w, w + 4, ... of the split.
template <class Tensors, int G>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) DecodeAttentionKernel(KernelArgs a, typename Tensors::Source k_src,
                                                                  typename Tensors::Source v_src) {
  using KRows = typename Tensors::template Rows<KOperand>;
  using VRows = typename Tensors::template Rows<VOperand>;
  KEEL_DYNAMIC_SHARED(float, smem);
  keel::cuda::AllowDependentLaunch();  // the combine kernel waits for this grid's completion itself
  constexpr int kStage = Tensors::kStageBytes;
  __shared__ __align__(16) uint8_t stage_mem[kStage > 0 ? kWarps * kStage : 16];

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_blocks = (a.n_tokens + kBlockTokens - 1) / kBlockTokens;
  const int blk0 = split * a.blocks_per_split;
  const int blk_end = min(blk0 + a.blocks_per_split, n_blocks);
  const int n_tok = min(blk_end * kBlockTokens, a.n_tokens) - blk0 * kBlockTokens;
  const int S = a.blocks_per_split * kBlockTokens;
  const int my_blocks = max(0, (blk_end - blk0 - warp + kWarps - 1) / kWarps);
  uint8_t* stage = kStage > 0 ? stage_mem + warp * kStage : nullptr;
  const int64_t row0 = static_cast<int64_t>(b) * a.n_q_heads + kvh * G;  // first (seq, q head) row
  // MMA rows g and g + 8 carry query head g (two parts of its values); rows of g >= G are zero.
  const bool has_head = g < G;

  // Both tensors' block offsets and headers go out first, so that V's are in registers by the
  // time PV starts (each costs two dependent round trips otherwise).
  KRows krows(k_src, b, kvh, a.n_kv_heads, stage, a.error);
  VRows vrows(v_src, b, kvh, a.n_kv_heads, stage, a.error);
  krows.prepare(blk0 + warp, kWarps, my_blocks, a.n_tokens, lane);
  vrows.prepare(blk0 + warp, kWarps, my_blocks, a.n_tokens, lane);

  // ---- QK: S^T = [Q_hi; Q_mid] K^T + [Q_lo; 0] K^T per block: 2 x 8 x 2 MMAs (two 8-token
  // halves, 8 k-steps, two parts of Q).
  {
    uint32_t qa[8][4];  // A fragments [Q_hi; Q_mid]: k-step s covers dims 32t + 4s .. + 3 of head g
    uint32_t ql[8][2];  // Q_lo's rows (A registers 0 and 2; registers 1 and 3 are the zero rows)
    {
      float qv[32];
      const float4* src = reinterpret_cast<const float4*>(a.q + (row0 + g) * kHeadDim + 32 * t);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float4 x = has_head ? __ldg(src + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        qv[4 * k] = x.x;
        qv[4 * k + 1] = x.y;
        qv[4 * k + 2] = x.z;
        qv[4 * k + 3] = x.w;
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        // k slots 2t, 2t + 1 are dims 4s, 4s + 2; slots 2t + 8, 2t + 9 dims 4s + 1, 4s + 3 (KOperand).
        SplitBf16x2x3(qv[4 * s], qv[4 * s + 2], qa[s][0], qa[s][1], ql[s][0]);
        SplitBf16x2x3(qv[4 * s + 1], qv[4 * s + 3], qa[s][2], qa[s][3], ql[s][1]);
      }
    }
    KRows& rows = krows;
    for (int it = 0; it < my_blocks; ++it) {
      const int blk = blk0 + warp + it * kWarps;
      const int fill = min(kBlockTokens, a.n_tokens - blk * kBlockTokens);
      rows.fetch(blk, it, fill, lane);
      // [token half][k-step parity]: two accumulators per half keep the dependent MMA chains at 8.
      // Rows g accumulate Q_hi and Q_lo, rows g + 8 Q_mid.
      float acc[2][2][4] = {};
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint32_t b0 = rows.Word(i, 2 * s), b1 = rows.Word(i, 2 * s + 1);
          const uint32_t lo[4] = {ql[s][0], 0u, ql[s][1], 0u};
          Mma(acc[i][s & 1], qa[s], b0, b1);
          Mma(acc[i][s & 1], lo, b0, b1);
        }
      if (has_head) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int tok = 8 * i + 2 * t + j;  // column 2t + j of half i
            // Element j is row g (hi + lo), element 2 + j row g + 8 (mid).
            const float dot = __fadd_rn(__fadd_rn(acc[i][0][j], acc[i][1][j]), __fadd_rn(acc[i][0][2 + j], acc[i][1][2 + j]));
            smem[g * S + (blk - blk0) * kBlockTokens + tok] = tok < fill ? __fmul_rn(dot, a.scale) : -INFINITY;
          }
      }
    }
  }
  __syncthreads();

  // ---- Softmax over the split, one warp per head: m = max, p = e^(s-m) in place, l = sum p.
  for (int h = warp; h < G; h += kWarps) {
    float* s = smem + h * S;
    float m = -INFINITY;
    for (int x = lane; x < n_tok; x += 32) m = fmaxf(m, s[x]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    float l = 0.f;
    for (int x = lane; x < n_tok; x += 32) {
      const float e = expf(__fsub_rn(s[x], m));
      s[x] = e;
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

  // ---- PV: O^T = [P_hi; P_lo] V per block, 16 MMAs (one per 8 dims); o[nt] holds dims
  // 32t + nt (elements 0, 2) and 32t + 16 + nt (1, 3), hi and lo parts.
  float o[16][4] = {};
  {
    VRows& rows = vrows;
    for (int it = 0; it < my_blocks; ++it) {
      const int blk = blk0 + warp + it * kWarps;
      const int fill = min(kBlockTokens, a.n_tokens - blk * kBlockTokens);
      rows.fetch(blk, it, fill, lane);
      float p[4] = {0.f, 0.f, 0.f, 0.f};  // tokens 2t, 2t+1, 2t+8, 2t+9
      if (has_head) {
        const float* ps = smem + g * S + (blk - blk0) * kBlockTokens;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int tok = 2 * t + (j & 1) + 8 * (j >> 1);
          p[j] = tok < fill ? ps[tok] : 0.f;
        }
      }
      uint32_t pa[4];
      SplitBf16x2(p[0], p[1], pa[0], pa[1]);
      SplitBf16x2(p[2], p[3], pa[2], pa[3]);
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) Mma(o[nt], pa, rows.Pair(0, 1, nt), rows.Pair(2, 3, nt));
    }
  }
  __syncthreads();  // probabilities no longer needed: reuse smem for the reduction

  // ---- Sum the 4 warps' partials in a fixed order and write the split's partial output.
  if (has_head) {
    float* dst = smem + (warp * G + g) * kOutRow + kOutLane * t;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      reinterpret_cast<float4*>(dst)[k] =
          make_float4(__fadd_rn(o[4 * k][0], o[4 * k][2]), __fadd_rn(o[4 * k + 1][0], o[4 * k + 1][2]),
                      __fadd_rn(o[4 * k + 2][0], o[4 * k + 2][2]), __fadd_rn(o[4 * k + 3][0], o[4 * k + 3][2]));
      reinterpret_cast<float4*>(dst + 16)[k] =
          make_float4(__fadd_rn(o[4 * k][1], o[4 * k][3]), __fadd_rn(o[4 * k + 1][1], o[4 * k + 1][3]),
                      __fadd_rn(o[4 * k + 2][1], o[4 * k + 2][3]), __fadd_rn(o[4 * k + 3][1], o[4 * k + 3][3]));
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * kHeadDim; idx += kThreads) {
    const int h = idx / kHeadDim, d = idx % kHeadDim;
    const int at = (d / 32) * kOutLane + d % 32;
    float sum = smem[h * kOutRow + at];
#pragma unroll
    for (int x = 1; x < kWarps; ++x) sum = __fadd_rn(sum, smem[(x * G + h) * kOutRow + at]);
    a.part_out[((row0 + h) * a.n_splits + split) * kHeadDim + d] = sum;
  }
}

// Combines the splits of one (seq, q head): thread d writes out[d]. Shared by both paths.
// Launched with LaunchKernelAfterPrevious, so its launch overlaps the attention kernel's tail.
__global__ void __launch_bounds__(kHeadDim) CombineSplitsKernel(const float* part_out, const float* part_ml,
                                                                float* out, int n_splits) {
  keel::cuda::WaitForPrerequisiteGrid();
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

// Test hook: one warp per block, decode with ZfRows<Op> and write bf16 bits.
template <class Op>
__global__ void __launch_bounds__(32) DecodeBlocksKernel(ZfSource src, int n_kv_heads, int n_tokens, uint16_t* out,
                                                         int64_t token_capacity, int* error) {
  __shared__ __align__(16) uint8_t stage[ZfRows<Op>::kStageBytes];
  const int blk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
  const int fill = min(kBlockTokens, n_tokens - blk * kBlockTokens);
  ZfRows<Op> rows(src, b, kvh, n_kv_heads, stage, error);
  rows.prepare(blk, 1, 1, n_tokens, lane);
  rows.fetch(blk, 0, fill, lane);
  uint16_t* head = out + ((static_cast<int64_t>(b) * n_kv_heads + kvh) * token_capacity +
                          static_cast<int64_t>(blk) * kBlockTokens) * kHeadDim + Op::Dim0(lane);
  if constexpr (Op::kRows == 2) {  // K: whole bf16 pairs of one row
#pragma unroll
    for (int i = 0; i < Op::kRows; ++i) {
      const int r = Op::Row(i, lane);
      if (r < fill) {
#pragma unroll
        for (int q = 0; q < Op::kDims / 8; ++q) {
          // Words 4q.. hold dims (8q, 8q+2), (8q+1, 8q+3), (8q+4, 8q+6), (8q+5, 8q+7): back to dim order.
          const uint32_t w0 = rows.Word(i, 4 * q), w1 = rows.Word(i, 4 * q + 1);
          const uint32_t w2 = rows.Word(i, 4 * q + 2), w3 = rows.Word(i, 4 * q + 3);
          reinterpret_cast<uint4*>(head + r * kHeadDim)[q] =
              make_uint4(Prmt(w0, w1, 0x5410u), Prmt(w0, w1, 0x7632u), Prmt(w2, w3, 0x5410u), Prmt(w2, w3, 0x7632u));
        }
      }
    }
  } else {  // V: pairs of rows
#pragma unroll
    for (int i = 0; i < Op::kRows; i += 2) {
      const int r0 = Op::Row(i, lane), r1 = Op::Row(i + 1, lane);
#pragma unroll
      for (int d = 0; d < Op::kDims; ++d) {
        const uint32_t x = rows.Pair(i, i + 1, d);
        if (r0 < fill) head[r0 * kHeadDim + d] = static_cast<uint16_t>(x);
        if (r1 < fill) head[r1 * kHeadDim + d] = static_cast<uint16_t>(x >> 16);
      }
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

template <class Tensors>
int Launch(const ZfAttnShape& s, const ZfPlan& plan, const float* q, const typename Tensors::Source& k_src,
           const typename Tensors::Source& v_src,
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
  const size_t smem = SharedFloats(g, plan.blocks_per_split) * sizeof(float);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  using keel::cuda::LaunchKernel;
  switch (g) {
    case 1: LaunchKernel(DecodeAttentionKernel<Tensors, 1>, grid, kThreads, smem, st, a, k_src, v_src); break;
    case 2: LaunchKernel(DecodeAttentionKernel<Tensors, 2>, grid, kThreads, smem, st, a, k_src, v_src); break;
    case 4: LaunchKernel(DecodeAttentionKernel<Tensors, 4>, grid, kThreads, smem, st, a, k_src, v_src); break;
    default: LaunchKernel(DecodeAttentionKernel<Tensors, 8>, grid, kThreads, smem, st, a, k_src, v_src); break;
  }
  ZF_CUDA(cudaGetLastError());
  keel::cuda::LaunchKernelAfterPrevious(CombineSplitsKernel, dim3(static_cast<unsigned>(rows)), dim3(kHeadDim), 0, st,
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
  return Launch<Bf16Tensors>(s, plan, q, {k, cap}, {v, cap}, out, workspace, workspace_bytes, nullptr, stream);
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
  return Launch<ZfTensors>(s, plan, q, {k_blocks, k_offsets, cap}, {v_blocks, v_offsets, cap}, out, workspace,
                        workspace_bytes, error_flag, stream);
}

int zf_decode_blocks(const ZfAttnShape& s, const uint8_t* blocks, const uint64_t* offsets, uint16_t* out,
                     ZfOperand operand, int* error_flag, void* stream) {
  ZfPlan plan;
  ZfAttnShape s1 = s;
  s1.blocks_per_split = 1;  // no device query needed
  if (int rc = zf_make_plan(s1, &plan)) return rc;
  if (operand != kZfKeyOperand && operand != kZfValueOperand)
    return Fail(kZfInvalidArgument, "operand must be kZfKeyOperand or kZfValueOperand");
  const int64_t tcap = s.token_capacity > 0 ? s.token_capacity : s.n_tokens;
  const int64_t bcap = s.block_capacity > 0 ? s.block_capacity : plan.n_blocks;
  if (tcap < s.n_tokens || bcap < plan.n_blocks) return Fail(kZfInvalidArgument, "capacity below n_tokens");
  if (!Aligned(blocks, 8) || !Aligned(offsets, 8) || !Aligned(out, 16))
    return Fail(kZfInvalidArgument, "misaligned pointer");
  const dim3 grid(plan.n_blocks, s.n_kv_heads, s.batch);
  const ZfSource src{blocks, offsets, bcap};
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (operand == kZfKeyOperand)
    keel::cuda::LaunchKernel(DecodeBlocksKernel<KOperand>, grid, dim3(32), 0, st, src, s.n_kv_heads, s.n_tokens, out,
                             tcap, error_flag);
  else
    keel::cuda::LaunchKernel(DecodeBlocksKernel<VOperand>, grid, dim3(32), 0, st, src, s.n_kv_heads, s.n_tokens, out,
                             tcap, error_flag);
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

// ------------------------------------------------------------------------------------------------
// C API (zipfusion_attention_c.h): the same functions with C types.

namespace {
namespace gpu = keel::kv::zipfusion::gpu;
static_assert(int{KEEL_ZF_OK} == int{gpu::kZfOk} && int{KEEL_ZF_INVALID_ARGUMENT} == int{gpu::kZfInvalidArgument} &&
              int{KEEL_ZF_UNSUPPORTED} == int{gpu::kZfUnsupported} && int{KEEL_ZF_CUDA_ERROR} == int{gpu::kZfCudaError} &&
              int{KEEL_ZF_CORRUPT_BLOCK} == int{gpu::kZfCorruptBlock});

int ToShape(const keel_zf_shape* c, gpu::ZfAttnShape* s) {
  if (c == nullptr) return gpu::Fail(gpu::kZfInvalidArgument, "shape is NULL");
  s->batch = c->batch;
  s->n_q_heads = c->n_q_heads;
  s->n_kv_heads = c->n_kv_heads;
  s->head_dim = c->head_dim;
  s->n_tokens = c->n_tokens;
  s->token_capacity = c->token_capacity;
  s->block_capacity = c->block_capacity;
  s->blocks_per_split = c->blocks_per_split;
  return gpu::kZfOk;
}
}  // namespace

extern "C" {

void keel_zf_shape_init(keel_zf_shape* shape) {
  if (shape == nullptr) return;
  const gpu::ZfAttnShape d;
  shape->batch = d.batch;
  shape->n_q_heads = d.n_q_heads;
  shape->n_kv_heads = d.n_kv_heads;
  shape->head_dim = d.head_dim;
  shape->n_tokens = d.n_tokens;
  shape->token_capacity = d.token_capacity;
  shape->block_capacity = d.block_capacity;
  shape->blocks_per_split = d.blocks_per_split;
}

int keel_zf_make_plan(const keel_zf_shape* shape, keel_zf_plan* plan) {
  gpu::ZfAttnShape s;
  if (int rc = ToShape(shape, &s)) return rc;
  if (plan == nullptr) return gpu::Fail(gpu::kZfInvalidArgument, "plan is NULL");
  gpu::ZfPlan p;
  if (int rc = gpu::zf_make_plan(s, &p)) return rc;
  plan->n_blocks = p.n_blocks;
  plan->blocks_per_split = p.blocks_per_split;
  plan->n_splits = p.n_splits;
  plan->workspace_bytes = p.workspace_bytes;
  return gpu::kZfOk;
}

int keel_zf_attention_bf16(const keel_zf_shape* shape, const float* q, const uint16_t* k, const uint16_t* v,
                           float* out, void* workspace, size_t workspace_bytes, void* stream) {
  gpu::ZfAttnShape s;
  if (int rc = ToShape(shape, &s)) return rc;
  return gpu::zf_attention_bf16(s, q, k, v, out, workspace, workspace_bytes, stream);
}

int keel_zf_attention_zipfusion(const keel_zf_shape* shape, const float* q, const uint8_t* k_blocks,
                                const uint64_t* k_offsets, const uint8_t* v_blocks, const uint64_t* v_offsets,
                                float* out, void* workspace, size_t workspace_bytes, int* error_flag,
                                void* stream) {
  gpu::ZfAttnShape s;
  if (int rc = ToShape(shape, &s)) return rc;
  return gpu::zf_attention_zipfusion(s, q, k_blocks, k_offsets, v_blocks, v_offsets, out, workspace, workspace_bytes,
                                     error_flag, stream);
}

int keel_zf_validate_block(const uint8_t* data, size_t size, int n) { return gpu::zf_validate_block(data, size, n); }
size_t keel_zf_packed_bytes(const size_t* sizes, size_t count) { return gpu::zf_packed_bytes(sizes, count); }
void keel_zf_pack_blocks(const uint8_t* const* blocks, const size_t* sizes, size_t count, uint8_t* out,
                         uint64_t* offsets) {
  gpu::zf_pack_blocks(blocks, sizes, count, out, offsets);
}
int keel_zf_upload_blocks(const uint8_t* const* blocks, const size_t* sizes, const int* n, size_t count,
                          uint8_t** d_buf, uint64_t** d_offsets) {
  return gpu::zf_upload_blocks(blocks, sizes, n, count, d_buf, d_offsets);
}
int keel_zf_malloc(void** ptr, size_t bytes) { return gpu::zf_malloc(ptr, bytes); }
int keel_zf_free(void* ptr) { return gpu::zf_free(ptr); }
int keel_zf_copy_to_device(void* dst, const void* src, size_t bytes) { return gpu::zf_copy_to_device(dst, src, bytes); }
int keel_zf_copy_to_host(void* dst, const void* src, size_t bytes) { return gpu::zf_copy_to_host(dst, src, bytes); }
int keel_zf_synchronize(void) { return gpu::zf_synchronize(); }
const char* keel_zf_last_error(void) { return gpu::zf_last_error(); }
const char* keel_zf_status_name(int status) { return gpu::zf_status_name(status); }

}  // extern "C"
