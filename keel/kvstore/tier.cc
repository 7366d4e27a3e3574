#include "keel/kvstore/tier.h"

#include "keel/core/hash.h"

#include <chrono>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace keel::kvstore {

namespace {

constexpr size_t kPooledMinBytes = 16 << 10;
constexpr size_t kPoolMaxBytes = 32 << 20;

struct BufferPool {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<uint8_t*>> free;  // by exact size
  size_t bytes = 0;
};

BufferPool& Pool() {
  static BufferPool* pool = new BufferPool;  // never destroyed: blobs may outlive static destruction
  return *pool;
}

}  // namespace

Blob::Blob(size_t size) : data_(nullptr, ReturnBuffer{size == 0 ? 1 : size}), size_(size) {
  const size_t n = data_.get_deleter().size;
  if (n >= kPooledMinBytes) {
    BufferPool& pool = Pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    auto it = pool.free.find(n);
    if (it != pool.free.end() && !it->second.empty()) {
      data_.reset(it->second.back());
      it->second.pop_back();
      pool.bytes -= n;
      return;
    }
  }
  data_.reset(new uint8_t[n]);
}

void Blob::ReturnBuffer::operator()(uint8_t* p) const {
  if (p == nullptr) return;
  if (size >= kPooledMinBytes) {
    BufferPool& pool = Pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pool.bytes + size <= kPoolMaxBytes) {
      try {
        pool.free[size].push_back(p);
        pool.bytes += size;
        return;
      } catch (...) {  // no memory for the list: free the buffer instead
      }
    }
  }
  delete[] p;
}

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
