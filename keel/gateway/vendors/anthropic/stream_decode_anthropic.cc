// The Anthropic upstream stream decoder: Messages SSE events (message_start, content_block_*,
// message_delta, message_stop, error) -> StreamEvents. Open blocks are capped at kMaxBlocks.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "keel/gateway/stream_internal.h"
#include "keel/gateway/vendors/anthropic/anthropic.h"

namespace keel::gateway {

namespace {

using namespace stream_internal;  // NOLINT: the shared decoder pieces are this file's vocabulary

constexpr size_t kMaxBlocks = 4096;

// Anthropic error.type -> kind. OpenAI/Gemini in-stream errors carry a numeric code or a type.
ErrorKind KindForAnthropicType(std::string_view type) {
  if (type == "invalid_request_error") return ErrorKind::kInvalidRequest;
  if (type == "authentication_error") return ErrorKind::kAuthentication;
  if (type == "permission_error" || type == "billing_error") return ErrorKind::kPermission;
  if (type == "not_found_error") return ErrorKind::kNotFound;
  if (type == "request_too_large") return ErrorKind::kRequestTooLarge;
  if (type == "rate_limit_error") return ErrorKind::kRateLimit;
  if (type == "overloaded_error") return ErrorKind::kOverloaded;
  if (type == "timeout_error") return ErrorKind::kTimeout;
  return ErrorKind::kApi;
}
// ---- Anthropic Messages events

class AnthropicDecoder final : public SseDecoder {
 public:
  explicit AnthropicDecoder(size_t max_event_bytes) : SseDecoder("anthropic", max_event_bytes) {}

 protected:
  const char* EndMarker() const override { return "message_stop"; }

  Status Handle(const SseParser::Event& ev, std::vector<StreamEvent>* out) override {
    Json j;
    KEEL_RETURN_IF_ERROR(ParseObject(ev, &j));
    std::string type = ev.event.empty() ? Str(j, "type") : ev.event;
    if (type == "message_start") return MessageStart(j, out);
    if (type == "content_block_start") return BlockStart(j, out);
    if (type == "content_block_delta") return BlockDelta(j, out);
    if (type == "content_block_stop") return BlockStop(j, out);
    if (type == "message_delta") return MessageDelta(j, out);
    if (type == "message_stop") {
      ended_ = closed_ = true;
      return Status::Ok();
    }
    if (type == "error") {
      const Json* err = Field(j, "error");
      const Json& e = err ? *err : j;
      return RaiseError(KindForAnthropicType(Str(e, "type")), Str(e, "message"));
    }
    return Status::Ok();  // ping and event types added later
  }

 private:
  struct Block {
    bool text = false;
    int tool = -1;  // tool ordinal for tool_use blocks
    bool has_args = false;
  };

  // Anthropic's input_tokens excludes cached prompt tokens; the neutral count is the whole prompt.
  static int64_t InputTokens(const Json& usage) {
    int64_t input = Int(usage, "input_tokens");
    if (input < 0) return -1;
    return input + std::max<int64_t>(0, Int(usage, "cache_creation_input_tokens", 0)) +
           std::max<int64_t>(0, Int(usage, "cache_read_input_tokens", 0));
  }

  Status MessageStart(const Json& j, std::vector<StreamEvent>* out) {
    const Json* msg = Field(j, "message");
    if (!msg || !msg->is_object()) return Status::Corruption("anthropic stream: message_start without message");
    EmitStart(Str(*msg, "id"), Str(*msg, "model"), out);
    if (const Json* u = Field(*msg, "usage"); u && u->is_object()) {
      // output_tokens here is a placeholder (usually 1); message_delta carries the real count.
      if (int64_t input = InputTokens(*u); input >= 0) out->push_back(UsageEv(input, -1));
    }
    return Status::Ok();
  }

  Status BlockStart(const Json& j, std::vector<StreamEvent>* out) {
    const int64_t index = Int(j, "index");
    const Json* cb = Field(j, "content_block");
    if (index < 0 || !cb) return Status::Corruption("anthropic stream: content_block_start without index/block");
    if (blocks_.size() >= kMaxBlocks && !blocks_.count(index)) {
      return Status::Corruption("anthropic stream: too many content blocks");
    }
    Block& b = blocks_[index];
    b = Block();
    const std::string type = Str(*cb, "type");
    if (type == "text") {
      b.text = true;
      if (std::string text = Str(*cb, "text"); !text.empty()) out->push_back(TextEv(std::move(text)));
    } else if (type == "tool_use") {
      b.tool = tool_count_++;
      StreamEvent e = Ev(StreamEvent::Kind::kToolCallStart);
      e.tool_index = b.tool;
      e.tool_call.id = Str(*cb, "id");
      e.tool_call.name = Str(*cb, "name");
      out->push_back(std::move(e));
      // Usually {} with the input streamed as input_json_delta; a non-empty input is complete.
      if (const Json* input = Field(*cb, "input"); input && input->is_object() && !input->empty()) {
        out->push_back(ArgsEv(b.tool, Dump(*input)));
        b.has_args = true;
      }
    }
    // thinking, redacted_thinking, server tool blocks: not part of the neutral answer.
    return Status::Ok();
  }

  Status BlockDelta(const Json& j, std::vector<StreamEvent>* out) {
    const Json* delta = Field(j, "delta");
    if (!delta) return Status::Corruption("anthropic stream: content_block_delta without delta");
    auto it = blocks_.find(Int(j, "index"));
    const std::string type = Str(*delta, "type");
    if (type == "text_delta") {
      if (it == blocks_.end() || !it->second.text) {
        return Status::Corruption("anthropic stream: text_delta for a block that is not text");
      }
      if (std::string text = Str(*delta, "text"); !text.empty()) out->push_back(TextEv(std::move(text)));
    } else if (type == "input_json_delta") {
      if (it == blocks_.end()) return Status::Corruption("anthropic stream: input_json_delta for an unknown block");
      if (it->second.tool < 0) return Status::Ok();  // a server tool's input
      if (std::string piece = Str(*delta, "partial_json"); !piece.empty()) {
        it->second.has_args = true;
        out->push_back(ArgsEv(it->second.tool, std::move(piece)));
      }
    }
    return Status::Ok();  // thinking_delta, signature_delta, citations_delta
  }

  Status BlockStop(const Json& j, std::vector<StreamEvent>* out) {
    auto it = blocks_.find(Int(j, "index"));
    if (it == blocks_.end()) return Status::Ok();
    // A tool called with no input streams no JSON at all; clients expect an object.
    if (it->second.tool >= 0 && !it->second.has_args) out->push_back(ArgsEv(it->second.tool, "{}"));
    blocks_.erase(it);
    return Status::Ok();
  }

  Status MessageDelta(const Json& j, std::vector<StreamEvent>* out) {
    if (const Json* delta = Field(j, "delta")) {
      const std::string stop = Str(*delta, "stop_reason");
      if (!stop.empty()) {
        EmitFinish(ParseAnthropicFinishReason(stop), out,
                   stop == "stop_sequence" ? Str(*delta, "stop_sequence") : std::string());
      }
    }
    if (const Json* u = Field(j, "usage"); u && u->is_object()) {
      const int64_t input = InputTokens(*u);
      const int64_t output = Int(*u, "output_tokens");
      if (input >= 0 || output >= 0) out->push_back(UsageEv(input, output));
    }
    return Status::Ok();
  }

  static StreamEvent ArgsEv(int ordinal, std::string args) {
    StreamEvent e = Ev(StreamEvent::Kind::kToolCallDelta);
    e.tool_index = ordinal;
    e.text = std::move(args);
    return e;
  }

  std::map<int64_t, Block> blocks_;  // open blocks only (Anthropic closes each before the next)
  int tool_count_ = 0;
};

}  // namespace

std::unique_ptr<StreamDecoder> MakeAnthropicStreamDecoder(size_t max_event_bytes) {
  return std::make_unique<AnthropicDecoder>(max_event_bytes);
}

}  // namespace keel::gateway
