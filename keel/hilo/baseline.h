// The per-service baseline HiLO is evaluated against (issue 23): every service degrades on its own
// load, DAGOR-like, with no view of the product. ServicePolicy is that rule for ONE service: it
// reads only that service's own load reports and picks a level index, 0 = the catalog's first
// (full) state ... n-1 = its cheapest. The service then applies only its own level of the state at
// that index (as it does under HiLO), so "level i" of a service is its part of catalog state i.
// The simulation's baseline (sim.h, Policy::kBaseline) runs the same rule on its modelled queues;
// the live product runs it in ControllerServer's per_service policy (server.h), which hosts one
// ServicePolicy per service only for convenience: each service's level depends on its own reports
// alone. Pure: no I/O, time is passed in (unix ms). Not thread-safe: the owner serialises calls.
//
// Overload signal. DAGOR's signal is the queueing delay a request saw, which the sim measures but
// a LoadReport does not carry. A report is *overloaded* when any of:
//  - its queueing-delay estimate (Little's law: queue_depth / arrival_rate, in ms; a queue with no
//    arrivals in the window counts as unbounded) is over degrade_queue_ms (DAGOR's 20 ms). The
//    queue_depth is a sample at report time, the rate a window mean: an estimate, not DAGOR's
//    measured delay; it scales with the service's rate, so a fast service with a few requests
//    waiting is not overloaded while a slow one (the engine) with one waiting is;
//  - utilisation_threshold > 0 and its utilisation is at or above it (0.9): the workers are
//    saturated. 0 turns it off, leaving DAGOR's queueing signal alone: a batching engine's slots
//    can be nearly all taken at a load it carries easily;
//  - p99_bound_ms > 0 and its p99_ms is over it (a per-service latency bound; off by default,
//    since only the operator knows each service's share of the product SLO).
// A report is *calm* when it is not overloaded and its queueing-delay estimate is below
// recover_queue_ms; between the two it is neither (the sim's hysteresis band).
//
// Rules, per report (of any instance of the service, in arrival order):
//  - overloaded: one level cheaper, unless at the cheapest, or a change happened less than
//    degrade_gap_s ago (one step per report window, as in the sim, whose reports come every
//    0.5 s; live instances report every 250 ms each, and a step must be applied before the next
//    is judged). Ends any calm stretch.
//  - not calm: ends any calm stretch.
//  - calm: one level back toward 0 once the service has been calm for recover_dwell_s (10)
//    continuously and min_dwell_s (5) have passed since its last change; a recovery starts a new
//    calm stretch, so each further step needs another full dwell.
// A service that stops reporting keeps its level (nothing happens without a report).
#pragma once

#include <cstdint>
#include <string>

#include "keel/core/status.h"
#include "keel/hilo/report.h"

namespace keel::hilo {

// The baseline's thresholds and dwell times, shared by the simulation (SimOptions::baseline) and
// the live ServicePolicy.
struct BaselineOptions {
  double degrade_queue_ms = 20;  // DAGOR's default queueing-delay threshold
  double recover_queue_ms = 5;
  double recover_dwell_s = 10;
  double min_dwell_s = 5;
};

// InvalidArgument unless 0 <= recover_queue_ms <= degrade_queue_ms and both dwells are >= 0, all
// finite. The live rule (ServicePolicy::Create) and the simulation's own rule both check this.
Status CheckBaselineOptions(const BaselineOptions& b);

struct ServicePolicyOptions {
  BaselineOptions baseline;            // queueing-delay thresholds (estimated, see above) and dwells
  double utilisation_threshold = 0.9;  // overloaded at or above; [0, 1], 0 = not used
  double p99_bound_ms = 0;             // overloaded above; 0 = not used
  double degrade_gap_s = 0.5;          // at most one step per this (the sim's report interval)
  int initial_level = 0;               // 0 = full: the sim's baseline starts there too
};

// What one report did to the level.
struct ServiceStep {
  bool changed = false;
  int from = 0;
  int to = 0;
  std::string reason;  // why it changed ("" when it did not)
};

class ServicePolicy {
 public:
  // `num_levels` >= 1 (the catalog's state count). InvalidArgument naming the option otherwise:
  // thresholds finite and >= 0 with recover_queue_ms <= degrade_queue_ms, utilisation_threshold in
  // [0, 1], dwells and the gap finite and >= 0, initial_level in [0, num_levels).
  static Result<ServicePolicy> Create(int num_levels, ServicePolicyOptions options);

  // Applies one report of this service, received at now_ms (the receiver's clock: the report's
  // own unix_ms is not trusted for time). The caller routes only this service's reports here.
  ServiceStep Observe(const LoadReport& r, int64_t now_ms);

  int level() const { return level_; }
  int num_levels() const { return num_levels_; }
  const ServicePolicyOptions& options() const { return opt_; }

  // The queueing-delay estimate of `r` in ms (Little's law; +inf for a queue with no arrivals,
  // 0 with no queue), and the two verdicts the rules use. Exposed for tests and logs.
  static double QueueDelayMs(const LoadReport& r);
  bool Overloaded(const LoadReport& r, std::string* why = nullptr) const;
  bool Calm(const LoadReport& r) const;

 private:
  ServicePolicy(int num_levels, ServicePolicyOptions options)
      : num_levels_(num_levels), opt_(options), level_(options.initial_level) {}

  int num_levels_ = 1;
  ServicePolicyOptions opt_;
  int level_ = 0;
  bool changed_once_ = false;
  int64_t last_change_ms_ = 0;
  int64_t calm_since_ms_ = -1;  // -1 = not calm now
};

}  // namespace keel::hilo
