// Client-facing formats ("fronts"), one adapter each: how a client's chat request is read into
// the neutral form and how answers, streams and errors are written back in its format. The
// gateway's filter chain (gateway_chat.cc) is the same for every front; a new client format is
// one adapter plus one line in the registry in front.cc and a route in gateway.cc.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"
#include "keel/gateway/stream.h"

namespace keel::gateway {

class ClientFront {
 public:
  virtual ~ClientFront() = default;
  virtual WireFormat format() const = 0;
  // `path_model`: the model named by the URL (Gemini's /v1beta/models/{m}:...), else "".
  // `stream_by_path`: the URL asked for a stream (Gemini's :streamGenerateContent).
  virtual Result<ChatRequest> Parse(std::string_view body, std::string_view path_model,
                                    bool stream_by_path) const = 0;
  virtual std::string BuildAnswer(const ChatResponse& response, const ChatRequest& request,
                                  const std::string& client_model) const = 0;
  virtual std::unique_ptr<StreamEncoder> MakeEncoder(const ChatRequest& request,
                                                     const std::string& client_model) const = 0;
  virtual std::string ErrorBody(const GatewayError& error) const;
  virtual const char* StreamContentType() const { return "text/event-stream"; }
};

// Never null for a client format (kOpenAIChat, kOpenAICompletions, kAnthropicMessages, kGemini,
// kOpenAIResponses).
const ClientFront& FrontFor(WireFormat format);
// Gemini's front for ?alt=sse streams (sse) or JSON-array streams (no alt=sse).
const ClientFront& GeminiFrontFor(bool sse);

}  // namespace keel::gateway
