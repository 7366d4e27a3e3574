// `keel hilo validate`: measures every state's figures through the running product and writes
// them into the catalog, so the controller decides from measurements, not guesses.
//
// The product must be running with every service following the controller (`--hilo URL`), and the
// controller must accept pins (`keel hilo serve --admin-token-file F --allow-unvalidated`: the
// catalog is not validated yet). For each state, in catalog order:
//   1. pin it (POST /v1/pin) and wait until an instance of every service reports it applied
//      (GET /v1/services), so no figure mixes two states;
//   2. quality: replay the evaluation set through `keel answer`, one request at a time at
//      temperature 0, and score it against the full state's replay (keel/answer/replay.h): the
//      first state's own replay is the reference, so it scores 100 x its recall@10;
//   3. capacity: an open-loop ramp of Poisson arrivals (keel/hilo/loadgen.h), step_s per step at
//      start_rate x growth^k, until a step fails the product SLO (p99 over slo_ms, or more than
//      max_error_fraction of answers not 200); then `refine_steps` bisections between the last
//      passing and the first failing rate. A failing step is run once more and fails only if that
//      run fails too (one transient stall must not cut the capacity). The capacity is the highest
//      passing rate. Before each step the product must settle (no service reports work in flight
//      or queued), so a step does not inherit an overloaded step's backlog.
//   4. goodput under overload (overload_factor > 0): one step at overload_factor x the capacity
//      just measured, counting the 200 answers within slo_ms. The controller's expected-quality
//      objective weighs an overloaded state by it instead of assuming it serves its capacity:
//      shedding costs CPU on a shared machine, and the capacity's 1 % error bound leaves some
//      throughput unused (here every state served 101-134 % of its capacity at 1.5x).
//   With rounds > 1, steps 1, 3 and 4 are repeated over all states in that many rounds (quality is
//   deterministic and measured once) and the capacity figure is the rounds' lower median (or the
//   lowest): capacity on a shared machine moves between runs (2-31 % over three rounds here), and
//   the controller must count on neither a lucky nor a stalled run. The goodput recorded is the
//   chosen round's.
// Per-service capacity: every request passes every service once (vector is skipped with retrieval
// off), so each service's demand equals the product's and the product's capacity is recorded for
// every service. A service that is not the bottleneck may sustain more; the ramp cannot see that
// through the product, so its figure is a lower bound. The report names the service that looked
// saturated (highest utilisation reported at the failing step).
//
// Figures must descend (quality) and ascend (capacity) down the list (catalog rules). Measured
// values that break that are adjusted, and each adjustment is reported: a state's quality is
// lowered to the one above it (quality is deterministic at temperature 0: a cheaper state scoring
// higher is an artefact of the evaluation set); a state's capacity is raised to the one above it
// (a cheaper state does no more work per request, so it sustains at least the rate the costlier
// state passed; the ramp's failures, not its passes, are what transient stalls produce).
#pragma once

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "keel/answer/corpus.h"
#include "keel/answer/replay.h"
#include "keel/core/status.h"
#include "keel/hilo/catalog.h"

namespace keel::hilo {

// Whether `f` is an accepted ValidateOptions::overload_factor: 0 (not measured) or in (1, 10].
inline bool OverloadFactorValid(double f) { return f == 0 || (f > 1 && f <= 10); }

// Which round's capacity a state records when there are several.
enum class RoundFigure { kLowerMedian, kLowest };

struct ValidateOptions {
  std::string controller_url;  // http://host:port of `keel hilo serve`
  std::string admin_token;     // its --admin-token-file token (for POST /v1/pin)
  std::string answer_url;      // http://host:port of `keel answer serve`
  std::vector<answer::EvalQuery> eval;  // the evaluation set (answer::LoadEvalSet)
  answer::ReplayOptions replay;         // model and max_tokens of every request
  double slo_ms = 2000;              // product p99 bound during the ramp
  double max_error_fraction = 0.01;  // answers not 200 allowed in a passing step
  double start_rate = 1;             // req/s of the first step
  double growth = 1.5;               // rate multiplier per step, > 1
  double max_rate = 10000;           // stop ramping here (recorded as the capacity if it passes)
  double step_s = 10;                // seconds per step
  int refine_steps = 2;              // bisections after the first failing step
  bool confirm_failures = true;      // a failing step fails only if a second run at its rate fails too
  // Capacity ramps per state, in rounds over all states (so a slow drift of the machine touches
  // every state alike); the figure is the lower median of the rounds (default: one stalled or one
  // lucky round does not move it) or the lowest. Later rounds start at later_round_start x the
  // state's first capacity (never below start_rate).
  int rounds = 1;
  RoundFigure round_figure = RoundFigure::kLowerMedian;
  double later_round_start = 0.5;
  double overload_factor = 1.5;      // step 4 offers this x the capacity; see OverloadFactorValid
  int apply_timeout_ms = 30000;      // wait this long for every service to apply a pinned state
  int settle_timeout_ms = 60000;     // before each step, wait this long at most for no work in flight
  int workers = 256;                 // open-loop generator threads
  uint64_t seed = 1;
  std::function<void(const std::string&)> progress;  // one line per step; null = log
};

struct RampStep {
  int round = 0;         // the round it belongs to
  double rate = 0;       // offered req/s
  int64_t sent = 0;
  int64_t ok = 0;        // 200
  int64_t shed = 0;      // 429/503
  int64_t failed = 0;    // other statuses, no reply, dropped by the generator
  int64_t within_slo = 0;  // 200 answers within slo_ms
  double p99_ms = 0;     // of 200 answers
  bool pass = false;
  bool overload = false; // step 4's, not the ramp's: it never counts as a passing ramp step
  std::array<double, kNumServices> utilisation{};  // highest reported during the step, per service
};

struct StateMeasurement {
  std::string state;
  answer::StateQuality quality;
  double capacity = 0;      // the chosen round's highest passing rate, req/s (0 when even start_rate failed)
  std::vector<double> round_capacities;  // each round's, in order
  std::vector<std::string> round_bottlenecks;
  // Step 4, per round: the offered rate and the goodput (req/s of 200 answers within the SLO);
  // 0 and 0 when not measured. `offered` and `goodput` are the chosen round's.
  std::vector<double> round_offered, round_goodputs;
  double offered = 0, goodput = 0;
  // Each service's own capacity, estimated from the chosen round's highest passing step (see
  // ServiceCapacities); all 0 when not estimated (ApplyFigures then records `capacity` for all).
  std::array<double, kNumServices> service_capacity{};
  std::string bottleneck;   // the service with the highest utilisation at that round's first failing step
  std::vector<RampStep> steps;
};

// Each service's own capacity, estimated from what the product's ramp saw: at the highest passing
// step of round `round` (rate R), a service that reported utilisation u would be `target` busy at
// R x target / u, if its load stayed proportional to the rate. The estimate is bounded below by
// `capacity` (the product passed it, so every service sustains it) and above by max_factor x
// capacity (a service that reported almost no utilisation). It assumes the service's share of the
// machine is not taken by the others, so it is an estimate, not a measurement of the service
// alone. All 0 when the round has no passing step, or when no service reported utilisation of
// at least 0.5 there (far from every limit, e.g. a ramp that reached max_rate, the extrapolation
// is too long to trust).
std::array<double, kNumServices> ServiceCapacities(const StateMeasurement& m, int round, double capacity,
                                                   double target = 0.9, double max_factor = 100);

// The round whose capacity a state records: the lowest, or the lower median (with 2 rounds, the
// lower; with 3, the middle). Ties keep the earlier round. 0 for no rounds.
size_t ChosenRound(const std::vector<double>& capacities, RoundFigure figure);

// Runs steps 1-3 for every state of `catalog` (the controller's catalog: same states and levels)
// and unpins at the end (also on error); a controller that cannot be unpinned (started pinned on
// this unvalidated catalog) is left pinned to the first state. Errors name the state and what failed (a service that
// never applied the state, the controller refusing the pin, the reference replay failing).
Result<std::vector<StateMeasurement>> MeasureStates(const Catalog& catalog, const ValidateOptions& options);

// The catalog with the measured figures (quality, capacity for every service, the goodput under
// overload where measured, validated_at = now_s) and binaries = fingerprint, adjusted as
// described above (a service's estimated capacity, where there is one, replaces the product's
// figure for that service, and is raised down the list like it); `notes` receives one line per
// adjustment. InvalidArgument when measurements do not match the catalog's states, a state has no
// capacity (failed at start_rate), or the result fails ValidateCatalog.
Result<Catalog> ApplyFigures(Catalog catalog, const std::vector<StateMeasurement>& measured,
                             const std::string& fingerprint, int64_t now_s, std::vector<std::string>* notes);

}  // namespace keel::hilo
