// chaos_bench: fault injection against real `keel` server processes on loopback (issue 17).
//
// Crash-restart: kvstore, vector and the gateway's policy service each run as a child process
// on a private port (or Unix socket) and temp directory while client threads write; at a random
// moment (seeded) the server gets SIGKILL, is restarted on the same data, and every acknowledged
// write is checked. Lost = an acknowledged durable write that is missing or reads back older.
//   kvstore: plain PUTs are write-behind by contract, so only persisted PUTs count as lost
//   (a plain PUT's survival is reported beside them); a read OLDER than the newest persisted ack
//   is lost even if that read version was a plain one. The workload includes the interleaving
//   "plain PUT v, then persisted PUT v+1 of the same key". A no-crash phase with a tiny DRAM tier
//   then checks that every acknowledged write (plain or persisted) reads back as its newest
//   version ("stale reads").
//   vector: upserts and deletes (every call is fdatasync'd to the WAL before its reply).
//   policy: keys, budgets, policies (admin API) and usage settlements (SQLite).
// Floods: slowloris (a header byte per second) and idle connections against `keel serve`,
// `keel vector`, kvstore's HTTP port and `keel gateway`, and idle connections on kvstore's
// binary port while a client does PUT/GET. A prober opens a fresh connection every 100 ms (5 s
// timeout) and GETs /healthz; reported: the longest time /healthz went unanswered and p99.
//
// kill -9 tests process crashes only: data the kernel holds in its page cache survives it, so
// this does NOT test power loss (see the "Durability" sections of docs/kvstore.md, vector.md,
// gateway.md for what is fdatasync'd before an acknowledgement).
//
//   chaos_bench --keel build/keel [--shared DIR (default $KEEL_SHARED)] [--rounds 5] [--duration 3] [--seed 1]
//               [--threads 4] [--slowloris 300] [--idle 2000] [--flood-seconds 10]
//               [--parts kvstore,vector,policy,flood] [--quick] [--assert-zero vector,policy]
// --parts: any of kvstore, vector, policy, flood (all four flood targets) or one flood target:
//   flood:serve, flood:vector, flood:kvstore, flood:gateway.
// --quick: 1 crash round per service, short phases and smaller floods (the CTest smoke run).
// --assert-zero: exit 1 when a listed service (kvstore, vector, policy) lost an acknowledged write
//   (kvstore: also when the no-crash phase read a value older than the newest acknowledged one).
// --inject N: self-check of the checker. After each restart, N acknowledged writes per service are
//   destroyed through its own API (kvstore: older version or DELETE; vector: delete; policy: a
//   budget deleted); exit 1 unless every one is counted lost (and, for --assert-zero services,
//   nothing else is).
// Exit 2 when the harness itself failed (a server did not start).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/common/child_process.h"
#include "keel/core/hash.h"
#include "keel/gateway/policy.h"
#include "keel/kvstore/client.h"

namespace keel::chaos {
namespace {

using json = nlohmann::json;
using bench::Child;
using bench::Clock;
using bench::FreeLoopbackPort;
using bench::MsSince;
using bench::SleepMs;
using bench::Tail;

struct Options {
  std::string keel = "build/keel";
  std::string shared = "../shared";
  int rounds = 5;
  double duration_s = 3;     // writers run this long per round at most; the kill lands in [40 %, 100 %)
  uint64_t seed = 1;
  int threads = 4;
  int slowloris = 300;
  int idle = 2000;
  double flood_s = 10;
  std::set<std::string> parts = {"kvstore", "vector", "policy", "flood"};
  std::set<std::string> assert_zero;
  bool quick = false;
  int inject = 0;  // self-check: acknowledged writes destroyed through the API after each restart
  std::string command_line;
};

// ---------------------------------------------------------------------------------------------
// A minimal HTTP/1.1 client (one request per connection, every wait bounded).

struct Endpoint {
  int port = 0;           // TCP on 127.0.0.1 when unix_path is empty
  std::string unix_path;
};

// Non-blocking connect to the endpoint; returns the fd (blocking mode restored) or -1.
int ConnectWithin(const Endpoint& ep, int timeout_ms) {
  const bool is_unix = !ep.unix_path.empty();
  int fd = ::socket(is_unix ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  int rc;
  if (is_unix) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, ep.unix_path.c_str(), sizeof(a.sun_path) - 1);
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(ep.port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  if (rc != 0 && errno != EINPROGRESS && errno != EAGAIN) {
    ::close(fd);
    return -1;
  }
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (::poll(&p, 1, timeout_ms) != 1 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      ::close(fd);
      return -1;
    }
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (!is_unix) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

struct HttpResult {
  int status = 0;  // 0: no answer (refused, timed out, closed, malformed)
  std::string body;
};

HttpResult Http(const Endpoint& ep, const std::string& method, const std::string& target, const std::string& body = "",
                const std::string& headers = "", int timeout_ms = 10000) {
  HttpResult out;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto left = [&] { return std::max(0, static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count())); };
  int fd = ConnectWithin(ep, timeout_ms);
  if (fd < 0) return out;
  std::string req = method + " " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + headers;
  if (!body.empty() || method == "POST" || method == "PUT") {
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  req += "\r\n" + body;
  size_t sent = 0;
  while (sent < req.size()) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, left()) != 1) break;
    ssize_t n = ::send(fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n <= 0 && errno != EAGAIN) break;
    if (n > 0) sent += static_cast<size_t>(n);
  }
  std::string resp;
  char buf[65536];
  size_t header_end = std::string::npos, want = std::string::npos;
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, left()) != 1) break;
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && errno == EAGAIN) continue;
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
    if (header_end == std::string::npos && (header_end = resp.find("\r\n\r\n")) != std::string::npos) {
      std::string head = resp.substr(0, header_end);
      for (auto& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (size_t cl = head.find("content-length:"); cl != std::string::npos) {
        want = header_end + 4 + std::strtoull(head.c_str() + cl + 15, nullptr, 10);
      }
    }
    if (want != std::string::npos && resp.size() >= want) break;
  }
  ::close(fd);
  if (header_end == std::string::npos || resp.size() < 12 || resp.compare(0, 5, "HTTP/") != 0) return out;
  if (want != std::string::npos && resp.size() < want) return out;  // cut short
  out.status = std::atoi(resp.c_str() + 9);
  out.body = resp.substr(header_end + 4);
  return out;
}

bool WaitUntil(const std::function<bool()>& ready, double timeout_s) {
  const auto t0 = Clock::now();
  while (MsSince(t0) < timeout_s * 1000) {
    if (ready()) return true;
    SleepMs(20);
  }
  return false;
}

bool Healthy(const Endpoint& ep) { return Http(ep, "GET", "/healthz", "", "", 2000).status == 200; }

// ---------------------------------------------------------------------------------------------
// Results

struct CrashRow {
  std::string service;
  int rounds = 0;
  int64_t acked = 0;       // acknowledged durable writes checked
  int64_t lost = 0;
  int64_t injected = 0;    // --inject: losses made on purpose, which `lost` must include
  std::string extra;       // service-specific notes (plain-PUT survival, restart times)
  bool harness_ok = true;
};

struct StaleRow {
  int64_t acked = 0;
  int64_t stale = 0;  // read back older than acknowledged (or missing)
  int64_t missing = 0;
  int64_t errors = 0;
  std::string extra;
  bool harness_ok = true;
};

struct FloodRow {
  std::string target, flood;
  int requested = 0, opened = 0, closed_by_server = 0;
  int probes = 0, failed = 0;
  double longest_ms = 0, p99_ms = 0;
  bool recovered = true;
  std::string extra;
  bool harness_ok = true;
};

// ---------------------------------------------------------------------------------------------
// kvstore: versioned values.
// value = header {u32 magic, u32 key index, u64 version, u64 checksum of the rest} + filler.

constexpr uint32_t kValueMagic = 0x4f414843;  // "CHAO"

std::string MakeValue(uint32_t key, uint64_t version, size_t size) {
  std::string v(std::max<size_t>(size, 24), '\0');
  uint64_t x = (static_cast<uint64_t>(key) << 32) ^ version ^ 0x9e3779b97f4a7c15ull;
  for (size_t i = 24; i + 8 <= v.size(); i += 8) {  // splitmix64 filler, different per version
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(v.data() + i, &z, 8);
  }
  std::memcpy(v.data(), &kValueMagic, 4);
  std::memcpy(v.data() + 4, &key, 4);
  std::memcpy(v.data() + 8, &version, 8);
  const uint64_t sum = Xxh3_64(v.data() + 24, v.size() - 24) ^ Xxh3_64(v.data(), 16);
  std::memcpy(v.data() + 16, &sum, 8);
  return v;
}

// The version a stored value carries, or nullopt when it is not a well-formed value of `key`.
std::optional<uint64_t> ValueVersion(const kvstore::Blob& b, uint32_t key) {
  if (b.size() < 24) return std::nullopt;
  uint32_t magic, k;
  uint64_t version, sum;
  std::memcpy(&magic, b.data(), 4);
  std::memcpy(&k, b.data() + 4, 4);
  std::memcpy(&version, b.data() + 8, 8);
  std::memcpy(&sum, b.data() + 16, 8);
  if (magic != kValueMagic || k != key) return std::nullopt;
  if (sum != (Xxh3_64(b.data() + 24, b.size() - 24) ^ Xxh3_64(b.data(), 16))) return std::nullopt;
  return version;
}

enum class KeyClass { kMixed, kPlain, kPersist, kHot };

struct KvKey {
  uint32_t index = 0;
  std::string name;
  KeyClass cls = KeyClass::kPlain;
  uint64_t sent = 0;            // highest version sent (perhaps never acknowledged)
  uint64_t acked = 0;           // newest acknowledged version, plain or persisted
  uint64_t acked_persist = 0;   // newest acknowledged persisted version
  bool written_this_round = false;
  bool lost_before = false;     // counted lost in an earlier round: not counted again
};

struct KvWorkload {
  std::vector<std::vector<KvKey>> per_thread;  // each key written by exactly one thread
  size_t value_bytes = 4096;
};

KvWorkload MakeKvWorkload(int threads, int keys_per_class, int hot_keys, size_t value_bytes) {
  KvWorkload w;
  w.value_bytes = value_bytes;
  uint32_t next = 0;
  w.per_thread.resize(threads);
  const char* names[] = {"mixed", "plain", "persist", "hot"};
  for (int t = 0; t < threads; ++t) {
    for (KeyClass c : {KeyClass::kMixed, KeyClass::kPlain, KeyClass::kPersist, KeyClass::kHot}) {
      const int n = c == KeyClass::kHot ? hot_keys : keys_per_class;
      for (int i = 0; i < n; ++i) {
        KvKey k;
        k.index = next++;
        k.cls = c;
        k.name = "chaos/" + std::string(names[static_cast<int>(c)]) + "/" + std::to_string(k.index);
        w.per_thread[t].push_back(std::move(k));
      }
    }
  }
  return w;
}

struct KvWriterStats {
  int64_t puts_ok = 0, gets = 0, stale_live = 0, missing_live = 0, errors = 0;
};

// One writer thread: until `stop` or the first failed call (the server was killed). Live GETs
// of its own keys check "newest acknowledged version or newer" while the server is up.
void KvWriter(int port, std::vector<KvKey>& keys, size_t value_bytes, uint64_t seed, const std::atomic<bool>& stop,
              bool stop_on_error, KvWriterStats* stats) {
  kvstore::ClientOptions co;
  co.connect_timeout_ms = 1000;
  co.timeout_ms = 5000;
  auto c = kvstore::Client::Connect("127.0.0.1", port, co);
  if (!c.ok()) {
    ++stats->errors;
    return;
  }
  kvstore::Client& client = **c;
  std::mt19937_64 rng(seed);
  std::vector<KvKey*> by_class[4];
  for (auto& k : keys) by_class[static_cast<int>(k.cls)].push_back(&k);
  size_t mixed_next = 0;
  auto put = [&](KvKey& k, bool persist) {
    const uint64_t v = ++k.sent;
    k.written_this_round = true;
    const std::string value = MakeValue(k.index, v, value_bytes);
    Status s = client.Put(k.name, value.data(), value.size(), 0, persist);
    if (!s.ok()) {
      ++stats->errors;
      return false;
    }
    ++stats->puts_ok;
    k.acked = v;
    if (persist) {
      k.acked_persist = v;
      k.lost_before = false;  // a new promise, checked again
    }
    return true;
  };
  while (!stop.load(std::memory_order_relaxed)) {
    const int r = static_cast<int>(rng() % 100);
    bool ok = true;
    KvKey* last = nullptr;
    if (r < 30 && !by_class[0].empty()) {
      // The reported interleaving: plain PUT v, then persisted PUT v+1 of the same key.
      KvKey& k = *by_class[0][mixed_next++ % by_class[0].size()];
      ok = put(k, false) && put(k, true);
      last = &k;
    } else if (r < 50 && !by_class[1].empty()) {
      last = by_class[1][rng() % by_class[1].size()];
      ok = put(*last, false);
    } else if (r < 70 && !by_class[2].empty()) {
      last = by_class[2][rng() % by_class[2].size()];
      ok = put(*last, true);
    } else if (!by_class[3].empty()) {
      last = by_class[3][rng() % by_class[3].size()];
      ok = put(*last, rng() % 2 == 0);
    }
    if (!ok) {
      if (stop_on_error) return;
      continue;
    }
    if (last != nullptr && rng() % 8 == 0) {
      // Read back a random own key that has an acknowledged version.
      KvKey& k = keys[rng() % keys.size()];
      if (k.acked == 0) continue;
      auto g = client.Get(k.name);
      ++stats->gets;
      if (!g.ok()) {
        if (g.status().code() == StatusCode::kNotFound) {
          ++stats->stale_live;
          ++stats->missing_live;
        } else {
          ++stats->errors;
          if (stop_on_error) return;
        }
        continue;
      }
      auto v = ValueVersion(**g, k.index);
      if (!v || *v < k.acked) ++stats->stale_live;
    }
  }
}

struct KvVerify {
  int64_t persisted_keys = 0, lost = 0, lost_missing = 0, lost_older = 0, corrupt = 0;
  int64_t plain_newest = 0, plain_survived = 0;  // keys whose newest ack was a plain PUT
  int64_t newest_checked = 0, stale = 0, missing = 0, errors = 0;
};

// Reads every key written so far and classifies it. crash=true: only persisted acks are
// promises; crash=false: every ack is.
KvVerify VerifyKv(int port, KvWorkload& w, bool crash) {
  KvVerify out;
  kvstore::ClientOptions co;
  co.timeout_ms = 20000;
  auto c = kvstore::Client::Connect("127.0.0.1", port, co);
  if (!c.ok()) {
    out.errors = 1;
    return out;
  }
  std::vector<KvKey*> all;
  for (auto& t : w.per_thread)
    for (auto& k : t)
      if (k.sent > 0) all.push_back(&k);
  for (size_t b = 0; b < all.size(); b += 128) {
    std::vector<std::string_view> names;
    for (size_t i = b; i < std::min(all.size(), b + 128); ++i) names.push_back(all[i]->name);
    auto got = (*c)->GetMany(names);
    if (!got.ok()) {
      out.errors += static_cast<int64_t>(names.size());
      continue;
    }
    for (size_t i = 0; i < names.size(); ++i) {
      KvKey& k = *all[b + i];
      const kvstore::BlobPtr& blob = (*got)[i];
      std::optional<uint64_t> v;
      if (blob) v = ValueVersion(*blob, k.index);
      const bool corrupt = blob && (!v || *v > k.sent);
      if (corrupt) ++out.corrupt;
      if (crash) {
        if (k.acked_persist > 0 && !k.lost_before) {
          ++out.persisted_keys;
          if (!blob || corrupt || *v < k.acked_persist) {
            ++out.lost;
            ++(blob ? out.lost_older : out.lost_missing);
            k.lost_before = true;  // one loss per key, not one per later round
          }
        }
        if (k.written_this_round && k.acked > k.acked_persist) {
          ++out.plain_newest;
          if (blob && !corrupt && *v >= k.acked) ++out.plain_survived;
        }
      } else if (k.acked > 0) {
        ++out.newest_checked;
        if (!blob) {
          ++out.missing;
          ++out.stale;
        } else if (corrupt || *v < k.acked) {
          ++out.stale;
        }
      }
      k.written_this_round = false;
    }
  }
  return out;
}

// --inject: n keys with a persisted ack get an older version (persisted) or are deleted, as the
// bugs under test would do; the checker must count every one of them.
int64_t InjectKv(int port, KvWorkload& w, int n, std::mt19937_64& rng) {
  auto c = kvstore::Client::Connect("127.0.0.1", port);
  if (!c.ok()) return 0;
  std::vector<KvKey*> cand;
  for (auto& t : w.per_thread)
    for (auto& k : t)
      if (k.acked_persist > 0 && !k.lost_before) cand.push_back(&k);
  std::shuffle(cand.begin(), cand.end(), rng);
  int64_t done = 0;
  for (int i = 0; i < n && i < static_cast<int>(cand.size()); ++i) {
    KvKey& k = *cand[i];
    Status s = k.acked_persist > 1 && i % 2 == 0
                   ? [&] {
                       const std::string v = MakeValue(k.index, k.acked_persist - 1, w.value_bytes);
                       return (*c)->Put(k.name, v.data(), v.size(), 0, true);
                     }()
                   : (*c)->Delete(k.name);
    if (s.ok()) ++done;
  }
  return done;
}

std::vector<std::string> KvstoreArgs(int port, int http_port, const std::string& dir, int dram_mb) {
  return {"kvstore",  "--port",     std::to_string(port), "--http-port", std::to_string(http_port),
          "--dram-mb", std::to_string(dram_mb), "--ssd-dir", dir, "--ssd-mb", "1024", "--log-level", "warn"};
}

CrashRow KvstoreCrash(const Options& o, const std::string& work, std::mt19937_64& rng, std::string* log) {
  CrashRow row;
  row.service = "kvstore";
  const std::string dir = work + "/kvstore-crash";
  std::filesystem::create_directories(dir);
  const int port = FreeLoopbackPort(), http_port = FreeLoopbackPort();
  const int keys_per_class = o.quick ? 150 : 400;
  KvWorkload w = MakeKvWorkload(o.threads, keys_per_class, 8, 4096);
  Child server(o.keel, KvstoreArgs(port, http_port, dir, 2), work + "/kvstore-crash.log");
  int64_t plain_newest = 0, plain_survived = 0, lost_missing = 0, lost_older = 0, corrupt = 0, puts = 0;
  double worst_restart_ms = 0;
  // Round r starts the server on the data of round r-1's crash and checks it before writing more;
  // the last start only checks.
  for (int round = 0; round <= o.rounds; ++round) {
    const auto t0 = Clock::now();
    if (!server.StartReady([&] { return Healthy({http_port, ""}); })) {
      *log += "kvstore did not start: " + Tail(server.log()) + "\n";
      row.harness_ok = false;
      return row;
    }
    if (round > 0) {
      worst_restart_ms = std::max(worst_restart_ms, MsSince(t0));
      if (o.inject > 0) row.injected += InjectKv(port, w, o.inject, rng);
      KvVerify v = VerifyKv(port, w, true);
      row.acked += v.persisted_keys;
      row.lost += v.lost;
      lost_missing += v.lost_missing;
      lost_older += v.lost_older;
      corrupt += v.corrupt;
      plain_newest += v.plain_newest;
      plain_survived += v.plain_survived;
      if (v.errors) row.harness_ok = false;
      *log += "kvstore round " + std::to_string(round) + ": persisted keys " + std::to_string(v.persisted_keys) +
              ", lost " + std::to_string(v.lost) + " (missing " + std::to_string(v.lost_missing) + ", older " +
              std::to_string(v.lost_older) + "), plain-newest survived " + std::to_string(v.plain_survived) + "/" +
              std::to_string(v.plain_newest) + "\n";
    }
    if (round == o.rounds) break;
    std::atomic<bool> stop{false};
    std::vector<KvWriterStats> stats(o.threads);
    std::vector<std::thread> writers;
    for (int t = 0; t < o.threads; ++t) {
      writers.emplace_back(KvWriter, port, std::ref(w.per_thread[t]), w.value_bytes, o.seed * 1000 + round * 16 + t,
                           std::cref(stop), true, &stats[t]);
    }
    const double kill_at = o.duration_s * 1000 * std::uniform_real_distribution<double>(0.4, 1.0)(rng);
    SleepMs(kill_at);
    server.Kill9();  // mid-write: every thread has a call in flight or about to be
    stop = true;
    for (auto& t : writers) t.join();
    for (auto& s : stats) puts += s.puts_ok;
    ++row.rounds;
  }
  server.Kill9();
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%" PRId64 " PUTs acked; lost: %" PRId64 " read older, %" PRId64 " missing; corrupt %" PRId64
                "; plain-PUT-newest keys that survived: %" PRId64 "/%" PRId64 " (write-behind, not counted); "
                "slowest restart %.0f ms",
                puts, lost_older, lost_missing, corrupt, plain_survived, plain_newest, worst_restart_ms);
  row.extra = buf;
  return row;
}

StaleRow KvstoreNoCrash(const Options& o, const std::string& work, std::string* log) {
  StaleRow row;
  const std::string dir = work + "/kvstore-tiny";
  std::filesystem::create_directories(dir);
  const int port = FreeLoopbackPort(), http_port = FreeLoopbackPort();
  // 16 KiB values into a 1 MiB DRAM tier: at most ~64 values in DRAM, the rest evicted to SSD.
  KvWorkload w = MakeKvWorkload(o.threads, o.quick ? 100 : 300, 8, 16384);
  Child server(o.keel, KvstoreArgs(port, http_port, dir, 1), work + "/kvstore-tiny.log");
  if (!server.StartReady([&] { return Healthy({http_port, ""}); })) {
    *log += "kvstore (tiny DRAM) did not start: " + Tail(server.log()) + "\n";
    row.harness_ok = false;
    return row;
  }
  std::atomic<bool> stop{false};
  std::vector<KvWriterStats> stats(o.threads);
  std::vector<std::thread> writers;
  for (int t = 0; t < o.threads; ++t) {
    writers.emplace_back(KvWriter, port, std::ref(w.per_thread[t]), w.value_bytes, o.seed * 7777 + t, std::cref(stop),
                         false, &stats[t]);
  }
  SleepMs(o.duration_s * 1000);
  stop = true;
  for (auto& t : writers) t.join();
  int64_t live_stale = 0, live_missing = 0, live_gets = 0, puts = 0;
  for (auto& s : stats) {
    live_stale += s.stale_live;
    live_missing += s.missing_live;
    live_gets += s.gets;
    row.errors += s.errors;
    puts += s.puts_ok;
  }
  KvVerify v = VerifyKv(port, w, false);
  row.acked = v.newest_checked;
  row.stale = v.stale + live_stale;
  row.missing = v.missing + live_missing;
  row.errors += v.errors;
  server.Kill9();
  char buf[300];
  std::snprintf(buf, sizeof buf,
                "%" PRId64 " PUTs acked; final read of %" PRId64 " keys: %" PRId64 " stale (%" PRId64
                " missing); reads during the writes: %" PRId64 " stale of %" PRId64 "; call errors %" PRId64,
                puts, v.newest_checked, v.stale, v.missing, live_stale, live_gets, row.errors);
  row.extra = buf;
  *log += "kvstore tiny DRAM: " + row.extra + "\n";
  return row;
}

// ---------------------------------------------------------------------------------------------
// vector: per id, the acknowledged state (version, or deleted) and the state of a call in flight.

constexpr int kVecDim = 8;

// Dyadic floats: exact through JSON both ways. Different per (id, version, modality).
std::vector<float> VecOf(uint64_t id, int64_t version, int modality) {
  std::vector<float> v(kVecDim);
  uint64_t x = id * 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(version) * 0xbf58476d1ce4e5b9ull ^ (modality + 1);
  for (int i = 0; i < kVecDim; ++i) {
    x ^= x >> 31;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 29;
    v[i] = static_cast<float>(static_cast<int64_t>(x % 4001) - 2000) / 64.0f;
  }
  return v;
}

struct VecId {
  uint64_t id = 0;
  int64_t acked = 0;     // 0: never acknowledged; >0: version; -1: deleted
  int64_t pending = 0;   // state of an unacknowledged call in flight (0: none)
  bool has_pending = false;
  bool lost_before = false;
};

struct VecWriterStats {
  int64_t upserts = 0, deletes = 0, errors = 0;
};

void VecWriter(int port, std::vector<VecId>& ids, uint64_t seed, const std::atomic<bool>& stop, int64_t* version,
               VecWriterStats* stats) {
  std::mt19937_64 rng(seed);
  while (!stop.load(std::memory_order_relaxed)) {
    const bool del = rng() % 100 < 15;
    const int n = 1 + static_cast<int>(rng() % (del ? 5 : 20));
    std::set<size_t> pick;
    while (static_cast<int>(pick.size()) < n) pick.insert(rng() % ids.size());
    json body;
    const int64_t v = ++*version;
    if (del) {
      json arr = json::array();
      for (size_t i : pick) arr.push_back(ids[i].id);
      body = {{"ids", arr}};
    } else {
      json items = json::array();
      for (size_t i : pick) {
        items.push_back({{"id", ids[i].id}, {"text", VecOf(ids[i].id, v, 0)}, {"image", VecOf(ids[i].id, v, 1)}});
      }
      body = {{"items", items}};
    }
    for (size_t i : pick) {
      ids[i].pending = del ? -1 : v;
      ids[i].has_pending = true;
    }
    HttpResult r = Http({port, ""}, "POST", del ? "/v1/delete" : "/v1/upsert", body.dump(), "", 10000);
    if (r.status != 200) {
      ++stats->errors;
      return;  // killed: the pending states stay as "may or may not have been applied"
    }
    for (size_t i : pick) {
      ids[i].acked = ids[i].pending;
      ids[i].has_pending = false;
    }
    ++(del ? stats->deletes : stats->upserts);
  }
}

struct VecVerify {
  int64_t acked_ids = 0, lost = 0, wrong_vector = 0, missing = 0, resurrected = 0, search_miss = 0;
  bool error = false;
};

VecVerify VerifyVector(int port, std::vector<std::vector<VecId>>& all) {
  VecVerify out;
  std::vector<VecId*> ids;
  for (auto& t : all)
    for (auto& i : t)
      if ((i.acked != 0 || i.has_pending) && !i.lost_before) ids.push_back(&i);
  std::map<uint64_t, std::vector<float>> images;
  for (size_t b = 0; b < ids.size(); b += 500) {
    json arr = json::array();
    for (size_t i = b; i < std::min(ids.size(), b + 500); ++i) arr.push_back(ids[i]->id);
    HttpResult r = Http({port, ""}, "POST", "/v1/search", json{{"kind", "image"}, {"ids", arr}}.dump(), "", 20000);
    json j = json::parse(r.body, nullptr, false);
    if (r.status != 200 || !j.is_object()) {
      out.error = true;
      return out;
    }
    for (const auto& h : j["hits"]) images[h["id"].get<uint64_t>()] = h["image"].get<std::vector<float>>();
  }
  for (VecId* p : ids) {
    VecId& i = *p;
    auto state_ok = [&](int64_t state, std::string* why) {
      auto it = images.find(i.id);
      if (state == -1 || state == 0) {
        if (it != images.end()) *why = "resurrected";
        return it == images.end();
      }
      if (it == images.end()) {
        *why = "missing";
        return false;
      }
      if (it->second != VecOf(i.id, state, 1)) {
        *why = "wrong";
        return false;
      }
      // Searchable by its exact text vector (ivf-flat below its training size is exact).
      json q = {{"kind", "text"}, {"text", VecOf(i.id, state, 0)}, {"k", 1}, {"include_vectors", true}};
      HttpResult r = Http({port, ""}, "POST", "/v1/search", q.dump(), "", 20000);
      json j = json::parse(r.body, nullptr, false);
      if (r.status != 200 || !j.is_object() || j["hits"].empty() || j["hits"][0]["id"] != i.id ||
          j["hits"][0]["text_distance"].get<double>() != 0.0 ||
          j["hits"][0]["text"].get<std::vector<float>>() != VecOf(i.id, state, 0)) {
        *why = "search";
        return false;
      }
      return true;
    };
    if (i.acked != 0) ++out.acked_ids;
    std::string why_acked, why_pending;
    const bool acked_ok = state_ok(i.acked, &why_acked);
    const bool pending_ok = !acked_ok && i.has_pending && state_ok(i.pending, &why_pending);
    if (!acked_ok && !pending_ok && i.acked != 0) {
      ++out.lost;
      i.lost_before = true;
      if (why_acked == "missing") ++out.missing;
      else if (why_acked == "resurrected") ++out.resurrected;
      else if (why_acked == "search") ++out.search_miss;
      else ++out.wrong_vector;
    }
    if (pending_ok) i.acked = i.pending;  // the call in flight was applied: the new baseline
    i.has_pending = false;
  }
  return out;
}

// --inject: n live acknowledged ids (no call in flight) deleted behind the checker's back.
int64_t InjectVector(int port, std::vector<std::vector<VecId>>& all, int n, std::mt19937_64& rng) {
  std::vector<uint64_t> cand;
  for (auto& t : all)
    for (auto& i : t)
      if (i.acked > 0 && !i.has_pending && !i.lost_before) cand.push_back(i.id);
  std::shuffle(cand.begin(), cand.end(), rng);
  cand.resize(std::min<size_t>(cand.size(), n));
  if (cand.empty()) return 0;
  HttpResult r = Http({port, ""}, "POST", "/v1/delete", json{{"ids", cand}}.dump());
  return r.status == 200 ? static_cast<int64_t>(cand.size()) : 0;
}

CrashRow VectorCrash(const Options& o, const std::string& work, std::mt19937_64& rng, std::string* log) {
  CrashRow row;
  row.service = "vector";
  const std::string dir = work + "/vector";
  std::filesystem::create_directories(dir);
  const int port = FreeLoopbackPort();
  const int threads = std::max(1, o.threads - 1);
  std::vector<std::vector<VecId>> ids(threads);
  for (int t = 0; t < threads; ++t) {
    for (int i = 0; i < (o.quick ? 300 : 1000); ++i) ids[t].push_back({static_cast<uint64_t>(t) * 1000000 + i});
  }
  std::vector<int64_t> versions(threads, 0);
  Child server(o.keel,
               {"vector", "--dir", dir, "--port", std::to_string(port), "--text-dim", std::to_string(kVecDim),
                "--image-dim", std::to_string(kVecDim), "--index", "ivf-flat", "--placement", "off", "--log-level", "warn"},
               work + "/vector.log");
  int64_t upserts = 0, deletes = 0, missing = 0, wrong = 0, resurrected = 0, search_miss = 0;
  double worst_restart_ms = 0;
  for (int round = 0; round <= o.rounds; ++round) {
    const auto t0 = Clock::now();
    if (!server.StartReady([&] { return Healthy({port, ""}); })) {
      *log += "vector did not start: " + Tail(server.log()) + "\n";
      row.harness_ok = false;
      return row;
    }
    if (round > 0) {
      worst_restart_ms = std::max(worst_restart_ms, MsSince(t0));
      if (o.inject > 0) row.injected += InjectVector(port, ids, o.inject, rng);
      VecVerify v = VerifyVector(port, ids);
      if (v.error) row.harness_ok = false;
      row.acked += v.acked_ids;
      row.lost += v.lost;
      missing += v.missing;
      wrong += v.wrong_vector;
      resurrected += v.resurrected;
      search_miss += v.search_miss;
      *log += "vector round " + std::to_string(round) + ": acked ids " + std::to_string(v.acked_ids) + ", lost " +
              std::to_string(v.lost) + "\n";
    }
    if (round == o.rounds) break;
    std::atomic<bool> stop{false};
    std::vector<VecWriterStats> stats(threads);
    std::vector<std::thread> writers;
    for (int t = 0; t < threads; ++t) {
      writers.emplace_back(VecWriter, port, std::ref(ids[t]), o.seed * 31 + round * 16 + t, std::cref(stop),
                           &versions[t], &stats[t]);
    }
    SleepMs(o.duration_s * 1000 * std::uniform_real_distribution<double>(0.4, 1.0)(rng));
    server.Kill9();
    stop = true;
    for (auto& t : writers) t.join();
    for (auto& s : stats) {
      upserts += s.upserts;
      deletes += s.deletes;
    }
    ++row.rounds;
  }
  server.Kill9();
  char buf[300];
  std::snprintf(buf, sizeof buf,
                "%" PRId64 " upsert and %" PRId64 " delete calls acked; lost: %" PRId64 " missing, %" PRId64
                " wrong vector, %" PRId64 " deleted came back, %" PRId64 " not found by text; slowest restart %.0f ms",
                upserts, deletes, missing, wrong, resurrected, search_miss, worst_restart_ms);
  row.extra = buf;
  return row;
}

// ---------------------------------------------------------------------------------------------
// policy service: keys, budgets, policies and usage.

const std::string kAdminKey = "chaos-admin-key-0123456789abcdef";

struct PolicyKey {
  std::string key_id, api_key, team;
  int64_t acked_tokens = 0, pending_tokens = 0;  // usage settled for this key
  std::string daily_budget_id;
  bool lost_before = false;
};
struct PolicyTeam {
  std::string name;
  int64_t acked_max = -1, pending_max = -1;        // policies.max_tokens
  int64_t acked_limit = -1, pending_limit = -1;    // monthly team budget limit_tokens
  bool lost_before = false;
};
struct PolicyState {
  std::vector<PolicyKey> keys;
  std::vector<PolicyTeam> teams;
  uint64_t next_request = 0;
};

struct PolicyWriterStats {
  int64_t acked = 0, errors = 0;
};

HttpResult Admin(const std::string& sock, const std::string& method, const std::string& target, const json& body = nullptr) {
  return Http({0, sock}, method, target, body.is_null() ? "" : body.dump(), "Authorization: Bearer " + kAdminKey + "\r\n",
              10000);
}

// One writer per state (its own teams and keys). Stops at the first unanswered call.
void PolicyWriter(const std::string& sock, PolicyState& st, int tag, uint64_t seed, const std::atomic<bool>& stop,
                  PolicyWriterStats* stats) {
  std::mt19937_64 rng(seed);
  while (!stop.load(std::memory_order_relaxed)) {
    const int r = static_cast<int>(rng() % 100);
    PolicyTeam& team = st.teams[rng() % st.teams.size()];
    if (r < 15 || st.keys.size() < st.teams.size()) {
      HttpResult h = Admin(sock, "POST", "/admin/keys", {{"principal", "p" + std::to_string(st.keys.size())}, {"team", team.name}});
      json j = json::parse(h.body, nullptr, false);
      if (h.status != 200 || !j.is_object()) break;
      PolicyKey k;
      k.key_id = j["key_id"];
      k.api_key = j["api_key"];
      k.team = team.name;
      // A daily key budget of its own, so budget rows are created as well as updated.
      HttpResult b = Admin(sock, "PUT", "/admin/budgets",
                           {{"scope", "key"}, {"subject", k.key_id}, {"window", "daily"}, {"limit_tokens", 1000000000}});
      st.keys.push_back(k);
      ++stats->acked;
      json bj = json::parse(b.body, nullptr, false);
      if (b.status != 200 || !bj.is_object()) break;
      st.keys.back().daily_budget_id = bj["budget_id"];
      ++stats->acked;
    } else if (r < 30) {
      team.pending_limit = 1000000 + static_cast<int64_t>(rng() % 1000000);
      HttpResult h = Admin(sock, "PUT", "/admin/budgets",
                           {{"scope", "team"}, {"subject", team.name}, {"window", "monthly"}, {"limit_tokens", team.pending_limit}});
      if (h.status != 200) break;
      team.acked_limit = team.pending_limit;
      ++stats->acked;
    } else if (r < 45) {
      team.pending_max = 1 + static_cast<int64_t>(rng() % 100000);
      HttpResult h = Admin(sock, "PUT", "/admin/policies", {{"team", team.name}, {"max_tokens", team.pending_max}});
      if (h.status != 200) break;
      team.acked_max = team.pending_max;
      ++stats->acked;
    } else {
      // A batch of settled usage records, as the gateway sends them.
      const int n = 1 + static_cast<int>(rng() % 10);
      std::vector<gateway::UsageRecord> batch;
      std::vector<std::pair<size_t, int64_t>> adds;
      const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::system_clock::now().time_since_epoch()).count();
      for (int i = 0; i < n; ++i) {
        const size_t ki = rng() % st.keys.size();
        const int64_t in = 1 + static_cast<int64_t>(rng() % 500), outt = static_cast<int64_t>(rng() % 500);
        batch.push_back({"chaos-" + std::to_string(tag) + "-" + std::to_string(st.next_request++), st.keys[ki].key_id,
                         st.keys[ki].team, "m", in, outt, 0.0, now_ms});
        adds.emplace_back(ki, in + outt);
      }
      for (auto [ki, t] : adds) st.keys[ki].pending_tokens += t;
      HttpResult h = Http({0, sock}, "POST", "/v1/usage", gateway::UsageBatchToJson(batch), "", 10000);
      json j = json::parse(h.body, nullptr, false);
      if (h.status != 200 || !j.is_object() || j["accepted"] != n) {
        if (h.status == 200) ++stats->errors;  // answered but not all accepted: a harness bug
        break;
      }
      for (auto [ki, t] : adds) {
        st.keys[ki].acked_tokens += t;
        st.keys[ki].pending_tokens -= t;
      }
      stats->acked += n;
    }
  }
}

struct PolicyVerify {
  int64_t acked = 0, lost = 0;
  std::map<std::string, int64_t> lost_by_kind;
  bool error = false;
};

PolicyVerify VerifyPolicy(const std::string& sock, std::vector<PolicyState>& states) {
  PolicyVerify out;
  HttpResult keys = Admin(sock, "GET", "/admin/keys");
  json kj = json::parse(keys.body, nullptr, false);
  if (keys.status != 200 || !kj.is_object()) {
    out.error = true;
    return out;
  }
  std::set<std::string> present;
  for (const auto& k : kj["keys"]) present.insert(k["key_id"].get<std::string>());
  auto lose = [&](const std::string& kind) {
    ++out.lost;
    ++out.lost_by_kind[kind];
  };
  for (auto& st : states) {
    for (auto& k : st.keys) {
      if (k.lost_before) continue;
      ++out.acked;  // the key
      if (!present.count(k.key_id)) {
        lose("key");
        k.lost_before = true;
        continue;
      }
      HttpResult s = Admin(sock, "GET", "/admin/spend?key_id=" + k.key_id);
      json sj = json::parse(s.body, nullptr, false);
      if (s.status != 200 || !sj.is_object()) {
        out.error = true;
        continue;
      }
      if (!k.daily_budget_id.empty()) {
        ++out.acked;
        bool found = false;
        for (const auto& b : sj["budgets"]) found |= b["budget_id"] == k.daily_budget_id;
        if (!found) {
          lose("budget");
          k.daily_budget_id.clear();
        }
      }
      const int64_t tokens = sj["monthly"]["tokens"].get<int64_t>();
      if (k.acked_tokens > 0) ++out.acked;
      if (tokens < k.acked_tokens || tokens > k.acked_tokens + k.pending_tokens) {
        lose("usage");
        k.lost_before = true;
      }
      k.acked_tokens = tokens;  // an in-flight batch may have landed: what is stored is the baseline
      k.pending_tokens = 0;
    }
    for (auto& t : st.teams) {
      if (t.lost_before) continue;
      if (t.acked_limit >= 0) {
        ++out.acked;
        HttpResult s = Admin(sock, "GET", "/admin/spend?team=" + t.name);
        json sj = json::parse(s.body, nullptr, false);
        int64_t limit = -2;
        if (s.status == 200 && sj.is_object()) {
          for (const auto& b : sj["budgets"])
            if (b["window"] == "monthly") limit = b["limit_tokens"].get<int64_t>();
        }
        if (limit != t.acked_limit && limit != t.pending_limit) {
          lose("team budget");
          t.lost_before = true;
        }
        t.acked_limit = t.pending_limit = limit;
      }
      if (t.acked_max >= 0) {
        ++out.acked;
        const PolicyKey* key = nullptr;
        for (const auto& k : st.keys)
          if (k.team == t.name && !k.lost_before) key = &k;
        if (key == nullptr) continue;
        HttpResult r = Http({0, sock}, "POST", "/v1/resolve", json{{"key_hash", gateway::HashApiKey(key->api_key)}}.dump());
        auto d = gateway::KeyDecisionFromJson(r.body);
        const int64_t max = d.ok() ? d->policy.max_tokens : -2;
        if (max != t.acked_max && max != t.pending_max) {
          lose("policy");
          t.lost_before = true;
        }
        t.acked_max = t.pending_max = max;
      }
    }
  }
  return out;
}

// --inject: n acknowledged key budgets deleted through the admin API.
int64_t InjectPolicy(const std::string& sock, std::vector<PolicyState>& states, int n, std::mt19937_64& rng) {
  std::vector<PolicyKey*> cand;
  for (auto& st : states)
    for (auto& k : st.keys)
      if (!k.daily_budget_id.empty() && !k.lost_before) cand.push_back(&k);
  std::shuffle(cand.begin(), cand.end(), rng);
  int64_t done = 0;
  for (int i = 0; i < n && i < static_cast<int>(cand.size()); ++i) {
    if (Admin(sock, "DELETE", "/admin/budgets", {{"budget_id", cand[i]->daily_budget_id}}).status == 200) ++done;
  }
  return done;
}

CrashRow PolicyCrash(const Options& o, const std::string& work, std::mt19937_64& rng, std::string* log) {
  CrashRow row;
  row.service = "policy";
  const std::string dir = work + "/policy";
  std::filesystem::create_directories(dir);
  const std::string sock = dir + "/policy.sock", key_file = dir + "/admin.key";
  std::ofstream(key_file) << kAdminKey;
  ::chmod(key_file.c_str(), 0600);
  const int threads = 2;
  std::vector<PolicyState> states(threads);
  for (int t = 0; t < threads; ++t)
    for (int i = 0; i < 3; ++i) states[t].teams.push_back({"team-" + std::to_string(t) + "-" + std::to_string(i)});
  Child server(o.keel,
               {"gateway-policy", "--socket", sock, "--db", dir + "/gw.db", "--admin-key-file", key_file, "--log-level", "warn"},
               work + "/policy.log");
  int64_t calls = 0;
  std::map<std::string, int64_t> by_kind;
  double worst_restart_ms = 0;
  for (int round = 0; round <= o.rounds; ++round) {
    const auto t0 = Clock::now();
    if (!server.StartReady([&] { return Healthy({0, sock}); })) {
      *log += "gateway-policy did not start: " + Tail(server.log()) + "\n";
      row.harness_ok = false;
      return row;
    }
    if (round > 0) {
      worst_restart_ms = std::max(worst_restart_ms, MsSince(t0));
      if (o.inject > 0) row.injected += InjectPolicy(sock, states, o.inject, rng);
      PolicyVerify v = VerifyPolicy(sock, states);
      if (v.error) row.harness_ok = false;
      row.acked += v.acked;
      row.lost += v.lost;
      for (auto& [k, n] : v.lost_by_kind) by_kind[k] += n;
      *log += "policy round " + std::to_string(round) + ": acked " + std::to_string(v.acked) + ", lost " +
              std::to_string(v.lost) + "\n";
    }
    if (round == o.rounds) break;
    std::atomic<bool> stop{false};
    std::vector<PolicyWriterStats> stats(threads);
    std::vector<std::thread> writers;
    for (int t = 0; t < threads; ++t) {
      writers.emplace_back(PolicyWriter, sock, std::ref(states[t]), t, o.seed * 131 + round * 16 + t, std::cref(stop),
                           &stats[t]);
    }
    SleepMs(o.duration_s * 1000 * std::uniform_real_distribution<double>(0.4, 1.0)(rng));
    server.Kill9();
    stop = true;
    for (auto& t : writers) t.join();
    for (auto& s : stats) calls += s.acked;
    ++row.rounds;
  }
  server.Kill9();
  std::string kinds;
  for (auto& [k, n] : by_kind) kinds += (kinds.empty() ? "" : ", ") + k + " " + std::to_string(n);
  char buf[300];
  std::snprintf(buf, sizeof buf, "%" PRId64 " admin writes and usage records acked (SQLite WAL); lost by kind: %s; "
                "slowest restart %.0f ms", calls, kinds.empty() ? "none" : kinds.c_str(), worst_restart_ms);
  row.extra = buf;
  return row;
}

// ---------------------------------------------------------------------------------------------
// Floods

struct Probe {
  Clock::time_point start, end;
  bool ok = false;
};

// Every 100 ms, a probe on a fresh connection (its own thread, 5 s timeout).
class Prober {
 public:
  explicit Prober(std::function<bool()> probe) : probe_(std::move(probe)) {
    thread_ = std::thread([this] {
      while (!stop_) {
        const size_t i = Add();
        workers_.emplace_back([this, i] {
          const bool ok = probe_();
          std::lock_guard<std::mutex> l(mu_);
          probes_[i].end = Clock::now();
          probes_[i].ok = ok;
        });
        SleepMs(100);
      }
    });
  }
  // Stops launching probes and waits for those in flight (each ends within its timeout).
  std::vector<Probe> Finish() {
    stop_ = true;
    thread_.join();
    for (auto& w : workers_) w.join();
    return probes_;
  }

 private:
  size_t Add() {
    std::lock_guard<std::mutex> l(mu_);
    probes_.push_back({Clock::now(), {}, false});
    return probes_.size() - 1;
  }
  std::function<bool()> probe_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<Probe> probes_;
  std::vector<std::thread> workers_;
  std::thread thread_;
};

constexpr double kProbeTimeoutMs = 5000;

// Longest unanswered: from the start of the first probe of a failed run to the answer of the
// next answered probe (or the end, if none was answered again); an answered probe's own latency
// counts too. p99 over the answered probes (the failed ones are counted beside it).
void Summarise(std::vector<Probe> probes, Clock::time_point end, FloodRow* row) {
  std::sort(probes.begin(), probes.end(), [](const Probe& a, const Probe& b) { return a.start < b.start; });
  std::vector<double> lat;
  row->probes = static_cast<int>(probes.size());
  for (size_t i = 0; i < probes.size(); ++i) {
    const Probe& p = probes[i];
    if (p.ok) {
      lat.push_back(MsSince(p.start, p.end));
      row->longest_ms = std::max(row->longest_ms, MsSince(p.start, p.end));
      continue;
    }
    ++row->failed;
    if (i > 0 && !probes[i - 1].ok) continue;  // not the first of its run
    size_t j = i + 1;
    while (j < probes.size() && !probes[j].ok) ++j;
    if (j == probes.size()) {
      row->recovered = false;
      row->longest_ms = std::max(row->longest_ms, MsSince(p.start, end));
    } else {
      row->longest_ms = std::max(row->longest_ms, MsSince(p.start, probes[j].end));
    }
  }
  std::sort(lat.begin(), lat.end());
  row->p99_ms = lat.empty() ? -1 : lat[std::min(lat.size() - 1, static_cast<size_t>(lat.size() * 0.99))];
}

// Flood connections to one TCP port: idle (connect, send nothing) or slowloris (a request whose
// headers never end, one byte per second per connection). One thread drives all of them.
class Flood {
 public:
  Flood(int port, int n, bool slowloris) : port_(port), n_(n), slow_(slowloris) {}
  ~Flood() { Stop(); }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }
  void Stop() {
    if (!thread_.joinable()) return;
    stop_ = true;
    thread_.join();
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
    fds_.clear();
  }
  int opened() const { return opened_; }
  int closed_by_server() const { return closed_; }

 private:
  void Run() {
    // Open in batches of 100 non-blocking connects, each batch given up to 1 s (a server that
    // stops accepting fills its backlog and the rest never complete); 10 s for all at most.
    const auto t0 = Clock::now();
    for (int b = 0; b < n_ && !stop_ && MsSince(t0) < 10000; b += 100) {
      std::vector<int> batch;
      for (int i = b; i < std::min(n_, b + 100); ++i) {
        int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) break;
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(static_cast<uint16_t>(port_));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
          ::close(fd);
          continue;
        }
        batch.push_back(fd);
      }
      const auto tb = Clock::now();
      std::vector<bool> done(batch.size(), false);
      size_t left = batch.size();
      while (left > 0 && MsSince(tb) < 1000) {
        std::vector<pollfd> p;
        std::vector<size_t> idx;
        for (size_t i = 0; i < batch.size(); ++i)
          if (!done[i]) {
            p.push_back({batch[i], POLLOUT, 0});
            idx.push_back(i);
          }
        if (::poll(p.data(), p.size(), 100) <= 0) continue;
        for (size_t k = 0; k < p.size(); ++k) {
          if (p[k].revents == 0) continue;
          done[idx[k]] = true;
          --left;
          int err = 0;
          socklen_t len = sizeof(err);
          ::getsockopt(p[k].fd, SOL_SOCKET, SO_ERROR, &err, &len);
          if (err == 0) {
            fds_.push_back(p[k].fd);
            ++opened_;
          } else {
            ::close(p[k].fd);
          }
        }
      }
      for (size_t i = 0; i < batch.size(); ++i)
        if (!done[i]) ::close(batch[i]);
    }
    // Hold them: slowloris sends one header byte per second to each; both notice a close.
    static const std::string kSlow = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    size_t pos = 0;
    while (!stop_) {
      for (int& fd : fds_) {
        if (fd < 0) continue;
        char buf[512];
        ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        bool closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
        if (!closed && slow_) {
          const char c = pos < kSlow.size() ? kSlow[pos] : 'a';
          if (::send(fd, &c, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EAGAIN) closed = true;
        }
        if (closed) {
          ::close(fd);
          fd = -1;
          ++closed_;
        }
      }
      ++pos;
      for (int i = 0; i < 10 && !stop_; ++i) SleepMs(100);
    }
  }

  int port_, n_;
  bool slow_;
  std::atomic<bool> stop_{false};
  std::vector<int> fds_;
  std::atomic<int> opened_{0}, closed_{0};
  std::thread thread_;
};

// One flood against one target: prober runs 0.5 s before, through the flood, and 1 s after.
FloodRow RunFlood(const std::string& target, const std::string& kind, int flood_port, int n, bool slowloris,
                  double flood_s, std::function<bool()> probe) {
  FloodRow row;
  row.target = target;
  row.flood = kind;
  row.requested = n;
  Prober prober(std::move(probe));
  SleepMs(500);
  Flood flood(flood_port, n, slowloris);
  flood.Start();
  SleepMs(flood_s * 1000);
  const int closed = flood.closed_by_server();
  row.opened = flood.opened();
  flood.Stop();
  row.closed_by_server = closed;
  SleepMs(1000);
  const auto end = Clock::now();
  Summarise(prober.Finish(), end, &row);
  return row;
}

std::function<bool()> HealthProbe(int port) {
  return [port] { return Http({port, ""}, "GET", "/healthz", "", "", static_cast<int>(kProbeTimeoutMs)).status == 200; };
}

std::vector<FloodRow> Floods(const Options& o, const std::string& work, std::string* log) {
  std::vector<FloodRow> rows;
  const std::string dir = work + "/flood";
  std::filesystem::create_directories(dir);
  const std::string models = o.shared + "/data/models";
  auto failed_row = [&](const std::string& target, const std::string& why) {
    FloodRow r;
    r.target = target;
    r.flood = "(did not start)";
    r.harness_ok = false;
    *log += target + " did not start: " + why + "\n";
    rows.push_back(r);
  };
  auto both = [&](const std::string& target, int port) {
    rows.push_back(RunFlood(target, "slowloris", port, o.slowloris, true, o.flood_s, HealthProbe(port)));
    // Let the server shed the previous flood's connections before the next one.
    WaitUntil([&] { return Healthy({port, ""}); }, 10);
    rows.push_back(RunFlood(target, "idle", port, o.idle, false, o.flood_s, HealthProbe(port)));
  };

  auto want = [&](const std::string& name) { return o.parts.count("flood") || o.parts.count("flood:" + name); };
  if (want("serve")) {  // engine
    const int port = FreeLoopbackPort();
    Child c(o.keel, {"serve", "-m", models + "/aidreams260K.bin", "-z", models + "/aidreams_tok512.bin", "--port",
                     std::to_string(port), "--log-level", "warn"},
            dir + "/serve.log");
    if (c.StartReady([&] { return Healthy({port, ""}); })) both("keel serve", port);
    else failed_row("keel serve", Tail(c.log()));
  }
  if (want("vector")) {
    const int port = FreeLoopbackPort();
    Child c(o.keel, {"vector", "--dir", dir + "/vector", "--port", std::to_string(port), "--text-dim", "8", "--image-dim",
                     "8", "--placement", "off", "--log-level", "warn"},
            dir + "/vector.log");
    if (c.StartReady([&] { return Healthy({port, ""}); })) both("keel vector", port);
    else failed_row("keel vector", Tail(c.log()));
  }
  if (want("kvstore")) {  // HTTP port floods, then its binary port while a client does PUT/GET
    const int port = FreeLoopbackPort(), http_port = FreeLoopbackPort();
    Child c(o.keel, KvstoreArgs(port, http_port, dir + "/kvstore", 64), dir + "/kvstore.log");
    if (c.StartReady([&] { return Healthy({http_port, ""}); })) {
      both("kvstore --http-port", http_port);
      WaitUntil([&] { return Healthy({http_port, ""}); }, 10);
      // A steady client doing PUT/GET: its longest gap between answered calls, and its errors.
      std::atomic<bool> stop{false};
      std::atomic<int64_t> ops{0}, errors{0};
      double longest_gap = 0;
      std::thread worker([&] {
        kvstore::ClientOptions co;
        co.connect_timeout_ms = static_cast<int>(kProbeTimeoutMs);
        co.timeout_ms = static_cast<int>(kProbeTimeoutMs);
        std::unique_ptr<kvstore::Client> client;
        const std::string value(4096, 'x');
        auto last = Clock::now();
        for (uint64_t i = 0; !stop; ++i) {
          if (!client) {
            auto cc = kvstore::Client::Connect("127.0.0.1", port, co);
            if (!cc.ok()) {
              ++errors;
              SleepMs(10);
              continue;
            }
            client = std::move(cc).value();
          }
          const std::string key = "flood/" + std::to_string(i % 1000);
          Status s = client->Put(key, value);
          auto g = s.ok() ? client->Get(key) : Result<kvstore::BlobPtr>(s);
          if (s.ok() && g.ok()) {
            ++ops;
            longest_gap = std::max(longest_gap, MsSince(last));
            last = Clock::now();
          } else {
            ++errors;
          }
          SleepMs(5);
        }
        longest_gap = std::max(longest_gap, MsSince(last));
      });
      auto ping = [port] {
        kvstore::ClientOptions co;
        co.connect_timeout_ms = static_cast<int>(kProbeTimeoutMs);
        co.timeout_ms = static_cast<int>(kProbeTimeoutMs);
        auto cc = kvstore::Client::Connect("127.0.0.1", port, co);
        return cc.ok() && (*cc)->Ping().ok();
      };
      FloodRow r = RunFlood("kvstore binary port", "idle", port, o.idle, false, o.flood_s, ping);
      stop = true;
      worker.join();
      char buf[200];
      std::snprintf(buf, sizeof buf, "probe = fresh connection + PING; a steady PUT/GET client: %" PRId64
                    " ok, %" PRId64 " failed, longest gap %.0f ms", ops.load(), errors.load(), longest_gap);
      r.extra = buf;
      r.longest_ms = std::max(r.longest_ms, longest_gap);
      rows.push_back(r);
    } else {
      failed_row("kvstore", Tail(c.log()));
    }
  }
  if (want("gateway")) {  // policy service + fake vendor + gateway (async Beast server)
    const std::string sock = dir + "/policy.sock", key_file = dir + "/admin.key";
    std::ofstream(key_file) << kAdminKey;
    ::chmod(key_file.c_str(), 0600);
    Child policy(o.keel, {"gateway-policy", "--socket", sock, "--db", dir + "/gw.db", "--admin-key-file", key_file,
                          "--log-level", "warn"},
                 dir + "/policy.log");
    const int vendor_port = FreeLoopbackPort(), port = FreeLoopbackPort();
    Child vendor(o.keel, {"fake-vendor", "--kind", "openai", "--port", std::to_string(vendor_port)}, dir + "/vendor.log");
    json config = {
        {"listen", {{"host", "127.0.0.1"}, {"port", port}}},
        {"policy", {{"socket", sock}}},
        {"upstreams", {{{"name", "fv"}, {"format", "openai"}, {"base_url", "http://127.0.0.1:" + std::to_string(vendor_port)},
                        {"api_key", "vendor-key"}}}},
        {"models", {{{"name", "m"}, {"targets", {{{"upstream", "fv"}, {"model", "gpt-test"}}}}}}}};
    std::ofstream(dir + "/gateway.json") << config.dump(2);
    Child gw(o.keel, {"gateway", "--config", dir + "/gateway.json", "--log-level", "warn"}, dir + "/gateway.log");
    auto accepts = [](int p) {
      const int fd = ConnectWithin({p, ""}, 1000);
      if (fd >= 0) ::close(fd);
      return fd >= 0;
    };
    if (policy.StartReady([&] { return Healthy({0, sock}); }) && vendor.StartReady([&] { return accepts(vendor_port); }) &&
        gw.StartReady([&] { return Healthy({port, ""}); })) {
      both("keel gateway", port);
    } else {
      failed_row("keel gateway", Tail(gw.log()) + Tail(policy.log()));
    }
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Report

std::string MachineInfo() {
  std::string cpu = "unknown";
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  utsname u{};
  ::uname(&u);
  char buf[512];
  std::snprintf(buf, sizeof buf, "nproc %u, CPU %s, Linux %s", std::thread::hardware_concurrency(), cpu.c_str(), u.release);
  return buf;
}

std::string Fmt(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f", ms);
  return b;
}

int RunWith(const Options& o, const std::string& work);

int Run(const Options& o) {
  char tmpl[] = "/tmp/keel-chaos-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    std::perror("mkdtemp");
    return 2;
  }
  const std::string work = tmpl;
  // Every server of the run from one snapshot of the binary: a concurrent rebuild relinking
  // build/keel mid-run would otherwise make an exec fail or mix two builds in one table.
  Options opt = o;
  opt.keel = work + "/keel";
  std::error_code ec;
  std::filesystem::copy_file(o.keel, opt.keel, ec);
  if (ec) {
    std::fprintf(stderr, "chaos_bench: cannot copy %s: %s\n", o.keel.c_str(), ec.message().c_str());
    return 2;
  }
  return RunWith(opt, work);
}

int RunWith(const Options& o, const std::string& work) {
  std::mt19937_64 rng(o.seed);
  std::string log;
  const auto t_start = Clock::now();
  std::vector<CrashRow> crash;
  std::optional<StaleRow> stale;
  std::vector<FloodRow> floods;
  if (o.parts.count("kvstore")) {
    crash.push_back(KvstoreCrash(o, work, rng, &log));
    stale = KvstoreNoCrash(o, work, &log);
  }
  if (o.parts.count("vector")) crash.push_back(VectorCrash(o, work, rng, &log));
  if (o.parts.count("policy")) crash.push_back(PolicyCrash(o, work, rng, &log));
  bool any_flood = false;
  for (const auto& p : o.parts) any_flood |= p.rfind("flood", 0) == 0;
  if (any_flood) floods = Floods(o, work, &log);

  std::time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::printf("\n### Reliability (scripts/chaos)\n\n");
  std::printf("Machine: %s. Date: %s. Run time %.0f s.\nCommand: `%s`\n\n", MachineInfo().c_str(), date,
              MsSince(t_start) / 1000, o.command_line.c_str());
  bool harness_ok = true, asserted_ok = true;
  if (!crash.empty()) {
    std::printf("Crash-restart (kill -9 at a random moment under load, restart on the same data):\n\n");
    std::printf("| service | rounds | acked writes checked | lost | goal 0 met | notes |\n|---|---:|---:|---:|---|---|\n");
    for (const auto& r : crash) {
      const std::string injected = o.inject > 0 ? " (" + std::to_string(r.injected) + " injected)" : "";
      std::printf("| %s | %d | %" PRId64 " | %" PRId64 "%s | %s | %s |\n", r.service.c_str(), r.rounds, r.acked, r.lost,
                  injected.c_str(), !r.harness_ok ? "harness error" : r.lost == r.injected ? "yes" : "**no**",
                  r.extra.c_str());
      harness_ok &= r.harness_ok;
      // --inject: every injected loss must be seen; a service asserted to lose nothing must
      // show exactly the injected ones.
      if (r.lost < r.injected || (o.inject > 0 && r.injected == 0)) {
        std::fprintf(stderr, "chaos_bench: %s: %" PRId64 " losses injected, %" PRId64 " found\n", r.service.c_str(),
                     r.injected, r.lost);
        asserted_ok = false;
      }
      if (o.assert_zero.count(r.service) && (r.lost != r.injected || !r.harness_ok)) asserted_ok = false;
    }
    std::printf("\nkvstore \"acked writes checked\": keys with a persisted acknowledgement, per verification; "
                "vector: ids with an acknowledged upsert or delete; policy: keys, budgets, policies and usage totals.\n\n");
  }
  if (stale) {
    std::printf("No crash, tiny DRAM (kvstore --dram-mb 1, 16 KiB values, SSD tier behind it):\n\n");
    std::printf("| service | acked keys checked | stale reads | goal 0 met | notes |\n|---|---:|---:|---|---|\n");
    std::printf("| kvstore | %" PRId64 " | %" PRId64 " | %s | %s |\n\n", stale->acked, stale->stale,
                !stale->harness_ok ? "harness error" : stale->stale == 0 ? "yes" : "**no**", stale->extra.c_str());
    harness_ok &= stale->harness_ok;
    // A cache may forget a key, never serve an older value than it acknowledged.
    if (o.assert_zero.count("kvstore") && stale->stale - stale->missing != 0) asserted_ok = false;
  }
  if (!floods.empty()) {
    std::printf("Floods (a fresh-connection /healthz probe every 100 ms, 5 s timeout; %.0f s per flood; "
                "p99 over answered probes):\n\n", o.flood_s);
    std::printf("| target | flood | connections opened | closed by server | probes (failed) | longest unanswered ms | "
                "p99 ms | goal < 1 s met |\n|---|---|---:|---:|---:|---:|---:|---|\n");
    for (const auto& r : floods) {
      harness_ok &= r.harness_ok;
      if (!r.harness_ok) {
        std::printf("| %s | %s | | | | | | harness error |\n", r.target.c_str(), r.flood.c_str());
        continue;
      }
      std::printf("| %s | %s x%d | %d | %d | %d (%d) | %s%s | %s | %s |\n", r.target.c_str(), r.flood.c_str(), r.requested,
                  r.opened, r.closed_by_server, r.probes, r.failed, Fmt(r.longest_ms).c_str(),
                  r.recovered ? "" : " (not answered again)", r.p99_ms < 0 ? "n/a" : Fmt(r.p99_ms).c_str(), r.longest_ms < 1000 ? "yes" : "**no**");
    }
    for (const auto& r : floods)
      if (!r.extra.empty()) std::printf("\n%s: %s\n", r.target.c_str(), r.extra.c_str());
  }
  std::printf("\nDetails:\n%s", log.c_str());
  std::fflush(stdout);
  if (harness_ok && asserted_ok) {
    std::filesystem::remove_all(work);
  } else {
    std::fprintf(stderr, "chaos_bench: logs kept in %s\n", work.c_str());
  }
  if (!harness_ok) return 2;
  return asserted_ok ? 0 : 1;
}

std::set<std::string> SplitSet(const std::string& s) {
  std::set<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.insert(item);
  return out;
}

}  // namespace
}  // namespace keel::chaos

int main(int argc, char** argv) {
  using keel::chaos::Options;
  Options o;
  for (int i = 0; i < argc; ++i) o.command_line += (i ? " " : "") + std::string(argv[i]);
#ifdef KEEL_SOURCE_DIR
  o.shared = KEEL_SOURCE_DIR "/../shared";
#endif
  if (const char* s = std::getenv("KEEL_SHARED"); s != nullptr && *s != '\0') o.shared = s;
  bool rounds_set = false, duration_set = false, flood_set = false, slow_set = false, idle_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--keel") o.keel = next();
    else if (a == "--shared") o.shared = next();
    else if (a == "--rounds") o.rounds = std::max(1, std::atoi(next().c_str())), rounds_set = true;
    else if (a == "--duration") o.duration_s = std::atof(next().c_str()), duration_set = true;
    else if (a == "--seed") o.seed = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--threads") o.threads = std::max(1, std::atoi(next().c_str()));
    else if (a == "--slowloris") o.slowloris = std::atoi(next().c_str()), slow_set = true;
    else if (a == "--idle") o.idle = std::atoi(next().c_str()), idle_set = true;
    else if (a == "--flood-seconds") o.flood_s = std::atof(next().c_str()), flood_set = true;
    else if (a == "--parts") o.parts = keel::chaos::SplitSet(next());
    else if (a == "--assert-zero") o.assert_zero = keel::chaos::SplitSet(next());
    else if (a == "--quick") o.quick = true;
    else if (a == "--inject") o.inject = std::max(0, std::atoi(next().c_str()));
    else {
      std::fprintf(stderr,
                   "usage: %s [--keel PATH] [--shared DIR] [--rounds N] [--duration S] [--seed N] [--threads N]\n"
                   "          [--slowloris N] [--idle N] [--flood-seconds S] [--parts kvstore,vector,policy,flood]\n"
                   "          [--quick] [--assert-zero kvstore,vector,policy] [--inject N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (o.quick) {
    if (!rounds_set) o.rounds = 1;
    if (!duration_set) o.duration_s = 1.5;
    if (!flood_set) o.flood_s = 2.5;
    if (!slow_set) o.slowloris = 100;
    if (!idle_set) o.idle = 500;
  }
  // 2,000 idle connections plus the servers' own: raise the descriptor limit (children inherit it).
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  ::signal(SIGPIPE, SIG_IGN);
  return keel::chaos::Run(o);
}
