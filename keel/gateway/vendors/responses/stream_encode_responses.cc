// The Responses API stream encoder: StreamEvents -> OpenAI Responses SSE events (responses.h).
//
// A small state machine over output items: at most one item is open; text opens a message item
// (closing an open function call), a new tool call opens a function_call item (closing whatever
// is open), and kDone closes the last one and writes the final Response. Every item event carries
// the item's output_index and id, which is how clients (the SDKs' accumulators) address it.
#include <ctime>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "keel/gateway/vendors/responses/responses.h"
#include "keel/gateway/vendors/responses/responses_internal.h"
#include "keel/gateway/translate.h"
#include "keel/gateway/vendors/openai/openai.h"

namespace keel::gateway {

namespace {

namespace ri = responses_internal;
using ri::Json;

constexpr size_t kMaxToolCalls = 1024;  // as the other encoders: later calls are dropped

// ResponseError.code of a failed Response (a closed set in OpenAI's schema).
const char* FailedCode(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kRateLimit: return "rate_limit_exceeded";
    case ErrorKind::kInvalidRequest: return "invalid_prompt";
    default: return "server_error";
  }
}

class ResponsesEncoder final : public StreamEncoder {
 public:
  ResponsesEncoder(const ChatRequest& request, const std::string& client_model)
      : template_(ri::ResponseTemplate(request, client_model)),
        created_at_(static_cast<int64_t>(std::time(nullptr))) {}

  void Encode(const StreamEvent& ev, std::string* out) override {
    if (done_) return;
    using K = StreamEvent::Kind;
    switch (ev.kind) {
      case K::kStart:
        if (!started_ && id_.empty() && !ev.id.empty()) id_ = ri::ResponseId(ev.id);
        EnsureStarted(out);
        break;
      case K::kTextDelta:
        if (ev.text.empty()) break;
        EnsureStarted(out);
        TextDelta(ev.text, out);
        break;
      case K::kToolCallStart:
        EnsureStarted(out);
        ToolItem(ev.tool_index, ev.tool_call.id, ev.tool_call.name, out);
        if (!ev.tool_call.arguments_json.empty()) ToolArgs(ev.tool_index, ev.tool_call.arguments_json, out);
        break;
      case K::kToolCallDelta:
        if (ev.text.empty()) break;
        EnsureStarted(out);
        ToolArgs(ev.tool_index, ev.text, out);
        break;
      case K::kFinish:
        if (finish_ == FinishReason::kNone) finish_ = ev.finish;
        break;
      case K::kUsage:
        MergeUsage(ev.usage, &usage_);
        break;
      case K::kDone: {
        EnsureStarted(out);
        const char* status = ri::StatusFor(finish_);
        CloseOpen(status, out);
        Json e = Begin(std::string("response.") + status);
        e["response"] = Snapshot(status, ri::IncompleteDetails(finish_), ri::UsageJson(usage_));
        Emit(e, out);
        done_ = true;
        break;
      }
    }
  }

  // OpenAI's `error` event carries code/message/param at the top level (its schema); the same
  // object under "error" is what the SDKs raise on (openai-node and openai-python throw on a
  // data.error key). response.failed follows so clients that wait for a terminal response.* event
  // see one. The open item, if any, is left "incomplete" in the failed Response.
  void EncodeError(const GatewayError& error, std::string* out) override {
    if (done_) return;
    EnsureStarted(out);
    Json body = Json::parse(BuildOpenAIErrorBody(error), nullptr, /*allow_exceptions=*/false);
    Json err = body.is_object() && body.contains("error") ? body["error"] : Json::object();
    Json e = Begin("error");
    e["code"] = err.contains("code") ? err["code"] : Json(nullptr);
    e["message"] = error.message;
    e["param"] = nullptr;
    e["error"] = std::move(err);
    Emit(e, out);
    Json failed = Begin("response.failed");
    failed["response"] = Snapshot("failed", nullptr, ri::UsageJson(usage_));
    failed["response"]["error"] = Json{{"code", FailedCode(error.kind)}, {"message", error.message}};
    Emit(failed, out);
    done_ = true;
  }

 private:
  struct Item {
    bool is_call = false;
    std::string id;
    std::string text;  // message: the text so far; call: the arguments so far
    std::string call_id;
    std::string name;
    const char* status = "in_progress";
  };

  // An event of `type` with its sequence number; Emit must follow before the next Begin.
  Json Begin(const std::string& type) { return Json{{"type", type}, {"sequence_number", seq_++}}; }

  void Emit(const Json& e, std::string* out) {
    // Compact JSON has no raw line breaks, so one data line always holds the whole event.
    out->append("event: ").append(e["type"].get<std::string>()).append("\ndata: ");
    out->append(ri::Dump(e)).append("\n\n");
  }

  Json ItemJson(const Item& item) const {
    if (item.is_call)
      return ri::FunctionCallItem(item.id, item.status, item.call_id, item.name, item.text.empty() ? "{}" : item.text);
    return ri::MessageItem(item.id, item.status, Json::array({ri::OutputText(item.text)}));
  }

  Json Snapshot(const char* status, Json incomplete_details, Json usage) const {
    Json output = Json::array();
    for (size_t i = 0; i < items_.size(); ++i) {
      Item item = items_[i];
      if (static_cast<int>(i) == open_) item.status = "incomplete";  // only when failing
      output.push_back(ItemJson(item));
    }
    Json r = template_;
    ri::SetOutcome(&r, id_, created_at_, status, std::move(incomplete_details), std::move(output), std::move(usage));
    return r;
  }

  void EnsureStarted(std::string* out) {
    if (started_) return;
    started_ = true;
    if (id_.empty()) id_ = ri::ResponseId("");
    const Json r = Snapshot("in_progress", nullptr, nullptr);
    for (const char* type : {"response.created", "response.in_progress"}) {
      Json e = Begin(type);
      e["response"] = r;
      Emit(e, out);
    }
  }

  Json ItemEvent(const char* type, int index) {
    Json e = Begin(type);
    e["item_id"] = items_[index].id;
    e["output_index"] = index;
    return e;
  }

  int Open(Item item, std::string* out) {
    CloseOpen("completed", out);
    items_.push_back(std::move(item));
    open_ = static_cast<int>(items_.size()) - 1;
    Json added = Begin("response.output_item.added");
    added["output_index"] = open_;
    added["item"] = items_[open_].is_call
                        ? ri::FunctionCallItem(items_[open_].id, "in_progress", items_[open_].call_id, items_[open_].name, "")
                        : ri::MessageItem(items_[open_].id, "in_progress", Json::array());
    Emit(added, out);
    if (!items_[open_].is_call) {
      Json part = ItemEvent("response.content_part.added", open_);
      part["content_index"] = 0;
      part["part"] = ri::OutputText("");
      Emit(part, out);
    }
    return open_;
  }

  void CloseOpen(const char* status, std::string* out) {
    if (open_ < 0) return;
    Item& item = items_[open_];
    item.status = status;
    if (item.is_call) {
      Json done = ItemEvent("response.function_call_arguments.done", open_);
      done["name"] = item.name;
      done["arguments"] = item.text.empty() ? "{}" : item.text;
      Emit(done, out);
    } else {
      Json text = ItemEvent("response.output_text.done", open_);
      text["content_index"] = 0;
      text["text"] = item.text;
      text["logprobs"] = Json::array();
      Emit(text, out);
      Json part = ItemEvent("response.content_part.done", open_);
      part["content_index"] = 0;
      part["part"] = ri::OutputText(item.text);
      Emit(part, out);
    }
    Json done = Begin("response.output_item.done");
    done["output_index"] = open_;
    done["item"] = ItemJson(item);
    Emit(done, out);
    open_ = -1;
  }

  void TextDelta(const std::string& text, std::string* out) {
    if (open_ < 0 || items_[open_].is_call) {
      Item msg;
      msg.id = ri::NewItemId("msg_");
      Open(std::move(msg), out);
    }
    items_[open_].text += text;
    Json e = ItemEvent("response.output_text.delta", open_);
    e["content_index"] = 0;
    e["delta"] = text;
    e["logprobs"] = Json::array();
    Emit(e, out);
  }

  // The output index of a tool call, opening its item on first sight; -1 past the bound.
  int ToolItem(int tool_index, const std::string& call_id, const std::string& name, std::string* out) {
    auto it = tool_items_.find(tool_index);
    if (it != tool_items_.end()) return it->second;
    if (tool_items_.size() >= kMaxToolCalls) return -1;
    Item call;
    call.is_call = true;
    call.id = ri::NewItemId("fc_");
    call.call_id = call_id.empty() ? ri::NewItemId("call_") : call_id;
    call.name = name;
    const int index = Open(std::move(call), out);
    tool_items_.emplace(tool_index, index);
    return index;
  }

  // A piece for a call whose item already closed (an upstream that interleaves calls) is still
  // sent with that item's index and kept for the final Response, which is the complete record.
  void ToolArgs(int tool_index, const std::string& piece, std::string* out) {
    const int index = ToolItem(tool_index, "", "", out);  // a delta without a start still opens one
    if (index < 0) return;
    items_[index].text += piece;
    Json e = ItemEvent("response.function_call_arguments.delta", index);
    e["delta"] = piece;
    Emit(e, out);
  }

  const Json template_;  // the Response with the request's echoed settings
  const int64_t created_at_;
  std::string id_;
  int64_t seq_ = 0;
  bool started_ = false;
  bool done_ = false;
  std::vector<Item> items_;
  int open_ = -1;  // index into items_ of the open item, -1 none
  std::map<int, int> tool_items_;  // neutral tool_index -> output index
  FinishReason finish_ = FinishReason::kNone;
  Usage usage_;
};

}  // namespace

std::unique_ptr<StreamEncoder> MakeResponsesStreamEncoder(const ChatRequest& request,
                                                          const std::string& client_model) {
  return std::make_unique<ResponsesEncoder>(request, client_model);
}

}  // namespace keel::gateway
