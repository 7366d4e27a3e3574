#include "keel/hilo/validate/validate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "keel/core/http_client.h"
#include "keel/core/json_reader.h"
#include "keel/core/json_writer.h"
#include "keel/core/log.h"
#include "keel/hilo/loadgen.h"

namespace keel::hilo {
namespace {

constexpr int kCallTimeoutMs = 10000;
constexpr int64_t kFreshMs = 2000;  // an instance whose report is older is not counted

struct Clients {
  std::unique_ptr<HttpClient> controller;
  std::unique_ptr<HttpClient> answer;
  std::string bearer;
};

Result<Clients> Connect(const ValidateOptions& o) {
  KEEL_ASSIGN_OR_RETURN(HttpEndpoint c, ParseHttpUrl(o.controller_url));
  KEEL_ASSIGN_OR_RETURN(HttpEndpoint a, ParseHttpUrl(o.answer_url));
  Clients out;
  out.controller = std::make_unique<HttpClient>(c);
  HttpClientOptions ao;
  ao.max_idle_connections = std::max(16, o.workers);
  out.answer = std::make_unique<HttpClient>(a, ao);
  out.bearer = "Bearer " + o.admin_token;
  return out;
}

Result<nlohmann::json> GetJson(HttpClient& c, std::string_view target) {
  KEEL_ASSIGN_OR_RETURN(HttpReply r, c.Call("GET", target, "", "", DeadlineIn(kCallTimeoutMs)));
  if (r.status != 200) return Status::Unavailable(fmt::format("{} {}: HTTP {}", c.Address(), target, r.status));
  JsonLimits limits;
  limits.require_object = true;
  limits.max_values = 1 << 20;
  return ParseUntrustedJson(r.body, limits);
}

Status Pin(Clients& cl, const std::string& state) {
  std::string body = "{\"state\":";
  AppendJsonString(state, &body);
  body += "}";
  KEEL_ASSIGN_OR_RETURN(HttpReply r, cl.controller->Call("POST", "/v1/pin", body, "application/json",
                                                         DeadlineIn(kCallTimeoutMs), {{"Authorization", cl.bearer}}));
  if (r.status != 200) {
    return Status::InvalidArgument(fmt::format("controller refused to pin '{}': HTTP {}: {}", state, r.status,
                                               r.body.substr(0, 300)));
  }
  return Status::Ok();
}

// Per service: the fresh instances and the states they report.
struct ServiceView {
  int64_t busy = 0;  // in_flight + queue_depth over the fresh instances
  int fresh = 0;
  int applied = 0;  // fresh instances reporting the wanted state
  std::vector<std::string> states;
  double max_utilisation = 0;
};

Result<std::array<ServiceView, kNumServices>> ReadServices(Clients& cl, const std::string& wanted) {
  KEEL_ASSIGN_OR_RETURN(nlohmann::json j, GetJson(*cl.controller, "/v1/services"));
  std::array<ServiceView, kNumServices> out;
  const auto list = j.find("services");
  if (list == j.end() || !list->is_array()) return Status::InvalidArgument("controller /v1/services: no services array");
  for (const auto& e : *list) {
    if (!e.is_object()) continue;
    auto s = ServiceFromName(e.value("service", std::string()));
    if (!s || e.value("age_ms", int64_t{1} << 40) > kFreshMs) continue;
    ServiceView& v = out[static_cast<int>(*s)];
    ++v.fresh;
    const std::string applied = e.value("applied_state", std::string());
    if (applied == wanted) ++v.applied;
    v.states.push_back(e.value("instance", std::string()) + "=" + (applied.empty() ? "(none)" : applied));
    v.max_utilisation = std::max(v.max_utilisation, e.value("utilisation", 0.0));
    v.busy += e.value("in_flight", int64_t{0}) + e.value("queue_depth", int64_t{0});
  }
  return out;
}

// Waits until every service has a fresh instance and all of them report `state`.
Status WaitApplied(Clients& cl, const std::string& state, int timeout_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string missing;
  while (true) {
    auto views = ReadServices(cl, state);
    if (!views.ok()) return views.status();
    missing.clear();
    for (Service s : kAllServices) {
      const ServiceView& v = (*views)[static_cast<int>(s)];
      if (v.fresh == 0) {
        missing += fmt::format("{}: no fresh report; ", ServiceName(s));
      } else if (v.applied != v.fresh) {
        missing += fmt::format("{}: {}; ", ServiceName(s), fmt::join(v.states, ", "));
      }
    }
    if (missing.empty()) return Status::Ok();
    if (std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return Status::Unavailable(fmt::format("state '{}' not applied by every service within {} ms ({}); are all four "
                                         "services running with --hilo pointing at this controller?",
                                         state, timeout_ms, missing));
}

// Waits until no service reports work in flight or queued (two report rounds in a row), so a step
// does not inherit the backlog of an overloaded one before it: requests whose clients gave up may
// still run downstream. Gives up after settle_timeout_ms and says so (the step then runs anyway).
void Settle(Clients& cl, const ValidateOptions& o, const std::string& state) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(o.settle_timeout_ms);
  int quiet = 0;
  while (std::chrono::steady_clock::now() < until) {
    auto views = ReadServices(cl, state);
    int64_t busy = 0;
    if (views.ok()) {
      for (const ServiceView& v : *views) busy += v.busy;
    }
    quiet = views.ok() && busy == 0 ? quiet + 1 : 0;
    if (quiet >= 2) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  Log().warn("validate: [{}] the product still reports work in flight after {} ms; measuring anyway", state,
             o.settle_timeout_ms);
}

RampStep RunStep(Clients& cl, const ValidateOptions& o, double rate, const std::string& state) {
  Settle(cl, o, state);
  RampStep step;
  step.rate = rate;
  Trace flat;
  flat.name = "ramp";
  flat.duration_s = o.step_s;
  flat.points = {{0, 1}, {o.step_s, 1}};
  OpenLoopOptions lo;
  lo.baseline_rate = rate;
  lo.seed = o.seed + static_cast<uint64_t>(rate * 1000);
  lo.workers = o.workers;
  lo.tick_s = 1;
  std::mutex mu;
  lo.on_tick = [&](double) {
    auto views = ReadServices(cl, state);
    if (!views.ok()) return;
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < kNumServices; ++i) step.utilisation[i] = std::max(step.utilisation[i], (*views)[i].max_utilisation);
  };
  const size_t n = o.eval.size();
  auto outcomes = RunOpenLoop(flat, lo, [&](int64_t seq, Outcome& out) {
    answer::ReplayOptions ro = o.replay;
    ro.timeout_ms = static_cast<int>(std::min<double>(ro.timeout_ms, o.slo_ms * 4));
    const answer::ReplayedAnswer a = answer::AskOne(*cl.answer, o.eval[static_cast<size_t>(seq) % n], ro);
    out.status = a.status;
    out.state = a.state;
  });
  if (!outcomes.ok()) return step;
  std::vector<double> lat;
  for (const Outcome& out : *outcomes) {
    ++step.sent;
    if (out.status == 200) {
      ++step.ok;
      step.within_slo += out.latency_ms <= o.slo_ms;
      lat.push_back(out.latency_ms);
    } else if (out.status == 429 || out.status == 503) {
      ++step.shed;
    } else {
      ++step.failed;
    }
  }
  if (!lat.empty()) {
    const size_t i = std::min(lat.size() - 1, static_cast<size_t>(std::ceil(0.99 * static_cast<double>(lat.size()))) - 1);
    std::nth_element(lat.begin(), lat.begin() + static_cast<std::ptrdiff_t>(i), lat.end());
    step.p99_ms = lat[i];
  }
  const double errors = static_cast<double>(step.sent - step.ok);
  // A step that drew no arrival (a short step at a low rate) shows nothing wrong: it passes.
  step.pass = step.p99_ms <= o.slo_ms && errors <= o.max_error_fraction * static_cast<double>(step.sent);
  return step;
}

std::string Describe(const RampStep& s) {
  return fmt::format("{:.3g} req/s: {} sent, {} ok, {} shed, {} failed, p99 {:.0f} ms, utilisation answer {:.2f} "
                     "vector {:.2f} engine {:.2f} gateway {:.2f} -> {}",
                     s.rate, s.sent, s.ok, s.shed, s.failed, s.p99_ms, s.utilisation[0], s.utilisation[1],
                     s.utilisation[2], s.utilisation[3],
                     s.overload ? fmt::format("{} within the SLO", s.within_slo) : s.pass ? "pass" : "FAIL");
}

Status CheckOptions(const ValidateOptions& o) {
  if (o.eval.empty()) return Status::InvalidArgument("validate: empty evaluation set");
  if (!(o.slo_ms > 0)) return Status::InvalidArgument("validate: slo_ms must be > 0");
  if (!(o.max_error_fraction >= 0 && o.max_error_fraction < 1)) return Status::InvalidArgument("validate: max_error_fraction must be in [0, 1)");
  if (!(o.start_rate > 0) || !(o.max_rate >= o.start_rate)) return Status::InvalidArgument("validate: need 0 < start_rate <= max_rate");
  if (!(o.growth > 1) || o.growth > 10) return Status::InvalidArgument("validate: growth must be in (1, 10]");
  if (!(o.step_s >= 1) || o.step_s > 3600) return Status::InvalidArgument("validate: step_s must be in [1, 3600]");
  if (o.refine_steps < 0 || o.refine_steps > 10) return Status::InvalidArgument("validate: refine_steps must be 0..10");
  if (o.rounds < 1 || o.rounds > 20) return Status::InvalidArgument("validate: rounds must be 1..20");
  if (o.round_figure != RoundFigure::kLowest && o.round_figure != RoundFigure::kLowerMedian) {
    return Status::InvalidArgument("validate: round_figure must be lowest or median");
  }
  if (!(o.later_round_start > 0 && o.later_round_start <= 1)) {
    return Status::InvalidArgument("validate: later_round_start must be in (0, 1]");
  }
  if (!OverloadFactorValid(o.overload_factor)) {
    return Status::InvalidArgument("validate: overload_factor must be 0 (not measured) or in (1, 10]");
  }
  if (o.admin_token.empty()) return Status::InvalidArgument("validate: the controller's admin token is needed to pin states");
  return Status::Ok();
}

void Say(const ValidateOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
  else Log().info("{}", line);
}

// Pins `state` and waits until every service applied it.
Status PinAndWait(Clients& cl, const ValidateOptions& o, const std::string& state, const std::string& label) {
  KEEL_RETURN_IF_ERROR(Pin(cl, state));
  KEEL_RETURN_IF_ERROR(WaitApplied(cl, state, o.apply_timeout_ms));
  Say(o, fmt::format("[{}] pinned and applied by every service", label));
  return Status::Ok();
}

// Step 2: the evaluation set through the pinned state, scored against the reference (the first
// state's replay, which this call records when `reference` is empty).
Status MeasureQuality(Clients& cl, const ValidateOptions& o, const State& state,
                      std::vector<answer::ReplayedAnswer>* reference, StateMeasurement* m) {
  Say(o, fmt::format("[{}] replaying {} evaluation queries", state.name, o.eval.size()));
  std::vector<answer::ReplayedAnswer> answers = answer::Replay(*cl.answer, o.eval, o.replay);
  for (const answer::ReplayedAnswer& a : answers) {
    if (a.status == 200 && a.state != state.name) {
      return Status::Unavailable(fmt::format("[{}] an answer ran in state '{}': the product left the pinned state",
                                             state.name, a.state));
    }
  }
  if (reference->empty()) {
    int64_t served = 0;
    for (const answer::ReplayedAnswer& a : answers) served += a.status == 200;
    if (served == 0) {
      return Status::Unavailable(fmt::format("[{}] the reference replay failed: no query answered 200 (first error: {})",
                                             state.name, answers.empty() ? "" : answers[0].error));
    }
    *reference = answers;
  }
  m->quality = answer::Score(o.eval, *reference, answers);
  Say(o, fmt::format("[{}] quality {:.2f} (recall@10 {:.3f}, agreement {:.3f}; {} of {} served)", state.name,
                     m->quality.quality, m->quality.recall, m->quality.agreement, m->quality.served, m->quality.requests));
  return Status::Ok();
}

struct RampResult {
  double capacity = 0;     // highest passing rate (0: the first step failed)
  std::string bottleneck;  // "" when max_rate passed
};

// Step 3, one ramp from `start_rate`; every step run is appended to m->steps.
RampResult Ramp(Clients& cl, const ValidateOptions& o, const State& state, const std::string& label, double start_rate,
                int round, StateMeasurement* m) {
  double pass_rate = 0, fail_rate = 0;
  // A failing step is run once more and fails only if that fails too: one transient stall must not
  // cut a state's capacity (both runs are kept in the steps).
  auto run_confirmed = [&](double rate, const char* what) {
    RampStep s = RunStep(cl, o, rate, state.name);
    s.round = round;
    Say(o, fmt::format("[{}] {} {}", label, what, Describe(s)));
    m->steps.push_back(s);
    if (s.pass || !o.confirm_failures) return s;
    s = RunStep(cl, o, rate, state.name);
    s.round = round;
    Say(o, fmt::format("[{}] {} (confirming) {}", label, what, Describe(s)));
    m->steps.push_back(s);
    return s;
  };
  for (double rate = start_rate;; rate *= o.growth) {
    rate = std::min(rate, o.max_rate);
    RampStep s = run_confirmed(rate, "ramp");
    if (!s.pass) {
      fail_rate = rate;
      break;
    }
    pass_rate = rate;
    if (rate >= o.max_rate) break;
  }
  for (int k = 0; k < o.refine_steps && fail_rate > 0 && pass_rate > 0; ++k) {
    const double mid = std::sqrt(pass_rate * fail_rate);  // geometric: the steps grow geometrically
    RampStep s = run_confirmed(mid, "refine");
    (s.pass ? pass_rate : fail_rate) = mid;
  }
  RampResult r;
  r.capacity = pass_rate;
  if (fail_rate > 0) {
    // The bottleneck: highest utilisation at the first failing rate's step of this ramp.
    const RampStep* failing = nullptr;
    for (const RampStep& s : m->steps) {
      if (!s.pass && !s.overload && s.round == round && s.rate == fail_rate) failing = &s;
    }
    int worst = 0;
    for (int i = 1; i < kNumServices; ++i) {
      if (failing->utilisation[i] > failing->utilisation[worst]) worst = i;
    }
    r.bottleneck = failing->utilisation[worst] > 0 ? std::string(ServiceName(static_cast<Service>(worst)))
                                                   : "unknown (no service reported utilisation)";
  }
  Say(o, fmt::format("[{}] capacity {:.3g} req/s{}", label, r.capacity,
                     r.bottleneck.empty() ? " (max_rate reached)" : " (saturated: " + r.bottleneck + ")"));
  return r;
}

// Step 4: one step at overload_factor x `capacity`; records the offered rate and the goodput
// (0 and 0 when not measured: the factor is 0 or the state has no capacity).
void MeasureGoodput(Clients& cl, const ValidateOptions& o, const State& state, const std::string& label,
                    double capacity, int round, StateMeasurement* m) {
  double offered = 0, goodput = 0;
  if (o.overload_factor > 0 && capacity > 0) {
    RampStep s = RunStep(cl, o, capacity * o.overload_factor, state.name);
    s.round = round;
    s.overload = true;
    s.pass = false;
    offered = s.rate;
    // Scaled to the offered rate, not the step's length: Poisson arrivals vary around it.
    goodput = s.sent > 0 ? s.rate * static_cast<double>(s.within_slo) / static_cast<double>(s.sent) : 0;
    Say(o, fmt::format("[{}] overload {}: goodput {:.4g} req/s ({:.0f} % of the capacity)", label, Describe(s), goodput,
                       100 * goodput / capacity));
    m->steps.push_back(s);
  }
  m->round_offered.push_back(offered);
  m->round_goodputs.push_back(goodput);
}

// One round over every state: pin, (round 0: quality), ramp. Later rounds start their ramp at
// `later_round_start` x the state's first capacity, since the steps below are known to pass; a
// later ramp that fails at that start is run again from start_rate.
Status MeasureRound(Clients& cl, const ValidateOptions& o, const Catalog& catalog, int round,
                    std::vector<answer::ReplayedAnswer>* reference, std::vector<StateMeasurement>* out) {
  for (size_t i = 0; i < catalog.states.size(); ++i) {
    const State& state = catalog.states[i];
    const std::string label =
        o.rounds > 1 ? fmt::format("{} round {}/{}", state.name, round + 1, o.rounds) : state.name;
    if (round == 0) {
      out->emplace_back();
      (*out)[i].state = state.name;
    }
    StateMeasurement& m = (*out)[i];
    KEEL_RETURN_IF_ERROR(PinAndWait(cl, o, state.name, label));
    if (round == 0) KEEL_RETURN_IF_ERROR(MeasureQuality(cl, o, state, reference, &m));
    double start = o.start_rate;
    if (round > 0 && m.round_capacities[0] > 0) {
      start = std::clamp(m.round_capacities[0] * o.later_round_start, o.start_rate, o.max_rate);
    }
    RampResult r = Ramp(cl, o, state, label, start, round, &m);
    if (r.capacity == 0 && start > o.start_rate) r = Ramp(cl, o, state, label, o.start_rate, round, &m);
    m.round_capacities.push_back(r.capacity);
    m.round_bottlenecks.push_back(r.bottleneck);
    MeasureGoodput(cl, o, state, label, r.capacity, round, &m);
  }
  return Status::Ok();
}

void ChooseRoundFigure(const ValidateOptions& o, StateMeasurement* m) {
  const size_t pick = ChosenRound(m->round_capacities, o.round_figure);
  m->capacity = m->round_capacities[pick];
  m->bottleneck = m->round_bottlenecks[pick];
  m->offered = m->round_offered[pick];
  m->goodput = m->round_goodputs[pick];
  m->service_capacity = ServiceCapacities(*m, static_cast<int>(pick), m->capacity);
}

}  // namespace

std::array<double, kNumServices> ServiceCapacities(const StateMeasurement& m, int round, double capacity, double target,
                                                   double max_factor) {
  constexpr double kMinUtilisationToEstimate = 0.5;
  std::array<double, kNumServices> out{};
  const RampStep* top = nullptr;
  for (const RampStep& s : m.steps) {
    if (s.round == round && s.pass && !s.overload && s.sent > 0 && (top == nullptr || s.rate > top->rate)) top = &s;
  }
  if (top == nullptr || !(capacity > 0)) return out;
  // Far from any limit the extrapolation is too long to trust (a ramp that reached max_rate).
  if (*std::max_element(top->utilisation.begin(), top->utilisation.end()) < kMinUtilisationToEstimate) return out;
  for (int i = 0; i < kNumServices; ++i) {
    const double u = top->utilisation[i];
    const double est = u > 0 ? top->rate * target / u : std::numeric_limits<double>::infinity();
    out[i] = std::clamp(est, capacity, max_factor * capacity);
  }
  return out;
}

size_t ChosenRound(const std::vector<double>& capacities, RoundFigure figure) {
  if (capacities.empty()) return 0;
  std::vector<size_t> order(capacities.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return capacities[a] < capacities[b]; });
  return figure == RoundFigure::kLowest ? order.front() : order[(order.size() - 1) / 2];
}

Result<std::vector<StateMeasurement>> MeasureStates(const Catalog& catalog, const ValidateOptions& o) {
  KEEL_RETURN_IF_ERROR(CheckOptions(o));
  KEEL_RETURN_IF_ERROR(ValidateCatalog(catalog));
  KEEL_ASSIGN_OR_RETURN(Clients cl, Connect(o));
  // The controller must hold the same states, or pins would measure something else.
  KEEL_ASSIGN_OR_RETURN(HttpReply cr, cl.controller->Call("GET", "/v1/catalog", "", "", DeadlineIn(kCallTimeoutMs)));
  if (cr.status != 200) return Status::Unavailable(fmt::format("controller /v1/catalog: HTTP {}", cr.status));
  KEEL_ASSIGN_OR_RETURN(Catalog served, ParseCatalog(cr.body));
  if (served.states.size() != catalog.states.size()) {
    return Status::InvalidArgument("the controller runs a different catalog (state count differs)");
  }
  for (size_t i = 0; i < served.states.size(); ++i) {
    if (served.states[i].name != catalog.states[i].name || WriteLevels(served.states[i]) != WriteLevels(catalog.states[i])) {
      return Status::InvalidArgument(fmt::format("the controller runs a different catalog: state {} ('{}') differs", i,
                                                 catalog.states[i].name));
    }
  }
  std::vector<StateMeasurement> out;
  std::vector<answer::ReplayedAnswer> reference;
  Status failure;
  for (int round = 0; round < o.rounds && failure.ok(); ++round) failure = MeasureRound(cl, o, catalog, round, &reference, &out);
  if (failure.ok()) {
    for (StateMeasurement& m : out) ChooseRoundFigure(o, &m);
  }
  // Unpin. A controller started pinned on an unvalidated catalog refuses (it decides from figures it
  // does not have): leave it pinned to the first state, the product's full quality, and say so.
  if (Status u = Pin(cl, ""); !u.ok()) {
    const std::string first = catalog.states.front().name;
    if (Status p = Pin(cl, first); !p.ok() && failure.ok()) failure = p;
    Log().warn("validate: the controller cannot be unpinned ({}); it stays pinned to '{}': restart it with the "
               "validated catalog",
               u.message(), first);
  }
  if (!failure.ok()) return failure;
  return out;
}

Result<Catalog> ApplyFigures(Catalog c, const std::vector<StateMeasurement>& measured, const std::string& fingerprint,
                             int64_t now_s, std::vector<std::string>* notes) {
  if (measured.size() != c.states.size()) return Status::InvalidArgument("validate: one measurement per state needed");
  const size_t n = c.states.size();
  std::vector<double> quality(n), capacity(n);
  for (size_t i = 0; i < n; ++i) {
    if (measured[i].state != c.states[i].name) {
      return Status::InvalidArgument(fmt::format("validate: measurement {} is for '{}', the catalog's state is '{}'", i,
                                                 measured[i].state, c.states[i].name));
    }
    if (!(measured[i].capacity > 0)) {
      return Status::InvalidArgument(fmt::format("validate: state '{}' failed its SLO at the first ramp step: no capacity "
                                                 "(lower --start-rate or raise --slo-ms)",
                                                 c.states[i].name));
    }
    quality[i] = std::clamp(measured[i].quality.quality, 0.0, 100.0);
    capacity[i] = std::min(measured[i].capacity, 1e9);
  }
  for (size_t i = 1; i < n; ++i) {
    if (quality[i] > quality[i - 1]) {
      if (notes) notes->push_back(fmt::format("'{}': measured quality {:.3f} above '{}''s {:.3f}: recorded as {:.3f}",
                                              c.states[i].name, quality[i], c.states[i - 1].name, quality[i - 1],
                                              quality[i - 1]));
      quality[i] = quality[i - 1];
    }
  }
  // A cheaper state does no more work per request than the state above it, so it sustains at least
  // the rate that state passed. A passing step is hard evidence; a failing one may be a transient
  // stall, so a low figure below a higher one is raised, not the higher one lowered.
  for (size_t i = 1; i < n; ++i) {
    if (capacity[i] < capacity[i - 1]) {
      if (notes) notes->push_back(fmt::format("'{}': measured capacity {:.4g} below '{}''s {:.4g}, which does more work: "
                                              "recorded as {:.4g}",
                                              c.states[i].name, capacity[i], c.states[i - 1].name, capacity[i - 1],
                                              capacity[i - 1]));
      capacity[i] = capacity[i - 1];
    }
  }
  // Each service's figure: its estimate where there is one (never below the product's), else the
  // product's; raised down the list by the same rule, per service.
  std::vector<std::array<double, kNumServices>> per(n);
  for (size_t i = 0; i < n; ++i) {
    for (int k = 0; k < kNumServices; ++k) {
      const double est = measured[i].service_capacity[k];
      per[i][k] = est > 0 ? std::min(std::max(est, capacity[i]), 1e9) : capacity[i];
      if (i > 0 && per[i][k] < per[i - 1][k]) {
        if (notes && est > 0) {
          notes->push_back(fmt::format("'{}': {}'s estimated capacity {:.4g} below '{}''s {:.4g}: recorded as {:.4g}",
                                       c.states[i].name, ServiceName(static_cast<Service>(k)), per[i][k],
                                       c.states[i - 1].name, per[i - 1][k], per[i - 1][k]));
        }
        per[i][k] = per[i - 1][k];
      }
    }
  }
  for (size_t i = 0; i < n; ++i) {
    Figures f;
    f.quality = quality[i];
    f.capacity = per[i];
    f.validated_at = now_s;
    if (measured[i].offered > 0) {
      f.offered = std::min(measured[i].offered, 1e9);
      f.goodput = std::clamp(measured[i].goodput, 0.0, f.offered);
    }
    c.states[i].figures = f;
  }
  c.binaries = fingerprint;
  KEEL_RETURN_IF_ERROR(ValidateCatalog(c));
  return c;
}

}  // namespace keel::hilo
