// Cache-line aligned storage for hot buffers: 32-byte AVX loads from 64-byte aligned rows never
// straddle two cache lines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace keel {

// x rounded up to a multiple of `align`, a power of two.
constexpr uint64_t RoundUp(uint64_t x, uint64_t align) { return (x + align - 1) & ~(align - 1); }

template <typename T, size_t Align = 64>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U, Align>&) {}  // NOLINT
  template <typename U>
  struct rebind {
    using other = AlignedAllocator<U, Align>;
  };
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(Align))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(Align)); }
  bool operator==(const AlignedAllocator&) const { return true; }
  bool operator!=(const AlignedAllocator&) const { return false; }
};

using AlignedFloats = std::vector<float, AlignedAllocator<float>>;

}  // namespace keel
