// The OpenAI Responses API front (keel/gateway/vendors/responses/responses.h): request parsing (every field, every
// refusal), the Response object's exact shape, and the SSE stream -- its event sequence and
// sequence numbers, and that replaying it the way the openai SDK's ResponseAccumulator does gives
// the Response that response.completed carries, which equals the non-streaming one.
#include "keel/gateway/vendors/responses/responses.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/gateway/stream.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

using Json = nlohmann::json;
using Kind = StreamEvent::Kind;

Json J(const std::string& text) {
  Json j = Json::parse(text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << text;
  return j;
}

ChatRequest MustParse(const std::string& body) {
  auto r = ParseResponsesRequest(body);
  EXPECT_TRUE(r.ok()) << r.status().ToString() << "\n" << body;
  return r.ok() ? r.value() : ChatRequest{};
}

// ---- parse

TEST(ResponsesParse, StringInputIsOneUserTurn) {
  ChatRequest r = MustParse(R"({"model":"gpt-x","input":"Hello there"})");
  EXPECT_EQ(r.client_format, WireFormat::kOpenAIResponses);
  EXPECT_EQ(r.model, "gpt-x");
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "Hello there");
  EXPECT_EQ(r.system, "");
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FALSE(r.response_format.has_value());
  EXPECT_FALSE(r.parallel_tool_calls.has_value());
  EXPECT_TRUE(r.tools.empty());
  EXPECT_EQ(r.tool_choice, "");
}

TEST(ResponsesParse, EveryField) {
  ChatRequest r = MustParse(R"({
    "model": "virt", "instructions": "Be brief.",
    "input": [
      {"role": "developer", "content": "Use metric units."},
      {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
      {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Cite nothing."}]},
      {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
       "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
      {"type": "function_call", "id": "fc_1", "call_id": "call_A", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
      {"type": "function_call", "call_id": "call_B", "name": "get_time", "arguments": {"tz": "CET"}},
      {"type": "function_call_output", "call_id": "call_A", "output": "18C"},
      {"type": "function_call_output", "call_id": "call_B", "output": [{"type": "input_text", "text": "12:00"}]},
      {"role": "assistant", "content": "It is 18C at noon."},
      {"role": "user", "content": "Thanks"}
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather now",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": true},
              {"type": "function", "name": "get_time", "parameters": null, "strict": false}],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "max_output_tokens": 256, "temperature": 0.2, "top_p": 0.9, "stream": true, "user": "u-42",
    "parallel_tool_calls": false,
    "text": {"format": {"type": "json_schema", "name": "answer", "strict": true,
                        "schema": {"type": "object", "properties": {"a": {"type": "string"}}}},
             "verbosity": "low"},
    "metadata": {"k": "v"}, "store": true, "include": ["reasoning.encrypted_content"],
    "background": false, "previous_response_id": null, "top_logprobs": 0, "truncation": "auto",
    "reasoning": {"effort": "low"}, "service_tier": "auto", "some_future_field": {"x": 1}
  })");
  EXPECT_EQ(r.model, "virt");
  EXPECT_EQ(r.system, "Be brief.\nUse metric units.\nCite nothing.");
  ASSERT_EQ(r.messages.size(), 6u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "Weather in Paris?");
  // The assistant's text and both calls are one turn.
  EXPECT_EQ(r.messages[1].role, "assistant");
  EXPECT_EQ(r.messages[1].content, "Checking.");
  ASSERT_EQ(r.messages[1].tool_calls.size(), 2u);
  EXPECT_EQ(r.messages[1].tool_calls[0].id, "call_A");
  EXPECT_EQ(r.messages[1].tool_calls[0].name, "get_weather");
  EXPECT_EQ(r.messages[1].tool_calls[0].arguments_json, "{\"city\":\"Paris\"}");
  EXPECT_EQ(r.messages[1].tool_calls[1].id, "call_B");
  EXPECT_EQ(J(r.messages[1].tool_calls[1].arguments_json), J(R"({"tz":"CET"})"));
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_EQ(r.messages[2].tool_call_id, "call_A");
  EXPECT_EQ(r.messages[2].name, "get_weather");  // from the call it answers
  EXPECT_EQ(r.messages[2].content, "18C");
  EXPECT_EQ(r.messages[3].tool_call_id, "call_B");
  EXPECT_EQ(r.messages[3].name, "get_time");
  EXPECT_EQ(r.messages[3].content, "12:00");
  EXPECT_EQ(r.messages[4].role, "assistant");
  EXPECT_EQ(r.messages[4].content, "It is 18C at noon.");
  EXPECT_TRUE(r.messages[4].tool_calls.empty());
  EXPECT_EQ(r.messages[5].content, "Thanks");
  ASSERT_EQ(r.tools.size(), 2u);
  EXPECT_EQ(r.tools[0].name, "get_weather");
  EXPECT_EQ(r.tools[0].description, "Weather now");
  EXPECT_EQ(J(r.tools[0].parameters_json), J(R"({"type":"object","properties":{"city":{"type":"string"}}})"));
  EXPECT_EQ(r.tools[1].parameters_json, "{}");
  EXPECT_EQ(r.tool_choice, "get_weather");
  EXPECT_EQ(r.max_tokens, 256);
  EXPECT_EQ(r.temperature, 0.2);
  EXPECT_EQ(r.top_p, 0.9);
  EXPECT_TRUE(r.stream);
  EXPECT_EQ(r.user, "u-42");
  EXPECT_EQ(r.parallel_tool_calls, false);
  ASSERT_TRUE(r.response_format.has_value());
  EXPECT_EQ(r.response_format->kind, ResponseFormat::Kind::kJsonSchema);
  EXPECT_EQ(r.response_format->name, "answer");
  EXPECT_TRUE(r.response_format->strict);
  EXPECT_EQ(J(r.response_format->schema_json), J(R"({"type":"object","properties":{"a":{"type":"string"}}})"));
}

TEST(ResponsesParse, ToolChoiceAndTextFormatVariants) {
  for (const char* choice : {"auto", "none", "required"}) {
    ChatRequest r = MustParse(std::string(R"({"model":"m","input":"x","tool_choice":")") + choice + "\"}");
    EXPECT_EQ(r.tool_choice, choice);
  }
  ChatRequest text = MustParse(R"({"model":"m","input":"x","text":{"format":{"type":"text"}}})");
  ASSERT_TRUE(text.response_format.has_value());
  EXPECT_EQ(text.response_format->kind, ResponseFormat::Kind::kText);
  ChatRequest obj = MustParse(R"({"model":"m","input":"x","text":{"format":{"type":"json_object"}}})");
  ASSERT_TRUE(obj.response_format.has_value());
  EXPECT_EQ(obj.response_format->kind, ResponseFormat::Kind::kJsonObject);
  ChatRequest none = MustParse(R"({"model":"m","input":"x","text":{"verbosity":"high"},"store":false})");
  EXPECT_FALSE(none.response_format.has_value());
  // A call with no assistant text before it is an assistant turn of its own.
  ChatRequest call = MustParse(R"({"model":"m","input":[{"role":"user","content":"x"},
      {"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},
      {"type":"function_call_output","call_id":"c1","output":"ok"}]})");
  ASSERT_EQ(call.messages.size(), 3u);
  EXPECT_EQ(call.messages[1].role, "assistant");
  EXPECT_EQ(call.messages[1].content, "");
  ASSERT_EQ(call.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(call.messages[2].name, "f");
}

TEST(ResponsesParse, RefusalsNameTheField) {
  struct Case {
    const char* body;
    const char* starts_with;  // the message begins with the field's path
    const char* mentions;     // and says why
  };
  const Case cases[] = {
      {R"({"input":"x"})", "model: required", ""},
      {R"({"model":"m"})", "input: required", ""},
      {R"({"model":"m","input":42})", "input: expected", ""},
      {R"({"model":"m","input":[]})", "input: must not be empty", ""},
      {R"({"model":"m","input":[{"role":"system","content":"only system"}]})", "input: at least one", ""},
      {R"({"model":"m","input":"x","previous_response_id":"resp_1"})", "previous_response_id: not supported", "stateless"},
      {R"({"model":"m","input":"x","conversation":"conv_1"})", "conversation: not supported", "stateless"},
      {R"({"model":"m","input":"x","background":true})", "background: not supported", "stateless"},
      {R"({"model":"m","input":"x","background":"yes"})", "background: expected true or false", ""},
      {R"({"model":"m","input":"x","prompt":{"id":"pmpt_1"}})", "prompt: not supported", ""},
      {R"({"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"see"},
          {"type":"input_image","image_url":"https://x/y.png"}]}]})", "input[0].content[1].type: input_image is not supported", "text-only"},
      {R"({"model":"m","input":[{"role":"user","content":[{"type":"input_file","file_id":"f"}]}]})", "input[0].content[0].type: input_file", "text-only"},
      {R"({"model":"m","input":[{"role":"user","content":[{"type":"input_audio"}]}]})", "input[0].content[0].type: input_audio", "text-only"},
      {R"({"model":"m","input":[{"role":"user","content":[{"type":"input_text"}]}]})", "input[0].content[0].text: required", ""},
      {R"({"model":"m","input":[{"role":"user","content":[{"type":"bogus","text":"x"}]}]})", "input[0].content[0].type: expected", ""},
      {R"({"model":"m","input":[{"role":"user"}]})", "input[0].content: required", ""},
      {R"({"model":"m","input":[{"role":"tool","content":"x"}]})", "input[0].role: expected", ""},
      {R"({"model":"m","input":[{"content":"x"}]})", "input[0].type: required", ""},
      {R"({"model":"m","input":["x"]})", "input[0]: expected an object", ""},
      {R"({"model":"m","input":[{"type":"reasoning","id":"rs_1","summary":[]}]})", "input[0].type: reasoning items are not supported", ""},
      {R"({"model":"m","input":[{"type":"item_reference","id":"msg_1"}]})", "input[0].type: item_reference is not supported", "stateless"},
      {R"({"model":"m","input":[{"type":"function_call","name":"f","arguments":"{}"}]})", "input[0].call_id: required", ""},
      {R"({"model":"m","input":[{"type":"function_call","call_id":"c","arguments":"{}"}]})", "input[0].name: required", ""},
      {R"({"model":"m","input":[{"type":"function_call_output","call_id":"c"}]})", "input[0].output: required", ""},
      {R"({"model":"m","input":[{"type":"function_call_output","output":"x"}]})", "input[0].call_id: required", ""},
      {R"({"model":"m","input":"x","tools":[{"type":"web_search"}]})", "tools[0].type: web_search is not supported", "function"},
      {R"({"model":"m","input":"x","tools":[{"type":"function","name":"f"},{"type":"file_search","vector_store_ids":["v"]}]})",
       "tools[1].type: file_search is not supported", ""},
      {R"({"model":"m","input":"x","tools":[{"type":"function"}]})", "tools[0].name: required", ""},
      {R"({"model":"m","input":"x","tools":[{"type":"function","name":"f","parameters":"{}"}]})", "tools[0].parameters: expected", ""},
      {R"({"model":"m","input":"x","tools":[{"type":"function","name":"f","strict":"yes"}]})", "tools[0].strict: expected", ""},
      {R"({"model":"m","input":"x","tools":{}})", "tools: expected an array", ""},
      {R"({"model":"m","input":"x","tool_choice":"any"})", "tool_choice: expected", ""},
      {R"({"model":"m","input":"x","tool_choice":{"type":"file_search"}})", "tool_choice.type: file_search is not supported", ""},
      {R"({"model":"m","input":"x","tool_choice":{"type":"function"}})", "tool_choice.name: required", ""},
      {R"({"model":"m","input":"x","text":"json"})", "text: expected an object", ""},
      {R"({"model":"m","input":"x","text":{"format":{"type":"xml"}}})", "text.format.type: expected", ""},
      {R"({"model":"m","input":"x","text":{"format":{"type":"json_schema","schema":{}}}})", "text.format.name: required", ""},
      {R"({"model":"m","input":"x","text":{"format":{"type":"json_schema","name":"n"}}})", "text.format.schema: required", ""},
      {R"({"model":"m","input":"x","text":{"format":{"type":"json_schema","name":"n","schema":[]}}})", "text.format.schema: expected", ""},
      {R"({"model":"m","input":"x","top_logprobs":5})", "top_logprobs: not supported", ""},
      {R"({"model":"m","input":"x","include":["message.output_text.logprobs"]})", "include[0]: message.output_text.logprobs", ""},
      {R"({"model":"m","input":"x","include":"all"})", "include: expected", ""},
      {R"({"model":"m","input":"x","metadata":"x"})", "metadata: expected an object", ""},
      {R"({"model":"m","input":"x","store":"no"})", "store: expected true or false", ""},
      {R"({"model":"m","input":"x","max_output_tokens":0})", "max_output_tokens: expected a positive integer", ""},
      {R"({"model":"m","input":"x","temperature":"hot"})", "temperature: expected a number", ""},
      {R"({"model":"m","input":"x","top_p":"high"})", "top_p: expected a number", ""},
      {R"({"model":"m","input":"x","parallel_tool_calls":"no"})", "parallel_tool_calls: expected true or false", ""},
      {R"({"model":"m","input":"x","instructions":["a"]})", "instructions: expected a string", ""},
      {R"({"model":"m","input":"x","stream":1})", "stream: expected true or false", ""},
      {R"({"model":"m","input":"x")", "request body: malformed JSON", ""},
      {R"(["model"])", "request body: expected a JSON object", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    auto r = ParseResponsesRequest(c.body);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message().rfind(c.starts_with, 0), 0u) << r.status().message();
    EXPECT_NE(r.status().message().find(c.mentions), std::string::npos) << r.status().message();
  }
}

// ---- build

// `j` with every "id"/"item_id" that starts with `prefix` replaced by `prefix` + "X", after
// checking the random part is there: ids are fresh each call, everything else must be exact.
void NormalizeIds(Json* j) {
  if (j->is_object()) {
    for (auto& [key, v] : j->items()) {
      if ((key == "id" || key == "item_id" || key == "call_id") && v.is_string()) {
        const std::string s = v.get<std::string>();
        for (const char* prefix : {"msg_", "fc_", "resp_", "call_"}) {
          const std::string p = prefix;
          if (s.rfind(p, 0) == 0 && s.size() == p.size() + 24) v = p + "X";
        }
      } else {
        NormalizeIds(&v);
      }
    }
  } else if (j->is_array()) {
    for (Json& v : *j) NormalizeIds(&v);
  }
}

const char kSettingsRequest[] = R"({"model":"virt","instructions":"Be brief.","input":"weather?",
    "tools":[{"type":"function","name":"get_weather","description":"Weather now",
              "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}],
    "tool_choice":"required","max_output_tokens":100,"temperature":0.5,"top_p":0.25,
    "parallel_tool_calls":false,"user":"u1","store":true,"metadata":{"a":"b"},
    "text":{"format":{"type":"json_schema","name":"w","schema":{"type":"object"},"strict":true}}})";

TEST(ResponsesBuild, ExactShapeWithTextAndCalls) {
  ChatRequest req = MustParse(kSettingsRequest);
  ChatResponse resp;
  resp.id = "chatcmpl-abc";
  resp.model = "upstream-model";
  resp.created = 1700000000;
  resp.content = "Let me check.";
  resp.tool_calls = {{"call_1", "get_weather", "{\"city\":\"Paris\"}"}, {"", "get_weather", ""}};
  resp.finish = FinishReason::kToolCalls;
  resp.usage = {12, 7};
  Json got = J(BuildResponsesResponse(resp, req, "virt"));
  NormalizeIds(&got);
  const Json want = J(R"({
    "id": "resp_chatcmpl-abc", "object": "response", "created_at": 1700000000, "status": "completed",
    "background": false, "error": null, "incomplete_details": null, "instructions": "Be brief.",
    "max_output_tokens": 100, "model": "virt",
    "output": [
      {"type": "message", "id": "msg_X", "status": "completed", "role": "assistant",
       "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
      {"type": "function_call", "id": "fc_X", "call_id": "call_1", "name": "get_weather",
       "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
      {"type": "function_call", "id": "fc_X", "call_id": "call_X", "name": "get_weather",
       "arguments": "{}", "status": "completed"}],
    "parallel_tool_calls": false, "previous_response_id": null,
    "reasoning": {"effort": null, "summary": null}, "store": false, "temperature": 0.5,
    "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
    "tool_choice": "required",
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather now",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": null}],
    "top_p": 0.25, "truncation": "disabled",
    "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 7,
              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 19},
    "user": "u1", "metadata": {}})");
  EXPECT_EQ(got, want) << got.dump(2);
  // Field order is OpenAI's (ordered JSON), so a person reading curl output sees the familiar object.
  const std::string text = BuildResponsesResponse(resp, req, "virt");
  EXPECT_EQ(text.rfind(R"({"id":"resp_chatcmpl-abc","object":"response","created_at":1700000000,"status":"completed")", 0), 0u)
      << text;
}

TEST(ResponsesBuild, DefaultsAndIncompleteAnswers) {
  ChatRequest req = MustParse(R"({"model":"m","input":"x"})");
  ChatResponse resp;
  resp.content = "cut off mid";
  resp.finish = FinishReason::kLength;
  Json got = J(BuildResponsesResponse(resp, req, "client-name"));
  EXPECT_EQ(got["id"].get<std::string>().rfind("resp_", 0), 0u);
  EXPECT_GT(got["created_at"].get<int64_t>(), 1600000000);  // now, when the upstream gave none
  EXPECT_EQ(got["model"], "client-name");
  EXPECT_EQ(got["status"], "incomplete");
  EXPECT_EQ(got["incomplete_details"], J(R"({"reason":"max_output_tokens"})"));
  EXPECT_EQ(got["output"][0]["status"], "incomplete");
  EXPECT_TRUE(got["usage"].is_null());  // unknown, not invented
  EXPECT_TRUE(got["instructions"].is_null());
  EXPECT_TRUE(got["max_output_tokens"].is_null());
  EXPECT_TRUE(got["temperature"].is_null());
  EXPECT_TRUE(got["top_p"].is_null());
  EXPECT_TRUE(got["user"].is_null());
  EXPECT_EQ(got["tool_choice"], "auto");
  EXPECT_EQ(got["tools"], Json::array());
  EXPECT_EQ(got["parallel_tool_calls"], true);
  EXPECT_EQ(got["text"], J(R"({"format":{"type":"text"}})"));

  resp.finish = FinishReason::kContentFilter;
  resp.usage = {5, -1};
  got = J(BuildResponsesResponse(resp, req, "m"));
  EXPECT_EQ(got["incomplete_details"], J(R"({"reason":"content_filter"})"));
  EXPECT_EQ(got["usage"]["input_tokens"], 5);
  EXPECT_EQ(got["usage"]["output_tokens"], 0);
  EXPECT_EQ(got["usage"]["total_tokens"], 5);

  // No text and no calls: still one (empty) message, so output_text reads "".
  ChatResponse empty;
  empty.finish = FinishReason::kStop;
  got = J(BuildResponsesResponse(empty, req, "m"));
  EXPECT_EQ(got["status"], "completed");
  ASSERT_EQ(got["output"].size(), 1u);
  EXPECT_EQ(got["output"][0]["content"][0]["text"], "");
  // Only calls: no message item; a cut-off call is the incomplete item.
  ChatResponse calls;
  calls.id = "resp_given";
  calls.tool_calls = {{"c1", "f", "{\"a\":"}};
  calls.finish = FinishReason::kLength;
  got = J(BuildResponsesResponse(calls, req, "m"));
  EXPECT_EQ(got["id"], "resp_given");  // the prefix is not doubled
  ASSERT_EQ(got["output"].size(), 1u);
  EXPECT_EQ(got["output"][0]["type"], "function_call");
  EXPECT_EQ(got["output"][0]["status"], "incomplete");
  EXPECT_EQ(got["output"][0]["arguments"], "{\"a\":");  // verbatim
  ChatRequest json_object = MustParse(R"({"model":"m","input":"x","text":{"format":{"type":"json_object"}},
      "tool_choice":{"type":"function","name":"f"},"tools":[{"type":"function","name":"f"}]})");
  got = J(BuildResponsesResponse(empty, json_object, "m"));
  EXPECT_EQ(got["text"], J(R"({"format":{"type":"json_object"}})"));
  EXPECT_EQ(got["tool_choice"], J(R"({"type":"function","name":"f"})"));
  EXPECT_EQ(got["tools"][0]["parameters"], Json::object());
  EXPECT_TRUE(got["tools"][0]["description"].is_null());
}

// ---- stream

StreamEvent E(Kind k) {
  StreamEvent e;
  e.kind = k;
  return e;
}
StreamEvent Start(std::string id) {
  StreamEvent e = E(Kind::kStart);
  e.id = std::move(id);
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

struct Frame {
  std::string event;
  Json data;
};

// Splits an SSE body with the gateway's own parser, checking each event's name equals its data's
// type and that sequence numbers run 0, 1, 2, ... without a gap.
std::vector<Frame> Frames(const std::string& body) {
  SseParser p;
  std::vector<SseParser::Event> raw;
  EXPECT_TRUE(p.Feed(body, &raw).ok());
  EXPECT_FALSE(p.HasPartialEvent());
  std::vector<Frame> out;
  for (size_t i = 0; i < raw.size(); ++i) {
    Frame f{raw[i].event, J(raw[i].data)};
    EXPECT_EQ(f.data.value("type", ""), f.event) << raw[i].data;
    EXPECT_EQ(f.data.value("sequence_number", -1), static_cast<int64_t>(i)) << raw[i].data;
    out.push_back(std::move(f));
  }
  return out;
}

std::vector<std::string> Types(const std::vector<Frame>& frames) {
  std::vector<std::string> t;
  for (const Frame& f : frames) t.push_back(f.event);
  return t;
}

std::string EncodeAll(const std::vector<StreamEvent>& events, const ChatRequest& req = ChatRequest{},
                      const std::string& model = "virt") {
  auto enc = MakeResponsesStreamEncoder(req, model);
  std::string out;
  for (const StreamEvent& e : events) enc->Encode(e, &out);
  return out;
}

// Replays events onto a snapshot the way openai-node's ResponseAccumulator does, failing where it
// would throw (an item or content index that does not exist, a first event that is not
// response.created). Returns the snapshot after the last event.
Json Accumulate(const std::vector<Frame>& frames) {
  Json snap;
  for (const Frame& f : frames) {
    const Json& e = f.data;
    const std::string type = e["type"];
    SCOPED_TRACE(e.dump());
    if (snap.is_null()) {
      EXPECT_EQ(type, "response.created");
      snap = e["response"];
      continue;
    }
    auto output = [&]() -> Json& {
      const size_t i = e["output_index"].get<size_t>();
      EXPECT_LT(i, snap["output"].size());
      if (i >= snap["output"].size()) snap["output"].push_back(Json::object());
      return snap["output"][i];
    };
    auto content = [&](Json& item) -> Json& {
      const size_t i = e["content_index"].get<size_t>();
      EXPECT_LT(i, item["content"].size());
      if (i >= item["content"].size()) item["content"].push_back(Json::object());
      return item["content"][i];
    };
    if (type == "response.output_item.added") {
      snap["output"].push_back(e["item"]);
    } else if (type == "response.output_item.done") {
      output() = e["item"];
    } else if (type == "response.content_part.added") {
      Json& item = output();
      EXPECT_EQ(item["type"], "message");
      EXPECT_EQ(item["id"], e["item_id"]);
      item["content"].push_back(e["part"]);
    } else if (type == "response.content_part.done") {
      content(output()) = e["part"];
    } else if (type == "response.output_text.delta") {
      Json& item = output();
      EXPECT_EQ(item["id"], e["item_id"]);
      Json& part = content(item);
      EXPECT_EQ(part["type"], "output_text");
      part["text"] = part["text"].get<std::string>() + e["delta"].get<std::string>();
      EXPECT_TRUE(e["logprobs"].is_array());
    } else if (type == "response.output_text.done") {
      Json& part = content(output());
      EXPECT_EQ(part["text"], e["text"]);  // the deltas added up to the done text
    } else if (type == "response.function_call_arguments.delta") {
      Json& item = output();
      EXPECT_EQ(item["type"], "function_call");
      EXPECT_EQ(item["id"], e["item_id"]);
      item["arguments"] = item["arguments"].get<std::string>() + e["delta"].get<std::string>();
    } else if (type == "response.function_call_arguments.done") {
      Json& item = output();
      EXPECT_EQ(item["name"], e["name"]);
      item["arguments"] = e["arguments"];
    } else if (type == "response.in_progress" || type == "response.completed" ||
               type == "response.incomplete" || type == "response.failed") {
      // Lifecycle events replace the snapshot; what was accumulated must be what they carry
      // (a failed Response marks the item that was open "incomplete").
      if (type != "response.in_progress") {
        Json carried = e["response"]["output"];
        if (type == "response.failed" && !carried.empty() && carried.back()["status"] == "incomplete")
          carried.back()["status"] = "in_progress";
        EXPECT_EQ(snap["output"], carried);
      }
      snap = e["response"];
    } else if (type != "error") {
      ADD_FAILURE() << "unexpected event " << type;
    }
  }
  return snap;
}

TEST(ResponsesStream, TextEventSequenceAndShapes) {
  ChatRequest req = MustParse(kSettingsRequest);
  const std::string body = EncodeAll({Start("abc"), Use(11, -1), Text("Hel"), Text("lo"), Fin(FinishReason::kStop),
                                      Use(-1, 2), E(Kind::kDone)},
                                     req);
  auto frames = Frames(body);
  EXPECT_EQ(Types(frames),
            (std::vector<std::string>{"response.created", "response.in_progress", "response.output_item.added",
                                      "response.content_part.added", "response.output_text.delta",
                                      "response.output_text.delta", "response.output_text.done",
                                      "response.content_part.done", "response.output_item.done",
                                      "response.completed"}));
  const Json created = frames[0].data["response"];
  EXPECT_EQ(created["id"], "resp_abc");
  EXPECT_EQ(created["status"], "in_progress");
  EXPECT_EQ(created["output"], Json::array());
  EXPECT_TRUE(created["usage"].is_null());
  EXPECT_EQ(created["model"], "virt");
  EXPECT_EQ(created["instructions"], "Be brief.");  // the echoed settings are there from the start
  EXPECT_EQ(created["temperature"], 0.5);
  EXPECT_EQ(frames[1].data["response"], created);
  const std::string msg_id = frames[2].data["item"]["id"];
  EXPECT_EQ(msg_id.rfind("msg_", 0), 0u);
  EXPECT_EQ(frames[2].data["output_index"], 0);
  EXPECT_EQ(frames[2].data["item"],
            J(R"({"type":"message","id":")" + msg_id + R"(","status":"in_progress","role":"assistant","content":[]})"));
  EXPECT_EQ(frames[3].data, J(R"({"type":"response.content_part.added","sequence_number":3,"item_id":")" + msg_id +
                              R"(","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[]}})"));
  EXPECT_EQ(frames[4].data, J(R"({"type":"response.output_text.delta","sequence_number":4,"item_id":")" + msg_id +
                              R"(","output_index":0,"content_index":0,"delta":"Hel","logprobs":[]})"));
  EXPECT_EQ(frames[6].data, J(R"({"type":"response.output_text.done","sequence_number":6,"item_id":")" + msg_id +
                              R"(","output_index":0,"content_index":0,"text":"Hello","logprobs":[]})"));
  EXPECT_EQ(frames[7].data["part"], J(R"({"type":"output_text","text":"Hello","annotations":[]})"));
  EXPECT_EQ(frames[8].data["item"]["status"], "completed");
  const Json done = frames[9].data["response"];
  EXPECT_EQ(done["status"], "completed");
  EXPECT_EQ(done["usage"], J(R"({"input_tokens":11,"input_tokens_details":{"cached_tokens":0},"output_tokens":2,
                                 "output_tokens_details":{"reasoning_tokens":0},"total_tokens":13})"));
  EXPECT_EQ(done["created_at"], created["created_at"]);
  EXPECT_EQ(Accumulate(frames), done);
  // The stream's final Response is the non-streaming one for the same answer.
  ChatResponse same;
  same.id = "abc";
  same.created = done["created_at"];
  same.content = "Hello";
  same.finish = FinishReason::kStop;
  same.usage = {11, 2};
  Json built = J(BuildResponsesResponse(same, req, "virt"));
  Json streamed = done;
  NormalizeIds(&built);
  NormalizeIds(&streamed);
  EXPECT_EQ(streamed, built);
}

TEST(ResponsesStream, ToolCallsThenTextAfterATool) {
  ChatRequest req = MustParse(kSettingsRequest);
  const std::string body =
      EncodeAll({Start("t"), Text("Checking."), Tool(0, "call_A", "get_weather"), Args(0, "{\"city\":"),
                 Args(0, "\"Paris\"}"), Tool(1, "", "get_time"), Text("and more"), Fin(FinishReason::kToolCalls),
                 Use(80, 30), E(Kind::kDone)},
                req);
  auto frames = Frames(body);
  EXPECT_EQ(Types(frames),
            (std::vector<std::string>{
                "response.created", "response.in_progress",
                "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done",
                "response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.delta", "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added", "response.function_call_arguments.done", "response.output_item.done",
                "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done",
                "response.completed"}));
  const Json added = frames[8].data;
  EXPECT_EQ(added["output_index"], 1);
  const std::string fc_id = added["item"]["id"];
  EXPECT_EQ(fc_id.rfind("fc_", 0), 0u);
  EXPECT_EQ(added["item"], J(R"({"type":"function_call","id":")" + fc_id +
                             R"(","call_id":"call_A","name":"get_weather","arguments":"","status":"in_progress"})"));
  EXPECT_EQ(frames[9].data, J(R"({"type":"response.function_call_arguments.delta","sequence_number":9,"item_id":")" +
                              fc_id + R"(","output_index":1,"delta":"{\"city\":"})"));
  EXPECT_EQ(frames[11].data, J(R"({"type":"response.function_call_arguments.done","sequence_number":11,"item_id":")" +
                               fc_id + R"(","output_index":1,"name":"get_weather","arguments":"{\"city\":\"Paris\"}"})"));
  // A call with no id gets a call_ id; one with no arguments says {}.
  const Json second = frames[15].data["item"];
  EXPECT_EQ(second["call_id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(second["arguments"], "{}");
  EXPECT_EQ(frames[16].data["output_index"], 3);  // text after a tool is a new message item
  const Json done = frames.back().data["response"];
  ASSERT_EQ(done["output"].size(), 4u);
  EXPECT_EQ(done["output"][1]["arguments"], "{\"city\":\"Paris\"}");
  EXPECT_EQ(done["output"][3]["content"][0]["text"], "and more");
  EXPECT_EQ(done["usage"]["total_tokens"], 110);
  EXPECT_EQ(Accumulate(frames), done);
}

TEST(ResponsesStream, IncompleteAndAwkwardOrders) {
  // Cut off by the token limit: response.incomplete, the open item incomplete.
  auto cut = Frames(EncodeAll({Start("c"), Text("partial"), Fin(FinishReason::kLength), E(Kind::kDone)}));
  EXPECT_EQ(cut.back().event, "response.incomplete");
  EXPECT_EQ(cut.back().data["response"]["status"], "incomplete");
  EXPECT_EQ(cut.back().data["response"]["incomplete_details"], J(R"({"reason":"max_output_tokens"})"));
  EXPECT_EQ(cut[cut.size() - 2].data["item"]["status"], "incomplete");
  EXPECT_EQ(Accumulate(cut), cut.back().data["response"]);

  // Nothing but kDone: a well-formed, empty, completed stream.
  auto empty = Frames(EncodeAll({E(Kind::kDone)}));
  EXPECT_EQ(Types(empty), (std::vector<std::string>{"response.created", "response.in_progress", "response.completed"}));
  EXPECT_EQ(empty.back().data["response"]["output"], Json::array());
  EXPECT_EQ(empty[0].data["response"]["id"].get<std::string>().rfind("resp_", 0), 0u);

  // A delta without a start opens its call; a late piece for a closed call is still delivered
  // against that call's index, and the final Response has the whole arguments.
  auto odd = Frames(EncodeAll({Args(3, "{\"a\""), Tool(4, "c4", "g"), Args(3, ":1}"), Text(""), Args(4, ""),
                               Fin(FinishReason::kStop), Fin(FinishReason::kLength), E(Kind::kDone)}));
  const Json final_response = odd.back().data["response"];
  EXPECT_EQ(final_response["status"], "completed");  // the first finish counts
  ASSERT_EQ(final_response["output"].size(), 2u);
  EXPECT_EQ(final_response["output"][0]["arguments"], "{\"a\":1}");
  EXPECT_EQ(final_response["output"][1]["call_id"], "c4");
  EXPECT_EQ(odd[odd.size() - 4].data["output_index"], 0);  // the late delta
  Accumulate(odd);

  // Usage never reported: null, not zeros.
  auto no_usage = Frames(EncodeAll({Text("x"), E(Kind::kDone)}));
  EXPECT_TRUE(no_usage.back().data["response"]["usage"].is_null());
}

TEST(ResponsesStream, ErrorMidStream) {
  auto enc = MakeResponsesStreamEncoder(ChatRequest{}, "virt");
  std::string out;
  enc->Encode(Start("e"), &out);
  enc->Encode(Text("partial answer"), &out);
  enc->Encode(Use(9, 3), &out);
  enc->EncodeError({429, ErrorKind::kRateLimit, "budget exhausted"}, &out);
  const std::string ended = out;
  enc->Encode(Text("late"), &out);
  enc->Encode(E(Kind::kDone), &out);
  enc->EncodeError({500, ErrorKind::kApi, "late"}, &out);
  EXPECT_EQ(out, ended);  // nothing after the end
  auto frames = Frames(out);
  EXPECT_EQ(Types(frames), (std::vector<std::string>{"response.created", "response.in_progress",
                                                     "response.output_item.added", "response.content_part.added",
                                                     "response.output_text.delta", "error", "response.failed"}));
  EXPECT_EQ(frames[5].data, J(R"({"type":"error","sequence_number":5,"code":"rate_limit_exceeded",
      "message":"budget exhausted","param":null,
      "error":{"message":"budget exhausted","type":"rate_limit_error","param":null,"code":"rate_limit_exceeded"}})"));
  const Json failed = frames[6].data["response"];
  EXPECT_EQ(failed["status"], "failed");
  EXPECT_EQ(failed["id"], "resp_e");
  EXPECT_EQ(failed["error"], J(R"({"code":"rate_limit_exceeded","message":"budget exhausted"})"));
  ASSERT_EQ(failed["output"].size(), 1u);
  EXPECT_EQ(failed["output"][0]["status"], "incomplete");
  EXPECT_EQ(failed["output"][0]["content"][0]["text"], "partial answer");  // what came before survives
  EXPECT_EQ(failed["usage"]["input_tokens"], 9);
  Accumulate(frames);

  // Before anything was sent: still a well-formed stream, opened and then failed.
  auto first = MakeResponsesStreamEncoder(ChatRequest{}, "virt");
  std::string early;
  first->EncodeError({502, ErrorKind::kBadGateway, "upstream said \"no\"\nline 2"}, &early);
  auto ef = Frames(early);
  EXPECT_EQ(Types(ef), (std::vector<std::string>{"response.created", "response.in_progress", "error", "response.failed"}));
  EXPECT_EQ(ef[2].data["message"], "upstream said \"no\"\nline 2");
  EXPECT_EQ(ef[2].data["error"]["type"], "server_error");
  EXPECT_EQ(ef[3].data["response"]["error"]["code"], "server_error");
}

TEST(ResponsesStream, InvalidUtf8IsReplacedNotThrown) {
  std::string body;
  ASSERT_NO_THROW(body = EncodeAll({Text("a\xff" "b"), Tool(0, "i\xc3", "n\xe2"), Args(0, "{\xfe}"), E(Kind::kDone)}));
  auto frames = Frames(body);
  const Json done = frames.back().data["response"];
  EXPECT_EQ(done["output"][0]["content"][0]["text"], "a\xef\xbf\xbd" "b");
  EXPECT_EQ(Accumulate(frames), done);
}

// The readers the Responses front shares with OpenAI chat give the Responses paths, word for word
// (text.format's fields sit beside its type; tools and calls are flat).
TEST(ResponsesParse, SharedReadersGiveResponsesPathsExactly) {
  auto with = [](const std::string& fields) { return R"({"model":"m","input":"x",)" + fields + "}"; };
  std::string many_parts = R"({"type":"input_text","text":"a"})";
  for (int i = 0; i < 10000; ++i) many_parts += R"(,{"type":"input_text","text":"a"})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {with(R"("text":{"format":"json"})"), "text.format: expected an object"},
      {with(R"("text":{"format":{}})"), "text.format.type: required"},
      {with(R"("text":{"format":{"type":"xml"}})"), "text.format.type: expected text, json_object or json_schema"},
      {with(R"("text":{"format":{"type":"json_schema","name":5}})"), "text.format.name: expected a string"},
      {with(R"("text":{"format":{"type":"json_schema","name":"n"}})"), "text.format.schema: required"},
      {with(R"("text":{"format":{"type":"json_schema","name":"n","schema":"{}"}})"),
       "text.format.schema: expected a JSON object"},
      {with(R"("text":{"format":{"type":"json_schema","name":"n","schema":{},"strict":1}})"),
       "text.format.strict: expected true or false"},
      {with(R"("text":{"format":{"type":"json_schema","name":"n","schema":{},"description":[]}})"),
       "text.format.description: expected a string"},
      {with(R"("tool_choice":"any")"), "tool_choice: expected auto, none, required or an object"},
      {with(R"("tool_choice":["f"])"), "tool_choice: expected a string or an object"},
      {with(R"("tool_choice":{"type":"file_search"})"), "tool_choice.type: file_search is not supported (only function)"},
      {with(R"("tool_choice":{"type":"function"})"), "tool_choice.name: required"},
      {with(R"("tools":[{"type":"function","name":"f","description":5}])"), "tools[0].description: expected a string"},
      {with(R"("tools":[{"type":"function","name":"f","parameters":[]}])"), "tools[0].parameters: expected a JSON object"},
      {with(R"("tools":[{"type":"function","name":"f","strict":"yes"}])"), "tools[0].strict: expected true or false"},
      {R"({"model":"m","input":[{"type":"function_call","call_id":"c","name":"f","arguments":5}]})",
       "input[0].arguments: expected a string"},
      {R"({"model":"m","input":[{"role":"user","content":5}]})", "input[0].content: expected a string or an array of parts"},
      {R"({"model":"m","input":[{"role":"user","content":["x"]}]})", "input[0].content[0]: expected an object"},
      {R"({"model":"m","input":[{"type":"function_call_output","call_id":"c","output":[{"type":"input_text"}]}]})",
       "input[0].output[0].text: required"},
      {R"({"model":"m","input":[{"role":"user","content":[)" + many_parts + "]}]}", "input[0].content: at most 10000 parts"},
  };
  for (const auto& [body, message] : cases) {
    SCOPED_TRACE(body);
    auto r = ParseResponsesRequest(body);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), message);
  }
  // The Responses API has no name rule of its own here; the name is carried as sent.
  ChatRequest named = MustParse(with(R"("text":{"format":{"type":"json_schema","name":"a.b","schema":{}}})"));
  ASSERT_TRUE(named.response_format.has_value());
  EXPECT_EQ(named.response_format->name, "a.b");
  ChatRequest args = MustParse(R"({"model":"m","input":[{"type":"function_call","call_id":"c","name":"f",)"
                               R"("arguments":{"a":[1]}},{"type":"function_call_output","call_id":"c","output":"r"}]})");
  ASSERT_FALSE(args.messages.empty());
  ASSERT_EQ(args.messages[0].tool_calls.size(), 1u);
  EXPECT_EQ(args.messages[0].tool_calls[0].arguments_json, R"({"a":[1]})");
}

}  // namespace
}  // namespace keel::gateway
