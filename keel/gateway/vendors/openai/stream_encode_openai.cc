// The OpenAI client stream encoder: StreamEvents -> chat.completion.chunk or text_completion SSE.
//
// A small state machine that repairs the order it is given: the opening chunk is written lazily
// before the first content, a missing finish becomes "stop" (or "tool_calls" after tool calls),
// and usage is written at kDone so a count arriving after the finish reason is still reported.
#include <algorithm>
#include <ctime>
#include <map>
#include <string>
#include <utility>

#include "keel/gateway/stream_internal.h"
#include "keel/gateway/vendors/openai/openai.h"

namespace keel::gateway {

namespace {

using namespace stream_internal;  // NOLINT: the shared encoder pieces are this file's vocabulary

// ---- OpenAI chat.completion.chunk / text_completion

class OpenAIEncoder final : public StreamEncoder {
 public:
  OpenAIEncoder(bool chat, std::string model, bool include_usage)
      : chat_(chat), model_(std::move(model)), include_usage_(include_usage),
        created_(static_cast<int64_t>(std::time(nullptr))) {}

  void Encode(const StreamEvent& ev, std::string* out) override {
    if (done_) return;
    using K = StreamEvent::Kind;
    switch (ev.kind) {
      case K::kStart:
        if (id_.empty()) id_ = ClientId(Prefix(), ev.id);
        EnsureHeader(out);
        break;
      case K::kTextDelta:
        if (ev.text.empty()) break;
        EnsureHeader(out);
        TextChunk(ev.text, out);
        break;
      case K::kToolCallStart:
        if (chat_) StartTool(ev.tool_index, ev.tool_call.id, ev.tool_call.name, out);
        break;
      case K::kToolCallDelta:
        if (chat_ && !ev.text.empty()) ToolArgs(ev.tool_index, ev.text, out);
        break;
      case K::kFinish:
        WriteFinish(ev.finish, out);
        break;
      case K::kUsage:
        MergeUsage(ev.usage, &usage_);
        break;
      case K::kDone:
        WriteFinish(FinishReason::kNone, out);
        if (include_usage_) WriteUsage(out);
        out->append("data: [DONE]\n\n");
        done_ = true;
        break;
    }
  }

  // OpenAI reports a mid-stream failure as a data-only {"error":{...}} event; the SDKs raise on
  // it. [DONE] follows (as vLLM does) so line-oriented clients still see the stream close.
  void EncodeError(const GatewayError& error, std::string* out) override {
    if (done_) return;
    AppendSse(out, "", BuildOpenAIErrorBody(error));
    out->append("data: [DONE]\n\n");
    done_ = true;
  }

 private:
  const char* Prefix() const { return chat_ ? "chatcmpl-" : "cmpl-"; }

  // The first chat chunk announces the role, as OpenAI's does.
  void EnsureHeader(std::string* out) {
    if (id_.empty()) id_ = ClientId(Prefix(), "");
    if (header_sent_) return;
    header_sent_ = true;
    if (chat_) RawChunk(R"({"role":"assistant","content":""})", nullptr, out);
  }

  // Chunks are written directly (the bytes nlohmann's dump of the same ordered object would
  // give): the envelope up to the choice's delta is the same for every chunk of the stream.
  void TextChunk(const std::string& text, std::string* out) {
    scratch_.clear();
    if (chat_) scratch_.append(R"({"content":)");
    AppendJsonString(text, &scratch_);
    if (chat_) scratch_.push_back('}');
    RawChunk(scratch_, nullptr, out);
  }

  // `delta`: the chat delta object or the completions text, as JSON text; `finish` null while
  // streaming. The JSON holds no raw line break (dump escapes them), so it is one data line.
  void RawChunk(std::string_view delta, const char* finish, std::string* out) {
    if (prefix_.empty()) {
      prefix_.append(R"(data: {"id":)");
      AppendJsonString(id_, &prefix_);
      prefix_.append(chat_ ? R"(,"object":"chat.completion.chunk","created":)" : R"(,"object":"text_completion","created":)");
      prefix_.append(std::to_string(created_)).append(R"(,"model":)");
      AppendJsonString(model_, &prefix_);
      prefix_.append(chat_ ? R"(,"choices":[{"index":0,"delta":)" : R"(,"choices":[{"index":0,"text":)");
    }
    out->append(prefix_).append(delta).append(R"(,"logprobs":null,"finish_reason":)");
    if (finish) {
      AppendJsonString(finish, out);
    } else {
      out->append("null");
    }
    out->append(include_usage_ ? R"(}],"usage":null})" "\n\n" : "}]}\n\n");
  }

  void Chunk(const Json& delta, const char* finish, std::string* out) { RawChunk(Dump(delta), finish, out); }

  Json Envelope() const {
    return Json{{"id", id_},
                {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
                {"created", created_},
                {"model", model_}};
  }

  int ToolSlot(int tool_index, std::string id, const std::string& name, std::string* out) {
    auto it = tools_.find(tool_index);
    if (it != tools_.end()) return it->second;
    if (tools_.size() >= kMaxToolCalls) return -1;
    EnsureHeader(out);
    const int slot = static_cast<int>(tools_.size());
    tools_.emplace(tool_index, slot);
    saw_tools_ = true;
    if (id.empty()) id = "call_" + RandomHex(24);
    Json call = {{"index", slot},
                 {"id", std::move(id)},
                 {"type", "function"},
                 {"function", {{"name", name}, {"arguments", ""}}}};
    Chunk(Json{{"tool_calls", Json::array({std::move(call)})}}, nullptr, out);
    return slot;
  }

  void StartTool(int tool_index, const std::string& id, const std::string& name, std::string* out) {
    ToolSlot(tool_index, id, name, out);
  }

  void ToolArgs(int tool_index, const std::string& piece, std::string* out) {
    const int slot = ToolSlot(tool_index, "", "", out);  // a delta without a start still opens one
    if (slot < 0) return;
    Json call = {{"index", slot}, {"function", {{"arguments", piece}}}};
    Chunk(Json{{"tool_calls", Json::array({std::move(call)})}}, nullptr, out);
  }

  void WriteFinish(FinishReason reason, std::string* out) {
    if (finish_sent_) return;
    EnsureHeader(out);
    finish_sent_ = true;
    const char* name = OpenAIFinishReasonName(EffectiveFinish(reason, saw_tools_));
    RawChunk(chat_ ? "{}" : R"("")", name, out);
  }

  // Unknown counts are written as 0: a client that asked for usage expects the object.
  void WriteUsage(std::string* out) {
    const int64_t in = std::max<int64_t>(usage_.input_tokens, 0);
    const int64_t outp = std::max<int64_t>(usage_.output_tokens, 0);
    Json j = Envelope();
    j["choices"] = Json::array();
    j["usage"] = {{"prompt_tokens", in}, {"completion_tokens", outp}, {"total_tokens", in + outp}};
    AppendSse(out, "", Dump(j));
  }

  const bool chat_;
  const std::string model_;
  const bool include_usage_;
  const int64_t created_;
  std::string id_;     // fixed once a chunk was written
  std::string prefix_;  // "data: " and each chunk's JSON up to the delta; built at the first chunk
  std::string scratch_;
  bool header_sent_ = false;
  bool finish_sent_ = false;
  bool done_ = false;
  bool saw_tools_ = false;
  Usage usage_;
  std::map<int, int> tools_;  // neutral tool_index -> OpenAI choice tool index
};

}  // namespace

std::unique_ptr<StreamEncoder> MakeOpenAIStreamEncoder(bool chat, const std::string& client_model,
                                                       bool include_usage) {
  return std::make_unique<OpenAIEncoder>(chat, client_model, include_usage);
}

}  // namespace keel::gateway
