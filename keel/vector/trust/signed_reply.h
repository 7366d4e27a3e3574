// keel::vector::trust — signed replica replies. A replica signs what it answered (its shard id,
// replica id, failure domain, index version, the digest of the query it answered and its ranked
// hits) with Ed25519; the router holds the replicas' public keys in a TrustStore and discards any
// reply that is unsigned, badly signed, for another query (replayed: the digest covers a
// per-request nonce) or for another shard.
//
// Wire form (JSON, in a replica's /v1/search answer, beside its usual "hits"):
//   "trust": {"shard":0, "replica":"s0-a", "zone":"a", "index_version":12,
//             "query_digest":"<64 hex>", "signature":"<128 hex>"}
// The signature covers CanonicalReplyBytes(): a domain tag, the fields above and every hit as
// (id, text_distance, image_distance, vector_digest) in rank order, little-endian, so the JSON's
// spelling (key order, number format) never matters: floats survive JSON exactly (float -> double
// -> shortest round-trip text -> double -> float).
//
// Keys: PEM files (PKCS#8 private, SubjectPublicKeyInfo public) written by `keel vector keygen`;
// the private file is created 0600 and never logged.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/shard.h"

namespace keel::vector::trust {

// Which shard owns an item: id modulo the shard count (ids are spread by the writer; SIFT ids are
// dense). The router routes writes by it and rejects replies holding ids of other shards.
inline uint32_t ShardOf(uint64_t id, uint32_t shards) { return static_cast<uint32_t>(id % shards); }

struct QueryDigest {
  std::array<uint8_t, 32> bytes{};
  std::string Hex() const;
  static Result<QueryDigest> FromHex(std::string_view hex);  // InvalidArgument unless 64 hex digits
  bool operator==(const QueryDigest&) const = default;
};

// SHA-256 over a canonical encoding of everything that decides a search's answer (kind, k, ef,
// nprobe, rerank when not -1, the vectors' float bits, ids, filter, include_vectors) and the
// requester's nonce. Two
// requests that parse to the same SearchRequest have the same digest whatever their JSON spelling.
QueryDigest DigestQuery(const SearchRequest& request, std::string_view nonce);

// Limits a router enforces on a nonce it receives from a client, and that a replica enforces.
inline constexpr size_t kMaxNonceBytes = 64;
// A fresh random nonce (32 hex digits from the OS CSPRNG).
std::string NewNonce();

struct SignedHit {
  uint64_t id = 0;
  float text_distance = 0;
  float image_distance = 0;
  uint64_t vector_digest = 0;  // XXH3-64 of the hit's text floats then image floats; 0 without vectors
  bool operator==(const SignedHit&) const = default;
};
// XXH3-64 over the text floats' bytes followed by the image floats' bytes (0 when both are empty).
uint64_t VectorDigest(std::span<const float> text, std::span<const float> image);
SignedHit ToSignedHit(const SearchHit& hit);

struct ReplyBody {
  uint32_t shard = 0;
  std::string replica;  // at most 128 bytes
  std::string zone;     // failure domain label, at most 128 bytes
  uint64_t index_version = 0;
  QueryDigest query;
  std::vector<SignedHit> hits;
};

inline constexpr size_t kMaxLabelBytes = 128;
std::string CanonicalReplyBytes(const ReplyBody& body);

// An Ed25519 private key.
class SigningKey {
 public:
  static Result<SigningKey> Generate();
  // Reads a PEM private key. NotFound / IOError naming the file; InvalidArgument when it is not an
  // Ed25519 key; refuses (InvalidArgument) a file readable by group or others.
  static Result<SigningKey> Load(const std::string& path);
  // Writes `private_path` (created 0600, refused if it exists) and `public_path` (0644).
  Status Save(const std::string& private_path, const std::string& public_path) const;
  // 64-byte signature as 128 lowercase hex digits.
  std::string SignHex(std::string_view message) const;
  std::string PublicKeyPem() const;

  SigningKey(SigningKey&&) noexcept;
  SigningKey& operator=(SigningKey&&) noexcept;
  ~SigningKey();

 private:
  SigningKey() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Signs `body` and returns the "trust" JSON object's fields as (signature hex); convenience for
// replicas: CanonicalReplyBytes + SignHex.
std::string SignReply(const SigningKey& key, const ReplyBody& body);

// Why a reply was discarded (label values of keel_trust_replies_total{outcome=...}).
enum class ReplyFault {
  kNone = 0,
  kUnsigned,       // no "trust" object, or no signature
  kUnknownReplica, // replica id not in the trust store, or not a replica of the shard asked
  kBadSignature,   // signature does not verify under that replica's key
  kReplay,         // signed for another query (digest mismatch)
  kWrongShard,     // signed for another shard, or holds ids another shard owns
  kStale,          // index version older than the router's committed version
  kMalformed,      // not JSON, wrong types, NaN/inf scores, duplicate ids, unsorted, too many hits
  kUnreachable,    // connect/read failure, HTTP error, deadline
};
std::string_view ReplyFaultName(ReplyFault fault);

// The router's trust store: replica id -> (shard, zone, public key).
class TrustStore {
 public:
  TrustStore();
  ~TrustStore();
  TrustStore(TrustStore&&) noexcept;
  TrustStore& operator=(TrustStore&&) noexcept;
  // Reads a PEM public key file. InvalidArgument when the replica id is already present, the file
  // is not an Ed25519 public key; NotFound / IOError for the file.
  Status AddFile(const std::string& replica, uint32_t shard, const std::string& zone, const std::string& pem_path);
  Status AddPem(const std::string& replica, uint32_t shard, const std::string& zone, std::string_view pem);
  // Checks, in order: the replica is known and belongs to `expected_shard` (kUnknownReplica), the
  // body's shard is `expected_shard` (kWrongShard), its zone is the one registered
  // (kUnknownReplica), the signature verifies (kBadSignature), the query digest is `expected`
  // (kReplay). kNone when the reply is authentic.
  ReplyFault Verify(const ReplyBody& body, std::string_view signature_hex, uint32_t expected_shard,
                    const QueryDigest& expected) const;
  size_t size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::vector::trust
