#include "keel/hilo/service_link.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "keel/core/log.h"
#include "keel/hilo/fingerprint.h"
#include "keel/hilo/json_fields.h"

namespace keel::hilo {
namespace {

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---- LoadMeter

LoadMeter::LoadMeter(int workers, int64_t start_ms)
    : workers_(std::max(workers, 1)), window_start_ms_(start_ms < 0 ? SystemNowMs() : start_ms) {}

void LoadMeter::Arrive() {
  std::lock_guard<std::mutex> lock(mu_);
  ++arrivals_;
  ++queued_;
}

void LoadMeter::Shed() {
  std::lock_guard<std::mutex> lock(mu_);
  if (queued_ > 0) --queued_;  // a Shed without its Arrive must not drive the queue negative
}

void LoadMeter::Started() {
  std::lock_guard<std::mutex> lock(mu_);
  if (queued_ > 0) --queued_;
  ++in_service_;
}

void LoadMeter::Finish(double latency_s, double busy_s) {
  // Garbage in (NaN, negative) must not poison the report: the controller refuses non-finite or
  // negative figures, and one refused report is a lost window.
  const double latency_ms = std::isfinite(latency_s) && latency_s > 0 ? latency_s * 1000 : 0;
  const double busy = std::isfinite(busy_s) && busy_s > 0 ? busy_s : 0;
  std::lock_guard<std::mutex> lock(mu_);
  if (in_service_ > 0) --in_service_;
  busy_s_ += busy;
  ++finished_;
  const auto sample = static_cast<float>(std::min(latency_ms, 1e9));
  if (latencies_ms_.size() < kMaxSamples) {
    latencies_ms_.push_back(sample);
    return;
  }
  // Reservoir sampling (Algorithm R): each of the window's latencies is kept with equal chance.
  rng_ ^= rng_ << 13;  // xorshift64: cheap, and statistical quality is plenty for a p99 sample
  rng_ ^= rng_ >> 7;
  rng_ ^= rng_ << 17;
  const uint64_t j = rng_ % static_cast<uint64_t>(finished_);
  if (j < kMaxSamples) latencies_ms_[j] = sample;
}

void LoadMeter::SetQueueDepthProbe(std::function<int64_t()> probe) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_probe_ = std::move(probe);
}

void LoadMeter::SetUtilisationProbe(std::function<double()> probe) {
  std::lock_guard<std::mutex> lock(mu_);
  util_probe_ = std::move(probe);
}

void LoadMeter::SetRateWindow(int64_t ms) {
  std::lock_guard<std::mutex> lock(mu_);
  rate_.SetSpan(ms);
}

void LoadMeter::SetRecentWindow(int64_t ms) {
  std::lock_guard<std::mutex> lock(mu_);
  recent_.SetSpan(ms);
}

LoadReport LoadMeter::Take(int64_t now_ms) {
  std::vector<float> lat;
  std::function<int64_t()> queue_probe;
  std::function<double()> util_probe;
  int64_t arrivals = 0, queued = 0, in_service = 0, window_ms = 0;
  double busy_s = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    window_ms = now_ms - window_start_ms_;
    arrivals = arrivals_;
    queued = queued_;
    in_service = in_service_;
    busy_s = busy_s_;
    lat.swap(latencies_ms_);
    queue_probe = queue_probe_;
    util_probe = util_probe_;
    window_start_ms_ = now_ms;
    arrivals_ = 0;
    busy_s_ = 0;
    finished_ = 0;
  }
  // Probes and the sort run outside the lock: a probe may take the service's own locks, and
  // requests keep being counted meanwhile.
  LoadReport r;
  r.unix_ms = std::max<int64_t>(now_ms, 0);
  const double window_s = window_ms > 0 ? window_ms / 1000.0 : 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    r.arrival_rate = rate_.Add(window_ms, arrivals);
    r.recent_rate = recent_.Add(window_ms, arrivals);
    r.recent_span_ms = recent_.covered_ms();
  }
  r.in_flight = std::min<int64_t>(in_service, 1000000000);
  r.queue_depth = std::min<int64_t>(queued, 1000000000);
  if (queue_probe) r.queue_depth = std::clamp<int64_t>(queue_probe(), 0, 1000000000);
  if (util_probe) {
    const double u = util_probe();
    r.utilisation = std::isfinite(u) ? std::clamp(u, 0.0, 1.0) : 0;
  } else if (window_s > 0) {
    r.utilisation = std::min(1.0, busy_s / (window_s * workers_));
  }
  if (!lat.empty()) {
    // Nearest rank: the smallest sample with at least 99% of the samples at or below it.
    const size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(lat.size())));
    const size_t k = std::max<size_t>(rank, 1) - 1;
    std::nth_element(lat.begin(), lat.begin() + static_cast<std::ptrdiff_t>(k), lat.end());
    r.p99_ms = lat[k];
  }
  return r;
}

// ---- ServiceLink

ServiceLink::ServiceLink(Catalog catalog, ServiceLinkOptions options)
    : catalog_(std::move(catalog)), opt_(std::move(options)), meter_(opt_.workers, opt_.clock()) {
  meter_.SetRateWindow(opt_.rate_window_ms);
  meter_.SetRecentWindow(opt_.recent_window_ms);
}

namespace {

// Checks and completes the options shared by Create and Pinned.
Status PrepareOptions(ServiceLinkOptions& o) {
  if (o.report_interval_ms < 10 || o.report_interval_ms > 60000) {
    return Status::InvalidArgument("service link: report_interval_ms must be 10..60000");
  }
  if (o.workers < 1) return Status::InvalidArgument("service link: workers must be >= 1");
  if (o.rate_window_ms < 0 || o.rate_window_ms > 60000) {
    return Status::InvalidArgument("service link: rate_window_ms must be 0..60000");
  }
  if (o.recent_window_ms < 0 || o.recent_window_ms > 60000) {
    return Status::InvalidArgument("service link: recent_window_ms must be 0..60000");
  }
  if (o.instance.empty()) o.instance = std::string(ServiceName(o.service)) + "-" + std::to_string(::getpid());
  if (!internal::IsValidName(o.instance)) {
    return Status::InvalidArgument("service link: instance '" + o.instance +
                                   "' must be 1..64 characters of [A-Za-z0-9_.:-]");
  }
  if (!o.clock) o.clock = SystemNowMs;
  if (!o.client.clock) o.client.clock = o.clock;
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ServiceLink>> ServiceLink::Create(Catalog catalog, ControllerCall call,
                                                         ServiceLinkOptions options) {
  KEEL_RETURN_IF_ERROR(PrepareOptions(options));
  std::unique_ptr<ServiceLink> link(new ServiceLink(catalog, std::move(options)));
  AgentClientOptions co = link->opt_.client;
  co.service = std::string(ServiceName(link->opt_.service));  // a per-service controller answers its own level
  ServiceLink* self = link.get();
  // The client lives inside the link and is stopped before the link dies, so `self` outlives
  // every call of this callback.
  co.on_push = [self, user = std::move(co.on_push)] {
    if (user) user();
    self->Refresh();
  };
  KEEL_ASSIGN_OR_RETURN(link->client_, AgentClient::Create(std::move(catalog), std::move(call), std::move(co)));
  if (link->opt_.metrics) {
    auto& reports = link->opt_.metrics->AddCounter("keel_hilo_link_reports_total",
                                                   "Load reports this process posted to the HiLO controller.",
                                                   {"result"});
    link->reports_ok_counter_ = &reports.WithLabels({"ok"});
    link->report_errors_counter_ = &reports.WithLabels({"error"});
  }
  link->Refresh();  // the agent's answer before any push: the safe state
  link->notified_ = link->applied_.load();
  return link;
}

Result<std::unique_ptr<ServiceLink>> ServiceLink::Connect(ControllerCall call, ServiceLinkOptions options,
                                                          Deadline deadline) {
  if (!call) return Status::InvalidArgument("service link: no controller call");
  KEEL_ASSIGN_OR_RETURN(ControllerReply reply, call("GET", "/v1/catalog", "", "", deadline));
  if (reply.status != 200) {
    return Status::Unavailable("controller answered " + std::to_string(reply.status) + " to GET /v1/catalog");
  }
  auto catalog = ParseCatalog(reply.body);
  if (!catalog.ok()) return Status::InvalidArgument("controller's catalog: " + catalog.status().message());
  return Create(std::move(*catalog), std::move(call), std::move(options));
}

Result<std::unique_ptr<ServiceLink>> ServiceLink::Pinned(Catalog catalog, std::string_view state,
                                                         ServiceLinkOptions options) {
  KEEL_RETURN_IF_ERROR(PrepareOptions(options));
  KEEL_RETURN_IF_ERROR(ValidateCatalog(catalog));
  if (catalog.IndexOf(state) < 0) {
    return Status::InvalidArgument("service link: pinned state '" + std::string(state) + "' is not in the catalog");
  }
  std::unique_ptr<ServiceLink> link(new ServiceLink(std::move(catalog), std::move(options)));
  KEEL_RETURN_IF_ERROR(link->Pin(state));
  link->notified_ = link->applied_.load();
  return link;
}

ServiceLink::~ServiceLink() { Stop(); }

Status ServiceLink::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_ || stopping_) return Status::Internal("service link already started");
    started_ = true;
  }
  if (client_) KEEL_RETURN_IF_ERROR(client_->Start());
  reporter_ = std::thread([this] { ReportLoop(); });
  return Status::Ok();
}

void ServiceLink::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (reporter_.joinable()) reporter_.join();
  if (client_) client_->Stop();
}

const State& ServiceLink::Current() const {
  return catalog_.states[static_cast<size_t>(applied_.load(std::memory_order_acquire))];
}

int ServiceLink::CurrentIndex() const { return applied_.load(std::memory_order_acquire); }

Status ServiceLink::Pin(std::string_view state) {
  int index = -1;
  if (!state.empty()) {
    index = catalog_.IndexOf(state);
    if (index < 0) {
      return Status::InvalidArgument("service link: cannot pin '" + std::string(state) +
                                     "': the catalog has no such state");
    }
  }
  pinned_.store(index);
  Log().info("hilo link: {} {}", ServiceName(opt_.service),
             index < 0 ? std::string("unpinned") : "pinned to '" + std::string(state) + "'");
  Refresh();
  return Status::Ok();
}

void ServiceLink::OnChange(std::function<void(const State& from, const State& to)> fn) {
  on_change_ = std::move(fn);
}

void ServiceLink::Refresh() {
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(refresh_mu_);
    const int pin = pinned_.load();
    int want = pin;
    if (want < 0) want = client_ ? client_->Current(Now()).index : catalog_.SafeIndex();
    changed = applied_.exchange(want, std::memory_order_acq_rel) != want;
    if (!state_gauge_ && opt_.metrics) {
      state_gauge_ = &opt_.metrics
                          ->AddGauge("keel_hilo_applied_state",
                                     "Index in the catalog of the product state this service applies.", {"service"})
                          .WithLabels({std::string(ServiceName(opt_.service))});
    }
    if (state_gauge_) state_gauge_->Set(want);
  }
  if (!changed) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    change_pending_ = true;
  }
  cv_.notify_all();
}

void ServiceLink::ReportLoop() {
  const auto interval = std::chrono::milliseconds(opt_.report_interval_ms);
  auto next = std::chrono::steady_clock::now() + interval;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_until(lock, next, [this] { return stopping_ || change_pending_; });
    if (stopping_) break;
    change_pending_ = false;
    lock.unlock();

    const auto now = std::chrono::steady_clock::now();
    const bool due = now >= next;
    if (due) Refresh();  // hold and fallback happen with time, not with a push
    const int to = applied_.load(std::memory_order_acquire);
    if (to != notified_) {
      const int from = notified_;
      notified_ = to;
      Log().info("hilo link: {} applies '{}' (was '{}')", ServiceName(opt_.service),
                 catalog_.states[static_cast<size_t>(to)].name, catalog_.states[static_cast<size_t>(from)].name);
      if (on_change_) on_change_(catalog_.states[static_cast<size_t>(from)], catalog_.states[static_cast<size_t>(to)]);
    }
    if (due) {
      // Catch up without a burst after a slow report: the next tick is one interval from now.
      next = std::max(next + interval, now + interval / 2);
      if (client_) {
        LoadReport r = meter_.Take(Now());
        r.service = opt_.service;
        r.instance = opt_.instance;
        r.applied_state = Current().name;
        r.binaries = opt_.binaries;
        const Status s = client_->Report(r);  // logs its own failures, once per streak
        if (s.ok()) {
          ++reports_ok_;
          if (reports_ok_counter_) reports_ok_counter_->Inc();
        } else {
          ++report_errors_;
          if (report_errors_counter_) report_errors_counter_->Inc();
        }
      }
    }
    lock.lock();
  }
}

Result<std::unique_ptr<ServiceLink>> OpenServiceLink(const LinkSource& f, ServiceLinkOptions o) {
  if (f.url.empty() && f.catalog.empty()) {
    if (!f.state.empty() || !f.instance.empty()) {
      return Status::InvalidArgument("--hilo-state and --hilo-instance need --hilo URL or --hilo-catalog FILE");
    }
    return std::unique_ptr<ServiceLink>();
  }
  if (!f.url.empty() && !f.catalog.empty()) {
    return Status::InvalidArgument("--hilo and --hilo-catalog exclude each other: with a controller the catalog is the controller's");
  }
  o.instance = f.instance;
  if (!f.catalog.empty()) {
    if (f.state.empty()) return Status::InvalidArgument("--hilo-catalog needs --hilo-state (the state to pin)");
    KEEL_ASSIGN_OR_RETURN(Catalog catalog, ReadCatalogFile(f.catalog));
    return ServiceLink::Pinned(std::move(catalog), f.state, std::move(o));
  }
  KEEL_ASSIGN_OR_RETURN(ControllerCall call, HttpControllerCallForUrl(f.url));
  // Hashing the executable reads it once (~10 ms for a 20 MB binary), at start-up only.
  if (o.binaries.empty()) {
    Result<std::string> self = ExecutableFingerprint();
    if (self.ok()) {
      o.binaries = *self;
    } else {
      Log().warn("hilo link: reports go without this binary's fingerprint: {}", self.status().message());
    }
  }
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<ServiceLink> link,
                        ServiceLink::Connect(std::move(call), std::move(o), DeadlineIn(f.connect_timeout_ms)));
  if (!f.state.empty()) KEEL_RETURN_IF_ERROR(link->Pin(f.state));
  return link;
}

}  // namespace keel::hilo
