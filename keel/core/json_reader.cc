#include "keel/core/json_reader.h"

#include <fmt/format.h>

#include <set>
#include <string>
#include <vector>

namespace keel {

JsonReadError CheckJsonLimits(std::string_view text, const JsonLimits& limits, size_t* offset) {
  int depth = 0;
  size_t values = 0;
  bool in_string = false;
  bool in_scalar = false;  // inside a number or literal: its later bytes are not new values
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped byte (a quote or backslash included) cannot end the string
      else if (c == '"') in_string = false;
      continue;
    }
    const bool starts_value = c == '"' || c == '[' || c == '{' ||
                              (!in_scalar && c != ']' && c != '}' && c != ',' && c != ':' && c != ' ' &&
                               c != '\t' && c != '\n' && c != '\r');
    if (starts_value && ++values > limits.max_values) {
      if (offset) *offset = i;
      return JsonReadError::kTooManyValues;
    }
    switch (c) {
      case '"':
        in_string = true;
        in_scalar = false;
        break;
      case '[':
      case '{':
        in_scalar = false;
        if (++depth > limits.max_depth) {
          if (offset) *offset = i;
          return JsonReadError::kTooDeep;
        }
        break;
      case ']':
      case '}':
        in_scalar = false;
        if (depth > 0) --depth;  // unbalanced text is malformed; the parser says so
        break;
      case ',': case ':': case ' ': case '\t': case '\n': case '\r':
        in_scalar = false;
        break;
      default:
        in_scalar = true;
    }
  }
  return JsonReadError::kNone;
}

namespace {

// "[json.exception.parse_error.101] parse error at line 1, column 2: syntax error ..." -> the
// part after the position, which the byte offset replaces.
std::string_view Reason(std::string_view what) {
  if (size_t tag = what.find("] "); what.starts_with("[json.exception.") && tag != std::string_view::npos) {
    what.remove_prefix(tag + 2);
  }
  if (what.starts_with("parse error at line ")) {
    if (size_t at = what.find(": "); at != std::string_view::npos) what.remove_prefix(at + 2);
  }
  return what;
}

template <typename Json>
Result<Json> Parse(std::string_view text, const JsonLimits& limits, JsonReadError* error) {
  auto fail = [error](JsonReadError kind, std::string message) -> Result<Json> {
    if (error) *error = kind;
    return Status::InvalidArgument(std::move(message));
  };
  size_t offset = 0;
  switch (CheckJsonLimits(text, limits, &offset)) {
    case JsonReadError::kTooDeep:
      return fail(JsonReadError::kTooDeep, fmt::format("JSON nested deeper than {} (byte {})", limits.max_depth, offset));
    case JsonReadError::kTooManyValues:
      return fail(JsonReadError::kTooManyValues,
                  fmt::format("JSON has more than {} values (byte {})", limits.max_values, offset));
    default:
      break;
  }
  // A raw NUL is never valid JSON (in a string it must be escaped), and nlohmann's lexer reads
  // one as the end of the input: text after it would be ignored, not refused.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return fail(JsonReadError::kMalformed, fmt::format("malformed JSON at byte {}: a NUL byte", nul));
  }
  Json j;
  // With reject_duplicate_keys: the keys seen in each object open at the moment.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  auto watch_keys = [&](int, nlohmann::json::parse_event_t event, Json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      open_objects.emplace_back();
    } else if (event == Event::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == Event::key && !open_objects.empty() && parsed.is_string()) {
      if (!open_objects.back().insert(parsed.template get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.template get<std::string>();
      }
    }
    return true;
  };
  try {
    if (limits.reject_duplicate_keys) {
      j = Json::parse(text.begin(), text.end(), watch_keys);
    } else {
      j = Json::parse(text.begin(), text.end());
    }
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte counts bytes read, so the offending byte is at e.byte - 1 (0 for empty text).
    return fail(JsonReadError::kMalformed,
                fmt::format("malformed JSON at byte {}: {}", e.byte > 0 ? e.byte - 1 : 0, Reason(e.what())));
  } catch (const nlohmann::json::out_of_range&) {
    // 406: the grammar allows any number of digits; the number is not echoed (it may be megabytes).
    return fail(JsonReadError::kNumberOutOfRange, "JSON number out of range: it overflows a double");
  } catch (const nlohmann::json::exception& e) {
    return fail(JsonReadError::kMalformed, fmt::format("malformed JSON: {}", Reason(e.what())));
  }
  if (!duplicate.empty()) {
    return fail(JsonReadError::kMalformed, fmt::format("JSON object names the key \"{}\" twice", duplicate.substr(0, 200)));
  }
  if (limits.require_object && !j.is_object()) return fail(JsonReadError::kNotObject, "expected a JSON object");
  if (error) *error = JsonReadError::kNone;
  return j;
}

}  // namespace

Result<nlohmann::json> ParseUntrustedJson(std::string_view text, const JsonLimits& limits, JsonReadError* error) {
  return Parse<nlohmann::json>(text, limits, error);
}

Result<nlohmann::ordered_json> ParseUntrustedOrderedJson(std::string_view text, const JsonLimits& limits,
                                                         JsonReadError* error) {
  return Parse<nlohmann::ordered_json>(text, limits, error);
}

}  // namespace keel
