// RawCodec's check of stored blocks (validate_stored): fetched from a KV store with a valid
// checksum, a block of NaN or Inf must still be refused before attention reads it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/kv/codec.h"

namespace keel::kv {
namespace {

TEST(RawCodec, StoredBlocksWithNonFiniteElementsAreCorruption) {
  const KvShape s{2, 4, 2, 8, 4};
  for (const char* spec : {"raw:f32", "raw:bf16", "raw:f16"}) {
    SCOPED_TRACE(spec);
    auto codec = MakeCodec(spec, s);
    ASSERT_TRUE(codec.ok()) << codec.status().ToString();
    const size_t bytes = (*codec)->block_bytes(1);
    std::vector<uint8_t> block(bytes, 0);
    const float k[16] = {0.5f, -1.25f, 3.0f, 0.0f, 1.0f, 2.0f, -3.0f, 4.0f, 0.5f, -1.25f, 3.0f, 0.0f, 1.0f, 2.0f, -3.0f, 4.0f};
    for (int slot = 0; slot < s.block_tokens; ++slot) (*codec)->append(1, block.data(), slot, k, k);
    auto good = (*codec)->validate_stored(1, block.data(), block.size());
    ASSERT_TRUE(good.ok()) << good.status().ToString();
    EXPECT_EQ(*good, bytes);
    EXPECT_FALSE((*codec)->validate_stored(1, block.data(), bytes - 1).ok());  // short
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<uint8_t> b = block;
      float row[16];
      std::fill(row, row + 16, 1.0f);
      row[5] = bad;
      (*codec)->append(1, b.data(), s.block_tokens - 1, row, k);
      auto r = (*codec)->validate_stored(1, b.data(), b.size());
      ASSERT_FALSE(r.ok()) << bad;
      EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
      EXPECT_NE(r.status().message().find("not finite"), std::string::npos) << r.status().message();
    }
    // All bits set: NaN in every dtype (the pattern of a wiped or hostile value).
    std::vector<uint8_t> ones(bytes, 0xFF);
    EXPECT_FALSE((*codec)->validate_stored(0, ones.data(), ones.size()).ok());
  }
}

}  // namespace
}  // namespace keel::kv
