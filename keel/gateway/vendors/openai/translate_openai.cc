// OpenAI Chat Completions and (legacy) Completions: client requests in, upstream requests out,
// upstream responses in, client responses out.
#include "keel/gateway/stream.h"
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/openai/openai_answer.h"

namespace keel::gateway {

using namespace internal;  // NOLINT: the helpers are this file's vocabulary

namespace {

constexpr size_t kMaxLogitBias = 300;  // OpenAI's own bound on logit_bias entries

// logit_bias: token ids (decimal strings, as JSON keys must be) to biases in [-100, 100]. Kept
// as compact text; an empty object is the same as none.
Status ReadLogitBias(const json& body, std::string* out) {
  auto it = body.find("logit_bias");
  if (it == body.end() || it->is_null()) return Status::Ok();
  if (!it->is_object()) return Status::InvalidArgument("logit_bias: expected an object of token ids to numbers");
  if (it->size() > kMaxLogitBias)
    return Status::InvalidArgument("logit_bias: at most " + std::to_string(kMaxLogitBias) + " entries");
  for (const auto& [key, value] : it->items()) {
    // Not echoed: a key that is not a token id may hold anything.
    if (key.empty() || key.size() > 10 || key.find_first_not_of("0123456789") != std::string::npos)
      return Status::InvalidArgument("logit_bias: keys must be token ids (non-negative integers)");
    if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100))
      return Status::InvalidArgument("logit_bias." + key + ": expected a number between -100 and 100");
  }
  if (!it->empty()) *out = Dump(*it);
  return Status::Ok();
}

// response_format: {type: text} | {type: json_object} | {type: json_schema, json_schema: {name,
// schema, strict, description}}. The description is not carried (no other format has one).
Status ReadResponseFormat(const json& body, ChatRequest* req) {
  auto it = body.find("response_format");
  if (it == body.end() || it->is_null()) return Status::Ok();
  return ReadOpenAIResponseFormat(*it, {.path = "response_format", .schema_member = "json_schema",
                                        .check_name = true, .schema_required = false},
                                  &req->response_format);
}

// Fields chat and completions requests share.
Status ReadCommon(const json& body, ChatRequest* req) {
  KEEL_RETURN_IF_ERROR(ReadRequiredString(body, "model", "model", &req->model));
  // max_completion_tokens replaced max_tokens; when both are sent the newer one wins.
  KEEL_RETURN_IF_ERROR(ReadPositiveInt(body, "max_tokens", "max_tokens", &req->max_tokens));
  KEEL_RETURN_IF_ERROR(
      ReadPositiveInt(body, "max_completion_tokens", "max_completion_tokens", &req->max_tokens));
  KEEL_RETURN_IF_ERROR(ReadNumber(body, "temperature", "temperature", &req->temperature));
  KEEL_RETURN_IF_ERROR(ReadNumber(body, "top_p", "top_p", &req->top_p));
  KEEL_RETURN_IF_ERROR(ReadInt(body, "seed", "seed", &req->seed));
  // Not an OpenAI field, but `keel serve` and most OpenAI-compatible servers read it.
  KEEL_RETURN_IF_ERROR(ReadPositiveInt(body, "top_k", "top_k", &req->top_k));
  KEEL_RETURN_IF_ERROR(
      ReadNumberInRange(body, "presence_penalty", "presence_penalty", -2, 2, &req->presence_penalty));
  KEEL_RETURN_IF_ERROR(
      ReadNumberInRange(body, "frequency_penalty", "frequency_penalty", -2, 2, &req->frequency_penalty));
  KEEL_RETURN_IF_ERROR(ReadLogitBias(body, &req->logit_bias_json));
  KEEL_RETURN_IF_ERROR(ReadStop(body, "stop", "stop", /*allow_single_string=*/true, &req->stop));
  KEEL_RETURN_IF_ERROR(ReadBool(body, "stream", "stream", &req->stream));
  KEEL_RETURN_IF_ERROR(ReadString(body, "user", "user", &req->user));
  if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return Status::InvalidArgument("stream_options: expected an object");
    KEEL_RETURN_IF_ERROR(ReadBool(*it, "include_usage", "stream_options.include_usage",
                                  &req->stream_include_usage));
  }
  // One choice is all the gateway returns; asking for more must not silently give fewer.
  if (auto it = body.find("n"); it != body.end() && !it->is_null() && *it != 1)
    return Status::InvalidArgument("n: only 1 is supported");
  // Likewise log-probabilities: the internal form does not carry them (Anthropic has none), so
  // a request for them is refused rather than answered with "logprobs": null. false/null pass.
  if (auto it = body.find("logprobs"); it != body.end() && !it->is_null() && *it != false)
    return Status::InvalidArgument("logprobs: not supported by the gateway");
  if (auto it = body.find("top_logprobs"); it != body.end() && !it->is_null())
    return Status::InvalidArgument("top_logprobs: not supported by the gateway");
  return Status::Ok();
}

// Message content: a string, null, or an array of {type:"text",text} parts (concatenated).
Status ReadContent(const json& msg, const std::string& path, std::string* out) {
  auto it = msg.find("content");
  if (it == msg.end() || it->is_null()) return Status::Ok();
  return ReadStringOrParts(*it, path, out, [&](const json& part, const std::string& part_path) -> Status {
    std::string type, text;
    KEEL_RETURN_IF_ERROR(ReadString(part, "type", part_path + ".type", &type));
    if (type != "text")
      return Status::InvalidArgument(part_path + ".type: only text parts are supported");
    if (!part.contains("text")) return Status::InvalidArgument(part_path + ".text: required");
    KEEL_RETURN_IF_ERROR(ReadString(part, "text", part_path + ".text", &text));
    *out += text;
    return Status::Ok();
  });
}

// Clients must send call ids (tool results refer to them); upstreams that omit one get
// "call_<index>", as for Gemini.
Status ReadToolCalls(const json& msg, const std::string& path, bool require_id,
                     std::vector<ToolCall>* out) {
  auto it = msg.find("tool_calls");
  if (it == msg.end() || it->is_null()) return Status::Ok();
  if (!it->is_array()) return Status::InvalidArgument(path + ": expected an array");
  if (it->size() > kMaxToolCalls)
    return Status::InvalidArgument(path + ": at most " + std::to_string(kMaxToolCalls) + " calls");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& c = (*it)[i];
    const std::string call_path = At(path, i);
    if (!c.is_object()) return Status::InvalidArgument(call_path + ": expected an object");
    ToolCall call;
    if (require_id) KEEL_RETURN_IF_ERROR(ReadRequiredString(c, "id", call_path + ".id", &call.id));
    else KEEL_RETURN_IF_ERROR(ReadString(c, "id", call_path + ".id", &call.id));
    if (call.id.empty()) call.id = "call_" + std::to_string(i);
    std::string type = "function";
    KEEL_RETURN_IF_ERROR(ReadString(c, "type", call_path + ".type", &type));
    if (type != "function")
      return Status::InvalidArgument(call_path + ".type: only function calls are supported");
    auto fn = c.find("function");
    if (fn == c.end() || !fn->is_object())
      return Status::InvalidArgument(call_path + ".function: expected an object");
    KEEL_RETURN_IF_ERROR(ReadRequiredString(*fn, "name", call_path + ".function.name", &call.name));
    KEEL_RETURN_IF_ERROR(ReadArgumentsText(*fn, call_path + ".function.arguments", &call.arguments_json));
    out->push_back(std::move(call));
  }
  return Status::Ok();
}

Status ReadMessages(const json& body, ChatRequest* req) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) return Status::InvalidArgument("messages: required");
  if (!it->is_array()) return Status::InvalidArgument("messages: expected an array");
  if (it->empty()) return Status::InvalidArgument("messages: must not be empty");
  if (it->size() > kMaxMessages)
    return Status::InvalidArgument("messages: at most " + std::to_string(kMaxMessages) + " messages");
  std::vector<std::string> system;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string path = At("messages", i);
    if (!m.is_object()) return Status::InvalidArgument(path + ": expected an object");
    Message msg;
    KEEL_RETURN_IF_ERROR(ReadRequiredString(m, "role", path + ".role", &msg.role));
    KEEL_RETURN_IF_ERROR(ReadContent(m, path + ".content", &msg.content));
    if (msg.role == "system" || msg.role == "developer") {
      system.push_back(std::move(msg.content));
      continue;
    }
    if (msg.role == "assistant") {
      KEEL_RETURN_IF_ERROR(ReadToolCalls(m, path + ".tool_calls", /*require_id=*/true, &msg.tool_calls));
      // A refused turn (content null, refusal the text the model said) is what the model said.
      if (msg.content.empty()) KEEL_RETURN_IF_ERROR(ReadString(m, "refusal", path + ".refusal", &msg.content));
    } else if (msg.role == "tool") {
      KEEL_RETURN_IF_ERROR(
          ReadRequiredString(m, "tool_call_id", path + ".tool_call_id", &msg.tool_call_id));
      KEEL_RETURN_IF_ERROR(ReadString(m, "name", path + ".name", &msg.name));
    } else if (msg.role != "user") {
      return Status::InvalidArgument(path + ".role: expected system, developer, user, assistant or tool");
    }
    req->messages.push_back(std::move(msg));
  }
  if (req->messages.empty())
    return Status::InvalidArgument("messages: at least one non-system message is required");
  for (size_t i = 0; i < system.size(); ++i) req->system += (i ? "\n" : "") + system[i];
  NameToolMessages(&req->messages);
  return Status::Ok();
}

Status ReadTools(const json& body, ChatRequest* req) {
  KEEL_RETURN_IF_ERROR(ForEachTool(body, [&](const json& t, const std::string& path) -> Status {
    std::string type;
    KEEL_RETURN_IF_ERROR(ReadRequiredString(t, "type", path + ".type", &type));
    if (type != "function") return Status::InvalidArgument(path + ".type: only function tools are supported");
    auto fn = t.find("function");
    if (fn == t.end() || !fn->is_object()) return Status::InvalidArgument(path + ".function: expected an object");
    Tool tool;
    KEEL_RETURN_IF_ERROR(ReadFunctionTool(*fn, path + ".function", &tool));
    req->tools.push_back(std::move(tool));
    return Status::Ok();
  }));
  return ReadToolChoice(body, &req->tool_choice, [&](const json& tc) -> Status {
    auto fn = tc.find("function");
    if (fn == tc.end() || !fn->is_object()) return Status::InvalidArgument("tool_choice.function: expected an object");
    return ReadRequiredString(*fn, "name", "tool_choice.function.name", &req->tool_choice);
  });
}

// Sampling fields both OpenAI upstream bodies carry. top_k too: `keel serve` (and vLLM, llama.cpp)
// honour it; OpenAI itself answers 400 naming it, which reaches the client as such.
void WriteCommon(const ChatRequest& request, SortedMembers* body) {
  if (request.temperature) AppendJsonNumber(*request.temperature, body->Add("temperature"));
  if (request.top_p) AppendJsonNumber(*request.top_p, body->Add("top_p"));
  if (request.top_k) AppendJsonNumber(*request.top_k, body->Add("top_k"));
  if (request.presence_penalty) AppendJsonNumber(*request.presence_penalty, body->Add("presence_penalty"));
  if (request.frequency_penalty) AppendJsonNumber(*request.frequency_penalty, body->Add("frequency_penalty"));
  // Re-read and written again (not copied): the text is the client's object, normalised.
  if (!request.logit_bias_json.empty()) *body->Add("logit_bias") += Dump(SchemaObject(request.logit_bias_json));
  if (request.seed) AppendJsonNumber(*request.seed, body->Add("seed"));
  if (!request.stop.empty()) {
    std::string* out = body->Add("stop");
    *out += '[';
    for (size_t i = 0; i < request.stop.size(); ++i) {
      if (i) *out += ',';
      AppendJsonString(request.stop[i], out);
    }
    *out += ']';
  }
  if (!request.user.empty()) AppendJsonString(request.user, body->Add("user"));
  if (request.stream) {
    *body->Add("stream") += "true";
    // Always asked for: the gateway counts tokens even when the client does not want usage.
    *body->Add("stream_options") += "{\"include_usage\":true}";
  }
}

// One message of the upstream body: {"content","role","tool_call_id","tool_calls"}, in that
// (sorted) order.
void AppendMessage(std::string_view role, const std::string& content, const Message* m, std::string* out) {
  const bool calls = m && role == "assistant" && !m->tool_calls.empty();
  *out += "{\"content\":";
  if (calls && content.empty()) *out += "null";
  else AppendJsonString(content, out);
  *out += ",\"role\":";
  AppendJsonString(role, out);
  if (calls) {
    *out += ",\"tool_calls\":";
    AppendOpenAIToolCalls(m->tool_calls, out);
  } else if (m && role == "tool") {
    *out += ",\"tool_call_id\":";
    AppendJsonString(m->tool_call_id, out);
  }
  *out += '}';
}

json ResponseFormatJson(const ResponseFormat& format) {
  switch (format.kind) {
    case ResponseFormat::Kind::kText: return {{"type", "text"}};
    case ResponseFormat::Kind::kJsonObject: return {{"type", "json_object"}};
    case ResponseFormat::Kind::kJsonSchema: break;
  }
  // OpenAI requires a name; Anthropic's output_config.format has none to give.
  json schema = {{"name", format.name.empty() ? "response" : format.name},
                 {"schema", SchemaObject(format.schema_json)}};
  if (format.strict) schema["strict"] = true;
  return {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
}

Status ReadUsage(const json& body, Usage* usage) {
  auto u = body.find("usage");
  if (u == body.end() || !u->is_object()) return Status::Ok();
  if (auto p = u->find("prompt_tokens"); p != u->end() && p->is_number_integer())
    usage->input_tokens = p->get<int64_t>();
  if (auto c = u->find("completion_tokens"); c != u->end() && c->is_number_integer())
    usage->output_tokens = c->get<int64_t>();
  return Status::Ok();
}

// The first choice of an upstream response, with id/model/created/usage read into `out`.
Result<const json*> FirstChoice(const json& body, ChatResponse* out) {
  if (auto e = body.find("error"); e != body.end() && !e->is_null() && !body.contains("choices")) {
    std::string message = e->is_object() && e->contains("message") && (*e)["message"].is_string()
                              ? (*e)["message"].get<std::string>()
                              : Dump(*e).substr(0, 200);
    return Status::Corruption("upstream response: error: " + message);
  }
  auto choices = body.find("choices");
  if (choices == body.end() || !choices->is_array() || choices->empty() || !(*choices)[0].is_object())
    return Status::Corruption("upstream response: choices: expected a non-empty array of objects");
  ReadString(body, "id", "id", &out->id).ok();  // optional and informational: wrong types ignored
  ReadString(body, "model", "model", &out->model).ok();
  if (auto c = body.find("created"); c != body.end() && c->is_number_integer()) out->created = c->get<int64_t>();
  ReadUsage(body, &out->usage).ok();
  return &(*choices)[0];
}

// Fields that change the answer but that the neutral form does not carry: refused, never
// dropped with a 200 (docs/gateway.md, "Parameters per upstream"). Values asking for the default
// (null, false, "", a text-only modality list, best_of 1) pass.
Status RefuseUncarriedChatFields(const json& body) {
  if (auto it = body.find("modalities"); it != body.end() && !it->is_null() && *it != json::array({"text"}))
    return Status::InvalidArgument("modalities: only [\"text\"] is supported by the gateway");
  for (const char* f : {"functions", "function_call"}) {
    if (auto it = body.find(f); it != body.end() && !it->is_null())
      return Status::InvalidArgument(std::string(f) + ": the legacy functions form is not supported; send tools");
  }
  for (const char* f : {"audio", "web_search_options", "prediction"}) {
    if (auto it = body.find(f); it != body.end() && !it->is_null())
      return Status::InvalidArgument(std::string(f) + ": not supported by the gateway");
  }
  return Status::Ok();
}

Status RefuseUncarriedCompletionsFields(const json& body) {
  if (auto it = body.find("echo"); it != body.end() && !it->is_null() && *it != false)
    return Status::InvalidArgument("echo: not supported by the gateway");
  if (auto it = body.find("suffix"); it != body.end() && !it->is_null() && *it != "")
    return Status::InvalidArgument("suffix: not supported by the gateway");
  if (auto it = body.find("best_of"); it != body.end() && !it->is_null() && *it != 1)
    return Status::InvalidArgument("best_of: only 1 is supported by the gateway");
  return Status::Ok();
}

}  // namespace

Result<ChatRequest> ParseOpenAIChatRequest(std::string_view text) {
  ChatRequest req;
  if (ReadOpenAIChatRequestFast(text, &req)) return req;
  return ParseOpenAIChatRequestDom(text);
}

Result<ChatRequest> internal::ParseOpenAIChatRequestDom(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseObject(text, "request body"));
  ChatRequest req;
  req.client_format = WireFormat::kOpenAIChat;
  KEEL_RETURN_IF_ERROR(ReadCommon(body, &req));
  KEEL_RETURN_IF_ERROR(RefuseUncarriedChatFields(body));
  KEEL_RETURN_IF_ERROR(ReadMessages(body, &req));
  KEEL_RETURN_IF_ERROR(ReadTools(body, &req));
  KEEL_RETURN_IF_ERROR(
      ReadBool(body, "parallel_tool_calls", "parallel_tool_calls", &req.parallel_tool_calls));
  KEEL_RETURN_IF_ERROR(ReadResponseFormat(body, &req));
  KEEL_RETURN_IF_ERROR(ReadReasoningEffort(body, "reasoning_effort", &req.reasoning_effort));
  return req;
}

Result<ChatRequest> ParseOpenAICompletionsRequest(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseObject(text, "request body"));
  ChatRequest req;
  req.client_format = WireFormat::kOpenAICompletions;
  KEEL_RETURN_IF_ERROR(ReadCommon(body, &req));
  KEEL_RETURN_IF_ERROR(RefuseUncarriedCompletionsFields(body));
  auto p = body.find("prompt");
  if (p == body.end() || p->is_null()) return Status::InvalidArgument("prompt: required");
  if (p->is_array()) {
    // A batch of prompts would need several answers; token-id prompts need the upstream's tokenizer.
    if (p->size() != 1 || !(*p)[0].is_string())
      return Status::InvalidArgument("prompt: expected a string or an array of exactly one string");
    req.prompt = (*p)[0].get<std::string>();
  } else if (p->is_string()) {
    req.prompt = p->get<std::string>();
  } else {
    return Status::InvalidArgument("prompt: expected a string or an array of exactly one string");
  }
  return req;
}

// The body is written directly (members sorted, as Dump of a json wrote them: the tests compare
// it byte for byte with the DOM builder it replaced); tool schemas, logit_bias and response_format
// still go through a json, since they are re-read client objects.
Result<std::string> BuildOpenAIChatRequest(const ChatRequest& request, const std::string& model) {
  SortedMembers body;
  AppendJsonString(model, body.Add("model"));
  std::string* messages = body.Add("messages");
  *messages += '[';
  if (!request.system.empty()) {
    AppendMessage("system", request.system, nullptr, messages);
    *messages += ',';
  }
  if (request.messages.empty() && request.client_format == WireFormat::kOpenAICompletions) {
    AppendMessage("user", request.prompt, nullptr, messages);  // EffectiveMessages, without the copy
  } else {
    for (const Message& m : request.messages) {
      AppendMessage(m.role, m.content, &m, messages);
      *messages += ',';
    }
    if (messages->back() == ',') messages->pop_back();
  }
  *messages += ']';
  if (!request.tools.empty()) {
    std::string* tools = body.Add("tools");
    *tools += '[';
    for (size_t i = 0; i < request.tools.size(); ++i) {
      const Tool& t = request.tools[i];
      *tools += i ? ",{\"function\":{" : "{\"function\":{";
      if (!t.description.empty()) {
        *tools += "\"description\":";
        AppendJsonString(t.description, tools);
        *tools += ',';
      }
      *tools += "\"name\":";
      AppendJsonString(t.name, tools);
      *tools += ",\"parameters\":";
      *tools += Dump(SchemaObject(t.parameters_json));
      if (t.strict) *tools += *t.strict ? ",\"strict\":true" : ",\"strict\":false";
      *tools += "},\"type\":\"function\"}";
    }
    *tools += ']';
    const std::string& tc = request.tool_choice;
    if (tc == "auto" || tc == "none" || tc == "required") {
      AppendJsonString(tc, body.Add("tool_choice"));
    } else if (!tc.empty()) {
      std::string* choice = body.Add("tool_choice");
      *choice += "{\"function\":{\"name\":";
      AppendJsonString(tc, choice);
      *choice += "},\"type\":\"function\"}";
    }
    // Only with tools: OpenAI refuses parallel_tool_calls in a request without them.
    if (request.parallel_tool_calls) *body.Add("parallel_tool_calls") += *request.parallel_tool_calls ? "true" : "false";
  }
  if (request.response_format) *body.Add("response_format") += Dump(ResponseFormatJson(*request.response_format));
  // max_completion_tokens: OpenAI's reasoning models reject max_tokens; keel serve reads both.
  if (request.max_tokens) AppendJsonNumber(*request.max_tokens, body.Add("max_completion_tokens"));
  if (!request.reasoning_effort.empty()) AppendJsonString(request.reasoning_effort, body.Add("reasoning_effort"));
  WriteCommon(request, &body);
  std::string out;
  out.reserve(body.value_bytes() + 256);
  body.AppendTo(&out);
  return out;
}

Result<std::string> BuildOpenAICompletionsRequest(const ChatRequest& request, const std::string& model) {
  // Legacy completions have no structured output (nor tools: those are not sent).
  if (request.response_format && request.response_format->kind != ResponseFormat::Kind::kText)
    return Unsupported("response_format", WireFormat::kOpenAICompletions);
  std::string prompt = request.prompt;
  if (request.client_format != WireFormat::kOpenAICompletions) {
    // A chat request to a completions-only upstream: the turns as plain text, no template.
    prompt = request.system;
    for (const Message& m : request.messages) prompt += (prompt.empty() ? "" : "\n") + m.content;
  }
  SortedMembers body;
  AppendJsonString(model, body.Add("model"));
  AppendJsonString(prompt, body.Add("prompt"));
  if (request.max_tokens) AppendJsonNumber(*request.max_tokens, body.Add("max_tokens"));
  WriteCommon(request, &body);
  std::string out;
  out.reserve(body.value_bytes() + 128);
  body.AppendTo(&out);
  return out;
}

Result<ChatResponse> internal::ParseOpenAIChatResponseDom(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseUpstreamObject(text));
  ChatResponse out;
  KEEL_ASSIGN_OR_RETURN(const json* choice, FirstChoice(body, &out));
  auto msg = choice->find("message");
  if (msg == choice->end() || !msg->is_object())
    return Status::Corruption("upstream response: choices[0].message: expected an object");
  if (auto c = msg->find("content"); c != msg->end() && !c->is_null()) {
    Status s = ReadContent(*msg, "choices[0].message.content", &out.content);
    if (!s.ok()) return Status::Corruption("upstream response: " + s.message());
  }
  Status s = ReadToolCalls(*msg, "choices[0].message.tool_calls", /*require_id=*/false, &out.tool_calls);
  if (!s.ok()) return Status::Corruption("upstream response: " + s.message());
  std::string finish;
  ReadString(*choice, "finish_reason", "finish_reason", &finish).ok();
  out.finish = ParseOpenAIFinishReason(finish);
  return out;
}

Result<ChatResponse> internal::ParseOpenAICompletionsResponseDom(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseUpstreamObject(text));
  ChatResponse out;
  KEEL_ASSIGN_OR_RETURN(const json* choice, FirstChoice(body, &out));
  Status s = ReadString(*choice, "text", "choices[0].text", &out.content);
  if (!s.ok()) return Status::Corruption("upstream response: " + s.message());
  std::string finish;
  ReadString(*choice, "finish_reason", "finish_reason", &finish).ok();
  out.finish = ParseOpenAIFinishReason(finish);
  return out;
}

}  // namespace keel::gateway
