// Internals shared by the FakeVendor's files: the reply plan (what to say, independent of the
// wire format), model-name switches, and the per-request Exchange (pacing, disconnects, the
// connection cut). Each vendor file turns a Prompt into a Plan and writes it in its own format.
// Not part of the public API.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/core/http_server.h"
#include "keel/gateway/fake_vendor.h"

namespace keel::gateway {

// The FakeVendor's state, shared by every connection thread.
struct FakeVendor::Impl {
  explicit Impl(FakeVendorOptions o) : options(std::move(o)) {}
  const FakeVendorOptions options;
  std::unique_ptr<HttpServer> server;
  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> requests{0}, streams{0}, errors{0}, cancelled{0}, output_tokens{0}, id_counter{0};
  std::atomic<int64_t> active{0};
  uint64_t id_seed = 0;

  mutable std::mutex last_mu;
  nlohmann::ordered_json last_request;  // null until the first vendor request

  // prefix + `len` base62 characters, unique per request.
  std::string NewId(std::string_view prefix, size_t len = 24);
  void Record(const HttpRequest& req);
  void Handle(const HttpRequest& req, HttpResponder& res);
};

}  // namespace keel::gateway

namespace keel::gateway::fake {

using Json = nlohmann::ordered_json;

// Serializes without throwing on invalid UTF-8 (replaced), compact.
std::string Dump(const Json& j);
// ceil(bytes / 4): the fake's token estimate.
inline int64_t EstimateTokens(size_t bytes) { return static_cast<int64_t>((bytes + 3) / 4); }
// Unix seconds now.
int64_t UnixNow();

// Behaviour switches read from the model name (see fake_vendor.h).
struct Switches {
  int error_status = 0;  // 429, 500 or 503 to inject; 0 = none
  bool garbage = false;
  bool truncate = false;
  bool slow = false;
  bool tools = false;
};
Switches ParseSwitches(std::string_view model);

// What a vendor's request parser extracts: enough to plan the answer.
struct Prompt {
  std::string model;
  size_t text_bytes = 0;             // all text, for the input-token estimate
  std::string last_user_text;        // echoed back as the first words
  std::vector<std::string> tools;    // declared tool names, in order
  bool tool_choice_none = false;
  bool last_is_tool_result = false;  // the last turn carries a tool's result
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stop;
  bool stream = false;
  // Structured output (OpenAI response_format, Anthropic output_config.format, Gemini
  // responseMimeType): the answer is one JSON document instead of words. `schema` null = any
  // JSON object ({"answer": <the words>}); else an instance of that JSON Schema.
  bool json_answer = false;
  Json schema;
  // Gemini's responseSchema is OpenAPI-style (upper-case type names); JSON Schema otherwise.
  // text/x.enum answers the first enum value as plain text.
  bool enum_answer = false;
};

enum class Finish { kStop, kLength, kStopSequence, kToolCall };

// The answer, before any wire format.
struct Plan {
  std::vector<std::string> pieces;  // text deltas, one per output token ("say", " hello", " w2")
  Finish finish = Finish::kStop;
  std::string stop_sequence;        // kStopSequence: the one that matched
  // kToolCall: one call; its arguments JSON split into the pieces a stream sends.
  std::string tool_name;
  std::string tool_arguments;       // {"x":1}
  std::vector<std::string> tool_argument_pieces;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;

  std::string Text() const;  // the pieces joined
  // Number of pieces a "truncate" stream sends before it drops the connection.
  size_t TruncatedCount() const { return pieces.size() / 2; }
};
Plan MakePlan(const Prompt& prompt, const Switches& sw, int reply_tokens);

// The words of a plain answer: the prompt's last user text, then "w<i>", `n` in all.
std::vector<std::string> ReplyWords(std::string_view last_user_text, size_t n);
// A JSON value that satisfies `schema` (JSON Schema: type, properties, items, enum, const,
// anyOf/oneOf/allOf, $ref into $defs/definitions, minimum/maximum, minItems, string formats;
// type names in any case, so Gemini's OpenAPI subset works too). Strings take successive `words`
// (then "w<i>"); numbers are 1 (or the minimum), booleans true, arrays one item (or minItems).
// A null schema gives {"answer": <the words joined>}. Never throws; depth is bounded.
Json SchemaInstance(const Json& schema, const std::vector<std::string>& words);
// A JSON text cut into stream pieces at its structure ("{", "\"k\":", "\"v\"", ",", "}"), so
// the pieces join to the text and each is one output token.
std::vector<std::string> JsonPieces(std::string_view text);

// One request being answered: its responder plus pacing, disconnect checks and counters.
class Exchange {
 public:
  Exchange(FakeVendor::Impl& impl, const HttpRequest& req, HttpResponder& res);
  ~Exchange();

  FakeVendor::Impl& impl;
  const HttpRequest& req;
  HttpResponder& res;
  const FakeVendorOptions& options() const { return impl.options; }

  // Sleeps; false (and the exchange counted as cancelled) when the client went away or the
  // fake is stopping first.
  bool SleepMs(double ms);
  bool cancelled() const { return cancelled_; }
  // Milliseconds since the request was read.
  double ElapsedMs() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - arrival_).count();
  }
  // Restarts the pacing clock (after a "slow" wait).
  void RestartClock() { start_ = std::chrono::steady_clock::now(); }
  // Waits until output token i (0-based) is due: ttft_ms + i / tokens_per_second after the start.
  bool AwaitToken(size_t i);
  // Waits until the whole answer of n tokens is due (a non-streamed answer).
  bool AwaitAll(size_t n) { return AwaitToken(n == 0 ? 0 : n - 1); }

  bool Send(int status, std::string_view content_type, std::string body, const HttpHeaderList& extra = {});
  bool Begin(std::string_view content_type, const HttpHeaderList& extra = {});  // a 200 stream
  bool Write(std::string_view data);  // one chunk; false (cancelled) when the client is gone
  void CountTokens(int64_t n) { impl.output_tokens += static_cast<uint64_t>(n); }
  // Drops the connection without finishing the response: the client sees the body end early
  // (no terminating chunk). The server's own later writes fail and it closes the socket.
  void Cut();

 private:
  void Cancel();
  std::chrono::steady_clock::time_point arrival_;
  std::chrono::steady_clock::time_point start_;  // of pacing
  bool cancelled_ = false;
};

// Error bodies in each vendor's format, for the server's own errors (400, 404, 413, 503, ...).
std::string OpenAIErrorBody(int status, std::string_view message);
std::string AnthropicErrorBody(int status, std::string_view message);
std::string GeminiErrorBody(int status, std::string_view message);

// The vendors' handlers: every request that is not /_fake/*.
void ServeOpenAI(Exchange& ex);
void ServeAnthropic(Exchange& ex);
void ServeGemini(Exchange& ex);

// The body a "garbage" answer sends instead of JSON.
inline constexpr std::string_view kGarbageBody = "<html><body>upstream garbage: {\"choices\": [ not json</body></html>";

// Small JSON readers that never throw: nullptr when absent, null or of another type.
const Json* Member(const Json& obj, const char* name);
const Json* StringMember(const Json& obj, const char* name);
const Json* ArrayMember(const Json& obj, const char* name);
const Json* ObjectMember(const Json& obj, const char* name);

}  // namespace keel::gateway::fake
