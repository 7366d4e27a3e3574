// AppendJsonString must write exactly what nlohmann's dump (with error_handler_t::replace) writes
// for the same string: the gateway's encoders and writers rely on it to keep client bytes unchanged.
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "keel/core/json_writer.h"

namespace keel {
namespace {

std::string Nlohmann(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string Ours(const std::string& s) {
  std::string out = "prefix:";  // appends, keeping what was there
  AppendJsonString(s, &out);
  return out.substr(7);
}

TEST(AppendJsonString, CommonTextAndEscapes) {
  for (const std::string& s : std::vector<std::string>{"", "hello", "a\"b\\c", "line\nbreak\r\ttab\b\f", std::string("nul\0x", 5),
                              "\x01\x1f\x7f", "héllo – 日本 🙂", "</script>"}) {
    EXPECT_EQ(Ours(s), Nlohmann(s)) << s;
  }
  EXPECT_EQ(Ours("\x1f"), "\"\\u001f\"");  // lowercase hex, as nlohmann writes
}

TEST(AppendJsonString, EveryOneAndTwoByteString) {
  for (int a = 0; a < 256; ++a) {
    const std::string one(1, static_cast<char>(a));
    ASSERT_EQ(Ours(one), Nlohmann(one)) << a;
    for (int b = 0; b < 256; ++b) {
      const std::string two = one + static_cast<char>(b);
      ASSERT_EQ(Ours(two), Nlohmann(two)) << a << " " << b;
    }
  }
}

// Pieces that stress the UTF-8 rules: boundaries of every lead byte's continuation range,
// surrogates, overlongs, past U+10FFFF, truncated sequences, lone continuation bytes.
TEST(AppendJsonString, RandomHostileStrings) {
  const std::vector<std::string> pieces = {
      "a", " ", "\"", "\\", "\n", "\x7f", "\x00", "\x1b", "\xc2\x80", "\xdf\xbf", "\xc0\xaf", "\xc1\xbf",
      "\xe0\xa0\x80", "\xe0\x9f\xbf", "\xed\x9f\xbf", "\xed\xa0\x80", "\xef\xbf\xbf", "\xf0\x90\x80\x80",
      "\xf0\x8f\xbf\xbf", "\xf4\x8f\xbf\xbf", "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "\xff", "\xfe",
      "\x80", "\xbf", "\xe2\x82", "\xf0\x9f\x99", "\xc3", "\xe6\x97\xa5"};
  std::mt19937 rng(22);
  for (int n = 0; n < 20000; ++n) {
    std::string s;
    const int len = static_cast<int>(rng() % 12);
    for (int k = 0; k < len; ++k) {
      if (rng() % 4 == 0) {
        s.push_back(static_cast<char>(rng() & 0xff));
      } else {
        const std::string& p = pieces[rng() % pieces.size()];
        s.append(p.empty() ? std::string(1, '\0') : p);
      }
    }
    ASSERT_EQ(Ours(s), Nlohmann(s)) << testing::PrintToString(s);
  }
}

}  // namespace
}  // namespace keel
