// Router internals shared by router.cc (server, stats, sync loop), router_write.cc (versioned
// writes, catch-up) and router_search.cc (fan-out, verification, merge). Not a public header.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/vector/replica_client.h"
#include "keel/vector/router.h"
#include "keel/vector/trust/signed_reply.h"
#include "keel/vector/trust/verifier.h"

namespace keel::vector {

// What the router knows of one replica. Versions are observations (a write's answer, a stats
// read), possibly stale; replicas only move forward unless wiped.
struct ReplicaState {
  RouterReplica config;
  trust::ReplicaInfo info;
  std::unique_ptr<ReplicaClient> client;
  Gauge* version_gauge = nullptr;
  std::atomic<uint64_t> version{0};
  std::atomic<bool> known{false};      // a version was observed at least once
  std::atomic<bool> reachable{false};  // the last call reached it

  void Observe(uint64_t v);
  void Unreachable(const std::string& why);
  std::string last_error() const;

 private:
  mutable std::mutex mu_;
  std::string last_error_;
};

inline constexpr int kMaxCallThreads = 1024;  // default replica-call pool, at most
inline constexpr int kMaxShardTasks = 256;    // per-shard work (verification, writes), at most

struct ShardState {
  uint32_t id = 0;
  std::vector<std::unique_ptr<ReplicaState>> replicas;
  std::mutex write_mu;                 // one write at a time per shard
  std::atomic<uint64_t> committed{0};  // highest version a majority applied
  // Highest version this router sent (committed or not). A replica's own report never raises it:
  // one compromised replica claiming a version far ahead would otherwise have the sync loop copy
  // writes the router never issued to its honest peers, or stall every write behind a version no
  // peer can supply.
  std::atomic<uint64_t> issued{0};
  std::atomic<bool> learned{false};    // a majority's versions were read at least once

  int majority() const { return static_cast<int>(replicas.size()) / 2 + 1; }
  // The version the replicas are brought to and the next write follows: max(committed, issued).
  uint64_t head() const { return std::max(committed.load(), issued.load()); }
  // Folds the replicas' known versions into committed (the majority-th highest; only grows).
  void UpdateVersions();
};

class Router::Impl {
 public:
  RouterOptions options;
  MetricsRegistry metrics;
  CounterFamily* requests = nullptr;
  CounterFamily* replies = nullptr;      // keel_trust_replies_total{outcome}
  CounterFamily* verdicts = nullptr;     // keel_trust_verdicts_total{verdict}
  CounterFamily* escalations = nullptr;
  CounterFamily* catch_ups = nullptr;
  HistogramFamily* search_seconds = nullptr;
  trust::TrustStore store;
  std::unique_ptr<trust::Verifier> verifier;
  std::vector<std::unique_ptr<ShardState>> shards;
  std::atomic<uint64_t> plain_rotation{0};
  std::atomic<int64_t> rejections_seen{0};  // the HTTP server's rejected count already metered

  // Replica calls run on `calls`; per-shard work that waits for calls (verification, a shard's
  // write) runs on `shard_tasks`, so a pool thread never waits for its own pool.
  std::unique_ptr<CallPool> calls;
  std::unique_ptr<CallPool> shard_tasks;
  HttpRouter http_router;
  std::unique_ptr<HttpServer> http;

  std::thread sync_thread;
  std::mutex sync_mu;
  std::condition_variable sync_cv;
  bool stopping = false;
  bool stopped = false;

  ~Impl() { Stop(); }
  Status Init();
  void RegisterMetrics();
  void Route(const HttpRequest& req, HttpResponder& res);
  void HandleStats(const HttpRequest& req, HttpResponder& res);
  void HandleSnapshot(const HttpRequest& req, HttpResponder& res);
  void SyncLoop();
  void Stop();

  // router_write.cc
  void HandleUpsert(const HttpRequest& req, HttpResponder& res);
  void HandleDelete(const HttpRequest& req, HttpResponder& res);
  // Reads every replica's version (stats) and, with `catch_up`, brings laggards to the highest.
  void SyncShard(ShardState& shard, bool catch_up);
  // Copies versions (from, target] from a peer's log into replica `i`. Unavailable when no
  // peer can supply them.
  Status CatchUp(ShardState& shard, int i, uint64_t from, uint64_t target);

  // router_search.cc
  void HandleSearch(const HttpRequest& req, HttpResponder& res);
  void Search(const HttpRequest& req, HttpResponder& res, const hilo::State* state);

 private:
  void ReadStats(ShardState& shard, int i);
  Result<HttpReply> FetchLog(ReplicaState& peer, uint64_t after);
  // Copies the next batch of versions (after, target] into `to` from `peers` (most advanced
  // first; two of them must agree where two exist). Returns the version `to` reached.
  Result<uint64_t> CopyLog(ShardState& shard, const std::vector<int>& peers, ReplicaState& to, uint64_t after,
                           uint64_t target);
};

// The JSON error body every route answers with, plus optional extra fields.
void SendRouterError(HttpResponder& res, int status, const std::string& message,
                     nlohmann::json extra = nlohmann::json::object());
// An HTTP status for a Status code (400, 404, 503, 500).
int HttpStatusOf(const Status& s);

}  // namespace keel::vector
