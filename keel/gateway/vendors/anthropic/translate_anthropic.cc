// Anthropic Messages: client requests in, upstream requests out, upstream responses in, client
// responses out.
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendors/anthropic/anthropic.h"

namespace keel::gateway {

using namespace internal;  // NOLINT: the helpers are this file's vocabulary

namespace {

// Text blocks ({type:"text",text}) or a string; anything else names the offending block.
Status ReadTextBlocks(const json& v, const std::string& path, std::string* out) {
  if (v.is_string()) {
    *out = v.get<std::string>();
    return Status::Ok();
  }
  if (!v.is_array()) return Status::InvalidArgument(path + ": expected a string or an array of blocks");
  if (v.size() > kMaxParts)
    return Status::InvalidArgument(path + ": at most " + std::to_string(kMaxParts) + " blocks");
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string block_path = At(path, i);
    if (!v[i].is_object()) return Status::InvalidArgument(block_path + ": expected an object");
    std::string type, text;
    KEEL_RETURN_IF_ERROR(ReadString(v[i], "type", block_path + ".type", &type));
    if (type != "text") return Status::InvalidArgument(block_path + ".type: only text blocks are supported");
    KEEL_RETURN_IF_ERROR(ReadString(v[i], "text", block_path + ".text", &text));
    *out += text;
  }
  return Status::Ok();
}

// One Anthropic message -> one or more Messages: tool_result blocks become role "tool" messages,
// in block order, with the text around them as user messages.
Status ReadMessage(const json& m, const std::string& path, std::vector<Message>* out) {
  if (!m.is_object()) return Status::InvalidArgument(path + ": expected an object");
  std::string role;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(m, "role", path + ".role", &role));
  if (role != "user" && role != "assistant")
    return Status::InvalidArgument(path + ".role: expected user or assistant");
  auto content = m.find("content");
  if (content == m.end() || content->is_null()) return Status::InvalidArgument(path + ".content: required");
  const std::string content_path = path + ".content";
  Message current;
  current.role = role;
  if (content->is_string()) {
    current.content = content->get<std::string>();
    out->push_back(std::move(current));
    return Status::Ok();
  }
  if (!content->is_array())
    return Status::InvalidArgument(content_path + ": expected a string or an array of blocks");
  if (content->size() > kMaxParts)
    return Status::InvalidArgument(content_path + ": at most " + std::to_string(kMaxParts) + " blocks");
  const size_t first = out->size();
  for (size_t i = 0; i < content->size(); ++i) {
    const json& b = (*content)[i];
    const std::string bp = At(content_path, i);
    if (!b.is_object()) return Status::InvalidArgument(bp + ": expected an object");
    std::string type;
    KEEL_RETURN_IF_ERROR(ReadRequiredString(b, "type", bp + ".type", &type));
    if (type == "text") {
      std::string text;
      KEEL_RETURN_IF_ERROR(ReadString(b, "text", bp + ".text", &text));
      current.content += text;
    } else if (type == "tool_use" && role == "assistant") {
      if (current.tool_calls.size() >= kMaxToolCalls)
        return Status::InvalidArgument(content_path + ": too many tool_use blocks");
      ToolCall call;
      KEEL_RETURN_IF_ERROR(ReadRequiredString(b, "id", bp + ".id", &call.id));
      KEEL_RETURN_IF_ERROR(ReadRequiredString(b, "name", bp + ".name", &call.name));
      KEEL_RETURN_IF_ERROR(ReadObjectText(b, "input", bp + ".input", &call.arguments_json));
      current.tool_calls.push_back(std::move(call));
    } else if (type == "tool_result" && role == "user") {
      if (!current.content.empty()) out->push_back(current);  // text before the result
      current.content.clear();
      Message tool;
      tool.role = "tool";
      KEEL_RETURN_IF_ERROR(ReadRequiredString(b, "tool_use_id", bp + ".tool_use_id", &tool.tool_call_id));
      KEEL_RETURN_IF_ERROR(ReadBool(b, "is_error", bp + ".is_error", &tool.tool_error));
      if (auto c = b.find("content"); c != b.end() && !c->is_null())
        KEEL_RETURN_IF_ERROR(ReadTextBlocks(*c, bp + ".content", &tool.content));
      out->push_back(std::move(tool));
    } else if ((type == "thinking" || type == "redacted_thinking") && role == "assistant") {
      // Dropped: the gateway does not carry reasoning; Anthropic ignores it in earlier turns.
    } else {
      return Status::InvalidArgument(bp + ".type: " + type + " blocks are not supported in " + role +
                                     " messages");
    }
  }
  // An empty block list (or only empty text) is still a turn.
  if (!current.content.empty() || !current.tool_calls.empty() || out->size() == first)
    out->push_back(std::move(current));
  return Status::Ok();
}

Status ReadTools(const json& body, ChatRequest* req) {
  KEEL_RETURN_IF_ERROR(ForEachTool(body, [&](const json& t, const std::string& path) -> Status {
    std::string type = "custom";
    KEEL_RETURN_IF_ERROR(ReadString(t, "type", path + ".type", &type));
    if (type != "custom")  // server tools (web search, bash, ...) only Anthropic can run
      return Status::InvalidArgument(path + ".type: only custom tools are supported");
    Tool tool;
    KEEL_RETURN_IF_ERROR(ReadRequiredString(t, "name", path + ".name", &tool.name));
    KEEL_RETURN_IF_ERROR(ReadString(t, "description", path + ".description", &tool.description));
    KEEL_RETURN_IF_ERROR(ReadObjectText(t, "input_schema", path + ".input_schema", &tool.parameters_json));
    req->tools.push_back(std::move(tool));
    return Status::Ok();
  }));
  auto tc = body.find("tool_choice");
  if (tc == body.end() || tc->is_null()) return Status::Ok();
  if (!tc->is_object()) return Status::InvalidArgument("tool_choice: expected an object");
  std::string type;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(*tc, "type", "tool_choice.type", &type));
  if (type == "auto" || type == "none") req->tool_choice = type;
  else if (type == "any") req->tool_choice = "required";
  else if (type == "tool") KEEL_RETURN_IF_ERROR(ReadRequiredString(*tc, "name", "tool_choice.name", &req->tool_choice));
  else return Status::InvalidArgument("tool_choice.type: expected auto, any, tool or none");
  std::optional<bool> disable_parallel;
  KEEL_RETURN_IF_ERROR(ReadBool(*tc, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use",
                                &disable_parallel));
  if (disable_parallel) req->parallel_tool_calls = !*disable_parallel;
  return Status::Ok();
}

// One structured-output format object: {type: "json_schema", schema: {...}}. Anthropic decodes
// under the schema's constraint, so it is strict in OpenAI's sense.
Status ReadFormat(const json& f, const std::string& path, ChatRequest* req) {
  if (!f.is_object()) return Status::InvalidArgument(path + ": expected an object");
  std::string type;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(f, "type", path + ".type", &type));
  if (type != "json_schema") return Status::InvalidArgument(path + ".type: expected json_schema");
  if (auto s = f.find("schema"); s == f.end() || s->is_null())
    return Status::InvalidArgument(path + ".schema: required");
  ResponseFormat format;
  format.kind = ResponseFormat::Kind::kJsonSchema;
  format.strict = true;
  KEEL_RETURN_IF_ERROR(ReadObjectText(f, "schema", path + ".schema", &format.schema_json));
  req->response_format = std::move(format);
  return Status::Ok();
}

// Structured output: output_config.format, or the earlier beta's top-level output_format (same
// shape; still accepted by Anthropic). output_config's other settings (effort) cannot be carried
// to other upstreams, so they are refused rather than dropped.
Status ReadOutputFormat(const json& body, ChatRequest* req) {
  if (auto config = body.find("output_config"); config != body.end() && !config->is_null()) {
    if (!config->is_object()) return Status::InvalidArgument("output_config: expected an object");
    for (const auto& [key, value] : config->items())
      if (key != "format" && !value.is_null())
        return Status::InvalidArgument("output_config: only format is supported by the gateway");
    if (auto f = config->find("format"); f != config->end() && !f->is_null())
      KEEL_RETURN_IF_ERROR(ReadFormat(*f, "output_config.format", req));
  }
  if (auto legacy = body.find("output_format"); legacy != body.end() && !legacy->is_null()) {
    if (req->response_format)
      return Status::InvalidArgument("output_format: send output_config.format or output_format, not both");
    KEEL_RETURN_IF_ERROR(ReadFormat(*legacy, "output_format", req));
  }
  return Status::Ok();
}

// Appends `blocks` as a turn of `role`, merging into the previous turn when it has the same
// role: Anthropic requires user and assistant turns to alternate.
void AppendTurn(json* messages, const char* role, json blocks) {
  if (!messages->empty() && messages->back()["role"] == role) {
    for (auto& b : blocks) messages->back()["content"].push_back(std::move(b));
    return;
  }
  messages->push_back({{"role", role}, {"content", std::move(blocks)}});
}

json InputSchema(const std::string& parameters_json) {
  json schema = SchemaObject(parameters_json);
  if (!schema.contains("type")) schema["type"] = "object";  // Anthropic requires an object schema
  return schema;
}

}  // namespace

Result<ChatRequest> ParseAnthropicMessagesRequest(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseObject(text, "request body"));
  ChatRequest req;
  req.client_format = WireFormat::kAnthropicMessages;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(body, "model", "model", &req.model));
  KEEL_RETURN_IF_ERROR(ReadPositiveInt(body, "max_tokens", "max_tokens", &req.max_tokens));
  if (!req.max_tokens) return Status::InvalidArgument("max_tokens: required");
  if (auto s = body.find("system"); s != body.end() && !s->is_null())
    KEEL_RETURN_IF_ERROR(ReadTextBlocks(*s, "system", &req.system));
  auto msgs = body.find("messages");
  if (msgs == body.end() || msgs->is_null()) return Status::InvalidArgument("messages: required");
  if (!msgs->is_array()) return Status::InvalidArgument("messages: expected an array");
  if (msgs->empty()) return Status::InvalidArgument("messages: must not be empty");
  if (msgs->size() > kMaxMessages)
    return Status::InvalidArgument("messages: at most " + std::to_string(kMaxMessages) + " messages");
  for (size_t i = 0; i < msgs->size(); ++i)
    KEEL_RETURN_IF_ERROR(ReadMessage((*msgs)[i], At("messages", i), &req.messages));
  NameToolMessages(&req.messages);
  KEEL_RETURN_IF_ERROR(ReadTools(body, &req));
  KEEL_RETURN_IF_ERROR(ReadNumber(body, "temperature", "temperature", &req.temperature));
  KEEL_RETURN_IF_ERROR(ReadNumber(body, "top_p", "top_p", &req.top_p));
  KEEL_RETURN_IF_ERROR(ReadPositiveInt(body, "top_k", "top_k", &req.top_k));
  KEEL_RETURN_IF_ERROR(ReadStop(body, "stop_sequences", "stop_sequences", false, &req.stop));
  KEEL_RETURN_IF_ERROR(ReadOutputFormat(body, &req));
  KEEL_RETURN_IF_ERROR(ReadBool(body, "stream", "stream", &req.stream));
  if (auto md = body.find("metadata"); md != body.end() && !md->is_null()) {
    if (!md->is_object()) return Status::InvalidArgument("metadata: expected an object");
    KEEL_RETURN_IF_ERROR(ReadString(*md, "user_id", "metadata.user_id", &req.user));
  }
  return req;
}

Result<std::string> BuildAnthropicRequest(const ChatRequest& request, const std::string& model,
                                          int64_t default_max_tokens) {
  constexpr WireFormat kSelf = WireFormat::kAnthropicMessages;
  // No equivalent on Anthropic. A zero penalty is the default, so it asks for nothing.
  if (request.presence_penalty.value_or(0) != 0) return Unsupported("presence_penalty", kSelf);
  if (request.frequency_penalty.value_or(0) != 0) return Unsupported("frequency_penalty", kSelf);
  if (!request.logit_bias_json.empty()) return Unsupported("logit_bias", kSelf);
  // OpenAI's reasoning and strict tools ask for what an Anthropic request here cannot promise.
  if (!request.reasoning_effort.empty()) return Unsupported("reasoning_effort", kSelf);
  for (const Tool& t : request.tools) {
    if (t.strict.value_or(false)) return Unsupported("tools[].function.strict", kSelf);
  }
  // JSON without a schema: Anthropic only constrains output to a given schema.
  if (request.response_format && request.response_format->kind == ResponseFormat::Kind::kJsonObject)
    return Status::InvalidArgument(
        "response_format: json_object is not supported by anthropic upstreams (json_schema is)");
  json body = {{"model", model}, {"max_tokens", request.max_tokens.value_or(default_max_tokens)}};
  if (!request.system.empty()) body["system"] = request.system;
  json messages = json::array();
  const auto& turns = EffectiveMessages(request);
  for (size_t i = 0; i < turns.size(); ++i) {
    const Message& m = turns[i];
    json blocks = json::array();
    // Anthropic rejects empty text blocks, and an empty turn anywhere but last ("all messages
    // must have non-empty content except for the optional final assistant message"): an empty
    // turn says nothing, so it is left out and its neighbours merge (AppendTurn).
    if (!m.content.empty() && m.role != "tool") blocks.push_back({{"type", "text"}, {"text", m.content}});
    if (m.role != "tool" && m.tool_calls.empty() && blocks.empty() && i + 1 < turns.size()) continue;
    if (m.role == "assistant") {
      for (const ToolCall& c : m.tool_calls)
        blocks.push_back({{"type", "tool_use"}, {"id", c.id}, {"name", c.name},
                          {"input", ArgumentsObject(c.arguments_json)}});
      AppendTurn(&messages, "assistant", std::move(blocks));
    } else if (m.role == "tool") {
      blocks.push_back({{"type", "tool_result"}, {"tool_use_id", m.tool_call_id}, {"content", m.content}});
      if (m.tool_error) blocks.back()["is_error"] = true;  // the model is told the call failed
      AppendTurn(&messages, "user", std::move(blocks));
    } else {
      AppendTurn(&messages, "user", std::move(blocks));
    }
  }
  // A turn left without blocks (empty text) would be rejected; an empty string says the same.
  for (auto& turn : messages)
    if (turn["content"].empty()) turn["content"] = "";
  body["messages"] = std::move(messages);
  if (!request.tools.empty()) {
    json tools = json::array();
    for (const Tool& t : request.tools) {
      json tool = {{"name", t.name}, {"input_schema", InputSchema(t.parameters_json)}};
      if (!t.description.empty()) tool["description"] = t.description;
      tools.push_back(std::move(tool));
    }
    body["tools"] = std::move(tools);
    const std::string& tc = request.tool_choice;
    json choice;
    if (tc == "auto" || tc == "none") choice = {{"type", tc}};
    else if (tc == "required") choice = {{"type", "any"}};
    else if (!tc.empty()) choice = {{"type", "tool"}, {"name", tc}};
    // Anthropic's switch for parallel calls lives in tool_choice ("none" makes no calls at all).
    if (request.parallel_tool_calls && !*request.parallel_tool_calls && tc != "none") {
      if (choice.is_null()) choice = {{"type", "auto"}};
      choice["disable_parallel_tool_use"] = true;
    }
    if (!choice.is_null()) body["tool_choice"] = std::move(choice);
  }
  if (request.temperature) body["temperature"] = *request.temperature;
  if (request.top_p) body["top_p"] = *request.top_p;
  if (request.top_k) body["top_k"] = *request.top_k;
  if (!request.stop.empty()) body["stop_sequences"] = request.stop;
  if (request.response_format && request.response_format->kind == ResponseFormat::Kind::kJsonSchema) {
    body["output_config"] = {
        {"format", {{"type", "json_schema"}, {"schema", SchemaObject(request.response_format->schema_json)}}}};
  }
  if (request.stream) body["stream"] = true;
  if (!request.user.empty()) body["metadata"] = {{"user_id", request.user}};
  return Dump(body);
}

Result<ChatResponse> ParseAnthropicResponse(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseUpstreamObject(text));
  if (StringOr(body, "type") == "error") {
    std::string message = "unknown error";
    if (auto e = body.find("error"); e != body.end() && e->is_object())
      message = StringOr(*e, "message", message);
    return Status::Corruption("upstream response: error: " + message);
  }
  auto content = body.find("content");
  if (content == body.end() || !content->is_array())
    return Status::Corruption("upstream response: content: expected an array");
  ChatResponse out;
  ReadString(body, "id", "id", &out.id).ok();  // informational: wrong types ignored
  ReadString(body, "model", "model", &out.model).ok();
  for (const json& b : *content) {
    if (!b.is_object()) return Status::Corruption("upstream response: content: expected objects");
    const std::string type = StringOr(b, "type");
    if (type == "text" && b.contains("text") && b["text"].is_string()) {
      out.content += b["text"].get<std::string>();
    } else if (type == "tool_use") {
      ToolCall call;
      call.id = StringOr(b, "id");
      call.name = StringOr(b, "name");
      auto input = b.find("input");
      call.arguments_json = input != b.end() && !input->is_null() ? Dump(*input) : "{}";
      if (call.name.empty()) return Status::Corruption("upstream response: tool_use block without a name");
      if (call.id.empty()) call.id = "toolu_" + std::to_string(out.tool_calls.size());
      out.tool_calls.push_back(std::move(call));
    }  // thinking and server-tool blocks carry nothing the gateway forwards
  }
  std::string stop;
  ReadString(body, "stop_reason", "stop_reason", &stop).ok();
  out.finish = ParseAnthropicFinishReason(stop);
  if (stop == "stop_sequence") ReadString(body, "stop_sequence", "stop_sequence", &out.stop_sequence).ok();
  if (auto u = body.find("usage"); u != body.end() && u->is_object()) {
    // Cached prompt tokens are reported apart from input_tokens; the prompt is their sum.
    auto count = [&](const char* key) -> int64_t {
      auto it = u->find(key);
      return it != u->end() && it->is_number_integer() ? it->get<int64_t>() : -1;
    };
    const int64_t in = count("input_tokens");
    if (in >= 0)
      out.usage.input_tokens = in + std::max<int64_t>(count("cache_creation_input_tokens"), 0) +
                               std::max<int64_t>(count("cache_read_input_tokens"), 0);
    out.usage.output_tokens = count("output_tokens");
  }
  return out;
}

std::string BuildAnthropicResponse(const ChatResponse& response, const std::string& model) {
  json content = json::array();
  if (!response.content.empty()) content.push_back({{"type", "text"}, {"text", response.content}});
  for (const ToolCall& c : response.tool_calls)
    content.push_back({{"type", "tool_use"}, {"id", c.id}, {"name", c.name},
                       {"input", ArgumentsObject(c.arguments_json)}});
  // A stop sequence is reported only when the upstream said which one matched.
  const bool by_sequence = response.finish == FinishReason::kStop && !response.stop_sequence.empty();
  const char* stop =
      by_sequence ? "stop_sequence" : AnthropicFinishReasonName(response.finish);
  json body = {{"id", PrefixedId(response.id, "msg_")},
               {"type", "message"},
               {"role", "assistant"},
               {"model", model},
               {"content", std::move(content)},
               {"stop_reason", *stop ? json(stop) : json(nullptr)},
               {"stop_sequence", by_sequence ? json(response.stop_sequence) : json(nullptr)},
               // Anthropic clients require both counts; unknown is reported as 0. The cache counts
               // and service tier are required (nullable) members of the SDKs' Usage type; the
               // gateway does not carry them, so they are null.
               {"usage", {{"input_tokens", std::max<int64_t>(response.usage.input_tokens, 0)},
                          {"output_tokens", std::max<int64_t>(response.usage.output_tokens, 0)},
                          {"cache_creation_input_tokens", nullptr},
                          {"cache_read_input_tokens", nullptr},
                          {"service_tier", nullptr}}}};
  return Dump(body);
}

}  // namespace keel::gateway
