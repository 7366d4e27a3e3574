#include "keel/gateway/vendor.h"

#include <map>

#include "keel/gateway/gateway.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

ClientRequest JsonPost(std::string url, std::string body, bool stream) {
  ClientRequest r;
  r.method = "POST";
  r.url = std::move(url);
  r.body = std::move(body);
  r.headers.emplace_back("Content-Type", "application/json");
  if (stream) r.headers.emplace_back("Accept", "text/event-stream");
  return r;
}

// A field the upstream would drop or reject: the client's 400, named, before anything is sent.
Status Unsupported(const char* field, std::string_view vendor) {
  return Status::InvalidArgument(std::string(field) + ": not supported by " + std::string(vendor) + " upstreams");
}

// OpenAI's chat/completions, and every server that copies it. `keel serve` ("keel") speaks the
// same wire format with a different set of sampling fields: it has top_k, and no penalties,
// logit_bias or structured output (it would ignore them, so they are refused here); OpenAI has
// no top_k (it would answer 400).
class OpenAIVendor final : public VendorAdapter {
 public:
  explicit OpenAIVendor(bool keel) : keel_(keel) {}
  WireFormat format() const override { return WireFormat::kOpenAIChat; }
  Result<ClientRequest> BuildChat(const UpstreamConfig& up, const ChatRequest& request, const std::string& model,
                                  int64_t default_max_tokens) const override {
    if (keel_) {
      if (request.presence_penalty.value_or(0) != 0) return Unsupported("presence_penalty", "keel");
      if (request.frequency_penalty.value_or(0) != 0) return Unsupported("frequency_penalty", "keel");
      if (!request.logit_bias_json.empty() && request.logit_bias_json != "{}") return Unsupported("logit_bias", "keel");
      if (request.response_format && request.response_format->kind != ResponseFormat::Kind::kText) {
        return Unsupported("response_format", "keel");
      }
    } else if (request.top_k) {
      return Unsupported("top_k", "openai");
    }
    KEEL_ASSIGN_OR_RETURN(std::string body,
                          BuildUpstreamRequest(format(), request, model, default_max_tokens));
    ClientRequest r = JsonPost(up.base_url + "/v1/chat/completions", std::move(body), request.stream);
    Authorize(up, &r);
    return r;
  }
  Result<ClientRequest> BuildEmbeddings(const UpstreamConfig& up, std::string body) const override {
    ClientRequest r = JsonPost(up.base_url + "/v1/embeddings", std::move(body), false);
    Authorize(up, &r);
    return r;
  }

 private:
  static void Authorize(const UpstreamConfig& up, ClientRequest* r) {
    if (!up.api_key.empty()) r->headers.emplace_back("Authorization", "Bearer " + up.api_key);
  }
  bool keel_;
};

class AnthropicVendor final : public VendorAdapter {
 public:
  WireFormat format() const override { return WireFormat::kAnthropicMessages; }
  Result<ClientRequest> BuildChat(const UpstreamConfig& up, const ChatRequest& request, const std::string& model,
                                  int64_t default_max_tokens) const override {
    KEEL_ASSIGN_OR_RETURN(std::string body,
                          BuildUpstreamRequest(format(), request, model, default_max_tokens));
    ClientRequest r = JsonPost(up.base_url + "/v1/messages", std::move(body), request.stream);
    r.headers.emplace_back("x-api-key", up.api_key);
    r.headers.emplace_back("anthropic-version", "2023-06-01");
    return r;
  }
};

class GeminiVendor final : public VendorAdapter {
 public:
  WireFormat format() const override { return WireFormat::kGemini; }
  Result<ClientRequest> BuildChat(const UpstreamConfig& up, const ChatRequest& request, const std::string& model,
                                  int64_t default_max_tokens) const override {
    KEEL_ASSIGN_OR_RETURN(std::string body,
                          BuildUpstreamRequest(format(), request, model, default_max_tokens));
    ClientRequest r = JsonPost(up.base_url + "/v1beta/models/" + model +
                                   (request.stream ? ":streamGenerateContent?alt=sse" : ":generateContent"),
                               std::move(body), request.stream);
    r.headers.emplace_back("x-goog-api-key", up.api_key);
    return r;
  }
};

const std::map<std::string, std::unique_ptr<VendorAdapter>, std::less<>>& Registry() {
  static const auto* registry = [] {
    auto* m = new std::map<std::string, std::unique_ptr<VendorAdapter>, std::less<>>();
    m->emplace("openai", std::make_unique<OpenAIVendor>(/*keel=*/false));
    m->emplace("keel", std::make_unique<OpenAIVendor>(/*keel=*/true));
    m->emplace("anthropic", std::make_unique<AnthropicVendor>());
    m->emplace("gemini", std::make_unique<GeminiVendor>());
    return m;
  }();
  return *registry;
}

}  // namespace

Result<ClientRequest> VendorAdapter::BuildEmbeddings(const UpstreamConfig& up, std::string body) const {
  return Status::NotFound(std::string(WireFormatName(format())) + " upstreams have no OpenAI-shaped embeddings");
}

Result<ChatResponse> VendorAdapter::ParseChat(std::string_view body) const {
  return ParseUpstreamResponse(format(), body);
}

GatewayError VendorAdapter::ParseError(int http_status, std::string_view body) const {
  return ParseUpstreamError(format(), http_status, body);
}

std::unique_ptr<StreamDecoder> VendorAdapter::MakeDecoder() const { return MakeStreamDecoder(format()); }

Result<const VendorAdapter*> FindVendor(std::string_view name) {
  const auto& registry = Registry();
  auto it = registry.find(name);
  if (it != registry.end()) return it->second.get();
  std::string names;
  for (const auto& [n, adapter] : registry) names += (names.empty() ? "" : ", ") + n;
  return Status::NotFound("unknown format \"" + std::string(name) + "\" (one of " + names + ")");
}

std::string_view VendorNameFor(WireFormat format) {
  switch (format) {
    case WireFormat::kAnthropicMessages: return "anthropic";
    case WireFormat::kGemini: return "gemini";
    default: return "openai";
  }
}

std::vector<std::string> VendorNames() {
  std::vector<std::string> names;
  for (const auto& [n, adapter] : Registry()) names.push_back(n);
  return names;
}

}  // namespace keel::gateway
