// Upstream vendors, one adapter each: where the gateway sends a chat or embeddings request, how
// it authenticates, and how answers, errors and streams come back into the neutral form
// (chat.h). A config names an adapter ("openai", "keel", "anthropic", "gemini"); a new vendor
// is one adapter in vendor.cc (or its own file) plus one line in the registry there.
#pragma once

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

  // Reading the vendor's answers. The defaults serve the formats translate.h and stream.h know
  // (by format()); a vendor with a wire format of its own overrides all three.
  virtual Result<ChatResponse> ParseChat(std::string_view body) const;
  // A vendor's error answer in neutral form (see ParseUpstreamError).
  virtual GatewayError ParseError(int http_status, std::string_view body) const;
  virtual std::unique_ptr<StreamDecoder> MakeDecoder() const;
};

// The adapter a config's "format" names; NotFound lists the names there are.
Result<const VendorAdapter*> FindVendor(std::string_view name);
// The default adapter's name for an upstream format ("openai", "anthropic", "gemini").
std::string_view VendorNameFor(WireFormat format);
// Every registered name, for --help and error messages.
std::vector<std::string> VendorNames();

}  // namespace keel::gateway
