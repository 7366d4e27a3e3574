// libFuzzer target for ParseUntrustedJson (keel/core/json_reader.h), which every server runs on
// every body it did not write. Beyond crashes and sanitizer reports it checks the reader against
// nlohmann's own json::accept: within the limits, it accepts exactly what nlohmann accepts (texts
// with a raw NUL byte aside: the reader refuses them, nlohmann stops reading at one); what
// it accepts dumps and parses back to the same value; and whatever the pre-parse check lets
// through is really within the limits (depth), so the counting scan cannot be fooled by strings,
// escapes or malformed text into letting deep input reach nlohmann.
//
// Input: byte 0 picks the limits (small ones reach the limit paths), the rest is the text.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "keel/core/json_reader.h"

namespace {

[[noreturn]] void Broken(const char* what, std::string_view text) {
  std::fprintf(stderr, "json_reader_fuzz: %s\n--- text ---\n%.*s\n", what, static_cast<int>(text.size()), text.data());
  std::abort();
}

int Depth(const nlohmann::json& j) {
  if (!j.is_structured()) return 0;
  int deepest = 0;
  for (const auto& child : j) {
    const int d = Depth(child);
    if (d > deepest) deepest = d;
  }
  return deepest + 1;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  keel::JsonLimits limits;
  limits.max_depth = 1 + data[0] % 16;
  limits.max_values = 1 + (data[0] >> 4) * 8;
  limits.reject_duplicate_keys = data[0] & 0x08;
  keel::JsonReadError kind = keel::JsonReadError::kNone;
  auto parsed = keel::ParseUntrustedJson(text, limits, &kind);
  // nlohmann's lexer ends the input at a NUL byte (accepting "5\0garbage"); the reader refuses
  // any raw NUL, which JSON never allows. Compare only texts without one.
  const bool has_nul = text.find('\0') != std::string_view::npos;
  const bool nlohmann_accepts = !has_nul && nlohmann::json::accept(text);
  if (parsed.ok()) {
    if (kind != keel::JsonReadError::kNone) Broken("accepted, yet an error kind was set", text);
    if (!nlohmann_accepts) Broken("accepted text that nlohmann refuses", text);
    if (Depth(*parsed) > limits.max_depth) Broken("accepted text nested past max_depth", text);
    auto again = keel::ParseUntrustedJson(parsed->dump(), keel::JsonLimits{});
    if (!again.ok() || *again != *parsed) Broken("an accepted value does not survive dump and parse", text);
    return 0;
  }
  if (kind == keel::JsonReadError::kNone) Broken("refused without an error kind", text);
  if (kind == keel::JsonReadError::kMalformed && nlohmann_accepts && !limits.reject_duplicate_keys) {
    Broken("called malformed, yet nlohmann accepts it", text);
  }
  if (kind == keel::JsonReadError::kTooDeep || kind == keel::JsonReadError::kTooManyValues) {
    if (keel::CheckJsonLimits(text, limits) != kind) Broken("the limit check and the parse disagree", text);
  }
  (void)keel::ParseUntrustedOrderedJson(text, limits);
  return 0;
}
