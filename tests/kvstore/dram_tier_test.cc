#include "keel/kvstore/dram_tier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace keel::kvstore {
namespace {

Entry MakeEntry(std::string_view bytes, int64_t expires_at_ms = 0) { return Entry{Blob::Copy(bytes), expires_at_ms}; }

std::string ValueOf(const Result<Entry>& r) { return std::string(r->value->view()); }

// A large value's buffer freed on one thread is what the next value of that size, allocated on
// another thread, gets. Plain malloc returns it to the arena of the (still running) thread that
// allocated it, and the other thread gets fresh pages: checked with new[]/delete[], same=0.
TEST(BlobTest, FreedValueBufferIsReusedAcrossThreads) {
  constexpr size_t kSize = (64 << 10) + 123;  // a size no other test uses
  std::shared_ptr<Blob> first;
  std::promise<void> allocated, finish;
  std::thread owner([&] {
    first = Blob::Allocate(kSize);
    allocated.set_value();
    finish.get_future().wait();  // alive, so its malloc arena stays its own
  });
  allocated.get_future().wait();
  const uint8_t* buffer = first->data();
  first.reset();
  std::shared_ptr<Blob> second;
  std::thread([&] {
    second = Blob::Allocate(kSize);
    std::memset(second->data(), 'x', kSize);
  }).join();
  finish.set_value();
  owner.join();
  EXPECT_EQ(second->data(), buffer);
  EXPECT_EQ(second->size(), kSize);
  EXPECT_EQ(second->view(), std::string(kSize, 'x'));
  // A buffer in use is never handed out twice.
  std::shared_ptr<Blob> third = Blob::Allocate(kSize);
  EXPECT_NE(third->data(), second->data());
  EXPECT_EQ(Blob::Copy("hi")->view(), "hi");
}

TEST(DramTierTest, RoundTripAndStats) {
  DramTier tier(DramOptions{.capacity_bytes = 1 << 20});
  EXPECT_EQ(tier.name(), "dram");
  ASSERT_TRUE(tier.Put("key1", MakeEntry("hello")).ok());
  Result<Entry> got = tier.Get("key1");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(ValueOf(got), "hello");
  EXPECT_TRUE(*tier.Contains("key1"));
  EXPECT_FALSE(*tier.Contains("other"));
  Result<Entry> missing = tier.Get("other");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);

  TierStats s = tier.Stats();
  EXPECT_EQ(s.name, "dram");
  EXPECT_EQ(s.items, 1);
  EXPECT_EQ(s.bytes, 5 + 4 + kEntryOverheadBytes);  // value + key + the entry's bookkeeping
  EXPECT_EQ(s.capacity_bytes, 1 << 20);
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.puts, 1);
  EXPECT_EQ(s.evictions, 0);

  ASSERT_TRUE(tier.Delete("key1").ok());
  ASSERT_TRUE(tier.Delete("key1").ok());  // absent: still OK
  EXPECT_EQ(tier.Get("key1").status().code(), StatusCode::kNotFound);
  s = tier.Stats();
  EXPECT_EQ(s.items, 0);
  EXPECT_EQ(s.bytes, 0);
}

TEST(DramTierTest, RejectsBadKeysAndNullValues) {
  DramTier tier;
  EXPECT_EQ(tier.Put("", MakeEntry("x")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.Put(std::string(kMaxKeyBytes + 1, 'k'), MakeEntry("x")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.Put("k", Entry{}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.Get("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.Contains("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.Delete("").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.Stats().items, 0);
}

TEST(DramTierTest, OverwriteReplacesValueAndBytes) {
  DramTier tier(DramOptions{.capacity_bytes = 1 << 20});
  ASSERT_TRUE(tier.Put("k", MakeEntry(std::string(100, 'a'))).ok());
  ASSERT_TRUE(tier.Put("k", MakeEntry(std::string(300, 'b'))).ok());
  TierStats s = tier.Stats();
  EXPECT_EQ(s.items, 1);
  EXPECT_EQ(s.bytes, 300 + 1 + kEntryOverheadBytes);
  EXPECT_EQ(s.puts, 2);
  EXPECT_EQ(ValueOf(tier.Get("k")), std::string(300, 'b'));
  ASSERT_TRUE(tier.Put("k", MakeEntry("c")).ok());
  EXPECT_EQ(tier.Stats().bytes, 1 + 1 + kEntryOverheadBytes);
}

TEST(DramTierTest, OversizeValueIsResourceExhausted) {
  DramTier tier(DramOptions{.capacity_bytes = 1000 + kEntryOverheadBytes});
  EXPECT_EQ(tier.Put("k", MakeEntry(std::string(1000, 'x'))).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(tier.Stats().items, 0);
  // Exactly the capacity (value + key + overhead) fits, and evicts everything else.
  ASSERT_TRUE(tier.Put("a", MakeEntry("small")).ok());
  ASSERT_TRUE(tier.Put("k", MakeEntry(std::string(999, 'x'))).ok());
  TierStats s = tier.Stats();
  EXPECT_EQ(s.items, 1);
  EXPECT_EQ(s.bytes, 1000 + kEntryOverheadBytes);
  EXPECT_EQ(s.evictions, 1);
  EXPECT_FALSE(*tier.Contains("a"));
}

// Every entry is charged its bookkeeping: empty values cannot hold many times the capacity.
TEST(DramTierTest, EmptyValuesAreChargedTheirEntryOverhead) {
  const int64_t capacity = 64 << 10;
  DramTier tier(DramOptions{.capacity_bytes = capacity});
  for (int i = 0; i < 10000; ++i) ASSERT_TRUE(tier.Put("k" + std::to_string(i), MakeEntry("")).ok());
  const TierStats s = tier.Stats();
  EXPECT_LE(s.bytes, capacity);
  EXPECT_LE(s.items, capacity / kEntryOverheadBytes) << "10,000 empty values, " << s.items << " kept";
  EXPECT_GT(s.evictions, 0);
}

TEST(DramTierTest, ExpiredEntriesAreNotFoundAndRemoved) {
  DramTier tier(DramOptions{.capacity_bytes = 1 << 20});
  const int64_t now = NowUnixMs();
  ASSERT_TRUE(tier.Put("short", MakeEntry("v1", now + 150)).ok());
  ASSERT_TRUE(tier.Put("long", MakeEntry("v2", now + 3'600'000)).ok());
  ASSERT_TRUE(tier.Put("never", MakeEntry("v3")).ok());
  EXPECT_TRUE(tier.Get("short").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_EQ(tier.Get("short").status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(*tier.Contains("short"));
  EXPECT_TRUE(tier.Get("long").ok());
  EXPECT_TRUE(tier.Get("never").ok());
  TierStats s = tier.Stats();
  EXPECT_EQ(s.expirations, 1);
  EXPECT_EQ(s.items, 2);
  EXPECT_EQ(s.bytes, (2 + 4) + (2 + 5) + 2 * kEntryOverheadBytes);

  // Contains also drops an expired entry; putting an already-expired entry removes the key.
  ASSERT_TRUE(tier.Put("c", MakeEntry("v", NowUnixMs() + 100)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(*tier.Contains("c"));
  EXPECT_EQ(tier.Stats().expirations, 2);
  ASSERT_TRUE(tier.Put("long", MakeEntry("gone", NowUnixMs() - 1)).ok());
  EXPECT_FALSE(*tier.Contains("long"));
  EXPECT_EQ(tier.Stats().items, 1);
}

class DramTierEvictionTest : public ::testing::TestWithParam<EvictionKind> {};

TEST_P(DramTierEvictionTest, CallbackGetsEvictedEntriesOutsideTheLock) {
  // Room for exactly three 100-byte values under 2-byte keys.
  const DramOptions options{.capacity_bytes = 3 * (102 + kEntryOverheadBytes), .eviction = GetParam()};
  std::map<std::string, std::string> evicted;
  DramTier* tier_ptr = nullptr;
  int reentrant_checks = 0;
  DramTier tier(options, [&](std::string key, Entry entry) {
    // Re-entering the tier would deadlock if the lock were held here.
    Result<bool> still_there = tier_ptr->Contains(key);
    EXPECT_TRUE(still_there.ok());
    EXPECT_FALSE(*still_there);
    EXPECT_LE(tier_ptr->Stats().bytes, options.capacity_bytes);
    ++reentrant_checks;
    evicted[key] = std::string(entry.value->view());
  });
  tier_ptr = &tier;

  auto value_of = [](int i) { return std::string(100, static_cast<char>('a' + i)); };
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(tier.Put("k" + std::to_string(i), MakeEntry(value_of(i))).ok());

  TierStats s = tier.Stats();
  EXPECT_EQ(s.items, 3);
  EXPECT_EQ(s.bytes, 3 * (102 + kEntryOverheadBytes));
  EXPECT_EQ(s.evictions, 5);
  EXPECT_EQ(reentrant_checks, 5);
  ASSERT_EQ(evicted.size(), 5u);
  for (int i = 0; i < 8; ++i) {
    const std::string key = "k" + std::to_string(i);
    const bool resident = *tier.Contains(key);
    auto it = evicted.find(key);
    EXPECT_NE(resident, it != evicted.end()) << key << " must be either resident or evicted";
    if (it != evicted.end()) {
      EXPECT_EQ(it->second, value_of(i)) << key;
    }
  }
  EXPECT_TRUE(*tier.Contains("k7"));  // the latest put is never its own victim
}

INSTANTIATE_TEST_SUITE_P(AllKinds, DramTierEvictionTest,
                         ::testing::Values(EvictionKind::kLru, EvictionKind::kS3Fifo, EvictionKind::kArc),
                         [](const auto& info) { return std::string(EvictionKindName(info.param)); });

TEST(DramTierTest, ExpiredVictimsAreCountedAsExpirationsNotDemoted) {
  std::vector<std::string> demoted;
  DramTier tier(DramOptions{.capacity_bytes = 2 * (11 + kEntryOverheadBytes), .eviction = EvictionKind::kLru},
                [&](std::string key, Entry) { demoted.push_back(key); });
  ASSERT_TRUE(tier.Put("a", MakeEntry(std::string(10, 'a'), NowUnixMs() + 100)).ok());
  ASSERT_TRUE(tier.Put("b", MakeEntry(std::string(10, 'b'))).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_TRUE(tier.Put("c", MakeEntry(std::string(10, 'c'))).ok());  // LRU victim: expired "a"
  EXPECT_TRUE(demoted.empty());
  TierStats s = tier.Stats();
  EXPECT_EQ(s.expirations, 1);
  EXPECT_EQ(s.evictions, 0);
  ASSERT_TRUE(tier.Put("d", MakeEntry(std::string(10, 'd'))).ok());  // victim: live "b"
  EXPECT_EQ(demoted, std::vector<std::string>{"b"});
  EXPECT_EQ(tier.Stats().evictions, 1);
}

TEST(DramTierTest, DefaultOptions) {
  DramOptions o;
  EXPECT_EQ(o.capacity_bytes, int64_t{1} << 30);
  EXPECT_EQ(o.eviction, EvictionKind::kArc);  // chosen by bench/kvstore/eviction_bench.cc
  DramTier tier;
  EXPECT_EQ(tier.Stats().capacity_bytes, int64_t{1} << 30);
}

// Writers and readers on overlapping keys under eviction pressure: every value read is the one
// some writer stored for that key (values encode their key), bytes stay within capacity, and
// the callback sees exactly the evictions the stats count.
TEST(DramTierTest, ConcurrentPutGetDeleteIsConsistent) {
  constexpr int kThreads = 4;
  constexpr int kOps = 20'000;
  constexpr int64_t kCapacity = 64 * 1024;
  std::atomic<int64_t> callbacks{0};
  std::atomic<int64_t> bad_evictions{0};
  auto value_for = [](const std::string& key, int version) {
    std::string v = key + "#" + std::to_string(version) + "#";
    v.resize(200 + (version % 7) * 100, static_cast<char>('a' + version % 26));
    return v;
  };
  auto value_matches_key = [](const std::string& key, std::string_view v) {
    return v.substr(0, key.size() + 1) == key + "#";
  };
  DramTier tier(DramOptions{.capacity_bytes = kCapacity, .eviction = EvictionKind::kS3Fifo},
                [&](std::string key, Entry entry) {
                  callbacks.fetch_add(1);
                  if (!value_matches_key(key, entry.value->view())) bad_evictions.fetch_add(1);
                });

  std::atomic<int64_t> bad_reads{0}, hits{0}, puts{0}, gets{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      uint64_t x = 0x9e3779b97f4a7c15ULL * (t + 1);
      for (int i = 0; i < kOps; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const std::string key = "key-" + std::to_string(x % 500);
        const int op = static_cast<int>((x >> 20) % 10);
        if (op < 4) {
          ASSERT_TRUE(tier.Put(key, MakeEntry(value_for(key, static_cast<int>(x >> 40) % 1000))).ok());
          puts.fetch_add(1);
        } else if (op < 9) {
          Result<Entry> r = tier.Get(key);
          gets.fetch_add(1);
          if (r.ok()) {
            hits.fetch_add(1);
            if (!value_matches_key(key, r->value->view())) bad_reads.fetch_add(1);
          } else if (r.status().code() != StatusCode::kNotFound) {
            bad_reads.fetch_add(1);
          }
        } else {
          ASSERT_TRUE(tier.Delete(key).ok());
        }
      }
    });
  }
  for (auto& th : threads) th.join();

  EXPECT_EQ(bad_reads.load(), 0);
  EXPECT_EQ(bad_evictions.load(), 0);
  TierStats s = tier.Stats();
  EXPECT_LE(s.bytes, kCapacity);
  EXPECT_GT(s.evictions, 0);
  EXPECT_EQ(s.evictions, callbacks.load());
  EXPECT_EQ(s.puts, puts.load());
  EXPECT_EQ(s.hits, hits.load());
  EXPECT_GT(s.hits, 0);
  EXPECT_EQ(s.hits + s.misses, gets.load());
}

}  // namespace
}  // namespace keel::kvstore
