// The format-neutral part of translation between wire formats and the gateway's
// ChatRequest/ChatResponse: the contract every format's codec keeps, and the error mapping they
// share. Pure functions: no I/O, thread-safe.
//
// Parsers validate what the gateway relies on (types, required fields, sizes) and return
// InvalidArgument with a message naming the field ("messages[2].content: expected string or
// array"); they never throw.
#pragma once

#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/gateway/chat.h"

namespace keel::gateway {

// What every vendor's codec (keel/gateway/vendors/<name>/<name>.h) promises; the per-format
// functions live with their format, and the gateway reaches them through VendorAdapter (vendor.h)
// and ClientFront (front.h).
//
// ---- client requests -> ChatRequest: InvalidArgument naming the field on anything malformed.
//
// ---- ChatRequest -> upstream request body, for the upstream's model name.
// Every field is carried, translated to the upstream's equivalent, or refused: InvalidArgument
// naming the field and the upstream ("logit_bias: not supported by anthropic upstreams") when
// the upstream has no way to honour it. Values that ask for the default (a zero penalty,
// parallel_tool_calls true, response_format text) are never refused. The table is in
// docs/gateway.md ("Parameters per upstream").
//
// Tool arguments: an OpenAI arguments string is kept verbatim (even if not valid JSON) when
// going to OpenAI; Anthropic/Gemini need an object, so empty text becomes {} and text that is not
// a JSON object becomes {"_raw": "<text>"}. Gemini tool results that are not a JSON object are
// sent as {"result": "<text>"}; Gemini function names for results come from Message::name, else
// the earlier call with that id. Streaming to an OpenAI upstream always asks for
// stream_options.include_usage (the gateway counts tokens); whether the client sees usage is
// the stream encoder's include_usage.
//
// ---- upstream response body -> ChatResponse
// Corruption (never InvalidArgument: the client did nothing wrong) for malformed JSON, a missing
// choices/content/candidates, or an error object in a 200 body. Gemini calls get ids "call_<i>".
//
// ---- ChatResponse -> client response body, with the model name the client asked for.
// created == 0 becomes now; the id gets the format's prefix ("chatcmpl-", "cmpl-", "msg_") unless
// it has it (empty: a random one). Unknown usage (-1) is omitted for OpenAI, 0 for Anthropic.
// Anthropic clients get stop_reason "stop_sequence" and the sequence when the upstream named the
// one that matched (ChatResponse::stop_sequence: Anthropic upstreams do; OpenAI, `keel serve` and
// Gemini do not), otherwise "end_turn" and null.
//
// ---- errors: each format has its error body (OpenAI {"error":{message,type,param,code}},
// Anthropic {"type":"error","error":{type,message}}, Gemini {"error":{code,message,status}}) and
// reads its vendor's error answers with ParseVendorError below.
//
// ---- finish reasons per format ("stop"/"length"/"tool_calls"; "end_turn"/"max_tokens"/
// "tool_use"/"stop_sequence"; "STOP"/"MAX_TOKENS"/"SAFETY"). Names are never null: kNone gives ""
// for OpenAI/Anthropic (write JSON null) and "FINISH_REASON_UNSPECIFIED" for Gemini. Gemini has no
// tool-call reason (kToolCalls gives "STOP"); Anthropic content filtering is "refusal". Parsing:
// "" gives kNone; an unknown non-empty name gives kStop (the turn did end).

// Kind for an HTTP status, and the status for a kind.
ErrorKind ErrorKindForStatus(int http_status);
int StatusForErrorKind(ErrorKind kind);

// Reads a vendor's error body (any status >= 400) into a GatewayError; a body that is not the
// vendor's error JSON still gives a GatewayError with the HTTP status and a short excerpt
// (printable ASCII, at most ~200 bytes). The kind follows the status, refined by the vendor's type
// (overloaded_error, RESOURCE_EXHAUSTED, ...), which the vendor writes in error.<type_member>
// ("type"; Gemini: "status"), else error.code; 529 becomes status 503; a status outside 400..599
// becomes 502.
GatewayError ParseVendorError(int http_status, std::string_view body, const char* type_member);

}  // namespace keel::gateway
