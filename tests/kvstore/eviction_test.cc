#include "keel/kvstore/eviction.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace keel::kvstore {
namespace {

// Inserts `key` and evicts down to `capacity`, returning the victims in order.
std::vector<std::string> InsertAndEvict(EvictionPolicy& p, const std::string& key, int64_t bytes, int64_t capacity) {
  p.Insert(key, bytes);
  std::vector<std::string> victims;
  while (p.bytes() > capacity) {
    std::optional<std::string> v = p.Victim();
    if (!v) break;
    victims.push_back(*v);
  }
  return victims;
}

TEST(EvictionParseTest, ParsesKnownNamesAndRejectsOthers) {
  ASSERT_TRUE(ParseEvictionKind("lru").ok());
  EXPECT_EQ(*ParseEvictionKind("lru"), EvictionKind::kLru);
  EXPECT_EQ(*ParseEvictionKind("s3fifo"), EvictionKind::kS3Fifo);
  EXPECT_EQ(*ParseEvictionKind("arc"), EvictionKind::kArc);
  for (const char* bad : {"", "LRU", "lfu", "s3-fifo", "arc "}) {
    Result<EvictionKind> r = ParseEvictionKind(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  for (EvictionKind k : {EvictionKind::kLru, EvictionKind::kS3Fifo, EvictionKind::kArc}) {
    EXPECT_EQ(*ParseEvictionKind(EvictionKindName(k)), k);
    EXPECT_EQ(MakeEvictionPolicy(k, 100)->name(), EvictionKindName(k));
  }
}

class EvictionPolicyTest : public ::testing::TestWithParam<EvictionKind> {};

// A random mix of inserts (new, repeated, replacing with a new size), hits and erases, checked
// against a model of what is resident: the policy's byte and key counts match the model, the
// owner's loop keeps the bytes within capacity, every victim was resident, and the latest insert
// is never the victim while anything else is resident.
TEST_P(EvictionPolicyTest, RandomWorkloadStaysWithinCapacityAndConsistent) {
  constexpr int64_t kCapacity = 10'000;
  auto p = MakeEvictionPolicy(GetParam(), kCapacity);
  std::map<std::string, int64_t> model;
  int64_t model_bytes = 0;
  std::mt19937 rng(7);
  int64_t evictions = 0;
  for (int op = 0; op < 20'000; ++op) {
    const std::string key = "k" + std::to_string(rng() % 400);
    const int r = static_cast<int>(rng() % 10);
    if (r < 6) {
      const int64_t bytes = 1 + static_cast<int64_t>(rng() % 900);
      if (auto it = model.find(key); it != model.end()) model_bytes -= it->second;
      model[key] = bytes;
      model_bytes += bytes;
      for (const std::string& v : InsertAndEvict(*p, key, bytes, kCapacity)) {
        auto it = model.find(v);
        ASSERT_NE(it, model.end()) << "victim " << v << " was not resident";
        ASSERT_TRUE(v != key || model.size() == 1) << "evicted the key just inserted";
        model_bytes -= it->second;
        model.erase(it);
        ++evictions;
      }
    } else if (r < 9) {
      p->Access(key);
    } else {
      p->Erase(key);
      if (auto it = model.find(key); it != model.end()) {
        model_bytes -= it->second;
        model.erase(it);
      }
    }
    ASSERT_LE(p->bytes(), kCapacity);
    ASSERT_EQ(p->bytes(), model_bytes);
    ASSERT_EQ(p->size(), static_cast<int64_t>(model.size()));
  }
  EXPECT_GT(evictions, 1000);  // the workload really exercised eviction
  // Draining hands out every resident key exactly once.
  std::set<std::string> drained;
  while (std::optional<std::string> v = p->Victim()) ASSERT_TRUE(drained.insert(*v).second) << *v;
  EXPECT_EQ(drained.size(), model.size());
  EXPECT_EQ(p->bytes(), 0);
  EXPECT_EQ(p->size(), 0);
}

TEST_P(EvictionPolicyTest, UnknownKeysAreHarmless) {
  auto p = MakeEvictionPolicy(GetParam(), 100);
  EXPECT_FALSE(p->Victim().has_value());
  p->Erase("nope");
  p->Access("nope");
  EXPECT_EQ(p->bytes(), 0);
  p->Insert("a", 10);
  p->Erase("nope");
  p->Access("nope");
  EXPECT_EQ(p->bytes(), 10);
  EXPECT_EQ(p->size(), 1);
  EXPECT_EQ(p->Victim(), "a");
  EXPECT_FALSE(p->Victim().has_value());
  p->Erase("a");  // already evicted (a ghost at most): still harmless
  EXPECT_EQ(p->bytes(), 0);
}

TEST_P(EvictionPolicyTest, ReinsertUpdatesBytesWithoutDuplicating) {
  auto p = MakeEvictionPolicy(GetParam(), 1000);
  p->Insert("a", 10);
  p->Insert("b", 20);
  p->Insert("a", 300);
  EXPECT_EQ(p->bytes(), 320);
  EXPECT_EQ(p->size(), 2);
  p->Erase("a");
  EXPECT_EQ(p->bytes(), 20);
  EXPECT_EQ(p->size(), 1);
}

TEST_P(EvictionPolicyTest, NeverEvictsTheKeyJustInsertedWhileOthersAreResident) {
  auto p = MakeEvictionPolicy(GetParam(), 100);
  p->Insert("old1", 30);
  p->Insert("old2", 30);
  p->Access("old1");
  p->Access("old2");
  const std::vector<std::string> victims = InsertAndEvict(*p, "big", 90, 100);
  EXPECT_EQ(victims.size(), 2u);
  for (const std::string& v : victims) EXPECT_NE(v, "big");
  EXPECT_EQ(p->bytes(), 90);
}

INSTANTIATE_TEST_SUITE_P(AllKinds, EvictionPolicyTest,
                         ::testing::Values(EvictionKind::kLru, EvictionKind::kS3Fifo, EvictionKind::kArc),
                         [](const auto& info) { return std::string(EvictionKindName(info.param)); });

TEST(EvictionLruTest, EvictsLeastRecentlyUsedFirst) {
  auto p = MakeEvictionPolicy(EvictionKind::kLru, 100);
  p->Insert("a", 1);
  p->Insert("b", 1);
  p->Insert("c", 1);
  p->Access("a");
  p->Insert("b", 1);  // a replacing insert counts as a use
  EXPECT_EQ(p->Victim(), "c");
  EXPECT_EQ(p->Victim(), "a");
  EXPECT_EQ(p->Victim(), "b");
  EXPECT_FALSE(p->Victim().has_value());
}

// Capacity 100 with 10-byte keys: the small queue's share is one key.
TEST(EvictionS3FifoTest, OneHitWondersLeaveBeforeAFrequentKey) {
  constexpr int64_t kCap = 100;
  auto p = MakeEvictionPolicy(EvictionKind::kS3Fifo, kCap);
  p->Insert("hot", 10);
  p->Access("hot");
  for (int i = 0; i < 9; ++i) EXPECT_TRUE(InsertAndEvict(*p, "w" + std::to_string(i), 10, kCap).empty());
  // From here each insert evicts one key: the re-accessed key moves to main; the one-hit
  // wonders leave through the small queue in FIFO order.
  for (int i = 9; i < 60; ++i) {
    const std::vector<std::string> v = InsertAndEvict(*p, "w" + std::to_string(i), 10, kCap);
    ASSERT_EQ(v.size(), 1u);
    EXPECT_EQ(v[0], "w" + std::to_string(i - 9));
  }

  // The same sequence under LRU evicts "hot" once it is the least recent.
  auto lru = MakeEvictionPolicy(EvictionKind::kLru, kCap);
  lru->Insert("hot", 10);
  lru->Access("hot");
  std::vector<std::string> lru_victims;
  for (int i = 0; i < 60; ++i) {
    for (const std::string& v : InsertAndEvict(*lru, "w" + std::to_string(i), 10, kCap)) lru_victims.push_back(v);
  }
  ASSERT_FALSE(lru_victims.empty());
  EXPECT_EQ(lru_victims[0], "hot");
}

TEST(EvictionS3FifoTest, GhostHitGoesStraightToMain) {
  constexpr int64_t kCap = 100;
  auto p = MakeEvictionPolicy(EvictionKind::kS3Fifo, kCap);
  for (int i = 0; i < 10; ++i) InsertAndEvict(*p, "a" + std::to_string(i), 10, kCap);
  // "a0" leaves through the small queue without a second access: it becomes a ghost.
  std::vector<std::string> v = InsertAndEvict(*p, "a10", 10, kCap);
  ASSERT_EQ(v, std::vector<std::string>{"a0"});

  // Re-inserting the ghost admits it to main; a brand-new key inserted right after goes to
  // the small queue and, never re-accessed, leaves first.
  v = InsertAndEvict(*p, "a0", 10, kCap);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0], "a1");
  InsertAndEvict(*p, "fresh", 10, kCap);
  std::vector<std::string> later;
  for (int i = 0; i < 30; ++i) {
    for (const std::string& k : InsertAndEvict(*p, "b" + std::to_string(i), 10, kCap)) later.push_back(k);
  }
  EXPECT_NE(std::find(later.begin(), later.end(), "fresh"), later.end());
  EXPECT_EQ(std::find(later.begin(), later.end(), "a0"), later.end()) << "the ghost-hit key was evicted";
}

TEST(EvictionS3FifoTest, EraseOfAGhostForgetsIt) {
  constexpr int64_t kCap = 100;
  auto p = MakeEvictionPolicy(EvictionKind::kS3Fifo, kCap);
  for (int i = 0; i <= 10; ++i) InsertAndEvict(*p, "a" + std::to_string(i), 10, kCap);  // a0 -> ghost
  p->Erase("a0");
  // Without the ghost, "a0" comes back as a new key into the small queue, and leaves first again
  // once the small queue's older keys are gone.
  InsertAndEvict(*p, "a0", 10, kCap);
  std::vector<std::string> victims;
  for (int i = 0; i < 12; ++i) {
    for (const std::string& k : InsertAndEvict(*p, "c" + std::to_string(i), 10, kCap)) victims.push_back(k);
  }
  EXPECT_NE(std::find(victims.begin(), victims.end(), "a0"), victims.end());
}

// A working set used twice sits in T2; a long scan of one-time keys churns T1 only.
TEST(EvictionArcTest, ScanDoesNotFlushFrequentWorkingSet) {
  constexpr int64_t kCap = 50;
  auto run = [&](EvictionKind kind) {
    auto p = MakeEvictionPolicy(kind, kCap);
    for (int i = 0; i < 20; ++i) InsertAndEvict(*p, "ws" + std::to_string(i), 1, kCap);
    for (int i = 0; i < 20; ++i) p->Access("ws" + std::to_string(i));
    int lost = 0;
    for (int i = 0; i < 1000; ++i) {
      for (const std::string& v : InsertAndEvict(*p, "scan" + std::to_string(i), 1, kCap)) lost += v.rfind("ws", 0) == 0;
    }
    return lost;
  };
  // ARC gives up at most the one key the first scan miss takes while T1 is still empty.
  EXPECT_LE(run(EvictionKind::kArc), 1);
  EXPECT_EQ(run(EvictionKind::kLru), 20);  // the contrast that makes the check meaningful
}

TEST(EvictionArcTest, GhostHitIsAdmittedAsFrequent) {
  constexpr int64_t kCap = 10;
  auto p = MakeEvictionPolicy(EvictionKind::kArc, kCap);
  InsertAndEvict(*p, "hot", 1, kCap);
  p->Access("hot");  // T2 holds one key, so T1 + B1 has room for a ghost
  for (int i = 0; i < 9; ++i) InsertAndEvict(*p, "k" + std::to_string(i), 1, kCap);
  std::vector<std::string> v = InsertAndEvict(*p, "k9", 1, kCap);
  ASSERT_EQ(v, std::vector<std::string>{"k0"});  // T1's LRU, now in B1
  v = InsertAndEvict(*p, "k0", 1, kCap);          // B1 hit: back into T2
  ASSERT_EQ(v, std::vector<std::string>{"k1"});
  int k0_lost = 0, hot_lost = 0;
  for (int i = 0; i < 100; ++i) {
    for (const std::string& k : InsertAndEvict(*p, "s" + std::to_string(i), 1, kCap)) {
      k0_lost += k == "k0";
      hot_lost += k == "hot";
    }
  }
  EXPECT_EQ(k0_lost, 0);
  EXPECT_EQ(hot_lost, 0);
}

}  // namespace
}  // namespace keel::kvstore
