// The OpenAI upstream request bodies are written directly (keel/gateway/vendors/openai/
// translate_openai.cc); they must be byte for byte what the DOM builders they replaced wrote
// (tests/gateway/openai_dom_reference.h), on generated requests of every shape the builders
// handle: both client formats, system prompts, tool calls and results, tools with schemas (valid,
// unordered, invalid, empty), tool choices, response formats, every sampling field with awkward
// numbers (-0.0, 1e-07, 1e300, NaN, infinity), stop lists, streaming, hostile strings.
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "keel/gateway/vendors/openai/openai.h"
#include "tests/gateway/openai_dom_reference.h"

namespace keel::gateway {
namespace {

class RequestGen {
 public:
  explicit RequestGen(uint32_t seed) : rng_(seed) {}

  size_t Pick(size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }

  std::string Str() {
    static const std::vector<std::string> kPieces = {
        "hello", " ", "\"", "\\", "/", "\n", "\t", "\r", "\b", "\f", std::string("\x00", 1), "\x01", "\x1f", "\x7f",
        "é", "世界", "🙂", "\xff", "\xc3", "\xe4\xb8", "\xed\xa0\x80", "</script>", "\u2028", "{}", "{\"a\":1}"};
    std::string s;
    const size_t n = Pick(6);
    for (size_t i = 0; i < n; ++i) s += kPieces[Pick(kPieces.size())];
    return s;
  }

  std::optional<double> Double() {
    static const std::vector<double> kValues = {0.0, -0.0, 0.7, 1.0, 2.0, -2.0, 0.1, 1e-7, 1.2345678901234567, 1e300,
                                                -1.5e-300, 123456789.0, std::nan(""),
                                                std::numeric_limits<double>::infinity()};
    if (Pick(2)) return std::nullopt;
    return Pick(4) ? kValues[Pick(kValues.size())] : std::uniform_real_distribution<double>(-3, 3)(rng_);
  }
  std::optional<int64_t> Int() {
    static const std::vector<int64_t> kValues = {0, 1, 7, -1, 4096, std::numeric_limits<int64_t>::max(),
                                                 std::numeric_limits<int64_t>::min()};
    if (Pick(2)) return std::nullopt;
    return kValues[Pick(kValues.size())];
  }
  std::string ObjectText() {
    static const std::vector<std::string> kTexts = {
        "", "{}", R"({"type":"object","properties":{"b":{"type":"string"},"a":{"type":"integer"}},"required":["b"]})",
        R"({ "z" : 1, "a" : [1.50, -0, 1e2, "\u00e9"] })", "not json", "[1,2]", R"({"12":5,"3":-100})"};
    return kTexts[Pick(kTexts.size())];
  }

  ChatRequest Request() {
    ChatRequest r;
    r.client_format = Pick(4) == 0 ? WireFormat::kOpenAICompletions : WireFormat::kOpenAIChat;
    r.model = Str();
    if (Pick(2)) r.system = Str();
    if (r.client_format == WireFormat::kOpenAICompletions) {
      r.prompt = Str();
      if (Pick(4) == 0) r.messages.push_back({"user", Str(), {}, "", ""});
    } else {
      const size_t n = Pick(5);
      for (size_t i = 0; i < n; ++i) {
        Message m;
        static const std::vector<std::string> kRoles = {"user", "assistant", "tool", "user"};
        m.role = kRoles[Pick(kRoles.size())];
        m.content = Pick(4) ? Str() : "";
        if (Pick(2)) {
          const size_t calls = 1 + Pick(2);
          for (size_t c = 0; c < calls; ++c) m.tool_calls.push_back({"call_" + Str(), Str(), Pick(3) ? ObjectText() : Str()});
        }
        if (m.role == "tool" || Pick(4) == 0) m.tool_call_id = Str();
        if (Pick(3) == 0) m.name = Str();
        r.messages.push_back(std::move(m));
      }
    }
    if (Pick(2)) {
      const size_t n = 1 + Pick(3);
      for (size_t i = 0; i < n; ++i) r.tools.push_back({Str(), Pick(2) ? Str() : "", ObjectText()});
    }
    static const std::vector<std::string> kChoices = {"", "auto", "none", "required", "lookup", "\"q\""};
    r.tool_choice = kChoices[Pick(kChoices.size())];
    if (Pick(2)) r.parallel_tool_calls = Pick(2) == 0;
    if (Pick(2)) {
      ResponseFormat f;
      f.kind = static_cast<ResponseFormat::Kind>(Pick(3));
      f.name = Pick(2) ? Str() : "";
      f.schema_json = ObjectText();
      f.strict = Pick(2);
      r.response_format = f;
    }
    r.max_tokens = Int();
    r.temperature = Double();
    r.top_p = Double();
    r.seed = Int();
    r.top_k = Int();
    r.presence_penalty = Double();
    r.frequency_penalty = Double();
    if (Pick(3) == 0) r.logit_bias_json = ObjectText();
    const size_t stops = Pick(3);
    for (size_t i = 0; i < stops; ++i) r.stop.push_back(Str());
    r.stream = Pick(2);
    r.stream_include_usage = Pick(2);
    if (Pick(2)) r.user = Str();
    return r;
  }

 private:
  std::mt19937 rng_;
};

std::string Show(const Result<std::string>& r) { return r.ok() ? r.value() : "error " + r.status().ToString(); }

TEST(OpenAIRequestWrite, ByteIdenticalToTheDomBuilders) {
  RequestGen gen(11);
  for (int i = 0; i < 20000; ++i) {
    const ChatRequest r = gen.Request();
    const std::string model = gen.Str();
    EXPECT_EQ(Show(BuildOpenAIChatRequest(r, model)), Show(dom_reference::BuildOpenAIChatRequest(r, model)));
    EXPECT_EQ(Show(BuildOpenAICompletionsRequest(r, model)),
              Show(dom_reference::BuildOpenAICompletionsRequest(r, model)));
    if (::testing::Test::HasFailure()) break;  // one failing request is enough to read
  }
}

TEST(OpenAIRequestWrite, CommonRequest) {
  ChatRequest r;
  r.system = "be brief";
  r.messages.push_back({"user", "say \"hi\"", {}, "", ""});
  r.temperature = 0.7;
  r.max_tokens = 64;
  r.stream = true;
  const Result<std::string> body = BuildOpenAIChatRequest(r, "gpt-4o-mini");
  ASSERT_TRUE(body.ok());
  EXPECT_EQ(body.value(),
            R"({"max_completion_tokens":64,"messages":[{"content":"be brief","role":"system"},)"
            R"({"content":"say \"hi\"","role":"user"}],"model":"gpt-4o-mini","stream":true,)"
            R"("stream_options":{"include_usage":true},"temperature":0.7})");
  EXPECT_EQ(body.value(), Show(dom_reference::BuildOpenAIChatRequest(r, "gpt-4o-mini")));
  // No messages at all (not a completions request): an empty array, as the DOM wrote it.
  ChatRequest empty;
  EXPECT_EQ(Show(BuildOpenAIChatRequest(empty, "m")), Show(dom_reference::BuildOpenAIChatRequest(empty, "m")));
  empty.system = "s";
  EXPECT_EQ(Show(BuildOpenAIChatRequest(empty, "m")), Show(dom_reference::BuildOpenAIChatRequest(empty, "m")));
}

}  // namespace
}  // namespace keel::gateway
