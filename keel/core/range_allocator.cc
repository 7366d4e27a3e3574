#include "keel/core/range_allocator.h"

#include <cassert>

namespace keel {

RangeAllocator::RangeAllocator(uint64_t size, uint64_t alignment) : size_(size & ~(alignment - 1)), align_(alignment) {
  assert(alignment > 0 && (alignment & (alignment - 1)) == 0);
  if (size_ > 0) Insert(0, size_);
}

void RangeAllocator::Insert(uint64_t offset, uint64_t bytes) {
  by_offset_.emplace(offset, bytes);
  by_size_.emplace(bytes, offset);
  free_bytes_ += bytes;
}

void RangeAllocator::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t bytes, End end) {
  bytes = RoundUp(bytes == 0 ? 1 : bytes);
  if (end == End::kHighest) {
    for (auto it = by_offset_.rbegin(); it != by_offset_.rend(); ++it) {
      if (it->second < bytes) continue;
      const uint64_t offset = it->first, have = it->second;
      Erase(std::prev(it.base()));
      if (have > bytes) Insert(offset, have - bytes);
      return offset + have - bytes;
    }
    return std::nullopt;
  }
  if (end == End::kLowest) {
    for (auto it = by_offset_.begin(); it != by_offset_.end(); ++it) {
      if (it->second < bytes) continue;
      const uint64_t offset = it->first, have = it->second;
      Erase(it);
      if (have > bytes) Insert(offset + bytes, have - bytes);
      return offset;
    }
    return std::nullopt;
  }
  auto fit = by_size_.lower_bound({bytes, 0});
  if (fit == by_size_.end()) return std::nullopt;
  const uint64_t offset = fit->second, have = fit->first;
  Erase(by_offset_.find(offset));
  if (have > bytes) Insert(offset + bytes, have - bytes);
  return offset;
}

void RangeAllocator::Free(uint64_t offset, uint64_t bytes) {
  bytes = RoundUp(bytes == 0 ? 1 : bytes);
  auto next = by_offset_.lower_bound(offset);
  assert(next == by_offset_.end() || next->first >= offset + bytes);  // not already free
  if (next != by_offset_.end() && next->first == offset + bytes) {
    bytes += next->second;
    Erase(next);
  }
  auto after = by_offset_.lower_bound(offset);
  if (after != by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      bytes += prev->second;
      Erase(prev);
    }
  }
  Insert(offset, bytes);
}

}  // namespace keel
