#include "keel/hilo/sim.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <optional>
#include <queue>
#include <random>
#include <unordered_set>

#include "keel/hilo/windowed_rate.h"

namespace keel::hilo {

namespace {

constexpr int64_t kUnixMs0 = 1764900000000;  // the simulation's t = 0, as the controller's clock
// The order a request visits the services in.
constexpr std::array<Service, kNumServices> kPath = {Service::kAnswer, Service::kVector, Service::kGateway,
                                                     Service::kEngine};

uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A unit-mean exponential draw fixed by (seed, request, service): both policies give a request the
// same draws (common random numbers), so their difference is the policy, not the dice.
double UnitExp(uint64_t seed, int64_t req, int svc) {
  uint64_t z = Mix(Mix(seed) ^ (static_cast<uint64_t>(req) * kNumServices + static_cast<uint64_t>(svc)));
  double u = (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
  return -std::log(u);
}

struct Req {
  double arrival = 0;
  double enqueued = 0;  // when it entered its current service
  int stage = 0;        // index into kPath
  int worst = 0;        // the cheapest level applied so far, as a state index (Sim::quality_state_)
  int answer_level = 0;
  uint32_t gen = 0;     // bumped when its pending kDone is replaced; older ones are ignored
  double done_at = 0;   // when its service in progress ends
};

// kDone ends one request's service at a station of independent workers; kBatchDone the batch
// member due first at a batching station (only the latest one scheduled counts).
enum class EvType : uint8_t { kDone, kBatchDone, kReport, kDecide, kApply, kSpeed };
struct Event {
  double t;
  uint64_t seq;  // ties break by insertion order, so runs are deterministic
  EvType type;
  int svc;
  int64_t arg;  // request id (kDone) or state index (kApply)
  uint32_t gen = 0;  // kDone: the request's gen when pushed
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

struct Station {
  int servers = 1;
  size_t bound = 0;
  int busy = 0;
  std::unordered_set<int64_t> serving;  // requests in service (only kept where a level reaches them)
  std::deque<int64_t> waiting;
  int level = 0;
  // The current report window.
  int64_t arrivals = 0;
  double busy_integral = 0;  // server-seconds
  double last_t = 0;
  std::vector<double> sojourn_ms;
  double qdelay_sum_ms = 0;
  int64_t qdelay_n = 0;
  WindowedRate rate;                    // reported arrival rate over rate_window_s
  WindowedRate recent;                  // reported recent rate over recent_window_s
  std::optional<ServicePolicy> policy;  // SimOptions::live_baseline: the live per-service rule
  // Baseline rule.
  double last_change = -std::numeric_limits<double>::infinity();
  double calm_since = -1;
  // A batching station (SimOptions::batch_slowdown > 0) shares its work in virtual time: vclock is
  // the work (seconds of service alone) that each request in service has received since t = 0, and
  // a request ends when vclock reaches its finish. `batch` is a min-heap of (finish, request).
  double slowdown = 0;  // already divided by the scale
  double speed = 1;     // the machine's speed factor now (SimOptions::speed_sd)
  double vclock = 0;
  double vlast_t = 0;
  std::vector<std::pair<double, int64_t>> batch;
  uint32_t batch_gen = 0;  // the kBatchDone in force

  bool batching() const { return slowdown > 0; }
  double Speed() const { return speed / (1.0 + slowdown * std::max(0, busy - 1)); }
  // Call before `busy` changes, at every event time: the speed is constant between changes.
  void Account(double t) {
    busy_integral += busy * (t - last_t);
    last_t = t;
    if (batching()) {
      vclock += (t - vlast_t) * Speed();
      vlast_t = t;
    }
  }
};

struct WindowAcc {
  int64_t arrived = 0;
  double drop_sum = 0;  // sum of full_quality - quality
  int state = 0;
  std::array<int, kNumServices> levels{};
};

class Sim {
 public:
  Sim(const Catalog& catalog, const Trace& trace, Policy policy, const SimOptions& o)
      : cat_(catalog), trace_(trace), policy_(policy), o_(o) {}

  Result<SimResult> Run() {
    const int n = static_cast<int>(cat_.states.size());
    full_q_ = cat_.states[0].figures->quality;
    for (int s = 0; s < kNumServices; ++s) {
      quality_state_[s].assign(n, 0);
      for (int k = 0; k < n; ++k) {
        int j = 0;
        while (!SameLevel(cat_.states[j], cat_.states[k], kAllServices[s])) ++j;
        quality_state_[s][k] = j;
      }
    }
    int initial = 0;
    if (policy_ == Policy::kHilo) {
      Catalog scaled = cat_;
      for (State& s : scaled.states) {
        for (double& c : s.figures->capacity) c *= o_.scale;
        s.figures->offered *= o_.scale;
        s.figures->goodput *= o_.scale;
      }
      ControllerOptions co = o_.controller;
      if (co.initial_state.empty()) co.initial_state = cat_.states[0].name;
      Result<Controller> c = Controller::Create(std::move(scaled), co, nullptr);
      if (!c.ok()) return c.status();
      ctrl_.emplace(std::move(c).value());
      initial = ctrl_->current();
    }
    for (int s = 0; s < kNumServices; ++s) {
      Station& st = st_[s];
      st.servers = std::max(1, static_cast<int>(std::lround(o_.servers[s] * o_.scale)));
      st.bound = static_cast<size_t>(o_.queue_per_server) * st.servers;
      st.slowdown = o_.batch_slowdown[s] / o_.scale;
      st.level = initial;
      st.rate.SetSpan(std::llround(o_.rate_window_s * 1000));
      st.recent.SetSpan(std::llround(o_.recent_window_s * 1000));
      if (!ctrl_ && o_.live_baseline) {
        ServicePolicyOptions po;  // the live defaults (ControllerServerOptions::per_service)
        po.baseline = o_.baseline;
        Result<ServicePolicy> p = ServicePolicy::Create(n, po);
        if (!p.ok()) return p.status();
        st.policy.emplace(std::move(p).value());
      }
    }
    entry_bound_ = o_.entry_max_in_flight > 0 ? std::max<int64_t>(1, std::llround(o_.entry_max_in_flight * o_.scale)) : 0;
    arrivals_ = PoissonArrivals(trace_, o_.baseline_rate * o_.scale, o_.seed);
    reqs_.resize(arrivals_.size());
    windows_.resize(static_cast<size_t>(std::ceil(trace_.duration_s / o_.window_s)) + 1);
    res_.policy = std::string(PolicyName(policy_));
    res_.trace = trace_.name;
    res_.full_quality = full_q_;
    res_.time_in_state_s.assign(n, 0);

    Push(o_.report_interval_s, EvType::kReport, 0, 0);
    if (ctrl_) Push(o_.decide_interval_s, EvType::kDecide, 0, 0);
    if (o_.speed_drifts()) {
      speed_ = SpeedPath(o_, trace_.duration_s);
      for (Station& st : st_) st.speed = speed_[0];
      Push(o_.speed_step_s, EvType::kSpeed, 0, 1);
    }
    size_t next = 0;
    while (next < arrivals_.size() || !events_.empty()) {
      if (next < arrivals_.size() && (events_.empty() || arrivals_[next] < events_.top().t)) {
        Arrive(static_cast<int64_t>(next), arrivals_[next]);
        ++next;
        continue;
      }
      Event e = events_.top();
      events_.pop();
      switch (e.type) {
        case EvType::kDone:
          if (e.gen == reqs_[e.arg].gen) Done(e.svc, e.arg, e.t);
          break;
        case EvType::kBatchDone:
          if (e.gen == st_[e.svc].batch_gen) BatchDone(e.svc, e.t);
          break;
        case EvType::kReport: Report(e.t); break;
        case EvType::kDecide: Decide(e.t); break;
        case EvType::kApply:
          for (int svc = 0; svc < kNumServices; ++svc) SetLevel(svc, static_cast<int>(e.arg), e.t);
          break;
        case EvType::kSpeed: ChangeSpeed(static_cast<size_t>(e.arg), e.t); break;
      }
    }
    Summarise();
    return std::move(res_);
  }

 private:
  void Push(double t, EvType type, int svc, int64_t arg, uint32_t gen = 0) {
    events_.push(Event{t, seq_++, type, svc, arg, gen});
  }

  bool ReachesAdmitted(int svc) const { return o_.engine_clamps_admitted && svc == static_cast<int>(Service::kEngine); }

  // Every level change goes through here. Where the new level reaches work in service (the
  // engine's max_new_tokens falling), that work is cut: its remaining time shrinks by the capacity
  // ratio and it scores as the new level.
  void SetLevel(int svc, int level, double t) {
    Station& st = st_[svc];
    const int old = st.level;
    st.level = level;
    if (!ReachesAdmitted(svc) || level == old) return;
    if (cat_.states[level].engine.max_new_tokens >= cat_.states[old].engine.max_new_tokens) return;
    const double ratio = std::min(1.0, cat_.states[old].figures->capacity[svc] / cat_.states[level].figures->capacity[svc]);
    if (st.batching()) {
      // The same factor for every member keeps the heap's order.
      st.Account(t);
      for (auto& [finish, id] : st.batch) {
        reqs_[id].worst = std::max(reqs_[id].worst, quality_state_[svc][level]);
        finish = st.vclock + (finish - st.vclock) * ratio;
      }
      ScheduleBatch(svc, t);
      return;
    }
    for (int64_t id : st.serving) {
      Req& r = reqs_[id];
      r.worst = std::max(r.worst, quality_state_[svc][level]);
      r.done_at = t + (r.done_at - t) * ratio;
      Push(r.done_at, EvType::kDone, svc, id, ++r.gen);
    }
  }

  // A new machine speed: batching stations account their work at the old one and reschedule;
  // independent workers take the speed at their start (Start), which a half-second step keeps close.
  void ChangeSpeed(size_t k, double t) {
    const double v = speed_[std::min(k, speed_.size() - 1)];
    for (int svc = 0; svc < kNumServices; ++svc) {
      Station& st = st_[svc];
      st.Account(t);
      st.speed = v;
      if (st.batching()) ScheduleBatch(svc, t);
    }
    // Speed steps run while anything can still arrive or is in the product.
    if (k + 1 < speed_.size() || in_product_ > 0) Push(t + o_.speed_step_s, EvType::kSpeed, 0, static_cast<int64_t>(k + 1));
  }

  void Arrive(int64_t id, double t) {
    reqs_[id] = Req{t, t, 0, 0, 0, 0, 0};
    ++res_.arrived;
    ++in_product_;  // Score ends it, whatever the request's fate
    if (entry_bound_ > 0 && in_product_ > entry_bound_) {
      ++st_[static_cast<int>(kPath[0])].arrivals;  // the entry saw it: its reported rate counts it
      ++res_.shed;
      Score(id, 0);
      return;
    }
    Enter(id, t);
  }

  void Enter(int64_t id, double t) {
    Req& r = reqs_[id];
    if (kPath[r.stage] == Service::kVector && !cat_.states[r.answer_level].answer.retrieval) ++r.stage;
    const int svc = static_cast<int>(kPath[r.stage]);
    Station& st = st_[svc];
    ++st.arrivals;
    r.enqueued = t;
    if (st.busy < st.servers) {
      Start(svc, id, t);
    } else if (st.waiting.size() < st.bound) {
      st.waiting.push_back(id);
    } else {
      ++res_.shed;
      Score(id, 0);
    }
  }

  void Start(int svc, int64_t id, double t) {
    Station& st = st_[svc];
    Req& r = reqs_[id];
    st.Account(t);
    ++st.busy;
    st.qdelay_sum_ms += (t - r.enqueued) * 1000;
    ++st.qdelay_n;
    r.worst = std::max(r.worst, quality_state_[svc][st.level]);
    if (svc == static_cast<int>(Service::kAnswer)) r.answer_level = st.level;
    const double capacity = cat_.states[st.level].figures->capacity[svc] * o_.scale;
    // A full batch (all servers busy) completes capacity / capacity_utilisation per second; with
    // no slowdown that is each worker's mean service time.
    const double mean_s = o_.capacity_utilisation * st.servers / (capacity * (1 + st.slowdown * (st.servers - 1)));
    const double work_s = UnitExp(o_.seed, id, svc) * mean_s;
    if (st.batching()) {
      st.batch.emplace_back(st.vclock + work_s, id);
      std::push_heap(st.batch.begin(), st.batch.end(), std::greater<>());
      ScheduleBatch(svc, t);
      return;
    }
    r.done_at = t + work_s / st.speed;
    if (ReachesAdmitted(svc)) st.serving.insert(id);
    Push(r.done_at, EvType::kDone, svc, id, r.gen);
  }

  // (Re)schedules a batching station's next completion; the speed changed or the batch did.
  void ScheduleBatch(int svc, double t) {
    Station& st = st_[svc];
    ++st.batch_gen;
    if (st.batch.empty()) return;
    const double left = std::max(0.0, st.batch.front().first - st.vclock);
    Push(t + left / st.Speed(), EvType::kBatchDone, svc, st.batch.front().second, st.batch_gen);
  }

  void BatchDone(int svc, double t) {
    Station& st = st_[svc];
    st.Account(t);
    std::pop_heap(st.batch.begin(), st.batch.end(), std::greater<>());
    const auto [finish, id] = st.batch.back();
    st.batch.pop_back();
    st.vclock = std::max(st.vclock, finish);  // no drift from the division in ScheduleBatch
    Done(svc, id, t);
    ScheduleBatch(svc, t);
  }

  void Done(int svc, int64_t id, double t) {
    Station& st = st_[svc];
    Req& r = reqs_[id];
    st.Account(t);
    --st.busy;
    st.serving.erase(id);
    st.sojourn_ms.push_back((t - r.enqueued) * 1000);
    if (++r.stage == kNumServices) {
      ++res_.served;
      const bool late = (t - r.arrival) * 1000 > o_.slo_ms;
      if (late) ++res_.slo_violations;
      Score(id, late ? 0 : cat_.states[r.worst].figures->quality);
    } else {
      Enter(id, t);
    }
    while (!st.waiting.empty()) {
      int64_t w = st.waiting.front();
      st.waiting.pop_front();
      if ((t - reqs_[w].arrival) * 1000 > o_.timeout_ms) {
        ++res_.failed;
        Score(w, 0);
        continue;
      }
      Start(svc, w, t);
      break;
    }
  }

  void Score(int64_t id, double quality) {
    --in_product_;
    WindowAcc& w = windows_[std::min(windows_.size() - 1, static_cast<size_t>(reqs_[id].arrival / o_.window_s))];
    ++w.arrived;
    w.drop_sum += full_q_ - quality;
  }

  void Report(double t) {
    const int64_t now_ms = kUnixMs0 + std::llround(t * 1000);
    for (int s = 0; s < kNumServices; ++s) {
      Station& st = st_[s];
      st.Account(t);
      if (ctrl_ || st.policy) {
        LoadReport r;
        r.service = static_cast<Service>(s);
        r.instance = "sim-" + std::string(ServiceName(r.service));
        r.unix_ms = now_ms;
        // As the live LoadMeter reports it: over the last rate_window_s of report windows.
        r.arrival_rate = st.rate.Add(std::llround(o_.report_interval_s * 1000), st.arrivals);
        r.recent_rate = st.recent.Add(std::llround(o_.report_interval_s * 1000), st.arrivals);
        r.recent_span_ms = st.recent.covered_ms();
        r.in_flight = st.busy;
        r.queue_depth = static_cast<int64_t>(st.waiting.size());
        r.utilisation = std::min(1.0, st.busy_integral / (st.servers * o_.report_interval_s));
        r.p99_ms = P99(st.sojourn_ms);
        r.applied_state = cat_.states[st.level].name;
        if (ctrl_) {
          ctrl_->Observe(r);
        } else {
          const ServiceStep step = st.policy->Observe(r, now_ms);
          if (step.changed) {
            SetLevel(s, step.to, t);
            ++res_.transitions;
          }
        }
      } else {
        LocalRule(s, t);
      }
      st.arrivals = 0;
      st.busy_integral = 0;
      st.sojourn_ms.clear();
      st.qdelay_sum_ms = 0;
      st.qdelay_n = 0;
    }
    int eff = 0;
    for (const Station& st : st_) eff = std::max(eff, st.level);
    res_.time_in_state_s[eff] += o_.report_interval_s;
    size_t w = static_cast<size_t>((t - 1e-9) / o_.window_s);
    if (w < windows_.size()) {
      windows_[w].state = eff;
      for (int s = 0; s < kNumServices; ++s) windows_[w].levels[s] = st_[s].level;
    }
    if (t + o_.report_interval_s <= trace_.duration_s + 1e-9) Push(t + o_.report_interval_s, EvType::kReport, 0, 0);
  }

  // DAGOR-like: one step cheaper per report while the mean queueing delay is over the threshold;
  // one step back after a calm dwell.
  void LocalRule(int svc, double t) {
    Station& st = st_[svc];
    const double qdelay = st.qdelay_n > 0 ? st.qdelay_sum_ms / st.qdelay_n : 0;
    const int cheapest = static_cast<int>(cat_.states.size()) - 1;
    const BaselineOptions& b = o_.baseline;
    if (qdelay > b.degrade_queue_ms) {
      st.calm_since = -1;
      if (st.level < cheapest) {
        SetLevel(svc, st.level + 1, t);
        st.last_change = t;
        ++res_.transitions;
      }
      return;
    }
    if (qdelay >= b.recover_queue_ms) {
      st.calm_since = -1;
      return;
    }
    if (st.calm_since < 0) st.calm_since = t;
    if (st.level > 0 && t - st.calm_since >= b.recover_dwell_s && t - st.last_change >= b.min_dwell_s) {
      SetLevel(svc, st.level - 1, t);
      st.last_change = t;
      st.calm_since = t;
      ++res_.transitions;
    }
  }

  void Decide(double t) {
    Decision d = ctrl_->Decide(kUnixMs0 + std::llround(t * 1000));
    if (d.changed) {
      ++res_.transitions;
      Push(t + o_.push_delay_s, EvType::kApply, 0, d.index);
    }
    if (t + o_.decide_interval_s <= trace_.duration_s + 1e-9) Push(t + o_.decide_interval_s, EvType::kDecide, 0, 0);
  }

  static double P99(std::vector<double>& v) {
    if (v.empty()) return 0;
    size_t k = static_cast<size_t>(0.99 * static_cast<double>(v.size() - 1));
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
    return v[k];
  }

  void Summarise() {
    double drop_total = 0;
    int64_t counted = 0;
    for (size_t i = 0; i < windows_.size(); ++i) {
      const WindowAcc& w = windows_[i];
      if (w.arrived == 0) continue;
      const double drop = w.drop_sum / static_cast<double>(w.arrived);
      res_.max_drop = std::max(res_.max_drop, drop);
      drop_total += drop;
      ++counted;
      res_.windows.push_back(SimWindow{static_cast<double>(i) * o_.window_s, w.arrived, full_q_ - drop, w.state, w.levels});
    }
    res_.mean_drop = counted > 0 ? drop_total / static_cast<double>(counted) : 0;
  }

  const Catalog& cat_;
  // quality_state_[s][k]: the first state that gives service s the same level as state k. A
  // request is scored as the cheapest of these over the services that handled it: a service the
  // per-service rule stepped to a state that leaves its own knobs as they were (the engine's
  // max_new_tokens is the same in shorter16 and small16; the model is the gateway's) handled it
  // as before. Levels that differ still count as that whole state (no quality is measured for a
  // mix of levels), which is pessimistic for such mixes.
  std::array<std::vector<int>, kNumServices> quality_state_;
  const Trace& trace_;
  Policy policy_;
  const SimOptions& o_;
  double full_q_ = 0;
  std::optional<Controller> ctrl_;
  std::vector<double> speed_;  // SpeedPath, when the speed drifts
  std::array<Station, kNumServices> st_;
  std::vector<double> arrivals_;
  std::vector<Req> reqs_;
  std::vector<WindowAcc> windows_;
  int64_t entry_bound_ = 0;  // SimOptions::entry_max_in_flight x scale; 0 = none
  int64_t in_product_ = 0;   // arrived and not yet scored
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t seq_ = 0;
  SimResult res_;
};

Status CheckOptions(const SimOptions& o) {
  auto bad = [](const char* what) { return Status::InvalidArgument(std::string("sim options: ") + what); };
  if (!(o.baseline_rate > 0) || !std::isfinite(o.baseline_rate)) return bad("baseline_rate must be > 0");
  if (!(o.scale > 0) || o.scale > 1e4) return bad("scale must be in (0, 1e4]");
  for (int s : o.servers) {
    if (s < 1) return bad("servers must be >= 1");
  }
  if (!(o.capacity_utilisation > 0 && o.capacity_utilisation <= 1)) return bad("capacity_utilisation must be in (0, 1]");
  if (o.queue_per_server < 0) return bad("queue_per_server must be >= 0");
  for (double b : o.batch_slowdown) {
    if (!(b >= 0 && b <= 1)) return bad("batch_slowdown must be in [0, 1]");
  }
  if (o.entry_max_in_flight < 0 || o.entry_max_in_flight > (1 << 24)) return bad("entry_max_in_flight must be in [0, 2^24]");
  if (!(o.slo_ms > 0) || !(o.timeout_ms > 0)) return bad("slo_ms and timeout_ms must be > 0");
  if (!(o.window_s > 0) || !(o.report_interval_s > 0) || !(o.decide_interval_s > 0)) {
    return bad("window_s, report_interval_s and decide_interval_s must be > 0");
  }
  if (!(o.push_delay_s >= 0)) return bad("push_delay_s must be >= 0");
  if (!(o.rate_window_s >= 0 && o.rate_window_s <= 3600)) return bad("rate_window_s must be in [0, 3600]");
  if (!(o.recent_window_s >= 0 && o.recent_window_s <= 3600)) return bad("recent_window_s must be in [0, 3600]");
  if (!(o.speed_sd >= 0 && o.speed_sd <= 1)) return bad("speed_sd must be in [0, 1]");
  if (!(o.speed_run_sd >= 0 && o.speed_run_sd <= 1)) return bad("speed_run_sd must be in [0, 1]");
  if (!(o.speed_tau_s > 0 && o.speed_tau_s <= 1e6)) return bad("speed_tau_s must be in (0, 1e6]");
  // A path of at most ~10^7 steps: a hostile step cannot allocate without bound.
  if (!(o.speed_step_s >= 1e-3 && o.speed_step_s <= 3600)) return bad("speed_step_s must be in [0.001, 3600]");
  if (Status s = CheckBaselineOptions(o.baseline); !s.ok()) return Status::InvalidArgument("sim options: baseline: " + s.message());
  return Status::Ok();
}

}  // namespace

std::string_view PolicyName(Policy p) { return p == Policy::kHilo ? "hilo" : "baseline"; }

std::vector<double> PoissonArrivals(const Trace& trace, double rate, uint64_t seed) {
  std::vector<double> out;
  const double peak = trace.Peak() * rate;
  if (!(peak > 0) || !(trace.duration_s > 0)) return out;
  std::mt19937_64 gen(seed);
  auto uniform = [&gen] { return (static_cast<double>(gen() >> 11) + 0.5) * 0x1.0p-53; };
  out.reserve(static_cast<size_t>(peak * trace.duration_s * 0.8));
  double t = 0;
  while (true) {
    t += -std::log(uniform()) / peak;
    if (t >= trace.duration_s) break;
    if (uniform() * peak < trace.Multiplier(t) * rate) out.push_back(t);
  }
  return out;
}

std::vector<double> SpeedPath(const SimOptions& o, double duration_s) {
  if (!(o.speed_step_s >= 1e-3) || !(duration_s >= 0) || duration_s > 1e7) return {1.0};  // CheckOptions' bounds
  const size_t n = static_cast<size_t>(std::ceil(duration_s / o.speed_step_s)) + 1;
  std::vector<double> out(n, 1.0);
  if (!o.speed_drifts() || !(o.speed_tau_s > 0)) return out;
  // Exact AR(1) sampling of an Ornstein-Uhlenbeck process at the step, started in its stationary law.
  std::mt19937_64 gen(Mix(o.speed_seed ^ 0x5eedULL));
  std::normal_distribution<double> z(0.0, 1.0);
  const double rho = std::exp(-o.speed_step_s / o.speed_tau_s);
  const double innovation = o.speed_sd * std::sqrt(1 - rho * rho);
  const double run = o.speed_run_sd * z(gen);
  const double bias = run - 0.5 * (o.speed_sd * o.speed_sd + o.speed_run_sd * o.speed_run_sd);  // E[speed] = 1
  double x = o.speed_sd * z(gen);
  for (size_t k = 0; k < n; ++k) {
    out[k] = std::exp(x + bias);
    x = rho * x + innovation * z(gen);
  }
  return out;
}

Result<SimResult> Simulate(const Catalog& catalog, const Trace& trace, Policy policy, const SimOptions& options) {
  if (Status s = ValidateCatalog(catalog); !s.ok()) return s;
  for (const State& s : catalog.states) {
    if (!s.figures) return Status::InvalidArgument("sim: state " + s.name + " is not validated");
  }
  if (trace.points.empty() || !(trace.duration_s > 0)) {
    return Status::InvalidArgument("sim: trace " + trace.name + " has no points or no duration");
  }
  if (Status s = CheckOptions(options); !s.ok()) return s;
  Sim sim(catalog, trace, policy, options);
  return sim.Run();
}

}  // namespace keel::hilo
