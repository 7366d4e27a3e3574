// PolicyService: `keel gateway-policy` — the gateway's governance service (endpoints in
// policy.h) over HTTP/1.1 + JSON on a Unix-domain socket that only its owner may connect to.
// Admin endpoints need "Authorization: Bearer <admin key>" (compared in constant time via its
// SHA-256); anything else gets 401. Optional header "X-Keel-Actor: <name>" labels the admin in
// the audit log (with the peer's pid/uid). Keys and key hashes never reach logs or the audit log.
//
// Start and Stop are called from one thread; the handlers run on the HTTP server's threads and
// share the thread-safe PolicyStore.
#pragma once

#include <memory>
#include <string>

#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/gateway/policy_store.h"

namespace keel::gateway {

struct PolicyServiceOptions {
  std::string socket_path = "/tmp/keel-gateway-policy.sock";  // the gateway's default too
  std::string admin_key;              // required, at least 16 bytes
  PolicyStoreOptions store;
  size_t max_body_bytes = 4 << 20;    // a full usage batch (10000 records) fits
  int max_connections = 64;
};

// Reads the admin key: from `file` when non-empty (surrounding whitespace trimmed), else from
// the environment variable KEEL_GATEWAY_ADMIN_KEY. InvalidArgument when neither gives one, or it
// is shorter than 16 bytes; IOError naming the file when it cannot be read.
Result<std::string> LoadAdminKey(const std::string& file);

class PolicyService {
 public:
  // Opens the store, then listens. Errors from either (the socket path or the database file are
  // named in the message); InvalidArgument for a missing or short admin key.
  static Result<std::unique_ptr<PolicyService>> Start(PolicyServiceOptions options);
  ~PolicyService();  // Stop()
  PolicyService(const PolicyService&) = delete;
  PolicyService& operator=(const PolicyService&) = delete;

  // Stops listening, lets requests in progress finish (bounded) and removes the socket file.
  void Stop();

  const std::string& socket_path() const { return options_.socket_path; }
  PolicyStore& store() { return *store_; }
  MetricsRegistry& metrics() { return metrics_; }

 private:
  explicit PolicyService(PolicyServiceOptions options);
  void Handle(const HttpRequest& request, HttpResponder& responder);
  void Route();
  void ServeResolve(const HttpRequest& request, HttpResponder& responder);
  void ServeUsage(const HttpRequest& request, HttpResponder& responder);
  // True when the request carries the admin key; otherwise answers 401 and logs the attempt.
  bool Authorized(const HttpRequest& request, HttpResponder& responder) const;

  PolicyServiceOptions options_;
  std::string admin_key_hash_;
  std::unique_ptr<PolicyStore> store_;
  MetricsRegistry metrics_;
  HttpRouter router_;
  std::unique_ptr<HttpServer> http_;
  CounterFamily* requests_ = nullptr;
  CounterFamily* resolves_ = nullptr;
  CounterFamily* usage_records_ = nullptr;
  CounterFamily* admin_calls_ = nullptr;
  CounterFamily* errors_ = nullptr;
  HistogramFamily* latency_ = nullptr;
  bool stopped_ = false;
};

}  // namespace keel::gateway
