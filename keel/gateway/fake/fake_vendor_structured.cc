// FakeVendor: structured-output answers. A vendor asked for JSON (OpenAI response_format,
// Anthropic output_config.format, Gemini responseMimeType/responseSchema) answers with a JSON
// document that satisfies the schema, as a constrained model would, so an SDK's parse helpers
// (zod, pydantic) accept what came back through the gateway.
#include <algorithm>
#include <cctype>

#include "keel/gateway/fake_vendor_internal.h"

namespace keel::gateway::fake {
namespace {

constexpr int kMaxDepth = 24;        // recursive $ref schemas stop here (null)
constexpr int64_t kMaxArrayItems = 8;  // minItems beyond this is not honoured

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// "#/$defs/Name" (or any local JSON pointer) resolved against the root schema; nullptr if absent.
const Json* ResolveRef(const Json& root, const std::string& ref) {
  if (ref.rfind("#", 0) != 0) return nullptr;
  const Json* at = &root;
  size_t pos = 1;
  while (pos < ref.size()) {
    if (ref[pos] != '/') return nullptr;
    size_t end = ref.find('/', pos + 1);
    std::string token = ref.substr(pos + 1, end == std::string::npos ? std::string::npos : end - pos - 1);
    for (size_t i; (i = token.find("~1")) != std::string::npos;) token.replace(i, 2, "/");
    for (size_t i; (i = token.find("~0")) != std::string::npos;) token.replace(i, 2, "~");
    at = Member(*at, token.c_str());
    if (!at) return nullptr;
    pos = end == std::string::npos ? ref.size() : end;
  }
  return at;
}

// The schema's type, lower case: the first non-null one of a type list; inferred when absent.
std::string TypeOf(const Json& schema) {
  if (const Json* t = StringMember(schema, "type")) return Lower(t->get<std::string>());
  if (const Json* ts = ArrayMember(schema, "type")) {
    for (const auto& t : *ts) {
      if (t.is_string() && Lower(t.get<std::string>()) != "null") return Lower(t.get<std::string>());
    }
    return "null";
  }
  if (ObjectMember(schema, "properties")) return "object";
  if (Member(schema, "items")) return "array";
  return "string";
}

bool IsNullSchema(const Json& s) {
  const Json* t = StringMember(s, "type");
  return t && Lower(t->get<std::string>()) == "null";
}

class Instancer {
 public:
  Instancer(const Json& root, const std::vector<std::string>& words) : root_(root), words_(words) {}

  Json Make(const Json& schema, int depth) {
    if (depth > kMaxDepth || !schema.is_object()) return schema.is_boolean() ? Json(NextWord()) : Json(nullptr);
    if (const Json* ref = StringMember(schema, "$ref")) {
      const Json* target = ResolveRef(root_, ref->get<std::string>());
      return target ? Make(*target, depth + 1) : Json(nullptr);
    }
    if (const Json* c = Member(schema, "const")) return *c;
    if (const Json* e = ArrayMember(schema, "enum"); e && !e->empty()) return e->front();
    for (const char* alt : {"anyOf", "oneOf", "any_of"}) {
      if (const Json* options = ArrayMember(schema, alt); options && !options->empty()) {
        // A nullable field is written anyOf [T, null]: answer the T.
        for (const auto& o : *options) {
          if (!IsNullSchema(o)) return Make(o, depth + 1);
        }
        return nullptr;
      }
    }
    if (const Json* all = ArrayMember(schema, "allOf"); all && !all->empty()) return Make(all->front(), depth + 1);
    const std::string type = TypeOf(schema);
    if (type == "object") return Object(schema, depth);
    if (type == "array") return Array(schema, depth);
    if (type == "integer" || type == "number") return Number(schema, type == "integer");
    if (type == "boolean") return true;
    if (type == "null") return nullptr;
    return String(schema);
  }

 private:
  std::string NextWord() {
    const size_t i = next_++;
    return i < words_.size() ? words_[i] : "w" + std::to_string(i);
  }

  Json Object(const Json& schema, int depth) {
    Json out = Json::object();
    if (const Json* props = ObjectMember(schema, "properties")) {
      for (auto it = props->begin(); it != props->end(); ++it) out[it.key()] = Make(it.value(), depth + 1);
    }
    return out;
  }

  Json Array(const Json& schema, int depth) {
    int64_t n = 1;
    for (const char* key : {"minItems", "min_items"}) {
      if (const Json* m = Member(schema, key); m && m->is_number_integer()) n = std::clamp<int64_t>(m->get<int64_t>(), 0, kMaxArrayItems);
    }
    const Json* items = Member(schema, "items");
    Json out = Json::array();
    for (int64_t i = 0; i < n; ++i) out.push_back(items ? Make(*items, depth + 1) : Json(NextWord()));
    return out;
  }

  static Json Number(const Json& schema, bool integer) {
    double v = 1;
    if (const Json* lo = Member(schema, "minimum"); lo && lo->is_number()) v = std::max(v, lo->get<double>());
    if (const Json* hi = Member(schema, "maximum"); hi && hi->is_number()) v = std::min(v, hi->get<double>());
    if (integer) return static_cast<int64_t>(v);
    return v;
  }

  Json String(const Json& schema) {
    if (const Json* f = StringMember(schema, "format")) {
      const std::string format = f->get<std::string>();
      if (format == "date-time") return "2025-01-01T00:00:00Z";
      if (format == "date") return "2025-01-01";
      if (format == "email") return NextWord() + "@example.com";
      if (format == "uri") return "https://example.com/" + NextWord();
      if (format == "uuid") return "00000000-0000-4000-8000-000000000000";
    }
    return NextWord();
  }

  const Json& root_;
  const std::vector<std::string>& words_;
  size_t next_ = 0;
};

}  // namespace

Json SchemaInstance(const Json& schema, const std::vector<std::string>& words) {
  if (schema.is_null()) {
    std::string text;
    for (size_t i = 0; i < words.size(); ++i) text += (i ? " " : "") + words[i];
    return {{"answer", text}};
  }
  return Instancer(schema, words).Make(schema, 0);
}

std::vector<std::string> JsonPieces(std::string_view text) {
  std::vector<std::string> pieces;
  std::string cur;
  auto flush = [&] {
    if (!cur.empty()) pieces.push_back(std::move(cur));
    cur.clear();
  };
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      cur += c;
      if (c == '\\' && i + 1 < text.size()) {
        cur += text[++i];
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      cur += c;
    } else if (c == '}' || c == ']') {
      flush();
      cur = c;
      flush();
    } else {
      cur += c;
      if (c == '{' || c == '[' || c == ',' || c == ':') flush();
    }
  }
  flush();
  return pieces;
}

}  // namespace keel::gateway::fake
