// Upstream vendors, one adapter each: where the gateway sends a chat or embeddings request, how
// it authenticates, and how answers, errors, finish reasons and streams come back into the
// neutral form (chat.h). A config names an adapter ("openai", "keel", "anthropic", "gemini").
// Each vendor is one folder, keel/gateway/vendors/<name>/, holding its codec, its stream decoder
// and its adapter, and declaring Register<Name>Vendors in <name>.h; vendors/vendor.cc calls each
// of those once (one line per vendor) to fill the registry. Adapters are immutable and
// thread-safe; the registry is filled at first use and read-only afterwards.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/gateway/async_http.h"
#include "keel/gateway/chat.h"
#include "keel/gateway/stream.h"

namespace keel::gateway {

struct UpstreamConfig;

class VendorAdapter {
 public:
  virtual ~VendorAdapter() = default;
  virtual WireFormat format() const = 0;

  // The upstream request for `request` sent to `model`: URL, auth headers and body.
  // InvalidArgument naming the field when the request asks for something this vendor cannot do
  // (the client's error: answered 400, no fallback).
  virtual Result<ClientRequest> BuildChat(const UpstreamConfig& upstream, const ChatRequest& request,
                                          const std::string& model, int64_t default_max_tokens) const = 0;
  // An OpenAI-shaped /v1/embeddings request with `body`; NotFound when the vendor has none.
  virtual Result<ClientRequest> BuildEmbeddings(const UpstreamConfig& upstream, std::string body) const;

  // Reading the vendor's answers (translate.h states what every codec promises).
  virtual Result<ChatResponse> ParseChat(std::string_view body) const = 0;
  // A vendor's error answer in neutral form (see ParseVendorError in translate.h).
  virtual GatewayError ParseError(int http_status, std::string_view body) const = 0;
  // A decoder for one streamed answer, bounding one SSE event at kDefaultMaxEventBytes. Never null.
  virtual std::unique_ptr<StreamDecoder> MakeDecoder() const = 0;
  // The vendor's finish-reason name as a FinishReason ("" gives kNone; unknown names kStop).
  virtual FinishReason ParseFinishReason(std::string_view name) const = 0;
};

// The adapters by name, as vendors/vendor.cc fills it from each vendor folder's
// Register<Name>Vendors. Not thread-safe while being filled.
class VendorRegistry {
 public:
  // Adds `adapter` as `name`. The first adapter added for a format is the one VendorNameFor names.
  void Add(std::string name, std::unique_ptr<VendorAdapter> adapter);
  const VendorAdapter* Find(std::string_view name) const;  // null when there is none
  std::vector<std::string> Names() const;                  // sorted
  std::string_view DefaultNameFor(WireFormat format) const;  // "" when no adapter has `format`

 private:
  std::map<std::string, std::unique_ptr<VendorAdapter>, std::less<>> by_name_;
  std::map<WireFormat, std::string> default_name_;
};

// A POST of JSON `body` to `url` (Content-Type application/json; Accept text/event-stream when
// `stream`): what adapters' Build* start from before adding their auth headers.
ClientRequest JsonPost(std::string url, std::string body, bool stream);

// The adapter a config's "format" names; NotFound lists the names there are.
Result<const VendorAdapter*> FindVendor(std::string_view name);
// The default adapter's name for an upstream format ("openai", "anthropic", "gemini"); formats
// no adapter speaks (kOpenAICompletions, kOpenAIResponses) get kOpenAIChat's.
std::string_view VendorNameFor(WireFormat format);
// Every registered name, for --help and error messages.
std::vector<std::string> VendorNames();

}  // namespace keel::gateway
