// The Gemini upstream stream decoder: streamGenerateContent?alt=sse GenerateContentResponse
// chunks -> StreamEvents. Function calls arrive whole; they are capped at kMaxToolCalls.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "keel/gateway/stream_internal.h"
#include "keel/gateway/vendors/gemini/gemini.h"

namespace keel::gateway {

namespace {

using namespace stream_internal;  // NOLINT: the shared decoder pieces are this file's vocabulary

// ---- Gemini GenerateContentResponse chunks

class GeminiDecoder final : public SseDecoder {
 public:
  explicit GeminiDecoder(size_t max_event_bytes) : SseDecoder("gemini", max_event_bytes) {}

 protected:
  const char* EndMarker() const override { return "a chunk with finishReason"; }

  Status Handle(const SseParser::Event& ev, std::vector<StreamEvent>* out) override {
    Json j;
    KEEL_RETURN_IF_ERROR(ParseObject(ev, &j));
    if (const Json* err = Field(j, "error")) {
      ErrorKind kind = ErrorKind::kApi;
      if (int64_t code = Int(*err, "code"); code >= 400) kind = ErrorKindForStatus(static_cast<int>(code));
      return RaiseError(kind, Str(*err, "message"));
    }
    EmitStart(Str(j, "responseId"), Str(j, "modelVersion"), out);
    // Usage first: an encoder that must state input tokens up front (Anthropic) then knows them.
    if (const Json* u = Field(j, "usageMetadata"); u && u->is_object()) {
      int64_t output = Int(*u, "candidatesTokenCount");
      // Thinking tokens are billed as output; the neutral count is what the call cost.
      if (int64_t thoughts = Int(*u, "thoughtsTokenCount"); thoughts > 0) output = std::max<int64_t>(output, 0) + thoughts;
      out->push_back(UsageEv(Int(*u, "promptTokenCount"), output));
    }
    const Json* cands = Field(j, "candidates");
    if (cands && cands->is_array() && !cands->empty()) {
      const Json& c = (*cands)[0];
      if (const Json* content = Field(c, "content")) {
        if (const Json* parts = Field(*content, "parts"); parts && parts->is_array()) {
          for (const Json& p : *parts) KEEL_RETURN_IF_ERROR(Part(p, out));
        }
      }
      const std::string finish = Str(c, "finishReason");
      if (!finish.empty() && finish != "FINISH_REASON_UNSPECIFIED") {
        FinishReason r = ParseGeminiFinishReason(finish);
        if (r == FinishReason::kStop && tool_count_ > 0) r = FinishReason::kToolCalls;
        EmitFinish(r, out);
        ended_ = true;  // more chunks (usage) may follow; the body end is the real end
      }
    } else if (const Json* fb = Field(j, "promptFeedback"); fb && !Str(*fb, "blockReason").empty()) {
      EmitFinish(FinishReason::kContentFilter, out);  // the prompt itself was blocked
      ended_ = true;
    }
    return Status::Ok();
  }

 private:
  Status Part(const Json& p, std::vector<StreamEvent>* out) {
    if (const Json* thought = Field(p, "thought"); thought && thought->is_boolean() && thought->get<bool>()) {
      return Status::Ok();  // thought summaries are not the answer
    }
    if (std::string text = Str(p, "text"); !text.empty()) out->push_back(TextEv(std::move(text)));
    if (const Json* fc = Field(p, "functionCall")) {
      if (tool_count_ >= static_cast<int>(kMaxToolCalls)) return Status::Corruption("gemini stream: too many function calls");
      const int ordinal = tool_count_++;
      StreamEvent start = Ev(StreamEvent::Kind::kToolCallStart);
      start.tool_index = ordinal;
      start.tool_call.id = Str(*fc, "id");
      if (start.tool_call.id.empty()) start.tool_call.id = "call_" + std::to_string(ordinal);
      start.tool_call.name = Str(*fc, "name");
      out->push_back(std::move(start));
      StreamEvent args = Ev(StreamEvent::Kind::kToolCallDelta);
      args.tool_index = ordinal;
      const Json* a = Field(*fc, "args");
      args.text = a && a->is_object() ? Dump(*a) : "{}";
      out->push_back(std::move(args));
    }
    return Status::Ok();
  }

  int tool_count_ = 0;
};

}  // namespace

std::unique_ptr<StreamDecoder> MakeGeminiStreamDecoder(size_t max_event_bytes) {
  return std::make_unique<GeminiDecoder>(max_event_bytes);
}

}  // namespace keel::gateway
