#include "keel/vector/wire.h"

#include <cmath>

#include "keel/core/json_reader.h"

namespace keel::vector::wire {

Result<QueryKind> ParseQueryKind(std::string_view name) {
  if (name == "text") return QueryKind::kText;
  if (name == "multimodal") return QueryKind::kMultimodal;
  if (name == "image") return QueryKind::kImage;
  return Status::InvalidArgument("unknown query kind \"" + std::string(name) + "\" (text, multimodal, image)");
}

using json = nlohmann::json;

Result<json> ParseBody(std::string_view text, size_t max_values) {
  const JsonLimits limits{.max_depth = 8, .max_values = max_values, .require_object = true};
  JsonReadError why = JsonReadError::kNone;
  Result<json> body = ParseUntrustedJson(text, limits, &why);
  if (why == JsonReadError::kMalformed) {
    return Status::InvalidArgument("request body is not valid JSON: " + body.status().message());
  }
  if (why == JsonReadError::kNotObject) return Status::InvalidArgument("request body must be a JSON object");
  if (!body.ok()) return Status::InvalidArgument("request body: " + body.status().message());
  return body;
}

// JSON cannot carry NaN or Inf, but a number beyond float32's range becomes Inf once narrowed.
Status GetFloats(const json& j, const std::string& field, std::vector<float>* out) {
  if (!j.is_array()) return Status::InvalidArgument(field + " must be an array of numbers");
  out->resize(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const json& v = j[i];
    if (!v.is_number()) return Status::InvalidArgument(field + "[" + std::to_string(i) + "] is not a number");
    const float f = static_cast<float>(v.get<double>());
    if (!std::isfinite(f)) return Status::InvalidArgument(field + "[" + std::to_string(i) + "] is not a finite float32");
    (*out)[i] = f;
  }
  return Status::Ok();
}

Status GetId(const json& j, const std::string& field, uint64_t* out) {
  if (!j.is_number_unsigned()) return Status::InvalidArgument(field + " must be an unsigned integer");
  *out = j.get<uint64_t>();
  return Status::Ok();
}

namespace {

Status GetStringMap(const json& j, const std::string& field, std::map<std::string, std::string>* out) {
  if (!j.is_object()) return Status::InvalidArgument(field + " must be an object of strings");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it.value().is_string()) return Status::InvalidArgument(field + "." + it.key() + " must be a string");
    (*out)[it.key()] = it.value().get<std::string>();
  }
  return Status::Ok();
}

// An integer field in [lo, hi]; absent leaves *out unchanged.
Status GetInt(const json& body, const char* name, int lo, int hi, int* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return Status::Ok();
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (!it->is_number_integer()) return Status::InvalidArgument(std::string(name) + " must be an integer in " + range);
  // Unsigned values beyond int64 read as huge; compare in the widest type first.
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return Status::InvalidArgument(std::string(name) + " must be in " + range + ", got " + it->dump());
  }
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) return Status::InvalidArgument(std::string(name) + " must be in " + range + ", got " + std::to_string(v));
  *out = static_cast<int>(v);
  return Status::Ok();
}

bool IsHex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) return false;
  }
  return true;
}

// A score as a replica wrote it: a float32 printed as the shortest double that round-trips.
Status GetScore(const json& hit, const char* name, const std::string& where, float* out) {
  auto it = hit.find(name);
  if (it == hit.end() || it->is_null()) {
    *out = 0;
    return Status::Ok();
  }
  if (!it->is_number()) return Status::InvalidArgument(where + "." + name + " must be a number");
  *out = static_cast<float>(it->get<double>());
  if (!std::isfinite(*out)) return Status::InvalidArgument(where + "." + name + " is not a finite float32");
  return Status::Ok();
}

}  // namespace

Status ParseItem(const json& j, size_t i, Item* item) {
  const std::string where = "items[" + std::to_string(i) + "]";
  if (!j.is_object()) return Status::InvalidArgument(where + " must be an object");
  auto id = j.find("id");
  if (id == j.end()) return Status::InvalidArgument(where + ".id is missing");
  KEEL_RETURN_IF_ERROR(GetId(*id, where + ".id", &item->id));
  auto text = j.find("text");
  if (text == j.end()) return Status::InvalidArgument(where + ".text is missing");
  KEEL_RETURN_IF_ERROR(GetFloats(*text, where + ".text", &item->text));
  if (auto image = j.find("image"); image != j.end() && !image->is_null()) {
    KEEL_RETURN_IF_ERROR(GetFloats(*image, where + ".image", &item->image));
  }
  if (auto attrs = j.find("attributes"); attrs != j.end() && !attrs->is_null()) {
    KEEL_RETURN_IF_ERROR(GetStringMap(*attrs, where + ".attributes", &item->attributes));
  }
  return Status::Ok();
}

Status ParseItems(const json& body, std::vector<Item>* out) {
  auto items = body.find("items");
  if (items == body.end() || !items->is_array()) return Status::InvalidArgument("items must be an array");
  out->assign(items->size(), Item{});
  for (size_t i = 0; i < out->size(); ++i) KEEL_RETURN_IF_ERROR(ParseItem((*items)[i], i, &(*out)[i]));
  return Status::Ok();
}

Status ParseIds(const json& body, std::vector<uint64_t>* out) {
  auto ids = body.find("ids");
  if (ids == body.end() || !ids->is_array()) return Status::InvalidArgument("ids must be an array of unsigned integers");
  out->assign(ids->size(), 0);
  for (size_t i = 0; i < out->size(); ++i) KEEL_RETURN_IF_ERROR(GetId((*ids)[i], "ids[" + std::to_string(i) + "]", &(*out)[i]));
  return Status::Ok();
}

Status ParseWriteVersion(const json& body, std::optional<uint64_t>* out) {
  out->reset();
  auto v = body.find("version");
  if (v == body.end() || v->is_null()) return Status::Ok();
  uint64_t version = 0;
  KEEL_RETURN_IF_ERROR(GetId(*v, "version", &version));
  *out = version;
  return Status::Ok();
}

Status ParseSearchRequest(const json& body, int max_k, SearchRequest* r) {
  if (auto kind = body.find("kind"); kind != body.end()) {
    if (!kind->is_string()) return Status::InvalidArgument("kind must be a string (text, multimodal, image)");
    KEEL_ASSIGN_OR_RETURN(r->kind, ParseQueryKind(kind->get<std::string>()));
  }
  if (auto t = body.find("text"); t != body.end() && !t->is_null()) KEEL_RETURN_IF_ERROR(GetFloats(*t, "text", &r->text_query));
  if (auto t = body.find("image"); t != body.end() && !t->is_null()) KEEL_RETURN_IF_ERROR(GetFloats(*t, "image", &r->image_query));
  if (auto ids = body.find("ids"); ids != body.end() && !ids->is_null()) {
    if (!ids->is_array()) return Status::InvalidArgument("ids must be an array of unsigned integers");
    if (ids->size() > static_cast<size_t>(max_k)) {
      return Status::InvalidArgument("ids holds " + std::to_string(ids->size()) + " entries, at most " + std::to_string(max_k));
    }
    r->ids.resize(ids->size());
    for (size_t i = 0; i < ids->size(); ++i) KEEL_RETURN_IF_ERROR(GetId((*ids)[i], "ids[" + std::to_string(i) + "]", &r->ids[i]));
  }
  KEEL_RETURN_IF_ERROR(GetInt(body, "k", 1, max_k, &r->k));
  KEEL_RETURN_IF_ERROR(GetInt(body, "ef", 0, 1 << 16, &r->ef));
  KEEL_RETURN_IF_ERROR(GetInt(body, "nprobe", 0, 1 << 20, &r->nprobe));
  KEEL_RETURN_IF_ERROR(GetInt(body, "rerank", -1, 1 << 16, &r->rerank));
  if (auto f = body.find("filter"); f != body.end() && !f->is_null()) KEEL_RETURN_IF_ERROR(GetStringMap(*f, "filter", &r->filter));
  if (auto v = body.find("include_vectors"); v != body.end() && !v->is_null()) {
    if (!v->is_boolean()) return Status::InvalidArgument("include_vectors must be true or false");
    r->include_vectors = v->get<bool>();
  }
  if (r->kind != QueryKind::kImage && r->text_query.empty()) {
    return Status::InvalidArgument("text is required for kind " + std::string(r->kind == QueryKind::kText ? "text" : "multimodal"));
  }
  return Status::Ok();
}

Status ParseNonce(const json& body, std::string* nonce) {
  nonce->clear();
  auto n = body.find("nonce");
  if (n == body.end() || n->is_null()) return Status::Ok();
  const std::string what = "nonce must be a string of 1.." + std::to_string(trust::kMaxNonceBytes) + " printable ASCII characters";
  if (!n->is_string()) return Status::InvalidArgument(what);
  const std::string& s = n->get_ref<const std::string&>();
  if (s.empty() || s.size() > trust::kMaxNonceBytes) return Status::InvalidArgument(what + ", got " + std::to_string(s.size()) + " bytes");
  for (char c : s) {
    if (c < 0x20 || c > 0x7e) return Status::InvalidArgument(what);
  }
  *nonce = s;
  return Status::Ok();
}

json HitJson(const SearchHit& h, const SearchRequest& r) {
  json j = {{"id", h.id}};
  if (r.kind != QueryKind::kImage) j["text_distance"] = h.text_distance;
  if (!r.image_query.empty()) j["image_distance"] = h.image_distance;
  if (!h.text.empty()) j["text"] = h.text;
  if (!h.image.empty()) j["image"] = h.image;
  return j;
}

json TrustJson(const trust::ReplyBody& body, std::string_view signature_hex) {
  return {{"shard", body.shard},
          {"replica", body.replica},
          {"zone", body.zone},
          {"index_version", body.index_version},
          {"query_digest", body.query.Hex()},
          {"signature", std::string(signature_hex)}};
}

Status ParseSignedReply(const json& answer, size_t max_hits, trust::ReplyBody* body, std::string* signature_hex) {
  if (!answer.is_object()) return Status::InvalidArgument("answer must be a JSON object");
  auto t = answer.find("trust");
  if (t == answer.end() || !t->is_object()) return Status::InvalidArgument("answer has no trust object");
  auto str = [&](const char* name, std::string* out) -> Status {
    auto it = t->find(name);
    if (it == t->end() || !it->is_string()) return Status::InvalidArgument(std::string("trust.") + name + " must be a string");
    *out = it->get<std::string>();
    return Status::Ok();
  };
  auto uint = [&](const char* name, uint64_t* out) -> Status {
    auto it = t->find(name);
    if (it == t->end()) return Status::InvalidArgument(std::string("trust.") + name + " is missing");
    return GetId(*it, std::string("trust.") + name, out);
  };
  uint64_t shard = 0;
  KEEL_RETURN_IF_ERROR(uint("shard", &shard));
  if (shard > UINT32_MAX) return Status::InvalidArgument("trust.shard out of range");
  body->shard = static_cast<uint32_t>(shard);
  KEEL_RETURN_IF_ERROR(str("replica", &body->replica));
  KEEL_RETURN_IF_ERROR(str("zone", &body->zone));
  if (body->replica.size() > trust::kMaxLabelBytes || body->zone.size() > trust::kMaxLabelBytes) {
    return Status::InvalidArgument("trust.replica and trust.zone hold at most " + std::to_string(trust::kMaxLabelBytes) + " bytes");
  }
  KEEL_RETURN_IF_ERROR(uint("index_version", &body->index_version));
  std::string digest;
  KEEL_RETURN_IF_ERROR(str("query_digest", &digest));
  KEEL_ASSIGN_OR_RETURN(body->query, trust::QueryDigest::FromHex(digest));
  KEEL_RETURN_IF_ERROR(str("signature", signature_hex));
  if (signature_hex->size() != 128 || !IsHex(*signature_hex)) return Status::InvalidArgument("trust.signature must be 128 hex digits");

  auto hits = answer.find("hits");
  if (hits == answer.end() || !hits->is_array()) return Status::InvalidArgument("hits must be an array");
  if (hits->size() > max_hits) {
    return Status::InvalidArgument("hits holds " + std::to_string(hits->size()) + " entries, at most " + std::to_string(max_hits));
  }
  body->hits.clear();
  body->hits.reserve(hits->size());
  for (size_t i = 0; i < hits->size(); ++i) {
    const json& h = (*hits)[i];
    const std::string where = "hits[" + std::to_string(i) + "]";
    if (!h.is_object()) return Status::InvalidArgument(where + " must be an object");
    trust::SignedHit s;
    auto id = h.find("id");
    if (id == h.end()) return Status::InvalidArgument(where + ".id is missing");
    KEEL_RETURN_IF_ERROR(GetId(*id, where + ".id", &s.id));
    KEEL_RETURN_IF_ERROR(GetScore(h, "text_distance", where, &s.text_distance));
    KEEL_RETURN_IF_ERROR(GetScore(h, "image_distance", where, &s.image_distance));
    std::vector<float> text, image;
    if (auto v = h.find("text"); v != h.end() && !v->is_null()) KEEL_RETURN_IF_ERROR(GetFloats(*v, where + ".text", &text));
    if (auto v = h.find("image"); v != h.end() && !v->is_null()) KEEL_RETURN_IF_ERROR(GetFloats(*v, where + ".image", &image));
    s.vector_digest = trust::VectorDigest(text, image);
    body->hits.push_back(s);
  }
  return Status::Ok();
}

}  // namespace keel::vector::wire
