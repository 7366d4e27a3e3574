// OpenAI's finish reasons and error bodies, the "openai" and "keel" vendor adapters, and the
// chat/completions and completions fronts.
#include "keel/gateway/vendors/openai/openai.h"

#include "keel/gateway/front.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/translate.h"
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendor.h"

namespace keel::gateway {
namespace {

using internal::json;

// OpenAI's error "type" and "code" per kind. OpenAI itself reports 401 as
// invalid_request_error/invalid_api_key; SDKs dispatch on the HTTP status, not the type.
std::pair<const char*, const char*> OpenAIErrorType(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidRequest: return {"invalid_request_error", nullptr};
    case ErrorKind::kAuthentication: return {"authentication_error", "invalid_api_key"};
    case ErrorKind::kPermission: return {"permission_error", nullptr};
    case ErrorKind::kNotFound: return {"invalid_request_error", "model_not_found"};  // as OpenAI answers a 404
    case ErrorKind::kRequestTooLarge: return {"invalid_request_error", "request_too_large"};
    case ErrorKind::kRateLimit: return {"rate_limit_error", "rate_limit_exceeded"};
    case ErrorKind::kApi: return {"server_error", nullptr};
    case ErrorKind::kBadGateway: return {"server_error", "bad_gateway"};
    case ErrorKind::kOverloaded: return {"server_error", "overloaded"};
    case ErrorKind::kTimeout: return {"server_error", "timeout"};
  }
  return {"server_error", nullptr};
}

// A field the upstream would drop or reject: the client's 400, named, before anything is sent.
Status Unsupported(const char* field, std::string_view vendor) {
  return Status::InvalidArgument(std::string(field) + ": not supported by " + std::string(vendor) + " upstreams");
}

// OpenAI's chat/completions, and every server that copies it. `keel serve` ("keel") speaks the
// same wire format with a different set of sampling fields: it has top_k, the penalties and
// logit_bias, and no structured output or reasoning effort (refused here); OpenAI has no top_k
// (it would answer 400).
class OpenAIVendor final : public VendorAdapter {
 public:
  explicit OpenAIVendor(bool keel) : keel_(keel) {}
  WireFormat format() const override { return WireFormat::kOpenAIChat; }
  Result<ClientRequest> BuildChat(const UpstreamConfig& up, const ChatRequest& request, const std::string& model,
                                  int64_t) const override {
    if (keel_) {
      if (!request.reasoning_effort.empty()) return Unsupported("reasoning_effort", "keel");
      if (request.response_format && request.response_format->kind != ResponseFormat::Kind::kText) {
        return Unsupported("response_format", "keel");
      }
    } else if (request.top_k) {
      return Unsupported("top_k", "openai");
    }
    KEEL_ASSIGN_OR_RETURN(std::string body, BuildOpenAIChatRequest(request, model));
    ClientRequest r = JsonPost(up.base_url + "/v1/chat/completions", std::move(body), request.stream);
    Authorize(up, &r);
    return r;
  }
  Result<ClientRequest> BuildEmbeddings(const UpstreamConfig& up, std::string body) const override {
    ClientRequest r = JsonPost(up.base_url + "/v1/embeddings", std::move(body), false);
    Authorize(up, &r);
    return r;
  }
  Result<ChatResponse> ParseChat(std::string_view body) const override { return ParseOpenAIChatResponse(body); }
  GatewayError ParseError(int http_status, std::string_view body) const override {
    return ParseOpenAIError(http_status, body);
  }
  std::unique_ptr<StreamDecoder> MakeDecoder() const override { return MakeOpenAIStreamDecoder(); }
  FinishReason ParseFinishReason(std::string_view name) const override { return ParseOpenAIFinishReason(name); }

 private:
  static void Authorize(const UpstreamConfig& up, ClientRequest* r) {
    if (!up.api_key.empty()) r->headers.emplace_back("Authorization", "Bearer " + up.api_key);
  }
  bool keel_;
};

// POST /v1/chat/completions (`chat`) or /v1/completions.
class OpenAIFront final : public ClientFront {
 public:
  explicit OpenAIFront(bool chat) : chat_(chat) {}
  WireFormat format() const override { return chat_ ? WireFormat::kOpenAIChat : WireFormat::kOpenAICompletions; }
  Result<ChatRequest> Parse(std::string_view body, std::string_view, bool) const override {
    return chat_ ? ParseOpenAIChatRequest(body) : ParseOpenAICompletionsRequest(body);
  }
  std::string BuildAnswer(const ChatResponse& response, const ChatRequest&,
                          const std::string& client_model) const override {
    return chat_ ? BuildOpenAIChatResponse(response, client_model)
                 : BuildOpenAICompletionsResponse(response, client_model);
  }
  std::unique_ptr<StreamEncoder> MakeEncoder(const ChatRequest& request,
                                             const std::string& client_model) const override {
    return MakeOpenAIStreamEncoder(chat_, client_model, request.stream_include_usage);
  }
  std::string ErrorBody(const GatewayError& error) const override { return BuildOpenAIErrorBody(error); }
  const char* FinishReasonName(FinishReason reason) const override { return OpenAIFinishReasonName(reason); }

 private:
  bool chat_;
};

}  // namespace

const char* OpenAIFinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "";  // callers write JSON null
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kToolCalls: return "tool_calls";
    case FinishReason::kContentFilter: return "content_filter";
  }
  return "";
}

FinishReason ParseOpenAIFinishReason(std::string_view name) {
  if (name.empty()) return FinishReason::kNone;
  if (name == "stop") return FinishReason::kStop;
  if (name == "length") return FinishReason::kLength;
  if (name == "tool_calls" || name == "function_call") return FinishReason::kToolCalls;
  if (name == "content_filter") return FinishReason::kContentFilter;
  return FinishReason::kStop;  // unknown but finished
}

std::string BuildOpenAIErrorBody(const GatewayError& error) {
  auto [type, code] = OpenAIErrorType(error.kind);
  json body;
  body["error"] = {{"message", error.message}, {"type", type}, {"param", nullptr},
                   {"code", code ? json(code) : json(nullptr)}};
  return internal::Dump(body);  // replaces invalid UTF-8: messages may carry upstream bytes
}

GatewayError ParseOpenAIError(int http_status, std::string_view body) {
  return ParseVendorError(http_status, body, "type");
}

void RegisterOpenAIVendors(VendorRegistry* registry) {
  registry->Add("openai", std::make_unique<OpenAIVendor>(/*keel=*/false));
  registry->Add("keel", std::make_unique<OpenAIVendor>(/*keel=*/true));
}

void RegisterOpenAIFronts(FrontRegistry* registry) {
  registry->Add(std::make_unique<OpenAIFront>(/*chat=*/true));
  registry->Add(std::make_unique<OpenAIFront>(/*chat=*/false));
}

}  // namespace keel::gateway
