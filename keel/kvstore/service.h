// Service: what `keel kvstore` runs — a Store, the binary-protocol Server in front of it, and an
// HTTP side port for operators: GET /healthz, GET /metrics (Prometheus), GET /v1/stats (JSON).
#pragma once

#include <chrono>
#include <memory>

#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/kvstore/server.h"
#include "keel/kvstore/store.h"

namespace keel::kvstore {

struct ServiceOptions {
  StoreOptions store;
  ServerOptions server;
  std::string http_host = "127.0.0.1";
  int http_port = 7401;  // 0: any free port; -1: no HTTP side port
  // At Stop, how long queued write-behind may wait for Redis before the rest skip it.
  std::chrono::milliseconds redis_flush_limit{10000};
};

class Service {
 public:
  static Result<std::unique_ptr<Service>> Start(const ServiceOptions& options);
  ~Service();  // Stop()
  // Stops the HTTP port, then the server (connections closed), then flushes the write-behind
  // queue so acknowledged values reach the SSD tier; writes for Redis still queued after
  // redis_flush_limit are dropped (logged). Safe after a Start that failed half way.
  void Stop();

  int port() const { return server_->port(); }
  int http_port() const { return http_ ? http_->port() : -1; }
  Store& store() { return *store_; }
  Server& server() { return *server_; }
  MetricsRegistry& metrics() { return metrics_; }

 private:
  Service() = default;
  MetricsRegistry metrics_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Server> server_;
  HttpRouter router_;
  std::unique_ptr<HttpServer> http_;
  std::chrono::milliseconds redis_flush_limit_{10000};
  bool stopped_ = false;
};

}  // namespace keel::kvstore
