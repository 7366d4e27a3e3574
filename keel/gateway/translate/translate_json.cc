// JSON reading helpers shared by the format translators (see translate_internal.h).
#include <cctype>
#include <cstdio>
#include <ctime>
#include <random>

#include "keel/gateway/translate_internal.h"

namespace keel::gateway::internal {

namespace {

Result<json> ParseImpl(std::string_view body, const char* what, StatusCode code, const JsonLimits& limits) {
  Result<json> j = ParseUntrustedJson(body, limits);
  if (!j.ok()) return Status(code, std::string(what) + ": " + j.status().message());
  return j;
}

const json* Field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

}  // namespace

Result<json> ParseObject(std::string_view body, const char* what) {
  return ParseImpl(body, what, StatusCode::kInvalidArgument, kClientJsonLimits);
}

Result<json> ParseUpstreamObject(std::string_view body) {
  return ParseImpl(body, "upstream response", StatusCode::kCorruption, kUpstreamJsonLimits);
}

std::string StringOr(const json& obj, const char* key, const std::string& fallback) {
  if (!obj.is_object()) return fallback;
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : fallback;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

Status ReadString(const json& obj, const char* key, const std::string& path, std::string* out) {
  const json* v = Field(obj, key);
  if (!v) return Status::Ok();
  if (!v->is_string()) return Status::InvalidArgument(path + ": expected a string");
  *out = v->get<std::string>();
  return Status::Ok();
}

Status ReadRequiredString(const json& obj, const char* key, const std::string& path, std::string* out) {
  if (!Field(obj, key)) return Status::InvalidArgument(path + ": required");
  KEEL_RETURN_IF_ERROR(ReadString(obj, key, path, out));
  if (out->empty()) return Status::InvalidArgument(path + ": must not be empty");
  return Status::Ok();
}

namespace {

// An integer in int64 range into *out. 16.0 is accepted (some clients serialise every number as
// a double); 16.5 is not.
bool IntegerValue(const json& v, int64_t* out) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX) return false;
    *out = v.get<int64_t>();
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d >= -9.0e18 && d <= 9.0e18 && d == static_cast<double>(static_cast<int64_t>(d))) {
      *out = static_cast<int64_t>(d);
      return true;
    }
  }
  return false;
}

}  // namespace

Status ReadPositiveInt(const json& obj, const char* key, const std::string& path,
                       std::optional<int64_t>* out) {
  const json* v = Field(obj, key);
  if (!v) return Status::Ok();
  int64_t x = 0;
  if (!IntegerValue(*v, &x) || x < 1) return Status::InvalidArgument(path + ": expected a positive integer");
  *out = x;
  return Status::Ok();
}

Status ReadInt(const json& obj, const char* key, const std::string& path, std::optional<int64_t>* out) {
  const json* v = Field(obj, key);
  if (!v) return Status::Ok();
  int64_t x = 0;
  if (!IntegerValue(*v, &x)) return Status::InvalidArgument(path + ": expected an integer");
  *out = x;
  return Status::Ok();
}

Status ReadNumber(const json& obj, const char* key, const std::string& path, std::optional<double>* out) {
  const json* v = Field(obj, key);
  if (!v) return Status::Ok();
  if (!v->is_number()) return Status::InvalidArgument(path + ": expected a number");
  *out = v->get<double>();
  return Status::Ok();
}

Status ReadNumberInRange(const json& obj, const char* key, const std::string& path, double lo, double hi,
                         std::optional<double>* out) {
  std::optional<double> v;
  KEEL_RETURN_IF_ERROR(ReadNumber(obj, key, path, &v));
  if (!v) return Status::Ok();
  if (!(*v >= lo && *v <= hi)) {
    char range[64];
    std::snprintf(range, sizeof range, "%g and %g", lo, hi);
    return Status::InvalidArgument(path + ": expected a number between " + range);
  }
  *out = v;
  return Status::Ok();
}

Status ReadReasoningEffort(const json& obj, const char* key, std::string* out) {
  KEEL_RETURN_IF_ERROR(ReadString(obj, key, key, out));
  if (out->size() > 16 || out->find_first_not_of("abcdefghijklmnopqrstuvwxyz_") != std::string::npos) {
    return Status::InvalidArgument(std::string(key) + ": expected an effort such as \"low\", \"medium\" or \"high\"");
  }
  return Status::Ok();
}

Status ReadBool(const json& obj, const char* key, const std::string& path, bool* out) {
  const json* v = Field(obj, key);
  if (!v) return Status::Ok();
  if (!v->is_boolean()) return Status::InvalidArgument(path + ": expected true or false");
  *out = v->get<bool>();
  return Status::Ok();
}

Status ReadBool(const json& obj, const char* key, const std::string& path, std::optional<bool>* out) {
  if (!Field(obj, key)) return Status::Ok();
  bool b = false;
  KEEL_RETURN_IF_ERROR(ReadBool(obj, key, path, &b));
  *out = b;
  return Status::Ok();
}

Status ReadStop(const json& obj, const char* key, const std::string& path, bool allow_single_string,
                std::vector<std::string>* out) {
  const json* v = Field(obj, key);
  if (!v) return Status::Ok();
  if (allow_single_string && v->is_string()) {
    out->push_back(v->get<std::string>());
    return Status::Ok();
  }
  const char* expected = allow_single_string ? ": expected a string or an array of strings"
                                             : ": expected an array of strings";
  if (!v->is_array()) return Status::InvalidArgument(path + expected);
  if (v->size() > kMaxStop)
    return Status::InvalidArgument(path + ": at most " + std::to_string(kMaxStop) + " entries");
  for (size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string())
      return Status::InvalidArgument(path + "[" + std::to_string(i) + "]: expected a string");
    out->push_back((*v)[i].get<std::string>());
  }
  return Status::Ok();
}

Status ReadObjectText(const json& obj, const char* key, const std::string& path, std::string* out) {
  const json* v = Field(obj, key);
  if (!v) {
    *out = "{}";
    return Status::Ok();
  }
  if (!v->is_object()) return Status::InvalidArgument(path + ": expected a JSON object");
  *out = Dump(*v);
  return Status::Ok();
}

Status ReadFunctionTool(const json& fn, const std::string& path, Tool* tool) {
  KEEL_RETURN_IF_ERROR(ReadRequiredString(fn, "name", path + ".name", &tool->name));
  KEEL_RETURN_IF_ERROR(ReadString(fn, "description", path + ".description", &tool->description));
  KEEL_RETURN_IF_ERROR(ReadBool(fn, "strict", path + ".strict", &tool->strict));
  return ReadObjectText(fn, "parameters", path + ".parameters", &tool->parameters_json);
}

Status ReadArgumentsText(const json& obj, const std::string& path, std::string* out) {
  if (auto a = obj.find("arguments"); a != obj.end() && a->is_object()) {
    *out = Dump(*a);
    return Status::Ok();
  }
  return ReadString(obj, "arguments", path, out);
}

namespace {

// OpenAI's rule for json_schema.name.
bool ValidSchemaName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  return true;
}

// json_schema's fields, in `fields` (whose path is `path`).
Status ReadJsonSchemaFields(const json& fields, const std::string& path, const ResponseFormatSpelling& spelling,
                            ResponseFormat* format) {
  KEEL_RETURN_IF_ERROR(ReadRequiredString(fields, "name", path + ".name", &format->name));
  if (spelling.check_name && !ValidSchemaName(format->name))
    return Status::InvalidArgument(path + ".name: expected 1 to 64 letters, digits, '_' or '-'");
  if (spelling.schema_required && !Field(fields, "schema")) return Status::InvalidArgument(path + ".schema: required");
  std::string description;  // validated; ResponseFormat has no place for it (no other format has one)
  KEEL_RETURN_IF_ERROR(ReadString(fields, "description", path + ".description", &description));
  KEEL_RETURN_IF_ERROR(ReadObjectText(fields, "schema", path + ".schema", &format->schema_json));
  return ReadBool(fields, "strict", path + ".strict", &format->strict);
}

}  // namespace

Status ReadOpenAIResponseFormat(const json& f, const ResponseFormatSpelling& spelling,
                                std::optional<ResponseFormat>* out) {
  const std::string path = spelling.path;
  if (!f.is_object()) return Status::InvalidArgument(path + ": expected an object");
  std::string type;
  KEEL_RETURN_IF_ERROR(ReadRequiredString(f, "type", path + ".type", &type));
  ResponseFormat format;
  if (type == "text") {
    format.kind = ResponseFormat::Kind::kText;
  } else if (type == "json_object") {
    format.kind = ResponseFormat::Kind::kJsonObject;
  } else if (type == "json_schema") {
    format.kind = ResponseFormat::Kind::kJsonSchema;
    if (!spelling.schema_member) {
      KEEL_RETURN_IF_ERROR(ReadJsonSchemaFields(f, path, spelling, &format));
    } else {
      const std::string member_path = path + "." + spelling.schema_member;
      const json* js = Field(f, spelling.schema_member);
      if (!js) return Status::InvalidArgument(member_path + ": required");
      if (!js->is_object()) return Status::InvalidArgument(member_path + ": expected an object");
      KEEL_RETURN_IF_ERROR(ReadJsonSchemaFields(*js, member_path, spelling, &format));
    }
  } else {
    return Status::InvalidArgument(path + ".type: expected text, json_object or json_schema");
  }
  *out = std::move(format);
  return Status::Ok();
}

json ArgumentsObject(const std::string& arguments_json) {
  if (arguments_json.find_first_not_of(" \t\r\n") == std::string::npos) return json::object();
  Result<json> j = ParseUntrustedJson(arguments_json, kClientJsonLimits);
  if (j.ok()) return std::move(j).value();
  return json{{"_raw", arguments_json}};
}

json SchemaObject(const std::string& parameters_json) {
  Result<json> j = ParseUntrustedJson(parameters_json, kClientJsonLimits);
  return j.ok() ? std::move(j).value() : json::object();
}

std::vector<Message> EffectiveMessages(const ChatRequest& request) {
  if (request.messages.empty() && request.client_format == WireFormat::kOpenAICompletions) {
    Message m;
    m.role = "user";
    m.content = request.prompt;
    return {m};
  }
  return request.messages;
}

std::string ToolNameFor(const std::vector<Message>& messages, size_t tool_index) {
  const Message& tool = messages[tool_index];
  if (!tool.name.empty()) return tool.name;
  for (size_t i = tool_index; i-- > 0;) {
    for (const ToolCall& call : messages[i].tool_calls)
      if (call.id == tool.tool_call_id) return call.name;
  }
  return tool.tool_call_id;
}

void NameToolMessages(std::vector<Message>* messages) {
  for (size_t i = 0; i < messages->size(); ++i)
    if ((*messages)[i].role == "tool") (*messages)[i].name = ToolNameFor(*messages, i);
}

std::string NewId(const char* prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char kHex[] = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += kHex[rng() & 15];
  return id;
}

std::string PrefixedId(const std::string& id, const char* prefix) {
  if (id.empty()) return NewId(prefix);
  if (id.rfind(prefix, 0) == 0) return id;
  return prefix + id;
}

int64_t NowSeconds() { return static_cast<int64_t>(std::time(nullptr)); }

Status Unsupported(const std::string& field, WireFormat upstream) {
  return Status::InvalidArgument(field + ": not supported by " + WireFormatName(upstream) + " upstreams");
}

}  // namespace keel::gateway::internal
