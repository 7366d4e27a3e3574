// OpenAI request parsing and response shaping for the engine server (see openai_protocol.h).
#include "keel/engine/openai_protocol.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <random>
#include <utility>

#include <fmt/format.h>

namespace keel::engine {

using json = nlohmann::json;

namespace {

uint64_t RandomSeed() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Errors and JSON output

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json ErrorObject(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param ? json(*e.param) : json(nullptr)},
            {"code", e.code ? json(*e.code) : json(nullptr)}}}};
}

ApiError BadParam(std::string param, std::string message) {
  std::optional<std::string> p;
  if (!param.empty()) p = std::move(param);
  return ApiError{400, std::move(message), "invalid_request_error", std::move(p), std::nullopt};
}

// Errors the HTTP layer itself produces (404, 405, 413, 431, 400 for broken HTTP, 503).
std::string OpenAiHttpErrorBody(int status, std::string_view message) {
  ApiError e;
  e.status = status;
  e.message = std::string(message);
  e.type = status >= 500 ? "server_error" : "invalid_request_error";
  if (status == 404) e.code = "not_found";
  return Dump(ErrorObject(e));
}

// ---------------------------------------------------------------------------------------------
// Request parsing

// Reads an optional integer field. Absent or null leaves *out untouched and returns nullopt.
std::optional<ApiError> GetInt(const json& body, const char* name, int64_t* out, bool* present) {
  *present = false;
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_number_unsigned()) {
    uint64_t v = it->get<uint64_t>();
    *out = v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
               ? std::numeric_limits<int64_t>::max()
               : static_cast<int64_t>(v);
  } else if (it->is_number_integer()) {
    *out = it->get<int64_t>();
  } else {
    return BadParam(name, fmt::format("'{}' must be an integer", name));
  }
  *present = true;
  return std::nullopt;
}

std::optional<ApiError> GetNumber(const json& body, const char* name, double* out, bool* present) {
  *present = false;
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return BadParam(name, fmt::format("'{}' must be a number", name));
  *out = it->get<double>();
  if (!std::isfinite(*out)) return BadParam(name, fmt::format("'{}' must be finite", name));
  *present = true;
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& body, const char* name, bool* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return BadParam(name, fmt::format("'{}' must be a boolean", name));
  *out = it->get<bool>();
  return std::nullopt;
}

// The chat template (documented in openai_protocol.h): contents joined by "\n", no role labels.
std::string RenderChat(const std::vector<std::string>& contents) {
  std::string out;
  for (size_t i = 0; i < contents.size(); ++i) {
    if (i) out += '\n';
    out += contents[i];
  }
  return out;
}

// Parses the fields common to both endpoints (model, n, sampling, stop, stream).
std::optional<ApiError> ParseCommon(const json& body, const std::string& model_name, ServerJob* job) {
  auto model = body.find("model");
  if (model == body.end() || model->is_null()) return BadParam("model", "'model' is required");
  if (!model->is_string()) return BadParam("model", "'model' must be a string");
  if (model->get<std::string>() != model_name) {
    // param null, as OpenAI sends it for an unknown model.
    ApiError e{404, fmt::format("The model `{}` does not exist; this server serves `{}`",
                                model->get<std::string>(), model_name),
               "invalid_request_error", std::nullopt, "model_not_found"};
    return e;
  }

  bool present = false;
  int64_t n = 1;
  if (auto e = GetInt(body, "n", &n, &present)) return e;
  if (n < 1 || n > kMaxChoicesPerRequest) {
    return BadParam("n", fmt::format("'n' must be between 1 and {}", kMaxChoicesPerRequest));
  }
  job->n = static_cast<int>(n);
  int64_t best_of = n;
  if (auto e = GetInt(body, "best_of", &best_of, &present)) return e;
  // best_of > n asks for extra candidates ranked by likelihood, which Keel does not generate.
  if (best_of != n) return BadParam("best_of", fmt::format("'best_of' must equal 'n' ({}) when given", n));

  SamplingOptions& s = job->params.sampling;
  double temperature = 1.0;
  if (auto e = GetNumber(body, "temperature", &temperature, &present)) return e;
  if (temperature < 0 || temperature > 2) {
    return BadParam("temperature", "'temperature' must be between 0 and 2");
  }
  s.temperature = static_cast<float>(temperature);
  double top_p = 1.0;
  if (auto e = GetNumber(body, "top_p", &top_p, &present)) return e;
  // 0 is OpenAI's too (with temperature 0, a common way to ask for determinism): the nucleus is
  // then the most likely token alone.
  if (!(top_p >= 0 && top_p <= 1)) return BadParam("top_p", "'top_p' must be between 0 and 1");
  s.top_p = static_cast<float>(top_p);
  for (const auto& [name, field] : {std::pair{"presence_penalty", &SamplingOptions::presence_penalty},
                                    std::pair{"frequency_penalty", &SamplingOptions::frequency_penalty}}) {
    double penalty = 0.0;
    if (auto e = GetNumber(body, name, &penalty, &present)) return e;
    if (!(penalty >= -2 && penalty <= 2)) return BadParam(name, fmt::format("'{}' must be between -2 and 2", name));
    s.*field = static_cast<float>(penalty);
  }
  int64_t top_k = 0;
  if (auto e = GetInt(body, "top_k", &top_k, &present)) return e;
  if (top_k < 0) return BadParam("top_k", "'top_k' must be >= 0");
  s.top_k = static_cast<int>(std::min<int64_t>(top_k, std::numeric_limits<int>::max()));
  auto seed = body.find("seed");
  if (seed != body.end() && !seed->is_null()) {
    if (seed->is_number_unsigned()) {
      s.seed = seed->get<uint64_t>();
    } else if (seed->is_number_integer()) {
      s.seed = static_cast<uint64_t>(seed->get<int64_t>());
    } else {
      return BadParam("seed", "'seed' must be an integer");
    }
  } else {
    s.seed = RandomSeed();
  }

  auto stop = body.find("stop");
  if (stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      job->params.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > 4) return BadParam("stop", "'stop' holds at most 4 sequences");
      for (const auto& v : *stop) {
        if (!v.is_string()) return BadParam("stop", "'stop' must be a string or an array of strings");
        job->params.stop.push_back(v.get<std::string>());
      }
    } else {
      return BadParam("stop", "'stop' must be a string or an array of strings");
    }
    for (const auto& st : job->params.stop) {
      if (st.empty()) return BadParam("stop", "stop sequences must not be empty");
    }
  }

  if (auto e = GetBool(body, "stream", &job->stream)) return e;
  auto so = body.find("stream_options");
  if (so != body.end() && !so->is_null()) {
    if (!so->is_object()) return BadParam("stream_options", "'stream_options' must be an object");
    if (auto e = GetBool(*so, "include_usage", &job->include_usage)) {
      e->param = "stream_options.include_usage";
      return e;
    }
    // As OpenAI answers: options for a stream on a request that is not one are a mistake.
    if (!job->stream) return BadParam("stream_options", "'stream_options' is only allowed when 'stream' is true");
  }
  auto user = body.find("user");
  if (user != body.end() && !user->is_null() && !user->is_string()) {
    return BadParam("user", "'user' must be a string");
  }
  return std::nullopt;
}

namespace {

// One prompt given as token ids, appended to *out.
std::optional<ApiError> ParseTokenIds(const json& ids, int vocab, std::vector<int>* out) {
  if (ids.empty()) return BadParam("prompt", "'prompt' must not be empty");
  for (const auto& t : ids) {
    if (!t.is_number_integer()) return BadParam("prompt", "token ids must be integers");
    int64_t id = t.is_number_unsigned() && t.get<uint64_t>() > static_cast<uint64_t>(vocab)
                     ? static_cast<int64_t>(vocab)
                     : t.get<int64_t>();
    if (id < 0 || id >= vocab) {
      return BadParam("prompt", fmt::format("token id {} is outside the vocabulary (0..{})", t.dump(), vocab - 1));
    }
    out->push_back(static_cast<int>(id));
  }
  return std::nullopt;
}

}  // namespace

// Prompts of /v1/completions: a string, an array of token ids, or an array of strings or of
// arrays of token ids. Token ids are used as given (no BOS added).
std::optional<ApiError> ParsePrompt(const json& body, const Tokenizer& tok, int vocab,
                                    std::vector<std::vector<int>>* out) {
  auto p = body.find("prompt");
  if (p == body.end() || p->is_null()) return BadParam("prompt", "'prompt' is required");
  if (p->is_string()) {
    out->push_back(tok.Encode(p->get<std::string>(), /*bos=*/true));
    return std::nullopt;
  }
  if (!p->is_array()) {
    return BadParam("prompt", "'prompt' must be a string, an array of strings, or an array of token ids");
  }
  if (p->empty()) return BadParam("prompt", "'prompt' must not be empty");
  const bool several = (*p)[0].is_string() || (*p)[0].is_array();
  if (!several) {
    out->emplace_back();
    return ParseTokenIds(*p, vocab, &out->back());
  }
  if (p->size() > static_cast<size_t>(kMaxPromptsPerRequest)) {
    return BadParam("prompt", fmt::format("'prompt' holds at most {} prompts", kMaxPromptsPerRequest));
  }
  for (const auto& one : *p) {
    if (one.is_string()) {
      out->push_back(tok.Encode(one.get<std::string>(), /*bos=*/true));
    } else if (one.is_array()) {
      out->emplace_back();
      if (auto e = ParseTokenIds(one, vocab, &out->back())) return e;
    } else {
      return BadParam("prompt", "an array of prompts must hold only strings or arrays of token ids");
    }
  }
  return std::nullopt;
}

std::optional<ApiError> ParseMessages(const json& body, const Tokenizer& tok, std::vector<int>* out) {
  auto m = body.find("messages");
  if (m == body.end() || m->is_null()) return BadParam("messages", "'messages' is required");
  if (!m->is_array() || m->empty()) return BadParam("messages", "'messages' must be a non-empty array");
  std::vector<std::string> contents;
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    std::string where = fmt::format("messages[{}]", i);
    if (!msg.is_object()) return BadParam(where, where + " must be an object");
    auto role = msg.find("role");
    if (role == msg.end() || !role->is_string()) {
      return BadParam(where + ".role", where + ".role must be a string");
    }
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "developer" && r != "tool") {
      return BadParam(where + ".role",
                      fmt::format("{}.role '{}' is not supported (system, developer, user, assistant, tool)", where, r));
    }
    // A tool result replays a conversation held with another model (this server offers no tools);
    // its content is text like any other turn. OpenAI requires the id of the call it answers.
    if (r == "tool") {
      auto id = msg.find("tool_call_id");
      if (id == msg.end() || !id->is_string()) {
        return BadParam(where + ".tool_call_id", fmt::format("Missing required parameter: '{}.tool_call_id'", where));
      }
    }
    auto content = msg.find("content");
    if (content == msg.end()) return BadParam(where + ".content", where + ".content is required");
    if (content->is_string()) {
      contents.push_back(content->get<std::string>());
    } else if (content->is_null() && r == "assistant") {
      contents.emplace_back();
    } else if (content->is_array()) {
      // Content parts: only text parts are supported; they are concatenated.
      std::string text;
      for (const auto& part : *content) {
        auto type = part.is_object() ? part.find("type") : part.end();
        auto t = part.is_object() ? part.find("text") : part.end();
        // An assistant's refusal part (replayed history) is its text under another name.
        if (r == "assistant" && part.is_object() && type != part.end() && *type == "refusal") {
          auto refusal = part.find("refusal");
          if (refusal == part.end() || !refusal->is_string()) {
            return BadParam(where + ".content", where + ".content refusal parts must be {\"type\":\"refusal\",\"refusal\":...}");
          }
          text += refusal->get<std::string>();
          continue;
        }
        if (!part.is_object() || type == part.end() || *type != "text" || t == part.end() || !t->is_string()) {
          return BadParam(where + ".content", where + ".content parts must be {\"type\":\"text\",\"text\":...}");
        }
        text += t->get<std::string>();
      }
      contents.push_back(std::move(text));
    } else {
      return BadParam(where + ".content", where + ".content must be a string");
    }
  }
  *out = tok.Encode(RenderChat(contents), /*bos=*/true);
  return std::nullopt;
}

// Fills max_tokens: explicit values must be >= 1 and fit the context with the prompt; the
// default is what the context leaves (chat) or at most 16 (completions).
std::optional<ApiError> ParseMaxTokens(const json& body, bool chat, int prompt_len, int context,
                                       GenerationParams* params, bool allow_zero) {
  const char* name = "max_tokens";
  int64_t value = 0;
  bool present = false;
  if (chat) {
    if (auto e = GetInt(body, "max_completion_tokens", &value, &present)) return e;
    if (present) name = "max_completion_tokens";
  }
  if (!present) {
    if (auto e = GetInt(body, "max_tokens", &value, &present)) return e;
  }
  if (prompt_len >= context) {
    // OpenAI's code for it: clients that trim history and retry look for it.
    ApiError e = BadParam(chat ? "messages" : "prompt",
                           fmt::format("This model's maximum context length is {} tokens. However, your {} resulted "
                                       "in {} tokens. Please reduce the length of the {}.",
                                       context, chat ? "messages" : "prompt", prompt_len, chat ? "messages" : "prompt"));
    e.code = "context_length_exceeded";
    return e;
  }
  if (!present) {
    const int64_t left = context - prompt_len;
    params->max_tokens = static_cast<int>(chat ? left : std::min<int64_t>(16, left));
    return std::nullopt;
  }
  if (value < (allow_zero ? 0 : 1)) {
    return BadParam(name, fmt::format("'{}' must be at least {}", name, allow_zero ? "0 (with echo)" : "1"));
  }
  if (value > static_cast<int64_t>(context - prompt_len)) {  // no overflow for huge values
    ApiError e = BadParam(name, fmt::format("This model's maximum context length is {} tokens. However, you "
                                             "requested {} tokens ({} in the prompt, {} for the completion). Please "
                                             "reduce the length of the prompt or completion.",
                                             context, static_cast<double>(prompt_len) + static_cast<double>(value),
                                             prompt_len, value));
    e.code = "context_length_exceeded";
    return e;
  }
  params->max_tokens = static_cast<int>(value);
  return std::nullopt;
}

std::optional<ApiError> ParseLogprobs(const json& body, bool chat, GenerationParams* params) {
  params->logprobs = -1;
  auto lp = body.find("logprobs");
  const bool lp_set = lp != body.end() && !lp->is_null();
  const std::string range = fmt::format("between 0 and {}", kMaxTopLogprobs);
  if (!chat) {
    if (!lp_set || (lp->is_boolean() && !lp->get<bool>())) return std::nullopt;
    if (!lp->is_number_integer()) return BadParam("logprobs", "'logprobs' must be an integer " + range);
    int64_t n = 0;
    bool present = false;
    if (auto e = GetInt(body, "logprobs", &n, &present)) return e;
    if (n < 0 || n > kMaxTopLogprobs) return BadParam("logprobs", "'logprobs' must be an integer " + range);
    params->logprobs = static_cast<int>(n);
    return std::nullopt;
  }
  bool want = false;
  if (auto e = GetBool(body, "logprobs", &want)) return e;
  int64_t top = 0;
  bool top_present = false;
  if (auto e = GetInt(body, "top_logprobs", &top, &top_present)) return e;
  if (top_present) {
    if (top < 0 || top > kMaxTopLogprobs) {
      return BadParam("top_logprobs", "'top_logprobs' must be an integer " + range);
    }
    if (!want) return BadParam("top_logprobs", "'top_logprobs' needs 'logprobs' set to true");
  }
  if (want) params->logprobs = static_cast<int>(top);
  return std::nullopt;
}

std::optional<ApiError> ParseEcho(const json& body, bool chat, ServerJob* job) {
  if (chat) return std::nullopt;
  if (auto e = GetBool(body, "echo", &job->echo)) return e;
  job->params.prompt_logprobs = job->echo && job->params.logprobs >= 0;
  return std::nullopt;
}

std::optional<ApiError> RejectUnsupported(const json& body, bool chat) {
  if (!chat) {
    auto suffix = body.find("suffix");
    if (suffix != body.end() && !suffix->is_null() && !(suffix->is_string() && suffix->get<std::string>().empty())) {
      return BadParam("suffix", "suffix is not supported");
    }
  } else {
    // Agent frameworks send their tools on every turn; with tool_choice "none" none may be
    // called, which this server can honour. Any other choice needs tool calling.
    auto tools = body.find("tools");
    if (tools != body.end() && !tools->is_null() && !(tools->is_array() && tools->empty())) {
      if (!tools->is_array()) return BadParam("tools", "'tools' must be an array");
      auto choice = body.find("tool_choice");
      if (choice == body.end() || !choice->is_string() || choice->get<std::string>() != "none") {
        return BadParam("tools", "tools are not supported (only with tool_choice \"none\")");
      }
    }
  }
  // Both endpoints: legacy completions have no such field, but a client that sends one wants it.
  auto format = body.find("response_format");
  if (format != body.end() && !format->is_null()) {
    auto type = format->is_object() ? format->find("type") : format->end();
    if (type == format->end() || !type->is_string()) {
      return BadParam("response_format", "'response_format' must be an object with a string 'type'");
    }
    // Structured output needs constrained decoding, which this server lacks: refusing beats a
    // 200 whose text a client's JSON parse then fails on.
    if (type->get<std::string>() != "text") {
      return BadParam("response_format.type",
                      fmt::format("response_format type '{}' is not supported (only 'text')", type->get<std::string>()));
    }
  }
  return std::nullopt;
}

// logit_bias: {"token id": bias in [-100, 100]}, as OpenAI takes it (ids as JSON object keys).
std::optional<ApiError> ParseLogitBias(const json& body, int vocab, SamplingOptions* s) {
  auto lb = body.find("logit_bias");
  if (lb == body.end() || lb->is_null()) return std::nullopt;
  if (!lb->is_object()) return BadParam("logit_bias", "'logit_bias' must be an object of token id -> bias");
  if (lb->size() > 1024) return BadParam("logit_bias", "'logit_bias' holds at most 1024 tokens");
  for (auto it = lb->begin(); it != lb->end(); ++it) {
    const std::string& key = it.key();
    int64_t id = -1;
    const auto r = std::from_chars(key.data(), key.data() + key.size(), id);
    if (key.empty() || r.ec != std::errc() || r.ptr != key.data() + key.size() || id < 0 || id >= vocab) {
      return BadParam("logit_bias", fmt::format("logit_bias key '{}' is not a token id (0..{})", key, vocab - 1));
    }
    if (!it->is_number() || !(it->get<double>() >= -100 && it->get<double>() <= 100)) {
      return BadParam("logit_bias", fmt::format("logit_bias['{}'] must be a number between -100 and 100", key));
    }
    s->logit_bias.emplace_back(static_cast<int>(id), static_cast<float>(it->get<double>()));
  }
  return std::nullopt;
}

int CutPromptFront(std::vector<int>* prompt, int max_tokens) {
  const int n = static_cast<int>(prompt->size());
  max_tokens = std::max(1, max_tokens);
  if (n <= max_tokens) return 0;
  const int drop = n - max_tokens;
  // Keep a BOS: the model was trained with one at position 0, and nothing else marks the start.
  const int from = (*prompt)[0] == Tokenizer::kBos ? 1 : 0;
  prompt->erase(prompt->begin() + from, prompt->begin() + from + drop);
  return drop;
}

std::optional<ApiError> ParseGenerateRequest(const std::string& body_text, bool chat, const std::string& model_name,
                                             const Tokenizer& tok, int vocab, int context, ServerJob* job,
                                             int max_prompt_tokens) {
  // The body is parsed as JSON whatever the Content-Type says: `curl -d` sends form encoding.
  JsonReadError why = JsonReadError::kNone;
  Result<json> parsed = ParseUntrustedJson(body_text, kRequestJsonLimits, &why);
  switch (why) {
    case JsonReadError::kNone: break;
    case JsonReadError::kTooDeep: return BadParam("", "request JSON nests too deeply");
    case JsonReadError::kMalformed:
      return ApiError{400, "We could not parse the JSON body of your request: it is not valid JSON",
                      "invalid_request_error", std::nullopt, std::nullopt};
    case JsonReadError::kNotObject: return BadParam("", "the request body must be a JSON object");
    case JsonReadError::kNumberOutOfRange: return BadParam("", "a number in the request is too large");
    default: return BadParam("", "request " + parsed.status().message());
  }
  json body = std::move(parsed).value();
  std::optional<ApiError> err = ParseCommon(body, model_name, job);
  if (!err) err = ParseLogprobs(body, chat, &job->params);
  if (!err) err = ParseLogitBias(body, vocab, &job->params.sampling);
  if (!err) err = RejectUnsupported(body, chat);
  if (!err) err = ParseEcho(body, chat, job);
  std::vector<std::vector<int>> prompts;
  if (!err) {
    if (chat) {
      prompts.emplace_back();
      err = ParseMessages(body, tok, &prompts.back());
    } else {
      err = ParsePrompt(body, tok, vocab, &prompts);
    }
  }
  if (err) return err;
  job->prompts.clear();
  for (std::vector<int>& tokens : prompts) {
    JobPrompt p;
    p.tokens = std::move(tokens);
    if (max_prompt_tokens > 0) p.tokens_cut = CutPromptFront(&p.tokens, max_prompt_tokens);
    GenerationParams fitted;
    if (auto e = ParseMaxTokens(body, chat, static_cast<int>(p.tokens.size()), context, &fitted, job->echo)) return e;
    p.max_tokens = fitted.max_tokens;
    if (p.tokens.empty()) return BadParam(chat ? "messages" : "prompt", "the prompt is empty");
    if (job->echo) p.echo_text = EchoText(tok, p.tokens);
    job->prompts.push_back(std::move(p));
  }
  if (job->choices() > kMaxChoicesPerRequest) {
    return BadParam("n", fmt::format("{} prompts x n = {} asks for {} choices; at most {} per request",
                                     job->prompts.size(), job->n, job->choices(), kMaxChoicesPerRequest));
  }
  return std::nullopt;
}

GenerationParams ServerJob::params_of(int choice) const {
  GenerationParams p = params;
  p.max_tokens = prompt_of(choice).max_tokens;
  p.sampling.seed += static_cast<uint64_t>(choice % n);  // wraps, as seeds may
  return p;
}

int ServerJob::prompt_tokens() const {
  int total = 0;
  for (const JobPrompt& p : prompts) total += static_cast<int>(p.tokens.size());
  return total;
}

int ServerJob::prompt_tokens_cut() const {
  int total = 0;
  for (const JobPrompt& p : prompts) total += p.tokens_cut;
  return total;
}

// ---------------------------------------------------------------------------------------------
// Response shaping

const char* OpenAiFinishReason(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    default: return nullptr;
  }
}

std::string SseEvent(const json& j) { return "data: " + Dump(j) + "\n\n"; }

json UsageObject(const Usage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

namespace {

// A prompt token's text in an echo: BOS and EOS are markers, not text the client sent.
std::string EchoPiece(const Tokenizer& tok, int prev, int token) {
  if (token == Tokenizer::kBos || token == Tokenizer::kEos) return {};
  return tok.Decode(prev, token);
}

// The four parallel arrays of a completions "logprobs" object, filled token by token; text
// offsets count from *text_offset, which is advanced.
struct CompletionLogprobs {
  explicit CompletionLogprobs(size_t* offset) : text_offset(offset) {}
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       offsets = json::array();
  size_t* text_offset;

  // Dictionary keys are made valid UTF-8 here, not at serialisation, so that two byte tokens
  // that both become U+FFFD stay one key instead of a duplicate.
  static std::string Key(const std::string& s) { return json::parse(Dump(json(s))).get<std::string>(); }
  void Push(const std::string& text, json logprob, json top) {
    tokens.push_back(text);
    token_logprobs.push_back(std::move(logprob));
    top_logprobs.push_back(std::move(top));
    offsets.push_back(*text_offset);
    *text_offset += text.size();
  }
  // `piece(prev, token)`: the text a token adds. The dictionary holds the alternatives and the
  // token itself.
  template <class Piece>
  void Add(const TokenLogprob& e, Piece piece) {
    const std::string text = piece(e.prev, e.token);
    json top = json::object();
    for (const auto& [id, lp] : e.top) top[Key(piece(e.prev, id))] = lp;
    top[Key(text)] = e.logprob;
    Push(text, e.logprob, std::move(top));
  }
  json Take() {
    return json{{"tokens", std::move(tokens)}, {"token_logprobs", std::move(token_logprobs)},
                {"top_logprobs", std::move(top_logprobs)}, {"text_offset", std::move(offsets)}};
  }
};

}  // namespace

json LogprobsObject(bool chat, const Tokenizer& tok, const std::vector<TokenLogprob>& entries,
                    size_t* text_offset) {
  auto bytes_of = [](const std::string& s) {
    json b = json::array();
    for (unsigned char c : s) b.push_back(static_cast<int>(c));
    return b;
  };
  if (chat) {
    json content = json::array();
    for (const TokenLogprob& e : entries) {
      const std::string text = tok.Decode(e.prev, e.token);
      json top = json::array();
      for (const auto& [id, lp] : e.top) {
        const std::string alt = tok.Decode(e.prev, id);
        top.push_back({{"token", alt}, {"logprob", lp}, {"bytes", bytes_of(alt)}});
      }
      content.push_back({{"token", text}, {"logprob", e.logprob}, {"bytes", bytes_of(text)},
                         {"top_logprobs", std::move(top)}});
      *text_offset += text.size();
    }
    return json{{"content", std::move(content)}, {"refusal", nullptr}};
  }
  CompletionLogprobs out(text_offset);
  for (const TokenLogprob& e : entries) out.Add(e, [&](int prev, int t) { return tok.Decode(prev, t); });
  return out.Take();
}

std::string EchoText(const Tokenizer& tok, const std::vector<int>& prompt) {
  std::string out;
  int prev = Tokenizer::kBos;
  for (int t : prompt) {
    out += EchoPiece(tok, prev, t);
    prev = t;
  }
  return out;
}

json PromptLogprobsObject(const Tokenizer& tok, bool with_first, int first, const std::vector<TokenLogprob>& entries,
                          size_t* text_offset) {
  CompletionLogprobs out(text_offset);
  if (with_first) out.Push(EchoPiece(tok, Tokenizer::kBos, first), nullptr, nullptr);
  for (const TokenLogprob& e : entries) out.Add(e, [&](int prev, int t) { return EchoPiece(tok, prev, t); });
  return out.Take();
}

void AppendLogprobs(json* into, const json& more) {
  if (into->is_null()) {
    *into = more;
    return;
  }
  for (const char* field : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
    json& to = (*into)[field];
    for (const json& v : more[field]) to.push_back(v);
  }
}

std::string StreamChunk(const ServerJob& job, const std::string& model, int index, const std::string& text,
                        const char* finish, bool first, const json& logprobs) {
  const std::string object = job.chat ? "chat.completion.chunk" : "text_completion";
  json choice = {{"index", index}, {"logprobs", logprobs}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
  if (job.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (first || !text.empty()) delta["content"] = text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  json j = {{"id", job.id}, {"object", object}, {"created", job.created},
            {"model", model}, {"choices", json::array({choice})}};
  if (job.include_usage) j["usage"] = nullptr;
  return SseEvent(j);
}

std::string UsageChunk(const ServerJob& job, const std::string& model, const Usage& usage) {
  const std::string object = job.chat ? "chat.completion.chunk" : "text_completion";
  json j = {{"id", job.id}, {"object", object}, {"created", job.created},
            {"model", model}, {"choices", json::array()}, {"usage", UsageObject(usage)}};
  return SseEvent(j);
}

json CompletionBody(const ServerJob& job, const std::string& model, const std::vector<ChoiceResult>& choices,
                    const Usage& usage) {
  json out = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    json choice = {{"index", i}, {"logprobs", c.logprobs}, {"finish_reason", c.finish ? json(c.finish) : json(nullptr)}};
    if (job.chat) {
      // refusal and annotations as OpenAI sends them: SDK code reads message.refusal === null.
      choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}, {"annotations", json::array()}};
    } else {
      choice["text"] = c.text;
    }
    out.push_back(std::move(choice));
  }
  return json{{"id", job.id}, {"object", job.chat ? "chat.completion" : "text_completion"},
              {"created", job.created}, {"model", model},
              {"choices", std::move(out)}, {"usage", UsageObject(usage)}};
}

}  // namespace keel::engine
