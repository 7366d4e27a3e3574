// RangeAllocator: hands out byte ranges of one fixed-size region (offsets, not pointers), best
// fit, with neighbouring free ranges merged on release. The KV cache uses it to place blocks of
// different sizes (a block being filled takes its worst-case size; a full, compressed block is
// moved to a range of its actual size) in one budget.
//
// Sizes are rounded up to `alignment` (a power of two); every offset is a multiple of it.
// O(log n) per call in the number of free ranges. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "keel/core/aligned.h"

namespace keel {

class RangeAllocator {
 public:
  RangeAllocator(uint64_t size, uint64_t alignment);

  // Offset of a free range of at least `bytes` (rounded up), or nullopt when no free range is
  // that large (free_bytes() may still exceed it: fragmentation). kBestFit: the smallest free
  // range that fits, lowest offset among equals. kLowest / kHighest: the lowest (highest) free
  // range that fits, carved from its low (high) end: keeping long-lived ranges low and
  // short-lived ones high keeps their holes apart, so freed short-lived ranges merge back into
  // large ones (best fit would put long-lived ranges into short-lived ones' holes, leaving
  // slivers). O(free ranges) for those two.
  enum class End { kBestFit, kLowest, kHighest };
  std::optional<uint64_t> Allocate(uint64_t bytes, End end = End::kBestFit);
  // Returns a range from Allocate(offset, same bytes).
  void Free(uint64_t offset, uint64_t bytes);

  uint64_t size() const { return size_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }
  uint64_t RoundUp(uint64_t bytes) const { return keel::RoundUp(bytes, align_); }

 private:
  void Insert(uint64_t offset, uint64_t bytes);
  void Erase(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t size_;
  uint64_t align_;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;            // free ranges: offset -> bytes
  std::set<std::pair<uint64_t, uint64_t>> by_size_;   // (bytes, offset)
};

}  // namespace keel
