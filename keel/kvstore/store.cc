#include "keel/kvstore/store.h"

#include <nlohmann/json.hpp>

#include "keel/core/log.h"
#include "keel/kvstore/redis_tier.h"
#include "keel/kvstore/ssd_tier.h"

namespace keel::kvstore {

Store::Store(const StoreOptions& options) : options_(options) {}

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  if (options.dram_bytes <= 0) return Status::InvalidArgument("kvstore: the DRAM tier needs a capacity above 0 bytes");
  std::unique_ptr<Store> store(new Store(options));
  Store* self = store.get();
  DramOptions dram;
  dram.capacity_bytes = options.dram_bytes;
  dram.eviction = options.eviction;
  store->dram_ = std::make_unique<DramTier>(
      dram, [self](std::string key, Entry entry) { self->OnDramEvict(std::move(key), std::move(entry)); });
  if (!options.ssd_dir.empty()) {
    SsdOptions ssd;
    ssd.dir = options.ssd_dir;
    ssd.capacity_bytes = options.ssd_bytes;
    ssd.segment_bytes = options.ssd_segment_bytes;
    KEEL_ASSIGN_OR_RETURN(store->ssd_, SsdTier::Open(ssd));
  }
  if (!options.redis_url.empty()) {
    KEEL_ASSIGN_OR_RETURN(RedisOptions redis, ParseRedisUrl(options.redis_url));
    KEEL_ASSIGN_OR_RETURN(store->redis_, RedisTier::Connect(redis));
  }
  if (store->ssd_ || store->redis_) store->writer_ = std::thread([self] { self->WriteBehindLoop(); });
  return store;
}

Store::~Store() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  space_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

int64_t Store::ExpiryFor(int64_t ttl_ms) const {
  if (ttl_ms < 0) ttl_ms = options_.default_ttl_ms;
  return ttl_ms == 0 ? 0 : NowUnixMs() + ttl_ms;
}

Status Store::Put(std::string_view key, BlobPtr value, int64_t ttl_ms, bool persist) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  if (value == nullptr) return Status::InvalidArgument("kvstore: null value");
  if (value->size() > options_.max_value_bytes) {
    return Status::ResourceExhausted("kvstore: value of " + std::to_string(value->size()) +
                                     " bytes exceeds the limit of " + std::to_string(options_.max_value_bytes));
  }
  if (persist && !ssd_) return Status::InvalidArgument("kvstore: persist requested but the store has no SSD tier");
  Entry entry{std::move(value), ExpiryFor(ttl_ms)};
  if (persist) {
    KEEL_RETURN_IF_ERROR(ssd_->Put(key, entry));
    KEEL_RETURN_IF_ERROR(ssd_->Sync());
  }
  Status dram = dram_->Put(key, entry);
  // A value too large for DRAM can still live in the lower tiers.
  if (!dram.ok() && dram.code() != StatusCode::kResourceExhausted) return dram;
  if (!dram.ok() && !ssd_ && !redis_) return dram;
  if (ssd_ || redis_) Enqueue(Pending{std::string(key), std::move(entry), ssd_ != nullptr && !persist, redis_ != nullptr});
  return Status::Ok();
}

void Store::Enqueue(Pending p) {
  const int64_t bytes = static_cast<int64_t>(p.entry.value->size());
  std::unique_lock<std::mutex> lock(mu_);
  const bool room = space_cv_.wait_for(lock, std::chrono::milliseconds(options_.write_behind_wait_ms), [&] {
    return stop_ || queued_bytes_ == 0 || queued_bytes_ + bytes <= options_.write_behind_bytes;
  });
  if (!room || stop_) {
    skipped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  queued_bytes_ += bytes;
  queue_.push_back(std::move(p));
  cv_.notify_one();
}

void Store::WriteBehindLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ with nothing left
    Pending p = std::move(queue_.front());
    queue_.pop_front();
    ++in_flight_;
    lock.unlock();
    if (p.to_ssd) {
      Status s = ssd_->Put(p.key, p.entry);
      if (!s.ok()) {
        lower_errors_.fetch_add(1, std::memory_order_relaxed);
        Log().warn("kvstore: SSD write-behind failed: {}", s.ToString());
      }
    }
    if (p.to_redis) {
      Status s = redis_->Put(p.key, p.entry);
      if (!s.ok()) {
        lower_errors_.fetch_add(1, std::memory_order_relaxed);
        Log().debug("kvstore: Redis write-behind failed: {}", s.ToString());
      }
    }
    lock.lock();
    --in_flight_;
    queued_bytes_ -= static_cast<int64_t>(p.entry.value->size());
    space_cv_.notify_all();
  }
}

void Store::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  space_cv_.wait(lock, [&] { return stop_ || (queue_.empty() && in_flight_ == 0); });
}

void Store::OnDramEvict(std::string key, Entry entry) {
  if (!ssd_) return;
  Result<bool> has = ssd_->Contains(key);
  if (has.ok() && *has) return;
  demotions_.fetch_add(1, std::memory_order_relaxed);
  Enqueue(Pending{std::move(key), std::move(entry), true, false});
}

Result<StoredValue> Store::Get(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  Result<Entry> e = dram_->Get(key);
  if (e.ok()) return StoredValue{std::move(e->value), "dram"};
  Tier* lower[2] = {ssd_.get(), redis_.get()};
  for (Tier* t : lower) {
    if (t == nullptr) continue;
    e = t->Get(key);
    if (e.ok()) {
      promotions_.fetch_add(1, std::memory_order_relaxed);
      (void)dram_->Put(key, *e);  // too large for DRAM: served from below, not promoted
      return StoredValue{std::move(e->value), t->name()};
    }
    if (e.status().code() != StatusCode::kNotFound) {
      lower_errors_.fetch_add(1, std::memory_order_relaxed);
      Log().debug("kvstore: {} tier read failed: {}", t->name(), e.status().ToString());
    }
  }
  return Status::NotFound("kvstore: key not found");
}

Result<bool> Store::Contains(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  return LongestPrefix({key}) == 1;
}

int Store::LongestPrefix(const std::vector<std::string_view>& keys) {
  size_t i = 0;
  for (; i < keys.size(); ++i) {
    if (!ValidateKey(keys[i]).ok()) return static_cast<int>(i);
    Result<bool> in_dram = dram_->Contains(keys[i]);
    if (in_dram.ok() && *in_dram) continue;
    if (ssd_) {
      Result<bool> in_ssd = ssd_->Contains(keys[i]);
      if (in_ssd.ok() && *in_ssd) continue;
    }
    break;
  }
  if (i == keys.size() || !redis_) return static_cast<int>(i);
  std::vector<std::string_view> rest(keys.begin() + static_cast<std::ptrdiff_t>(i), keys.end());
  std::vector<Result<bool>> remote = redis_->ContainsMany(rest);
  for (const Result<bool>& r : remote) {
    if (!r.ok()) {
      lower_errors_.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    if (!*r) break;
    ++i;
  }
  return static_cast<int>(i);
}

Status Store::Delete(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  KEEL_RETURN_IF_ERROR(dram_->Delete(key));
  if (ssd_) KEEL_RETURN_IF_ERROR(ssd_->Delete(key));
  if (redis_) KEEL_RETURN_IF_ERROR(redis_->Delete(key));
  return Status::Ok();
}

StoreStats Store::Stats() const {
  StoreStats s;
  s.tiers.push_back(dram_->Stats());
  if (ssd_) s.tiers.push_back(ssd_->Stats());
  if (redis_) s.tiers.push_back(redis_->Stats());
  s.promotions = promotions_.load(std::memory_order_relaxed);
  s.demotions = demotions_.load(std::memory_order_relaxed);
  s.write_behind_skipped = skipped_.load(std::memory_order_relaxed);
  s.lower_tier_errors = lower_errors_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  s.write_behind_queued_bytes = queued_bytes_;
  return s;
}

std::string Store::StatsJson() const {
  StoreStats s = Stats();
  nlohmann::json j;
  j["promotions"] = s.promotions;
  j["demotions"] = s.demotions;
  j["write_behind_queued_bytes"] = s.write_behind_queued_bytes;
  j["write_behind_skipped"] = s.write_behind_skipped;
  j["lower_tier_errors"] = s.lower_tier_errors;
  nlohmann::json tiers = nlohmann::json::array();
  for (const TierStats& t : s.tiers) {
    tiers.push_back({{"name", t.name},
                     {"items", t.items},
                     {"bytes", t.bytes},
                     {"capacity_bytes", t.capacity_bytes},
                     {"hits", t.hits},
                     {"misses", t.misses},
                     {"puts", t.puts},
                     {"evictions", t.evictions},
                     {"expirations", t.expirations},
                     {"errors", t.errors}});
  }
  j["tiers"] = std::move(tiers);
  return j.dump();
}

void Store::RegisterMetrics(MetricsRegistry& registry) {
  struct Field {
    const char* name;
    const char* help;
    int64_t TierStats::*member;
    bool counter;
  };
  static const Field kFields[] = {
      {"keel_kvstore_tier_items", "Entries held per tier (-1: unknown).", &TierStats::items, false},
      {"keel_kvstore_tier_bytes", "Value bytes held (DRAM, SSD) or written (Redis) per tier.", &TierStats::bytes, false},
      {"keel_kvstore_tier_capacity_bytes", "Configured capacity per tier.", &TierStats::capacity_bytes, false},
      {"keel_kvstore_tier_hits_total", "Lookups answered per tier.", &TierStats::hits, true},
      {"keel_kvstore_tier_misses_total", "Lookups missed per tier.", &TierStats::misses, true},
      {"keel_kvstore_tier_puts_total", "Values written per tier.", &TierStats::puts, true},
      {"keel_kvstore_tier_evictions_total", "Entries dropped for capacity per tier.", &TierStats::evictions, true},
      {"keel_kvstore_tier_expirations_total", "Entries dropped for TTL per tier.", &TierStats::expirations, true},
      {"keel_kvstore_tier_errors_total", "I/O, corruption or connection failures per tier.", &TierStats::errors, true},
  };
  std::vector<std::string> names = {"dram"};
  if (ssd_) names.push_back("ssd");
  if (redis_) names.push_back("redis");
  for (const Field& f : kFields) {
    for (size_t i = 0; i < names.size(); ++i) {
      auto read = [this, i, member = f.member] {
        StoreStats s = Stats();
        return i < s.tiers.size() ? static_cast<double>(s.tiers[i].*member) : 0.0;
      };
      if (f.counter) {
        registry.AddCounter(f.name, f.help, {"tier"}).WithLabels({names[i]}).SetCallback(read);
      } else {
        registry.AddGauge(f.name, f.help, {"tier"}).WithLabels({names[i]}).SetCallback(read);
      }
    }
  }
  registry.AddCounter("keel_kvstore_promotions_total", "Lower-tier hits copied into DRAM.")
      .Get()
      .SetCallback([this] { return static_cast<double>(promotions_.load()); });
  registry.AddCounter("keel_kvstore_demotions_total", "DRAM evictions written down to SSD.")
      .Get()
      .SetCallback([this] { return static_cast<double>(demotions_.load()); });
  registry.AddCounter("keel_kvstore_write_behind_skipped_total", "Values not written to lower tiers (queue full).")
      .Get()
      .SetCallback([this] { return static_cast<double>(skipped_.load()); });
  registry.AddGauge("keel_kvstore_write_behind_queued_bytes", "Bytes waiting for the SSD/Redis writer.")
      .Get()
      .SetCallback([this] {
        std::lock_guard<std::mutex> lock(mu_);
        return static_cast<double>(queued_bytes_);
      });
}

}  // namespace keel::kvstore
