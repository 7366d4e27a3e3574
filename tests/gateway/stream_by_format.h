// For the stream tests: a format's stream decoder and encoder, reached the way the gateway reaches
// them -- an upstream format's decoder from its vendor folder (vendors/<name>/<name>.h; the same
// one VendorAdapter::MakeDecoder makes, with a chosen event bound), a client format's encoder from
// its front (front.h).
#pragma once

#include <memory>
#include <string>

#include "keel/gateway/front.h"
#include "keel/gateway/stream.h"
#include "keel/gateway/vendors/anthropic/anthropic.h"
#include "keel/gateway/vendors/gemini/gemini.h"
#include "keel/gateway/vendors/openai/openai.h"

namespace keel::gateway::stream_by_format {

// kOpenAICompletions (legacy text_completion chunks) is read by the OpenAI decoder.
inline std::unique_ptr<StreamDecoder> MakeStreamDecoder(WireFormat upstream,
                                                        size_t max_event_bytes = kDefaultMaxEventBytes) {
  switch (upstream) {
    case WireFormat::kAnthropicMessages: return MakeAnthropicStreamDecoder(max_event_bytes);
    case WireFormat::kGemini: return MakeGeminiStreamDecoder(max_event_bytes);
    default: return MakeOpenAIStreamDecoder(max_event_bytes);
  }
}

// `include_usage`: the client's stream_options.include_usage.
inline std::unique_ptr<StreamEncoder> MakeStreamEncoder(WireFormat client, const std::string& client_model,
                                                        bool include_usage) {
  ChatRequest request;
  request.model = client_model;
  request.stream_include_usage = include_usage;
  return FrontFor(client).MakeEncoder(request, client_model);
}

}  // namespace keel::gateway::stream_by_format
