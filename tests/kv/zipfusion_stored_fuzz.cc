// libFuzzer target for stored ZipFusion blocks from untrusted sources (chunks fetched from a KV
// store): Codec::validate_stored either rejects the bytes, or every byte that attention and read
// then touch lies inside the extent it returned (ASan checks: the block sits in a heap buffer of
// exactly that size).
//
// Each input builds a real block and then damages it: byte 1 says how many edits follow (0-7),
// each (u16 position, u8 xor) applied to the block's compact form; the remaining bytes are the
// block's bf16 values. So every input starts from a valid block, and the fuzzer explores the
// damage.
//   build/zipfusion_stored_fuzz -max_total_time=600 /tmp/zfs_corpus
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "keel/kv/codec.h"
#include "keel/kv/zipfusion/zipfusion_codec.h"

// Built without OpenMP: as if already inside a parallel region, so attention stays on this thread.
extern "C" int omp_get_active_level() { return 1; }

namespace {

using namespace keel::kv;

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "zipfusion_stored_fuzz: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One layer, 2 query heads over 1 KV head of 16 dims, blocks of 4 tokens: 64 values a region.
  static const KvShape shape{1, 2, 1, 16, 4};
  static const auto codec = std::move(zipfusion::MakeZipFusionCodec(shape, keel::DType::kBF16)).value();
  if (size < 2) return 0;
  const int kvd = shape.kv_dim();
  size_t at = 2;
  struct Edit {
    uint16_t pos;
    uint8_t x;
  };
  std::vector<Edit> edits;
  for (int e = 0; e < data[1] % 8 && at + 3 <= size; ++e, at += 3) {
    edits.push_back({static_cast<uint16_t>(data[at] | (data[at + 1] << 8)), data[at + 2]});
  }
  // The block, filled as the cache fills it, then compacted. Values come from the input (bf16
  // bits; inf/NaN made finite, attention must not see them), then a fixed pattern once it ends.
  auto next_value = [&, i = 0]() mutable {
    uint16_t bits = static_cast<uint16_t>(0x3F80 + 37 * i++);
    if (at + 2 <= size) {
      bits = static_cast<uint16_t>(data[at] | (data[at + 1] << 8));
      at += 2;
    }
    if ((bits & 0x7F80) == 0x7F80) bits &= 0xBFFF;
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  std::vector<uint8_t> open(codec->block_bytes(0));
  std::vector<float> k(kvd), v(kvd);
  for (int t = 0; t < shape.block_tokens; ++t) {
    for (int d = 0; d < kvd; ++d) {
      k[d] = next_value();
      v[d] = next_value();
    }
    codec->append(0, open.data(), t, k.data(), v.data());
  }
  const size_t compact = codec->compact_bytes(0, open.data());
  Check(compact > 0 && compact <= open.size(), "compact size out of range");
  std::vector<uint8_t> stored(compact);
  codec->compact(0, open.data(), stored.data());
  {
    auto ok = codec->validate_stored(0, stored.data(), stored.size());
    Check(ok.ok() && *ok == compact, "an undamaged compact block must validate to its own size");
  }
  for (const Edit& e : edits) stored[e.pos % stored.size()] ^= e.x;

  auto extent = codec->validate_stored(0, stored.data(), stored.size());
  if (!extent.ok()) return 0;
  Check(*extent <= stored.size(), "extent past the bytes given");
  // Exactly the validated bytes, in a buffer of that size: any read past it is an ASan report.
  std::vector<uint8_t> block(stored.begin(), stored.begin() + static_cast<std::ptrdiff_t>(*extent));
  const uint8_t* blocks[1] = {block.data()};
  std::vector<float> q(shape.n_heads * shape.head_dim, 0.25f), out(q.size());
  AttendScratch scratch;
  for (int n = 1; n <= shape.block_tokens; ++n) codec->attend(0, blocks, n, q.data(), out.data(), scratch);
  std::vector<float> rk(kvd), rv(kvd);
  for (int t = 0; t < shape.block_tokens; ++t) codec->read(0, block.data(), t, rk.data(), rv.data());
  return 0;
}
