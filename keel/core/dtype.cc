#include "keel/core/dtype.h"

namespace keel {
namespace {

// Safetensors only aligns the data section, not each tensor: a 16-bit tensor may start at an odd
// byte offset in the map, where dereferencing a uint16_t* is undefined behaviour.
uint16_t LoadU16(const void* base, size_t i) {
  uint16_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(base) + 2 * i, 2);
  return v;
}

}  // namespace

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return "?";
}

void ConvertToF32(DType t, const void* src, float* dst, size_t n) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      size_t i = 0;
      for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
      }
      for (; i < n; ++i) dst[i] = F16ToF32(LoadU16(src, i));
      return;
    }
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      size_t i = 0;
      for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
      }
      for (; i < n; ++i) dst[i] = Bf16ToF32(LoadU16(src, i));
      return;
    }
  }
}

}  // namespace keel
