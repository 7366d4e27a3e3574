/* C API of the ZipFusion CUDA decode attention: what an engine with a GPU calls, from C or
 * through a foreign-function interface. The same functions as the C++ header
 * zipfusion_attention.h (which documents the problem, layouts and block format), with C types:
 * plain structs, int status codes, no default arguments. Built into keel_zipfusion_cuda.
 *
 * Decode step of an engine, per layer:
 *
 *   keel_zf_shape s;
 *   keel_zf_shape_init(&s);                      // defaults: 32 query heads over 8, head_dim 128
 *   s.batch = n_seqs; s.n_tokens = context;      // same context for every sequence
 *   keel_zf_plan plan;
 *   if (keel_zf_make_plan(&s, &plan) != KEEL_ZF_OK) fail(keel_zf_last_error());
 *   // workspace: plan.workspace_bytes of device memory, reusable across calls and layers
 *   rc = keel_zf_attention_zipfusion(&s, q, k_blocks, k_offsets, v_blocks, v_offsets, out,
 *                                    workspace, plan.workspace_bytes, error_flag, stream);
 *
 * Blocks must have passed keel_zf_validate_block (or Keel's ParseBlock) before they reach the
 * device; keel_zf_upload_blocks validates, packs and uploads in one call. Calls are asynchronous
 * on `stream` (a cudaStream_t; NULL = the default stream). Every call returns a KEEL_ZF_* status;
 * keel_zf_last_error() has the message of the last failure on the calling thread. */
#ifndef KEEL_KV_ZIPFUSION_CUDA_ZIPFUSION_ATTENTION_C_H_
#define KEEL_KV_ZIPFUSION_CUDA_ZIPFUSION_ATTENTION_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  KEEL_ZF_OK = 0,
  KEEL_ZF_INVALID_ARGUMENT = 1, /* bad shape, pointer alignment, workspace too small */
  KEEL_ZF_UNSUPPORTED = 2,      /* head_dim != 128, GQA group not 1, 2, 4 or 8, fp16 block */
  KEEL_ZF_CUDA_ERROR = 3,       /* a CUDA runtime call failed (no device, launch failure, ...) */
  KEEL_ZF_CORRUPT_BLOCK = 4     /* a block failed host-side validation */
};

typedef struct keel_zf_shape {
  int batch;
  int n_q_heads;
  int n_kv_heads;
  int head_dim;             /* only 128 */
  int n_tokens;             /* context length, the same for every sequence, >= 1 */
  int64_t token_capacity;   /* bf16: tokens allocated per (seq, kv head); 0 = n_tokens */
  int64_t block_capacity;   /* ZipFusion: offset-table entries per (seq, kv head); 0 = ceil(n_tokens/16) */
  int blocks_per_split;     /* context split size in 16-token blocks (1..64); 0 = automatic */
} keel_zf_shape;

typedef struct keel_zf_plan {
  int n_blocks;
  int blocks_per_split;
  int n_splits;
  size_t workspace_bytes;
} keel_zf_plan;

/* batch 1, 32 query heads, 8 KV heads, head_dim 128, n_tokens 0 (set it), automatic split. */
void keel_zf_shape_init(keel_zf_shape* shape);
int keel_zf_make_plan(const keel_zf_shape* shape, keel_zf_plan* plan);

int keel_zf_attention_bf16(const keel_zf_shape* shape, const float* q, const uint16_t* k, const uint16_t* v,
                           float* out, void* workspace, size_t workspace_bytes, void* stream);
int keel_zf_attention_zipfusion(const keel_zf_shape* shape, const float* q, const uint8_t* k_blocks,
                                const uint64_t* k_offsets, const uint8_t* v_blocks, const uint64_t* v_offsets,
                                float* out, void* workspace, size_t workspace_bytes, int* error_flag,
                                void* stream);

int keel_zf_validate_block(const uint8_t* data, size_t size, int n);
size_t keel_zf_packed_bytes(const size_t* sizes, size_t count);
void keel_zf_pack_blocks(const uint8_t* const* blocks, const size_t* sizes, size_t count, uint8_t* out,
                         uint64_t* offsets);
int keel_zf_upload_blocks(const uint8_t* const* blocks, const size_t* sizes, const int* n, size_t count,
                          uint8_t** d_buf, uint64_t** d_offsets);

int keel_zf_malloc(void** ptr, size_t bytes);
int keel_zf_free(void* ptr);
int keel_zf_copy_to_device(void* dst, const void* src, size_t bytes);
int keel_zf_copy_to_host(void* dst, const void* src, size_t bytes);
int keel_zf_synchronize(void);

const char* keel_zf_last_error(void);
const char* keel_zf_status_name(int status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KEEL_KV_ZIPFUSION_CUDA_ZIPFUSION_ATTENTION_C_H_ */
