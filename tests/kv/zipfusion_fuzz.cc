// libFuzzer target for the ZipFusion block format (built by CMake with clang when available;
// see the "Fuzzing" block in CMakeLists.txt).
//
// Two properties per input:
//   1. The input as a block: ParseBlock either rejects it or returns a view that DecodeBlock and
//      the fused DecodeChunkF32 decode without reading outside the input (ASan checks), and the
//      two decoders agree.
//   2. The input as data: its bytes read as 16-bit values encode (bf16 and fp16) into a block
//      that parses and decodes back to the same values.
// Any violation calls abort(). Longer runs by hand:
//   build/zipfusion_fuzz -max_total_time=600 -jobs=2 /tmp/zfcorpus tests/kv/zipfusion_corpus
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "keel/kv/zipfusion/format.h"

namespace zf = keel::kv::zipfusion;

namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

uint32_t Widen(uint16_t v, zf::Dtype t) {
  if (t == zf::Dtype::kBf16) return static_cast<uint32_t>(v) << 16;
  return Bits(_cvtsh_ss(v));
}

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "zipfusion_fuzz: %s\n", what);
    std::abort();
  }
}

// Decodes a parsed block both ways; aborts if the fused decoder disagrees with the reference.
void DecodeBoth(const zf::BlockView& b, std::vector<uint16_t>& out) {
  out.assign(static_cast<size_t>(b.n), 0);
  zf::DecodeBlock(b, out.data());
  zf::ExceptionCursor cur;
  for (int s = 0; s < b.n; s += 8) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, zf::DecodeChunkF32(b, s, cur));
    for (int j = 0; j < 8; ++j) Check(Bits(lanes[j]) == Widen(out[s + j], b.dtype), "fused != reference");
  }
}

void RoundTrip(const std::vector<uint16_t>& v, zf::Dtype t) {
  const int n = static_cast<int>(v.size());
  // Exactly the size the encoder will need, so ASan sees any write past it.
  const zf::WidthChoice c = zf::ChooseWidth(v.data(), n, t);
  Check(c.bytes <= zf::MaxEncodedBytes(n, t), "encoded size above bound");
  std::vector<uint8_t> enc(c.bytes);
  auto size = zf::EncodeBlock(v.data(), n, t, enc.data(), enc.size());
  Check(size.ok() && *size == c.bytes, "encode failed or size differs from ChooseWidth");
  auto b = zf::ParseBlock(enc.data(), enc.size());
  Check(b.ok(), "encoder output does not parse");
  std::vector<uint16_t> out;
  DecodeBoth(*b, out);
  Check(out == v, "round trip changed values");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Exact-size copy: libFuzzer's buffer is already exact, but this keeps the property explicit.
  std::vector<uint8_t> block(data, data + size);
  auto b = zf::ParseBlock(block.data(), block.size());
  if (b.ok()) {
    Check(b->bytes <= size, "view larger than input");
    std::vector<uint16_t> out;
    DecodeBoth(*b, out);
  } else {
    Check(b.status().code() == keel::StatusCode::kCorruption, "non-Corruption parse error");
  }

  size_t n = size / 2;
  if (n > static_cast<size_t>(zf::kMaxElements)) n = zf::kMaxElements;
  n -= n % 8;
  if (n > 0) {
    std::vector<uint16_t> v(n);
    std::memcpy(v.data(), data, 2 * n);
    RoundTrip(v, zf::Dtype::kBf16);
    RoundTrip(v, zf::Dtype::kFp16);
  }
  return 0;
}
