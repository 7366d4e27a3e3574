// The non-streamed OpenAI answer codecs without a DOM (keel/gateway/vendors/openai/answer_openai.cc):
//  - the fast readers, against the DOM readers, on real fake-vendor answers (which they must
//    accept) and on tens of thousands of mutations of them (byte flips, truncations, inserted
//    and repeated keys, type swaps, deep nesting, huge numbers, invalid UTF-8, escapes): whatever
//    a fast reader accepts must be read exactly as the DOM reader reads it, and the public parser
//    must always answer what the DOM reader answers (result or error);
//  - the direct writers, byte for byte against the DOM builders (tests/gateway/openai_dom_reference.h).
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "keel/gateway/fake_vendor.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/openai/openai_answer.h"
#include "tests/core/http_test_client.h"
#include "tests/gateway/json_mutator.h"
#include "tests/gateway/openai_dom_reference.h"

namespace keel::gateway {
namespace {

using test::HttpTestClient;
using test::HttpTestResponse;

std::string Show(const ChatResponse& r) {
  std::string s = r.id + "|" + r.model + "|" + std::to_string(r.created) + "|" + r.content + "|" +
                  std::to_string(static_cast<int>(r.finish)) + "|" + r.stop_sequence + "|" +
                  std::to_string(r.usage.input_tokens) + "|" + std::to_string(r.usage.output_tokens);
  for (const ToolCall& c : r.tool_calls) s += "|call " + c.id + " " + c.name + " " + c.arguments_json;
  return s;
}

std::string Show(const Result<ChatResponse>& r) {
  return r.ok() ? "ok " + Show(r.value()) : "error " + r.status().ToString();
}

// Real answers from the fake OpenAI vendor: chat (plain, cut by max_tokens, by a stop sequence,
// with non-ASCII and escapes, a tool call) and completions.
std::vector<std::string> FakeAnswers(bool chat) {
  auto fv = FakeVendor::Start(FakeVendorOptions{});
  EXPECT_TRUE(fv.ok()) << fv.status().ToString();
  if (!fv.ok()) return {};
  std::vector<std::string> bodies;
  const std::vector<std::string> prompts = {"say hello", "héllo wörld 世界 🙂", "quote \\\" back\\\\slash\\n tab\\t",
                                            "a\\u0001b \\u00e9 \\ud83d\\ude00"};
  for (const std::string& prompt : prompts) {
    for (const std::string& extra : {std::string(), std::string(",\"max_tokens\":3"),
                                     std::string(",\"stop\":[\"w5\"]")}) {
      std::string body =
          chat ? "{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"user\",\"content\":\"" + prompt + "\"}]" + extra + "}"
               : "{\"model\":\"gpt-3.5-turbo-instruct\",\"prompt\":\"" + prompt + "\"" + extra + "}";
      HttpTestClient c((*fv)->port(), 20);
      EXPECT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("POST", chat ? "/v1/chat/completions" : "/v1/completions",
                                                        body, "application/json",
                                                        {{"Authorization", "Bearer sk-test"}})));
      HttpTestResponse res;
      EXPECT_TRUE(c.ReadResponse(&res));
      EXPECT_EQ(res.status, 200) << res.body;
      bodies.push_back(res.body);
    }
  }
  if (chat) {
    HttpTestClient c((*fv)->port(), 20);
    const std::string body =
        "{\"model\":\"gpt-4o-tools\",\"messages\":[{\"role\":\"user\",\"content\":\"go\"}],\"tools\":[{\"type\":"
        "\"function\",\"function\":{\"name\":\"lookup\",\"parameters\":{\"type\":\"object\"}}}]}";
    EXPECT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("POST", "/v1/chat/completions", body, "application/json",
                                                      {{"Authorization", "Bearer sk-test"}})));
    HttpTestResponse res;
    EXPECT_TRUE(c.ReadResponse(&res));
    EXPECT_NE(res.body.find("tool_calls"), std::string::npos) << res.body;
    bodies.push_back(res.body);
  }
  return bodies;
}

// Checks one text with both readers of one format; returns whether the fast reader accepted it.
bool CheckOne(const std::string& text, bool chat) {
  const Result<ChatResponse> dom = chat ? internal::ParseOpenAIChatResponseDom(text)
                                        : internal::ParseOpenAICompletionsResponseDom(text);
  ChatResponse fast;
  const bool accepted = chat ? internal::ReadOpenAIChatResponseFast(text, &fast)
                             : internal::ReadOpenAICompletionsResponseFast(text, &fast);
  if (accepted) {
    EXPECT_TRUE(dom.ok()) << "fast accepted what the DOM refuses: " << text << "\n" << Show(dom);
    if (dom.ok()) {
      EXPECT_EQ(Show(fast), Show(dom.value())) << text;
    }
  }
  const Result<ChatResponse> pub = chat ? ParseOpenAIChatResponse(text) : ParseOpenAICompletionsResponse(text);
  EXPECT_EQ(Show(pub), Show(dom)) << text;
  return accepted;
}

TEST(OpenAIAnswerRead, AcceptsEveryPlainFakeVendorAnswerAsTheDomReads) {
  for (bool chat : {true, false}) {
    const std::vector<std::string> bodies = FakeAnswers(chat);
    ASSERT_GE(bodies.size(), 12u);
    for (const std::string& b : bodies) {
      const bool tool = b.find("\"tool_calls\":[") != std::string::npos;
      EXPECT_EQ(CheckOne(b, chat), !tool) << b;  // plain answers take the fast path; tool calls decline
      ChatResponse r;
      if (!tool && (chat ? internal::ReadOpenAIChatResponseFast(b, &r) : internal::ReadOpenAICompletionsResponseFast(b, &r))) {
        EXPECT_FALSE(r.content.empty()) << b;
        EXPECT_GT(r.usage.input_tokens, 0) << b;
        EXPECT_GT(r.usage.output_tokens, 0) << b;
        EXPECT_NE(r.finish, FinishReason::kNone) << b;
      }
    }
  }
}

TEST(OpenAIAnswerRead, HandWrittenEdges) {
  struct Case {
    std::string text;
    bool accepted;
  };
  const std::vector<Case> cases = {
      {R"({"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]})", true},
      {R"({"choices":[{"message":{"content":null}}],"created":1.5,"id":7,"usage":null})", true},
      {R"({"choices":[{"message":{}},{"message":5},3]})", true},
      {R"({"choices":[{"message":{"content":"\u00e9\ud83d\ude00\u0000"}}],"usage":{"prompt_tokens":-3,"completion_tokens":2.0}})", true},
      {R"({"choices":[{"message":{"content":"a"}}],"x":1e-400,"y":-0.0,"z":[1E+2]})", true},
      {"\t{ \"choices\" : [ { \"message\" : { \"content\" : \"a\" } } ] }\r\n", true},
      {R"({"choices":[{"message":{"content":"a"}}],"error":null})", true},
      {R"({"choices":[{"message":{"content":"a"}}],"error":{"message":"x"}})", false},
      {R"({"error":{"message":"rate limited"}})", false},
      {R"({"choices":[]})", false},
      {R"({"choices":[5]})", false},
      {R"({"choices":[{"message":{"content":"a"}}],"id":"x","id":"y"})", false},
      {R"({"choices":[{"message":{"content":"a"}}],"\u0069d":"x","id":"y"})", false},
      {R"({"choices":[{"message":{"content":[{"type":"text","text":"a"}]}}]})", false},
      {R"({"choices":[{"message":{"content":5}}]})", false},
      {R"({"choices":[{"message":{"content":"a"}}],"x":1e400})", false},
      {R"({"choices":[{"message":{"content":"a"}}],"created":12345678901234567890})", false},
      {R"({"choices":[{"message":{"content":"\ud83d"}}]})", false},
      {R"({"choices":[{"message":{"content":"\udc00"}}]})", false},
      {"{\"choices\":[{\"message\":{\"content\":\"\xff\"}}]}", false},
      {"{\"choices\":[{\"message\":{\"content\":\"a\"}}]} x", false},
      {"\xEF\xBB\xBF{\"choices\":[{\"message\":{\"content\":\"a\"}}]}", false},
      {"[1]", false},
      {"", false},
  };
  for (const Case& c : cases) EXPECT_EQ(CheckOne(c.text, true), c.accepted) << c.text;
  EXPECT_TRUE(CheckOne(R"({"choices":[{"text":"hi","finish_reason":"length"}]})", false));
  EXPECT_TRUE(CheckOne(R"({"choices":[{"text":null}]})", false));
  EXPECT_FALSE(CheckOne(R"({"choices":[{"text":5}]})", false));
  std::string deep = R"({"choices":[{"message":{"content":"a"}}],"d":)" + std::string(200, '[') + std::string(200, ']') + "}";
  EXPECT_FALSE(CheckOne(deep, true));
}

const std::vector<std::string> kAnswerMembers = {
    R"("id":"dup",)", R"("id":null,)", R"("id":5,)", R"("model":["x"],)", R"("created":1.5,)",
    R"("created":-7,)", R"("created":123456789012345678901,)", R"("created":1e400,)",
    R"("choices":[{"message":{}}],)", R"("choices":[],)", R"("choices":null,)", R"("usage":{"prompt_tokens":1e2},)",
    R"("usage":{"prompt_tokens":9,"prompt_tokens":8},)", R"("usage":"x",)", R"("prompt_tokens":18446744073709551615,)",
    R"("completion_tokens":-1,)", R"("completion_tokens":2.5,)", R"("error":{"message":"boom"},)",
    R"("error":null,)", R"("error":"x",)", R"("content":[{"type":"text","text":"a"}],)", R"("content":null,)",
    R"("content":"dup",)", R"("content":7,)", R"("tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}],)",
    R"("tool_calls":null,)", R"("tool_calls":[],)", R"("text":5,)", R"("text":"t",)", R"("text":null,)",
    R"("finish_reason":7,)", R"("finish_reason":"length",)", R"("message":"str",)", R"("message":{},)",
    R"("s":"\ud83d\ude00",)", R"("s":"\ud83d",)", R"("s":"\u0000\u001f\u00e9",)", R"("\u0069d":"esc",)",
    R"("f":-0.0e-5,)", R"("f":1E308,)", R"("f":1e309,)", R"("f":0.1e-99999,)", R"("n":-,)", R"("n":01,)",
    "\"k\":\"\xff\",", "\"k\":\"\xc0\x80\",", "\"k\":\"\xed\xa0\x80\",", "\"k\":\"\xf4\x90\x80\x80\",",
    "\"k\":\"a\x01\",", R"("k":tru,)", R"("k":nul,)", R"(,)", R"("k":)", R"("k" "v",)"};

TEST(OpenAIAnswerRead, MutatedAnswersReadAsTheDomReads) {
  std::vector<std::string> seeds_chat = FakeAnswers(true), seeds_completions = FakeAnswers(false);
  ASSERT_FALSE(seeds_chat.empty());
  ASSERT_FALSE(seeds_completions.empty());
  mutation::Mutator m(20261205, kAnswerMembers);
  size_t accepted = 0, declined = 0;
  constexpr int kRounds = 30000;
  for (int i = 0; i < kRounds; ++i) {
    const bool chat = i % 3 != 0;
    const std::vector<std::string>& seeds = chat ? seeds_chat : seeds_completions;
    const std::string text = m.Mutate(seeds[static_cast<size_t>(i) % seeds.size()]);
    (CheckOne(text, chat) ? accepted : declined)++;
    if (::testing::Test::HasFailure()) break;  // one failing text is enough to read
  }
  // Both outcomes must be common, or the comparison tests little.
  EXPECT_GT(accepted, kRounds / 10u);
  EXPECT_GT(declined, kRounds / 10u);
  std::printf("mutated answers: %zu accepted by the fast reader, %zu declined\n", accepted, declined);
}

// ---- writers

class ResponseGen {
 public:
  explicit ResponseGen(uint32_t seed) : rng_(seed) {}

  std::string Str() {
    static const std::vector<std::string> kPieces = {
        "hello", " ", "\"", "\\", "/", "\n", "\t", "\r", "\b", "\f", std::string("\x00", 1), "\x01", "\x1f", "\x7f",
        "é", "世界", "🙂", "\xff", "\xc3", "\xe4\xb8", "\xed\xa0\x80", "\xf4\x90\x80\x80", "</script>", "\u2028", "{}",
        "chatcmpl-", "cmpl-"};
    std::string s;
    const size_t n = Pick(6);
    for (size_t i = 0; i < n; ++i) s += kPieces[Pick(kPieces.size())];
    return s;
  }

  ChatResponse Response() {
    ChatResponse r;
    r.id = Pick(4) == 0 ? "" : Pick(2) ? "chatcmpl-" + Str() : Str() + "x";
    r.model = Str();
    r.created = Pick(5) == 0 ? 0 : static_cast<int64_t>(rng_()) - (Pick(2) ? 0 : (int64_t{1} << 40));
    r.content = Pick(5) == 0 ? "" : Str();
    if (Pick(3) == 0) {
      const size_t n = 1 + Pick(3);
      for (size_t i = 0; i < n; ++i) {
        ToolCall c;
        c.id = Pick(4) == 0 ? "" : "call_" + Str();
        c.name = Str();
        c.arguments_json = Pick(3) == 0 ? "" : Pick(2) ? "{\"x\":1}" : Str();
        r.tool_calls.push_back(c);
      }
    }
    r.finish = static_cast<FinishReason>(Pick(5));
    const int64_t counts[] = {-1, 0, 7, 123456789012};
    r.usage.input_tokens = counts[Pick(4)];
    r.usage.output_tokens = counts[Pick(4)];
    return r;
  }

 private:
  size_t Pick(size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  std::mt19937 rng_;
};

// The writer's output must equal the DOM builder's. A made-up id or creation time (empty id,
// created 0) is read back from the output and given to the DOM builder, after checking it.
void ExpectSameAnswer(ChatResponse r, const std::string& model, bool chat) {
  const int64_t before = internal::NowSeconds();
  const std::string fast = chat ? BuildOpenAIChatResponse(r, model) : BuildOpenAICompletionsResponse(r, model);
  const int64_t after = internal::NowSeconds();
  if (r.id.empty() || r.created == 0) {
    const internal::json j = internal::json::parse(fast, nullptr, false);
    ASSERT_TRUE(j.is_object()) << fast;
    if (r.id.empty()) {
      r.id = j["id"].get<std::string>();
      EXPECT_EQ(r.id.rfind(chat ? "chatcmpl-" : "cmpl-", 0), 0u) << fast;
    }
    if (r.created == 0) {
      r.created = j["created"].get<int64_t>();
      EXPECT_GE(r.created, before);
      EXPECT_LE(r.created, after);
    }
  }
  const std::string dom = chat ? dom_reference::BuildOpenAIChatResponse(r, model)
                               : dom_reference::BuildOpenAICompletionsResponse(r, model);
  EXPECT_EQ(fast, dom);
}

TEST(OpenAIAnswerWrite, ByteIdenticalToTheDomBuilders) {
  ResponseGen gen(7);
  for (int i = 0; i < 20000; ++i) {
    const ChatResponse r = gen.Response();
    const std::string model = gen.Str();
    ExpectSameAnswer(r, model, true);
    ExpectSameAnswer(r, model, false);
    if (::testing::Test::HasFailure()) break;
  }
}

TEST(OpenAIAnswerWrite, CommonCases) {
  ChatResponse r;
  r.id = "chatcmpl-abc";
  r.created = 1700000000;
  r.content = "Hello";
  r.finish = FinishReason::kStop;
  r.usage = {3, 5};
  EXPECT_EQ(BuildOpenAIChatResponse(r, "gpt-4o"),
            R"({"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"message":{"annotations":[],"content":"Hello","refusal":null,"role":"assistant"}}],)"
            R"("created":1700000000,"id":"chatcmpl-abc","model":"gpt-4o","object":"chat.completion",)"
            R"("usage":{"completion_tokens":5,"prompt_tokens":3,"total_tokens":8}})");
  ExpectSameAnswer(r, "gpt-4o", true);
  r.usage = {};  // unknown usage: no member
  r.tool_calls = {{"call_1", "lookup", ""}};
  r.content.clear();
  r.finish = FinishReason::kToolCalls;
  ExpectSameAnswer(r, "gpt-4o", true);
  EXPECT_NE(BuildOpenAIChatResponse(r, "m").find(R"("content":null)"), std::string::npos);
  EXPECT_NE(BuildOpenAIChatResponse(r, "m").find(R"("arguments":"{}")"), std::string::npos);
  r.created = 0;
  r.id.clear();
  ExpectSameAnswer(r, "gpt-4o", true);
  ExpectSameAnswer(r, "gpt-4o", false);
}

}  // namespace
}  // namespace keel::gateway
