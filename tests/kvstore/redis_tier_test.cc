// RedisTier against real redis-servers: the shared/private one from RedisProcess, private ones
// killed and restarted, a socket that never answers, and a real 3-node Redis Cluster.
#include "keel/kvstore/redis_tier.h"

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/kvstore/redis_process.h"

namespace keel::kvstore {
namespace {

using keel::test::FreeLoopbackPort;
using keel::test::PortAccepts;
using keel::test::RedisProcess;
using keel::test::UniquePrefix;
using Clock = std::chrono::steady_clock;

// One server for the whole binary (stopped at exit; the shared KEEL_REDIS_URL one when set).
RedisProcess& SharedRedis() {
  static RedisProcess redis;
  return redis;
}

RedisOptions OptionsFor(const std::string& host, int port, const std::string& tag) {
  RedisOptions o;
  o.host = host;
  o.port = port;
  o.key_prefix = UniquePrefix(tag);
  return o;
}

std::unique_ptr<RedisTier> ConnectOrDie(const RedisOptions& o) {
  Result<std::unique_ptr<RedisTier>> t = RedisTier::Connect(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

// Bytes 0..255 repeating from `seed`, so every value has NULs and differs per key.
std::string BinaryValue(size_t size, unsigned seed) {
  std::string v(size, '\0');
  for (size_t i = 0; i < size; ++i) v[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return v;
}

Entry MakeEntry(std::string_view bytes, int64_t expires_at_ms = 0) { return Entry{Blob::Copy(bytes), expires_at_ms}; }

// A plain hiredis connection for looking behind the tier's back.
class DirectConn {
 public:
  explicit DirectConn(int port, const std::string& host = "127.0.0.1") : c_(redisConnect(host.c_str(), port)) {}
  ~DirectConn() { redisFree(c_); }
  bool ok() const { return c_ != nullptr && c_->err == 0; }
  // The reply as text: strings/status/errors verbatim, integers in decimal, nil as "(nil)".
  // Deletes every key starting with `prefix` (a shared server outlives the test).
  void DeletePrefix(const std::string& prefix) {
    std::string cursor = "0", pattern = prefix + "*";
    do {
      auto* r = static_cast<redisReply*>(
          redisCommand(c_, "SCAN %s MATCH %b COUNT 1000", cursor.c_str(), pattern.data(), pattern.size()));
      if (r == nullptr || r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
        if (r != nullptr) freeReplyObject(r);
        return;
      }
      cursor.assign(r->element[0]->str, r->element[0]->len);
      for (size_t i = 0; i < r->element[1]->elements; ++i) {
        const redisReply* k = r->element[1]->element[i];
        freeReplyObject(redisCommand(c_, "DEL %b", k->str, k->len));
      }
      freeReplyObject(r);
    } while (cursor != "0");
  }

  std::string Text(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (r == nullptr) return "(io error)";
    std::string out;
    if (r->type == REDIS_REPLY_INTEGER) out = std::to_string(r->integer);
    else if (r->type == REDIS_REPLY_NIL) out = "(nil)";
    else if (r->str != nullptr) out.assign(r->str, r->len);
    freeReplyObject(r);
    return out;
  }

 private:
  redisContext* c_;
};

// A private redis-server on a chosen port (RedisProcess picks its own), to restart "the same"
// server after killing it.
class RedisOnPort {
 public:
  explicit RedisOnPort(int port) : port_(port) {
    dir_ = "/tmp/keel-redis-restart-" + std::to_string(::getpid()) + "-" + std::to_string(port);
    std::string cmd = "mkdir -p " + dir_ + " && cd " + dir_ + " && exec redis-server --bind 127.0.0.1 --port " +
                      std::to_string(port) + " --save '' --appendonly no --daemonize no --loglevel warning";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 200 && !PortAccepts(port_); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ~RedisOnPort() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    std::string rm = "rm -rf " + dir_;
    (void)std::system(rm.c_str());
  }
  bool ok() const { return PortAccepts(port_); }

 private:
  int port_;
  pid_t pid_ = -1;
  std::string dir_;
};

class RedisTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(SharedRedis().ok()) << "no redis-server: install redis-server or set KEEL_REDIS_URL";
    tier_ = ConnectOrDie(OptionsFor(SharedRedis().host(), SharedRedis().port(), "tier"));
    ASSERT_NE(tier_, nullptr);
  }
  void TearDown() override {
    if (tier_ == nullptr) return;
    DirectConn c(SharedRedis().port(), SharedRedis().host());
    c.DeletePrefix(tier_->options().key_prefix);
  }
  std::unique_ptr<RedisTier> tier_;
};

TEST_F(RedisTierTest, RoundTripsBinaryValuesOfAllSizes) {
  for (size_t size : {size_t{0}, size_t{1}, size_t{64} << 10, size_t{2} << 20}) {
    std::string key = "k-" + std::to_string(size);
    std::string value = BinaryValue(size, static_cast<unsigned>(size));
    ASSERT_TRUE(tier_->Put(key, MakeEntry(value)).ok()) << size;
    Result<Entry> got = tier_->Get(key);
    ASSERT_TRUE(got.ok()) << size << ": " << got.status().ToString();
    EXPECT_EQ(got->value->view(), value) << size;
    EXPECT_EQ(got->expires_at_ms, 0);
  }
  // Keys are binary-safe too.
  std::string key("a\0b\r\n c", 7);
  ASSERT_TRUE(tier_->Put(key, MakeEntry("v")).ok());
  EXPECT_EQ(tier_->Get(key)->value->view(), "v");
  EXPECT_EQ(tier_->Get(std::string("a\0b", 3)).status().code(), StatusCode::kNotFound);
}

Entry SeqEntry(std::string_view bytes, uint64_t seq) { return Entry{Blob::Copy(bytes), 0, seq}; }

// Redis orders writes by sequence number itself: a late write-behind or another instance's
// older write cannot replace a newer value or resurrect a deleted key.
TEST_F(RedisTierTest, AnOlderWriteNeverReplacesANewerOneAndTombstonesHoldBackOlderWrites) {
  ASSERT_TRUE(tier_->Put("k", SeqEntry("newer", 2000)).ok());
  ASSERT_TRUE(tier_->Put("k", SeqEntry("older", 1000)).ok());  // accepted, ignored
  Result<Entry> got = tier_->Get("k");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->value->view(), "newer");
  EXPECT_EQ(got->seq, 2000u);
  EXPECT_EQ(tier_->Stats().stale_puts, 1);
  // 20-digit numbers: 10^19 > 9 * 10^18 compares right as text.
  ASSERT_TRUE(tier_->Put("big", SeqEntry("a", 9000000000000000000ull)).ok());
  ASSERT_TRUE(tier_->Put("big", SeqEntry("b", 10000000000000000000ull)).ok());
  ASSERT_TRUE(tier_->Put("big", SeqEntry("c", 9999999999999999999ull)).ok());
  EXPECT_EQ(tier_->Get("big")->value->view(), "b");

  ASSERT_TRUE(tier_->DeleteAt("k", 3000).ok());
  EXPECT_EQ(tier_->Get("k").status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(*tier_->Contains("k"));
  EXPECT_FALSE(*tier_->ContainsMany({"k"})[0]);
  ASSERT_TRUE(tier_->Put("k", SeqEntry("late", 2500)).ok());  // older than the delete
  EXPECT_EQ(tier_->Get("k").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(tier_->Put("k", SeqEntry("after", 3500)).ok());
  EXPECT_EQ(tier_->Get("k")->value->view(), "after");
  ASSERT_TRUE(tier_->DeleteAt("k", 3400).ok());  // older than the value: ignored
  EXPECT_EQ(tier_->Get("k")->value->view(), "after");

  // The tombstone expires by itself.
  DirectConn c(SharedRedis().port(), SharedRedis().host());
  ASSERT_TRUE(tier_->DeleteAt("k", 4000).ok());
  const std::string full = tier_->options().key_prefix + "k";
  const long long ttl = std::atoll(c.Text({"PTTL", full}).c_str());
  EXPECT_GT(ttl, 0);
  EXPECT_LE(ttl, 10 * 60 * 1000);
}

TEST_F(RedisTierTest, AValueInTheOlderPlainStringFormatReadsAsAbsentAndIsReplaced) {
  DirectConn c(SharedRedis().port(), SharedRedis().host());
  const std::string full = tier_->options().key_prefix + "legacy";
  ASSERT_EQ(c.Text({"SET", full, "raw-bytes"}), "OK");
  EXPECT_EQ(tier_->Get("legacy").status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(*tier_->Contains("legacy"));
  EXPECT_EQ(tier_->GetMany({"legacy"})[0].status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(tier_->Put("legacy", SeqEntry("fresh", 1)).ok());
  EXPECT_EQ(tier_->Get("legacy")->value->view(), "fresh");
  EXPECT_EQ(tier_->Stats().errors, 0);
}

TEST_F(RedisTierTest, OverwriteReplacesValue) {
  ASSERT_TRUE(tier_->Put("k", MakeEntry(BinaryValue(1000, 1))).ok());
  ASSERT_TRUE(tier_->Put("k", MakeEntry(BinaryValue(10, 2))).ok());
  EXPECT_EQ(tier_->Get("k")->value->view(), BinaryValue(10, 2));
  // Overwriting a TTL'd entry with a permanent one drops the TTL (SET replaces it).
  ASSERT_TRUE(tier_->Put("t", MakeEntry("x", NowUnixMs() + 60000)).ok());
  ASSERT_TRUE(tier_->Put("t", MakeEntry("y")).ok());
  EXPECT_EQ(tier_->Get("t")->expires_at_ms, 0);
}

TEST_F(RedisTierTest, DeleteAndContains) {
  EXPECT_FALSE(*tier_->Contains("k"));
  EXPECT_EQ(tier_->Get("k").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(tier_->Put("k", MakeEntry("value")).ok());
  EXPECT_TRUE(*tier_->Contains("k"));
  EXPECT_TRUE(tier_->Delete("k").ok());
  EXPECT_FALSE(*tier_->Contains("k"));
  EXPECT_EQ(tier_->Get("k").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(tier_->Delete("k").ok());  // absent: still OK
}

TEST_F(RedisTierTest, RejectsBadKeysAndNullValues) {
  EXPECT_EQ(tier_->Put("", MakeEntry("v")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier_->Put(std::string(kMaxKeyBytes + 1, 'k'), MakeEntry("v")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier_->Put("k", Entry{}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier_->Get("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier_->Contains("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier_->Delete("").code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(tier_->Put(std::string(kMaxKeyBytes, 'k'), MakeEntry("v")).ok());
}

TEST_F(RedisTierTest, GetManyAndContainsManyMixPresentAndAbsent) {
  std::vector<std::string> names;
  for (int i = 0; i < 60; ++i) names.push_back("key-" + std::to_string(i));
  for (int i = 0; i < 60; i += 2) ASSERT_TRUE(tier_->Put(names[i], MakeEntry(BinaryValue(100 + i, i))).ok());
  std::vector<std::string_view> keys(names.begin(), names.end());
  keys.push_back("");  // invalid: reported in its own slot, the rest still answered

  std::vector<Result<Entry>> got = tier_->GetMany(keys);
  std::vector<Result<bool>> has = tier_->ContainsMany(keys);
  ASSERT_EQ(got.size(), keys.size());
  ASSERT_EQ(has.size(), keys.size());
  for (int i = 0; i < 60; ++i) {
    if (i % 2 == 0) {
      ASSERT_TRUE(got[i].ok()) << i << ": " << got[i].status().ToString();
      EXPECT_EQ(got[i]->value->view(), BinaryValue(100 + i, i)) << i;
      EXPECT_TRUE(*has[i]) << i;
    } else {
      EXPECT_EQ(got[i].status().code(), StatusCode::kNotFound) << i;
      EXPECT_FALSE(*has[i]) << i;
    }
  }
  EXPECT_EQ(got.back().status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(has.back().status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(tier_->GetMany({}).empty());

  TierStats s = tier_->Stats();
  EXPECT_EQ(s.hits, 30);
  EXPECT_EQ(s.misses, 30);
}

TEST_F(RedisTierTest, ExpiryInThePastIsNotStoredAndFutureTtlExpires) {
  ASSERT_TRUE(tier_->Put("old", MakeEntry("v1")).ok());
  ASSERT_TRUE(tier_->Put("old", MakeEntry("v2", NowUnixMs() - 1000)).ok());  // replaced by nothing
  EXPECT_EQ(tier_->Get("old").status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(*tier_->Contains("old"));

  int64_t expires = NowUnixMs() + 400;
  ASSERT_TRUE(tier_->Put("soon", MakeEntry("v", expires)).ok());
  Result<Entry> got = tier_->Get("soon");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->expires_at_ms, expires);  // read back with PEXPIRETIME
  EXPECT_TRUE(*tier_->Contains("soon"));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(tier_->Get("soon").status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(*tier_->Contains("soon"));
  EXPECT_EQ(tier_->GetMany({"soon"})[0].status().code(), StatusCode::kNotFound);
}

TEST_F(RedisTierTest, StatsCountHitsMissesPutsBytes) {
  ASSERT_TRUE(tier_->Put("a", MakeEntry(std::string(100, 'a'))).ok());
  ASSERT_TRUE(tier_->Put("b", MakeEntry(std::string(28, 'b'))).ok());
  ASSERT_TRUE(tier_->Get("a").ok());
  EXPECT_FALSE(tier_->Get("zz").ok());
  TierStats s = tier_->Stats();
  EXPECT_EQ(s.name, "redis");
  EXPECT_EQ(s.items, -1);
  EXPECT_EQ(s.puts, 2);
  EXPECT_EQ(s.bytes, 128);
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.errors, 0);
}

TEST_F(RedisTierTest, ConcurrentPutsAndGetsSeeTheirOwnValues) {
  RedisOptions o = tier_->options();
  o.max_connections = 3;  // fewer connections than threads: borrowers wait their turn
  std::unique_ptr<RedisTier> tier = ConnectOrDie(o);
  ASSERT_NE(tier, nullptr);
  constexpr int kThreads = 8, kOps = 150;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kOps; ++i) {
        std::string key = "t" + std::to_string(t) + "-" + std::to_string(i % 20);
        std::string value = BinaryValue(1 + (i * 37) % 5000, t * 1000 + i);
        if (!tier->Put(key, MakeEntry(value)).ok()) ++failures;
        Result<Entry> got = tier->Get(key);
        if (!got.ok() || got->value->view() != value) ++failures;
        if (i % 10 == 0) {
          std::vector<Result<Entry>> many = tier->GetMany({key, "absent"});
          if (!many[0].ok() || many[0]->value->view() != value || many[1].status().code() != StatusCode::kNotFound) {
            ++failures;
          }
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  TierStats s = tier->Stats();
  EXPECT_EQ(s.puts, kThreads * kOps);
  EXPECT_EQ(s.errors, 0);
}

TEST(RedisUrlTest, ParsesGoodUrls) {
  Result<RedisOptions> o = ParseRedisUrl("redis://cache.local:7000");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->host, "cache.local");
  EXPECT_EQ(o->port, 7000);
  EXPECT_FALSE(o->cluster);
  EXPECT_EQ(o->key_prefix, "keel:kv:");

  o = ParseRedisUrl("10.0.0.5:6380");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host, "10.0.0.5");
  EXPECT_EQ(o->port, 6380);

  o = ParseRedisUrl("redis+cluster://10.0.0.5:30001");
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->cluster);
  EXPECT_EQ(o->port, 30001);

  o = ParseRedisUrl("redis://localhost");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->port, 6379);

  o = ParseRedisUrl("redis://[::1]:6390/");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host, "::1");
  EXPECT_EQ(o->port, 6390);
}

TEST(RedisUrlTest, RejectsBadUrlsWithReasons) {
  struct Case {
    const char* url;
    const char* reason;
  };
  for (const Case& c : std::vector<Case>{{"", "no host"},
                                         {"redis://", "no host"},
                                         {":6379", "no host"},
                                         {"http://h:1", "unknown scheme"},
                                         {"redis://h:", "empty port"},
                                         {"redis://h:abc", "not a number"},
                                         {"redis://h:0", "1..65535"},
                                         {"redis://h:70000", "1..65535"},
                                         {"h:6379x", "not a number"},
                                         {"redis://user:pw@h:1", "credentials"},
                                         {"redis://h:1/2", "database"},
                                         {"::1:6379", "brackets"},
                                         {"redis://[::1", "unterminated"}}) {
    Result<RedisOptions> o = ParseRedisUrl(c.url);
    ASSERT_FALSE(o.ok()) << c.url;
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument) << c.url;
    EXPECT_NE(o.status().message().find(c.reason), std::string::npos) << c.url << " -> " << o.status().message();
  }
}

TEST(RedisSlotTest, Crc16AndSlotsMatchRedis) {
  EXPECT_EQ(Crc16Xmodem("123456789"), 0x31C3);  // the XMODEM check value
  EXPECT_EQ(Crc16Xmodem(""), 0);
  EXPECT_EQ(RedisClusterSlot("foo"), 12182);
  EXPECT_EQ(RedisClusterSlot("bar"), 5061);
  EXPECT_EQ(RedisClusterSlot("hello"), 866);
  EXPECT_EQ(RedisClusterSlot("{user1000}.following"), RedisClusterSlot("{user1000}.followers"));
  EXPECT_EQ(RedisClusterSlot("{user1000}.following"), RedisClusterSlot("user1000"));
  EXPECT_EQ(RedisClusterSlot("foo{}{bar}"), Crc16Xmodem("foo{}{bar}") % 16384);  // empty tag: whole key
  EXPECT_EQ(RedisClusterSlot("foo{{bar}}zap"), RedisClusterSlot("{bar"));        // first '{' to first '}'
  EXPECT_EQ(RedisClusterSlot("foo{bar}{zap}"), RedisClusterSlot("bar"));
  EXPECT_EQ(RedisClusterSlot("no{close"), Crc16Xmodem("no{close") % 16384);
}

TEST(RedisTierFailureTest, RefusedConnectionIsUnavailableQuickly) {
  int port = FreeLoopbackPort();
  RedisOptions o = OptionsFor("127.0.0.1", port, "refused");
  auto start = Clock::now();
  Result<std::unique_ptr<RedisTier>> t = RedisTier::Connect(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(t.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos) << t.status().message();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
}

TEST(RedisTierFailureTest, ServerThatNeverAnswersTimesOut) {
  // A listening socket nobody accepts on: connect succeeds (the kernel's backlog), replies never come.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  RedisOptions o = OptionsFor("127.0.0.1", ntohs(a.sin_port), "silent");
  o.command_timeout_ms = 300;
  auto start = Clock::now();
  Result<std::unique_ptr<RedisTier>> t = RedisTier::Connect(o);
  auto took = Clock::now() - start;
  ::close(fd);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(t.status().message().find("timed out"), std::string::npos) << t.status().message();
  EXPECT_GE(took, std::chrono::milliseconds(250));
  EXPECT_LT(took, std::chrono::seconds(5));
}

TEST(RedisTierFailureTest, ClusterModeAgainstStandaloneServerIsInvalidArgument) {
  ASSERT_TRUE(SharedRedis().ok()) << "no redis-server";
  RedisOptions o = OptionsFor(SharedRedis().host(), SharedRedis().port(), "notcluster");
  o.cluster = true;
  Result<std::unique_ptr<RedisTier>> t = RedisTier::Connect(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().ToString();
}

TEST(RedisTierFailureTest, KilledServerIsUnavailableAndTierRecoversOnRestart) {
  auto redis = std::make_unique<RedisProcess>("", /*force_private=*/true);
  ASSERT_TRUE(redis->ok()) << "no redis-server";
  int port = redis->port();
  std::unique_ptr<RedisTier> tier = ConnectOrDie(OptionsFor("127.0.0.1", port, "killed"));
  ASSERT_NE(tier, nullptr);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(tier->Put("k" + std::to_string(i), MakeEntry("before")).ok());
  ASSERT_TRUE(tier->GetMany({"k0", "k1", "k2", "k3"})[3].ok());

  redis->Stop();
  std::string where = "127.0.0.1:" + std::to_string(port);
  auto start = Clock::now();
  Result<Entry> got = tier->Get("k0");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(got.status().message().find(where), std::string::npos) << got.status().message();
  Status put = tier->Put("k9", MakeEntry("during"));
  EXPECT_EQ(put.code(), StatusCode::kUnavailable) << put.ToString();
  EXPECT_EQ(tier->Contains("k0").status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(tier->Delete("k0").code(), StatusCode::kUnavailable);
  std::vector<Result<Entry>> many = tier->GetMany({"k0", "k1"});
  EXPECT_EQ(many[0].status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(many[1].status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(tier->ContainsMany({"k0"})[0].status().code(), StatusCode::kUnavailable);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_GE(tier->Stats().errors, 7);

  RedisOnPort again(port);  // a fresh, empty server where the old one was
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(tier->Get("k0").status().code(), StatusCode::kNotFound);  // the data died with the server
  ASSERT_TRUE(tier->Put("k0", MakeEntry("after")).ok());
  EXPECT_EQ(tier->Get("k0")->value->view(), "after");
  EXPECT_TRUE(tier->GetMany({"k0"})[0].ok());
}

// ---- Redis Cluster ------------------------------------------------------------------------------

// Three private cluster-enabled servers joined by redis-cli into one cluster (all 16384 slots,
// no replicas). The bus port is chosen explicitly: port + 10000 may not exist.
class RedisClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string create = "redis-cli --cluster create";
    for (int i = 0; i < 3; ++i) {
      for (int attempt = 0; attempt < 3; ++attempt) {
        int bus = FreeLoopbackPort();
        auto node = std::make_unique<RedisProcess>(
            "--cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000 --cluster-port " +
                std::to_string(bus),
            true);
        if (node->ok()) {
          nodes_.push_back(std::move(node));
          break;
        }
      }
      ASSERT_EQ(nodes_.size(), static_cast<size_t>(i + 1)) << "cannot start cluster-enabled redis-server";
      create += " 127.0.0.1:" + std::to_string(nodes_.back()->port());
    }
    create += " --cluster-replicas 0 --cluster-yes > /dev/null 2>&1";
    ASSERT_EQ(std::system(create.c_str()), 0) << "redis-cli --cluster create failed (is redis-tools installed?)";
    auto deadline = Clock::now() + std::chrono::seconds(20);
    for (auto& node : nodes_) {
      DirectConn c(node->port());
      ASSERT_TRUE(c.ok());
      while (c.Text({"CLUSTER", "INFO"}).find("cluster_state:ok") == std::string::npos) {
        ASSERT_LT(Clock::now(), deadline) << "cluster never reached cluster_state:ok";
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }

  RedisOptions ClusterOptions(int seed, const std::string& prefix) {
    RedisOptions o;
    o.port = nodes_[seed]->port();
    o.cluster = true;
    o.key_prefix = prefix;
    return o;
  }

  std::vector<std::unique_ptr<RedisProcess>> nodes_;
};

TEST_F(RedisClusterTest, SpreadsKeysOverNodesAndFollowsMoved) {
  std::string prefix = UniquePrefix("cluster");
  std::unique_ptr<RedisTier> tier = ConnectOrDie(ClusterOptions(0, prefix));
  ASSERT_NE(tier, nullptr);
  EXPECT_GE(tier->cluster_counters().map_refreshes, 1);

  constexpr int kKeys = 200;
  std::vector<std::string> names;
  for (int i = 0; i < kKeys; ++i) names.push_back("chunk-" + std::to_string(i));
  for (int i = 0; i < kKeys; ++i) ASSERT_TRUE(tier->Put(names[i], MakeEntry(BinaryValue(50 + i, i))).ok()) << i;
  for (int i = 0; i < kKeys; ++i) {
    Result<Entry> got = tier->Get(names[i]);
    ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
    EXPECT_EQ(got->value->view(), BinaryValue(50 + i, i));
  }
  EXPECT_EQ(tier->cluster_counters().moved, 0);  // the slot map was right all along

  // The keys really are spread, and our slot function agrees with the server's.
  int nodes_with_keys = 0;
  int64_t total = 0;
  for (auto& node : nodes_) {
    DirectConn c(node->port());
    int64_t n = std::stoll(c.Text({"DBSIZE"}));
    total += n;
    nodes_with_keys += n > 0;
  }
  EXPECT_EQ(total, kKeys);
  EXPECT_GE(nodes_with_keys, 2);
  DirectConn any(nodes_[1]->port());
  for (int i = 0; i < 20; ++i) {
    std::string full = prefix + names[i];
    EXPECT_EQ(any.Text({"CLUSTER", "KEYSLOT", full}), std::to_string(RedisClusterSlot(full))) << full;
  }

  // Pipelined batches, grouped by node.
  std::vector<std::string_view> keys(names.begin(), names.end());
  keys.push_back("absent");
  std::vector<Result<Entry>> many = tier->GetMany(keys);
  std::vector<Result<bool>> has = tier->ContainsMany(keys);
  for (int i = 0; i < kKeys; ++i) {
    ASSERT_TRUE(many[i].ok()) << i << ": " << many[i].status().ToString();
    EXPECT_EQ(many[i]->value->view(), BinaryValue(50 + i, i));
    EXPECT_TRUE(*has[i]);
  }
  EXPECT_EQ(many.back().status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(*has.back());

  // With no slot map everything goes to the seed; keys it does not own come back MOVED.
  tier->ForgetSlotMapForTesting();
  for (int i = 0; i < kKeys; ++i) {
    Result<Entry> got = tier->Get(names[i]);
    ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
    EXPECT_EQ(got->value->view(), BinaryValue(50 + i, i));
  }
  EXPECT_GE(tier->cluster_counters().moved, 1);
  tier->ForgetSlotMapForTesting();
  many = tier->GetMany(keys);
  for (int i = 0; i < kKeys; ++i) ASSERT_TRUE(many[i].ok()) << i << ": " << many[i].status().ToString();

  // Any node works as the seed.
  std::unique_ptr<RedisTier> via2 = ConnectOrDie(ClusterOptions(2, prefix));
  ASSERT_NE(via2, nullptr);
  EXPECT_EQ(via2->Get(names[7])->value->view(), BinaryValue(57, 7));
  EXPECT_TRUE(via2->Delete(names[7]).ok());
  EXPECT_FALSE(*tier->Contains(names[7]));
  EXPECT_EQ(tier->Stats().errors, 0);
}

TEST_F(RedisClusterTest, HashTagPinsNamespaceAndAskMovedFollowMigration) {
  // A {tag} in the prefix puts every key of the namespace in one slot.
  std::string prefix = "keeltest:{" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}()) + "}:";
  std::unique_ptr<RedisTier> tier = ConnectOrDie(ClusterOptions(0, prefix));
  ASSERT_NE(tier, nullptr);
  int slot = RedisClusterSlot(prefix + "x");
  ASSERT_EQ(slot, RedisClusterSlot(prefix + "y"));
  ASSERT_TRUE(tier->Put("old", MakeEntry("old-value")).ok());
  ASSERT_TRUE(tier->Put("also", MakeEntry("also-value")).ok());

  // Find the owner (source) and another node (target) by asking each node for the key.
  int source = -1;
  for (int i = 0; i < 3; ++i) {
    DirectConn c(nodes_[i]->port());
    if (c.Text({"HGET", prefix + "old", "v"}) == "old-value") source = i;
  }
  ASSERT_GE(source, 0);
  int target = (source + 1) % 3;
  DirectConn src(nodes_[source]->port()), dst(nodes_[target]->port());
  std::string src_id = src.Text({"CLUSTER", "MYID"}), dst_id = dst.Text({"CLUSTER", "MYID"});
  std::string s = std::to_string(slot);

  // Mid-migration: keys still on the source are served there, new ones go to the target (ASK).
  ASSERT_EQ(dst.Text({"CLUSTER", "SETSLOT", s, "IMPORTING", src_id}), "OK");
  ASSERT_EQ(src.Text({"CLUSTER", "SETSLOT", s, "MIGRATING", dst_id}), "OK");
  EXPECT_EQ(tier->Get("old")->value->view(), "old-value");
  ASSERT_TRUE(tier->Put("new", MakeEntry("new-value", NowUnixMs() + 60000)).ok());
  EXPECT_GE(tier->cluster_counters().ask, 1);
  EXPECT_EQ(dst.Text({"ASKING"}), "OK");
  EXPECT_EQ(dst.Text({"HGET", prefix + "new", "v"}), "new-value");  // it landed on the target
  Result<Entry> fresh = tier->Get("new");
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(fresh->value->view(), "new-value");
  EXPECT_GT(fresh->expires_at_ms, 0);  // PEXPIRETIME also went through ASKING
  std::vector<Result<Entry>> many = tier->GetMany({"old", "new", "none"});
  ASSERT_TRUE(many[0].ok() && many[1].ok()) << many[0].status().ToString() << " / " << many[1].status().ToString();
  EXPECT_EQ(many[0]->value->view(), "old-value");
  EXPECT_EQ(many[1]->value->view(), "new-value");
  EXPECT_EQ(many[2].status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(*tier->ContainsMany({"new"})[0]);

  // Finish: move the remaining keys, hand the slot over everywhere. The tier's map is now
  // stale; the source answers MOVED and the tier refreshes.
  std::string dst_port = std::to_string(nodes_[target]->port());
  ASSERT_EQ(src.Text({"MIGRATE", "127.0.0.1", dst_port, "", "0", "5000", "KEYS", prefix + "old", prefix + "also"}),
            "OK");
  for (int i = 0; i < 3; ++i) {
    DirectConn c(nodes_[i]->port());
    ASSERT_EQ(c.Text({"CLUSTER", "SETSLOT", s, "NODE", dst_id}), "OK") << i;
  }
  int64_t moved_before = tier->cluster_counters().moved;
  Result<Entry> old = tier->Get("old");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(old->value->view(), "old-value");
  EXPECT_GT(tier->cluster_counters().moved, moved_before);
  EXPECT_EQ(tier->Get("also")->value->view(), "also-value");
  EXPECT_EQ(tier->Stats().errors, 0);
}

}  // namespace
}  // namespace keel::kvstore
