// The gateway's one internal form of a chat request and response. Every client format (OpenAI
// chat/completions, Anthropic messages) is parsed into it and every upstream format (OpenAI,
// Anthropic, Gemini, `keel serve`) is written from it, so N formats need 2N translators, not N².
// Fields a format cannot express are dropped on the way out, never invented.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace keel::gateway {

// Wire formats the gateway speaks. Upstreams: kOpenAIChat (OpenAI and `keel serve`),
// kAnthropicMessages, kGemini. Clients (fronts): kOpenAIChat, kOpenAICompletions,
// kAnthropicMessages, kGemini (generateContent), kOpenAIResponses (POST /v1/responses).
enum class WireFormat { kOpenAIChat, kOpenAICompletions, kAnthropicMessages, kGemini, kOpenAIResponses };
const char* WireFormatName(WireFormat f);  // "openai-chat", "openai-completions", "anthropic", "gemini"

struct ToolCall {
  std::string id;              // vendor call id ("call_..", "toolu_.."); generated when absent
  std::string name;
  std::string arguments_json;  // JSON object text, as the model produced it
};

struct Message {
  std::string role;                 // "user", "assistant", "tool" (system lives in ChatRequest)
  std::string content;              // text (multi-part text content is concatenated)
  std::vector<ToolCall> tool_calls; // assistant turns that called tools
  std::string tool_call_id;         // role "tool": which call this result answers
  std::string name;                 // role "tool": the function's name, when known
  bool tool_error = false;          // role "tool": Anthropic tool_result.is_error (the call failed)
};

struct Tool {
  std::string name;
  std::string description;
  std::string parameters_json;  // JSON Schema object text ("{}" when none)
  std::optional<bool> strict;   // OpenAI: arguments must follow the schema exactly
};

// Structured output: OpenAI response_format / Responses text.format, Gemini
// generationConfig.responseMimeType + responseJsonSchema, Anthropic output_format.
struct ResponseFormat {
  enum class Kind { kText, kJsonObject, kJsonSchema };
  Kind kind = Kind::kText;
  std::string name;         // kJsonSchema: the schema's name (OpenAI requires one)
  std::string schema_json;  // kJsonSchema: the JSON Schema object text
  bool strict = false;      // OpenAI json_schema.strict
};

struct ChatRequest {
  WireFormat client_format = WireFormat::kOpenAIChat;
  std::string model;                 // as the client named it (a virtual model name)
  std::string system;                // system prompt(s), joined with "\n"
  std::vector<Message> messages;
  std::string prompt;                // kOpenAICompletions only: the prompt text
  std::vector<Tool> tools;
  std::string tool_choice;           // "", "auto", "none", "required", or a function name
  std::optional<int64_t> max_tokens;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> seed;       // OpenAI "seed" (best-effort determinism; keel serve honours it)
  std::vector<std::string> stop;
  std::optional<int64_t> top_k;               // Anthropic/Gemini top_k
  std::optional<double> presence_penalty;     // OpenAI; Gemini presencePenalty
  std::optional<double> frequency_penalty;    // OpenAI; Gemini frequencyPenalty
  std::string logit_bias_json;                // OpenAI logit_bias object text; "" = absent
  std::optional<bool> parallel_tool_calls;    // OpenAI; Anthropic tool_choice.disable_parallel_tool_use
  std::optional<ResponseFormat> response_format;
  bool stream = false;
  bool stream_include_usage = false;  // OpenAI stream_options.include_usage
  std::string user;                   // OpenAI "user" / Anthropic metadata.user_id
  std::string reasoning_effort;       // OpenAI reasoning_effort / Responses reasoning.effort; "" = absent
};

enum class FinishReason { kNone, kStop, kLength, kToolCalls, kContentFilter };

struct Usage {
  int64_t input_tokens = -1;   // -1: not reported
  int64_t output_tokens = -1;
};

struct ChatResponse {
  std::string id;
  std::string model;           // the upstream model that answered
  int64_t created = 0;         // unix seconds
  std::string content;
  std::vector<ToolCall> tool_calls;
  FinishReason finish = FinishReason::kNone;
  std::string stop_sequence;   // kStop because this stop sequence matched, when the vendor says
  Usage usage;
};

// One step of a streamed answer, vendor-neutral.
struct StreamEvent {
  enum class Kind {
    kStart,          // id/model known (first event)
    kTextDelta,      // text
    kToolCallStart,  // tool_index, tool_call.id, tool_call.name
    kToolCallDelta,  // tool_index, text = a piece of the arguments JSON
    kFinish,         // finish
    kUsage,          // usage (may come before or after kFinish)
    kDone,           // the upstream ended the stream cleanly
  };
  Kind kind = Kind::kTextDelta;
  std::string id;
  std::string model;
  std::string text;
  int tool_index = 0;
  ToolCall tool_call;
  FinishReason finish = FinishReason::kNone;
  std::string stop_sequence;   // kFinish: the stop sequence that matched, when the vendor says
  Usage usage;
};

// An error in vendor-neutral form: HTTP status plus a kind that every format can express.
enum class ErrorKind {
  kInvalidRequest,   // 400
  kAuthentication,   // 401
  kPermission,       // 403
  kNotFound,         // 404
  kRequestTooLarge,  // 413
  kRateLimit,        // 429 (also: budget exhausted)
  kApi,              // 500
  kBadGateway,       // 502 (upstream garbage, truncated stream)
  kOverloaded,       // 503 / 529
  kTimeout,          // 504
};

struct GatewayError {
  int status = 500;
  ErrorKind kind = ErrorKind::kApi;
  std::string message;
  // An upstream's Retry-After (seconds, as it sent them; "" for none), passed on so SDKs wait as
  // long as the vendor asked instead of their own short backoff.
  std::string retry_after;
};

}  // namespace keel::gateway
