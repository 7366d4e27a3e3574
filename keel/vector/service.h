// Service: what `keel vector` runs — one vector Shard behind an HTTP/JSON API, plus an optional
// background Placer that re-places the shard's vectors across the tiers from its query log.
//
//   POST /v1/upsert    {"items":[{"id":7,"text":[...],"image":[...],"attributes":{"k":"v"}}]}
//   POST /v1/delete    {"ids":[7,8]}
//   POST /v1/search    {"kind":"text|multimodal|image","text":[...],"image":[...],"ids":[...],
//                       "k":10,"ef":64,"nprobe":16,"filter":{"k":"v"},"include_vectors":false}
//                      -> {"hits":[{"id":7,"text_distance":..,"image_distance":..}],
//                          "tiers_touched":1,"search_us":..,"fetch_us":..}
//   POST /v1/snapshot  writes a snapshot now (and truncates the log)
//   GET  /v1/stats     shard, tier and placer state as JSON
//   GET  /healthz, GET /metrics (Prometheus)
//
// Bad input (malformed JSON, wrong types, wrong dimensions, numbers that are not finite
// float32, k out of range, ids that are not unsigned integers, JSON nested deeper than 8 or with
// more than max_json_values values) is 400 with a message naming the field or limit; bodies over
// max_body_bytes are 413. Errors are {"error":{"message":..,"code":..}}.
// Start/Stop are for one owner thread; requests are served concurrently.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/vector/coloc/placement.h"
#include "keel/vector/shard.h"

namespace keel::vector {

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
  bool placer = false;                    // run a background Placer
  coloc::PlacerOptions placer_options;
  bool snapshot_on_stop = true;
  // An upsert or delete that leaves the log larger than this snapshots the shard before it
  // answers (searches continue meanwhile), so restarts never replay an unbounded log. 0 = never.
  int64_t snapshot_wal_bytes = int64_t{1} << 30;
};

class Service {
 public:
  // Opens the shard (replaying its log), starts the placer and the HTTP server. Errors from
  // Shard::Open, or IOError when the address cannot be bound.
  static Result<std::unique_ptr<Service>> Start(const ServiceOptions& options);
  ~Service();  // Stop()
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Stops the HTTP server (draining requests in progress), then the placer, then snapshots the
  // shard when snapshot_on_stop. Returns the snapshot's status. Idempotent.
  Status Stop();

  int port() const { return http_ ? http_->port() : 0; }
  Shard& shard() { return *shard_; }
  MetricsRegistry& metrics() { return metrics_; }
  coloc::Placer* placer() { return placer_.get(); }

 private:
  Service() = default;
  void RegisterMetrics();
  void Route(const HttpRequest& req, HttpResponder& res);
  void HandleUpsert(const HttpRequest& req, HttpResponder& res);
  void HandleDelete(const HttpRequest& req, HttpResponder& res);
  void HandleSearch(const HttpRequest& req, HttpResponder& res);
  void HandleSnapshot(const HttpRequest& req, HttpResponder& res);
  void HandleStats(const HttpRequest& req, HttpResponder& res);
  Status MaybeSnapshot();

  ServiceOptions options_;
  MetricsRegistry metrics_;
  CounterFamily* requests_ = nullptr;
  HistogramFamily* search_seconds_ = nullptr;
  CounterFamily* cross_tier_ = nullptr;
  std::unique_ptr<Shard> shard_;
  std::unique_ptr<coloc::Placer> placer_;
  HttpRouter router_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<bool> snapshotting_{false};
  bool stopped_ = false;
};

}  // namespace keel::vector
