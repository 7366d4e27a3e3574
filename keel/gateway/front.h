// Client-facing formats ("fronts"), one adapter each: how a client's chat request is read into
// the neutral form and how answers, streams, finish reasons and errors are written back in its
// format. The gateway's filter chain (gateway_chat.cc) is the same for every front. A front lives
// in its format's folder, keel/gateway/vendors/<name>/ (next to the vendor adapter when the format
// is also an upstream one), which declares Register<Name>Fronts in <name>.h; vendors/front.cc
// calls each of those once (one line per folder). A new client format also needs its route in
// gateway.cc. Fronts are immutable and thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

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
  virtual std::string ErrorBody(const GatewayError& error) const = 0;
  // The HTTP status of `error` in this format (Anthropic says 529 for overloaded).
  virtual int ErrorStatus(const GatewayError& error) const { return error.status; }
  virtual const char* StreamContentType() const { return "text/event-stream"; }
  // The format's name for `reason` (translate.h: never null; kNone may be "").
  virtual const char* FinishReasonName(FinishReason reason) const = 0;
};

// The fronts by format, as vendors/front.cc fills it from each folder's Register<Name>Fronts.
// Not thread-safe while being filled.
class FrontRegistry {
 public:
  // Adds `front` for its format(); a format's first front stays.
  void Add(std::unique_ptr<ClientFront> front);
  const ClientFront* Find(WireFormat format) const;  // null when there is none
  std::vector<WireFormat> Formats() const;           // in enum order

 private:
  std::map<WireFormat, std::unique_ptr<ClientFront>> by_format_;
};

// Never null for a client format (kOpenAIChat, kOpenAICompletions, kAnthropicMessages, kGemini,
// kOpenAIResponses); a format without a front gets kOpenAIChat's.
const ClientFront& FrontFor(WireFormat format);
// The formats with a registered front, in enum order.
std::vector<WireFormat> FrontFormats();
// Gemini's front for ?alt=sse streams (sse) or JSON-array streams (no alt=sse).
const ClientFront& GeminiFrontFor(bool sse);

}  // namespace keel::gateway
