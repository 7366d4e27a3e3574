// Client stream encoders: StreamEvents -> OpenAI chat.completion.chunk / text_completion SSE,
// or Anthropic Messages SSE events.
//
// Both encoders are small state machines that repair the order they are given: the opening
// chunk/event is written lazily before the first content, a missing finish becomes "stop" (or
// "tool_calls" after tool calls), and usage is written at kDone so a count arriving after the
// finish reason is still reported.
#include <algorithm>
#include <ctime>
#include <map>
#include <random>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "keel/gateway/stream.h"

#include "keel/gateway/gemini_front.h"
#include "keel/gateway/vendors/responses/responses.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {

namespace {

using Json = nlohmann::ordered_json;  // ordered: fields appear as the vendors document them

constexpr size_t kMaxToolCalls = 1024;

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// One SSE event. Data is split at line breaks so a payload can never end the event early.
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

// The upstream id under the client's prefix, or a fresh one.
std::string ClientId(const std::string& prefix, const std::string& upstream_id) {
  if (upstream_id.empty()) return prefix + RandomHex(24);
  if (upstream_id.rfind(prefix, 0) == 0) return upstream_id;
  return prefix + upstream_id;
}

FinishReason EffectiveFinish(FinishReason given, bool saw_tools) {
  if (given != FinishReason::kNone) return given;
  return saw_tools ? FinishReason::kToolCalls : FinishReason::kStop;
}

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
    AppendSse(out, "", BuildErrorBody(chat_ ? WireFormat::kOpenAIChat : WireFormat::kOpenAICompletions, error));
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
    const char* name = FinishReasonName(WireFormat::kOpenAIChat, EffectiveFinish(reason, saw_tools_));
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

// ---- Anthropic Messages events

class AnthropicEncoder final : public StreamEncoder {
 public:
  explicit AnthropicEncoder(std::string model) : model_(std::move(model)) {}

  void Encode(const StreamEvent& ev, std::string* out) override {
    if (done_) return;
    using K = StreamEvent::Kind;
    switch (ev.kind) {
      case K::kStart:
        if (id_.empty()) id_ = ClientId("msg_", ev.id);
        break;  // message_start waits for the first content: input usage usually follows kStart
      case K::kTextDelta:
        if (ev.text.empty()) break;
        EnsureHeader(out);
        if (open_block_ < 0 || !open_is_text_) {
          CloseBlock(out);
          OpenBlock(Json{{"type", "text"}, {"text", ""}}, /*text=*/true, out);
        }
        Delta(open_block_, Json{{"type", "text_delta"}, {"text", ev.text}}, out);
        break;
      case K::kToolCallStart:
        EnsureHeader(out);
        ToolBlock(ev.tool_index, ev.tool_call.id, ev.tool_call.name, out);
        break;
      case K::kToolCallDelta: {
        if (ev.text.empty()) break;
        EnsureHeader(out);
        const int block = ToolBlock(ev.tool_index, "", "", out);
        // A call whose block already closed (upstream interleaved calls) keeps its own index.
        if (block >= 0) Delta(block, Json{{"type", "input_json_delta"}, {"partial_json", ev.text}}, out);
        break;
      }
      case K::kFinish:
        if (finish_ == FinishReason::kNone) {
          finish_ = ev.finish;
          stop_sequence_ = ev.stop_sequence;
        }
        break;
      case K::kUsage:
        MergeUsage(ev.usage, &usage_);
        break;
      case K::kDone:
        EnsureHeader(out);
        CloseBlock(out);
        WriteEnd(out);
        done_ = true;
        break;
    }
  }

  void EncodeError(const GatewayError& error, std::string* out) override {
    if (done_) return;
    AppendSse(out, "error", BuildErrorBody(WireFormat::kAnthropicMessages, error));
    done_ = true;
  }

 private:
  void Event(const char* type, Json j, std::string* out) { AppendSse(out, type, Dump(j)); }

  void EnsureHeader(std::string* out) {
    if (header_sent_) return;
    header_sent_ = true;
    if (id_.empty()) id_ = ClientId("msg_", "");
    // Input tokens as known now (0 if the upstream reports them only at the end; message_delta
    // then carries them). output_tokens 0: clients that add start and delta counts stay exact.
    Json msg = {{"id", id_},
                {"type", "message"},
                {"role", "assistant"},
                {"model", model_},
                {"content", Json::array()},
                {"stop_reason", nullptr},
                {"stop_sequence", nullptr},
                {"usage", {{"input_tokens", std::max<int64_t>(usage_.input_tokens, 0)}, {"output_tokens", 0}}}};
    Event("message_start", Json{{"type", "message_start"}, {"message", std::move(msg)}}, out);
    Event("ping", Json{{"type", "ping"}}, out);
  }

  void OpenBlock(Json block, bool text, std::string* out) {
    open_block_ = next_block_++;
    open_is_text_ = text;
    Event("content_block_start",
          Json{{"type", "content_block_start"}, {"index", open_block_}, {"content_block", std::move(block)}}, out);
  }

  void CloseBlock(std::string* out) {
    if (open_block_ < 0) return;
    Event("content_block_stop", Json{{"type", "content_block_stop"}, {"index", open_block_}}, out);
    open_block_ = -1;
    open_is_text_ = false;
  }

  void Delta(int block, Json delta, std::string* out) {
    Event("content_block_delta",
          Json{{"type", "content_block_delta"}, {"index", block}, {"delta", std::move(delta)}}, out);
  }

  // The block index of a tool call, opening its tool_use block on first sight; -1 past the bound.
  int ToolBlock(int tool_index, std::string id, const std::string& name, std::string* out) {
    auto it = tool_blocks_.find(tool_index);
    if (it != tool_blocks_.end()) return it->second;
    if (tool_blocks_.size() >= kMaxToolCalls) return -1;
    CloseBlock(out);  // a text block (or the previous call) ends before a tool_use block opens
    if (id.empty()) id = "toolu_" + RandomHex(24);
    OpenBlock(Json{{"type", "tool_use"}, {"id", std::move(id)}, {"name", name}, {"input", Json::object()}},
              /*text=*/false, out);
    tool_blocks_.emplace(tool_index, open_block_);
    return open_block_;
  }

  // message_delta is deferred to kDone so usage that arrives after the finish is included.
  void WriteEnd(std::string* out) {
    const FinishReason reason = EffectiveFinish(finish_, !tool_blocks_.empty());
    // "stop_sequence" only when the upstream named the sequence that matched.
    const bool by_sequence = reason == FinishReason::kStop && !stop_sequence_.empty();
    Json usage = Json::object();
    if (usage_.input_tokens >= 0) usage["input_tokens"] = usage_.input_tokens;
    usage["output_tokens"] = std::max<int64_t>(usage_.output_tokens, 0);
    Event("message_delta",
          Json{{"type", "message_delta"},
               {"delta", {{"stop_reason", by_sequence ? "stop_sequence"
                                                      : FinishReasonName(WireFormat::kAnthropicMessages, reason)},
                          {"stop_sequence", by_sequence ? Json(stop_sequence_) : Json(nullptr)}}},
               {"usage", std::move(usage)}},
          out);
    Event("message_stop", Json{{"type", "message_stop"}}, out);
  }

  const std::string model_;
  std::string id_;
  bool header_sent_ = false;
  bool done_ = false;
  int open_block_ = -1;  // index of the open content block, -1 none
  bool open_is_text_ = false;
  int next_block_ = 0;
  FinishReason finish_ = FinishReason::kNone;
  std::string stop_sequence_;  // from kFinish: the stop sequence that matched, when known
  Usage usage_;
  std::map<int, int> tool_blocks_;  // neutral tool_index -> content block index
};

}  // namespace

std::unique_ptr<StreamEncoder> MakeStreamEncoder(WireFormat client, const std::string& client_model,
                                                 bool include_usage) {
  switch (client) {
    case WireFormat::kAnthropicMessages: return std::make_unique<AnthropicEncoder>(client_model);
    case WireFormat::kOpenAICompletions:
      return std::make_unique<OpenAIEncoder>(/*chat=*/false, client_model, include_usage);
    case WireFormat::kGemini: return MakeGeminiStreamEncoder(client_model, /*sse=*/true);
    case WireFormat::kOpenAIResponses: {
      ChatRequest request;  // the Responses object echoes request settings: fronts pass the real one
      request.model = client_model;
      return MakeResponsesStreamEncoder(request, client_model);
    }
    case WireFormat::kOpenAIChat: break;
  }
  return std::make_unique<OpenAIEncoder>(/*chat=*/true, client_model, include_usage);
}

}  // namespace keel::gateway
