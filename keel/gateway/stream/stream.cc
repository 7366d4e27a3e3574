// SseParser: incremental text/event-stream framing; AppendJsonString; MergeUsage. Each format's
// decoder and encoder live in its folder under keel/gateway/vendors/.
#include "keel/gateway/stream.h"

#include <string>


namespace keel::gateway {

namespace {
constexpr std::string_view kBom = "\xEF\xBB\xBF";
}  // namespace

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
