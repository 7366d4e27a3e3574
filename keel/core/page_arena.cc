#include "keel/core/page_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace keel {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}

Result<PageArena> PageArena::Map(size_t bytes) {
  PageArena a;
  if (bytes == 0) return a;
  // Over-map by one huge page so the usable range can start on a 2 MiB boundary.
  const size_t map_bytes = bytes + kHugePage;
  void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return Status::ResourceExhausted("cannot map " + std::to_string(bytes) + " bytes: " + std::strerror(errno));
  }
  a.map_ = p;
  a.map_bytes_ = map_bytes;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  a.data_ = reinterpret_cast<uint8_t*>(start);
  a.size_ = bytes;
  madvise(a.data_, bytes, MADV_HUGEPAGE);  // advice only: failure (THP off) is not an error
  return a;
}

PageArena& PageArena::operator=(PageArena&& o) noexcept {
  if (this != &o) {
    if (map_ != nullptr) munmap(map_, map_bytes_);
    map_ = o.map_;
    map_bytes_ = o.map_bytes_;
    data_ = o.data_;
    size_ = o.size_;
    o.map_ = nullptr;
    o.map_bytes_ = 0;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

PageArena::~PageArena() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

}  // namespace keel
