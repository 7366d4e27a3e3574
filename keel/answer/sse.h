// OpenAI's streaming wire format for a `keel answer` client that sent "stream": true
// (docs/answer.md, "Streaming").
//
// SseRelay passes the gateway's own stream on as it arrives, token by token, adding the answer's
// "keel" member. CompletionAsSse re-encodes a finished chat completion, for an upstream that
// answered a streaming request with a whole completion. It sends the chunks an OpenAI stream
// carries: per choice, one chunk opening the assistant turn (role, empty content),
// one with the whole content (skipped when empty) and one with the finish_reason; then, when the
// client asked for usage (stream_options.include_usage), a chunk with "choices": [] and the
// usage, every earlier chunk carrying "usage": null as OpenAI's do; then "data: [DONE]". Each
// chunk repeats the completion's id, created, model and (when present) system_fingerprint under
// "object": "chat.completion.chunk". The completion's "keel" member rides on the last chunk of
// the last choice. A client therefore sees a valid stream, but its first token arrives with the
// last.
//
// CompletionAsSse is a pure function. An SseRelay serves one stream, from one thread.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace keel::answer {

// `completion` is a chat.completion object as a gateway or engine answers it ("choices" is an
// array; a choice without a message string counts as empty content, one without finish_reason
// finishes "stop"). Returns the SSE body, every event one "data: <json>\n\n" line.
std::string CompletionAsSse(const nlohmann::ordered_json& completion, bool include_usage);

// Relays an OpenAI chat-completion stream (server-sent events, bytes in any pieces) to a client:
//   - events are split at blank lines (LF or CRLF); comment lines (":" keep-alives) and fields
//     other than "data" are dropped; several data lines of one event are joined with "\n";
//   - every data payload but "[DONE]" must be a JSON object (bounded like any upstream answer)
//     and is sent on as one "data: <json>\n\n" event; an upstream error event (an "error"
//     member other than null or false, as the OpenAI SDKs read it) is sent on and ends the
//     relay: no [DONE] follows it, whatever the upstream sends;
//   - the "keel" member (from `keel_member`, called once) rides on the chunk that carries a
//     finish_reason; an upstream that sends [DONE] without one gets it on an extra chunk with
//     "choices": [];
//   - whatever follows [DONE] is ignored.
// A payload that is not a JSON object, an event over `max_event_bytes`, or a stream that ends
// before [DONE] (Finish) is a broken upstream: the client gets one OpenAI error event
// ({"error":{"message","type":"upstream_error",...}}, which the OpenAI SDKs raise) and no
// [DONE], so it cannot mistake a cut answer for a whole one.
class SseRelay {
 public:
  using Write = std::function<bool(std::string_view)>;  // false: the client is gone
  SseRelay(Write write, std::function<nlohmann::ordered_json()> keel_member, std::string upstream_name,
           size_t max_event_bytes = size_t{1} << 20);

  // Takes the next bytes of the upstream stream. False when the relay should stop reading: the
  // client is gone, or the upstream broke the format (an error event was sent). After [DONE] it
  // stays true, so the caller can read the body to its end and reuse the connection.
  bool Feed(std::string_view bytes);
  // The upstream stream ended (cleanly or not: `upstream_error` says why, "" for a clean end).
  // Sends the error event when [DONE] was not relayed. False when the answer was cut.
  bool Finish(std::string_view upstream_error);

  bool done() const { return done_; }
  bool failed() const { return failed_; }
  // Why the answer was cut ("" when it was not).
  const std::string& failure() const { return failure_; }

 private:
  bool Event(std::string_view data);
  bool Fail(std::string_view why);
  bool Send(const nlohmann::ordered_json& chunk);

  Write write_;
  std::function<nlohmann::ordered_json()> keel_member_;
  std::string upstream_name_;
  size_t max_event_bytes_;
  std::string pending_;     // bytes of an incomplete event
  std::string data_;        // data lines of the event being read
  nlohmann::ordered_json last_envelope_;  // id/created/model of the last chunk, for an extra one
  bool keel_sent_ = false;
  bool done_ = false;
  bool failed_ = false;
  bool client_gone_ = false;
  std::string failure_;
};

}  // namespace keel::answer
