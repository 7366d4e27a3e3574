// The Gemini front's stream encoder (gemini_front.h): StreamEvents -> streamGenerateContent
// chunks, as SSE ("data: {...}\r\n\r\n", Gemini's framing) or as one JSON array.
//
// Text is written as it comes, one chunk per delta. Function calls are collected and written
// whole in the last chunk, at kDone, with finishReason and usageMetadata: Gemini never streams
// arguments, and usage may arrive after the finish.
#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/gateway/vendors/gemini/gemini_front.h"
#include "keel/gateway/stream_internal.h"
#include "keel/gateway/vendors/gemini/gemini.h"

namespace keel::gateway {

namespace {

using namespace stream_internal;  // NOLINT: Json (ordered: fields in Gemini's order), Dump, RandomHex

// `json_text` with U+2028 and U+2029 (E2 80 A8 / E2 80 A9) written as JSON escapes.
void AppendEscapingJsLineTerminators(std::string_view json_text, std::string* out) {
  size_t from = 0;
  for (size_t i = json_text.find('\xE2'); i != std::string_view::npos; i = json_text.find('\xE2', i + 1)) {
    if (i + 2 < json_text.size() && json_text[i + 1] == '\x80' && (json_text[i + 2] == '\xA8' || json_text[i + 2] == '\xA9')) {
      out->append(json_text.substr(from, i - from)).append(json_text[i + 2] == '\xA8' ? "\\u2028" : "\\u2029");
      from = i + 3;
    }
  }
  out->append(json_text.substr(from));
}

// Arguments are held until the end; a stream whose calls exceed this is failed, not truncated.
constexpr size_t kMaxBufferedArgumentBytes = size_t{16} << 20;
constexpr JsonLimits kArgumentLimits{.max_depth = 128, .max_values = size_t{1} << 20, .require_object = true};

// Arguments text as the object Gemini's functionCall.args must be: {} when empty, the text
// wrapped as {"_raw": text} when it is not a JSON object (as translate.h does for requests).
Json ArgsObject(const std::string& text) {
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return Json::object();
  Result<Json> j = ParseUntrustedOrderedJson(text, kArgumentLimits);
  if (j.ok()) return std::move(j).value();
  return Json{{"_raw", text}};
}

class GeminiEncoder final : public StreamEncoder {
 public:
  GeminiEncoder(std::string model, bool sse) : model_(std::move(model)), sse_(sse) {}

  void Encode(const StreamEvent& ev, std::string* out) override {
    if (done_) return;
    using K = StreamEvent::Kind;
    switch (ev.kind) {
      case K::kStart:
        if (id_.empty() && !ev.id.empty()) id_ = ev.id;
        break;
      case K::kTextDelta:
        if (!ev.text.empty()) Chunk(Json::array({{{"text", ev.text}}}), nullptr, out);
        break;
      case K::kToolCallStart:
        if (Call* c = FindCall(ev.tool_index)) c->name = ev.tool_call.name;
        break;
      case K::kToolCallDelta:
        if (Call* c = FindCall(ev.tool_index)) {
          buffered_ += ev.text.size();
          if (buffered_ > kMaxBufferedArgumentBytes) {
            EncodeError({502, ErrorKind::kBadGateway, "function call arguments exceed the gateway's buffer"}, out);
            return;
          }
          c->args += ev.text;
        }
        break;
      case K::kFinish:
        if (finish_ == FinishReason::kNone) finish_ = ev.finish;
        break;
      case K::kUsage:
        MergeUsage(ev.usage, &usage_);
        break;
      case K::kDone:
        WriteLast(out);
        break;
    }
  }

  void EncodeError(const GatewayError& error, std::string* out) override {
    if (done_) return;
    Frame(BuildGeminiErrorBody(error), out);
    End(out);
  }

 private:
  struct Call {
    std::string name;
    std::string args;
  };

  // The call at neutral `tool_index`, opened on first sight (a delta without a start still opens
  // one); null past kMaxToolCalls.
  Call* FindCall(int tool_index) {
    auto it = calls_.find(tool_index);
    if (it != calls_.end()) return &it->second;
    if (calls_.size() >= kMaxToolCalls) return nullptr;
    return &calls_[tool_index];
  }

  void WriteLast(std::string* out) {
    Json parts = Json::array();
    for (auto& [index, call] : calls_)
      parts.push_back({{"functionCall", {{"name", call.name}, {"args", ArgsObject(call.args)}}}});
    // Gemini's last chunk holds an empty text part when it has nothing else; clients that keep
    // chunks as history (the SDK's chats) need every chunk to have a non-empty parts list.
    if (parts.empty()) parts.push_back({{"text", ""}});
    // A turn that called functions ends with STOP in Gemini's terms (GeminiFinishReasonName maps it).
    const FinishReason finish = finish_ == FinishReason::kNone ? FinishReason::kStop : finish_;
    Chunk(std::move(parts), GeminiFinishReasonName(finish), out);
    End(out);
  }

  // One GenerateContentResponse. `finish` null for a chunk before the last.
  void Chunk(Json parts, const char* finish, std::string* out) {
    Json cand = {{"content", {{"parts", std::move(parts)}, {"role", "model"}}}};
    if (finish) cand["finishReason"] = finish;
    cand["index"] = 0;
    Json j = {{"candidates", Json::array({std::move(cand)})}};
    // Gemini reports the prompt's count on every chunk and the answer's on the last.
    const int64_t in = std::max<int64_t>(usage_.input_tokens, 0);
    if (finish) {
      const int64_t outp = std::max<int64_t>(usage_.output_tokens, 0);
      j["usageMetadata"] = {{"promptTokenCount", in}, {"candidatesTokenCount", outp}, {"totalTokenCount", in + outp}};
    } else if (usage_.input_tokens >= 0) {
      j["usageMetadata"] = {{"promptTokenCount", in}, {"totalTokenCount", in}};
    }
    j["modelVersion"] = model_;
    if (id_.empty()) id_ = RandomHex(24);
    j["responseId"] = id_;
    Frame(Dump(j), out);
  }

  // Compact JSON has no raw line breaks, so one "data:" line always holds the whole chunk. But
  // U+2028 and U+2029 are line terminators to JavaScript: @google/genai frames events with
  // /^data: (.*)(?:\n\n|\r\r|\r\n\r\n)/, whose `.` stops at them, and drops the rest of the
  // stream. They can only occur inside JSON strings, where \u2028 / \u2029 mean the same.
  void Frame(const std::string& json_text, std::string* out) {
    if (sse_) {
      out->append("data: ");
      AppendEscapingJsLineTerminators(json_text, out);
      out->append("\r\n\r\n");
      return;
    }
    out->append(frames_ == 0 ? "[" : ",\r\n").append(json_text);
    ++frames_;
  }

  void End(std::string* out) {
    if (!sse_) out->append(frames_ == 0 ? "[]" : "]");
    done_ = true;
  }

  const std::string model_;
  const bool sse_;
  std::string id_;
  bool done_ = false;
  size_t frames_ = 0;    // JSON-array mode: elements written
  size_t buffered_ = 0;  // argument bytes held in calls_
  FinishReason finish_ = FinishReason::kNone;
  Usage usage_;
  std::map<int, Call> calls_;  // neutral tool_index -> call, in index order
};

}  // namespace

std::unique_ptr<StreamEncoder> MakeGeminiStreamEncoder(const std::string& client_model, bool sse) {
  return std::make_unique<GeminiEncoder>(client_model, sse);
}

}  // namespace keel::gateway
