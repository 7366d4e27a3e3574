// Router: start/stop, HTTP routes, stats, metrics and the background sync loop. Writes are in
// router_write.cc, searches in router_search.cc.
#include "keel/vector/router.h"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "keel/core/http_metrics.h"
#include "keel/core/json_reader.h"
#include "keel/core/log.h"
#include "keel/core/signal.h"
#include "keel/vector/router_impl.h"

namespace keel::vector {

using json = nlohmann::json;

void ReplicaState::Observe(uint64_t v) {
  version.store(v);
  known.store(true);
  reachable.store(true);
  if (version_gauge) version_gauge->Set(static_cast<double>(v));
}

void ReplicaState::Unreachable(const std::string& why) {
  reachable.store(false);
  std::lock_guard lock(mu_);
  last_error_ = why;
}

std::string ReplicaState::last_error() const {
  std::lock_guard lock(mu_);
  return last_error_;
}

void ShardState::UpdateVersions() {
  std::vector<uint64_t> known;
  for (const auto& r : replicas) {
    if (r->known.load()) known.push_back(r->version.load());
  }
  if (known.empty()) return;
  std::sort(known.rbegin(), known.rend());
  if (static_cast<int>(known.size()) < majority()) return;
  // The majority-th highest version: at least a majority of the replicas hold it.
  const uint64_t c = known[static_cast<size_t>(majority() - 1)];
  uint64_t cur = committed.load();
  while (c > cur && !committed.compare_exchange_weak(cur, c)) {
  }
  learned.store(true);
}

int HttpStatusOf(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable: return 503;
    default: return 500;
  }
}

void SendRouterError(HttpResponder& res, int status, const std::string& message, json extra) {
  extra["error"] = {{"message", message}, {"code", status}};
  res.Send(status, "application/json", extra.dump(-1, ' ', false, json::error_handler_t::replace));
}

Status Router::Impl::Init() {
  KEEL_RETURN_IF_ERROR(options.Validate());
  int total = 0;
  for (const RouterShard& s : options.shards) total += static_cast<int>(s.replicas.size());
  RegisterMetrics();
  auto& version_gauges = metrics.AddGauge("keel_router_replica_version", "Last index version seen per replica.", {"replica"});
  for (const RouterShard& s : options.shards) {
    auto shard = std::make_unique<ShardState>();
    shard->id = s.id;
    for (const RouterReplica& r : s.replicas) {
      if (options.mode == RouterMode::kTrust) {
        if (Status st = store.AddFile(r.id, s.id, r.zone, r.public_key); !st.ok()) {
          return Status(st.code(), fmt::format("replica {}: public_key: {}", r.id, st.message()));
        }
      }
      auto rep = std::make_unique<ReplicaState>();
      rep->config = r;
      rep->info = {r.id, r.zone};
      rep->client = std::make_unique<ReplicaClient>(ParseHttpUrl(r.url).value(), options.client);
      rep->version_gauge = &version_gauges.WithLabels({r.id});
      shard->replicas.push_back(std::move(rep));
    }
    shards.push_back(std::move(shard));
  }
  verifier = std::make_unique<trust::Verifier>(options.trust);
  // Calls block a thread until the replica answers or the deadline passes, so a slow replica
  // holds threads for as long as it is slow: size for searches in flight x fan-out, not for cores
  // (a waiting thread costs a stack, no CPU). Too few threads queue every search behind the slow
  // replica's calls (measured: plain-mode p50 890 ms with one 200 ms replica at 114 queries/s).
  // Capped: a config of thousands of shards would otherwise start tens of thousands of threads
  // and abort when the system refuses one (calls beyond the pool queue; nothing waits on its own
  // pool, so a smaller pool is slower, never stuck).
  calls = std::make_unique<CallPool>(options.call_threads > 0 ? options.call_threads
                                                              : std::clamp(16 * total, 128, kMaxCallThreads));
  shard_tasks = std::make_unique<CallPool>(std::clamp(16 * static_cast<int>(shards.size()), 64, kMaxShardTasks));
  return Status::Ok();
}

void Router::Impl::RegisterMetrics() {
  requests = &metrics.AddCounter("keel_router_requests_total", "HTTP requests by route and status.", {"route", "code"});
  replies = &metrics.AddCounter("keel_trust_replies_total", "Replica search replies by outcome (valid or why discarded).", {"outcome"});
  verdicts = &metrics.AddCounter("keel_trust_verdicts_total", "Per-shard search answers by verdict.", {"verdict"});
  escalations = &metrics.AddCounter("keel_trust_escalations_total", "Extra replicas asked because the first replies did not agree.");
  catch_ups = &metrics.AddCounter("keel_router_catch_ups_total", "Replicas brought up to date from a peer's log.");
  search_seconds = &metrics.AddHistogram("keel_router_search_seconds", "Search latency at the router (fan-out, verification, merge).",
                                         ExponentialBuckets(0.0001, 2.5, 14));
  for (trust::ReplyFault f : {trust::ReplyFault::kNone, trust::ReplyFault::kUnsigned, trust::ReplyFault::kUnknownReplica,
                              trust::ReplyFault::kBadSignature, trust::ReplyFault::kReplay, trust::ReplyFault::kWrongShard,
                              trust::ReplyFault::kStale, trust::ReplyFault::kMalformed, trust::ReplyFault::kUnreachable}) {
    replies->WithLabels({std::string(trust::ReplyFaultName(f))});  // every outcome shows, at 0
  }
  verdicts->WithLabels({"verified"});
  verdicts->WithLabels({"unverified"});
}

void Router::Impl::Route(const HttpRequest& req, HttpResponder& res) {
  CountingResponder counting(res, *requests, http_router.RouteLabel(req.path));
  try {
    http_router.Dispatch(req, counting);
  } catch (const std::exception& e) {
    Log().error("vector router: {} {}: {}", req.method, req.path, e.what());
    if (counting.status() == 0) SendRouterError(counting, 500, "internal error");
  }
  counting.CountIfSilent();
}

void Router::Impl::HandleStats(const HttpRequest&, HttpResponder& res) {
  json out_shards = json::array();
  for (const auto& s : shards) {
    json reps = json::array();
    for (const auto& r : s->replicas) {
      json j = {{"id", r->info.id}, {"zone", r->info.zone}, {"url", r->config.url}, {"reachable", r->reachable.load()}};
      j["index_version"] = r->known.load() ? json(r->version.load()) : json(nullptr);
      if (!r->reachable.load()) j["error"] = r->last_error();
      reps.push_back(std::move(j));
    }
    out_shards.push_back({{"shard", s->id}, {"committed_version", s->committed.load()}, {"issued_version", s->issued.load()},
                          {"learned", s->learned.load()}, {"majority", s->majority()}, {"replicas", std::move(reps)}});
  }
  json out = {{"mode", options.mode == RouterMode::kTrust ? "trust" : "plain"},
              {"text_dim", options.text_dim},
              {"image_dim", options.image_dim},
              {"hilo_state", options.hilo ? json(options.hilo->Current().name) : json(nullptr)},
              {"shards", std::move(out_shards)}};
  if (options.mode == RouterMode::kTrust) {
    const auto& t = options.trust;
    out["trust"] = {{"quorum", t.quorum}, {"min_zones", t.min_zones}, {"threshold", t.threshold}, {"fanout", t.fanout},
                    {"depth", t.depth}, {"deadline_ms", t.deadline.count()}};
  }
  res.Send(200, "application/json", out.dump(-1, ' ', false, json::error_handler_t::replace));
}

// Every replica snapshots (and truncates its log) — what POST /v1/snapshot does on one shard.
// A replica behind its peers can no longer catch up past a truncated log (410), so the router
// first brings laggards up and refuses (409, naming them) while any replica is unreachable or
// still behind: snapshotting the others would strand it. {"force": true} snapshots anyway (a
// replica that is gone for good). The answer names any replica whose snapshot failed.
void Router::Impl::HandleSnapshot(const HttpRequest& req, HttpResponder& res) {
  bool force = false;
  if (!req.body.empty()) {
    auto body = ParseUntrustedJson(req.body, JsonLimits{.max_depth = 2, .max_values = 16, .require_object = true});
    if (!body.ok()) return SendRouterError(res, 400, body.status().message());
    if (auto f = body->find("force"); f != body->end()) {
      if (!f->is_boolean()) return SendRouterError(res, 400, "force must be true or false");
      force = f->get<bool>();
    }
  }
  if (!force) {
    std::string behind;
    for (auto& s : shards) {
      SyncShard(*s, /*catch_up=*/true);
      const uint64_t head = s->head();
      for (auto& r : s->replicas) {
        std::string why;
        if (!r->reachable.load() || !r->known.load()) {
          why = "unreachable";
        } else if (r->version.load() < head) {
          why = fmt::format("at version {} of {}", r->version.load(), head);
        }
        if (!why.empty()) behind += (behind.empty() ? "" : "; ") + r->info.id + " (" + why + ")";
      }
    }
    if (!behind.empty()) {
      return SendRouterError(res, 409,
                             "not snapshotting: a replica behind its peers cannot catch up from their logs once they "
                             "are truncated; behind: " + behind + ". Bring it up, or send {\"force\": true}");
    }
  }
  std::vector<ReplicaState*> all;
  for (auto& s : shards) {
    for (auto& r : s->replicas) all.push_back(r.get());
  }
  std::vector<std::string> failed(all.size());
  calls->RunAll(static_cast<int>(all.size()), [&](int i) {
    auto reply = all[static_cast<size_t>(i)]->client->Call("POST", "/v1/snapshot", "{}", "application/json",
                                                           DeadlineIn(options.write_timeout_ms));
    if (!reply.ok()) {
      failed[static_cast<size_t>(i)] = reply.status().message();
    } else if (reply->status != 200) {
      failed[static_cast<size_t>(i)] = "HTTP " + std::to_string(reply->status);
    }
  });
  std::string why;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!failed[i].empty()) why += (why.empty() ? "" : "; ") + all[i]->info.id + ": " + failed[i];
  }
  if (!why.empty()) return SendRouterError(res, 503, "snapshot failed on " + why);
  res.Send(200, "application/json", json{{"snapshot", "ok"}, {"replicas", all.size()}}.dump());
}

void Router::Impl::SyncLoop() {
  std::unique_lock lock(sync_mu);
  while (!stopping) {
    sync_cv.wait_for(lock, std::chrono::milliseconds(options.sync_interval_ms), [this] { return stopping; });
    if (stopping) break;
    lock.unlock();
    for (auto& s : shards) SyncShard(*s, /*catch_up=*/true);
    lock.lock();
  }
}

void Router::Impl::Stop() {
  if (stopped) return;
  stopped = true;
  if (http) http->Stop();
  {
    std::lock_guard lock(sync_mu);
    stopping = true;
  }
  sync_cv.notify_all();
  if (sync_thread.joinable()) sync_thread.join();
  // Replies still in flight (a verifier decides before every replica answered) finish within
  // their deadline; the pools run them out before the state they touch goes away.
  shard_tasks.reset();
  calls.reset();
}

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Router::~Router() { Stop(); }
void Router::Stop() { impl_->Stop(); }
int Router::port() const { return impl_->http ? impl_->http->port() : 0; }
MetricsRegistry& Router::metrics() { return impl_->metrics; }

void Router::SyncNow() {
  for (auto& s : impl_->shards) impl_->SyncShard(*s, /*catch_up=*/true);
}

Result<std::unique_ptr<Router>> Router::Start(const RouterOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  KEEL_RETURN_IF_ERROR(impl->Init());
  for (auto& s : impl->shards) impl->SyncShard(*s, /*catch_up=*/false);
  Impl* self = impl.get();
  auto bind = [self](void (Impl::*fn)(const HttpRequest&, HttpResponder&)) {
    return [self, fn](const HttpRequest& q, HttpResponder& r) { (self->*fn)(q, r); };
  };
  self->http_router.Handle("POST", "/v1/upsert", bind(&Impl::HandleUpsert));
  self->http_router.Handle("POST", "/v1/delete", bind(&Impl::HandleDelete));
  self->http_router.Handle("POST", "/v1/search", bind(&Impl::HandleSearch));
  self->http_router.Handle("GET", "/v1/stats", bind(&Impl::HandleStats));
  self->http_router.Handle("POST", "/v1/snapshot", bind(&Impl::HandleSnapshot));
  HandleHealthAndMetrics(self->http_router, self->metrics);
  HttpServerOptions h;
  h.host = options.host;
  h.port = options.port;
  h.max_connections = options.max_connections;
  h.max_active_requests = options.max_active_requests;
  h.max_body_bytes = options.max_body_bytes;
  h.server_name = "keel-vector-router";
  self->http = std::make_unique<HttpServer>(h, [self](const HttpRequest& q, HttpResponder& r) { self->Route(q, r); });
  KEEL_RETURN_IF_ERROR(self->http->Start());
  if (options.sync_interval_ms > 0) self->sync_thread = std::thread([self] { self->SyncLoop(); });
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

int RunVectorRouterMain(const std::string& config_path, const std::string& host_override, int port_override) {
  return RunVectorRouterMain(config_path, host_override, port_override, HiloLinkFlags{});
}

int RunVectorRouterMain(const std::string& config_path, const std::string& host_override, int port_override,
                        const HiloLinkFlags& hilo) {
  auto options = LoadRouterConfig(config_path);
  if (!options.ok()) {
    Log().error("{}", options.status().ToString());
    return 2;
  }
  if (!host_override.empty()) options->host = host_override;
  if (port_override >= 0) options->port = port_override;
  auto link = OpenHiloLink(hilo, options->max_active_requests);
  if (!link.ok()) {
    Log().error("vector router: hilo: {}", link.status().ToString());
    return link.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  options->hilo = *link;
  if (options->hilo) {
    Log().info("vector router: following HiLO ({}), state {}", hilo.url.empty() ? "pinned, " + hilo.catalog : hilo.url,
               options->hilo->Current().name);
  }
  auto router = Router::Start(*options);
  if (!router.ok()) {
    Log().error("vector router: {}", router.status().ToString());
    return router.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  int replicas = 0;
  for (const auto& s : options->shards) replicas += static_cast<int>(s.replicas.size());
  std::printf("keel vector-router (%s, %zu shards, %d replicas) listening on http://%s:%d\n",
              options->mode == RouterMode::kTrust ? "trust" : "plain", options->shards.size(), replicas,
              options->host.c_str(), (*router)->port());
  std::fflush(stdout);
  auto sig = WaitForTerminationSignal();
  if (sig.ok()) Log().info("vector router: {} received, draining", SignalName(*sig));
  (*router)->Stop();
  if (options->hilo) options->hilo->Stop();
  return 0;
}

}  // namespace keel::vector
