// Google Gemini generateContent: upstream requests out, upstream responses in, and the
// GenerateContentResponse the Gemini front answers with.
#include "keel/gateway/vendors/gemini/gemini_front.h"
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendors/gemini/gemini.h"

namespace keel::gateway {

using namespace internal;  // NOLINT: the helpers are this file's vocabulary

namespace {

// Gemini's `parameters` is an OpenAPI subset: JSON Schema keywords it does not know make the
// whole request fail, so the common ones clients send are removed (recursively, through the
// keywords that hold sub-schemas; property *names* are never touched).
void ScrubSchema(json* schema) {
  if (!schema->is_object()) return;
  for (const char* key : {"$schema", "$id", "$comment", "additionalProperties", "strict"}) schema->erase(key);
  if (auto p = schema->find("properties"); p != schema->end() && p->is_object())
    for (auto& [name, sub] : p->items()) ScrubSchema(&sub);
  if (auto i = schema->find("items"); i != schema->end()) ScrubSchema(&*i);
  for (const char* key : {"anyOf", "oneOf", "allOf"})
    if (auto a = schema->find(key); a != schema->end() && a->is_array())
      for (auto& sub : *a) ScrubSchema(&sub);
}

// A tool result as functionResponse.response, which must be an object.
json ResponseObject(const std::string& content) {
  Result<json> j = ParseUntrustedJson(content, kClientJsonLimits);
  if (j.ok()) return std::move(j).value();
  return json{{"result", content}};
}

// Merges into the previous content when the role repeats: Gemini wants alternating turns, and
// all function responses for one model turn in a single content.
void AppendContent(json* contents, const char* role, json parts) {
  if (parts.empty()) return;  // Gemini rejects contents without parts
  if (!contents->empty() && contents->back()["role"] == role) {
    for (auto& p : parts) contents->back()["parts"].push_back(std::move(p));
    return;
  }
  contents->push_back({{"role", role}, {"parts", std::move(parts)}});
}

json FunctionDeclarations(const std::vector<Tool>& tools) {
  json decls = json::array();
  for (const Tool& t : tools) {
    json decl = {{"name", t.name}};
    if (!t.description.empty()) decl["description"] = t.description;
    json schema = SchemaObject(t.parameters_json);
    ScrubSchema(&schema);
    // An object schema without properties is rejected ("should be non-empty for OBJECT type").
    auto props = schema.find("properties");
    if (props != schema.end() && props->is_object() && !props->empty()) decl["parameters"] = std::move(schema);
    decls.push_back(std::move(decl));
  }
  return decls;
}

int64_t CountOr(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_number_integer() ? it->get<int64_t>() : -1;
}

}  // namespace

Result<std::string> BuildGeminiRequest(const ChatRequest& request) {
  if (!request.logit_bias_json.empty()) return Unsupported("logit_bias", WireFormat::kGemini);
  if (!request.reasoning_effort.empty()) return Unsupported("reasoning_effort", WireFormat::kGemini);
  for (const Tool& t : request.tools) {
    if (t.strict.value_or(false)) return Unsupported("tools[].function.strict", WireFormat::kGemini);
  }
  // Gemini has no switch for parallel function calls; true (the default) asks for nothing.
  const bool calls_possible = !request.tools.empty() && request.tool_choice != "none";
  if (calls_possible && request.parallel_tool_calls && !*request.parallel_tool_calls)
    return Status::InvalidArgument("parallel_tool_calls: false is not supported by gemini upstreams");
  json body = json::object();
  if (!request.system.empty()) body["systemInstruction"] = {{"parts", json::array({{{"text", request.system}}})}};
  const std::vector<Message> messages = EffectiveMessages(request);
  json contents = json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const Message& m = messages[i];
    json parts = json::array();
    if (m.role == "tool") {
      parts.push_back({{"functionResponse",
                        {{"name", ToolNameFor(messages, i)}, {"response", ResponseObject(m.content)}}}});
      AppendContent(&contents, "user", std::move(parts));
      continue;
    }
    if (!m.content.empty()) parts.push_back({{"text", m.content}});
    for (const ToolCall& c : m.tool_calls)
      parts.push_back({{"functionCall", {{"name", c.name}, {"args", ArgumentsObject(c.arguments_json)}}}});
    AppendContent(&contents, m.role == "assistant" ? "model" : "user", std::move(parts));
  }
  body["contents"] = std::move(contents);
  if (!request.tools.empty()) {
    body["tools"] = json::array({{{"functionDeclarations", FunctionDeclarations(request.tools)}}});
    const std::string& tc = request.tool_choice;
    json config;
    if (tc == "auto") config = {{"mode", "AUTO"}};
    else if (tc == "none") config = {{"mode", "NONE"}};
    else if (tc == "required") config = {{"mode", "ANY"}};
    else if (!tc.empty()) config = {{"mode", "ANY"}, {"allowedFunctionNames", json::array({tc})}};
    if (!config.is_null()) body["toolConfig"] = {{"functionCallingConfig", std::move(config)}};
  }
  json gen = json::object();
  if (request.max_tokens) gen["maxOutputTokens"] = *request.max_tokens;
  if (request.temperature) gen["temperature"] = *request.temperature;
  if (request.top_p) gen["topP"] = *request.top_p;
  // Gemini's seed is an int32; a wider one cannot be expressed and is dropped like Anthropic's
  // (which has no seed at all).
  if (request.seed && *request.seed >= INT32_MIN && *request.seed <= INT32_MAX) gen["seed"] = *request.seed;
  if (!request.stop.empty()) gen["stopSequences"] = request.stop;
  if (request.top_k) gen["topK"] = *request.top_k;
  // Zero is the default; some Gemini models refuse any penalty field, so a zero one is not sent.
  if (request.presence_penalty.value_or(0) != 0) gen["presencePenalty"] = *request.presence_penalty;
  if (request.frequency_penalty.value_or(0) != 0) gen["frequencyPenalty"] = *request.frequency_penalty;
  if (request.response_format) {
    switch (request.response_format->kind) {
      case ResponseFormat::Kind::kText: break;  // Gemini's default (text/plain)
      case ResponseFormat::Kind::kJsonObject: gen["responseMimeType"] = "application/json"; break;
      case ResponseFormat::Kind::kJsonSchema:
        // responseJsonSchema takes JSON Schema as clients write it (responseSchema wants
        // Gemini's OpenAPI subset). Gemini has no schema name or strict flag; it always
        // constrains to the schema.
        gen["responseMimeType"] = "application/json";
        gen["responseJsonSchema"] = SchemaObject(request.response_format->schema_json);
        break;
    }
  }
  if (!gen.empty()) body["generationConfig"] = std::move(gen);
  return Dump(body);
}

Result<ChatResponse> ParseGeminiResponse(std::string_view text) {
  KEEL_ASSIGN_OR_RETURN(json body, ParseUpstreamObject(text));
  if (auto e = body.find("error"); e != body.end() && e->is_object())
    return Status::Corruption("upstream response: error: " + StringOr(*e, "message", "unknown error"));
  ChatResponse out;
  out.id = StringOr(body, "responseId");
  out.model = StringOr(body, "modelVersion");
  if (auto u = body.find("usageMetadata"); u != body.end() && u->is_object()) {
    out.usage.input_tokens = CountOr(*u, "promptTokenCount");
    // Thinking tokens are billed as output but reported apart.
    const int64_t candidates = CountOr(*u, "candidatesTokenCount");
    const int64_t thoughts = CountOr(*u, "thoughtsTokenCount");
    if (candidates >= 0 || thoughts >= 0)
      out.usage.output_tokens = std::max<int64_t>(candidates, 0) + std::max<int64_t>(thoughts, 0);
  }
  auto candidates = body.find("candidates");
  if (candidates == body.end() || !candidates->is_array() || candidates->empty()) {
    // A blocked prompt has no candidates, only promptFeedback.blockReason.
    auto feedback = body.find("promptFeedback");
    if (feedback != body.end() && feedback->is_object() && feedback->contains("blockReason")) {
      out.finish = FinishReason::kContentFilter;
      return out;
    }
    return Status::Corruption("upstream response: candidates: expected a non-empty array");
  }
  const json& cand = (*candidates)[0];
  if (!cand.is_object()) return Status::Corruption("upstream response: candidates[0]: expected an object");
  if (auto content = cand.find("content"); content != cand.end() && content->is_object()) {
    auto parts = content->find("parts");
    if (parts != content->end() && parts->is_array()) {
      for (const json& p : *parts) {
        if (!p.is_object()) continue;
        if (auto t = p.find("thought"); t != p.end() && t->is_boolean() && t->get<bool>()) continue;
        if (auto t = p.find("text"); t != p.end() && t->is_string()) out.content += t->get<std::string>();
        auto fc = p.find("functionCall");
        if (fc == p.end() || !fc->is_object()) continue;
        ToolCall call;
        // Gemini gives no call ids (Vertex sometimes does); the index makes them deterministic.
        call.id = StringOr(*fc, "id", "call_" + std::to_string(out.tool_calls.size()));
        call.name = StringOr(*fc, "name");
        if (call.name.empty()) return Status::Corruption("upstream response: functionCall without a name");
        auto args = fc->find("args");
        call.arguments_json = args != fc->end() && !args->is_null() ? Dump(*args) : "{}";
        out.tool_calls.push_back(std::move(call));
      }
    }
  }
  out.finish = ParseGeminiFinishReason(StringOr(cand, "finishReason"));
  // Gemini ends a tool-calling turn with STOP; the calls are what say it was one.
  if (!out.tool_calls.empty() && (out.finish == FinishReason::kStop || out.finish == FinishReason::kNone))
    out.finish = FinishReason::kToolCalls;
  return out;
}

std::string BuildGeminiClientResponse(const ChatResponse& response, const std::string& model) {
  json parts = json::array();
  if (!response.content.empty() || response.tool_calls.empty()) parts.push_back({{"text", response.content}});
  for (const ToolCall& c : response.tool_calls)
    parts.push_back({{"functionCall", {{"name", c.name}, {"args", ArgumentsObject(c.arguments_json)}}}});
  json body = {{"candidates", json::array({{{"content", {{"role", "model"}, {"parts", std::move(parts)}}},
                                            {"finishReason", GeminiFinishReasonName(response.finish)},
                                            {"index", 0}}})},
               {"modelVersion", model},
               {"responseId", response.id.empty() ? NewId("") : response.id}};
  if (response.usage.input_tokens >= 0 || response.usage.output_tokens >= 0) {
    const int64_t in = std::max<int64_t>(response.usage.input_tokens, 0);
    const int64_t out = std::max<int64_t>(response.usage.output_tokens, 0);
    body["usageMetadata"] = {{"promptTokenCount", in}, {"candidatesTokenCount", out}, {"totalTokenCount", in + out}};
  }
  return Dump(body);
}

}  // namespace keel::gateway
