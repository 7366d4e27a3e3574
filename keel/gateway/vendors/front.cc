// The front registry: one Register<Name>Fronts call per folder that has client formats, and the
// lookups over it.
#include "keel/gateway/front.h"

#include "keel/gateway/vendors/anthropic/anthropic.h"
#include "keel/gateway/vendors/gemini/gemini.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/responses/responses.h"

namespace keel::gateway {
namespace {

const FrontRegistry& Registry() {
  static const FrontRegistry* registry = [] {
    auto* r = new FrontRegistry();
    RegisterOpenAIFronts(r);  // chat/completions, completions
    RegisterAnthropicFronts(r);
    RegisterGeminiFronts(r);  // ?alt=sse; GeminiFrontFor(false) makes the JSON-array one
    RegisterResponsesFronts(r);
    return r;
  }();
  return *registry;
}

}  // namespace

const ClientFront& FrontFor(WireFormat format) {
  if (const ClientFront* front = Registry().Find(format)) return *front;
  return *Registry().Find(WireFormat::kOpenAIChat);
}

std::vector<WireFormat> FrontFormats() { return Registry().Formats(); }

const ClientFront& GeminiFrontFor(bool sse) {
  static const std::unique_ptr<ClientFront> json_array = MakeGeminiFront(/*sse=*/false);
  return sse ? FrontFor(WireFormat::kGemini) : *json_array;
}

}  // namespace keel::gateway
