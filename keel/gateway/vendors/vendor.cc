// The vendor registry: one Register<Name>Vendors call per vendor folder, and the lookups over it.
#include "keel/gateway/vendor.h"

#include "keel/gateway/vendors/anthropic/anthropic.h"
#include "keel/gateway/vendors/gemini/gemini.h"
#include "keel/gateway/vendors/openai/openai.h"

namespace keel::gateway {
namespace {

const VendorRegistry& Registry() {
  static const VendorRegistry* registry = [] {
    auto* r = new VendorRegistry();
    RegisterOpenAIVendors(r);  // "openai", "keel"
    RegisterAnthropicVendors(r);
    RegisterGeminiVendors(r);
    return r;
  }();
  return *registry;
}

}  // namespace

Result<const VendorAdapter*> FindVendor(std::string_view name) {
  if (const VendorAdapter* adapter = Registry().Find(name)) return adapter;
  std::string names;
  for (const std::string& n : Registry().Names()) names += (names.empty() ? "" : ", ") + n;
  return Status::NotFound("unknown format \"" + std::string(name) + "\" (one of " + names + ")");
}

std::string_view VendorNameFor(WireFormat format) {
  std::string_view name = Registry().DefaultNameFor(format);
  return name.empty() ? Registry().DefaultNameFor(WireFormat::kOpenAIChat) : name;
}

std::vector<std::string> VendorNames() { return Registry().Names(); }

}  // namespace keel::gateway
