// Names, error kinds and error bodies shared by every format, plus the per-format dispatchers.
// Per-format parsing and building lives in translate_openai.cc / translate_anthropic.cc /
// translate_gemini.cc.
#include "keel/gateway/translate.h"

#include "keel/gateway/translate_internal.h"

namespace keel::gateway {

using internal::json;

const char* WireFormatName(WireFormat f) {
  switch (f) {
    case WireFormat::kOpenAIChat: return "openai-chat";
    case WireFormat::kOpenAICompletions: return "openai-completions";
    case WireFormat::kAnthropicMessages: return "anthropic";
    case WireFormat::kGemini: return "gemini";
    case WireFormat::kOpenAIResponses: return "openai-responses";
  }
  return "unknown";
}

ErrorKind ErrorKindForStatus(int http_status) {
  switch (http_status) {
    case 400: case 422: return ErrorKind::kInvalidRequest;
    case 401: return ErrorKind::kAuthentication;
    case 402: case 403: return ErrorKind::kPermission;
    case 404: return ErrorKind::kNotFound;
    case 408: case 504: return ErrorKind::kTimeout;
    case 413: return ErrorKind::kRequestTooLarge;
    case 429: return ErrorKind::kRateLimit;
    case 502: return ErrorKind::kBadGateway;
    case 503: case 529: return ErrorKind::kOverloaded;  // 529: Anthropic "overloaded_error"
    default: break;
  }
  if (http_status >= 400 && http_status < 500) return ErrorKind::kInvalidRequest;
  return ErrorKind::kApi;
}

int StatusForErrorKind(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidRequest: return 400;
    case ErrorKind::kAuthentication: return 401;
    case ErrorKind::kPermission: return 403;
    case ErrorKind::kNotFound: return 404;
    case ErrorKind::kRequestTooLarge: return 413;
    case ErrorKind::kRateLimit: return 429;
    case ErrorKind::kApi: return 500;
    case ErrorKind::kBadGateway: return 502;
    case ErrorKind::kOverloaded: return 503;
    case ErrorKind::kTimeout: return 504;
  }
  return 500;
}

const char* FinishReasonName(WireFormat format, FinishReason reason) {
  switch (format) {
    case WireFormat::kOpenAIChat:
    case WireFormat::kOpenAICompletions:
      switch (reason) {
        case FinishReason::kNone: return "";  // callers write JSON null
        case FinishReason::kStop: return "stop";
        case FinishReason::kLength: return "length";
        case FinishReason::kToolCalls: return "tool_calls";
        case FinishReason::kContentFilter: return "content_filter";
      }
      break;
    case WireFormat::kAnthropicMessages:
      switch (reason) {
        case FinishReason::kNone: return "";
        case FinishReason::kStop: return "end_turn";
        case FinishReason::kLength: return "max_tokens";
        case FinishReason::kToolCalls: return "tool_use";
        case FinishReason::kContentFilter: return "refusal";  // Anthropic's "declined" stop reason
      }
      break;
    case WireFormat::kGemini:
      switch (reason) {
        case FinishReason::kNone: return "FINISH_REASON_UNSPECIFIED";
        case FinishReason::kStop: return "STOP";
        case FinishReason::kLength: return "MAX_TOKENS";
        case FinishReason::kToolCalls: return "STOP";  // Gemini signals calls by functionCall parts
        case FinishReason::kContentFilter: return "SAFETY";
      }
      break;
  }
  return "";
}

FinishReason ParseFinishReason(WireFormat format, std::string_view name) {
  if (name.empty()) return FinishReason::kNone;
  switch (format) {
    case WireFormat::kOpenAIChat:
    case WireFormat::kOpenAICompletions:
      if (name == "stop") return FinishReason::kStop;
      if (name == "length") return FinishReason::kLength;
      if (name == "tool_calls" || name == "function_call") return FinishReason::kToolCalls;
      if (name == "content_filter") return FinishReason::kContentFilter;
      return FinishReason::kStop;  // unknown but finished
    case WireFormat::kAnthropicMessages:
      if (name == "end_turn" || name == "stop_sequence" || name == "pause_turn") return FinishReason::kStop;
      if (name == "max_tokens" || name == "model_context_window_exceeded") return FinishReason::kLength;
      if (name == "tool_use") return FinishReason::kToolCalls;
      if (name == "refusal") return FinishReason::kContentFilter;
      return FinishReason::kStop;
    case WireFormat::kGemini:
      if (name == "FINISH_REASON_UNSPECIFIED") return FinishReason::kNone;
      if (name == "STOP") return FinishReason::kStop;
      if (name == "MAX_TOKENS") return FinishReason::kLength;
      if (name == "SAFETY" || name == "RECITATION" || name == "BLOCKLIST" ||
          name == "PROHIBITED_CONTENT" || name == "SPII" || name == "IMAGE_SAFETY")
        return FinishReason::kContentFilter;
      return FinishReason::kStop;  // OTHER, LANGUAGE, MALFORMED_FUNCTION_CALL, ...
  }
  return FinishReason::kNone;
}

namespace {

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

}  // namespace

std::string BuildErrorBody(WireFormat client, const GatewayError& error) {
  const int status = error.status >= 400 ? error.status : StatusForErrorKind(error.kind);
  json body;
  switch (client) {
    case WireFormat::kOpenAIChat:
    case WireFormat::kOpenAICompletions: {
      auto [type, code] = OpenAIErrorType(error.kind);
      body["error"] = {{"message", error.message}, {"type", type}, {"param", nullptr},
                       {"code", code ? json(code) : json(nullptr)}};
      break;
    }
    case WireFormat::kAnthropicMessages:
      body = {{"type", "error"},
              {"error", {{"type", AnthropicErrorType(error.kind)}, {"message", error.message}}}};
      break;
    case WireFormat::kGemini:
      body["error"] = {{"code", status}, {"message", error.message},
                       {"status", GeminiErrorStatus(error.kind)}};
      break;
  }
  // replace: messages may carry upstream bytes that are not valid UTF-8.
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

// ---- dispatch

Result<ChatRequest> ParseClientRequest(WireFormat format, std::string_view body) {
  switch (format) {
    case WireFormat::kOpenAIChat: return ParseOpenAIChatRequest(body);
    case WireFormat::kOpenAICompletions: return ParseOpenAICompletionsRequest(body);
    case WireFormat::kAnthropicMessages: return ParseAnthropicMessagesRequest(body);
    case WireFormat::kGemini: break;
  }
  return Status::InvalidArgument(std::string(WireFormatName(format)) + " is not a client format");
}

Result<std::string> BuildUpstreamRequest(WireFormat upstream, const ChatRequest& request,
                                         const std::string& upstream_model, int64_t default_max_tokens) {
  switch (upstream) {
    case WireFormat::kOpenAIChat: return internal::BuildOpenAIChatRequest(request, upstream_model);
    case WireFormat::kOpenAICompletions:
      return internal::BuildOpenAICompletionsRequest(request, upstream_model);
    case WireFormat::kAnthropicMessages:
      return internal::BuildAnthropicRequest(request, upstream_model, default_max_tokens);
    case WireFormat::kGemini: return internal::BuildGeminiRequest(request);
    case WireFormat::kOpenAIResponses: break;
  }
  return Status::InvalidArgument(std::string(WireFormatName(upstream)) + " is not an upstream format");
}

Result<ChatResponse> ParseUpstreamResponse(WireFormat upstream, std::string_view body) {
  KEEL_ASSIGN_OR_RETURN(json j, internal::ParseUpstreamObject(body));
  switch (upstream) {
    case WireFormat::kOpenAIChat: return internal::ParseOpenAIChatResponse(j);
    case WireFormat::kOpenAICompletions: return internal::ParseOpenAICompletionsResponse(j);
    case WireFormat::kAnthropicMessages: return internal::ParseAnthropicResponse(j);
    case WireFormat::kGemini: return internal::ParseGeminiResponse(j);
  }
  return Status::Internal("unknown upstream format");
}

std::string BuildClientResponse(WireFormat client, const ChatResponse& response,
                                const std::string& client_model) {
  switch (client) {
    case WireFormat::kOpenAIChat: return internal::BuildOpenAIChatResponse(response, client_model);
    case WireFormat::kOpenAICompletions:
      return internal::BuildOpenAICompletionsResponse(response, client_model);
    case WireFormat::kAnthropicMessages: return internal::BuildAnthropicResponse(response, client_model);
    case WireFormat::kGemini: return internal::BuildGeminiResponse(response, client_model);
  }
  return "{}";
}

// ---- upstream errors

namespace {

constexpr size_t kMaxExcerpt = 200;
constexpr size_t kMaxMessage = 2000;

// Printable ASCII only, whitespace runs collapsed, at most kMaxExcerpt bytes: safe to log and to
// put in a client's error message whatever the upstream sent.
std::string Excerpt(std::string_view body) {
  std::string out;
  bool space = false;
  for (char c : body) {
    if (out.size() >= kMaxExcerpt) {
      out += "...";
      break;
    }
    const unsigned char u = static_cast<unsigned char>(c);
    if (u == ' ' || u == '\t' || u == '\n' || u == '\r') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += (u >= 0x20 && u < 0x7f) ? c : '?';
  }
  return out;
}

// The vendor's own classification, when it names one the status alone does not carry.
std::optional<ErrorKind> KindForVendorType(std::string_view type) {
  if (type == "overloaded_error" || type == "UNAVAILABLE") return ErrorKind::kOverloaded;
  if (type == "rate_limit_error" || type == "RESOURCE_EXHAUSTED" || type == "insufficient_quota" ||
      type == "rate_limit_exceeded")
    return ErrorKind::kRateLimit;
  if (type == "request_too_large") return ErrorKind::kRequestTooLarge;
  if (type == "DEADLINE_EXCEEDED" || type == "timeout_error") return ErrorKind::kTimeout;
  return std::nullopt;
}

}  // namespace

GatewayError ParseUpstreamError(WireFormat upstream, int http_status, std::string_view body) {
  GatewayError err;
  // A status that is not an error (a 200 with an error body) means the upstream misbehaved.
  err.status = http_status >= 400 && http_status <= 599 ? http_status : 502;
  err.kind = ErrorKindForStatus(err.status);
  std::string message, vendor_type;
  JsonLimits limits = internal::kUpstreamJsonLimits;
  limits.require_object = false;
  Result<json> parsed = ParseUntrustedJson(body, limits);
  json j = parsed.ok() ? std::move(parsed).value() : json();
  // Gemini reports some errors as a one-element array ([{"error":{...}}]).
  if (j.is_array() && j.size() == 1) j = j[0];
  if (j.is_object()) {
    auto e = j.find("error");
    if (e != j.end() && e->is_object()) {
      message = internal::StringOr(*e, "message");
      vendor_type = upstream == WireFormat::kGemini ? internal::StringOr(*e, "status")
                                                    : internal::StringOr(*e, "type");
      if (vendor_type.empty()) vendor_type = internal::StringOr(*e, "code");
    } else if (e != j.end() && e->is_string()) {
      message = e->get<std::string>();  // {"error": "..."}: some OpenAI-compatible servers
    } else {
      message = internal::StringOr(j, "message", internal::StringOr(j, "detail"));
    }
  }
  if (auto kind = KindForVendorType(vendor_type)) err.kind = *kind;
  if (err.status == 529) err.status = 503;  // 529 is Anthropic's own; clients of other formats know 503
  if (message.empty()) {
    err.message = "upstream returned HTTP " + std::to_string(http_status);
    if (const std::string excerpt = Excerpt(body); !excerpt.empty()) err.message += ": " + excerpt;
  } else {
    err.message = message.size() > kMaxMessage ? message.substr(0, kMaxMessage) + "..." : message;
  }
  return err;
}

}  // namespace keel::gateway
