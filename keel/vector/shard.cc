#include "keel/vector/shard.h"

#include <faiss/utils/distances.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

#include "keel/core/dir_lock.h"
#include "keel/core/log.h"
#include "keel/vector/index.h"
#include "keel/vector/records.h"
#include "keel/vector/snapshot.h"
#include "keel/vector/wal.h"

namespace keel::vector {

using coloc::FetchTrace;
using coloc::Modality;
using coloc::ItemOf;
using coloc::VectorKey;

Result<IndexKind> ParseIndexKind(std::string_view name) {
  if (name == "hnsw") return IndexKind::kHnsw;
  if (name == "ivf-flat") return IndexKind::kIvfFlat;
  if (name == "ivf-pq") return IndexKind::kIvfPq;
  return Status::InvalidArgument("unknown index \"" + std::string(name) + "\" (hnsw, ivf-flat, ivf-pq)");
}

std::string_view IndexKindName(IndexKind kind) {
  switch (kind) {
    case IndexKind::kHnsw: return "hnsw";
    case IndexKind::kIvfFlat: return "ivf-flat";
    case IndexKind::kIvfPq: return "ivf-pq";
  }
  return "unknown";
}

namespace {

// Item ids are shifted left once to make vector keys, so the top bit is not available.
constexpr uint64_t kMaxItemId = (uint64_t{1} << 63) - 1;
constexpr uint64_t kNoItem = ~uint64_t{0};
// Keys per Fetch when the shard reads vectors for itself (snapshot, rebuild).
constexpr size_t kBulkFetch = 4096;
constexpr int kMaxEf = 1 << 16;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void MergeTrace(FetchTrace* into, const FetchTrace& t) {
  into->tier_mask |= t.tier_mask;
  for (int i = 0; i < coloc::kMaxTiers; ++i) {
    into->keys_per_tier[i] += t.keys_per_tier[i];
    into->ns_per_tier[i] += t.ns_per_tier[i];
  }
  into->total_ns += t.total_ns;
  into->tiers_touched = std::popcount(into->tier_mask);
}

float L2(const std::vector<float>& a, const std::vector<float>& b) {
  return faiss::fvec_L2sqr(a.data(), b.data(), a.size());
}

}  // namespace

Status CheckVector(const std::vector<float>& v, int dim, const char* what, const std::string& where) {
  if (static_cast<int>(v.size()) != dim) {
    return Status::InvalidArgument(where + ": " + what + " has " + std::to_string(v.size()) + " values, expected " + std::to_string(dim));
  }
  double squared = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) return Status::InvalidArgument(where + ": " + what + "[" + std::to_string(i) + "] is not finite");
    squared += static_cast<double>(v[i]) * v[i];
  }
  // |a - b|^2 <= 2 (|a|^2 + |b|^2): with each squared length at most FLT_MAX / 4 every distance
  // stays finite in float32. Beyond that, distances overflowed to inf (null in JSON) and the
  // order among them was arbitrary.
  constexpr double kMaxSquaredLength = std::numeric_limits<float>::max() / 4.0;
  if (squared > kMaxSquaredLength) {
    return Status::InvalidArgument(where + ": " + what + " is too long (squared length " + std::to_string(squared) +
                                   " over " + std::to_string(kMaxSquaredLength) + "): distances would overflow float32");
  }
  return Status::Ok();
}

class Shard::Impl {
 public:
  struct Meta {
    int64_t label = -1;
    bool has_image = false;
    std::map<std::string, std::string> attributes;
  };

  explicit Impl(const ShardOptions& o) : options(o), log(o.query_log_window) {}

  Status Open();
  Status Upsert(std::span<const Item> items, std::optional<uint64_t> version, WriteOutcome* outcome);
  Status Delete(std::span<const uint64_t> ids, std::optional<uint64_t> version, WriteOutcome* outcome);
  Result<SearchResult> Search(const SearchRequest& request);
  Status Snapshot();
  ShardStats Stats() const;
  uint64_t version() const { return version_.load(std::memory_order_acquire); }
  Status ReadLog(uint64_t after, size_t max_bytes, LogRead* out) const;
  Status ApplyLog(std::string_view stream, LogApplied* out);

  DirLock dir_lock;  // first in, last out: held while anything below may write to the directory
  ShardOptions options;
  std::unique_ptr<coloc::TieredStore> store;
  coloc::QueryLog log;

 private:
  std::string SnapshotPath() const { return options.dir + "/shard.snap"; }
  std::string WalPath() const { return options.dir + "/wal.log"; }
  Status ValidateItems(std::span<const Item> items) const;
  Status ValidateRequest(const SearchRequest& r) const;
  Status LoadSnapshot();
  Status ApplyRecord(std::string_view payload);
  void RollBackVectors(std::span<const Item> stored, const std::vector<uint64_t>& old_keys,
                       const std::vector<std::vector<float>>& old_vectors, bool can_restore);
  // Caller holds write_mu_. Whether a write carrying `version` applies now: OK (outcome->version
  // set) with *apply true, or duplicate (OK, *apply false), or gap (Unavailable).
  Status CheckVersion(std::optional<uint64_t> version, WriteOutcome* outcome, bool* apply) const;
  // Caller holds write_mu_ and validated the write. Logs `record`, runs `apply` under mu_ and
  // advances the version. An apply error with `rollback` takes the record back out of the log
  // (the write is refused and consumes no version); without it the record stays and counts.
  Status Commit(std::string_view record, const std::function<Status()>& apply, bool rollback);
  // Both apply to memory and the tiers only; the caller holds mu_ exclusively.
  Status ApplyUpsert(std::span<const Item> items);
  Status ApplyDelete(std::span<const uint64_t> ids);
  Status MaybeRebuild();
  // Reads the vectors of `keys` in bulk (not logged as a query).
  Status FetchAll(const std::vector<uint64_t>& keys, std::vector<std::vector<float>>* out);
  Status Fetch(const std::vector<uint64_t>& keys, std::vector<std::vector<float>>* out, SearchResult* result,
               std::vector<uint64_t>* logged);
  Status SearchText(const SearchRequest& r, SearchResult* out, std::vector<uint64_t>* logged);
  Status LookupImages(const SearchRequest& r, SearchResult* out, std::vector<uint64_t>* logged);

  mutable std::mutex write_mu_;   // one writer (log append + apply), log reader or snapshot at a time
  mutable std::shared_mutex mu_;  // applying a write: exclusive; searches, snapshot: shared
  std::unique_ptr<TextIndex> index_;
  std::vector<uint64_t> label_ids_;  // label -> item id (kNoItem once tombstoned)
  std::unordered_map<uint64_t, Meta> items_;
  std::unique_ptr<Wal> wal_;
  std::atomic<int64_t> searches_{0}, cross_tier_{0};
  // Changed under write_mu_ (version_ also under mu_ held exclusively, so a search reads the
  // version of the state it searched); read anywhere.
  std::atomic<uint64_t> version_{0};
  std::atomic<uint64_t> log_start_{0};  // version of the last snapshot; the log holds later ones
  uint32_t epoch_ = 0;                  // write_mu_: tag of the log's current records
  std::vector<int64_t> log_offsets_;    // write_mu_: log offset of version log_start_ + 1 + i
};

Status Shard::Impl::Open() {
  if (options.dir.empty()) return Status::InvalidArgument("vector shard: dir is required");
  if (options.text_dim < 1 || options.text_dim > 65536) return Status::InvalidArgument("vector shard: text_dim must be in [1, 65536]");
  if (options.image_dim < 1 || options.image_dim > 65536) return Status::InvalidArgument("vector shard: image_dim must be in [1, 65536]");
  if (options.max_k < 1) return Status::InvalidArgument("vector shard: max_k must be >= 1");
  if (options.rerank < 0) return Status::InvalidArgument("vector shard: rerank must be >= 0");
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return Status::IOError(options.dir + ": cannot create: " + ec.message());
  // Two shards writing one directory each overwrite the other's log and snapshot.
  KEEL_ASSIGN_OR_RETURN(dir_lock, DirLock::Acquire(options.dir, "shard.lock", "vector shard"));
  KEEL_ASSIGN_OR_RETURN(store, coloc::TieredStore::Open(options.tiers));
  if (std::filesystem::exists(SnapshotPath())) {
    // Every snapshot leaves a log beside it (emptied, then appended to): without one, the writes
    // acknowledged since the snapshot are gone, and starting would hide that.
    if (!std::filesystem::exists(WalPath())) {
      return Status::Corruption(WalPath() + " is missing beside " + SnapshotPath() +
                                ": the writes acknowledged after the snapshot would be lost. To start from the "
                                "snapshot alone, create an empty " + WalPath());
    }
    KEEL_RETURN_IF_ERROR(LoadSnapshot());
  } else {
    KEEL_ASSIGN_OR_RETURN(index_, TextIndex::Create(options.index, options.text_dim));
  }
  WalReplay replay;
  KEEL_ASSIGN_OR_RETURN(wal_, Wal::Open(WalPath(), options.wal_sync, [this](std::string_view p) { return ApplyRecord(p); },
                                        &replay, epoch_));
  log_offsets_ = std::move(replay.offsets);
  version_ = log_start_ + static_cast<uint64_t>(replay.records);
  if (index_->NeedsTraining()) {  // the log brought an IVF shard past its training size
    KEEL_RETURN_IF_ERROR(index_->BuildTrained());
    index_->InstallTrained();
  }
  KEEL_RETURN_IF_ERROR(MaybeRebuild());
  Log().info("vector shard {}: {} items, index version {}, {} WAL records replayed{}", options.dir, items_.size(),
             version_.load(), replay.records,
             replay.torn_bytes > 0 ? ", torn tail of " + std::to_string(replay.torn_bytes) + " bytes cut" : "");
  return Status::Ok();
}

Status Shard::Impl::LoadSnapshot() {
  SnapshotInfo info;
  Status s = ReadSnapshot(
      SnapshotPath(), &info,
      [&](std::string_view bytes) -> Status {
        KEEL_ASSIGN_OR_RETURN(index_, TextIndex::Load(options.index, options.text_dim, bytes));
        label_ids_.assign(index_->size(), kNoItem);
        return Status::Ok();
      },
      [&](int64_t label, Item&& item) -> Status {
        if (label < 0 || label >= index_->size() || !index_->IsLive(label)) {
          return Status::Corruption(SnapshotPath() + ": item " + std::to_string(item.id) + " has bad label " + std::to_string(label));
        }
        KEEL_RETURN_IF_ERROR(store->Put(VectorKey(item.id, Modality::kText), item.text));
        if (!item.image.empty()) KEEL_RETURN_IF_ERROR(store->Put(VectorKey(item.id, Modality::kImage), item.image));
        label_ids_[label] = item.id;
        items_[item.id] = Meta{label, !item.image.empty(), std::move(item.attributes)};
        return Status::Ok();
      });
  if (!s.ok()) return s;
  if (info.text_dim != options.text_dim || info.image_dim != options.image_dim) {
    return Status::InvalidArgument(SnapshotPath() + ": stored dims " + std::to_string(info.text_dim) + "/" +
                                   std::to_string(info.image_dim) + " differ from the options' " +
                                   std::to_string(options.text_dim) + "/" + std::to_string(options.image_dim));
  }
  log_start_ = info.index_version;
  epoch_ = info.log_epoch;
  return Status::Ok();
}

Status Shard::Impl::ApplyRecord(std::string_view payload) {
  KEEL_ASSIGN_OR_RETURN(auto rec, DecodeRecord(payload));
  if (rec.type == RecordType::kUpsert) {
    // Checked as a request is: a log written under other dims (a restart with another
    // --text-dim) would otherwise put vectors of the wrong length in the index.
    const Status valid = ValidateItems(rec.items);
    if (!valid.ok()) {
      return Status::Corruption("a logged upsert does not fit this shard (" + valid.message() +
                                "); was the directory written with other dims?");
    }
    return ApplyUpsert(rec.items);
  }
  return ApplyDelete(rec.ids);
}

Status Shard::Impl::ValidateItems(std::span<const Item> items) const {
  std::unordered_set<uint64_t> seen;
  seen.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const std::string where = "items[" + std::to_string(i) + "] (id " + std::to_string(it.id) + ")";
    if (it.id > kMaxItemId) return Status::InvalidArgument(where + ": id must be < 2^63");
    if (!seen.insert(it.id).second) return Status::InvalidArgument(where + ": duplicate id in one batch");
    KEEL_RETURN_IF_ERROR(CheckVector(it.text, options.text_dim, "text", where));
    if (!it.image.empty()) KEEL_RETURN_IF_ERROR(CheckVector(it.image, options.image_dim, "image", where));
  }
  return Status::Ok();
}

Status Shard::Impl::CheckVersion(std::optional<uint64_t> version, WriteOutcome* outcome, bool* apply) const {
  const uint64_t cur = version_.load(std::memory_order_relaxed);
  *outcome = WriteOutcome{cur};
  *apply = false;
  if (version.has_value() && *version <= cur) {
    outcome->duplicate = true;
    return Status::Ok();
  }
  if (version.has_value() && *version > cur + 1) {
    outcome->gap = true;
    return Status::Unavailable("stale: replica at version " + std::to_string(cur) + ", write is version " + std::to_string(*version));
  }
  *apply = true;
  return Status::Ok();
}

Status Shard::Impl::Commit(std::string_view record, const std::function<Status()>& apply, bool rollback) {
  const int64_t at = wal_->bytes();
  KEEL_RETURN_IF_ERROR(wal_->Append(record));
  std::unique_lock lock(mu_);
  const Status applied = apply();
  if (!applied.ok() && rollback) {
    // Not acknowledged, so it must not come back on replay (where it could fail again, e.g. a
    // full tier, and keep the shard from opening).
    if (Status t = wal_->TruncateTo(at); !t.ok()) Log().error("vector shard: {}", t.ToString());
    return applied;
  }
  // The record stays in the log, so it counts: replay will count it too.
  log_offsets_.push_back(at);
  version_.fetch_add(1, std::memory_order_release);
  if (index_->NeedsTraining()) {
    // IVF training takes seconds to a minute: searches keep running over the exact buffer
    // meanwhile (write_mu_ keeps every other writer, and so every change to it, out).
    lock.unlock();
    const Status trained = index_->BuildTrained();
    lock.lock();
    if (trained.ok()) {
      index_->InstallTrained();
    } else {  // the write is durable and applied; searches stay exact and the next write retries
      Log().error("vector shard {}: {}", options.dir, trained.ToString());
    }
  }
  // Like training: the write is durable and applied, so a failed rebuild (its vectors could not
  // all be read back) does not make it fail; the next write retries.
  if (const Status rebuilt = MaybeRebuild(); !rebuilt.ok()) {
    Log().error("vector shard {}: index rebuild: {}", options.dir, rebuilt.ToString());
  }
  return applied;
}

Status Shard::Impl::Upsert(std::span<const Item> items, std::optional<uint64_t> version, WriteOutcome* outcome) {
  *outcome = WriteOutcome{version_.load(std::memory_order_relaxed)};
  KEEL_RETURN_IF_ERROR(ValidateItems(items));
  const std::string record = EncodeUpsert(items);
  // Writers apply in log order (write_mu_), but searches keep running during the fsync.
  std::lock_guard write(write_mu_);
  bool apply = false;
  KEEL_RETURN_IF_ERROR(CheckVersion(version, outcome, &apply));
  if (!apply) return Status::Ok();
  Status s = Commit(record, [&] { return ApplyUpsert(items); }, /*rollback=*/true);
  outcome->version = version_.load(std::memory_order_relaxed);
  return s;
}

Status Shard::Impl::Delete(std::span<const uint64_t> ids, std::optional<uint64_t> version, WriteOutcome* outcome) {
  const std::string record = EncodeDelete(ids);
  std::lock_guard write(write_mu_);
  bool apply = false;
  KEEL_RETURN_IF_ERROR(CheckVersion(version, outcome, &apply));
  if (!apply) return Status::Ok();
  // Once logged, a delete has happened (a tier that cannot drop the bytes only leaks them).
  Status s = Commit(record, [&] { return ApplyDelete(ids); }, /*rollback=*/false);
  outcome->version = version_.load(std::memory_order_relaxed);
  return s;
}

Status Shard::Impl::ReadLog(uint64_t after, size_t max_bytes, LogRead* out) const {
  *out = LogRead{};
  // Holding write_mu_ keeps appends, roll-backs and the snapshot's truncation away from the
  // bytes being read; searches do not take it.
  std::lock_guard write(write_mu_);
  const uint64_t start = log_start_.load(std::memory_order_relaxed);
  out->version = version_.load(std::memory_order_relaxed);
  out->log_start = start;
  if (after < start) {
    out->truncated = true;
    return Status::NotFound("log starts after version " + std::to_string(start));
  }
  if (after >= out->version) return Status::Ok();
  const size_t first = static_cast<size_t>(after - start);
  if (first >= log_offsets_.size()) return Status::Internal("vector shard: log index holds fewer records than versions");
  const int64_t log_end = wal_->bytes();
  auto end_of = [&](size_t i) { return i + 1 < log_offsets_.size() ? log_offsets_[i + 1] : log_end; };
  size_t last = first;  // exclusive
  size_t bytes = 0;
  while (last < log_offsets_.size()) {
    const size_t rec = static_cast<size_t>(end_of(last) - log_offsets_[last]) - Wal::kHeaderBytes + kLogRecordOverhead;
    if (last > first && bytes + rec > max_bytes) break;
    bytes += rec;
    ++last;
  }
  out->bytes.reserve(bytes);
  uint64_t v = after;
  KEEL_RETURN_IF_ERROR(wal_->Read(log_offsets_[first], end_of(last - 1), [&](std::string_view payload) {
    AppendLogRecord(++v, payload, &out->bytes);
    return Status::Ok();
  }));
  out->records = v - after;
  return Status::Ok();
}

Status Shard::Impl::ApplyLog(std::string_view stream, LogApplied* out) {
  *out = LogApplied{};
  std::lock_guard write(write_mu_);
  out->version = version_.load(std::memory_order_relaxed);
  std::string_view in = stream;
  while (!in.empty()) {
    const size_t at = stream.size() - in.size();
    uint64_t v = 0;
    std::string_view payload;
    if (Status s = NextLogRecord(&in, at, &v, &payload); !s.ok()) return Status::InvalidArgument(s.message());
    const uint64_t cur = version_.load(std::memory_order_relaxed);
    if (v <= cur) {
      ++out->skipped;
      continue;
    }
    if (v > cur + 1) {
      out->gap = true;
      return Status::Unavailable("stale: replica at version " + std::to_string(cur) + ", write is version " + std::to_string(v));
    }
    const std::string where = "log record at byte " + std::to_string(at) + " (version " + std::to_string(v) + "): ";
    auto rec = DecodeRecord(payload);
    if (!rec.ok()) return Status::InvalidArgument(where + rec.status().message());
    Status s;
    if (rec->type == RecordType::kUpsert) {
      if (Status bad = ValidateItems(rec->items); !bad.ok()) return Status::InvalidArgument(where + bad.message());
      s = Commit(payload, [&] { return ApplyUpsert(rec->items); }, /*rollback=*/true);
    } else {
      s = Commit(payload, [&] { return ApplyDelete(rec->ids); }, /*rollback=*/false);
    }
    out->version = version_.load(std::memory_order_relaxed);
    if (out->version == v) ++out->applied;
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// Undoes the vectors a refused upsert stored: new ids' are removed, replaced ids' get their old
// vectors back (old_keys[i] held old_vectors[i]), and an image the batch added to an item that had
// none is removed.
void Shard::Impl::RollBackVectors(std::span<const Item> stored, const std::vector<uint64_t>& old_keys,
                                  const std::vector<std::vector<float>>& old_vectors, bool can_restore) {
  // A map, not a scan per item: a refused batch of n replacements would otherwise cost n².
  std::unordered_map<uint64_t, const std::vector<float>*> old_by_key;
  if (can_restore) {
    old_by_key.reserve(old_keys.size());
    for (size_t k = 0; k < old_keys.size(); ++k) old_by_key.emplace(old_keys[k], &old_vectors[k]);
  }
  auto old_vector = [&](uint64_t key) -> const std::vector<float>* {
    auto found = old_by_key.find(key);
    return found == old_by_key.end() ? nullptr : found->second;
  };
  for (const Item& it : stored) {
    auto meta = items_.find(it.id);
    if (meta == items_.end()) {  // a new id: nothing to keep (absent keys are fine to remove)
      (void)store->Remove(VectorKey(it.id, Modality::kText));
      (void)store->Remove(VectorKey(it.id, Modality::kImage));
      continue;
    }
    for (Modality m : {Modality::kText, Modality::kImage}) {
      const bool had = m == Modality::kText || meta->second.has_image;
      const bool wrote = m == Modality::kText || !it.image.empty();
      const uint64_t key = VectorKey(it.id, m);
      Status s;
      if (!had) {
        if (wrote) s = store->Remove(key);  // an image this batch added to an item that had none
      } else if (const std::vector<float>* v = old_vector(key)) {
        if (wrote) s = store->Put(key, *v);
      } else if (wrote) {
        s = Status::Unavailable("its old bytes were unreadable before the write");
      }
      if (!s.ok()) {
        Log().error("vector shard {}: item {}'s old {} vector could not be restored after a refused write ({}); "
                    "the tier holds the refused write's bytes",
                    options.dir, it.id, m == Modality::kText ? "text" : "image", s.ToString());
      }
    }
  }
}

Status Shard::Impl::ApplyUpsert(std::span<const Item> items) {
  // Vectors first: a tier that refuses one leaves the index and the label map untouched, so
  // labels stay aligned with the index whatever fails. The vectors of items this batch replaces
  // are read first, so a refused batch can put them back: the index still holds the old vector,
  // and search results, reranking and restarts must all see the old bytes.
  std::vector<uint64_t> old_keys;
  for (const Item& it : items) {
    auto old = items_.find(it.id);
    if (old == items_.end()) continue;
    old_keys.push_back(VectorKey(it.id, Modality::kText));
    if (old->second.has_image) old_keys.push_back(VectorKey(it.id, Modality::kImage));
  }
  std::vector<std::vector<float>> old_vectors;
  bool can_restore = true;
  if (!old_keys.empty()) {
    if (Status s = FetchAll(old_keys, &old_vectors); !s.ok()) {
      // A tier that lost an old vector must not block the write that replaces it.
      can_restore = false;
      Log().warn("vector shard {}: replaced items' old vectors unreadable ({}); a refused batch cannot restore them",
                 options.dir, s.ToString());
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    Status s = store->Put(VectorKey(it.id, Modality::kText), it.text);
    if (s.ok() && !it.image.empty()) s = store->Put(VectorKey(it.id, Modality::kImage), it.image);
    if (s.ok()) continue;
    RollBackVectors(items.first(i + 1), old_keys, old_vectors, can_restore);
    return s;
  }
  // From here the write is applied: a failure that only leaks bytes is logged, not returned
  // (Commit would roll back the log of a write that queries already see).
  std::vector<float> text;
  text.reserve(items.size() * options.text_dim);
  int64_t label = index_->size();
  for (const Item& it : items) {
    auto old = items_.find(it.id);
    if (old != items_.end()) {
      index_->Tombstone(old->second.label);
      label_ids_[old->second.label] = kNoItem;
      if (old->second.has_image && it.image.empty()) {
        if (Status s = store->Remove(VectorKey(it.id, Modality::kImage)); !s.ok()) {
          Log().warn("vector shard {}: item {}'s old image vector was not dropped (its bytes leak): {}", options.dir,
                     it.id, s.ToString());
        }
      }
    }
    text.insert(text.end(), it.text.begin(), it.text.end());
    items_[it.id] = Meta{label++, !it.image.empty(), it.attributes};
    label_ids_.push_back(it.id);
  }
  return index_->Add(text.data(), static_cast<int64_t>(items.size()), /*defer_training=*/true);
}

Status Shard::Impl::ApplyDelete(std::span<const uint64_t> ids) {
  for (uint64_t id : ids) {
    auto it = items_.find(id);
    if (it == items_.end()) continue;
    const bool has_image = it->second.has_image;
    index_->Tombstone(it->second.label);
    label_ids_[it->second.label] = kNoItem;
    items_.erase(it);
    // The item is gone for every query already; a tier that fails to drop the bytes only
    // leaks them (reported, never served).
    Status s = store->Remove(VectorKey(id, Modality::kText));
    if (s.ok() && has_image) s = store->Remove(VectorKey(id, Modality::kImage));
    if (!s.ok()) Log().warn("vector shard {}: deleted item {}'s vectors were not dropped (their bytes leak): {}", options.dir, id, s.ToString());
  }
  return Status::Ok();  // deleted for every query, and logged: the client must hear so
}

Status Shard::Impl::FetchAll(const std::vector<uint64_t>& keys, std::vector<std::vector<float>>* out) {
  out->clear();
  out->reserve(keys.size());
  std::vector<std::vector<float>> part;
  for (size_t i = 0; i < keys.size(); i += kBulkFetch) {
    const size_t n = std::min(kBulkFetch, keys.size() - i);
    KEEL_RETURN_IF_ERROR(store->Fetch(std::span<const uint64_t>(keys.data() + i, n), &part));
    for (auto& v : part) out->push_back(std::move(v));
  }
  return Status::Ok();
}

// Tombstones cost search time (HNSW still walks them) and memory; once they are a quarter of
// the index, rebuild it from the live vectors. The rebuilt index's labels are dense again.
Status Shard::Impl::MaybeRebuild() {
  const int64_t dead = index_->tombstones();
  if (dead < 1024 || dead * 4 < index_->size()) return Status::Ok();
  const int64_t t0 = NowNs();
  std::vector<uint64_t> ids, keys;
  ids.reserve(items_.size());
  for (uint64_t id : label_ids_) {
    if (id != kNoItem) ids.push_back(id);
  }
  keys.reserve(ids.size());
  for (uint64_t id : ids) keys.push_back(VectorKey(id, Modality::kText));
  std::vector<std::vector<float>> vecs;
  KEEL_RETURN_IF_ERROR(FetchAll(keys, &vecs));
  std::vector<float> flat;
  flat.reserve(ids.size() * options.text_dim);
  for (const auto& v : vecs) flat.insert(flat.end(), v.begin(), v.end());
  KEEL_ASSIGN_OR_RETURN(auto fresh, TextIndex::Create(options.index, options.text_dim));
  KEEL_RETURN_IF_ERROR(fresh->Add(flat.data(), static_cast<int64_t>(ids.size())));
  index_ = std::move(fresh);
  label_ids_ = ids;
  for (size_t l = 0; l < ids.size(); ++l) items_[ids[l]].label = static_cast<int64_t>(l);
  Log().info("vector shard {}: rebuilt the index without {} tombstones ({} live) in {} ms", options.dir, dead,
             ids.size(), (NowNs() - t0) / 1000000);
  return Status::Ok();
}

Status Shard::Impl::ValidateRequest(const SearchRequest& r) const {
  if (r.k < 1 || r.k > options.max_k) {
    return Status::InvalidArgument("k must be in [1, " + std::to_string(options.max_k) + "], got " + std::to_string(r.k));
  }
  if (r.ef < 0 || r.ef > kMaxEf) return Status::InvalidArgument("ef must be in [0, " + std::to_string(kMaxEf) + "]");
  if (r.nprobe < 0 || r.nprobe > (1 << 20)) return Status::InvalidArgument("nprobe must be in [0, 2^20]");
  if (const int most = std::max(options.max_k, options.rerank); r.rerank < -1 || r.rerank > most) {
    return Status::InvalidArgument("rerank must be in [-1, " + std::to_string(most) + "], got " + std::to_string(r.rerank));
  }
  if (r.kind == QueryKind::kImage) {
    if (r.ids.empty()) return Status::InvalidArgument("an image lookup needs ids");
    if (static_cast<int>(r.ids.size()) > options.max_k) {
      return Status::InvalidArgument("an image lookup takes at most " + std::to_string(options.max_k) + " ids");
    }
    return Status::Ok();
  }
  KEEL_RETURN_IF_ERROR(CheckVector(r.text_query, options.text_dim, "text", "query"));
  if (!r.image_query.empty()) {
    if (r.kind != QueryKind::kMultimodal) return Status::InvalidArgument("query: an image vector needs kind multimodal");
    KEEL_RETURN_IF_ERROR(CheckVector(r.image_query, options.image_dim, "image", "query"));
  }
  return Status::Ok();
}

Status Shard::Impl::Fetch(const std::vector<uint64_t>& keys, std::vector<std::vector<float>>* out, SearchResult* result,
                          std::vector<uint64_t>* logged) {
  if (keys.empty()) {
    out->clear();
    return Status::Ok();
  }
  FetchTrace trace;
  const int64_t t0 = NowNs();
  Status s = store->Fetch(keys, out, &trace);
  result->fetch_ns += NowNs() - t0;
  MergeTrace(&result->trace, trace);
  logged->insert(logged->end(), keys.begin(), keys.end());
  return s;
}

Status Shard::Impl::SearchText(const SearchRequest& r, SearchResult* out, std::vector<uint64_t>* logged) {
  std::function<bool(int64_t)> accept = [&](int64_t label) {
    const uint64_t id = label_ids_[label];
    if (id == kNoItem) return false;
    auto it = items_.find(id);
    if (it == items_.end()) return false;
    for (const auto& [k, v] : r.filter) {
      auto a = it->second.attributes.find(k);
      if (a == it->second.attributes.end() || a->second != v) return false;
    }
    return true;
  };
  IndexSearchParams p;
  p.k = std::max(r.k, r.rerank < 0 ? options.rerank : r.rerank);
  p.ef = r.ef;
  p.nprobe = r.nprobe;
  p.accept = r.filter.empty() ? nullptr : &accept;
  const int64_t t0 = NowNs();
  KEEL_ASSIGN_OR_RETURN(auto ann, index_->Search(r.text_query.data(), p));
  out->search_ns = NowNs() - t0;

  // Rerank the candidates by exact distance on their full-precision vectors from the tiers.
  std::vector<uint64_t> keys;
  for (const auto& h : ann) keys.push_back(VectorKey(label_ids_[h.label], Modality::kText));
  // When every candidate is a hit (no rerank beyond k), a multimodal query knows its image keys
  // already: one Fetch reads both modalities, one batched read per tier, which is what
  // co-locating an item's vectors pays off on.
  const bool one_fetch = r.kind == QueryKind::kMultimodal && static_cast<int>(ann.size()) <= r.k;
  const size_t n_text = keys.size();
  if (one_fetch) {
    for (const auto& h : ann) {
      const uint64_t id = label_ids_[h.label];
      if (items_.at(id).has_image) keys.push_back(VectorKey(id, Modality::kImage));
    }
  }
  std::vector<std::vector<float>> text;
  KEEL_RETURN_IF_ERROR(Fetch(keys, &text, out, logged));
  std::unordered_map<uint64_t, std::vector<float>> prefetched;  // id -> image vector
  for (size_t i = n_text; i < keys.size(); ++i) prefetched.emplace(ItemOf(keys[i]), std::move(text[i]));
  text.resize(n_text);
  std::vector<SearchHit> hits(ann.size());
  for (size_t i = 0; i < ann.size(); ++i) {
    hits[i].id = label_ids_[ann[i].label];
    hits[i].text_distance = L2(text[i], r.text_query);
    if (r.include_vectors) hits[i].text = std::move(text[i]);
  }
  auto by_text = [](const SearchHit& a, const SearchHit& b) {
    return a.text_distance < b.text_distance || (a.text_distance == b.text_distance && a.id < b.id);
  };
  std::sort(hits.begin(), hits.end(), by_text);
  if (static_cast<int>(hits.size()) > r.k) hits.resize(r.k);

  if (r.kind == QueryKind::kMultimodal) {
    std::vector<uint64_t> image_keys;
    std::vector<size_t> which;
    for (size_t i = 0; i < hits.size(); ++i) {
      if (items_.at(hits[i].id).has_image) {
        image_keys.push_back(VectorKey(hits[i].id, Modality::kImage));
        which.push_back(i);
      }
    }
    std::vector<std::vector<float>> images;
    if (one_fetch) {
      for (uint64_t key : image_keys) images.push_back(std::move(prefetched.at(ItemOf(key))));
    } else {
      KEEL_RETURN_IF_ERROR(Fetch(image_keys, &images, out, logged));
    }
    std::vector<bool> has(hits.size(), false);
    for (size_t j = 0; j < which.size(); ++j) {
      SearchHit& h = hits[which[j]];
      has[which[j]] = true;
      if (!r.image_query.empty()) h.image_distance = L2(images[j], r.image_query);
      if (r.include_vectors) h.image = std::move(images[j]);
    }
    if (!r.image_query.empty()) {
      // Items without an image vector rank after every item with one.
      std::vector<size_t> order(hits.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) -> bool {
        if (has[a] != has[b]) return has[a];
        if (!has[a]) return false;
        return hits[a].image_distance < hits[b].image_distance ||
               (hits[a].image_distance == hits[b].image_distance && hits[a].id < hits[b].id);
      });
      std::vector<SearchHit> sorted;
      sorted.reserve(hits.size());
      for (size_t i : order) sorted.push_back(std::move(hits[i]));
      hits = std::move(sorted);
    }
  }
  out->hits = std::move(hits);
  return Status::Ok();
}

Status Shard::Impl::LookupImages(const SearchRequest& r, SearchResult* out, std::vector<uint64_t>* logged) {
  // Unknown ids and items without an image vector are left out of the answer.
  std::vector<uint64_t> keys, ids;
  std::unordered_set<uint64_t> seen;
  for (uint64_t id : r.ids) {
    auto it = items_.find(id);
    if (it == items_.end() || !it->second.has_image || !seen.insert(id).second) continue;
    keys.push_back(VectorKey(id, Modality::kImage));
    ids.push_back(id);
  }
  std::vector<std::vector<float>> images;
  KEEL_RETURN_IF_ERROR(Fetch(keys, &images, out, logged));
  for (size_t i = 0; i < ids.size(); ++i) {
    SearchHit h;
    h.id = ids[i];
    h.image = std::move(images[i]);  // a lookup returns the vectors: that is what it is for
    out->hits.push_back(std::move(h));
  }
  return Status::Ok();
}

Result<SearchResult> Shard::Impl::Search(const SearchRequest& r) {
  KEEL_RETURN_IF_ERROR(ValidateRequest(r));
  SearchResult out;
  std::vector<uint64_t> logged;
  {
    std::shared_lock lock(mu_);
    out.index_version = version_.load(std::memory_order_acquire);
    Status s = r.kind == QueryKind::kImage ? LookupImages(r, &out, &logged) : SearchText(r, &out, &logged);
    if (!s.ok()) return s;
  }
  // One record per query: placement learns which keys are read together.
  if (!logged.empty()) log.Append(logged);
  searches_.fetch_add(1, std::memory_order_relaxed);
  if (out.trace.tiers_touched > 1) cross_tier_.fetch_add(1, std::memory_order_relaxed);
  return out;
}

Status Shard::Impl::Snapshot() {
  // No writer may log or apply while the snapshot is taken (the log is truncated after it);
  // searches only read, so they continue.
  std::lock_guard write(write_mu_);
  std::shared_lock lock(mu_);
  const int64_t t0 = NowNs();
  KEEL_ASSIGN_OR_RETURN(std::string index_bytes, index_->Save());
  // Records logged from here on belong to the next epoch: a restart that finds this snapshot
  // skips any older record a crash left in the log, since the snapshot holds it.
  SnapshotInfo info{options.text_dim, options.image_dim, options.index.kind, items_.size(),
                    version_.load(std::memory_order_relaxed), epoch_ + 1};
  KEEL_ASSIGN_OR_RETURN(auto writer, SnapshotWriter::Create(SnapshotPath(), info, index_bytes));
  index_bytes.clear();
  index_bytes.shrink_to_fit();
  // Items in label order, fetched from the tiers in bulk.
  std::vector<uint64_t> ids;
  ids.reserve(items_.size());
  for (uint64_t id : label_ids_) {
    if (id != kNoItem) ids.push_back(id);
  }
  std::vector<std::vector<float>> vecs;
  for (size_t i = 0; i < ids.size(); i += kBulkFetch / 2) {
    const size_t n = std::min(kBulkFetch / 2, ids.size() - i);
    std::vector<uint64_t> keys;
    std::vector<int> image_at(n, -1);
    for (size_t j = 0; j < n; ++j) {
      keys.push_back(VectorKey(ids[i + j], Modality::kText));
      if (items_.at(ids[i + j]).has_image) {
        image_at[j] = static_cast<int>(keys.size());
        keys.push_back(VectorKey(ids[i + j], Modality::kImage));
      }
    }
    KEEL_RETURN_IF_ERROR(store->Fetch(keys, &vecs));
    size_t at = 0;
    for (size_t j = 0; j < n; ++j) {
      const Meta& m = items_.at(ids[i + j]);
      Item item;
      item.id = ids[i + j];
      item.text = std::move(vecs[at++]);
      if (image_at[j] >= 0) item.image = std::move(vecs[at++]);
      item.attributes = m.attributes;
      KEEL_RETURN_IF_ERROR(writer->AddItem(m.label, item));
    }
  }
  const Status finished = writer->Finish();
  if (!writer->installed()) return finished;
  // The snapshot may be what a restart reads now, whatever else failed: the log moves to its
  // epoch (and is emptied: the snapshot holds all of it).
  epoch_ = info.log_epoch;
  log_start_.store(info.index_version, std::memory_order_relaxed);
  log_offsets_.clear();
  const Status reset = wal_->Reset(epoch_);
  KEEL_RETURN_IF_ERROR(finished);
  KEEL_RETURN_IF_ERROR(reset);
  Log().info("vector shard {}: snapshot of {} items in {} ms", options.dir, ids.size(), (NowNs() - t0) / 1000000);
  return Status::Ok();
}

ShardStats Shard::Impl::Stats() const {
  ShardStats s;
  {
    std::shared_lock lock(mu_);
    s.items = static_cast<int64_t>(items_.size());
    s.deleted_pending = index_->tombstones();
  }
  s.wal_bytes = wal_->bytes();
  s.searches = searches_.load(std::memory_order_relaxed);
  s.cross_tier_searches = cross_tier_.load(std::memory_order_relaxed);
  s.index_version = version_.load(std::memory_order_acquire);
  s.log_start_version = log_start_.load(std::memory_order_relaxed);
  s.tiers = store->Usage();
  return s;
}

Result<std::unique_ptr<Shard>> Shard::Open(const ShardOptions& options) {
  std::unique_ptr<Shard> shard(new Shard());
  shard->impl_ = std::make_unique<Impl>(options);
  KEEL_RETURN_IF_ERROR(shard->impl_->Open());
  return shard;
}

Shard::~Shard() = default;

Status Shard::Upsert(std::span<const Item> items) { return Upsert(items, std::nullopt, nullptr); }
Status Shard::Delete(std::span<const uint64_t> ids) { return Delete(ids, std::nullopt, nullptr); }
Status Shard::Upsert(std::span<const Item> items, std::optional<uint64_t> version, WriteOutcome* outcome) {
  WriteOutcome ignored;
  return impl_->Upsert(items, version, outcome != nullptr ? outcome : &ignored);
}
Status Shard::Delete(std::span<const uint64_t> ids, std::optional<uint64_t> version, WriteOutcome* outcome) {
  WriteOutcome ignored;
  return impl_->Delete(ids, version, outcome != nullptr ? outcome : &ignored);
}
uint64_t Shard::version() const { return impl_->version(); }
Status Shard::ReadLog(uint64_t after, size_t max_bytes, LogRead* out) const { return impl_->ReadLog(after, max_bytes, out); }
Status Shard::ApplyLog(std::string_view stream, LogApplied* out) {
  LogApplied ignored;
  return impl_->ApplyLog(stream, out != nullptr ? out : &ignored);
}
Result<SearchResult> Shard::Search(const SearchRequest& request) { return impl_->Search(request); }
Status Shard::Snapshot() { return impl_->Snapshot(); }
ShardStats Shard::Stats() const { return impl_->Stats(); }
const ShardOptions& Shard::options() const { return impl_->options; }
coloc::TieredStore& Shard::store() { return *impl_->store; }
coloc::QueryLog& Shard::query_log() { return impl_->log; }

}  // namespace keel::vector
