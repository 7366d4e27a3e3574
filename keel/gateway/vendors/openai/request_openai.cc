// The fast reader of OpenAI Chat Completions client bodies: the common request (model, text
// messages, a few sampling fields) read in one pass with no DOM; anything else declines to the
// DOM reader in translate_openai.cc, which keeps every check and its wording.
#include <charconv>
#include <string>
#include <string_view>
#include <vector>

#include "keel/gateway/translate_internal.h"
#include "keel/gateway/vendors/openai/json_scanner.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/openai/openai_answer.h"

namespace keel::gateway {

using namespace internal;  // NOLINT: the helpers are this file's vocabulary

namespace {

// A JSON null, which every field reader takes as absent.
bool Null(Scanner& s) { return s.Peek() == 'n' && s.Skip(); }

// ReadPositiveInt / ReadInt, for the integers the scanner reads exactly (others decline).
bool Int(Scanner& s, bool positive, std::optional<int64_t>* out) {
  if (Null(s)) return true;
  const char c = s.Peek();
  if (c != '-' && (c < '0' || c > '9')) return false;
  Scanner::Num kind;
  int64_t v;
  if (!s.Number(&kind, &v) || kind != Scanner::Num::kInt || (positive && v < 1)) return false;
  *out = v;
  return true;
}

// ReadNumber: the double nlohmann's strtod gives (from_chars rounds the same way, correctly).
bool Double(Scanner& s, std::optional<double>* out) {
  if (Null(s)) return true;
  const char c = s.Peek();
  if (c != '-' && (c < '0' || c > '9')) return false;
  Scanner::Num kind;
  int64_t v;
  std::string_view text;
  if (!s.Number(&kind, &v, &text)) return false;
  if (kind == Scanner::Num::kInt) {
    *out = static_cast<double>(v);
    return true;
  }
  double d = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), d);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size()) return false;  // e.g. underflow
  *out = d;
  return true;
}

bool Bool(Scanner& s, bool* out) {
  if (Null(s)) return true;
  if (s.Peek() == 't' || s.Peek() == 'f') {
    *out = s.Peek() == 't';
    return s.Skip();
  }
  return false;
}

bool StreamOptions(Scanner& s, bool* include_usage) {
  if (Null(s)) return true;
  Seen seen;
  return s.Object([&](const std::string& key) {
    if (key == "include_usage") return seen.First(1) && Bool(s, include_usage);
    return s.Skip();
  });
}

// One message: role and content (a string or null); tool_calls only as null.
bool ReadMessage(Scanner& s, Message* m) {
  Seen seen;
  return s.Object([&](const std::string& key) {
    if (key == "role") return seen.First(1) && s.Peek() == '"' && s.String(&m->role);
    if (key == "content") return seen.First(2) && (Null(s) || (s.Peek() == '"' && s.String(&m->content)));
    if (key == "tool_calls" || key == "refusal") return Null(s);  // read by the DOM reader only
    return s.Skip();
  });
}

// messages: text turns of system, developer, user and assistant (no tool calls, no tool results).
bool Messages(Scanner& s, ChatRequest* req) {
  if (!s.Open('[') || s.Peek() != '{') return false;
  std::string system;
  size_t system_count = 0, count = 0;
  do {
    Message m;
    if (++count > kMaxMessages || !ReadMessage(s, &m)) return false;
    if (m.role == "system" || m.role == "developer") {
      if (system_count++) system += '\n';
      system += m.content;
    } else if (m.role == "user" || m.role == "assistant") {
      req->messages.push_back(std::move(m));
    } else {
      return false;  // tool results, unknown or missing roles: the DOM reader
    }
  } while (s.Eat(','));
  if (!s.Close() || req->messages.empty()) return false;
  req->system = std::move(system);
  return true;
}

}  // namespace

bool internal::ReadOpenAIChatRequestFast(std::string_view body, ChatRequest* req) {
  Scanner s(body, kClientJsonLimits.max_values);
  req->client_format = WireFormat::kOpenAIChat;
  std::optional<int64_t> max_tokens, max_completion_tokens;
  Seen seen;
  const bool ok = s.Object([&](const std::string& key) {
    if (key == "model") return seen.First(1) && s.Peek() == '"' && s.String(&req->model) && !req->model.empty();
    if (key == "messages") return seen.First(2) && Messages(s, req);
    if (key == "max_tokens") return seen.First(4) && Int(s, true, &max_tokens);
    if (key == "max_completion_tokens") return seen.First(8) && Int(s, true, &max_completion_tokens);
    if (key == "temperature") return seen.First(16) && Double(s, &req->temperature);
    if (key == "top_p") return seen.First(32) && Double(s, &req->top_p);
    if (key == "seed") return seen.First(64) && Int(s, false, &req->seed);
    if (key == "stream") return seen.First(128) && Bool(s, &req->stream);
    if (key == "user") return seen.First(256) && (Null(s) || (s.Peek() == '"' && s.String(&req->user)));
    if (key == "stream_options") return seen.First(512) && StreamOptions(s, &req->stream_include_usage);
    if (key == "top_k" || key == "presence_penalty" || key == "frequency_penalty" || key == "logit_bias" ||
        key == "stop" || key == "n" || key == "logprobs" || key == "top_logprobs" || key == "tools" ||
        key == "tool_choice" || key == "parallel_tool_calls" || key == "response_format" || key == "prompt" ||
        key == "reasoning_effort" || key == "functions" || key == "function_call" || key == "audio" ||
        key == "modalities" || key == "web_search_options" || key == "prediction") {
      return Null(s);  // read and checked by the DOM reader only
    }
    return s.Skip();
  });
  // {} lacks model and messages.
  if (!ok || !s.AtEnd() || !seen.Has(1) || !seen.Has(2)) return false;
  // max_completion_tokens replaced max_tokens; when both are sent the newer one wins.
  req->max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  return true;
}

}  // namespace keel::gateway
