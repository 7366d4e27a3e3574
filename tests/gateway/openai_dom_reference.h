// The OpenAI client-answer builders as they were written over an nlohmann DOM, kept only as the
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
  json message = {{"role", "assistant"}, {"content", response.content}};
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

}  // namespace keel::gateway::dom_reference
