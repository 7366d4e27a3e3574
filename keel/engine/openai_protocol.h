// OpenAI protocol pieces of the engine server: parsing and validating /v1/completions and
// /v1/chat/completions requests, and shaping their responses and error bodies.
//
// Internal header: used by server.cc and its tests only; not part of Keel's public API (see
// server.h for that). Nothing here touches a socket or a thread: apart from the tokenizer and
// the random seed ParseCommon draws when the request names none, every function is a pure
// function of its arguments, so each is safe to call from any thread.
//
// Errors: every parser returns std::nullopt on success, or the ApiError to send. Unless noted,
// that is a 400 invalid_request_error whose `param` names the offending field (BadParam), with
// the message clients see verbatim.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/json_reader.h"
#include "keel/engine/scheduler.h"
#include "keel/engine/tokenizer.h"

namespace keel::engine {

// An OpenAI error: HTTP status plus the fields of {"error":{"message","type","param","code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::optional<std::string> param;
  std::optional<std::string> code;
};

// One prompt of a request, parsed and validated: what its choices are generated from.
struct JobPrompt {
  std::vector<int> tokens;
  std::string echo_text;  // with ServerJob::echo: the prompt as the model reads it (EchoText)
  int max_tokens = 16;   // generated tokens at most, fitted to this prompt and the context
  int tokens_cut = 0;    // dropped from the front of a prompt over max_prompt_tokens
};

// How many prompts one /v1/completions request may carry, and how many choices (prompts x n) a
// request may ask for: each choice is a sequence in the batch, so this bounds what one request
// can take of the scheduler's queue (OpenAI's own cap on n is 128).
inline constexpr int kMaxPromptsPerRequest = 64;
inline constexpr int kMaxChoicesPerRequest = 128;

// Everything about one generation request, parsed and validated. Choice i = p * n + j is the
// j-th sample of prompt p; it samples with seed + j, so choice 0 of a request with n > 1 is what
// the same request with n = 1 answers, and a request with a seed repeats exactly.
struct ServerJob {
  bool chat = false;
  std::string route;
  std::vector<JobPrompt> prompts;  // chat: one
  int n = 1;                       // samples per prompt
  GenerationParams params;         // shared by every choice (max_tokens: see JobPrompt)
  bool stream = false;
  bool include_usage = false;
  // Completions' echo: each choice's text starts with its prompt; with logprobs, the prompt's
  // tokens are scored too (params.prompt_logprobs) and lead the choice's logprobs.
  bool echo = false;
  std::string id;
  int64_t created = 0;
  std::chrono::steady_clock::time_point start;

  int choices() const { return static_cast<int>(prompts.size()) * n; }
  const JobPrompt& prompt_of(int choice) const { return prompts[static_cast<size_t>(choice / n)]; }
  // The generation parameters of one choice: the shared ones, its prompt's max_tokens, and its
  // seed (seed + j for the j-th sample).
  GenerationParams params_of(int choice) const;
  int prompt_tokens() const;       // over all prompts, each counted once (not n times)
  int prompt_tokens_cut() const;   // over all prompts
};

// ---------------------------------------------------------------------------------------------
// Errors and JSON output

// Serialises compactly. Generated text may hold bytes that are not valid UTF-8 (byte-fallback
// tokens); they become U+FFFD instead of throwing.
std::string Dump(const nlohmann::json& j);
// {"error":{...}} for `e` (absent param/code are null).
nlohmann::json ErrorObject(const ApiError& e);
// A 400 invalid_request_error naming `param` ("" for the body as a whole: param null).
ApiError BadParam(std::string param, std::string message);
// The body for errors the HTTP layer itself produces (404, 405, 413, 431, 400 for broken HTTP,
// 503): server_error for 5xx, else invalid_request_error; 404 gets code "not_found".
std::string OpenAiHttpErrorBody(int status, std::string_view message);

// ---------------------------------------------------------------------------------------------
// Request parsing

// Bounds on a request body (keel/core/json_reader.h): nothing in this API nests more than a few
// levels, and 1M values holds any prompt of token ids a context can take, with room to spare.
inline constexpr JsonLimits kRequestJsonLimits{.max_depth = 32, .max_values = size_t{1} << 20, .require_object = true};

// Optional-field readers: an absent or null field leaves *out untouched (and *present false).
// GetInt: an integer (unsigned values above INT64_MAX saturate); "'<name>' must be an integer".
std::optional<ApiError> GetInt(const nlohmann::json& body, const char* name, int64_t* out, bool* present);
// GetNumber: any finite number; "'<name>' must be a number" / "'<name>' must be finite".
std::optional<ApiError> GetNumber(const nlohmann::json& body, const char* name, double* out, bool* present);
// GetBool: a boolean; "'<name>' must be a boolean".
std::optional<ApiError> GetBool(const nlohmann::json& body, const char* name, bool* out);

// The chat template. The llama2.c models Keel serves by default were trained on plain text and
// know no role markers, so a conversation is rendered as the messages' contents in order, each
// separated by a single "\n", with no role labels and no trailing separator:
//   [{system,"A"},{user,"B"}]  ->  "A\nB"
// which is then encoded with BOS. Models with a real chat template need their own renderer.
std::string RenderChat(const std::vector<std::string>& contents);

// The fields common to both endpoints: model (required; a name other than `model_name` is a
// 404 with code "model_not_found"), n (1..kMaxChoicesPerRequest) and best_of (absent or equal to
// n: Keel does not generate extra candidates to rank), temperature [0, 2], top_p (0, 1],
// top_k >= 0, seed (any integer; a random one when absent), stop (a string or up to 4
// non-empty strings), stream, stream_options.include_usage, user. Fills job->params.sampling,
// job->n, job->params.stop, job->stream and job->include_usage.
std::optional<ApiError> ParseCommon(const nlohmann::json& body, const std::string& model_name, ServerJob* job);

// The prompts of /v1/completions into *out (each appended as one entry): a string, an array of
// token ids, or an array of up to kMaxPromptsPerRequest strings or arrays of token ids, as
// OpenAI takes them. Strings are encoded with BOS; token ids are used as given (no BOS) and must
// lie in [0, vocab). Missing or empty prompts, mixed forms and ids out of range are errors on
// "prompt".
std::optional<ApiError> ParsePrompt(const nlohmann::json& body, const Tokenizer& tok, int vocab,
                                    std::vector<std::vector<int>>* out);

// The messages of /v1/chat/completions into *out: a non-empty array of {role, content}, role
// one of system, developer, user, assistant, tool (which needs a string tool_call_id); content a
// string, text parts (concatenated), or null for an assistant. Rendered with RenderChat and encoded with BOS. Errors name the field,
// e.g. "messages[1].role".
std::optional<ApiError> ParseMessages(const nlohmann::json& body, const Tokenizer& tok, std::vector<int>* out);

// Fills params->max_tokens for a prompt of `prompt_len` tokens in a `context`-token window.
// Chat reads max_completion_tokens first, then max_tokens. A prompt that fills the context is an
// error on "prompt"/"messages"; an explicit value must be >= 1 (>= 0 with `allow_zero`: echo,
// which may only score the prompt) and fit beside the prompt. The default is what the context
// leaves (chat) or min(16, that) (completions).
std::optional<ApiError> ParseMaxTokens(const nlohmann::json& body, bool chat, int prompt_len, int context,
                                       GenerationParams* params, bool allow_zero = false);

// Log-probabilities into params->logprobs (-1: none). Completions: "logprobs" is the number of
// alternatives per token, an integer 0..kMaxTopLogprobs (the sampled token's own log-probability
// always comes with it); false or null for none. Chat: "logprobs" a boolean, "top_logprobs" an
// integer 0..kMaxTopLogprobs that needs logprobs true.
std::optional<ApiError> ParseLogprobs(const nlohmann::json& body, bool chat, GenerationParams* params);

// Completions' "echo" (a boolean) into job->echo; with logprobs it also asks the scheduler to
// score the prompt (params.prompt_logprobs). Chat has no such field.
std::optional<ApiError> ParseEcho(const nlohmann::json& body, bool chat, ServerJob* job);

// Rejects features Keel does not implement: for completions suffix (unless ""), for chat tools
// (unless []).
std::optional<ApiError> RejectUnsupported(const nlohmann::json& body, bool chat);

// Cuts a prompt longer than `max_tokens` (>= 1) from the front: a leading BOS stays, then the
// last tokens that fit, so the newest text (the question, the last turn) survives. Returns how
// many tokens were dropped (0 when it fits).
int CutPromptFront(std::vector<int>* prompt, int max_tokens);

// The whole request body of either endpoint, in the order the server checks it: nesting (at
// most 32 levels), JSON syntax, a top-level object, ParseCommon, ParseLogprobs, RejectUnsupported, the prompt
// (ParseMessages or ParsePrompt; ParseEcho before them), then for each prompt CutPromptFront to `max_prompt_tokens` when
// it is > 0 (HiLO's max_context; JobPrompt::tokens_cut), ParseMaxTokens against `context` and a
// non-empty prompt; then prompts x n <= kMaxChoicesPerRequest. Fills the parsed fields of *job
// (job->chat, id, created and start are the caller's).
std::optional<ApiError> ParseGenerateRequest(const std::string& body, bool chat, const std::string& model_name,
                                             const Tokenizer& tok, int vocab, int context, ServerJob* job,
                                             int max_prompt_tokens = 0);

// ---------------------------------------------------------------------------------------------
// Response shaping

// The OpenAI finish_reason for a finished sequence: "stop", "length", or nullptr for reasons
// OpenAI has no name for (cancelled, error), which the server turns into an error instead.
const char* OpenAiFinishReason(FinishReason r);
// One server-sent event: "data: <json>\n\n".
std::string SseEvent(const nlohmann::json& j);
// A request's token counts: its prompts (each once) and every choice's completion.
struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
};
// {"prompt_tokens","completion_tokens","total_tokens"}.
nlohmann::json UsageObject(const Usage& u);
// The "logprobs" object of a choice, for the generated tokens `entries` (all of a response, or
// those of one streamed chunk). Token strings are the bytes each token adds to the text (invalid
// UTF-8 is replaced when serialised; chat's "bytes" holds the exact bytes).
//   chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
//                 "logprob", "bytes"}, ...]}, ...], "refusal": null}
//   completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob,
//                 ...}, ...], "text_offset": [...]}; the dictionaries hold the alternatives and
//                 the sampled token; text offsets are bytes into the completion text, counted
//                 from *text_offset, which is advanced (a stream carries it across chunks).
nlohmann::json LogprobsObject(bool chat, const Tokenizer& tok, const std::vector<TokenLogprob>& entries,
                              size_t* text_offset);
// The prompt as echo returns it: its tokens decoded in order, BOS and EOS as nothing.
std::string EchoText(const Tokenizer& tok, const std::vector<int>& prompt);
// A completions "logprobs" object (LogprobsObject's shape) for an echoed prompt: with
// `with_first`, first the prompt's first token (`first`), whose logprob and top_logprobs are null
// (nothing precedes it); then the scored positions `entries`. Text offsets count from
// *text_offset, which is advanced.
nlohmann::json PromptLogprobsObject(const Tokenizer& tok, bool with_first, int first,
                                    const std::vector<TokenLogprob>& entries, size_t* text_offset);
// Appends the arrays of completions logprobs object `more` to those of `into` (null `into`:
// becomes `more`).
void AppendLogprobs(nlohmann::json* into, const nlohmann::json& more);

// One streamed chunk of choice `index` as an SSE event: `text` as a delta (chat: a choice's
// first chunk also carries role "assistant" and content even when empty) or as "text";
// finish_reason `finish` or null; `logprobs` (null, or a LogprobsObject); "usage": null when
// job.include_usage.
std::string StreamChunk(const ServerJob& job, const std::string& model, int index, const std::string& text,
                        const char* finish, bool first, const nlohmann::json& logprobs = nullptr);
// The final usage-only chunk of a stream with include_usage (empty choices), as an SSE event.
std::string UsageChunk(const ServerJob& job, const std::string& model, const Usage& usage);
// One finished choice of a non-streamed response.
struct ChoiceResult {
  std::string text;
  const char* finish = nullptr;  // OpenAiFinishReason
  nlohmann::json logprobs;       // null, or a LogprobsObject
};
// The body of a non-streamed response: `choices` in index order, plus usage.
nlohmann::json CompletionBody(const ServerJob& job, const std::string& model, const std::vector<ChoiceResult>& choices,
                              const Usage& usage);

}  // namespace keel::engine
