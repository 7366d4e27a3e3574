// The fake OpenAI API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, in
// OpenAI's documented shapes. Streams are SSE "data: <json>\n\n" lines ending "data: [DONE]";
// errors are {"error":{"message","type","param","code"}}.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/gateway/fake_vendor_internal.h"

namespace keel::gateway::fake {
namespace {

constexpr std::string_view kSse = "text/event-stream; charset=utf-8";
constexpr std::string_view kJson = "application/json";

Json ErrorJson(std::string_view message, std::string_view type, Json param, Json code) {
  return {{"error", {{"message", message}, {"type", type}, {"param", std::move(param)}, {"code", std::move(code)}}}};
}

// One OpenAI answer in progress: the request id and the headers that go with it.
struct OpenAIExchange {
  Exchange& ex;
  std::string request_id;

  HttpHeaderList Headers(HttpHeaderList extra = {}) const {
    HttpHeaderList h = {
        {"x-request-id", request_id},
        {"openai-processing-ms", std::to_string(static_cast<int64_t>(ex.ElapsedMs()))},
        {"openai-version", "2020-10-01"},
        {"openai-organization", "user-fake"},
        {"x-ratelimit-limit-requests", "10000"},
        {"x-ratelimit-remaining-requests", "9999"},
        {"x-ratelimit-reset-requests", "6ms"},
    };
    for (auto& kv : extra) h.push_back(std::move(kv));
    return h;
  }
  void Error(int status, std::string_view message, std::string_view type = "invalid_request_error",
             Json param = nullptr, Json code = nullptr, HttpHeaderList extra = {}) {
    ex.Send(status, kJson, Dump(ErrorJson(message, type, std::move(param), std::move(code))), Headers(std::move(extra)));
  }
  void Missing(const std::string& param) {
    Error(400, "Missing required parameter: '" + param + "'.", "invalid_request_error", param, "missing_required_parameter");
  }
  void WrongType(const std::string& param, std::string_view expected, const Json& got) {
    Error(400, "Invalid type for '" + param + "': expected " + std::string(expected) + ", but got " + TypeNoun(got) +
                   " instead.",
          "invalid_request_error", param, "invalid_type");
  }
  // OpenAI's words for a JSON value's type, with the article ("a string", "an integer").
  static std::string TypeNoun(const Json& v) {
    if (v.is_string()) return "a string";
    if (v.is_boolean()) return "a boolean";
    if (v.is_number_integer()) return "an integer";
    if (v.is_number()) return "a decimal";
    if (v.is_array()) return "an array";
    if (v.is_object()) return "an object";
    return "null";
  }
  bool Sse(const Json& chunk) { return ex.Write("data: " + Dump(chunk) + "\n\n"); }
};

std::string MaskKey(std::string_view key) {
  if (key.size() <= 8) return std::string(key.size(), '*');
  return std::string(key.substr(0, 3)) + std::string(key.size() - 7, '*') + std::string(key.substr(key.size() - 4));
}

// Bearer auth. False (and answered) when the key is missing or wrong.
bool CheckAuth(OpenAIExchange& oe) {
  std::string_view auth = oe.ex.req.headers.Get("Authorization");
  std::string_view key;
  if (auth.size() > 7 && strncasecmp(auth.data(), "Bearer ", 7) == 0) key = auth.substr(7);
  while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
  if (key.empty()) {
    oe.Error(401,
             "You didn't provide an API key. You need to provide your API key in an Authorization header using "
             "Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password field (with blank username) if "
             "you're accessing the API from your browser and are prompted for a username and password. You can "
             "obtain an API key from https://platform.openai.com/account/api-keys.");
    return false;
  }
  const std::string& want = oe.ex.options().api_key;
  if (!want.empty() && key != want) {
    oe.Error(401,
             "Incorrect API key provided: " + MaskKey(key) +
                 ". You can find your API key at https://platform.openai.com/account/api-keys.",
             "invalid_request_error", nullptr, "invalid_api_key");
    return false;
  }
  return true;
}

// The request body as a JSON object; answers 400 otherwise.
std::optional<Json> ParseBody(OpenAIExchange& oe) {
  Json body = Json::parse(oe.ex.req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    oe.Error(400,
             "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP "
             "library correctly. The OpenAI API expects a JSON payload, but what was sent was not valid JSON. If you "
             "have trouble figuring out how to fix this, please contact us through our help center at "
             "help.openai.com.)");
    return std::nullopt;
  }
  return body;
}

// "model" (required string). Answers 400 when absent or not a string.
bool ReadModel(OpenAIExchange& oe, const Json& body, Prompt& p) {
  const Json* m = Member(body, "model");
  if (!m) {
    oe.Error(400, "you must provide a model parameter");
    return false;
  }
  if (!m->is_string()) {
    oe.WrongType("model", "a string", *m);
    return false;
  }
  p.model = m->get<std::string>();
  return true;
}

// A bound as OpenAI prints it: 2, -2, 0.5.
std::string BoundText(double v) {
  return v == static_cast<double>(static_cast<int64_t>(v)) ? std::to_string(static_cast<int64_t>(v)) : Dump(Json(v));
}

// The optional number obj[key] in [lo, hi] (OpenAI calls it a decimal), named `name` in errors
// (default: the key). False (and answered) otherwise.
bool ReadDecimal(OpenAIExchange& oe, const Json& obj, const std::string& key, double lo, double hi,
                 std::string name = "") {
  if (name.empty()) name = key;
  const Json* v = Member(obj, key.c_str());
  if (!v) return true;
  if (!v->is_number()) {
    oe.WrongType(name, "a decimal", *v);
    return false;
  }
  const double x = v->get<double>();
  if (x > hi || x < lo) {
    const bool above = x > hi;
    oe.Error(400,
             "Invalid '" + name + "': decimal " + (above ? "above maximum" : "below minimum") + " value. Expected a value " +
                 (above ? "<= " + BoundText(hi) : ">= " + BoundText(lo)) + ", but got " + Dump(*v) + " instead.",
             "invalid_request_error", name, above ? "decimal_above_max_value" : "decimal_below_min_value");
    return false;
  }
  return true;
}

// temperature, top_p, presence_penalty, frequency_penalty, seed and logit_bias: accepted and
// checked as OpenAI checks them (types and ranges). The fake's answer does not depend on them:
// it is already deterministic, which is what a seed asks for.
bool ReadSampling(OpenAIExchange& oe, const Json& body) {
  if (!ReadDecimal(oe, body, "temperature", 0, 2) || !ReadDecimal(oe, body, "top_p", 0, 1) ||
      !ReadDecimal(oe, body, "presence_penalty", -2, 2) || !ReadDecimal(oe, body, "frequency_penalty", -2, 2)) {
    return false;
  }
  if (const Json* seed = Member(body, "seed"); seed && !seed->is_number_integer()) {
    oe.WrongType("seed", "an integer", *seed);
    return false;
  }
  const Json* bias = Member(body, "logit_bias");
  if (!bias) return true;
  if (!bias->is_object()) {
    oe.WrongType("logit_bias", "an object", *bias);
    return false;
  }
  for (auto it = bias->begin(); it != bias->end(); ++it) {
    const std::string& key = it.key();
    if (key.empty() || key.size() > 10 || key.find_first_not_of("0123456789") != std::string::npos) {
      oe.Error(400, "Invalid key in 'logit_bias': " + key + ". You should only be submitting non-negative integers.",
               "invalid_request_error", "logit_bias", "invalid_value");
      return false;
    }
    if (!ReadDecimal(oe, *bias, key, -100, 100, "logit_bias." + key)) return false;
  }
  return true;
}

// max_completion_tokens / max_tokens, stop, stream, stream_options, sampling.
bool ReadCommon(OpenAIExchange& oe, const Json& body, Prompt& p, bool* include_usage) {
  for (const char* name : {"max_completion_tokens", "max_tokens"}) {
    const Json* m = Member(body, name);
    if (!m) continue;
    if (!m->is_number_integer()) {
      oe.WrongType(name, "an integer", *m);
      return false;
    }
    int64_t v = m->get<int64_t>();
    if (v < 1) {
      oe.Error(400,
               std::string("Invalid '") + name + "': integer below minimum value. Expected a value >= 1, but got " +
                   std::to_string(v) + " instead.",
               "invalid_request_error", name, "integer_below_min_value");
      return false;
    }
    p.max_tokens = v;
    break;
  }
  if (const Json* s = Member(body, "stop")) {
    if (s->is_string()) {
      p.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > 4) {
        oe.Error(400,
                 "Invalid 'stop': array too long. Expected an array with maximum length 4, but got an array with "
                 "length " + std::to_string(s->size()) + " instead.",
                 "invalid_request_error", "stop", "array_above_max_length");
        return false;
      }
      for (const auto& e : *s) {
        if (!e.is_string()) {
          oe.WrongType("stop", "a string", e);
          return false;
        }
        p.stop.push_back(e.get<std::string>());
      }
    } else {
      oe.WrongType("stop", "a string or array", *s);
      return false;
    }
  }
  if (const Json* s = Member(body, "stream")) {
    if (!s->is_boolean()) {
      oe.WrongType("stream", "a boolean", *s);
      return false;
    }
    p.stream = s->get<bool>();
  }
  if (const Json* so = Member(body, "stream_options")) {
    if (!p.stream) {
      oe.Error(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "invalid_request_error",
               "stream_options");
      return false;
    }
    if (const Json* iu = Member(*so, "include_usage"); iu && iu->is_boolean()) *include_usage = iu->get<bool>();
  }
  return ReadSampling(oe, body);
}

// Text of a message's "content": a string or an array of parts ({"type":"text","text":...}).
std::string ContentText(const Json& content) {
  if (content.is_string()) return content.get<std::string>();
  std::string text;
  if (content.is_array()) {
    for (const auto& part : content) {
      if (const Json* t = StringMember(part, "text")) text += t->get<std::string>();
    }
  }
  return text;
}

bool MentionsJson(std::string_view text) {
  for (size_t i = 0; i + 4 <= text.size(); ++i) {
    if (strncasecmp(text.data() + i, "json", 4) == 0) return true;
  }
  return false;
}

// parallel_tool_calls: a boolean, and only with tools (as OpenAI requires). The fake makes one
// call at most, which both values allow.
bool ReadParallelToolCalls(OpenAIExchange& oe, const Json& body, const Prompt& p) {
  const Json* v = Member(body, "parallel_tool_calls");
  if (!v) return true;
  if (!v->is_boolean()) {
    oe.WrongType("parallel_tool_calls", "a boolean", *v);
    return false;
  }
  if (p.tools.empty()) {
    oe.Error(400,
             "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when 'tools' are "
             "specified.",
             "invalid_request_error", "parallel_tool_calls");
    return false;
  }
  return true;
}

// Strict structured outputs need every object closed (additionalProperties: false) and every
// property required. "" when `schema` (at `context`, OpenAI's tuple notation) meets that.
std::string StrictSchemaProblem(const Json& schema, const std::string& context, int depth = 0) {
  if (!schema.is_object() || depth > 32) return "";
  const Json* props = ObjectMember(schema, "properties");
  const Json* type = StringMember(schema, "type");
  if (props || (type && *type == "object")) {
    const Json* ap = Member(schema, "additionalProperties");
    if (!ap || !ap->is_boolean() || ap->get<bool>()) {
      return "In context=" + context + ", 'additionalProperties' is required to be supplied and to be false.";
    }
    const Json* required = ArrayMember(schema, "required");
    if (props) {
      for (auto it = props->begin(); it != props->end(); ++it) {
        if (!required || std::find(required->begin(), required->end(), Json(it.key())) == required->end()) {
          return "In context=" + context +
                 ", 'required' is required to be supplied and to be an array including every key in properties. "
                 "Missing '" + it.key() + "'.";
        }
        std::string inner = context == "()" ? "('properties', '" + it.key() + "')"
                                            : context.substr(0, context.size() - 1) + ", 'properties', '" + it.key() + "')";
        if (std::string problem = StrictSchemaProblem(it.value(), inner, depth + 1); !problem.empty()) return problem;
      }
    }
  }
  if (const Json* items = Member(schema, "items")) {
    std::string inner = context == "()" ? "('items',)" : context.substr(0, context.size() - 1) + ", 'items')";
    if (std::string problem = StrictSchemaProblem(*items, inner, depth + 1); !problem.empty()) return problem;
  }
  for (const char* defs : {"$defs", "definitions"}) {
    if (const Json* d = ObjectMember(schema, defs)) {
      for (auto it = d->begin(); it != d->end(); ++it) {
        std::string inner = "('" + std::string(defs) + "', '" + it.key() + "')";
        if (std::string problem = StrictSchemaProblem(it.value(), inner, depth + 1); !problem.empty()) return problem;
      }
    }
  }
  return "";
}

// response_format: {type: text} | {type: json_object} | {type: json_schema, json_schema: {name,
// schema?, strict?, description?}}, checked as OpenAI checks it, and honoured: JSON modes answer
// one JSON document (an instance of the schema for json_schema).
bool ReadResponseFormat(OpenAIExchange& oe, const Json& body, Prompt& p, bool mentions_json) {
  const Json* rf = Member(body, "response_format");
  if (!rf) return true;
  if (!rf->is_object()) {
    oe.WrongType("response_format", "an object", *rf);
    return false;
  }
  const Json* type = Member(*rf, "type");
  if (!type) {
    oe.Missing("response_format.type");
    return false;
  }
  if (!type->is_string() || (*type != "text" && *type != "json_object" && *type != "json_schema")) {
    oe.Error(400,
             "Invalid value: '" + (type->is_string() ? type->get<std::string>() : Dump(*type)) +
                 "'. Supported values are: 'json_object', 'json_schema', and 'text'.",
             "invalid_request_error", "response_format.type", "invalid_value");
    return false;
  }
  if (*type == "text") return true;
  if (*type == "json_object") {
    if (!mentions_json) {
      oe.Error(400,
               "'messages' must contain the word 'json' in some form, to use 'response_format' of type "
               "'json_object'.",
               "invalid_request_error", "messages");
      return false;
    }
    p.json_answer = true;
    return true;
  }
  const Json* js = Member(*rf, "json_schema");
  if (!js) {
    oe.Missing("response_format.json_schema");
    return false;
  }
  if (!js->is_object()) {
    oe.WrongType("response_format.json_schema", "an object", *js);
    return false;
  }
  const Json* name = Member(*js, "name");
  if (!name) {
    oe.Missing("response_format.json_schema.name");
    return false;
  }
  if (!name->is_string()) {
    oe.WrongType("response_format.json_schema.name", "a string", *name);
    return false;
  }
  const std::string& n = name->get_ref<const std::string&>();
  if (n.empty() || n.size() > 64 ||
      n.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") != std::string::npos) {
    oe.Error(400,
             "Invalid 'response_format.json_schema.name': string does not match pattern. Expected a string that "
             "matches the pattern '^[a-zA-Z0-9_-]+$'.",
             "invalid_request_error", "response_format.json_schema.name", "invalid_value");
    return false;
  }
  const Json* schema = Member(*js, "schema");
  if (schema && !schema->is_object()) {
    oe.WrongType("response_format.json_schema.schema", "an object", *schema);
    return false;
  }
  const Json* strict = Member(*js, "strict");
  if (strict && !strict->is_boolean()) {
    oe.WrongType("response_format.json_schema.strict", "a boolean", *strict);
    return false;
  }
  if (strict && strict->get<bool>() && schema) {
    if (std::string problem = StrictSchemaProblem(*schema, "()"); !problem.empty()) {
      oe.Error(400, "Invalid schema for response_format '" + n + "': " + problem, "invalid_request_error",
               "response_format", "invalid_value");
      return false;
    }
  }
  p.json_answer = true;
  if (schema) p.schema = *schema;
  return true;
}

bool ParseChat(OpenAIExchange& oe, const Json& body, Prompt& p, bool* include_usage) {
  if (!ReadModel(oe, body, p)) return false;
  bool mentions_json = false;  // json_object mode needs the word in the messages
  const Json* msgs = Member(body, "messages");
  if (!msgs) {
    oe.Missing("messages");
    return false;
  }
  if (!msgs->is_array()) {
    oe.WrongType("messages", "an array", *msgs);
    return false;
  }
  if (msgs->empty()) {
    oe.Error(400, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
             "invalid_request_error", "messages", "empty_array");
    return false;
  }
  static const std::vector<std::string> kRoles = {"system", "developer", "user", "assistant", "tool", "function"};
  for (size_t i = 0; i < msgs->size(); ++i) {
    const Json& m = (*msgs)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) {
      oe.WrongType(where, "an object", m);
      return false;
    }
    const Json* role = StringMember(m, "role");
    if (!role) {
      oe.Missing(where + ".role");
      return false;
    }
    const std::string r = role->get<std::string>();
    if (std::find(kRoles.begin(), kRoles.end(), r) == kRoles.end()) {
      oe.Error(400,
               "Invalid value: '" + r + "'. Supported values are: 'system', 'assistant', 'user', 'function', 'tool', "
               "and 'developer'.",
               "invalid_request_error", where + ".role", "invalid_value");
      return false;
    }
    if (r == "tool" && !StringMember(m, "tool_call_id")) {
      oe.Missing(where + ".tool_call_id");
      return false;
    }
    std::string text = Member(m, "content") ? ContentText(m["content"]) : "";
    p.text_bytes += text.size();
    mentions_json = mentions_json || MentionsJson(text);
    if (const Json* calls = ArrayMember(m, "tool_calls")) {
      for (const auto& c : *calls) {
        const Json* fn = ObjectMember(c, "function");
        if (!fn) continue;
        if (const Json* n = StringMember(*fn, "name")) p.text_bytes += n->get_ref<const std::string&>().size();
        if (const Json* a = StringMember(*fn, "arguments")) p.text_bytes += a->get_ref<const std::string&>().size();
      }
    }
    if (r == "user") p.last_user_text = text;
    p.last_is_tool_result = r == "tool" || r == "function";
  }
  if (const Json* tools = Member(body, "tools")) {
    if (!tools->is_array()) {
      oe.WrongType("tools", "an array", *tools);
      return false;
    }
    for (size_t i = 0; i < tools->size(); ++i) {
      const Json* fn = ObjectMember((*tools)[i], "function");
      const Json* name = fn ? StringMember(*fn, "name") : nullptr;
      if (!name) {
        oe.Missing("tools[" + std::to_string(i) + "].function" + (fn ? ".name" : ""));
        return false;
      }
      p.tools.push_back(name->get<std::string>());
    }
  }
  if (const Json* tc = Member(body, "tool_choice")) {
    if (tc->is_string()) {
      p.tool_choice_none = tc->get<std::string>() == "none";
    } else if (const Json* fn = ObjectMember(*tc, "function")) {
      // A forced function goes first, so the "tools" switch calls it.
      if (const Json* n = StringMember(*fn, "name")) {
        auto it = std::find(p.tools.begin(), p.tools.end(), n->get<std::string>());
        if (it != p.tools.end()) std::rotate(p.tools.begin(), it, it + 1);
      }
    }
  }
  return ReadCommon(oe, body, p, include_usage) && ReadParallelToolCalls(oe, body, p) &&
         ReadResponseFormat(oe, body, p, mentions_json);
}

const char* FinishName(Finish f) {
  switch (f) {
    case Finish::kStop: return "stop";
    case Finish::kLength: return "length";
    case Finish::kStopSequence: return "stop";
    case Finish::kToolCall: return "tool_calls";
  }
  return "stop";
}

Json UsageJson(const Plan& plan) {
  return {{"prompt_tokens", plan.input_tokens},
          {"completion_tokens", plan.output_tokens},
          {"total_tokens", plan.input_tokens + plan.output_tokens},
          {"prompt_tokens_details", {{"cached_tokens", 0}, {"audio_tokens", 0}}},
          {"completion_tokens_details",
           {{"reasoning_tokens", 0}, {"audio_tokens", 0}, {"accepted_prediction_tokens", 0},
            {"rejected_prediction_tokens", 0}}}};
}

// Injected errors, "slow" and "garbage": true when the request was answered by one of them.
bool ApplySwitches(OpenAIExchange& oe, const Switches& sw, bool stream, std::string_view garbage_event) {
  Exchange& ex = oe.ex;
  if (sw.slow) {
    if (!ex.SleepMs(ex.options().slow_ms)) return true;
    ex.RestartClock();
  }
  switch (sw.error_status) {
    case 429:
      oe.Error(429,
               "Rate limit reached for requests in organization user-fake on requests per min (RPM): Limit 3, "
               "Used 3, Requested 1. Please try again in 1s. Visit https://platform.openai.com/account/rate-limits to "
               "learn more.",
               "requests", nullptr, "rate_limit_exceeded",
               {{"retry-after", "1"}, {"x-ratelimit-remaining-requests", "0"}, {"x-ratelimit-reset-requests", "1s"}});
      return true;
    case 500:
      oe.Error(500, "The server had an error while processing your request. Sorry about that!", "server_error");
      return true;
    case 503:
      oe.Error(503, "The engine is currently overloaded, please try again later.", "server_error");
      return true;
    default: break;
  }
  if (!sw.garbage) return false;
  if (!ex.AwaitToken(0)) return true;
  if (stream) {
    if (ex.Begin(kSse, oe.Headers())) {
      if (ex.Write(garbage_event)) ex.Write("data: [DONE]\n\n");
    }
  } else {
    ex.Send(200, kJson, std::string(kGarbageBody), oe.Headers());
  }
  return true;
}

// A complete JSON answer, or, for "truncate", half of it followed by a dropped connection.
void SendJson(OpenAIExchange& oe, const Switches& sw, const Json& answer) {
  std::string body = Dump(answer);
  if (sw.truncate) {
    if (oe.ex.Begin(kJson, oe.Headers()) && oe.ex.Write(std::string_view(body).substr(0, body.size() / 2))) oe.ex.Cut();
    return;
  }
  oe.ex.Send(200, kJson, std::move(body), oe.Headers());
}

void ChatCompletions(OpenAIExchange& oe) {
  Exchange& ex = oe.ex;
  auto body = ParseBody(oe);
  if (!body) return;
  Prompt p;
  bool include_usage = false;
  if (!ParseChat(oe, *body, p, &include_usage)) return;
  Switches sw = ParseSwitches(p.model);
  if (ApplySwitches(oe, sw, p.stream,
                    "data: {\"id\":\"chatcmpl-garbage\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"delta\": not json\n\n")) {
    return;
  }
  Plan plan = MakePlan(p, sw, ex.options().reply_tokens);
  const std::string id = ex.impl.NewId("chatcmpl-", 29);
  const std::string fingerprint = "fp_fake0001";
  const int64_t created = UnixNow();
  const bool tool = plan.finish == Finish::kToolCall;
  const std::string call_id = tool ? ex.impl.NewId("call_", 24) : "";

  if (!p.stream) {
    const size_t n = tool ? plan.tool_argument_pieces.size() : plan.pieces.size();
    if (!ex.AwaitAll(n)) return;
    Json message = {{"role", "assistant"}, {"content", nullptr}, {"refusal", nullptr}, {"annotations", Json::array()}};
    if (tool) {
      message["tool_calls"] = Json::array({{{"id", call_id}, {"type", "function"},
                                            {"function", {{"name", plan.tool_name}, {"arguments", plan.tool_arguments}}}}});
    } else {
      message["content"] = plan.Text();
    }
    Json answer = {{"id", id},
                   {"object", "chat.completion"},
                   {"created", created},
                   {"model", p.model},
                   {"choices", Json::array({{{"index", 0}, {"message", std::move(message)}, {"logprobs", nullptr},
                                             {"finish_reason", FinishName(plan.finish)}}})},
                   {"usage", UsageJson(plan)},
                   {"service_tier", "default"},
                   {"system_fingerprint", fingerprint}};
    ex.CountTokens(plan.output_tokens);
    SendJson(oe, sw, answer);
    return;
  }

  auto chunk = [&](Json delta, Json finish) {
    Json c = {{"id", id},
              {"object", "chat.completion.chunk"},
              {"created", created},
              {"model", p.model},
              {"service_tier", "default"},
              {"system_fingerprint", fingerprint},
              {"choices", Json::array({{{"index", 0}, {"delta", std::move(delta)}, {"logprobs", nullptr},
                                        {"finish_reason", std::move(finish)}}})}};
    if (include_usage) c["usage"] = nullptr;
    return c;
  };
  if (!ex.AwaitToken(0) || !ex.Begin(kSse, oe.Headers())) return;
  const std::vector<std::string>& pieces = tool ? plan.tool_argument_pieces : plan.pieces;
  Json first = {{"role", "assistant"}, {"content", ""}, {"refusal", nullptr}};
  if (tool) {
    first["content"] = nullptr;
    first["tool_calls"] = Json::array({{{"index", 0}, {"id", call_id}, {"type", "function"},
                                        {"function", {{"name", plan.tool_name}, {"arguments", ""}}}}});
  }
  if (!oe.Sse(chunk(std::move(first), nullptr))) return;
  const size_t send = sw.truncate ? (tool ? 1 : plan.TruncatedCount()) : pieces.size();
  for (size_t i = 0; i < send; ++i) {
    if (!ex.AwaitToken(i)) return;
    Json delta = tool ? Json{{"tool_calls", Json::array({{{"index", 0}, {"function", {{"arguments", pieces[i]}}}}})}}
                      : Json{{"content", pieces[i]}};
    if (!oe.Sse(chunk(std::move(delta), nullptr))) return;
    if (!tool) ex.CountTokens(1);
  }
  if (sw.truncate) {
    ex.Cut();
    return;
  }
  if (tool) ex.CountTokens(plan.output_tokens);
  if (!oe.Sse(chunk(Json::object(), FinishName(plan.finish)))) return;
  if (include_usage) {
    Json u = chunk(Json::object(), nullptr);
    u["choices"] = Json::array();
    u["usage"] = UsageJson(plan);
    if (!oe.Sse(u)) return;
  }
  ex.Write("data: [DONE]\n\n");
}

// The legacy completions endpoint. Its max_tokens defaults to 16, as OpenAI's does.
void Completions(OpenAIExchange& oe) {
  Exchange& ex = oe.ex;
  auto body = ParseBody(oe);
  if (!body) return;
  Prompt p;
  bool include_usage = false;
  if (!ReadModel(oe, *body, p)) return;
  const Json* prompt = Member(*body, "prompt");
  if (!prompt) {
    oe.Missing("prompt");
    return;
  }
  auto add = [&](const Json& e) {
    if (e.is_string()) {
      p.last_user_text = e.get<std::string>();
      p.text_bytes += p.last_user_text.size();
      return true;
    }
    if (e.is_number_integer()) {
      p.text_bytes += 4;  // one token
      return true;
    }
    if (e.is_array()) {
      for (const auto& t : e) {
        if (!t.is_number_integer()) return false;
        p.text_bytes += 4;
      }
      return true;
    }
    return false;
  };
  bool ok = prompt->is_array() ? std::all_of(prompt->begin(), prompt->end(), add) : add(*prompt);
  if (!ok) {
    oe.WrongType("prompt", "a string or array", *prompt);
    return;
  }
  if (!ReadCommon(oe, *body, p, &include_usage)) return;
  if (!p.max_tokens) p.max_tokens = 16;
  Switches sw = ParseSwitches(p.model);
  sw.tools = false;
  if (ApplySwitches(oe, sw, p.stream, "data: {\"id\":\"cmpl-garbage\",\"object\":\"text_completion\",\"choices\":[{\"text\": not json\n\n")) {
    return;
  }
  Plan plan = MakePlan(p, sw, ex.options().reply_tokens);
  const std::string id = ex.impl.NewId("cmpl-", 29);
  const int64_t created = UnixNow();
  Json usage = {{"prompt_tokens", plan.input_tokens},
                {"completion_tokens", plan.output_tokens},
                {"total_tokens", plan.input_tokens + plan.output_tokens}};
  auto answer = [&](std::string text, Json finish) {
    return Json{{"id", id},
                {"object", "text_completion"},
                {"created", created},
                {"model", p.model},
                {"choices", Json::array({{{"text", std::move(text)}, {"index", 0}, {"logprobs", nullptr},
                                          {"finish_reason", std::move(finish)}}})},
                {"system_fingerprint", "fp_fake0001"}};
  };
  if (!p.stream) {
    if (!ex.AwaitAll(plan.pieces.size())) return;
    Json a = answer(plan.Text(), FinishName(plan.finish));
    a["usage"] = usage;
    ex.CountTokens(plan.output_tokens);
    SendJson(oe, sw, a);
    return;
  }
  if (!ex.AwaitToken(0) || !ex.Begin(kSse, oe.Headers())) return;
  const size_t send = sw.truncate ? plan.TruncatedCount() : plan.pieces.size();
  for (size_t i = 0; i < send; ++i) {
    if (!ex.AwaitToken(i)) return;
    Json c = answer(plan.pieces[i], nullptr);
    if (include_usage) c["usage"] = nullptr;
    if (!oe.Sse(c)) return;
    ex.CountTokens(1);
  }
  if (sw.truncate) {
    ex.Cut();
    return;
  }
  Json last = answer("", FinishName(plan.finish));
  if (include_usage) last["usage"] = nullptr;
  if (!oe.Sse(last)) return;
  if (include_usage) {
    Json u = answer("", nullptr);
    u["choices"] = Json::array();
    u["usage"] = usage;
    if (!oe.Sse(u)) return;
  }
  ex.Write("data: [DONE]\n\n");
}

// A deterministic unit vector from the text's hash (FNV-1a, then splitmix64 per dimension).
std::vector<float> EmbedText(std::string_view text, int dims) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  std::vector<float> v(static_cast<size_t>(dims));
  double norm = 0;
  for (int d = 0; d < dims; ++d) {
    uint64_t z = h + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(d + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    double x = static_cast<double>(z >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;  // [-1, 1)
    v[static_cast<size_t>(d)] = static_cast<float>(x);
    norm += x * x;
  }
  norm = std::sqrt(norm);
  if (norm > 0) {
    for (float& x : v) x = static_cast<float>(x / norm);
  }
  return v;
}

std::string Base64(const void* data, size_t n) {
  static constexpr char kTable[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t b = p[i] << 16 | (i + 1 < n ? p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
    out += kTable[(b >> 18) & 63];
    out += kTable[(b >> 12) & 63];
    out += i + 1 < n ? kTable[(b >> 6) & 63] : '=';
    out += i + 2 < n ? kTable[b & 63] : '=';
  }
  return out;
}

void Embeddings(OpenAIExchange& oe) {
  Exchange& ex = oe.ex;
  auto body = ParseBody(oe);
  if (!body) return;
  Prompt p;
  if (!ReadModel(oe, *body, p)) return;
  const Json* input = Member(*body, "input");
  if (!input) {
    oe.Missing("input");
    return;
  }
  // Each input as bytes to hash: a string, or a token array's JSON text.
  std::vector<std::string> inputs;
  auto invalid = [&] {
    oe.Error(400, "'$.input' is invalid. Please check the API reference: https://platform.openai.com/docs/api-reference.");
  };
  if (input->is_string()) {
    inputs.push_back(input->get<std::string>());
  } else if (input->is_array() && !input->empty()) {
    if ((*input)[0].is_number_integer()) {
      inputs.push_back(Dump(*input));
    } else {
      for (const auto& e : *input) {
        if (e.is_string()) {
          inputs.push_back(e.get<std::string>());
        } else if (e.is_array()) {
          inputs.push_back(Dump(e));
        } else {
          invalid();
          return;
        }
      }
    }
  } else {
    invalid();
    return;
  }
  for (const auto& s : inputs) {
    if (s.empty()) {
      invalid();
      return;
    }
    p.text_bytes += s.size();
  }
  int dims = ex.options().embedding_dims;
  if (const Json* d = Member(*body, "dimensions")) {
    if (!d->is_number_integer() || d->get<int64_t>() < 1 || d->get<int64_t>() > 65536) {
      oe.Error(400, "Invalid 'dimensions': expected an integer between 1 and 65536.", "invalid_request_error",
               "dimensions", "invalid_value");
      return;
    }
    dims = d->get<int>();
  }
  bool base64 = false;
  if (const Json* f = Member(*body, "encoding_format")) {
    if (!f->is_string() || (*f != "float" && *f != "base64")) {
      oe.Error(400, "Invalid value: '" + (f->is_string() ? f->get<std::string>() : Dump(*f)) +
                        "'. Supported values are: 'float' and 'base64'.",
               "invalid_request_error", "encoding_format", "invalid_value");
      return;
    }
    base64 = *f == "base64";
  }
  Switches sw = ParseSwitches(p.model);
  if (ApplySwitches(oe, sw, false, "")) return;
  if (!ex.AwaitToken(0)) return;
  Json data = Json::array();
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<float> v = EmbedText(inputs[i], dims);
    Json e = {{"object", "embedding"}, {"index", i}};
    e["embedding"] = base64 ? Json(Base64(v.data(), v.size() * sizeof(float))) : Json(v);
    data.push_back(std::move(e));
  }
  const int64_t tokens = EstimateTokens(p.text_bytes);
  SendJson(oe, sw,
           {{"object", "list"}, {"data", std::move(data)}, {"model", p.model},
            {"usage", {{"prompt_tokens", tokens}, {"total_tokens", tokens}}}});
}

Json ModelJson(std::string_view id) {
  return {{"id", id}, {"object", "model"}, {"created", 1715367049}, {"owned_by", "system"}};
}

}  // namespace

std::string OpenAIErrorBody(int status, std::string_view message) {
  return Dump(ErrorJson(message, status >= 500 ? "server_error" : "invalid_request_error", nullptr, nullptr));
}

void ServeOpenAI(Exchange& ex) {
  OpenAIExchange oe{ex, ex.impl.NewId("req_", 32)};
  const std::string& path = ex.req.path;
  const bool models = path == "/v1/models" || path.rfind("/v1/models/", 0) == 0;
  const bool post_path = path == "/v1/chat/completions" || path == "/v1/completions" || path == "/v1/embeddings";
  if (!models && !post_path) {
    oe.Error(404, "Invalid URL (" + ex.req.method + " " + path + ")");
    return;
  }
  if ((models && ex.req.method != "GET") || (post_path && ex.req.method != "POST")) {
    oe.Error(405, "Invalid method for URL (" + ex.req.method + " " + path + ")");
    return;
  }
  if (!CheckAuth(oe)) return;
  if (path == "/v1/chat/completions") {
    ChatCompletions(oe);
  } else if (path == "/v1/completions") {
    Completions(oe);
  } else if (path == "/v1/embeddings") {
    Embeddings(oe);
  } else if (path == "/v1/models") {
    Json data = Json::array();
    for (const char* id : {"gpt-4o", "gpt-4o-mini", "gpt-4.1", "gpt-3.5-turbo-instruct", "text-embedding-3-small"}) {
      data.push_back(ModelJson(id));
    }
    ex.Send(200, kJson, Dump({{"object", "list"}, {"data", std::move(data)}}), oe.Headers());
  } else {
    ex.Send(200, kJson, Dump(ModelJson(path.substr(std::strlen("/v1/models/")))), oe.Headers());
  }
}

}  // namespace keel::gateway::fake
