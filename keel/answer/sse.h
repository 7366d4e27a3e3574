// A finished chat completion re-encoded as OpenAI's streaming wire format, for a `keel answer`
// client that sent "stream": true (docs/answer.md, "Streaming").
//
// The answer is generated whole (the gateway call is not streamed), then sent as the chunks an
// OpenAI stream carries: per choice, one chunk opening the assistant turn (role, empty content),
// one with the whole content (skipped when empty) and one with the finish_reason; then, when the
// client asked for usage (stream_options.include_usage), a chunk with "choices": [] and the
// usage, every earlier chunk carrying "usage": null as OpenAI's do; then "data: [DONE]". Each
// chunk repeats the completion's id, created, model and (when present) system_fingerprint under
// "object": "chat.completion.chunk". The completion's "keel" member rides on the last chunk of
// the last choice. A client therefore sees a valid stream, but its first token arrives with the
// last.
//
// Pure function: thread-safe, no I/O.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace keel::answer {

// `completion` is a chat.completion object as a gateway or engine answers it ("choices" is an
// array; a choice without a message string counts as empty content, one without finish_reason
// finishes "stop"). Returns the SSE body, every event one "data: <json>\n\n" line.
std::string CompletionAsSse(const nlohmann::ordered_json& completion, bool include_usage);

}  // namespace keel::answer
