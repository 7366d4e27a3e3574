#include "keel/vector/coloc/placement.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>

#include "keel/core/log.h"

namespace keel::vector::coloc {
namespace {

using Clock = std::chrono::steady_clock;

int64_t ElapsedMs(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// Dense view of the input: key i has bytes[i] and accesses[i] (queries that fetched it).
struct Keys {
  std::vector<uint64_t> key;
  std::vector<int64_t> bytes;
  std::vector<int64_t> accesses;
  std::vector<int> current;  // tier now, -1 unknown
  std::unordered_map<uint64_t, uint32_t> index;
};

Keys Prepare(const PlacementInput& input) {
  Keys k;
  k.key.reserve(input.keys.size());
  k.index.reserve(input.keys.size());
  for (size_t i = 0; i < input.keys.size(); ++i) {
    const auto& [key, bytes] = input.keys[i];
    if (!k.index.emplace(key, static_cast<uint32_t>(k.key.size())).second) continue;  // duplicate
    k.key.push_back(key);
    k.bytes.push_back(bytes);
    k.current.push_back(i < input.current.size() ? input.current[i] : -1);
  }
  k.accesses.assign(k.key.size(), 0);
  std::vector<uint32_t> seen;
  for (const auto& q : input.queries) {
    seen.clear();
    for (uint64_t key : q) {
      auto it = k.index.find(key);
      if (it != k.index.end()) seen.push_back(it->second);
    }
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (uint32_t i : seen) k.accesses[i]++;  // once per query, however often it lists a key
  }
  return k;
}

Status Validate(const PlacementInput& input, const Keys& k) {
  if (input.capacities.empty()) return Status::InvalidArgument("placement: no tiers");
  if (input.capacities.size() > static_cast<size_t>(kMaxTiers)) {
    return Status::InvalidArgument("placement: more than " + std::to_string(kMaxTiers) + " tiers");
  }
  bool unbounded = false;
  int64_t room = 0;
  for (int64_t c : input.capacities) {
    if (c < 0) return Status::InvalidArgument("placement: negative capacity");
    unbounded |= c == 0;
    room += c;
  }
  int64_t need = 0;
  for (int64_t b : k.bytes) {
    if (b <= 0) return Status::InvalidArgument("placement: key with no bytes");
    need += b;
  }
  if (!unbounded && need > room) {
    return Status::InvalidArgument("placement: " + std::to_string(need) + " bytes cannot fit tiers holding " +
                                   std::to_string(room));
  }
  return Status::Ok();
}

// Tier capacities being filled; 0 = unbounded. `order` lists tier indices fastest first.
class Bins {
 public:
  Bins(const std::vector<int64_t>& caps, const std::vector<int>& order) : cap_(caps), used_(caps.size(), 0) {
    order_ = order;
    if (order_.size() != cap_.size()) {
      order_.resize(cap_.size());
      std::iota(order_.begin(), order_.end(), 0);
    }
    rank_.resize(cap_.size());
    for (int r = 0; r < size(); ++r) rank_[order_[r]] = r;
  }
  int size() const { return static_cast<int>(cap_.size()); }
  bool Fits(int t, int64_t bytes) const { return cap_[t] == 0 || used_[t] + bytes <= cap_[t]; }
  // The fastest tier with room, starting at rank `from_rank`; -1 when none.
  int FirstFit(int64_t bytes, int from_rank = 0) const {
    for (int r = from_rank; r < size(); ++r) {
      if (Fits(order_[r], bytes)) return order_[r];
    }
    return -1;
  }
  void Add(int t, int64_t bytes) { used_[t] += bytes; }
  int64_t cap(int t) const { return cap_[t]; }
  const std::vector<int>& order() const { return order_; }
  int rank(int t) const { return rank_[t]; }

 private:
  std::vector<int64_t> cap_;
  std::vector<int64_t> used_;
  std::vector<int> order_, rank_;
};

Status PlaceKey(const Keys& k, uint32_t i, int t, Bins& bins, Placement& out) {
  if (t < 0) {
    return Status::InvalidArgument("placement: no tier has room for key " + std::to_string(k.key[i]) +
                                   " (first-fit left the remaining space fragmented)");
  }
  bins.Add(t, k.bytes[i]);
  out[k.key[i]] = t;
  return Status::Ok();
}

// Keys no query touched, after the accessed ones: each stays in its current tier if that still
// has room, else goes to the next slower tier with room, else anywhere (fastest first). Keys of
// unknown tier fill fastest first, in key order.
Status PlaceUnaccessed(const Keys& k, std::vector<uint32_t>& cold, Bins& bins, Placement& out) {
  std::sort(cold.begin(), cold.end(), [&](uint32_t a, uint32_t b) { return k.key[a] < k.key[b]; });
  std::vector<uint32_t> unknown;
  for (uint32_t i : cold) {
    const int cur = k.current[i];
    if (cur < 0 || cur >= bins.size()) {
      unknown.push_back(i);
      continue;
    }
    int t = bins.FirstFit(k.bytes[i], bins.rank(cur));
    if (t < 0) t = bins.FirstFit(k.bytes[i]);
    KEEL_RETURN_IF_ERROR(PlaceKey(k, i, t, bins, out));
  }
  for (uint32_t i : unknown) KEEL_RETURN_IF_ERROR(PlaceKey(k, i, bins.FirstFit(k.bytes[i]), bins, out));
  return Status::Ok();
}

// Hottest first; ties by key so that the result is deterministic.
void SortByAccesses(const Keys& k, std::vector<uint32_t>& ids) {
  std::sort(ids.begin(), ids.end(), [&](uint32_t a, uint32_t b) {
    if (k.accesses[a] != k.accesses[b]) return k.accesses[a] > k.accesses[b];
    return k.key[a] < k.key[b];
  });
}

// The baseline: each modality is its own collection, ranked by its own accesses, and gets the
// modality's byte share of every tier. This is what splits a query's text and image vectors: an
// item's text vector ranks among texts, its image vector among images, and the two ranks differ.
Result<Placement> PlaceByFrequency(const PlacementInput& input, const Keys& k) {
  Bins bins(input.capacities, input.order);
  Placement out;
  out.reserve(k.key.size());
  std::array<int64_t, 2> modality_bytes{};
  int64_t total = 0;
  for (size_t i = 0; i < k.key.size(); ++i) {
    modality_bytes[static_cast<int>(ModalityOf(k.key[i]))] += k.bytes[i];
    total += k.bytes[i];
  }
  std::array<std::vector<uint32_t>, 2> hot;
  std::vector<uint32_t> cold;
  for (uint32_t i = 0; i < k.key.size(); ++i) {
    if (k.accesses[i] > 0) {
      hot[static_cast<int>(ModalityOf(k.key[i]))].push_back(i);
    } else {
      cold.push_back(i);
    }
  }
  for (int m = 0; m < 2; ++m) {
    const double share = total > 0 ? static_cast<double>(modality_bytes[m]) / static_cast<double>(total) : 0;
    std::vector<int64_t> budget(bins.size()), used(bins.size(), 0);
    for (int t = 0; t < bins.size(); ++t) {
      budget[t] = bins.cap(t) == 0 ? std::numeric_limits<int64_t>::max()
                                   : static_cast<int64_t>(static_cast<double>(bins.cap(t)) * share);
    }
    SortByAccesses(k, hot[m]);
    for (uint32_t i : hot[m]) {
      int t = -1;
      for (int c : bins.order()) {
        if (used[c] + k.bytes[i] <= budget[c] && bins.Fits(c, k.bytes[i])) {
          t = c;
          break;
        }
      }
      if (t < 0) t = bins.FirstFit(k.bytes[i]);  // rounding left the share short: any room will do
      if (t >= 0) used[t] += k.bytes[i];
      KEEL_RETURN_IF_ERROR(PlaceKey(k, i, t, bins, out));
    }
  }
  KEEL_RETURN_IF_ERROR(PlaceUnaccessed(k, cold, bins, out));
  return out;
}

// Union-find over dense key ids, tracking each group's bytes.
class Groups {
 public:
  explicit Groups(const std::vector<int64_t>& bytes) : parent_(bytes.size()), bytes_(bytes) {
    std::iota(parent_.begin(), parent_.end(), 0u);
  }
  uint32_t Find(uint32_t x) {
    while (parent_[x] != x) {
      parent_[x] = parent_[parent_[x]];
      x = parent_[x];
    }
    return x;
  }
  // Merges the groups of a and b unless the result would exceed `cap` bytes.
  void MergeUnder(uint32_t a, uint32_t b, int64_t cap) {
    a = Find(a);
    b = Find(b);
    if (a == b || bytes_[a] + bytes_[b] > cap) return;
    if (a > b) std::swap(a, b);
    parent_[b] = a;
    bytes_[a] += bytes_[b];
  }

 private:
  std::vector<uint32_t> parent_;
  std::vector<int64_t> bytes_;
};

// Queries up to this many keys contribute every pair as an edge; larger ones a path over their
// sorted keys. A clique is O(k^2) edges (a 40-key multimodal fetch would add 780), while the
// union-find only needs the query connected; sorting makes an item's text and image keys
// (VectorKey(i, text) + 1 == VectorKey(i, image)) neighbours on the path, and an identical
// query repeated adds weight to identical edges.
constexpr size_t kCliqueMaxKeys = 8;

// Co-access edges as (weight, a, b), heaviest first.
std::vector<std::tuple<int64_t, uint32_t, uint32_t>> CoAccessEdges(const PlacementInput& input, const Keys& k) {
  std::vector<uint64_t> pairs;  // a << 32 | b, a < b; counted by sorting
  std::vector<uint32_t> ids;
  for (const auto& q : input.queries) {
    ids.clear();
    for (uint64_t key : q) {
      auto it = k.index.find(key);
      if (it != k.index.end()) ids.push_back(it->second);
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    if (ids.size() <= kCliqueMaxKeys) {
      for (size_t a = 0; a < ids.size(); ++a) {
        for (size_t b = a + 1; b < ids.size(); ++b) pairs.push_back(uint64_t{ids[a]} << 32 | ids[b]);
      }
    } else {
      for (size_t a = 0; a + 1 < ids.size(); ++a) pairs.push_back(uint64_t{ids[a]} << 32 | ids[a + 1]);
    }
  }
  std::sort(pairs.begin(), pairs.end());
  std::vector<std::tuple<int64_t, uint32_t, uint32_t>> edges;
  for (size_t i = 0; i < pairs.size();) {
    size_t j = i;
    while (j < pairs.size() && pairs[j] == pairs[i]) ++j;
    edges.emplace_back(static_cast<int64_t>(j - i), static_cast<uint32_t>(pairs[i] >> 32),
                       static_cast<uint32_t>(pairs[i]));
    i = j;
  }
  std::sort(edges.begin(), edges.end(), [](const auto& x, const auto& y) {
    if (std::get<0>(x) != std::get<0>(y)) return std::get<0>(x) > std::get<0>(y);
    return std::make_pair(std::get<1>(x), std::get<2>(x)) < std::make_pair(std::get<1>(y), std::get<2>(y));
  });
  return edges;
}

// CoLoc. Why this heuristic (greedy agglomeration under a byte cap, then first-fit packing):
//   * The objective is "a query's keys share a tier", i.e. the co-access graph cut into pieces
//     that each fit a tier. Merging along edges heaviest first (Kruskal-style union-find) keeps
//     the pairs fetched together most often in one group; the byte cap stops the giant
//     component that popular items would otherwise glue together, so every group can be placed
//     whole in one tier.
//   * Cost is O(E log E) in the log's edges (E ~ sum of query sizes with the path edges), i.e.
//     near-linear in the log; it runs every few seconds on a 100k-query window.
//   * It is capacity-aware by construction, and the number of groups falls out of the data.
//     METIS-style multilevel k-way partitioning cuts fewer edges but needs the number of parts
//     up front, balances part sizes instead of filling tiers of very different sizes, and is a
//     heavier dependency and run time for a decision that is re-made online anyway.
//   * The cap is a quarter of the smallest bounded tier: groups up to a whole tier would make
//     first-fit packing waste up to half of it (bin packing with large items); a quarter keeps
//     the waste small and still holds a few hundred queries' worth of keys.
// Groups are then ordered by accesses per byte (what a byte of the fast tier buys) and packed
// fastest tier first; a group that fits nowhere whole (only when tiers are nearly full) is split
// key by key, hottest first.
Result<Placement> PlaceCoLoc(const PlacementInput& input, const Keys& k) {
  Bins bins(input.capacities, input.order);
  int64_t cap = std::numeric_limits<int64_t>::max();
  for (int64_t c : input.capacities) {
    if (c > 0) cap = std::min(cap, c / 4);
  }
  cap = std::max(cap, k.bytes.empty() ? int64_t{0} : *std::max_element(k.bytes.begin(), k.bytes.end()));

  Groups uf(k.bytes);
  for (const auto& [w, a, b] : CoAccessEdges(input, k)) uf.MergeUnder(a, b, cap);

  struct Group {
    std::vector<uint32_t> members;
    int64_t bytes = 0;
    int64_t accesses = 0;
    uint64_t first_key = 0;
  };
  std::unordered_map<uint32_t, size_t> by_root;
  std::vector<Group> groups;
  for (uint32_t i = 0; i < k.key.size(); ++i) {
    const uint32_t r = uf.Find(i);
    auto [it, fresh] = by_root.emplace(r, groups.size());
    if (fresh) groups.emplace_back().first_key = k.key[i];
    Group& g = groups[it->second];
    g.members.push_back(i);
    g.bytes += k.bytes[i];
    g.accesses += k.accesses[i];
    g.first_key = std::min(g.first_key, k.key[i]);
  }
  std::sort(groups.begin(), groups.end(), [](const Group& x, const Group& y) {
    // accesses/bytes compared by cross-multiplying (exact; no division)
    const __int128 lhs = static_cast<__int128>(x.accesses) * y.bytes;
    const __int128 rhs = static_cast<__int128>(y.accesses) * x.bytes;
    if (lhs != rhs) return lhs > rhs;
    if (x.accesses != y.accesses) return x.accesses > y.accesses;
    return x.first_key < y.first_key;
  });

  Placement out;
  out.reserve(k.key.size());
  std::vector<uint32_t> cold;  // never-accessed keys (singleton groups) go last, and stay put
  for (Group& g : groups) {
    if (g.accesses == 0) {
      cold.insert(cold.end(), g.members.begin(), g.members.end());
      continue;
    }
    const int t = bins.FirstFit(g.bytes);
    if (t >= 0) {
      for (uint32_t i : g.members) KEEL_RETURN_IF_ERROR(PlaceKey(k, i, t, bins, out));
      continue;
    }
    SortByAccesses(k, g.members);
    for (uint32_t i : g.members) KEEL_RETURN_IF_ERROR(PlaceKey(k, i, bins.FirstFit(k.bytes[i]), bins, out));
  }
  KEEL_RETURN_IF_ERROR(PlaceUnaccessed(k, cold, bins, out));
  return out;
}

}  // namespace

Result<PlacementPolicy> ParsePlacementPolicy(std::string_view name) {
  if (name == "frequency") return PlacementPolicy::kFrequency;
  if (name == "coloc") return PlacementPolicy::kCoLoc;
  return Status::InvalidArgument("placement: unknown policy '" + std::string(name) + "' (frequency | coloc)");
}

std::string_view PlacementPolicyName(PlacementPolicy p) {
  return p == PlacementPolicy::kFrequency ? "frequency" : "coloc";
}

QueryLog::QueryLog(size_t capacity, size_t max_keys) : capacity_(capacity), max_keys_(max_keys) {}

void QueryLog::Append(std::span<const uint64_t> keys) {
  if (capacity_ == 0 || keys.size() > max_keys_) {
    std::lock_guard<std::mutex> lock(mu_);
    total_++;
    return;
  }
  std::vector<uint64_t> q(keys.begin(), keys.end());  // copied before taking the lock
  std::lock_guard<std::mutex> lock(mu_);
  total_++;
  while (!window_.empty() && (window_.size() == capacity_ || keys_ + q.size() > max_keys_)) {
    keys_ -= window_.front().size();
    window_.pop_front();
  }
  keys_ += q.size();
  window_.push_back(std::move(q));
}

std::vector<std::vector<uint64_t>> QueryLog::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {window_.begin(), window_.end()};
}

size_t QueryLog::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return window_.size();
}

void QueryLog::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  window_.clear();
  keys_ = 0;
}

uint64_t QueryLog::total_appended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

std::vector<int> TierOrder(const TieredStore& store) {
  const std::vector<TierUsage> usage = store.Usage();
  std::vector<int> order(usage.size());
  std::iota(order.begin(), order.end(), 0);
  bool measured = !usage.empty();
  for (const auto& u : usage) measured &= u.measured_batch_us > 0;
  if (measured) {
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return usage[a].measured_batch_us < usage[b].measured_batch_us; });
  }
  return order;
}

Result<Placement> ComputePlacement(PlacementPolicy policy, const PlacementInput& input) {
  const Keys k = Prepare(input);
  KEEL_RETURN_IF_ERROR(Validate(input, k));
  return policy == PlacementPolicy::kFrequency ? PlaceByFrequency(input, k) : PlaceCoLoc(input, k);
}

double CrossTierFraction(const Placement& placement, const std::vector<std::vector<uint64_t>>& queries) {
  int64_t counted = 0, cross = 0;
  for (const auto& q : queries) {
    uint32_t mask = 0;
    for (uint64_t key : q) {
      auto it = placement.find(key);
      if (it != placement.end()) mask |= 1u << it->second;
    }
    if (mask == 0) continue;
    counted++;
    cross += (mask & (mask - 1)) != 0;
  }
  return counted == 0 ? 0.0 : static_cast<double>(cross) / static_cast<double>(counted);
}

Placer::Placer(TieredStore* store, QueryLog* log, PlacerOptions options)
    : store_(store), log_(log), options_(options) {}

Placer::~Placer() { Stop(); }

void Placer::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread(&Placer::Loop, this);
}

void Placer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Placer::Stopping() {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_;
}

Result<uint64_t> Placer::RunOnce() {
  std::lock_guard<std::mutex> round(round_mu_);
  return Round(/*interruptible=*/false);
}

PlacerStats Placer::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Placer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(options_.interval_ms), [&] { return stop_; });
    if (stop_) break;
    lock.unlock();
    {
      std::lock_guard<std::mutex> round(round_mu_);
      if (log_->total_appended() - last_total_ >= options_.min_new_queries) {
        Result<uint64_t> moved = Round(/*interruptible=*/true);
        if (!moved.ok()) Log().warn("coloc placer: {}", moved.status().ToString());
      }
    }
    lock.lock();
  }
}

Result<uint64_t> Placer::Round(bool interruptible) {
  auto t0 = Clock::now();
  const uint64_t total = log_->total_appended();
  PlacementInput input;
  input.queries = log_->Snapshot();
  const std::vector<TieredStore::StoredKey> inventory = store_->Inventory();
  input.keys.reserve(inventory.size());
  input.current.reserve(inventory.size());
  for (const auto& s : inventory) {
    input.keys.emplace_back(s.key, s.bytes);
    input.current.push_back(s.tier);
  }
  input.capacities = store_->Capacities();
  if (!options_.measure_tiers) {
    input.order.resize(input.capacities.size());
    std::iota(input.order.begin(), input.order.end(), 0);
  } else {
    input.order = TierOrder(*store_);
  }
  if (options_.measure_tiers && !measured_) {  // the first round measures the tiers, so that hot data goes where reads are fastest
    const Status m = store_->MeasureLatency(20);
    if (!m.ok()) Log().warn("coloc placer: measuring tier latency: {}", m.ToString());
    measured_ = true;
    input.order = TierOrder(*store_);
  }
  KEEL_ASSIGN_OR_RETURN(Placement placement, ComputePlacement(options_.policy, input));
  const int64_t compute_ms = ElapsedMs(t0);

  struct PlannedMove {
    uint64_t key;
    int from, to;
  };
  std::vector<PlannedMove> moves;
  for (const auto& s : inventory) {
    auto it = placement.find(s.key);
    if (it != placement.end() && it->second != s.tier) moves.push_back({s.key, s.tier, it->second});
  }
  // Out of a tier before into it: demotions first, slowest source first (SSD -> cold frees the
  // SSD room that DRAM -> SSD then needs), which empties the fast tiers of what no longer
  // belongs there; then promotions, into DRAM first (which frees SSD room for cold -> SSD).
  // Whatever still finds its target full is retried in the next pass, after the other moves
  // have freed space, and counted as skipped after the last.
  std::vector<int> rank(input.capacities.size());
  for (size_t r = 0; r < input.order.size(); ++r) rank[input.order[r]] = static_cast<int>(r);
  std::stable_sort(moves.begin(), moves.end(), [&](const PlannedMove& a, const PlannedMove& b) {
    const bool ad = rank[a.to] > rank[a.from], bd = rank[b.to] > rank[b.from];
    if (ad != bd) return ad;
    return ad ? rank[a.from] > rank[b.from] : rank[a.to] < rank[b.to];
  });

  t0 = Clock::now();
  uint64_t moved = 0, errors = 0;
  size_t since_yield = 0;
  bool stopped = false;
  // The unbounded (last) tier, if any, is where a demotion parks when its target is full.
  int spill = -1;
  if (!input.capacities.empty() && input.capacities.back() == 0) spill = static_cast<int>(input.capacities.size()) - 1;
  for (int pass = 0; pass < 4 && !moves.empty() && !stopped; ++pass) {
    std::vector<PlannedMove> full;
    const uint64_t moved_before_pass = moved;
    for (const PlannedMove& mv : moves) {
      if (++since_yield >= std::max<size_t>(options_.batch, 1)) {
        since_yield = 0;
        if (interruptible && Stopping()) {
          stopped = true;
          break;
        }
        std::this_thread::yield();  // each Move holds only its key's lock; this just spreads load
      }
      const Status s = store_->Move(mv.key, mv.to);
      if (s.ok()) {
        moved++;
      } else if (s.code() == StatusCode::kResourceExhausted && rank[mv.to] > rank[mv.from] && spill >= 0 &&
                 spill != mv.to && spill != mv.from) {
        // Every bounded tier is full, so a demotion and the promotion that would free its room
        // wait on each other. Park the key in the unbounded tier (freeing its old slot for the
        // promotions) and finish the move from there in the next pass.
        const Status parked = store_->Move(mv.key, spill);
        if (parked.ok()) {
          moved++;
          full.push_back({mv.key, spill, mv.to});
        } else if (parked.code() != StatusCode::kNotFound) {
          errors++;
          Log().warn("coloc placer: {}", parked.ToString());
        }
      } else if (s.code() == StatusCode::kResourceExhausted) {
        full.push_back(mv);
      } else if (s.code() != StatusCode::kNotFound) {  // NotFound: removed meanwhile
        errors++;
        Log().warn("coloc placer: {}", s.ToString());
      }
    }
    if (moved == moved_before_pass) {
      moves = std::move(full);
      break;  // no progress
    }
    moves = std::move(full);
  }

  std::lock_guard<std::mutex> lock(mu_);
  last_total_ = total;
  stats_.rounds++;
  stats_.moves += moved;
  stats_.move_errors += errors;
  if (!stopped) stats_.skipped_full += moves.size();
  stats_.last_compute_ms = compute_ms;
  stats_.last_migrate_ms = ElapsedMs(t0);
  return moved;
}

}  // namespace keel::vector::coloc
