// ServiceLink: what a service (answer, vector, engine, gateway) embeds to take part in HiLO. It
// follows the controller's product state (an AgentClient long-polling GET /v1/state into a
// StateAgent) and reports this instance's load (a LoadMeter) to POST /v1/report every
// report_interval_ms. The service reads Current() on each request and applies that state's level
// for itself at once: levels are run-time values, not start-up flags.
//
// Without a controller a link can be *pinned* to one state (Pin): `keel hilo validate` measures a
// state that way, and an operator can freeze the product in one state. A pinned link still reports
// load when it has a controller.
//
// A lost controller is the StateAgent's business: the last state is held for hold_s, then the safe
// state after fallback_s (docs/hilo.md, "Agent rules").
//
// Threads: the AgentClient's poll thread updates Current() as soon as a push arrives; a report
// thread reports every report_interval_ms, re-reads the agent (so hold and fallback happen on time)
// and runs OnChange callbacks.
//
// Thread safety: Current(), meter() and Pin() from any thread; Start/Stop from the owner.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/metrics.h"
#include "keel/core/socket.h"
#include "keel/core/status.h"
#include "keel/hilo/agent_client.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/report.h"
#include "keel/hilo/windowed_rate.h"

namespace keel::hilo {

// Counts one service instance's load over a report window. Every method may be called from any
// thread (one short mutex). A request is Arrive()d once, then either Shed() (refused: 429, queue
// full) or Started() (a worker took it) and later Finish()ed with its whole latency.
//
// Take()'s report:
//  - arrival_rate: Arrive() calls in the window (shed ones included) / window seconds;
//  - in_flight: requests Started() and not yet Finish()ed, now (LoadReport: "being served");
//  - queue_depth: requests Arrive()d and neither Started() nor Shed(), now; or the probe's value;
//  - utilisation: min(1, busy seconds Finish()ed in the window / (window seconds x workers)), or
//    the probe's value clamped to 0..1. A request's busy time counts in the window it finishes in;
//  - p99_ms: the p99 of the latencies Finish()ed in the window, from a uniform sample of at most
//    kMaxSamples of them; 0 for a window in which nothing finished.
// A Take at or before the window's start (a clock that went back) reports rates of 0.
class LoadMeter {
 public:
  static constexpr size_t kMaxSamples = 4096;

  // `workers`: how many requests the instance serves at once (threads, batch slots); utilisation
  // is busy time / (window x workers) unless a utilisation probe is set. Values below 1 count as
  // 1. The first window starts at `start_ms` (unix ms; -1 = the system clock now), so a meter fed
  // by a test clock passes that clock's time here.
  explicit LoadMeter(int workers, int64_t start_ms = -1);

  void Arrive();                  // a request arrived (counts toward arrival_rate, queue_depth)
  void Shed();                    // ...and was refused
  void Started();                 // ...a worker took it (leaves the queue, enters service)
  void Finish(double latency_s, double busy_s);  // ...done: end-to-end latency, worker time spent

  // Optional probes that replace the meter's own estimate (e.g. the engine scheduler's queue).
  void SetQueueDepthProbe(std::function<int64_t()> probe);
  void SetUtilisationProbe(std::function<double()> probe);  // 0..1
  // Reports the arrival rate over the report windows of the last `ms` (at least the current one)
  // instead of the current window alone. A 250 ms window at a few req/s holds 0 to 2 arrivals, and
  // the controller's trend would read that noise as surges. 0 = the current window only.
  void SetRateWindow(int64_t ms);
  // The span of LoadReport::recent_rate, the same way (0 = the current window only).
  void SetRecentWindow(int64_t ms);

  // The report for the window since the last Take (arrival rate, in-flight now, queue depth now,
  // utilisation, p99 of the latencies finished in the window), and starts a new window. `now_ms`
  // is unix ms. service/instance/applied_state are left for the caller.
  LoadReport Take(int64_t now_ms);

 private:
  const int workers_;
  std::mutex mu_;
  int64_t window_start_ms_ = 0;
  int64_t arrivals_ = 0;
  int64_t queued_ = 0;    // arrived, not yet started or shed
  int64_t in_service_ = 0;
  double busy_s_ = 0;
  std::vector<float> latencies_ms_;  // reservoir of the window's latencies (bounded)
  int64_t finished_ = 0;
  uint64_t rng_ = 0x9e3779b97f4a7c15ull;
  std::function<int64_t()> queue_probe_;
  std::function<double()> util_probe_;
  WindowedRate rate_;    // arrival rate over the past Takes' windows (SetRateWindow)
  WindowedRate recent_;  // ... over SetRecentWindow's shorter span
};

struct ServiceLinkOptions {
  Service service = Service::kAnswer;
  std::string instance;            // 1..64 of [A-Za-z0-9_.:-]; "" = "<service>-<pid>"
  int report_interval_ms = 250;    // docs: "every few hundred ms"
  int rate_window_ms = 2000;       // arrival rates are reported over this long (LoadMeter::SetRateWindow)
  int recent_window_ms = kDefaultRecentWindowMs;  // ... and recent_rate over this long (LoadMeter::SetRecentWindow)
  int workers = 1;                 // LoadMeter's worker count
  // The agent's hold/fallback and the poll timings. The link chains its own on_push after any
  // given here; a null client.clock becomes `clock`, so the agent and the link share one clock.
  AgentClientOptions client;
  // If set: gauge keel_hilo_applied_state{service} (the applied state's index), counters
  // keel_hilo_link_reports_total{result="ok"|"error"}. Must outlive the link.
  MetricsRegistry* metrics = nullptr;
  std::function<int64_t()> clock;      // unix ms; null = the system clock
  // Sent in every report (LoadReport::binaries); OpenServiceLink sets this process's
  // ExecutableFingerprint. "" = not sent.
  std::string binaries;
};

class ServiceLink {
 public:
  // With a controller: `call` reaches it (see agent_client.h); the catalog must be the controller's.
  static Result<std::unique_ptr<ServiceLink>> Create(Catalog catalog, ControllerCall call, ServiceLinkOptions options);
  // Asks the controller for its catalog (GET /v1/catalog, before `deadline`), then Create.
  static Result<std::unique_ptr<ServiceLink>> Connect(ControllerCall call, ServiceLinkOptions options,
                                                      Deadline deadline);
  // Without a controller: always `state` (which must be in `catalog`); reports nothing.
  static Result<std::unique_ptr<ServiceLink>> Pinned(Catalog catalog, std::string_view state,
                                                     ServiceLinkOptions options);
  ~ServiceLink();  // Stop()
  ServiceLink(const ServiceLink&) = delete;
  ServiceLink& operator=(const ServiceLink&) = delete;

  // Starts the long-poll and the report threads. A pinned link without controller starts only the
  // report thread, which then reports nothing and only runs OnChange after a Pin(). Internal if
  // already started.
  Status Start();
  // Wakes the report thread at once, then waits for the agent client's poll in flight (at most
  // client.wait_ms + slack_ms; about 1 s with the defaults, at once when the controller stops
  // first). Idempotent. No OnChange runs after it returns.
  void Stop();

  // The state to apply now, never null; valid while the link lives. Cheap (an atomic load):
  // call it per request.
  const State& Current() const;
  int CurrentIndex() const;
  // Pins (a state name) or unpins (""): while pinned, Current() is that state whatever the
  // controller says. InvalidArgument for a name the catalog lacks.
  Status Pin(std::string_view state);

  // Called on the report thread whenever the applied state changes (after the change), e.g. to
  // rebuild something a level fixes. `from` is the state the previous call ended in (the initial
  // state for the first), so changes that come and go within one wake-up are seen as one (or
  // none). No lock of the link is held: the callback may call Current(), Pin(), meter(). It must
  // not call Stop(). Set before Start.
  void OnChange(std::function<void(const State& from, const State& to)> fn);

  LoadMeter& meter() { return meter_; }
  const Catalog& catalog() const { return catalog_; }
  Service service() const { return opt_.service; }
  uint64_t reports_ok() const { return reports_ok_.load(); }
  uint64_t report_errors() const { return report_errors_.load(); }

 private:
  ServiceLink(Catalog catalog, ServiceLinkOptions options);
  void ReportLoop();
  void Refresh();  // recompute the applied index from the agent and the pin
  int64_t Now() const { return opt_.clock(); }

  Catalog catalog_;
  ServiceLinkOptions opt_;
  LoadMeter meter_;
  std::unique_ptr<AgentClient> client_;  // null for a pinned link without controller
  std::atomic<int> applied_{0};
  std::atomic<int> pinned_{-1};
  std::function<void(const State&, const State&)> on_change_;
  std::mutex refresh_mu_;  // serialises Refresh (a stale read must not overwrite a newer one)
  std::mutex mu_;          // guards stopping_, started_, change_pending_
  std::condition_variable cv_;
  bool stopping_ = false;
  bool started_ = false;
  bool change_pending_ = false;  // Refresh changed applied_: the report thread runs OnChange
  int notified_ = 0;             // the index OnChange last ended in; report thread only
  std::thread reporter_;
  std::atomic<uint64_t> reports_ok_{0};
  std::atomic<uint64_t> report_errors_{0};
  Gauge* state_gauge_ = nullptr;
  Counter* reports_ok_counter_ = nullptr;
  Counter* report_errors_counter_ = nullptr;
};

// Where a service's link comes from: what every service's `--hilo URL`, `--hilo-catalog F`,
// `--hilo-state S` and `--hilo-instance N` flags say.
struct LinkSource {
  std::string url;       // the controller (http://host:port); its catalog is fetched
  std::string catalog;   // a catalog file, for a link pinned without controller
  std::string state;     // the state to pin: required with catalog; with url it freezes the state
                         // while load is still reported
  std::string instance;  // the name in load reports ("" = "<service>-<pid>")
  int connect_timeout_ms = 5000;  // fetching the controller's catalog
};

// The link `source` describes, not started; null when it names neither a controller nor a
// catalog (the service runs without HiLO). `options.instance` is taken from the source.
// InvalidArgument, in the flags' words, for a state or instance without either, for both, and for
// a catalog without a state; the errors of ReadCatalogFile, Connect and Pin otherwise.
Result<std::unique_ptr<ServiceLink>> OpenServiceLink(const LinkSource& source, ServiceLinkOptions options);

}  // namespace keel::hilo
