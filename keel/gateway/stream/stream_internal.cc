// Encoder helpers every client format's stream encoder may use (stream_internal.h).
#include <random>
#include <string>

#include "keel/gateway/stream_internal.h"

namespace keel::gateway::stream_internal {

void AppendSse(std::string* out, std::string_view event, std::string_view data) {
  if (!event.empty()) {
    out->append("event: ").append(event).append("\n");
  }
  size_t start = 0;
  while (true) {
    size_t end = data.find_first_of("\r\n", start);
    out->append("data: ").append(data.substr(start, end == std::string_view::npos ? end : end - start));
    out->push_back('\n');
    if (end == std::string_view::npos) break;
    start = end + ((data[end] == '\r' && end + 1 < data.size() && data[end + 1] == '\n') ? 2 : 1);
  }
  out->push_back('\n');
}

std::string RandomHex(size_t n) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(n, '0');
  for (char& c : s) c = kHex[rng() & 15];
  return s;
}

std::string ClientId(const std::string& prefix, const std::string& upstream_id) {
  if (upstream_id.empty()) return prefix + RandomHex(24);
  if (upstream_id.rfind(prefix, 0) == 0) return upstream_id;
  return prefix + upstream_id;
}

}  // namespace keel::gateway::stream_internal
