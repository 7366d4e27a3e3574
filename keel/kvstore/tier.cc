#include "keel/kvstore/tier.h"

#include "keel/core/hash.h"

#include <chrono>
#include <cstring>

namespace keel::kvstore {

std::shared_ptr<Blob> Blob::Copy(const void* data, size_t size) {
  std::shared_ptr<Blob> b = Allocate(size);
  if (size > 0) std::memcpy(b->data(), data, size);
  return b;
}

uint64_t Blob::checksum() const {
  if (has_checksum_.load(std::memory_order_acquire)) return checksum_.load(std::memory_order_relaxed);
  const uint64_t c = Xxh3_64(data(), size());  // racing threads compute the same value
  set_checksum(c);
  return c;
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Status ValidateKey(std::string_view key) {
  if (key.empty()) return Status::InvalidArgument("kvstore: empty key");
  if (key.size() > kMaxKeyBytes) {
    return Status::InvalidArgument("kvstore: key of " + std::to_string(key.size()) + " bytes exceeds the limit of " +
                                   std::to_string(kMaxKeyBytes));
  }
  return Status::Ok();
}

std::vector<Result<Entry>> Tier::GetMany(const std::vector<std::string_view>& keys) {
  std::vector<Result<Entry>> out;
  out.reserve(keys.size());
  for (std::string_view k : keys) out.push_back(Get(k));
  return out;
}

std::vector<Result<bool>> Tier::ContainsMany(const std::vector<std::string_view>& keys) {
  std::vector<Result<bool>> out;
  out.reserve(keys.size());
  for (std::string_view k : keys) out.push_back(Contains(k));
  return out;
}

}  // namespace keel::kvstore
