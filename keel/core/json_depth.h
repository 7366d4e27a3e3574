// JsonDepthWithin: whether a JSON text nests at most `max_depth` objects/arrays deep, counted
// outside strings, without parsing it. Checked before parsing untrusted JSON because
// nlohmann::json's parser, dump() and destructor recurse once per level.
#pragma once

#include <string_view>

namespace keel {

inline bool JsonDepthWithin(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

}  // namespace keel
