// Service: what `keel vector` runs — one vector Shard behind an HTTP/JSON API, plus an optional
// background Placer that re-places the shard's vectors across the tiers from its query log. In a
// cluster it is one replica of one shard (ReplicaIdentity): it signs its search answers and
// serves its log to peers that missed writes (the router moves the bytes).
//
//   POST /v1/upsert    {"items":[{"id":7,"text":[...],"image":[...],"attributes":{"k":"v"}}],
//                       "version":V (optional)}  -> {"upserted":n,"version":V}
//   POST /v1/delete    {"ids":[7,8],"version":V (optional)}  -> {"deleted":n,"version":V}
//                      With "version" and the replica at cur: V == cur+1 applies; V <= cur is
//                      200 {"version":cur,"duplicate":true} (nothing applied); V > cur+1 is 409
//                      {"error":{"message":"stale: replica at version cur, write is version V",
//                      "code":409},"version":cur}. Every write answer, errors too, has "version".
//   POST /v1/search    {"kind":"text|multimodal|image","text":[...],"image":[...],"ids":[...],
//                       "k":10,"ef":64,"nprobe":16,"rerank":32 (-1 = shard default),
//                       "filter":{"k":"v"},"include_vectors":false,
//                       "nonce":"..." (optional, 1..64 printable ASCII)}
//                      -> {"hits":[{"id":7,"text_distance":..,"image_distance":..}],
//                          "index_version":V,"tiers_touched":1,"search_us":..,"fetch_us":..,
//                          "trust":{"shard","replica","zone","index_version","query_digest",
//                                   "signature"} (with a signing key; keel/vector/trust)}
//   GET  /v1/log?after=V[&max_bytes=N]  -> application/octet-stream: the writes after version V
//                      as replication records (keel/vector/records.h), at most N bytes (default
//                      64 MiB; at least one record); header X-Keel-Log-Version: the current
//                      version. 410 when a snapshot has dropped version V+1 from the log.
//   POST /v1/log       a replication stream: applied in order (at or below the version held:
//                      skipped; a gap: 409 as for writes; a corrupt or truncated record: 400,
//                      nothing after it applied) -> {"version":cur,"applied":n,"skipped":m}
//   POST /v1/snapshot  writes a snapshot now (and truncates the log)
//   GET  /v1/stats     shard, replica, tier and placer state as JSON; "hilo_state" (null
//                      without a HiLO link)
//   GET  /healthz, GET /metrics (Prometheus)
//
// HiLO (ServiceOptions::hilo, keel/vector/hilo_link.h): each search reads the link's current
// state and clamps itself to its vector level (nprobe/ef, k, rerank; ApplyVectorLevel), and its
// answer carries the header x-keel-hilo-state: <state name>. Each search is metered on the link
// (Arrive, Started, Finish with its latency); the HTTP server's own 503s (every handler thread
// busy, or every connection busy at the cap) never reach a handler and are folded in as shed
// searches when the next search arrives. Writes, log traffic and stats are not metered: HiLO
// trades search quality for search capacity, and a write's cost does not change with the level.
//
// Bad input (malformed JSON, wrong types, wrong dimensions, numbers that are not finite
// float32, k out of range, ids that are not unsigned integers, JSON nested deeper than 8 or with
// more than max_json_values values) is 400 with a message naming the field or limit; bodies over
// max_body_bytes are 413. Errors are {"error":{"message":..,"code":..}}.
// Start/Stop are for one owner thread; requests are served concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/hilo/service_link.h"
#include "keel/vector/coloc/placement.h"
#include "keel/vector/shard.h"
#include "keel/vector/trust/adversary.h"
#include "keel/vector/trust/signed_reply.h"

namespace keel::vector {

// Who this service is in a cluster (defaults: a standalone shard). Labels are 1..128 bytes.
struct ReplicaIdentity {
  uint32_t shard = 0;           // this shard's id, < shards
  uint32_t shards = 1;          // shard count (the adversary draws injected ids of this shard)
  std::string replica = "r0";   // replica id, as the router's trust store names it
  std::string zone = "default"; // failure domain
  // Ed25519 key (PEM written by `keel vector keygen`); without one, answers carry no "trust".
  std::string signing_key_path;
  std::shared_ptr<const trust::SigningKey> signing_key;  // already loaded; wins over the path
  // What a compromised replica does to its answers before signing them (tests, benchmarks).
  trust::Adversary adversary;
};

struct ServiceOptions {
  ShardOptions shard;
  std::string host = "127.0.0.1";
  int port = 7402;                        // 0 = any free port
  size_t max_body_bytes = size_t{64} << 20;
  // JSON values per request body (numbers, strings, keys, arrays, objects), counted before parsing
  // so a hostile body cannot cost ~30x its size in memory (keel/core/json_reader.h): at most
  // ~130 MiB for numbers, ~330 MiB for tiny objects. A batch of 10k items with 128-float text and
  // image vectors is ~2.6M values; larger batches split, or raise this.
  size_t max_json_values = size_t{4} << 20;
  int max_connections = 128;
  int max_active_requests = 256;          // HTTP handler threads (requests served at once)
  bool placer = false;                    // run a background Placer
  coloc::PlacerOptions placer_options;
  bool snapshot_on_stop = true;
  // An upsert or delete that leaves the log larger than this snapshots the shard before it
  // answers (searches continue meanwhile), so restarts never replay an unbounded log. 0 = never.
  int64_t snapshot_wal_bytes = int64_t{1} << 30;
  ReplicaIdentity identity;
  // The HiLO link whose state each search applies (not started or stopped here: its owner
  // does that). Null: no HiLO, searches as requested. Its workers should be max_active_requests.
  std::shared_ptr<hilo::ServiceLink> hilo;
  // Meter searches on the link. Off for replicas behind a `keel vector-router` that reports the
  // tier's searches itself: the controller sums every instance of a service, and each router
  // search is several replica searches. (An unmetered link still reports, with zero load.)
  bool hilo_meter = true;
};

class Service {
 public:
  // Opens the shard (replaying its log), starts the placer and the HTTP server. InvalidArgument
  // for a bad identity or adversary, errors loading the signing key, errors from Shard::Open, or
  // IOError when the address cannot be bound.
  static Result<std::unique_ptr<Service>> Start(const ServiceOptions& options);
  ~Service();  // Stop()
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Stops the HTTP server (draining requests in progress), then the placer, then snapshots the
  // shard when snapshot_on_stop. Returns the snapshot's status. Idempotent.
  Status Stop();

  int port() const { return http_ ? http_->port() : 0; }
  int active_requests() const { return http_ ? http_->active_requests() : 0; }  // handlers running now
  Shard& shard() { return *shard_; }
  MetricsRegistry& metrics() { return metrics_; }
  coloc::Placer* placer() { return placer_.get(); }

 private:
  Service() = default;
  void RegisterMetrics();
  void Route(const HttpRequest& req, HttpResponder& res);
  void HandleUpsert(const HttpRequest& req, HttpResponder& res);
  void HandleDelete(const HttpRequest& req, HttpResponder& res);
  void ApplyWrite(HttpResponder& res, const Status& parsed, const std::function<Status(WriteOutcome*)>& apply,
                  const char* count_name, size_t count);
  void HandleSearch(const HttpRequest& req, HttpResponder& res);
  void Search(const HttpRequest& req, HttpResponder& res, const hilo::State* state);
  void FoldServerRejections(hilo::LoadMeter& meter);
  void HandleSnapshot(const HttpRequest& req, HttpResponder& res);
  void HandleStats(const HttpRequest& req, HttpResponder& res);
  void HandleLogRead(const HttpRequest& req, HttpResponder& res);
  void HandleLogApply(const HttpRequest& req, HttpResponder& res);
  Status MaybeSnapshot();

  ServiceOptions options_;
  MetricsRegistry metrics_;
  CounterFamily* requests_ = nullptr;
  HistogramFamily* search_seconds_ = nullptr;
  CounterFamily* cross_tier_ = nullptr;
  std::shared_ptr<const trust::SigningKey> key_;
  std::unique_ptr<Shard> shard_;
  std::unique_ptr<coloc::Placer> placer_;
  HttpRouter router_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<bool> snapshotting_{false};
  std::atomic<int64_t> rejections_seen_{0};  // the HTTP server's rejected count already metered
  bool stopped_ = false;
};

}  // namespace keel::vector
