// Eviction policies for byte-bounded caches of opaque string keys (the DRAM tier's chunks).
//
// A policy only orders keys; it holds no values and never decides *when* to evict. The owner
// charges each key a byte size, and while its bytes exceed its capacity it asks Victim() for the
// next key to drop:
//
//   auto policy = MakeEvictionPolicy(EvictionKind::kS3Fifo, capacity);
//   policy->Insert(key, bytes);                       // a miss the owner just filled
//   while (policy->bytes() > capacity) {
//     std::optional<std::string> victim = policy->Victim();  // already forgotten by the policy
//     ... drop *victim from the owner's map ...
//   }
//   policy->Access(key);                              // a hit
//
// Victim() never returns the most recently inserted key while any other key is resident, so an
// owner that inserts first and then evicts down to capacity never drops what it just stored.
//
// Ops allocate only when a key becomes known (Insert; a ghost entry for S3-FIFO and ARC) and when
// Victim() hands a key out; Access and Erase do not allocate. Not thread-safe: the owner locks.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "keel/core/status.h"

namespace keel::kvstore {

enum class EvictionKind {
  kLru,     // least recently used
  kS3Fifo,  // Yang et al., SOSP'23: small FIFO + main FIFO with 2-bit frequency + ghost FIFO
  kArc,     // Megiddo & Modha, FAST'03: adaptive recency/frequency split with ghost lists
};

// "lru", "s3fifo", "arc" (case-sensitive); InvalidArgument otherwise.
Result<EvictionKind> ParseEvictionKind(std::string_view name);
std::string_view EvictionKindName(EvictionKind kind);

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string_view name() const = 0;

  // Starts tracking `key` as resident with `bytes` charged. For a key that is already resident
  // it updates the charge and counts as an access (a replacing Put). A key the policy remembers
  // as a recently evicted ghost is admitted as a re-reference (S3-FIFO, ARC).
  virtual void Insert(std::string_view key, int64_t bytes) = 0;
  // A hit on a resident key; unknown keys are ignored.
  virtual void Access(std::string_view key) = 0;
  // Forgets `key` entirely (resident or ghost): a delete or an expiry, not an eviction.
  // Unknown keys are ignored.
  virtual void Erase(std::string_view key) = 0;
  // Removes and returns the resident key to evict next; nullopt when nothing is resident.
  virtual std::optional<std::string> Victim() = 0;

  // Bytes and keys currently resident (ghosts excluded).
  virtual int64_t bytes() const = 0;
  virtual int64_t size() const = 0;
};

// `capacity_bytes` sizes the policy's internal queues (S3-FIFO's small queue, ARC's target and
// ghost lists); LRU ignores it. The owner still enforces the capacity itself.
std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionKind kind, int64_t capacity_bytes);

}  // namespace keel::kvstore
