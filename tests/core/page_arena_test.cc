#include "keel/core/page_arena.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace keel {
namespace {

TEST(PageArena, MapsAlignedWritableMemory) {
  auto a = PageArena::Map(5 << 20);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->size(), size_t{5} << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % (2 << 20), 0u);  // huge-page aligned
  std::memset(a->data(), 0xAB, a->size());
  EXPECT_EQ(a->data()[0], 0xAB);
  EXPECT_EQ(a->data()[a->size() - 1], 0xAB);
}

TEST(PageArena, UntouchedPagesReadAsZero) {
  auto a = PageArena::Map(3 << 20);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->data()[12345], 0);
}

TEST(PageArena, MovesOwnership) {
  auto a = PageArena::Map(1 << 20);
  ASSERT_TRUE(a.ok());
  uint8_t* p = a->data();
  PageArena b = std::move(a).value();
  EXPECT_EQ(b.data(), p);
  PageArena c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.size(), 0u);
  c.data()[0] = 1;
}

TEST(PageArena, EmptyAndImpossibleSizes) {
  auto empty = PageArena::Map(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->data(), nullptr);
  auto huge = PageArena::Map(size_t{1} << 62);  // far past any address space
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(huge.status().message().find(std::to_string(size_t{1} << 62)), std::string::npos);
}

}  // namespace
}  // namespace keel
