// Gemini's finish reasons and error bodies, the "gemini" vendor adapter, and the Gemini front
// (gemini_front.h: /v1beta/models/{m}:generateContent and :streamGenerateContent).
#include "keel/gateway/vendors/gemini/gemini.h"

#include "keel/gateway/front.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/vendors/gemini/gemini_front.h"
#include "keel/gateway/translate.h"
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendor.h"

namespace keel::gateway {
namespace {

using internal::json;

// google.rpc.Code names, as Gemini puts them in error.status.
const char* GeminiErrorStatus(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidRequest: return "INVALID_ARGUMENT";
    case ErrorKind::kAuthentication: return "UNAUTHENTICATED";
    case ErrorKind::kPermission: return "PERMISSION_DENIED";
    case ErrorKind::kNotFound: return "NOT_FOUND";
    case ErrorKind::kRequestTooLarge: return "INVALID_ARGUMENT";
    case ErrorKind::kRateLimit: return "RESOURCE_EXHAUSTED";
    case ErrorKind::kApi: return "INTERNAL";
    case ErrorKind::kBadGateway: return "INTERNAL";  // UNAVAILABLE would read as overloaded
    case ErrorKind::kOverloaded: return "UNAVAILABLE";
    case ErrorKind::kTimeout: return "DEADLINE_EXCEEDED";
  }
  return "INTERNAL";
}

class GeminiVendor final : public VendorAdapter {
 public:
  WireFormat format() const override { return WireFormat::kGemini; }
  Result<ClientRequest> BuildChat(const UpstreamConfig& up, const ChatRequest& request, const std::string& model,
                                  int64_t) const override {
    KEEL_ASSIGN_OR_RETURN(std::string body, BuildGeminiRequest(request));
    ClientRequest r = JsonPost(up.base_url + "/v1beta/models/" + model +
                                   (request.stream ? ":streamGenerateContent?alt=sse" : ":generateContent"),
                               std::move(body), request.stream);
    r.headers.emplace_back("x-goog-api-key", up.api_key);
    return r;
  }
  Result<ChatResponse> ParseChat(std::string_view body) const override { return ParseGeminiResponse(body); }
  GatewayError ParseError(int http_status, std::string_view body) const override {
    return ParseGeminiError(http_status, body);
  }
  std::unique_ptr<StreamDecoder> MakeDecoder() const override { return MakeGeminiStreamDecoder(); }
  FinishReason ParseFinishReason(std::string_view name) const override { return ParseGeminiFinishReason(name); }
};

// /v1beta/models/{m}:generateContent and :streamGenerateContent?alt=sse (gemini_front.h).
class GeminiFront final : public ClientFront {
 public:
  explicit GeminiFront(bool sse) : sse_(sse) {}
  WireFormat format() const override { return WireFormat::kGemini; }
  Result<ChatRequest> Parse(std::string_view body, std::string_view path_model, bool stream) const override {
    return ParseGeminiClientRequest(body, path_model, stream);
  }
  std::string BuildAnswer(const ChatResponse& response, const ChatRequest&,
                          const std::string& client_model) const override {
    return BuildGeminiClientResponse(response, client_model);
  }
  std::unique_ptr<StreamEncoder> MakeEncoder(const ChatRequest&, const std::string& client_model) const override {
    return MakeGeminiStreamEncoder(client_model, sse_);
  }
  std::string ErrorBody(const GatewayError& error) const override { return BuildGeminiErrorBody(error); }
  const char* StreamContentType() const override { return GeminiStreamContentType(sse_); }
  const char* FinishReasonName(FinishReason reason) const override { return GeminiFinishReasonName(reason); }

 private:
  bool sse_;  // false: a stream is one JSON array, as Gemini sends without ?alt=sse
};

}  // namespace

const char* GeminiFinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "FINISH_REASON_UNSPECIFIED";
    case FinishReason::kStop: return "STOP";
    case FinishReason::kLength: return "MAX_TOKENS";
    case FinishReason::kToolCalls: return "STOP";  // Gemini signals calls by functionCall parts
    case FinishReason::kContentFilter: return "SAFETY";
  }
  return "";
}

FinishReason ParseGeminiFinishReason(std::string_view name) {
  if (name.empty() || name == "FINISH_REASON_UNSPECIFIED") return FinishReason::kNone;
  if (name == "STOP") return FinishReason::kStop;
  if (name == "MAX_TOKENS") return FinishReason::kLength;
  if (name == "SAFETY" || name == "RECITATION" || name == "BLOCKLIST" || name == "PROHIBITED_CONTENT" ||
      name == "SPII" || name == "IMAGE_SAFETY")
    return FinishReason::kContentFilter;
  return FinishReason::kStop;  // OTHER, LANGUAGE, MALFORMED_FUNCTION_CALL, ...
}

std::string BuildGeminiErrorBody(const GatewayError& error) {
  const int status = error.status >= 400 ? error.status : StatusForErrorKind(error.kind);
  json body;
  body["error"] = {{"code", status}, {"message", error.message}, {"status", GeminiErrorStatus(error.kind)}};
  return internal::Dump(body);  // replaces invalid UTF-8: messages may carry upstream bytes
}

GatewayError ParseGeminiError(int http_status, std::string_view body) {
  return ParseVendorError(http_status, body, "status");
}

void RegisterGeminiVendors(VendorRegistry* registry) { registry->Add("gemini", std::make_unique<GeminiVendor>()); }

void RegisterGeminiFronts(FrontRegistry* registry) { registry->Add(MakeGeminiFront(/*sse=*/true)); }

std::unique_ptr<ClientFront> MakeGeminiFront(bool sse) { return std::make_unique<GeminiFront>(sse); }

}  // namespace keel::gateway
