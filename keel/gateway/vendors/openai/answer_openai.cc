// Non-streamed OpenAI answers without a JSON DOM: the fast readers of upstream answers (they
// decline to the DOM reader in translate_openai.cc for anything not plainly of the common shape)
// and the client answer writers, which write the JSON text directly, byte for byte what dumping
// the equivalent nlohmann::json (keys sorted, as its std::map holds them) would give.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "keel/gateway/stream.h"
#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/openai/openai_answer.h"
#include "keel/gateway/vendors/openai/json_scanner.h"

namespace keel::gateway {

using namespace internal;  // NOLINT: the helpers are this file's vocabulary

namespace {

// A member the DOM reader reads with ReadString and ignores when it has another type.
bool StringOrIgnore(Scanner& s, std::string* out) { return s.Peek() == '"' ? s.String(out) : s.Skip(); }

// An integer member the DOM reader takes only when is_number_integer().
bool IntOrIgnore(Scanner& s, int64_t* out) {
  const char c = s.Peek();
  if (c != '-' && (c < '0' || c > '9')) return s.Skip();
  Scanner::Num kind;
  int64_t v;
  if (!s.Number(&kind, &v)) return false;
  if (kind == Scanner::Num::kInt) *out = v;
  return true;
}

// ReadUsage: an object's prompt_tokens / completion_tokens; anything else is ignored.
bool ReadUsage(Scanner& s, Usage* usage) {
  if (s.Peek() != '{') return s.Skip();
  Seen seen;
  return s.Object([&](const std::string& key) {
    if (key == "prompt_tokens") return seen.First(1) && IntOrIgnore(s, &usage->input_tokens);
    if (key == "completion_tokens") return seen.First(2) && IntOrIgnore(s, &usage->output_tokens);
    return s.Skip();
  });
}

// A string or null, which the DOM reader takes as absent.
bool StringOrNull(Scanner& s, std::string* out) {
  return s.Peek() == '"' ? s.String(out) : s.Peek() == 'n' && s.Skip();
}

// choices[0].message: content a string or null, tool_calls absent or null.
bool ReadMessage(Scanner& s, std::string* content) {
  Seen seen;
  return s.Object([&](const std::string& key) {
    if (key == "content") return seen.First(1) && StringOrNull(s, content);
    if (key == "tool_calls") return seen.First(2) && s.Peek() == 'n' && s.Skip();
    return s.Skip();
  });
}

// choices[0]: chat's message, completions' text, and finish_reason.
bool ReadChoice(Scanner& s, bool chat, ChatResponse* out) {
  Seen seen;
  std::string finish;
  const bool ok = s.Object([&](const std::string& key) {
    if (key == "finish_reason") return seen.First(1) && StringOrIgnore(s, &finish);
    if (chat && key == "message") return seen.First(2) && ReadMessage(s, &out->content);
    if (!chat && key == "text") return seen.First(2) && StringOrNull(s, &out->content);
    return s.Skip();
  });
  if (!ok || (chat && !seen.Has(2))) return false;  // the DOM reader refuses an answer without a message
  out->finish = ParseOpenAIFinishReason(finish);
  return true;
}

// choices: a non-empty array whose first element is read; the rest are validated and dropped.
bool ReadChoices(Scanner& s, bool chat, ChatResponse* out) {
  if (!s.Open('[') || s.Peek() != '{' || !ReadChoice(s, chat, out)) return false;
  while (s.Eat(',')) {
    if (!s.Skip()) return false;
  }
  return s.Close();
}

bool ReadAnswer(std::string_view body, bool chat, ChatResponse* out) {
  Scanner s(body, kUpstreamJsonLimits.max_values);
  Seen seen;
  const bool ok = s.Object([&](const std::string& key) {
    if (key == "id") return seen.First(1) && StringOrIgnore(s, &out->id);
    if (key == "model") return seen.First(2) && StringOrIgnore(s, &out->model);
    if (key == "created") return seen.First(4) && IntOrIgnore(s, &out->created);
    if (key == "choices") return seen.First(8) && ReadChoices(s, chat, out);
    if (key == "usage") return seen.First(16) && ReadUsage(s, &out->usage);
    if (key == "error") return s.Peek() == 'n' && s.Skip();  // an error member: the DOM reader words it
    return s.Skip();
  });
  return ok && seen.Has(8) && s.AtEnd();
}

// ---- writers

void AppendFinish(FinishReason finish, std::string* out) {
  const char* name = OpenAIFinishReasonName(finish);
  if (*name) AppendJsonString(name, out);
  else *out += "null";
}

// ,"usage":{...} unless neither count is known (WriteUsage's rule).
void AppendUsage(const Usage& usage, std::string* out) {
  if (usage.input_tokens < 0 && usage.output_tokens < 0) return;
  const int64_t in = std::max<int64_t>(usage.input_tokens, 0);
  const int64_t o = std::max<int64_t>(usage.output_tokens, 0);
  *out += ",\"usage\":{\"completion_tokens\":";
  AppendJsonNumber(o, out);
  *out += ",\"prompt_tokens\":";
  AppendJsonNumber(in, out);
  *out += ",\"total_tokens\":";
  AppendJsonNumber(in + o, out);
  *out += '}';
}

// ,"created":..,"id":..,"model":..,"object":.. and the usage: the members after "choices".
void AppendTail(const ChatResponse& response, const char* id_prefix, const std::string& model, const char* object,
                std::string* out) {
  *out += ",\"created\":";
  AppendJsonNumber(response.created ? response.created : NowSeconds(), out);
  *out += ",\"id\":";
  AppendJsonString(PrefixedId(response.id, id_prefix), out);
  *out += ",\"model\":";
  AppendJsonString(model, out);
  *out += ",\"object\":\"";
  *out += object;
  *out += '"';
  AppendUsage(response.usage, out);
  *out += '}';
}

size_t StringsSize(const ChatResponse& response, const std::string& model) {
  size_t n = response.content.size() + response.id.size() + model.size();
  for (const ToolCall& c : response.tool_calls) n += c.id.size() + c.name.size() + c.arguments_json.size() + 64;
  return n + n / 8;  // room for escapes
}

}  // namespace

namespace internal {

bool ReadOpenAIChatResponseFast(std::string_view body, ChatResponse* out) { return ReadAnswer(body, true, out); }
bool ReadOpenAICompletionsResponseFast(std::string_view body, ChatResponse* out) {
  return ReadAnswer(body, false, out);
}

void AppendOpenAIToolCalls(const std::vector<ToolCall>& calls, std::string* out) {
  *out += '[';
  for (size_t i = 0; i < calls.size(); ++i) {
    const ToolCall& c = calls[i];
    *out += i ? ",{\"function\":{\"arguments\":" : "{\"function\":{\"arguments\":";
    AppendJsonString(c.arguments_json.empty() ? std::string_view("{}") : std::string_view(c.arguments_json), out);
    *out += ",\"name\":";
    AppendJsonString(c.name, out);
    *out += "},\"id\":";
    AppendJsonString(c.id, out);
    *out += ",\"type\":\"function\"}";
  }
  *out += ']';
}

}  // namespace internal

Result<ChatResponse> ParseOpenAIChatResponse(std::string_view body) {
  ChatResponse out;
  if (ReadOpenAIChatResponseFast(body, &out)) return out;
  return ParseOpenAIChatResponseDom(body);
}

Result<ChatResponse> ParseOpenAICompletionsResponse(std::string_view body) {
  ChatResponse out;
  if (ReadOpenAICompletionsResponseFast(body, &out)) return out;
  return ParseOpenAICompletionsResponseDom(body);
}

std::string BuildOpenAIChatResponse(const ChatResponse& response, const std::string& model) {
  std::string out;
  out.reserve(256 + StringsSize(response, model));
  out += "{\"choices\":[{\"finish_reason\":";
  AppendFinish(response.finish, &out);
  // refusal and annotations: members OpenAI always sends and its SDKs type as required
  // (string | null, array); the gateway has neither to carry.
  out += ",\"index\":0,\"logprobs\":null,\"message\":{\"annotations\":[],\"content\":";
  if (!response.tool_calls.empty() && response.content.empty()) out += "null";
  else AppendJsonString(response.content, &out);
  out += ",\"refusal\":null,\"role\":\"assistant\"";
  if (!response.tool_calls.empty()) {
    out += ",\"tool_calls\":";
    AppendOpenAIToolCalls(response.tool_calls, &out);
  }
  out += "}}]";
  AppendTail(response, "chatcmpl-", model, "chat.completion", &out);
  return out;
}

std::string BuildOpenAICompletionsResponse(const ChatResponse& response, const std::string& model) {
  std::string out;
  out.reserve(256 + StringsSize(response, model));
  out += "{\"choices\":[{\"finish_reason\":";
  AppendFinish(response.finish, &out);
  out += ",\"index\":0,\"logprobs\":null,\"text\":";
  AppendJsonString(response.content, &out);
  out += "}]";
  AppendTail(response, "cmpl-", model, "text_completion", &out);
  return out;
}

}  // namespace keel::gateway
