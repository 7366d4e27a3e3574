/* Compiled as C: the C API header is valid C, and a C caller can run attention through it
 * alone. keel_zf_c_api_run() is called by zipfusion_cuda_test.cc, which compares its output with
 * the C++ API's. */
#include <string.h>

#include "keel/kv/zipfusion/cuda/zipfusion_attention_c.h"

/* bf16 attention over one sequence, 8 KV heads x 4 query heads each, `tokens` tokens of K and V
 * given by the caller (host memory); writes 32 x 128 outputs. Returns a KEEL_ZF_* status, with
 * `stage` saying which call failed. */
int keel_zf_c_api_run(const float* q, const uint16_t* k, const uint16_t* v, int tokens, float* out,
                      const char** stage) {
  keel_zf_shape s;
  keel_zf_plan plan;
  void *dq = NULL, *dk = NULL, *dv = NULL, *dout = NULL, *ws = NULL;
  const size_t kv_bytes = (size_t)8 * tokens * 128 * sizeof(uint16_t);
  int rc;
  keel_zf_shape_init(&s);
  s.n_tokens = tokens;
  *stage = "make_plan";
  if ((rc = keel_zf_make_plan(&s, &plan)) != KEEL_ZF_OK) return rc;
  *stage = "malloc";
  if ((rc = keel_zf_malloc(&dq, 32 * 128 * sizeof(float))) != KEEL_ZF_OK ||
      (rc = keel_zf_malloc(&dk, kv_bytes)) != KEEL_ZF_OK || (rc = keel_zf_malloc(&dv, kv_bytes)) != KEEL_ZF_OK ||
      (rc = keel_zf_malloc(&dout, 32 * 128 * sizeof(float))) != KEEL_ZF_OK ||
      (rc = keel_zf_malloc(&ws, plan.workspace_bytes)) != KEEL_ZF_OK)
    goto done;
  *stage = "copy";
  if ((rc = keel_zf_copy_to_device(dq, q, 32 * 128 * sizeof(float))) != KEEL_ZF_OK ||
      (rc = keel_zf_copy_to_device(dk, k, kv_bytes)) != KEEL_ZF_OK ||
      (rc = keel_zf_copy_to_device(dv, v, kv_bytes)) != KEEL_ZF_OK)
    goto done;
  *stage = "attention";
  if ((rc = keel_zf_attention_bf16(&s, (const float*)dq, (const uint16_t*)dk, (const uint16_t*)dv, (float*)dout, ws,
                                   plan.workspace_bytes, NULL)) != KEEL_ZF_OK)
    goto done;
  *stage = "synchronize";
  if ((rc = keel_zf_synchronize()) != KEEL_ZF_OK) goto done;
  *stage = "copy back";
  rc = keel_zf_copy_to_host(out, dout, 32 * 128 * sizeof(float));
done:
  keel_zf_free(dq);
  keel_zf_free(dk);
  keel_zf_free(dv);
  keel_zf_free(dout);
  keel_zf_free(ws);
  return rc;
}

/* Argument errors through the C API: a status, a name and a message. */
int keel_zf_c_api_bad_head_dim(const char** name, const char** message) {
  keel_zf_shape s;
  keel_zf_plan plan;
  int rc;
  keel_zf_shape_init(&s);
  s.n_tokens = 16;
  s.head_dim = 64;
  rc = keel_zf_make_plan(&s, &plan);
  *name = keel_zf_status_name(rc);
  *message = keel_zf_last_error();
  return rc;
}
