#include "keel/kvstore/store.h"

#include <nlohmann/json.hpp>

#include "keel/core/hash.h"
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
  dram.evict_callback_under_lock = true;  // OnDramEvict queues the entry before any GET can miss it
  store->dram_ = std::make_unique<DramTier>(
      dram, [self](std::string key, Entry entry) { self->OnDramEvict(std::move(key), std::move(entry)); });
  if (!options.ssd_dir.empty()) {
    SsdOptions ssd;
    ssd.dir = options.ssd_dir;
    ssd.capacity_bytes = options.ssd_bytes;
    ssd.segment_bytes = options.ssd_segment_bytes;
    KEEL_ASSIGN_OR_RETURN(store->ssd_, SsdTier::Open(ssd));
    store->ObserveSeq(store->ssd_->max_seq());  // continue above every recovered write
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
    paused_ = false;
  }
  cv_.notify_all();
  space_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

int64_t Store::ExpiryFor(int64_t ttl_ms) const {
  if (ttl_ms < 0) ttl_ms = options_.default_ttl_ms;
  return ttl_ms == 0 ? 0 : NowUnixMs() + ttl_ms;
}

namespace {
// What one queued write holds in memory: its key and value, plus the queue node and its
// pending_ entry. The queue's byte bound counts all of it, so a flood of empty values cannot
// queue without bound while a lower tier is slow.
int64_t QueueCharge(std::string_view key, const Blob& value) {
  return static_cast<int64_t>(key.size() + value.size()) + kEntryOverheadBytes;
}

// Counts a PUT or DELETE when it is complete (still under the key lock), so a GET that began
// while it was in progress sees the count change and does not promote what it read meanwhile.
class WriteCounted {
 public:
  explicit WriteCounted(std::atomic<uint64_t>& count) : count_(count) {}
  ~WriteCounted() { count_.fetch_add(1, std::memory_order_release); }
  WriteCounted(const WriteCounted&) = delete;
  WriteCounted& operator=(const WriteCounted&) = delete;

 private:
  std::atomic<uint64_t>& count_;
};
}  // namespace

size_t Store::Stripe(std::string_view key) { return Xxh3_64(key.data(), key.size()) % kKeyLockStripes; }

// Hybrid clock: strictly above every number issued or observed, and at least the wall clock in
// microseconds, so a restarted store (and, roughly, another instance sharing Redis) continues
// above what the tiers hold.
uint64_t Store::NextSeq() {
  const uint64_t now_us = static_cast<uint64_t>(NowUnixMs()) * 1000;
  uint64_t last = last_seq_.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t next = std::max(last + 1, now_us);
    if (last_seq_.compare_exchange_weak(last, next, std::memory_order_relaxed)) return next;
  }
}

void Store::ObserveSeq(uint64_t seq) {
  uint64_t last = last_seq_.load(std::memory_order_relaxed);
  while (seq > last && !last_seq_.compare_exchange_weak(last, seq, std::memory_order_relaxed)) {
  }
}

bool Store::ReserveQueue(int64_t bytes, int wait_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool room = space_cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), [&] {
    return stop_ || queued_bytes_ == 0 || queued_bytes_ + bytes <= options_.write_behind_bytes;
  });
  if (!room || stop_) return false;
  queued_bytes_ += bytes;
  return true;
}

void Store::ReleaseQueue(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  queued_bytes_ -= bytes;
  space_cv_.notify_all();
}

void Store::PushLocked(Pending p) {
  PendingKey& k = pending_[p.key];
  if (k.queued == 0 || k.newest.seq <= p.entry.seq) k.newest = p.entry;
  ++k.queued;
  queue_.push_back(std::move(p));
  cv_.notify_one();
}

void Store::NoteUnqueuedLocked(const std::string& key, const Entry& entry) {
  skipped_.fetch_add(1, std::memory_order_relaxed);
  // Older writes of the key still queued must not land or be served after this one.
  auto p = pending_.find(key);
  if (p != pending_.end() && p->second.newest.seq < entry.seq) p->second.newest = entry;
  HideLowerLocked(key, entry.seq);
}

void Store::HideLowerLocked(const std::string& key, uint64_t seq) {
  auto it = hidden_.find(key);
  if (it != hidden_.end()) {
    it->second = std::max(it->second, seq);
  } else if (hidden_.size() < kMaxHiddenKeys) {
    hidden_.emplace(key, seq);
  } else {
    // Out of room to remember it: the lower tiers lose the key instead (rare: a queue that has
    // been full for a million distinct keys). The ordered deletes refuse nothing newer.
    if (ssd_) (void)ssd_->DeleteAt(key, seq);
    if (redis_) (void)redis_->DeleteAt(key, seq);
  }
}

Status Store::Put(std::string_view key, BlobPtr value, int64_t ttl_ms, bool persist) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  if (value == nullptr) return Status::InvalidArgument("kvstore: null value");
  if (ttl_ms > kMaxTtlMs) {
    return Status::InvalidArgument("kvstore: TTL of " + std::to_string(ttl_ms) + " ms is over the limit of " +
                                   std::to_string(kMaxTtlMs) + " ms (100 years)");
  }
  if (value->size() > options_.max_value_bytes) {
    return Status::ResourceExhausted("kvstore: value of " + std::to_string(value->size()) +
                                     " bytes exceeds the limit of " + std::to_string(options_.max_value_bytes));
  }
  if (persist && !ssd_) return Status::InvalidArgument("kvstore: persist requested but the store has no SSD tier");
  const bool lower = ssd_ != nullptr || redis_ != nullptr;
  const int64_t bytes = QueueCharge(key, *value);
  // Room is reserved before the key lock: waiting for the writer while holding a lock it may
  // need for its current entry would stall both.
  const bool queued = lower && ReserveQueue(bytes, options_.write_behind_wait_ms);

  const size_t stripe = Stripe(key);
  std::lock_guard<std::mutex> key_lock(key_locks_[stripe]);
  WriteCounted counted(key_writes_[stripe]);
  Entry entry{std::move(value), ExpiryFor(ttl_ms), NextSeq()};
  if (persist) {
    Status s = ssd_->Put(key, entry);
    if (s.ok()) s = ssd_->Sync();
    if (!s.ok()) {
      if (queued) ReleaseQueue(bytes);
      return s;
    }
  }
  Status dram = dram_->Put(key, entry);
  if (!dram.ok()) {
    // Too large for DRAM: it can still live below, but DRAM must not keep serving an older value.
    (void)dram_->Delete(key);
    if (dram.code() != StatusCode::kResourceExhausted || !lower) {
      if (queued) ReleaseQueue(bytes);
      return dram;
    }
  }
  if (!lower) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  if (queued) {
    PushLocked(Pending{std::string(key), std::move(entry), ssd_ != nullptr && !persist, redis_ != nullptr, persist});
  } else {
    // A persisted value is in SSD already; only Redis (and an SSD that later evicts it) lag.
    NoteUnqueuedLocked(std::string(key), entry);
  }
  return Status::Ok();
}

// Writes one queued entry down, unless a newer write or a delete of the key overtook it. Under
// the key's lock, so a delete cannot fall between the check and the SSD append.
Store::WriteDownResult Store::WriteDown(const Pending& p) {
  std::lock_guard<std::mutex> key_lock(key_locks_[Stripe(p.key)]);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(p.key);
    if (it != pending_.end() && it->second.newest.seq > p.entry.seq) {
      stale_.fetch_add(1, std::memory_order_relaxed);
      return WriteDownResult::kOvertaken;
    }
  }
  bool written = true;
  if (p.to_ssd) {
    Status s = ssd_->Put(p.key, p.entry);
    if (!s.ok()) {
      written = false;
      lower_errors_.fetch_add(1, std::memory_order_relaxed);
      Log().warn("kvstore: SSD write-behind failed: {}", s.ToString());
    }
  }
  if (p.to_redis && skip_redis_.load(std::memory_order_relaxed)) {
    written = false;
    redis_writes_skipped_.fetch_add(1, std::memory_order_relaxed);
  } else if (p.to_redis) {
    Status s = redis_->Put(p.key, p.entry);
    if (!s.ok()) {
      written = false;
      lower_errors_.fetch_add(1, std::memory_order_relaxed);
      Log().debug("kvstore: Redis write-behind failed: {}", s.ToString());
    }
  }
  return written ? WriteDownResult::kWritten : WriteDownResult::kFailed;
}

void Store::WriteBehindLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (!paused_ && !queue_.empty()); });
    if (queue_.empty()) return;  // stop_ with nothing left
    Pending p = std::move(queue_.front());
    queue_.pop_front();
    ++in_flight_;
    lock.unlock();
    const WriteDownResult result = WriteDown(p);
    const bool written = result == WriteDownResult::kWritten;
    lock.lock();
    --in_flight_;
    // A tier that failed the write may still hold an older value of the key, which a GET that
    // misses the tiers above would serve: hide it until a later write of the key reaches it.
    if (result == WriteDownResult::kFailed) HideLowerLocked(p.key, p.entry.seq);
    queued_bytes_ -= QueueCharge(p.key, *p.entry.value);
    auto it = pending_.find(p.key);
    if (it != pending_.end() && --it->second.queued == 0) pending_.erase(it);
    // A write that reached every lower tier un-hides the key.
    auto h = hidden_.find(p.key);
    if (written && h != hidden_.end() && p.entry.seq >= h->second && (p.to_ssd || p.in_ssd || !ssd_) &&
        (p.to_redis || !redis_)) {
      hidden_.erase(h);
    }
    space_cv_.notify_all();
  }
}

void Store::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  space_cv_.wait(lock, [&] { return stop_ || (queue_.empty() && in_flight_ == 0); });
}

int64_t Store::FlushForShutdown(std::chrono::milliseconds redis_limit) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    const bool drained = space_cv_.wait_for(lock, redis_limit, [&] { return stop_ || (queue_.empty() && in_flight_ == 0); });
    if (drained) return redis_writes_skipped_.load();
  }
  skip_redis_.store(true);
  Flush();  // the SSD parts, and the one Redis write in flight (bounded by its timeout)
  return redis_writes_skipped_.load();
}

void Store::PauseWriteBehindForTesting(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = paused;
  }
  cv_.notify_all();
}

// Runs under the DRAM tier's lock, on the thread of a Put that may hold another key's lock, so it
// takes no key lock and never waits for room: a demotion that does not fit is dropped and the
// key's older lower-tier copies are hidden instead. The demotion goes ahead only if nothing
// newer of the key is known (a GET that began before a newer write may promote this entry
// back just before it is evicted again).
void Store::OnDramEvict(std::string key, Entry entry) {
  if (!ssd_) return;
  std::optional<uint64_t> in_ssd = ssd_->SeqOf(key);
  const int64_t bytes = QueueCharge(key, *entry.value);
  const size_t stripe = Stripe(key);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(key);
  if (it != pending_.end()) {
    if (it->second.newest.seq >= entry.seq) return;  // on its way down, or overtaken
    // Older writes of the key are still queued: from now on GET must serve this one instead.
    it->second.newest = entry;
  }
  if (in_ssd && *in_ssd >= entry.seq) return;  // already down (a persisted PUT)
  auto h = hidden_.find(key);
  if (h != hidden_.end() && h->second > entry.seq) return;  // overtaken by a write that skipped the queue
  if (deleted_seq_[stripe].load(std::memory_order_acquire) > entry.seq) {
    // This key, or another of its stripe, was deleted after the entry was written. Dropping the
    // demotion is always safe once older lower-tier copies are hidden.
    HideLowerLocked(key, entry.seq);
    return;
  }
  if (stop_ || (queued_bytes_ != 0 && queued_bytes_ + bytes > options_.write_behind_bytes)) {
    NoteUnqueuedLocked(key, entry);
    return;
  }
  demotions_.fetch_add(1, std::memory_order_relaxed);
  queued_bytes_ += bytes;
  PushLocked(Pending{std::move(key), std::move(entry), true, false, false});
}

bool Store::LowerEntryCurrent(std::string_view key, const Entry& e) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!hidden_.empty()) {
    auto h = hidden_.find(std::string(key));
    if (h != hidden_.end() && e.seq < h->second) return false;
  }
  return true;
}

Result<StoredValue> Store::Get(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  const size_t stripe = Stripe(key);
  const uint64_t writes_before = key_writes_[stripe].load(std::memory_order_acquire);
  Result<Entry> e = dram_->Get(key);
  if (e.ok()) return StoredValue{std::move(e->value), "dram"};
  uint64_t floor = 0;  // the lowest sequence number a lower tier may answer with
  {
    // Evicted from DRAM but not yet written down: the queued value is the newest.
    std::lock_guard<std::mutex> lock(mu_);
    const std::string k(key);
    auto it = pending_.find(k);
    if (it != pending_.end()) {
      const Entry& newest = it->second.newest;
      if (newest.value == nullptr || Expired(newest, NowUnixMs())) return Status::NotFound("kvstore: key not found");
      return StoredValue{newest.value, "dram"};
    }
    // Taken before the read: the writer un-hides a key once a newer write is down, which may be
    // after this GET read the older copy.
    auto h = hidden_.find(k);
    if (h != hidden_.end()) floor = h->second;
  }
  Tier* lower[2] = {ssd_.get(), redis_.get()};
  for (Tier* t : lower) {
    if (t == nullptr) continue;
    e = t->Get(key);
    if (e.ok()) {
      ObserveSeq(e->seq);
      if (e->seq < floor || !LowerEntryCurrent(key, *e)) return Status::NotFound("kvstore: key not found");
      Promote(key, stripe, writes_before, *e);
      return StoredValue{std::move(e->value), t->name()};
    }
    if (e.status().code() != StatusCode::kNotFound) {
      lower_errors_.fetch_add(1, std::memory_order_relaxed);
      Log().debug("kvstore: {} tier read failed: {}", t->name(), e.status().ToString());
    }
  }
  return Status::NotFound("kvstore: key not found");
}

// Copies a lower-tier hit into DRAM unless the key was written or deleted since the GET began
// (the newer write may have left DRAM already, and a delete leaves nothing for DRAM's own
// ordering to compare with), or a newer write of it is queued or on SSD.
void Store::Promote(std::string_view key, size_t stripe, uint64_t writes_before, const Entry& e) {
  std::lock_guard<std::mutex> key_lock(key_locks_[stripe]);
  if (key_writes_[stripe].load(std::memory_order_acquire) != writes_before) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(std::string(key));
    if (it != pending_.end() && it->second.newest.seq > e.seq) return;
  }
  if (ssd_) {
    std::optional<uint64_t> in_ssd = ssd_->SeqOf(key);
    if (in_ssd && *in_ssd > e.seq) return;
  }
  promotions_.fetch_add(1, std::memory_order_relaxed);
  (void)dram_->Put(key, e);  // too large for DRAM: served from below, not promoted
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
    const KeyState state = LocalState(keys[i]);
    if (state == KeyState::kQueued) continue;
    if (state == KeyState::kHidden) return static_cast<int>(i);
    if (ssd_) {
      Result<bool> in_ssd = ssd_->Contains(keys[i]);
      if (in_ssd.ok() && *in_ssd) continue;
    }
    break;
  }
  if (i == keys.size() || !redis_) return static_cast<int>(i);
  std::vector<std::string_view> rest(keys.begin() + static_cast<std::ptrdiff_t>(i), keys.end());
  std::vector<Result<bool>> remote = redis_->ContainsMany(rest);
  for (size_t r = 0; r < remote.size(); ++r) {
    if (!remote[r].ok()) {
      lower_errors_.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    if (!*remote[r] || LocalState(rest[r]) == KeyState::kHidden) break;
    ++i;
  }
  return static_cast<int>(i);
}

Store::KeyState Store::LocalState(std::string_view key) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.empty() && hidden_.empty()) return KeyState::kNone;
  const std::string k(key);
  auto it = pending_.find(k);
  if (it != pending_.end()) return it->second.newest.value != nullptr ? KeyState::kQueued : KeyState::kHidden;
  return hidden_.count(k) != 0 ? KeyState::kHidden : KeyState::kNone;
}

// Ordered like a write: queued writes of the key become stale, and the lower tiers keep a
// tombstone at this number so a late older write cannot bring the key back.
Status Store::Delete(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  const size_t stripe = Stripe(key);
  std::lock_guard<std::mutex> key_lock(key_locks_[stripe]);
  WriteCounted counted(key_writes_[stripe]);
  const uint64_t seq = NextSeq();
  // Before DRAM loses the key: an eviction callback still in flight must see the delete.
  deleted_seq_[stripe].store(seq, std::memory_order_release);
  KEEL_RETURN_IF_ERROR(dram_->Delete(key));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(std::string(key));
    if (it != pending_.end()) it->second.newest = Entry{nullptr, 0, seq};
  }
  if (ssd_) KEEL_RETURN_IF_ERROR(ssd_->DeleteAt(key, seq));
  if (redis_) KEEL_RETURN_IF_ERROR(redis_->DeleteAt(key, seq));
  std::lock_guard<std::mutex> lock(mu_);
  hidden_.erase(std::string(key));
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
  s.write_behind_stale = stale_.load(std::memory_order_relaxed);
  s.lower_tier_errors = lower_errors_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  s.write_behind_queued_bytes = queued_bytes_;
  s.hidden_keys = static_cast<int64_t>(hidden_.size());
  return s;
}

std::string Store::StatsJson() const {
  StoreStats s = Stats();
  nlohmann::json j;
  j["promotions"] = s.promotions;
  j["demotions"] = s.demotions;
  j["write_behind_queued_bytes"] = s.write_behind_queued_bytes;
  j["write_behind_skipped"] = s.write_behind_skipped;
  j["write_behind_stale"] = s.write_behind_stale;
  j["hidden_keys"] = s.hidden_keys;
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
                     {"stale_puts", t.stale_puts},
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
      {"keel_kvstore_tier_stale_puts_total", "Writes ignored per tier because it held a newer write of the key.",
       &TierStats::stale_puts, true},
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
  registry.AddCounter("keel_kvstore_write_behind_stale_total",
                      "Queued writes dropped because a newer write or a delete of the key overtook them.")
      .Get()
      .SetCallback([this] { return static_cast<double>(stale_.load()); });
  registry.AddGauge("keel_kvstore_write_behind_queued_bytes", "Bytes waiting for the SSD/Redis writer.")
      .Get()
      .SetCallback([this] {
        std::lock_guard<std::mutex> lock(mu_);
        return static_cast<double>(queued_bytes_);
      });
}

}  // namespace keel::kvstore

