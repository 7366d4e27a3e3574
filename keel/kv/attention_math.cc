#include "keel/kv/attention_math.h"

#include <immintrin.h>

#include <cmath>

#include "keel/core/cpu.h"
#include "keel/core/vec_math.h"
#include "keel/kv/attention_math_avx512.h"

namespace keel::kv {

namespace {
bool Avx512() { return cpu::ActiveIsa() == cpu::Isa::kAvx512; }
}  // namespace

float DotF32(const float* a, const float* b, int n) {
  if (n % 16 == 0 && Avx512()) return avx512::DotF32(a, b, n);
  int i = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = ReduceLanes(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void AxpyF32(float w, const float* x, float* out, int n) {
  if (n >= 16 && Avx512()) return avx512::AxpyF32(w, x, out, n);
  int i = 0;
  __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(out + i)));
  }
  for (; i < n; ++i) out[i] += w * x[i];
}

float ExpF32(float x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, Exp8(_mm256_set1_ps(x)));
  return lanes[0];
}

void SoftmaxF32(float* x, int n) {
  if (n <= 0) return;
  if (Avx512()) return avx512::SoftmaxF32(x, n);
  // A partial last chunk goes through the same 8-lane code, so every element's bits depend only
  // on its own value, the maximum and the sum.
  const int full = n / 8 * 8;
  alignas(32) float tail[8];
  const int rest = n - full;
  for (int i = 0; i < 8; ++i) tail[i] = i < rest ? x[full + i] : x[0];
  __m256 mx = _mm256_load_ps(tail);
  for (int i = 0; i < full; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const __m256 vmax = _mm256_broadcastss_ps(m4);
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < full; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (rest > 0) {
    const __m256 keep = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 e = _mm256_and_ps(keep, Exp8(_mm256_sub_ps(_mm256_load_ps(tail), vmax)));
    _mm256_store_ps(tail, e);
    sum = _mm256_add_ps(sum, e);
    for (int i = 0; i < rest; ++i) x[full + i] = tail[i];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / ReduceLanes(sum));
  for (int i = 0; i < full; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  for (int i = full; i < n; ++i) x[i] *= _mm256_cvtss_f32(inv);
}

}  // namespace keel::kv
