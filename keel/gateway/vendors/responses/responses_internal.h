// Internal to translate_responses.cc and stream_encode_responses.cc: the pieces of a Responses
// object both the non-streaming builder and the stream encoder write, so the object a stream ends
// with is the one a non-streaming call returns. Not part of the gateway's API.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "keel/gateway/chat.h"

namespace keel::gateway::responses_internal {

using Json = nlohmann::ordered_json;  // ordered: fields appear in OpenAI's order

// Compact text; bytes that are not valid UTF-8 become U+FFFD instead of throwing.
std::string Dump(const Json& j);

// The Response object with everything the request decides (the echoed settings) filled in and,
// in their places, id "", created_at 0, status "", incomplete_details null, output [] and usage
// null for SetOutcome to fill.
Json ResponseTemplate(const ChatRequest& request, const std::string& client_model);
void SetOutcome(Json* response, const std::string& id, int64_t created_at, const char* status,
                Json incomplete_details, Json output, Json usage);

// Output items and their parts. `status`: "in_progress", "completed" or "incomplete".
Json OutputText(const std::string& text);
Json MessageItem(const std::string& id, const char* status, Json content);
Json FunctionCallItem(const std::string& id, const char* status, const std::string& call_id,
                      const std::string& name, const std::string& arguments);

// "completed", or "incomplete" for kLength / kContentFilter.
const char* StatusFor(FinishReason finish);
// {"reason":"max_output_tokens"|"content_filter"} for those finishes, else null.
Json IncompleteDetails(FinishReason finish);
// OpenAI's usage object (unknown counts 0); null when neither count is known.
Json UsageJson(const Usage& usage);

// A fresh random id with `prefix` ("msg_", "fc_", "call_"); the response id for an upstream id
// ("resp_" + it unless it has that prefix; a fresh one when empty).
std::string NewItemId(const char* prefix);
std::string ResponseId(const std::string& upstream_id);

}  // namespace keel::gateway::responses_internal
