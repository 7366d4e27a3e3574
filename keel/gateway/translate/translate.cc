// Format names, error kinds and the reading of vendors' error bodies: what every format shares.
// Each format's own parsing and building lives in its folder under keel/gateway/vendors/.
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

GatewayError ParseVendorError(int http_status, std::string_view body, const char* type_member) {
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
      vendor_type = internal::StringOr(*e, type_member);
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
