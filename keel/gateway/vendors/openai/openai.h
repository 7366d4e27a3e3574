// OpenAI's wire formats -- Chat Completions (/v1/chat/completions) and legacy Completions
// (/v1/completions) -- as upstream vendors ("openai"; "keel" for `keel serve`, which speaks the
// same format with other sampling fields) and as the client fronts for both routes. Pure
// functions, thread-safe; translate.h states what every format's codec promises.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"
#include "keel/gateway/stream.h"

namespace keel::gateway {

class VendorRegistry;
class FrontRegistry;

// ---- client requests -> ChatRequest (client_format kOpenAIChat / kOpenAICompletions)
Result<ChatRequest> ParseOpenAIChatRequest(std::string_view body);
Result<ChatRequest> ParseOpenAICompletionsRequest(std::string_view body);

// ---- ChatRequest -> upstream body for `model`. A kOpenAICompletions request sent to a chat
// upstream becomes one user message; a chat request sent to a completions upstream, its turns as
// plain text. top_k is carried (`keel serve`, vLLM and llama.cpp read it). Fails only with
// InvalidArgument "<field>: not supported by ... upstreams".
Result<std::string> BuildOpenAIChatRequest(const ChatRequest& request, const std::string& model);
Result<std::string> BuildOpenAICompletionsRequest(const ChatRequest& request, const std::string& model);

// ---- upstream answers -> ChatResponse (Corruption on anything malformed)
Result<ChatResponse> ParseOpenAIChatResponse(std::string_view body);
Result<ChatResponse> ParseOpenAICompletionsResponse(std::string_view body);

// ---- ChatResponse -> client answers; `client_model` is the name the client asked for
std::string BuildOpenAIChatResponse(const ChatResponse& response, const std::string& client_model);
std::string BuildOpenAICompletionsResponse(const ChatResponse& response, const std::string& client_model);

// ---- errors: {"error":{message,type,param,code}}, and an OpenAI error answer read back
std::string BuildOpenAIErrorBody(const GatewayError& error);
GatewayError ParseOpenAIError(int http_status, std::string_view body);

// ---- finish reasons: "stop", "length", "tool_calls" ("function_call" read as it),
// "content_filter"; kNone is ""
const char* OpenAIFinishReasonName(FinishReason reason);
FinishReason ParseOpenAIFinishReason(std::string_view name);

// ---- streams. The decoder reads chat.completion.chunk and text_completion chunks alike. The
// encoder writes chat chunks (`chat`) or text_completion chunks; `include_usage` = the client's
// stream_options.include_usage.
std::unique_ptr<StreamDecoder> MakeOpenAIStreamDecoder(size_t max_event_bytes = kDefaultMaxEventBytes);
std::unique_ptr<StreamEncoder> MakeOpenAIStreamEncoder(bool chat, const std::string& client_model,
                                                       bool include_usage);

// ---- registration (vendors/vendor.cc, vendors/front.cc): adapters "openai" (added first: the
// default for kOpenAIChat) and "keel"; fronts kOpenAIChat and kOpenAICompletions.
void RegisterOpenAIVendors(VendorRegistry* registry);
void RegisterOpenAIFronts(FrontRegistry* registry);

}  // namespace keel::gateway
