#include "keel/core/json_reader.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <new>
#include <string>

// Counts bytes that operator new hands out on the counting thread (others are not counted), so
// a test can show what a parse allocates in total -- an upper bound on its peak.
namespace {
thread_local bool t_counting = false;
thread_local size_t t_allocated = 0;
}  // namespace

// Replacing the global allocation functions with malloc/free is valid; GCC cannot see that the
// matching pairs are ours and warns.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(size_t n) {
  if (t_counting) t_allocated += n;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return ::operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace keel {
namespace {

using nlohmann::json;

// Bytes allocated while fn runs on this thread.
template <typename Fn>
size_t AllocatedBy(Fn&& fn) {
  t_allocated = 0;
  t_counting = true;
  fn();
  t_counting = false;
  return t_allocated;
}

bool Contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

JsonLimits Depth(int d) {
  JsonLimits l;
  l.max_depth = d;
  return l;
}

JsonLimits Values(size_t n) {
  JsonLimits l;
  l.max_values = n;
  return l;
}

TEST(JsonReader, CountingAllocatorSeesWhatPlainNlohmannCosts) {
  // The measurement below can fail: plain nlohmann spends ~50 bytes per `[` before it gives up.
  const std::string bomb(size_t{1} << 20, '[');
  const size_t plain = AllocatedBy([&] { (void)json::parse(bomb, nullptr, /*allow_exceptions=*/false); });
  EXPECT_GT(plain, size_t{16} << 20);
}

TEST(JsonReader, DepthBombOf8MiBIsRejectedWithoutAllocating) {
  const std::string bomb(size_t{8} << 20, '[');
  JsonReadError kind = JsonReadError::kNone;
  Result<json> r = Status::Internal("unset");
  const size_t bytes = AllocatedBy([&] { r = ParseUntrustedJson(bomb, JsonLimits{}, &kind); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "JSON nested deeper than 64 (byte 64)");
  EXPECT_EQ(kind, JsonReadError::kTooDeep);
  EXPECT_LT(bytes, size_t{64} << 10);  // the message, not the tree
}

TEST(JsonReader, FlatArrayOfTinyValuesIsBoundedByValueCount) {
  // 4M empty objects: 12 MiB of text that plain nlohmann turns into ~320 MiB.
  std::string flat = "[";
  for (int i = 0; i < (4 << 20); ++i) flat += "{},";
  flat += "{}]";
  JsonReadError kind = JsonReadError::kNone;
  Result<json> r = Status::Internal("unset");
  const size_t bytes = AllocatedBy([&] { r = ParseUntrustedJson(flat, JsonLimits{}, &kind); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kTooManyValues);
  // Value 1048577 is the 1048576th `{}`, which starts at byte 1 + 3 * 1048575.
  EXPECT_EQ(r.status().message(), "JSON has more than 1048576 values (byte 3145726)");
  EXPECT_LT(bytes, size_t{64} << 10);
}

TEST(JsonReader, DeepObjectsAreCountedLikeArrays) {
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "{\"a\":";
  deep += "1";
  deep += std::string(100, '}');
  auto r = ParseUntrustedJson(deep, Depth(99));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "nested deeper than 99")) << r.status().message();
  r = ParseUntrustedJson(deep, Depth(100));
  ASSERT_TRUE(r.ok()) << r.status().message();
  const json* node = &*r;
  for (int i = 0; i < 100; ++i) node = &(*node)["a"];
  EXPECT_EQ(*node, 1);
}

TEST(JsonReader, DepthCountsOnlyStructuralBrackets) {
  EXPECT_EQ(CheckJsonLimits("{\"a\":[1,[2]]}", Depth(3)), JsonReadError::kNone);
  size_t at = 0;
  EXPECT_EQ(CheckJsonLimits("{\"a\":[1,[2]]}", Depth(2), &at), JsonReadError::kTooDeep);
  EXPECT_EQ(at, 8u);
  EXPECT_EQ(CheckJsonLimits(std::string(33, '['), Depth(32)), JsonReadError::kTooDeep);
  EXPECT_EQ(CheckJsonLimits(std::string(32, '['), Depth(32)), JsonReadError::kNone);
  // Siblings do not accumulate: depth goes back down on close.
  EXPECT_TRUE(ParseUntrustedJson("[[1],[2],[3],[4]]", Depth(2)).ok());
}

TEST(JsonReader, BracketsInsideStringsDoNotCount) {
  auto r = ParseUntrustedJson(R"({"a":"[[[[{{{{","b":"]]]]}}"})", Depth(1));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)["a"], "[[[[{{{{");
  EXPECT_EQ(CheckJsonLimits(R"({"a":"[[,,,,1 2 3"})", Values(3)), JsonReadError::kNone);
}

TEST(JsonReader, EscapedQuotesAndBackslashesKeepTheStringOpenOrClosedCorrectly) {
  // \" does not end the string, so the brackets after it are text.
  auto r = ParseUntrustedJson(R"({"a":"\"[[[["})", Depth(1));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)["a"], "\"[[[[");
  // \\ is a whole escape: the quote after it ends the string, so the brackets after DO count.
  const std::string text = R"({"a":"\\","b":[[1]]})";
  EXPECT_FALSE(ParseUntrustedJson(text, Depth(2)).ok());
  r = ParseUntrustedJson(text, Depth(3));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ((*r)["a"], "\\");
  EXPECT_EQ((*r)["b"][0][0], 1);
}

TEST(JsonReader, ValueCountIncludesKeysContainersAndScalarsOnce) {
  // [1,2,3]: the array and three numbers.
  EXPECT_TRUE(ParseUntrustedJson("[1,2,3]", Values(4)).ok());
  size_t at = 0;
  EXPECT_EQ(CheckJsonLimits("[1,2,3]", Values(3), &at), JsonReadError::kTooManyValues);
  EXPECT_EQ(at, 5u);
  // The object, keys a and b, 1, the array, true, null: 7. Multi-byte numbers count once.
  const std::string text = R"({"a": -1.5e+10, "b": [true, null]})";
  EXPECT_TRUE(ParseUntrustedJson(text, Values(7)).ok());
  auto r = ParseUntrustedJson(text, Values(6));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "more than 6 values")) << r.status().message();
}

TEST(JsonReader, ValidJsonPassesUnchanged) {
  const std::string text =
      R"({"model":"m","messages":[{"role":"user","content":"h\u00e9llo \"q\" \\ [x]"}],)"
      R"("n":[0,-1,2.5e-3,18446744073709551615],"t":true,"f":false,"z":null,"o":{}})";
  auto r = ParseUntrustedJson(text, JsonLimits{});
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, json::parse(text));
  EXPECT_TRUE(ParseUntrustedJson("[1]", JsonLimits{}).ok());  // any top level unless asked
  EXPECT_EQ(*ParseUntrustedJson(" 7 ", JsonLimits{}), 7);
}

// nlohmann's lexer reads a NUL as the end of input: "{}\0garbage" parsed as {}.
TEST(JsonReader, ANulByteAnywhereIsMalformedNotTheEnd) {
  for (const std::string text : {std::string("{}\0garbage", 10), std::string("{\"a\":1}\0", 8),
                                 std::string("{\"a\":\"x\0y\"}", 11)}) {
    JsonReadError kind = JsonReadError::kNone;
    auto r = ParseUntrustedJson(text, JsonLimits{}, &kind);
    ASSERT_FALSE(r.ok()) << text.size();
    EXPECT_EQ(kind, JsonReadError::kMalformed);
    EXPECT_NE(r.status().message().find("NUL"), std::string::npos) << r.status().message();
  }
}

// Files operators write refuse a key named twice in one object (a typo's second copy silently
// won); the same key in different objects is fine, and wire formats keep last-one-wins.
TEST(JsonReader, DuplicateKeysAreRefusedWhereAsked) {
  const std::string dup = R"({"a":{"x":1,"y":2},"b":[{"x":1},{"x":2}],"a":3})";
  JsonLimits strict;
  strict.reject_duplicate_keys = true;
  JsonReadError kind = JsonReadError::kNone;
  auto r = ParseUntrustedJson(dup, strict, &kind);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kMalformed);
  EXPECT_NE(r.status().message().find("\"a\" twice"), std::string::npos) << r.status().message();
  auto nested = ParseUntrustedOrderedJson(R"({"s":{"nprobe":64,"nprobe":1}})", strict);
  ASSERT_FALSE(nested.ok());
  EXPECT_NE(nested.status().message().find("nprobe"), std::string::npos) << nested.status().message();
  EXPECT_TRUE(ParseUntrustedJson(R"({"a":{"x":1},"b":{"x":1},"c":[{"x":1},{"x":2}]})", strict).ok());
  auto lenient = ParseUntrustedJson(dup, JsonLimits{});
  ASSERT_TRUE(lenient.ok());
  EXPECT_EQ((*lenient)["a"], 3);
}

TEST(JsonReader, OrderedJsonKeepsKeyOrderUnderTheSameLimits) {
  auto r = ParseUntrustedOrderedJson(R"({"z":1,"a":2})", JsonLimits{});
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->begin().key(), "z");
  EXPECT_FALSE(ParseUntrustedOrderedJson(std::string(1000, '['), JsonLimits{}).ok());
}

TEST(JsonReader, MalformedAndNonObjectTextSaySoWithoutThrowing) {
  JsonLimits object;
  object.require_object = true;
  JsonReadError kind = JsonReadError::kNone;
  auto r = ParseUntrustedJson("", object, &kind);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kMalformed);
  EXPECT_TRUE(Contains(r.status().message(), "malformed JSON at byte 0")) << r.status().message();
  r = ParseUntrustedJson(R"({"a":1,})", object, &kind);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kMalformed);
  EXPECT_TRUE(Contains(r.status().message(), "malformed JSON at byte 7: ")) << r.status().message();
  EXPECT_FALSE(Contains(r.status().message(), "json.exception")) << r.status().message();
  r = ParseUntrustedJson("[1e999]", object, &kind);  // overflows a double: nlohmann throws out_of_range
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kNumberOutOfRange);
  EXPECT_EQ(r.status().message(), "JSON number out of range: it overflows a double");
  const std::string digits = "{\"max_tokens\":" + std::string(5000, '9') + "}";  // valid JSON, not echoed back
  r = ParseUntrustedJson(digits, object, &kind);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kNumberOutOfRange);
  EXPECT_FALSE(Contains(r.status().message(), "99999")) << r.status().message();
  r = ParseUntrustedJson("[1]", object, &kind);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kNotObject);
  EXPECT_EQ(r.status().message(), "expected a JSON object");
  r = ParseUntrustedJson("{}", object, &kind);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(kind, JsonReadError::kNone);
}

}  // namespace
}  // namespace keel
