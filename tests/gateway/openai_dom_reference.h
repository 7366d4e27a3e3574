// The OpenAI client-answer and upstream-request builders as they were written over an nlohmann DOM, kept only as the
// reference the direct writers (keel/gateway/vendors/openai/answer_openai.cc) must match byte for
// byte, for tests/gateway/openai_answer_test.cc and bench/gateway/openai_codec_bench.cc.
#pragma once

#include <algorithm>
#include <string>

#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendors/openai/openai.h"

namespace keel::gateway::dom_reference {

using internal::json;

inline json FinishJson(FinishReason finish) {
  const char* name = OpenAIFinishReasonName(finish);
  return *name ? json(name) : json(nullptr);
}

inline void WriteUsage(const Usage& usage, json* body) {
  if (usage.input_tokens < 0 && usage.output_tokens < 0) return;
  const int64_t in = std::max<int64_t>(usage.input_tokens, 0);
  const int64_t out = std::max<int64_t>(usage.output_tokens, 0);
  (*body)["usage"] = {{"prompt_tokens", in}, {"completion_tokens", out}, {"total_tokens", in + out}};
}

inline json ToolCallsJson(const std::vector<ToolCall>& calls) {
  json out = json::array();
  for (const ToolCall& c : calls) {
    out.push_back({{"id", c.id},
                   {"type", "function"},
                   {"function", {{"name", c.name},
                                 {"arguments", c.arguments_json.empty() ? "{}" : c.arguments_json}}}});
  }
  return out;
}

inline std::string BuildOpenAIChatResponse(const ChatResponse& response, const std::string& model) {
  json message = {{"role", "assistant"}, {"content", response.content}, {"refusal", nullptr}, {"annotations", json::array()}};
  if (!response.tool_calls.empty()) {
    if (response.content.empty()) message["content"] = nullptr;
    message["tool_calls"] = ToolCallsJson(response.tool_calls);
  }
  json body = {{"id", internal::PrefixedId(response.id, "chatcmpl-")},
               {"object", "chat.completion"},
               {"created", response.created ? response.created : internal::NowSeconds()},
               {"model", model},
               {"choices", json::array({{{"index", 0},
                                         {"message", std::move(message)},
                                         {"logprobs", nullptr},
                                         {"finish_reason", FinishJson(response.finish)}}})}};
  WriteUsage(response.usage, &body);
  return internal::Dump(body);
}

inline std::string BuildOpenAICompletionsResponse(const ChatResponse& response, const std::string& model) {
  json body = {{"id", internal::PrefixedId(response.id, "cmpl-")},
               {"object", "text_completion"},
               {"created", response.created ? response.created : internal::NowSeconds()},
               {"model", model},
               {"choices", json::array({{{"text", response.content},
                                         {"index", 0},
                                         {"logprobs", nullptr},
                                         {"finish_reason", FinishJson(response.finish)}}})}};
  WriteUsage(response.usage, &body);
  return internal::Dump(body);
}

// ---- upstream requests

inline void WriteCommon(const ChatRequest& request, json* body) {
  if (request.temperature) (*body)["temperature"] = *request.temperature;
  if (request.top_p) (*body)["top_p"] = *request.top_p;
  if (request.top_k) (*body)["top_k"] = *request.top_k;
  if (request.presence_penalty) (*body)["presence_penalty"] = *request.presence_penalty;
  if (request.frequency_penalty) (*body)["frequency_penalty"] = *request.frequency_penalty;
  if (!request.logit_bias_json.empty()) (*body)["logit_bias"] = internal::SchemaObject(request.logit_bias_json);
  if (request.seed) (*body)["seed"] = *request.seed;
  if (!request.stop.empty()) (*body)["stop"] = request.stop;
  if (!request.user.empty()) (*body)["user"] = request.user;
  if (request.stream) {
    (*body)["stream"] = true;
    // Always asked for: the gateway counts tokens even when the client does not want usage.
    (*body)["stream_options"] = {{"include_usage", true}};
  }
}

inline json ResponseFormatJson(const ResponseFormat& format) {
  switch (format.kind) {
    case ResponseFormat::Kind::kText: return {{"type", "text"}};
    case ResponseFormat::Kind::kJsonObject: return {{"type", "json_object"}};
    case ResponseFormat::Kind::kJsonSchema: break;
  }
  // OpenAI requires a name; Anthropic's output_config.format has none to give.
  json schema = {{"name", format.name.empty() ? "response" : format.name},
                 {"schema", internal::SchemaObject(format.schema_json)}};
  if (format.strict) schema["strict"] = true;
  return {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
}

inline Result<std::string> BuildOpenAIChatRequest(const ChatRequest& request, const std::string& model) {
  json body = {{"model", model}};
  json messages = json::array();
  if (!request.system.empty()) messages.push_back({{"role", "system"}, {"content", request.system}});
  for (const Message& m : internal::EffectiveMessages(request)) {
    json msg = {{"role", m.role}, {"content", m.content}};
    if (m.role == "assistant" && !m.tool_calls.empty()) {
      if (m.content.empty()) msg["content"] = nullptr;
      msg["tool_calls"] = ToolCallsJson(m.tool_calls);
    } else if (m.role == "tool") {
      msg["tool_call_id"] = m.tool_call_id;
    }
    messages.push_back(std::move(msg));
  }
  body["messages"] = std::move(messages);
  if (!request.tools.empty()) {
    json tools = json::array();
    for (const Tool& t : request.tools) {
      json fn = {{"name", t.name}, {"parameters", internal::SchemaObject(t.parameters_json)}};
      if (!t.description.empty()) fn["description"] = t.description;
      tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    body["tools"] = std::move(tools);
    const std::string& tc = request.tool_choice;
    if (tc == "auto" || tc == "none" || tc == "required") body["tool_choice"] = tc;
    else if (!tc.empty()) body["tool_choice"] = {{"type", "function"}, {"function", {{"name", tc}}}};
    // Only with tools: OpenAI refuses parallel_tool_calls in a request without them.
    if (request.parallel_tool_calls) body["parallel_tool_calls"] = *request.parallel_tool_calls;
  }
  if (request.response_format) body["response_format"] = ResponseFormatJson(*request.response_format);
  // max_completion_tokens: OpenAI's reasoning models reject max_tokens; keel serve reads both.
  if (request.max_tokens) body["max_completion_tokens"] = *request.max_tokens;
  WriteCommon(request, &body);
  return internal::Dump(body);
}

inline Result<std::string> BuildOpenAICompletionsRequest(const ChatRequest& request, const std::string& model) {
  // Legacy completions have no structured output (nor tools: those are not sent).
  if (request.response_format && request.response_format->kind != ResponseFormat::Kind::kText)
    return internal::Unsupported("response_format", WireFormat::kOpenAICompletions);
  std::string prompt = request.prompt;
  if (request.client_format != WireFormat::kOpenAICompletions) {
    // A chat request to a completions-only upstream: the turns as plain text, no template.
    prompt = request.system;
    for (const Message& m : request.messages) prompt += (prompt.empty() ? "" : "\n") + m.content;
  }
  json body = {{"model", model}, {"prompt", prompt}};
  if (request.max_tokens) body["max_tokens"] = *request.max_tokens;
  WriteCommon(request, &body);
  return internal::Dump(body);
}

}  // namespace keel::gateway::dom_reference
