// trust_bench: the plain router (first reply per shard) against TrustANN verification, same
// replicas, same load, same run.
//
// A cluster of S shards x R `keel vector` replicas (each its own process, its own signing key, a
// different HNSW level seed so honest replicas disagree as independently built ones do), zones
// a, b, c, ... one replica each, and two `keel vector-router` processes over the same replicas: one
// in plain mode, one in trust mode. Data: the real SIFT base vectors ($KEEL_SHARED/data/vectors),
// `--holdout` of them held out as queries (exact top-10 ground truth by brute force over the rest),
// optionally `--extra` more items drawn from their distribution (a real vector plus Gaussian noise,
// as the CoLoc bench does).
//
// 1. Capacity: closed loop, `--capacity-clients` clients on the plain router, `--capacity-s`.
// 2. For each load in `--loads` (fractions of that capacity): open-loop Poisson arrivals for
//    `--duration-s`, plain then trust; latency counts from each request's scheduled time.
// 3. For each attack in `--attacks`: one replica per shard (zone a) restarted as the adversary
//    (collude: two replicas per shard restarted in one zone with the same seed), both routers
//    restarted with the matching config, then plain and trust at the first load.
// Reported per run: p50/p95/p99 latency, throughput, recall@10, verified %, unverified %, and
// tampered %: answers served as verified (trust) or served at all (plain) that differ from what the
// honest replicas returned — a hit no honest replica of its shard returned, a distance that is not
// the honest one, or a hit every honest replica of the shard returned (and closer than the answer's
// k-th) left out.
// Zones are loopback ports; `--zone-delay-us D` puts a DelayProxy (bench/common) in front of every
// replica outside zone a (the routers' zone), adding about 2 x D per inter-zone round trip.
#include <sys/utsname.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/common/child_process.h"
#include "bench/common/delay_proxy.h"
#include "keel/vector/replica_client.h"
#include "keel/vector/texmex.h"
#include "keel/vector/trust/adversary.h"
#include "keel/vector/trust/audit.h"
#include "keel/vector/trust/signed_reply.h"
#include "keel/vector/trust/verifier.h"

namespace keel::trustbench {
namespace {

using bench::Child;
using bench::Clock;
using bench::FreeLoopbackPort;
using bench::MsSince;
using bench::SleepMs;
using json = nlohmann::json;

struct Args {
  std::string keel = "build/keel";
  std::string shared;
  std::string work;
  int shards = 2;
  int replicas = 3;
  int holdout = 500;
  int extra = 0;
  int k = 10;
  double duration_s = 8;
  double capacity_s = 4;
  int capacity_clients = 8;
  std::vector<double> loads = {0.3, 0.9};
  std::vector<std::string> attacks = {"drop", "inject", "reorder", "stale", "collude", "slow"};
  int quorum = 2, min_zones = 2, fanout = 0;
  double threshold = 0.95;
  int deadline_ms = 1000;
  int zone_delay_us = 0;
  std::string zones = "auto";  // netns | loopback | auto (netns when the machine allows)
  int ef = 64;
  int workers = 256;  // open loop: enough that a slow reply never holds back the next send
  uint64_t seed = 1;
  std::string json_out;
  bool quick = false;
  bool assert_zero = false;  // exit 1 if any verified answer was tampered
};

// ---- data ---------------------------------------------------------------------------------------

struct Data {
  int dim = 0;
  std::vector<uint64_t> ids;      // base item ids
  std::vector<float> base;        // ids.size() x dim
  std::vector<std::vector<float>> queries;
  std::vector<std::vector<uint64_t>> truth;  // exact top-k ids per query
};

Data MakeData(const Args& a) {
  auto set = vector::ReadBvecs(a.shared + "/data/vectors/bigann10k_base.bvecs");
  if (!set.ok()) {
    std::fprintf(stderr, "trust_bench: %s\n", set.status().ToString().c_str());
    std::exit(2);
  }
  Data d;
  d.dim = set->dim;
  std::mt19937_64 rng(a.seed);
  std::vector<int64_t> order(static_cast<size_t>(set->count));
  for (int64_t i = 0; i < set->count; ++i) order[static_cast<size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);
  const int64_t holdout = std::min<int64_t>(a.holdout, set->count / 2);
  std::set<int64_t> held(order.begin(), order.begin() + holdout);
  for (int64_t i = 0; i < set->count; ++i) {
    const float* row = set->values.data() + i * d.dim;
    if (held.count(i)) {
      d.queries.emplace_back(row, row + d.dim);
    } else {
      d.ids.push_back(static_cast<uint64_t>(i));
      d.base.insert(d.base.end(), row, row + d.dim);
    }
  }
  // Extra items: a random real vector plus Gaussian noise of 0.3x each dimension's std.
  if (a.extra > 0) {
    std::vector<double> mean(static_cast<size_t>(d.dim)), sq(static_cast<size_t>(d.dim));
    const size_t n = d.ids.size();
    for (size_t i = 0; i < n; ++i) {
      for (int j = 0; j < d.dim; ++j) {
        const double v = d.base[i * static_cast<size_t>(d.dim) + static_cast<size_t>(j)];
        mean[static_cast<size_t>(j)] += v;
        sq[static_cast<size_t>(j)] += v * v;
      }
    }
    std::vector<float> sd(static_cast<size_t>(d.dim));
    for (int j = 0; j < d.dim; ++j) {
      const double m = mean[static_cast<size_t>(j)] / static_cast<double>(n);
      sd[static_cast<size_t>(j)] = static_cast<float>(std::sqrt(std::max(0.0, sq[static_cast<size_t>(j)] / static_cast<double>(n) - m * m)));
    }
    std::normal_distribution<float> g;
    std::uniform_int_distribution<size_t> pick(0, n - 1);
    for (int e = 0; e < a.extra; ++e) {
      const size_t src = pick(rng);
      d.ids.push_back(static_cast<uint64_t>(set->count + e));
      for (int j = 0; j < d.dim; ++j) {
        const float v = d.base[src * static_cast<size_t>(d.dim) + static_cast<size_t>(j)] + 0.3f * sd[static_cast<size_t>(j)] * g(rng);
        d.base.push_back(std::clamp(std::round(v), 0.f, 255.f));
      }
    }
  }
  // Exact ground truth.
  for (const auto& q : d.queries) {
    std::vector<std::pair<float, uint64_t>> best;
    for (size_t i = 0; i < d.ids.size(); ++i) {
      const float* row = d.base.data() + i * static_cast<size_t>(d.dim);
      float dist = 0;
      for (int j = 0; j < d.dim; ++j) dist += (row[j] - q[static_cast<size_t>(j)]) * (row[j] - q[static_cast<size_t>(j)]);
      if (best.size() < static_cast<size_t>(a.k) || dist < best.back().first) {
        best.emplace_back(dist, d.ids[i]);
        std::sort(best.begin(), best.end());
        if (best.size() > static_cast<size_t>(a.k)) best.pop_back();
      }
    }
    std::vector<uint64_t> ids;
    for (auto& [dist, id] : best) ids.push_back(id);
    d.truth.push_back(std::move(ids));
  }
  return d;
}

// ---- cluster ------------------------------------------------------------------------------------

struct ReplicaProc {
  int shard = 0, index = 0;
  std::string id, zone, dir, key, pub, log;
  std::string host = "127.0.0.1";  // the replica's address (its namespace's veth end in netns mode)
  std::string netns;               // network namespace it runs in ("" = this one)
  int port = 0;        // the replica's own port
  int router_port = 0; // what the routers dial (a delay proxy's port for remote zones)
  std::unique_ptr<Child> child;
  std::unique_ptr<bench::DelayProxy> proxy;
  std::string adversary = "honest";
  uint64_t adversary_seed = 0;
};

struct Cluster {
  Args args;
  bool netns = false;              // zones are network namespaces
  std::vector<std::string> namespaces;
  std::vector<ReplicaProc> replicas;  // shard-major
  // The routers over the same replicas: plain-1 (one replica per shard: a load-balancing router),
  // plain-q (the first of as many replicas as trust asks first: the same read load as trust), trust.
  struct RouterProc {
    std::string name, mode;
    int plain_fanout = 0;
    int port = 0;
    std::unique_ptr<Child> child;
  };
  std::vector<RouterProc> routers;
  RouterProc& router(const std::string& name) {
    for (auto& r : routers) {
      if (r.name == name) return r;
    }
    std::abort();
  }

  ReplicaProc& at(int s, int r) { return replicas[static_cast<size_t>(s * args.replicas + r)]; }
};

Result<vector::HttpReply> CallAt(const std::string& host, int port, const std::string& method, const std::string& target,
                                 const std::string& body, int timeout_ms = 30000) {
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, std::unique_ptr<vector::ReplicaClient>> clients;
  vector::ReplicaClient* c;
  {
    std::lock_guard lock(mu);
    auto& slot = clients[{host, port}];
    if (!slot) {
      vector::ReplicaClientOptions o;
      o.max_idle_connections = 128;
      slot = std::make_unique<vector::ReplicaClient>(vector::HttpEndpoint{host, port}, o);
    }
    c = slot.get();
  }
  return c->Call(method, target, body, "application/json", DeadlineIn(timeout_ms));
}
Result<vector::HttpReply> Call(int port, const std::string& method, const std::string& target, const std::string& body,
                               int timeout_ms = 30000) {
  return CallAt("127.0.0.1", port, method, target, body, timeout_ms);
}

bool Healthy(const std::string& host, int port) {
  auto r = CallAt(host, port, "GET", "/healthz", "", 1000);
  return r.ok() && r->status == 200;
}
bool Healthy(int port) { return Healthy("127.0.0.1", port); }

// ---- zones as network namespaces ----------------------------------------------------------------

bool Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

// One namespace per zone, joined to this one by a veth pair: zone i is 10.<o>.<i+1>.2, this side
// .1 (o from the pid, so two runs do not collide). False (and nothing left behind) when the
// machine does not allow it (no root, no CAP_NET_ADMIN, no ip(8)).
bool SetUpNamespaces(Cluster& c) {
  const int pid = static_cast<int>(::getpid());
  const int octet = 100 + pid % 100;
  for (int z = 0; z < c.args.replicas; ++z) {
    const std::string ns = "kt" + std::to_string(pid) + "-" + std::string(1, static_cast<char>('a' + z));
    const std::string host_if = "kt" + std::to_string(pid % 100000) + "h" + std::to_string(z);
    const std::string ns_if = "kt" + std::to_string(pid % 100000) + "n" + std::to_string(z);
    const std::string net = "10." + std::to_string(octet) + "." + std::to_string(z + 1) + ".";
    const bool ok = Sh("ip netns add " + ns) && (c.namespaces.push_back(ns), true) &&
                    Sh("ip link add " + host_if + " type veth peer name " + ns_if) &&
                    Sh("ip link set " + ns_if + " netns " + ns) && Sh("ip addr add " + net + "1/24 dev " + host_if) &&
                    Sh("ip link set " + host_if + " up") && Sh("ip netns exec " + ns + " ip addr add " + net + "2/24 dev " + ns_if) &&
                    Sh("ip netns exec " + ns + " ip link set " + ns_if + " up") && Sh("ip netns exec " + ns + " ip link set lo up");
    if (!ok) return false;
  }
  return true;
}

void TearDownNamespaces(Cluster& c) {
  for (const auto& ns : c.namespaces) Sh("ip netns del " + ns);  // removes the veth pair with it
  c.namespaces.clear();
}

std::vector<std::string>* g_namespaces = nullptr;  // torn down on Die

void Die(const std::string& msg, const std::string& log = "") {
  std::fprintf(stderr, "trust_bench: %s\n", msg.c_str());
  if (g_namespaces) {
    for (const auto& ns : *g_namespaces) std::system(("ip netns del " + ns + " >/dev/null 2>&1").c_str());
  }
  if (!log.empty()) std::fprintf(stderr, "--- %s ---\n%s\n", log.c_str(), bench::Tail(log).c_str());
  std::exit(2);
}

std::string IpBinary() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "ip";
}

void StartReplica(Cluster& c, ReplicaProc& r) {
  std::vector<std::string> argv = {"vector", "--dir", r.dir, "--port", std::to_string(r.port), "--shard-id", std::to_string(r.shard),
                                   "--shards", std::to_string(c.args.shards), "--replica-id", r.id, "--zone", r.zone,
                                   "--signing-key", r.key, "--hnsw-seed", std::to_string(1000 + r.index),
                                   "--adversary", r.adversary, "--adversary-seed", std::to_string(r.adversary_seed),
                                   "--text-dim", "128", "--image-dim", "128", "--host", r.host};
  if (r.netns.empty()) {
    r.child = std::make_unique<Child>(c.args.keel, argv, r.log);
  } else {
    argv.insert(argv.begin(), {"netns", "exec", r.netns, c.args.keel});  // ip netns exec execs keel: same pid
    r.child = std::make_unique<Child>(IpBinary(), argv, r.log);
  }
  if (!r.child->StartReady([&] { return Healthy(r.host, r.port); })) Die("replica " + r.id + " did not start", r.log);
}

std::string ConfigJson(Cluster& c, const std::string& mode, int plain_fanout) {
  json shards = json::array();
  for (int s = 0; s < c.args.shards; ++s) {
    json reps = json::array();
    for (int r = 0; r < c.args.replicas; ++r) {
      const ReplicaProc& p = c.at(s, r);
      const std::string addr = p.proxy ? "127.0.0.1" : p.host;  // a delay proxy listens here
      reps.push_back({{"id", p.id}, {"url", "http://" + addr + ":" + std::to_string(p.router_port)}, {"zone", p.zone}, {"public_key", p.pub}});
    }
    shards.push_back({{"id", s}, {"replicas", reps}});
  }
  json cfg = {{"text_dim", 128},
              {"image_dim", 128},
              {"mode", mode},
              {"trust",
               {{"quorum", c.args.quorum},
                {"min_zones", c.args.min_zones},
                {"threshold", c.args.threshold},
                {"fanout", c.args.fanout},
                {"deadline_ms", c.args.deadline_ms}}},
              {"plain", {{"fanout", plain_fanout}}},
              {"shards", shards}};
  return cfg.dump(2);
}

void StartRouters(Cluster& c) {
  if (c.routers.empty()) {
    const int first_asks = c.args.fanout > 0 ? c.args.fanout : c.args.quorum;
    c.routers.push_back({"plain-" + std::to_string(first_asks), "plain", first_asks, 0, nullptr});
    if (first_asks != 1) c.routers.push_back({"plain-1", "plain", 1, 0, nullptr});
    c.routers.push_back({"trust", "trust", 0, 0, nullptr});
  }
  for (auto& r : c.routers) {
    const std::string cfg_path = c.args.work + "/router-" + r.name + ".json";
    const std::string log = c.args.work + "/router-" + r.name + ".log";
    std::ofstream(cfg_path) << ConfigJson(c, r.mode, r.plain_fanout);
    r.port = FreeLoopbackPort();
    r.child = std::make_unique<Child>(c.args.keel, std::vector<std::string>{"vector-router", "--config", cfg_path, "--port", std::to_string(r.port)}, log);
    if (!r.child->StartReady([&] { return Healthy(r.port); })) Die(r.name + " router did not start", log);
  }
}

void StopRouters(Cluster& c) {
  for (auto& r : c.routers) {
    if (r.child) r.child->Signal(SIGTERM);
  }
}

void StartCluster(Cluster& c) {
  std::filesystem::remove_all(c.args.work);
  std::filesystem::create_directories(c.args.work);
  if (c.args.zones != "loopback") {
    c.netns = SetUpNamespaces(c);
    if (!c.netns) {
      TearDownNamespaces(c);
      if (c.args.zones == "netns") Die("cannot create network namespaces (needs root / CAP_NET_ADMIN and ip(8))");
    }
  }
  const int octet = 100 + static_cast<int>(::getpid()) % 100;
  for (int s = 0; s < c.args.shards; ++s) {
    for (int r = 0; r < c.args.replicas; ++r) {
      ReplicaProc p;
      p.shard = s;
      p.index = r;
      p.zone = std::string(1, static_cast<char>('a' + r));
      p.id = "s" + std::to_string(s) + "-" + p.zone;
      p.dir = c.args.work + "/" + p.id;
      p.key = c.args.work + "/" + p.id + ".key";
      p.pub = c.args.work + "/" + p.id + ".pub";
      p.log = c.args.work + "/" + p.id + ".log";
      auto key = vector::trust::SigningKey::Generate();
      if (!key.ok() || !key->Save(p.key, p.pub).ok()) Die("cannot write keys for " + p.id);
      p.port = FreeLoopbackPort();  // free here; in a fresh namespace every port is free
      p.router_port = p.port;
      if (c.netns) {
        p.netns = c.namespaces[static_cast<size_t>(r)];
        p.host = "10." + std::to_string(octet) + "." + std::to_string(r + 1) + ".2";
      }
      c.replicas.push_back(std::move(p));
    }
  }
  for (auto& r : c.replicas) {
    StartReplica(c, r);
    if (c.args.zone_delay_us > 0 && r.zone != "a") {
      r.proxy = std::make_unique<bench::DelayProxy>(r.port, std::chrono::microseconds(c.args.zone_delay_us), r.host.c_str());
      r.router_port = r.proxy->port();
    }
  }
  StartRouters(c);
}

void Load(Cluster& c, const Data& d) {
  const size_t batch = 500;
  for (size_t i = 0; i < d.ids.size(); i += batch) {
    json items = json::array();
    for (size_t j = i; j < std::min(d.ids.size(), i + batch); ++j) {
      const float* row = d.base.data() + j * static_cast<size_t>(d.dim);
      items.push_back({{"id", d.ids[j]}, {"text", std::vector<float>(row, row + d.dim)}});
    }
    auto r = Call(c.router("trust").port, "POST", "/v1/upsert", json{{"items", items}}.dump(), 120000);
    if (!r.ok() || r->status != 200) Die("upsert through the router failed: " + (r.ok() ? r->body : r.status().ToString()));
  }
}

std::string SearchBody(const Args& a, const std::vector<float>& q) {
  return json{{"kind", "text"}, {"text", q}, {"k", a.k}, {"ef", a.ef}}.dump();
}

// Every replica's own answer to every query (honest replicas answer deterministically).
using ReplicaAnswers = std::vector<std::vector<std::vector<std::pair<uint64_t, float>>>>;  // [replica][query]

ReplicaAnswers AskEveryReplica(Cluster& c, const Data& d) {
  ReplicaAnswers out(c.replicas.size());
  for (size_t r = 0; r < c.replicas.size(); ++r) {
    for (const auto& q : d.queries) {
      auto res = CallAt(c.replicas[r].host, c.replicas[r].port, "POST", "/v1/search", SearchBody(c.args, q));
      std::vector<std::pair<uint64_t, float>> hits;
      if (!res.ok() || res->status != 200) {
        Die("replica " + c.replicas[r].id + " refused a search: " + (res.ok() ? res->body : res.status().ToString()), c.replicas[r].log);
      }
      const json answer = json::parse(res->body);  // named: a range-for over parse(...)["hits"] would dangle
      for (const auto& h : answer["hits"]) hits.emplace_back(h["id"].get<uint64_t>(), h["text_distance"].get<float>());
      out[r].push_back(std::move(hits));
    }
  }
  return out;
}

// ---- load ---------------------------------------------------------------------------------------

struct RunStats {
  std::string router, scenario;
  double load = 0, offered_qps = 0, achieved_qps = 0;
  double p50 = 0, p95 = 0, p99 = 0;
  double recall = 0;
  int64_t answers = 0, errors = 0, verified = 0, unverified = 0, tampered = 0, tampered_verified = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

struct Answer {
  bool ok = false, verified = false;
  std::vector<std::pair<uint64_t, float>> hits;
};

Answer Search(int port, const Args& a, const std::vector<float>& q) {
  Answer ans;
  auto r = Call(port, "POST", "/v1/search", SearchBody(a, q), 10000);
  if (!r.ok() || r->status != 200) return ans;
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.contains("hits")) return ans;
  ans.ok = true;
  ans.verified = j.value("verified", false);
  for (const auto& h : j["hits"]) ans.hits.emplace_back(h["id"].get<uint64_t>(), h["text_distance"].get<float>());
  return ans;
}

// The tamper audit (keel/vector/trust/audit.h) over the honest replicas' answers to query q.
bool Tampered(const Answer& ans, int q, const Cluster& c, const ReplicaAnswers& replica_answers, const std::vector<bool>& honest) {
  std::vector<std::vector<std::vector<vector::trust::SignedHit>>> by_shard(static_cast<size_t>(c.args.shards));
  for (size_t ri = 0; ri < replica_answers.size(); ++ri) {
    if (!honest[ri]) continue;
    std::vector<vector::trust::SignedHit> hits;
    for (const auto& [id, dist] : replica_answers[ri][static_cast<size_t>(q)]) hits.push_back({id, dist, 0, 0});
    by_shard[ri / static_cast<size_t>(c.args.replicas)].push_back(std::move(hits));
  }
  std::vector<vector::trust::SignedHit> got;
  for (const auto& [id, dist] : ans.hits) got.push_back({id, dist, 0, 0});
  const auto check = vector::trust::CheckAgainstHonest(got, c.args.k, static_cast<uint32_t>(c.args.shards), by_shard);
  static std::atomic<int> shown{0};
  if (check.tampered && std::getenv("TRUST_BENCH_DEBUG") && shown.fetch_add(1) < 3) {
    std::fprintf(stderr, "tampered (query %d): %s\n answer:", q, check.why.c_str());
    for (auto& h : got) std::fprintf(stderr, " %lu@%g", (unsigned long)h.id, h.text_distance);
    for (size_t s = 0; s < by_shard.size(); ++s) {
      for (auto& rep : by_shard[s]) {
        std::fprintf(stderr, "\n shard %zu:", s);
        for (auto& h : rep) std::fprintf(stderr, " %lu@%g", (unsigned long)h.id, h.text_distance);
      }
    }
    std::fprintf(stderr, "\n");
  }
  return check.tampered;
}

RunStats RunLoad(Cluster& c, const Data& d, int port, double qps, double seconds, const ReplicaAnswers& honest_answers,
                 const std::vector<bool>& honest) {
  const Args& a = c.args;
  std::mt19937_64 rng(a.seed + static_cast<uint64_t>(qps));
  std::exponential_distribution<double> gap(qps);
  std::vector<double> at;  // scheduled send times, seconds from start
  for (double t = gap(rng); t < seconds; t += gap(rng)) at.push_back(t);
  std::vector<double> latency_ms(at.size(), -1);
  std::vector<Answer> answers(at.size());
  std::atomic<size_t> next{0};
  const auto t0 = Clock::now() + std::chrono::milliseconds(50);
  std::vector<std::thread> workers;
  for (int w = 0; w < a.workers; ++w) {
    workers.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < at.size();) {
        const auto when = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at[i]));
        std::this_thread::sleep_until(when);
        answers[i] = Search(port, a, d.queries[i % d.queries.size()]);
        latency_ms[i] = MsSince(when);
      }
    });
  }
  for (auto& t : workers) t.join();
  const double elapsed = MsSince(t0) / 1000;
  RunStats st;
  st.offered_qps = qps;
  std::vector<double> lat;
  double recall_sum = 0;
  for (size_t i = 0; i < at.size(); ++i) {
    const Answer& ans = answers[i];
    if (!ans.ok) {
      ++st.errors;
      continue;
    }
    ++st.answers;
    lat.push_back(latency_ms[i]);
    const int q = static_cast<int>(i % d.queries.size());
    std::set<uint64_t> want(d.truth[static_cast<size_t>(q)].begin(), d.truth[static_cast<size_t>(q)].end());
    int found = 0;
    for (const auto& [id, dist] : ans.hits) found += want.count(id) ? 1 : 0;
    recall_sum += static_cast<double>(found) / static_cast<double>(want.size());
    ans.verified ? ++st.verified : ++st.unverified;
    if (Tampered(ans, q, c, honest_answers, honest)) {
      ++st.tampered;
      if (ans.verified) ++st.tampered_verified;
    }
  }
  st.achieved_qps = static_cast<double>(st.answers) / elapsed;
  st.p50 = Percentile(lat, 0.50);
  st.p95 = Percentile(lat, 0.95);
  st.p99 = Percentile(lat, 0.99);
  st.recall = st.answers ? recall_sum / static_cast<double>(st.answers) : 0;
  return st;
}

double MeasureCapacity(Cluster& c, const Data& d) {
  std::atomic<int64_t> done{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> ts;
  const auto t0 = Clock::now();
  for (int w = 0; w < c.args.capacity_clients; ++w) {
    ts.emplace_back([&, w] {
      for (size_t i = static_cast<size_t>(w); !stop.load(); i += static_cast<size_t>(c.args.capacity_clients)) {
        if (Search(c.routers.front().port, c.args, d.queries[i % d.queries.size()]).ok) done.fetch_add(1);
      }
    });
  }
  SleepMs(c.args.capacity_s * 1000);
  stop = true;
  for (auto& t : ts) t.join();
  return static_cast<double>(done.load()) / (MsSince(t0) / 1000);
}

void Print(const RunStats& s) {
  const bool plain = s.router != "trust";
  auto pct = [&](int64_t n) {
    return plain ? std::string("—") : fmt::format("{:.2f}%", s.answers ? 100.0 * static_cast<double>(n) / static_cast<double>(s.answers) : 0.0);
  };
  std::printf("| %-8s | %-7s | %4.0f%% | %7.1f | %7.1f | %7.2f | %7.2f | %7.2f | %6.4f | %7s | %7s | %7.2f%% | %5lld |\n",
              s.scenario.c_str(), s.router.c_str(), s.load * 100, s.offered_qps, s.achieved_qps, s.p50, s.p95, s.p99, s.recall,
              pct(s.verified).c_str(), pct(s.unverified).c_str(),
              s.answers ? 100.0 * static_cast<double>(s.router == "trust" ? s.tampered_verified : s.tampered) / static_cast<double>(s.answers) : 0.0,
              static_cast<long long>(s.errors));
  std::fflush(stdout);
}

json ToJson(const RunStats& s) {
  return {{"scenario", s.scenario}, {"router", s.router}, {"load", s.load}, {"offered_qps", s.offered_qps},
          {"achieved_qps", s.achieved_qps}, {"p50_ms", s.p50}, {"p95_ms", s.p95}, {"p99_ms", s.p99}, {"recall10", s.recall},
          {"answers", s.answers}, {"errors", s.errors}, {"verified", s.verified}, {"unverified", s.unverified},
          {"tampered", s.tampered}, {"tampered_verified", s.tampered_verified}};
}

// Restarts the replicas of `scenario` as adversaries (and, for collude, moves zone b's replica
// into zone a), then both routers with the matching config. "honest" restores everything.
void SetScenario(Cluster& c, const std::string& scenario, std::vector<bool>* honest) {
  StopRouters(c);
  honest->assign(c.replicas.size(), true);
  for (auto& r : c.replicas) {
    std::string mode = "honest";
    std::string zone = std::string(1, static_cast<char>('a' + r.index));
    uint64_t seed = 7;
    if (scenario == "collude") {
      if (r.index <= 1) {
        mode = "inject";
        zone = "a";
      }
    } else if (scenario != "honest" && r.index == 0) {
      mode = scenario;
    }
    if (mode == r.adversary && zone == r.zone) {
      if (mode != "honest" && mode != "slow") (*honest)[static_cast<size_t>(r.shard * c.args.replicas + r.index)] = false;
      continue;
    }
    r.child->Signal(SIGTERM);
    r.adversary = mode;
    r.adversary_seed = seed;
    r.zone = zone;
    StartReplica(c, r);
    if (mode != "honest" && mode != "slow") (*honest)[static_cast<size_t>(r.shard * c.args.replicas + r.index)] = false;
  }
  StartRouters(c);
}

int Main(int argc, char** argv) {
  Args a;
  CLI::App app{"TrustANN: plain router vs verified replicated search, same replicas, same load"};
  app.add_option("--keel", a.keel, "keel binary")->capture_default_str();
  app.add_option("--shared", a.shared, "shared data dir (default $KEEL_SHARED or ../shared)");
  app.add_option("--work", a.work, "scratch dir (default /tmp/keel-trust-bench-<pid>)");
  app.add_option("--shards", a.shards)->capture_default_str()->check(CLI::Range(1, 16));
  app.add_option("--replicas", a.replicas, "replicas per shard, one per zone")->capture_default_str()->check(CLI::Range(2, 8));
  app.add_option("--holdout", a.holdout, "SIFT base vectors held out as queries")->capture_default_str()->check(CLI::Range(10, 5000));
  app.add_option("--extra", a.extra, "extra items drawn from the SIFT distribution")->capture_default_str()->check(CLI::Range(0, 10000000));
  app.add_option("--k", a.k)->capture_default_str()->check(CLI::Range(1, 100));
  app.add_option("--ef", a.ef, "HNSW efSearch per query")->capture_default_str();
  app.add_option("--duration-s", a.duration_s, "seconds per load run")->capture_default_str();
  app.add_option("--capacity-s", a.capacity_s)->capture_default_str();
  app.add_option("--capacity-clients", a.capacity_clients)->capture_default_str();
  app.add_option("--loads", a.loads, "fractions of the plain router's capacity")->delimiter(',')->capture_default_str();
  app.add_option("--attacks", a.attacks, "drop,inject,reorder,stale,collude,slow (empty: none)")->delimiter(',')->capture_default_str();
  app.add_option("--quorum", a.quorum)->capture_default_str();
  app.add_option("--min-zones", a.min_zones)->capture_default_str();
  app.add_option("--threshold", a.threshold)->capture_default_str();
  app.add_option("--fanout", a.fanout, "replicas asked per shard at first, both routers (0: quorum)")->capture_default_str();
  app.add_option("--deadline-ms", a.deadline_ms)->capture_default_str();
  app.add_option("--zone-delay-us", a.zone_delay_us, "one-way delay to replicas outside zone a (DelayProxy)")->capture_default_str();
  app.add_option("--zones", a.zones, "netns: one network namespace per zone (veth links; needs root); loopback: ports on 127.0.0.1; auto: netns when allowed")
      ->check(CLI::IsMember({"auto", "netns", "loopback"}))->capture_default_str();
  app.add_option("--workers", a.workers, "load generator threads")->capture_default_str();
  app.add_option("--seed", a.seed)->capture_default_str();
  app.add_option("--json", a.json_out, "also write every run as JSON here");
  app.add_flag("--quick", a.quick, "small and short: a smoke run (CTest)");
  app.add_flag("--assert-zero", a.assert_zero, "exit 1 when any tampered answer was served as verified");
  CLI11_PARSE(app, argc, argv);
  if (a.shared.empty()) a.shared = std::getenv("KEEL_SHARED") ? std::getenv("KEEL_SHARED") : "../shared";
  if (a.work.empty()) a.work = "/tmp/keel-trust-bench-" + std::to_string(::getpid());
  a.work = std::filesystem::absolute(a.work).string();
  if (a.quick) {
    a.holdout = std::min(a.holdout, 60);
    a.duration_s = std::min(a.duration_s, 1.5);
    a.capacity_s = std::min(a.capacity_s, 1.0);
  }

  utsname u{};
  ::uname(&u);
  std::printf("# trust_bench: %d shards x %d replicas (zones a..%c%s), quorum %d, zones %d, threshold %.3f, fanout %d, k %d, ef %d\n",
              a.shards, a.replicas, 'a' + a.replicas - 1,
              a.zone_delay_us > 0 ? (", inter-zone delay " + std::to_string(a.zone_delay_us) + " us each way").c_str() : "",
              a.quorum, a.min_zones, a.threshold, a.fanout, a.k, a.ef);
  std::printf("# machine: %s %s, %u hardware threads\n", u.nodename, u.machine, std::thread::hardware_concurrency());

  const Data d = MakeData(a);
  std::printf("# data: %zu SIFT items (+%d drawn), %zu held-out queries, exact top-%d by brute force\n", d.ids.size() - static_cast<size_t>(a.extra),
              a.extra, d.queries.size(), a.k);
  Cluster c;
  c.args = a;
  g_namespaces = &c.namespaces;
  StartCluster(c);
  std::printf("# zones: %s\n", c.netns ? "network namespaces joined by veth pairs (routers in the root namespace)" : "loopback ports");
  const auto tl = Clock::now();
  Load(c, d);
  std::printf("# loaded %zu items through the trust router in %.1f s\n", d.ids.size(), MsSince(tl) / 1000);
  const ReplicaAnswers answers = AskEveryReplica(c, d);
  std::vector<bool> honest(c.replicas.size(), true);
  // Honest disagreement: how often two honest replicas of a shard differ at all.
  {
    int64_t pairs = 0, differ = 0;
    for (int s = 0; s < a.shards; ++s) {
      for (int r1 = 0; r1 < a.replicas; ++r1) {
        for (int r2 = r1 + 1; r2 < a.replicas; ++r2) {
          for (size_t q = 0; q < d.queries.size(); ++q) {
            ++pairs;
            differ += answers[static_cast<size_t>(s * a.replicas + r1)][q] != answers[static_cast<size_t>(s * a.replicas + r2)][q];
          }
        }
      }
    }
    std::printf("# honest replicas (different HNSW seeds) answer differently in %.2f%% of %lld replica-pair queries\n",
                pairs ? 100.0 * static_cast<double>(differ) / static_cast<double>(pairs) : 0.0, static_cast<long long>(pairs));
  }
  // Calibration: the similarity of honest pairs (what the threshold must stay below).
  {
    auto signed_hits = [](const std::vector<std::pair<uint64_t, float>>& v) {
      std::vector<vector::trust::SignedHit> h;
      for (auto& [id, dist] : v) h.push_back({id, dist, 0, 0});
      return h;
    };
    std::vector<double> sims;
    for (int s = 0; s < a.shards; ++s) {
      for (int r1 = 0; r1 < a.replicas; ++r1) {
        for (int r2 = r1 + 1; r2 < a.replicas; ++r2) {
          for (size_t q = 0; q < d.queries.size(); ++q) {
            sims.push_back(vector::trust::Similarity(signed_hits(answers[static_cast<size_t>(s * a.replicas + r1)][q]),
                                                     signed_hits(answers[static_cast<size_t>(s * a.replicas + r2)][q]), a.k, 0.5));
          }
        }
      }
    }
    std::sort(sims.begin(), sims.end());
    const size_t below = static_cast<size_t>(std::lower_bound(sims.begin(), sims.end(), a.threshold) - sims.begin());
    if (!sims.empty()) {
      std::printf("# honest pair similarity: min %.3f, 0.1%% %.3f, 1%% %.3f, 5%% %.3f, median %.3f; below threshold %.3f: %.3f%% of pairs\n",
                  sims.front(), sims[sims.size() / 1000], sims[sims.size() / 100], sims[sims.size() / 20], sims[sims.size() / 2], a.threshold,
                  100.0 * static_cast<double>(below) / static_cast<double>(sims.size()));
    }
  }
  const double capacity = MeasureCapacity(c, d);
  std::printf("# capacity of %s, the plain router with trust's read load (closed loop, %d clients): %.1f queries/s; loads are fractions of it\n\n",
              c.routers.front().name.c_str(), a.capacity_clients, capacity);
  std::printf("| scenario | router | load | offered/s | achieved/s | p50 ms | p95 ms | p99 ms | recall@10 | verified | unverified | tampered* | errors |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  json runs = json::array();
  bool tampered_verified = false;
  auto run = [&](const std::string& scenario, double load, bool every_router) {
    for (auto& router : c.routers) {
      if (!every_router && router.name == "plain-1" && c.routers.front().name != "plain-1") continue;
      RunStats st = RunLoad(c, d, router.port, capacity * load, a.duration_s, answers, honest);
      st.router = router.name;
      st.scenario = scenario;
      st.load = load;
      Print(st);
      runs.push_back(ToJson(st));
      tampered_verified |= st.tampered_verified > 0;
    }
  };
  for (double load : a.loads) run("honest", load, true);
  for (const std::string& attack : a.attacks) {
    if (attack.empty()) continue;
    SetScenario(c, attack, &honest);
    run(attack, a.loads.front(), false);
  }
  std::printf("\nrouters: plain-N takes the first valid reply of N replicas per shard, N = the replicas trust asks first (the same read\n"
              "load); plain-1 asks one (half that load; honest rows only); trust verifies. Attack rows: plain-N and trust.\n"
              "* tampered: plain = answers served that differ from the honest replicas' own answers; trust = such answers served as verified\n");
  if (!a.json_out.empty()) std::ofstream(a.json_out) << json{{"runs", runs}, {"capacity_qps", capacity}}.dump(2);
  StopRouters(c);
  for (auto& r : c.replicas) r.child->Signal(SIGTERM);
  TearDownNamespaces(c);
  std::filesystem::remove_all(a.work);
  return a.assert_zero && tampered_verified ? 1 : 0;
}

}  // namespace
}  // namespace keel::trustbench

int main(int argc, char** argv) { return keel::trustbench::Main(argc, argv); }
