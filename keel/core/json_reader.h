// ParseUntrustedJson: the one way Keel turns JSON it did not write (request bodies, peer and
// upstream answers, config files) into nlohmann::json, with bounded memory and stack for any input.
//
// Why not plain json::parse: nlohmann builds one heap node per value (16 bytes in its parent plus
// 24-80 bytes of its own for containers and strings, plus vector growth), so 8 MiB of `[` costs
// ~600 MiB before it fails, and a flat array of tiny values (`[{},{},...]`) costs ~27x its text;
// dump() recurses once per level, so deep input that parses can still overflow the stack later.
// Here one pass over the bytes checks nesting depth and counts values BEFORE nlohmann allocates
// anything; only text within both limits is parsed. Peak memory is therefore about
// max_values x 100 bytes at worst (32 bytes per number in an array, ~80 per object or string).
//
// Thread-safe (no state). Never throws.
#pragma once

#include <cstddef>
#include <string_view>

#include <nlohmann/json.hpp>

#include "keel/core/status.h"

namespace keel {

struct JsonLimits {
  // Arrays and objects open at once, counted outside strings. The top-level value is depth 1.
  int max_depth = 64;
  // Values in the document: every array, object, string (object keys included), number, true,
  // false and null counts one. 1M is ~33 MiB of numbers or ~100 MiB of small objects at worst.
  size_t max_values = size_t{1} << 20;
  // Reject a top level that is not an object (after parsing, so malformed text says malformed).
  bool require_object = false;
  // Reject an object that names a key twice (kMalformed). For files operators write, where the
  // second of two keys silently winning hides a typo; wire formats keep JSON's last-one-wins.
  bool reject_duplicate_keys = false;
};

// Which check refused the text; callers that must keep a wire format's own message use it.
// kNumberOutOfRange: well-formed JSON holding a number beyond a double's range (e.g. 1e999).
enum class JsonReadError { kNone, kTooDeep, kTooManyValues, kMalformed, kNumberOutOfRange, kNotObject };

// Parses `text` within `limits`. On success the parsed value; otherwise InvalidArgument whose
// message names the check and, where it has one, the byte offset (0-based) where it failed:
//   "JSON nested deeper than 32 (byte 32)", "JSON has more than 1048576 values (byte 2097152)",
//   "malformed JSON at byte 3: syntax error ...", "expected a JSON object".
// Messages carry no prefix; callers add the field or body name. `error` (optional) gets the kind.
Result<nlohmann::json> ParseUntrustedJson(std::string_view text, const JsonLimits& limits,
                                          JsonReadError* error = nullptr);
// The same into nlohmann::ordered_json (object keys keep the document's order).
Result<nlohmann::ordered_json> ParseUntrustedOrderedJson(std::string_view text, const JsonLimits& limits,
                                                         JsonReadError* error = nullptr);

// The pre-parse check alone: kNone when `text` nests at most limits.max_depth deep and holds at
// most limits.max_values values (as counted above); otherwise the kind, and *offset (optional)
// the byte where the limit was crossed. Does not validate the JSON.
JsonReadError CheckJsonLimits(std::string_view text, const JsonLimits& limits, size_t* offset = nullptr);

}  // namespace keel
