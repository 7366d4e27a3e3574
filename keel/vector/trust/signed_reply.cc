#include "keel/vector/trust/signed_reply.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "keel/core/hash.h"

namespace keel::vector::trust {

namespace {

template <typename T>
void Put(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void PutBytes(std::string* out, std::string_view s) {
  Put<uint64_t>(out, s.size());
  out->append(s);
}
void PutFloats(std::string* out, const std::vector<float>& v) {
  Put<uint64_t>(out, v.size());
  out->append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

constexpr char kHexDigits[] = "0123456789abcdef";
std::string ToHex(const uint8_t* p, size_t n) {
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kHexDigits[p[i] >> 4];
    s[2 * i + 1] = kHexDigits[p[i] & 15];
  }
  return s;
}
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
bool FromHexInto(std::string_view hex, uint8_t* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i) {
    const int hi = HexValue(hex[2 * i]), lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  if (e == 0) return "unknown OpenSSL error";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  ERR_clear_error();
  return buf;
}

struct PkeyDeleter {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
using Pkey = std::unique_ptr<EVP_PKEY, PkeyDeleter>;
struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
using Bio = std::unique_ptr<BIO, BioDeleter>;
struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxDeleter>;

Result<std::string> ReadSmallFile(const std::string& path, size_t limit) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT) return Status::NotFound("key file " + path + " does not exist");
    return Status::IOError("cannot read key file " + path + ": " + std::strerror(errno));
  }
  std::string s(limit + 1, '\0');
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  s.resize(static_cast<size_t>(in.gcount()));
  if (s.size() > limit) return Status::InvalidArgument("key file " + path + " is larger than " + std::to_string(limit) + " bytes");
  return s;
}

constexpr size_t kMaxPemBytes = 16 << 10;

Result<Pkey> PublicFromPem(std::string_view pem, const std::string& what) {
  if (pem.size() > kMaxPemBytes) return Status::InvalidArgument(what + " is too large for a public key");
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Pkey key(PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr));
  if (!key) return Status::InvalidArgument(what + " is not a PEM public key: " + OpenSslError());
  if (EVP_PKEY_get_id(key.get()) != EVP_PKEY_ED25519) return Status::InvalidArgument(what + " is not an Ed25519 key");
  return key;
}

Status WriteNewFile(const std::string& path, std::string_view data, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    if (errno == EEXIST) return Status::InvalidArgument(path + " already exists (refusing to overwrite a key)");
    return Status::IOError("cannot create " + path + ": " + std::strerror(errno));
  }
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(path.c_str());
      return Status::IOError("cannot write " + path + ": " + std::strerror(e));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) return Status::IOError("cannot write " + path + ": " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace

std::string QueryDigest::Hex() const { return ToHex(bytes.data(), bytes.size()); }

Result<QueryDigest> QueryDigest::FromHex(std::string_view hex) {
  QueryDigest d;
  if (!FromHexInto(hex, d.bytes.data(), d.bytes.size())) {
    return Status::InvalidArgument("query digest must be 64 hex digits");
  }
  return d;
}

QueryDigest DigestQuery(const SearchRequest& r, std::string_view nonce) {
  std::string buf = "keel-query-v1";
  buf.push_back('\0');
  Put<uint8_t>(&buf, static_cast<uint8_t>(r.kind));
  Put<int32_t>(&buf, r.k);
  Put<int32_t>(&buf, r.ef);
  Put<int32_t>(&buf, r.nprobe);
  PutFloats(&buf, r.text_query);
  PutFloats(&buf, r.image_query);
  Put<uint64_t>(&buf, r.ids.size());
  for (uint64_t id : r.ids) Put<uint64_t>(&buf, id);
  Put<uint64_t>(&buf, r.filter.size());
  for (const auto& [k, v] : r.filter) {
    PutBytes(&buf, k);
    PutBytes(&buf, v);
  }
  Put<uint8_t>(&buf, r.include_vectors ? 1 : 0);
  PutBytes(&buf, nonce);
  // Appended only when asked, so the digest of a request without it is what it always was.
  if (r.rerank >= 0) {
    buf += "rerank";
    Put<int32_t>(&buf, r.rerank);
  }
  QueryDigest d;
  unsigned int len = 0;
  if (EVP_Digest(buf.data(), buf.size(), d.bytes.data(), &len, EVP_sha256(), nullptr) != 1 || len != 32) std::abort();
  return d;
}

std::string NewNonce() {
  uint8_t raw[16];
  if (RAND_bytes(raw, sizeof raw) != 1) std::abort();  // no entropy: nothing safe to do
  return ToHex(raw, sizeof raw);
}

uint64_t VectorDigest(std::span<const float> text, std::span<const float> image) {
  if (text.empty() && image.empty()) return 0;
  std::string buf(reinterpret_cast<const char*>(text.data()), text.size_bytes());
  buf.append(reinterpret_cast<const char*>(image.data()), image.size_bytes());
  return Xxh3_64(buf.data(), buf.size());
}

SignedHit ToSignedHit(const SearchHit& hit) {
  return SignedHit{hit.id, hit.text_distance, hit.image_distance, VectorDigest(hit.text, hit.image)};
}

std::string CanonicalReplyBytes(const ReplyBody& body) {
  std::string buf = "keel-trust-reply-v1";
  buf.push_back('\0');
  buf.reserve(buf.size() + 128 + body.replica.size() + body.zone.size() + body.hits.size() * 24);
  Put<uint32_t>(&buf, body.shard);
  PutBytes(&buf, body.replica);
  PutBytes(&buf, body.zone);
  Put<uint64_t>(&buf, body.index_version);
  buf.append(reinterpret_cast<const char*>(body.query.bytes.data()), body.query.bytes.size());
  Put<uint64_t>(&buf, body.hits.size());
  for (const SignedHit& h : body.hits) {
    Put<uint64_t>(&buf, h.id);
    Put<float>(&buf, h.text_distance);
    Put<float>(&buf, h.image_distance);
    Put<uint64_t>(&buf, h.vector_digest);
  }
  return buf;
}

// ---- SigningKey ----------------------------------------------------------------------------------

struct SigningKey::Impl {
  Pkey key;
};

SigningKey::SigningKey(SigningKey&&) noexcept = default;
SigningKey& SigningKey::operator=(SigningKey&&) noexcept = default;
SigningKey::~SigningKey() = default;

Result<SigningKey> SigningKey::Generate() {
  Pkey key(EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519"));
  if (!key) return Status::Internal("Ed25519 key generation failed: " + OpenSslError());
  SigningKey k;
  k.impl_ = std::make_unique<Impl>();
  k.impl_->key = std::move(key);
  return k;
}

Result<SigningKey> SigningKey::Load(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound("signing key " + path + " does not exist");
    return Status::IOError("cannot stat signing key " + path + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 077) != 0) {
    return Status::InvalidArgument("signing key " + path + " is readable by group or others (chmod 600 it)");
  }
  KEEL_ASSIGN_OR_RETURN(std::string pem, ReadSmallFile(path, kMaxPemBytes));
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Pkey key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  OPENSSL_cleanse(pem.data(), pem.size());
  if (!key) return Status::InvalidArgument("signing key " + path + " is not a PEM private key: " + OpenSslError());
  if (EVP_PKEY_get_id(key.get()) != EVP_PKEY_ED25519) {
    return Status::InvalidArgument("signing key " + path + " is not an Ed25519 key");
  }
  SigningKey k;
  k.impl_ = std::make_unique<Impl>();
  k.impl_->key = std::move(key);
  return k;
}

Status SigningKey::Save(const std::string& private_path, const std::string& public_path) const {
  Bio bio(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_PrivateKey(bio.get(), impl_->key.get(), nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return Status::Internal("cannot encode the private key: " + OpenSslError());
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  KEEL_RETURN_IF_ERROR(WriteNewFile(private_path, std::string_view(data, static_cast<size_t>(n)), 0600));
  OPENSSL_cleanse(data, static_cast<size_t>(n));
  if (Status s = WriteNewFile(public_path, PublicKeyPem(), 0644); !s.ok()) {
    ::unlink(private_path.c_str());
    return s;
  }
  return Status::Ok();
}

std::string SigningKey::SignHex(std::string_view message) const {
  MdCtx ctx(EVP_MD_CTX_new());
  uint8_t sig[64];
  size_t len = sizeof sig;
  if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, nullptr, nullptr, impl_->key.get()) != 1 ||
      EVP_DigestSign(ctx.get(), sig, &len, reinterpret_cast<const uint8_t*>(message.data()), message.size()) != 1 ||
      len != sizeof sig) {
    std::abort();  // a loaded Ed25519 key always signs
  }
  return ToHex(sig, len);
}

std::string SigningKey::PublicKeyPem() const {
  Bio bio(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_PUBKEY(bio.get(), impl_->key.get()) != 1) std::abort();
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

std::string SignReply(const SigningKey& key, const ReplyBody& body) { return key.SignHex(CanonicalReplyBytes(body)); }

// ---- TrustStore ----------------------------------------------------------------------------------

std::string_view ReplyFaultName(ReplyFault fault) {
  switch (fault) {
    case ReplyFault::kNone: return "valid";
    case ReplyFault::kUnsigned: return "unsigned";
    case ReplyFault::kUnknownReplica: return "unknown_replica";
    case ReplyFault::kBadSignature: return "bad_signature";
    case ReplyFault::kReplay: return "replay";
    case ReplyFault::kWrongShard: return "wrong_shard";
    case ReplyFault::kStale: return "stale";
    case ReplyFault::kMalformed: return "malformed";
    case ReplyFault::kUnreachable: return "unreachable";
  }
  return "unknown";
}

struct TrustStore::Impl {
  struct Entry {
    uint32_t shard;
    std::string zone;
    Pkey key;
  };
  std::unordered_map<std::string, Entry> replicas;
};

TrustStore::TrustStore() : impl_(std::make_unique<Impl>()) {}
TrustStore::~TrustStore() = default;
TrustStore::TrustStore(TrustStore&&) noexcept = default;
TrustStore& TrustStore::operator=(TrustStore&&) noexcept = default;

Status TrustStore::AddFile(const std::string& replica, uint32_t shard, const std::string& zone, const std::string& pem_path) {
  KEEL_ASSIGN_OR_RETURN(std::string pem, ReadSmallFile(pem_path, kMaxPemBytes));
  if (Status s = AddPem(replica, shard, zone, pem); !s.ok()) {
    return Status(s.code(), "public key of replica " + replica + " (" + pem_path + "): " + s.message());
  }
  return Status::Ok();
}

Status TrustStore::AddPem(const std::string& replica, uint32_t shard, const std::string& zone, std::string_view pem) {
  if (replica.empty() || replica.size() > kMaxLabelBytes) return Status::InvalidArgument("replica id must be 1.." + std::to_string(kMaxLabelBytes) + " bytes");
  if (zone.size() > kMaxLabelBytes) return Status::InvalidArgument("zone label of " + replica + " is longer than " + std::to_string(kMaxLabelBytes) + " bytes");
  if (impl_->replicas.count(replica) != 0) return Status::InvalidArgument("replica id " + replica + " appears twice");
  KEEL_ASSIGN_OR_RETURN(Pkey key, PublicFromPem(pem, "public key of " + replica));
  // Replicas sharing a key cannot be told apart: one holder of it could sign for all of them
  // and make up a quorum alone.
  for (const auto& [other, entry] : impl_->replicas) {
    if (EVP_PKEY_eq(entry.key.get(), key.get()) == 1) {
      return Status::InvalidArgument("replica " + replica + " has the same public key as replica " + other +
                                     ": every replica needs its own key pair");
    }
  }
  impl_->replicas.emplace(replica, Impl::Entry{shard, zone, std::move(key)});
  return Status::Ok();
}

ReplyFault TrustStore::Verify(const ReplyBody& body, std::string_view signature_hex, uint32_t expected_shard,
                              const QueryDigest& expected) const {
  auto it = impl_->replicas.find(body.replica);
  if (it == impl_->replicas.end() || it->second.shard != expected_shard) return ReplyFault::kUnknownReplica;
  if (body.shard != expected_shard) return ReplyFault::kWrongShard;
  if (body.zone != it->second.zone) return ReplyFault::kUnknownReplica;
  uint8_t sig[64];
  if (!FromHexInto(signature_hex, sig, sizeof sig)) return ReplyFault::kBadSignature;
  const std::string msg = CanonicalReplyBytes(body);
  MdCtx ctx(EVP_MD_CTX_new());
  if (!ctx || EVP_DigestVerifyInit(ctx.get(), nullptr, nullptr, nullptr, it->second.key.get()) != 1) {
    ERR_clear_error();
    return ReplyFault::kBadSignature;
  }
  const int ok = EVP_DigestVerify(ctx.get(), sig, sizeof sig, reinterpret_cast<const uint8_t*>(msg.data()), msg.size());
  if (ok != 1) {
    ERR_clear_error();
    return ReplyFault::kBadSignature;
  }
  // Checked after the signature so a replayed reply is told apart from a forged one.
  if (!(body.query == expected)) return ReplyFault::kReplay;
  return ReplyFault::kNone;
}

size_t TrustStore::size() const { return impl_->replicas.size(); }

}  // namespace keel::vector::trust
