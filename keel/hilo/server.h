// ControllerServer: the HiLO controller as a service (`keel hilo serve`). Services POST their load
// reports; a decision thread runs Controller::Decide every decide_interval_ms; services long-poll
// the current product state. Built on keel/core/http_server.h, bound to 127.0.0.1 by default.
//
// Routes (docs/hilo.md):
//   POST /v1/report   a LoadReport (report.h), at most kMaxReportBytes (413 beyond; 400 naming the
//                     field on bad input). Freshness is stamped with the server's receive time, so
//                     a service whose clock is skewed cannot make its reports stale or eternal; the
//                     report's own unix_ms only feeds keel_hilo_report_skew_ms. A report naming
//                     binaries other than the catalog's (LoadReport::binaries) is refused with 409
//                     (unless allow_unvalidated): the figures do not cover that instance, so it
//                     counts as silent, and a service with no other instance sends the product to
//                     the safe state (Controller rules). Counted in
//                     keel_hilo_reports_foreign_binaries_total{service}, logged once per instance.
//   GET /v1/state?version=N&wait_ms=T[&service=NAME]
//                     {version, state, index, levels, reason, pinned}: at once when the current
//                     version is not N (or N is absent), else after the next change or T ms
//                     (clamped to max_wait_ms), whichever is first. `service` is ignored under the
//                     hilo policy; under per_service it is required (400 naming it otherwise) and
//                     the answer is that service's own state (+ "service"), see below.
//   GET /v1/catalog   the catalog (WriteCatalog).   GET /health, /healthz, /metrics.
//   GET /v1/services  every instance heard from in the last minute: its latest report and age
//                     ({"services":[{service, instance, applied_state, ..., age_ms}]}), so a tool
//                     can see which state each instance runs (keel hilo validate waits on it).
//   POST /v1/pin      {"state":"name"} pins the product state, {"state":""} unpins (Controller::Pin);
//                     answers like GET /v1/state. Needs `Authorization: Bearer <admin_token>`
//                     (401 without it or when wrong, 403 when the server has no admin token).
//
// Long-polls are bounded: at most max_waiters wait at once (one handler thread each); one more is
// answered at once with the current state (a heartbeat, never a 503). The HTTP pool has
// max_waiters + kSpareHandlers threads, so reports and scrapes are still served while every
// waiter slot is taken.
//
// Versions start at the start time in unix ms and each change sets max(version + 1, now_ms), so
// they grow across restarts, as StateAgent requires.
//
// Policies. kHilo (default): the Controller picks one product state and every service is answered
// it. kPerService: the per-service baseline of the evaluation (baseline.h): each service's reports
// feed that service's own ServicePolicy, and GET /v1/state?service=S answers the catalog state at
// S's own level (S applies only its own level of it). The product Controller still runs, for
// keel_hilo_state/transitions and /v1/services, but nothing pushes its state. Each service has its
// own version (same numbering rule), bumped only when that service's answer changes, so a service's
// long-poll is not woken by another's change. A pin (--pin, POST /v1/pin) beats both policies:
// while pinned every service is answered the pinned state. The per-service levels live in this
// process only for convenience; each depends on its own service's reports alone.
//
// Thread safety: Start and Stop from one owner thread; accessors from any thread.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <atomic>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/hash.h"
#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/core/status.h"
#include "keel/hilo/baseline.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/controller.h"
#include "keel/hilo/report.h"

namespace keel::hilo {

enum class StatePolicy { kHilo, kPerService };
// "hilo", "per_service".
std::string_view StatePolicyName(StatePolicy p);

struct ControllerServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                        // 0 = any free port; see port()
  std::string fingerprint;             // the running binaries, compared with catalog.binaries
  int64_t max_age_s = 30 * 86400;      // figures older than this are stale
  bool allow_unvalidated = false;      // development: start despite CheckUsable (logged loudly)
  int decide_interval_ms = 250;        // 10..60000
  int max_wait_ms = 30000;             // long-poll cap, 0..300000
  int max_waiters = 128;               // long-polls waiting at once, 1..10000
  ControllerOptions controller;
  StatePolicy policy = StatePolicy::kHilo;
  // kPerService only: each service's ServicePolicy options (e.g. a p99 bound for one service).
  std::array<ServicePolicyOptions, kNumServices> per_service;
  // Enables POST /v1/pin for a client presenting `Authorization: Bearer <admin_token>` (only a
  // hash is kept). Empty: pinning over HTTP is refused (403); Pin() still works in-process.
  std::string admin_token;
  // A state to pin at start ("" = none; see Controller::Pin). Started pinned, the server accepts
  // states without figures (with allow_unvalidated): what `keel hilo validate` needs.
  std::string pin;
  // Unix ms now; null = the system clock. Tests may pin time; the decision loop still runs on
  // decide_interval_ms of real time.
  std::function<int64_t()> clock;
};

class ControllerServer {
 public:
  static constexpr int kSpareHandlers = 16;  // handler threads beyond max_waiters

  // Checks the options (per_service ones too), CheckUsable (unless allow_unvalidated) and
  // Controller::Create.
  // InvalidArgument saying why the catalog or options cannot be used.
  static Result<std::unique_ptr<ControllerServer>> Create(Catalog catalog, ControllerServerOptions options);
  ~ControllerServer();  // Stop()
  ControllerServer(const ControllerServer&) = delete;
  ControllerServer& operator=(const ControllerServer&) = delete;

  // Binds and starts the HTTP server and the decision loop. IOError when the address cannot be bound.
  Status Start();
  // Wakes every long-poll (they answer the current state), stops the decision loop, drains HTTP.
  // Idempotent.
  void Stop();

  int port() const { return http_ ? http_->port() : 0; }
  int64_t version() const;  // the product state's version
  std::string state() const;  // the product state (under kPerService: computed, not pushed)
  StatePolicy policy() const { return opt_.policy; }
  // kPerService: the catalog index `s` is answered now (its own level, or the pin) and its version.
  // Under kHilo: the product's index and version.
  int service_index(Service s) const;
  int64_t service_version(Service s) const;
  // Runs one decision now (what the loop does every decide_interval_ms). For tests and tools.
  Decision DecideNow();
  // keel_hilo_catalog_age_seconds, and one error line when the figures pass max_age_s.
  void WatchCatalogAge(int64_t now_ms);
  // Pins (or with "" unpins) the product state and decides at once; see Controller::Pin.
  Status Pin(std::string_view state);

 private:
  explicit ControllerServer(ControllerServerOptions options);
  int64_t Now() const;
  void Loop();
  // False (and 409 sent) when `report` names binaries other than the catalog's.
  bool AcceptBinaries(const LoadReport& report, HttpResponder& r);
  void HandleReport(const HttpRequest& req, HttpResponder& r);
  void HandleState(const HttpRequest& req, HttpResponder& r);
  void HandlePin(const HttpRequest& req, HttpResponder& r);
  void HandleServices(const HttpRequest& req, HttpResponder& r);
  std::string StateBody() const;  // under mu_
  // Under mu_, kPerService: `s`'s answer. Its index: the pin if pinned, else its own level.
  std::string ServiceStateBody(Service s) const;
  int ServiceIndexLocked(Service s) const;
  // Under mu_, kPerService: bumps the version of every service whose index changed since it was
  // last answered; returns a log line per change (logged by the caller outside the lock).
  std::vector<std::string> RefreshServicesLocked(int64_t now);

  ControllerServerOptions opt_;
  MetricsRegistry metrics_;
  std::optional<Controller> controller_;  // under mu_
  std::unique_ptr<HttpServer> http_;

  mutable std::mutex mu_;
  std::condition_variable changed_;
  int64_t version_ = 0;
  std::string epoch_;  // random per Start: agents tell a new controller instance by it
  std::string reason_;
  int waiters_ = 0;
  // The latest report of each instance (for GET /v1/services), keyed by (service, instance),
  // with its receive time. Entries unheard for kForgetMs are dropped; at most kMaxInstances.
  std::map<std::pair<int, std::string>, LoadReport> instances_;
  Hash128 admin_hash_;
  bool admin_enabled_ = false;
  bool stopping_ = false;
  bool started_ = false;
  std::thread loop_;
  // kPerService (empty under kHilo), indexed by Service.
  std::vector<ServicePolicy> policies_;
  std::array<int64_t, kNumServices> svc_version_{};
  std::array<int, kNumServices> svc_index_{};         // the index each service is answered
  std::array<std::string, kNumServices> svc_reason_;  // why it is at that index
  std::array<std::string, kNumServices> policy_reason_;  // the policy's last step's reason

  CounterFamily* requests_ = nullptr;
  CounterFamily* reports_ = nullptr;
  CounterFamily* report_errors_ = nullptr;
  CounterFamily* foreign_binaries_ = nullptr;
  std::set<std::pair<int, std::string>> foreign_logged_;  // instances already warned about (bounded)
  GaugeFamily* demand_ = nullptr;
  GaugeFamily* predicted_ = nullptr;
  GaugeFamily* skew_ = nullptr;
  Gauge* version_gauge_ = nullptr;
  Gauge* catalog_age_ = nullptr;
  std::atomic<bool> age_warned_{false};
  Gauge* waiters_gauge_ = nullptr;
  GaugeFamily* service_level_ = nullptr;          // kPerService: keel_hilo_service_level{service}
  CounterFamily* service_transitions_ = nullptr;  // kPerService: keel_hilo_service_transitions_total{service}
};

}  // namespace keel::hilo
