// SseParser: incremental text/event-stream framing; AppendJsonString; MergeUsage. Each format's
// decoder and encoder live in its folder under keel/gateway/vendors/.
#include "keel/gateway/stream.h"

#include <string>

#include <nlohmann/json.hpp>

namespace keel::gateway {

namespace {
constexpr std::string_view kBom = "\xEF\xBB\xBF";
}  // namespace

size_t Utf8SequenceLength(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  const size_t left = s.size() - i;
  auto cont = [&](size_t k, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
    return k < left && b(i + k) >= lo && b(i + k) <= hi;
  };
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c == 0xE0) return cont(1, 0xA0) && cont(2) ? 3 : 0;
  if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return cont(1) && cont(2) ? 3 : 0;
  if (c == 0xED) return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0;
  if (c == 0xF0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
  if (c >= 0xF1 && c <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
  if (c == 0xF4) return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0;
  return 0;
}

void AppendJsonString(std::string_view s, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  const size_t start = out->size();
  out->reserve(start + s.size() + 2);
  out->push_back('"');
  size_t run = 0;  // s[run, i) is copied as is
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != '"' && c != '\\' && c < 0x80) {
      ++i;
      continue;
    }
    if (c >= 0x80) {
      const size_t n = Utf8SequenceLength(s, i);
      if (n == 0) {
        // Invalid UTF-8: nlohmann's replacement rules (how many bytes one U+FFFD stands for) are
        // intricate, and such text is rare; let nlohmann write this string.
        out->resize(start);
        out->append(nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
        return;
      }
      i += n;
      continue;
    }
    out->append(s.data() + run, i - run);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\b': out->append("\\b"); break;
      case '\t': out->append("\\t"); break;
      case '\n': out->append("\\n"); break;
      case '\f': out->append("\\f"); break;
      case '\r': out->append("\\r"); break;
      default: {
        const char esc[6] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]};
        out->append(esc, 6);
      }
    }
    run = ++i;
  }
  out->append(s.data() + run, s.size() - run);
  out->push_back('"');
}

Status SseParser::Feed(std::string_view bytes, std::vector<Event>* out) {
  if (failed_) return Status::InvalidArgument("SSE stream unusable after an oversize event");
  size_t i = 0;
  if (skip_lf_ && !bytes.empty()) {
    if (bytes[0] == '\n') i = 1;  // second half of a CRLF split across calls
    skip_lf_ = false;
  }
  while (i < bytes.size()) {
    const size_t end = bytes.find_first_of("\r\n", i);
    if (end == std::string_view::npos) {
      buffer_.append(bytes.substr(i));
      break;
    }
    std::string_view line = bytes.substr(i, end - i);
    if (!buffer_.empty()) {
      buffer_.append(line);
      line = buffer_;
    }
    if (line.size() + current_.data.size() + current_.event.size() > max_event_bytes_) {
      failed_ = true;
      return Status::InvalidArgument("SSE event exceeds " + std::to_string(max_event_bytes_) + " bytes");
    }
    Status s = ProcessLine(line, out);
    buffer_.clear();
    if (!s.ok()) return s;
    i = end + 1;
    if (bytes[end] == '\r') {
      if (i < bytes.size()) {
        if (bytes[i] == '\n') ++i;
      } else {
        skip_lf_ = true;
      }
    }
  }
  if (buffer_.size() + current_.data.size() + current_.event.size() > max_event_bytes_) {
    failed_ = true;
    return Status::InvalidArgument("SSE event exceeds " + std::to_string(max_event_bytes_) + " bytes");
  }
  return Status::Ok();
}

Status SseParser::ProcessLine(std::string_view line, std::vector<Event>* out) {
  if (first_line_) {
    first_line_ = false;
    if (line.substr(0, kBom.size()) == kBom) line.remove_prefix(kBom.size());
  }
  if (line.empty()) {  // dispatch
    if (has_data_) {
      // Every data line appended "\n"; the spec drops the last one.
      if (!current_.data.empty()) current_.data.pop_back();
      out->push_back(std::move(current_));
    }
    current_ = Event();
    current_has_fields_ = false;
    has_data_ = false;
    return Status::Ok();
  }
  if (line[0] == ':') return Status::Ok();  // comment (keep-alives)
  std::string_view field = line;
  std::string_view value;
  if (const size_t colon = line.find(':'); colon != std::string_view::npos) {
    field = line.substr(0, colon);
    value = line.substr(colon + 1);
    if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
  }
  current_has_fields_ = true;
  if (field == "event") {
    current_.event.assign(value);
  } else if (field == "data") {
    current_.data.append(value);
    current_.data.push_back('\n');
    has_data_ = true;
  }
  // "id", "retry" and unknown fields: ignored (no reconnection here).
  return Status::Ok();
}

bool SseParser::HasPartialEvent() const { return !buffer_.empty() || current_has_fields_; }

void MergeUsage(const Usage& in, Usage* total) {
  if (in.input_tokens >= 0) total->input_tokens = in.input_tokens;
  if (in.output_tokens >= 0) total->output_tokens = in.output_tokens;
}

}  // namespace keel::gateway
