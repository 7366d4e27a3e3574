// FakeVendor over real loopback HTTP: every test starts a fake in-process and talks to it with the
// raw-socket test client (tests/core/http_test_client.h), which parses responses itself, then
// checks the vendor's wire format field by field (SSE framing and event order included).
#include "keel/gateway/fake_vendor.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/core/http_test_client.h"

namespace keel::gateway {
namespace {

using nlohmann::json;
using test::HttpTestClient;
using test::HttpTestResponse;
using Headers = std::vector<std::pair<std::string, std::string>>;
using Clock = std::chrono::steady_clock;

std::unique_ptr<FakeVendor> StartFake(FakeVendorKind kind, FakeVendorOptions o = {}) {
  o.kind = kind;
  auto fv = FakeVendor::Start(o);
  EXPECT_TRUE(fv.ok()) << fv.status().ToString();
  return fv.ok() ? std::move(fv).value() : nullptr;
}

struct Reply {
  HttpTestResponse res;
  bool complete = false;  // the response ended properly (terminating chunk or full length)
  json Json() const { return json::parse(res.body, nullptr, false); }
};

Reply Call(int port, std::string_view method, std::string_view target, std::string_view body, const Headers& headers) {
  HttpTestClient c(port, 20);
  Reply r;
  if (!c.SendRaw(HttpTestClient::BuildRequest(method, target, body, "application/json", headers))) return r;
  r.complete = c.ReadResponse(&r.res);
  return r;
}

const Headers kOpenAIAuth = {{"Authorization", "Bearer sk-test"}};
const Headers kAnthropicAuth = {{"x-api-key", "sk-ant-test"}, {"anthropic-version", "2023-06-01"}};
const Headers kGeminiAuth = {{"x-goog-api-key", "AIza-test"}};

struct SseEvent {
  std::string event;  // "" when the event had no event: line
  std::string data;
};

// Splits an SSE body into events (blank-line separated; "\n" or "\r\n" line ends).
std::vector<SseEvent> ParseSse(std::string body) {
  std::string norm;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] == '\r' && i + 1 < body.size() && body[i + 1] == '\n') continue;
    norm += body[i];
  }
  std::vector<SseEvent> out;
  size_t pos = 0;
  while (pos < norm.size()) {
    size_t end = norm.find("\n\n", pos);
    std::string block = norm.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end == std::string::npos ? norm.size() : end + 2;
    SseEvent ev;
    size_t lp = 0;
    while (lp < block.size()) {
      size_t le = block.find('\n', lp);
      std::string line = block.substr(lp, le == std::string::npos ? std::string::npos : le - lp);
      lp = le == std::string::npos ? block.size() : le + 1;
      if (line.rfind("event: ", 0) == 0) ev.event = line.substr(7);
      if (line.rfind("data: ", 0) == 0) ev.data += line.substr(6);
    }
    if (!ev.event.empty() || !ev.data.empty()) out.push_back(ev);
  }
  return out;
}

std::string Words(int n) {  // filler answer to an empty prompt: "w0 w1 ... w<n-1>"
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? " w" : "w") + std::to_string(i);
  return s;
}

std::string ChatBody(std::string_view model, std::string_view user, json extra = json::object()) {
  json b = {{"model", model}, {"messages", json::array({{{"role", "system"}, {"content", "be brief"}},
                                                         {{"role", "user"}, {"content", user}}})}};
  b.update(extra);
  return b.dump();
}

// ---- OpenAI ------------------------------------------------------------------------------------

TEST(FakeVendorOpenAI, ChatNonStreamShapeUsageAndHeaders) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "say hello"), kOpenAIAuth);
  ASSERT_EQ(r.res.status, 200) << r.res.body;
  EXPECT_EQ(r.res.Header("Content-Type"), "application/json");
  EXPECT_EQ(r.res.Header("x-request-id").rfind("req_", 0), 0u);
  EXPECT_FALSE(r.res.Header("openai-processing-ms").empty());
  json j = r.Json();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(j["model"], "gpt-4o");
  EXPECT_TRUE(j["created"].is_number_integer());
  ASSERT_EQ(j["choices"].size(), 1u);
  const json& c = j["choices"][0];
  EXPECT_EQ(c["index"], 0);
  EXPECT_EQ(c["finish_reason"], "stop");
  EXPECT_EQ(c["message"]["role"], "assistant");
  // Echo of the last user message, then filler: 16 words.
  EXPECT_EQ(c["message"]["content"], "say hello w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15");
  // Input estimate: ceil(bytes / 4) of "be brief" + "say hello" = ceil(17 / 4) = 5.
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(j["usage"]["completion_tokens"], 16);
  EXPECT_EQ(j["usage"]["total_tokens"], 21);
}

TEST(FakeVendorOpenAI, ChatStreamChunksUsageAndDone) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions",
                 ChatBody("gpt-4o", "", {{"stream", true}, {"stream_options", {{"include_usage", true}}}}), kOpenAIAuth);
  ASSERT_EQ(r.res.status, 200);
  EXPECT_TRUE(r.complete);
  EXPECT_TRUE(r.res.chunked);
  EXPECT_EQ(r.res.Header("Content-Type").rfind("text/event-stream", 0), 0u);
  auto events = ParseSse(r.res.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back().data, "[DONE]");
  for (const auto& e : events) EXPECT_EQ(e.event, "");  // OpenAI uses data: lines only
  json first = json::parse(events[0].data);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  std::string text;
  int content_chunks = 0;
  std::string finish;
  std::string id = first["id"];
  for (size_t i = 1; i + 2 < events.size(); ++i) {
    json c = json::parse(events[i].data);
    EXPECT_EQ(c["id"], id);
    ASSERT_EQ(c["choices"].size(), 1u);
    const json& ch = c["choices"][0];
    if (ch["delta"].contains("content")) {
      text += ch["delta"]["content"].get<std::string>();
      ++content_chunks;
    }
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(text, Words(16));
  EXPECT_EQ(content_chunks, 16);  // one word per chunk
  EXPECT_EQ(finish, "stop");
  json usage_chunk = json::parse(events[events.size() - 2].data);
  EXPECT_TRUE(usage_chunk["choices"].empty());
  EXPECT_EQ(usage_chunk["usage"]["completion_tokens"], 16);
  EXPECT_EQ(usage_chunk["usage"]["prompt_tokens"], 2);  // ceil(8 / 4): "be brief"
}

TEST(FakeVendorOpenAI, StreamWithoutIncludeUsageHasNoUsage) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "hi", {{"stream", true}}), kOpenAIAuth);
  auto events = ParseSse(r.res.body);
  ASSERT_GE(events.size(), 3u);
  for (size_t i = 0; i + 1 < events.size(); ++i) EXPECT_FALSE(json::parse(events[i].data).contains("usage"));
  EXPECT_EQ(json::parse(events[events.size() - 2].data)["choices"][0]["finish_reason"], "stop");
}

TEST(FakeVendorOpenAI, AuthFailures) {
  FakeVendorOptions o;
  o.api_key = "sk-right-key-123456";
  auto fv = StartFake(FakeVendorKind::kOpenAI, o);
  Reply missing = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "x"), {});
  EXPECT_EQ(missing.res.status, 401);
  json m = missing.Json();
  EXPECT_EQ(m["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(m["error"]["param"].is_null());
  EXPECT_NE(m["error"]["message"].get<std::string>().find("didn't provide an API key"), std::string::npos);
  Reply wrong = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "x"),
                     {{"Authorization", "Bearer sk-wrong-key-999999"}});
  EXPECT_EQ(wrong.res.status, 401);
  json w = wrong.Json();
  EXPECT_EQ(w["error"]["code"], "invalid_api_key");
  EXPECT_EQ(w["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(w["error"].contains("param"));
  EXPECT_EQ(w["error"]["message"].get<std::string>().find("sk-wrong-key-999999"), std::string::npos);  // masked
  Reply right = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "x"),
                     {{"Authorization", "Bearer sk-right-key-123456"}});
  EXPECT_EQ(right.res.status, 200);
  EXPECT_EQ(fv->stats().errors, 2u);
}

TEST(FakeVendorOpenAI, ValidationErrors) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply bad = Call(fv->port(), "POST", "/v1/chat/completions", "{\"model\": ", kOpenAIAuth);
  EXPECT_EQ(bad.res.status, 400);
  EXPECT_EQ(bad.Json()["error"]["type"], "invalid_request_error");
  EXPECT_NE(bad.Json()["error"]["message"].get<std::string>().find("could not parse the JSON body"), std::string::npos);
  Reply no_model = Call(fv->port(), "POST", "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}]})",
                        kOpenAIAuth);
  EXPECT_EQ(no_model.res.status, 400);
  EXPECT_EQ(no_model.Json()["error"]["message"], "you must provide a model parameter");
  Reply no_msgs = Call(fv->port(), "POST", "/v1/chat/completions", R"({"model":"gpt-4o"})", kOpenAIAuth);
  EXPECT_EQ(no_msgs.res.status, 400);
  EXPECT_EQ(no_msgs.Json()["error"]["param"], "messages");
  EXPECT_EQ(no_msgs.Json()["error"]["code"], "missing_required_parameter");
  Reply bad_role = Call(fv->port(), "POST", "/v1/chat/completions",
                        R"({"model":"gpt-4o","messages":[{"role":"robot","content":"x"}]})", kOpenAIAuth);
  EXPECT_EQ(bad_role.res.status, 400);
  EXPECT_EQ(bad_role.Json()["error"]["param"], "messages[0].role");
  Reply zero = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "x", {{"max_tokens", 0}}), kOpenAIAuth);
  EXPECT_EQ(zero.res.status, 400);
  EXPECT_EQ(zero.Json()["error"]["code"], "integer_below_min_value");
  Reply opts = Call(fv->port(), "POST", "/v1/chat/completions",
                    ChatBody("gpt-4o", "x", {{"stream_options", {{"include_usage", true}}}}), kOpenAIAuth);
  EXPECT_EQ(opts.res.status, 400);
  Reply unknown = Call(fv->port(), "POST", "/v1/chat/complete", "{}", kOpenAIAuth);
  EXPECT_EQ(unknown.res.status, 404);
  EXPECT_EQ(unknown.Json()["error"]["message"], "Invalid URL (POST /v1/chat/complete)");
  Reply method = Call(fv->port(), "GET", "/v1/chat/completions", "", kOpenAIAuth);
  EXPECT_EQ(method.res.status, 405);
}

TEST(FakeVendorOpenAI, MaxTokensCutsWithFinishLength) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "", {{"max_completion_tokens", 3}}),
                 kOpenAIAuth);
  json j = r.Json();
  EXPECT_EQ(j["choices"][0]["message"]["content"], "w0 w1 w2");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 3);
  Reply s = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "", {{"max_tokens", 5}, {"stream", true}}),
                 kOpenAIAuth);
  auto events = ParseSse(s.res.body);
  ASSERT_EQ(events.size(), 1u + 5u + 1u + 1u);  // role, 5 words, finish, [DONE]
  EXPECT_EQ(json::parse(events[6].data)["choices"][0]["finish_reason"], "length");
}

TEST(FakeVendorOpenAI, StopSequenceCutsBeforeIt) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "", {{"stop", json::array({"w4", "w9"})}}),
                 kOpenAIAuth);
  json j = r.Json();
  EXPECT_EQ(j["choices"][0]["message"]["content"], "w0 w1 w2 w3 ");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  Reply single = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "", {{"stop", "1 w"}}), kOpenAIAuth);
  EXPECT_EQ(single.Json()["choices"][0]["message"]["content"], "w0 w");  // a stop spanning two words
}

json ToolsExtra() {
  return {{"tools", json::array({{{"type", "function"}, {"function", {{"name", "get_weather"}, {"parameters", json::object()}}}},
                                 {{"type", "function"}, {"function", {{"name", "other"}}}}})}};
}

TEST(FakeVendorOpenAI, ToolsSwitchCallsFirstTool) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o-tools", "weather?", ToolsExtra()), kOpenAIAuth);
  json j = r.Json();
  const json& msg = j["choices"][0]["message"];
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_TRUE(msg["content"].is_null());
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()), json({{"x", 1}}));

  json extra = ToolsExtra();
  extra["stream"] = true;
  Reply s = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o-tools", "weather?", extra), kOpenAIAuth);
  auto events = ParseSse(s.res.body);
  ASSERT_GE(events.size(), 4u);
  json first = json::parse(events[0].data)["choices"][0]["delta"];
  EXPECT_EQ(first["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(first["tool_calls"][0]["index"], 0);
  std::string args;
  std::string finish;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json c = json::parse(events[i].data)["choices"][0];
    if (c["delta"].contains("tool_calls")) args += c["delta"]["tool_calls"][0]["function"]["arguments"].get<std::string>();
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_EQ(json::parse(args), json({{"x", 1}}));
  EXPECT_EQ(finish, "tool_calls");

  // After the tool ran, the model answers with text.
  json after = {{"model", "gpt-4o-tools"},
                {"messages", json::array({{{"role", "user"}, {"content", "weather?"}},
                                          {{"role", "assistant"}, {"content", nullptr},
                                           {"tool_calls", json::array({{{"id", "call_1"}, {"type", "function"},
                                                                        {"function", {{"name", "get_weather"}, {"arguments", "{}"}}}}})}},
                                          {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny"}}})}};
  after.update(ToolsExtra());
  Reply t = Call(fv->port(), "POST", "/v1/chat/completions", after.dump(), kOpenAIAuth);
  EXPECT_EQ(t.Json()["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(t.Json()["choices"][0]["message"]["content"].is_string());
}

TEST(FakeVendorOpenAI, ErrorSwitches) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r429 = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-error-429", "x"), kOpenAIAuth);
  EXPECT_EQ(r429.res.status, 429);
  EXPECT_EQ(r429.res.Header("retry-after"), "1");
  EXPECT_EQ(r429.Json()["error"]["code"], "rate_limit_exceeded");
  Reply r500 = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-error-500", "x"), kOpenAIAuth);
  EXPECT_EQ(r500.res.status, 500);
  EXPECT_EQ(r500.Json()["error"]["type"], "server_error");
  Reply r503 = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("overloaded-model", "x"), kOpenAIAuth);
  EXPECT_EQ(r503.res.status, 503);
  EXPECT_TRUE(r503.Json()["error"].contains("message"));
}

TEST(FakeVendorOpenAI, GarbageSwitch) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("garbage", "x"), kOpenAIAuth);
  EXPECT_EQ(r.res.status, 200);
  EXPECT_TRUE(r.Json().is_discarded());
  Reply s = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("garbage", "x", {{"stream", true}}), kOpenAIAuth);
  EXPECT_EQ(s.res.status, 200);
  auto events = ParseSse(s.res.body);
  ASSERT_FALSE(events.empty());
  EXPECT_TRUE(json::parse(events[0].data, nullptr, false).is_discarded());
}

TEST(FakeVendorOpenAI, TruncateDropsTheConnectionMidStream) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  Reply s = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-truncate", "", {{"stream", true}}), kOpenAIAuth);
  EXPECT_EQ(s.res.status, 200);
  EXPECT_FALSE(s.complete);  // no terminating chunk: the connection was dropped
  auto events = ParseSse(s.res.body);
  ASSERT_EQ(events.size(), 1u + 8u);  // role chunk + half of 16 words
  for (const auto& e : events) EXPECT_NE(e.data, "[DONE]");
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-truncate", "x"), kOpenAIAuth);
  EXPECT_EQ(r.res.status, 200);
  EXPECT_FALSE(r.complete);
  EXPECT_TRUE(r.Json().is_discarded());
  // The fake still serves new connections afterwards.
  EXPECT_EQ(Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "x"), kOpenAIAuth).res.status, 200);
}

TEST(FakeVendorOpenAI, SlowWaitsAndGivesUpWhenTheClientLeaves) {
  FakeVendorOptions o;
  o.slow_ms = 300;
  auto fv = StartFake(FakeVendorKind::kOpenAI, o);
  auto t0 = Clock::now();
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("slow-model", "x"), kOpenAIAuth);
  EXPECT_EQ(r.res.status, 200);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(290));

  FakeVendorOptions o2;  // the default 5 s
  auto fv2 = StartFake(FakeVendorKind::kOpenAI, o2);
  {
    HttpTestClient c(fv2->port());
    ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("POST", "/v1/chat/completions", ChatBody("slow", "x"),
                                                        "application/json", kOpenAIAuth)));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(fv2->stats().active, 1);
  }  // closes
  auto t1 = Clock::now();
  while (fv2->stats().active != 0 && Clock::now() - t1 < std::chrono::seconds(3)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(fv2->stats().active, 0);
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(2));
  EXPECT_EQ(fv2->stats().cancelled, 1u);
}

TEST(FakeVendorOpenAI, PacingDelaysButDropsNothing) {
  FakeVendorOptions o;
  o.ttft_ms = 80;
  o.tokens_per_second = 200;  // 5 ms apart
  o.reply_tokens = 30;
  auto fv = StartFake(FakeVendorKind::kOpenAI, o);
  HttpTestClient c(fv->port());
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("POST", "/v1/chat/completions", ChatBody("gpt-4o", "", {{"stream", true}}),
                                                      "application/json", kOpenAIAuth)));
  auto t0 = Clock::now();
  Clock::time_point first;
  HttpTestResponse res;
  ASSERT_TRUE(c.ReadResponse(&res, [&](std::string_view) {
    if (first == Clock::time_point()) first = Clock::now();
    return true;
  }));
  auto total = Clock::now() - t0;
  EXPECT_GE(first - t0, std::chrono::milliseconds(70));
  EXPECT_GE(total, std::chrono::milliseconds(80 + 29 * 5 - 10));
  std::string text;
  auto events = ParseSse(res.body);
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json d = json::parse(events[i].data)["choices"][0]["delta"];
    if (d.contains("content")) text += d["content"].get<std::string>();
  }
  EXPECT_EQ(text, Words(30));
  EXPECT_GE(res.chunks.size(), 30u);  // written one by one
  EXPECT_EQ(fv->stats().output_tokens, 30u);
}

TEST(FakeVendorOpenAI, CompletionsStreamAndDefaultMaxTokens) {
  FakeVendorOptions o;
  o.reply_tokens = 20;
  auto fv = StartFake(FakeVendorKind::kOpenAI, o);
  Reply r = Call(fv->port(), "POST", "/v1/completions", R"({"model":"gpt-3.5-turbo-instruct","prompt":"once upon"})",
                 kOpenAIAuth);
  json j = r.Json();
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");  // max_tokens defaults to 16
  EXPECT_EQ(j["usage"]["completion_tokens"], 16);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);  // ceil(9 / 4)
  EXPECT_EQ(j["choices"][0]["text"].get<std::string>().rfind("once upon w2", 0), 0u);
  Reply s = Call(fv->port(), "POST", "/v1/completions",
                 R"({"model":"m","prompt":"a","max_tokens":4,"stream":true,"stream_options":{"include_usage":true}})",
                 kOpenAIAuth);
  auto events = ParseSse(s.res.body);
  ASSERT_EQ(events.size(), 4u + 1u + 1u + 1u);  // 4 texts, finish, usage, [DONE]
  std::string text;
  for (size_t i = 0; i < 4; ++i) text += json::parse(events[i].data)["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, "a w1 w2 w3");
  EXPECT_EQ(json::parse(events[4].data)["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(json::parse(events[5].data)["usage"]["completion_tokens"], 4);
  Reply missing = Call(fv->port(), "POST", "/v1/completions", R"({"model":"m"})", kOpenAIAuth);
  EXPECT_EQ(missing.res.status, 400);
  EXPECT_EQ(missing.Json()["error"]["param"], "prompt");
}

TEST(FakeVendorOpenAI, EmbeddingsAreDeterministicUnitVectors) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  auto embed = [&](const json& body) { return Call(fv->port(), "POST", "/v1/embeddings", body.dump(), kOpenAIAuth).Json(); };
  json a = embed({{"model", "text-embedding-3-small"}, {"input", json::array({"alpha", "beta", "alpha"})}});
  EXPECT_EQ(a["object"], "list");
  ASSERT_EQ(a["data"].size(), 3u);
  EXPECT_EQ(a["data"][1]["index"], 1);
  EXPECT_EQ(a["data"][0]["object"], "embedding");
  std::vector<float> v0 = a["data"][0]["embedding"], v1 = a["data"][1]["embedding"], v2 = a["data"][2]["embedding"];
  EXPECT_EQ(v0.size(), 8u);
  EXPECT_EQ(v0, v2);
  EXPECT_NE(v0, v1);
  double norm = 0;
  for (float x : v0) norm += x * x;
  EXPECT_NEAR(norm, 1.0, 1e-5);
  EXPECT_EQ(a["usage"]["prompt_tokens"], 4);  // ceil(14 / 4)
  json again = embed({{"model", "m"}, {"input", "alpha"}, {"dimensions", 4}});
  EXPECT_EQ(again["data"][0]["embedding"].size(), 4u);
  json b64 = embed({{"model", "m"}, {"input", "alpha"}, {"encoding_format", "base64"}});
  ASSERT_TRUE(b64["data"][0]["embedding"].is_string());
  EXPECT_EQ(b64["data"][0]["embedding"].get<std::string>().size(), 44u);  // 32 bytes -> 44 base64 chars
  EXPECT_EQ(Call(fv->port(), "POST", "/v1/embeddings", R"({"model":"m","input":""})", kOpenAIAuth).res.status, 400);
}

TEST(FakeVendorOpenAI, ModelsAndTestEndpoints) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  json models = Call(fv->port(), "GET", "/v1/models", "", kOpenAIAuth).Json();
  EXPECT_EQ(models["object"], "list");
  ASSERT_FALSE(models["data"].empty());
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(Call(fv->port(), "GET", "/v1/models/gpt-x", "", kOpenAIAuth).Json()["id"], "gpt-x");
  EXPECT_EQ(Call(fv->port(), "GET", "/v1/models", "", {}).res.status, 401);
  EXPECT_EQ(Call(fv->port(), "GET", "/_fake/last_request", "", {}).Json()["path"], "/v1/models");
}

TEST(FakeVendorOpenAI, SamplingFieldsAcceptedAndTypeChecked) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  auto chat = [&](json extra) {
    return Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "hi", std::move(extra)), kOpenAIAuth);
  };
  json all = {{"temperature", 0.2},        {"top_p", 0.9},  {"presence_penalty", 0.5},
              {"frequency_penalty", -1.5}, {"seed", 7},     {"logit_bias", {{"50256", -100}, {"13", 2.5}}},
              {"parallel_tool_calls", false}};
  all.update(ToolsExtra());
  Reply ok = chat(all);
  ASSERT_EQ(ok.res.status, 200) << ok.res.body;
  EXPECT_EQ(ok.Json()["choices"][0]["message"]["content"].get<std::string>().rfind("hi w1", 0), 0u);
  // Completions takes the same sampling fields.
  EXPECT_EQ(Call(fv->port(), "POST", "/v1/completions",
                 R"({"model":"m","prompt":"a","presence_penalty":1,"seed":3,"logit_bias":{"7":1}})", kOpenAIAuth)
                .res.status,
            200);

  struct Bad {
    json extra;
    std::string param, code;
  };
  const std::vector<Bad> bad = {
      {{{"presence_penalty", "high"}}, "presence_penalty", "invalid_type"},
      {{{"frequency_penalty", 3}}, "frequency_penalty", "decimal_above_max_value"},
      {{{"presence_penalty", -2.5}}, "presence_penalty", "decimal_below_min_value"},
      {{{"temperature", 2.5}}, "temperature", "decimal_above_max_value"},
      {{{"seed", 1.5}}, "seed", "invalid_type"},
      {{{"seed", "7"}}, "seed", "invalid_type"},
      {{{"logit_bias", json::array({1})}}, "logit_bias", "invalid_type"},
      {{{"logit_bias", {{"abc", 1}}}}, "logit_bias", "invalid_value"},
      {{{"logit_bias", {{"42", 101}}}}, "logit_bias.42", "decimal_above_max_value"},
      {{{"parallel_tool_calls", "yes"}, {"tools", ToolsExtra()["tools"]}}, "parallel_tool_calls", "invalid_type"},
  };
  for (const Bad& b : bad) {
    Reply r = chat(b.extra);
    EXPECT_EQ(r.res.status, 400) << b.extra.dump();
    json e = r.Json()["error"];
    EXPECT_EQ(e["type"], "invalid_request_error") << b.extra.dump();
    EXPECT_EQ(e["param"], b.param) << b.extra.dump();
    EXPECT_EQ(e["code"], b.code) << b.extra.dump();
  }
  Reply r = chat({{"seed", "7"}});
  EXPECT_EQ(r.Json()["error"]["message"], "Invalid type for 'seed': expected an integer, but got a string instead.");
  // parallel_tool_calls is refused without tools, as OpenAI refuses it.
  Reply no_tools = chat({{"parallel_tool_calls", true}});
  EXPECT_EQ(no_tools.res.status, 400);
  EXPECT_EQ(no_tools.Json()["error"]["param"], "parallel_tool_calls");
  EXPECT_NE(no_tools.Json()["error"]["message"].get<std::string>().find("only allowed when 'tools' are specified"),
            std::string::npos);
}

json PersonSchema() {
  return {{"type", "object"},
          {"properties",
           {{"name", {{"type", "string"}}},
            {"age", {{"type", "integer"}, {"minimum", 18}}},
            {"tags", {{"type", "array"}, {"items", {{"type", "string"}}}}},
            {"kind", {{"type", "string"}, {"enum", {"cat", "dog"}}}},
            {"pet", {{"anyOf", json::array({{{"$ref", "#/$defs/Pet"}}, {{"type", "null"}}})}}}}},
          {"required", {"name", "age", "tags", "kind", "pet"}},
          {"additionalProperties", false},
          {"$defs",
           {{"Pet",
             {{"type", "object"},
              {"properties", {{"alive", {{"type", "boolean"}}}}},
              {"required", {"alive"}},
              {"additionalProperties", false}}}}}};
}

// The answer a JSON Schema-constrained model gives: every property, of its type, strings from the
// reply's words ("say", "hello", then "w<i>").
void ExpectPerson(const json& j) {
  ASSERT_TRUE(j.is_object()) << j.dump();
  EXPECT_EQ(j["name"], "say");
  EXPECT_EQ(j["age"], 18);  // the minimum
  EXPECT_EQ(j["tags"], json::array({"hello"}));
  EXPECT_EQ(j["kind"], "cat");
  EXPECT_EQ(j["pet"], json({{"alive", true}}));
}

TEST(FakeVendorOpenAI, ResponseFormatJsonSchemaAnswersAnInstance) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  json rf = {{"response_format",
              {{"type", "json_schema"}, {"json_schema", {{"name", "person"}, {"strict", true}, {"schema", PersonSchema()}}}}}};
  Reply r = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "say hello", rf), kOpenAIAuth);
  ASSERT_EQ(r.res.status, 200) << r.res.body;
  EXPECT_EQ(r.Json()["choices"][0]["finish_reason"], "stop");
  ExpectPerson(json::parse(r.Json()["choices"][0]["message"]["content"].get<std::string>(), nullptr, false));

  rf["stream"] = true;
  Reply s = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "say hello", rf), kOpenAIAuth);
  std::string text;
  int pieces = 0;
  for (const auto& e : ParseSse(s.res.body)) {
    if (e.data == "[DONE]") continue;
    json d = json::parse(e.data)["choices"][0]["delta"];
    if (d.contains("content") && !d["content"].get<std::string>().empty()) {
      text += d["content"].get<std::string>();
      ++pieces;
    }
  }
  ExpectPerson(json::parse(text, nullptr, false));
  EXPECT_GT(pieces, 5);  // streamed in pieces, not one chunk

  // json_object: any object; OpenAI wants the word "json" in the messages.
  json obj = {{"response_format", {{"type", "json_object"}}}};
  Reply o = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "answer in JSON", obj), kOpenAIAuth);
  ASSERT_EQ(o.res.status, 200) << o.res.body;
  json answer = json::parse(o.Json()["choices"][0]["message"]["content"].get<std::string>(), nullptr, false);
  EXPECT_EQ(answer["answer"].get<std::string>().rfind("answer in JSON w3", 0), 0u);
  Reply no_word = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "hi", obj), kOpenAIAuth);
  EXPECT_EQ(no_word.res.status, 400);
  EXPECT_EQ(no_word.Json()["error"]["param"], "messages");
  // max_tokens still cuts (a JSON answer cut short is not JSON, finish "length").
  json cut = rf;
  cut["stream"] = false;
  cut["max_tokens"] = 3;
  json c = Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "x", cut), kOpenAIAuth).Json();
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["usage"]["completion_tokens"], 3);
}

TEST(FakeVendorOpenAI, ResponseFormatValidation) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  auto with = [&](json rf) {
    return Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("gpt-4o", "json", {{"response_format", rf}}),
                kOpenAIAuth);
  };
  Reply type = with({{"type", "xml"}});
  EXPECT_EQ(type.res.status, 400);
  EXPECT_EQ(type.Json()["error"]["param"], "response_format.type");
  EXPECT_EQ(type.Json()["error"]["message"], "Invalid value: 'xml'. Supported values are: 'json_object', 'json_schema', and 'text'.");
  EXPECT_EQ(with("json").Json()["error"]["code"], "invalid_type");
  Reply no_schema = with({{"type", "json_schema"}});
  EXPECT_EQ(no_schema.Json()["error"]["param"], "response_format.json_schema");
  EXPECT_EQ(no_schema.Json()["error"]["code"], "missing_required_parameter");
  Reply no_name = with({{"type", "json_schema"}, {"json_schema", {{"schema", PersonSchema()}}}});
  EXPECT_EQ(no_name.Json()["error"]["param"], "response_format.json_schema.name");
  Reply bad_name = with({{"type", "json_schema"}, {"json_schema", {{"name", "a person"}}}});
  EXPECT_EQ(bad_name.Json()["error"]["param"], "response_format.json_schema.name");
  // strict: every object closed and every property required, nested ones too.
  json open = PersonSchema();
  open["$defs"]["Pet"].erase("additionalProperties");
  Reply strict = with({{"type", "json_schema"}, {"json_schema", {{"name", "p"}, {"strict", true}, {"schema", open}}}});
  EXPECT_EQ(strict.res.status, 400);
  EXPECT_NE(strict.Json()["error"]["message"].get<std::string>().find("'additionalProperties' is required"),
            std::string::npos)
      << strict.res.body;
  json partial = PersonSchema();
  partial["required"] = {"name"};
  Reply req = with({{"type", "json_schema"}, {"json_schema", {{"name", "p"}, {"strict", true}, {"schema", partial}}}});
  EXPECT_NE(req.Json()["error"]["message"].get<std::string>().find("Missing 'age'"), std::string::npos) << req.res.body;
  // Not strict: the same schema is fine. Text is the default.
  EXPECT_EQ(with({{"type", "json_schema"}, {"json_schema", {{"name", "p"}, {"schema", partial}}}}).res.status, 200);
  Reply text = with({{"type", "text"}});
  EXPECT_EQ(text.res.status, 200);
  EXPECT_EQ(text.Json()["choices"][0]["message"]["content"].get<std::string>().rfind("json w1", 0), 0u);
}

TEST(FakeVendorCommon, LastRequestAndStats) {
  auto fv = StartFake(FakeVendorKind::kOpenAI);
  EXPECT_EQ(Call(fv->port(), "GET", "/_fake/last_request", "", {}).res.status, 404);
  std::string body = ChatBody("gpt-4o", "hi", {{"stream", true}});
  Call(fv->port(), "POST", "/v1/chat/completions?trace=1", body, {{"Authorization", "Bearer k"}, {"X-Custom", "v1"}});
  json last = Call(fv->port(), "GET", "/_fake/last_request", "", {}).Json();
  EXPECT_EQ(last["method"], "POST");
  EXPECT_EQ(last["path"], "/v1/chat/completions");
  EXPECT_EQ(last["query"], "trace=1");
  EXPECT_EQ(last["headers"]["x-custom"], "v1");
  EXPECT_EQ(last["headers"]["authorization"], "Bearer k");
  EXPECT_EQ(last["body"], body);
  json stats = Call(fv->port(), "GET", "/_fake/stats", "", {}).Json();
  EXPECT_EQ(stats["requests"], 1);  // /_fake/* is not counted
  EXPECT_EQ(stats["streams"], 1);
  EXPECT_EQ(stats["output_tokens"], 16);
}

// ---- Anthropic ---------------------------------------------------------------------------------

std::string MessagesBody(std::string_view model, json extra = json::object()) {
  json b = {{"model", model},
            {"max_tokens", 1024},
            {"system", "be brief"},
            {"messages", json::array({{{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "hi there"}}})}}})}};
  b.update(extra);
  return b.dump();
}

TEST(FakeVendorAnthropic, MessageNonStream) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-sonnet-4"), kAnthropicAuth);
  ASSERT_EQ(r.res.status, 200) << r.res.body;
  EXPECT_EQ(r.res.Header("request-id").rfind("req_", 0), 0u);
  json j = r.Json();
  EXPECT_EQ(j["type"], "message");
  EXPECT_EQ(j["role"], "assistant");
  EXPECT_EQ(j["id"].get<std::string>().rfind("msg_", 0), 0u);
  EXPECT_EQ(j["model"], "claude-sonnet-4");
  ASSERT_EQ(j["content"].size(), 1u);
  EXPECT_EQ(j["content"][0]["type"], "text");
  EXPECT_EQ(j["content"][0]["text"], "hi there w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15");
  EXPECT_EQ(j["stop_reason"], "end_turn");
  EXPECT_TRUE(j["stop_sequence"].is_null());
  EXPECT_EQ(j["usage"]["input_tokens"], 4);  // ceil((8 + 8) / 4)
  EXPECT_EQ(j["usage"]["output_tokens"], 16);
}

TEST(FakeVendorAnthropic, StreamEventOrder) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", {{"stream", true}, {"max_tokens", 4}}),
                 kAnthropicAuth);
  ASSERT_EQ(r.res.status, 200);
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.res.Header("Content-Type").rfind("text/event-stream", 0), 0u);
  auto events = ParseSse(r.res.body);
  std::vector<std::string> order;
  std::string text;
  for (const auto& e : events) {
    json d = json::parse(e.data);
    EXPECT_EQ(d["type"], e.event);  // the event: line names the data's type
    order.push_back(e.event);
    if (e.event == "content_block_delta") {
      EXPECT_EQ(d["delta"]["type"], "text_delta");
      EXPECT_EQ(d["index"], 0);
      text += d["delta"]["text"].get<std::string>();
    }
    if (e.event == "message_start") {
      EXPECT_EQ(d["message"]["usage"]["input_tokens"], 4);
      EXPECT_TRUE(d["message"]["content"].empty());
      EXPECT_TRUE(d["message"]["stop_reason"].is_null());
    }
    if (e.event == "content_block_start") {
      EXPECT_EQ(d["content_block"]["type"], "text");
    }
    if (e.event == "message_delta") {
      EXPECT_EQ(d["delta"]["stop_reason"], "max_tokens");
      EXPECT_EQ(d["usage"]["output_tokens"], 4);
    }
  }
  std::vector<std::string> want = {"message_start", "content_block_start", "ping", "content_block_delta",
                                   "content_block_delta", "content_block_delta", "content_block_delta",
                                   "content_block_stop", "message_delta", "message_stop"};
  EXPECT_EQ(order, want);
  EXPECT_EQ(text, "hi there w2 w3");
}

TEST(FakeVendorAnthropic, HeadersAndAuth) {
  FakeVendorOptions o;
  o.api_key = "sk-ant-good";
  auto fv = StartFake(FakeVendorKind::kAnthropic, o);
  Reply no_key = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"), {{"anthropic-version", "2023-06-01"}});
  EXPECT_EQ(no_key.res.status, 401);
  json k = no_key.Json();
  EXPECT_EQ(k["type"], "error");
  EXPECT_EQ(k["error"]["type"], "authentication_error");
  EXPECT_EQ(k["request_id"], no_key.res.Header("request-id"));
  Reply wrong = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"),
                     {{"x-api-key", "nope"}, {"anthropic-version", "2023-06-01"}});
  EXPECT_EQ(wrong.res.status, 401);
  Reply no_version = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"), {{"x-api-key", "sk-ant-good"}});
  EXPECT_EQ(no_version.res.status, 400);
  EXPECT_EQ(no_version.Json()["error"]["type"], "invalid_request_error");
  EXPECT_EQ(no_version.Json()["error"]["message"], "anthropic-version: header is required");
  Reply ok = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"),
                  {{"x-api-key", "sk-ant-good"}, {"anthropic-version", "2023-06-01"}});
  EXPECT_EQ(ok.res.status, 200);
}

TEST(FakeVendorAnthropic, ValidationErrors) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  Reply bad = Call(fv->port(), "POST", "/v1/messages", "{not json", kAnthropicAuth);
  EXPECT_EQ(bad.res.status, 400);
  EXPECT_EQ(bad.Json()["error"]["type"], "invalid_request_error");
  json no_max = json::parse(MessagesBody("claude"));
  no_max.erase("max_tokens");
  Reply r = Call(fv->port(), "POST", "/v1/messages", no_max.dump(), kAnthropicAuth);
  EXPECT_EQ(r.res.status, 400);
  EXPECT_EQ(r.Json()["error"]["message"], "max_tokens: Field required");
  Reply no_model = Call(fv->port(), "POST", "/v1/messages", R"({"max_tokens":5,"messages":[{"role":"user","content":"x"}]})",
                        kAnthropicAuth);
  EXPECT_EQ(no_model.res.status, 400);
  Reply no_messages = Call(fv->port(), "POST", "/v1/messages", R"({"model":"c","max_tokens":5})", kAnthropicAuth);
  EXPECT_EQ(no_messages.res.status, 400);
  EXPECT_EQ(no_messages.Json()["error"]["message"], "messages: Field required");
  Reply role = Call(fv->port(), "POST", "/v1/messages",
                    R"({"model":"c","max_tokens":5,"messages":[{"role":"system","content":"x"}]})", kAnthropicAuth);
  EXPECT_EQ(role.res.status, 400);
}

TEST(FakeVendorAnthropic, StopSequenceReported) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  json j = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", {{"stop_sequences", {"w3"}}}), kAnthropicAuth).Json();
  EXPECT_EQ(j["stop_reason"], "stop_sequence");
  EXPECT_EQ(j["stop_sequence"], "w3");
  EXPECT_EQ(j["content"][0]["text"], "hi there w2 ");
}

TEST(FakeVendorAnthropic, AcceptsWhatCurrentSdksSend) {
  FakeVendorOptions o;
  o.api_key = "sk-ant-good";
  auto fv = StartFake(FakeVendorKind::kAnthropic, o);
  // @anthropic-ai/sdk 1.x: the key as a Bearer token, API version 2026-10-21, betas.
  const Headers sdk = {{"Authorization", "Bearer sk-ant-good"},
                       {"anthropic-version", "2026-10-21"},
                       {"anthropic-beta", "some-future-beta-2031-01-01,structured-outputs-2025-11-13"}};
  Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"), sdk);
  ASSERT_EQ(r.res.status, 200) << r.res.body;
  EXPECT_EQ(r.Json()["type"], "message");
  EXPECT_EQ(Call(fv->port(), "GET", "/v1/models", "", sdk).res.status, 200);
  for (const char* version : {"2023-01-01", "2023-06-01"}) {
    EXPECT_EQ(Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"),
                   {{"x-api-key", "sk-ant-good"}, {"anthropic-version", version}})
                  .res.status,
              200)
        << version;
  }
  Reply wrong = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"),
                     {{"Authorization", "Bearer sk-ant-bad"}, {"anthropic-version", "2026-10-21"}});
  EXPECT_EQ(wrong.res.status, 401);
  EXPECT_EQ(wrong.Json()["error"]["type"], "authentication_error");
  Reply bad_version = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"),
                           {{"x-api-key", "sk-ant-good"}, {"anthropic-version", "2024-10-22"}});
  EXPECT_EQ(bad_version.res.status, 400);
  EXPECT_EQ(bad_version.Json()["error"]["message"], "anthropic-version: \"2024-10-22\" is not a valid version");
}

TEST(FakeVendorAnthropic, SamplingParametersDependOnTheApiVersion) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  const json sampling = {{"temperature", 0.5}, {"top_p", 0.9}, {"top_k", 40}};
  Reply old_version = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", sampling), kAnthropicAuth);
  EXPECT_EQ(old_version.res.status, 200) << old_version.res.body;
  // 2026-10-21 removed them: any value is a 400.
  const Headers v2026 = {{"x-api-key", "k"}, {"anthropic-version", "2026-10-21"}};
  for (const char* field : {"temperature", "top_p", "top_k"}) {
    Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", {{field, sampling[field]}}), v2026);
    EXPECT_EQ(r.res.status, 400) << field;
    EXPECT_EQ(r.Json()["error"]["message"], std::string(field) + ": Extra inputs are not permitted");
  }
  EXPECT_EQ(Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude"), v2026).res.status, 200);
  struct Bad {
    json extra;
    std::string message;
  };
  for (const Bad& b : std::vector<Bad>{
           {{{"top_k", "many"}}, "top_k: Input should be a valid integer"},
           {{{"top_k", -1}}, "top_k: Input should be greater than or equal to 0"},
           {{{"temperature", 1.5}}, "temperature: Input should be less than or equal to 1"},
           {{{"top_p", "x"}}, "top_p: Input should be a valid number"},
           // Other vendors' fields are refused, as the real API refuses them.
           {{{"response_format", {{"type", "json_object"}}}}, "response_format: Extra inputs are not permitted"},
           {{{"seed", 1}}, "seed: Extra inputs are not permitted"},
       }) {
    Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", b.extra), kAnthropicAuth);
    EXPECT_EQ(r.res.status, 400) << b.extra.dump();
    EXPECT_EQ(r.Json()["error"]["type"], "invalid_request_error");
    EXPECT_EQ(r.Json()["error"]["message"], b.message);
  }
}

TEST(FakeVendorAnthropic, ToolChoiceDisableParallelToolUse) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  json tools = {{"tools", json::array({{{"name", "lookup"}, {"input_schema", {{"type", "object"}}}},
                                       {{"name", "other"}, {"input_schema", {{"type", "object"}}}}})}};
  for (const char* type : {"auto", "any"}) {
    json req = tools;
    req["tool_choice"] = {{"type", type}, {"disable_parallel_tool_use", true}};
    json j = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-tools", req), kAnthropicAuth).Json();
    EXPECT_EQ(j["stop_reason"], "tool_use") << type;
    EXPECT_EQ(j["content"].size(), 1u) << type;  // at most one call
  }
  json forced = tools;
  forced["tool_choice"] = {{"type", "tool"}, {"name", "other"}, {"disable_parallel_tool_use", true}};
  json f = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-tools", forced), kAnthropicAuth).Json();
  EXPECT_EQ(f["content"][0]["name"], "other");
  struct Bad {
    json choice;
    std::string message;
  };
  for (const Bad& b : std::vector<Bad>{
           {{{"type", "auto"}, {"disable_parallel_tool_use", "yes"}},
            "tool_choice.auto.disable_parallel_tool_use: Input should be a valid boolean"},
           {{{"type", "sometimes"}},
            "tool_choice: Input tag 'sometimes' found using 'type' does not match any of the expected tags: 'auto', "
            "'any', 'tool', 'none'"},
           {{{"type", "tool"}}, "tool_choice.tool.name: Field required"},
           {{{"type", "none"}, {"disable_parallel_tool_use", true}},
            "tool_choice.none.disable_parallel_tool_use: Extra inputs are not permitted"},
       }) {
    json req = tools;
    req["tool_choice"] = b.choice;
    Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-tools", req), kAnthropicAuth);
    EXPECT_EQ(r.res.status, 400) << b.choice.dump();
    EXPECT_EQ(r.Json()["error"]["message"], b.message);
  }
  Reply no_tools = Call(fv->port(), "POST", "/v1/messages",
                        MessagesBody("claude", {{"tool_choice", {{"type", "auto"}}}}), kAnthropicAuth);
  EXPECT_EQ(no_tools.res.status, 400);
  EXPECT_EQ(no_tools.Json()["error"]["message"], "tool_choice may only be specified while providing tools.");
}

TEST(FakeVendorAnthropic, StructuredOutputAnswersTheSchema) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  const json schema = {{"type", "object"},
                       {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
                       {"required", {"city", "days"}},
                       {"additionalProperties", false}};
  const json want = {{"city", "hi"}, {"days", 1}};
  json req = {{"output_config", {{"format", {{"type", "json_schema"}, {"schema", schema}}}, {"effort", "low"}}}};
  json j = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", req), kAnthropicAuth).Json();
  ASSERT_EQ(j["type"], "message") << j.dump();
  EXPECT_EQ(json::parse(j["content"][0]["text"].get<std::string>(), nullptr, false), want);
  EXPECT_EQ(j["stop_reason"], "end_turn");
  // Streamed, the text deltas join to the same document; the beta spelling works too.
  json beta = {{"output_format", {{"type", "json_schema"}, {"schema", schema}}}, {"stream", true}};
  std::string text;
  for (const auto& e : ParseSse(Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", beta), kAnthropicAuth).res.body)) {
    if (e.event == "content_block_delta") text += json::parse(e.data)["delta"]["text"].get<std::string>();
  }
  EXPECT_EQ(json::parse(text, nullptr, false), want);
  for (const auto& [bad, message] : std::vector<std::pair<json, std::string>>{
           {{{"output_config", {{"format", {{"type", "xml"}}}}}}, "output_config.format.type: Input should be 'json_schema'"},
           {{{"output_config", {{"format", {{"type", "json_schema"}}}}}}, "output_config.format.schema: Field required"},
           {{{"output_config", {{"effort", "extreme"}}}},
            "output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'"},
       }) {
    Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", bad), kAnthropicAuth);
    EXPECT_EQ(r.res.status, 400) << bad.dump();
    EXPECT_EQ(r.Json()["error"]["message"], message);
  }
}

TEST(FakeVendorAnthropic, StopSequenceReportedInTheStream) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  Reply r = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude", {{"stop_sequences", {"w3"}}, {"stream", true}}),
                 kAnthropicAuth);
  std::string text;
  json delta;
  for (const auto& e : ParseSse(r.res.body)) {
    json d = json::parse(e.data);
    if (e.event == "content_block_delta") text += d["delta"]["text"].get<std::string>();
    if (e.event == "message_delta") delta = d["delta"];
  }
  EXPECT_EQ(text, "hi there w2 ");
  EXPECT_EQ(delta["stop_reason"], "stop_sequence");
  EXPECT_EQ(delta["stop_sequence"], "w3");
}

TEST(FakeVendorAnthropic, ToolUse) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  json tools = {{"tools", json::array({{{"name", "lookup"}, {"input_schema", {{"type", "object"}}}}})}};
  json j = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-tools", tools), kAnthropicAuth).Json();
  EXPECT_EQ(j["stop_reason"], "tool_use");
  ASSERT_EQ(j["content"].size(), 1u);
  EXPECT_EQ(j["content"][0]["type"], "tool_use");
  EXPECT_EQ(j["content"][0]["name"], "lookup");
  EXPECT_EQ(j["content"][0]["id"].get<std::string>().rfind("toolu_", 0), 0u);
  EXPECT_EQ(j["content"][0]["input"], json({{"x", 1}}));

  tools["stream"] = true;
  Reply s = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-tools", tools), kAnthropicAuth);
  std::string partial;
  std::string stop;
  for (const auto& e : ParseSse(s.res.body)) {
    json d = json::parse(e.data);
    if (e.event == "content_block_start") {
      EXPECT_EQ(d["content_block"]["type"], "tool_use");
      EXPECT_EQ(d["content_block"]["input"], json::object());
    }
    if (e.event == "content_block_delta") {
      EXPECT_EQ(d["delta"]["type"], "input_json_delta");
      partial += d["delta"]["partial_json"].get<std::string>();
    }
    if (e.event == "message_delta") stop = d["delta"]["stop_reason"];
  }
  EXPECT_EQ(json::parse(partial), json({{"x", 1}}));
  EXPECT_EQ(stop, "tool_use");

  // A tool_result as the last turn gets a text answer.
  json after = json::parse(MessagesBody("claude-tools", tools));
  after["stream"] = false;
  after["messages"].push_back({{"role", "assistant"},
                               {"content", json::array({{{"type", "tool_use"}, {"id", "toolu_1"}, {"name", "lookup"},
                                                         {"input", {{"x", 1}}}}})}});
  after["messages"].push_back(
      {{"role", "user"}, {"content", json::array({{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}, {"content", "42"}}})}});
  EXPECT_EQ(Call(fv->port(), "POST", "/v1/messages", after.dump(), kAnthropicAuth).Json()["stop_reason"], "end_turn");
}

TEST(FakeVendorAnthropic, Switches) {
  auto fv = StartFake(FakeVendorKind::kAnthropic);
  Reply over = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-overloaded"), kAnthropicAuth);
  EXPECT_EQ(over.res.status, 529);
  EXPECT_EQ(over.Json()["error"]["type"], "overloaded_error");
  Reply over2 = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-error-503"), kAnthropicAuth);
  EXPECT_EQ(over2.res.status, 529);
  Reply rl = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-error-429"), kAnthropicAuth);
  EXPECT_EQ(rl.res.status, 429);
  EXPECT_EQ(rl.Json()["error"]["type"], "rate_limit_error");
  EXPECT_EQ(rl.res.Header("retry-after"), "1");
  Reply e500 = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-error-500"), kAnthropicAuth);
  EXPECT_EQ(e500.res.status, 500);
  EXPECT_EQ(e500.Json()["error"]["type"], "api_error");
  Reply garbage = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-garbage"), kAnthropicAuth);
  EXPECT_EQ(garbage.res.status, 200);
  EXPECT_TRUE(garbage.Json().is_discarded());
  Reply trunc = Call(fv->port(), "POST", "/v1/messages", MessagesBody("claude-truncate", {{"stream", true}}), kAnthropicAuth);
  EXPECT_FALSE(trunc.complete);
  auto events = ParseSse(trunc.res.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front().event, "message_start");
  for (const auto& e : events) {
    EXPECT_NE(e.event, "message_stop");
    EXPECT_NE(e.event, "message_delta");
  }
}

// ---- Gemini ------------------------------------------------------------------------------------

std::string GeminiBody(json extra = json::object()) {
  json b = {{"systemInstruction", {{"parts", json::array({{{"text", "be brief"}}})}}},
            {"contents", json::array({{{"role", "user"}, {"parts", json::array({{{"text", "why sky"}}})}}})}};
  b.update(extra);
  return b.dump();
}

TEST(FakeVendorGemini, GenerateContent) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  Reply r = Call(fv->port(), "POST", "/v1beta/models/gemini-2.0-flash:generateContent", GeminiBody(), kGeminiAuth);
  ASSERT_EQ(r.res.status, 200) << r.res.body;
  json j = r.Json();
  ASSERT_EQ(j["candidates"].size(), 1u);
  const json& c = j["candidates"][0];
  EXPECT_EQ(c["content"]["role"], "model");
  EXPECT_EQ(c["content"]["parts"][0]["text"], "why sky w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15");
  EXPECT_EQ(c["finishReason"], "STOP");
  EXPECT_EQ(j["usageMetadata"]["promptTokenCount"], 4);  // ceil((8 + 7) / 4)
  EXPECT_EQ(j["usageMetadata"]["candidatesTokenCount"], 16);
  EXPECT_EQ(j["usageMetadata"]["totalTokenCount"], 20);
  EXPECT_EQ(j["modelVersion"], "gemini-2.0-flash");
  EXPECT_TRUE(j["responseId"].is_string());
}

TEST(FakeVendorGemini, StreamSse) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  Reply r = Call(fv->port(), "POST", "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
                 GeminiBody({{"generationConfig", {{"maxOutputTokens", 5}}}}), kGeminiAuth);
  ASSERT_EQ(r.res.status, 200);
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.res.Header("Content-Type"), "text/event-stream");
  EXPECT_NE(r.res.body.find("\r\n\r\n"), std::string::npos);  // Gemini frames events with CRLF
  EXPECT_EQ(r.res.body.find("event:"), std::string::npos);
  auto events = ParseSse(r.res.body);
  ASSERT_EQ(events.size(), 5u);
  std::string text;
  for (size_t i = 0; i < events.size(); ++i) {
    json d = json::parse(events[i].data);
    text += d["candidates"][0]["content"]["parts"][0]["text"].get<std::string>();
    EXPECT_EQ(d["usageMetadata"]["promptTokenCount"], 4);
    bool last = i + 1 == events.size();
    EXPECT_EQ(d["candidates"][0].contains("finishReason"), last);
    EXPECT_EQ(d["usageMetadata"].contains("candidatesTokenCount"), last);
  }
  EXPECT_EQ(text, "why sky w2 w3 w4");
  json last = json::parse(events.back().data);
  EXPECT_EQ(last["candidates"][0]["finishReason"], "MAX_TOKENS");
  EXPECT_EQ(last["usageMetadata"]["candidatesTokenCount"], 5);
}

TEST(FakeVendorGemini, StreamJsonArrayWithoutAltSse) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  Reply r = Call(fv->port(), "POST", "/v1beta/models/gemini-2.0-flash:streamGenerateContent", GeminiBody(), kGeminiAuth);
  json arr = r.Json();
  ASSERT_TRUE(arr.is_array()) << r.res.body;
  EXPECT_EQ(arr.size(), 16u);
  EXPECT_EQ(arr.back()["candidates"][0]["finishReason"], "STOP");
}

TEST(FakeVendorGemini, Auth) {
  FakeVendorOptions o;
  o.api_key = "AIza-good";
  auto fv = StartFake(FakeVendorKind::kGemini, o);
  const std::string path = "/v1beta/models/gemini-2.0-flash:generateContent";
  Reply none = Call(fv->port(), "POST", path, GeminiBody(), {});
  EXPECT_EQ(none.res.status, 403);
  EXPECT_EQ(none.Json()["error"]["status"], "PERMISSION_DENIED");
  EXPECT_EQ(none.Json()["error"]["code"], 403);
  Reply wrong = Call(fv->port(), "POST", path, GeminiBody(), {{"x-goog-api-key", "bad"}});
  EXPECT_EQ(wrong.res.status, 400);
  EXPECT_EQ(wrong.Json()["error"]["status"], "INVALID_ARGUMENT");
  EXPECT_EQ(wrong.Json()["error"]["details"][0]["reason"], "API_KEY_INVALID");
  EXPECT_EQ(Call(fv->port(), "POST", path + "?key=AIza-good", GeminiBody(), {}).res.status, 200);
  EXPECT_EQ(Call(fv->port(), "POST", path, GeminiBody(), {{"x-goog-api-key", "AIza-good"}}).res.status, 200);
}

TEST(FakeVendorGemini, Validation) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  const std::string path = "/v1beta/models/gemini-2.0-flash:generateContent";
  Reply bad = Call(fv->port(), "POST", path, "[1,", kGeminiAuth);
  EXPECT_EQ(bad.res.status, 400);
  EXPECT_EQ(bad.Json()["error"]["status"], "INVALID_ARGUMENT");
  Reply unknown = Call(fv->port(), "POST", path, GeminiBody({{"max_tokens", 5}}), kGeminiAuth);
  EXPECT_EQ(unknown.res.status, 400);
  EXPECT_NE(unknown.Json()["error"]["message"].get<std::string>().find("Unknown name \"max_tokens\""), std::string::npos);
  Reply unknown_cfg = Call(fv->port(), "POST", path, GeminiBody({{"generationConfig", {{"max_tokens", 5}}}}), kGeminiAuth);
  EXPECT_EQ(unknown_cfg.res.status, 400);
  Reply snake = Call(fv->port(), "POST", path, GeminiBody({{"generation_config", {{"max_output_tokens", 2}}}}), kGeminiAuth);
  EXPECT_EQ(snake.res.status, 200);
  EXPECT_EQ(snake.Json()["candidates"][0]["finishReason"], "MAX_TOKENS");
  Reply no_contents = Call(fv->port(), "POST", path, R"({"contents":[]})", kGeminiAuth);
  EXPECT_EQ(no_contents.res.status, 400);
  Reply bad_method = Call(fv->port(), "POST", "/v1beta/models/gemini-2.0-flash:fooBar", GeminiBody(), kGeminiAuth);
  EXPECT_EQ(bad_method.res.status, 404);
  EXPECT_EQ(bad_method.Json()["error"]["status"], "NOT_FOUND");
}

TEST(FakeVendorGemini, GenerationConfigSamplingFieldsAreTyped) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  const std::string path = "/v1beta/models/gemini-2.0-flash:generateContent";
  json gc = {{"topK", 40}, {"topP", 0.9}, {"presencePenalty", 0.5}, {"frequencyPenalty", -0.25}, {"stopSequences", {"w3"}}};
  Reply ok = Call(fv->port(), "POST", path, GeminiBody({{"generationConfig", gc}}), kGeminiAuth);
  ASSERT_EQ(ok.res.status, 200) << ok.res.body;
  EXPECT_EQ(ok.Json()["candidates"][0]["content"]["parts"][0]["text"], "why sky w2 ");
  EXPECT_EQ(ok.Json()["candidates"][0]["finishReason"], "STOP");
  for (const auto& [bad, field] : std::vector<std::pair<json, std::string>>{
           {{{"topK", "many"}}, "'generation_config.top_k' (TYPE_INT32)"},
           {{{"topK", 2.5}}, "'generation_config.top_k' (TYPE_INT32)"},
           {{{"presencePenalty", "high"}}, "'generation_config.presence_penalty' (TYPE_FLOAT)"},
           {{{"frequency_penalty", true}}, "'generation_config.frequency_penalty' (TYPE_FLOAT)"},
           {{{"stopSequences", {1}}}, "'generation_config.stop_sequences[0]' (TYPE_STRING)"},
       }) {
    Reply r = Call(fv->port(), "POST", path, GeminiBody({{"generationConfig", bad}}), kGeminiAuth);
    EXPECT_EQ(r.res.status, 400) << bad.dump();
    EXPECT_EQ(r.Json()["error"]["status"], "INVALID_ARGUMENT");
    EXPECT_NE(r.Json()["error"]["message"].get<std::string>().find(field), std::string::npos) << r.res.body;
  }
}

TEST(FakeVendorGemini, StructuredOutput) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  const std::string path = "/v1beta/models/gemini-2.0-flash:generateContent";
  auto text_of = [&](const json& gc, const std::string& p = "") {
    Reply r = Call(fv->port(), "POST", p.empty() ? path : p, GeminiBody({{"generationConfig", gc}}), kGeminiAuth);
    EXPECT_EQ(r.res.status, 200) << r.res.body;
    if (!p.empty()) {  // SSE: join the parts
      std::string text;
      for (const auto& e : ParseSse(r.res.body)) text += json::parse(e.data)["candidates"][0]["content"]["parts"][0]["text"].get<std::string>();
      return text;
    }
    return r.Json()["candidates"][0]["content"]["parts"][0]["text"].get<std::string>();
  };
  // JSON Schema (responseJsonSchema) and the OpenAPI subset (responseSchema, upper-case types).
  json js = {{"responseMimeType", "application/json"},
             {"responseJsonSchema",
              {{"type", "object"}, {"properties", {{"q", {{"type", "string"}}}, {"n", {{"type", "number"}}}}}}}};
  EXPECT_EQ(json::parse(text_of(js), nullptr, false), json({{"q", "why"}, {"n", 1.0}}));
  json openapi = {{"response_mime_type", "application/json"},
                  {"response_schema",
                   {{"type", "OBJECT"},
                    {"properties", {{"items", {{"type", "ARRAY"}, {"items", {{"type", "STRING"}}}}}, {"ok", {{"type", "BOOLEAN"}}}}}}}};
  EXPECT_EQ(json::parse(text_of(openapi), nullptr, false), json({{"items", {"why"}}, {"ok", true}}));
  EXPECT_EQ(json::parse(text_of(openapi, "/v1beta/models/g:streamGenerateContent?alt=sse"), nullptr, false),
            json({{"items", {"why"}}, {"ok", true}}));
  json plain = {{"responseMimeType", "application/json"}};
  EXPECT_EQ(json::parse(text_of(plain), nullptr, false)["answer"].get<std::string>().rfind("why sky w2", 0), 0u);
  json enumerated = {{"responseMimeType", "text/x.enum"}, {"responseSchema", {{"type", "STRING"}, {"enum", {"RED", "BLUE"}}}}};
  EXPECT_EQ(text_of(enumerated), "RED");

  for (const json& bad : {json{{"responseMimeType", "text/html"}},
                          json{{"responseSchema", {{"type", "OBJECT"}}}},  // text/plain with a schema
                          json{{"responseMimeType", "application/json"},
                               {"responseSchema", {{"type", "OBJECT"}}},
                               {"responseJsonSchema", {{"type", "object"}}}}}) {
    Reply r = Call(fv->port(), "POST", path, GeminiBody({{"generationConfig", bad}}), kGeminiAuth);
    EXPECT_EQ(r.res.status, 400) << bad.dump();
    EXPECT_EQ(r.Json()["error"]["status"], "INVALID_ARGUMENT");
  }
}

TEST(FakeVendorGemini, FunctionCall) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  json tools = {{"tools", json::array({{{"functionDeclarations", json::array({{{"name", "find"}}})}}})}};
  json j = Call(fv->port(), "POST", "/v1beta/models/gemini-tools:generateContent", GeminiBody(tools), kGeminiAuth).Json();
  const json& c = j["candidates"][0];
  EXPECT_EQ(c["finishReason"], "STOP");
  EXPECT_EQ(c["content"]["parts"][0]["functionCall"]["name"], "find");
  EXPECT_EQ(c["content"]["parts"][0]["functionCall"]["args"], json({{"x", 1}}));
  Reply s = Call(fv->port(), "POST", "/v1beta/models/gemini-tools:streamGenerateContent?alt=sse", GeminiBody(tools),
                 kGeminiAuth);
  auto events = ParseSse(s.res.body);
  ASSERT_EQ(events.size(), 1u);
  json d = json::parse(events[0].data);
  EXPECT_EQ(d["candidates"][0]["content"]["parts"][0]["functionCall"]["name"], "find");
  EXPECT_EQ(d["candidates"][0]["finishReason"], "STOP");
}

TEST(FakeVendorGemini, Switches) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  Reply rl = Call(fv->port(), "POST", "/v1beta/models/gemini-error-429:generateContent", GeminiBody(), kGeminiAuth);
  EXPECT_EQ(rl.res.status, 429);
  EXPECT_EQ(rl.Json()["error"]["status"], "RESOURCE_EXHAUSTED");
  EXPECT_EQ(rl.res.Header("retry-after"), "1");
  Reply un = Call(fv->port(), "POST", "/v1beta/models/gemini-error-503:generateContent", GeminiBody(), kGeminiAuth);
  EXPECT_EQ(un.res.status, 503);
  EXPECT_EQ(un.Json()["error"]["status"], "UNAVAILABLE");
  Reply e500 = Call(fv->port(), "POST", "/v1beta/models/gemini-error-500:generateContent", GeminiBody(), kGeminiAuth);
  EXPECT_EQ(e500.Json()["error"]["status"], "INTERNAL");
  Reply garbage = Call(fv->port(), "POST", "/v1beta/models/gemini-garbage:streamGenerateContent?alt=sse", GeminiBody(),
                       kGeminiAuth);
  EXPECT_EQ(garbage.res.status, 200);
  auto gev = ParseSse(garbage.res.body);
  ASSERT_FALSE(gev.empty());
  EXPECT_TRUE(json::parse(gev[0].data, nullptr, false).is_discarded());
  Reply trunc = Call(fv->port(), "POST", "/v1beta/models/gemini-truncate:streamGenerateContent?alt=sse", GeminiBody(),
                     kGeminiAuth);
  EXPECT_FALSE(trunc.complete);
  auto events = ParseSse(trunc.res.body);
  EXPECT_EQ(events.size(), 8u);
  for (const auto& e : events) EXPECT_FALSE(json::parse(e.data)["candidates"][0].contains("finishReason"));
}

TEST(FakeVendorCommon, ServerOwnErrorsUseTheVendorFormat) {
  auto fv = StartFake(FakeVendorKind::kGemini);
  HttpTestClient c(fv->port());
  ASSERT_TRUE(c.SendRaw("GARBAGE\r\n\r\n"));
  HttpTestResponse res;
  c.ReadResponse(&res);
  EXPECT_EQ(res.status, 400);
  EXPECT_EQ(json::parse(res.body, nullptr, false)["error"]["status"], "INVALID_ARGUMENT");
}

TEST(FakeVendorCommon, ParseKindAndStopInterruptsPacing) {
  EXPECT_EQ(ParseFakeVendorKind("anthropic").value(), FakeVendorKind::kAnthropic);
  EXPECT_FALSE(ParseFakeVendorKind("bard").ok());
  FakeVendorOptions bad;
  bad.reply_tokens = -1;
  EXPECT_FALSE(FakeVendor::Start(bad).ok());

  FakeVendorOptions o;
  o.tokens_per_second = 1;  // 16 words would take 15 s
  auto fv = StartFake(FakeVendorKind::kOpenAI, o);
  std::thread client([&] { Call(fv->port(), "POST", "/v1/chat/completions", ChatBody("m", "x", {{"stream", true}}), kOpenAIAuth); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto t0 = Clock::now();
  fv->Stop();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  client.join();
  EXPECT_EQ(fv->stats().cancelled, 1u);
}

}  // namespace
}  // namespace keel::gateway
