#include "keel/gateway/front.h"

#include "keel/gateway/gemini_front.h"
#include "keel/gateway/vendors/responses/responses.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

// OpenAI chat/completions, OpenAI legacy completions and Anthropic messages: the formats
// translate.h and stream.h read and write directly.
class TranslatedFront final : public ClientFront {
 public:
  explicit TranslatedFront(WireFormat format) : format_(format) {}
  WireFormat format() const override { return format_; }
  Result<ChatRequest> Parse(std::string_view body, std::string_view, bool) const override {
    return ParseClientRequest(format_, body);
  }
  std::string BuildAnswer(const ChatResponse& response, const ChatRequest&,
                          const std::string& client_model) const override {
    return BuildClientResponse(format_, response, client_model);
  }
  std::unique_ptr<StreamEncoder> MakeEncoder(const ChatRequest& request,
                                             const std::string& client_model) const override {
    return MakeStreamEncoder(format_, client_model, request.stream_include_usage);
  }

 private:
  WireFormat format_;
};

// POST /v1/responses (responses.h). Errors are OpenAI's.
class ResponsesFront final : public ClientFront {
 public:
  WireFormat format() const override { return WireFormat::kOpenAIResponses; }
  Result<ChatRequest> Parse(std::string_view body, std::string_view, bool) const override {
    return ParseResponsesRequest(body);
  }
  std::string BuildAnswer(const ChatResponse& response, const ChatRequest& request,
                          const std::string& client_model) const override {
    return BuildResponsesResponse(response, request, client_model);
  }
  std::unique_ptr<StreamEncoder> MakeEncoder(const ChatRequest& request,
                                             const std::string& client_model) const override {
    return MakeResponsesStreamEncoder(request, client_model);
  }
  std::string ErrorBody(const GatewayError& error) const override {
    return BuildErrorBody(WireFormat::kOpenAIChat, error);
  }
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
  const char* StreamContentType() const override { return GeminiStreamContentType(sse_); }

 private:
  bool sse_;  // false: a stream is one JSON array, as Gemini sends without ?alt=sse
};

}  // namespace

std::string ClientFront::ErrorBody(const GatewayError& error) const { return BuildErrorBody(format(), error); }

const ClientFront& FrontFor(WireFormat format) {
  static const TranslatedFront openai_chat(WireFormat::kOpenAIChat);
  static const TranslatedFront openai_completions(WireFormat::kOpenAICompletions);
  static const TranslatedFront anthropic(WireFormat::kAnthropicMessages);
  static const ResponsesFront responses;
  static const GeminiFront gemini(/*sse=*/true);
  switch (format) {
    case WireFormat::kOpenAICompletions: return openai_completions;
    case WireFormat::kAnthropicMessages: return anthropic;
    case WireFormat::kOpenAIResponses: return responses;
    case WireFormat::kGemini: return gemini;
    case WireFormat::kOpenAIChat: break;
  }
  return openai_chat;
}

const ClientFront& GeminiFrontFor(bool sse) {
  static const GeminiFront json_array(/*sse=*/false);
  return sse ? FrontFor(WireFormat::kGemini) : json_array;
}

}  // namespace keel::gateway
