// The fake Anthropic API: POST /v1/messages and GET /v1/models in Anthropic's documented shapes.
// Streams are SSE with "event:" lines: message_start, content_block_start, ping,
// content_block_delta..., content_block_stop, message_delta, message_stop. Errors are
// {"type":"error","error":{"type","message"},"request_id"} with a request-id header.
#include <algorithm>
#include <cstring>
#include <iterator>

#include "keel/gateway/fake_vendor_internal.h"

namespace keel::gateway::fake {
namespace {

constexpr std::string_view kSse = "text/event-stream; charset=utf-8";
constexpr std::string_view kJson = "application/json";

const char* ErrorType(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 500: return "api_error";
    case 503:
    case 529: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
  }
}

Json ErrorJson(std::string_view type, std::string_view message) {
  return {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

struct AnthropicExchange {
  Exchange& ex;
  std::string request_id;
  std::string version;  // anthropic-version, once checked

  HttpHeaderList Headers(HttpHeaderList extra = {}) const {
    HttpHeaderList h = {
        {"request-id", request_id},
        {"anthropic-organization-id", "00000000-0000-4000-8000-00000000fa4e"},
        {"anthropic-ratelimit-requests-limit", "4000"},
        {"anthropic-ratelimit-requests-remaining", "3999"},
        {"anthropic-ratelimit-requests-reset", "2030-01-01T00:00:00Z"},
    };
    for (auto& kv : extra) h.push_back(std::move(kv));
    return h;
  }
  void Error(int status, std::string_view message, HttpHeaderList extra = {}) {
    Json j = ErrorJson(ErrorType(status), message);
    j["request_id"] = request_id;
    ex.Send(status, kJson, Dump(j), Headers(std::move(extra)));
  }
  bool Event(std::string_view name, const Json& data) {
    return ex.Write("event: " + std::string(name) + "\ndata: " + Dump(data) + "\n\n");
  }
};

// The API versions the real API accepts: 2023-01-01 (the first), 2023-06-01 (SDKs up to the
// 2026 majors) and 2026-10-21 (current SDKs; sampling parameters removed, see ParseMessages).
constexpr std::string_view kVersions[] = {"2023-01-01", "2023-06-01", "2026-10-21"};

// Auth as the real API takes it: "x-api-key", or "Authorization: Bearer" (OAuth tokens, and API
// keys from SDKs of API version 2026-10-21). anthropic-beta is not checked: the fake has no beta
// features to switch, so every value is accepted.
bool CheckHeaders(AnthropicExchange& ae) {
  const HttpHeaders& h = ae.ex.req.headers;
  std::string_view key = h.Get("x-api-key");
  bool bearer = false;
  if (key.empty()) {
    std::string_view auth = h.Get("Authorization");
    if (auth.size() > 7 && strncasecmp(auth.data(), "Bearer ", 7) == 0) key = auth.substr(7);
    while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
    bearer = !key.empty();
  }
  if (key.empty()) {
    ae.Error(401, "x-api-key header is required");
    return false;
  }
  const std::string& want = ae.ex.options().api_key;
  if (!want.empty() && key != want) {
    ae.Error(401, bearer ? "Invalid bearer token" : "invalid x-api-key");
    return false;
  }
  if (!h.Has("anthropic-version")) {
    ae.Error(400, "anthropic-version: header is required");
    return false;
  }
  std::string_view version = h.Get("anthropic-version");
  if (std::find(std::begin(kVersions), std::end(kVersions), version) == std::end(kVersions)) {
    ae.Error(400, "anthropic-version: \"" + std::string(version) + "\" is not a valid version");
    return false;
  }
  ae.version = std::string(version);
  return true;
}

// Bytes of text in a content value (a string or an array of blocks), and its text blocks joined.
size_t ContentBytes(const Json& content, std::string* text) {
  if (content.is_string()) {
    if (text) *text += content.get<std::string>();
    return content.get_ref<const std::string&>().size();
  }
  size_t n = 0;
  if (!content.is_array()) return 0;
  for (const auto& block : content) {
    const Json* type = StringMember(block, "type");
    if (!type) continue;
    if (*type == "text") {
      if (const Json* t = StringMember(block, "text")) {
        n += t->get_ref<const std::string&>().size();
        if (text) *text += t->get<std::string>();
      }
    } else if (*type == "tool_use") {
      if (const Json* name = StringMember(block, "name")) n += name->get_ref<const std::string&>().size();
      if (const Json* input = Member(block, "input")) n += Dump(*input).size();
    } else if (*type == "tool_result") {
      if (const Json* c = Member(block, "content")) n += ContentBytes(*c, nullptr);
    }
  }
  return n;
}

bool HasToolResult(const Json& content) {
  if (!content.is_array()) return false;
  return std::any_of(content.begin(), content.end(), [](const Json& b) {
    const Json* t = StringMember(b, "type");
    return t && *t == "tool_result";
  });
}

// Top-level fields of a Messages request. Anything else is refused, as the real API refuses it
// ("<field>: Extra inputs are not permitted"), so a gateway that sends another vendor's field
// (response_format, seed) finds out here. API version 2026-10-21 removed temperature, top_p and
// top_k (a 400 at any value), so under it they are unknown too.
bool KnownField(std::string_view name, bool sampling) {
  static constexpr std::string_view kFields[] = {
      "model",         "messages",      "max_tokens",    "system",      "metadata",
      "stop_sequences", "stream",       "tools",         "tool_choice", "thinking",
      "service_tier",  "container",     "mcp_servers",   "context_management", "output_config",
      "output_format", "cache_control", "inference_geo", "speed",       "diagnostics"};
  if (std::find(std::begin(kFields), std::end(kFields), name) != std::end(kFields)) return true;
  return sampling && (name == "temperature" || name == "top_p" || name == "top_k");
}

// temperature and top_p in [0, 1], top_k a non-negative integer (API versions before 2026-10-21).
// The answer does not depend on them. "" when valid, else the error message.
std::string SamplingProblem(const Json& body) {
  for (const char* name : {"temperature", "top_p"}) {
    const Json* v = Member(body, name);
    if (!v) continue;
    if (!v->is_number()) return std::string(name) + ": Input should be a valid number";
    if (v->get<double>() < 0) return std::string(name) + ": Input should be greater than or equal to 0";
    if (v->get<double>() > 1) return std::string(name) + ": Input should be less than or equal to 1";
  }
  if (const Json* k = Member(body, "top_k")) {
    if (!k->is_number_integer()) return "top_k: Input should be a valid integer";
    if (k->get<int64_t>() < 0) return "top_k: Input should be greater than or equal to 0";
  }
  return "";
}

// tool_choice: {type: auto|any|tool|none, name (tool), disable_parallel_tool_use (not none)}.
// The fake makes one call at most, which disable_parallel_tool_use allows either way. "" when
// valid; else the error message.
std::string ToolChoiceProblem(const Json& tc, bool has_tools) {
  if (!tc.is_object()) return "tool_choice: Input should be a valid dictionary or object to extract fields from";
  const Json* type = Member(tc, "type");
  if (!type) return "tool_choice: Unable to extract tag using discriminator 'type'";
  const std::string t = type->is_string() ? type->get<std::string>() : Dump(*type);
  if (t != "auto" && t != "any" && t != "tool" && t != "none") {
    return "tool_choice: Input tag '" + t +
           "' found using 'type' does not match any of the expected tags: 'auto', 'any', 'tool', 'none'";
  }
  const std::string where = "tool_choice." + t;
  for (auto it = tc.begin(); it != tc.end(); ++it) {
    const std::string& k = it.key();
    const bool known = k == "type" || (k == "name" && t == "tool") || (k == "disable_parallel_tool_use" && t != "none");
    if (!known) return where + "." + k + ": Extra inputs are not permitted";
  }
  if (const Json* d = Member(tc, "disable_parallel_tool_use"); d && !d->is_boolean()) {
    return where + ".disable_parallel_tool_use: Input should be a valid boolean";
  }
  if (t == "tool") {
    const Json* name = Member(tc, "name");
    if (!name) return where + ".name: Field required";
    if (!name->is_string()) return where + ".name: Input should be a valid string";
  }
  if (!has_tools && t != "none") return "tool_choice may only be specified while providing tools.";
  return "";
}

// Structured output: output_config.format (or the beta's output_format) = {type: "json_schema",
// schema: {...}}, read into the prompt: the answer is an instance of the schema. Returns "" when
// valid, else the error message.
std::string ReadOutputFormat(const Json& format, const std::string& where, Prompt& p) {
  if (!format.is_object()) return where + ": Input should be a valid dictionary or object to extract fields from";
  const Json* type = Member(format, "type");
  if (!type) return where + ".type: Field required";
  if (*type != "json_schema") return where + ".type: Input should be 'json_schema'";
  const Json* schema = Member(format, "schema");
  if (!schema) return where + ".schema: Field required";
  if (!schema->is_object()) return where + ".schema: Input should be a valid dictionary";
  for (auto it = format.begin(); it != format.end(); ++it) {
    if (it.key() != "type" && it.key() != "schema") return where + "." + it.key() + ": Extra inputs are not permitted";
  }
  p.json_answer = true;
  p.schema = *schema;
  return "";
}

// output_config (effort, format) and output_format. Returns "" when valid, else the error message.
std::string ReadOutputConfig(const Json& body, Prompt& p) {
  if (const Json* oc = Member(body, "output_config")) {
    if (!oc->is_object()) return "output_config: Input should be a valid dictionary or object to extract fields from";
    for (auto it = oc->begin(); it != oc->end(); ++it) {
      if (it.key() != "effort" && it.key() != "format") return "output_config." + it.key() + ": Extra inputs are not permitted";
    }
    if (const Json* effort = Member(*oc, "effort")) {
      static constexpr std::string_view kEfforts[] = {"low", "medium", "high", "xhigh", "max"};
      if (!effort->is_string() || std::find(std::begin(kEfforts), std::end(kEfforts),
                                            effort->get_ref<const std::string&>()) == std::end(kEfforts)) {
        return "output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'";
      }
    }
    if (const Json* format = Member(*oc, "format")) {
      if (std::string e = ReadOutputFormat(*format, "output_config.format", p); !e.empty()) return e;
    }
  }
  if (const Json* of = Member(body, "output_format")) {
    if (p.json_answer) return "output_format: cannot be used together with output_config.format";
    return ReadOutputFormat(*of, "output_format", p);
  }
  return "";
}

// Validates the request the way the Messages API does and extracts the prompt. Answers 400.
bool ParseMessages(AnthropicExchange& ae, const Json& body, Prompt& p) {
  auto fail = [&](const std::string& m) {
    ae.Error(400, m);
    return false;
  };
  const Json* model = Member(body, "model");
  if (!model) return fail("model: Field required");
  if (!model->is_string()) return fail("model: Input should be a valid string");
  p.model = model->get<std::string>();
  const Json* msgs = Member(body, "messages");
  if (!msgs) return fail("messages: Field required");
  if (!msgs->is_array()) return fail("messages: Input should be a valid list");
  if (msgs->empty()) return fail("messages: at least one message is required");
  const Json* max_tokens = Member(body, "max_tokens");
  if (!max_tokens) return fail("max_tokens: Field required");
  if (!max_tokens->is_number_integer()) return fail("max_tokens: Input should be a valid integer");
  if (max_tokens->get<int64_t>() < 1) return fail("max_tokens: Input should be greater than or equal to 1");
  p.max_tokens = max_tokens->get<int64_t>();
  const bool sampling = ae.version != "2026-10-21";
  for (auto it = body.begin(); it != body.end(); ++it) {
    if (!KnownField(it.key(), sampling)) return fail(it.key() + ": Extra inputs are not permitted");
  }
  if (std::string e = SamplingProblem(body); !e.empty()) return fail(e);
  for (size_t i = 0; i < msgs->size(); ++i) {
    const Json& m = (*msgs)[i];
    const std::string where = "messages." + std::to_string(i);
    if (!m.is_object()) return fail(where + ": Input should be a valid dictionary");
    const Json* role = StringMember(m, "role");
    if (!role) return fail(where + ".role: Field required");
    if (*role != "user" && *role != "assistant") return fail(where + ".role: Input should be 'user' or 'assistant'");
    const Json* content = Member(m, "content");
    if (!content) return fail(where + ".content: Field required");
    if (!content->is_string() && !content->is_array()) return fail(where + ".content: Input should be a valid list");
    std::string text;
    p.text_bytes += ContentBytes(*content, &text);
    if (*role == "user" && !text.empty()) p.last_user_text = text;
    p.last_is_tool_result = *role == "user" && HasToolResult(*content);
  }
  if (const Json* system = Member(body, "system")) {
    if (!system->is_string() && !system->is_array()) return fail("system: Input should be a valid list");
    p.text_bytes += ContentBytes(*system, nullptr);
  }
  if (const Json* stops = Member(body, "stop_sequences")) {
    if (!stops->is_array()) return fail("stop_sequences: Input should be a valid list");
    for (const auto& s : *stops) {
      if (!s.is_string()) return fail("stop_sequences: Input should be a valid string");
      p.stop.push_back(s.get<std::string>());
    }
  }
  if (const Json* stream = Member(body, "stream")) {
    if (!stream->is_boolean()) return fail("stream: Input should be a valid boolean");
    p.stream = stream->get<bool>();
  }
  if (const Json* tools = Member(body, "tools")) {
    if (!tools->is_array()) return fail("tools: Input should be a valid list");
    for (size_t i = 0; i < tools->size(); ++i) {
      const Json* name = StringMember((*tools)[i], "name");
      if (!name) return fail("tools." + std::to_string(i) + ".name: Field required");
      p.tools.push_back(name->get<std::string>());
    }
  }
  if (const Json* tc = Member(body, "tool_choice")) {
    if (std::string e = ToolChoiceProblem(*tc, !p.tools.empty()); !e.empty()) return fail(e);
    const Json* type = StringMember(*tc, "type");
    if (type && *type == "none") p.tool_choice_none = true;
    const Json* name = StringMember(*tc, "name");
    if (type && *type == "tool" && name) {
      auto it = std::find(p.tools.begin(), p.tools.end(), name->get<std::string>());
      if (it != p.tools.end()) std::rotate(p.tools.begin(), it, it + 1);
    }
  }
  if (std::string e = ReadOutputConfig(body, p); !e.empty()) return fail(e);
  return true;
}

const char* StopReason(Finish f) {
  switch (f) {
    case Finish::kStop: return "end_turn";
    case Finish::kLength: return "max_tokens";
    case Finish::kStopSequence: return "stop_sequence";
    case Finish::kToolCall: return "tool_use";
  }
  return "end_turn";
}

Json UsageJson(const Plan& plan, int64_t output_tokens) {
  return {{"input_tokens", plan.input_tokens},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", 0},
          {"output_tokens", output_tokens},
          {"service_tier", "standard"}};
}

Json StopSequenceJson(const Plan& plan) {
  return plan.finish == Finish::kStopSequence ? Json(plan.stop_sequence) : Json(nullptr);
}

void Messages(AnthropicExchange& ae) {
  Exchange& ex = ae.ex;
  Json body = Json::parse(ex.req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    ae.Error(400, body.is_discarded() ? "There was an issue with the format of your request: invalid JSON body"
                                      : "Input should be a valid dictionary");
    return;
  }
  Prompt p;
  if (!ParseMessages(ae, body, p)) return;
  Switches sw = ParseSwitches(p.model);
  if (sw.slow) {
    if (!ex.SleepMs(ex.options().slow_ms)) return;
    ex.RestartClock();
  }
  switch (sw.error_status) {
    case 429:
      ae.Error(429,
               "Number of request tokens has exceeded your per-minute rate limit "
               "(https://docs.anthropic.com/en/api/rate-limits); see the response headers for current usage. Please "
               "reduce the prompt length or the maximum tokens requested, or try again later.",
               {{"retry-after", "1"}, {"anthropic-ratelimit-requests-remaining", "0"}});
      return;
    case 500: ae.Error(500, "Internal server error"); return;
    case 503: ae.Error(529, "Overloaded"); return;
    default: break;
  }
  Plan plan = MakePlan(p, sw, ex.options().reply_tokens);
  const std::string id = ex.impl.NewId("msg_01", 22);
  const bool tool = plan.finish == Finish::kToolCall;
  const std::string tool_id = tool ? ex.impl.NewId("toolu_01", 22) : "";
  Json start = {{"id", id},          {"type", "message"},         {"role", "assistant"},
                {"model", p.model},  {"content", Json::array()},  {"stop_reason", nullptr},
                {"stop_sequence", nullptr}, {"usage", UsageJson(plan, 1)}};

  if (sw.garbage) {
    if (!ex.AwaitToken(0)) return;
    if (!p.stream) {
      ex.Send(200, kJson, std::string(kGarbageBody), ae.Headers());
    } else if (ex.Begin(kSse, ae.Headers()) && ae.Event("message_start", {{"type", "message_start"}, {"message", start}})) {
      if (ex.Write("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0, not json\n\n")) {
        ae.Event("message_stop", {{"type", "message_stop"}});
      }
    }
    return;
  }

  if (!p.stream) {
    if (!ex.AwaitAll(tool ? plan.tool_argument_pieces.size() : plan.pieces.size())) return;
    Json content = tool ? Json::array({{{"type", "tool_use"}, {"id", tool_id}, {"name", plan.tool_name},
                                        {"input", Json::parse(plan.tool_arguments)}}})
                        : Json::array({{{"type", "text"}, {"text", plan.Text()}}});
    Json answer = start;
    answer["content"] = std::move(content);
    answer["stop_reason"] = StopReason(plan.finish);
    answer["stop_sequence"] = StopSequenceJson(plan);
    answer["usage"] = UsageJson(plan, plan.output_tokens);
    ex.CountTokens(plan.output_tokens);
    std::string text = Dump(answer);
    if (sw.truncate) {
      if (ex.Begin(kJson, ae.Headers()) && ex.Write(std::string_view(text).substr(0, text.size() / 2))) ex.Cut();
      return;
    }
    ex.Send(200, kJson, std::move(text), ae.Headers());
    return;
  }

  if (!ex.AwaitToken(0) || !ex.Begin(kSse, ae.Headers())) return;
  Json block = tool ? Json{{"type", "tool_use"}, {"id", tool_id}, {"name", plan.tool_name}, {"input", Json::object()}}
                    : Json{{"type", "text"}, {"text", ""}};
  if (!ae.Event("message_start", {{"type", "message_start"}, {"message", start}}) ||
      !ae.Event("content_block_start", {{"type", "content_block_start"}, {"index", 0}, {"content_block", block}}) ||
      !ae.Event("ping", {{"type", "ping"}})) {
    return;
  }
  const std::vector<std::string>& pieces = tool ? plan.tool_argument_pieces : plan.pieces;
  const size_t send = sw.truncate ? (tool ? 1 : plan.TruncatedCount()) : pieces.size();
  for (size_t i = 0; i < send; ++i) {
    if (!ex.AwaitToken(i)) return;
    Json delta = tool ? Json{{"type", "input_json_delta"}, {"partial_json", pieces[i]}}
                      : Json{{"type", "text_delta"}, {"text", pieces[i]}};
    if (!ae.Event("content_block_delta", {{"type", "content_block_delta"}, {"index", 0}, {"delta", delta}})) return;
    if (!tool) ex.CountTokens(1);
  }
  if (sw.truncate) {
    ex.Cut();
    return;
  }
  if (tool) ex.CountTokens(plan.output_tokens);
  if (!ae.Event("content_block_stop", {{"type", "content_block_stop"}, {"index", 0}}) ||
      !ae.Event("message_delta", {{"type", "message_delta"},
                                  {"delta", {{"stop_reason", StopReason(plan.finish)}, {"stop_sequence", StopSequenceJson(plan)}}},
                                  {"usage", {{"output_tokens", plan.output_tokens}}}})) {
    return;
  }
  ae.Event("message_stop", {{"type", "message_stop"}});
}

}  // namespace

std::string AnthropicErrorBody(int status, std::string_view message) {
  return Dump(ErrorJson(ErrorType(status), message));
}

void ServeAnthropic(Exchange& ex) {
  AnthropicExchange ae{ex, ex.impl.NewId("req_011", 20)};
  const std::string& path = ex.req.path;
  if (path != "/v1/messages" && path != "/v1/models") {
    ae.Error(404, "Not Found");
    return;
  }
  if ((path == "/v1/messages" && ex.req.method != "POST") || (path == "/v1/models" && ex.req.method != "GET")) {
    ae.Error(405, "Method Not Allowed");
    return;
  }
  if (!CheckHeaders(ae)) return;
  if (path == "/v1/messages") {
    Messages(ae);
    return;
  }
  Json data = Json::array();
  for (auto [id, name] : {std::pair{"claude-sonnet-4-20250514", "Claude Sonnet 4"},
                          std::pair{"claude-3-5-haiku-20241022", "Claude Haiku 3.5"}}) {
    data.push_back({{"type", "model"}, {"id", id}, {"display_name", name}, {"created_at", "2025-05-22T00:00:00Z"}});
  }
  Json list = {{"data", data}, {"has_more", false}, {"first_id", data.front()["id"]}, {"last_id", data.back()["id"]}};
  ex.Send(200, kJson, Dump(list), ae.Headers());
}

}  // namespace keel::gateway::fake
