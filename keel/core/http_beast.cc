#include "keel/core/http_beast.h"

#include <boost/beast/core/string.hpp>

namespace keel {

std::string OriginForm(std::string_view target) {
  const size_t colon = target.find("://");
  if (colon == std::string_view::npos || target.starts_with('/')) return std::string(target);
  const std::string_view scheme = target.substr(0, colon);
  if (!boost::beast::iequals(boost::beast::string_view(scheme.data(), scheme.size()), "http") &&
      !boost::beast::iequals(boost::beast::string_view(scheme.data(), scheme.size()), "https")) {
    return std::string(target);
  }
  const std::string_view rest = target.substr(colon + 3);
  const size_t end = rest.find_first_of("/?#");
  if (end == std::string_view::npos) return "/";
  if (rest[end] == '/') return std::string(rest.substr(end));
  return "/" + std::string(rest.substr(end));
}

std::string DecodePath(std::string_view path) {
  if (path.find('%') == std::string_view::npos) return std::string(path);
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(path.size());
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] != '%') {
      out += path[i];
      continue;
    }
    const int hi = i + 2 < path.size() ? hex(path[i + 1]) : -1, lo = i + 2 < path.size() ? hex(path[i + 2]) : -1;
    if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) return std::string(path);
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

}  // namespace keel
