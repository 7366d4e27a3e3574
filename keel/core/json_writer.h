// Writing JSON text directly, without building a nlohmann value: for hot paths (the gateway's
// stream encoders and answers, its usage batches) whose output must still be exactly what
// nlohmann would write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace keel {

// Appends `s` as a JSON string literal, quotes included, byte for byte what nlohmann's
// dump(-1, ' ', false, error_handler_t::replace) writes for it: '"', '\\' and control characters
// escaped (\b \t \n \f \r, the rest as \u00xx), other valid UTF-8 as is, invalid UTF-8
// replaced with U+FFFD exactly as nlohmann replaces it. Thread-safe.
void AppendJsonString(std::string_view s, std::string* out);
// Length of the well-formed UTF-8 sequence that starts at s[i] (Unicode's Table 3-7: no overlong
// forms, surrogates or code points past U+10FFFF -- what nlohmann accepts), 0 when there is none.
size_t Utf8SequenceLength(std::string_view s, size_t i);

// Appends a number as nlohmann writes it: an integer in decimal; a double in its shortest
// round-trip form ("0.7", "1.0", "1e-07"), or null when it is not finite.
void AppendJsonNumber(int64_t v, std::string* out);
void AppendJsonNumber(double v, std::string* out);

}  // namespace keel
