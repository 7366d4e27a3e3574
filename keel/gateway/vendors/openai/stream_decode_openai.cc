// The OpenAI upstream stream decoder: chat.completion.chunk SSE (also `keel serve`, vLLM, ...) and
// legacy text_completion chunks -> StreamEvents. An SseDecoder (stream_internal.h) plus a handler
// per event; per-tool-call bookkeeping is capped at kMaxToolCalls, pending arguments at
// kMaxPendingArgs, one event at max_event_bytes.
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "keel/gateway/stream_internal.h"
#include "keel/gateway/vendors/openai/json_scanner.h"
#include "keel/gateway/vendors/openai/openai.h"

namespace keel::gateway {

namespace {

using namespace stream_internal;  // NOLINT: the shared decoder pieces are this file's vocabulary

constexpr size_t kMaxPendingArgs = 1 << 20;

// ---- OpenAI chat.completion.chunk (and text_completion chunks)

// The fast path for the OpenAI chunks that make up nearly every stream: nlohmann's SAX parser
// (the same lexer, so the same acceptance of text, numbers and UTF-8) reads the fields the decoder
// uses straight into reused strings, with no DOM and no separate limits pass. It declines --
// Read returns false and the caller parses the event into a DOM as before -- whenever the event is
// not plainly of that shape: malformed or over the limits (the DOM path then words the error), not
// an object, an "error" member, tool calls, or a repeated key among the fields read (a DOM keeps
// the last; declining keeps that rule in one place). So what it accepts decodes exactly as the
// DOM path would decode it. Not thread-safe; one per decoder.
class OpenAIChunkReader {
 public:
  struct Choice {
    int64_t index = 0;
    std::string text, content, finish;  // "" when absent or not a string
  };
  std::string id, model;
  bool has_usage = false;
  int64_t prompt_tokens = -1, completion_tokens = -1;
  std::vector<Choice> choices;  // the first `choice_count` are this event's
  size_t choice_count = 0;

  bool Read(std::string_view data) {
    Reset();
    if (Scan(data)) return true;
    // Outside the Scanner's subset: nlohmann's lexer (it allocates per event, hence Scan first).
    Reset();
    return nlohmann::json::sax_parse(data.data(), data.data() + data.size(), this) && depth_ == 0;
  }

  // nlohmann SAX interface. Returning false stops the parse (the caller declines).
  using Sax = nlohmann::json;
  bool null() { return Value() && slot_ != Slot::kRoot; }
  bool boolean(bool) { return Value() && slot_ != Slot::kRoot && slot_ != Slot::kError; }
  bool number_integer(Sax::number_integer_t v) { return Number(v, true); }
  bool number_unsigned(Sax::number_unsigned_t v) { return Number(static_cast<int64_t>(v), true); }  // wraps, as Int()
  bool number_float(Sax::number_float_t d, const Sax::string_t&) {
    const bool in_range = d >= -9e18 && d <= 9e18;  // as Int(): out of range reads as missing
    return Number(in_range ? static_cast<int64_t>(d) : 0, in_range);
  }
  bool string(Sax::string_t& v) {
    if (!Value()) return false;
    switch (slot_) {
      case Slot::kId: id = v; break;
      case Slot::kModel: model = v; break;
      case Slot::kText: Cur().text = v; break;
      case Slot::kContent: Cur().content = v; break;
      case Slot::kFinish: Cur().finish = v; break;
      case Slot::kRoot: case Slot::kError: return false;
      default: break;
    }
    return true;
  }
  bool binary(Sax::binary_t&) { return false; }
  bool start_object(std::size_t) {
    if (!Value() || ++depth_ > kMaxDepth) return false;
    Ctx c = Ctx::kSkip;
    switch (slot_) {
      case Slot::kRoot: c = Ctx::kTop; break;
      case Slot::kChoice:
        if (choice_count == choices.size()) choices.emplace_back();
        choices[choice_count++] = Choice();
        c = Ctx::kChoice;
        break;
      case Slot::kUsage: has_usage = true; c = Ctx::kUsage; break;
      case Slot::kDelta: c = Ctx::kDelta; break;
      case Slot::kError: return false;
      default: break;
    }
    return Push(c);
  }
  bool start_array(std::size_t) {
    if (!Value() || ++depth_ > kMaxDepth) return false;
    if (slot_ == Slot::kRoot || slot_ == Slot::kError || slot_ == Slot::kToolCalls) return false;
    return Push(slot_ == Slot::kChoices ? Ctx::kChoices : Ctx::kSkip);
  }
  bool end_object() { return Pop(); }
  bool end_array() { return Pop(); }
  bool key(Sax::string_t& k) {
    if (++values_ > kMaxValues) return false;
    slot_ = Slot::kOther;
    unsigned bit = 0;
    switch (stack_[depth_ - 1]) {
      case Ctx::kTop:
        if (k == "id") slot_ = Slot::kId, bit = 1;
        else if (k == "model") slot_ = Slot::kModel, bit = 2;
        else if (k == "choices") slot_ = Slot::kChoices, bit = 4;
        else if (k == "usage") slot_ = Slot::kUsage, bit = 8;
        else if (k == "error") slot_ = Slot::kError;
        break;
      case Ctx::kChoice:
        if (k == "index") slot_ = Slot::kIndex, bit = 1;
        else if (k == "text") slot_ = Slot::kText, bit = 2;
        else if (k == "delta") slot_ = Slot::kDelta, bit = 4;
        else if (k == "finish_reason") slot_ = Slot::kFinish, bit = 8;
        break;
      case Ctx::kDelta:
        if (k == "content") slot_ = Slot::kContent, bit = 1;
        else if (k == "tool_calls") slot_ = Slot::kToolCalls, bit = 2;
        break;
      case Ctx::kUsage:
        if (k == "prompt_tokens") slot_ = Slot::kPrompt, bit = 1;
        else if (k == "completion_tokens") slot_ = Slot::kCompletion, bit = 2;
        break;
      default: break;
    }
    if (seen_[depth_ - 1] & bit) return false;  // a repeated key: the DOM path decides
    seen_[depth_ - 1] |= bit;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }

 private:
  // Where the next value lands.
  enum class Slot : uint8_t {
    kRoot, kOther, kId, kModel, kChoices, kChoice, kUsage, kError, kIndex, kText, kDelta, kFinish,
    kContent, kToolCalls, kPrompt, kCompletion
  };
  enum class Ctx : uint8_t { kTop, kChoices, kChoice, kDelta, kUsage, kSkip };
  static constexpr int kMaxDepth = JsonLimits{}.max_depth;
  static constexpr size_t kMaxValues = JsonLimits{}.max_values;

  void Reset() {
    id.clear();
    model.clear();
    has_usage = false;
    prompt_tokens = completion_tokens = -1;
    choice_count = 0;
    depth_ = 0;
    values_ = 0;
    slot_ = Slot::kRoot;
  }

  // Walks the event with json_scanner.h's Scanner, driving the SAX calls above with no
  // allocation beyond the reused strings. The Scanner accepts a strict subset of JSON that
  // nlohmann reads to the same calls; a non-integer number declines too (the SAX path converts
  // it as nlohmann does). False for anything else.
  bool Scan(std::string_view t) {
    internal::Scanner s(t, kMaxValues);
    ScanHooks hooks{*this};
    return s.Walk(hooks) && s.AtEnd() && depth_ == 0;
  }
  // Scanner::Walk's hooks: the SAX calls.
  struct ScanHooks {
    OpenAIChunkReader& r;
    bool Begin(bool object) { return object ? r.start_object(0) : r.start_array(0); }
    bool End() { return r.Pop(); }
    bool Key(std::string& k) { return r.key(k); }
    bool String(std::string& v) { return r.string(v); }
    bool Number(internal::Scanner::Num kind, int64_t v) {
      return kind == internal::Scanner::Num::kInt && r.Number(v, true);
    }
    bool Null() { return r.null(); }
    bool Bool(bool b) { return r.boolean(b); }
  };

  Choice& Cur() { return choices[choice_count - 1]; }
  bool Value() { return ++values_ <= kMaxValues; }
  bool Number(int64_t v, bool present) {
    if (!Value()) return false;
    switch (slot_) {
      case Slot::kIndex: Cur().index = present ? v : 0; break;  // Int(c, "index", 0)
      case Slot::kPrompt: prompt_tokens = present ? v : -1; break;
      case Slot::kCompletion: completion_tokens = present ? v : -1; break;
      case Slot::kRoot: case Slot::kError: return false;
      default: break;
    }
    return true;
  }
  bool Push(Ctx c) {
    stack_[depth_ - 1] = c;
    seen_[depth_ - 1] = 0;
    slot_ = c == Ctx::kChoices ? Slot::kChoice : Slot::kOther;
    return true;
  }
  bool Pop() {
    if (depth_ == 0) return false;
    --depth_;
    slot_ = depth_ > 0 && stack_[depth_ - 1] == Ctx::kChoices ? Slot::kChoice : Slot::kOther;
    return true;
  }

  int depth_ = 0;
  size_t values_ = 0;
  Slot slot_ = Slot::kRoot;
  Ctx stack_[kMaxDepth];
  unsigned seen_[kMaxDepth];
};

class OpenAIDecoder final : public SseDecoder {
 public:
  explicit OpenAIDecoder(size_t max_event_bytes) : SseDecoder("openai", max_event_bytes) {}

 protected:
  const char* EndMarker() const override { return "data: [DONE]"; }

  Status Handle(const SseParser::Event& ev, std::vector<StreamEvent>* out) override {
    if (ev.data == "[DONE]") {
      FlushPending(out);
      ended_ = closed_ = true;
      return Status::Ok();
    }
    if (ev.event.empty() && reader_.Read(ev.data)) return HandleRead(out);
    Json j;
    KEEL_RETURN_IF_ERROR(ParseObject(ev, &j));
    if (const Json* err = Field(j, "error")) return OpenAIError(*err);
    if (ev.event == "error") return OpenAIError(j);
    EmitStart(Str(j, "id"), Str(j, "model"), out);
    if (const Json* choices = Field(j, "choices"); choices && choices->is_array()) {
      for (const Json& c : *choices) {
        if (Int(c, "index", 0) != 0) continue;  // n > 1 is not streamed through the gateway
        KEEL_RETURN_IF_ERROR(HandleChoice(c, out));
      }
    }
    if (const Json* u = Field(j, "usage"); u && u->is_object()) {
      out->push_back(UsageEv(Int(*u, "prompt_tokens"), Int(*u, "completion_tokens")));
    }
    return Status::Ok();
  }

  void FlushAtEnd(std::vector<StreamEvent>* out) override { FlushPending(out); }

 private:
  struct Call {
    int ordinal = -1;  // -1 until kToolCallStart was emitted
    std::string id;
    std::string name;
    std::string pending_args;  // arguments that arrived before the name
  };

  // The events of a chunk OpenAIChunkReader accepted, in the order Handle's DOM path emits them.
  Status HandleRead(std::vector<StreamEvent>* out) {
    EmitStart(reader_.id, reader_.model, out);
    for (size_t i = 0; i < reader_.choice_count; ++i) {
      OpenAIChunkReader::Choice& c = reader_.choices[i];
      if (c.index != 0) continue;
      if (!c.text.empty()) out->push_back(TextEv(c.text));
      if (!c.content.empty()) out->push_back(TextEv(c.content));
      if (!c.finish.empty()) {
        FlushPending(out);
        EmitFinish(ParseOpenAIFinishReason(c.finish), out);
      }
    }
    if (reader_.has_usage) out->push_back(UsageEv(reader_.prompt_tokens, reader_.completion_tokens));
    return Status::Ok();
  }

  Status OpenAIError(const Json& err) {
    std::string message = Str(err, "message");
    ErrorKind kind = ErrorKind::kApi;
    if (int64_t code = Int(err, "code"); code >= 400) kind = ErrorKindForStatus(static_cast<int>(code));
    const std::string type = Str(err, "type");
    if (type == "invalid_request_error") kind = ErrorKind::kInvalidRequest;
    if (type == "rate_limit_error" || Str(err, "code") == "rate_limit_exceeded") kind = ErrorKind::kRateLimit;
    return RaiseError(kind, std::move(message));
  }

  Status HandleChoice(const Json& c, std::vector<StreamEvent>* out) {
    if (std::string text = Str(c, "text"); !text.empty()) out->push_back(TextEv(std::move(text)));
    if (const Json* delta = Field(c, "delta"); delta && delta->is_object()) {
      if (std::string text = Str(*delta, "content"); !text.empty()) out->push_back(TextEv(std::move(text)));
      if (const Json* calls = Field(*delta, "tool_calls"); calls && calls->is_array()) {
        for (const Json& call : *calls) KEEL_RETURN_IF_ERROR(HandleToolCall(call, out));
      }
    }
    const std::string finish = Str(c, "finish_reason");
    if (!finish.empty()) {
      FlushPending(out);
      EmitFinish(ParseOpenAIFinishReason(finish), out);
    }
    return Status::Ok();
  }

  // The first chunk of a call carries id/type/name (arguments usually ""), later ones only
  // argument pieces. A call is announced once its name is known.
  Status HandleToolCall(const Json& call, std::vector<StreamEvent>* out) {
    const int64_t index = Int(call, "index", static_cast<int64_t>(calls_.size()));
    auto it = calls_.find(index);
    if (it == calls_.end()) {
      if (calls_.size() >= kMaxToolCalls) return Status::Corruption("openai stream: too many tool calls");
      it = calls_.emplace(index, Call()).first;
    }
    Call& c = it->second;
    if (std::string id = Str(call, "id"); !id.empty() && c.id.empty()) c.id = std::move(id);
    const Json* fn = Field(call, "function");
    std::string args;
    if (fn) {
      if (std::string name = Str(*fn, "name"); !name.empty() && c.name.empty()) c.name = std::move(name);
      args = Str(*fn, "arguments");
    }
    if (c.ordinal < 0 && !c.name.empty()) Announce(c, out);
    if (args.empty()) return Status::Ok();
    if (c.ordinal < 0) {
      if (c.pending_args.size() + args.size() > kMaxPendingArgs) {
        return Status::Corruption("openai stream: tool call arguments without a name exceed the bound");
      }
      c.pending_args += args;
      return Status::Ok();
    }
    out->push_back(ArgsEv(c.ordinal, std::move(args)));
    return Status::Ok();
  }

  void Announce(Call& c, std::vector<StreamEvent>* out) {
    c.ordinal = next_ordinal_++;
    StreamEvent e = Ev(StreamEvent::Kind::kToolCallStart);
    e.tool_index = c.ordinal;
    e.tool_call.id = c.id.empty() ? "call_" + std::to_string(c.ordinal) : c.id;
    e.tool_call.name = c.name;
    out->push_back(std::move(e));
    if (!c.pending_args.empty()) out->push_back(ArgsEv(c.ordinal, std::exchange(c.pending_args, {})));
  }

  static StreamEvent ArgsEv(int ordinal, std::string args) {
    StreamEvent e = Ev(StreamEvent::Kind::kToolCallDelta);
    e.tool_index = ordinal;
    e.text = std::move(args);
    return e;
  }

  // Calls that never got a name still reach the client rather than vanish.
  void FlushPending(std::vector<StreamEvent>* out) {
    for (auto& [index, c] : calls_) {
      if (c.ordinal < 0 && (!c.id.empty() || !c.pending_args.empty())) Announce(c, out);
    }
  }

  std::map<int64_t, Call> calls_;  // vendor index -> call
  int next_ordinal_ = 0;
  OpenAIChunkReader reader_;
};

}  // namespace

std::unique_ptr<StreamDecoder> MakeOpenAIStreamDecoder(size_t max_event_bytes) {
  return std::make_unique<OpenAIDecoder>(max_event_bytes);
}

}  // namespace keel::gateway
