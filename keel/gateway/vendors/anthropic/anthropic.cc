// Anthropic's finish reasons and error bodies, the "anthropic" vendor adapter and the messages
// front.
#include "keel/gateway/vendors/anthropic/anthropic.h"

#include "keel/gateway/front.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/translate.h"
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendor.h"

namespace keel::gateway {
namespace {

using internal::json;

const char* AnthropicErrorType(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidRequest: return "invalid_request_error";
    case ErrorKind::kAuthentication: return "authentication_error";
    case ErrorKind::kPermission: return "permission_error";
    case ErrorKind::kNotFound: return "not_found_error";
    case ErrorKind::kRequestTooLarge: return "request_too_large";
    case ErrorKind::kRateLimit: return "rate_limit_error";
    case ErrorKind::kApi: return "api_error";
    case ErrorKind::kBadGateway: return "api_error";
    case ErrorKind::kOverloaded: return "overloaded_error";
    case ErrorKind::kTimeout: return "timeout_error";
  }
  return "api_error";
}

class AnthropicVendor final : public VendorAdapter {
 public:
  WireFormat format() const override { return WireFormat::kAnthropicMessages; }
  Result<ClientRequest> BuildChat(const UpstreamConfig& up, const ChatRequest& request, const std::string& model,
                                  int64_t default_max_tokens) const override {
    KEEL_ASSIGN_OR_RETURN(std::string body, BuildAnthropicRequest(request, model, default_max_tokens));
    ClientRequest r = JsonPost(up.base_url + "/v1/messages", std::move(body), request.stream);
    r.headers.emplace_back("x-api-key", up.api_key);
    r.headers.emplace_back("anthropic-version", "2023-06-01");
    return r;
  }
  Result<ChatResponse> ParseChat(std::string_view body) const override { return ParseAnthropicResponse(body); }
  GatewayError ParseError(int http_status, std::string_view body) const override {
    return ParseAnthropicError(http_status, body);
  }
  std::unique_ptr<StreamDecoder> MakeDecoder() const override { return MakeAnthropicStreamDecoder(); }
  FinishReason ParseFinishReason(std::string_view name) const override { return ParseAnthropicFinishReason(name); }
};

// POST /v1/messages.
class AnthropicFront final : public ClientFront {
 public:
  WireFormat format() const override { return WireFormat::kAnthropicMessages; }
  Result<ChatRequest> Parse(std::string_view body, std::string_view, bool) const override {
    return ParseAnthropicMessagesRequest(body);
  }
  std::string BuildAnswer(const ChatResponse& response, const ChatRequest&,
                          const std::string& client_model) const override {
    return BuildAnthropicResponse(response, client_model);
  }
  std::unique_ptr<StreamEncoder> MakeEncoder(const ChatRequest&, const std::string& client_model) const override {
    return MakeAnthropicStreamEncoder(client_model);
  }
  std::string ErrorBody(const GatewayError& error) const override { return BuildAnthropicErrorBody(error); }
  // Anthropic's overloaded_error is 529; other formats' clients get the 503 they know.
  int ErrorStatus(const GatewayError& error) const override {
    return error.kind == ErrorKind::kOverloaded && error.status == 503 ? 529 : error.status;
  }
  const char* FinishReasonName(FinishReason reason) const override { return AnthropicFinishReasonName(reason); }
};

}  // namespace

const char* AnthropicFinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "end_turn";
    case FinishReason::kLength: return "max_tokens";
    case FinishReason::kToolCalls: return "tool_use";
    case FinishReason::kContentFilter: return "refusal";  // Anthropic's "declined" stop reason
  }
  return "";
}

FinishReason ParseAnthropicFinishReason(std::string_view name) {
  if (name.empty()) return FinishReason::kNone;
  if (name == "end_turn" || name == "stop_sequence" || name == "pause_turn") return FinishReason::kStop;
  if (name == "max_tokens" || name == "model_context_window_exceeded") return FinishReason::kLength;
  if (name == "tool_use") return FinishReason::kToolCalls;
  if (name == "refusal") return FinishReason::kContentFilter;
  return FinishReason::kStop;
}

std::string BuildAnthropicErrorBody(const GatewayError& error) {
  json body = {{"type", "error"}, {"error", {{"type", AnthropicErrorType(error.kind)}, {"message", error.message}}}};
  return internal::Dump(body);  // replaces invalid UTF-8: messages may carry upstream bytes
}

GatewayError ParseAnthropicError(int http_status, std::string_view body) {
  return ParseVendorError(http_status, body, "type");
}

void RegisterAnthropicVendors(VendorRegistry* registry) {
  registry->Add("anthropic", std::make_unique<AnthropicVendor>());
}

void RegisterAnthropicFronts(FrontRegistry* registry) { registry->Add(std::make_unique<AnthropicFront>()); }

}  // namespace keel::gateway
