#include "keel/kvstore/dram_tier.h"

#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "keel/core/hash.h"

namespace keel::kvstore {

namespace {

struct KeyHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return static_cast<size_t>(Xxh3_64(s.data(), s.size())); }
};

int64_t ChargedBytes(std::string_view key, const Entry& entry) {
  return static_cast<int64_t>(key.size() + entry.value->size()) + kEntryOverheadBytes;
}

}  // namespace

struct DramTier::State {
  State(DramOptions o, EvictCallback cb)
      : options(o), on_evict(std::move(cb)), policy(MakeEvictionPolicy(o.eviction, o.capacity_bytes)) {}

  // Removes `it` from the map and the policy; returns the entry so the caller can drop (free)
  // its value after unlocking.
  Entry RemoveLocked(std::unordered_map<std::string, Entry, KeyHash, std::equal_to<>>::iterator it) {
    policy->Erase(it->first);
    bytes -= ChargedBytes(it->first, it->second);
    Entry e = std::move(it->second);
    entries.erase(it);
    return e;
  }

  const DramOptions options;
  const EvictCallback on_evict;

  mutable std::mutex mu;
  std::unordered_map<std::string, Entry, KeyHash, std::equal_to<>> entries;  // guarded by mu
  std::unique_ptr<EvictionPolicy> policy;                                     // guarded by mu
  int64_t bytes = 0;
  int64_t hits = 0, misses = 0, puts = 0, evictions = 0, expirations = 0, stale_puts = 0;
};

DramTier::DramTier(DramOptions options, EvictCallback on_evict)
    : state_(std::make_unique<State>(options, std::move(on_evict))) {}

DramTier::~DramTier() = default;

Status DramTier::Put(std::string_view key, const Entry& entry) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  if (!entry.value) return Status::InvalidArgument("kvstore: dram put of a null value");
  State& s = *state_;
  const int64_t charged = ChargedBytes(key, entry);
  if (charged > s.options.capacity_bytes) {
    return Status::ResourceExhausted("kvstore: dram entry of " + std::to_string(charged) +
                                     " bytes (value + key + entry overhead) exceeds the tier capacity of " +
                                     std::to_string(s.options.capacity_bytes));
  }
  const int64_t now = NowUnixMs();

  // Victims (and a replaced value) leave the lock with us: the callback runs unlocked, and the
  // last reference to a large value is dropped unlocked too.
  std::vector<std::pair<std::string, Entry>> evicted;
  std::vector<Entry> dropped;
  Entry replaced;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.entries.find(key);
    if (it != s.entries.end() && it->second.seq > entry.seq) {
      ++s.stale_puts;  // a newer write already holds the key (tier.h: ordering)
      return Status::Ok();
    }
    ++s.puts;
    if (Expired(entry, now)) {
      if (it != s.entries.end()) replaced = s.RemoveLocked(it);
      return Status::Ok();
    }
    if (it != s.entries.end()) {
      s.bytes -= ChargedBytes(key, it->second);
      replaced = std::exchange(it->second, entry);
    } else {
      s.entries.emplace(std::string(key), entry);
    }
    s.bytes += charged;
    s.policy->Insert(key, charged);

    while (s.bytes > s.options.capacity_bytes) {
      std::optional<std::string> victim = s.policy->Victim();
      if (!victim) break;  // unreachable while policy and map agree
      auto vit = s.entries.find(*victim);
      if (vit == s.entries.end()) continue;
      s.bytes -= ChargedBytes(vit->first, vit->second);
      Entry e = std::move(vit->second);
      s.entries.erase(vit);
      if (Expired(e, now)) {
        ++s.expirations;
        dropped.push_back(std::move(e));
      } else if (s.on_evict) {
        ++s.evictions;
        evicted.emplace_back(std::move(*victim), std::move(e));
      } else {
        ++s.evictions;
        dropped.push_back(std::move(e));
      }
    }
    if (s.options.evict_callback_under_lock) {
      for (auto& [k, e] : evicted) s.on_evict(std::move(k), std::move(e));
      evicted.clear();
    }
  }
  for (auto& [k, e] : evicted) s.on_evict(std::move(k), std::move(e));
  return Status::Ok();
}

Result<Entry> DramTier::Get(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  State& s = *state_;
  Entry expired;
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.entries.find(key);
  if (it != s.entries.end() && Expired(it->second, NowUnixMs())) {
    expired = s.RemoveLocked(it);
    ++s.expirations;
    it = s.entries.end();
  }
  if (it == s.entries.end()) {
    ++s.misses;
    return Status::NotFound("kvstore: key not in dram");
  }
  ++s.hits;
  s.policy->Access(key);
  return it->second;
}

Result<bool> DramTier::Contains(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  State& s = *state_;
  Entry expired;
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.entries.find(key);
  if (it == s.entries.end()) return false;
  if (Expired(it->second, NowUnixMs())) {
    expired = s.RemoveLocked(it);
    ++s.expirations;
    return false;
  }
  return true;
}

Status DramTier::Delete(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  State& s = *state_;
  Entry removed;
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.entries.find(key);
  if (it != s.entries.end()) removed = s.RemoveLocked(it);
  return Status::Ok();
}

TierStats DramTier::Stats() const {
  const State& s = *state_;
  TierStats t;
  t.name = "dram";
  t.capacity_bytes = s.options.capacity_bytes;
  std::lock_guard<std::mutex> lock(s.mu);
  t.items = static_cast<int64_t>(s.entries.size());
  t.bytes = s.bytes;
  t.hits = s.hits;
  t.misses = s.misses;
  t.puts = s.puts;
  t.evictions = s.evictions;
  t.expirations = s.expirations;
  t.stale_puts = s.stale_puts;
  return t;
}

}  // namespace keel::kvstore
