#include "keel/hilo/validate/replay_live.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "keel/answer/quality.h"
#include "keel/core/http_client.h"
#include "keel/core/json_reader.h"
#include "keel/core/json_writer.h"

namespace keel::hilo {
namespace {

constexpr int kCallTimeoutMs = 5000;
constexpr int64_t kFreshMs = 3000;  // an instance unheard this long is not counted in a sample

Result<nlohmann::json> ParseObject(std::string_view text) {
  JsonLimits limits;
  limits.require_object = true;
  limits.max_depth = 8;
  return ParseUntrustedJson(text, limits);
}

void AppendCsvField(std::string_view s, std::string* out) {
  // State names are [A-Za-z0-9_.:-] (catalog rule), so no quoting is needed; guard anyway.
  for (char c : s) out->push_back(c == ',' || c == '\n' || c == '"' ? '_' : c);
}

}  // namespace

std::string WriteReferenceLine(int query, const answer::ReplayedAnswer& a) {
  std::string line = "{\"query\":";
  AppendJsonNumber(static_cast<int64_t>(query), &line);
  line += ",\"retrieved\":[";
  for (size_t i = 0; i < a.retrieved.size(); ++i) {
    if (i > 0) line += ',';
    line += std::to_string(a.retrieved[i]);
  }
  line += "],\"content\":";
  AppendJsonString(a.content, &line);
  line += '}';
  return line;
}

Result<std::vector<answer::ReplayedAnswer>> ParseReferences(std::string_view text, size_t n_queries) {
  if (text.size() > kMaxReferenceFileBytes) {
    return Status::InvalidArgument(fmt::format("references: file larger than {} bytes", kMaxReferenceFileBytes));
  }
  if (n_queries == 0) return Status::InvalidArgument("references: no evaluation queries to score");
  std::vector<answer::ReplayedAnswer> out(n_queries);
  std::vector<bool> seen(n_queries, false);
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    auto where = [&](std::string_view what) {
      return Status::InvalidArgument(fmt::format("references line {}: {}", line_no, what));
    };
    if (line.size() > kMaxReferenceLineBytes) return where(fmt::format("longer than {} bytes", kMaxReferenceLineBytes));
    auto j = ParseObject(line);
    if (!j.ok()) return where(j.status().message());
    const auto q = j->find("query");
    if (q == j->end() || !q->is_number_integer()) return where("\"query\": expected an integer");
    const int64_t idx = q->get<int64_t>();
    if (idx < 0) return where("\"query\": negative index");
    const auto r = j->find("retrieved");
    if (r == j->end() || !r->is_array()) return where("\"retrieved\": expected an array of ids");
    const auto c = j->find("content");
    if (c == j->end() || !c->is_string()) return where("\"content\": expected a string");
    answer::ReplayedAnswer a;
    a.status = 200;
    for (const auto& id : *r) {
      if (!id.is_number_unsigned()) return where("\"retrieved\": ids must be non-negative integers");
      a.retrieved.push_back(id.get<uint64_t>());
    }
    a.content = c->get<std::string>();
    if (static_cast<uint64_t>(idx) >= n_queries) continue;
    if (seen[static_cast<size_t>(idx)]) return where(fmt::format("query {} appears twice", idx));
    seen[static_cast<size_t>(idx)] = true;
    out[static_cast<size_t>(idx)] = std::move(a);
  }
  for (size_t i = 0; i < n_queries; ++i) {
    if (!seen[i]) {
      return Status::InvalidArgument(fmt::format("references: query {} missing (the file must cover the first {} "
                                                 "queries; rewrite it with --write-references over as many)",
                                                 i, n_queries));
    }
  }
  return out;
}

double ScoreAnswer(const answer::EvalQuery& query, const answer::ReplayedAnswer& reference,
                   const answer::ReplayedAnswer& a) {
  if (a.status != 200) return 0;
  return answer::RequestQuality(answer::RecallAt10(a.retrieved, query.truth), answer::WordF1(a.content, reference.content));
}

double FullQuality(std::span<const answer::EvalQuery> eval, std::span<const answer::ReplayedAnswer> references) {
  if (eval.empty() || eval.size() != references.size()) return 0;
  double sum = 0;
  for (size_t i = 0; i < eval.size(); ++i) sum += ScoreAnswer(eval[i], references[i], references[i]);
  return sum / static_cast<double>(eval.size());
}

Status ParseStateReply(std::string_view body, size_t n_states, StateSample* out) {
  auto j = ParseObject(body);
  if (!j.ok()) return Status::InvalidArgument("controller /v1/state: " + j.status().message());
  const auto i = j->find("index");
  const auto s = j->find("state");
  if (i == j->end() || !i->is_number_integer() || s == j->end() || !s->is_string()) {
    return Status::InvalidArgument("controller /v1/state: expected integer \"index\" and string \"state\"");
  }
  const int64_t idx = i->get<int64_t>();
  if (idx < 0 || static_cast<size_t>(idx) >= n_states) {
    return Status::InvalidArgument(fmt::format("controller /v1/state: index {} outside the catalog's {} states", idx, n_states));
  }
  out->index = static_cast<int>(idx);
  out->name = s->get<std::string>();
  return Status::Ok();
}

Status ParseServicesReply(std::string_view body, const Catalog& catalog, int64_t fresh_ms, StateSample* out) {
  auto j = ParseObject(body);
  if (!j.ok()) return Status::InvalidArgument("controller /v1/services: " + j.status().message());
  const auto list = j->find("services");
  if (list == j->end() || !list->is_array()) return Status::InvalidArgument("controller /v1/services: no services array");
  out->applied.fill(-1);
  for (const auto& e : *list) {
    if (!e.is_object()) continue;
    const auto svc = e.find("service");
    const auto st = e.find("applied_state");
    const auto age = e.find("age_ms");
    if (svc == e.end() || !svc->is_string() || st == e.end() || !st->is_string()) continue;
    if (age != e.end() && age->is_number() && age->get<double>() > static_cast<double>(fresh_ms)) continue;
    const auto s = ServiceFromName(svc->get<std::string>());
    if (!s) continue;
    const std::string name = st->get<std::string>();
    for (size_t k = 0; k < catalog.states.size(); ++k) {
      if (catalog.states[k].name == name) {
        int& slot = out->applied[static_cast<size_t>(*s)];
        slot = std::max(slot, static_cast<int>(k));
        break;
      }
    }
  }
  return Status::Ok();
}

void TallyStates(double tick_s, LiveResult* r) {
  r->time_in_state_s.assign(r->state_names.size(), 0.0);
  r->transitions = 0;
  int last = -1;
  for (const StateSample& s : r->samples) {
    // No product state (per-service policy): the cheapest level any service applied, as the
    // simulation counts its baseline.
    const int index = s.index >= 0 ? s.index : *std::max_element(s.applied.begin(), s.applied.end());
    if (index < 0 || static_cast<size_t>(index) >= r->state_names.size()) continue;
    r->time_in_state_s[static_cast<size_t>(index)] += tick_s;
    if (last >= 0 && index != last) ++r->transitions;
    last = index;
  }
}

Result<LiveResult> RunLiveReplay(const LiveOptions& o) {
  if (o.eval.empty()) return Status::InvalidArgument("replay: empty evaluation set");
  if (o.references.size() != o.eval.size()) {
    return Status::InvalidArgument(fmt::format("replay: {} references for {} queries", o.references.size(), o.eval.size()));
  }
  if (!(o.baseline_rate > 0) || o.baseline_rate > 1e5) return Status::InvalidArgument("replay: baseline rate must be in (0, 1e5]");
  if (!(o.time_scale > 0) || o.time_scale > 100) return Status::InvalidArgument("replay: time scale must be in (0, 100]");
  if (!(o.slo_ms > 0)) return Status::InvalidArgument("replay: slo_ms must be > 0");
  if (!(o.warmup_s >= 0) || o.warmup_s > 3600) return Status::InvalidArgument("replay: warmup must be in [0, 3600] s");
  if (!(o.window_s > 0) || o.window_s > o.trace.duration_s) {
    return Status::InvalidArgument("replay: window must be > 0 and at most the trace's duration");
  }
  KEEL_ASSIGN_OR_RETURN(HttpEndpoint aep, ParseHttpUrl(o.answer_url));
  HttpClientOptions ao;
  ao.max_idle_connections = std::max(16, o.workers);
  HttpClient answer_client(aep, ao);

  LiveResult r;
  r.trace = o.trace.name;
  r.peak = o.trace.Peak();
  r.full_quality = FullQuality(o.eval, o.references);
  std::unique_ptr<HttpClient> controller;
  Catalog catalog;
  if (!o.controller_url.empty()) {
    KEEL_ASSIGN_OR_RETURN(HttpEndpoint cep, ParseHttpUrl(o.controller_url));
    controller = std::make_unique<HttpClient>(cep);
    KEEL_ASSIGN_OR_RETURN(HttpReply cr, controller->Call("GET", "/v1/catalog", "", "", DeadlineIn(kCallTimeoutMs)));
    if (cr.status != 200) return Status::Unavailable(fmt::format("controller /v1/catalog: HTTP {}", cr.status));
    KEEL_ASSIGN_OR_RETURN(catalog, ParseCatalog(cr.body));
    r.limit = catalog.max_quality_drop;
    for (const State& s : catalog.states) r.state_names.push_back(s.name);
  }

  // Sample about twice per window, at most once per real second (the controller decides every
  // few hundred ms; sampling faster only adds load to a machine that is being measured).
  const double tick_real = std::clamp(o.window_s * o.time_scale / 2, 0.1, 1.0);
  std::mutex mu;
  OpenLoopOptions lo;
  // baseline_rate is real req/s at 1x: the product's capacity is in real req/s, so a compressed
  // replay (time_scale < 1) keeps the load and sends fewer requests per trace second.
  lo.baseline_rate = o.baseline_rate * o.time_scale;
  lo.time_scale = o.time_scale;
  lo.seed = o.seed;
  lo.workers = o.workers;
  lo.tick_s = tick_real;
  lo.on_tick = [&](double elapsed_s) {
    if (!controller) return;
    StateSample s;
    s.t_s = elapsed_s / o.time_scale;
    auto st = controller->Call("GET", "/v1/state", "", "", DeadlineIn(kCallTimeoutMs));
    if (st.ok() && st->status == 200) (void)ParseStateReply(st->body, catalog.states.size(), &s);
    auto sv = controller->Call("GET", "/v1/services", "", "", DeadlineIn(kCallTimeoutMs));
    if (sv.ok() && sv->status == 200) (void)ParseServicesReply(sv->body, catalog, kFreshMs, &s);
    std::lock_guard<std::mutex> lock(mu);
    r.samples.push_back(std::move(s));
  };
  answer::ReplayOptions ro = o.replay;
  // A request far past the SLO scores 0 anyway; do not hold a worker for it much longer.
  ro.timeout_ms = static_cast<int>(std::min<double>(ro.timeout_ms, o.slo_ms * 4));
  const size_t n = o.eval.size();
  const IssueFn issue = [&](int64_t seq, Outcome& out) {
    const size_t q = static_cast<size_t>(seq) % n;
    const answer::ReplayedAnswer a = answer::AskOne(answer_client, o.eval[q], ro);
    out.status = a.status;
    out.state = a.state;
    out.quality = ScoreAnswer(o.eval[q], o.references[q], a);
  };
  if (o.warmup_s > 0) {
    Trace flat;
    flat.name = "warmup";
    flat.duration_s = o.warmup_s;
    // Up from a tenth of 1x over the first third, then 1x: a jump from zero to 1x is a burst of
    // its own at a cold engine (a queue while the services' rate windows still hold idle time),
    // and the per-service baseline stepped down on it before the trace began (docs/hilo.md).
    flat.points = {{0, 0.1}, {o.warmup_s / 3, 1}, {o.warmup_s, 1}};
    OpenLoopOptions wo = lo;
    wo.baseline_rate = o.baseline_rate;
    wo.time_scale = 1;
    wo.seed = o.seed ^ 0x9e3779b97f4a7c15ULL;
    wo.on_tick = nullptr;
    KEEL_ASSIGN_OR_RETURN(std::vector<Outcome> ignored, RunOpenLoop(flat, wo, issue));
    (void)ignored;
  }
  KEEL_ASSIGN_OR_RETURN(std::vector<Outcome> outcomes, RunOpenLoop(o.trace, lo, issue));
  r.summary = Summarise(outcomes, r.full_quality, o.window_s, o.slo_ms, o.time_scale);
  std::sort(r.samples.begin(), r.samples.end(), [](const StateSample& a, const StateSample& b) { return a.t_s < b.t_s; });
  TallyStates(tick_real / o.time_scale, &r);
  return r;
}

std::string WriteLiveCsv(const LiveResult& r, double window_s) {
  std::string out = "t_s,arrived,mean_quality,p99_ms,state_index,state,answer_level,vector_level,engine_level,gateway_level\n";
  size_t k = 0;  // samples before the current window's end
  const StateSample none;
  for (const LiveWindow& w : r.summary.windows) {
    while (k < r.samples.size() && r.samples[k].t_s < w.t_s + window_s) ++k;
    const StateSample& s = k > 0 ? r.samples[k - 1] : none;
    out += fmt::format("{:.3f},{},{:.4f},{:.2f},{},", w.t_s, w.arrived, w.mean_quality, w.p99_ms, s.index);
    AppendCsvField(s.name, &out);
    for (int v : s.applied) out += fmt::format(",{}", v);
    out += '\n';
  }
  return out;
}

std::string WriteLiveSummaryJson(const LiveResult& r, std::string_view label) {
  nlohmann::ordered_json j;
  if (!label.empty()) j["label"] = std::string(label);
  j["trace"] = r.trace;
  j["peak"] = r.peak;
  j["full_quality"] = r.full_quality;
  j["limit"] = r.limit;
  j["arrived"] = r.summary.arrived;
  j["ok"] = r.summary.ok;
  j["shed"] = r.summary.shed;
  j["failed"] = r.summary.failed;
  j["slo_violations"] = r.summary.slo_violations;
  j["max_drop"] = r.summary.max_drop;
  j["mean_drop"] = r.summary.mean_drop;
  j["within_085_limit"] = r.limit > 0 && r.summary.max_drop <= 0.85 * r.limit;
  nlohmann::ordered_json t = nlohmann::ordered_json::object();
  for (size_t i = 0; i < r.state_names.size() && i < r.time_in_state_s.size(); ++i) t[r.state_names[i]] = r.time_in_state_s[i];
  j["time_in_state_s"] = std::move(t);
  j["transitions"] = r.transitions;
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

Result<std::string> WriteReferences(const std::string& answer_url, std::span<const answer::EvalQuery> eval,
                                    const answer::ReplayOptions& replay, const std::string& expect_state, int retries,
                                    double* full_quality) {
  if (eval.empty()) return Status::InvalidArgument("references: empty evaluation set");
  KEEL_ASSIGN_OR_RETURN(HttpEndpoint ep, ParseHttpUrl(answer_url));
  HttpClient client(ep);
  std::string out;
  std::vector<answer::ReplayedAnswer> refs;
  refs.reserve(eval.size());
  for (size_t i = 0; i < eval.size(); ++i) {
    answer::ReplayedAnswer a;
    for (int attempt = 0; attempt <= std::max(0, retries); ++attempt) {
      a = answer::AskOne(client, eval[i], replay);
      if (a.status == 200) break;
    }
    if (a.status != 200) {
      return Status::Unavailable(fmt::format("references: query {} never answered 200 (last: HTTP {} {})", i, a.status,
                                             a.error.substr(0, 200)));
    }
    if (!expect_state.empty() && a.state != expect_state) {
      return Status::Unavailable(fmt::format("references: query {} ran in state '{}', not '{}' (pin the product to its "
                                             "full state first)",
                                             i, a.state, expect_state));
    }
    out += WriteReferenceLine(static_cast<int>(i), a);
    out += '\n';
    refs.push_back(std::move(a));
  }
  if (full_quality) *full_quality = FullQuality(eval, refs);
  return out;
}

}  // namespace keel::hilo
