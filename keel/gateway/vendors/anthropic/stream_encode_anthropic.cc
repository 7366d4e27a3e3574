// The Anthropic client stream encoder: StreamEvents -> Messages SSE events.
//
// A small state machine that repairs the order it is given: message_start is written lazily
// before the first content, a missing finish becomes end_turn (or tool_use after tool calls), and
// usage is written at kDone so a count arriving after the stop reason is still reported.
#include <algorithm>
#include <ctime>
#include <map>
#include <string>
#include <utility>

#include "keel/gateway/stream_internal.h"
#include "keel/gateway/vendors/anthropic/anthropic.h"

namespace keel::gateway {

namespace {

using namespace stream_internal;  // NOLINT: the shared encoder pieces are this file's vocabulary

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
    AppendSse(out, "error", BuildAnthropicErrorBody(error));
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
                {"usage", {{"input_tokens", std::max<int64_t>(usage_.input_tokens, 0)},
                           {"output_tokens", 0},
                           {"cache_creation_input_tokens", nullptr},
                           {"cache_read_input_tokens", nullptr},
                           {"service_tier", nullptr}}}};
    Event("message_start", Json{{"type", "message_start"}, {"message", std::move(msg)}}, out);
  }

  // Anthropic's own order: message_start, the first content_block_start, then ping.
  void OpenBlock(Json block, bool text, std::string* out) {
    open_block_ = next_block_++;
    open_is_text_ = text;
    Event("content_block_start",
          Json{{"type", "content_block_start"}, {"index", open_block_}, {"content_block", std::move(block)}}, out);
    if (!ping_sent_) {
      ping_sent_ = true;
      Event("ping", Json{{"type", "ping"}}, out);
    }
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
                                                      : AnthropicFinishReasonName(reason)},
                          {"stop_sequence", by_sequence ? Json(stop_sequence_) : Json(nullptr)}}},
               {"usage", std::move(usage)}},
          out);
    Event("message_stop", Json{{"type", "message_stop"}}, out);
  }

  const std::string model_;
  std::string id_;
  bool header_sent_ = false;
  bool ping_sent_ = false;
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

std::unique_ptr<StreamEncoder> MakeAnthropicStreamEncoder(const std::string& client_model) {
  return std::make_unique<AnthropicEncoder>(client_model);
}

}  // namespace keel::gateway
