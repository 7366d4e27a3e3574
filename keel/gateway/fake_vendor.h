// FakeVendor: a local stand-in for one LLM vendor's HTTP API (OpenAI, Anthropic or Gemini) that
// speaks that vendor's documented wire format — request validation, response and SSE shapes,
// error bodies, auth and the usual response headers — and answers with deterministic text. Tests
// and benchmarks point the gateway at it instead of the real vendor.
//
// It is written independently of the gateway's translators (translate.h, stream.h) on purpose:
// a fake that shared their code would agree with their bugs.
//
// Reply. The answer is `reply_tokens` words: the words of the last user message, then filler
// "w<i>" (i = the word's position), so "say hello" gives "say hello w2 w3 ...". One word is one
// output token and one stream chunk/delta. The first is sent `ttft_ms` after the request is
// read, the i-th `i / tokens_per_second` later (0 = no pacing); a non-streamed answer is sent
// when its last token would have been. max_tokens cuts the answer (finish "length",
// "max_tokens", "MAX_TOKENS"); a stop sequence cuts it before the sequence (finish "stop",
// "stop_sequence" with the sequence, "STOP"). As in OpenAI's API, /v1/completions defaults max_tokens to 16.
// Structured output (OpenAI response_format json_object/json_schema, Anthropic
// output_config.format or output_format, Gemini responseMimeType application/json with
// responseSchema/responseJsonSchema) answers one JSON document instead: an instance of the schema
// whose strings are those words, or {"answer": "<words>"} without a schema, streamed in pieces cut
// at its structure (one piece = one token); Gemini text/x.enum answers the schema's first enum value.
// Sampling fields (temperature, top_p, top_k, penalties, seed, logit_bias) are type- and
// range-checked as each vendor checks them and do not change the answer.
//
// Usage. Input tokens are estimated as ceil(bytes / 4) of all the request's text: system
// prompt(s), every message's text parts, tool-call arguments and tool results (the completions
// prompt; the embeddings inputs). Output tokens are the words emitted; a tool call counts
// ceil(bytes(name + arguments) / 4).
//
// Behaviour switches, chosen by substrings of the model name (the gateway forwards model names,
// not custom headers); they combine ("slow-tools"):
//   "error-429"              429 rate-limit error in the vendor's format, with retry-after: 1
//   "error-500"              500 server error
//   "error-503", "overloaded" 503 (Anthropic: 529 overloaded_error)
//   "garbage"                200 with a body that is not JSON (stream: SSE whose data is not JSON)
//   "truncate"               the answer stops half-way and the connection is dropped: no final
//                            event/chunk and no terminating HTTP chunk (non-stream: half a body)
//   "slow"                   waits `slow_ms` (5 s) before answering; gives up when the client goes
//   "tools"                  the answer calls the first declared tool with arguments {"x":1}
//                            (finish tool_calls / tool_use / STOP with a functionCall part), unless
//                            no tool is declared, tool choice is "none", or the last turn is a tool
//                            result (then it answers with text, as a model would after a tool ran)
//
// Test endpoints (no auth): GET /_fake/last_request -> {"method","path","query","headers":{lower-
// cased name: value},"body":"<raw body>"} of the last vendor request; GET /_fake/stats -> the
// counters below ({"requests": n, ...}).
//
// Endpoints by kind:
//   openai:    POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings,
//              GET /v1/models, GET /v1/models/{id}; auth "Authorization: Bearer <key>".
//   anthropic: POST /v1/messages, GET /v1/models; auth "x-api-key" or "Authorization: Bearer";
//              "anthropic-version" required: 2023-01-01, 2023-06-01 or 2026-10-21 (which removed
//              temperature/top_p/top_k); anthropic-beta values are ignored; unknown body fields are
//              refused ("<field>: Extra inputs are not permitted"), as the real API refuses them.
//   gemini:    POST /v1beta/models/{model}:generateContent, :streamGenerateContent (?alt=sse for
//              SSE, else a streamed JSON array), GET /v1beta/models; auth "x-goog-api-key" or
//              "?key=". (/v1/ works as well as /v1beta/.)
//
// Thread safety: Start, port, url, stats and Stop may be called from any thread. Requests are
// served on the HttpServer's connection threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"

namespace keel::gateway {

enum class FakeVendorKind { kOpenAI, kAnthropic, kGemini };
const char* FakeVendorKindName(FakeVendorKind kind);  // "openai", "anthropic", "gemini"
// InvalidArgument for anything but "openai", "anthropic", "gemini".
Result<FakeVendorKind> ParseFakeVendorKind(std::string_view name);

struct FakeVendorOptions {
  FakeVendorKind kind = FakeVendorKind::kOpenAI;
  std::string host = "127.0.0.1";
  int port = 0;                    // 0 = any free port; see FakeVendor::port()
  double ttft_ms = 0;              // delay before the first token (and before a non-stream answer)
  double tokens_per_second = 0;    // pacing of later tokens; 0 = all at once
  int reply_tokens = 16;           // words in a full answer (before max_tokens / stop cut it)
  std::string api_key;             // "" = accept any non-empty key
  int embedding_dims = 8;          // OpenAI embeddings without "dimensions"
  double slow_ms = 5000;           // the "slow" switch's wait
  int max_connections = 1024;      // open connections (HttpServerOptions::max_connections)
  size_t max_body_bytes = 32u << 20;
  double drain_seconds = 2;        // Stop waits this long for answers in progress
};

// Counters since Start. A snapshot; the fields are read one by one, not atomically together.
struct FakeVendorStats {
  uint64_t requests = 0;       // vendor API requests received (not /_fake/*)
  uint64_t streams = 0;        // of those, answered with a stream
  uint64_t errors = 0;         // answered with a 4xx/5xx status (auth, validation, switches)
  uint64_t cancelled = 0;      // the client went away before the answer was complete
  uint64_t output_tokens = 0;  // output tokens written
  int64_t active = 0;          // requests being answered now
};

class FakeVendor {
 public:
  // Binds host:port and starts serving. InvalidArgument for bad options (reply_tokens < 0,
  // negative delays); IOError when the address cannot be bound.
  static Result<std::unique_ptr<FakeVendor>> Start(FakeVendorOptions options);
  ~FakeVendor();  // Stop()
  FakeVendor(const FakeVendor&) = delete;
  FakeVendor& operator=(const FakeVendor&) = delete;

  int port() const;
  std::string url() const;  // "http://host:port" (no trailing slash)
  const FakeVendorOptions& options() const;
  FakeVendorStats stats() const;
  // Cuts pacing and "slow" waits short, then stops the server (waiting up to drain_seconds for
  // answers in progress). Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit FakeVendor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `keel fake-vendor`: starts a FakeVendor, prints "fake-vendor <kind> listening on <url>" on
// stdout, serves until SIGINT/SIGTERM, stops. Returns the process exit code (0; 1 when it cannot
// start, 2 for bad options).
int RunFakeVendorMain(const FakeVendorOptions& options);

}  // namespace keel::gateway
