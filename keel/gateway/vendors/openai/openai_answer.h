// Internal to keel/gateway/vendors/openai/ (and its tests and benchmark): the two paths of the
// non-streamed OpenAI answer codecs. ParseOpenAIChatResponse / ParseOpenAICompletionsResponse
// (openai.h) try the fast reader first and fall back to the DOM reader when it declines; the DOM
// reader stays the single source of error wording. Pure functions, thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"

namespace keel::gateway::internal {

// The DOM readers (translate_openai.cc): the whole body into an nlohmann DOM within
// kUpstreamJsonLimits, then the fields. Corruption on anything malformed.
Result<ChatResponse> ParseOpenAIChatResponseDom(std::string_view body);
Result<ChatResponse> ParseOpenAICompletionsResponseDom(std::string_view body);

// The fast readers (answer_openai.cc): one pass over the text with no DOM. True, with *out
// filled exactly as the DOM reader would fill it, when the body is plainly the common answer
// shape: a JSON object of a strict JSON subset (no BOM, numbers whose value is finite, valid
// UTF-8, nesting at most 64) whose choices[0] is an object -- for chat with a message object
// whose content is a string or null and whose tool_calls is absent or null; for completions with
// a text that is a string or null -- with no repeated key among the members read and no
// non-null "error". False (declined; *out unspecified) otherwise, including for every body the
// DOM reader refuses, so a caller that falls back to the DOM reader gets its answer or its error.
bool ReadOpenAIChatResponseFast(std::string_view body, ChatResponse* out);
bool ReadOpenAICompletionsResponseFast(std::string_view body, ChatResponse* out);

// The client body's two paths (ParseOpenAIChatRequest tries the fast one first). The fast reader
// (request_openai.cc) takes the common request -- model, messages of role system, developer, user
// or assistant with string or null content, max_tokens, max_completion_tokens, temperature,
// top_p, seed, stream, stream_options, user; every other field the DOM reader knows absent or
// null, unknown ones ignored -- in the same strict JSON subset, with no repeated key among those,
// and declines (false; *req unspecified) anything else, every refused body included.
Result<ChatRequest> ParseOpenAIChatRequestDom(std::string_view body);
bool ReadOpenAIChatRequestFast(std::string_view body, ChatRequest* req);

// Tool calls as OpenAI writes them, a JSON array of {"function":{"arguments","name"},"id",
// "type":"function"} (members sorted, as the DOM wrote them); empty arguments become "{}".
void AppendOpenAIToolCalls(const std::vector<ToolCall>& calls, std::string* out);

}  // namespace keel::gateway::internal
