// The Gemini front's non-streaming half (gemini_front.h): routes, keys, request bodies in,
// GenerateContentResponse and countTokens bodies out.
#include <algorithm>
#include <cctype>
#include <deque>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "keel/gateway/vendors/gemini/gemini_front.h"
#include "keel/gateway/translate.h"
#include "keel/gateway/translate_internal.h"

namespace keel::gateway {

using internal::At;
using internal::json;

namespace {

constexpr size_t kMaxModelName = 256;

// ---- URLs

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// %XX-decodes `in`; `plus_is_space` for query values (form encoding). False on a bad escape.
bool PercentDecode(std::string_view in, bool plus_is_space, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '%') {
      if (i + 2 >= in.size()) return false;
      const int hi = HexValue(in[i + 1]);
      const int lo = HexValue(in[i + 2]);
      if (hi < 0 || lo < 0) return false;
      out->push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else {
      out->push_back(plus_is_space && in[i] == '+' ? ' ' : in[i]);
    }
  }
  return true;
}

// The raw value of the first `name` parameter in `query`; nullopt when absent.
std::optional<std::string_view> QueryValue(std::string_view query, std::string_view name) {
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (pair.substr(0, eq) != name) continue;
    return eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
  }
  return std::nullopt;
}

bool ModelChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("-._~:@+/").find(c) != std::string_view::npos;
}

// A model name a route may carry: it is echoed to the client and matched against config names,
// and may reach an upstream URL, so it holds no path tricks or bytes that need escaping.
Status CheckModelName(const std::string& model) {
  if (model.empty()) return Status::InvalidArgument("model name: must not be empty");
  if (model.size() > kMaxModelName)
    return Status::InvalidArgument("model name: longer than " + std::to_string(kMaxModelName) + " characters");
  if (!std::all_of(model.begin(), model.end(), ModelChar))
    return Status::InvalidArgument("model name: only letters, digits and -._~:@+/ are allowed");
  size_t start = 0;
  while (true) {
    const size_t slash = model.find('/', start);
    const std::string_view seg = std::string_view(model).substr(start, slash == std::string::npos ? slash : slash - start);
    if (seg.empty() || seg == "." || seg == "..")
      return Status::InvalidArgument("model name: empty, \".\" or \"..\" segment");
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return Status::Ok();
}

// ---- proto JSON field names

// Proto JSON accepts a field's lowerCamelCase name and its proto (snake_case) name alike; Google's
// REST examples use both ("system_instruction", "generationConfig").
std::string SnakeCase(std::string_view camel) {
  std::string out;
  for (char c : camel) {
    if (std::isupper(static_cast<unsigned char>(c))) {
      out += '_';
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else {
      out += c;
    }
  }
  return out;
}

std::string CamelCase(std::string_view name) {
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '_' && i + 1 < name.size()) {
      out += static_cast<char>(std::toupper(static_cast<unsigned char>(name[++i])));
    } else {
      out += name[i];
    }
  }
  return out;
}

// obj's member `camel` under either spelling; null when absent or JSON null (a proto default).
const json* Get(const json& obj, std::string_view camel) {
  auto it = obj.find(camel);
  if (it == obj.end()) it = obj.find(SnakeCase(camel));
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// InvalidArgument for the first member of `obj` whose name (either spelling) is not in `known`.
Status CheckKnown(const json& obj, const std::string& path, std::initializer_list<std::string_view> known) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string camel = CamelCase(it.key());
    if (std::find(known.begin(), known.end(), camel) == known.end())
      return Status::InvalidArgument((path.empty() ? "" : path + ".") + it.key() +
                                     ": unknown field (not in Gemini's API, or not served by the gateway)");
  }
  return Status::Ok();
}

Status Unsupported(const std::string& path, const char* why) { return Status::InvalidArgument(path + ": " + why); }

// The internal readers take a key and read it verbatim; these find the member under either
// spelling first, so the readers see one canonical object.
json Canonical(const json& obj, std::initializer_list<std::string_view> keys) {
  json out = json::object();
  for (std::string_view k : keys)
    if (const json* v = Get(obj, k)) out[std::string(k)] = *v;
  return out;
}

// ---- schemas

// Gemini's Schema (an OpenAPI 3.0 subset: "OBJECT", nullable, int64 bounds as strings) as JSON
// Schema, which every other format (and Gemini's own parametersJsonSchema) takes.
void GeminiSchemaToJsonSchema(json* s, int depth) {
  if (!s->is_object() || depth > internal::kMaxJsonDepth) return;
  if (auto t = s->find("type"); t != s->end() && t->is_string()) {
    std::string type = t->get<std::string>();
    std::transform(type.begin(), type.end(), type.begin(), [](unsigned char c) { return std::tolower(c); });
    if (type == "type_unspecified") {
      s->erase("type");
    } else {
      *t = type;
    }
  }
  if (auto n = s->find("nullable"); n != s->end()) {
    const bool nullable = n->is_boolean() && n->get<bool>();
    s->erase(n);
    if (auto t = s->find("type"); nullable && t != s->end() && t->is_string()) *t = json::array({*t, "null"});
  }
  s->erase("propertyOrdering");
  for (const char* key : {"minItems", "maxItems", "minProperties", "maxProperties", "minLength", "maxLength"}) {
    auto v = s->find(key);
    if (v == s->end() || !v->is_string()) continue;
    const std::string text = v->get<std::string>();
    if (!text.empty() && text.size() < 19 && std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); }))
      *v = std::stoll(text);
  }
  if (auto p = s->find("properties"); p != s->end() && p->is_object())
    for (auto& [name, sub] : p->items()) GeminiSchemaToJsonSchema(&sub, depth + 1);
  if (auto i = s->find("items"); i != s->end()) GeminiSchemaToJsonSchema(&*i, depth + 1);
  if (auto a = s->find("anyOf"); a != s->end() && a->is_array())
    for (auto& sub : *a) GeminiSchemaToJsonSchema(&sub, depth + 1);
}

// The schema of a declaration or of structured output: `gemini_key` (a Gemini Schema, converted)
// or `json_key` (JSON Schema, kept); not both. `*present` says whether either was there.
Status ReadSchema(const json& obj, const std::string& path, std::string_view gemini_key, std::string_view json_key,
                  std::string* out, bool* present) {
  const json* g = Get(obj, gemini_key);
  const json* j = Get(obj, json_key);
  *present = g || j;
  if (g && j)
    return Status::InvalidArgument(path + ": " + std::string(gemini_key) + " and " + std::string(json_key) +
                                   " are mutually exclusive");
  if (!*present) {
    *out = "{}";
    return Status::Ok();
  }
  const std::string field = path + "." + std::string(g ? gemini_key : json_key);
  if (!(g ? g : j)->is_object()) return Status::InvalidArgument(field + ": expected a JSON object");
  json schema = *(g ? g : j);
  if (g) GeminiSchemaToJsonSchema(&schema, 0);
  *out = internal::Dump(schema);
  return Status::Ok();
}

// ---- parts

// obj's parts into *parts (null when absent): an array of at most kMaxParts.
Status GetParts(const json& obj, const std::string& path, const json** parts) {
  *parts = Get(obj, "parts");
  if (!*parts) return Status::Ok();
  if (!(*parts)->is_array()) return Status::InvalidArgument(path + ".parts: expected an array");
  if ((*parts)->size() > internal::kMaxParts)
    return Status::InvalidArgument(path + ".parts: at most " + std::to_string(internal::kMaxParts) + " parts");
  return Status::Ok();
}

// A part's text, when it has one, appended to *text; *has_text is then set.
Status ReadPartText(const json& p, const std::string& path, std::string* text, bool* has_text) {
  const json* t = Get(p, "text");
  if (!t) return Status::Ok();
  if (!t->is_string()) return Status::InvalidArgument(path + ".text: expected a string");
  *text += t->get<std::string>();
  *has_text = true;
  return Status::Ok();
}

// ---- contents

struct PendingCall {
  std::string id;
  std::string name;
};

// Reads contents[] into messages, pairing function responses with the calls they answer.
class ContentsReader {
 public:
  explicit ContentsReader(ChatRequest* req) : req_(req) {}

  Status Read(const json& contents) {
    if (!contents.is_array()) return Status::InvalidArgument("contents: expected an array");
    if (contents.empty()) return Status::InvalidArgument("contents: must not be empty");
    if (contents.size() > internal::kMaxMessages)
      return Status::InvalidArgument("contents: at most " + std::to_string(internal::kMaxMessages) + " entries");
    for (size_t i = 0; i < contents.size(); ++i) KEEL_RETURN_IF_ERROR(Content(contents[i], At("contents", i)));
    return Status::Ok();
  }

 private:
  Status Content(const json& c, const std::string& path) {
    if (!c.is_object()) return Status::InvalidArgument(path + ": expected an object");
    KEEL_RETURN_IF_ERROR(CheckKnown(c, path, {"role", "parts"}));
    std::string role = "user";
    KEEL_RETURN_IF_ERROR(internal::ReadString(c, "role", path + ".role", &role));
    if (role.empty() || role == "function") role = "user";  // "function": the v1 name for tool results
    if (role != "user" && role != "model")
      return Status::InvalidArgument(path + ".role: expected \"user\" or \"model\"");
    const json* parts = nullptr;
    KEEL_RETURN_IF_ERROR(GetParts(c, path, &parts));
    if (!parts) return Status::Ok();  // the SDK records an empty model turn as {role, parts: []}
    return role == "model" ? ModelTurn(*parts, path) : UserTurn(*parts, path);
  }

  // Checks a part's fields: text and function parts only. `*is_thought`: a thought summary.
  static Status PartFields(const json& p, const std::string& path, bool* is_thought) {
    if (!p.is_object()) return Status::InvalidArgument(path + ": expected an object");
    if (p.empty()) return Status::InvalidArgument(path + ": empty part");
    for (auto it = p.begin(); it != p.end(); ++it) {
      const std::string camel = CamelCase(it.key());
      if (camel == "inlineData" || camel == "fileData" || camel == "videoMetadata" || camel == "executableCode" ||
          camel == "codeExecutionResult")
        return Unsupported(path + "." + it.key(), "not supported: the gateway carries text and function parts only");
      if (camel != "text" && camel != "thought" && camel != "thoughtSignature" && camel != "functionCall" &&
          camel != "functionResponse" && camel != "partMetadata")
        return Status::InvalidArgument(path + "." + it.key() + ": unknown part field");
    }
    bool thought = false;
    KEEL_RETURN_IF_ERROR(internal::ReadBool(Canonical(p, {"thought"}), "thought", path + ".thought", &thought));
    *is_thought = thought;
    return Status::Ok();
  }

  // A turn's parts in order: each one's fields are checked; a thought is skipped; the text of the
  // others joins *text, then function_fields(part, part's path) reads what else it holds.
  template <class FunctionFields>
  static Status ReadTurnParts(const json& parts, const std::string& path, std::string* text, bool* has_text,
                              FunctionFields&& function_fields) {
    for (size_t j = 0; j < parts.size(); ++j) {
      const std::string pp = At(path + ".parts", j);
      bool thought = false;
      KEEL_RETURN_IF_ERROR(PartFields(parts[j], pp, &thought));
      if (thought) continue;
      KEEL_RETURN_IF_ERROR(ReadPartText(parts[j], pp, text, has_text));
      KEEL_RETURN_IF_ERROR(function_fields(parts[j], pp));
    }
    return Status::Ok();
  }

  Status ModelTurn(const json& parts, const std::string& path) {
    Message m;
    bool has_text = false;
    auto function_fields = [&](const json& p, const std::string& pp) -> Status {
      if (const json* fc = Get(p, "functionCall")) KEEL_RETURN_IF_ERROR(Call(*fc, pp + ".functionCall", &m));
      if (Get(p, "functionResponse")) return Status::InvalidArgument(pp + ".functionResponse: only in a user turn");
      return Status::Ok();
    };
    KEEL_RETURN_IF_ERROR(ReadTurnParts(parts, path, &m.content, &has_text, function_fields));
    if (!has_text && m.tool_calls.empty()) return Status::Ok();
    // A model turn right after another continues it (a streamed answer kept chunk by chunk).
    if (last_was_model_) {
      Message& prev = req_->messages.back();
      prev.content += m.content;
      if (prev.tool_calls.size() + m.tool_calls.size() > internal::kMaxToolCalls)
        return Status::InvalidArgument(path + ": at most " + std::to_string(internal::kMaxToolCalls) + " function calls");
      for (ToolCall& c : m.tool_calls) prev.tool_calls.push_back(std::move(c));
    } else {
      m.role = "assistant";
      req_->messages.push_back(std::move(m));
    }
    last_was_model_ = true;
    return Status::Ok();
  }

  Status Call(const json& fc, const std::string& path, Message* m) {
    if (!fc.is_object()) return Status::InvalidArgument(path + ": expected an object");
    if (m->tool_calls.size() >= internal::kMaxToolCalls)
      return Status::InvalidArgument(path + ": at most " + std::to_string(internal::kMaxToolCalls) + " function calls");
    const json canon = Canonical(fc, {"id", "name", "args"});
    ToolCall call;
    KEEL_RETURN_IF_ERROR(internal::ReadRequiredString(canon, "name", path + ".name", &call.name));
    KEEL_RETURN_IF_ERROR(internal::ReadString(canon, "id", path + ".id", &call.id));
    if (call.id.empty()) call.id = "call_" + std::to_string(next_call_++);
    KEEL_RETURN_IF_ERROR(internal::ReadObjectText(canon, "args", path + ".args", &call.arguments_json));
    pending_.push_back({call.id, call.name});
    m->tool_calls.push_back(std::move(call));
    return Status::Ok();
  }

  Status UserTurn(const json& parts, const std::string& path) {
    last_was_model_ = false;
    Message user;
    user.role = "user";
    bool has_text = false;
    auto function_fields = [&](const json& p, const std::string& pp) -> Status {
      if (Get(p, "functionCall")) return Status::InvalidArgument(pp + ".functionCall: only in a model turn");
      if (const json* fr = Get(p, "functionResponse")) KEEL_RETURN_IF_ERROR(Response(*fr, pp + ".functionResponse"));
      if (req_->messages.size() > internal::kMaxMessages)
        return Status::InvalidArgument("contents: more than " + std::to_string(internal::kMaxMessages) + " messages");
      return Status::Ok();
    };
    KEEL_RETURN_IF_ERROR(ReadTurnParts(parts, path, &user.content, &has_text, function_fields));
    // Tool results were pushed as they came: they must follow the calls directly, so the turn's
    // text goes after them.
    if (has_text) req_->messages.push_back(std::move(user));
    return Status::Ok();
  }

  Status Response(const json& fr, const std::string& path) {
    if (!fr.is_object()) return Status::InvalidArgument(path + ": expected an object");
    if (const json* parts = Get(fr, "parts"); parts && !(parts->is_array() && parts->empty()))
      return Unsupported(path + ".parts", "not supported: the gateway carries text and function parts only");
    const json canon = Canonical(fr, {"id", "name", "response"});
    Message m;
    m.role = "tool";
    KEEL_RETURN_IF_ERROR(internal::ReadRequiredString(canon, "name", path + ".name", &m.name));
    std::string id;
    KEEL_RETURN_IF_ERROR(internal::ReadString(canon, "id", path + ".id", &id));
    KEEL_RETURN_IF_ERROR(internal::ReadObjectText(canon, "response", path + ".response", &m.content));
    // Gemini pairs results with calls by name (ids are optional); the earliest open call wins.
    auto match = std::find_if(pending_.begin(), pending_.end(), [&](const PendingCall& c) {
      return id.empty() ? c.name == m.name : c.id == id;
    });
    if (match != pending_.end()) {
      m.tool_call_id = match->id;
      pending_.erase(match);
    } else {
      m.tool_call_id = id.empty() ? "call_" + std::to_string(next_call_++) : id;
    }
    req_->messages.push_back(std::move(m));
    return Status::Ok();
  }

  ChatRequest* req_;
  std::deque<PendingCall> pending_;
  int64_t next_call_ = 0;
  bool last_was_model_ = false;  // the last message came from a model turn (the next one joins it)
};

// ---- the rest of the request

Status ReadSystem(const json& si, ChatRequest* req) {
  const std::string path = "systemInstruction";
  if (si.is_string()) {  // not proto JSON, but what the SDK's own config accepts
    req->system = si.get<std::string>();
    return Status::Ok();
  }
  if (!si.is_object()) return Status::InvalidArgument(path + ": expected an object");
  KEEL_RETURN_IF_ERROR(CheckKnown(si, path, {"role", "parts"}));
  const json* parts = nullptr;
  KEEL_RETURN_IF_ERROR(GetParts(si, path, &parts));
  if (!parts) return Status::Ok();
  for (size_t j = 0; j < parts->size(); ++j) {
    const std::string pp = At(path + ".parts", j);
    const json& p = (*parts)[j];
    if (!p.is_object()) return Status::InvalidArgument(pp + ": expected an object");
    for (auto it = p.begin(); it != p.end(); ++it)
      if (CamelCase(it.key()) != "text") return Unsupported(pp + "." + it.key(), "not supported: system parts are text");
    bool has_text = false;
    KEEL_RETURN_IF_ERROR(ReadPartText(p, pp, &req->system, &has_text));
  }
  return Status::Ok();
}

Status ReadTools(const json& tools, ChatRequest* req) {
  if (!tools.is_array()) return Status::InvalidArgument("tools: expected an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string path = At("tools", i);
    const json& t = tools[i];
    if (!t.is_object()) return Status::InvalidArgument(path + ": expected an object");
    for (auto it = t.begin(); it != t.end(); ++it)
      if (CamelCase(it.key()) != "functionDeclarations")
        return Unsupported(path + "." + it.key(), "not supported: the gateway offers functionDeclarations only");
    const json* decls = Get(t, "functionDeclarations");
    if (!decls) continue;
    const std::string dpath = path + ".functionDeclarations";
    if (!decls->is_array()) return Status::InvalidArgument(dpath + ": expected an array");
    for (size_t j = 0; j < decls->size(); ++j) {
      const std::string fpath = At(dpath, j);
      const json& d = (*decls)[j];
      if (!d.is_object()) return Status::InvalidArgument(fpath + ": expected an object");
      KEEL_RETURN_IF_ERROR(CheckKnown(d, fpath, {"name", "description", "parameters", "parametersJsonSchema",
                                                 "response", "responseJsonSchema", "behavior"}));
      if (req->tools.size() >= internal::kMaxTools)
        return Status::InvalidArgument("tools: at most " + std::to_string(internal::kMaxTools) + " functions");
      const json canon = Canonical(d, {"name", "description"});
      Tool tool;
      KEEL_RETURN_IF_ERROR(internal::ReadRequiredString(canon, "name", fpath + ".name", &tool.name));
      KEEL_RETURN_IF_ERROR(internal::ReadString(canon, "description", fpath + ".description", &tool.description));
      bool present = false;
      KEEL_RETURN_IF_ERROR(ReadSchema(d, fpath, "parameters", "parametersJsonSchema", &tool.parameters_json, &present));
      req->tools.push_back(std::move(tool));
    }
  }
  return Status::Ok();
}

Status ReadToolConfig(const json& tc, ChatRequest* req) {
  const std::string path = "toolConfig";
  if (!tc.is_object()) return Status::InvalidArgument(path + ": expected an object");
  KEEL_RETURN_IF_ERROR(CheckKnown(tc, path, {"functionCallingConfig"}));
  const json* fcc = Get(tc, "functionCallingConfig");
  if (!fcc) return Status::Ok();
  const std::string fpath = path + ".functionCallingConfig";
  if (!fcc->is_object()) return Status::InvalidArgument(fpath + ": expected an object");
  KEEL_RETURN_IF_ERROR(CheckKnown(*fcc, fpath, {"mode", "allowedFunctionNames"}));
  const json canon = Canonical(*fcc, {"mode"});
  std::string mode;
  KEEL_RETURN_IF_ERROR(internal::ReadString(canon, "mode", fpath + ".mode", &mode));
  std::vector<std::string> allowed;
  KEEL_RETURN_IF_ERROR(internal::ReadStop(Canonical(*fcc, {"allowedFunctionNames"}), "allowedFunctionNames",
                                          fpath + ".allowedFunctionNames", /*allow_single_string=*/false, &allowed));
  if (mode.empty() || mode == "MODE_UNSPECIFIED") {
    req->tool_choice = "";
  } else if (mode == "AUTO" || mode == "VALIDATED") {
    req->tool_choice = "auto";
  } else if (mode == "NONE") {
    req->tool_choice = "none";
  } else if (mode == "ANY") {
    req->tool_choice = "required";
  } else {
    return Status::InvalidArgument(fpath + ".mode: expected AUTO, ANY, NONE or VALIDATED");
  }
  if (allowed.empty()) return Status::Ok();
  if (mode != "ANY") return Status::InvalidArgument(fpath + ".allowedFunctionNames: only with mode ANY");
  if (allowed.size() == 1) {
    req->tool_choice = allowed[0];
    return Status::Ok();
  }
  // "Call one of these": the other declarations are withheld, so "required" means exactly that.
  std::erase_if(req->tools, [&](const Tool& t) { return std::find(allowed.begin(), allowed.end(), t.name) == allowed.end(); });
  return Status::Ok();
}

Status ReadResponseFormat(const json& gc, const std::string& path, ChatRequest* req) {
  std::string mime;
  KEEL_RETURN_IF_ERROR(internal::ReadString(Canonical(gc, {"responseMimeType"}), "responseMimeType",
                                            path + ".responseMimeType", &mime));
  std::string schema;
  bool has_schema = false;
  KEEL_RETURN_IF_ERROR(ReadSchema(gc, path, "responseSchema", "responseJsonSchema", &schema, &has_schema));
  if (mime.empty() || mime == "text/plain") {
    if (has_schema)
      return Status::InvalidArgument(path + ".responseSchema: needs responseMimeType \"application/json\"");
    return Status::Ok();
  }
  if (mime != "application/json")
    return Status::InvalidArgument(path + ".responseMimeType: \"" + mime +
                                   "\" is not supported (text/plain or application/json)");
  ResponseFormat rf;
  rf.kind = has_schema ? ResponseFormat::Kind::kJsonSchema : ResponseFormat::Kind::kJsonObject;
  if (has_schema) {
    rf.name = "response";
    rf.schema_json = std::move(schema);
  }
  req->response_format = std::move(rf);
  return Status::Ok();
}

Status ReadGenerationConfig(const json& gc, ChatRequest* req) {
  const std::string path = "generationConfig";
  if (!gc.is_object()) return Status::InvalidArgument(path + ": expected an object");
  KEEL_RETURN_IF_ERROR(CheckKnown(
      gc, path,
      {"temperature", "topP", "topK", "candidateCount", "maxOutputTokens", "stopSequences", "presencePenalty",
       "frequencyPenalty", "seed", "responseMimeType", "responseSchema", "responseJsonSchema", "responseLogprobs",
       "logprobs", "responseModalities", "thinkingConfig", "mediaResolution", "enableEnhancedCivicAnswers",
       "speechConfig", "imageConfig", "audioTimestamp", "audioTranscriptionConfig"}));
  for (const char* key : {"speechConfig", "imageConfig", "audioTimestamp", "audioTranscriptionConfig"})
    if (Get(gc, key)) return Unsupported(path + "." + key, "not supported: the gateway answers text only");
  const json c = Canonical(gc, {"temperature", "topP", "topK", "candidateCount", "maxOutputTokens", "stopSequences",
                                "presencePenalty", "frequencyPenalty", "seed", "responseLogprobs",
                                "responseModalities"});
  KEEL_RETURN_IF_ERROR(internal::ReadNumber(c, "temperature", path + ".temperature", &req->temperature));
  KEEL_RETURN_IF_ERROR(internal::ReadNumber(c, "topP", path + ".topP", &req->top_p));
  KEEL_RETURN_IF_ERROR(internal::ReadPositiveInt(c, "topK", path + ".topK", &req->top_k));
  KEEL_RETURN_IF_ERROR(internal::ReadPositiveInt(c, "maxOutputTokens", path + ".maxOutputTokens", &req->max_tokens));
  KEEL_RETURN_IF_ERROR(internal::ReadStop(c, "stopSequences", path + ".stopSequences", false, &req->stop));
  KEEL_RETURN_IF_ERROR(internal::ReadNumber(c, "presencePenalty", path + ".presencePenalty", &req->presence_penalty));
  KEEL_RETURN_IF_ERROR(
      internal::ReadNumber(c, "frequencyPenalty", path + ".frequencyPenalty", &req->frequency_penalty));
  KEEL_RETURN_IF_ERROR(internal::ReadInt(c, "seed", path + ".seed", &req->seed));
  std::optional<int64_t> candidates;
  KEEL_RETURN_IF_ERROR(internal::ReadPositiveInt(c, "candidateCount", path + ".candidateCount", &candidates));
  if (candidates && *candidates != 1)
    return Unsupported(path + ".candidateCount", "only 1 is supported (the gateway answers one candidate)");
  bool logprobs = false;
  KEEL_RETURN_IF_ERROR(internal::ReadBool(c, "responseLogprobs", path + ".responseLogprobs", &logprobs));
  if (logprobs || Get(gc, "logprobs"))
    return Unsupported(path + (logprobs ? ".responseLogprobs" : ".logprobs"), "log-probabilities are not supported");
  std::vector<std::string> modalities;
  KEEL_RETURN_IF_ERROR(
      internal::ReadStop(c, "responseModalities", path + ".responseModalities", false, &modalities));
  for (const std::string& m : modalities)
    if (m != "TEXT") return Unsupported(path + ".responseModalities", "only TEXT is supported");
  return ReadResponseFormat(gc, path, req);
}

// The fields of a GenerateContentRequest body (also countTokens' generateContentRequest).
Status ReadGenerateRequest(const json& body, ChatRequest* req) {
  KEEL_RETURN_IF_ERROR(CheckKnown(body, "", {"model", "contents", "systemInstruction", "tools", "toolConfig",
                                             "generationConfig", "safetySettings", "cachedContent", "labels",
                                             "serviceTier"}));
  if (Get(body, "cachedContent"))
    return Unsupported("cachedContent", "not supported: the gateway keeps no cached contents");
  if (const json* s = Get(body, "safetySettings"); s && !s->is_array())
    return Status::InvalidArgument("safetySettings: expected an array");
  const json* contents = Get(body, "contents");
  if (!contents) return Status::InvalidArgument("contents: required");
  KEEL_RETURN_IF_ERROR(ContentsReader(req).Read(*contents));
  if (const json* si = Get(body, "systemInstruction")) KEEL_RETURN_IF_ERROR(ReadSystem(*si, req));
  if (const json* t = Get(body, "tools")) KEEL_RETURN_IF_ERROR(ReadTools(*t, req));
  if (const json* tc = Get(body, "toolConfig")) KEEL_RETURN_IF_ERROR(ReadToolConfig(*tc, req));
  if (const json* gc = Get(body, "generationConfig")) KEEL_RETURN_IF_ERROR(ReadGenerationConfig(*gc, req));
  return Status::Ok();
}

ChatRequest NewRequest(std::string_view model, bool stream) {
  ChatRequest req;
  req.client_format = WireFormat::kGemini;
  req.model = std::string(model);
  req.stream = stream;
  return req;
}

}  // namespace

Result<GeminiRoute> ParseGeminiPath(std::string_view target) {
  const size_t q = target.find('?');
  const std::string_view path = target.substr(0, q);
  const std::string_view query = q == std::string_view::npos ? std::string_view() : target.substr(q + 1);
  std::string_view rest;
  for (std::string_view prefix : {"/v1beta/models/", "/v1/models/", "/v1alpha/models/"}) {
    if (path.substr(0, prefix.size()) == prefix) {
      rest = path.substr(prefix.size());
      break;
    }
  }
  if (rest.empty()) return Status::NotFound("not a Gemini model path (/v1beta/models/{model}:{method})");
  const size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos) return Status::NotFound("no method in the path (models/{model}:{method})");
  const std::string_view method = rest.substr(colon + 1);
  GeminiRoute route;
  if (method == "generateContent") {
    route.method = GeminiRoute::Method::kGenerate;
  } else if (method == "streamGenerateContent") {
    route.method = GeminiRoute::Method::kStream;
  } else if (method == "countTokens") {
    route.method = GeminiRoute::Method::kCountTokens;
  } else {
    return Status::NotFound("method \"" + std::string(method).substr(0, 64) +
                            "\" is not served (generateContent, streamGenerateContent, countTokens)");
  }
  if (!PercentDecode(rest.substr(0, colon), /*plus_is_space=*/false, &route.model))
    return Status::InvalidArgument("model name: malformed %-escape");
  KEEL_RETURN_IF_ERROR(CheckModelName(route.model));
  std::optional<std::string_view> alt = QueryValue(query, "alt");
  if (!alt) alt = QueryValue(query, "$alt");
  if (alt) {
    const std::string_view value = alt->substr(0, alt->find(';'));  // "json;enum-encoding=int"
    if (value == "sse" && route.method == GeminiRoute::Method::kStream) {
      route.sse = true;
    } else if (value != "json") {
      return Status::InvalidArgument("alt=" + std::string(value).substr(0, 64) +
                                     ": expected json (or sse, for streamGenerateContent)");
    }
  }
  return route;
}

std::string GeminiPresentedKey(std::string_view x_goog_api_key_header, std::string_view query) {
  if (!x_goog_api_key_header.empty()) return std::string(x_goog_api_key_header);
  std::optional<std::string_view> raw = QueryValue(query, "key");
  std::string key;
  if (!raw || !PercentDecode(*raw, /*plus_is_space=*/true, &key)) return "";
  return key;
}

Result<ChatRequest> ParseGeminiClientRequest(std::string_view body, std::string_view model_from_url, bool stream) {
  Result<json> parsed = internal::ParseObject(body, "request body");
  if (!parsed.ok()) return parsed.status();
  ChatRequest req = NewRequest(model_from_url, stream);
  KEEL_RETURN_IF_ERROR(ReadGenerateRequest(*parsed, &req));
  return req;
}

Result<ChatRequest> ParseGeminiCountTokensRequest(std::string_view body, std::string_view model_from_url) {
  Result<json> parsed = internal::ParseObject(body, "request body");
  if (!parsed.ok()) return parsed.status();
  const json& j = *parsed;
  KEEL_RETURN_IF_ERROR(CheckKnown(j, "", {"contents", "generateContentRequest"}));
  const json* contents = Get(j, "contents");
  const json* inner = Get(j, "generateContentRequest");
  if (contents && inner)
    return Status::InvalidArgument("contents and generateContentRequest are mutually exclusive");
  ChatRequest req = NewRequest(model_from_url, false);
  if (inner) {
    if (!inner->is_object()) return Status::InvalidArgument("generateContentRequest: expected an object");
    Status s = ReadGenerateRequest(*inner, &req);
    if (!s.ok()) return Status::InvalidArgument("generateContentRequest." + s.message());
    return req;
  }
  if (!contents) return Status::InvalidArgument("contents: required (or generateContentRequest)");
  KEEL_RETURN_IF_ERROR(ContentsReader(&req).Read(*contents));
  return req;
}

std::string BuildGeminiCountTokensResponse(int64_t total_tokens) {
  const int64_t n = std::max<int64_t>(total_tokens, 0);
  return internal::Dump(
      json{{"totalTokens", n}, {"promptTokensDetails", json::array({{{"modality", "TEXT"}, {"tokenCount", n}}})}});
}

const char* GeminiStreamContentType(bool sse) { return sse ? "text/event-stream" : "application/json"; }

}  // namespace keel::gateway
