#include "keel/vector/service.h"

#include <charconv>
#include <chrono>
#include <optional>
#include <thread>
#include <unordered_map>
#include <nlohmann/json.hpp>

#include "keel/core/http_metrics.h"
#include "keel/core/log.h"
#include "keel/vector/hilo_link.h"
#include "keel/vector/wire.h"

namespace keel::vector {

namespace {

using json = nlohmann::json;

constexpr size_t kDefaultLogReadBytes = size_t{64} << 20;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

int HttpStatusOf(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable: return 503;
    default: return 500;
  }
}

void SendStatus(HttpResponder& res, const Status& s) {
  res.Send(HttpStatusOf(s), "application/json", DefaultHttpErrorBody(HttpStatusOf(s), s.message()));
}

void SendBad(HttpResponder& res, const std::string& message) { SendStatus(res, Status::InvalidArgument(message)); }

// {"error":{"message":..,"code":..},"version":cur}: every write answer says where the replica is.
void SendWriteError(HttpResponder& res, int code, const std::string& message, uint64_t version,
                    std::optional<uint64_t> applied = std::nullopt) {
  json out = {{"error", {{"message", message}, {"code", code}}}, {"version", version}};
  if (applied) out["applied"] = *applied;
  res.Send(code, "application/json", Dump(out));
}

// An unsigned decimal query parameter, e.g. after=12 in "after=12&max_bytes=4096".
Status QueryUnsigned(std::string_view query, std::string_view name, std::optional<uint64_t>* out) {
  out->reset();
  while (!query.empty()) {
    const size_t amp = query.find('&');
    std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (pair.substr(0, eq) != name) continue;
    std::string_view v = eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
    uint64_t n = 0;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
      return Status::InvalidArgument(std::string(name) + " must be an unsigned integer");
    }
    *out = n;
  }
  return Status::Ok();
}

Status ValidateIdentity(const ReplicaIdentity& id) {
  if (id.shards < 1) return Status::InvalidArgument("vector service: shards must be >= 1");
  if (id.shard >= id.shards) {
    return Status::InvalidArgument("vector service: shard id " + std::to_string(id.shard) + " must be < shards (" + std::to_string(id.shards) + ")");
  }
  for (const auto& [what, label] : {std::pair{"replica id", &id.replica}, std::pair{"zone", &id.zone}}) {
    if (label->empty() || label->size() > trust::kMaxLabelBytes) {
      return Status::InvalidArgument(std::string("vector service: ") + what + " must be 1.." + std::to_string(trust::kMaxLabelBytes) + " bytes");
    }
  }
  return id.adversary.Validate();
}

}  // namespace

Result<std::unique_ptr<Service>> Service::Start(const ServiceOptions& options) {
  std::unique_ptr<Service> s(new Service());
  s->options_ = options;
  KEEL_RETURN_IF_ERROR(ValidateIdentity(options.identity));
  if (options.identity.signing_key) {
    s->key_ = options.identity.signing_key;
  } else if (!options.identity.signing_key_path.empty()) {
    KEEL_ASSIGN_OR_RETURN(auto key, trust::SigningKey::Load(options.identity.signing_key_path));
    s->key_ = std::make_shared<const trust::SigningKey>(std::move(key));
  }
  KEEL_ASSIGN_OR_RETURN(s->shard_, Shard::Open(options.shard));
  s->RegisterMetrics();
  if (options.placer) {
    s->placer_ = std::make_unique<coloc::Placer>(&s->shard_->store(), &s->shard_->query_log(), options.placer_options);
    s->placer_->Start();
  }
  Service* self = s.get();
  auto bind = [self](void (Service::*fn)(const HttpRequest&, HttpResponder&)) {
    return [self, fn](const HttpRequest& q, HttpResponder& r) { (self->*fn)(q, r); };
  };
  s->router_.Handle("POST", "/v1/upsert", bind(&Service::HandleUpsert));
  s->router_.Handle("POST", "/v1/delete", bind(&Service::HandleDelete));
  s->router_.Handle("POST", "/v1/search", bind(&Service::HandleSearch));
  s->router_.Handle("POST", "/v1/snapshot", bind(&Service::HandleSnapshot));
  s->router_.Handle("GET", "/v1/stats", bind(&Service::HandleStats));
  s->router_.Handle("GET", "/v1/log", bind(&Service::HandleLogRead));
  s->router_.Handle("POST", "/v1/log", bind(&Service::HandleLogApply));
  HandleHealthAndMetrics(s->router_, s->metrics_);
  HttpServerOptions h;
  h.host = options.host;
  h.port = options.port;
  h.max_connections = options.max_connections;
  h.max_active_requests = options.max_active_requests;
  h.max_body_bytes = options.max_body_bytes;
  h.server_name = "keel-vector";
  s->http_ = std::make_unique<HttpServer>(h, [self](const HttpRequest& q, HttpResponder& r) { self->Route(q, r); });
  KEEL_RETURN_IF_ERROR(s->http_->Start());
  return s;
}

Service::~Service() { Stop(); }

Status Service::Stop() {
  if (stopped_) return Status::Ok();
  stopped_ = true;
  if (http_) http_->Stop();
  if (placer_) placer_->Stop();
  if (!options_.snapshot_on_stop || !shard_) return Status::Ok();
  Status s = shard_->Snapshot();
  if (!s.ok()) Log().error("vector service: snapshot on stop failed: {}", s.ToString());
  return s;
}

void Service::RegisterMetrics() {
  requests_ = &metrics_.AddCounter("keel_vector_requests_total", "HTTP requests by route and status.", {"route", "code"});
  search_seconds_ = &metrics_.AddHistogram("keel_vector_search_seconds", "Search latency (index + tier fetches).",
                                           ExponentialBuckets(0.0001, 2.5, 12));
  cross_tier_ = &metrics_.AddCounter("keel_vector_cross_tier_searches_total", "Searches whose fetches touched more than one tier.");
  Shard* shard = shard_.get();
  metrics_.AddGauge("keel_vector_items", "Items in the shard.").Get().SetCallback([shard] {
    return static_cast<double>(shard->Stats().items);
  });
  metrics_.AddGauge("keel_vector_index_version", "Writes applied to the shard (its index version).").Get().SetCallback([shard] {
    return static_cast<double>(shard->version());
  });
  if (hilo::ServiceLink* link = options_.hilo.get()) {
    metrics_.AddGauge("keel_vector_hilo_state", "Index of the HiLO state the searches apply (0 = full quality).")
        .Get().SetCallback([link] { return static_cast<double>(link->CurrentIndex()); });
  }
  auto& items = metrics_.AddGauge("keel_vector_tier_items", "Vectors placed in each tier.", {"tier"});
  auto& bytes = metrics_.AddGauge("keel_vector_tier_bytes", "Vector payload bytes placed in each tier.", {"tier"});
  coloc::TieredStore* store = &shard_->store();
  for (int t = 0; t < store->tier_count(); ++t) {
    const std::string name(store->tier_name(t));
    auto usage = [store, t] {
      auto u = store->Usage();
      return static_cast<size_t>(t) < u.size() ? u[t] : coloc::TierUsage{};
    };
    items.WithLabels({name}).SetCallback([usage] { return static_cast<double>(usage().items); });
    bytes.WithLabels({name}).SetCallback([usage] { return static_cast<double>(usage().bytes); });
  }
}

void Service::Route(const HttpRequest& req, HttpResponder& res) {
  CountingResponder counting(res, *requests_, router_.RouteLabel(req.path));
  try {
    router_.Dispatch(req, counting);
  } catch (const std::exception& e) {
    // Nothing below should throw; a bug must not take the connection thread down.
    Log().error("vector service: {} {}: {}", req.method, req.path, e.what());
    if (counting.status() == 0) SendStatus(counting, Status::Internal("internal error"));
  }
  counting.CountIfSilent();
}

void Service::HandleUpsert(const HttpRequest& req, HttpResponder& res) {
  auto body = wire::ParseBody(req.body, options_.max_json_values);
  std::vector<Item> items;
  std::optional<uint64_t> version;
  Status parsed = body.status();
  if (parsed.ok()) parsed = wire::ParseItems(*body, &items);
  if (parsed.ok()) parsed = wire::ParseWriteVersion(*body, &version);
  ApplyWrite(res, parsed, [&](WriteOutcome* o) { return shard_->Upsert(items, version, o); }, "upserted", items.size());
}

void Service::HandleDelete(const HttpRequest& req, HttpResponder& res) {
  auto body = wire::ParseBody(req.body, options_.max_json_values);
  std::vector<uint64_t> ids;
  std::optional<uint64_t> version;
  Status parsed = body.status();
  if (parsed.ok()) parsed = wire::ParseIds(*body, &ids);
  if (parsed.ok()) parsed = wire::ParseWriteVersion(*body, &version);
  ApplyWrite(res, parsed, [&](WriteOutcome* o) { return shard_->Delete(ids, version, o); }, "deleted", ids.size());
}

// The rest of a write once its body is parsed: apply (with the duplicate/gap rules of a versioned
// write), snapshot when the log has grown past its bound, answer with the version.
void Service::ApplyWrite(HttpResponder& res, const Status& parsed, const std::function<Status(WriteOutcome*)>& apply,
                         const char* count_name, size_t count) {
  if (!parsed.ok()) return SendWriteError(res, HttpStatusOf(parsed), parsed.message(), shard_->version());
  WriteOutcome o;
  if (Status s = apply(&o); !s.ok()) return SendWriteError(res, o.gap ? 409 : HttpStatusOf(s), s.message(), o.version);
  if (o.duplicate) {
    res.Send(200, "application/json", Dump({{"version", o.version}, {"duplicate", true}}));
    return;
  }
  if (Status s = MaybeSnapshot(); !s.ok()) return SendWriteError(res, HttpStatusOf(s), s.message(), o.version);
  res.Send(200, "application/json", Dump({{count_name, count}, {"version", o.version}}));
}

void Service::HandleSearch(const HttpRequest& req, HttpResponder& res) {
  hilo::ServiceLink* link = options_.hilo.get();
  if (link == nullptr) return Search(req, res, nullptr);
  if (!options_.hilo_meter) return Search(req, res, &link->Current());
  hilo::LoadMeter& meter = link->meter();
  FoldServerRejections(meter);
  // No queue of its own: a request that reaches a handler is being served (the server sheds the
  // rest), so it starts as it arrives.
  meter.Arrive();
  meter.Started();
  const auto t0 = std::chrono::steady_clock::now();
  Search(req, res, &link->Current());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  meter.Finish(seconds, seconds);  // the handler thread is busy for the whole search
}

// The server answers 503 itself when every handler thread (or every connection) is busy; those
// requests are searches refused for overload as far as HiLO can tell, so each counts as one shed
// arrival. Folded in here because no handler runs for them.
void Service::FoldServerRejections(hilo::LoadMeter& meter) {
  const int64_t rejected = http_->connection_stats().rejected;
  int64_t seen = rejections_seen_.load();
  while (rejected > seen) {
    if (rejections_seen_.compare_exchange_weak(seen, rejected)) {
      for (int64_t i = seen; i < rejected; ++i) {
        meter.Arrive();
        meter.Shed();
      }
      return;
    }
  }
}

void Service::Search(const HttpRequest& req, HttpResponder& res, const hilo::State* state) {
  auto body = wire::ParseBody(req.body, options_.max_json_values);
  if (!body.ok()) return SendStatus(res, body.status());
  SearchRequest r;
  std::string nonce;
  if (Status s = wire::ParseSearchRequest(*body, shard_->options().max_k, &r); !s.ok()) return SendStatus(res, s);
  if (Status s = wire::ParseNonce(*body, &nonce); !s.ok()) return SendStatus(res, s);
  const ReplicaIdentity& id = options_.identity;
  const trust::Adversary& adversary = id.adversary;
  const bool tamper = adversary.mode != trust::AdversaryMode::kHonest;
  // The digest covers the request as the client sent it (its k), not what the adversary asks.
  trust::QueryDigest digest;
  if (key_ || tamper) digest = trust::DigestQuery(r, nonce);
  const bool targeted = tamper && adversary.Targets(digest);
  if (const int most = std::max(shard_->options().max_k, shard_->options().rerank); r.rerank > most) {
    // Refused whatever the level: a level with rerank off would otherwise hide the client's error.
    return SendBad(res, "rerank must be in [-1, " + std::to_string(most) + "], got " + std::to_string(r.rerank));
  }
  SearchRequest asked = r;
  if (state != nullptr) ApplyVectorLevel(state->vector, &asked);
  const int level_k = asked.k;  // what the answer may hold: the client's k, capped by the level
  if (targeted && r.kind != QueryKind::kImage) asked.k = std::min(level_k + adversary.ExtraHits(), shard_->options().max_k);
  if (targeted && adversary.mode == trust::AdversaryMode::kSlow) std::this_thread::sleep_for(adversary.delay);

  const auto t0 = std::chrono::steady_clock::now();
  auto result = shard_->Search(asked);
  if (!result.ok()) return SendStatus(res, result.status());
  search_seconds_->Get().Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (result->trace.tiers_touched > 1) cross_tier_->Get().Inc();

  json hits = json::array();
  uint64_t version = result->index_version;
  std::vector<trust::SignedHit> signed_hits;
  if (key_ || tamper) {
    signed_hits.reserve(result->hits.size());
    for (const SearchHit& h : result->hits) signed_hits.push_back(trust::ToSignedHit(h));
    if (tamper) {
      // An image lookup answers every id it found, not k of them.
      const int k = r.kind == QueryKind::kImage ? static_cast<int>(signed_hits.size()) : level_k;
      auto in_shard = [&id](uint64_t item) { return trust::ShardOf(item, id.shards) == id.shard; };
      adversary.Apply(digest, k, in_shard, &signed_hits, &version);
    }
    // The answer shows what was signed; vectors come with the ids the shard really returned.
    std::unordered_map<uint64_t, const SearchHit*> honest;
    for (const SearchHit& h : result->hits) honest.emplace(h.id, &h);
    for (const trust::SignedHit& sh : signed_hits) {
      SearchHit h;
      h.id = sh.id;
      h.text_distance = sh.text_distance;
      h.image_distance = sh.image_distance;
      if (auto it = honest.find(sh.id); it != honest.end()) {
        h.text = it->second->text;
        h.image = it->second->image;
      }
      hits.push_back(wire::HitJson(h, r));
    }
  } else {
    for (const SearchHit& h : result->hits) hits.push_back(wire::HitJson(h, r));
  }
  json out = {{"hits", std::move(hits)},
              {"index_version", version},
              {"tiers_touched", result->trace.tiers_touched},
              {"search_us", result->search_ns / 1000},
              {"fetch_us", result->fetch_ns / 1000}};
  if (key_) {
    trust::ReplyBody reply{id.shard, id.replica, id.zone, version, digest, std::move(signed_hits)};
    const std::string signature = trust::SignReply(*key_, reply);
    out["trust"] = wire::TrustJson(reply, signature);
  }
  if (state == nullptr) {
    res.Send(200, "application/json", Dump(out));
  } else {
    res.Send(200, "application/json", Dump(out), {{"x-keel-hilo-state", state->name}});
  }
}

void Service::HandleLogRead(const HttpRequest& req, HttpResponder& res) {
  std::optional<uint64_t> after, max_bytes;
  if (Status s = QueryUnsigned(req.query, "after", &after); !s.ok()) return SendStatus(res, s);
  if (Status s = QueryUnsigned(req.query, "max_bytes", &max_bytes); !s.ok()) return SendStatus(res, s);
  if (!after) return SendBad(res, "after is required (GET /v1/log?after=VERSION)");
  if (max_bytes && (*max_bytes < 1 || *max_bytes > (uint64_t{1} << 40))) return SendBad(res, "max_bytes must be in [1, 2^40]");
  LogRead log;
  Status s = shard_->ReadLog(*after, max_bytes ? static_cast<size_t>(*max_bytes) : kDefaultLogReadBytes, &log);
  if (log.truncated) return SendWriteError(res, 410, s.message(), log.version);
  if (!s.ok()) return SendStatus(res, s);
  res.Send(200, "application/octet-stream", std::move(log.bytes),
           {{"X-Keel-Log-Version", std::to_string(log.version)},
            {"X-Keel-Log-Start", std::to_string(log.log_start)},
            {"X-Keel-Log-Records", std::to_string(log.records)}});
}

void Service::HandleLogApply(const HttpRequest& req, HttpResponder& res) {
  LogApplied a;
  if (Status s = shard_->ApplyLog(req.body, &a); !s.ok()) {
    return SendWriteError(res, a.gap ? 409 : HttpStatusOf(s), s.message(), a.version, a.applied);
  }
  if (Status s = MaybeSnapshot(); !s.ok()) return SendWriteError(res, HttpStatusOf(s), s.message(), a.version, a.applied);
  res.Send(200, "application/json", Dump({{"version", a.version}, {"applied", a.applied}, {"skipped", a.skipped}}));
}

Status Service::MaybeSnapshot() {
  if (options_.snapshot_wal_bytes <= 0 || shard_->Stats().wal_bytes < options_.snapshot_wal_bytes) return Status::Ok();
  if (snapshotting_.exchange(true)) return Status::Ok();  // another request is on it
  Status s = shard_->Snapshot();
  snapshotting_ = false;
  return s;
}

void Service::HandleSnapshot(const HttpRequest&, HttpResponder& res) {
  if (Status s = shard_->Snapshot(); !s.ok()) return SendStatus(res, s);
  res.Send(200, "application/json", R"({"snapshot":"ok"})");
}

void Service::HandleStats(const HttpRequest&, HttpResponder& res) {
  ShardStats st = shard_->Stats();
  json tiers = json::array();
  for (const auto& t : st.tiers) {
    tiers.push_back({{"name", t.name}, {"items", t.items}, {"bytes", t.bytes}, {"capacity_bytes", t.capacity_bytes},
                     {"measured_read_us", t.measured_read_us}, {"measured_batch_us", t.measured_batch_us},
                     {"reads", t.reads}});
  }
  const ShardOptions& o = shard_->options();
  json out = {{"items", st.items},
              {"deleted_pending", st.deleted_pending},
              {"wal_bytes", st.wal_bytes},
              {"searches", st.searches},
              {"cross_tier_searches", st.cross_tier_searches},
              {"index", IndexKindName(o.index.kind)},
              {"text_dim", o.text_dim},
              {"image_dim", o.image_dim},
              {"query_log", shard_->query_log().size()},
              {"shard", options_.identity.shard},
              {"shards", options_.identity.shards},
              {"replica", options_.identity.replica},
              {"zone", options_.identity.zone},
              {"index_version", st.index_version},
              {"log_start_version", st.log_start_version},
              {"signed", key_ != nullptr},
              {"hilo_state", options_.hilo ? json(options_.hilo->Current().name) : json(nullptr)},
              {"tiers", std::move(tiers)}};
  if (placer_) {
    coloc::PlacerStats p = placer_->stats();
    out["placer"] = {{"policy", coloc::PlacementPolicyName(options_.placer_options.policy)},
                     {"rounds", p.rounds}, {"moves", p.moves}, {"move_errors", p.move_errors},
                     {"last_compute_ms", p.last_compute_ms}, {"last_migrate_ms", p.last_migrate_ms}};
  }
  res.Send(200, "application/json", Dump(out));
}

}  // namespace keel::vector
