// A discrete-event simulation of the HiLO product under a surge trace, deterministic for a seed.
// Requests arrive as a Poisson process whose rate follows the trace and pass answer -> vector ->
// gateway -> engine (vector is skipped when the answer level turns retrieval off). Each service is
// a multi-server FIFO queue with a bounded queue: full queue -> the request is shed (429); a request
// that reaches the head of a queue after its deadline is failed (the client gave up). Service time
// is exponential with mean capacity_utilisation x servers / capacity, the capacity being the
// catalog's figure for the level the service runs at, so a service at its catalog capacity is
// capacity_utilisation busy. A batching service (batch_slowdown > 0, the engine) instead shares
// its work among the requests in service: each slows as more join the batch, and its servers are
// batch slots. The model and its assumptions are in docs/hilo.md ("Simulation").
//
// Two policies see identical arrivals and identical per-request service-time draws:
//  - kHilo: every report_interval each service sends a LoadReport to a real keel::hilo::Controller
//    (catalog capacities x scale), which decides every decide_interval; a changed state reaches
//    every service push_delay later.
//  - kBaseline: each service degrades on its own (DAGOR-like): when the mean queueing delay of its
//    last report_interval exceeds degrade_queue_ms it steps to its next cheaper level; it steps
//    back up after recover_dwell_s below recover_queue_ms and min_dwell_s after its last change.
//    A service's levels are the catalog's states read for that service alone.
// A request's quality is the catalog quality of the cheapest state index any service it passed
// applied to it; shed, failed and SLO-violating requests score 0. Plain functions; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/hilo/baseline.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/controller.h"
#include "keel/hilo/trace.h"

namespace keel::hilo {

enum class Policy { kHilo, kBaseline };
// "hilo", "baseline".
std::string_view PolicyName(Policy p);

// BaselineOptions (the baseline's thresholds and dwells) live in baseline.h, shared with the live
// per-service policy.

struct SimOptions {
  double baseline_rate = 50;  // req/s at scale 1, the trace's 1x
  double scale = 1;           // multiplies the arrival rate, every capacity and every server count
  std::array<int, kNumServices> servers = {8, 8, 8, 8};  // workers per service at scale 1
  double capacity_utilisation = 0.9;  // busy fraction at the catalog capacity, (0, 1]
  int queue_per_server = 4;           // queue bound = this x servers
  // Requests in the product at once, at scale 1 (x scale): one arriving while this many are
  // between arrival and their end (served, shed downstream or failed) is shed at the entry, as
  // the live answer service sheds beyond its --max-inflight (it holds each request while the
  // vector service and the engine work on it). It also bounds every queue behind the entry.
  // 0 = no bound (each service's own queue bound only).
  int entry_max_in_flight = 0;
  // Per service, how a batching service's requests share it (0 for the others): with n requests
  // in service each progresses at 1 / (1 + batch_slowdown x (n - 1)) of its speed alone, so a
  // request alone takes its own work and the batch's throughput rises with n toward the full batch
  // (servers) -- a continuous-batching engine, whose batched steps cost more per step but less
  // per request. 0 = independent workers (the default); 1 = one worker shared, no gain from
  // batching. The catalog capacity fixes the work: at `servers` in service the service completes
  // capacity / capacity_utilisation requests/s. At scale k the slowdown is divided by k, so a
  // request's time at a given share of the slots is the same at every scale. Each in [0, 1].
  std::array<double, kNumServices> batch_slowdown = {0, 0, 0, 0};
  double slo_ms = 1000;               // end-to-end latency bound
  double timeout_ms = 2000;           // a request still queued after this is failed
  double window_s = 1;                // quality windows, by arrival time
  double report_interval_s = 0.5;
  double rate_window_s = 0;        // reported arrival rates average this long (0: one report window);
                                   // the live services use 2 s (ServiceLinkOptions::rate_window_ms)
  double recent_window_s = kDefaultRecentWindowMs / 1000.0;  // ... and recent rates this long (ServiceLinkOptions::recent_window_ms)
  double decide_interval_s = 0.5;  // decide on every report round
  double push_delay_s = 0.05;      // long-poll push plus apply
  ControllerOptions controller;  // initial_state "" starts the simulation in the full state
  BaselineOptions baseline;
  // kBaseline runs the live per-service rule (ServicePolicy, baseline.h) on each service's modelled
  // LoadReports instead of the sim's own rule on measured queueing delay.
  bool live_baseline = false;
  // As the live engine does (it clamps admitted work to a new state's max_new_tokens): when the
  // engine's level changes to one with fewer max_new_tokens, requests in service there finish in
  // their remaining time x old capacity / new capacity, and score as the new level. Off: a level
  // applies only to requests that start after it.
  bool engine_clamps_admitted = true;
  // The machine's speed over time. Every service shares the VM's cores, and under a flat overload
  // the live product's throughput wanders with seconds-long correlation (by about 10 % with two
  // OpenMP threads per engine, whose spin-waits compete with the other processes; less with one:
  // docs/results.md, "HiLO: the simulation's machine drifts"). The speed is
  // exp(r + x - (sd^2 + run_sd^2) / 2): x a stationary Gauss-Markov process with
  // standard deviation `speed_sd` and correlation time `speed_tau_s`, held constant over
  // `speed_step_s`, and r one normal draw per path with standard deviation `speed_run_sd` (the
  // machine is faster or slower for a whole run: figures measured minutes apart differ by more than
  // a run's own wander). Mean 1, so the catalog capacities stay the mean. It multiplies every
  // service's rate. Both 0 = constant speed.
  double speed_sd = 0;
  double speed_run_sd = 0;
  double speed_tau_s = 10;
  double speed_step_s = 0.5;
  uint64_t speed_seed = 1;  // the speed path's own seed, so arrivals can stay fixed across paths
  uint64_t seed = 1;

  bool speed_drifts() const { return speed_sd > 0 || speed_run_sd > 0; }
};

struct SimWindow {
  double t_s = 0;  // window start
  int64_t arrived = 0;
  double mean_quality = 0;  // over arrived requests; shed/failed/late score 0
  int state = 0;            // cheapest state index applied at the window's end
  std::array<int, kNumServices> levels{};  // each service's level (state index) at the window's end
};

struct SimResult {
  std::string policy;
  std::string trace;
  int64_t arrived = 0;
  int64_t served = 0;  // completed all services, in or out of SLO
  int64_t shed = 0;
  int64_t failed = 0;
  int64_t slo_violations = 0;  // served, but slower than slo_ms
  double full_quality = 0;     // catalog quality of state 0
  double max_drop = 0;         // max over windows of full_quality - mean_quality
  double mean_drop = 0;        // mean over windows with arrivals
  std::vector<double> time_in_state_s;  // per catalog state; for kBaseline the cheapest level applied
  int64_t transitions = 0;     // product state changes (kHilo) or per-service level changes (kBaseline)
  std::vector<SimWindow> windows;
};

// Arrival times (s) of a Poisson process with rate trace.Multiplier(t) x rate over the trace's
// duration, by thinning; deterministic for `seed`.
std::vector<double> PoissonArrivals(const Trace& trace, double rate, uint64_t seed);

// The machine speed factors of SimOptions' drift model, one per speed_step_s over `duration_s`
// (plus one): deterministic for options.speed_seed; all 1 when speed_sd and speed_run_sd are 0.
std::vector<double> SpeedPath(const SimOptions& options, double duration_s);

// Runs `policy` on `trace`. `catalog` must pass ValidateCatalog with every state validated; the
// trace must have points and a positive duration; options must be in range. InvalidArgument
// naming the problem otherwise.
Result<SimResult> Simulate(const Catalog& catalog, const Trace& trace, Policy policy, const SimOptions& options);

}  // namespace keel::hilo
