// Stream encoders: every client format's stream is checked for well-formedness, then parsed back
// with the gateway's own decoders and compared to what went in -- for hand-built event sequences
// in awkward orders and for real-shaped upstream streams of every vendor (all format pairs).
#include "keel/gateway/stream.h"
#include "tests/gateway/stream_by_format.h"

#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

using stream_by_format::MakeStreamDecoder;
using stream_by_format::MakeStreamEncoder;

using Json = nlohmann::json;
using Kind = StreamEvent::Kind;

const WireFormat kClients[] = {WireFormat::kOpenAIChat, WireFormat::kOpenAICompletions,
                               WireFormat::kAnthropicMessages};

// ---- event builders

StreamEvent E(Kind k) {
  StreamEvent e;
  e.kind = k;
  return e;
}
StreamEvent Start(std::string id) {
  StreamEvent e = E(Kind::kStart);
  e.id = std::move(id);
  e.model = "upstream-model";
  return e;
}
StreamEvent Text(std::string t) {
  StreamEvent e = E(Kind::kTextDelta);
  e.text = std::move(t);
  return e;
}
StreamEvent Tool(int i, std::string id, std::string name) {
  StreamEvent e = E(Kind::kToolCallStart);
  e.tool_index = i;
  e.tool_call.id = std::move(id);
  e.tool_call.name = std::move(name);
  return e;
}
StreamEvent Args(int i, std::string piece) {
  StreamEvent e = E(Kind::kToolCallDelta);
  e.tool_index = i;
  e.text = std::move(piece);
  return e;
}
StreamEvent Fin(FinishReason r) {
  StreamEvent e = E(Kind::kFinish);
  e.finish = r;
  return e;
}
StreamEvent Use(int64_t in, int64_t out) {
  StreamEvent e = E(Kind::kUsage);
  e.usage = {in, out};
  return e;
}

// ---- what a stream amounts to

struct Summary {
  std::string text;
  std::vector<ToolCall> tools;
  FinishReason finish = FinishReason::kNone;
  Usage usage;
  bool done = false;
};

Summary Summarize(const std::vector<StreamEvent>& events) {
  Summary s;
  std::map<int, size_t> slot;
  auto tool = [&](int i) -> ToolCall& {
    auto [it, fresh] = slot.emplace(i, s.tools.size());
    if (fresh) s.tools.emplace_back();
    return s.tools[it->second];
  };
  for (const StreamEvent& e : events) {
    switch (e.kind) {
      case Kind::kStart: break;
      case Kind::kTextDelta: s.text += e.text; break;
      case Kind::kToolCallStart:
        tool(e.tool_index).id = e.tool_call.id;
        tool(e.tool_index).name = e.tool_call.name;
        break;
      case Kind::kToolCallDelta: tool(e.tool_index).arguments_json += e.text; break;
      case Kind::kFinish:
        if (s.finish == FinishReason::kNone) s.finish = e.finish;
        break;
      case Kind::kUsage:
        if (e.usage.input_tokens >= 0) s.usage.input_tokens = e.usage.input_tokens;
        if (e.usage.output_tokens >= 0) s.usage.output_tokens = e.usage.output_tokens;
        break;
      case Kind::kDone: s.done = true; break;
    }
  }
  return s;
}

std::string EncodeAll(WireFormat client, const std::vector<StreamEvent>& events, bool include_usage,
                      const std::string& model = "my-model") {
  auto enc = MakeStreamEncoder(client, model, include_usage);
  std::string out;
  for (const StreamEvent& e : events) enc->Encode(e, &out);
  return out;
}

Result<std::vector<StreamEvent>> DecodeAll(WireFormat f, std::string_view body) {
  auto dec = MakeStreamDecoder(f);
  std::vector<StreamEvent> events;
  KEEL_RETURN_IF_ERROR(dec->Feed(body, &events));
  KEEL_RETURN_IF_ERROR(dec->Finish(&events));
  return events;
}

std::vector<SseParser::Event> Frames(std::string_view body) {
  SseParser p;
  std::vector<SseParser::Event> out;
  EXPECT_TRUE(p.Feed(body, &out).ok());
  EXPECT_FALSE(p.HasPartialEvent());
  return out;
}

// ---- well-formedness of a client stream, beyond what the decoders check

void ValidateOpenAI(std::string_view body, bool chat, bool include_usage, const std::string& model) {
  auto frames = Frames(body);
  ASSERT_GE(frames.size(), 2u);
  ASSERT_EQ(frames.back().data, "[DONE]");
  std::string id;
  int finishes = 0, usage_chunks = 0;
  std::map<int64_t, bool> tools_seen;
  for (size_t i = 0; i + 1 < frames.size(); ++i) {
    SCOPED_TRACE(frames[i].data);
    EXPECT_EQ(frames[i].event, "");
    Json j = Json::parse(frames[i].data, nullptr, false);
    ASSERT_TRUE(j.is_object());
    if (id.empty()) id = j.value("id", "");
    EXPECT_EQ(j.value("id", ""), id);
    EXPECT_EQ(id.rfind(chat ? "chatcmpl-" : "cmpl-", 0), 0u) << id;
    EXPECT_EQ(j.value("object", ""), chat ? "chat.completion.chunk" : "text_completion");
    EXPECT_EQ(j.value("model", ""), model);
    EXPECT_TRUE(j["created"].is_number_integer());
    EXPECT_EQ(j.contains("usage"), include_usage);
    ASSERT_TRUE(j["choices"].is_array());
    if (j["choices"].empty()) {  // the usage chunk: once, last
      ++usage_chunks;
      EXPECT_EQ(i + 2, frames.size());
      const Json& u = j["usage"];
      EXPECT_EQ(u["total_tokens"], u["prompt_tokens"].get<int64_t>() + u["completion_tokens"].get<int64_t>());
      continue;
    }
    if (include_usage) { EXPECT_TRUE(j["usage"].is_null()); }
    const Json& c = j["choices"][0];
    EXPECT_EQ(c["index"], 0);
    EXPECT_TRUE(c.contains("logprobs") && c["logprobs"].is_null());
    if (!c["finish_reason"].is_null()) ++finishes;
    if (!chat) {
      EXPECT_TRUE(c["text"].is_string());
      continue;
    }
    if (i == 0) { EXPECT_EQ(c["delta"].value("role", ""), "assistant"); }
    if (c["delta"].contains("tool_calls")) {
      for (const Json& t : c["delta"]["tool_calls"]) {
        if (tools_seen[t["index"].get<int64_t>()]) continue;
        tools_seen[t["index"].get<int64_t>()] = true;  // first sight: id, type and name
        EXPECT_TRUE(t["id"].is_string() && !t["id"].get<std::string>().empty());
        EXPECT_EQ(t["type"], "function");
        EXPECT_TRUE(t["function"]["name"].is_string());
      }
    }
  }
  EXPECT_EQ(finishes, 1);
  EXPECT_EQ(usage_chunks, include_usage ? 1 : 0);
}

void ValidateAnthropic(std::string_view body, const std::string& model) {
  auto frames = Frames(body);
  ASSERT_GE(frames.size(), 3u);
  int open = -1, next = 0;
  std::string open_type;
  for (size_t i = 0; i < frames.size(); ++i) {
    SCOPED_TRACE(frames[i].data);
    Json j = Json::parse(frames[i].data, nullptr, false);
    ASSERT_TRUE(j.is_object());
    const std::string type = j.value("type", "");
    EXPECT_EQ(frames[i].event, type);
    if (i == 0) {
      ASSERT_EQ(type, "message_start");
      EXPECT_EQ(j["message"]["model"], model);
      EXPECT_EQ(j["message"]["id"].get<std::string>().rfind("msg_", 0), 0u);
      EXPECT_TRUE(j["message"]["content"].is_array() && j["message"]["content"].empty());
      EXPECT_TRUE(j["message"]["usage"]["input_tokens"].is_number_integer());
      continue;
    }
    EXPECT_NE(type, "message_start");
    if (type == "content_block_start") {
      EXPECT_EQ(open, -1) << "block opened while another is open";
      EXPECT_EQ(j["index"], next);
      open = next++;
      open_type = j["content_block"]["type"];
      if (open_type == "tool_use") { EXPECT_FALSE(j["content_block"]["id"].get<std::string>().empty()); }
    } else if (type == "content_block_delta") {
      EXPECT_EQ(j["index"], open);
      EXPECT_EQ(j["delta"]["type"], open_type == "text" ? "text_delta" : "input_json_delta");
    } else if (type == "content_block_stop") {
      EXPECT_EQ(j["index"], open);
      open = -1;
    } else if (type == "message_delta") {
      EXPECT_EQ(open, -1);
      EXPECT_EQ(i + 2, frames.size());
      EXPECT_TRUE(j["delta"]["stop_reason"].is_string());
      EXPECT_TRUE(j["usage"]["output_tokens"].is_number_integer());
    } else if (type == "message_stop") {
      EXPECT_EQ(i + 1, frames.size());
    } else {
      EXPECT_EQ(type, "ping");
    }
  }
  EXPECT_EQ(frames.back().event, "message_stop");
}

void Validate(WireFormat client, std::string_view body, bool include_usage, const std::string& model) {
  if (client == WireFormat::kAnthropicMessages) {
    ValidateAnthropic(body, model);
  } else {
    ValidateOpenAI(body, client == WireFormat::kOpenAIChat, include_usage, model);
  }
}

// What a client of `client` format must see, given what went in.
Summary Expected(WireFormat client, Summary in, bool include_usage) {
  if (client == WireFormat::kOpenAICompletions) in.tools.clear();  // completions cannot carry calls
  if (in.finish == FinishReason::kNone) in.finish = in.tools.empty() ? FinishReason::kStop : FinishReason::kToolCalls;
  if (client == WireFormat::kAnthropicMessages || include_usage) {
    in.usage.input_tokens = std::max<int64_t>(in.usage.input_tokens, 0);
    in.usage.output_tokens = std::max<int64_t>(in.usage.output_tokens, 0);
  } else {
    in.usage = Usage();
  }
  in.done = true;
  return in;
}

void ExpectSame(const Summary& want, const Summary& got) {
  EXPECT_EQ(got.text, want.text);
  EXPECT_EQ(got.finish, want.finish);
  EXPECT_EQ(got.usage.input_tokens, want.usage.input_tokens);
  EXPECT_EQ(got.usage.output_tokens, want.usage.output_tokens);
  EXPECT_EQ(got.done, want.done);
  ASSERT_EQ(got.tools.size(), want.tools.size());
  for (size_t i = 0; i < want.tools.size(); ++i) {
    if (!want.tools[i].id.empty()) { EXPECT_EQ(got.tools[i].id, want.tools[i].id); }
    EXPECT_FALSE(got.tools[i].id.empty());
    EXPECT_EQ(got.tools[i].name, want.tools[i].name);
    EXPECT_EQ(got.tools[i].arguments_json, want.tools[i].arguments_json);
  }
}

// Encodes `events` for every client format (with and without include_usage), checks the stream
// is well formed and decodes back to the same answer.
void RoundTrip(const std::vector<StreamEvent>& events) {
  const Summary in = Summarize(events);
  for (WireFormat client : kClients) {
    for (bool usage : {false, true}) {
      SCOPED_TRACE(std::string(WireFormatName(client)) + (usage ? " +usage" : ""));
      const std::string body = EncodeAll(client, events, usage);
      Validate(client, body, usage, "my-model");
      auto back = DecodeAll(client, body);
      ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << body;
      ExpectSame(Expected(client, in, usage), Summarize(*back));
    }
  }
}

// ---- hand-built sequences, including orders no vendor sends

TEST(StreamEncoder, TextWithUsageBeforeFinish) {
  RoundTrip({Start("u1"), Use(11, -1), Text("Hel"), Text("lo \"you\"\n\tok\r\n\xe2\x80\xa8 \xf0\x9f\x98\x80"), Use(-1, 4),
             Fin(FinishReason::kLength), E(Kind::kDone)});
}

TEST(StreamEncoder, TextThenParallelToolsWithUsageAfterFinish) {
  RoundTrip({Start("u2"), Text("Checking."), Tool(0, "call_A", "get_weather"), Args(0, "{\"city\":"),
             Args(0, "\"Paris\"}"), Tool(1, "call_B", "get_time"), Args(1, "{}"), Fin(FinishReason::kToolCalls),
             Use(80, 30), E(Kind::kDone)});
}

TEST(StreamEncoder, NothingButDone) { RoundTrip({E(Kind::kDone)}); }

TEST(StreamEncoder, DoneWithoutFinishAfterToolsMeansToolCalls) {
  RoundTrip({Start("u3"), Tool(0, "toolu_9", "f"), Args(0, "{\"a\":1}"), E(Kind::kDone)});
}

TEST(StreamEncoder, TextAfterToolAndToolDeltaWithoutStart) {
  RoundTrip({Tool(5, "id5", "first"), Args(5, "{}"), Text("between"), Args(7, "{\"x\":2}"), Text("after"),
             Fin(FinishReason::kStop), E(Kind::kDone)});
}

TEST(StreamEncoder, EmptyPiecesAndRepeatedFinish) {
  RoundTrip({Start(""), Text(""), Text("a"), Fin(FinishReason::kContentFilter), Fin(FinishReason::kStop),
             Text(""), Use(3, 1), E(Kind::kDone)});
}

TEST(StreamEncoder, OpenAIChunkShapes) {
  const std::string body = EncodeAll(WireFormat::kOpenAIChat,
                                     {Start("abc"), Text("hi"), Tool(0, "call_1", "f"), Args(0, "{}"),
                                      Fin(FinishReason::kToolCalls), Use(5, 2), E(Kind::kDone)},
                                     true, "virt");
  auto frames = Frames(body);
  ASSERT_EQ(frames.size(), 7u);
  auto chunk = [&](size_t i) { return Json::parse(frames[i].data); };
  EXPECT_EQ(chunk(0)["id"], "chatcmpl-abc");
  EXPECT_EQ(chunk(0)["choices"][0]["delta"], Json::parse(R"({"role":"assistant","content":""})"));
  EXPECT_EQ(chunk(1)["choices"][0]["delta"], Json::parse(R"({"content":"hi"})"));
  EXPECT_EQ(chunk(2)["choices"][0]["delta"],
            Json::parse(R"({"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]})"));
  EXPECT_EQ(chunk(3)["choices"][0]["delta"], Json::parse(R"({"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]})"));
  EXPECT_EQ(chunk(4)["choices"][0]["delta"], Json::object());
  EXPECT_EQ(chunk(4)["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(chunk(5)["usage"], Json::parse(R"({"prompt_tokens":5,"completion_tokens":2,"total_tokens":7})"));
  EXPECT_EQ(frames[6].data, "[DONE]");
  // Upstream ids keep a client prefix only once.
  EXPECT_EQ(Json::parse(Frames(EncodeAll(WireFormat::kOpenAIChat, {Start("chatcmpl-x"), E(Kind::kDone)}, false))[0].data)["id"],
            "chatcmpl-x");
}

TEST(StreamEncoder, AnthropicEventShapesAndDeferredUsage) {
  const std::string body = EncodeAll(WireFormat::kAnthropicMessages,
                                     {Start("abc"), Text("hi"), Tool(0, "call_1", "f"), Args(0, "{\"q\":1}"),
                                      Fin(FinishReason::kToolCalls), Use(17, 9), E(Kind::kDone)},
                                     false, "claude-virt");
  auto frames = Frames(body);
  std::vector<std::string> names;
  for (auto& f : frames) names.push_back(f.event);
  EXPECT_EQ(names, (std::vector<std::string>{"message_start", "content_block_start", "ping", "content_block_delta",
                                             "content_block_stop", "content_block_start", "content_block_delta",
                                             "content_block_stop", "message_delta", "message_stop"}));
  Json start = Json::parse(frames[0].data)["message"];
  EXPECT_EQ(start["id"], "msg_abc");
  EXPECT_EQ(start["role"], "assistant");
  EXPECT_EQ(start["type"], "message");
  EXPECT_TRUE(start["stop_reason"].is_null());
  EXPECT_EQ(start["usage"]["input_tokens"], 0);  // only known at the end here
  EXPECT_EQ(Json::parse(frames[5].data)["content_block"],
            Json::parse(R"({"type":"tool_use","id":"call_1","name":"f","input":{}})"));
  Json delta = Json::parse(frames[8].data);
  EXPECT_EQ(delta["delta"]["stop_reason"], "tool_use");
  EXPECT_EQ(delta["usage"]["output_tokens"], 9);
  EXPECT_EQ(delta["usage"]["input_tokens"], 17);
  // Input usage known right after kStart reaches message_start (the header waits for content).
  auto early = Frames(EncodeAll(WireFormat::kAnthropicMessages, {Start("m"), Use(40, -1), Text("x"), E(Kind::kDone)}, false));
  EXPECT_EQ(Json::parse(early[0].data)["message"]["usage"]["input_tokens"], 40);
}

StreamEvent FinSeq(FinishReason r, std::string sequence) {
  StreamEvent e = Fin(r);
  e.stop_sequence = std::move(sequence);
  return e;
}

// The message_delta of an Anthropic client stream.
Json AnthropicEnd(const std::vector<StreamEvent>& events) {
  auto frames = Frames(EncodeAll(WireFormat::kAnthropicMessages, events, false));
  for (const auto& f : frames)
    if (f.event == "message_delta") return Json::parse(f.data)["delta"];
  ADD_FAILURE() << "no message_delta";
  return Json();
}

TEST(StreamEncoder, AnthropicStopSequence) {
  Json d = AnthropicEnd({Start("s"), Text("one two"), FinSeq(FinishReason::kStop, "###"), E(Kind::kDone)});
  EXPECT_EQ(d["stop_reason"], "stop_sequence");
  EXPECT_EQ(d["stop_sequence"], "###");
  d = AnthropicEnd({Start("s"), Text("x"), Fin(FinishReason::kStop), E(Kind::kDone)});
  EXPECT_EQ(d["stop_reason"], "end_turn");
  EXPECT_TRUE(d["stop_sequence"].is_null());
  d = AnthropicEnd({Start("s"), Text("x"), FinSeq(FinishReason::kLength, "###"), E(Kind::kDone)});
  EXPECT_EQ(d["stop_reason"], "max_tokens");  // only a stop is reported as a sequence
  EXPECT_TRUE(d["stop_sequence"].is_null());
  d = AnthropicEnd({Start("s"), Text("x"), FinSeq(FinishReason::kStop, "A"), FinSeq(FinishReason::kStop, "B"),
                    E(Kind::kDone)});
  EXPECT_EQ(d["stop_sequence"], "A");  // the first finish wins, with its sequence
  // OpenAI clients have no such field: a plain "stop".
  auto frames = Frames(EncodeAll(WireFormat::kOpenAIChat,
                                 {Start("s"), Text("x"), FinSeq(FinishReason::kStop, "###"), E(Kind::kDone)}, false));
  ASSERT_GE(frames.size(), 2u);
  EXPECT_EQ(Json::parse(frames[frames.size() - 2].data)["choices"][0]["finish_reason"], "stop");
}

TEST(StreamEncoder, EventsAfterDoneOrErrorAreIgnored) {
  for (WireFormat client : kClients) {
    auto enc = MakeStreamEncoder(client, "m", true);
    std::string out;
    enc->Encode(E(Kind::kDone), &out);
    const std::string ended = out;
    enc->Encode(Text("late"), &out);
    enc->Encode(E(Kind::kDone), &out);
    enc->EncodeError({500, ErrorKind::kApi, "late"}, &out);
    EXPECT_EQ(out, ended) << WireFormatName(client);
    auto enc2 = MakeStreamEncoder(client, "m", true);
    std::string out2;
    enc2->EncodeError({500, ErrorKind::kApi, "boom"}, &out2);
    const std::string errored = out2;
    enc2->Encode(Text("late"), &out2);
    enc2->Encode(E(Kind::kDone), &out2);
    EXPECT_EQ(out2, errored) << WireFormatName(client);
  }
}

TEST(StreamEncoder, ErrorsMidStreamReachTheClientDecoder) {
  struct Case {
    WireFormat client;
    GatewayError error;
  };
  const Case cases[] = {
      {WireFormat::kOpenAIChat, {429, ErrorKind::kRateLimit, "budget exhausted"}},
      {WireFormat::kOpenAICompletions, {502, ErrorKind::kBadGateway, "truncated upstream"}},
      {WireFormat::kAnthropicMessages, {529, ErrorKind::kOverloaded, "Overloaded"}},
      {WireFormat::kAnthropicMessages, {429, ErrorKind::kRateLimit, "line1\nline2"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.error.message);
    auto enc = MakeStreamEncoder(c.client, "m", false);
    std::string out;
    enc->Encode(Start("s"), &out);
    enc->Encode(Text("partial answer"), &out);
    enc->EncodeError(c.error, &out);
    if (c.client == WireFormat::kAnthropicMessages) {
      const size_t at = out.find("event: error\ndata: ");
      ASSERT_NE(at, std::string::npos) << out;
      EXPECT_EQ(Json::parse(out.substr(at + 19))["type"], "error");
    } else {
      EXPECT_EQ(out.substr(out.size() - 14), "data: [DONE]\n\n");
    }
    auto dec = MakeStreamDecoder(c.client);
    std::vector<StreamEvent> events;
    Status s = dec->Feed(out, &events);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << out;
    ASSERT_NE(dec->upstream_error(), nullptr);
    EXPECT_EQ(dec->upstream_error()->message, c.error.message);
    if (c.error.kind != ErrorKind::kBadGateway) { EXPECT_EQ(dec->upstream_error()->kind, c.error.kind); }
    EXPECT_EQ(Summarize(events).text, "partial answer");  // what came before the error survives
  }
}

TEST(StreamEncoder, InvalidUtf8IsReplacedNotThrown) {
  for (WireFormat client : kClients) {
    std::string body;
    ASSERT_NO_THROW(body = EncodeAll(client, {Text("a\xff" "b"), Tool(0, "i\xc3", "n\xe2"), Args(0, "{\xfe}"), E(Kind::kDone)}, true));
    auto back = DecodeAll(client, body);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(Summarize(*back).text, "a\xef\xbf\xbd" "b");
  }
}

// Every client format gets its own encoder from the one factory (Gemini clients used to get
// OpenAI chunks from it).
TEST(StreamEncoder, GeminiAndResponsesClientsGetTheirOwnEncoders) {
  auto gemini = Frames(EncodeAll(WireFormat::kGemini, {Text("x"), E(Kind::kDone)}, false));
  ASSERT_FALSE(gemini.empty());
  Json first = Json::parse(gemini.front().data);
  EXPECT_EQ(first["candidates"][0]["content"]["parts"][0]["text"], "x");
  EXPECT_EQ(Json::parse(gemini.back().data)["candidates"][0]["finishReason"], "STOP");
  auto responses = Frames(EncodeAll(WireFormat::kOpenAIResponses, {Text("x"), E(Kind::kDone)}, false));
  ASSERT_FALSE(responses.empty());
  EXPECT_EQ(responses.front().event, "response.created");
  EXPECT_EQ(Json::parse(responses.back().data)["response"]["output"][0]["content"][0]["text"], "x");
}

// U+2028 / U+2029 end a line for JavaScript: @google/genai's framing regex (/^data: (.*)\n\n/)
// stops at them and drops the rest of the stream. Written as escapes, the text is unchanged.
TEST(StreamEncoder, GeminiSseEscapesJavaScriptLineTerminators) {
  const std::string text = "a\xE2\x80\xA8" "b\xE2\x80\xA9" "c \xE2\x82\xAC";  // U+2028, U+2029, and a euro sign kept
  const std::string body = EncodeAll(WireFormat::kGemini, {Text(text), E(Kind::kDone)}, false);
  EXPECT_EQ(body.find("\xE2\x80\xA8"), std::string::npos);
  EXPECT_EQ(body.find("\xE2\x80\xA9"), std::string::npos);
  EXPECT_NE(body.find("a\\u2028b\\u2029c \xE2\x82\xAC"), std::string::npos) << body;
  auto frames = Frames(body);
  ASSERT_FALSE(frames.empty());
  EXPECT_EQ(Json::parse(frames.front().data)["candidates"][0]["content"]["parts"][0]["text"], text);
}

// ---- real-shaped upstream streams -> every client format

const char kOpenAIUp[] =
    "data: {\"id\":\"chatcmpl-u\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"role\":\"assistant\",\"content\":\"Sure: \"},\"finish_reason\":null}],\"usage\":null}\n\n"
    "data: {\"id\":\"chatcmpl-u\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_A\",\"type\":\"function\",\"function\":{\"name\":\"lookup\","
    "\"arguments\":\"{\\\"q\\\":\"}}]},\"finish_reason\":null}],\"usage\":null}\n\n"
    "data: {\"id\":\"chatcmpl-u\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"x\\\"}\"}}]},\"finish_reason\":null}],\"usage\":null}\n\n"
    "data: {\"id\":\"chatcmpl-u\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{},\"finish_reason\":\"tool_calls\"}],\"usage\":null}\n\n"
    "data: {\"id\":\"chatcmpl-u\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],"
    "\"usage\":{\"prompt_tokens\":31,\"completion_tokens\":12,\"total_tokens\":43}}\n\n"
    "data: [DONE]\n\n";

const char kAnthropicUp[] =
    "event: message_start\r\n"
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_u\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],"
    "\"model\":\"claude-sonnet-4-5\",\"usage\":{\"input_tokens\":50,\"output_tokens\":1}}}\r\n\r\n"
    "event: content_block_start\r\n"
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\r\n\r\n"
    "event: content_block_delta\r\n"
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Line one\\nline two\"}}\r\n\r\n"
    "event: content_block_stop\r\n"
    "data: {\"type\":\"content_block_stop\",\"index\":0}\r\n\r\n"
    "event: message_delta\r\n"
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":6}}\r\n\r\n"
    "event: message_stop\r\n"
    "data: {\"type\":\"message_stop\"}\r\n\r\n";

const char kGeminiUp[] =
    "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"Calling.\"}],\"role\":\"model\"},\"index\":0}],"
    "\"usageMetadata\":{\"promptTokenCount\":20},\"modelVersion\":\"gemini-2.5-flash\",\"responseId\":\"g1\"}\r\n\r\n"
    "data: {\"candidates\":[{\"content\":{\"parts\":[{\"functionCall\":{\"name\":\"lookup\",\"args\":{\"q\":\"x\",\"n\":2}}}],"
    "\"role\":\"model\"},\"finishReason\":\"STOP\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":20,"
    "\"candidatesTokenCount\":9},\"modelVersion\":\"gemini-2.5-flash\",\"responseId\":\"g1\"}\r\n\r\n";

TEST(StreamTranslate, EveryUpstreamToEveryClient) {
  struct Up {
    WireFormat format;
    const char* body;
  };
  for (const Up& up : {Up{WireFormat::kOpenAIChat, kOpenAIUp}, Up{WireFormat::kAnthropicMessages, kAnthropicUp},
                       Up{WireFormat::kGemini, kGeminiUp}}) {
    SCOPED_TRACE(WireFormatName(up.format));
    auto events = DecodeAll(up.format, up.body);
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    const Summary in = Summarize(*events);
    ASSERT_TRUE(in.done);
    ASSERT_FALSE(in.text.empty());
    ASSERT_GE(in.usage.input_tokens, 0);
    ASSERT_GE(in.usage.output_tokens, 0);
    RoundTrip(*events);
    // The client's stream, fed to the client-side decoder one byte at a time, gives the same.
    for (WireFormat client : kClients) {
      const std::string body = EncodeAll(client, *events, true);
      auto dec = MakeStreamDecoder(client);
      std::vector<StreamEvent> back;
      for (char ch : body) ASSERT_TRUE(dec->Feed(std::string_view(&ch, 1), &back).ok());
      ASSERT_TRUE(dec->Finish(&back).ok());
      ExpectSame(Expected(client, in, true), Summarize(back));
    }
  }
}

// An Anthropic upstream that stopped on a stop sequence, to an Anthropic client: the sequence
// survives decode and re-encode, and the client-side decoder reads it back.
TEST(StreamTranslate, AnthropicStopSequenceReachesAnthropicClient) {
  std::string up = kAnthropicUp;
  const std::string natural = "{\"stop_reason\":\"end_turn\",\"stop_sequence\":null}";
  const size_t at = up.find(natural);
  ASSERT_NE(at, std::string::npos);
  up.replace(at, natural.size(), "{\"stop_reason\":\"stop_sequence\",\"stop_sequence\":\"\\n\\nHuman:\"}");
  auto events = DecodeAll(WireFormat::kAnthropicMessages, up);
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  const std::string client = EncodeAll(WireFormat::kAnthropicMessages, *events, false);
  Json end;
  for (const auto& f : Frames(client))
    if (f.event == "message_delta") end = Json::parse(f.data)["delta"];
  EXPECT_EQ(end["stop_reason"], "stop_sequence");
  EXPECT_EQ(end["stop_sequence"], "\n\nHuman:");
  auto back = DecodeAll(WireFormat::kAnthropicMessages, client);
  ASSERT_TRUE(back.ok());
  std::string seen;
  for (const StreamEvent& e : *back)
    if (e.kind == Kind::kFinish) seen = e.stop_sequence;
  EXPECT_EQ(seen, "\n\nHuman:");
}

TEST(StreamTranslate, ToolCallsSurviveWithIdsAndArguments) {
  auto events = DecodeAll(WireFormat::kGemini, kGeminiUp);
  ASSERT_TRUE(events.ok());
  auto back = DecodeAll(WireFormat::kAnthropicMessages, EncodeAll(WireFormat::kAnthropicMessages, *events, false));
  ASSERT_TRUE(back.ok());
  Summary s = Summarize(*back);
  ASSERT_EQ(s.tools.size(), 1u);
  EXPECT_EQ(s.tools[0].id, "call_0");
  EXPECT_EQ(s.tools[0].name, "lookup");
  EXPECT_EQ(s.tools[0].arguments_json, "{\"q\":\"x\",\"n\":2}");  // the model's key order
  EXPECT_EQ(s.finish, FinishReason::kToolCalls);
  EXPECT_EQ(s.usage.input_tokens, 20);
  EXPECT_EQ(s.usage.output_tokens, 9);
}

}  // namespace
}  // namespace keel::gateway
