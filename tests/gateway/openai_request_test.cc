// The OpenAI upstream request bodies are written directly (keel/gateway/vendors/openai/
// translate_openai.cc); they must be byte for byte what the DOM builders they replaced wrote
// (tests/gateway/openai_dom_reference.h), on generated requests of every shape the builders
// handle: both client formats, system prompts, tool calls and results, tools with schemas (valid,
// unordered, invalid, empty), tool choices, response formats, every sampling field with awkward
// numbers (-0.0, 1e-07, 1e300, NaN, infinity), stop lists, streaming, hostile strings.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/openai/openai_answer.h"
#include "tests/gateway/json_mutator.h"
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


// ---- the client body's fast reader

std::string Show(const ChatRequest& r) {
  auto opt = [](const auto& o) { return o ? std::to_string(*o) : std::string("-"); };
  std::string s = std::to_string(static_cast<int>(r.client_format)) + "|" + r.model + "|sys " + r.system + "|" +
                  r.prompt + "|" + opt(r.max_tokens) + "|" + opt(r.temperature) + "|" + opt(r.top_p) + "|" +
                  opt(r.seed) + "|" + opt(r.top_k) + "|" + opt(r.presence_penalty) + "|" + opt(r.frequency_penalty) +
                  "|" + r.logit_bias_json + "|" + opt(r.parallel_tool_calls) + "|" + (r.response_format ? "rf" : "-") +
                  "|" + std::to_string(r.stream) + std::to_string(r.stream_include_usage) + "|" + r.user + "|" +
                  r.tool_choice;
  // Doubles exactly, not as to_string's 6 digits.
  char bits[64];
  for (const auto* d : {&r.temperature, &r.top_p}) {
    if (*d) {
      std::snprintf(bits, sizeof bits, "|%a", **d);
      s += bits;
    }
  }
  for (const Message& m : r.messages) {
    s += "|msg " + m.role + ":" + m.content + ":" + m.tool_call_id + ":" + m.name;
    for (const ToolCall& c : m.tool_calls) s += ":call " + c.id + " " + c.name + " " + c.arguments_json;
  }
  for (const Tool& t : r.tools) s += "|tool " + t.name + " " + t.description + " " + t.parameters_json;
  for (const std::string& st : r.stop) s += "|stop " + st;
  return s;
}
std::string Show(const Result<ChatRequest>& r) { return r.ok() ? "ok " + Show(r.value()) : "error " + r.status().ToString(); }

bool CheckRequest(const std::string& text) {
  const Result<ChatRequest> dom = internal::ParseOpenAIChatRequestDom(text);
  ChatRequest fast;
  const bool accepted = internal::ReadOpenAIChatRequestFast(text, &fast);
  if (accepted) {
    EXPECT_TRUE(dom.ok()) << "fast accepted what the DOM refuses: " << text << "\n" << Show(dom);
    if (dom.ok()) {
      EXPECT_EQ(Show(fast), Show(dom.value())) << text;
    }
  }
  EXPECT_EQ(Show(ParseOpenAIChatRequest(text)), Show(dom)) << text;
  return accepted;
}

const char kBenchBody[] =
    R"({"model":"gpt-4o-mini","messages":[{"role":"system","content":"You are a helpful assistant."},)"
    R"({"role":"user","content":"Say hello to the benchmark and then count slowly."}],"max_tokens":64,)"
    R"("temperature":0,"stream":false})";

TEST(OpenAIRequestRead, CommonBodiesTakeTheFastPath) {
  const std::vector<std::pair<std::string, bool>> cases = {
      {kBenchBody, true},
      {R"({"model":"m","messages":[{"role":"developer","content":"a"},{"role":"system","content":null},)"
       R"({"role":"user","content":"\u00e9\ud83d\ude00","name":"bob"},{"role":"assistant","content":"x","tool_calls":null}],)"
       R"("max_tokens":5,"max_completion_tokens":7,"temperature":0.7,"top_p":1e-1,"seed":-3,"stream":true,)"
       R"("stream_options":{"include_usage":true,"x":1},"user":"u","tools":null,"n":null,"metadata":{"a":[1]}})",
       true},
      {R"({"model":"m","messages":[{"role":"user","content":"a"}],"temperature":1.2345678901234567})", true},
      {R"({"model":"m","messages":[{"role":"user","content":"a"}],"temperature":"hot"})", false},
      {R"({"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":0})", false},
      {R"({"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":64.0})", false},
      {R"({"model":"m","messages":[{"role":"system","content":"a"}]})", false},
      {R"({"model":"m","messages":[{"role":"tool","content":"a","tool_call_id":"c"}]})", false},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]})", false},
      {R"({"model":"m","messages":[{"role":"user","content":"a"}],"n":2})", false},
      {R"({"model":"m","messages":[{"role":"user","content":"a"}],"model":"n"})", false},
      {R"({"model":"","messages":[{"role":"user","content":"a"}]})", false},
      {R"({"messages":[{"role":"user","content":"a"}]})", false},
      {R"({"model":"m","messages":[]})", false},
  };
  for (const auto& [text, accepted] : cases) EXPECT_EQ(CheckRequest(text), accepted) << text;
}

const std::vector<std::string> kRequestMembers = {
    R"("model":"dup",)", R"("model":null,)", R"("model":5,)", R"("model":"",)", R"("messages":[],)",
    R"("messages":null,)", R"("messages":[{"role":"user","content":"b"}],)", R"("role":"tool",)", R"("role":"system",)",
    R"("role":"developer",)", R"("role":"",)", R"("content":null,)", R"("content":5,)", R"("content":"dup",)",
    R"("content":[{"type":"text","text":"p"}],)", R"("tool_calls":null,)", R"("tool_calls":[],)", R"("name":"n",)",
    R"("tool_call_id":"c",)", R"("max_tokens":-1,)", R"("max_tokens":1.0,)", R"("max_tokens":99999999999999999999,)",
    R"("max_completion_tokens":3,)", R"("max_completion_tokens":null,)", R"("temperature":1e-400,)",
    R"("temperature":4.9e-324,)", R"("temperature":0.1,)", R"("temperature":true,)", R"("top_p":-0.0,)",
    R"("seed":1.5,)", R"("seed":-9,)", R"("stream":1,)", R"("stream":true,)", R"("stream_options":{"include_usage":1},)",
    R"("stream_options":[],)", R"("stream_options":{"include_usage":false},)", R"("user":7,)", R"("user":"\u0000",)",
    R"("n":1,)", R"("n":null,)", R"("logprobs":false,)", R"("tools":[],)", R"("stop":"x",)", R"("top_k":3,)",
    R"("response_format":{"type":"text"},)", R"("logit_bias":{},)", R"("extra":{"deep":[1,2,{"x":null}]},)",
    "\"k\":\"\xff\",", "\"k\":\"\xed\xa0\x80\",", R"("\u006dodel":"esc",)", R"("k":1e999,)", R"("k":tru,)", R"(,)"};

TEST(OpenAIRequestRead, MutatedBodiesReadAsTheDomReads) {
  std::vector<std::string> seeds = {kBenchBody};
  RequestGen gen(5);
  for (int i = 0; i < 300; ++i) {
    ChatRequest r = gen.Request();
    r.client_format = WireFormat::kOpenAIChat;  // an upstream chat body is a client body too
    if (i % 4) {  // mostly the common shape: text turns and the fields the fast reader takes
      r.tools.clear();
      r.stop.clear();
      r.response_format.reset();
      r.logit_bias_json.clear();
      r.top_k.reset();
      r.presence_penalty.reset();
      r.frequency_penalty.reset();
      r.parallel_tool_calls.reset();
      if (r.max_tokens && *r.max_tokens < 1) r.max_tokens = 16;
      for (Message& msg : r.messages) {
        msg.tool_calls.clear();
        if (msg.role == "tool") msg.role = "user";
      }
      if (r.messages.empty()) r.messages.push_back({"user", gen.Str(), {}, "", ""});
    }
    const Result<std::string> body = dom_reference::BuildOpenAIChatRequest(r, "gpt-4o-mini");
    if (body.ok()) seeds.push_back(*body);
  }
  size_t seed_accepted = 0;
  for (const std::string& s : seeds) seed_accepted += CheckRequest(s);
  EXPECT_GT(seed_accepted, seeds.size() / 2);
  mutation::Mutator m(99, kRequestMembers);
  size_t accepted = 0, declined = 0;
  constexpr int kRounds = 30000;
  for (int i = 0; i < kRounds; ++i) {
    (CheckRequest(m.Mutate(seeds[static_cast<size_t>(i) % seeds.size()])) ? accepted : declined)++;
    if (::testing::Test::HasFailure()) break;  // one failing text is enough to read
  }
  EXPECT_GT(accepted, kRounds / 25u);
  EXPECT_GT(declined, kRounds / 10u);
  std::printf("mutated client bodies: %zu accepted by the fast reader, %zu declined\n", accepted, declined);
}

}  // namespace
}  // namespace keel::gateway
