// keel::vector::wire — the vector shard's JSON wire format, in one place so that a replica
// (`keel vector`) and the router in front of it (`keel vector-router`) read a client's body the
// same way: the same SearchRequest, hence the same DigestQuery on both sides of a signed reply.
//
// Every parser takes untrusted input and answers InvalidArgument naming the field and what is
// wrong; none throws. Stateless and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/core/status.h"
#include "keel/vector/shard.h"
#include "keel/vector/trust/signed_reply.h"

namespace keel::vector::wire {

// A request body: a JSON object nested at most 8 deep (nothing in the API nests deeper than 4)
// holding at most `max_values` values (keel/core/json_reader.h), checked before parsing.
Result<nlohmann::json> ParseBody(std::string_view body, size_t max_values);

// A query kind by name: "text" | "multimodal" | "image".
Result<QueryKind> ParseQueryKind(std::string_view name);

// /v1/search: kind, text, image, ids (at most max_k), k in [1, max_k], ef in [0, 2^16],
// nprobe in [0, 2^20], rerank in [-1, 2^16] (the shard bounds it further), filter,
// include_vectors. Numbers must be finite as float32. Text and
// multimodal queries need "text". Dimensions are checked by the shard, not here.
Status ParseSearchRequest(const nlohmann::json& body, int max_k, SearchRequest* out);
// The optional "nonce" of /v1/search: a string of 1..trust::kMaxNonceBytes printable ASCII
// characters (0x20..0x7e). "" when absent or null.
Status ParseNonce(const nlohmann::json& body, std::string* nonce);

// /v1/upsert's "items" (required array) and /v1/delete's "ids" (required array of unsigned
// integers).
Status ParseItems(const nlohmann::json& body, std::vector<Item>* out);
Status ParseIds(const nlohmann::json& body, std::vector<uint64_t>* out);
// The optional "version" of /v1/upsert and /v1/delete: an unsigned integer; nullopt when absent.
Status ParseWriteVersion(const nlohmann::json& body, std::optional<uint64_t>* out);

// One item object ({"id","text","image","attributes"}); `i` names it in messages (items[i]).
Status ParseItem(const nlohmann::json& j, size_t i, Item* item);
// An array of numbers, each finite as float32; `field` names it in messages.
Status GetFloats(const nlohmann::json& j, const std::string& field, std::vector<float>* out);
// An unsigned integer; `field` names it in messages.
Status GetId(const nlohmann::json& j, const std::string& field, uint64_t* out);

// A search answer's "hits" entry as a replica writes it: "id", "text_distance" (not for image
// lookups), "image_distance" (when the query had an image vector), "text"/"image" when non-empty.
nlohmann::json HitJson(const SearchHit& hit, const SearchRequest& request);

// The "trust" object of a signed search answer (keel/vector/trust/signed_reply.h):
// {"shard","replica","zone","index_version","query_digest","signature"}.
nlohmann::json TrustJson(const trust::ReplyBody& body, std::string_view signature_hex);
// Reads a replica's search answer back into a ReplyBody (hits from "hits", identity from
// "trust") and the signature. InvalidArgument when the answer has no "trust" object, a field has
// the wrong type, a digest or signature is not hex of the right length, a score is not a finite
// float32, or there are more than `max_hits` hits. A hit's vector_digest is recomputed from its
// "text"/"image" vectors (0 without them), as the replica computed it before signing.
Status ParseSignedReply(const nlohmann::json& answer, size_t max_hits, trust::ReplyBody* body, std::string* signature_hex);

}  // namespace keel::vector::wire
