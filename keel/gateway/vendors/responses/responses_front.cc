// The OpenAI Responses front (POST /v1/responses, responses.h). Its errors are OpenAI's.
#include "keel/gateway/front.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/responses/responses.h"

namespace keel::gateway {
namespace {

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
  std::string ErrorBody(const GatewayError& error) const override { return BuildOpenAIErrorBody(error); }
  // Responses objects carry status/incomplete_details instead; this is the chat name, for logs.
  const char* FinishReasonName(FinishReason reason) const override { return OpenAIFinishReasonName(reason); }
};

}  // namespace

void RegisterResponsesFronts(FrontRegistry* registry) { registry->Add(std::make_unique<ResponsesFront>()); }

}  // namespace keel::gateway
