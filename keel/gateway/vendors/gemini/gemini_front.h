// The gateway's Gemini-format front: what a client of the Generative Language API (the official
// `@google/genai` SDK, Google's REST examples) sends to `keel gateway`, parsed into the neutral
// ChatRequest, and the answers written back in Gemini's shapes. Routes served:
//   POST /{v1beta|v1|v1alpha}/models/{model}:generateContent
//   POST /{...}/models/{model}:streamGenerateContent?alt=sse   (SSE; without alt=sse a JSON array)
//   POST /{...}/models/{model}:countTokens
// Pure functions and one stream encoder: no I/O. The functions are thread-safe; an encoder is
// used by one response at a time.
//
// Errors: parsers return InvalidArgument naming the field ("generationConfig.candidateCount: ...")
// -> 400, and ParseGeminiPath NotFound for a path that is not one of the routes above -> 404; the
// body for either is BuildGeminiErrorBody (vendors/gemini/gemini.h) ({"error":{code,message,status}}).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"
#include "keel/gateway/stream.h"

namespace keel::gateway {

struct GeminiRoute {
  enum class Method { kGenerate, kStream, kCountTokens };
  std::string model;  // percent-decoded, without "models/" ("gemini-2.5-flash", "my.model-v1")
  Method method = Method::kGenerate;
  // kStream only: true for ?alt=sse (SSE, what the SDK asks for); false streams a JSON array
  // ("[" chunk ",\r\n" chunk ... "]", Content-Type application/json), as Gemini does without it.
  bool sse = false;
};

// Parses a request target ("/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse").
// The method is after the last ':' of the path, so model names may hold ':' ("llama3:8b"); the
// model is percent-decoded and must then be 1..256 characters of [A-Za-z0-9-._~:@+/] with no
// empty, "." or ".." segment between '/'s. "alt" (or "$alt", up to any ';') is "sse" or "json";
// alt=sse is accepted only for streamGenerateContent. Other query parameters are ignored.
// NotFound: not under /v1beta|v1|v1alpha/models/, no ":method", or a method other than the three
// served (embedContent, ...). InvalidArgument: a bad %-escape, a model outside the rule above, or
// a bad alt.
Result<GeminiRoute> ParseGeminiPath(std::string_view target);

// The API key a Gemini client presented: the x-goog-api-key header's value (what the SDK sends)
// when non-empty, else the "key" query parameter, %-decoded ('+' is a space). "" when neither is
// there or the parameter's %-escapes are malformed. `query` is the target after '?'.
std::string GeminiPresentedKey(std::string_view x_goog_api_key_header, std::string_view query);

// A generateContent / streamGenerateContent body -> ChatRequest (client_format kGemini, model =
// `model_from_url`; a "model" in the body is ignored). Field names may be lowerCamelCase or
// snake_case, as proto JSON allows. Carried: contents (role user|model, "function" read as user;
// text, functionCall, functionResponse parts), systemInstruction, tools[].functionDeclarations
// (Gemini `parameters` schemas are converted to JSON Schema: types lower-cased, nullable ->
// type [t, "null"]; `parametersJsonSchema` is kept as is), toolConfig.functionCallingConfig
// (AUTO, NONE, ANY, VALIDATED read as AUTO; ANY with one allowed name forces that function, with
// several keeps only those tools), generationConfig's temperature, topP, topK, maxOutputTokens,
// stopSequences, presencePenalty, frequencyPenalty, seed, responseMimeType and
// responseSchema/responseJsonSchema (-> response_format).
// Function calls get ids "call_<n>" in order (or their own "id"); a functionResponse answers the
// call with its id, else the earliest unanswered call of that name. A user turn's function
// responses become role "tool" messages placed before its text. Consecutive model turns (the
// chunks of a streamed answer a client keeps as history) join into one assistant message; text
// parts join without a separator; thought parts and thoughtSignature are dropped.
// Accepted and ignored (no neutral form, no effect on the answer's shape): safetySettings,
// labels, serviceTier, generationConfig.thinkingConfig / mediaResolution /
// enableEnhancedCivicAnswers, functionDeclarations' response schemas and behavior.
// Refused with InvalidArgument naming the field: unknown field names (Gemini does the same),
// inlineData/fileData/executableCode/codeExecutionResult/videoMetadata parts and functionResponse
// parts (text only), tools other than functionDeclarations (googleSearch, codeExecution, ...),
// candidateCount other than 1, responseLogprobs true, logprobs, responseModalities other than
// TEXT, speech/image/audio output configs, cachedContent, a responseSchema without
// responseMimeType application/json, and bounds (translate_internal.h: messages, parts, tools).
Result<ChatRequest> ParseGeminiClientRequest(std::string_view body, std::string_view model_from_url, bool stream);

// A countTokens body -> the ChatRequest whose tokens are to be counted: either {"contents":[...]}
// (what the SDK sends) or {"generateContentRequest":{...}} (a whole generateContent body, parsed
// as ParseGeminiClientRequest does). Errors as there.
Result<ChatRequest> ParseGeminiCountTokensRequest(std::string_view body, std::string_view model_from_url);

// A ChatResponse as Gemini's GenerateContentResponse:
// {candidates:[{content:{parts:[{text}|{functionCall:{name,args}}],role:"model"},finishReason,
// index:0}], modelVersion: client_model, responseId, usageMetadata (when counts are known)}.
std::string BuildGeminiClientResponse(const ChatResponse& response, const std::string& client_model);

// {"totalTokens":n,"promptTokensDetails":[{"modality":"TEXT","tokenCount":n}]}.
std::string BuildGeminiCountTokensResponse(int64_t total_tokens);

// Content-Type of a streamGenerateContent answer: "text/event-stream" for SSE, else
// "application/json" (the JSON-array stream).
const char* GeminiStreamContentType(bool sse);

// StreamEvents -> streamGenerateContent body. SSE: one "data: <GenerateContentResponse>\r\n\r\n"
// event per chunk, no event names and no terminator, as Gemini writes them; otherwise the same
// chunks as one JSON array. Each text delta is a chunk; function calls are sent whole in the last
// chunk (Gemini never streams arguments), which carries finishReason and usageMetadata and is
// written at kDone (with parts [{"text":""}] when there are no calls, as Gemini's last chunk).
// EncodeError writes {"error":{code,message,status}} as a chunk (the SDK raises ApiError on it)
// and ends the stream. Never null.
std::unique_ptr<StreamEncoder> MakeGeminiStreamEncoder(const std::string& client_model, bool sse = true);

}  // namespace keel::gateway
