// Controller: picks the one product state every service runs in, from the services' load reports.
// Pure: time is passed in (unix ms), never read from a clock, so a trace replays identically.
// Not thread-safe: the controller server calls it from one strand.
//
// Rules (docs/hilo.md):
//  - A service's demand is the sum of the arrival rates of its instances whose latest report is
//    at most report_timeout_s old (older instances are dropped). Each Decide feeds that demand to
//    Holt's smoothing (level + damped trend) and predicts lookahead_s ahead, times headroom. The
//    smoothing is set by time constants, not per-sample weights, so the prediction does not
//    depend on how often Decide runs: a per-sample trend weight divides each sample's noise by the
//    sampling interval, and at 4 decisions a second that read Poisson noise as surges. The trend
//    decays with trend_damping_s, because a step's trend outlives the step: undamped, a 1.8x step
//    was predicted at 2.0x and sent the product one state too deep.
//  - Onset guard (recent_rate_guard): a service's prediction is at least a lower confidence bound
//    on the sum of its fresh instances' recent rates (LoadReport::recent_rate, over the span each
//    report gives in recent_span_ms, or recent_window_s for a report without one), without
//    smoothing or headroom. The smoothed level lags a fast onset by a second or more (2 s report
//    window, then level_tau_s), and a product that is already overloaded sheds meanwhile. The
//    bound is Poisson's: an instance's rate r over a span w counts r w arrivals, with variance
//    r / w in the rate, so the sum R is bounded by R - z sqrt(sum r_i / w_i) (z = recent_noise_z;
//    for one span that is (n - z sqrt(n)) / w with n arrivals). A 500 ms window at 100 req/s
//    holds 50 +- 7 arrivals, and a plateau near a state's capacity must not be sent a state
//    deeper by that noise.
//  - Target (objective kCover, the default): the highest-quality state whose capacity covers every
//    service's prediction; none covers -> the lowest state ("overloaded"). Objective
//    kExpectedQuality: the state with the highest quality x the fraction of the predicted demand it
//    can serve (the rest is shed, and a shed request scores 0; what an overloaded state serves is
//    its validated goodput where the catalog has one, see ServedRate): a deeper state is entered
//    only when it serves more quality per arriving request than shedding in a better one.
//  - Degrade at once (min_dwell_s does not apply). Recover only to a state that has covered every
//    prediction with margin continuously for recover_dwell_s, and no sooner than min_dwell_s after
//    the last change. The margin applies to the prediction before headroom (prediction / headroom
//    <= recover_margin x capacity), so the two do not stack: with 1.1 and 0.8 the product degrades
//    above 0.91 x capacity and recovers below 0.8 x, not below 0.73 x.
//  - A service with no fresh instance is unknown: the controller does not recover (known services
//    may still force a degrade); once it has been silent for stale_fallback_s the controller goes
//    to the catalog's safe state, unless already at or below it. A service never heard from counts
//    as silent since the first Decide.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/metrics.h"
#include "keel/core/status.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/report.h"

namespace keel::hilo {

// What the controller's target maximises (docs/hilo.md, "Controller rules").
enum class Objective {
  kCover,            // the highest-quality state that covers every prediction, else the lowest
  kExpectedQuality,  // max over states of quality x ServedRate(product demand) / demand, worst service
};
std::string_view ObjectiveName(Objective o);  // "cover", "expected-quality"
// InvalidArgument naming the accepted values for anything else.
Result<Objective> ParseObjective(std::string_view name);

// The req/s a state serves at `demand` when its bottleneck capacity is `capacity` (the figures'
// own, or scaled by the recovery margin, which scales the overload figures alike): all of it up
// to the capacity; above, linearly to the goodput validate measured at its offered rate, and that
// goodput beyond it (never more than the demand). Without a goodput figure, the capacity.
double ServedRate(const Figures& f, double capacity, double demand);

// Whether the kExpectedQuality objective can pick `state` of a validated catalog at some steady
// demand (every service seeing the product's demand): it must serve strictly more quality per
// arriving request there than every better state, and no less than every worse one. Checked on
// every state's capacity and offered rate and a fine grid around them. Without goodput figures
// that needs a quality x bottleneck capacity above every better state's: at any demand, a
// better state with a larger product serves more quality per arriving request by shedding.
// `keel hilo check` prints it per state.
bool ExpectedQualityCanPick(const Catalog& c, int state);
// quality x bottleneck capacity of a validated state (0 without figures).
double QualityCapacity(const State& s);
// quality x what it serves far into overload: its goodput where measured, else its capacity.
double QualityGoodput(const State& s);

struct ControllerOptions {
  Objective objective = Objective::kCover;
  double level_tau_s = 1.0;      // Holt level time constant, seconds (0 = the latest demand, no smoothing)
  double trend_tau_s = 4.0;      // Holt trend time constant, seconds (0 = no trend)
  double trend_damping_s = 2.0;  // the trend decays as exp(-t / this), seconds (0 = undamped)
  double lookahead_s = 2.0;      // predict this far ahead: about one decision + push + apply
  double headroom = 1.1;         // predicted demand x this must fit the capacity, >= 1
  double recover_margin = 0.8;   // recover only to a state with prediction / headroom <= margin x capacity, (0, 1]
  double recover_dwell_s = 10;   // ... held continuously this long
  double min_dwell_s = 5;        // no change more often than this, except to degrade
  double report_timeout_s = 2;   // an instance's report is fresh this long
  double stale_fallback_s = 10;  // a silent service sends the product to the safe state after this
  bool recent_rate_guard = true; // predictions are at least the reported recent rates (see above)
  double recent_window_s = kDefaultRecentWindowMs / 1000.0;  // the span of a recent_rate reported without one
  double recent_noise_z = 2;     // the guard's lower bound: this many Poisson standard deviations below
  size_t log_capacity = 1024;    // transitions kept in Log()
  std::string initial_state;     // "" = the catalog's safe state (load unknown at start)
  // Start pinned to this state (see Pin). A controller started pinned may run on a catalog whose
  // states have no figures yet (what `keel hilo validate` measures); it cannot be unpinned until
  // every state has them.
  std::string pin;
};

struct Decision {
  int index = 0;
  std::string state;
  bool changed = false;
  std::string reason;  // why this state: the constraining service and figures, or who went silent
};

struct Transition {
  int64_t at_ms = 0;
  std::string from;
  std::string to;
  std::string reason;
};

class Controller {
 public:
  // `catalog` must pass ValidateCatalog and have figures for every state (the caller also checks
  // CheckUsable against the running binaries); options must be in range. `metrics` may be null;
  // otherwise it must outlive the controller, which registers keel_hilo_transitions_total{from,to}
  // and keel_hilo_state (the current index) there. InvalidArgument naming the problem otherwise.
  static Result<Controller> Create(Catalog catalog, ControllerOptions options, MetricsRegistry* metrics);

  // Records `r` as its instance's latest report (an older report than the one held is ignored).
  void Observe(const LoadReport& r);
  // Updates the predictions with the demand at now_ms and picks the state; see the rules above.
  Decision Decide(int64_t now_ms);
  // Pins the product to `state` (an operator's freeze, or `keel hilo validate` measuring one
  // state): until unpinned, Decide moves to it at its next call and stays there whatever the
  // load (predictions still update). "" unpins: the normal rules resume from the pinned state
  // (degrade at once; recover after recover_dwell_s). InvalidArgument for an unknown name, or for
  // unpinning while a state has no figures.
  Status Pin(std::string_view state);
  // The pinned state's name, or "" when not pinned.
  std::string pinned() const { return pinned_ < 0 ? std::string() : catalog_.states[pinned_].name; }

  int current() const { return current_; }
  const Catalog& catalog() const { return catalog_; }
  // Sum of fresh instances' arrival rates at now_ms; -1 when the service has no fresh instance.
  double Demand(Service s, int64_t now_ms) const;
  // The sum of their recent rates (0 when none is fresh or none reports one), and that sum's
  // variance by Poisson counting (sum of rate / span).
  struct Recent {
    double rate = 0;
    double variance = 0;
  };
  Recent RecentDemand(Service s, int64_t now_ms) const;
  // The last prediction (x headroom) for `s`; 0 before its first fresh report.
  double Predicted(Service s) const { return services_[static_cast<int>(s)].predicted; }
  // The most recent transitions, oldest first, at most log_capacity of them.
  const std::deque<Transition>& Log() const { return log_; }
  uint64_t transitions() const { return transitions_; }

 private:
  struct Instance {
    int64_t unix_ms = 0;
    double arrival_rate = 0;
    double recent_rate = 0;
    double recent_span_s = 0;  // as reported; 0 = not reported
  };
  struct ServiceState {
    std::map<std::string, Instance> instances;
    int64_t last_heard_ms = -1;  // newest report of any instance
    bool has_model = false;      // Holt's level/trend initialised
    double level = 0;
    double trend = 0;            // per second
    int64_t sample_ms = 0;
    double predicted = 0;
  };

  Controller(Catalog catalog, ControllerOptions options, MetricsRegistry* metrics);
  void UpdatePrediction(ServiceState& s, double demand, const Recent& recent, int64_t now_ms) const;
  // Whether every known service's prediction (with headroom) is <= factor x its capacity in `state`.
  bool Covers(int state, const std::array<bool, kNumServices>& known, double factor) const;
  // The fraction of the product's demand (the largest prediction: the entry's) `state` can serve
  // at factor x its capacities (the worst known service's), and that fraction times the state's
  // quality.
  double Served(int state, const std::array<bool, kNumServices>& known, double factor) const;
  double ExpectedQuality(int state, const std::array<bool, kNumServices>& known, double factor) const;
  // The objective's target at factor x the capacities.
  int Target(const std::array<bool, kNumServices>& known, double factor) const;
  // Whether `state` may be recovered to at factor x the capacities: kCover, it covers every
  // prediction; kExpectedQuality, no deeper state has a higher expected quality.
  bool Acceptable(int state, const std::array<bool, kNumServices>& known, double factor) const;
  // How far the damped trend carries over `seconds`: seconds undamped, else tau (1 - e^-s/tau).
  double TrendReach(double seconds) const;
  std::string Constraint(int state, const std::array<bool, kNumServices>& known) const;
  Decision Move(int to, int64_t now_ms, std::string reason);
  Decision Stay(std::string reason) const;

  Catalog catalog_;
  ControllerOptions opt_;
  int current_ = 0;
  int64_t start_ms_ = -1;
  int64_t last_change_ms_ = -1;
  std::array<ServiceState, kNumServices> services_;
  std::vector<int64_t> covered_since_;  // per state: since when it covered with margin, -1 = not now
  std::deque<Transition> log_;
  uint64_t transitions_ = 0;
  int pinned_ = -1;  // index of the pinned state, -1 = not pinned
  CounterFamily* transitions_metric_ = nullptr;
  Gauge* state_metric_ = nullptr;
};

}  // namespace keel::hilo
