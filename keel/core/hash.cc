#include "keel/core/hash.h"

#include <xxhash.h>

#include <cstdio>

namespace keel {

std::string Hash128::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

uint64_t Xxh3_64(const void* data, size_t len) { return XXH3_64bits(data, len); }

Hash128 Xxh3_128(const void* data, size_t len) {
  XXH128_hash_t h = XXH3_128bits(data, len);
  return {h.low64, h.high64};
}

Hasher128::Hasher128() : state_(XXH3_createState()) { XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_)); }
Hasher128::~Hasher128() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Hasher128::update(const void* data, size_t len) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), data, len);
}
Hash128 Hasher128::digest() const {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return {h.low64, h.high64};
}

Hasher64::Hasher64() : state_(XXH3_createState()) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
Hasher64::~Hasher64() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Hasher64::update(const void* data, size_t len) { XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, len); }
uint64_t Hasher64::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

}  // namespace keel
