// The request `keel answer` accepts and the prompt it builds (docs/answer.md, "Request").
//
// Request: an OpenAI chat-completions body plus one extension member:
//   {"model":"m","messages":[{"role":"user","content":"..."}],"max_tokens":32,"temperature":0,
//    "keel_retrieval":{"vector":[128 finite numbers]}}
// - messages: 1..max_messages objects {role, content}; role one of system, user, assistant,
//   developer, tool; content a string (content-part arrays are refused) of at most
//   max_message_bytes. There must be a user message: the LAST one is the question. The user and
//   assistant turns before it are the history (BuildPrompt puts the newest of them in the prompt
//   when given a history budget); system, developer and tool turns are not forwarded.
// - model: a string of 1..256 bytes; absent: the server's default model (--model); neither: 400.
// - max_completion_tokens (read first) or max_tokens: an integer 1..max_tokens_limit; absent:
//   default_max_tokens. temperature: a number in [0, 2]; absent: 0 (greedy, so the full state's
//   answer is a stable reference).
// - stream: a boolean; true answers in OpenAI's SSE format, token by token (keel/answer/sse.h).
//   stream_options: {"include_usage": bool}, only with
//   stream: true (400 otherwise, as OpenAI does).
// - keel_retrieval: absent or null = no search. Else an object whose only member "vector" is an
//   array of exactly `dim` finite numbers that fit a float32.
// Other top-level members are ignored, as OpenAI clients send many.
//
// Pure functions: thread-safe, no I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/json_reader.h"
#include "keel/core/status.h"

namespace keel::answer {

struct RequestLimits {
  int dim = 128;                   // length of keel_retrieval.vector (the vector service's dim)
  size_t max_messages = 64;
  size_t max_message_bytes = 16 << 10;
  int64_t max_tokens_limit = 4096;
  int64_t default_max_tokens = 16;
  size_t max_json_values = 20000;  // counted before parsing (keel/core/json_reader.h)
  int max_json_depth = 8;
};

// One earlier turn of the conversation.
struct Turn {
  bool user = true;  // else the assistant
  std::string content;
};

struct AnswerRequest {
  std::string model;                   // "" when absent (the server fills in its default)
  std::string question;                // the last user message's content
  std::vector<Turn> history;           // user and assistant turns before it, oldest first
  int64_t max_tokens = 0;
  double temperature = 0;
  std::optional<std::vector<float>> vector;  // keel_retrieval.vector
  bool stream = false;
  bool include_usage = false;          // stream_options.include_usage
};

// Parses and checks one body. InvalidArgument whose message names the member, e.g.
// "keel_retrieval.vector: expected 128 numbers, got 3", "messages[2].content: expected a string".
Result<AnswerRequest> ParseAnswerRequest(std::string_view body, const RequestLimits& limits);

// The prompt sent to the model as one user message:
//   "Context:\n" + for each document "- " + text + "\n" + "Question: " + question + "\nAnswer:"
// and with no documents just "Question: " + question + "\nAnswer:".
// The documents share `context_bytes`: each gets floor(context_bytes / docs.size()) bytes of its
// text (cut at a UTF-8 boundary, newlines turned into spaces), so asking for more documents puts
// more documents, each shorter, in the same budget. The question is not cut (it is bounded by
// max_message_bytes; a prompt beyond the model's context is the engine's 400).
//
// With `history_bytes` > 0 the newest turns of `history` that fit in it, whole, come first, in
// their order ("Conversation:\n" then "User: ...\n" / "Assistant: ...\n", newlines in a turn
// turned into spaces); the first turn that does not fit drops it and every older one. With 0
// (the default) no history is sent.
std::string BuildPrompt(const std::vector<std::string_view>& docs, std::string_view question, size_t context_bytes,
                        const std::vector<Turn>& history = {}, size_t history_bytes = 0);

// OpenAI's error body: {"error":{"message":..,"type":..,"param":null,"code":..}} with type
// "invalid_request_error" (4xx other than 429), "rate_limit_exceeded" (429) or "upstream_error"
// (5xx), and code the same string.
std::string OpenAIErrorBody(int status, std::string_view message);

// Bounds for what an upstream (vector service, gateway) answers: a hostile or broken peer cannot
// make the answer service build a huge DOM. Objects only, at most 16 deep and 200,000 values.
JsonLimits UpstreamJsonLimits();

}  // namespace keel::answer
