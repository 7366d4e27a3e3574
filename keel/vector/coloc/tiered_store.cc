#include "keel/vector/coloc/tiered_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <unordered_map>

#include "keel/core/log.h"
#include "keel/kvstore/dram_tier.h"
#include "keel/kvstore/redis_tier.h"
#include "keel/kvstore/ssd_tier.h"
#include "keel/vector/coloc/cold_tier.h"

namespace keel::vector::coloc {
namespace {

using kvstore::Blob;
using kvstore::Entry;
using Clock = std::chrono::steady_clock;

// The store enforces capacities itself (placement decides what goes where), so the kvstore
// tiers are given bounds they never reach: DramTier would evict and SsdTier drop whole
// segments FIFO, and either would lose vectors the location map still points at.
constexpr int64_t kNeverEvict = int64_t{1} << 60;

// Stripes for the per-key write lock (Put/Remove/Move of one key run one at a time; Fetch
// takes none of them).
constexpr size_t kKeyStripes = 64;

struct KeyBytes {
  char b[8];
  explicit KeyBytes(uint64_t key) {
    static_assert(std::endian::native == std::endian::little);
    std::memcpy(b, &key, 8);
  }
  std::string_view view() const { return {b, 8}; }
};

std::string DescribeKey(uint64_t key) {
  return "key " + std::to_string(key) + " (item " + std::to_string(ItemOf(key)) +
         (ModalityOf(key) == Modality::kText ? ", text)" : ", image)");
}

int64_t ElapsedNs(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// Removes a previous run's segment files (prefix*suffix) from `dir`, after making sure no live
// tier holds the directory (both SsdTier and ColdTier flock dir/LOCK).
Status ClearSegments(const std::string& dir, std::string_view prefix, std::string_view suffix) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError(dir + ": create directory: " + ec.message());
  const std::string lock_path = dir + "/LOCK";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(lock_path + ": open: " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return Status::Unavailable(dir + ": in use by another tier");
  }
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (it->is_regular_file() && name.starts_with(prefix) && name.ends_with(suffix)) {
      std::filesystem::remove(it->path(), ec);
      if (ec) break;
    }
  }
  ::close(fd);  // releases the flock; the tier's Open takes it again
  if (ec) return Status::IOError(dir + ": clear old segments: " + ec.message());
  return Status::Ok();
}

double P50Us(std::vector<int64_t>& ns) {
  if (ns.empty()) return 0;
  std::nth_element(ns.begin(), ns.begin() + ns.size() / 2, ns.end());
  return static_cast<double>(ns[ns.size() / 2]) / 1000.0;
}

}  // namespace

class TieredStore::Impl {
 public:
  struct Slot {
    TierIndex kind;
    std::string name;
    std::unique_ptr<kvstore::Tier> tier;
    int64_t capacity = 0;  // 0 = unbounded
    // Guarded by mu_. bytes includes reservations of writes in flight.
    int64_t bytes = 0;
    int64_t items = 0;
    std::atomic<int64_t> reads{0};
    double read_us = 0, batch_us = 0;  // guarded by measure_mu_
  };
  struct Loc {
    int tier = -1;
    int64_t bytes = 0;
  };

  std::vector<std::unique_ptr<Slot>> slots;
  mutable std::shared_mutex mu_;  // the location map and the slots' bytes/items
  std::unordered_map<uint64_t, Loc> locs;
  std::array<std::mutex, kKeyStripes> key_mu;
  mutable std::mutex measure_mu_;

  std::mutex& KeyLock(uint64_t key) { return key_mu[std::hash<uint64_t>{}(key * 0x9e3779b97f4a7c15ULL) % kKeyStripes]; }

  int count() const { return static_cast<int>(slots.size()); }

  // Whether `tier` can take `add` more bytes once `freed` bytes of it are released. Under mu_.
  bool HasRoom(int tier, int64_t add, int64_t freed) const {
    const Slot& s = *slots[tier];
    return s.capacity == 0 || s.bytes - freed + add <= s.capacity;
  }

  Status CheckTier(int tier) const {
    if (tier < 0 || tier >= count()) {
      return Status::InvalidArgument("tiered store: tier " + std::to_string(tier) + " not configured (" +
                                     std::to_string(count()) + " tiers)");
    }
    return Status::Ok();
  }

  void Unreserve(int tier, int64_t bytes) {
    std::unique_lock lock(mu_);
    slots[tier]->bytes -= bytes;
  }

  // One batched read of `idx` (positions into keys) from `tier`; decodes into out. NotFound
  // keys (moved away meanwhile) go to *retry; any other failure is returned.
  Status ReadTier(int tier, std::span<const uint64_t> keys, const std::vector<size_t>& idx,
                  std::vector<std::vector<float>>* out, FetchTrace* trace, std::vector<size_t>* retry) {
    Slot& slot = *slots[tier];
    std::vector<KeyBytes> kb;
    kb.reserve(idx.size());
    std::vector<std::string_view> views;
    views.reserve(idx.size());
    for (size_t i : idx) kb.emplace_back(keys[i]);
    for (const KeyBytes& k : kb) views.push_back(k.view());
    const auto t0 = Clock::now();
    std::vector<Result<Entry>> got = slot.tier->GetMany(views);
    const int64_t ns = ElapsedNs(t0);
    if (trace != nullptr) {
      trace->tier_mask |= 1u << tier;
      trace->keys_per_tier[tier] += static_cast<int>(idx.size());
      trace->ns_per_tier[tier] += ns;
    }
    slot.reads.fetch_add(static_cast<int64_t>(idx.size()), std::memory_order_relaxed);
    for (size_t j = 0; j < idx.size(); ++j) {
      const size_t i = idx[j];
      if (!got[j].ok()) {
        if (got[j].status().code() == StatusCode::kNotFound && retry != nullptr) {
          retry->push_back(i);
          continue;
        }
        if (got[j].status().code() == StatusCode::kNotFound) {
          // The store put it there and no Move took it: the tier lost it (a Redis restarted
          // without persistence, or evicting under maxmemory). A server fault, not a 404.
          return Status::Corruption("tiered store: " + slot.name + ": " + DescribeKey(keys[i]) +
                                    " is missing from the tier that held it (" + got[j].status().message() +
                                    "): the tier lost data");
        }
        return Status(got[j].status().code(),
                      "tiered store: " + slot.name + ": " + DescribeKey(keys[i]) + ": " + got[j].status().message());
      }
      const Blob& b = *got[j]->value;
      if (b.size() % sizeof(float) != 0) {
        return Status::Corruption("tiered store: " + slot.name + ": " + DescribeKey(keys[i]) + " holds " +
                                  std::to_string(b.size()) + " bytes, not whole floats");
      }
      (*out)[i].resize(b.size() / sizeof(float));
      if (b.size() > 0) std::memcpy((*out)[i].data(), b.data(), b.size());
    }
    return Status::Ok();
  }

  // Groups positions by the tier each key is in now; NotFound naming the first missing key.
  Status Group(std::span<const uint64_t> keys, const std::vector<size_t>& which,
               std::array<std::vector<size_t>, kMaxTiers>* groups) const {
    std::shared_lock lock(mu_);
    for (size_t i : which) {
      auto it = locs.find(keys[i]);
      if (it == locs.end()) return Status::NotFound("tiered store: " + DescribeKey(keys[i]) + " not found");
      (*groups)[it->second.tier].push_back(i);
    }
    return Status::Ok();
  }
};

Result<std::unique_ptr<TieredStore>> TieredStore::Open(const TieredStoreOptions& options) {
  auto impl = std::make_unique<Impl>();
  auto add = [&](TierIndex kind, std::string name, std::unique_ptr<kvstore::Tier> tier, int64_t capacity) {
    auto slot = std::make_unique<Impl::Slot>();
    slot->kind = kind;
    slot->name = std::move(name);
    slot->tier = std::move(tier);
    slot->capacity = std::max<int64_t>(0, capacity);
    impl->slots.push_back(std::move(slot));
  };
  if (options.dram_bytes >= 0) {
    add(kDram, "dram", std::make_unique<kvstore::DramTier>(kvstore::DramOptions{.capacity_bytes = kNeverEvict}),
        options.dram_bytes);
  }
  if (!options.ssd_dir.empty()) {
    KEEL_RETURN_IF_ERROR(ClearSegments(options.ssd_dir, "seg-", ".kvs"));
    kvstore::SsdOptions so;
    so.dir = options.ssd_dir;
    so.capacity_bytes = kNeverEvict;
    so.uncached_reads = options.ssd_uncached_reads;
    auto ssd = kvstore::SsdTier::Open(so);
    if (!ssd.ok()) return Status(ssd.status().code(), "tiered store: ssd tier: " + ssd.status().message());
    add(kSsd, "ssd", std::move(ssd).value(), options.ssd_bytes);
  }
  if (!options.cold_dir.empty()) {
    KEEL_RETURN_IF_ERROR(ClearSegments(options.cold_dir, "seg-", ".kvs"));
    ColdTierOptions co;
    co.dir = options.cold_dir;
    co.zstd_level = options.cold_zstd_level;
    auto cold = ColdTier::Open(co);
    if (!cold.ok()) return Status(cold.status().code(), "tiered store: cold tier: " + cold.status().message());
    add(kCold, "cold", std::move(cold).value(), options.cold_bytes);
  }
  if (!options.redis_url.empty()) {
    auto ro = kvstore::ParseRedisUrl(options.redis_url);
    if (!ro.ok()) return Status(ro.status().code(), "tiered store: remote tier: " + ro.status().message());
    ro->key_prefix = options.redis_prefix;
    auto redis = kvstore::RedisTier::Connect(*ro);
    if (!redis.ok()) return Status(redis.status().code(), "tiered store: remote tier: " + redis.status().message());
    add(kRemote, "remote", std::move(redis).value(), options.remote_bytes);
  }
  if (impl->slots.empty()) return Status::InvalidArgument("tiered store: no tier configured");
  std::unique_ptr<TieredStore> store(new TieredStore());
  store->impl_ = std::move(impl);
  return store;
}

TieredStore::~TieredStore() = default;

int TieredStore::tier_count() const { return impl_->count(); }

std::string_view TieredStore::tier_name(int tier) const {
  if (tier < 0 || tier >= impl_->count()) return "none";
  return impl_->slots[tier]->name;
}

int TieredStore::TierPosition(TierIndex kind) const {
  for (int t = 0; t < impl_->count(); ++t) {
    if (impl_->slots[t]->kind == kind) return t;
  }
  return -1;
}

std::vector<int64_t> TieredStore::Capacities() const {
  std::vector<int64_t> caps;
  for (const auto& s : impl_->slots) caps.push_back(s->capacity);
  return caps;
}

Status TieredStore::Put(uint64_t key, std::span<const float> values, int tier) {
  Impl& m = *impl_;
  if (tier >= 0) KEEL_RETURN_IF_ERROR(m.CheckTier(tier));
  if (values.empty()) return Status::InvalidArgument("tiered store: empty vector for " + DescribeKey(key));
  const int64_t bytes = static_cast<int64_t>(values.size_bytes());
  std::lock_guard<std::mutex> key_lock(m.KeyLock(key));

  Impl::Loc old;
  int target = -1;
  {
    std::unique_lock lock(m.mu_);
    if (auto it = m.locs.find(key); it != m.locs.end()) old = it->second;
    auto freed = [&](int t) { return old.tier == t ? old.bytes : 0; };
    if (tier >= 0 || old.tier >= 0) {
      const int want = tier >= 0 ? tier : old.tier;
      if (!m.HasRoom(want, bytes, freed(want))) {
        return Status::ResourceExhausted("tiered store: tier " + m.slots[want]->name + " is full (" +
                                         std::to_string(m.slots[want]->capacity) + " bytes)");
      }
      target = want;
    } else {
      for (int t = 0; t < m.count() && target < 0; ++t) {
        if (m.HasRoom(t, bytes, 0)) target = t;
      }
      if (target < 0) {
        return Status::ResourceExhausted("tiered store: no tier has room for " + std::to_string(bytes) + " bytes");
      }
    }
    m.slots[target]->bytes += bytes;  // reserved until the write lands
  }

  const KeyBytes kb(key);
  if (Status s = m.slots[target]->tier->Put(kb.view(), Entry{Blob::Copy(values.data(), bytes), 0}); !s.ok()) {
    m.Unreserve(target, bytes);
    return Status(s.code(), "tiered store: " + m.slots[target]->name + ": put " + DescribeKey(key) + ": " + s.message());
  }
  {
    std::unique_lock lock(m.mu_);
    if (old.tier >= 0) {
      m.slots[old.tier]->bytes -= old.bytes;
      m.slots[old.tier]->items--;
    }
    m.slots[target]->items++;
    m.locs[key] = Impl::Loc{target, bytes};
  }
  if (old.tier >= 0 && old.tier != target) {
    // The location already points at the new copy; a failed delete only leaves garbage.
    if (Status s = m.slots[old.tier]->tier->Delete(kb.view()); !s.ok()) {
      Log().warn("tiered store: {}: delete old copy of {}: {}", m.slots[old.tier]->name, DescribeKey(key), s.ToString());
    }
  }
  return Status::Ok();
}

Status TieredStore::Remove(uint64_t key) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> key_lock(m.KeyLock(key));
  Impl::Loc old;
  {
    std::unique_lock lock(m.mu_);
    auto it = m.locs.find(key);
    if (it == m.locs.end()) return Status::Ok();
    old = it->second;
    m.locs.erase(it);
    m.slots[old.tier]->bytes -= old.bytes;
    m.slots[old.tier]->items--;
  }
  return m.slots[old.tier]->tier->Delete(KeyBytes(key).view());
}

Status TieredStore::Fetch(std::span<const uint64_t> keys, std::vector<std::vector<float>>* out,
                          FetchTrace* trace) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  if (trace != nullptr) *trace = FetchTrace{};
  out->assign(keys.size(), {});
  std::vector<size_t> all(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) all[i] = i;

  std::array<std::vector<size_t>, kMaxTiers> groups;
  KEEL_RETURN_IF_ERROR(m.Group(keys, all, &groups));
  std::vector<size_t> retry;
  for (int t = 0; t < m.count(); ++t) {
    if (!groups[t].empty()) KEEL_RETURN_IF_ERROR(m.ReadTier(t, keys, groups[t], out, trace, &retry));
  }
  if (!retry.empty()) {
    // A Move switched these keys' location and deleted the copy we were about to read; the
    // new location is final for this Fetch (a second miss is a real NotFound).
    std::array<std::vector<size_t>, kMaxTiers> again;
    KEEL_RETURN_IF_ERROR(m.Group(keys, retry, &again));
    for (int t = 0; t < m.count(); ++t) {
      if (!again[t].empty()) KEEL_RETURN_IF_ERROR(m.ReadTier(t, keys, again[t], out, trace, nullptr));
    }
  }
  if (trace != nullptr) {
    trace->tiers_touched = std::popcount(trace->tier_mask);
    trace->total_ns = ElapsedNs(t0);
  }
  return Status::Ok();
}

int TieredStore::TierOf(uint64_t key) const {
  std::shared_lock lock(impl_->mu_);
  auto it = impl_->locs.find(key);
  return it == impl_->locs.end() ? -1 : it->second.tier;
}

Status TieredStore::Move(uint64_t key, int to_tier) {
  Impl& m = *impl_;
  KEEL_RETURN_IF_ERROR(m.CheckTier(to_tier));
  std::lock_guard<std::mutex> key_lock(m.KeyLock(key));
  Impl::Loc loc;
  {
    std::unique_lock lock(m.mu_);
    auto it = m.locs.find(key);
    if (it == m.locs.end()) return Status::NotFound("tiered store: move: " + DescribeKey(key) + " not found");
    loc = it->second;
    if (loc.tier == to_tier) return Status::Ok();
    if (!m.HasRoom(to_tier, loc.bytes, 0)) {
      return Status::ResourceExhausted("tiered store: move: tier " + m.slots[to_tier]->name + " is full");
    }
    m.slots[to_tier]->bytes += loc.bytes;  // reserved
  }
  const KeyBytes kb(key);
  Impl::Slot& from = *m.slots[loc.tier];
  Impl::Slot& to = *m.slots[to_tier];
  Result<Entry> got = from.tier->Get(kb.view());
  Status s = got.ok() ? to.tier->Put(kb.view(), *got) : got.status();
  if (!s.ok()) {
    m.Unreserve(to_tier, loc.bytes);
    return Status(s.code(), "tiered store: move " + DescribeKey(key) + " " + from.name + " -> " + to.name + ": " +
                                s.message());
  }
  {
    std::unique_lock lock(m.mu_);
    from.bytes -= loc.bytes;
    from.items--;
    to.items++;
    m.locs[key].tier = to_tier;
  }
  // Readers that looked the key up before the switch may still be reading this copy; one that
  // misses it re-reads the location (Fetch's retry).
  if (Status d = from.tier->Delete(kb.view()); !d.ok()) {
    Log().warn("tiered store: {}: delete moved {}: {}", from.name, DescribeKey(key), d.ToString());
  }
  return Status::Ok();
}

std::vector<std::pair<uint64_t, int>> TieredStore::Locations() const {
  std::shared_lock lock(impl_->mu_);
  std::vector<std::pair<uint64_t, int>> out;
  out.reserve(impl_->locs.size());
  for (const auto& [key, loc] : impl_->locs) out.emplace_back(key, loc.tier);
  return out;
}

std::vector<TieredStore::StoredKey> TieredStore::Inventory() const {
  std::shared_lock lock(impl_->mu_);
  std::vector<StoredKey> out;
  out.reserve(impl_->locs.size());
  for (const auto& [key, loc] : impl_->locs) out.push_back(StoredKey{key, loc.tier, loc.bytes});
  return out;
}

std::vector<TierUsage> TieredStore::Usage() const {
  std::vector<TierUsage> out;
  std::shared_lock lock(impl_->mu_);
  std::lock_guard<std::mutex> mlock(impl_->measure_mu_);
  for (const auto& s : impl_->slots) {
    TierUsage u;
    u.name = s->name;
    u.items = s->items;
    u.bytes = s->bytes;
    u.capacity_bytes = s->capacity;
    u.measured_read_us = s->read_us;
    u.measured_batch_us = s->batch_us;
    u.reads = s->reads.load(std::memory_order_relaxed);
    out.push_back(std::move(u));
  }
  return out;
}

// Probes use their own keys ("coloc-probe-N": never 8 bytes, so never a vector key) written
// straight to each tier, outside the location map and the capacities: measuring races with no
// Move and no Fetch, and a tier is measured even while empty. Probe vectors have the size of a
// stored vector (512 bytes when the store is empty) and random contents (zstd must not shrink
// them to nothing).
Status TieredStore::MeasureLatency(int probes) {
  Impl& m = *impl_;
  probes = std::max(probes, 1);
  constexpr int kBatch = 10;
  int64_t vector_bytes = 512;
  {
    std::shared_lock lock(m.mu_);
    if (!m.locs.empty()) vector_bytes = m.locs.begin()->second.bytes;
  }
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<std::string> keys;
  for (int i = 0; i < kBatch; ++i) keys.push_back("coloc-probe-" + std::to_string(i));
  const std::vector<std::string_view> views(keys.begin(), keys.end());

  for (auto& slot : m.slots) {
    kvstore::Tier& tier = *slot->tier;
    Status s;
    for (int i = 0; i < kBatch && s.ok(); ++i) {
      std::vector<float> v(static_cast<size_t>(vector_bytes) / sizeof(float));
      for (float& f : v) f = dist(rng);
      s = tier.Put(keys[i], Entry{Blob::Copy(v.data(), v.size() * sizeof(float)), 0});
    }
    std::vector<int64_t> single, batch;
    for (int p = 0; p < probes && s.ok(); ++p) {
      const auto t0 = Clock::now();
      Result<Entry> e = tier.Get(keys[p % kBatch]);
      single.push_back(ElapsedNs(t0));
      if (!e.ok()) s = e.status();
    }
    for (int p = 0; p < probes && s.ok(); ++p) {
      const auto t0 = Clock::now();
      std::vector<Result<Entry>> got = tier.GetMany(views);
      batch.push_back(ElapsedNs(t0));
      for (const auto& g : got) {
        if (!g.ok() && s.ok()) s = g.status();
      }
    }
    for (const std::string& k : keys) (void)tier.Delete(k);
    if (!s.ok()) return Status(s.code(), "tiered store: measure " + slot->name + ": " + s.message());
    std::lock_guard<std::mutex> lock(m.measure_mu_);
    slot->read_us = P50Us(single);
    slot->batch_us = P50Us(batch);
  }
  return Status::Ok();
}

}  // namespace keel::vector::coloc
