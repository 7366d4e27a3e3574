// Software prefetch that the compiler cannot drop.
//
// GCC (12) treats __builtin_prefetch / _mm_prefetch as free of side effects: a small function
// that only computes addresses and prefetches is found "pure", and since it returns nothing its
// calls are deleted as dead code — silently, at -O2. Keel's attention readers prefetch through
// such helpers, and for several sessions none of their prefetches reached the binary. An
// `asm volatile` prefetch is never removed.
#pragma once

namespace keel {

// Towards L2 (and the levels below it): for data needed a few thousand cycles from now.
inline void PrefetchL2(const void* p) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

// Towards L1: for data needed within a few hundred cycles.
inline void PrefetchL1(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}

}  // namespace keel
