#include "keel/kvstore/eviction.h"

#include <algorithm>
#include <functional>
#include <string>
#include <unordered_map>

#include "keel/core/hash.h"

namespace keel::kvstore {

Result<EvictionKind> ParseEvictionKind(std::string_view name) {
  if (name == "lru") return EvictionKind::kLru;
  if (name == "s3fifo") return EvictionKind::kS3Fifo;
  if (name == "arc") return EvictionKind::kArc;
  return Status::InvalidArgument("kvstore: unknown eviction policy '" + std::string(name) +
                                 "' (expected lru, s3fifo or arc)");
}

std::string_view EvictionKindName(EvictionKind kind) {
  switch (kind) {
    case EvictionKind::kLru: return "lru";
    case EvictionKind::kS3Fifo: return "s3fifo";
    case EvictionKind::kArc: return "arc";
  }
  return "unknown";
}

namespace {

// One tracked key. Nodes live inside the policy's hash map (whose elements never move), and the
// queues link them intrusively, so moving a key between queues never allocates.
struct Node {
  Node* prev = nullptr;
  Node* next = nullptr;
  const std::string* key = nullptr;  // the map's own key
  int64_t bytes = 0;
  uint8_t queue = 0;  // which queue holds the node; meaning is per policy
  uint8_t freq = 0;   // S3-FIFO's 2-bit access counter
};

// Doubly linked queue with a sentinel. "Newest" is the MRU end / FIFO head, "oldest" the
// LRU end / FIFO tail. Tracks the bytes and count of what it holds.
class Queue {
 public:
  Queue() { sentinel_.prev = sentinel_.next = &sentinel_; }
  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  bool empty() const { return count_ == 0; }
  int64_t bytes() const { return bytes_; }
  int64_t count() const { return count_; }
  Node* oldest() const { return empty() ? nullptr : sentinel_.prev; }

  void PushNewest(Node* n) {
    n->prev = &sentinel_;
    n->next = sentinel_.next;
    sentinel_.next->prev = n;
    sentinel_.next = n;
    bytes_ += n->bytes;
    ++count_;
  }
  void Remove(Node* n) {
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = nullptr;
    bytes_ -= n->bytes;
    --count_;
  }
  void MoveToNewest(Node* n) {
    Remove(n);
    PushNewest(n);
  }
  // Changes the charge of a node this queue holds, keeping its position.
  void Resize(Node* n, int64_t bytes) {
    bytes_ += bytes - n->bytes;
    n->bytes = bytes;
  }

 private:
  Node sentinel_;
  int64_t bytes_ = 0;
  int64_t count_ = 0;
};

struct KeyHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return static_cast<size_t>(Xxh3_64(s.data(), s.size())); }
};

// The key -> node map and the resident totals every policy shares. `latest_` is the node of the
// latest Insert, which Victim() must not hand out while other keys are resident (see the header);
// an Access ends that protection.
class PolicyBase : public EvictionPolicy {
 public:
  int64_t bytes() const override { return resident_bytes_; }
  int64_t size() const override { return resident_count_; }

 protected:
  Node* Find(std::string_view key) {
    auto it = nodes_.find(key);
    return it == nodes_.end() ? nullptr : &it->second;
  }
  Node* Add(std::string_view key, int64_t bytes, uint8_t queue) {
    auto [it, inserted] = nodes_.try_emplace(std::string(key));
    Node* n = &it->second;
    n->key = &it->first;
    n->bytes = bytes;
    n->queue = queue;
    n->freq = 0;
    return n;
  }
  // Drops the node (already unlinked from its queue) and hands its key out without a copy.
  std::string Forget(Node* n) {
    if (n == latest_) latest_ = nullptr;
    auto handle = nodes_.extract(nodes_.find(*n->key));
    return std::move(handle.key());
  }
  void AddResident(int64_t bytes, int64_t count) {
    resident_bytes_ += bytes;
    resident_count_ += count;
  }

  std::unordered_map<std::string, Node, KeyHash, std::equal_to<>> nodes_;
  Node* latest_ = nullptr;

 private:
  int64_t resident_bytes_ = 0;
  int64_t resident_count_ = 0;
};

// ---- LRU -----------------------------------------------------------------------------------

class LruPolicy final : public PolicyBase {
 public:
  std::string_view name() const override { return "lru"; }

  void Insert(std::string_view key, int64_t bytes) override {
    Node* n = Find(key);
    if (n != nullptr) {
      AddResident(bytes - n->bytes, 0);
      lru_.Resize(n, bytes);
      lru_.MoveToNewest(n);
    } else {
      n = Add(key, bytes, 0);
      lru_.PushNewest(n);
      AddResident(bytes, 1);
    }
    latest_ = n;
  }
  void Access(std::string_view key) override {
    latest_ = nullptr;
    if (Node* n = Find(key)) lru_.MoveToNewest(n);
  }
  void Erase(std::string_view key) override {
    Node* n = Find(key);
    if (n == nullptr) return;
    lru_.Remove(n);
    AddResident(-n->bytes, -1);
    Forget(n);
  }
  std::optional<std::string> Victim() override {
    // The latest insert is the newest, so the oldest is it only when it is alone.
    Node* n = lru_.oldest();
    if (n == nullptr) return std::nullopt;
    lru_.Remove(n);
    AddResident(-n->bytes, -1);
    return Forget(n);
  }

 private:
  Queue lru_;
};

// ---- S3-FIFO -------------------------------------------------------------------------------
//
// Small FIFO S (10% of capacity) admits new keys; main FIFO M holds keys that proved themselves;
// ghost FIFO G remembers keys recently evicted from S (keys only, no values). A hit only bumps a
// 2-bit counter (no list move: "lazy promotion"). Evicting from S: a key re-accessed while in S
// moves to M, otherwise it leaves the cache and enters G ("quick demotion" of one-hit wonders).
// Evicting from M: a key with freq > 0 is reinserted at M's head with freq - 1, otherwise it
// leaves. A miss on a key in G is admitted straight into M.
// Byte-aware choices: S is "full" at 10% of capacity in bytes; G is bounded by M's share of the
// capacity in (remembered) bytes, the byte analogue of the paper's "as many entries as M".
// A key is promoted from S after one re-access (the paper's text; its pseudo-code reads
// freq > 1) and enters M with freq 0.

class S3FifoPolicy final : public PolicyBase {
 public:
  explicit S3FifoPolicy(int64_t capacity_bytes)
      : small_target_(std::max<int64_t>(1, capacity_bytes / 10)),
        ghost_limit_(std::max<int64_t>(1, capacity_bytes - capacity_bytes / 10)) {}

  std::string_view name() const override { return "s3fifo"; }

  void Insert(std::string_view key, int64_t bytes) override {
    Node* n = Find(key);
    if (n == nullptr) {
      n = Add(key, bytes, kSmall);
      small_.PushNewest(n);
      AddResident(bytes, 1);
    } else if (n->queue == kGhost) {
      ghost_.Remove(n);
      n->bytes = bytes;
      n->freq = 0;
      n->queue = kMain;
      main_.PushNewest(n);
      AddResident(bytes, 1);
    } else {
      AddResident(bytes - n->bytes, 0);
      QueueOf(n).Resize(n, bytes);
      Bump(n);
    }
    latest_ = n;
  }

  void Access(std::string_view key) override {
    latest_ = nullptr;
    Node* n = Find(key);
    if (n != nullptr && n->queue != kGhost) Bump(n);
  }

  void Erase(std::string_view key) override {
    Node* n = Find(key);
    if (n == nullptr) return;
    if (n->queue != kGhost) AddResident(-n->bytes, -1);
    QueueOf(n).Remove(n);
    Forget(n);
  }

  std::optional<std::string> Victim() override {
    while (!small_.empty() || !main_.empty()) {
      bool from_small = !small_.empty() && (small_.bytes() >= small_target_ || main_.empty());
      Queue* q = from_small ? &small_ : &main_;
      Node* t = q->oldest();
      if (t == latest_) {
        // Never hand out the latest insert while anything else is resident: skip it once
        // around its queue, or take from the other queue when it is alone in this one.
        if (q->count() > 1) {
          q->MoveToNewest(t);
          continue;
        }
        Queue* other = from_small ? &main_ : &small_;
        if (!other->empty()) {
          from_small = !from_small;
          q = other;
          t = q->oldest();
        }
      }

      if (from_small) {
        small_.Remove(t);
        if (t->freq >= kPromoteFreq) {
          t->freq = 0;
          t->queue = kMain;
          main_.PushNewest(t);
          continue;
        }
        AddResident(-t->bytes, -1);
        t->queue = kGhost;
        ghost_.PushNewest(t);
        std::string key = *t->key;  // copied: the node stays behind as a ghost
        if (t == latest_) latest_ = nullptr;
        TrimGhost();
        return key;
      }

      if (t->freq > 0) {
        --t->freq;
        main_.MoveToNewest(t);
        continue;
      }
      main_.Remove(t);
      AddResident(-t->bytes, -1);
      return Forget(t);
    }
    return std::nullopt;
  }

 private:
  enum : uint8_t { kSmall, kMain, kGhost };
  static constexpr uint8_t kMaxFreq = 3;
  static constexpr uint8_t kPromoteFreq = 1;

  Queue& QueueOf(Node* n) { return n->queue == kSmall ? small_ : n->queue == kMain ? main_ : ghost_; }
  static void Bump(Node* n) {
    if (n->freq < kMaxFreq) ++n->freq;
  }
  void TrimGhost() {
    while (ghost_.bytes() > ghost_limit_) {
      Node* g = ghost_.oldest();
      ghost_.Remove(g);
      Forget(g);
    }
  }

  const int64_t small_target_;
  const int64_t ghost_limit_;
  Queue small_, main_, ghost_;
};

// ---- ARC -----------------------------------------------------------------------------------
//
// T1: resident keys seen once recently; T2: resident keys seen at least twice. B1/B2: ghosts of
// keys evicted from T1/T2. p is the adaptive target for T1's share. A hit moves a key to T2's
// MRU end; a miss that hits B1 grows p (recency was undervalued), one that hits B2 shrinks it.
// Victim() evicts T1's LRU when T1 exceeds p (or equals it after a B2 hit), else T2's LRU.
// Byte-aware approximations of the page-count original: sizes, p and the deltas are in bytes
// (delta = size of the key * max(1, |B_other| / |B_hit|) in bytes); the directory bounds become
// |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c in bytes, enforced by dropping ghost LRUs after
// each insert and eviction; evicted keys always enter their ghost list first (the original drops
// T1's LRU outright when B1 is empty and T1 fills c - the trim then drops it from B1 at once).

class ArcPolicy final : public PolicyBase {
 public:
  explicit ArcPolicy(int64_t capacity_bytes) : capacity_(std::max<int64_t>(1, capacity_bytes)) {}

  std::string_view name() const override { return "arc"; }

  void Insert(std::string_view key, int64_t bytes) override {
    last_hit_b2_ = false;
    Node* n = Find(key);
    if (n == nullptr) {
      n = Add(key, bytes, kT1);
      t1_.PushNewest(n);
      AddResident(bytes, 1);
    } else if (n->queue == kB1 || n->queue == kB2) {
      const bool in_b1 = n->queue == kB1;
      Queue& hit = in_b1 ? b1_ : b2_;
      const Queue& other = in_b1 ? b2_ : b1_;
      hit.Remove(n);
      const double ratio = hit.bytes() > 0 ? static_cast<double>(other.bytes()) / hit.bytes() : 1.0;
      const int64_t delta = static_cast<int64_t>(static_cast<double>(bytes) * std::max(1.0, ratio));
      p_ = in_b1 ? std::min(capacity_, p_ + delta) : std::max<int64_t>(0, p_ - delta);
      last_hit_b2_ = !in_b1;
      n->bytes = bytes;
      n->queue = kT2;
      t2_.PushNewest(n);
      AddResident(bytes, 1);
    } else {
      AddResident(bytes - n->bytes, 0);
      QueueOf(n).Resize(n, bytes);
      Promote(n);
    }
    latest_ = n;
    TrimGhosts();
  }

  void Access(std::string_view key) override {
    latest_ = nullptr;
    last_hit_b2_ = false;
    Node* n = Find(key);
    if (n != nullptr && (n->queue == kT1 || n->queue == kT2)) Promote(n);
  }

  void Erase(std::string_view key) override {
    Node* n = Find(key);
    if (n == nullptr) return;
    if (n->queue == kT1 || n->queue == kT2) AddResident(-n->bytes, -1);
    QueueOf(n).Remove(n);
    Forget(n);
  }

  std::optional<std::string> Victim() override {
    if (t1_.empty() && t2_.empty()) return std::nullopt;
    bool from_t1 = !t1_.empty() && (t2_.empty() || t1_.bytes() > p_ || (last_hit_b2_ && t1_.bytes() >= p_));
    // A list whose LRU is the latest insert holds nothing else: take from the other one.
    Queue& chosen = from_t1 ? t1_ : t2_;
    Queue& other = from_t1 ? t2_ : t1_;
    if (chosen.oldest() == latest_ && !other.empty()) from_t1 = !from_t1;

    Queue& from = from_t1 ? t1_ : t2_;
    Node* t = from.oldest();
    from.Remove(t);
    AddResident(-t->bytes, -1);
    t->queue = from_t1 ? kB1 : kB2;
    (from_t1 ? b1_ : b2_).PushNewest(t);
    std::string key = *t->key;  // copied: the node stays behind as a ghost
    if (t == latest_) latest_ = nullptr;
    TrimGhosts();
    return key;
  }

 private:
  enum : uint8_t { kT1, kT2, kB1, kB2 };

  Queue& QueueOf(Node* n) {
    switch (n->queue) {
      case kT1: return t1_;
      case kT2: return t2_;
      case kB1: return b1_;
      default: return b2_;
    }
  }
  void Promote(Node* n) {
    QueueOf(n).Remove(n);
    n->queue = kT2;
    t2_.PushNewest(n);
  }
  void DropOldest(Queue& q) {
    Node* g = q.oldest();
    q.Remove(g);
    Forget(g);
  }
  void TrimGhosts() {
    while (!b1_.empty() && t1_.bytes() + b1_.bytes() > capacity_) DropOldest(b1_);
    while (!b2_.empty() && t1_.bytes() + t2_.bytes() + b1_.bytes() + b2_.bytes() > 2 * capacity_) {
      DropOldest(b2_);
    }
  }

  const int64_t capacity_;
  int64_t p_ = 0;
  bool last_hit_b2_ = false;
  Queue t1_, t2_, b1_, b2_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionKind kind, int64_t capacity_bytes) {
  switch (kind) {
    case EvictionKind::kLru: return std::make_unique<LruPolicy>();
    case EvictionKind::kS3Fifo: return std::make_unique<S3FifoPolicy>(capacity_bytes);
    case EvictionKind::kArc: return std::make_unique<ArcPolicy>(capacity_bytes);
  }
  return nullptr;
}

}  // namespace keel::kvstore
