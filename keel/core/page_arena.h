// Anonymous memory for large, long-lived buffers (the KV cache's per-layer arenas): 2 MiB
// aligned and advised for transparent huge pages, so attention walking a sequence's blocks does
// not take a TLB miss on every 4 KiB page (blocks are tens of KiB; a long context spans
// thousands of pages). Pages are only touched when written, as with new[] of a large array.
// Where THP is off ("never") the advice is ignored and the arena works as plain memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "keel/core/status.h"

namespace keel {

class PageArena {
 public:
  // ResourceExhausted naming the size when the mapping fails.
  static Result<PageArena> Map(size_t bytes);

  PageArena() = default;
  PageArena(PageArena&& o) noexcept { *this = static_cast<PageArena&&>(o); }
  PageArena& operator=(PageArena&& o) noexcept;
  PageArena(const PageArena&) = delete;
  PageArena& operator=(const PageArena&) = delete;
  ~PageArena();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* map_ = nullptr;  // the whole mapping (data_ is its first 2 MiB boundary)
  size_t map_bytes_ = 0;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace keel
