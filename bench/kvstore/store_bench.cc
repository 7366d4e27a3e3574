// Throughput / latency of the keel kvstore server vs a private redis-server, in the same run,
// over loopback TCP with large values (KV chunks).
//
// Per (value size, client count) cell and per system: each client thread opens its own
// connection; first the keyspace (N distinct keys, N * size ~ --total-mib, default 256 MiB) is
// PUT, split across the clients; then every client GETs uniformly random keys for --seconds.
// PUT GB/s = bytes put / wall time of the PUT phase; GET GB/s = bytes got / --seconds. Latency
// percentiles are per operation over all clients. GET replies are checked (size and the first 8
// bytes, which encode the key index); mismatches and failed calls count as errors.
//
// keel runs in-process (Service, DRAM tier --dram-mib, default 1 GiB, no SSD / HTTP); redis is
// started as `redis-server --port P --save '' --appendonly no --bind 127.0.0.1` on a free port and
// killed at the end (--redis-server PATH picks the binary).
//
//   store_bench [--sizes 64K,256K,2M] [--clients 1,4,16] [--seconds 2] [--total-mib 256]
//               [--dram-mib 1024] [--redis-server redis-server]
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/kvstore/client.h"
#include "keel/kvstore/service.h"
#include "bench/common/redis_server.h"

namespace {
using keel::bench::RedisFlush;
using keel::bench::StartRedis;
using keel::bench::WaitRedis;


using Clock = std::chrono::steady_clock;

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    if (q > p) out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

size_t ParseSize(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string suf(end ? end : "");
  if (suf == "K" || suf == "k" || suf == "KiB") v *= 1024;
  else if (suf == "M" || suf == "m" || suf == "MiB") v *= 1024 * 1024;
  else if (suf == "G" || suf == "g" || suf == "GiB") v *= 1024.0 * 1024 * 1024;
  return static_cast<size_t>(v);
}

std::string SizeName(size_t s) {
  if (s % (1 << 20) == 0) return std::to_string(s >> 20) + " MiB";
  if (s % 1024 == 0) return std::to_string(s >> 10) + " KiB";
  return std::to_string(s) + " B";
}

std::string KeyOf(size_t size, size_t i) { return "sb:" + std::to_string(size) + ":" + std::to_string(i); }

// Value for key i: the index in the first 8 bytes, then a cheap pattern.
void FillValue(std::vector<uint8_t>& buf, uint64_t i) {
  std::memcpy(buf.data(), &i, 8);
}

struct OpStats {
  std::vector<double> lat_ms;
  int64_t bytes = 0;
  int64_t errors = 0;
};

struct PhaseResult {
  double gbps = 0, p50 = 0, p99 = 0;
  int64_t ops = 0, errors = 0;
};

PhaseResult Summarize(std::vector<OpStats>& per, double seconds) {
  PhaseResult r;
  std::vector<double> all;
  int64_t bytes = 0;
  for (auto& p : per) {
    all.insert(all.end(), p.lat_ms.begin(), p.lat_ms.end());
    bytes += p.bytes;
    r.errors += p.errors;
  }
  r.ops = static_cast<int64_t>(all.size());
  r.gbps = seconds > 0 ? bytes / seconds / 1e9 : 0;
  if (!all.empty()) {
    std::sort(all.begin(), all.end());
    r.p50 = all[all.size() / 2];
    r.p99 = all[std::min(all.size() - 1, static_cast<size_t>(all.size() * 0.99))];
  }
  return r;
}

// One system's client: connect / put / get.
class Conn {
 public:
  virtual ~Conn() = default;
  virtual bool Put(const std::string& key, const uint8_t* data, size_t size) = 0;
  // Returns true if a value of `size` bytes whose first 8 bytes equal `idx` came back.
  virtual bool Get(const std::string& key, size_t size, uint64_t idx) = 0;
};

class KeelConn : public Conn {
 public:
  explicit KeelConn(int port) {
    auto c = keel::kvstore::Client::Connect("127.0.0.1", port);
    if (c.ok()) c_ = std::move(*c);
    else std::fprintf(stderr, "keel connect: %s\n", c.status().ToString().c_str());
  }
  bool Put(const std::string& key, const uint8_t* data, size_t size) override {
    return c_ && c_->Put(key, data, size).ok();
  }
  bool Get(const std::string& key, size_t size, uint64_t idx) override {
    if (!c_) return false;
    auto r = c_->Get(key);
    if (!r.ok() || !*r) return false;
    const auto& b = **r;
    uint64_t got;
    if (b.size() != size) return false;
    std::memcpy(&got, b.data(), 8);
    return got == idx;
  }

 private:
  std::unique_ptr<keel::kvstore::Client> c_;
};

class RedisConn : public Conn {
 public:
  explicit RedisConn(int port) {
    c_ = redisConnect("127.0.0.1", port);
    if (!c_ || c_->err) std::fprintf(stderr, "redis connect failed\n");
  }
  ~RedisConn() override { if (c_) redisFree(c_); }
  bool Put(const std::string& key, const uint8_t* data, size_t size) override {
    if (!c_ || c_->err) return false;
    auto* r = static_cast<redisReply*>(redisCommand(c_, "SET %b %b", key.data(), key.size(), data, size));
    bool ok = r && r->type == REDIS_REPLY_STATUS;
    if (r) freeReplyObject(r);
    return ok;
  }
  bool Get(const std::string& key, size_t size, uint64_t idx) override {
    if (!c_ || c_->err) return false;
    auto* r = static_cast<redisReply*>(redisCommand(c_, "GET %b", key.data(), key.size()));
    bool ok = false;
    if (r && r->type == REDIS_REPLY_STRING && r->len == size) {
      uint64_t got;
      std::memcpy(&got, r->str, 8);
      ok = got == idx;
    }
    if (r) freeReplyObject(r);
    return ok;
  }

 private:
  redisContext* c_ = nullptr;
};

struct CellResult {
  PhaseResult put, get;
};

CellResult RunCell(bool keel, int port, size_t size, int clients, double seconds, size_t nkeys) {
  std::vector<OpStats> put_stats(clients), get_stats(clients);
  std::vector<std::unique_ptr<Conn>> conns;
  for (int c = 0; c < clients; ++c) {
    if (keel) conns.push_back(std::make_unique<KeelConn>(port));
    else conns.push_back(std::make_unique<RedisConn>(port));
  }
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  // PUT phase.
  auto put_start = Clock::now();
  {
    std::vector<std::thread> ts;
    for (int c = 0; c < clients; ++c) {
      ts.emplace_back([&, c] {
        std::vector<uint8_t> buf(size);
        for (size_t j = 0; j < size; ++j) buf[j] = static_cast<uint8_t>(j * 131 + c);
        ready++;
        while (!go.load()) std::this_thread::yield();
        auto& st = put_stats[c];
        for (size_t i = c; i < nkeys; i += clients) {
          FillValue(buf, i);
          auto k = KeyOf(size, i);
          auto t0 = Clock::now();
          bool ok = conns[c]->Put(k, buf.data(), size);
          st.lat_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          if (ok) st.bytes += size;
          else st.errors++;
        }
      });
    }
    while (ready.load() < clients) std::this_thread::yield();
    put_start = Clock::now();
    go = true;
    for (auto& t : ts) t.join();
  }
  double put_secs = std::chrono::duration<double>(Clock::now() - put_start).count();
  // GET phase.
  ready = 0;
  go = false;
  auto get_start = Clock::now();
  {
    std::vector<std::thread> ts;
    for (int c = 0; c < clients; ++c) {
      ts.emplace_back([&, c] {
        std::mt19937_64 rng(0x5eed + c * 7919 + size);
        std::uniform_int_distribution<size_t> pick(0, nkeys - 1);
        auto& st = get_stats[c];
        ready++;
        while (!go.load()) std::this_thread::yield();
        auto end = get_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
        while (Clock::now() < end) {
          size_t i = pick(rng);
          auto k = KeyOf(size, i);
          auto t0 = Clock::now();
          bool ok = conns[c]->Get(k, size, i);
          st.lat_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          if (ok) st.bytes += size;
          else st.errors++;
        }
      });
    }
    while (ready.load() < clients) std::this_thread::yield();
    get_start = Clock::now();
    go = true;
    for (auto& t : ts) t.join();
  }
  double get_secs = std::chrono::duration<double>(Clock::now() - get_start).count();
  CellResult r;
  r.put = Summarize(put_stats, put_secs);
  r.get = Summarize(get_stats, get_secs);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string sizes_arg = "64K,256K,2M", clients_arg = "1,4,16", redis_bin = "redis-server";
  double seconds = 2;
  int64_t total_mib = 256, dram_mib = 1024;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--sizes") sizes_arg = next();
    else if (a == "--clients") clients_arg = next();
    else if (a == "--seconds") seconds = std::atof(next().c_str());
    else if (a == "--total-mib") total_mib = std::atoll(next().c_str());
    else if (a == "--dram-mib") dram_mib = std::atoll(next().c_str());
    else if (a == "--redis-server") redis_bin = next();
    else { std::fprintf(stderr, "unknown flag %s\n", a.c_str()); return 2; }
  }
  signal(SIGPIPE, SIG_IGN);
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
  std::printf("command: %s\nnproc: %u\n\n", cmd.c_str(), std::thread::hardware_concurrency());

  std::vector<size_t> sizes;
  for (auto& s : Split(sizes_arg)) sizes.push_back(ParseSize(s));
  std::vector<int> clients;
  for (auto& s : Split(clients_arg)) clients.push_back(std::atoi(s.c_str()));

  keel::kvstore::ServiceOptions so;
  so.store.dram_bytes = dram_mib << 20;
  so.server.port = 0;
  so.http_port = -1;
  auto svc = keel::kvstore::Service::Start(so);
  if (!svc.ok()) {
    std::fprintf(stderr, "keel Service::Start: %s\n", svc.status().ToString().c_str());
    return 1;
  }
  int keel_port = (*svc)->port();

  int redis_port = keel::bench::FreeLoopbackPort();
  pid_t redis_pid = StartRedis(redis_bin, redis_port);
  if (redis_pid < 0 || !WaitRedis(redis_port)) {
    std::fprintf(stderr, "redis-server did not come up on port %d\n", redis_port);
    if (redis_pid > 0) { kill(redis_pid, SIGKILL); waitpid(redis_pid, nullptr, 0); }
    return 1;
  }

  std::printf("keel port %d (DRAM %lld MiB), redis-server port %d; keyspace ~%lld MiB per size, GET phase %.1f s\n\n",
              keel_port, static_cast<long long>(dram_mib), redis_port, static_cast<long long>(total_mib), seconds);
  std::printf("| size | clients | op | keel GB/s | redis GB/s | ratio | keel p50/p99 ms | redis p50/p99 ms | keel ops/err | redis ops/err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  int64_t total_errors = 0;
  for (size_t size : sizes) {
    size_t nkeys = std::max<size_t>(1, static_cast<size_t>((total_mib << 20) / size));
    RedisFlush(redis_port);
    for (int c : clients) {
      CellResult k = RunCell(true, keel_port, size, c, seconds, nkeys);
      CellResult r = RunCell(false, redis_port, size, c, seconds, nkeys);
      auto row = [&](const char* op, const PhaseResult& kp, const PhaseResult& rp) {
        std::printf("| %s | %d | %s | %.2f | %.2f | %.2fx | %.2f / %.2f | %.2f / %.2f | %lld/%lld | %lld/%lld |\n",
                    SizeName(size).c_str(), c, op, kp.gbps, rp.gbps, rp.gbps > 0 ? kp.gbps / rp.gbps : 0.0, kp.p50,
                    kp.p99, rp.p50, rp.p99, static_cast<long long>(kp.ops), static_cast<long long>(kp.errors),
                    static_cast<long long>(rp.ops), static_cast<long long>(rp.errors));
        total_errors += kp.errors + rp.errors;
      };
      row("PUT", k.put, r.put);
      row("GET", k.get, r.get);
      std::fflush(stdout);
    }
  }
  std::printf("\ntotal errors: %lld\n", static_cast<long long>(total_errors));
  kill(redis_pid, SIGTERM);
  waitpid(redis_pid, nullptr, 0);
  (*svc)->Stop();
  return total_errors == 0 ? 0 : 3;
}
