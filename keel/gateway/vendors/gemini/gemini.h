// Google Gemini's generateContent API as an upstream vendor ("gemini"), and the registration of
// the Gemini client front (whose routes, request parsing and encoders are in
// keel/gateway/vendors/gemini/gemini_front.h). Pure functions, thread-safe; translate.h states what every
// format's codec promises.
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
class ClientFront;

// ---- ChatRequest -> generateContent / streamGenerateContent body (the model is in the URL, not
// the body). Fails only with InvalidArgument "<field>: not supported by gemini upstreams".
Result<std::string> BuildGeminiRequest(const ChatRequest& request);

// ---- an upstream GenerateContentResponse -> ChatResponse (Corruption on anything malformed);
// calls without ids get "call_<i>", and a turn with calls finishes kToolCalls.
Result<ChatResponse> ParseGeminiResponse(std::string_view body);

// ---- errors: {"error":{code,message,status}}, and a Gemini error answer (also the
// one-element-array form) read back
std::string BuildGeminiErrorBody(const GatewayError& error);
GatewayError ParseGeminiError(int http_status, std::string_view body);

// ---- finish reasons: "STOP", "MAX_TOKENS", "SAFETY" (RECITATION, BLOCKLIST, ... read as
// kContentFilter); kToolCalls is "STOP" and kNone "FINISH_REASON_UNSPECIFIED"
const char* GeminiFinishReasonName(FinishReason reason);
FinishReason ParseGeminiFinishReason(std::string_view name);

// ---- the upstream stream decoder (streamGenerateContent?alt=sse). The client encoder is
// gemini_front.h's MakeGeminiStreamEncoder.
std::unique_ptr<StreamDecoder> MakeGeminiStreamDecoder(size_t max_event_bytes = kDefaultMaxEventBytes);

// ---- registration (vendors/vendor.cc, vendors/front.cc): adapter "gemini", front kGemini
// (streams as SSE); MakeGeminiFront(false) is the front for JSON-array streams (no ?alt=sse).
void RegisterGeminiVendors(VendorRegistry* registry);
void RegisterGeminiFronts(FrontRegistry* registry);
std::unique_ptr<ClientFront> MakeGeminiFront(bool sse);

}  // namespace keel::gateway
