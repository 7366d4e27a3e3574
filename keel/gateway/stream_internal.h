// Internal to the stream decoders and encoders (keel/gateway/stream/ and each vendor folder
// under keel/gateway/vendors/): the pieces several formats share -- never-throwing JSON readers,
// StreamEvent builders, the SseDecoder skeleton every upstream decoder derives from, SSE framing
// and client ids for encoders. Not part of the gateway's API.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/core/status.h"
#include "keel/gateway/chat.h"
#include "keel/gateway/stream.h"
#include "keel/gateway/translate.h"

namespace keel::gateway::stream_internal {

using Json = nlohmann::ordered_json;  // ordered: fields keep the order vendors (and models) wrote

// Bound on the tool calls one stream may open (decoders and encoders alike).
inline constexpr size_t kMaxToolCalls = 1024;

// ---- small readers that never throw

inline const Json* Field(const Json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

inline std::string Str(const Json& j, const char* key) {
  const Json* f = Field(j, key);
  return f && f->is_string() ? f->get<std::string>() : std::string();
}

inline int64_t Int(const Json& j, const char* key, int64_t missing = -1) {
  const Json* f = Field(j, key);
  if (!f) return missing;
  if (f->is_number_integer()) return f->get<int64_t>();  // huge unsigned wraps negative: "missing"
  if (f->is_number_float()) {
    const double d = f->get<double>();  // casting an out-of-range double is undefined
    return d >= -9e18 && d <= 9e18 ? static_cast<int64_t>(d) : missing;
  }
  return missing;
}

// Compact text; invalid UTF-8 becomes U+FFFD instead of throwing.
inline std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// At most ~120 bytes of `s`, for error messages.
inline std::string Excerpt(std::string_view s) {
  constexpr size_t kMax = 120;
  return s.size() <= kMax ? std::string(s) : std::string(s.substr(0, kMax)) + "...";
}

// ---- StreamEvents

inline StreamEvent Ev(StreamEvent::Kind kind) {
  StreamEvent e;
  e.kind = kind;
  return e;
}

inline StreamEvent TextEv(std::string text) {
  StreamEvent e = Ev(StreamEvent::Kind::kTextDelta);
  e.text = std::move(text);
  return e;
}

inline StreamEvent UsageEv(int64_t input, int64_t output) {
  StreamEvent e = Ev(StreamEvent::Kind::kUsage);
  e.usage.input_tokens = input;
  e.usage.output_tokens = output;
  return e;
}

// Status code for an in-stream error: the upstream said it failed (vs. Corruption: garbage).
inline Status UpstreamErrorStatus(const GatewayError& e, const char* format) {
  return Status::Unavailable(std::string(format) + " stream error event: " + e.message);
}

// ---- the shared skeleton: SSE framing, error latching, end-of-stream bookkeeping

class SseDecoder : public StreamDecoder {
 public:
  SseDecoder(const char* format, size_t max_event_bytes) : format_(format), sse_(max_event_bytes) {}

  Status Feed(std::string_view bytes, std::vector<StreamEvent>* out) final {
    if (!failed_.ok()) return failed_;
    if (finished_) return Status::InvalidArgument("Feed after Finish");
    events_.clear();
    if (Status s = sse_.Feed(bytes, &events_); !s.ok()) return Fail(s);
    for (const SseParser::Event& ev : events_) {
      ++event_count_;
      if (closed_) continue;  // bytes after [DONE] / message_stop carry nothing
      if (Status s = Handle(ev, out); !s.ok()) return Fail(s);
    }
    return Status::Ok();
  }

  Status Finish(std::vector<StreamEvent>* out) final {
    if (!failed_.ok()) return failed_;
    if (finished_) return Status::Ok();
    finished_ = true;
    if (!ended_) {
      std::string why = std::string("truncated stream: ") + format_ + " body ended before " +
                        EndMarker() + " after " + std::to_string(event_count_) + " events";
      if (sse_.HasPartialEvent()) why += " (an unfinished event was buffered)";
      return Fail(Status::Corruption(why));
    }
    FlushAtEnd(out);
    out->push_back(Ev(StreamEvent::Kind::kDone));
    return Status::Ok();
  }

  const GatewayError* upstream_error() const final { return error_ ? &*error_ : nullptr; }

 protected:
  virtual Status Handle(const SseParser::Event& ev, std::vector<StreamEvent>* out) = 0;
  virtual const char* EndMarker() const = 0;
  virtual void FlushAtEnd(std::vector<StreamEvent>*) {}

  Status Fail(Status s) {
    failed_ = std::move(s);
    return failed_;
  }

  // Parses one event's data as a JSON object, or says which event was malformed.
  // Bounded like every JSON text Keel reads (default depth and value limits; events are small).
  Status ParseObject(const SseParser::Event& ev, Json* j) const {
    Result<Json> parsed = ParseUntrustedOrderedJson(ev.data, JsonLimits{.require_object = true});
    if (parsed.ok()) *j = std::move(parsed).value();
    if (!parsed.ok()) {
      return Status::Corruption(std::string("malformed JSON in ") + format_ + " stream event #" +
                                std::to_string(event_count_) +
                                (ev.event.empty() ? "" : " (" + ev.event + ")") + ": " + Excerpt(ev.data));
    }
    return Status::Ok();
  }

  Status RaiseError(ErrorKind kind, std::string message) {
    GatewayError e;
    e.kind = kind;
    e.status = StatusForErrorKind(kind);
    e.message = message.empty() ? std::string("upstream reported an error mid-stream") : std::move(message);
    error_ = e;
    return UpstreamErrorStatus(*error_, format_);
  }

  // Emits kFinish once; vendors that repeat a finish reason do not make two. `stop_sequence`:
  // the stop sequence that matched, when the vendor names it.
  void EmitFinish(FinishReason reason, std::vector<StreamEvent>* out, std::string stop_sequence = {}) {
    if (finish_sent_ || reason == FinishReason::kNone) return;
    finish_sent_ = true;
    StreamEvent e = Ev(StreamEvent::Kind::kFinish);
    e.finish = reason;
    e.stop_sequence = std::move(stop_sequence);
    out->push_back(std::move(e));
  }

  void EmitStart(const std::string& id, const std::string& model, std::vector<StreamEvent>* out) {
    if (start_sent_) return;
    start_sent_ = true;
    StreamEvent e = Ev(StreamEvent::Kind::kStart);
    e.id = id;
    e.model = model;
    out->push_back(std::move(e));
  }

  const char* format_;
  bool ended_ = false;   // the stream's end marker was seen: Finish succeeds
  bool closed_ = false;  // ignore every later event
  size_t event_count_ = 0;

 private:
  SseParser sse_;
  std::vector<SseParser::Event> events_;
  Status failed_;
  std::optional<GatewayError> error_;
  bool finished_ = false;
  bool finish_sent_ = false;
  bool start_sent_ = false;
};

// ---- encoders

// One SSE event. Data is split at line breaks so a payload can never end the event early.
void AppendSse(std::string* out, std::string_view event, std::string_view data);
// `n` random lowercase hex digits (ids the gateway makes up).
std::string RandomHex(size_t n);
// The upstream id under the client's prefix, or a fresh one.
std::string ClientId(const std::string& prefix, const std::string& upstream_id);
// The finish a client is told when the stream named none: tool_calls after tool calls, else stop.
inline FinishReason EffectiveFinish(FinishReason given, bool saw_tools) {
  if (given != FinishReason::kNone) return given;
  return saw_tools ? FinishReason::kToolCalls : FinishReason::kStop;
}

}  // namespace keel::gateway::stream_internal
