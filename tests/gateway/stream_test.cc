// SseParser and the upstream stream decoders: framing rules, real-shaped vendor streams fed at
// every chunk boundary, truncation, malformed JSON, in-stream errors and size bounds.
#include "keel/gateway/stream.h"
#include "tests/gateway/stream_by_format.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace keel::gateway {
namespace {

using stream_by_format::MakeStreamDecoder;

using Kind = StreamEvent::Kind;

// ---- fixtures: shaped like the vendors' real streams

const char kOpenAIText[] =
    "data: {\"id\":\"chatcmpl-abc\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o-mini\","
    "\"system_fingerprint\":\"fp_1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},"
    "\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
    ": keep-alive\n\n"
    "data: {\"id\":\"chatcmpl-abc\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o-mini\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
    "data: {\"id\":\"chatcmpl-abc\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o-mini\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\", w\\u00f6rld \xe2\x98\x83\\n\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
    "data: {\"id\":\"chatcmpl-abc\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o-mini\","
    "\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n"
    "data: {\"id\":\"chatcmpl-abc\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o-mini\","
    "\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":3,\"total_tokens\":15}}\n\n"
    "data: [DONE]\n\n";

const char kOpenAITools[] =
    "data: {\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"index\":0,\"id\":\"call_A\",\"type\":\"function\","
    "\"function\":{\"name\":\"get_weather\",\"arguments\":\"\"}}]},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\\\":\"}}]},\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"Paris\\\"}\"}}]},\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"call_B\",\"type\":\"function\",\"function\":{\"name\":\"get_time\","
    "\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"arguments\":\"{\\\"tz\\\":\\\"CET\\\"}\"}}]},\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,"
    "\"delta\":{},\"finish_reason\":\"tool_calls\"}],\"usage\":{\"prompt_tokens\":80,\"completion_tokens\":30,\"total_tokens\":110}}\n\n"
    "data: [DONE]\n\n";

const char kAnthropicTool[] =
    "event: message_start\n"
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01X\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],"
    "\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,"
    "\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":5,\"output_tokens\":1}}}\n\n"
    "event: content_block_start\n"
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n"
    "event: ping\n"
    "data: {\"type\": \"ping\"}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Let me check \"}}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"the weather.\"}}\n\n"
    "event: content_block_stop\n"
    "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
    "event: content_block_start\n"
    "data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_01\","
    "\"name\":\"get_weather\",\"input\":{}}}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\"}}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"city\\\": \\\"Par\"}}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"is\\\"}\"}}\n\n"
    "event: content_block_stop\n"
    "data: {\"type\":\"content_block_stop\",\"index\":1}\n\n"
    "event: message_delta\n"
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":42}}\n\n"
    "event: message_stop\n"
    "data: {\"type\":\"message_stop\"}\n\n";

// Thinking block, an event type this decoder does not know, a tool called with no input.
const char kAnthropicThinking[] =
    "event: message_start\n"
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_02\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],"
    "\"model\":\"claude-opus-4\",\"usage\":{\"input_tokens\":7,\"output_tokens\":1}}}\n\n"
    "event: content_block_start\n"
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm\"}}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"EqQ=\"}}\n\n"
    "event: content_block_stop\n"
    "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
    "event: future_event\n"
    "data: {\"type\":\"future_event\",\"whatever\":[1,2]}\n\n"
    "event: content_block_start\n"
    "data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n"
    "event: content_block_delta\n"
    "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"Done.\"}}\n\n"
    "event: content_block_stop\n"
    "data: {\"type\":\"content_block_stop\",\"index\":1}\n\n"
    "event: content_block_start\n"
    "data: {\"type\":\"content_block_start\",\"index\":2,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_02\","
    "\"name\":\"now\",\"input\":{}}}\n\n"
    "event: content_block_stop\n"
    "data: {\"type\":\"content_block_stop\",\"index\":2}\n\n"
    "event: message_delta\n"
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},"
    "\"usage\":{\"output_tokens\":99}}\n\n"
    "event: message_stop\n"
    "data: {\"type\":\"message_stop\"}\n\n";

// Gemini frames with CRLF.
const char kGeminiText[] =
    "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"Hello\"}],\"role\": \"model\"},\"index\": 0}],"
    "\"usageMetadata\": {\"promptTokenCount\": 8,\"totalTokenCount\": 8},\"modelVersion\": \"gemini-2.0-flash\","
    "\"responseId\": \"resp-1\"}\r\n\r\n"
    "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" there\", \"thought\": false},"
    "{\"text\": \"(private)\", \"thought\": true}],\"role\": \"model\"},\"finishReason\": \"STOP\",\"index\": 0}],"
    "\"usageMetadata\": {\"promptTokenCount\": 8,\"candidatesTokenCount\": 2,\"thoughtsTokenCount\": 5,\"totalTokenCount\": 15},"
    "\"modelVersion\": \"gemini-2.0-flash\",\"responseId\": \"resp-1\"}\r\n\r\n";

const char kGeminiTool[] =
    "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"Checking.\"},{\"functionCall\":{\"name\":\"get_weather\","
    "\"args\":{\"city\":\"Paris\",\"units\":\"c\"}}},{\"functionCall\":{\"name\":\"now\"}}],\"role\":\"model\"},"
    "\"finishReason\":\"STOP\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":20,\"candidatesTokenCount\":9},"
    "\"modelVersion\":\"gemini-2.5-pro\",\"responseId\":\"r2\"}\r\n\r\n";

// ---- helpers

std::string Describe(const StreamEvent& e) {
  switch (e.kind) {
    case Kind::kStart: return "start(" + e.id + "," + e.model + ")";
    case Kind::kTextDelta: return "text(" + e.text + ")";
    case Kind::kToolCallStart:
      return "tool(" + std::to_string(e.tool_index) + "," + e.tool_call.id + "," + e.tool_call.name + ")";
    case Kind::kToolCallDelta: return "args(" + std::to_string(e.tool_index) + "," + e.text + ")";
    case Kind::kFinish:
      return "finish(" + std::to_string(static_cast<int>(e.finish)) +
             (e.stop_sequence.empty() ? "" : "," + e.stop_sequence) + ")";
    case Kind::kUsage:
      return "usage(" + std::to_string(e.usage.input_tokens) + "," + std::to_string(e.usage.output_tokens) + ")";
    case Kind::kDone: return "done";
  }
  return "?";
}

std::vector<std::string> Describe(const std::vector<StreamEvent>& events) {
  std::vector<std::string> out;
  for (const auto& e : events) out.push_back(Describe(e));
  return out;
}

struct Decoded {
  Status status;  // first failure (Feed or Finish)
  std::vector<std::string> events;
};

// Feeds `body` cut at `cuts` (ascending offsets), then Finish.
Decoded DecodeChunked(WireFormat f, std::string_view body, const std::vector<size_t>& cuts) {
  auto dec = MakeStreamDecoder(f);
  std::vector<StreamEvent> events;
  Decoded d;
  size_t pos = 0;
  std::vector<size_t> all = cuts;
  all.push_back(body.size());
  for (size_t cut : all) {
    d.status = dec->Feed(body.substr(pos, cut - pos), &events);
    pos = cut;
    if (!d.status.ok()) break;
  }
  if (d.status.ok()) d.status = dec->Finish(&events);
  d.events = Describe(events);
  return d;
}

Decoded Decode(WireFormat f, std::string_view body) { return DecodeChunked(f, body, {}); }

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  size_t pos = 0;
  while ((pos = s.find(from, pos)) != std::string::npos) {
    s.replace(pos, from.size(), to);
    pos += to.size();
  }
  return s;
}

struct Fixture {
  const char* name;
  WireFormat format;
  const char* body;
};
const Fixture kFixtures[] = {
    {"openai_text", WireFormat::kOpenAIChat, kOpenAIText},
    {"openai_tools", WireFormat::kOpenAIChat, kOpenAITools},
    {"anthropic_tool", WireFormat::kAnthropicMessages, kAnthropicTool},
    {"anthropic_thinking", WireFormat::kAnthropicMessages, kAnthropicThinking},
    {"gemini_text", WireFormat::kGemini, kGeminiText},
    {"gemini_tool", WireFormat::kGemini, kGeminiTool},
};

std::vector<SseParser::Event> ParseAll(std::string_view bytes, const std::vector<size_t>& cuts = {}) {
  SseParser p;
  std::vector<SseParser::Event> out;
  size_t pos = 0;
  std::vector<size_t> all = cuts;
  all.push_back(bytes.size());
  for (size_t cut : all) {
    EXPECT_TRUE(p.Feed(bytes.substr(pos, cut - pos), &out).ok());
    pos = cut;
  }
  return out;
}

// ---- SseParser

TEST(SseParser, FieldsCommentsAndMultiLineData) {
  auto ev = ParseAll(
      ": comment\n"
      "event: add\n"
      "id: 7\n"
      "retry: 100\n"
      "data:first\n"
      "data:  second\n"
      "unknown: x\n"
      "data\n"
      "\n");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].event, "add");
  EXPECT_EQ(ev[0].data, "first\n second\n");  // one space stripped; bare "data" is an empty line
}

TEST(SseParser, EventWithoutDataIsNotDispatchedAndNameResets) {
  auto ev = ParseAll("event: lonely\n\ndata: x\n\n");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].event, "");
  EXPECT_EQ(ev[0].data, "x");
}

TEST(SseParser, EmptyDataLineIsStillAnEvent) {
  auto ev = ParseAll("data:\n\n");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].data, "");
}

TEST(SseParser, LineEndingsLfCrlfCrAndMixed) {
  for (const char* body : {"data: a\ndata: b\n\ndata: c\n\n", "data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n",
                           "data: a\rdata: b\r\rdata: c\r\r", "data: a\r\ndata: b\r\rdata: c\n\r\n"}) {
    SCOPED_TRACE(body);
    auto ev = ParseAll(body);
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_EQ(ev[0].data, "a\nb");
    EXPECT_EQ(ev[1].data, "c");
  }
}

TEST(SseParser, CrlfSplitAcrossFeedsIsOneLineEnd) {
  // Were the LF an extra empty line, "a" would be dispatched alone.
  const std::string body = "data: a\r\ndata: b\r\n\r\n";
  for (size_t cut = 0; cut <= body.size(); ++cut) {
    auto ev = ParseAll(body, {cut});
    ASSERT_EQ(ev.size(), 1u) << cut;
    EXPECT_EQ(ev[0].data, "a\nb") << cut;
  }
}

TEST(SseParser, BomSkippedEvenWhenSplit) {
  const std::string body = "\xEF\xBB\xBF" "data: x\n\n";
  for (size_t cut = 0; cut <= 4; ++cut) {
    auto ev = ParseAll(body, {cut});
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].data, "x");
  }
  // A BOM later in the stream is data.
  auto ev = ParseAll("data: x\n\n\xEF\xBB\xBF" "data: y\n\n");
  EXPECT_EQ(ev.size(), 1u);
}

TEST(SseParser, HasPartialEvent) {
  SseParser p;
  std::vector<SseParser::Event> out;
  EXPECT_FALSE(p.HasPartialEvent());
  ASSERT_TRUE(p.Feed("data: par", &out).ok());
  EXPECT_TRUE(p.HasPartialEvent());
  ASSERT_TRUE(p.Feed("tial\n", &out).ok());
  EXPECT_TRUE(p.HasPartialEvent());  // a field line without the blank line
  ASSERT_TRUE(p.Feed("\n", &out).ok());
  EXPECT_FALSE(p.HasPartialEvent());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].data, "partial");
  ASSERT_TRUE(p.Feed(": ping\n", &out).ok());
  EXPECT_FALSE(p.HasPartialEvent());  // comments are not an event
}

TEST(SseParser, OversizeEventFailsAndStaysFailed) {
  SseParser p(64);
  std::vector<SseParser::Event> out;
  ASSERT_TRUE(p.Feed("data: " + std::string(40, 'a') + "\n\n", &out).ok());
  ASSERT_EQ(out.size(), 1u);
  // Many lines, each small, add up past the bound.
  Status s;
  for (int i = 0; i < 10 && s.ok(); ++i) s = p.Feed("data: " + std::string(10, 'b') + "\n", &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.Feed("\n", &out).code(), StatusCode::kInvalidArgument);
  // One partial line without a terminator is bounded too.
  SseParser q(64);
  EXPECT_EQ(q.Feed("data: " + std::string(100, 'c'), &out).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(out.size(), 1u);
}

// ---- decoders: expected sequences

TEST(StreamDecoder, OpenAIText) {
  Decoded d = Decode(WireFormat::kOpenAIChat, kOpenAIText);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(chatcmpl-abc,gpt-4o-mini)", "text(Hello)",
                                                "text(, w\xc3\xb6rld \xe2\x98\x83\n)", "finish(1)", "usage(12,3)",
                                                "done"}));
}

TEST(StreamDecoder, OpenAIParallelToolCalls) {
  Decoded d = Decode(WireFormat::kOpenAIChat, kOpenAITools);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(chatcmpl-t,gpt-4o)", "tool(0,call_A,get_weather)",
                                                "args(0,{\"city\":)", "args(0,\"Paris\"})", "tool(1,call_B,get_time)",
                                                "args(1,{\"tz\":\"CET\"})", "finish(3)", "usage(80,30)", "done"}));
}

TEST(StreamDecoder, OpenAIToolNameAfterArgumentsAndVendorIndexRemapped) {
  const std::string body =
      "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":3,\"function\":{\"arguments\":\"{\\\"a\\\"\"}}]}}]}\n\n"
      "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":3,\"id\":\"c9\",\"function\":{\"name\":\"f\",\"arguments\":\":1}\"}}]}}]}\n\n"
      "data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"other choice\"}}]}\n\n"
      "data: [DONE]\n\n";
  Decoded d = Decode(WireFormat::kOpenAIChat, body);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(,)", "tool(0,c9,f)", "args(0,{\"a\")", "args(0,:1})", "done"}));
}

TEST(StreamDecoder, OpenAICompletionsChunks) {
  const std::string body =
      "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"text\":\"Once\",\"index\":0,"
      "\"logprobs\":null,\"finish_reason\":null}]}\n\n"
      "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"text\":\" upon\",\"index\":0,"
      "\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n"
      "data: [DONE]\n\n";
  Decoded d = Decode(WireFormat::kOpenAICompletions, body);
  ASSERT_TRUE(d.status.ok());
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(cmpl-1,m)", "text(Once)", "text( upon)", "finish(2)", "done"}));
}

TEST(StreamDecoder, OpenAIBytesAfterDoneIgnored) {
  Decoded d = Decode(WireFormat::kOpenAIChat, std::string(kOpenAIText) + "data: {not json\n\n");
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events.back(), "done");
}

TEST(StreamDecoder, AnthropicTextThenTool) {
  Decoded d = Decode(WireFormat::kAnthropicMessages, kAnthropicTool);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events,
            (std::vector<std::string>{"start(msg_01X,claude-sonnet-4-5)", "usage(30,-1)", "text(Let me check )",
                                      "text(the weather.)", "tool(0,toolu_01,get_weather)", "args(0,{\"city\": \"Par)",
                                      "args(0,is\"})", "finish(3)", "usage(-1,42)", "done"}));
}

TEST(StreamDecoder, AnthropicThinkingUnknownEventsAndEmptyToolInput) {
  Decoded d = Decode(WireFormat::kAnthropicMessages, kAnthropicThinking);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(msg_02,claude-opus-4)", "usage(7,-1)", "text(Done.)",
                                                "tool(0,toolu_02,now)", "args(0,{})", "finish(2)", "usage(-1,99)",
                                                "done"}));
}

// message_delta names the stop sequence that matched; it rides on kFinish (at every chunk boundary).
TEST(StreamDecoder, AnthropicStopSequence) {
  const std::string head =
      "event: message_start\n"
      "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_s\",\"model\":\"claude-x\",\"usage\":{\"input_tokens\":3}}}\n\n"
      "event: content_block_start\n"
      "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n"
      "event: content_block_delta\n"
      "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"one two\"}}\n\n"
      "event: content_block_stop\n"
      "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n";
  const std::string tail = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
  const std::string body =
      head +
      "event: message_delta\n"
      "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"stop_sequence\",\"stop_sequence\":\"###\"},"
      "\"usage\":{\"output_tokens\":2}}\n\n" +
      tail;
  const std::vector<std::string> want = {"start(msg_s,claude-x)", "usage(3,-1)", "text(one two)", "finish(1,###)",
                                         "usage(-1,2)", "done"};
  for (size_t cut = 0; cut <= body.size(); ++cut) {
    Decoded d = DecodeChunked(WireFormat::kAnthropicMessages, body, {cut});
    ASSERT_TRUE(d.status.ok()) << cut << ": " << d.status.ToString();
    ASSERT_EQ(d.events, want) << cut;
  }
  // end_turn carries no sequence even if the field were filled.
  Decoded end = Decode(WireFormat::kAnthropicMessages,
                       head +
                           "event: message_delta\n"
                           "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":\"###\"}}\n\n" +
                           tail);
  ASSERT_TRUE(end.status.ok()) << end.status.ToString();
  EXPECT_EQ(end.events[3], "finish(1)");
}

TEST(StreamDecoder, AnthropicTextDeltaForUnknownBlockIsCorruption) {
  Decoded d = Decode(WireFormat::kAnthropicMessages,
                     "event: content_block_delta\n"
                     "data: {\"type\":\"content_block_delta\",\"index\":4,\"delta\":{\"type\":\"text_delta\",\"text\":\"x\"}}\n\n");
  EXPECT_EQ(d.status.code(), StatusCode::kCorruption);
}

TEST(StreamDecoder, GeminiTextCrlfThoughtsSkippedUsageLastWins) {
  Decoded d = Decode(WireFormat::kGemini, kGeminiText);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(resp-1,gemini-2.0-flash)", "usage(8,-1)", "text(Hello)",
                                                "usage(8,7)", "text( there)", "finish(1)", "done"}));
}

TEST(StreamDecoder, GeminiFunctionCallsFinishAsToolCalls) {
  Decoded d = Decode(WireFormat::kGemini, kGeminiTool);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(r2,gemini-2.5-pro)", "usage(20,9)", "text(Checking.)",
                                                "tool(0,call_0,get_weather)", "args(0,{\"city\":\"Paris\",\"units\":\"c\"})",
                                                "tool(1,call_1,now)", "args(1,{})", "finish(3)", "done"}));
}

TEST(StreamDecoder, GeminiBlockedPromptEndsWithContentFilter) {
  Decoded d = Decode(WireFormat::kGemini,
                     "data: {\"promptFeedback\":{\"blockReason\":\"SAFETY\"},\"usageMetadata\":{\"promptTokenCount\":4}}\r\n\r\n");
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(d.events, (std::vector<std::string>{"start(,)", "usage(4,-1)", "finish(4)", "done"}));
}

// ---- every fixture, every chunking, every line-ending style

TEST(StreamDecoder, SameEventsAtEveryChunkBoundary) {
  for (const Fixture& fx : kFixtures) {
    for (const char* eol : {"\n", "\r\n", "\r"}) {
      // Normalize to LF, then rewrite (fixture JSON has no raw line breaks inside strings).
      std::string body = Replace(Replace(fx.body, "\r\n", "\n"), "\n", eol);
      SCOPED_TRACE(std::string(fx.name) + " eol=" + (eol[0] == '\n' ? "LF" : eol[1] ? "CRLF" : "CR"));
      const Decoded whole = Decode(fx.format, body);
      ASSERT_TRUE(whole.status.ok()) << whole.status.ToString();
      ASSERT_EQ(whole.events.back(), "done");
      for (size_t cut = 0; cut <= body.size(); ++cut) {
        Decoded d = DecodeChunked(fx.format, body, {cut});
        ASSERT_TRUE(d.status.ok()) << cut << ": " << d.status.ToString();
        ASSERT_EQ(d.events, whole.events) << "cut at " << cut;
      }
      std::vector<size_t> every;
      for (size_t i = 1; i < body.size(); ++i) every.push_back(i);
      EXPECT_EQ(DecodeChunked(fx.format, body, every).events, whole.events) << "byte by byte";
      std::mt19937 rng(42);
      for (int trial = 0; trial < 30; ++trial) {
        std::vector<size_t> cuts;
        for (size_t pos = 0;;) {
          pos += 1 + rng() % 23;
          if (pos >= body.size()) break;
          cuts.push_back(pos);
        }
        EXPECT_EQ(DecodeChunked(fx.format, body, cuts).events, whole.events) << "trial " << trial;
      }
    }
  }
}

TEST(StreamDecoder, EveryProperPrefixIsTruncated) {
  for (const Fixture& fx : kFixtures) {
    SCOPED_TRACE(fx.name);
    const std::string body = fx.body;
    for (size_t len = 0; len < body.size(); ++len) {
      // The end marker is the last event, so a prefix never holds it whole... except that a
      // CRLF-framed stream is complete once the second CR of the final "\r\n\r\n" has arrived.
      if (body.size() - len == 1 && body.back() == '\n' && body[len - 1] == '\r') continue;
      Decoded d = Decode(fx.format, std::string_view(body).substr(0, len));
      ASSERT_EQ(d.status.code(), StatusCode::kCorruption) << len;
      ASSERT_NE(d.status.message().find("truncated stream"), std::string::npos) << d.status.message();
      ASSERT_TRUE(d.events.empty() || d.events.back() != "done");
    }
  }
}

TEST(StreamDecoder, TruncationMessageNamesMarkerAndPartialEvent) {
  Decoded d = Decode(WireFormat::kOpenAIChat, "data: {\"choices\":[]}\n\ndata: [DO");
  EXPECT_EQ(d.status.code(), StatusCode::kCorruption);
  EXPECT_NE(d.status.message().find("[DONE]"), std::string::npos) << d.status.message();
  EXPECT_NE(d.status.message().find("unfinished event"), std::string::npos) << d.status.message();
}

TEST(StreamDecoder, MalformedJsonNamesTheEvent) {
  Decoded a = Decode(WireFormat::kOpenAIChat, "data: {\"choices\":[]}\n\ndata: {\"id\":\n\n");
  EXPECT_EQ(a.status.code(), StatusCode::kCorruption);
  EXPECT_NE(a.status.message().find("event #2"), std::string::npos) << a.status.message();
  Decoded b = Decode(WireFormat::kAnthropicMessages, "event: content_block_delta\ndata: [1,2\n\n");
  EXPECT_EQ(b.status.code(), StatusCode::kCorruption);
  EXPECT_NE(b.status.message().find("content_block_delta"), std::string::npos) << b.status.message();
  Decoded c = Decode(WireFormat::kGemini, "data: \"just a string\"\r\n\r\n");
  EXPECT_EQ(c.status.code(), StatusCode::kCorruption);
}

TEST(StreamDecoder, FailureIsSticky) {
  auto dec = MakeStreamDecoder(WireFormat::kOpenAIChat);
  std::vector<StreamEvent> out;
  EXPECT_FALSE(dec->Feed("data: nope\n\n", &out).ok());
  EXPECT_FALSE(dec->Feed(kOpenAIText, &out).ok());
  EXPECT_FALSE(dec->Finish(&out).ok());
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(dec->upstream_error(), nullptr);  // garbage, not a vendor error
}

TEST(StreamDecoder, InStreamErrorEvents) {
  struct Case {
    WireFormat f;
    std::string body;
    ErrorKind kind;
    const char* message;
  };
  const Case cases[] = {
      {WireFormat::kOpenAIChat,
       "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"par\"}}]}\n\n"
       "data: {\"error\":{\"message\":\"The server had an error\",\"type\":\"server_error\",\"param\":null,\"code\":null}}\n\n",
       ErrorKind::kApi, "The server had an error"},
      {WireFormat::kOpenAIChat,
       "event: error\ndata: {\"message\":\"slow down\",\"type\":\"rate_limit_error\"}\n\n", ErrorKind::kRateLimit,
       "slow down"},
      {WireFormat::kAnthropicMessages,
       "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
       ErrorKind::kOverloaded, "Overloaded"},
      {WireFormat::kGemini,
       "data: {\"error\":{\"code\":429,\"message\":\"Resource has been exhausted\",\"status\":\"RESOURCE_EXHAUSTED\"}}\r\n\r\n",
       ErrorKind::kRateLimit, "Resource has been exhausted"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    auto dec = MakeStreamDecoder(c.f);
    std::vector<StreamEvent> out;
    Status s = dec->Feed(c.body, &out);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s.message();
    ASSERT_NE(dec->upstream_error(), nullptr);
    EXPECT_EQ(dec->upstream_error()->kind, c.kind);
    EXPECT_EQ(dec->upstream_error()->message, c.message);
    EXPECT_GE(dec->upstream_error()->status, 400);
    EXPECT_FALSE(dec->Finish(&out).ok());
  }
}

TEST(StreamDecoder, GeminiChunksAfterFinishStillCount) {
  const std::string body = std::string(kGeminiTool) +
                           "data: {\"candidates\":[],\"usageMetadata\":{\"promptTokenCount\":20,\"candidatesTokenCount\":11}}\r\n\r\n";
  Decoded d = Decode(WireFormat::kGemini, body);
  ASSERT_TRUE(d.status.ok()) << d.status.ToString();
  ASSERT_GE(d.events.size(), 2u);
  EXPECT_EQ(d.events[d.events.size() - 2], "usage(20,11)");
}

// Corrupted vendor bytes: never an exception, and a stream that passes ends with kDone after
// exactly one kStart at the front at most.
TEST(StreamDecoder, MutatedStreamsNeverThrow) {
  std::mt19937 rng(7);
  const char kNoise[] = {'\0', '\n', '\r', '"', '{', '}', ':', '\\', '\xff', 'x'};
  for (const Fixture& fx : kFixtures) {
    SCOPED_TRACE(fx.name);
    const std::string body = fx.body;
    for (size_t i = 0; i < body.size(); ++i) {
      std::string m = body;
      m[i] = kNoise[rng() % sizeof(kNoise)];
      Decoded d;
      ASSERT_NO_THROW(d = DecodeChunked(fx.format, m, {rng() % m.size()})) << i;
      if (!d.status.ok()) continue;
      ASSERT_FALSE(d.events.empty());
      EXPECT_EQ(d.events.back(), "done");
      for (size_t k = 1; k < d.events.size(); ++k) EXPECT_NE(d.events[k].rfind("start(", 0), 0u) << i;
    }
  }
}

TEST(StreamDecoder, OversizeEventRejected) {
  for (WireFormat f : {WireFormat::kOpenAIChat, WireFormat::kAnthropicMessages, WireFormat::kGemini}) {
    auto dec = MakeStreamDecoder(f, 256);
    std::vector<StreamEvent> out;
    const std::string big = "data: {\"x\":\"" + std::string(1000, 'a') + "\"}\n\n";
    Status s;
    for (size_t i = 0; i < big.size() && s.ok(); i += 100) s = dec->Feed(std::string_view(big).substr(i, 100), &out);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << WireFormatName(f);
  }
  // The default bound admits a large but sane event.
  auto dec = MakeStreamDecoder(WireFormat::kOpenAIChat);
  std::vector<StreamEvent> out;
  const std::string text(200000, 'z');
  ASSERT_TRUE(dec->Feed("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"" + text + "\"}}]}\n\ndata: [DONE]\n\n", &out).ok());
  ASSERT_TRUE(dec->Finish(&out).ok());
  ASSERT_GE(out.size(), 2u);
  EXPECT_EQ(out[1].text, text);
}

}  // namespace
}  // namespace keel::gateway
