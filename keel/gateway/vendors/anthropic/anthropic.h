// Anthropic's Messages API (/v1/messages) as an upstream vendor ("anthropic") and as the client
// front for that route. Pure functions, thread-safe; translate.h states what every format's codec
// promises.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"
#include "keel/gateway/stream.h"

namespace keel::gateway {

class VendorRegistry;
class FrontRegistry;

// ---- a client's messages request -> ChatRequest (client_format kAnthropicMessages); max_tokens
// is required, as Anthropic requires it.
Result<ChatRequest> ParseAnthropicMessagesRequest(std::string_view body);

// ---- ChatRequest -> upstream body for `model`; max_tokens is required there, so
// `default_max_tokens` fills it. Fails only with InvalidArgument "<field>: not supported by
// anthropic upstreams".
Result<std::string> BuildAnthropicRequest(const ChatRequest& request, const std::string& model,
                                          int64_t default_max_tokens);

// ---- an upstream answer -> ChatResponse (Corruption on anything malformed); the matched stop
// sequence is kept in ChatResponse::stop_sequence.
Result<ChatResponse> ParseAnthropicResponse(std::string_view body);

// ---- ChatResponse -> a client's message; `client_model` is the name the client asked for.
std::string BuildAnthropicResponse(const ChatResponse& response, const std::string& client_model);

// ---- errors: {"type":"error","error":{type,message}}, and an Anthropic error answer read back
std::string BuildAnthropicErrorBody(const GatewayError& error);
GatewayError ParseAnthropicError(int http_status, std::string_view body);

// ---- finish reasons: "end_turn", "max_tokens", "tool_use", "refusal" (stop_sequence and
// pause_turn read as kStop, model_context_window_exceeded as kLength); kNone is ""
const char* AnthropicFinishReasonName(FinishReason reason);
FinishReason ParseAnthropicFinishReason(std::string_view name);

// ---- streams: Messages SSE events in and out
std::unique_ptr<StreamDecoder> MakeAnthropicStreamDecoder(size_t max_event_bytes = kDefaultMaxEventBytes);
std::unique_ptr<StreamEncoder> MakeAnthropicStreamEncoder(const std::string& client_model);

// ---- registration (vendors/vendor.cc, vendors/front.cc): adapter "anthropic", front
// kAnthropicMessages.
void RegisterAnthropicVendors(VendorRegistry* registry);
void RegisterAnthropicFronts(FrontRegistry* registry);

}  // namespace keel::gateway
