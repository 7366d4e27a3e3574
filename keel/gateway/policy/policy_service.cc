#include "keel/gateway/policy_service.h"

#include <openssl/crypto.h>
#include <strings.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "keel/core/http_metrics.h"
#include "keel/core/log.h"
#include "keel/core/mapped_file.h"

namespace keel::gateway {

using json = nlohmann::json;

namespace {

constexpr size_t kMinAdminKeyBytes = 16;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

int HttpStatusOf(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kResourceExhausted: return 429;
    case StatusCode::kUnavailable: return 503;
    default: return 500;
  }
}

std::string ErrorKind(int status) {
  switch (status) {
    case 400: return "bad_request";
    case 401: return "unauthorized";
    case 404: return "not_found";
    case 503: return "unavailable";
    default: return status >= 500 ? "internal" : "client";
  }
}

Result<json> ParseBody(const HttpRequest& q) {
  if (q.body.empty()) return Status::InvalidArgument("body: empty; a JSON object is required");
  Result<json> j = ParseUntrustedJson(q.body, kPolicyJsonLimits);
  if (!j.ok()) return Status::InvalidArgument("body: " + j.status().message());
  return j;
}

Status OnlyFields(const json& o, std::initializer_list<std::string_view> known) {
  for (auto it = o.begin(); it != o.end(); ++it) {
    bool ok = false;
    for (std::string_view k : known) ok = ok || it.key() == k;
    if (!ok) return Status::InvalidArgument(fmt::format("{}: unknown field", it.key()));
  }
  return Status::Ok();
}

Status GetString(const json& o, const char* field, std::string* out) {
  auto it = o.find(field);
  if (it == o.end() || it->is_null()) return Status::InvalidArgument(fmt::format("{}: required", field));
  if (!it->is_string()) return Status::InvalidArgument(fmt::format("{}: must be a string", field));
  *out = it->get<std::string>();
  if (out->size() > kMaxJsonString) return Status::InvalidArgument(fmt::format("{}: too long", field));
  return Status::Ok();
}

// Absent or null: leaves *out (the default) alone.
template <typename T>
Status GetNumber(const json& o, const char* field, T* out) {
  auto it = o.find(field);
  if (it == o.end() || it->is_null()) return Status::Ok();
  if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer() ||
        (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      return Status::InvalidArgument(fmt::format("{}: must be an integer", field));
    }
  } else if (!it->is_number()) {
    return Status::InvalidArgument(fmt::format("{}: must be a number", field));
  }
  *out = it->get<T>();
  return Status::Ok();
}

std::string PercentDecode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out += ' ';
    } else if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
               std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out += static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::map<std::string, std::string> ParseQuery(std::string_view q) {
  std::map<std::string, std::string> out;
  while (!q.empty()) {
    size_t amp = q.find('&');
    std::string_view part = q.substr(0, amp);
    size_t eq = part.find('=');
    out[PercentDecode(part.substr(0, eq))] = eq == std::string_view::npos ? "" : PercentDecode(part.substr(eq + 1));
    if (amp == std::string_view::npos) break;
    q.remove_prefix(amp + 1);
  }
  return out;
}

// "<label> via <peer>": the label from X-Keel-Actor when it is a plain name, else "admin".
std::string ActorOf(const HttpRequest& q) {
  std::string label(q.headers.Get("X-Keel-Actor"));
  bool plain = !label.empty() && label.size() <= 64;
  for (char c : label) {
    plain = plain && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '@' || c == '-');
  }
  return fmt::format("{} via {}", plain ? label : "admin", q.remote.empty() ? "unknown" : q.remote);
}

json BudgetJson(const BudgetState& b) {
  return {{"budget_id", b.budget_id},       {"scope", b.scope},           {"subject", b.subject},
          {"window", b.window},             {"limit_tokens", b.limit_tokens}, {"limit_cost", b.limit_cost},
          {"spent_tokens", b.spent_tokens}, {"spent_cost", b.spent_cost}, {"window_end_unix", b.window_end_unix}};
}

void SendJson(HttpResponder& r, const json& body) { r.Send(200, "application/json", Dump(body)); }

void SendError(HttpResponder& r, const Status& s) {
  const int status = HttpStatusOf(s);
  if (status >= 500) Log().error("gateway-policy: {}", s.ToString());
  r.Send(status, "application/json", DefaultHttpErrorBody(status, s.message()));
}

// ---- admin actions: each reads its call and answers the 200 body (errors become 4xx/5xx).

// An authorized admin call: the request, its JSON body (null for routes without one), who made it.
struct AdminCall {
  const HttpRequest& request;
  const json& body;
  const std::string& actor;
};

Result<json> CreateKey(PolicyStore& store, const AdminCall& c) {
  KEEL_RETURN_IF_ERROR(OnlyFields(c.body, {"principal", "team"}));
  std::string principal, team;
  KEEL_RETURN_IF_ERROR(GetString(c.body, "principal", &principal));
  KEEL_RETURN_IF_ERROR(GetString(c.body, "team", &team));
  KEEL_ASSIGN_OR_RETURN(auto key, store.CreateKey(principal, team, c.actor));
  return json{{"key_id", key.key_id}, {"api_key", key.api_key}};
}

Result<json> ListKeys(PolicyStore& store, const AdminCall&) {
  KEEL_ASSIGN_OR_RETURN(auto keys, store.ListKeys());
  json arr = json::array();
  for (const KeyInfo& k : keys) {
    arr.push_back({{"key_id", k.key_id}, {"principal", k.principal}, {"team", k.team},
                   {"created_unix", k.created_unix}, {"revoked", k.revoked_unix != 0},
                   {"revoked_unix", k.revoked_unix != 0 ? json(k.revoked_unix) : json(nullptr)}});
  }
  return json{{"keys", arr}};
}

Result<json> RevokeKey(PolicyStore& store, const AdminCall& c) {
  KEEL_RETURN_IF_ERROR(OnlyFields(c.body, {"key_id"}));
  std::string key_id;
  KEEL_RETURN_IF_ERROR(GetString(c.body, "key_id", &key_id));
  KEEL_RETURN_IF_ERROR(store.RevokeKey(key_id, c.actor));
  return json{{"key_id", key_id}, {"revoked", true}};
}

Result<json> PutBudget(PolicyStore& store, const AdminCall& c) {
  KEEL_RETURN_IF_ERROR(OnlyFields(c.body, {"scope", "subject", "window", "limit_tokens", "limit_cost"}));
  BudgetSpec spec;
  KEEL_RETURN_IF_ERROR(GetString(c.body, "scope", &spec.scope));
  KEEL_RETURN_IF_ERROR(GetString(c.body, "subject", &spec.subject));
  KEEL_RETURN_IF_ERROR(GetString(c.body, "window", &spec.window));
  KEEL_RETURN_IF_ERROR(GetNumber(c.body, "limit_tokens", &spec.limit_tokens));
  KEEL_RETURN_IF_ERROR(GetNumber(c.body, "limit_cost", &spec.limit_cost));
  KEEL_ASSIGN_OR_RETURN(std::string id, store.PutBudget(spec, c.actor));
  return json{{"budget_id", id}};
}

Result<json> DeleteBudget(PolicyStore& store, const AdminCall& c) {
  KEEL_RETURN_IF_ERROR(OnlyFields(c.body, {"budget_id"}));
  std::string id;
  KEEL_RETURN_IF_ERROR(GetString(c.body, "budget_id", &id));
  KEEL_RETURN_IF_ERROR(store.DeleteBudget(id, c.actor));
  return json{{"budget_id", id}, {"deleted", true}};
}

Result<json> PutPolicy(PolicyStore& store, const AdminCall& c) {
  std::string team;
  KEEL_RETURN_IF_ERROR(GetString(c.body, "team", &team));
  json rules_json = c.body;
  rules_json.erase("team");
  KEEL_ASSIGN_OR_RETURN(PolicyRules rules, PolicyRulesFromJson(Dump(rules_json)));
  KEEL_RETURN_IF_ERROR(store.PutPolicy(team, rules, c.actor));
  return json{{"team", team}, {"policy", json::parse(ToJson(rules), nullptr, false)}};
}

Result<json> PutPrice(PolicyStore& store, const AdminCall& c) {
  KEEL_RETURN_IF_ERROR(OnlyFields(c.body, {"model", "input_per_mtok", "output_per_mtok"}));
  std::string model;
  Price p{-1, -1};
  KEEL_RETURN_IF_ERROR(GetString(c.body, "model", &model));
  KEEL_RETURN_IF_ERROR(GetNumber(c.body, "input_per_mtok", &p.input_per_mtok));
  KEEL_RETURN_IF_ERROR(GetNumber(c.body, "output_per_mtok", &p.output_per_mtok));
  if (p.input_per_mtok < 0 || p.output_per_mtok < 0) {
    return Status::InvalidArgument("input_per_mtok and output_per_mtok: required, >= 0");
  }
  KEEL_RETURN_IF_ERROR(store.PutPrice(model, p, c.actor));
  return json{{"model", model}, {"input_per_mtok", p.input_per_mtok}, {"output_per_mtok", p.output_per_mtok}};
}

Result<json> GetSpend(PolicyStore& store, const AdminCall& c) {
  auto query = ParseQuery(c.request.query);
  const bool by_team = query.count("team") != 0, by_key = query.count("key_id") != 0;
  if (by_team == by_key) return Status::InvalidArgument("query: give exactly one of team=<team> or key_id=<key_id>");
  KEEL_ASSIGN_OR_RETURN(SpendReport s, store.Spend(by_team ? "team" : "key", by_team ? query["team"] : query["key_id"]));
  json budgets = json::array();
  for (const BudgetState& b : s.budgets) budgets.push_back(BudgetJson(b));
  return json{{"scope", s.scope}, {"subject", s.subject},
              {"daily", {{"tokens", s.daily_tokens}, {"cost", s.daily_cost}, {"window_end_unix", s.daily_end_unix}}},
              {"monthly", {{"tokens", s.monthly_tokens}, {"cost", s.monthly_cost}, {"window_end_unix", s.monthly_end_unix}}},
              {"budgets", budgets}};
}

Result<json> GetAudit(PolicyStore& store, const AdminCall& c) {
  auto query = ParseQuery(c.request.query);
  int limit = 100;
  if (auto it = query.find("limit"); it != query.end()) {
    char* end = nullptr;
    long v = std::strtol(it->second.c_str(), &end, 10);
    if (it->second.empty() || *end != '\0' || v < 1 || v > 1000) return Status::InvalidArgument("limit: must be in 1..1000");
    limit = static_cast<int>(v);
  }
  KEEL_ASSIGN_OR_RETURN(auto entries, store.Audit(limit));
  json arr = json::array();
  for (const AuditEntry& e : entries) {
    json detail = json::parse(e.detail, nullptr, false);
    arr.push_back({{"id", e.id}, {"unix_ms", e.unix_ms}, {"actor", e.actor}, {"action", e.action},
                   {"target", e.target}, {"detail", detail.is_discarded() ? json(e.detail) : detail}});
  }
  return json{{"entries", arr}};
}

// Admin routes, authorized first: what each is called in metrics and logs, whether it reads a
// JSON body, and the action.
struct AdminRoute {
  const char* method;
  const char* path;
  const char* action;
  bool has_body;
  Result<json> (*run)(PolicyStore&, const AdminCall&);
};
constexpr AdminRoute kAdminRoutes[] = {
    {"POST", "/admin/keys", "key.create", true, &CreateKey},
    {"GET", "/admin/keys", "key.list", false, &ListKeys},
    {"POST", "/admin/keys/revoke", "key.revoke", true, &RevokeKey},
    {"PUT", "/admin/budgets", "budget.put", true, &PutBudget},
    {"DELETE", "/admin/budgets", "budget.delete", true, &DeleteBudget},
    {"PUT", "/admin/policies", "policy.put", true, &PutPolicy},
    {"PUT", "/admin/prices", "price.put", true, &PutPrice},
    {"GET", "/admin/spend", "spend.get", false, &GetSpend},
    {"GET", "/admin/audit", "audit.get", false, &GetAudit},
};

void ServeAdmin(PolicyStore& store, CounterFamily& calls, const AdminRoute& route, const HttpRequest& q,
                HttpResponder& r) {
  json body;
  if (route.has_body) {
    auto parsed = ParseBody(q);
    if (!parsed.ok()) return SendError(r, parsed.status());
    body = std::move(parsed).value();
  }
  const std::string actor = ActorOf(q);
  Result<json> answer = route.run(store, AdminCall{q, body, actor});
  if (!answer.ok()) return SendError(r, answer.status());
  // Counted and logged before the answer goes out: a caller that has its answer finds the action
  // in the log and on /metrics.
  calls.WithLabels({route.action}).Inc();
  Log().info("gateway-policy: {} by {}", route.action, actor);
  SendJson(r, *answer);
}

}  // namespace

Result<std::string> LoadAdminKey(const std::string& file) {
  std::string key;
  if (!file.empty()) {
    Result<std::string> text = ReadSmallFile(file, 64 << 10);  // a key, not a device or a FIFO
    if (!text.ok()) return Status(text.status().code(), "admin key file: " + text.status().message());
    key = std::move(text).value();
  } else if (const char* env = std::getenv("KEEL_GATEWAY_ADMIN_KEY"); env != nullptr) {
    key = env;
  }
  const auto first = key.find_first_not_of(" \t\r\n");
  key = first == std::string::npos ? "" : key.substr(first, key.find_last_not_of(" \t\r\n") - first + 1);
  if (key.empty()) {
    return Status::InvalidArgument("no admin key: pass --admin-key-file or set KEEL_GATEWAY_ADMIN_KEY");
  }
  if (key.size() < kMinAdminKeyBytes) {
    return Status::InvalidArgument(fmt::format("admin key: at least {} bytes required", kMinAdminKeyBytes));
  }
  return key;
}

PolicyService::PolicyService(PolicyServiceOptions options) : options_(std::move(options)) {}

PolicyService::~PolicyService() { Stop(); }

Result<std::unique_ptr<PolicyService>> PolicyService::Start(PolicyServiceOptions options) {
  if (options.admin_key.size() < kMinAdminKeyBytes) {
    return Status::InvalidArgument(fmt::format("admin key: at least {} bytes required", kMinAdminKeyBytes));
  }
  std::unique_ptr<PolicyService> s(new PolicyService(std::move(options)));
  s->admin_key_hash_ = HashApiKey(s->options_.admin_key);
  s->options_.admin_key.assign(s->options_.admin_key.size(), '\0');  // only the hash is kept
  s->options_.admin_key.clear();
  KEEL_ASSIGN_OR_RETURN(s->store_, PolicyStore::Open(s->options_.store));
  MetricsRegistry& m = s->metrics_;
  s->requests_ = &m.AddCounter("keel_gateway_policy_requests_total", "HTTP requests by route and status.", {"route", "code"});
  s->resolves_ = &m.AddCounter("keel_gateway_policy_resolves_total", "Key resolutions by result.", {"result"});
  s->usage_records_ = &m.AddCounter("keel_gateway_policy_usage_records_total", "Usage records by outcome.", {"outcome"});
  s->admin_calls_ = &m.AddCounter("keel_gateway_policy_admin_calls_total", "Authorized admin calls by action.", {"action"});
  s->errors_ = &m.AddCounter("keel_gateway_policy_errors_total", "Error responses by kind.", {"kind"});
  s->latency_ = &m.AddHistogram("keel_gateway_policy_request_seconds", "Request latency by route.", LatencyBuckets(), {"route"});
  m.AddGauge("keel_gateway_policy_redis", "1 when spend is kept in Redis, 0 when computed from the ledger.")
      .Get()
      .Set(s->store_->uses_redis() ? 1 : 0);
  s->Route();
  HttpServerOptions h;
  h.host = "unix:" + s->options_.socket_path;
  h.max_body_bytes = s->options_.max_body_bytes;
  h.max_connections = s->options_.max_connections;
  h.drain_seconds = 5;
  h.server_name = "keel-gateway-policy";
  PolicyService* self = s.get();
  s->http_ = std::make_unique<HttpServer>(h, [self](const HttpRequest& q, HttpResponder& r) { self->Handle(q, r); });
  KEEL_RETURN_IF_ERROR(s->http_->Start());
  return s;
}

void PolicyService::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (http_) http_->Stop();
}

void PolicyService::Handle(const HttpRequest& q, HttpResponder& r) {
  const std::string route = router_.RouteLabel(q.path);
  const auto t0 = std::chrono::steady_clock::now();
  CountingResponder counting(r, *requests_, route);
  router_.Dispatch(q, counting);
  if (counting.status() == 0) counting.CountIfSilent();
  if (counting.status() >= 400) errors_->WithLabels({ErrorKind(counting.status())}).Inc();
  latency_->WithLabels({route}).Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void PolicyService::Route() {
  router_.Handle("GET", "/healthz", [](const HttpRequest&, HttpResponder& r) { SendJson(r, {{"status", "ok"}}); });
  router_.Handle("GET", "/metrics", [this](const HttpRequest&, HttpResponder& r) {
    r.Send(200, MetricsRegistry::kContentType, metrics_.Render());
  });
  router_.Handle("POST", "/v1/resolve", [this](const HttpRequest& q, HttpResponder& r) { ServeResolve(q, r); });
  router_.Handle("POST", "/v1/usage", [this](const HttpRequest& q, HttpResponder& r) { ServeUsage(q, r); });
  for (const AdminRoute& route : kAdminRoutes) {
    router_.Handle(route.method, route.path, [this, &route](const HttpRequest& q, HttpResponder& r) {
      if (Authorized(q, r)) ServeAdmin(*store_, *admin_calls_, route, q, r);
    });
  }
}

void PolicyService::ServeResolve(const HttpRequest& q, HttpResponder& r) {
  auto body = ParseBody(q);
  if (!body.ok()) return SendError(r, body.status());
  std::string key_hash;
  if (Status s = GetString(*body, "key_hash", &key_hash); !s.ok()) return SendError(r, s);
  auto d = store_->Resolve(key_hash);
  if (!d.ok()) return SendError(r, d.status());
  resolves_->WithLabels({!d->known ? "unknown" : d->revoked ? "revoked" : "known"}).Inc();
  r.Send(200, "application/json", ToJson(*d));
}

void PolicyService::ServeUsage(const HttpRequest& q, HttpResponder& r) {
  auto records = UsageBatchFromJson(q.body);
  if (!records.ok()) return SendError(r, records.status());
  auto outcome = store_->RecordUsage(*records);
  if (!outcome.ok()) return SendError(r, outcome.status());
  usage_records_->WithLabels({"accepted"}).Inc(static_cast<double>(outcome->accepted));
  usage_records_->WithLabels({"duplicate"}).Inc(static_cast<double>(outcome->duplicates));
  SendJson(r, {{"accepted", outcome->accepted}, {"duplicates", outcome->duplicates}});
}

bool PolicyService::Authorized(const HttpRequest& q, HttpResponder& r) const {
  std::string_view auth = q.headers.Get("Authorization");
  const bool bearer = auth.size() > 7 && ::strncasecmp(auth.data(), "Bearer ", 7) == 0;
  const std::string presented = HashApiKey(bearer ? auth.substr(7) : std::string_view("\x01"));
  if (bearer && CRYPTO_memcmp(presented.data(), admin_key_hash_.data(), admin_key_hash_.size()) == 0) return true;
  Log().warn("gateway-policy: unauthorized {} {} from {}", q.method, q.path, q.remote);
  r.Send(401, "application/json", DefaultHttpErrorBody(401, "admin key required: Authorization: Bearer <admin key>"),
         {{"WWW-Authenticate", "Bearer"}});
  return false;
}


}  // namespace keel::gateway
