#include "keel/vector/service.h"

#include <chrono>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "keel/core/http_metrics.h"
#include "keel/core/json_reader.h"
#include "keel/core/log.h"

namespace keel::vector {

namespace {

using json = nlohmann::json;

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

Result<json> ParseBody(const HttpRequest& req, size_t max_values) {
  // Nothing in this API nests deeper than 4 (items[i].attributes); 8 leaves room.
  const JsonLimits limits{.max_depth = 8, .max_values = max_values, .require_object = true};
  JsonReadError why = JsonReadError::kNone;
  Result<json> body = ParseUntrustedJson(req.body, limits, &why);
  if (why == JsonReadError::kMalformed) {
    return Status::InvalidArgument("request body is not valid JSON: " + body.status().message());
  }
  if (why == JsonReadError::kNotObject) return Status::InvalidArgument("request body must be a JSON object");
  if (!body.ok()) return Status::InvalidArgument("request body: " + body.status().message());
  return body;
}

// JSON cannot carry NaN or Inf, but a number beyond float32's range becomes Inf once narrowed.
Status GetFloats(const json& j, const std::string& field, std::vector<float>* out) {
  if (!j.is_array()) return Status::InvalidArgument(field + " must be an array of numbers");
  out->resize(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const json& v = j[i];
    if (!v.is_number()) return Status::InvalidArgument(field + "[" + std::to_string(i) + "] is not a number");
    const float f = static_cast<float>(v.get<double>());
    if (!std::isfinite(f)) return Status::InvalidArgument(field + "[" + std::to_string(i) + "] is not a finite float32");
    (*out)[i] = f;
  }
  return Status::Ok();
}

Status GetId(const json& j, const std::string& field, uint64_t* out) {
  if (!j.is_number_unsigned()) return Status::InvalidArgument(field + " must be an unsigned integer");
  *out = j.get<uint64_t>();
  return Status::Ok();
}

Status GetStringMap(const json& j, const std::string& field, std::map<std::string, std::string>* out) {
  if (!j.is_object()) return Status::InvalidArgument(field + " must be an object of strings");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it.value().is_string()) return Status::InvalidArgument(field + "." + it.key() + " must be a string");
    (*out)[it.key()] = it.value().get<std::string>();
  }
  return Status::Ok();
}

// An integer field in [lo, hi]; absent leaves *out unchanged.
Status GetInt(const json& body, const char* name, int lo, int hi, int* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return Status::Ok();
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (!it->is_number_integer()) return Status::InvalidArgument(std::string(name) + " must be an integer in " + range);
  // Unsigned values beyond int64 read as huge; compare in the widest type first.
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return Status::InvalidArgument(std::string(name) + " must be in " + range + ", got " + it->dump());
  }
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) return Status::InvalidArgument(std::string(name) + " must be in " + range + ", got " + std::to_string(v));
  *out = static_cast<int>(v);
  return Status::Ok();
}

Status ParseItem(const json& j, size_t i, Item* item) {
  const std::string where = "items[" + std::to_string(i) + "]";
  if (!j.is_object()) return Status::InvalidArgument(where + " must be an object");
  auto id = j.find("id");
  if (id == j.end()) return Status::InvalidArgument(where + ".id is missing");
  KEEL_RETURN_IF_ERROR(GetId(*id, where + ".id", &item->id));
  auto text = j.find("text");
  if (text == j.end()) return Status::InvalidArgument(where + ".text is missing");
  KEEL_RETURN_IF_ERROR(GetFloats(*text, where + ".text", &item->text));
  if (auto image = j.find("image"); image != j.end() && !image->is_null()) {
    KEEL_RETURN_IF_ERROR(GetFloats(*image, where + ".image", &item->image));
  }
  if (auto attrs = j.find("attributes"); attrs != j.end() && !attrs->is_null()) {
    KEEL_RETURN_IF_ERROR(GetStringMap(*attrs, where + ".attributes", &item->attributes));
  }
  return Status::Ok();
}

Status ParseSearch(const json& body, int max_k, SearchRequest* r) {
  if (auto kind = body.find("kind"); kind != body.end()) {
    if (!kind->is_string()) return Status::InvalidArgument("kind must be a string (text, multimodal, image)");
    KEEL_ASSIGN_OR_RETURN(r->kind, ParseQueryKind(kind->get<std::string>()));
  }
  if (auto t = body.find("text"); t != body.end() && !t->is_null()) KEEL_RETURN_IF_ERROR(GetFloats(*t, "text", &r->text_query));
  if (auto t = body.find("image"); t != body.end() && !t->is_null()) KEEL_RETURN_IF_ERROR(GetFloats(*t, "image", &r->image_query));
  if (auto ids = body.find("ids"); ids != body.end() && !ids->is_null()) {
    if (!ids->is_array()) return Status::InvalidArgument("ids must be an array of unsigned integers");
    if (ids->size() > static_cast<size_t>(max_k)) {
      return Status::InvalidArgument("ids holds " + std::to_string(ids->size()) + " entries, at most " + std::to_string(max_k));
    }
    r->ids.resize(ids->size());
    for (size_t i = 0; i < ids->size(); ++i) KEEL_RETURN_IF_ERROR(GetId((*ids)[i], "ids[" + std::to_string(i) + "]", &r->ids[i]));
  }
  KEEL_RETURN_IF_ERROR(GetInt(body, "k", 1, max_k, &r->k));
  KEEL_RETURN_IF_ERROR(GetInt(body, "ef", 0, 1 << 16, &r->ef));
  KEEL_RETURN_IF_ERROR(GetInt(body, "nprobe", 0, 1 << 20, &r->nprobe));
  if (auto f = body.find("filter"); f != body.end() && !f->is_null()) KEEL_RETURN_IF_ERROR(GetStringMap(*f, "filter", &r->filter));
  if (auto v = body.find("include_vectors"); v != body.end() && !v->is_null()) {
    if (!v->is_boolean()) return Status::InvalidArgument("include_vectors must be true or false");
    r->include_vectors = v->get<bool>();
  }
  if (r->kind != QueryKind::kImage && r->text_query.empty()) return Status::InvalidArgument("text is required for kind " + std::string(r->kind == QueryKind::kText ? "text" : "multimodal"));
  return Status::Ok();
}


}  // namespace

Result<std::unique_ptr<Service>> Service::Start(const ServiceOptions& options) {
  std::unique_ptr<Service> s(new Service());
  s->options_ = options;
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
  s->router_.Handle("GET", "/healthz", [](const HttpRequest&, HttpResponder& r) {
    r.Send(200, "application/json", R"({"status":"ok"})");
  });
  s->router_.Handle("GET", "/metrics", [self](const HttpRequest&, HttpResponder& r) {
    r.Send(200, MetricsRegistry::kContentType, self->metrics_.Render());
  });
  HttpServerOptions h;
  h.host = options.host;
  h.port = options.port;
  h.max_connections = options.max_connections;
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
  // The route label takes only the fixed set of known paths; anything else is "other".
  CountingResponder counting(res, *requests_, router_.HasPath(req.path) ? req.path : "other");
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
  auto body = ParseBody(req, options_.max_json_values);
  if (!body.ok()) return SendStatus(res, body.status());
  auto items = body->find("items");
  if (items == body->end() || !items->is_array()) return SendBad(res, "items must be an array");
  std::vector<Item> parsed(items->size());
  for (size_t i = 0; i < parsed.size(); ++i) {
    if (Status s = ParseItem((*items)[i], i, &parsed[i]); !s.ok()) return SendStatus(res, s);
  }
  if (Status s = shard_->Upsert(parsed); !s.ok()) return SendStatus(res, s);
  if (Status s = MaybeSnapshot(); !s.ok()) return SendStatus(res, s);
  res.Send(200, "application/json", Dump({{"upserted", parsed.size()}}));
}

void Service::HandleDelete(const HttpRequest& req, HttpResponder& res) {
  auto body = ParseBody(req, options_.max_json_values);
  if (!body.ok()) return SendStatus(res, body.status());
  auto ids = body->find("ids");
  if (ids == body->end() || !ids->is_array()) return SendBad(res, "ids must be an array of unsigned integers");
  std::vector<uint64_t> parsed(ids->size());
  for (size_t i = 0; i < parsed.size(); ++i) {
    if (Status s = GetId((*ids)[i], "ids[" + std::to_string(i) + "]", &parsed[i]); !s.ok()) return SendStatus(res, s);
  }
  if (Status s = shard_->Delete(parsed); !s.ok()) return SendStatus(res, s);
  if (Status s = MaybeSnapshot(); !s.ok()) return SendStatus(res, s);
  res.Send(200, "application/json", Dump({{"deleted", parsed.size()}}));
}

void Service::HandleSearch(const HttpRequest& req, HttpResponder& res) {
  auto body = ParseBody(req, options_.max_json_values);
  if (!body.ok()) return SendStatus(res, body.status());
  SearchRequest r;
  if (Status s = ParseSearch(*body, shard_->options().max_k, &r); !s.ok()) return SendStatus(res, s);
  const auto t0 = std::chrono::steady_clock::now();
  auto result = shard_->Search(r);
  if (!result.ok()) return SendStatus(res, result.status());
  search_seconds_->Get().Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (result->trace.tiers_touched > 1) cross_tier_->Get().Inc();
  json hits = json::array();
  for (const SearchHit& h : result->hits) {
    json j = {{"id", h.id}};
    if (r.kind != QueryKind::kImage) j["text_distance"] = h.text_distance;
    if (!r.image_query.empty()) j["image_distance"] = h.image_distance;
    if (!h.text.empty()) j["text"] = h.text;
    if (!h.image.empty()) j["image"] = h.image;
    hits.push_back(std::move(j));
  }
  json out = {{"hits", std::move(hits)},
              {"tiers_touched", result->trace.tiers_touched},
              {"search_us", result->search_ns / 1000},
              {"fetch_us", result->fetch_ns / 1000}};
  res.Send(200, "application/json", Dump(out));
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
