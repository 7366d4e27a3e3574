// The OpenAI Responses API front: POST /v1/responses bodies in, Responses objects out (see
// responses.h), plus the object pieces the stream encoder shares (responses_internal.h).
#include <algorithm>

#include "keel/gateway/vendors/responses/responses.h"
#include "keel/gateway/vendors/responses/responses_internal.h"
#include "keel/gateway/translate_internal.h"

namespace keel::gateway {

using namespace internal;  // NOLINT: the validating readers are this file's vocabulary

namespace {

// A type name from the client, short enough to quote in an error message.
std::string Quote(const std::string& s) { return s.size() <= 64 ? s : s.substr(0, 64) + "..."; }

bool Present(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && !it->is_null();
}

// A field that needs server-side state the gateway does not keep: present and not null is refused.
Status RefuseIfPresent(const json& body, const char* key, const std::string& why) {
  if (Present(body, key)) return Status::InvalidArgument(std::string(key) + ": not supported (" + why + ")");
  return Status::Ok();
}

// Text content: a string, or an array of input_text / output_text / refusal parts, concatenated.
// Non-text parts are refused by name (the gateway is text-only). Absent or null: `required`
// decides.
Status ReadTextParts(const json& obj, const char* key, const std::string& path, bool required,
                     std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    return required ? Status::InvalidArgument(path + ": required") : Status::Ok();
  }
  return ReadStringOrParts(*it, path, out, [&](const json& part, const std::string& part_path) -> Status {
    std::string type;
    KEEL_RETURN_IF_ERROR(ReadRequiredString(part, "type", part_path + ".type", &type));
    const char* text_key = type == "refusal" ? "refusal" : "text";
    if (type == "input_image" || type == "input_file" || type == "input_audio")
      return Status::InvalidArgument(part_path + ".type: " + type + " is not supported (the gateway is text-only)");
    if (type != "input_text" && type != "output_text" && type != "refusal")
      return Status::InvalidArgument(part_path + ".type: expected input_text or output_text, got " + Quote(type));
    if (!Present(part, text_key)) return Status::InvalidArgument(part_path + "." + text_key + ": required");
    std::string text;
    KEEL_RETURN_IF_ERROR(ReadString(part, text_key, part_path + "." + text_key, &text));
    *out += text;
    return Status::Ok();
  });
}

Status ReadMessageItem(const json& item, const std::string& path, ChatRequest* req,
                       std::vector<std::string>* system) {
  Message msg;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(item, "role", path + ".role", &msg.role));
  KEEL_RETURN_IF_ERROR(ReadTextParts(item, "content", path + ".content", /*required=*/true, &msg.content));
  if (msg.role == "system" || msg.role == "developer") {
    system->push_back(std::move(msg.content));
    return Status::Ok();
  }
  if (msg.role != "user" && msg.role != "assistant")
    return Status::InvalidArgument(path + ".role: expected user, assistant, system or developer");
  req->messages.push_back(std::move(msg));
  return Status::Ok();
}

// A call joins the assistant turn just before it (its text, or earlier calls of the same turn):
// chat formats carry one assistant turn with text and calls, and Anthropic needs turns to alternate.
Status ReadFunctionCallItem(const json& item, const std::string& path, ChatRequest* req) {
  ToolCall call;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(item, "call_id", path + ".call_id", &call.id));
  KEEL_RETURN_IF_ERROR(ReadRequiredString(item, "name", path + ".name", &call.name));
  KEEL_RETURN_IF_ERROR(ReadArgumentsText(item, path + ".arguments", &call.arguments_json));
  if (req->messages.empty() || req->messages.back().role != "assistant") {
    Message turn;
    turn.role = "assistant";
    req->messages.push_back(std::move(turn));
  }
  std::vector<ToolCall>& calls = req->messages.back().tool_calls;
  if (calls.size() >= kMaxToolCalls)
    return Status::InvalidArgument(path + ": at most " + std::to_string(kMaxToolCalls) +
                                   " function calls in one assistant turn");
  calls.push_back(std::move(call));
  return Status::Ok();
}

Status ReadFunctionCallOutputItem(const json& item, const std::string& path, ChatRequest* req) {
  Message msg;
  msg.role = "tool";
  KEEL_RETURN_IF_ERROR(ReadRequiredString(item, "call_id", path + ".call_id", &msg.tool_call_id));
  KEEL_RETURN_IF_ERROR(ReadTextParts(item, "output", path + ".output", /*required=*/true, &msg.content));
  req->messages.push_back(std::move(msg));
  return Status::Ok();
}

Status ReadInput(const json& body, ChatRequest* req, std::vector<std::string>* system) {
  auto it = body.find("input");
  if (it == body.end() || it->is_null()) return Status::InvalidArgument("input: required");
  if (it->is_string()) {
    Message msg;
    msg.role = "user";
    msg.content = it->get<std::string>();
    req->messages.push_back(std::move(msg));
    return Status::Ok();
  }
  if (!it->is_array()) return Status::InvalidArgument("input: expected a string or an array of items");
  if (it->empty()) return Status::InvalidArgument("input: must not be empty");
  if (it->size() > kMaxMessages)
    return Status::InvalidArgument("input: at most " + std::to_string(kMaxMessages) + " items");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& item = (*it)[i];
    const std::string path = At("input", i);
    if (!item.is_object()) return Status::InvalidArgument(path + ": expected an object");
    std::string type;
    KEEL_RETURN_IF_ERROR(ReadString(item, "type", path + ".type", &type));
    if (type.empty() && !Present(item, "role")) return Status::InvalidArgument(path + ".type: required");
    if (type.empty() || type == "message") {
      KEEL_RETURN_IF_ERROR(ReadMessageItem(item, path, req, system));
    } else if (type == "function_call") {
      KEEL_RETURN_IF_ERROR(ReadFunctionCallItem(item, path, req));
    } else if (type == "function_call_output") {
      KEEL_RETURN_IF_ERROR(ReadFunctionCallOutputItem(item, path, req));
    } else if (type == "item_reference") {
      return Status::InvalidArgument(path + ".type: item_reference is not supported (the gateway is stateless: "
                                     "send the items themselves)");
    } else {
      return Status::InvalidArgument(path + ".type: " + Quote(type) + " items are not supported (only message, "
                                     "function_call and function_call_output)");
    }
  }
  if (req->messages.empty())
    return Status::InvalidArgument("input: at least one user, assistant or function call item is required");
  NameToolMessages(&req->messages);
  return Status::Ok();
}

Status ReadTools(const json& body, ChatRequest* req) {
  KEEL_RETURN_IF_ERROR(ForEachTool(body, [&](const json& t, const std::string& path) -> Status {
    std::string type;
    KEEL_RETURN_IF_ERROR(ReadRequiredString(t, "type", path + ".type", &type));
    if (type != "function")
      return Status::InvalidArgument(path + ".type: " + Quote(type) +
                                     " is not supported (only function tools: the gateway runs no built-in tools)");
    Tool tool;
    KEEL_RETURN_IF_ERROR(ReadFunctionTool(t, path, &tool));
    bool strict = false;  // validated; the internal form has no place for it
    KEEL_RETURN_IF_ERROR(ReadBool(t, "strict", path + ".strict", &strict));
    req->tools.push_back(std::move(tool));
    return Status::Ok();
  }));
  return ReadToolChoice(body, &req->tool_choice, [&](const json& tc) -> Status {
    std::string type;
    KEEL_RETURN_IF_ERROR(ReadRequiredString(tc, "type", "tool_choice.type", &type));
    if (type != "function")
      return Status::InvalidArgument("tool_choice.type: " + Quote(type) + " is not supported (only function)");
    return ReadRequiredString(tc, "name", "tool_choice.name", &req->tool_choice);
  });
}

// text.format -> response_format: json_schema's fields sit beside type. verbosity is accepted and
// not carried.
Status ReadTextFormat(const json& body, ChatRequest* req) {
  auto text = body.find("text");
  if (text == body.end() || text->is_null()) return Status::Ok();
  if (!text->is_object()) return Status::InvalidArgument("text: expected an object");
  auto f = text->find("format");
  if (f == text->end() || f->is_null()) return Status::Ok();
  return ReadOpenAIResponseFormat(*f, {.path = "text.format", .schema_member = nullptr, .check_name = false,
                                       .schema_required = true},
                                  &req->response_format);
}

// Fields the gateway cannot honour (no stored state, no log-probabilities) are refused rather than
// answered with less than was asked; fields that only concern OpenAI's storage are accepted.
Status ReadRefusedAndAccepted(const json& body) {
  const std::string stateless = "the gateway is stateless: send the whole conversation in input";
  KEEL_RETURN_IF_ERROR(RefuseIfPresent(body, "previous_response_id", stateless));
  KEEL_RETURN_IF_ERROR(RefuseIfPresent(body, "conversation", stateless));
  KEEL_RETURN_IF_ERROR(RefuseIfPresent(body, "prompt", "stored prompt templates need state; send instructions and input"));
  bool background = false;
  KEEL_RETURN_IF_ERROR(ReadBool(body, "background", "background", &background));
  if (background) return Status::InvalidArgument("background: not supported (the gateway is stateless)");
  bool store = false;  // accepted either way; nothing is stored
  KEEL_RETURN_IF_ERROR(ReadBool(body, "store", "store", &store));
  if (Present(body, "metadata") && !body["metadata"].is_object())
    return Status::InvalidArgument("metadata: expected an object");
  if (auto t = body.find("top_logprobs"); t != body.end() && !t->is_null() && *t != 0)
    return Status::InvalidArgument("top_logprobs: not supported by the gateway");
  if (auto inc = body.find("include"); inc != body.end() && !inc->is_null()) {
    if (!inc->is_array()) return Status::InvalidArgument("include: expected an array of strings");
    for (size_t i = 0; i < inc->size(); ++i) {
      if (!(*inc)[i].is_string()) return Status::InvalidArgument(At("include", i) + ": expected a string");
      // The others ask for output of tools and reasoning the gateway never produces.
      if ((*inc)[i] == "message.output_text.logprobs")
        return Status::InvalidArgument(At("include", i) + ": message.output_text.logprobs is not supported by the gateway");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<ChatRequest> ParseResponsesRequest(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseObject(text, "request body"));
  ChatRequest req;
  req.client_format = WireFormat::kOpenAIResponses;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(body, "model", "model", &req.model));
  KEEL_RETURN_IF_ERROR(ReadRefusedAndAccepted(body));
  // reasoning.effort is OpenAI's reasoning_effort; its summary asks for reasoning items the gateway
  // never returns, so it goes with the other accepted fields.
  if (auto r = body.find("reasoning"); r != body.end() && !r->is_null()) {
    if (!r->is_object()) return Status::InvalidArgument("reasoning: expected an object");
    KEEL_RETURN_IF_ERROR(ReadReasoningEffort(*r, "effort", &req.reasoning_effort));
  }
  std::vector<std::string> system;
  std::string instructions;
  KEEL_RETURN_IF_ERROR(ReadString(body, "instructions", "instructions", &instructions));
  if (!instructions.empty()) system.push_back(std::move(instructions));
  KEEL_RETURN_IF_ERROR(ReadInput(body, &req, &system));
  for (size_t i = 0; i < system.size(); ++i) req.system += (i ? "\n" : "") + system[i];
  KEEL_RETURN_IF_ERROR(ReadPositiveInt(body, "max_output_tokens", "max_output_tokens", &req.max_tokens));
  KEEL_RETURN_IF_ERROR(ReadNumber(body, "temperature", "temperature", &req.temperature));
  KEEL_RETURN_IF_ERROR(ReadNumber(body, "top_p", "top_p", &req.top_p));
  KEEL_RETURN_IF_ERROR(ReadBool(body, "stream", "stream", &req.stream));
  KEEL_RETURN_IF_ERROR(ReadString(body, "user", "user", &req.user));
  if (Present(body, "parallel_tool_calls")) {
    bool parallel = true;
    KEEL_RETURN_IF_ERROR(ReadBool(body, "parallel_tool_calls", "parallel_tool_calls", &parallel));
    req.parallel_tool_calls = parallel;
  }
  KEEL_RETURN_IF_ERROR(ReadTools(body, &req));
  KEEL_RETURN_IF_ERROR(ReadTextFormat(body, &req));
  return req;
}

namespace responses_internal {

namespace {

// Text this gateway wrote from validated JSON (schemas); anything else gives {}.
Json ObjectFromText(const std::string& text) {
  Result<Json> j = ParseUntrustedOrderedJson(text, kClientJsonLimits);
  return j.ok() ? std::move(j).value() : Json::object();
}

Json FormatJson(const std::optional<ResponseFormat>& format) {
  if (!format || format->kind == ResponseFormat::Kind::kText) return Json{{"type", "text"}};
  if (format->kind == ResponseFormat::Kind::kJsonObject) return Json{{"type", "json_object"}};
  return Json{{"type", "json_schema"},
              {"name", format->name},
              {"schema", ObjectFromText(format->schema_json)},
              {"strict", format->strict}};
}

Json ToolChoiceJson(const std::string& choice) {
  if (choice.empty()) return "auto";  // OpenAI's default, which every upstream shares
  if (choice == "auto" || choice == "none" || choice == "required") return choice;
  return Json{{"type", "function"}, {"name", choice}};
}

// strict is null: the internal form does not carry it, and null ("not stated") is a value the
// Responses object allows.
Json ToolsJson(const std::vector<Tool>& tools) {
  Json out = Json::array();
  for (const Tool& t : tools) {
    out.push_back(Json{{"type", "function"},
                       {"name", t.name},
                       {"description", t.description.empty() ? Json(nullptr) : Json(t.description)},
                       {"parameters", ObjectFromText(t.parameters_json)},
                       {"strict", nullptr}});
  }
  return out;
}

template <class T>
Json OrNull(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}

}  // namespace

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

Json ResponseTemplate(const ChatRequest& request, const std::string& client_model) {
  Json r = Json::object();
  r["id"] = "";
  r["object"] = "response";
  r["created_at"] = 0;
  r["status"] = "";
  r["background"] = false;
  r["error"] = nullptr;
  r["incomplete_details"] = nullptr;
  // The system text sent upstream: instructions plus any system/developer input messages.
  r["instructions"] = request.system.empty() ? Json(nullptr) : Json(request.system);
  r["max_output_tokens"] = OrNull(request.max_tokens);
  r["model"] = client_model;
  r["output"] = Json::array();
  r["parallel_tool_calls"] = request.parallel_tool_calls.value_or(true);
  r["previous_response_id"] = nullptr;
  r["reasoning"] = Json{{"effort", nullptr}, {"summary", nullptr}};
  r["store"] = false;  // nothing is stored: a later GET /v1/responses/{id} could not find it
  r["temperature"] = OrNull(request.temperature);
  r["text"] = Json{{"format", FormatJson(request.response_format)}};
  r["tool_choice"] = ToolChoiceJson(request.tool_choice);
  r["tools"] = ToolsJson(request.tools);
  r["top_p"] = OrNull(request.top_p);
  r["truncation"] = "disabled";
  r["usage"] = nullptr;
  r["user"] = request.user.empty() ? Json(nullptr) : Json(request.user);
  r["metadata"] = Json::object();  // accepted from the client, not carried
  return r;
}

void SetOutcome(Json* response, const std::string& id, int64_t created_at, const char* status,
                Json incomplete_details, Json output, Json usage) {
  Json& r = *response;
  r["id"] = id;
  r["created_at"] = created_at;
  r["status"] = status;
  r["incomplete_details"] = std::move(incomplete_details);
  r["output"] = std::move(output);
  r["usage"] = std::move(usage);
}

Json OutputText(const std::string& text) {
  return Json{{"type", "output_text"}, {"text", text}, {"annotations", Json::array()}};
}

Json MessageItem(const std::string& id, const char* status, Json content) {
  return Json{{"type", "message"}, {"id", id}, {"status", status}, {"role", "assistant"}, {"content", std::move(content)}};
}

Json FunctionCallItem(const std::string& id, const char* status, const std::string& call_id,
                      const std::string& name, const std::string& arguments) {
  return Json{{"type", "function_call"}, {"id", id},           {"call_id", call_id},
              {"name", name},            {"arguments", arguments}, {"status", status}};
}

const char* StatusFor(FinishReason finish) {
  return finish == FinishReason::kLength || finish == FinishReason::kContentFilter ? "incomplete" : "completed";
}

Json IncompleteDetails(FinishReason finish) {
  if (finish == FinishReason::kLength) return Json{{"reason", "max_output_tokens"}};
  if (finish == FinishReason::kContentFilter) return Json{{"reason", "content_filter"}};
  return nullptr;
}

Json UsageJson(const Usage& usage) {
  if (usage.input_tokens < 0 && usage.output_tokens < 0) return nullptr;
  const int64_t in = std::max<int64_t>(usage.input_tokens, 0);
  const int64_t out = std::max<int64_t>(usage.output_tokens, 0);
  return Json{{"input_tokens", in},
              {"input_tokens_details", {{"cached_tokens", 0}}},
              {"output_tokens", out},
              {"output_tokens_details", {{"reasoning_tokens", 0}}},
              {"total_tokens", in + out}};
}

std::string NewItemId(const char* prefix) { return NewId(prefix); }
std::string ResponseId(const std::string& upstream_id) { return PrefixedId(upstream_id, "resp_"); }

}  // namespace responses_internal

std::string BuildResponsesResponse(const ChatResponse& response, const ChatRequest& request,
                                   const std::string& client_model) {
  namespace ri = responses_internal;
  const char* status = ri::StatusFor(response.finish);
  const bool with_message = !response.content.empty() || response.tool_calls.empty();
  const size_t items = (with_message ? 1 : 0) + response.tool_calls.size();
  // Where the answer was cut off, the item being written then (the last) is incomplete too.
  auto item_status = [&](size_t i) { return i + 1 == items ? status : "completed"; };
  ri::Json output = ri::Json::array();
  if (with_message) {
    output.push_back(ri::MessageItem(ri::NewItemId("msg_"), item_status(0),
                                     ri::Json::array({ri::OutputText(response.content)})));
  }
  for (const ToolCall& call : response.tool_calls) {
    output.push_back(ri::FunctionCallItem(ri::NewItemId("fc_"), item_status(output.size()),
                                          call.id.empty() ? ri::NewItemId("call_") : call.id, call.name,
                                          call.arguments_json.empty() ? "{}" : call.arguments_json));
  }
  ri::Json r = ri::ResponseTemplate(request, client_model);
  ri::SetOutcome(&r, ri::ResponseId(response.id), response.created ? response.created : NowSeconds(), status,
                 ri::IncompleteDetails(response.finish), std::move(output), ri::UsageJson(response.usage));
  return ri::Dump(r);
}

}  // namespace keel::gateway
