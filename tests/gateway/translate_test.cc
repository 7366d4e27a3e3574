// Non-streaming translation: names and error mapping, requests client -> ChatRequest -> upstream,
// responses upstream -> ChatResponse -> client, and rejection of bad input. Outputs are checked
// by parsing the produced JSON and reading fields, or by round trips through the parsers.
#include "keel/gateway/translate.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "keel/gateway/front.h"
#include "keel/gateway/vendor.h"
#include "keel/gateway/vendors/anthropic/anthropic.h"
#include "keel/gateway/vendors/gemini/gemini.h"
#include "keel/gateway/vendors/openai/openai.h"

namespace keel::gateway {
namespace {

using nlohmann::json;

constexpr WireFormat kOpenAI = WireFormat::kOpenAIChat;
constexpr WireFormat kCompletions = WireFormat::kOpenAICompletions;
constexpr WireFormat kAnthropic = WireFormat::kAnthropicMessages;
constexpr WireFormat kGemini = WireFormat::kGemini;

// The per-format calls these tests make, reached the way the gateway reaches them: a client
// format through its front (front.h), an upstream format through its vendor adapter (vendor.h).
// Upstream bodies come from each format's own builder (vendors/<name>/<name>.h): the adapters
// refuse a few more fields per vendor (top_k to OpenAI; vendor_test.cc covers those), and no
// adapter speaks legacy completions upstream.
const VendorAdapter& Vendor(WireFormat f) { return **FindVendor(VendorNameFor(f)); }

Result<ChatRequest> ParseClientRequest(WireFormat f, std::string_view body) {
  return FrontFor(f).Parse(body, /*path_model=*/"", /*stream_by_path=*/false);
}

Result<std::string> BuildUpstreamRequest(WireFormat f, const ChatRequest& r, const std::string& model,
                                         int64_t default_max_tokens = 4096) {
  switch (f) {
    case WireFormat::kOpenAIChat: return BuildOpenAIChatRequest(r, model);
    case WireFormat::kOpenAICompletions: return BuildOpenAICompletionsRequest(r, model);
    case WireFormat::kAnthropicMessages: return BuildAnthropicRequest(r, model, default_max_tokens);
    case WireFormat::kGemini: return BuildGeminiRequest(r);
    case WireFormat::kOpenAIResponses: break;
  }
  return Status::InvalidArgument("no upstream speaks openai-responses");
}

Result<ChatResponse> ParseUpstreamResponse(WireFormat f, std::string_view body) {
  if (f == kCompletions) return ParseOpenAICompletionsResponse(body);
  return Vendor(f).ParseChat(body);
}

std::string BuildClientResponse(WireFormat f, const ChatResponse& r, const std::string& client_model) {
  return FrontFor(f).BuildAnswer(r, ChatRequest{}, client_model);
}

std::string BuildErrorBody(WireFormat f, const GatewayError& e) { return FrontFor(f).ErrorBody(e); }

GatewayError ParseUpstreamError(WireFormat f, int http_status, std::string_view body) {
  return Vendor(f).ParseError(http_status, body);
}

const char* FinishReasonName(WireFormat f, FinishReason r) { return FrontFor(f).FinishReasonName(r); }

FinishReason ParseFinishReason(WireFormat f, std::string_view name) { return Vendor(f).ParseFinishReason(name); }

const std::vector<ErrorKind> kAllKinds = {
    ErrorKind::kInvalidRequest, ErrorKind::kAuthentication, ErrorKind::kPermission,
    ErrorKind::kNotFound,       ErrorKind::kRequestTooLarge, ErrorKind::kRateLimit,
    ErrorKind::kApi,            ErrorKind::kBadGateway,      ErrorKind::kOverloaded,
    ErrorKind::kTimeout};

json J(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << text;
  return j;
}

ChatRequest MustParse(WireFormat f, const json& body) {
  auto r = ParseClientRequest(f, body.dump());
  EXPECT_TRUE(r.ok()) << r.status().ToString() << "\n" << body.dump();
  return r.ok() ? r.value() : ChatRequest{};
}

// The upstream body for `r`, which must be buildable.
std::string Up(WireFormat f, const ChatRequest& r, const std::string& model, int64_t default_max_tokens = 4096) {
  auto built = BuildUpstreamRequest(f, r, model, default_max_tokens);
  EXPECT_TRUE(built.ok()) << built.status().ToString();
  return built.ok() ? built.value() : "{}";
}

ChatResponse MustParseResponse(WireFormat f, const std::string& body) {
  auto r = ParseUpstreamResponse(f, body);
  EXPECT_TRUE(r.ok()) << r.status().ToString() << "\n" << body;
  return r.ok() ? r.value() : ChatResponse{};
}

// An OpenAI conversation: system + developer, a tool call with two parallel calls, both results,
// then a follow-up user turn.
json OpenAIToolConversation() {
  return J(R"({
    "model": "gpt-virtual",
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
      {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris and Rome?"}]},
      {"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]},
      {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp\":21}"},
      {"role": "tool", "tool_call_id": "call_b", "content": "sunny"},
      {"role": "user", "content": "Thanks. And tomorrow?"}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
      "parameters": {"type": "object", "$schema": "x", "additionalProperties": false,
                     "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
              {"type": "function", "function": {"name": "now"}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_tokens": 50, "max_completion_tokens": 100,
    "temperature": 0.25, "top_p": 0.9, "stop": "END", "stream": true, "seed": 42,
    "stream_options": {"include_usage": true}, "user": "u-1"
  })");
}

// ---------------------------------------------------------------------------------------------
// Names, error kinds, finish reasons

TEST(TranslateNames, WireFormatNamesAreDistinct) {
  EXPECT_STREQ(WireFormatName(kOpenAI), "openai-chat");
  EXPECT_STREQ(WireFormatName(kCompletions), "openai-completions");
  EXPECT_STREQ(WireFormatName(kAnthropic), "anthropic");
  EXPECT_STREQ(WireFormatName(kGemini), "gemini");
}

TEST(TranslateErrors, KindStatusRoundTrip) {
  for (ErrorKind k : kAllKinds) EXPECT_EQ(ErrorKindForStatus(StatusForErrorKind(k)), k);
  EXPECT_EQ(ErrorKindForStatus(529), ErrorKind::kOverloaded);
  EXPECT_EQ(ErrorKindForStatus(418), ErrorKind::kInvalidRequest);
  EXPECT_EQ(ErrorKindForStatus(599), ErrorKind::kApi);
  EXPECT_EQ(StatusForErrorKind(ErrorKind::kBadGateway), 502);
  EXPECT_EQ(StatusForErrorKind(ErrorKind::kTimeout), 504);
  EXPECT_EQ(StatusForErrorKind(ErrorKind::kOverloaded), 503);
}

TEST(TranslateFinish, NamesParseBackInEveryFormat) {
  for (WireFormat f : {kOpenAI, kCompletions, kAnthropic, kGemini}) {
    for (FinishReason r : {FinishReason::kStop, FinishReason::kLength, FinishReason::kContentFilter,
                           FinishReason::kToolCalls}) {
      if (f == kGemini && r == FinishReason::kToolCalls) continue;  // Gemini says STOP + functionCall
      const char* name = FinishReasonName(f, r);
      ASSERT_NE(name, nullptr);
      EXPECT_EQ(ParseFinishReason(f, name), r) << WireFormatName(f) << " " << name;
    }
    ASSERT_NE(FinishReasonName(f, FinishReason::kNone), nullptr);
    EXPECT_EQ(ParseFinishReason(f, ""), FinishReason::kNone);
  }
  EXPECT_STREQ(FinishReasonName(kOpenAI, FinishReason::kToolCalls), "tool_calls");
  EXPECT_STREQ(FinishReasonName(kAnthropic, FinishReason::kLength), "max_tokens");
  EXPECT_STREQ(FinishReasonName(kAnthropic, FinishReason::kToolCalls), "tool_use");
  EXPECT_STREQ(FinishReasonName(kGemini, FinishReason::kLength), "MAX_TOKENS");
  EXPECT_EQ(ParseFinishReason(kAnthropic, "stop_sequence"), FinishReason::kStop);
  EXPECT_EQ(ParseFinishReason(kAnthropic, "end_turn"), FinishReason::kStop);
  for (const char* n : {"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT"})
    EXPECT_EQ(ParseFinishReason(kGemini, n), FinishReason::kContentFilter) << n;
}

// ---------------------------------------------------------------------------------------------
// Error bodies

TEST(TranslateErrors, BodiesHaveEachFormatsShape) {
  GatewayError e{429, ErrorKind::kRateLimit, "slow down"};
  json o = J(BuildErrorBody(kOpenAI, e));
  EXPECT_EQ(o["error"]["message"], "slow down");
  EXPECT_TRUE(o["error"]["type"].is_string());
  EXPECT_TRUE(o["error"].contains("param") && o["error"]["param"].is_null());
  EXPECT_TRUE(o["error"].contains("code"));
  json a = J(BuildErrorBody(kAnthropic, e));
  EXPECT_EQ(a["type"], "error");
  EXPECT_EQ(a["error"]["type"], "rate_limit_error");
  EXPECT_EQ(a["error"]["message"], "slow down");
  json g = J(BuildErrorBody(kGemini, e));
  EXPECT_EQ(g["error"]["code"], 429);
  EXPECT_EQ(g["error"]["status"], "RESOURCE_EXHAUSTED");
  EXPECT_EQ(g["error"]["message"], "slow down");

  EXPECT_EQ(J(BuildErrorBody(kAnthropic, {529, ErrorKind::kOverloaded, "x"}))["error"]["type"], "overloaded_error");
  EXPECT_EQ(J(BuildErrorBody(kAnthropic, {400, ErrorKind::kInvalidRequest, "x"}))["error"]["type"],
            "invalid_request_error");
  EXPECT_EQ(J(BuildErrorBody(kGemini, {404, ErrorKind::kNotFound, "x"}))["error"]["status"], "NOT_FOUND");
  // OpenAI answers an unknown model with type invalid_request_error, code model_not_found.
  json missing = J(BuildErrorBody(kOpenAI, {404, ErrorKind::kNotFound, "x"}));
  EXPECT_EQ(missing["error"]["type"], "invalid_request_error");
  EXPECT_EQ(missing["error"]["code"], "model_not_found");
  EXPECT_EQ(J(BuildErrorBody(kAnthropic, {404, ErrorKind::kNotFound, "x"}))["error"]["type"], "not_found_error");
  EXPECT_EQ(J(BuildErrorBody(kOpenAI, {401, ErrorKind::kAuthentication, "x"}))["error"]["code"], "invalid_api_key");
  EXPECT_EQ(J(BuildErrorBody(kOpenAI, {500, ErrorKind::kApi, "x"}))["error"]["type"], "server_error");
}

TEST(TranslateErrors, BodiesSurviveInvalidUtf8) {
  json o = J(BuildErrorBody(kOpenAI, {502, ErrorKind::kBadGateway, std::string("bad \xff byte")}));
  EXPECT_NE(o["error"]["message"].get<std::string>().find("bad"), std::string::npos);
}

// Every kind survives BuildErrorBody -> ParseUpstreamError in every format.
TEST(TranslateErrors, BuildThenParseKeepsKindAndMessage) {
  for (WireFormat f : {kOpenAI, kAnthropic, kGemini}) {
    for (ErrorKind k : kAllKinds) {
      GatewayError in{StatusForErrorKind(k), k, "boom " + std::to_string(static_cast<int>(k))};
      GatewayError out = ParseUpstreamError(f, in.status, BuildErrorBody(f, in));
      EXPECT_EQ(out.kind, k) << WireFormatName(f) << " kind " << static_cast<int>(k);
      EXPECT_EQ(out.status, in.status);
      EXPECT_EQ(out.message, in.message);
    }
  }
}

TEST(TranslateErrors, UpstreamVendorBodies) {
  GatewayError a = ParseUpstreamError(
      kAnthropic, 529, R"({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}})");
  EXPECT_EQ(a.kind, ErrorKind::kOverloaded);
  EXPECT_EQ(a.status, 503);
  EXPECT_EQ(a.message, "Overloaded");

  GatewayError g = ParseUpstreamError(
      kGemini, 429, R"([{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED"}}])");
  EXPECT_EQ(g.kind, ErrorKind::kRateLimit);
  EXPECT_EQ(g.message, "Quota exceeded");

  GatewayError o = ParseUpstreamError(kOpenAI, 400, R"({"error":"model is required"})");
  EXPECT_EQ(o.kind, ErrorKind::kInvalidRequest);
  EXPECT_EQ(o.message, "model is required");
}

TEST(TranslateErrors, NonJsonAndTruncatedBodiesGiveSanitizedExcerpt) {
  std::string html = "<html>\r\n<body>\x01\x02 Bad   gateway\xc3\xa9</body></html>" + std::string(1000, 'x');
  GatewayError e = ParseUpstreamError(kOpenAI, 502, html);
  EXPECT_EQ(e.status, 502);
  EXPECT_EQ(e.kind, ErrorKind::kBadGateway);
  EXPECT_NE(e.message.find("502"), std::string::npos);
  EXPECT_NE(e.message.find("<html> <body>?" "? Bad gateway?" "?</body>"), std::string::npos) << e.message;
  EXPECT_LE(e.message.size(), 260u);
  for (char c : e.message) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << static_cast<int>(c);

  GatewayError t = ParseUpstreamError(kAnthropic, 500, R"({"type":"error","error":{"type":"api_err)");
  EXPECT_EQ(t.kind, ErrorKind::kApi);
  EXPECT_NE(t.message.find("api_err"), std::string::npos) << t.message;

  GatewayError empty = ParseUpstreamError(kGemini, 504, "");
  EXPECT_EQ(empty.kind, ErrorKind::kTimeout);
  EXPECT_FALSE(empty.message.empty());

  GatewayError ok_status = ParseUpstreamError(kOpenAI, 200, "garbage");
  EXPECT_EQ(ok_status.status, 502);
}

// ---------------------------------------------------------------------------------------------
// Client requests

TEST(TranslateRequest, OpenAIChatParsesEveryField) {
  ChatRequest r = MustParse(kOpenAI, OpenAIToolConversation());
  EXPECT_EQ(r.client_format, kOpenAI);
  EXPECT_EQ(r.model, "gpt-virtual");
  EXPECT_EQ(r.system, "Be brief.\nUse tools.");
  ASSERT_EQ(r.messages.size(), 5u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "Weather in Paris and Rome?");
  ASSERT_EQ(r.messages[1].tool_calls.size(), 2u);
  EXPECT_EQ(r.messages[1].tool_calls[1].id, "call_b");
  EXPECT_EQ(J(r.messages[1].tool_calls[1].arguments_json)["city"], "Rome");
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_EQ(r.messages[2].tool_call_id, "call_a");
  EXPECT_EQ(r.messages[2].name, "get_weather");  // resolved from the call it answers
  ASSERT_EQ(r.tools.size(), 2u);
  EXPECT_EQ(r.tools[0].description, "Weather by city");
  EXPECT_EQ(J(r.tools[0].parameters_json)["required"][0], "city");
  EXPECT_EQ(J(r.tools[1].parameters_json), json::object());
  EXPECT_EQ(r.tool_choice, "get_weather");
  EXPECT_EQ(r.max_tokens, 100);  // max_completion_tokens wins
  EXPECT_EQ(r.temperature, 0.25);
  EXPECT_EQ(r.top_p, 0.9);
  EXPECT_EQ(r.seed, 42);
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.stream_include_usage);
  EXPECT_EQ(r.user, "u-1");
}

TEST(TranslateRequest, OpenAIToOpenAIRoundTrip) {
  ChatRequest r = MustParse(kOpenAI, OpenAIToolConversation());
  json up = J(Up(kOpenAI, r, "gpt-4o"));
  EXPECT_EQ(up["model"], "gpt-4o");
  EXPECT_EQ(up["messages"][0]["role"], "system");
  EXPECT_TRUE(up["messages"][2]["content"].is_null());  // only tool calls
  EXPECT_EQ(up["stream_options"]["include_usage"], true);
  ChatRequest back = MustParse(kOpenAI, up);
  EXPECT_EQ(back.system, r.system);
  ASSERT_EQ(back.messages.size(), r.messages.size());
  for (size_t i = 0; i < r.messages.size(); ++i) {
    EXPECT_EQ(back.messages[i].role, r.messages[i].role);
    EXPECT_EQ(back.messages[i].content, r.messages[i].content);
    EXPECT_EQ(back.messages[i].tool_call_id, r.messages[i].tool_call_id);
    ASSERT_EQ(back.messages[i].tool_calls.size(), r.messages[i].tool_calls.size());
    for (size_t c = 0; c < r.messages[i].tool_calls.size(); ++c) {
      EXPECT_EQ(back.messages[i].tool_calls[c].id, r.messages[i].tool_calls[c].id);
      EXPECT_EQ(J(back.messages[i].tool_calls[c].arguments_json), J(r.messages[i].tool_calls[c].arguments_json));
    }
  }
  EXPECT_EQ(back.tool_choice, r.tool_choice);
  EXPECT_EQ(back.max_tokens, r.max_tokens);
  EXPECT_EQ(back.temperature, r.temperature);
  EXPECT_EQ(back.seed, 42);
  EXPECT_EQ(back.stop, r.stop);
  EXPECT_EQ(back.user, r.user);
  EXPECT_EQ(J(back.tools[0].parameters_json), J(r.tools[0].parameters_json));
}

// OpenAI-only fields that change the answer reach an OpenAI upstream, and are refused by the
// others rather than dropped with a 200 (both used to be dropped).
TEST(TranslateRequest, StrictToolsAndReasoningEffortReachOpenAIAndAreRefusedElsewhere) {
  json body = OpenAIToolConversation();
  body["tools"][0]["function"]["strict"] = true;
  body["reasoning_effort"] = "high";
  ChatRequest r = MustParse(kOpenAI, body);
  EXPECT_EQ(r.tools[0].strict, true);
  EXPECT_EQ(r.reasoning_effort, "high");
  json up = J(Up(kOpenAI, r, "o3"));
  EXPECT_EQ(up["tools"][0]["function"]["strict"], true);
  EXPECT_EQ(up["reasoning_effort"], "high");
  for (WireFormat other : {kAnthropic, kGemini}) {
    auto built = BuildUpstreamRequest(other, r, "m", 4096);
    ASSERT_FALSE(built.ok());
    EXPECT_NE(built.status().message().find("reasoning_effort"), std::string::npos) << built.status().ToString();
  }
  r.reasoning_effort.clear();
  auto strict = BuildUpstreamRequest(kAnthropic, r, "m", 4096);
  ASSERT_FALSE(strict.ok());
  EXPECT_NE(strict.status().message().find("strict"), std::string::npos) << strict.status().ToString();
  // The fast reader hands a request with reasoning_effort to the full one, which keeps it.
  json plain = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"reasoning_effort", "low"}};
  EXPECT_EQ(MustParse(kOpenAI, plain).reasoning_effort, "low");
  plain["reasoning_effort"] = "HIGH!";
  EXPECT_FALSE(ParseClientRequest(kOpenAI, plain.dump()).ok());
  // Responses: reasoning.effort.
  json resp = {{"model", "m"}, {"input", "hi"}, {"reasoning", {{"effort", "medium"}, {"summary", "auto"}}}};
  auto rr = ParseClientRequest(WireFormat::kOpenAIResponses, resp.dump());
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->reasoning_effort, "medium");
}

TEST(TranslateRequest, OpenAIToAnthropicAlternatesAndMergesToolResults) {
  ChatRequest r = MustParse(kOpenAI, OpenAIToolConversation());
  r.max_tokens.reset();
  r.tool_choice = "required";
  json up = J(Up(kAnthropic, r, "claude-x", 777));
  EXPECT_EQ(up["model"], "claude-x");
  EXPECT_EQ(up["max_tokens"], 777);  // default fills the required field
  EXPECT_EQ(up["system"], "Be brief.\nUse tools.");
  EXPECT_EQ(up["stop_sequences"], json::array({"END"}));
  EXPECT_EQ(up["tool_choice"]["type"], "any");
  EXPECT_EQ(up["metadata"]["user_id"], "u-1");
  EXPECT_EQ(up["temperature"], 0.25);
  EXPECT_FALSE(up.contains("seed"));  // Anthropic has no seed
  const json& msgs = up["messages"];
  ASSERT_EQ(msgs.size(), 3u);  // user, assistant, user(results + follow-up) after merging
  for (size_t i = 1; i < msgs.size(); ++i) EXPECT_NE(msgs[i]["role"], msgs[i - 1]["role"]);
  EXPECT_EQ(msgs[1]["role"], "assistant");
  ASSERT_EQ(msgs[1]["content"].size(), 2u);
  EXPECT_EQ(msgs[1]["content"][0]["type"], "tool_use");
  EXPECT_EQ(msgs[1]["content"][0]["id"], "call_a");
  EXPECT_EQ(msgs[1]["content"][0]["input"]["city"], "Paris");  // an object, not a string
  const json& results = msgs[2]["content"];
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[0]["type"], "tool_result");
  EXPECT_EQ(results[0]["tool_use_id"], "call_a");
  EXPECT_EQ(results[1]["tool_use_id"], "call_b");
  EXPECT_EQ(results[1]["content"], "sunny");
  EXPECT_EQ(results[2]["type"], "text");
  EXPECT_EQ(up["tools"][0]["input_schema"]["properties"]["city"]["type"], "string");
  EXPECT_EQ(up["tools"][1]["input_schema"]["type"], "object");  // "{}" gets the required type

  // And back: the Anthropic body parses to the same conversation.
  ChatRequest back = MustParse(kAnthropic, up);
  ASSERT_EQ(back.messages.size(), r.messages.size());
  for (size_t i = 0; i < r.messages.size(); ++i) {
    EXPECT_EQ(back.messages[i].role, r.messages[i].role) << i;
    EXPECT_EQ(back.messages[i].content, r.messages[i].content) << i;
    EXPECT_EQ(back.messages[i].tool_call_id, r.messages[i].tool_call_id) << i;
    EXPECT_EQ(back.messages[i].tool_calls.size(), r.messages[i].tool_calls.size()) << i;
  }
  EXPECT_EQ(back.tool_choice, "required");
  EXPECT_EQ(back.user, "u-1");
}

// Anthropic refuses an empty turn anywhere but last: an empty assistant turn is left out (its
// neighbours merge), and an OpenAI refusal is the text the assistant said.
TEST(TranslateRequest, OpenAIToAnthropicLeavesEmptyTurnsOutAndCarriesRefusals) {
  ChatRequest r = MustParse(kOpenAI, json{{"model", "m"},
                                          {"messages",
                                           {{{"role", "user"}, {"content", "q1"}},
                                            {{"role", "assistant"}, {"content", ""}},
                                            {{"role", "user"}, {"content", "q2"}},
                                            {{"role", "assistant"}, {"content", nullptr}, {"refusal", "I cannot"}},
                                            {{"role", "user"}, {"content", "q3"}}}}});
  json up = J(Up(kAnthropic, r, "claude-x", 64));
  const json& msgs = up["messages"];
  ASSERT_EQ(msgs.size(), 3u) << msgs.dump();
  EXPECT_EQ(msgs[0]["role"], "user");
  ASSERT_EQ(msgs[0]["content"].size(), 2u) << msgs.dump();  // q1 and q2, merged
  EXPECT_EQ(msgs[0]["content"][1]["text"], "q2");
  EXPECT_EQ(msgs[1]["role"], "assistant");
  EXPECT_EQ(msgs[1]["content"][0]["text"], "I cannot");
  for (const json& m : msgs) EXPECT_FALSE(m["content"].empty()) << msgs.dump();
  // A refusal read by the fast reader and the DOM reader alike (a null one is no refusal).
  ChatRequest plain = MustParse(kOpenAI, json{{"model", "m"},
                                              {"messages",
                                               {{{"role", "user"}, {"content", "q1"}},
                                                {{"role", "assistant"}, {"content", "a"}, {"refusal", nullptr}}}}});
  EXPECT_EQ(plain.messages.back().content, "a");
}

TEST(TranslateRequest, OpenAIToGemini) {
  ChatRequest r = MustParse(kOpenAI, OpenAIToolConversation());
  json up = J(Up(kGemini, r, "gemini-2.5-flash"));
  EXPECT_FALSE(up.contains("model"));  // in the URL
  EXPECT_EQ(up["systemInstruction"]["parts"][0]["text"], "Be brief.\nUse tools.");
  const json& c = up["contents"];
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0]["role"], "user");
  EXPECT_EQ(c[1]["role"], "model");
  EXPECT_EQ(c[1]["parts"][1]["functionCall"]["name"], "get_weather");
  EXPECT_EQ(c[1]["parts"][1]["functionCall"]["args"]["city"], "Rome");
  EXPECT_EQ(c[2]["role"], "user");
  ASSERT_EQ(c[2]["parts"].size(), 3u);
  EXPECT_EQ(c[2]["parts"][0]["functionResponse"]["name"], "get_weather");
  EXPECT_EQ(c[2]["parts"][0]["functionResponse"]["response"]["temp"], 21);  // an object stays
  EXPECT_EQ(c[2]["parts"][1]["functionResponse"]["response"]["result"], "sunny");  // wrapped
  EXPECT_EQ(c[2]["parts"][2]["text"], "Thanks. And tomorrow?");
  const json& decl = up["tools"][0]["functionDeclarations"];
  EXPECT_EQ(decl[0]["parameters"]["properties"]["city"]["type"], "string");
  EXPECT_FALSE(decl[0]["parameters"].contains("additionalProperties"));
  EXPECT_FALSE(decl[0]["parameters"].contains("$schema"));
  EXPECT_FALSE(decl[1].contains("parameters"));  // no properties: omitted
  EXPECT_EQ(up["toolConfig"]["functionCallingConfig"]["mode"], "ANY");
  EXPECT_EQ(up["toolConfig"]["functionCallingConfig"]["allowedFunctionNames"][0], "get_weather");
  EXPECT_EQ(up["generationConfig"]["maxOutputTokens"], 100);
  EXPECT_EQ(up["generationConfig"]["temperature"], 0.25);
  EXPECT_EQ(up["generationConfig"]["topP"], 0.9);
  EXPECT_EQ(up["generationConfig"]["seed"], 42);
  EXPECT_EQ(up["generationConfig"]["stopSequences"][0], "END");

  r.tool_choice = "none";
  EXPECT_EQ(J(Up(kGemini, r, "g"))["toolConfig"]["functionCallingConfig"]["mode"], "NONE");
  // Gemini's seed is an int32: a wider one is not sent (OpenAI upstreams still get it).
  r.seed = int64_t{1} << 40;
  EXPECT_FALSE(J(Up(kGemini, r, "g"))["generationConfig"].contains("seed"));
  EXPECT_EQ(J(Up(kOpenAI, r, "gpt"))["seed"], int64_t{1} << 40);
  r.seed = -5;
  EXPECT_EQ(J(Up(kGemini, r, "g"))["generationConfig"]["seed"], -5);
}

TEST(TranslateRequest, GeminiToolNameFromMessageWhenCallUnknown) {
  ChatRequest r;
  r.messages = {Message{.role = "user", .content = "hi", .tool_calls = {}, .tool_call_id = "", .name = ""},
                Message{.role = "tool", .content = "[1,2]", .tool_calls = {}, .tool_call_id = "x", .name = "lookup"}};
  json up = J(Up(kGemini, r, "g"));
  EXPECT_EQ(up["contents"][0]["parts"][1]["functionResponse"]["name"], "lookup");
  EXPECT_EQ(up["contents"][0]["parts"][1]["functionResponse"]["response"]["result"], "[1,2]");
  EXPECT_FALSE(up.contains("generationConfig"));
}

json AnthropicConversation() {
  return J(R"({
    "model": "claude-virtual", "max_tokens": 256,
    "system": [{"type": "text", "text": "Sys A"}, {"type": "text", "text": " and B"}],
    "messages": [
      {"role": "user", "content": "What is 2+2? Use calc."},
      {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "s"},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"expr": "2+2"}}]},
      {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "4"}]},
        {"type": "text", "text": "Now double it."}]}
    ],
    "tools": [{"name": "calc", "description": "Evaluate", "input_schema": {"type": "object", "properties": {"expr": {"type": "string"}}}}],
    "tool_choice": {"type": "tool", "name": "calc"},
    "temperature": 0.5, "top_p": 0.8, "stop_sequences": ["\n\nHuman:", "STOP"], "stream": false,
    "metadata": {"user_id": "team-7"}
  })");
}

TEST(TranslateRequest, AnthropicParsesBlocks) {
  ChatRequest r = MustParse(kAnthropic, AnthropicConversation());
  EXPECT_EQ(r.client_format, kAnthropic);
  EXPECT_EQ(r.system, "Sys A and B");
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[1].role, "assistant");
  EXPECT_EQ(r.messages[1].content, "Calling.");  // thinking dropped
  ASSERT_EQ(r.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(J(r.messages[1].tool_calls[0].arguments_json)["expr"], "2+2");
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_EQ(r.messages[2].tool_call_id, "toolu_1");
  EXPECT_EQ(r.messages[2].name, "calc");
  EXPECT_EQ(r.messages[2].content, "4");
  EXPECT_EQ(r.messages[3].role, "user");
  EXPECT_EQ(r.messages[3].content, "Now double it.");
  EXPECT_EQ(r.tool_choice, "calc");
  EXPECT_EQ(r.max_tokens, 256);
  EXPECT_EQ(r.stop.size(), 2u);
  EXPECT_EQ(r.user, "team-7");
  EXPECT_EQ(r.top_p, 0.8);
}

TEST(TranslateRequest, AnthropicToOpenAI) {
  ChatRequest r = MustParse(kAnthropic, AnthropicConversation());
  json up = J(Up(kOpenAI, r, "gpt"));
  const json& m = up["messages"];
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0]["role"], "system");
  EXPECT_EQ(m[0]["content"], "Sys A and B");
  EXPECT_EQ(m[2]["content"], "Calling.");
  const json& call = m[2]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  ASSERT_TRUE(call["function"]["arguments"].is_string());  // OpenAI carries a string
  EXPECT_EQ(J(call["function"]["arguments"].get<std::string>())["expr"], "2+2");
  EXPECT_EQ(m[3]["role"], "tool");
  EXPECT_EQ(m[3]["tool_call_id"], "toolu_1");
  EXPECT_EQ(up["tool_choice"]["function"]["name"], "calc");
  EXPECT_EQ(up["stop"].size(), 2u);
  EXPECT_EQ(up["max_completion_tokens"], 256);
  EXPECT_FALSE(up.contains("stream"));
}

TEST(TranslateRequest, AnthropicToAnthropicRoundTrip) {
  ChatRequest r = MustParse(kAnthropic, AnthropicConversation());
  json up = J(Up(kAnthropic, r, "claude-real"));
  EXPECT_EQ(up["max_tokens"], 256);  // the request's, not the default
  EXPECT_EQ(up["tool_choice"], J(R"({"type":"tool","name":"calc"})"));
  ChatRequest back = MustParse(kAnthropic, up);
  EXPECT_EQ(back.system, r.system);
  ASSERT_EQ(back.messages.size(), r.messages.size());
  for (size_t i = 0; i < r.messages.size(); ++i) {
    EXPECT_EQ(back.messages[i].role, r.messages[i].role);
    EXPECT_EQ(back.messages[i].content, r.messages[i].content);
  }
  EXPECT_EQ(back.stop, r.stop);
  EXPECT_EQ(back.temperature, r.temperature);

  // A failed tool call stays failed: is_error used to be dropped, so the model took "boom" for a result.
  json failed = AnthropicConversation();
  for (auto& m : failed["messages"]) {
    if (!m["content"].is_array()) continue;
    for (auto& b : m["content"]) {
      if (b["type"] == "tool_result") b["is_error"] = true;
    }
  }
  json again = J(Up(kAnthropic, MustParse(kAnthropic, failed), "claude-real"));
  int errors = 0;
  for (const auto& m : again["messages"]) {
    if (!m["content"].is_array()) continue;
    for (const auto& b : m["content"]) errors += b.value("type", "") == "tool_result" && b.value("is_error", false);
  }
  EXPECT_EQ(errors, 1) << again.dump();
  EXPECT_EQ(up.dump().find("is_error"), std::string::npos);  // absent unless the client said so
}

TEST(TranslateRequest, InvalidToolArgumentsAreKeptOrWrapped) {
  json body = OpenAIToolConversation();
  body["messages"][3]["tool_calls"][0]["function"]["arguments"] = "{not json";
  body["messages"][3]["tool_calls"][1]["function"]["arguments"] = "";
  ChatRequest r = MustParse(kOpenAI, body);
  json openai = J(Up(kOpenAI, r, "m"));
  EXPECT_EQ(openai["messages"][2]["tool_calls"][0]["function"]["arguments"], "{not json");  // verbatim
  EXPECT_EQ(openai["messages"][2]["tool_calls"][1]["function"]["arguments"], "{}");
  json anthropic = J(Up(kAnthropic, r, "m"));
  EXPECT_EQ(anthropic["messages"][1]["content"][0]["input"]["_raw"], "{not json");
  EXPECT_EQ(anthropic["messages"][1]["content"][1]["input"], json::object());
  json gemini = J(Up(kGemini, r, "m"));
  EXPECT_EQ(gemini["contents"][1]["parts"][0]["functionCall"]["args"]["_raw"], "{not json");
}

TEST(TranslateRequest, CompletionsBecomesOneUserMessage) {
  ChatRequest r = MustParse(kCompletions, J(R"({"model":"m","prompt":["Once upon"],"max_tokens":7,"stop":["\n"]})"));
  EXPECT_EQ(r.client_format, kCompletions);
  EXPECT_EQ(r.prompt, "Once upon");
  EXPECT_TRUE(r.messages.empty());
  json chat = J(Up(kOpenAI, r, "up"));
  ASSERT_EQ(chat["messages"].size(), 1u);
  EXPECT_EQ(chat["messages"][0]["role"], "user");
  EXPECT_EQ(chat["messages"][0]["content"], "Once upon");
  json anthropic = J(Up(kAnthropic, r, "up"));
  EXPECT_EQ(anthropic["messages"][0]["content"][0]["text"], "Once upon");
  EXPECT_EQ(anthropic["max_tokens"], 7);
  json gemini = J(Up(kGemini, r, "up"));
  EXPECT_EQ(gemini["contents"][0]["parts"][0]["text"], "Once upon");
  json completions = J(Up(kCompletions, r, "up"));
  EXPECT_EQ(completions["prompt"], "Once upon");
  EXPECT_EQ(completions["max_tokens"], 7);
  EXPECT_EQ(MustParse(kCompletions, J(R"({"model":"m","prompt":"p"})")).prompt, "p");
}

// ---------------------------------------------------------------------------------------------
// Responses

TEST(TranslateResponse, OpenAIUpstreamToAnthropicClient) {
  ChatResponse r = MustParseResponse(kOpenAI, R"({"id":"chatcmpl-1","object":"chat.completion","created":1700000000,
    "model":"gpt-4o-2024","choices":[{"index":0,"message":{"role":"assistant","content":"Let me check.",
    "tool_calls":[{"id":"call_9","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},
    "finish_reason":"tool_calls"}],"usage":{"prompt_tokens":11,"completion_tokens":5,"total_tokens":16}})");
  EXPECT_EQ(r.model, "gpt-4o-2024");
  EXPECT_EQ(r.created, 1700000000);
  EXPECT_EQ(r.finish, FinishReason::kToolCalls);
  EXPECT_EQ(r.usage.input_tokens, 11);
  EXPECT_EQ(r.usage.output_tokens, 5);
  json a = J(BuildClientResponse(kAnthropic, r, "claude-virtual"));
  EXPECT_EQ(a["type"], "message");
  EXPECT_EQ(a["role"], "assistant");
  EXPECT_EQ(a["model"], "claude-virtual");
  EXPECT_EQ(a["id"].get<std::string>().rfind("msg_", 0), 0u);
  EXPECT_EQ(a["content"][0]["text"], "Let me check.");
  EXPECT_EQ(a["content"][1]["type"], "tool_use");
  EXPECT_EQ(a["content"][1]["id"], "call_9");
  EXPECT_EQ(a["content"][1]["input"]["a"], 1);
  EXPECT_EQ(a["stop_reason"], "tool_use");
  EXPECT_TRUE(a["stop_sequence"].is_null());
  EXPECT_EQ(a["usage"]["input_tokens"], 11);
  EXPECT_EQ(a["usage"]["output_tokens"], 5);
}

TEST(TranslateResponse, AnthropicUpstreamToOpenAIClient) {
  ChatResponse r = MustParseResponse(kAnthropic, R"({"id":"msg_1","type":"message","role":"assistant",
    "model":"claude-real","content":[{"type":"thinking","thinking":"x"},
    {"type":"tool_use","id":"toolu_5","name":"calc","input":{"expr":"1+1"}}],
    "stop_reason":"tool_use","stop_sequence":null,
    "usage":{"input_tokens":10,"cache_read_input_tokens":90,"output_tokens":3}})");
  EXPECT_EQ(r.usage.input_tokens, 100);  // cached prompt tokens count as prompt
  json o = J(BuildClientResponse(kOpenAI, r, "gpt-virtual"));
  EXPECT_EQ(o["object"], "chat.completion");
  EXPECT_EQ(o["model"], "gpt-virtual");
  EXPECT_GT(o["created"].get<int64_t>(), 0);
  const json& choice = o["choices"][0];
  EXPECT_EQ(choice["index"], 0);
  EXPECT_TRUE(choice["logprobs"].is_null());
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["role"], "assistant");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  EXPECT_EQ(choice["message"]["tool_calls"][0]["id"], "toolu_5");
  EXPECT_EQ(J(choice["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>())["expr"], "1+1");
  EXPECT_EQ(o["usage"]["prompt_tokens"], 100);
  EXPECT_EQ(o["usage"]["completion_tokens"], 3);
  EXPECT_EQ(o["usage"]["total_tokens"], 103);
}

TEST(TranslateResponse, GeminiUpstream) {
  ChatResponse r = MustParseResponse(kGemini, R"({"candidates":[{"content":{"role":"model","parts":[
    {"text":"thinking...","thought":true},{"text":"Checking "},{"text":"both."},
    {"functionCall":{"name":"get_weather","args":{"city":"Paris"}}},
    {"functionCall":{"name":"get_weather","args":{"city":"Rome"}}}]},"finishReason":"STOP","index":0}],
    "usageMetadata":{"promptTokenCount":20,"candidatesTokenCount":8,"thoughtsTokenCount":4,"totalTokenCount":32},
    "modelVersion":"gemini-2.5-flash","responseId":"resp-1"})");
  EXPECT_EQ(r.content, "Checking both.");
  EXPECT_EQ(r.finish, FinishReason::kToolCalls);  // STOP + functionCall parts
  ASSERT_EQ(r.tool_calls.size(), 2u);
  EXPECT_EQ(r.tool_calls[0].id, "call_0");
  EXPECT_EQ(r.tool_calls[1].id, "call_1");
  EXPECT_EQ(J(r.tool_calls[1].arguments_json)["city"], "Rome");
  EXPECT_EQ(r.usage.input_tokens, 20);
  EXPECT_EQ(r.usage.output_tokens, 12);
  EXPECT_EQ(r.id, "resp-1");
  EXPECT_EQ(r.model, "gemini-2.5-flash");

  EXPECT_EQ(MustParseResponse(kGemini, R"({"candidates":[{"content":{"parts":[{"text":"a"}]},"finishReason":"MAX_TOKENS"}]})").finish,
            FinishReason::kLength);
  ChatResponse safety = MustParseResponse(kGemini, R"({"candidates":[{"finishReason":"SAFETY"}]})");
  EXPECT_EQ(safety.finish, FinishReason::kContentFilter);
  EXPECT_EQ(safety.usage.input_tokens, -1);
  ChatResponse blocked = MustParseResponse(kGemini, R"({"promptFeedback":{"blockReason":"SAFETY"}})");
  EXPECT_EQ(blocked.finish, FinishReason::kContentFilter);
  EXPECT_EQ(J(BuildClientResponse(kOpenAI, blocked, "m"))["choices"][0]["finish_reason"], "content_filter");
}

TEST(TranslateResponse, UnknownUsageIsOmittedForOpenAIAndZeroForAnthropic) {
  ChatResponse r;
  r.content = "hi";
  r.finish = FinishReason::kStop;
  json o = J(BuildClientResponse(kOpenAI, r, "m"));
  EXPECT_FALSE(o.contains("usage"));
  EXPECT_EQ(o["choices"][0]["message"]["content"], "hi");
  EXPECT_FALSE(o["choices"][0]["message"].contains("tool_calls"));
  json a = J(BuildClientResponse(kAnthropic, r, "m"));
  EXPECT_EQ(a["usage"]["input_tokens"], 0);
  EXPECT_EQ(a["stop_reason"], "end_turn");
  r.finish = FinishReason::kNone;
  EXPECT_TRUE(J(BuildClientResponse(kOpenAI, r, "m"))["choices"][0]["finish_reason"].is_null());
}

TEST(TranslateResponse, CompletionsClientAndUpstream) {
  ChatResponse r;
  r.id = "abc";
  r.content = "the end";
  r.finish = FinishReason::kLength;
  r.usage = {3, 2};
  json c = J(BuildClientResponse(kCompletions, r, "m"));
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["id"], "cmpl-abc");
  EXPECT_EQ(c["choices"][0]["text"], "the end");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["usage"]["total_tokens"], 5);
  ChatResponse back = MustParseResponse(kCompletions, c.dump());
  EXPECT_EQ(back.content, "the end");
  EXPECT_EQ(back.finish, FinishReason::kLength);
}

// A response built in a format parses back to the same finish, text, calls and usage.
TEST(TranslateResponse, StopReasonAndUsageRoundTripEveryFormat) {
  for (WireFormat f : {kOpenAI, kAnthropic, kGemini}) {
    for (FinishReason finish : {FinishReason::kStop, FinishReason::kLength, FinishReason::kToolCalls,
                                FinishReason::kContentFilter}) {
      ChatResponse r;
      r.id = "id1";
      r.content = "text";
      r.finish = finish;
      r.usage = {7, 9};
      if (finish == FinishReason::kToolCalls) r.tool_calls = {{"call_0", "fn", R"({"k":[1,2]})"}};
      ChatResponse back = MustParseResponse(f, BuildClientResponse(f, r, "model-x"));
      EXPECT_EQ(back.finish, finish) << WireFormatName(f) << " " << static_cast<int>(finish);
      EXPECT_EQ(back.content, "text");
      EXPECT_EQ(back.usage.input_tokens, 7);
      EXPECT_EQ(back.usage.output_tokens, 9);
      EXPECT_EQ(back.model, "model-x");
      ASSERT_EQ(back.tool_calls.size(), r.tool_calls.size());
      if (!r.tool_calls.empty()) {
        EXPECT_EQ(back.tool_calls[0].name, "fn");
        EXPECT_EQ(J(back.tool_calls[0].arguments_json), J(r.tool_calls[0].arguments_json));
      }
    }
  }
}

TEST(TranslateResponse, UpstreamGarbageIsCorruption) {
  struct Case { WireFormat f; const char* body; const char* want; };
  const Case cases[] = {
      {kOpenAI, "not json", "malformed JSON"},
      {kOpenAI, R"({"choices":[{"message":{"content":"x"})", "malformed JSON"},
      {kOpenAI, R"({"choices":[]})", "choices"},
      {kOpenAI, R"({"error":{"message":"quota"}})", "quota"},
      {kOpenAI, R"({"choices":[{"message":{"content":5}}]})", "content"},
      {kAnthropic, R"({"type":"error","error":{"type":"api_error","message":"bad thing"}})", "bad thing"},
      {kAnthropic, R"({"id":"x","content":"nope"})", "content"},
      {kGemini, R"({"candidates":[]})", "candidates"},
      {kGemini, R"([1,2])", "object"},
  };
  for (const Case& c : cases) {
    auto r = ParseUpstreamResponse(c.f, c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << c.body;
    EXPECT_NE(r.status().message().find(c.want), std::string::npos) << r.status().message();
  }
}

// ---------------------------------------------------------------------------------------------
// Bad client input

struct BadCase {
  WireFormat format;
  std::string body;
  std::string field;  // the message must name it
};

TEST(TranslateBadInput, InvalidArgumentNamesTheField) {
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  const std::string amsgs = R"("max_tokens":10,"messages":[{"role":"user","content":"hi"}])";
  const std::vector<BadCase> cases = {
      {kOpenAI, "{\"model\":", "malformed JSON"},
      {kOpenAI, "[1]", "expected a JSON object"},
      {kOpenAI, "", "malformed JSON"},
      {kOpenAI, "{" + msgs + "}", "model: required"},
      {kOpenAI, R"({"model":5,)" + msgs + "}", "model: expected a string"},
      {kOpenAI, R"({"model":"m"})", "messages: required"},
      {kOpenAI, R"({"model":"m","messages":[]})", "messages: must not be empty"},
      {kOpenAI, R"({"model":"m","messages":{}})", "messages: expected an array"},
      {kOpenAI, R"({"model":"m","messages":[{"role":"system","content":"s"}]})", "messages: at least one"},
      {kOpenAI, R"({"model":"m","messages":["hi"]})", "messages[0]: expected an object"},
      {kOpenAI, R"({"model":"m","messages":[{"content":"hi"}]})", "messages[0].role: required"},
      {kOpenAI, R"({"model":"m","messages":[{"role":"robot","content":"hi"}]})", "messages[0].role"},
      {kOpenAI, R"({"model":"m","messages":[{"role":"user","content":5}]})", "messages[0].content"},
      {kOpenAI, R"({"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]})",
       "messages[1].content[0].type: only text parts are supported"},
      {kOpenAI, R"({"model":"m","messages":[{"role":"tool","content":"r"}]})", "messages[0].tool_call_id: required"},
      {kOpenAI, R"({"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"arguments":"{}"}}]}]})",
       "messages[0].tool_calls[0].function.name: required"},
      {kOpenAI, R"({"model":"m","max_tokens":"10",)" + msgs + "}", "max_tokens: expected a positive integer"},
      {kOpenAI, R"({"model":"m","max_tokens":-1,)" + msgs + "}", "max_tokens: expected a positive integer"},
      {kOpenAI, R"({"model":"m","max_completion_tokens":1.5,)" + msgs + "}", "max_completion_tokens: expected a positive integer"},
      {kOpenAI, R"({"model":"m","temperature":"hot",)" + msgs + "}", "temperature: expected a number"},
      {kOpenAI, R"({"model":"m","seed":"7",)" + msgs + "}", "seed: expected an integer"},
      {kOpenAI, R"({"model":"m","seed":1.5,)" + msgs + "}", "seed: expected an integer"},
      {kOpenAI, R"({"model":"m","seed":18446744073709551615,)" + msgs + "}", "seed: expected an integer"},
      {kOpenAI, R"({"model":"m","stop":5,)" + msgs + "}", "stop: expected a string or an array"},
      {kOpenAI, R"({"model":"m","stop":["a",1],)" + msgs + "}", "stop[1]: expected a string"},
      {kOpenAI, R"({"model":"m","stream":"yes",)" + msgs + "}", "stream: expected true or false"},
      {kOpenAI, R"({"model":"m","stream_options":{"include_usage":1},)" + msgs + "}", "stream_options.include_usage"},
      {kOpenAI, R"({"model":"m","n":2,)" + msgs + "}", "n: only 1"},
      {kOpenAI, R"({"model":"m","logprobs":true,)" + msgs + "}", "logprobs: not supported"},
      {kOpenAI, R"({"model":"m","logprobs":false,"top_logprobs":2,)" + msgs + "}", "top_logprobs: not supported"},
      {kCompletions, R"({"model":"m","prompt":"a","logprobs":0})", "logprobs: not supported"},
      // Fields that change the answer and are not carried: refused, not dropped with a 200.
      {kOpenAI, R"({"model":"m","functions":[{"name":"f","parameters":{}}],)" + msgs + "}", "functions: the legacy functions form"},
      {kOpenAI, R"({"model":"m","function_call":"auto",)" + msgs + "}", "function_call: the legacy functions form"},
      {kOpenAI, R"({"model":"m","modalities":["text","audio"],"audio":{"voice":"alloy","format":"wav"},)" + msgs + "}",
       "modalities: only"},
      {kOpenAI, R"({"model":"m","audio":{"voice":"alloy","format":"wav"},)" + msgs + "}", "audio: not supported"},
      {kOpenAI, R"({"model":"m","web_search_options":{},)" + msgs + "}", "web_search_options: not supported"},
      {kOpenAI, R"({"model":"m","prediction":{"type":"content","content":"x"},)" + msgs + "}", "prediction: not supported"},
      {kCompletions, R"({"model":"m","prompt":"a","echo":true})", "echo: not supported"},
      {kCompletions, R"({"model":"m","prompt":"a","suffix":"end"})", "suffix: not supported"},
      {kCompletions, R"({"model":"m","prompt":"a","best_of":3})", "best_of: only 1"},
      {kOpenAI, R"({"model":"m","tools":{},)" + msgs + "}", "tools: expected an array"},
      {kOpenAI, R"({"model":"m","tools":[{"type":"web_search"}],)" + msgs + "}", "tools[0].type"},
      {kOpenAI, R"({"model":"m","tools":[{"type":"function","function":{"name":"f","parameters":[]}}],)" + msgs + "}",
       "tools[0].function.parameters: expected a JSON object"},
      {kOpenAI, R"({"model":"m","tool_choice":"always",)" + msgs + "}", "tool_choice"},
      {kOpenAI, R"({"model":"m","tool_choice":{"type":"function"},)" + msgs + "}", "tool_choice.function"},
      {kCompletions, R"({"model":"m"})", "prompt: required"},
      {kCompletions, R"({"model":"m","prompt":["a","b"]})", "prompt: expected a string or an array of exactly one"},
      {kCompletions, R"({"model":"m","prompt":[1,2,3]})", "prompt"},
      {kCompletions, R"({"model":"m","prompt":7})", "prompt"},
      {kAnthropic, R"({"model":"m",)" + msgs + "}", "max_tokens: required"},
      {kAnthropic, R"({"model":"m","max_tokens":0,)" + msgs + "}", "max_tokens: expected a positive integer"},
      {kAnthropic, R"({"model":"m","max_tokens":10,"messages":[]})", "messages: must not be empty"},
      {kAnthropic, R"({"model":"m","max_tokens":10,"messages":[{"role":"system","content":"x"}]})", "messages[0].role"},
      {kAnthropic, R"({"model":"m","max_tokens":10,"messages":[{"role":"user"}]})", "messages[0].content: required"},
      {kAnthropic, R"({"model":"m","max_tokens":10,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]})",
       "messages[0].content[0].type"},
      {kAnthropic, R"({"model":"m","max_tokens":10,"messages":[{"role":"assistant","content":[{"type":"tool_result","tool_use_id":"x"}]}]})",
       "messages[0].content[0].type"},
      {kAnthropic, R"({"model":"m","max_tokens":10,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":"x"}]}]})",
       "messages[0].content[0].input: expected a JSON object"},
      {kAnthropic, R"({"model":"m","max_tokens":10,"messages":[{"role":"user","content":[{"type":"tool_result"}]}]})",
       "messages[0].content[0].tool_use_id: required"},
      {kAnthropic, R"({"model":"m","system":[{"type":"image"}],)" + amsgs + "}", "system[0].type"},
      {kAnthropic, R"({"model":"m","stop_sequences":"x",)" + amsgs + "}", "stop_sequences: expected an array"},
      {kAnthropic, R"({"model":"m","tools":[{"description":"d"}],)" + amsgs + "}", "tools[0].name: required"},
      {kAnthropic, R"({"model":"m","tools":[{"type":"web_search_20250305","name":"web"}],)" + amsgs + "}", "tools[0].type"},
      {kAnthropic, R"({"model":"m","tool_choice":{"type":"tool"},)" + amsgs + "}", "tool_choice.name: required"},
      {kAnthropic, R"({"model":"m","tool_choice":"auto",)" + amsgs + "}", "tool_choice: expected an object"},
      {kAnthropic, R"({"model":"m","metadata":{"user_id":3},)" + amsgs + "}", "metadata.user_id"},
      {kGemini, R"({"contents":[]})", "contents: must not be empty"},  // the Gemini front's parser
  };
  for (const BadCase& c : cases) {
    auto r = ParseClientRequest(c.format, c.body);
    ASSERT_FALSE(r.ok()) << WireFormatName(c.format) << " " << c.body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.body;
    EXPECT_NE(r.status().message().find(c.field), std::string::npos)
        << "message: " << r.status().message() << "\nwant: " << c.field;
  }
}

// Clients that send the "off" values of fields the gateway refuses (many SDKs send defaults)
// are served.
TEST(TranslateBadInput, OffValuesOfRefusedFieldsPass) {
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  for (const std::string& extra : {R"("logprobs":false,)", R"("logprobs":null,"top_logprobs":null,)", R"("n":1,)",
                                   R"("modalities":["text"],)", R"("functions":null,"audio":null,"prediction":null,)"}) {
    auto r = ParseClientRequest(WireFormat::kOpenAIChat, R"({"model":"m",)" + extra + msgs + "}");
    EXPECT_TRUE(r.ok()) << extra << ": " << r.status().ToString();
  }
  auto c = ParseClientRequest(WireFormat::kOpenAICompletions, R"({"model":"m","prompt":"a","logprobs":null})");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  c = ParseClientRequest(WireFormat::kOpenAICompletions,
                         R"({"model":"m","prompt":"a","echo":false,"suffix":null,"best_of":1})");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
}

TEST(TranslateBadInput, OversizedArraysAndDeepNesting) {
  json big = {{"model", "m"}, {"messages", json::array()}};
  for (int i = 0; i < 10001; ++i) big["messages"].push_back({{"role", "user"}, {"content", "x"}});
  auto r = ParseOpenAIChatRequest(big.dump());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("messages: at most 10000"), std::string::npos) << r.status().message();
  big["max_tokens"] = 5;
  auto a = ParseAnthropicMessagesRequest(big.dump());
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("messages: at most"), std::string::npos);

  big["messages"].erase(big["messages"].begin() + 100, big["messages"].end());  // inside the bound
  EXPECT_TRUE(ParseOpenAIChatRequest(big.dump()).ok());

  json stops = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}, {"stop", json::array()}};
  for (int i = 0; i < 65; ++i) stops["stop"].push_back("s");
  auto s = ParseOpenAIChatRequest(stops.dump());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("stop: at most"), std::string::npos);

  std::string deep = R"({"model":"m","messages":[{"role":"user","content":"x"}],"x":)" +
                     std::string(100000, '[') + std::string(100000, ']') + "}";
  auto d = ParseOpenAIChatRequest(deep);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("nested deeper"), std::string::npos);
  // A flat array past the value bound is refused before it is parsed.
  std::string flat = R"({"model":"m","messages":[{"role":"user","content":"x"}],"x":[)";
  for (int i = 0; i < (1 << 20); ++i) flat += "0,";
  flat += "0]}";
  auto f = ParseOpenAIChatRequest(flat);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("request body: JSON has more than 1048576 values"), std::string::npos)
      << f.status().message();
  // Brackets inside strings do not count.
  std::string quoted = R"({"model":"m","messages":[{"role":"user","content":")" + std::string(500, '[') + R"("}]})";
  auto q = ParseOpenAIChatRequest(quoted);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->messages[0].content.size(), 500u);
}

TEST(TranslateBadInput, AcceptsIntegralDoublesAndNulls) {
  ChatRequest r = MustParse(kOpenAI, J(R"({"model":"m","max_tokens":16.0,"temperature":null,"stop":null,
    "messages":[{"role":"user","content":"x"}]})"));
  EXPECT_EQ(r.max_tokens, 16);
  EXPECT_FALSE(r.temperature.has_value());
  EXPECT_TRUE(r.stop.empty());
}

// ---------------------------------------------------------------------------------------------
// Sampling and structured-output fields: parsed, carried or translated per upstream, or refused

// An OpenAI chat request with every sampling/structured-output field the gateway carries.
json OpenAISamplingRequest() {
  return J(R"({
    "model": "gpt-virtual",
    "messages": [{"role": "user", "content": "Weather?"}],
    "tools": [{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    "top_k": 40, "presence_penalty": 0.5, "frequency_penalty": -1.25,
    "logit_bias": {"50256": -100, "15": 2.5},
    "parallel_tool_calls": false,
    "response_format": {"type": "json_schema", "json_schema": {"name": "weather_report", "strict": true,
      "description": "A report",
      "schema": {"type": "object", "properties": {"temp": {"type": "number"}}, "required": ["temp"],
                 "additionalProperties": false}}}
  })");
}

const json kWeatherSchema = J(R"({"type":"object","properties":{"temp":{"type":"number"}},"required":["temp"],
                                  "additionalProperties":false})");

// The request minus the fields `drop` names, so each upstream's refusal can be checked alone.
ChatRequest Without(ChatRequest r, const std::vector<std::string>& drop) {
  for (const std::string& f : drop) {
    if (f == "presence_penalty") r.presence_penalty.reset();
    if (f == "frequency_penalty") r.frequency_penalty.reset();
    if (f == "logit_bias") r.logit_bias_json.clear();
    if (f == "parallel_tool_calls") r.parallel_tool_calls.reset();
    if (f == "response_format") r.response_format.reset();
  }
  return r;
}

std::optional<ResponseFormat::Kind> FormatKind(const ChatRequest& r) {
  return r.response_format ? std::optional(r.response_format->kind) : std::nullopt;
}

void ExpectRefused(WireFormat upstream, const ChatRequest& r, const std::string& field) {
  auto built = BuildUpstreamRequest(upstream, r, "m");
  ASSERT_FALSE(built.ok()) << WireFormatName(upstream) << " accepted " << field;
  EXPECT_EQ(built.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = built.status().message();
  EXPECT_EQ(m.rfind(field + ":", 0), 0u) << m;  // names the field first
  EXPECT_NE(m.find(WireFormatName(upstream)), std::string::npos) << m;  // and the upstream
}

TEST(TranslateSampling, OpenAIParsesEveryField) {
  ChatRequest r = MustParse(kOpenAI, OpenAISamplingRequest());
  EXPECT_EQ(r.top_k, 40);
  EXPECT_EQ(r.presence_penalty, 0.5);
  EXPECT_EQ(r.frequency_penalty, -1.25);
  EXPECT_EQ(J(r.logit_bias_json), J(R"({"50256":-100,"15":2.5})"));
  EXPECT_EQ(r.parallel_tool_calls, false);
  ASSERT_TRUE(r.response_format.has_value());
  EXPECT_EQ(r.response_format->kind, ResponseFormat::Kind::kJsonSchema);
  EXPECT_EQ(r.response_format->name, "weather_report");
  EXPECT_TRUE(r.response_format->strict);
  EXPECT_EQ(J(r.response_format->schema_json), kWeatherSchema);

  json body = OpenAISamplingRequest();
  body["response_format"] = {{"type", "json_object"}};
  body["logit_bias"] = json::object();  // empty: nothing to bias
  body.erase("parallel_tool_calls");
  ChatRequest o = MustParse(kOpenAI, body);
  EXPECT_EQ(FormatKind(o), ResponseFormat::Kind::kJsonObject);
  EXPECT_TRUE(o.logit_bias_json.empty());
  EXPECT_FALSE(o.parallel_tool_calls.has_value());
  body["response_format"] = {{"type", "text"}};
  EXPECT_EQ(FormatKind(MustParse(kOpenAI, body)), ResponseFormat::Kind::kText);
  body.erase("response_format");
  EXPECT_FALSE(MustParse(kOpenAI, body).response_format.has_value());

  // Completions clients share the sampling fields.
  ChatRequest c = MustParse(kCompletions, J(R"({"model":"m","prompt":"p","presence_penalty":1,
                                                "frequency_penalty":2,"logit_bias":{"7":1},"top_k":3})"));
  EXPECT_EQ(c.presence_penalty, 1);
  EXPECT_EQ(c.frequency_penalty, 2);
  EXPECT_EQ(J(c.logit_bias_json), J(R"({"7":1})"));
  EXPECT_EQ(c.top_k, 3);
}

TEST(TranslateSampling, OpenAIUpstreamCarriesEveryField) {
  ChatRequest r = MustParse(kOpenAI, OpenAISamplingRequest());
  ASSERT_TRUE(r.response_format.has_value());
  json up = J(Up(kOpenAI, r, "gpt-4o"));
  EXPECT_EQ(up["top_k"], 40);  // keel serve reads it; OpenAI answers its own 400
  EXPECT_EQ(up["presence_penalty"], 0.5);
  EXPECT_EQ(up["frequency_penalty"], -1.25);
  EXPECT_EQ(up["logit_bias"], J(R"({"50256":-100,"15":2.5})"));
  EXPECT_EQ(up["parallel_tool_calls"], false);
  EXPECT_EQ(up["response_format"], json({{"type", "json_schema"},
                                         {"json_schema", {{"name", "weather_report"}, {"strict", true},
                                                          {"schema", kWeatherSchema}}}}));
  // And it parses back to the same request.
  ChatRequest back = MustParse(kOpenAI, up);
  EXPECT_EQ(back.presence_penalty, r.presence_penalty);
  EXPECT_EQ(J(back.logit_bias_json), J(r.logit_bias_json));
  ASSERT_TRUE(back.response_format.has_value());
  EXPECT_EQ(back.response_format->name, "weather_report");

  r.response_format->kind = ResponseFormat::Kind::kJsonObject;
  EXPECT_EQ(J(Up(kOpenAI, r, "m"))["response_format"], json({{"type", "json_object"}}));
  // parallel_tool_calls only goes with tools (OpenAI refuses it without).
  r.tools.clear();
  EXPECT_FALSE(J(Up(kOpenAI, r, "m")).contains("parallel_tool_calls"));

  // Legacy completions upstream: sampling fields carried, structured output refused.
  json comp = J(Up(kCompletions, Without(r, {"response_format"}), "m"));
  EXPECT_EQ(comp["presence_penalty"], 0.5);
  EXPECT_EQ(comp["frequency_penalty"], -1.25);
  EXPECT_EQ(comp["logit_bias"]["50256"], -100);
  ExpectRefused(kCompletions, r, "response_format");
}

TEST(TranslateSampling, AnthropicUpstreamTranslatesOrRefuses) {
  ChatRequest r = MustParse(kOpenAI, OpenAISamplingRequest());
  ASSERT_TRUE(r.response_format.has_value());
  ExpectRefused(kAnthropic, r, "presence_penalty");
  ExpectRefused(kAnthropic, Without(r, {"presence_penalty"}), "frequency_penalty");
  ExpectRefused(kAnthropic, Without(r, {"presence_penalty", "frequency_penalty"}), "logit_bias");
  ChatRequest ok = Without(r, {"presence_penalty", "frequency_penalty", "logit_bias"});
  json up = J(Up(kAnthropic, ok, "claude-x"));
  EXPECT_EQ(up["top_k"], 40);
  EXPECT_EQ(up["tool_choice"], J(R"({"type":"auto","disable_parallel_tool_use":true})"));
  EXPECT_EQ(up["output_config"], json({{"format", {{"type", "json_schema"}, {"schema", kWeatherSchema}}}}));
  EXPECT_FALSE(up.contains("response_format"));
  ok.tool_choice = "required";
  EXPECT_EQ(J(Up(kAnthropic, ok, "c"))["tool_choice"], J(R"({"type":"any","disable_parallel_tool_use":true})"));
  ok.tool_choice = "get_weather";
  EXPECT_EQ(J(Up(kAnthropic, ok, "c"))["tool_choice"],
            J(R"({"type":"tool","name":"get_weather","disable_parallel_tool_use":true})"));
  ok.tool_choice = "none";  // no calls at all: nothing to disable
  EXPECT_EQ(J(Up(kAnthropic, ok, "c"))["tool_choice"], J(R"({"type":"none"})"));
  ok.tool_choice.clear();
  ok.parallel_tool_calls = true;  // the default: omitted, never refused
  EXPECT_FALSE(J(Up(kAnthropic, ok, "c")).contains("tool_choice"));

  // JSON without a schema has no Anthropic equivalent; text is the default.
  ok.response_format->kind = ResponseFormat::Kind::kJsonObject;
  ExpectRefused(kAnthropic, ok, "response_format");
  ok.response_format->kind = ResponseFormat::Kind::kText;
  EXPECT_FALSE(J(Up(kAnthropic, ok, "c")).contains("output_config"));

  // Zero penalties ask for nothing (SDKs send them as defaults).
  ok.presence_penalty = 0;
  ok.frequency_penalty = 0;
  EXPECT_TRUE(BuildUpstreamRequest(kAnthropic, ok, "c").ok());
}

TEST(TranslateSampling, GeminiUpstreamTranslatesOrRefuses) {
  ChatRequest r = MustParse(kOpenAI, OpenAISamplingRequest());
  ASSERT_TRUE(r.response_format.has_value());
  ExpectRefused(kGemini, r, "logit_bias");
  ExpectRefused(kGemini, Without(r, {"logit_bias"}), "parallel_tool_calls");
  ChatRequest ok = Without(r, {"logit_bias", "parallel_tool_calls"});
  json gen = J(Up(kGemini, ok, "g"))["generationConfig"];
  EXPECT_EQ(gen["topK"], 40);
  EXPECT_EQ(gen["presencePenalty"], 0.5);
  EXPECT_EQ(gen["frequencyPenalty"], -1.25);
  EXPECT_EQ(gen["responseMimeType"], "application/json");
  EXPECT_EQ(gen["responseJsonSchema"], kWeatherSchema);

  ok.response_format->kind = ResponseFormat::Kind::kJsonObject;
  gen = J(Up(kGemini, ok, "g"))["generationConfig"];
  EXPECT_EQ(gen["responseMimeType"], "application/json");
  EXPECT_FALSE(gen.contains("responseJsonSchema"));
  ok.response_format->kind = ResponseFormat::Kind::kText;
  ok.presence_penalty = 0;  // zero penalties are not sent: some Gemini models refuse the fields
  gen = J(Up(kGemini, ok, "g"))["generationConfig"];
  EXPECT_FALSE(gen.contains("responseMimeType"));
  EXPECT_FALSE(gen.contains("presencePenalty"));

  // parallel_tool_calls false only matters when a call can happen.
  ok.parallel_tool_calls = false;
  ok.tool_choice = "none";
  EXPECT_TRUE(BuildUpstreamRequest(kGemini, ok, "g").ok());
  ok.tool_choice.clear();
  ok.tools.clear();
  EXPECT_TRUE(BuildUpstreamRequest(kGemini, ok, "g").ok());
  ChatRequest parallel = Without(r, {"logit_bias"});
  parallel.parallel_tool_calls = true;  // the default: omitted, never refused
  EXPECT_TRUE(BuildUpstreamRequest(kGemini, parallel, "g").ok());
}

json AnthropicSamplingRequest() {
  return J(R"({
    "model": "claude-virtual", "max_tokens": 64,
    "messages": [{"role": "user", "content": "Weather?"}],
    "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
    "top_k": 5, "stop_sequences": ["###"],
    "output_config": {"format": {"type": "json_schema",
      "schema": {"type": "object", "properties": {"temp": {"type": "number"}}, "required": ["temp"],
                 "additionalProperties": false}}}
  })");
}

TEST(TranslateSampling, AnthropicClientFields) {
  ChatRequest r = MustParse(kAnthropic, AnthropicSamplingRequest());
  EXPECT_EQ(r.top_k, 5);
  EXPECT_EQ(r.stop, std::vector<std::string>{"###"});
  EXPECT_EQ(r.parallel_tool_calls, false);
  EXPECT_EQ(r.tool_choice, "auto");
  ASSERT_TRUE(r.response_format.has_value());
  EXPECT_EQ(r.response_format->kind, ResponseFormat::Kind::kJsonSchema);
  EXPECT_EQ(J(r.response_format->schema_json), kWeatherSchema);

  // Anthropic -> Anthropic: the same fields in the same places.
  json up = J(Up(kAnthropic, r, "claude-real"));
  EXPECT_EQ(up["top_k"], 5);
  EXPECT_EQ(up["stop_sequences"], json::array({"###"}));
  EXPECT_EQ(up["tool_choice"], J(R"({"type":"auto","disable_parallel_tool_use":true})"));
  EXPECT_EQ(up["output_config"]["format"]["schema"], kWeatherSchema);

  // Anthropic -> OpenAI: a schema name is made up (OpenAI requires one); Anthropic's is strict.
  json o = J(Up(kOpenAI, r, "gpt"));
  EXPECT_EQ(o["response_format"]["json_schema"]["name"], "response");
  EXPECT_EQ(o["response_format"]["json_schema"]["strict"], true);
  EXPECT_EQ(o["response_format"]["json_schema"]["schema"], kWeatherSchema);
  EXPECT_EQ(o["parallel_tool_calls"], false);
  EXPECT_EQ(o["top_k"], 5);

  // Anthropic -> Gemini.
  json g = J(Up(kGemini, Without(r, {"parallel_tool_calls"}), "g"))["generationConfig"];
  EXPECT_EQ(g["topK"], 5);
  EXPECT_EQ(g["responseJsonSchema"], kWeatherSchema);

  // The earlier beta's top-level output_format is read the same way.
  json legacy = AnthropicSamplingRequest();
  legacy["output_format"] = legacy["output_config"]["format"];
  legacy.erase("output_config");
  legacy["tool_choice"]["disable_parallel_tool_use"] = false;
  ChatRequest l = MustParse(kAnthropic, legacy);
  ASSERT_TRUE(l.response_format.has_value());
  EXPECT_EQ(J(l.response_format->schema_json), kWeatherSchema);
  EXPECT_EQ(l.parallel_tool_calls, true);
}

TEST(TranslateBadInput, SamplingAndStructuredOutputValues) {
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  const std::string amsgs = R"("max_tokens":10,"messages":[{"role":"user","content":"hi"}])";
  auto openai = [&](const std::string& field) { return R"({"model":"m",)" + field + "," + msgs + "}"; };
  auto anthropic = [&](const std::string& field) { return R"({"model":"m",)" + field + "," + amsgs + "}"; };
  std::string many_biases = R"("logit_bias":{)";
  for (int i = 0; i < 301; ++i) many_biases += (i ? ",\"" : "\"") + std::to_string(i) + "\":1";
  many_biases += "}";
  const std::vector<BadCase> cases = {
      {kOpenAI, openai(R"("presence_penalty":2.5)"), "presence_penalty: expected a number between -2 and 2"},
      {kOpenAI, openai(R"("presence_penalty":"0")"), "presence_penalty: expected a number"},
      {kOpenAI, openai(R"("frequency_penalty":-2.01)"), "frequency_penalty: expected a number between -2 and 2"},
      {kCompletions, R"({"model":"m","prompt":"p","frequency_penalty":3})", "frequency_penalty"},
      {kOpenAI, openai(R"("logit_bias":[1])"), "logit_bias: expected an object"},
      {kOpenAI, openai(R"("logit_bias":{"abc":1})"), "logit_bias: keys must be token ids"},
      {kOpenAI, openai(R"("logit_bias":{"-5":1})"), "logit_bias: keys must be token ids"},
      {kOpenAI, openai(R"("logit_bias":{"5":101})"), "logit_bias.5: expected a number between -100 and 100"},
      {kOpenAI, openai(R"("logit_bias":{"5":"1"})"), "logit_bias.5: expected a number"},
      {kOpenAI, openai(R"("logit_bias":{"5":null})"), "logit_bias.5: expected a number"},
      {kOpenAI, openai(many_biases), "logit_bias: at most 300 entries"},
      {kOpenAI, openai(R"("top_k":0)"), "top_k: expected a positive integer"},
      {kOpenAI, openai(R"("parallel_tool_calls":"no")"), "parallel_tool_calls: expected true or false"},
      {kOpenAI, openai(R"("response_format":"json")"), "response_format: expected an object"},
      {kOpenAI, openai(R"("response_format":{})"), "response_format.type: required"},
      {kOpenAI, openai(R"("response_format":{"type":"xml"})"), "response_format.type: expected text, json_object or json_schema"},
      {kOpenAI, openai(R"("response_format":{"type":"json_schema"})"), "response_format.json_schema: required"},
      {kOpenAI, openai(R"("response_format":{"type":"json_schema","json_schema":[]})"), "response_format.json_schema: expected an object"},
      {kOpenAI, openai(R"("response_format":{"type":"json_schema","json_schema":{"schema":{}}})"),
       "response_format.json_schema.name: required"},
      {kOpenAI, openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"a b","schema":{}}})"),
       "response_format.json_schema.name: expected 1 to 64 letters"},
      {kOpenAI, openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"s","schema":"{}"}})"),
       "response_format.json_schema.schema: expected a JSON object"},
      {kOpenAI, openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"s","strict":1}})"),
       "response_format.json_schema.strict: expected true or false"},
      {kAnthropic, anthropic(R"("top_k":0)"), "top_k: expected a positive integer"},
      {kAnthropic, anthropic(R"("top_k":"5")"), "top_k: expected a positive integer"},
      {kAnthropic, anthropic(R"("top_k":2.5)"), "top_k: expected a positive integer"},
      {kAnthropic, anthropic(R"("tool_choice":{"type":"auto","disable_parallel_tool_use":"yes"})"),
       "tool_choice.disable_parallel_tool_use: expected true or false"},
      {kAnthropic, anthropic(R"("output_config":[])"), "output_config: expected an object"},
      {kAnthropic, anthropic(R"("output_config":{"effort":"high"})"), "output_config: only format is supported"},
      {kAnthropic, anthropic(R"("output_config":{"format":"json"})"), "output_config.format: expected an object"},
      {kAnthropic, anthropic(R"("output_config":{"format":{"type":"xml","schema":{}}})"),
       "output_config.format.type: expected json_schema"},
      {kAnthropic, anthropic(R"("output_config":{"format":{"type":"json_schema"}})"), "output_config.format.schema: required"},
      {kAnthropic, anthropic(R"("output_config":{"format":{"type":"json_schema","schema":[]}})"),
       "output_config.format.schema: expected a JSON object"},
      {kAnthropic, anthropic(R"("output_format":{"schema":{}})"), "output_format.type: required"},
      {kAnthropic,
       anthropic(R"("output_config":{"format":{"type":"json_schema","schema":{}}},"output_format":{"type":"json_schema","schema":{}})"),
       "output_format: send output_config.format or output_format, not both"},
  };
  for (const BadCase& c : cases) {
    auto r = ParseClientRequest(c.format, c.body);
    ASSERT_FALSE(r.ok()) << WireFormatName(c.format) << " " << c.body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.body;
    EXPECT_NE(r.status().message().find(c.field), std::string::npos)
        << "message: " << r.status().message() << "\nwant: " << c.field;
  }
  // The bounds themselves pass.
  for (const char* field : {R"("presence_penalty":-2,"frequency_penalty":2)", R"("logit_bias":{"0":-100,"9":100})"}) {
    auto r = ParseClientRequest(kOpenAI, openai(field));
    EXPECT_TRUE(r.ok()) << field << ": " << r.status().ToString();
  }
}

// ---------------------------------------------------------------------------------------------
// Stop sequences: which one matched reaches Anthropic clients when the upstream says

TEST(TranslateStopSequence, AnthropicUpstreamToAnthropicClient) {
  ChatResponse r = MustParseResponse(kAnthropic, R"({"id":"msg_s","type":"message","role":"assistant",
    "model":"claude-real","content":[{"type":"text","text":"one two"}],
    "stop_reason":"stop_sequence","stop_sequence":"###","usage":{"input_tokens":4,"output_tokens":2}})");
  EXPECT_EQ(r.finish, FinishReason::kStop);
  EXPECT_EQ(r.stop_sequence, "###");
  json a = J(BuildClientResponse(kAnthropic, r, "claude-virtual"));
  EXPECT_EQ(a["stop_reason"], "stop_sequence");
  EXPECT_EQ(a["stop_sequence"], "###");
  // Other clients have no such field: a plain stop.
  EXPECT_EQ(J(BuildClientResponse(kOpenAI, r, "gpt"))["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(J(BuildClientResponse(kGemini, r, "g"))["candidates"][0]["finishReason"], "STOP");

  // A natural end, and an upstream that does not say which sequence matched (OpenAI, keel serve).
  ChatResponse end = MustParseResponse(kAnthropic, R"({"content":[{"type":"text","text":"x"}],
    "stop_reason":"end_turn","stop_sequence":null})");
  EXPECT_TRUE(end.stop_sequence.empty());
  json e = J(BuildClientResponse(kAnthropic, end, "c"));
  EXPECT_EQ(e["stop_reason"], "end_turn");
  EXPECT_TRUE(e["stop_sequence"].is_null());
  ChatResponse o = MustParseResponse(kOpenAI, R"({"choices":[{"message":{"content":"x"},"finish_reason":"stop"}]})");
  EXPECT_EQ(J(BuildClientResponse(kAnthropic, o, "c"))["stop_reason"], "end_turn");
  // A sequence with another finish reason is not reported as the reason.
  r.finish = FinishReason::kLength;
  json l = J(BuildClientResponse(kAnthropic, r, "c"));
  EXPECT_EQ(l["stop_reason"], "max_tokens");
  EXPECT_TRUE(l["stop_sequence"].is_null());
}

// ---------------------------------------------------------------------------------------------
// The readers OpenAI chat shares with the Responses front (response format, tool_choice, function
// tools, call arguments) give OpenAI chat's field paths, word for word.

TEST(TranslateBadInput, SharedReadersGiveChatCompletionsPathsExactly) {
  auto openai = [](const std::string& fields) {
    return R"({"model":"m","messages":[{"role":"user","content":"hi"}],)" + fields + "}";
  };
  auto call = [](const std::string& function) {
    return R"({"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":)" +
           function + "}]}]}";
  };
  std::string many_parts = R"({"type":"text","text":"a"})";
  for (int i = 0; i < 10000; ++i) many_parts += R"(,{"type":"text","text":"a"})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {openai(R"("response_format":"json")"), "response_format: expected an object"},
      {openai(R"("response_format":{"type":5})"), "response_format.type: expected a string"},
      {openai(R"("response_format":{"type":"xml"})"), "response_format.type: expected text, json_object or json_schema"},
      {openai(R"("response_format":{"type":"json_schema"})"), "response_format.json_schema: required"},
      {openai(R"("response_format":{"type":"json_schema","json_schema":"s"})"),
       "response_format.json_schema: expected an object"},
      {openai(R"("response_format":{"type":"json_schema","json_schema":{"name":""}})"),
       "response_format.json_schema.name: must not be empty"},
      {openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"a.b"}})"),
       "response_format.json_schema.name: expected 1 to 64 letters, digits, '_' or '-'"},
      {openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"s","description":5}})"),
       "response_format.json_schema.description: expected a string"},
      {openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"s","schema":[]}})"),
       "response_format.json_schema.schema: expected a JSON object"},
      {openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"s","strict":"yes"}})"),
       "response_format.json_schema.strict: expected true or false"},
      {openai(R"("tool_choice":"any")"), "tool_choice: expected auto, none, required or an object"},
      {openai(R"("tool_choice":5)"), "tool_choice: expected a string or an object"},
      {openai(R"("tool_choice":{"type":"function","function":"f"})"), "tool_choice.function: expected an object"},
      {openai(R"("tool_choice":{"type":"function","function":{}})"), "tool_choice.function.name: required"},
      {openai(R"("tools":[{"type":"function"}])"), "tools[0].function: expected an object"},
      {openai(R"("tools":[{"type":"function","function":{"description":"d"}}])"), "tools[0].function.name: required"},
      {openai(R"("tools":[{"type":"function","function":{"name":"f","description":5}}])"),
       "tools[0].function.description: expected a string"},
      {openai(R"("tools":[{"type":"function","function":{"name":"f","parameters":"{}"}}])"),
       "tools[0].function.parameters: expected a JSON object"},
      {call(R"({"name":"f","arguments":5})"), "messages[0].tool_calls[0].function.arguments: expected a string"},
      {R"({"model":"m","messages":[{"role":"user","content":5}]})",
       "messages[0].content: expected a string or an array of parts"},
      {R"({"model":"m","messages":[{"role":"user","content":["hi"]}]})", "messages[0].content[0]: expected an object"},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]})", "messages[0].content[0].text: required"},
      {R"({"model":"m","messages":[{"role":"user","content":[)" + many_parts + "]}]}",
       "messages[0].content: at most 10000 parts"},
  };
  for (const auto& [body, message] : cases) {
    auto r = ParseClientRequest(kOpenAI, body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(r.status().message(), message) << body;
  }
  // What they accept: a schema may be left out (OpenAI's is optional); arguments sent as an
  // object are kept as its text; string tool_choice values pass as they are.
  auto r = ParseClientRequest(kOpenAI, openai(R"("response_format":{"type":"json_schema","json_schema":{"name":"s"}})"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->response_format.has_value());
  EXPECT_EQ(r->response_format->kind, ResponseFormat::Kind::kJsonSchema);
  EXPECT_EQ(r->response_format->schema_json, "{}");
  EXPECT_FALSE(r->response_format->strict);
  r = ParseClientRequest(kOpenAI, R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},)"
                                  R"({"type":"text","text":"b"}]}]})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->messages[0].content, "ab");
  r = ParseClientRequest(kOpenAI, call(R"({"name":"f","arguments":{"a":1}})"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->messages[0].tool_calls[0].arguments_json, R"({"a":1})");
  for (const char* choice : {"auto", "none", "required"}) {
    r = ParseClientRequest(kOpenAI, openai(std::string(R"("tool_choice":")") + choice + "\""));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tool_choice, choice);
  }
}

}  // namespace
}  // namespace keel::gateway
