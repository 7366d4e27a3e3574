#include "keel/hilo/controller.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace keel::hilo {

namespace {

constexpr size_t kMaxInstancesPerService = 1024;  // bounds memory against a flood of instance names

std::string Fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", x);
  return buf;
}

Status CheckOptions(const ControllerOptions& o) {
  auto bad = [](const char* what) { return Status::InvalidArgument(std::string("controller option ") + what); };
  if (!(o.level_tau_s >= 0 && o.level_tau_s <= 3600)) return bad("level_tau_s: expected 0..3600");
  if (!(o.trend_tau_s >= 0 && o.trend_tau_s <= 3600)) return bad("trend_tau_s: expected 0..3600");
  if (!(o.trend_damping_s >= 0 && o.trend_damping_s <= 3600)) return bad("trend_damping_s: expected 0..3600");
  if (!(o.lookahead_s >= 0 && o.lookahead_s <= 3600)) return bad("lookahead_s: expected 0..3600");
  if (!(o.headroom >= 1 && o.headroom <= 10)) return bad("headroom: expected 1..10");
  if (!(o.recover_margin > 0 && o.recover_margin <= 1)) return bad("recover_margin: expected (0, 1]");
  // Upper bounds: seconds become int64 milliseconds (Ms), and inf or 1e300 there is undefined
  // (on x86 INT64_MIN: every report was stale at once).
  if (!(o.recover_dwell_s >= 0 && o.recover_dwell_s <= 86400)) return bad("recover_dwell_s: expected 0..86400");
  if (!(o.min_dwell_s >= 0 && o.min_dwell_s <= 86400)) return bad("min_dwell_s: expected 0..86400");
  if (!(o.report_timeout_s > 0 && o.report_timeout_s <= 86400)) return bad("report_timeout_s: expected (0, 86400]");
  if (!(o.recent_window_s > 0 && o.recent_window_s <= 60)) return bad("recent_window_s: expected (0, 60]");
  if (!(o.recent_noise_z >= 0 && o.recent_noise_z <= 10)) return bad("recent_noise_z: expected 0..10");
  if (!(o.stale_fallback_s >= o.report_timeout_s && o.stale_fallback_s <= 86400)) {
    return bad("stale_fallback_s: expected report_timeout_s..86400");
  }
  if (o.log_capacity == 0) return bad("log_capacity: expected > 0");
  return Status::Ok();
}

int64_t Ms(double seconds) { return static_cast<int64_t>(seconds * 1000.0); }

}  // namespace

std::string_view ObjectiveName(Objective o) {
  return o == Objective::kExpectedQuality ? "expected-quality" : "cover";
}

double ServedRate(const Figures& f, double capacity, double demand) {
  if (demand <= capacity) return std::max(0.0, demand);
  if (!f.HasGoodput()) return capacity;
  const double scale = capacity / f.Bottleneck();
  const double offered = f.offered * scale;
  const double goodput = f.goodput * scale;
  double served = goodput;
  if (demand < offered) served = capacity + (goodput - capacity) * (demand - capacity) / (offered - capacity);
  return std::clamp(served, 0.0, demand);
}

double QualityCapacity(const State& s) { return s.figures ? s.figures->quality * s.figures->Bottleneck() : 0; }

double QualityGoodput(const State& s) {
  if (!s.figures) return 0;
  return s.figures->quality * (s.figures->HasGoodput() ? s.figures->goodput : s.figures->Bottleneck());
}

bool ExpectedQualityCanPick(const Catalog& c, int state) {
  const int n = static_cast<int>(c.states.size());
  if (state < 0 || state >= n) return false;
  for (const State& s : c.states) {
    if (!s.figures) return false;
  }
  // The expected quality is piecewise smooth in the demand with kinks at each state's capacity
  // and offered rate: try those, just either side of them, and a geometric grid over the range.
  std::vector<double> demands;
  double lo = std::numeric_limits<double>::infinity(), hi = 0;
  for (const State& s : c.states) {
    for (double d : {s.figures->Bottleneck(), s.figures->offered}) {
      if (!(d > 0)) continue;
      lo = std::min(lo, d);
      hi = std::max(hi, d);
      for (double k : {0.999, 1.0, 1.001}) demands.push_back(d * k);
    }
  }
  constexpr int kGrid = 2000;
  for (int k = 0; k <= kGrid; ++k) demands.push_back(0.5 * lo * std::pow(100 * hi / lo, static_cast<double>(k) / kGrid));
  for (double d : demands) {
    auto eq = [&](int i) {
      const Figures& f = *c.states[i].figures;
      return f.quality * ServedRate(f, f.Bottleneck(), d) / d;
    };
    const double mine = eq(state);
    bool picked = true;
    for (int i = 0; i < n && picked; ++i) {
      if (i < state) picked = mine > eq(i);
      else if (i > state) picked = mine >= eq(i);
    }
    if (picked) return true;
  }
  return false;
}

Result<Objective> ParseObjective(std::string_view name) {
  if (name == "cover") return Objective::kCover;
  if (name == "expected-quality") return Objective::kExpectedQuality;
  return Status::InvalidArgument("controller objective '" + std::string(name.substr(0, 64)) +
                                 "': expected cover or expected-quality");
}

Result<Controller> Controller::Create(Catalog catalog, ControllerOptions options, MetricsRegistry* metrics) {
  KEEL_RETURN_IF_ERROR(ValidateCatalog(catalog));
  // A pinned controller never reads capacities, so it may run on a catalog being validated.
  if (options.pin.empty()) {
    for (const State& s : catalog.states) {
      if (!s.figures) return Status::InvalidArgument("state '" + s.name + "' is not validated (no figures)");
    }
  }
  KEEL_RETURN_IF_ERROR(CheckOptions(options));
  if (!options.initial_state.empty() && catalog.IndexOf(options.initial_state) < 0) {
    return Status::InvalidArgument("controller option initial_state: '" + options.initial_state + "' is not a state");
  }
  const std::string pin = options.pin;
  Controller c(std::move(catalog), std::move(options), metrics);
  if (!pin.empty()) KEEL_RETURN_IF_ERROR(c.Pin(pin));
  return c;
}

Controller::Controller(Catalog catalog, ControllerOptions options, MetricsRegistry* metrics)
    : catalog_(std::move(catalog)), opt_(std::move(options)) {
  current_ = opt_.initial_state.empty() ? catalog_.SafeIndex() : catalog_.IndexOf(opt_.initial_state);
  covered_since_.assign(catalog_.states.size(), -1);
  if (metrics) {
    transitions_metric_ = &metrics->AddCounter("keel_hilo_transitions_total",
                                               "Product state changes made by the HiLO controller.", {"from", "to"});
    state_metric_ = &metrics->AddGauge("keel_hilo_state",
                                       "Index of the current product state (0 = full quality).").Get();
    state_metric_->Set(current_);
  }
}

void Controller::Observe(const LoadReport& r) {
  ServiceState& s = services_[static_cast<int>(r.service)];
  auto it = s.instances.find(r.instance);
  if (it == s.instances.end()) {
    if (s.instances.size() >= kMaxInstancesPerService) return;
    it = s.instances.emplace(r.instance, Instance{}).first;
  } else if (r.unix_ms < it->second.unix_ms) {
    return;  // reordered delivery: keep the newer one
  }
  it->second = Instance{r.unix_ms, r.arrival_rate, r.recent_rate, r.recent_span_ms / 1000.0};
  s.last_heard_ms = std::max(s.last_heard_ms, r.unix_ms);
}

double Controller::Demand(Service s, int64_t now_ms) const {
  double sum = 0;
  bool any = false;
  for (const auto& [name, inst] : services_[static_cast<int>(s)].instances) {
    if (now_ms - inst.unix_ms > Ms(opt_.report_timeout_s)) continue;
    sum += inst.arrival_rate;
    any = true;
  }
  return any ? sum : -1;
}

Controller::Recent Controller::RecentDemand(Service s, int64_t now_ms) const {
  Recent sum;
  for (const auto& [name, inst] : services_[static_cast<int>(s)].instances) {
    if (now_ms - inst.unix_ms > Ms(opt_.report_timeout_s)) continue;
    const double span_s = inst.recent_span_s > 0 ? inst.recent_span_s : opt_.recent_window_s;
    sum.rate += inst.recent_rate;
    sum.variance += inst.recent_rate / span_s;  // Poisson: rate x span arrivals, variance the same
  }
  return sum;
}

double Controller::TrendReach(double seconds) const {
  const double tau = opt_.trend_damping_s;
  return tau > 0 ? -tau * std::expm1(-seconds / tau) : seconds;
}

// Holt's method with a damped trend (Gardner and McKenzie's, in continuous time) and irregular
// sampling: the trend is per second, the level's prior is extrapolated over the actual gap since
// the last sample with the trend decaying as exp(-t / trend_damping_s), and each weight is
// 1 - exp(-dt / tau). For dt << tau the trend weight over dt is about dt / tau, so a level step of
// d moves the trend by about d / trend_tau_s whatever the decision interval.
void Controller::UpdatePrediction(ServiceState& s, double demand, const Recent& recent, int64_t now_ms) const {
  if (!s.has_model) {
    s.has_model = true;
    s.level = demand;
    s.trend = 0;
    s.sample_ms = now_ms;
  } else if (now_ms > s.sample_ms) {
    const double dt = (now_ms - s.sample_ms) / 1000.0;
    const double a = opt_.level_tau_s > 0 ? -std::expm1(-dt / opt_.level_tau_s) : 1.0;
    const double b = opt_.trend_tau_s > 0 ? -std::expm1(-dt / opt_.trend_tau_s) : 0.0;
    const double reach = TrendReach(dt);
    const double level = a * demand + (1 - a) * (s.level + s.trend * reach);
    // The prior trend has decayed over the gap.
    const double prior_trend = opt_.trend_damping_s > 0 ? s.trend * std::exp(-dt / opt_.trend_damping_s) : s.trend;
    s.trend = b * (level - s.level) / dt + (1 - b) * prior_trend;
    s.level = level;
    s.sample_ms = now_ms;
  }
  s.predicted = std::max(0.0, s.level + s.trend * TrendReach(opt_.lookahead_s)) * opt_.headroom;
  if (opt_.recent_rate_guard && recent.rate > 0) {
    s.predicted = std::max(s.predicted, recent.rate - opt_.recent_noise_z * std::sqrt(recent.variance));
  }
}

bool Controller::Covers(int state, const std::array<bool, kNumServices>& known, double factor) const {
  const Figures& f = *catalog_.states[state].figures;
  for (Service s : kAllServices) {
    const int i = static_cast<int>(s);
    if (known[i] && services_[i].predicted > factor * f.Capacity(s)) return false;
  }
  return true;
}

// Capacities are product requests per second at which each service saturates (what validate
// measures), so every service is held against the product's demand: the largest prediction, which
// is the entry's. A service's own arrivals are not its demand once the entry sheds: live, at 3x,
// the engine saw only the ~190 req/s the entry admitted, its own prediction fitted shorter24's
// engine, and the controller degraded to shorter24 on a wrong 74.0 > 72.7.
double Controller::Served(int state, const std::array<bool, kNumServices>& known, double factor) const {
  double demand = 0;
  for (Service s : kAllServices) {
    const int i = static_cast<int>(s);
    if (known[i]) demand = std::max(demand, services_[i].predicted);
  }
  if (demand <= 0) return 1.0;
  const Figures& f = *catalog_.states[state].figures;
  double capacity = std::numeric_limits<double>::infinity();
  for (Service s : kAllServices) {
    if (known[static_cast<int>(s)]) capacity = std::min(capacity, factor * f.Capacity(s));
  }
  return ServedRate(f, capacity, demand) / demand;
}

double Controller::ExpectedQuality(int state, const std::array<bool, kNumServices>& known, double factor) const {
  return catalog_.states[state].figures->quality * Served(state, known, factor);
}

int Controller::Target(const std::array<bool, kNumServices>& known, double factor) const {
  const int n = static_cast<int>(catalog_.states.size());
  if (opt_.objective == Objective::kCover) {
    for (int i = 0; i < n; ++i) {
      if (Covers(i, known, factor)) return i;
    }
    return n - 1;
  }
  int best = 0;  // ties go to the better state
  double best_q = ExpectedQuality(0, known, factor);
  for (int i = 1; i < n; ++i) {
    const double q = ExpectedQuality(i, known, factor);
    if (q > best_q) best = i, best_q = q;
  }
  return best;
}

bool Controller::Acceptable(int state, const std::array<bool, kNumServices>& known, double factor) const {
  if (opt_.objective == Objective::kCover) return Covers(state, known, factor);
  const double q = ExpectedQuality(state, known, factor);
  for (int i = state + 1; i < static_cast<int>(catalog_.states.size()); ++i) {
    if (ExpectedQuality(i, known, factor) > q) return false;
  }
  return true;
}

// "vector predicted 540.0 req/s > capacity 500.0 in 'full'" for the first service `state` does
// not cover.
std::string Controller::Constraint(int state, const std::array<bool, kNumServices>& known) const {
  const Figures& f = *catalog_.states[state].figures;
  for (Service s : kAllServices) {
    const int i = static_cast<int>(s);
    if (known[i] && services_[i].predicted > f.Capacity(s)) {
      return std::string(ServiceName(s)) + " predicted " + Fmt(services_[i].predicted) + " req/s > capacity " +
             Fmt(f.Capacity(s)) + " in '" + catalog_.states[state].name + "'";
    }
  }
  return "";
}

Decision Controller::Move(int to, int64_t now_ms, std::string reason) {
  const std::string& from = catalog_.states[current_].name;
  const std::string& name = catalog_.states[to].name;
  if (log_.size() == opt_.log_capacity) log_.pop_front();
  log_.push_back(Transition{now_ms, from, name, reason});
  ++transitions_;
  if (transitions_metric_) transitions_metric_->WithLabels({from, name}).Inc();
  if (state_metric_) state_metric_->Set(to);
  current_ = to;
  last_change_ms_ = now_ms;
  return Decision{to, name, true, std::move(reason)};
}

Decision Controller::Stay(std::string reason) const {
  return Decision{current_, catalog_.states[current_].name, false, std::move(reason)};
}

Status Controller::Pin(std::string_view state) {
  if (state.empty()) {
    for (const State& s : catalog_.states) {
      if (!s.figures) {
        return Status::InvalidArgument("cannot unpin: state '" + s.name +
                                       "' is not validated, and the controller decides from figures");
      }
    }
    pinned_ = -1;
    return Status::Ok();
  }
  const int i = catalog_.IndexOf(state);
  if (i < 0) return Status::InvalidArgument("pin: no state named '" + std::string(state.substr(0, 64)) + "' in the catalog");
  pinned_ = i;
  return Status::Ok();
}

Decision Controller::Decide(int64_t now_ms) {
  if (start_ms_ < 0) {
    start_ms_ = now_ms;
    last_change_ms_ = now_ms;
  }
  // Demand and predictions; find the service silent longest.
  std::array<bool, kNumServices> known{};
  int silent = -1;
  int64_t silent_ms = -1;
  for (Service s : kAllServices) {
    const int i = static_cast<int>(s);
    ServiceState& st = services_[i];
    std::erase_if(st.instances, [&](const auto& kv) { return now_ms - kv.second.unix_ms > Ms(opt_.report_timeout_s); });
    const double demand = Demand(s, now_ms);
    known[i] = demand >= 0;
    if (known[i]) {
      UpdatePrediction(st, demand, RecentDemand(s, now_ms), now_ms);
    } else {
      const int64_t gap = now_ms - std::max(st.last_heard_ms, start_ms_);
      if (gap > silent_ms) silent = i, silent_ms = gap;
    }
  }
  const bool all_known = silent < 0;
  const int n = static_cast<int>(catalog_.states.size());
  if (pinned_ >= 0) {
    // Coverage is not tracked while pinned: recovery after an unpin waits a full recover_dwell_s.
    std::fill(covered_since_.begin(), covered_since_.end(), -1);
    if (current_ != pinned_) return Move(pinned_, now_ms, "pinned by operator");
    return Stay("pinned by operator");
  }

  const int target = Target(known, 1.0);
  const bool overloaded = !Covers(target, known, 1.0);
  for (int i = 0; i < n; ++i) {
    // predicted / headroom <= margin x capacity: the margin does not stack on the headroom.
    const bool with_margin = all_known && Acceptable(i, known, std::min(1.0, opt_.recover_margin * opt_.headroom));
    if (!with_margin) covered_since_[i] = -1;
    else if (covered_since_[i] < 0) covered_since_[i] = now_ms;
  }

  std::string silence;
  if (!all_known) {
    silence = "service " + std::string(ServiceName(static_cast<Service>(silent))) + " silent for " +
              Fmt(silent_ms / 1000.0) + " s";
  }
  const int safe = catalog_.SafeIndex();
  if (!all_known && silent_ms >= Ms(opt_.stale_fallback_s) && current_ < std::max(safe, target)) {
    return Move(std::max(safe, target), now_ms, silence + ": safe state");
  }
  if (target > current_) {
    const std::string why = Constraint(current_, known);
    if (opt_.objective == Objective::kExpectedQuality) {
      return Move(target, now_ms, "degrade: " + why + "; expected quality " + Fmt(ExpectedQuality(target, known, 1.0)) +
                                      " in '" + catalog_.states[target].name + "' > " +
                                      Fmt(ExpectedQuality(current_, known, 1.0)) + " here");
    }
    return Move(target, now_ms, (overloaded ? "overloaded, no state covers demand: " : "degrade: ") + why);
  }
  if (!all_known) return Stay("holding: " + silence);

  for (int i = 0; i < current_; ++i) {
    if (covered_since_[i] < 0 || now_ms - covered_since_[i] < Ms(opt_.recover_dwell_s)) continue;
    if (now_ms - last_change_ms_ < Ms(opt_.min_dwell_s)) return Stay("recovery waits for min_dwell_s");
    const char* what = opt_.objective == Objective::kCover ? "' covered demand with margin for "
                                                           : "' served the most expected quality with margin for ";
    return Move(i, now_ms, "recover: '" + catalog_.states[i].name + what +
                               Fmt((now_ms - covered_since_[i]) / 1000.0) + " s");
  }
  if (overloaded && target == current_ && opt_.objective == Objective::kExpectedQuality) {
    return Stay("shedding: " + Constraint(current_, known) + "; serves " +
                Fmt(100 * Served(current_, known, 1.0)) + " % of it, expected quality " +
                Fmt(ExpectedQuality(current_, known, 1.0)) + ", the most of any state");
  }
  return Stay(overloaded ? "overloaded: " + Constraint(current_, known) : "current state covers demand");
}

}  // namespace keel::hilo
