#include "keel/vector/replica_reply.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_map>
#include <limits>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/vector/wire.h"

namespace keel::vector {

namespace {

using json = nlohmann::json;
using trust::ReplyFault;
using trust::SignedHit;

CheckedAnswer Fault(ReplyFault fault, std::string detail) {
  CheckedAnswer out;
  out.reply.fault = fault;
  out.reply.detail = std::move(detail);
  return out;
}

// Hits a shard may return: k, or for an image lookup the distinct ids asked.
size_t MaxHits(const SearchRequest& r) {
  if (r.kind != QueryKind::kImage) return static_cast<size_t>(std::max(r.k, 0));
  return std::unordered_set<uint64_t>(r.ids.begin(), r.ids.end()).size();
}

// A score the shard must have written for this request: present, finite as float32, >= 0
// (squared L2 distances).
Status GetScore(const json& hit, const char* name, const std::string& where, float* out) {
  auto it = hit.find(name);
  if (it == hit.end() || !it->is_number()) return Status::InvalidArgument(where + "." + name + " must be a number");
  *out = static_cast<float>(it->get<double>());
  if (!std::isfinite(*out) || *out < 0) return Status::InvalidArgument(where + "." + name + " must be a finite float32 >= 0");
  return Status::Ok();
}

Status ParseHit(const json& h, const SearchRequest& r, const std::string& where, SearchHit* out) {
  if (!h.is_object()) return Status::InvalidArgument(where + " must be an object");
  auto id = h.find("id");
  if (id == h.end()) return Status::InvalidArgument(where + ".id is missing");
  KEEL_RETURN_IF_ERROR(wire::GetId(*id, where + ".id", &out->id));
  if (r.kind != QueryKind::kImage) KEEL_RETURN_IF_ERROR(GetScore(h, "text_distance", where, &out->text_distance));
  if (!r.image_query.empty()) KEEL_RETURN_IF_ERROR(GetScore(h, "image_distance", where, &out->image_distance));
  if (auto v = h.find("text"); v != h.end() && !v->is_null()) KEEL_RETURN_IF_ERROR(wire::GetFloats(*v, where + ".text", &out->text));
  if (auto v = h.find("image"); v != h.end() && !v->is_null()) KEEL_RETURN_IF_ERROR(wire::GetFloats(*v, where + ".image", &out->image));
  return Status::Ok();
}

Status ParseHits(const json& answer, const SearchRequest& r, std::vector<SearchHit>* out) {
  auto hits = answer.find("hits");
  if (hits == answer.end() || !hits->is_array()) return Status::InvalidArgument("hits must be an array");
  if (hits->size() > MaxHits(r)) {
    return Status::InvalidArgument(fmt::format("{} hits, at most {} asked", hits->size(), MaxHits(r)));
  }
  out->resize(hits->size());
  for (size_t i = 0; i < hits->size(); ++i) {
    KEEL_RETURN_IF_ERROR(ParseHit((*hits)[i], r, fmt::format("hits[{}]", i), &(*out)[i]));
  }
  return Status::Ok();
}

bool TextBefore(const SearchHit& a, const SearchHit& b) {
  return a.text_distance < b.text_distance || (a.text_distance == b.text_distance && a.id < b.id);
}
bool ImageBefore(const SearchHit& a, const SearchHit& b) {
  return a.image_distance < b.image_distance || (a.image_distance == b.image_distance && a.id < b.id);
}

// The shard's ranking (keel/vector/shard.h): by (text_distance, id); with an image query, by
// (image_distance, id) with items lacking an image vector last in text order (they are written
// with image_distance 0); image lookups follow the order of the ids asked.
Status CheckOrder(const std::vector<SearchHit>& hits, const SearchRequest& r) {
  if (r.kind == QueryKind::kImage) {
    std::unordered_map<uint64_t, size_t> position;
    for (size_t i = 0; i < r.ids.size(); ++i) position.emplace(r.ids[i], i);
    size_t last = 0;
    for (size_t i = 0; i < hits.size(); ++i) {
      auto it = position.find(hits[i].id);
      if (it == position.end()) return Status::InvalidArgument(fmt::format("hits[{}]: id {} was not asked for", i, hits[i].id));
      if (i > 0 && it->second <= last) return Status::InvalidArgument(fmt::format("hits[{}] is out of the order asked", i));
      last = it->second;
    }
    return Status::Ok();
  }
  size_t i = 1;
  if (!r.image_query.empty()) {
    while (i < hits.size() && ImageBefore(hits[i - 1], hits[i])) ++i;
    // The rest may only be items without an image vector, in text order.
    if (i < hits.size() && hits[i].image_distance != 0) return Status::InvalidArgument(fmt::format("hits[{}] is out of order", i));
    for (size_t j = i; j < hits.size(); ++j) {
      if (hits[j].image_distance != 0) return Status::InvalidArgument(fmt::format("hits[{}] is out of order", j));
    }
    ++i;
  }
  for (; i < hits.size(); ++i) {
    if (!TextBefore(hits[i - 1], hits[i])) return Status::InvalidArgument(fmt::format("hits[{}] is out of order", i));
  }
  return Status::Ok();
}

// With an image query a shard ranks items without an image vector last, writing image distance 0
// for them (CheckOrder has checked that shape). The zeros after a positive distance are that tail:
// they get +inf here, so a merge across shards ranks them last too. (All zeros is ambiguous and
// left as it is: exact image matches and imageless items both read 0.)
void MarkImagelessTail(std::vector<SearchHit>* hits) {
  size_t tail = hits->size();
  while (tail > 0 && (*hits)[tail - 1].image_distance == 0) --tail;
  if (tail == 0) return;
  for (size_t i = tail; i < hits->size(); ++i) (*hits)[i].image_distance = std::numeric_limits<float>::infinity();
}

// Content checks shared by both modes: ids unique and of this shard, ranking as the shard ranks.
CheckedAnswer CheckContent(const std::vector<SearchHit>& hits, const ReplyExpectation& e) {
  std::unordered_set<uint64_t> seen;
  for (size_t i = 0; i < hits.size(); ++i) {
    if (!seen.insert(hits[i].id).second) return Fault(ReplyFault::kMalformed, fmt::format("duplicate id {}", hits[i].id));
    if (trust::ShardOf(hits[i].id, e.shards) != e.shard) {
      return Fault(ReplyFault::kWrongShard, fmt::format("id {} belongs to shard {}", hits[i].id, trust::ShardOf(hits[i].id, e.shards)));
    }
  }
  if (Status s = CheckOrder(hits, *e.request); !s.ok()) return Fault(ReplyFault::kMalformed, s.message());
  return {};
}

// Trust mode: the "trust" object must be there, verify under the replica's key, and be the
// replica's own. Fills `body` with what was signed.
CheckedAnswer CheckSignature(const json& answer, const ReplyExpectation& e, trust::ReplyBody* body) {
  auto t = answer.find("trust");
  if (t == answer.end() || !t->is_object() || !t->contains("signature")) return Fault(ReplyFault::kUnsigned, "no signature");
  std::string signature;
  if (Status s = wire::ParseSignedReply(answer, MaxHits(*e.request), body, &signature); !s.ok()) {
    return Fault(ReplyFault::kMalformed, s.message());
  }
  if (ReplyFault f = e.store->Verify(*body, signature, e.shard, e.digest); f != ReplyFault::kNone) {
    return Fault(f, fmt::format("signed as {} of shard {}", body->replica, body->shard));
  }
  if (body->replica != e.replica) return Fault(ReplyFault::kReplay, fmt::format("signed by {}, asked {}", body->replica, e.replica));
  return {};
}

// Plain mode: the version, if the replica reports one, is read without being trusted.
std::optional<uint64_t> UncheckedVersion(const json& answer) {
  auto t = answer.find("trust");
  if (t == answer.end() || !t->is_object()) return std::nullopt;
  auto v = t->find("index_version");
  if (v == t->end() || !v->is_number_unsigned()) return std::nullopt;
  return v->get<uint64_t>();
}

}  // namespace

CheckedAnswer CheckReplicaAnswer(const Result<HttpReply>& call, const ReplyExpectation& e) {
  if (!call.ok()) return Fault(ReplyFault::kUnreachable, call.status().message());
  if (call->status != 200) {
    return Fault(ReplyFault::kUnreachable, fmt::format("HTTP {}: {}", call->status, call->body.substr(0, 200)));
  }
  // Hits nest 3 deep (answer, hits, hit, vector); 8 leaves room.
  const JsonLimits limits{.max_depth = 8, .max_values = e.max_json_values, .require_object = true};
  auto answer = ParseUntrustedJson(call->body, limits);
  if (!answer.ok()) return Fault(ReplyFault::kMalformed, answer.status().message());
  CheckedAnswer out;
  if (Status s = ParseHits(*answer, *e.request, &out.hits); !s.ok()) return Fault(ReplyFault::kMalformed, s.message());
  trust::ReplyBody body;
  bool versioned = true;  // a plain-mode replica without a "trust" object reports no version
  if (e.store) {
    CheckedAnswer sig = CheckSignature(*answer, e, &body);
    if (sig.reply.fault != ReplyFault::kNone) return sig;
  } else {
    const std::optional<uint64_t> v = UncheckedVersion(*answer);
    versioned = v.has_value();
    body.index_version = v.value_or(0);
    for (const SearchHit& h : out.hits) body.hits.push_back(trust::ToSignedHit(h));
  }
  CheckedAnswer content = CheckContent(out.hits, e);
  if (content.reply.fault != ReplyFault::kNone) return content;
  if (!e.request->image_query.empty()) MarkImagelessTail(&out.hits);
  if (versioned && body.index_version < e.min_version) {
    return Fault(ReplyFault::kStale, fmt::format("index version {}, committed {}", body.index_version, e.min_version));
  }
  out.reply.index_version = body.index_version;
  out.reply.hits = std::move(body.hits);  // as signed
  if (auto t = answer->find("tiers_touched"); t != answer->end() && t->is_number_unsigned()) {
    out.tiers_touched = static_cast<int>(std::min<uint64_t>(t->get<uint64_t>(), 64));
  }
  return out;
}

}  // namespace keel::vector
