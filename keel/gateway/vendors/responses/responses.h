// The OpenAI Responses API front (POST /v1/responses): a client request in that format becomes
// the gateway's ChatRequest, and a ChatResponse (or a stream of StreamEvents) becomes a Responses
// object (or its SSE event stream) that the official SDKs read, `response.output_text` included.
// Pure functions and one encoder class; no I/O. Error bodies for this front are OpenAI's:
// BuildOpenAIErrorBody in vendors/openai/openai.h.
//
// The gateway is stateless and text-only, so what would need stored state or non-text content is
// refused with InvalidArgument naming the field: previous_response_id, conversation,
// background: true, prompt (stored templates), input items other than messages, function_call and
// function_call_output (reasoning, item_reference, built-in tool calls), non-text content parts
// (input_image, input_file, input_audio), tools other than "function", tool_choice other than
// auto/none/required/{type:"function"}, top_logprobs above 0 and include
// "message.output_text.logprobs". `store` (true or false), `metadata`, `include`, `reasoning`,
// `truncation` and unknown fields are accepted and not carried (as the chat parser does with
// unknown fields); nothing is stored, so the answer always says "store": false.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"
#include "keel/gateway/stream.h"

namespace keel::gateway {

// A POST /v1/responses body -> ChatRequest (client_format kOpenAIResponses). `input` (a string:
// one user turn; or an array of items) becomes messages; `instructions` and system/developer
// input messages become `system` (joined with "\n", instructions first); function_call items join
// the assistant turn before them (one turn with text and calls, as chat formats have it);
// max_output_tokens -> max_tokens; text.format -> response_format. InvalidArgument naming the
// field on anything malformed or refused (above); never throws.
Result<ChatRequest> ParseResponsesRequest(std::string_view body);

// ChatResponse -> the Responses object JSON. `request` supplies the settings the object echoes
// (instructions, max_output_tokens, temperature, top_p, tools, tool_choice, parallel_tool_calls,
// text.format, user); `client_model` is the model name the client asked for. Finish kLength or
// kContentFilter gives status "incomplete" with incomplete_details.reason "max_output_tokens" or
// "content_filter" (and the last output item "incomplete"); otherwise "completed". Output: one
// message item (when there is text, or nothing else) then one function_call item per call.
// Unknown usage (both counts -1) is "usage": null; an unknown single count is 0.
std::string BuildResponsesResponse(const ChatResponse& response, const ChatRequest& request,
                                   const std::string& client_model);

// StreamEvents -> Responses SSE (`event: <type>` + `data: {"type":"<type>","sequence_number":N,...}`
// with N = 0, 1, 2, ...): response.created and response.in_progress first, then per output item
// output_item.added, (content_part.added, output_text.delta..., output_text.done,
// content_part.done | function_call_arguments.delta..., function_call_arguments.done),
// output_item.done, and at kDone response.completed or response.incomplete carrying the whole
// Response (output and usage). An item closes when another one opens, so text after a tool call
// is a new message item. EncodeError writes an `error` event (OpenAI's fields at the top level
// and under "error", so SDKs raise it) then response.failed, and ends the stream. Accepts any
// event order, like every StreamEncoder. Holds the whole answer: the format repeats it in the
// .done events and the final Response. Not thread-safe; one per client response.
std::unique_ptr<StreamEncoder> MakeResponsesStreamEncoder(const ChatRequest& request,
                                                          const std::string& client_model);

// Registration (vendors/front.cc): the kOpenAIResponses front. No upstream speaks this format to
// the gateway, so there is no vendor adapter.
class FrontRegistry;
void RegisterResponsesFronts(FrontRegistry* registry);

}  // namespace keel::gateway
