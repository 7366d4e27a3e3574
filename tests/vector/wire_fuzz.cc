// libFuzzer target for the vector service's JSON wire (keel/vector/wire.h): request bodies a
// client sends to `keel vector` and `keel vector-router` (/v1/search, /v1/upsert, /v1/delete),
// and the signed search answers a replica sends back to the router, which in trust mode must
// assume the replica is hostile. The first input byte picks the reader; the rest is the text.
// Crashes, sanitizer reports and broken invariants (abort with a message) are bugs:
//  * a body that parses obeys the documented bounds (k, ef, nprobe, rerank, ids, finite floats);
//  * a parsed search request written back as JSON parses to the same request and the same
//    query digest (router and replica must digest a request alike);
//  * a signed answer that parses obeys its bounds, and written back (TrustJson, hits) parses to
//    the same reply body, with the same canonical bytes.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/json_reader.h"
#include "keel/vector/wire.h"

namespace {

using namespace keel::vector;
using nlohmann::json;

constexpr int kMaxK = 64;
constexpr size_t kMaxHits = 64;

[[noreturn]] void Broken(const char* what) {
  std::fprintf(stderr, "vector_wire_fuzz: %s\n", what);
  std::abort();
}

bool Finite(const std::vector<float>& v) {
  for (float f : v) {
    if (!std::isfinite(f)) return false;
  }
  return true;
}

json RequestJson(const SearchRequest& r) {
  static const char* const kKinds[] = {"text", "multimodal", "image"};
  json j = {{"kind", kKinds[static_cast<int>(r.kind)]}, {"k", r.k}, {"ef", r.ef}, {"nprobe", r.nprobe},
            {"rerank", r.rerank}, {"include_vectors", r.include_vectors}};
  if (!r.text_query.empty()) j["text"] = r.text_query;
  if (!r.image_query.empty()) j["image"] = r.image_query;
  if (!r.ids.empty()) j["ids"] = r.ids;
  if (!r.filter.empty()) j["filter"] = r.filter;
  return j;
}

bool SameRequest(const SearchRequest& a, const SearchRequest& b) {
  return a.kind == b.kind && a.text_query == b.text_query && a.image_query == b.image_query && a.ids == b.ids &&
         a.k == b.k && a.ef == b.ef && a.nprobe == b.nprobe && a.rerank == b.rerank && a.filter == b.filter &&
         a.include_vectors == b.include_vectors;
}

void Body(std::string_view text) {
  auto body = wire::ParseBody(text, 1 << 14);
  if (!body.ok()) return;
  if (!body->is_object()) Broken("ParseBody accepted a non-object");

  SearchRequest r;
  std::string nonce;
  if (wire::ParseSearchRequest(*body, kMaxK, &r).ok() && wire::ParseNonce(*body, &nonce).ok()) {
    if (r.k < 1 || r.k > kMaxK || r.ef < 0 || r.ef > (1 << 16) || r.nprobe < 0 || r.nprobe > (1 << 20) ||
        r.rerank < -1 || r.rerank > (1 << 16) || r.ids.size() > static_cast<size_t>(kMaxK)) {
      Broken("a search request outside its bounds was accepted");
    }
    if (!Finite(r.text_query) || !Finite(r.image_query)) Broken("a non-finite query vector was accepted");
    if (r.kind != QueryKind::kImage && r.text_query.empty()) Broken("a text query without text was accepted");
    json again = RequestJson(r);
    if (!nonce.empty()) again["nonce"] = nonce;
    auto reparsed = wire::ParseBody(again.dump(), 1 << 14);
    SearchRequest back;
    std::string back_nonce;
    if (!reparsed.ok() || !wire::ParseSearchRequest(*reparsed, kMaxK, &back).ok() ||
        !wire::ParseNonce(*reparsed, &back_nonce).ok()) {
      Broken("a parsed search request does not parse again");
    }
    if (!SameRequest(r, back) || nonce != back_nonce) Broken("a search request changed through JSON");
    if (!(trust::DigestQuery(r, nonce) == trust::DigestQuery(back, back_nonce))) Broken("the query digest changed");
  }

  std::vector<Item> items;
  if (wire::ParseItems(*body, &items).ok()) {
    for (const Item& item : items) {
      if (!Finite(item.text) || !Finite(item.image)) Broken("a non-finite item vector was accepted");
    }
  }
  std::vector<uint64_t> ids;
  (void)wire::ParseIds(*body, &ids);
  std::optional<uint64_t> version;
  (void)wire::ParseWriteVersion(*body, &version);
}

void Answer(std::string_view text) {
  auto answer = keel::ParseUntrustedJson(text, keel::JsonLimits{.max_depth = 8, .max_values = 1 << 14});
  if (!answer.ok()) return;
  trust::ReplyBody body;
  std::string signature;
  if (!wire::ParseSignedReply(*answer, kMaxHits, &body, &signature).ok()) return;
  if (body.hits.size() > kMaxHits) Broken("more hits than allowed were accepted");
  if (body.replica.size() > trust::kMaxLabelBytes || body.zone.size() > trust::kMaxLabelBytes) {
    Broken("an oversized replica or zone label was accepted");
  }
  if (signature.size() != 128) Broken("a signature of the wrong length was accepted");
  for (const trust::SignedHit& h : body.hits) {
    if (!std::isfinite(h.text_distance) || !std::isfinite(h.image_distance)) Broken("a non-finite score was accepted");
  }
  // Written back without vectors (their digests are kept aside), the answer reads the same.
  json hits = json::array();
  for (const trust::SignedHit& h : body.hits) {
    hits.push_back({{"id", h.id}, {"text_distance", h.text_distance}, {"image_distance", h.image_distance}});
  }
  const json again = {{"hits", std::move(hits)}, {"trust", wire::TrustJson(body, signature)}};
  trust::ReplyBody back;
  std::string back_signature;
  if (!wire::ParseSignedReply(again, kMaxHits, &back, &back_signature).ok()) Broken("a parsed answer does not parse again");
  for (size_t i = 0; i < back.hits.size(); ++i) back.hits[i].vector_digest = body.hits[i].vector_digest;
  if (back_signature != signature || trust::CanonicalReplyBytes(back) != trust::CanonicalReplyBytes(body)) {
    Broken("a signed answer changed through JSON");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    Answer(text);
  } else {
    Body(text);
  }
  return 0;
}
