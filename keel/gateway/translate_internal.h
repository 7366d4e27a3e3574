// Internal to the formats' translate*.cc files (keel/gateway/vendors/<name>/) and their adapters:
// JSON helpers that validate while they read, shared bounds, tool-argument conversion. Not part
// of the gateway's API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/json_reader.h"
#include "keel/core/json_writer.h"
#include "keel/core/status.h"
#include "keel/gateway/chat.h"

namespace keel::gateway::internal {

using nlohmann::json;

// Bounds on client input. Real clients stay far below them; they stop a request from making
// the gateway do unbounded work before policy sees it.
inline constexpr size_t kMaxMessages = 10000;
inline constexpr size_t kMaxParts = 10000;   // content parts / blocks in one message
inline constexpr size_t kMaxTools = 1000;
inline constexpr size_t kMaxToolCalls = 1000;  // in one assistant turn

// "path[i]": the field path of element i, for error messages.
inline std::string At(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

// Calls read(tool, path) for each element of body["tools"] (absent or null: none) once the list
// is known to be an array of at most kMaxTools objects; stops at the first error.
template <class ReadTool>
Status ForEachTool(const json& body, ReadTool&& read) {
  auto it = body.find("tools");
  if (it == body.end() || it->is_null()) return Status::Ok();
  if (!it->is_array()) return Status::InvalidArgument("tools: expected an array");
  if (it->size() > kMaxTools) return Status::InvalidArgument("tools: at most " + std::to_string(kMaxTools) + " tools");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    const std::string path = At("tools", i);
    if (!t.is_object()) return Status::InvalidArgument(path + ": expected an object");
    KEEL_RETURN_IF_ERROR(read(t, path));
  }
  return Status::Ok();
}
// Text content as the OpenAI formats send it: a string (kept as *out), or an array of at most
// kMaxParts objects, each handed in order to read_part(part, path of the part), which appends its
// text to *out; stops at the first error. Absent or null is the caller's to decide.
template <class ReadPart>
Status ReadStringOrParts(const json& v, const std::string& path, std::string* out, ReadPart&& read_part) {
  if (v.is_string()) {
    *out = v.get<std::string>();
    return Status::Ok();
  }
  if (!v.is_array()) return Status::InvalidArgument(path + ": expected a string or an array of parts");
  if (v.size() > kMaxParts) return Status::InvalidArgument(path + ": at most " + std::to_string(kMaxParts) + " parts");
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string part_path = At(path, i);
    if (!v[i].is_object()) return Status::InvalidArgument(part_path + ": expected an object");
    KEEL_RETURN_IF_ERROR(read_part(v[i], part_path));
  }
  return Status::Ok();
}
inline constexpr size_t kMaxStop = 64;
inline constexpr int kMaxJsonDepth = 128;  // dump() recurses; deep input could overflow the stack
// Every JSON text the gateway reads goes through keel/core/json_reader.h with these bounds.
// Client bodies and tool-argument texts: 1M values is many times any real request (kMaxMessages
// messages of a few parts each, kMaxTools schemas) and caps the parse at ~100 MiB at worst.
inline constexpr JsonLimits kClientJsonLimits{
    .max_depth = kMaxJsonDepth, .max_values = size_t{1} << 20, .require_object = true};
// Upstream answers: the vendor is configured, not hostile, but its answers (embeddings, logprobs)
// are larger; still bounded so a broken one cannot exhaust memory or the stack.
inline constexpr JsonLimits kUpstreamJsonLimits{
    .max_depth = kMaxJsonDepth, .max_values = size_t{16} << 20, .require_object = true};

// Parses `body` as a JSON object within kClientJsonLimits. InvalidArgument (`what`: "request
// body") for malformed JSON, nesting deeper than kMaxJsonDepth, too many values, or a top level
// that is not an object; the message names the limit or the byte offset.
Result<json> ParseObject(std::string_view body, const char* what);
// Same for upstream bodies within kUpstreamJsonLimits; failures are Corruption (the upstream
// sent garbage).
Result<json> ParseUpstreamObject(std::string_view body);

// Compact serialisation; bytes that are not valid UTF-8 become U+FFFD instead of throwing.
std::string Dump(const json& j);

// obj[key] when obj is an object and that is a string, else `fallback`. Never throws (json::value
// throws on a type mismatch, so it is not used on untrusted input).
std::string StringOr(const json& obj, const char* key, const std::string& fallback = "");

// Field readers: absent (or JSON null) leaves `out` unchanged and returns OK; a present value of
// the wrong type is InvalidArgument "<path>: expected ...". `path` is the field's full name.
Status ReadString(const json& obj, const char* key, const std::string& path, std::string* out);
Status ReadRequiredString(const json& obj, const char* key, const std::string& path, std::string* out);
Status ReadPositiveInt(const json& obj, const char* key, const std::string& path,
                       std::optional<int64_t>* out);
// Any integer in int64 range ("seed").
Status ReadInt(const json& obj, const char* key, const std::string& path, std::optional<int64_t>* out);
Status ReadNumber(const json& obj, const char* key, const std::string& path, std::optional<double>* out);
// A number in [lo, hi] ("presence_penalty: expected a number between -2 and 2").
Status ReadNumberInRange(const json& obj, const char* key, const std::string& path, double lo, double hi,
                         std::optional<double>* out);
Status ReadBool(const json& obj, const char* key, const std::string& path, bool* out);
Status ReadBool(const json& obj, const char* key, const std::string& path, std::optional<bool>* out);
// OpenAI's reasoning effort ("minimal", "low", "medium", "high", ...): a short word, passed on to
// OpenAI upstreams as it came (its list grows), refused by the others.
Status ReadReasoningEffort(const json& obj, const char* key, std::string* out);
// A string or an array of strings (OpenAI "stop"); Anthropic's stop_sequences passes
// `allow_single_string` = false.
Status ReadStop(const json& obj, const char* key, const std::string& path, bool allow_single_string,
                std::vector<std::string>* out);
// A JSON value that must be an object (or absent: "{}"); returns its compact text.
Status ReadObjectText(const json& obj, const char* key, const std::string& path, std::string* out);

// ---- OpenAI's shapes, read alike by Chat Completions (translate_openai.cc) and the Responses
// front (translate_responses.cc); each takes the field path its format spells.

// A function tool's {name (required), description, parameters (an object; absent: "{}")} in `fn`
// into *tool. `path` is fn's own: "tools[i].function" (Chat Completions), "tools[i]" (Responses).
Status ReadFunctionTool(const json& fn, const std::string& path, Tool* tool);

// A function call's obj["arguments"] into *out: a string is kept verbatim, even when it is not
// valid JSON (the model produced it); an object (some OpenAI-compatible servers send one) as its
// text. `path` names the field ("...function.arguments").
Status ReadArgumentsText(const json& obj, const std::string& path, std::string* out);

// body["tool_choice"]: absent or null leaves *out unchanged; "auto", "none" or "required" are kept;
// an object goes to read_object(object), since each format names the function its own way;
// anything else is InvalidArgument.
template <class ReadObject>
Status ReadToolChoice(const json& body, std::string* out, ReadObject&& read_object) {
  auto tc = body.find("tool_choice");
  if (tc == body.end() || tc->is_null()) return Status::Ok();
  if (tc->is_string()) {
    *out = tc->get<std::string>();
    if (*out != "auto" && *out != "none" && *out != "required")
      return Status::InvalidArgument("tool_choice: expected auto, none, required or an object");
    return Status::Ok();
  }
  if (!tc->is_object()) return Status::InvalidArgument("tool_choice: expected a string or an object");
  return read_object(*tc);
}

// Where a format keeps structured output's settings, and which checks its API makes on them.
struct ResponseFormatSpelling {
  const char* path;           // the format object's own: "response_format", "text.format"
  const char* schema_member;  // json_schema's fields sit in this member ("json_schema"), or beside type (nullptr)
  bool check_name;            // the name must be 1 to 64 letters, digits, '_' or '-' (Chat Completions)
  bool schema_required;       // a json_schema without a schema is refused (Responses)
};
// `format` (present and not null) as {type: text | json_object | json_schema, plus json_schema's
// name (required), description (checked, not carried), schema, strict} into *out; on an error
// *out is unchanged and the message names the field by `spelling`.
Status ReadOpenAIResponseFormat(const json& format, const ResponseFormatSpelling& spelling,
                                std::optional<ResponseFormat>* out);

// Tool arguments. arguments_json is the object text; OpenAI carries it as a string, Anthropic
// and Gemini as an object. Text that is empty becomes {}; text that is not a JSON object is
// wrapped as {"_raw": "<text>"} so it survives (visibly) a format that needs an object.
json ArgumentsObject(const std::string& arguments_json);
// An object text the parsers produced (Tool::parameters_json, ResponseFormat::schema_json,
// ChatRequest::logit_bias_json) as JSON; invalid or empty text gives {}.
json SchemaObject(const std::string& parameters_json);

// The messages to send upstream: request.messages, or for a completions request one user
// message holding the prompt.
std::vector<Message> EffectiveMessages(const ChatRequest& request);
// The function name a role "tool" message answers: its own name, else the name of the call
// with its tool_call_id among earlier assistant turns, else the tool_call_id itself.
std::string ToolNameFor(const std::vector<Message>& messages, size_t tool_index);
// Gives every role "tool" message in `messages` that name: what each client parser does last.
void NameToolMessages(std::vector<Message>* messages);

// ---- writing JSON text directly (no DOM), byte for byte as Dump writes the equivalent json

// Numbers and strings: AppendJsonNumber / AppendJsonString (keel/core/json_writer.h).

// The members of one JSON object, added in any order and written sorted by key -- the order a
// json (a std::map) dumps them in. Keys are literals that need no escaping; each is added once.
class SortedMembers {
 public:
  // Starts member `key`; its value's JSON text is appended to the returned string next.
  std::string* Add(std::string_view key) {
    End();
    members_.push_back({key, values_.size(), 0});
    open_ = true;
    return &values_;
  }
  // Appends {"key":value,...} to *out.
  void AppendTo(std::string* out) {
    End();
    std::sort(members_.begin(), members_.end(), [](const Member& a, const Member& b) { return a.key < b.key; });
    *out += '{';
    for (size_t i = 0; i < members_.size(); ++i) {
      if (i) *out += ',';
      *out += '"';
      *out += members_[i].key;
      *out += "\":";
      out->append(values_, members_[i].begin, members_[i].end - members_[i].begin);
    }
    *out += '}';
  }
  size_t value_bytes() const { return values_.size(); }

 private:
  struct Member {
    std::string_view key;
    size_t begin, end;
  };
  void End() {
    if (open_) members_.back().end = values_.size();
    open_ = false;
  }
  std::vector<Member> members_;
  std::string values_;
  bool open_ = false;
};

// A fresh random id with `prefix` ("chatcmpl-", "msg_"): for responses whose upstream gave none.
std::string NewId(const char* prefix);
// `id` with `prefix` unless it already starts with it; a fresh id when empty.
std::string PrefixedId(const std::string& id, const char* prefix);
// Unix seconds now, for responses whose upstream reported no creation time.
int64_t NowSeconds();

// The upstream builders' refusal of a field `upstream` has no equivalent for: InvalidArgument
// "<field>: not supported by <format> upstreams" (the client asked for something the chosen
// upstream cannot do; answering without it would be answering a different question).
Status Unsupported(const std::string& field, WireFormat upstream);

}  // namespace keel::gateway::internal
