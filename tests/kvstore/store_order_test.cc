// The newest acknowledged write of a key wins in every tier of the Store, across write-behind,
// DRAM eviction, deletes, a full write-behind queue and crashes (kill -9 of a child process that
// owns the store). Each interleaving here once read back an older value.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/kvstore/ssd_tier.h"
#include "keel/kvstore/store.h"
#include "tests/engine/test_util.h"
#include "tests/kvstore/redis_process.h"

namespace keel::kvstore {
namespace {

// Values name their key and version, padded so a few fill the small DRAM tier.
std::string Value(const std::string& key, int version, size_t size = 3000) {
  std::string v = key + "@" + std::to_string(version) + "#";
  v.resize(size, static_cast<char>('a' + version % 26));
  return v;
}

// The version encoded by Value(); -1 for anything else.
int VersionOf(const std::string& key, std::string_view value) {
  const std::string prefix = key + "@";
  if (value.substr(0, prefix.size()) != prefix) return -1;
  const size_t hash = value.find('#');
  if (hash == std::string_view::npos) return -1;
  return std::atoi(std::string(value.substr(prefix.size(), hash - prefix.size())).c_str());
}

StoreOptions Options(const std::string& dir, int64_t dram_bytes = 16 << 10) {
  StoreOptions o;
  o.dram_bytes = dram_bytes;
  o.ssd_dir = dir;
  o.ssd_bytes = 64 << 20;
  o.ssd_segment_bytes = 1 << 20;
  return o;
}

std::unique_ptr<Store> MustOpen(const StoreOptions& o) {
  Result<std::unique_ptr<Store>> s = Store::Open(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

Status PutValue(Store& s, const std::string& key, int version, bool persist) {
  return s.Put(key, Blob::Copy(Value(key, version)), -1, persist);
}

// The version Get returns: nullopt for NotFound; fails the test on other errors.
std::optional<int> ReadVersion(Store& s, const std::string& key) {
  Result<StoredValue> v = s.Get(key);
  if (!v.ok()) {
    EXPECT_EQ(v.status().code(), StatusCode::kNotFound) << key << ": " << v.status().ToString();
    return std::nullopt;
  }
  return VersionOf(key, v->value->view());
}

// Pushes everything else out of the small DRAM tier.
void FillDram(Store& s, const std::string& tag, int n = 12) {
  for (int i = 0; i < n; ++i) ASSERT_TRUE(PutValue(s, tag + std::to_string(i), 0, false).ok());
}

// Runs `body` in a child process that is then killed with SIGKILL (no destructor, no flush),
// and waits for it. `body` returns false to report a failure through the exit status.
void RunThenKill9(const std::function<bool()>& body) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (!body()) ::_exit(3);
    ::kill(::getpid(), SIGKILL);
    ::_exit(4);  // unreachable
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "child did not reach its kill -9 (exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << ")";
}

TEST(StoreOrder, PlainPutThenPersistedPutKeepsThePersistedOneAfterWriteBehind) {
  test::TempDir dir("keel-order");
  {
    auto s = MustOpen(Options(dir.path()));
    ASSERT_NE(s, nullptr);
    s->PauseWriteBehindForTesting(true);
    ASSERT_TRUE(PutValue(*s, "k", 1, false).ok());  // queued for SSD
    ASSERT_TRUE(PutValue(*s, "k", 2, true).ok());   // on SSD and fdatasync'd at once
    s->PauseWriteBehindForTesting(false);
    s->Flush();  // the queued older write reaches the writer after the newer one
    EXPECT_EQ(ReadVersion(*s, "k"), 2);
    FillDram(*s, "other");
    EXPECT_EQ(ReadVersion(*s, "k"), 2) << "read from SSD after DRAM eviction";
    EXPECT_GE(s->Stats().write_behind_stale, 1);
  }
  auto s = MustOpen(Options(dir.path()));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(ReadVersion(*s, "k"), 2) << "after a clean restart";
}

TEST(StoreOrder, PlainPutThenPersistedPutSurvivesKill9) {
  test::TempDir dir("keel-order");
  const int kKeys = 40;
  RunThenKill9([&] {
    auto s = Store::Open(Options(dir.path()));
    if (!s.ok()) return false;
    Store& store = **s;
    store.PauseWriteBehindForTesting(true);
    for (int i = 0; i < kKeys; ++i) {
      const std::string key = "k" + std::to_string(i);
      if (!PutValue(store, key, 1, false).ok() || !PutValue(store, key, 2, true).ok()) return false;
    }
    store.PauseWriteBehindForTesting(false);
    store.Flush();
    return true;
  });
  auto s = MustOpen(Options(dir.path()));
  ASSERT_NE(s, nullptr);
  int older = 0;
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = "k" + std::to_string(i);
    std::optional<int> v = ReadVersion(*s, key);
    ASSERT_TRUE(v.has_value()) << key << ": a persisted write was lost";
    if (*v != 2) ++older;
  }
  EXPECT_EQ(older, 0) << "keys read back at their older, overwritten version after kill -9";
}

TEST(StoreOrder, EvictedNewerValueIsServedWhileItsWriteBehindWaits) {
  test::TempDir dir("keel-order");
  auto s = MustOpen(Options(dir.path()));
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(PutValue(*s, "k", 1, true).ok());
  s->PauseWriteBehindForTesting(true);
  ASSERT_TRUE(PutValue(*s, "k", 2, false).ok());  // newer, only in DRAM and the queue
  FillDram(*s, "other");                           // evicts it; SSD still holds version 1
  EXPECT_EQ(ReadVersion(*s, "k"), 2);
  EXPECT_EQ(s->LongestPrefix({"k"}), 1);
  s->PauseWriteBehindForTesting(false);
  s->Flush();
  EXPECT_EQ(ReadVersion(*s, "k"), 2);
}

TEST(StoreOrder, DeleteDropsQueuedOlderWritesAndStaysDeletedAfterRestart) {
  test::TempDir dir("keel-order");
  {
    auto s = MustOpen(Options(dir.path()));
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(PutValue(*s, "k", 1, true).ok());
    s->PauseWriteBehindForTesting(true);
    ASSERT_TRUE(PutValue(*s, "k", 2, false).ok());
    ASSERT_TRUE(s->Delete("k").ok());
    EXPECT_EQ(ReadVersion(*s, "k"), std::nullopt);
    FillDram(*s, "other");
    EXPECT_EQ(ReadVersion(*s, "k"), std::nullopt) << "the queued write must not show through";
    EXPECT_EQ(s->LongestPrefix({"k"}), 0);
    s->PauseWriteBehindForTesting(false);
    s->Flush();
    EXPECT_EQ(ReadVersion(*s, "k"), std::nullopt) << "the queued write must not land after the delete";
    ASSERT_TRUE(PutValue(*s, "k", 3, false).ok());
    s->Flush();
    EXPECT_EQ(ReadVersion(*s, "k"), 3) << "a write after the delete counts";
    ASSERT_TRUE(s->Delete("k").ok());
  }
  auto s = MustOpen(Options(dir.path()));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(ReadVersion(*s, "k"), std::nullopt);
}

// The queue's bound counts each write's key and bookkeeping, not only its value: empty values
// once queued without bound (1M of them held ~350 MB) while a lower tier was stuck.
TEST(StoreOrder, EmptyValuesFillTheWriteBehindQueueToItsBound) {
  test::TempDir dir("keel-order");
  StoreOptions o = Options(dir.path());
  o.write_behind_bytes = 64 << 10;
  o.write_behind_wait_ms = 0;
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  s->PauseWriteBehindForTesting(true);
  for (int i = 0; i < 2000; ++i) ASSERT_TRUE(s->Put("empty-" + std::to_string(i), Blob::Copy("")).ok());
  const StoreStats st = s->Stats();
  EXPECT_LE(st.write_behind_queued_bytes, o.write_behind_bytes);
  EXPECT_GT(st.write_behind_queued_bytes, 0);
  EXPECT_GE(st.write_behind_skipped, 2000 - o.write_behind_bytes / kEntryOverheadBytes);
  s->PauseWriteBehindForTesting(false);
  s->Flush();
  EXPECT_EQ(s->Stats().write_behind_queued_bytes, 0);
}

TEST(StoreOrder, AWriteThatCouldNotBeQueuedHidesOlderLowerTierCopies) {
  test::TempDir dir("keel-order");
  StoreOptions o = Options(dir.path());
  o.write_behind_bytes = 4000;  // about one value
  o.write_behind_wait_ms = 0;
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(PutValue(*s, "k", 1, true).ok());  // SSD holds version 1
  s->PauseWriteBehindForTesting(true);
  ASSERT_TRUE(PutValue(*s, "filler", 0, false).ok());  // the queue is now full
  ASSERT_TRUE(PutValue(*s, "k", 2, false).ok());       // acknowledged, but not queued
  EXPECT_GE(s->Stats().write_behind_skipped, 1);
  EXPECT_EQ(ReadVersion(*s, "k"), 2);
  FillDram(*s, "other");  // version 2 leaves DRAM; its demotion cannot be queued either
  const std::optional<int> v = ReadVersion(*s, "k");
  EXPECT_NE(v, std::optional<int>(1)) << "the overwritten version came back from SSD";
  EXPECT_GE(s->Stats().hidden_keys, 1);
  s->PauseWriteBehindForTesting(false);
  s->Flush();
  EXPECT_NE(ReadVersion(*s, "k"), std::optional<int>(1));
  ASSERT_TRUE(PutValue(*s, "k", 3, false).ok());
  s->Flush();
  FillDram(*s, "more");
  EXPECT_EQ(ReadVersion(*s, "k"), 3) << "a newer write that reached SSD un-hides the key";
}

// A write-behind that Redis refused (here: out of memory, so writes fail and reads work) left
// Redis holding the older value; once the newer one left DRAM, GET served the older one.
TEST(StoreOrder, AWriteBehindThatFailedHidesTheOlderLowerTierCopy) {
  test::RedisProcess redis("", /*force_private=*/true);
  StoreOptions o;
  o.dram_bytes = 16 << 10;
  o.eviction = EvictionKind::kLru;  // ARC would keep the twice-written key through any scan
  o.redis_url = redis.host() + ":" + std::to_string(redis.port());
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(PutValue(*s, "k", 1, false).ok());
  s->Flush();  // Redis holds version 1
  ASSERT_EQ(test::RedisCommand(redis.port(), "CONFIG SET maxmemory-policy noeviction").substr(0, 3), "+OK");
  ASSERT_EQ(test::RedisCommand(redis.port(), "CONFIG SET maxmemory 1").substr(0, 3), "+OK");
  const int64_t errors_before = s->Stats().lower_tier_errors;
  ASSERT_TRUE(PutValue(*s, "k", 2, false).ok());  // acknowledged; its write-behind is refused
  s->Flush();
  EXPECT_GT(s->Stats().lower_tier_errors, errors_before);
  ASSERT_EQ(test::RedisCommand(redis.port(), "CONFIG SET maxmemory 0").substr(0, 3), "+OK");
  FillDram(*s, "other");  // version 2 leaves DRAM, and there is no SSD to take it
  EXPECT_NE(ReadVersion(*s, "k"), std::optional<int>(1)) << "the overwritten version came back from Redis";
  ASSERT_TRUE(PutValue(*s, "k", 3, false).ok());
  s->Flush();
  FillDram(*s, "more");
  EXPECT_EQ(ReadVersion(*s, "k"), 3) << "a newer write that reached Redis un-hides the key";
}

// A Redis that stops answering (paused, partitioned) held SIGTERM until it came back: every
// queued write waited out its timeout. Past the limit the rest skip Redis and are counted.
TEST(StoreOrder, ShutdownFlushGivesUpOnARedisThatStoppedAnswering) {
  test::RedisProcess redis("", /*force_private=*/true);
  ASSERT_TRUE(redis.ok());
  StoreOptions o;
  o.redis_url = redis.host() + ":" + std::to_string(redis.port());
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(PutValue(*s, "first", 1, false).ok());
  s->Flush();
  ASSERT_EQ(::kill(redis.pid(), SIGSTOP), 0);
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(PutValue(*s, "k" + std::to_string(i), i, false).ok());
  const int64_t skipped = s->FlushForShutdown(std::chrono::milliseconds(300));
  EXPECT_GT(skipped, 30) << "40 writes at 500 ms each cannot have reached a paused Redis";
  EXPECT_LE(skipped, 40);
  ::kill(redis.pid(), SIGCONT);
  EXPECT_EQ(ReadVersion(*s, "k39"), 39);  // still served from DRAM
}

TEST(StoreOrder, RestartContinuesSequenceNumbersAboveWhatSsdHolds) {
  test::TempDir dir("keel-order");
  uint64_t before = 0;
  {
    auto s = MustOpen(Options(dir.path()));
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(PutValue(*s, "k", 1, true).ok());
  }
  {
    SsdOptions so;
    so.dir = dir.path();
    auto ssd = SsdTier::Open(so);
    ASSERT_TRUE(ssd.ok());
    before = (*ssd)->max_seq();
    ASSERT_GT(before, 0u);
    // A write stamped far in the future (a clock that jumped back since): the store must still
    // order its next writes above it.
    ASSERT_TRUE((*ssd)->Put("k", Entry{Blob::Copy(Value("k", 2)), 0, before + (uint64_t{1} << 40)}).ok());
  }
  auto s = MustOpen(Options(dir.path()));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(ReadVersion(*s, "k"), 2);
  ASSERT_TRUE(PutValue(*s, "k", 3, true).ok());
  FillDram(*s, "other");
  EXPECT_EQ(ReadVersion(*s, "k"), 3);
}

// Random interleavings of plain and persisted PUTs, DELETEs and GETs on a few keys, with the
// writer paused and resumed at random and a DRAM tier that holds only a few values. Every GET
// must return the newest acknowledged version or nothing, never an older one; then the store is
// killed with SIGKILL and every key must come back at least at its newest persisted version.
struct Op {
  enum Kind { kPlain, kPersist, kDelete, kPause, kResume } kind;
  int key;
};

std::vector<Op> RandomOps(uint32_t seed, int n, int keys) {
  std::mt19937 rng(seed);
  std::vector<Op> ops;
  for (int i = 0; i < n; ++i) {
    const int r = static_cast<int>(rng() % 100);
    const int key = static_cast<int>(rng() % static_cast<uint32_t>(keys));
    Op::Kind kind = r < 50 ? Op::kPlain : r < 80 ? Op::kPersist : r < 88 ? Op::kDelete : r < 94 ? Op::kPause : Op::kResume;
    ops.push_back({kind, key});
  }
  return ops;
}

TEST(StoreOrder, RandomInterleavingsNeverReadOlderValuesAndSurviveKill9) {
  const int kKeys = 6, kOps = 600;
  for (uint32_t seed = 1; seed <= 16; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    test::TempDir dir("keel-order");
    StoreOptions o = Options(dir.path(), 12 << 10);
    o.write_behind_bytes = 20000;  // fills up while paused: some writes skip the lower tier
    o.write_behind_wait_ms = 0;
    const std::vector<Op> ops = RandomOps(seed, kOps, kKeys);
    RunThenKill9([&] {
      auto opened = Store::Open(o);
      if (!opened.ok()) return false;
      Store& s = **opened;
      std::vector<int> newest(kKeys, -1);  // -1: deleted or never written
      for (int i = 0; i < kOps; ++i) {
        const Op& op = ops[static_cast<size_t>(i)];
        const std::string key = "key" + std::to_string(op.key);
        switch (op.kind) {
          case Op::kPlain:
          case Op::kPersist:
            if (!PutValue(s, key, i, op.kind == Op::kPersist).ok()) return false;
            newest[static_cast<size_t>(op.key)] = i;
            break;
          case Op::kDelete:
            if (!s.Delete(key).ok()) return false;
            newest[static_cast<size_t>(op.key)] = -1;
            break;
          case Op::kPause: s.PauseWriteBehindForTesting(true); break;
          case Op::kResume: s.PauseWriteBehindForTesting(false); break;
        }
        for (int k = 0; k < kKeys; ++k) {
          const std::string probe = "key" + std::to_string(k);
          Result<StoredValue> v = s.Get(probe);
          if (!v.ok()) continue;  // a cache may miss
          const int got = VersionOf(probe, v->value->view());
          if (got != newest[static_cast<size_t>(k)]) {
            std::fprintf(stderr, "op %d: %s read version %d, newest acknowledged %d\n", i, probe.c_str(), got,
                         newest[static_cast<size_t>(k)]);
            return false;
          }
        }
      }
      return true;
    });
    if (HasFatalFailure()) return;

    // After the crash: at least the newest persisted version, unless a delete came after it.
    auto s = MustOpen(o);
    ASSERT_NE(s, nullptr);
    for (int k = 0; k < kKeys; ++k) {
      int last_persist = -1, last_delete = -1;
      std::vector<bool> written(kOps, false);
      for (int i = 0; i < kOps; ++i) {
        if (ops[static_cast<size_t>(i)].key != k) continue;
        const Op::Kind kind = ops[static_cast<size_t>(i)].kind;
        if (kind == Op::kPersist) last_persist = i;
        if (kind == Op::kDelete) last_delete = i;
        if (kind == Op::kPlain || kind == Op::kPersist) written[static_cast<size_t>(i)] = true;
      }
      const std::string key = "key" + std::to_string(k);
      const std::optional<int> got = ReadVersion(*s, key);
      if (last_persist > last_delete) {
        ASSERT_TRUE(got.has_value()) << key << ": persisted version " << last_persist << " lost";
        EXPECT_GE(*got, last_persist) << key << ": an older version replaced the persisted one";
      }
      if (got) {
        ASSERT_GE(*got, 0);
        EXPECT_TRUE(written[static_cast<size_t>(*got)]) << key << ": read a version never written to it";
        EXPECT_GT(*got, last_delete) << key << ": a version from before its delete came back";
      }
    }
  }
}

// Threads race on the same keys: each key has one writer (so its acknowledged order is known)
// mixing plain and persisted PUTs and DELs, while readers hammer every key, DRAM evicts
// constantly and the small write-behind queue overflows. A writer must read its own newest
// version or nothing; a reader must never see a key's version go backwards.
TEST(StoreOrder, ConcurrentWritersAndReadersNeverSeeAVersionGoBack) {
  test::TempDir dir("keel-order");
  StoreOptions o = Options(dir.path(), 24 << 10);
  o.write_behind_bytes = 16 << 10;
  o.write_behind_wait_ms = 1;
  auto s = MustOpen(o);
  ASSERT_NE(s, nullptr);
  const int kWriters = 3, kKeysPerWriter = 4, kOps = 400;
  std::atomic<bool> done{false};
  std::atomic<int> errors{0};
  auto key_name = [](int w, int k) { return "w" + std::to_string(w) + "k" + std::to_string(k); };
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(static_cast<uint32_t>(w) + 100);
      for (int i = 1; i <= kOps && errors == 0; ++i) {
        const std::string key = key_name(w, static_cast<int>(rng() % kKeysPerWriter));
        const int r = static_cast<int>(rng() % 10);
        Status st = r < 1 ? s->Delete(key) : PutValue(*s, key, i, r < 4);
        if (!st.ok()) {
          std::fprintf(stderr, "%s: %s\n", key.c_str(), st.ToString().c_str());
          errors++;
        }
        Result<StoredValue> v = s->Get(key);
        const int want = r < 1 ? -1 : i;
        if (v.ok() && VersionOf(key, v->value->view()) != want) {
          std::fprintf(stderr, "writer read %s version %d from %s, wrote %d\n", key.c_str(),
                       VersionOf(key, v->value->view()), std::string(v->tier).c_str(), want);
          errors++;
        }
      }
    });
  }
  for (int reader = 0; reader < 2; ++reader) {
    threads.emplace_back([&, reader] {
      std::map<std::string, int> seen;
      std::mt19937 rng(static_cast<uint32_t>(reader) + 7);
      while (!done && errors == 0) {
        const std::string key = key_name(static_cast<int>(rng() % kWriters), static_cast<int>(rng() % kKeysPerWriter));
        Result<StoredValue> v = s->Get(key);
        if (!v.ok()) continue;
        const int got = VersionOf(key, v->value->view());
        int& last = seen[key];
        if (got < last) {
          std::fprintf(stderr, "reader saw %s go back from version %d to %d (from %s)\n", key.c_str(), last, got,
                       std::string(v->tier).c_str());
          errors++;
        }
        last = got;
      }
    });
  }
  for (int w = 0; w < kWriters; ++w) threads[static_cast<size_t>(w)].join();
  done = true;
  for (size_t t = kWriters; t < threads.size(); ++t) threads[t].join();
  EXPECT_EQ(errors.load(), 0);
  s->Flush();
}

}  // namespace
}  // namespace keel::kvstore
