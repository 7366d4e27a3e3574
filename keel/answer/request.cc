#include "keel/answer/request.h"

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/core/json_writer.h"

namespace keel::answer {
namespace {

using json = nlohmann::json;

Status Bad(std::string_view field, std::string_view what) {
  return Status::InvalidArgument(std::string(field) + ": " + std::string(what));
}

bool KnownRole(const std::string& r) {
  return r == "system" || r == "user" || r == "assistant" || r == "developer" || r == "tool";
}

// An integer member 1..max, or nullopt when absent/null.
Result<std::optional<int64_t>> TokenCount(const json& body, const char* name, int64_t max) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::optional<int64_t>();
  if (!it->is_number_integer() && !it->is_number_unsigned()) return Bad(name, "expected an integer");
  // nlohmann reads non-negative integers as unsigned: check the range before narrowing.
  const bool huge = it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(max);
  const int64_t v = huge ? 0 : it->get<int64_t>();
  if (huge || v < 1 || v > max) return Bad(name, "expected an integer from 1 to " + std::to_string(max));
  return std::optional<int64_t>(v);
}

// Copies bytes of `s` up to `n`, never splitting a UTF-8 sequence; newlines become spaces.
void AppendCut(std::string_view s, size_t n, std::string* out) {
  if (s.size() > n) {
    size_t cut = n;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
    s = s.substr(0, cut);
  }
  for (char c : s) out->push_back(c == '\n' || c == '\r' ? ' ' : c);
}

}  // namespace

Result<AnswerRequest> ParseAnswerRequest(std::string_view body, const RequestLimits& limits) {
  JsonLimits jl;
  jl.max_depth = limits.max_json_depth;
  jl.max_values = limits.max_json_values;
  jl.require_object = true;
  auto parsed = ParseUntrustedJson(body, jl);
  if (!parsed.ok()) return Status::InvalidArgument("request body: " + parsed.status().message());
  const json& j = *parsed;
  AnswerRequest out;

  if (auto it = j.find("stream"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return Bad("stream", "expected a boolean");
    out.stream = it->get<bool>();
  }
  // OpenAI refuses stream_options without stream: true; so do we, rather than ignore it.
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!out.stream) return Bad("stream_options", "only allowed when stream is true");
    if (!it->is_object()) return Bad("stream_options", "expected an object");
    if (auto u = it->find("include_usage"); u != it->end() && !u->is_null()) {
      if (!u->is_boolean()) return Bad("stream_options.include_usage", "expected a boolean");
      out.include_usage = u->get<bool>();
    }
  }

  if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return Bad("model", "expected a string");
    out.model = it->get<std::string>();
    if (out.model.empty() || out.model.size() > 256) return Bad("model", "expected 1 to 256 bytes");
  }

  auto msgs = j.find("messages");
  if (msgs == j.end() || msgs->is_null()) return Bad("messages", "required");
  if (!msgs->is_array()) return Bad("messages", "expected an array");
  if (msgs->empty()) return Bad("messages", "expected at least one message");
  if (msgs->size() > limits.max_messages) {
    return Bad("messages", "more than " + std::to_string(limits.max_messages) + " messages");
  }
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return Bad(at, "expected an object");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) return Bad(at + ".role", "expected a string");
    const std::string r = role->get<std::string>();
    if (!KnownRole(r)) return Bad(at + ".role", "expected system, user, assistant, developer or tool");
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      if (r == "assistant") continue;  // tool-call turns carry no content
      return Bad(at + ".content", "required");
    }
    if (!content->is_string()) return Bad(at + ".content", "expected a string (content parts are not supported)");
    const std::string& text = content->get_ref<const std::string&>();
    if (text.size() > limits.max_message_bytes) {
      return Bad(at + ".content", "longer than " + std::to_string(limits.max_message_bytes) + " bytes");
    }
    if (r == "user" || r == "assistant") out.history.push_back(Turn{r == "user", text});
  }
  // The last user turn is the question; what came after it (assistant turns) is dropped.
  while (!out.history.empty() && !out.history.back().user) out.history.pop_back();
  if (out.history.empty()) return Bad("messages", "no user message to answer");
  out.question = std::move(out.history.back().content);
  out.history.pop_back();

  KEEL_ASSIGN_OR_RETURN(auto mct, TokenCount(j, "max_completion_tokens", limits.max_tokens_limit));
  KEEL_ASSIGN_OR_RETURN(auto mt, TokenCount(j, "max_tokens", limits.max_tokens_limit));
  out.max_tokens = mct ? *mct : mt ? *mt : limits.default_max_tokens;

  if (auto it = j.find("temperature"); it != j.end() && !it->is_null()) {
    if (!it->is_number()) return Bad("temperature", "expected a number");
    const double t = it->get<double>();
    if (!(t >= 0 && t <= 2)) return Bad("temperature", "expected a number from 0 to 2");
    out.temperature = t;
  }

  // One answer per request: n > 1 answered with one choice breaks clients that read n of them.
  if (auto it = j.find("n"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() != 1) return Bad("n", "only 1 is supported");
  }

  if (auto it = j.find("keel_retrieval"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return Bad("keel_retrieval", "expected an object");
    for (auto m = it->begin(); m != it->end(); ++m) {
      if (m.key() != "vector") return Bad("keel_retrieval", "unknown member (only \"vector\")");
    }
    auto v = it->find("vector");
    if (v == it->end() || !v->is_array()) return Bad("keel_retrieval.vector", "expected an array of numbers");
    if (v->size() != static_cast<size_t>(limits.dim)) {
      return Bad("keel_retrieval.vector",
                 "expected " + std::to_string(limits.dim) + " numbers, got " + std::to_string(v->size()));
    }
    std::vector<float> vec;
    vec.reserve(v->size());
    for (size_t i = 0; i < v->size(); ++i) {
      const json& x = (*v)[i];
      if (!x.is_number()) return Bad("keel_retrieval.vector[" + std::to_string(i) + "]", "expected a number");
      const double d = x.get<double>();
      if (!std::isfinite(d) || std::fabs(d) > std::numeric_limits<float>::max()) {
        return Bad("keel_retrieval.vector[" + std::to_string(i) + "]", "expected a finite float32");
      }
      vec.push_back(static_cast<float>(d));
    }
    out.vector = std::move(vec);
  }
  return out;
}

std::string BuildPrompt(const std::vector<std::string_view>& docs, std::string_view question, size_t context_bytes,
                        const std::vector<Turn>& history, size_t history_bytes) {
  std::string p;
  size_t first = history.size(), used = 0;
  while (first > 0) {
    const Turn& t = history[first - 1];
    const size_t line = (t.user ? 6 : 11) + t.content.size() + 1;  // "User: " / "Assistant: ", text, "\n"
    if (used + line > history_bytes) break;
    used += line;
    --first;
  }
  if (first < history.size()) {
    p += "Conversation:\n";
    for (size_t i = first; i < history.size(); ++i) {
      p += history[i].user ? "User: " : "Assistant: ";
      AppendCut(history[i].content, history[i].content.size(), &p);
      p += '\n';
    }
  }
  if (!docs.empty()) {
    const size_t share = context_bytes / docs.size();
    p += "Context:\n";
    for (std::string_view d : docs) {
      p += "- ";
      AppendCut(d, share, &p);
      p += '\n';
    }
  }
  p += "Question: ";
  p.append(question);
  p += "\nAnswer:";
  return p;
}

JsonLimits UpstreamJsonLimits() {
  JsonLimits l;
  l.max_depth = 16;
  l.max_values = 200000;
  l.require_object = true;
  return l;
}

std::string OpenAIErrorBody(int status, std::string_view message) {
  const char* type = status == 429 ? "rate_limit_exceeded" : status >= 500 ? "upstream_error" : "invalid_request_error";
  std::string out = "{\"error\":{\"message\":";
  AppendJsonString(message, &out);
  out += ",\"type\":\"";
  out += type;
  out += "\",\"param\":null,\"code\":\"";
  out += type;
  out += "\"}}";
  return out;
}

}  // namespace keel::answer
