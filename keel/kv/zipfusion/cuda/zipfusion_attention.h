// CUDA decode attention over ZipFusion blocks, and the uncompressed bf16 kernel of the same
// design that is its baseline. Plain C++ declarations (no CUDA types), so CPU code can call it;
// the implementation is zipfusion_attention.cu (library keel_zipfusion_cuda, built when nvcc is
// found, CMake option KEEL_CUDA).
//
// Problem: one query token per sequence (decode), GQA with n_q_heads = group * n_kv_heads
// (query head h reads K/V head h / group), head_dim 128, fp32 accumulation,
// out = softmax(q k^T / sqrt(head_dim)) v.
//
// Layouts (all device pointers):
//   q, out      float [batch][n_q_heads][128]
//   bf16 K, V   uint16 (bf16 bits) [batch][n_kv_heads][token_capacity][128]: tokens contiguous
//               per head; only the first n_tokens of each head are read.
//   ZipFusion   K and V each: one device byte buffer of ZipFusion blocks in the format of
//               keel/kv/zipfusion/format.h (bf16 only), each block = 16 tokens x 128 of one
//               (sequence, KV head), token-major, the last block of a head holding
//               n_tokens - 16*(n_blocks-1) tokens (n = 128 * that); plus an offset table
//               uint64 [batch][n_kv_heads][block_capacity], the byte offset of each block in the
//               buffer. Offsets must be multiples of 8 (zf_pack_blocks does this). K and V may
//               share one buffer. Blocks must have passed validation (ParseBlock or
//               zf_validate_block) before upload: the kernel checks each header (magic, dtype,
//               width, base, n, exception count) and raises *error_flag on a bad one, but does
//               not bounds-check exception positions against the buffer.
//
// Both kernels share one template and differ only in how a 16-token block of K or V becomes
// bf16 tensor-core operands, so their outputs are bit-identical for the same shape and split plan.
// Numerics: the products run on tensor cores (mma.sync, bf16 inputs, fp32 accumulation; sm_80 or
// newer); the fp32 queries enter as three bf16 parts (~24 bits, as fp32) and the probabilities as
// two (~16 bits): outputs are within ~1e-5 of sum_t p_t |v_t| of exact attention (6.6e-6 worst
// in zipfusion_gpu_bench's checks; worse only where fp32 scores themselves lose precision, with
// keys thousands of times larger than the rest).
// Entry points return a ZfStatus code; zf_last_error() has the message. Kernels are launched
// asynchronously on `stream` (a cudaStream_t, nullptr = the default stream).
#pragma once

#include <cstddef>
#include <cstdint>

namespace keel::kv::zipfusion::gpu {

enum ZfStatus : int {
  kZfOk = 0,
  kZfInvalidArgument = 1,  // bad shape, pointer alignment, workspace too small
  kZfUnsupported = 2,      // head_dim != 128, group not in {1,2,4,8}, fp16 block
  kZfCudaError = 3,        // a CUDA runtime call failed (no device, launch failure, ...)
  kZfCorruptBlock = 4,     // a block failed host-side validation
};

// Message of the last failed call on this thread ("" after a success).
const char* zf_last_error();
const char* zf_status_name(int status);

struct ZfAttnShape {
  int batch = 1;
  int n_q_heads = 32;
  int n_kv_heads = 8;
  int head_dim = 128;          // only 128 is supported
  int n_tokens = 0;            // context length, the same for every sequence, >= 1
  int64_t token_capacity = 0;  // bf16: tokens allocated per (seq, kv head); 0 = n_tokens
  int64_t block_capacity = 0;  // ZipFusion: offset-table entries per (seq, kv head); 0 = ceil(n_tokens/16)
  int blocks_per_split = 0;    // context split size in 16-token blocks (1..64); 0 = automatic
};

// How a call is split over the context (flash-decoding): n_splits work units per (seq, kv head),
// each blocks_per_split blocks long. The automatic choice depends on the shape and the current
// device's SM count only, so the bf16 and ZipFusion kernels always get the same plan.
struct ZfPlan {
  int n_blocks = 0;          // ceil(n_tokens / 16)
  int blocks_per_split = 0;
  int n_splits = 0;
  size_t workspace_bytes = 0;  // device scratch a call needs (partial outputs + softmax stats)
};
int zf_make_plan(const ZfAttnShape& shape, ZfPlan* plan);

// Decode attention over uncompressed bf16 K/V.
int zf_attention_bf16(const ZfAttnShape& shape, const float* q, const uint16_t* k, const uint16_t* v,
                      float* out, void* workspace, size_t workspace_bytes, void* stream = nullptr);

// Decode attention over ZipFusion K/V blocks. error_flag (device int, may be null) gets bit 0
// set when a block header is inconsistent; such a block is read as width 0 without exceptions.
int zf_attention_zipfusion(const ZfAttnShape& shape, const float* q, const uint8_t* k_blocks,
                           const uint64_t* k_offsets, const uint8_t* v_blocks, const uint64_t* v_offsets,
                           float* out, void* workspace, size_t workspace_bytes, int* error_flag = nullptr,
                           void* stream = nullptr);

// Test hook: decodes every block of one ZipFusion tensor with the attention kernel's own block
// loader, in the register layout it uses for K (kZfKeyOperand) or for V (kZfValueOperand), and
// writes bf16 bits in the bf16 layout above (rows of partial blocks past n_tokens are left
// untouched).
enum ZfOperand : int { kZfKeyOperand = 0, kZfValueOperand = 1 };
int zf_decode_blocks(const ZfAttnShape& shape, const uint8_t* blocks, const uint64_t* offsets,
                     uint16_t* out, ZfOperand operand, int* error_flag = nullptr, void* stream = nullptr);

// ---- Host-side helpers (no device needed unless stated).

// Validates one bf16 block of exactly `n` elements: header, section sizes within `size`,
// exception positions strictly increasing and < n, exception exponents outside [base, base+2^w).
int zf_validate_block(const uint8_t* data, size_t size, int n);

// Packs `count` blocks into one buffer, each at an 8-byte aligned offset. zf_packed_bytes gives
// the size `out` needs; offsets[i] receives block i's offset.
size_t zf_packed_bytes(const size_t* sizes, size_t count);
void zf_pack_blocks(const uint8_t* const* blocks, const size_t* sizes, size_t count, uint8_t* out,
                    uint64_t* offsets);

// Validates (with element counts n[i]), packs and uploads blocks; allocates *d_buf and
// *d_offsets on the current device (free with zf_free).
int zf_upload_blocks(const uint8_t* const* blocks, const size_t* sizes, const int* n, size_t count,
                     uint8_t** d_buf, uint64_t** d_offsets);

// Thin CUDA runtime wrappers so that CPU code needs no CUDA headers.
int zf_malloc(void** ptr, size_t bytes);
int zf_free(void* ptr);
int zf_copy_to_device(void* dst, const void* src, size_t bytes);
int zf_copy_to_host(void* dst, const void* src, size_t bytes);
int zf_memset(void* ptr, int value, size_t bytes);
int zf_synchronize();
// Name and SM count of the current device; kZfCudaError when there is none.
int zf_device_info(char* name, size_t name_capacity, int* sm_count);

}  // namespace keel::kv::zipfusion::gpu
