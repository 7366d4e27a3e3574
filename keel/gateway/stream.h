// Streaming translation. An upstream's byte stream (SSE for OpenAI/Anthropic/`keel serve`, SSE
// from Gemini's streamGenerateContent?alt=sse) is decoded incrementally into StreamEvents, and
// StreamEvents are encoded into the client's SSE format. Both sides work on arbitrary chunk
// boundaries (a chunk may end mid-line or mid-UTF-8 sequence) and hold bounded state.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/json_writer.h"
#include "keel/core/status.h"
#include "keel/gateway/chat.h"

namespace keel::gateway {

// Incremental SSE framing per the WHATWG event-stream rules: lines end in LF, CRLF or CR (a CRLF
// split across two Feed calls is one line end); "event:" sets the name, "data:" lines are joined
// with "\n", "id:"/"retry:"/unknown fields and ":" comments are ignored, one space after the colon
// is stripped, a blank line dispatches the event -- only when it had a data line (an event with no
// data is dropped, as browsers do). A leading UTF-8 BOM is skipped. Not thread-safe; one per stream.
class SseParser {
 public:
  struct Event {
    std::string event;  // "" when the event had no "event:" line
    std::string data;   // data lines joined with "\n"
  };
  explicit SseParser(size_t max_event_bytes = 1 << 20) : max_event_bytes_(max_event_bytes) {}
  // Appends bytes; complete events are appended to `out`. InvalidArgument when one event grows
  // past max_event_bytes (the stream is then unusable).
  Status Feed(std::string_view bytes, std::vector<Event>* out);
  // True when bytes of an unfinished event are buffered (a stream that ends now was truncated).
  bool HasPartialEvent() const;

 private:
  size_t max_event_bytes_;
  std::string buffer_;
  Event current_;
  bool current_has_fields_ = false;
  bool has_data_ = false;       // current_ saw a "data" field (dispatch rule)
  bool skip_lf_ = false;        // the last Feed ended in CR: a leading LF completes that CRLF
  bool first_line_ = true;      // BOM check pending
  bool failed_ = false;         // max_event_bytes was exceeded; every later Feed fails

  Status ProcessLine(std::string_view line, std::vector<Event>* out);
};

// The encoders write their events directly (keel/core/json_writer.h), byte-identical to nlohmann.
using ::keel::AppendJsonString;
using ::keel::Utf8SequenceLength;

// Upstream stream -> StreamEvents. Not thread-safe; one per upstream response.
//
// Event order: kStart first (when the upstream names an id/model), then text and tool events in
// stream order, at most one kFinish, kUsage any number of times (before or after kFinish), and
// kDone last (from Finish only). A kUsage field of -1 means "not in this event": consumers keep
// the latest non-negative value of each field (all vendors report running totals).
// Tool calls: tool_index counts calls 0, 1, 2... in order of their kToolCallStart (not the
// vendor's index); every kToolCallDelta follows its call's kToolCallStart. kFinish carries the
// matched stop sequence when the vendor names it (Anthropic's message_delta.stop_sequence).
class StreamDecoder {
 public:
  virtual ~StreamDecoder() = default;
  // Feeds raw body bytes. Error (kBadGateway-worthy) on malformed JSON in an event, an event
  // of an unknown shape that the format makes mandatory, or an in-stream error event (its message
  // is carried in the Status). Codes: Corruption (garbage), Unavailable (the vendor's own error
  // event; see upstream_error()), InvalidArgument (an event over max_event_bytes). Events decoded
  // before the failure are still appended. Errors are sticky: later Feed/Finish return the same.
  virtual Status Feed(std::string_view bytes, std::vector<StreamEvent>* out) = 0;
  // The upstream closed the body. Emits kDone when the stream had ended properly ([DONE],
  // message_stop, a Gemini chunk with finishReason); Corruption("truncated stream: ...") otherwise.
  virtual Status Finish(std::vector<StreamEvent>* out) = 0;
  // After Feed failed on an in-stream error event (OpenAI/Gemini {"error":{..}}, Anthropic
  // `event: error`): the vendor's error in neutral form (status is the HTTP status the kind
  // implies, since the real one was 200). Null otherwise -- e.g. for malformed JSON (Corruption).
  virtual const GatewayError* upstream_error() const { return nullptr; }
};
// Folds one kUsage event into running totals: the latest non-negative value of each field wins
// (every vendor reports running totals; -1 means "not in this event").
void MergeUsage(const Usage& in, Usage* total);

// Each upstream format's decoder is made by its vendor (VendorAdapter::MakeDecoder in vendor.h, or
// the Make*StreamDecoder function in keel/gateway/vendors/<name>/<name>.h); `max_event_bytes`
// bounds one SSE event (a decoder's only unbounded input).
inline constexpr size_t kDefaultMaxEventBytes = size_t{1} << 20;

// StreamEvents -> client SSE bytes. Accepts any event order (no kStart, kDone without kFinish,
// text after tools, nothing at all) and always writes a well-formed client stream ending at kDone
// or EncodeError; events after that are ignored. Not thread-safe; one per client response.
class StreamEncoder {
 public:
  virtual ~StreamEncoder() = default;
  // Appends the SSE bytes for `event` (possibly none) to `out`.
  virtual void Encode(const StreamEvent& event, std::string* out) = 0;
  // Appends an in-stream error event in the client's format (after headers were sent, an error
  // can only be reported inside the stream), then ends the stream.
  virtual void EncodeError(const GatewayError& error, std::string* out) = 0;
};
// Each client format's encoder is made by its front (ClientFront::MakeEncoder in front.h). The
// Anthropic encoder writes stop_reason "stop_sequence" with the sequence when kFinish (a kStop)
// carries one; the OpenAI encoder writes usage only when the client asked for it
// (stream_options.include_usage; Anthropic always carries usage in message_start/message_delta).

}  // namespace keel::gateway
