// Deterministic hashing (XXH3). No per-process seeds: the same bytes give the same hash in every
// process and on every machine, which cross-instance cache keys depend on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace keel {

struct Hash128 {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const Hash128&) const = default;
  std::string hex() const;  // 32 lowercase hex digits, hi then lo
};

uint64_t Xxh3_64(const void* data, size_t len);
Hash128 Xxh3_128(const void* data, size_t len);
inline Hash128 Xxh3_128(std::string_view s) { return Xxh3_128(s.data(), s.size()); }

// Streaming XXH3-128 for data that arrives in pieces (file checksums, chunk keys).
class Hasher128 {
 public:
  Hasher128();
  ~Hasher128();
  Hasher128(const Hasher128&) = delete;
  Hasher128& operator=(const Hasher128&) = delete;
  void update(const void* data, size_t len);
  void update(std::string_view s) { update(s.data(), s.size()); }
  template <typename T>
  void update_pod(const T& v) { update(&v, sizeof(T)); }
  Hash128 digest() const;

 private:
  void* state_;
};

// Streaming XXH3-64 (frame and record checksums over several pieces).
class Hasher64 {
 public:
  Hasher64();
  ~Hasher64();
  Hasher64(const Hasher64&) = delete;
  Hasher64& operator=(const Hasher64&) = delete;
  void update(const void* data, size_t len);
  void update(std::string_view s) { update(s.data(), s.size()); }
  uint64_t digest() const;

 private:
  void* state_;
};

struct Hash128Hasher {
  size_t operator()(const Hash128& h) const { return static_cast<size_t>(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ULL)); }
};

}  // namespace keel
