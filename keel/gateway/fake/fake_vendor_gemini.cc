// The fake Gemini API (Generative Language API, v1beta): models/{model}:generateContent and
// :streamGenerateContent. With ?alt=sse the stream is SSE "data: <GenerateContentResponse>\r\n\r\n"
// events (no event names, no terminator; the last carries finishReason and full usageMetadata);
// without it, a JSON array streamed element by element. Errors are
// {"error":{"code","message","status"}}. Like the real API, it rejects unknown field names.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/gateway/fake_vendor_internal.h"

namespace keel::gateway::fake {
namespace {

constexpr std::string_view kJson = "application/json; charset=UTF-8";

const char* StatusName(int status) {
  switch (status) {
    case 400: return "INVALID_ARGUMENT";
    case 401: return "UNAUTHENTICATED";
    case 403: return "PERMISSION_DENIED";
    case 404: return "NOT_FOUND";
    case 405: return "INVALID_ARGUMENT";
    case 413: return "INVALID_ARGUMENT";
    case 429: return "RESOURCE_EXHAUSTED";
    case 500: return "INTERNAL";
    case 503: return "UNAVAILABLE";
    case 504: return "DEADLINE_EXCEEDED";
    default: return status >= 500 ? "INTERNAL" : "INVALID_ARGUMENT";
  }
}

Json ErrorJson(int status, std::string_view message) {
  return {{"error", {{"code", status}, {"message", message}, {"status", StatusName(status)}}}};
}

struct GeminiExchange {
  Exchange& ex;

  HttpHeaderList Headers(HttpHeaderList extra = {}) const {
    HttpHeaderList h = {{"server-timing", "gfet4t7; dur=" + std::to_string(static_cast<int64_t>(ex.ElapsedMs()))},
                        {"vary", "Origin, X-Origin, Referer"}};
    for (auto& kv : extra) h.push_back(std::move(kv));
    return h;
  }
  void Error(int status, std::string_view message, Json details = nullptr, HttpHeaderList extra = {}) {
    Json j = ErrorJson(status, message);
    if (!details.is_null()) j["error"]["details"] = std::move(details);
    ex.Send(status, kJson, Dump(j), Headers(std::move(extra)));
  }
};

// The value of `name` in a query string ("" when absent); %XX decoded.
std::string QueryParam(std::string_view query, std::string_view name) {
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    size_t eq = kv.find('=');
    if (kv.substr(0, eq) != name) continue;
    std::string out;
    std::string_view v = eq == std::string_view::npos ? std::string_view() : kv.substr(eq + 1);
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] == '%' && i + 2 < v.size()) {
        out += static_cast<char>(std::stoi(std::string(v.substr(i + 1, 2)), nullptr, 16));
        i += 2;
      } else {
        out += v[i] == '+' ? ' ' : v[i];
      }
    }
    return out;
  }
  return "";
}

bool CheckAuth(GeminiExchange& ge) {
  std::string key(ge.ex.req.headers.Get("x-goog-api-key"));
  if (key.empty()) key = QueryParam(ge.ex.req.query, "key");
  if (key.empty()) {
    ge.Error(403,
             "Method doesn't allow unregistered callers (callers without established identity). Please use API Key or "
             "other form of API consumer identity to call this API.");
    return false;
  }
  const std::string& want = ge.ex.options().api_key;
  if (!want.empty() && key != want) {
    ge.Error(400, "API key not valid. Please pass a valid API key.",
             Json::array({{{"@type", "type.googleapis.com/google.rpc.ErrorInfo"},
                           {"reason", "API_KEY_INVALID"},
                           {"domain", "googleapis.com"},
                           {"metadata", {{"service", "generativelanguage.googleapis.com"}}}}}));
    return false;
  }
  return true;
}

// Proto JSON accepts lowerCamelCase and the proto's snake_case names alike.
std::string CamelCase(std::string_view name) {
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '_' && i + 1 < name.size()) {
      out += static_cast<char>(std::toupper(static_cast<unsigned char>(name[++i])));
    } else {
      out += name[i];
    }
  }
  return out;
}

// The member `camel` under either spelling.
const Json* Field(const Json& obj, const std::string& camel) {
  if (const Json* m = Member(obj, camel.c_str())) return m;
  std::string snake;
  for (char c : camel) {
    if (std::isupper(static_cast<unsigned char>(c))) {
      snake += '_';
      snake += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else {
      snake += c;
    }
  }
  return Member(obj, snake.c_str());
}

// The first member of `obj` whose name is not in `known` (camelCase), or "".
std::string UnknownField(const Json& obj, std::initializer_list<std::string_view> known) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    std::string camel = CamelCase(it.key());
    if (std::find(known.begin(), known.end(), camel) == known.end()) return it.key();
  }
  return "";
}

size_t PartsBytes(const Json& parts, std::string* text, bool* function_response) {
  size_t n = 0;
  if (!parts.is_array()) return 0;
  for (const auto& part : parts) {
    if (const Json* t = StringMember(part, "text")) {
      n += t->get_ref<const std::string&>().size();
      if (text) *text += t->get<std::string>();
    }
    if (const Json* fc = Field(part, "functionCall")) n += Dump(*fc).size();
    if (const Json* fr = Field(part, "functionResponse")) {
      n += Dump(*fr).size();
      if (function_response) *function_response = true;
    }
  }
  return n;
}

// generationConfig's sampling and output-format fields, typed as the proto's JSON mapping types
// them, and structured output honoured: application/json answers an instance of
// responseJsonSchema (JSON Schema) or responseSchema (OpenAPI subset), text/x.enum the first
// enum value. Penalties and topK do not change the fake's answer. "" when valid, else the error.
std::string GenerationConfigProblem(const Json& gc, Prompt& p) {
  // int32 in proto JSON: an integer, or a number with no fraction.
  auto int32 = [](const Json& v) {
    if (v.is_number_integer()) return true;
    return v.is_number_float() && v.get<double>() == std::trunc(v.get<double>());
  };
  if (const Json* k = Field(gc, "topK"); k && !int32(*k)) {
    return "Invalid value at 'generation_config.top_k' (TYPE_INT32), " + Dump(*k);
  }
  for (auto [camel, snake] : {std::pair{"temperature", "temperature"}, std::pair{"topP", "top_p"},
                               std::pair{"presencePenalty", "presence_penalty"},
                               std::pair{"frequencyPenalty", "frequency_penalty"}}) {
    const Json* v = Field(gc, camel);
    if (v && !v->is_number()) {
      return std::string("Invalid value at 'generation_config.") + snake + "' (TYPE_FLOAT), " + Dump(*v);
    }
  }
  std::string mime = "text/plain";
  if (const Json* m = Field(gc, "responseMimeType")) {
    if (!m->is_string()) return "Invalid value at 'generation_config.response_mime_type' (TYPE_STRING), " + Dump(*m);
    mime = m->get<std::string>();
    static constexpr std::string_view kMimes[] = {"text/plain", "application/json", "application/xml",
                                                  "application/yaml", "text/x.enum"};
    if (std::find(std::begin(kMimes), std::end(kMimes), mime) == std::end(kMimes)) {
      return "* GenerateContentRequest.generation_config.response_mime_type: allowed mimetypes are `text/plain`, "
             "`application/json`, `application/xml`, `application/yaml` and `text/x.enum`.\n";
    }
  }
  const Json* schema = Field(gc, "responseSchema");
  const Json* json_schema = Field(gc, "responseJsonSchema");
  if (schema && json_schema) {
    return "* GenerateContentRequest.generation_config.response_schema: only one of response_schema and "
           "response_json_schema may be set.\n";
  }
  if (schema && !schema->is_object()) {
    return "Invalid value at 'generation_config.response_schema' "
           "(type.googleapis.com/google.ai.generativelanguage.v1beta.Schema), " + Dump(*schema);
  }
  const char* schema_field = schema ? "response_schema" : "response_json_schema";
  if (!schema) schema = json_schema;
  if (schema && mime != "application/json" && mime != "text/x.enum") {
    return std::string("* GenerateContentRequest.generation_config.") + schema_field +
           ": response_mime_type must be application/json or text/x.enum when a response schema is set.\n";
  }
  if (mime == "application/json") {
    p.json_answer = true;
    if (schema) p.schema = *schema;
  } else if (mime == "text/x.enum" && schema) {
    p.enum_answer = true;
    p.schema = *schema;
  }
  return "";
}

bool ParseRequest(GeminiExchange& ge, const Json& body, Prompt& p) {
  auto fail = [&](const std::string& m) {
    ge.Error(400, m);
    return false;
  };
  if (std::string u = UnknownField(body, {"contents", "tools", "toolConfig", "safetySettings", "systemInstruction",
                                          "generationConfig", "cachedContent", "model", "labels"});
      !u.empty()) {
    return fail("Invalid JSON payload received. Unknown name \"" + u + "\": Cannot find field.");
  }
  const Json* contents = Field(body, "contents");
  if (!contents || !contents->is_array() || contents->empty()) {
    return fail("* GenerateContentRequest.contents: contents is not specified\n");
  }
  for (size_t i = 0; i < contents->size(); ++i) {
    const Json& c = (*contents)[i];
    const Json* parts = ArrayMember(c, "parts");
    if (!parts || parts->empty()) {
      return fail("* GenerateContentRequest.contents[" + std::to_string(i) + "].parts: contents.parts must not be empty.\n");
    }
    const Json* role = StringMember(c, "role");
    if (role && *role != "user" && *role != "model" && *role != "function") {
      return fail("Please use a valid role: user, model.");
    }
    std::string text;
    bool function_response = false;
    p.text_bytes += PartsBytes(*parts, &text, &function_response);
    if ((!role || *role == "user") && !text.empty()) p.last_user_text = text;
    p.last_is_tool_result = function_response;
  }
  if (const Json* si = Field(body, "systemInstruction")) {
    if (const Json* parts = ArrayMember(*si, "parts")) p.text_bytes += PartsBytes(*parts, nullptr, nullptr);
  }
  if (const Json* gc = Field(body, "generationConfig")) {
    if (!gc->is_object()) return fail("Invalid JSON payload received. Unknown name \"generationConfig\": Proto field is not repeating, cannot start list.");
    if (std::string u = UnknownField(
            *gc, {"stopSequences", "responseMimeType", "responseSchema", "responseJsonSchema", "responseModalities",
                  "candidateCount", "maxOutputTokens", "temperature", "topP", "topK", "seed", "presencePenalty",
                  "frequencyPenalty", "responseLogprobs", "logprobs", "enableEnhancedCivicAnswers", "speechConfig",
                  "thinkingConfig", "mediaResolution"});
        !u.empty()) {
      return fail("Invalid JSON payload received. Unknown name \"" + u + "\" at 'generation_config': Cannot find field.");
    }
    if (const Json* mt = Field(*gc, "maxOutputTokens")) {
      if (!mt->is_number_integer()) {
        return fail("Invalid value at 'generation_config.max_output_tokens' (TYPE_INT32), " + Dump(*mt));
      }
      if (mt->get<int64_t>() > 0) p.max_tokens = mt->get<int64_t>();
    }
    if (const Json* ss = Field(*gc, "stopSequences")) {
      if (!ss->is_array()) return fail("Invalid value at 'generation_config.stop_sequences' (TYPE_STRING)");
      for (size_t i = 0; i < ss->size(); ++i) {
        const Json& s = (*ss)[i];
        if (!s.is_string()) {
          return fail("Invalid value at 'generation_config.stop_sequences[" + std::to_string(i) + "]' (TYPE_STRING), " +
                      Dump(s));
        }
        p.stop.push_back(s.get<std::string>());
      }
    }
    if (std::string e = GenerationConfigProblem(*gc, p); !e.empty()) return fail(e);
  }
  if (const Json* tools = Field(body, "tools")) {
    if (tools->is_array()) {
      for (const auto& t : *tools) {
        const Json* decls = Field(t, "functionDeclarations");
        if (!decls || !decls->is_array()) continue;
        for (const auto& d : *decls) {
          const Json* name = StringMember(d, "name");
          if (!name) return fail("* GenerateContentRequest.tools[0].function_declarations[0].name: Name is empty.\n");
          p.tools.push_back(name->get<std::string>());
        }
      }
    }
  }
  if (const Json* tc = Field(body, "toolConfig")) {
    if (const Json* fcc = Field(*tc, "functionCallingConfig")) {
      const Json* mode = StringMember(*fcc, "mode");
      p.tool_choice_none = mode && *mode == "NONE";
    }
  }
  return true;
}

Json UsageJson(const Plan& plan, bool final) {
  Json u = {{"promptTokenCount", plan.input_tokens}};
  if (final) u["candidatesTokenCount"] = plan.output_tokens;
  u["totalTokenCount"] = plan.input_tokens + (final ? plan.output_tokens : 0);
  u["promptTokensDetails"] = Json::array({{{"modality", "TEXT"}, {"tokenCount", plan.input_tokens}}});
  return u;
}

const char* FinishName(Finish f) { return f == Finish::kLength ? "MAX_TOKENS" : "STOP"; }

void Generate(GeminiExchange& ge, const std::string& model, bool stream) {
  Exchange& ex = ge.ex;
  Json body = Json::parse(ex.req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    ge.Error(400, "Invalid JSON payload received. Unexpected token.");
    return;
  }
  Prompt p;
  p.model = model;
  p.stream = stream;
  if (!ParseRequest(ge, body, p)) return;
  Switches sw = ParseSwitches(model);
  if (sw.slow) {
    if (!ex.SleepMs(ex.options().slow_ms)) return;
    ex.RestartClock();
  }
  switch (sw.error_status) {
    case 429:
      ge.Error(429,
               "You exceeded your current quota, please check your plan and billing details. For more information on "
               "this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.",
               Json::array({{{"@type", "type.googleapis.com/google.rpc.RetryInfo"}, {"retryDelay", "1s"}}}),
               {{"retry-after", "1"}});
      return;
    case 500:
      ge.Error(500, "An internal error has occurred. Please retry or report in "
                    "https://developers.generativeai.google/guide/troubleshooting");
      return;
    case 503: ge.Error(503, "The model is overloaded. Please try again later."); return;
    default: break;
  }
  const bool sse = QueryParam(ex.req.query, "alt") == "sse";
  const std::string_view content_type = stream && sse ? std::string_view("text/event-stream") : kJson;
  if (sw.garbage) {
    if (!ex.AwaitToken(0)) return;
    if (!stream) {
      ex.Send(200, kJson, std::string(kGarbageBody), ge.Headers());
    } else if (ex.Begin(content_type, ge.Headers())) {
      ex.Write(sse ? "data: {\"candidates\": [{\"content\": not json\r\n\r\n" : "[{\"candidates\": [{\"content\": not json");
    }
    return;
  }

  Plan plan = MakePlan(p, sw, ex.options().reply_tokens);
  const std::string response_id = ex.impl.NewId("", 23);
  const bool tool = plan.finish == Finish::kToolCall;
  // One GenerateContentResponse: `parts` of the model's turn, final or not.
  auto response = [&](Json parts, bool final) {
    Json cand = {{"content", {{"parts", std::move(parts)}, {"role", "model"}}}};
    if (final) cand["finishReason"] = FinishName(plan.finish);
    cand["index"] = 0;
    return Json{{"candidates", Json::array({std::move(cand)})},
                {"usageMetadata", UsageJson(plan, final)},
                {"modelVersion", model},
                {"responseId", response_id}};
  };
  auto text_part = [](std::string text) { return Json::array({{{"text", std::move(text)}}}); };
  const Json call_part = tool ? Json::array({{{"functionCall", {{"name", plan.tool_name}, {"args", Json::parse(plan.tool_arguments)}}}}})
                              : Json();

  if (!stream) {
    if (!ex.AwaitAll(tool ? 1 : plan.pieces.size())) return;
    std::string text = Dump(response(tool ? call_part : text_part(plan.Text()), true));
    ex.CountTokens(plan.output_tokens);
    if (sw.truncate) {
      if (ex.Begin(kJson, ge.Headers()) && ex.Write(std::string_view(text).substr(0, text.size() / 2))) ex.Cut();
      return;
    }
    ex.Send(200, kJson, std::move(text), ge.Headers());
    return;
  }

  // Each element of the stream, framed as SSE or as a JSON array.
  size_t sent = 0;
  auto emit = [&](const Json& r) {
    std::string data = sse ? "data: " + Dump(r) + "\r\n\r\n" : (sent == 0 ? "[" : ",\r\n") + Dump(r);
    ++sent;
    return ex.Write(data);
  };
  if (!ex.AwaitToken(0) || !ex.Begin(content_type, ge.Headers())) return;
  if (tool) {
    // Gemini sends a function call whole, in the final response.
    if (sw.truncate) {
      ex.Cut();
      return;
    }
    if (!emit(response(call_part, true))) return;
    ex.CountTokens(plan.output_tokens);
  } else {
    // One word per response; the last word rides in the final response with finishReason.
    const size_t n = plan.pieces.size();
    const size_t send = sw.truncate ? plan.TruncatedCount() : n;
    for (size_t i = 0; i < send; ++i) {
      if (!ex.AwaitToken(i)) return;
      const bool final = !sw.truncate && i + 1 == n;
      if (!emit(response(text_part(plan.pieces[i]), final))) return;
      ex.CountTokens(1);
    }
    if (sw.truncate) {
      ex.Cut();
      return;
    }
    if (n == 0 && !emit(response(text_part(""), true))) return;
  }
  if (!sse) ex.Write("]");
}

Json ModelJson(std::string_view id) {
  return {{"name", "models/" + std::string(id)},
          {"version", "001"},
          {"displayName", id},
          {"inputTokenLimit", 1048576},
          {"outputTokenLimit", 8192},
          {"supportedGenerationMethods", Json::array({"generateContent", "countTokens"})}};
}

}  // namespace

std::string GeminiErrorBody(int status, std::string_view message) { return Dump(ErrorJson(status, message)); }

void ServeGemini(Exchange& ex) {
  GeminiExchange ge{ex};
  std::string_view path = ex.req.path;
  std::string_view rest;
  for (std::string_view prefix : {"/v1beta/models", "/v1/models"}) {
    if (path.substr(0, prefix.size()) == prefix && (path.size() == prefix.size() || path[prefix.size()] == '/')) {
      rest = path.substr(prefix.size());
      break;
    }
  }
  if (rest.empty() && path != "/v1beta/models" && path != "/v1/models") {
    ge.Error(404, "Requested entity was not found.");
    return;
  }
  if (!CheckAuth(ge)) return;
  if (rest.empty()) {
    if (ex.req.method != "GET") {
      ge.Error(405, "Method not allowed.");
      return;
    }
    Json models = Json::array();
    for (const char* id : {"gemini-2.0-flash", "gemini-2.5-flash", "gemini-2.5-pro", "text-embedding-004"}) {
      models.push_back(ModelJson(id));
    }
    ex.Send(200, kJson, Dump({{"models", std::move(models)}}), ge.Headers());
    return;
  }
  rest.remove_prefix(1);  // the '/'
  size_t colon = rest.find(':');
  std::string model(rest.substr(0, colon));
  std::string_view method = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
  if (model.empty() || model.find('/') != std::string::npos) {
    ge.Error(404, "Requested entity was not found.");
    return;
  }
  if (method.empty()) {
    if (ex.req.method != "GET") {
      ge.Error(405, "Method not allowed.");
      return;
    }
    ex.Send(200, kJson, Dump(ModelJson(model)), ge.Headers());
    return;
  }
  if (method != "generateContent" && method != "streamGenerateContent") {
    ge.Error(404, "Method " + std::string(method) + " not found for model models/" + model + ".");
    return;
  }
  if (ex.req.method != "POST") {
    ge.Error(405, "Method not allowed.");
    return;
  }
  Generate(ge, model, method == "streamGenerateContent");
}

}  // namespace keel::gateway::fake
