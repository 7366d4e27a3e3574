#include "keel/hilo/server.h"

#include <limits>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "keel/core/http_metrics.h"
#include "keel/core/log.h"
#include "keel/hilo/report.h"

namespace keel::hilo {
namespace {

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ErrorBody(int status, std::string_view message) { return DefaultHttpErrorBody(status, message); }

// The value of `key` in a query string ("a=1&b=2"), or nullopt when absent.
std::optional<std::string_view> QueryParam(std::string_view query, std::string_view key) {
  while (!query.empty()) {
    const size_t amp = query.find('&');
    std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (pair.substr(0, eq) == key) return eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
  }
  return std::nullopt;
}

// A non-negative integer query parameter; `fallback` when absent. InvalidArgument naming it.
Result<int64_t> IntParam(std::string_view query, std::string_view key, int64_t fallback) {
  auto v = QueryParam(query, key);
  if (!v) return fallback;
  int64_t out = 0;
  auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
  if (ec != std::errc() || end != v->data() + v->size() || out < 0) {
    return Status::InvalidArgument(std::string(key) + ": expected a non-negative integer");
  }
  return out;
}

constexpr int64_t kForgetMs = 60000;        // /v1/services forgets instances unheard this long
constexpr size_t kMaxInstances = 4096;        // bounds /v1/services against a flood of instance names
constexpr size_t kMaxPinBytes = 256;

// Constant-time comparison of two hashes: a timing side channel must not reveal how much of a
// guessed token matched.
bool SameHash(const Hash128& a, const Hash128& b) {
  return ((a.lo ^ b.lo) | (a.hi ^ b.hi)) == 0;
}

}  // namespace

std::string_view StatePolicyName(StatePolicy p) { return p == StatePolicy::kHilo ? "hilo" : "per_service"; }

Result<std::unique_ptr<ControllerServer>> ControllerServer::Create(Catalog catalog, ControllerServerOptions options) {
  if (options.decide_interval_ms < 10 || options.decide_interval_ms > 60000) {
    return Status::InvalidArgument("decide_interval_ms: expected 10..60000");
  }
  if (options.max_wait_ms < 0 || options.max_wait_ms > 300000) return Status::InvalidArgument("max_wait_ms: expected 0..300000");
  if (options.max_waiters < 1 || options.max_waiters > 10000) return Status::InvalidArgument("max_waiters: expected 1..10000");
  if (options.policy != StatePolicy::kHilo && options.policy != StatePolicy::kPerService) {
    return Status::InvalidArgument("policy: expected hilo or per_service");
  }
  if (!options.clock) options.clock = SystemNowMs;
  const int64_t now_s = options.clock() / 1000;
  if (Status s = CheckUsable(catalog, options.fingerprint, now_s, options.max_age_s); !s.ok()) {
    if (!options.allow_unvalidated) return s;
    Log().warn("HILO RUNNING ON AN UNUSABLE CATALOG (--allow-unvalidated, development only): {}", s.message());
  }
  std::unique_ptr<ControllerServer> server(new ControllerServer(std::move(options)));
  // The registry lives in the server, so the controller is created after it.
  if (!server->opt_.pin.empty()) server->opt_.controller.pin = server->opt_.pin;
  KEEL_ASSIGN_OR_RETURN(Controller c, Controller::Create(std::move(catalog), server->opt_.controller, &server->metrics_));
  server->controller_.emplace(std::move(c));
  const Catalog& cat = server->controller_->catalog();
  server->reason_ = "initial state";
  if (server->opt_.policy == StatePolicy::kPerService) {
    for (Service s : kAllServices) {
      const int i = static_cast<int>(s);
      auto p = ServicePolicy::Create(static_cast<int>(cat.states.size()), server->opt_.per_service[i]);
      if (!p.ok()) return Status::InvalidArgument("per_service." + std::string(ServiceName(s)) + ": " + p.status().message());
      server->policies_.push_back(std::move(*p));
      server->policy_reason_[i] = "initial level";
      server->svc_index_[i] = server->ServiceIndexLocked(s);
      server->svc_reason_[i] = server->opt_.pin.empty() ? "initial level" : "pinned to '" + server->opt_.pin + "'";
      server->service_level_->WithLabels({std::string(ServiceName(s))}).Set(server->svc_index_[i]);
    }
    Log().warn("hilo: per-service policy (the evaluation's baseline): each service is answered its own level, "
               "from its own reports only; the product state below is computed, not pushed");
    for (Service s : kAllServices) {
      const ServicePolicyOptions& po = server->opt_.per_service[static_cast<int>(s)];
      Log().info("hilo per-service: {} degrades on queueing > {} ms{}{}, recovers below {} ms", ServiceName(s),
                 po.baseline.degrade_queue_ms,
                 po.utilisation_threshold > 0 ? fmt::format(" or utilisation >= {}", po.utilisation_threshold) : std::string(),
                 po.p99_bound_ms > 0 ? " or p99 > " + std::to_string(po.p99_bound_ms) + " ms" : std::string(),
                 po.baseline.recover_queue_ms);
    }
  }
  if (!server->opt_.admin_token.empty()) {
    server->admin_hash_ = Xxh3_128(server->opt_.admin_token);
    server->admin_enabled_ = true;
    server->opt_.admin_token.assign(server->opt_.admin_token.size(), '\0');
    server->opt_.admin_token.clear();
  }
  if (!server->opt_.pin.empty()) Log().warn("hilo: product pinned to '{}' from start (--pin)", server->opt_.pin);
  Log().info("hilo: catalog of {} states, starting in '{}' (safe state '{}')", cat.states.size(),
             cat.states[server->controller_->current()].name, cat.safe_state);
  return server;
}

ControllerServer::ControllerServer(ControllerServerOptions options) : opt_(std::move(options)) {
  requests_ = &metrics_.AddCounter("keel_hilo_http_requests_total", "HTTP requests to the controller.", {"route", "code"});
  reports_ = &metrics_.AddCounter("keel_hilo_reports_total", "Load reports accepted.", {"service"});
  report_errors_ = &metrics_.AddCounter("keel_hilo_report_errors_total", "Load reports refused (400).");
  foreign_binaries_ = &metrics_.AddCounter("keel_hilo_reports_foreign_binaries_total",
                                           "Load reports from binaries the catalog was not validated with.", {"service"});
  demand_ = &metrics_.AddGauge("keel_hilo_demand", "Sum of fresh instances' arrival rates (req/s); -1 = no fresh instance.", {"service"});
  predicted_ = &metrics_.AddGauge("keel_hilo_predicted_demand", "Predicted demand x headroom (req/s).", {"service"});
  skew_ = &metrics_.AddGauge("keel_hilo_report_skew_ms", "Receive time minus the report's own unix_ms, last report.", {"service"});
  version_gauge_ = &metrics_.AddGauge("keel_hilo_version", "Version of the current product state.").Get();
  catalog_age_ = &metrics_.AddGauge("keel_hilo_catalog_age_seconds",
                                    "Age of the oldest state's figures (validated_at); past max_age_s a restart refuses the catalog.")
                      .Get();
  waiters_gauge_ = &metrics_.AddGauge("keel_hilo_waiters", "Long-polls waiting now.").Get();
  if (opt_.policy == StatePolicy::kPerService) {
    service_level_ = &metrics_.AddGauge("keel_hilo_service_level",
                                        "Per-service policy: the catalog index each service is answered (its own level, or the pin).",
                                        {"service"});
    service_transitions_ = &metrics_.AddCounter("keel_hilo_service_transitions_total",
                                                "Per-service policy: changes of the index a service is answered.", {"service"});
  }
}

ControllerServer::~ControllerServer() { Stop(); }

int64_t ControllerServer::Now() const { return opt_.clock(); }

Status ControllerServer::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return Status::Internal("hilo controller server already started");
    started_ = true;
    // Versions grow across restarts: a restarted controller starts above anything it pushed before
    // (unless the clock stepped back by more than the changes it made).
    version_ = Now();
    std::random_device rd;
    epoch_ = fmt::format("{:08x}{:08x}", rd(), rd());
    version_gauge_->Set(static_cast<double>(version_));
    svc_version_.fill(version_);
  }
  HttpRouter router(ErrorBody);
  auto counted = [this](std::string route, void (ControllerServer::*fn)(const HttpRequest&, HttpResponder&)) {
    return [this, route, fn](const HttpRequest& req, HttpResponder& r) {
      CountingResponder cr(r, *requests_, route);
      (this->*fn)(req, cr);
    };
  };
  router.Handle("POST", "/v1/report", counted("/v1/report", &ControllerServer::HandleReport));
  router.Handle("GET", "/v1/state", counted("/v1/state", &ControllerServer::HandleState));
  router.Handle("POST", "/v1/pin", counted("/v1/pin", &ControllerServer::HandlePin));
  router.Handle("GET", "/v1/services", counted("/v1/services", &ControllerServer::HandleServices));
  router.Handle("GET", "/v1/catalog", [this](const HttpRequest&, HttpResponder& r) {
    std::string body;
    {
      std::lock_guard<std::mutex> lock(mu_);
      body = WriteCatalog(controller_->catalog());
    }
    r.Send(200, "application/json", std::move(body));
  });
  // The fingerprint tells `keel hilo validate` which binaries its figures are for.
  router.Handle("GET", "/health", [this](const HttpRequest&, HttpResponder& r) {
    nlohmann::ordered_json j;
    j["status"] = "ok";
    j["binaries"] = opt_.fingerprint;
    j["policy"] = StatePolicyName(opt_.policy);
    r.Send(200, "application/json", j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  });
  HandleHealthAndMetrics(router, metrics_);

  HttpServerOptions ho;
  ho.host = opt_.host;
  ho.port = opt_.port;
  ho.max_active_requests = opt_.max_waiters + kSpareHandlers;
  ho.max_body_bytes = kMaxReportBytes;
  ho.server_name = "keel-hilo";
  ho.error_body = ErrorBody;
  ho.drain_seconds = 5;
  http_ = std::make_unique<HttpServer>(ho, std::move(router));
  if (Status s = http_->Start(); !s.ok()) return s;
  loop_ = std::thread([this] { Loop(); });
  Log().info("hilo controller listening on {}:{} (decide every {} ms, long-poll <= {} ms, <= {} waiters)", opt_.host,
             http_->port(), opt_.decide_interval_ms, opt_.max_wait_ms, opt_.max_waiters);
  const ControllerOptions& co = opt_.controller;
  Log().info("hilo controller: objective {}, headroom {}, recover margin {} after {} s, min dwell {} s, lookahead {} s, level tau {} s, "
             "trend tau {} s, trend damping {} s, recent-rate guard {}, reports fresh {} s, safe state after {} s of silence",
             ObjectiveName(co.objective), co.headroom, co.recover_margin, co.recover_dwell_s, co.min_dwell_s, co.lookahead_s, co.level_tau_s,
             co.trend_tau_s, co.trend_damping_s, co.recent_rate_guard ? "on" : "off", co.report_timeout_s,
             co.stale_fallback_s);
  return Status::Ok();
}

void ControllerServer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  changed_.notify_all();
  if (loop_.joinable()) loop_.join();
  if (http_) http_->Stop();
}

int64_t ControllerServer::version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return version_;
}

std::string ControllerServer::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return controller_->catalog().states[controller_->current()].name;
}

int ControllerServer::service_index(Service s) const {
  std::lock_guard<std::mutex> lock(mu_);
  return opt_.policy == StatePolicy::kPerService ? svc_index_[static_cast<int>(s)] : controller_->current();
}

int64_t ControllerServer::service_version(Service s) const {
  std::lock_guard<std::mutex> lock(mu_);
  return opt_.policy == StatePolicy::kPerService ? svc_version_[static_cast<int>(s)] : version_;
}

int ControllerServer::ServiceIndexLocked(Service s) const {
  const std::string pinned = controller_->pinned();
  if (!pinned.empty()) return controller_->catalog().IndexOf(pinned);
  return policies_[static_cast<size_t>(s)].level();
}

std::vector<std::string> ControllerServer::RefreshServicesLocked(int64_t now) {
  std::vector<std::string> lines;
  if (opt_.policy != StatePolicy::kPerService) return lines;
  const Catalog& c = controller_->catalog();
  const std::string pinned = controller_->pinned();
  for (Service s : kAllServices) {
    const int i = static_cast<int>(s);
    const int want = ServiceIndexLocked(s);
    if (want == svc_index_[i]) continue;
    const std::string name(ServiceName(s));
    lines.push_back("hilo per-service: " + name + " -> '" + c.states[want].name + "' (index " + std::to_string(want) +
                    ", was '" + c.states[svc_index_[i]].name + "'): " +
                    (pinned.empty() ? policy_reason_[i] : "pinned to '" + pinned + "'"));
    svc_index_[i] = want;
    svc_reason_[i] = pinned.empty() ? policy_reason_[i] : "pinned to '" + pinned + "'";
    svc_version_[i] = std::max(svc_version_[i] + 1, now);
    service_level_->WithLabels({name}).Set(want);
    service_transitions_->WithLabels({name}).Inc();
  }
  return lines;
}

void ControllerServer::WatchCatalogAge(int64_t now_ms) {
  int64_t oldest = std::numeric_limits<int64_t>::max();
  for (const State& s : controller_->catalog().states) {
    if (s.figures) oldest = std::min(oldest, s.figures->validated_at);
  }
  if (oldest == std::numeric_limits<int64_t>::max()) return;  // no figures (validate's own controller)
  const int64_t age = now_ms / 1000 - oldest;
  catalog_age_->Set(static_cast<double>(age));
  // Checked at start (CheckUsable); a controller that outlives the limit keeps acting on the
  // figures it has (dropping to the safe state for a date would be an outage), but says so.
  if (age > opt_.max_age_s && !age_warned_.exchange(true)) {
    Log().error("hilo: the catalog's figures are now {} s old, past max_age_s {}: a restart will refuse this catalog; "
                "run keel hilo validate",
                age, opt_.max_age_s);
  }
}

Decision ControllerServer::DecideNow() {
  const int64_t now = Now();
  WatchCatalogAge(now);
  Decision d;
  {
    std::lock_guard<std::mutex> lock(mu_);
    d = controller_->Decide(now);
    for (Service s : kAllServices) {
      const std::string name(ServiceName(s));
      demand_->WithLabels({name}).Set(controller_->Demand(s, now));
      predicted_->WithLabels({name}).Set(controller_->Predicted(s));
    }
    if (!d.changed) return d;
    version_ = std::max(version_ + 1, now);
    reason_ = d.reason;
    version_gauge_->Set(static_cast<double>(version_));
  }
  changed_.notify_all();
  if (opt_.policy == StatePolicy::kPerService) {
    Log().info("hilo: product state (computed, not pushed: per-service policy) -> '{}' (index {}): {}", d.state, d.index,
               d.reason);
  } else {
    Log().info("hilo: state -> '{}' (index {}): {}", d.state, d.index, d.reason);
  }
  return d;
}

Status ControllerServer::Pin(std::string_view state) {
  std::vector<std::string> lines;
  {
    std::lock_guard<std::mutex> lock(mu_);
    KEEL_RETURN_IF_ERROR(controller_->Pin(state));
    lines = RefreshServicesLocked(Now());
  }
  if (!lines.empty()) changed_.notify_all();
  if (state.empty()) Log().warn("hilo: product unpinned");
  else Log().warn("hilo: product pinned to '{}'", state);
  for (const std::string& l : lines) Log().info("{}", l);
  DecideNow();
  return Status::Ok();
}

void ControllerServer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    lock.unlock();
    DecideNow();
    lock.lock();
    changed_.wait_for(lock, std::chrono::milliseconds(opt_.decide_interval_ms), [this] { return stopping_; });
  }
}

void ControllerServer::HandleReport(const HttpRequest& req, HttpResponder& r) {
  auto report = ParseLoadReport(req.body);
  if (!report.ok()) {
    report_errors_->Get().Inc();
    r.Send(400, "application/json", ErrorBody(400, report.status().message()));
    return;
  }
  if (!AcceptBinaries(*report, r)) return;
  const int64_t now = Now();
  const int64_t reported_ms = report->unix_ms;
  report->unix_ms = now;  // freshness by our clock, not the service's
  std::vector<std::string> lines;
  {
    std::lock_guard<std::mutex> lock(mu_);
    controller_->Observe(*report);
    std::erase_if(instances_, [&](const auto& kv) { return now - kv.second.unix_ms > kForgetMs; });
    auto key = std::make_pair(static_cast<int>(report->service), report->instance);
    if (instances_.size() < kMaxInstances || instances_.count(key)) instances_[std::move(key)] = *report;
    if (opt_.policy == StatePolicy::kPerService) {
      // Only this service's own report moves its level: the baseline has no view of the product.
      const auto i = static_cast<size_t>(report->service);
      const ServiceStep step = policies_[i].Observe(*report, now);
      if (step.changed) policy_reason_[i] = step.reason;
      lines = RefreshServicesLocked(now);
    }
  }
  if (!lines.empty()) changed_.notify_all();
  for (const std::string& l : lines) Log().info("{}", l);
  const std::string service(ServiceName(report->service));
  reports_->WithLabels({service}).Inc();
  skew_->WithLabels({service}).Set(static_cast<double>(now - reported_ms));
  r.Send(200, "application/json", R"({"ok":true})");
}

bool ControllerServer::AcceptBinaries(const LoadReport& report, HttpResponder& r) {
  const std::string& validated = controller_->catalog().binaries;  // fixed at Create
  if (report.binaries.empty() || validated.empty() || report.binaries == validated) return true;
  foreign_binaries_->WithLabels({std::string(ServiceName(report.service))}).Inc();
  const std::string why = fmt::format("{} instance '{}' runs binaries '{}', not '{}' that the catalog's figures were "
                                      "measured with; run keel hilo validate with these binaries",
                                      ServiceName(report.service), report.instance, report.binaries, validated);
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto key = std::make_pair(static_cast<int>(report.service), report.instance);
    if (foreign_logged_.size() < kMaxInstances) first = foreign_logged_.insert(std::move(key)).second;
  }
  if (opt_.allow_unvalidated) {
    if (first) Log().warn("hilo: accepting reports anyway (--allow-unvalidated): {}", why);
    return true;
  }
  if (first) Log().warn("hilo: refusing reports: {}", why);
  r.Send(409, "application/json", ErrorBody(409, why));
  return false;
}

void ControllerServer::HandlePin(const HttpRequest& req, HttpResponder& r) {
  if (!admin_enabled_) {
    r.Send(403, "application/json", ErrorBody(403, "pinning is disabled: start the controller with an admin token"));
    return;
  }
  std::string_view auth = req.headers.Get("authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (auth.size() <= kBearer.size() || auth.substr(0, kBearer.size()) != kBearer ||
      !SameHash(Xxh3_128(auth.substr(kBearer.size())), admin_hash_)) {
    r.Send(401, "application/json", ErrorBody(401, "pin needs Authorization: Bearer <admin token>"),
           {{"WWW-Authenticate", "Bearer"}});
    return;
  }
  if (req.body.size() > kMaxPinBytes) {
    r.Send(413, "application/json", ErrorBody(413, "pin body over 256 bytes"));
    return;
  }
  auto j = nlohmann::json::parse(req.body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("state") || !j["state"].is_string() || j.size() != 1) {
    r.Send(400, "application/json", ErrorBody(400, R"(pin body must be {"state":"<name>"} ("" unpins))"));
    return;
  }
  if (Status s = Pin(j["state"].get<std::string>()); !s.ok()) {
    r.Send(400, "application/json", ErrorBody(400, s.message()));
    return;
  }
  std::string body;
  {
    std::lock_guard<std::mutex> lock(mu_);
    body = StateBody();
  }
  r.Send(200, "application/json", std::move(body));
}

void ControllerServer::HandleServices(const HttpRequest&, HttpResponder& r) {
  const int64_t now = Now();
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, rep] : instances_) {
      if (now - rep.unix_ms > kForgetMs) continue;
      // The report as the instance sent it (one writer of its fields), plus its age here.
      nlohmann::ordered_json e = nlohmann::ordered_json::parse(WriteLoadReport(rep));
      e["age_ms"] = now - rep.unix_ms;
      list.push_back(std::move(e));
    }
  }
  nlohmann::ordered_json j;
  j["services"] = std::move(list);
  r.Send(200, "application/json", j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

std::string ControllerServer::StateBody() const {
  const Catalog& c = controller_->catalog();
  const int i = controller_->current();
  nlohmann::ordered_json j;
  j["version"] = version_;
  j["epoch"] = epoch_;
  j["state"] = c.states[i].name;
  j["index"] = i;
  j["levels"] = nlohmann::ordered_json::parse(WriteLevels(c.states[i]));
  j["reason"] = reason_;
  j["pinned"] = !controller_->pinned().empty();
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

std::string ControllerServer::ServiceStateBody(Service s) const {
  const Catalog& c = controller_->catalog();
  const int i = svc_index_[static_cast<int>(s)];
  nlohmann::ordered_json j;
  j["version"] = svc_version_[static_cast<int>(s)];
  j["epoch"] = epoch_;
  j["state"] = c.states[i].name;
  j["index"] = i;
  j["levels"] = nlohmann::ordered_json::parse(WriteLevels(c.states[i]));
  j["reason"] = svc_reason_[static_cast<int>(s)];
  j["pinned"] = !controller_->pinned().empty();
  j["service"] = ServiceName(s);
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

void ControllerServer::HandleState(const HttpRequest& req, HttpResponder& r) {
  auto known = IntParam(req.query, "version", -1);
  auto wait = IntParam(req.query, "wait_ms", 0);
  if (!known.ok() || !wait.ok()) {
    r.Send(400, "application/json", ErrorBody(400, (!known.ok() ? known.status() : wait.status()).message()));
    return;
  }
  // Under kHilo `service` is ignored (every service gets the product state); under kPerService it
  // picks whose own level is answered.
  std::optional<Service> service;
  if (opt_.policy == StatePolicy::kPerService) {
    const auto name = QueryParam(req.query, "service");
    if (!name || name->empty()) {
      r.Send(400, "application/json",
             ErrorBody(400, "service: required under the per_service policy (GET /v1/state?service=NAME)"));
      return;
    }
    service = ServiceFromName(*name);
    if (!service) {
      r.Send(400, "application/json",
             ErrorBody(400, "service: unknown service '" + std::string(name->substr(0, 64)) +
                                "' (expected answer, vector, engine or gateway)"));
      return;
    }
  }
  const int64_t wait_ms = std::min<int64_t>(*wait, opt_.max_wait_ms);
  // The version the caller is compared with: its service's own under kPerService, so another
  // service's change does not wake it.
  auto current = [&] { return service ? svc_version_[static_cast<int>(*service)] : version_; };
  std::unique_lock<std::mutex> lock(mu_);
  // With every waiting slot taken the poll is answered at once with the current state: a
  // heartbeat, not a 503. A 503 counted as not hearing the controller, so a flood of anonymous
  // long-polls put every service in its safe state after fallback_s (agents pace such early
  // answers: AgentClient waits retry_ms after a poll that brought nothing new).
  if (current() == *known && wait_ms > 0 && !stopping_ && waiters_ < opt_.max_waiters) {
    ++waiters_;
    waiters_gauge_->Set(waiters_);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
    // Wake in slices to notice a client that went away: its thread is returned to the pool.
    while (current() == *known && !stopping_ && std::chrono::steady_clock::now() < until) {
      changed_.wait_until(lock, std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(500)));
      if (current() != *known || stopping_) break;
      lock.unlock();
      const bool gone = r.ClientGone();
      lock.lock();
      if (gone) break;
    }
    --waiters_;
    waiters_gauge_->Set(waiters_);
  }
  std::string body = service ? ServiceStateBody(*service) : StateBody();
  lock.unlock();
  r.Send(200, "application/json", std::move(body));
}

}  // namespace keel::hilo
