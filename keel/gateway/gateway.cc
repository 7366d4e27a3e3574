// `keel gateway`: routing, start/stop and the answers every route shares. The chat filter chain
// is in gateway_chat.cc, the other API routes in gateway_endpoints.cc (see gateway_internal.h).
#include "keel/gateway/gateway.h"

#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include "keel/core/log.h"
#include "keel/core/signal.h"
#include "keel/gateway/gateway_internal.h"
#include "keel/gateway/vendors/gemini/gemini_front.h"
#include "keel/gateway/policy.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

// "gw-<16 hex digits from the OS CSPRNG>-".
std::string NewRequestPrefix() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[32];
  std::snprintf(buf, sizeof(buf), "gw-%016llx-", static_cast<unsigned long long>(r));
  return buf;
}

bool StartsWith(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// The chat routes: path -> the front that reads it.
struct ChatRoute {
  std::string_view path;
  WireFormat format;
};
constexpr ChatRoute kChatRoutes[] = {
    {"/v1/chat/completions", WireFormat::kOpenAIChat},
    {"/v1/completions", WireFormat::kOpenAICompletions},
    {"/v1/messages", WireFormat::kAnthropicMessages},
    {"/v1/responses", WireFormat::kOpenAIResponses},
};

// Gemini's model routes live under these prefixes ("/v1beta/models/{m}:generateContent").
bool HasKeyParameter(std::string_view query) {
  for (size_t at = 0; at <= query.size();) {
    const size_t amp = std::min(query.find('&', at), query.size());
    if (StartsWith(query.substr(at, amp - at), "key=")) return true;
    at = amp + 1;
  }
  return false;
}

// Gemini's own paths, and the /v1/ ones it shares with OpenAI and Anthropic. /v1/models/{m}:method
// is Gemini's (its methods are all POSTs); a GET of an id with colons (OpenAI fine-tunes are
// "ft:gpt-4o:org::id") is a model lookup. The model list and a model's GET are Gemini's when the
// request carries Gemini's key (x-goog-api-key or ?key=) and neither OpenAI's nor Anthropic's
// (@google/genai with apiVersion "v1").
bool IsGeminiRequest(const HttpRequest& req, bool get) {
  const std::string_view path = req.path;
  for (std::string_view p : {"/v1beta/models", "/v1alpha/models"}) {
    if (path == p || StartsWith(path, std::string(p) + "/")) return true;
  }
  if (path != "/v1/models" && !StartsWith(path, "/v1/models/")) return false;
  if (!get) return path.find(':') != std::string_view::npos;
  const bool gemini_key = req.headers.Has("x-goog-api-key") || HasKeyParameter(req.query);
  return gemini_key && !req.headers.Has("authorization") && !req.headers.Has("x-api-key") &&
         !req.headers.Has("anthropic-version");
}

// What a request's method and path ask for, decided before any work is done for it.
enum class RouteKind { kChat, kCountTokens, kEmbeddings, kModels, kGeminiModels, kWrongMethod, kUnknown };
struct RouteMatch {
  RouteKind kind = RouteKind::kUnknown;
  WireFormat format = WireFormat::kOpenAIChat;  // the front that reads it and answers errors
  std::string route = "other";                  // the metrics label
  std::string allow = "POST";                   // for kWrongMethod
  std::string path_model;                       // Gemini: the model named by the URL
  bool stream_by_path = false;                  // Gemini :streamGenerateContent
  bool sse = true;                              // Gemini: ?alt=sse (else a JSON-array stream)
  std::optional<GatewayError> refused;          // a Gemini path that cannot be served
};

RouteMatch MatchRoute(const HttpRequest& req) {
  const std::string& path = req.path;
  // HEAD is GET without the body (the server's responder drops it).
  const bool post = req.method == "POST", get = req.method == "GET" || req.method == "HEAD";
  RouteMatch m;
  // `ok` is the method the route takes; any other gets 405 naming `allow`.
  auto route = [&m](RouteKind kind, bool ok, std::string label) {
    m.kind = ok ? kind : RouteKind::kWrongMethod;
    m.route = std::move(label);
    return m;
  };
  for (const ChatRoute& r : kChatRoutes) {
    if (path == r.path) {
      m.format = r.format;
      return route(RouteKind::kChat, post, path);
    }
  }
  if (path == "/v1/messages/count_tokens") {
    m.format = WireFormat::kAnthropicMessages;
    return route(RouteKind::kCountTokens, post, path);
  }
  if (path == "/v1/embeddings") return route(RouteKind::kEmbeddings, post, path);
  if (IsGeminiRequest(req, get)) {
    m.format = WireFormat::kGemini;
    if (get || path.find(':') == std::string::npos) {
      m.allow = "GET, HEAD";
      return route(RouteKind::kGeminiModels, get, path.size() > 15 ? "/v1beta/models/{id}" : "/v1beta/models");
    }
    auto parsed = ParseGeminiPath(req.target);
    if (!parsed.ok()) {
      const bool bad = parsed.status().code() == StatusCode::kInvalidArgument;
      m.refused = GatewayError{bad ? 400 : 404, bad ? ErrorKind::kInvalidRequest : ErrorKind::kNotFound,
                               parsed.status().message()};
      return m;
    }
    m.path_model = parsed->model;
    m.stream_by_path = parsed->method == GeminiRoute::Method::kStream;
    m.sse = parsed->sse;
    if (parsed->method == GeminiRoute::Method::kCountTokens) {
      return route(RouteKind::kCountTokens, post, "/v1beta/models/{m}:countTokens");
    }
    return route(RouteKind::kChat, post,
                 m.stream_by_path ? "/v1beta/models/{m}:streamGenerateContent" : "/v1beta/models/{m}:generateContent");
  }
  if (path == "/v1/models" || StartsWith(path, "/v1/models/")) {
    m.allow = "GET, HEAD";
    if (req.headers.Has("anthropic-version")) m.format = WireFormat::kAnthropicMessages;
    return route(RouteKind::kModels, get, path == "/v1/models" ? path : "/v1/models/{id}");
  }
  // No route: answered in the format the path (or Anthropic's version header) speaks, so an
  // SDK calling an API the gateway lacks (batches, files, tuned models) gets its own error type.
  if (StartsWith(path, "/v1/messages/") || req.headers.Has("anthropic-version")) {
    m.format = WireFormat::kAnthropicMessages;
  } else if (StartsWith(path, "/v1beta/") || StartsWith(path, "/v1alpha/")) {
    m.format = WireFormat::kGemini;
  }
  return m;  // kUnknown, "other"
}
}  // namespace

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

HttpHeaderList BudgetDenialHeaders(const Governance::Denial& denial) {
  HttpHeaderList headers;
  if (denial.retry_after_seconds >= 0) headers.emplace_back("retry-after", std::to_string(denial.retry_after_seconds));
  const bool retry = denial.retry_helps && denial.retry_after_seconds <= 60;
  headers.emplace_back("x-should-retry", retry ? "true" : "false");
  return headers;
}

std::string RewrittenModel(const PolicyRules& policy, const std::string& requested) {
  auto it = policy.rewrites.find(requested);
  return it == policy.rewrites.end() ? requested : it->second;
}

bool ModelAllowed(const PolicyRules& policy, const std::string& model) {
  if (policy.allowed_models.empty()) return true;
  for (const std::string& glob : policy.allowed_models) {
    if (GlobMatch(glob, model)) return true;
  }
  return false;
}

void Gateway::Impl::RegisterMetrics() {
  requests = &metrics.AddCounter("keel_gateway_requests_total", "Client requests by route and status.",
                                 {"route", "code"});
  upstream_requests = &metrics.AddCounter("keel_gateway_upstream_requests_total",
                                          "Upstream attempts by upstream and outcome.", {"upstream", "outcome"});
  fallbacks = &metrics.AddCounter("keel_gateway_fallbacks_total", "Moves to the next target of a virtual model.");
  tokens = &metrics.AddCounter("keel_gateway_tokens_total", "Tokens settled, by direction.", {"direction"});
  request_seconds = &metrics.AddHistogram("keel_gateway_request_seconds", "Client request duration.",
                                          LatencyBuckets(), {"route"});
  upstream_seconds = &metrics.AddHistogram("keel_gateway_upstream_first_byte_seconds",
                                           "Time from forwarding to the upstream's response headers.",
                                           LatencyBuckets(), {"upstream"});
}

Task<void> Gateway::Impl::Fail(Exchange& x, const GatewayError& error, const HttpHeaderList& extra) {
  HttpHeaderList headers = x.headers;
  headers.insert(headers.end(), extra.begin(), extra.end());
  if (!error.retry_after.empty()) headers.emplace_back("retry-after", error.retry_after);
  std::string body = x.front.ErrorBody(error);
  const int status = x.front.ErrorStatus(error);
  requests->WithLabels({x.route, std::to_string(status)}).Inc();
  co_await x.resp.Send(status, "application/json", std::move(body), headers);
}

void Gateway::Impl::Settle(Exchange& x, const RouteTarget& target, int64_t in, int64_t out, std::string_view status) {
  const KeyDecision& d = *x.auth.decision;
  governance->Settle(x.reservation, UsageRecord{x.request_id, d.key_id, d.team, target.model, in, out,
                                                CostOf(d.prices, target.model, in, out), UnixMillis()});
  tokens->WithLabels({"input"}).Inc(static_cast<double>(in));
  if (out > 0) tokens->WithLabels({"output"}).Inc(static_cast<double>(out));
  requests->WithLabels({x.route, std::string(status)}).Inc();
}

void Gateway::Impl::SettleAbandoned(Exchange& x, const RouteTarget& target, const Upstream& up) {
  upstream_requests->WithLabels({up.config.name, "abandoned"}).Inc();
  Log().debug("gateway: {} client left before its answer; the request to {} was abandoned", x.request_id,
             up.config.name);
  // Charged as reserved: how much the upstream generated before it saw the connection close is
  // unknown, and a budget must not be overspent by clients that hang up.
  Settle(x, target, x.input_tokens, x.request.max_tokens.value_or(0), "499");
}

Task<void> Gateway::Impl::Handle(const HttpRequest& req, AsyncResponder& resp) {
  const auto start = Clock::now();
  if (req.path == "/healthz" || req.path == "/metrics") {
    Exchange probe(req, resp, FrontFor(WireFormat::kOpenAIChat), req.path);
    // Read-only endpoints: GET, or HEAD answered the same without a body; anything else is 405
    // (a DELETE or a typo must not look like it did something).
    if (req.method != "GET" && req.method != "HEAD") {
      const GatewayError e{405, ErrorKind::kInvalidRequest, "method " + req.method + " not allowed on " + req.path};
      const HttpHeaderList allow = {{"Allow", "GET, HEAD"}};
      co_await Fail(probe, e, allow);
      co_return;
    }
    const bool health = req.path == "/healthz";
    std::string body = health ? "{\"status\":\"ok\"}" : metrics.Render();  // HEAD: the server sends no body
    co_await resp.Send(200, health ? "application/json" : MetricsRegistry::kContentType, std::move(body));
    co_return;
  }

  RouteMatch m = MatchRoute(req);
  if (m.refused) {
    Exchange refused(req, resp, FrontFor(m.format), m.route);
    co_await Fail(refused, *m.refused);
    co_return;
  }
  const ClientFront& front = m.format == WireFormat::kGemini ? GeminiFrontFor(m.sse) : FrontFor(m.format);
  Exchange x(req, resp, front, m.route);
  x.path_model = std::move(m.path_model);
  x.stream_by_path = m.stream_by_path;
  x.request_id = NextRequestId();
  // OpenAI's SDKs read x-request-id, Anthropic's request-id.
  x.headers = {{"x-request-id", x.request_id}, {"request-id", x.request_id}};
  if (hilo) {
    // One read of the product state per request (an atomic load): every filter of this request
    // applies the same state, and the client sees which one.
    x.hilo_index = hilo->CurrentIndex();
    x.headers.emplace_back("x-keel-hilo-state", hilo->catalog().states[x.hilo_index].name);
  }
  // An if-chain, not a switch: GCC 12 mishandles co_await inside switch cases.
  const std::string_view path(req.path);
  if (m.kind == RouteKind::kChat) {
    co_await HandleChat(x);
  } else if (m.kind == RouteKind::kCountTokens) {
    co_await HandleCountTokens(x);
  } else if (m.kind == RouteKind::kEmbeddings) {
    co_await HandleEmbeddings(x);
  } else if (m.kind == RouteKind::kModels) {
    const std::string_view id = path.size() > 11 ? path.substr(11) : std::string_view();  // after "/v1/models/"
    co_await HandleModels(x, id);
  } else if (m.kind == RouteKind::kGeminiModels) {
    const size_t slash = path.find("/models/");
    const std::string_view id = slash == std::string_view::npos ? std::string_view() : path.substr(slash + 8);
    co_await HandleGeminiModels(x, id);
  } else if (m.kind == RouteKind::kWrongMethod) {
    const GatewayError e{405, ErrorKind::kInvalidRequest, "method " + req.method + " not allowed on " + req.path};
    const HttpHeaderList extra = {{"Allow", m.allow}};
    co_await Fail(x, e, extra);
  } else {
    // OpenAI answers an unknown URL as an invalid request with no code (its kNotFound code is
    // "model_not_found"); Anthropic and Gemini answer not_found_error / NOT_FOUND.
    const ErrorKind kind = m.format == WireFormat::kOpenAIChat ? ErrorKind::kInvalidRequest : ErrorKind::kNotFound;
    const GatewayError e{404, kind, "no route for " + req.method + " " + req.path};
    co_await Fail(x, e);
  }
  request_seconds->WithLabels({x.route}).Observe(SecondsSince(start));
}

Task<void> Gateway::Impl::FlushLoop() {
  while (!stopping.load()) {
    flush_timer->expires_after(std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(config.usage_flush_seconds)));
    boost::system::error_code ec;
    co_await flush_timer->async_wait(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
    if (stopping.load()) break;
    Status s = co_await governance->Flush();
    if (!s.ok()) Log().warn("gateway: usage not delivered yet ({} queued): {}", governance->queued_usage(), s.message());
  }
}

namespace {

// The catalog file, bounded (hilo::ReadCatalogFile), its errors under the config path.
Result<hilo::Catalog> ReadCatalogFile(const std::string& path) {
  auto c = hilo::ReadCatalogFile(path);
  if (!c.ok()) return Status::InvalidArgument("gateway config: hilo.catalog: " + c.status().message());
  return c;
}

}  // namespace

Status Gateway::Impl::StartHilo(int workers) {
  const HiloGatewayConfig& h = *config.hilo;
  hilo::ServiceLinkOptions lo;
  lo.service = hilo::Service::kGateway;
  lo.instance = h.instance;
  lo.workers = workers;
  lo.metrics = &metrics;
  Result<std::unique_ptr<hilo::ServiceLink>> link = Status::InvalidArgument("unset");
  if (!h.controller.empty()) {
    // Called from the link's own threads (blocking, keel/core's HttpClient), never the io threads.
    auto call = hilo::HttpControllerCallForUrl(h.controller);
    if (!call.ok()) return Status::InvalidArgument("gateway config: hilo.controller: " + call.status().message());
    // The catalog comes from the controller: the gateway cannot start without knowing its states.
    link = hilo::ServiceLink::Connect(std::move(call).value(), lo, DeadlineIn(5000));
    if (!link.ok()) {
      return Status::InvalidArgument("gateway config: hilo.controller: " + h.controller + ": " + link.status().message());
    }
  } else {
    auto catalog = ReadCatalogFile(h.catalog_path);
    if (!catalog.ok()) return catalog.status();
    link = hilo::ServiceLink::Pinned(std::move(catalog).value(), h.state, lo);
    if (!link.ok()) return Status::InvalidArgument("gateway config: hilo.state: " + link.status().message());
  }
  hilo = std::move(link).value();
  const hilo::Catalog& catalog = hilo->catalog();
  // Every tier a state can route to must have a model in every tiers entry; found now, not at
  // the surge that first enters that state.
  for (const auto& [name, tiers] : h.tiers) {
    std::vector<std::string>& routes = hilo_routes[name];
    for (const hilo::State& s : catalog.states) {
      auto it = tiers.find(s.gateway.model);
      if (it == tiers.end()) {
        return Status::InvalidArgument("gateway config: hilo.tiers." + name + ": no model for tier \"" +
                                       s.gateway.model + "\", which catalog state \"" + s.name + "\" routes to");
      }
      routes.push_back(it->second);
    }
  }
  if (!h.controller.empty() && !h.state.empty()) {
    if (Status s = hilo->Pin(h.state); !s.ok()) return Status::InvalidArgument("gateway config: hilo.state: " + s.message());
  }
  if (Status s = hilo->Start(); !s.ok()) return s;
  const hilo::State& now = hilo->Current();
  const std::string source = h.controller.empty() ? "pinned to " + h.catalog_path : "following " + h.controller;
  Log().info("gateway: HiLO {}, state {} (tier {}, max_tokens clamp {})", source, now.name, now.gateway.model,
             now.gateway.max_tokens_clamp);
  return Status::Ok();
}

Gateway::Gateway(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

hilo::ServiceLink* Gateway::hilo_link() { return impl_->hilo.get(); }

Gateway::~Gateway() { Stop(); }

int Gateway::port() const { return impl_->server ? impl_->server->port() : 0; }

Result<std::unique_ptr<Gateway>> Gateway::Start(GatewayConfig config) {
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  Impl* p = impl.get();
  p->RegisterMetrics();
  p->request_prefix = NewRequestPrefix();
  for (const VirtualModel& m : p->config.models) {
    p->models[m.name] = m;
    if (!m.tokenizer_path.empty()) {
      auto counter = MakeKeelTokenizerCounter(m.tokenizer_path, m.tokenizer_vocab);
      if (!counter.ok()) return Status::InvalidArgument("model " + m.name + ": " + counter.status().message());
      p->counters[m.name] = std::move(counter).value();
    }
  }
  AsyncServerOptions so;
  so.host = p->config.host;
  so.port = p->config.port;
  so.threads = p->config.threads;
  so.max_body_bytes = p->config.max_body_bytes;
  so.read_timeout_seconds = p->config.client_timeout_seconds;
  so.tls_cert_file = p->config.tls_cert_file;
  so.tls_key_file = p->config.tls_key_file;
  // Before routing (a body over the limit, bad framing): in the wire format the path speaks, so an
  // Anthropic or Gemini SDK gets an error it can read; OpenAI's when the path is unknown.
  so.error_body = [](int status, std::string_view message, std::string_view target) {
    HttpRequest req;
    req.method = "POST";
    req.target = std::string(target);
    req.path = req.target.substr(0, req.target.find('?'));
    const RouteMatch m = MatchRoute(req);
    const ClientFront& front = m.format == WireFormat::kGemini ? GeminiFrontFor(m.sse) : FrontFor(m.format);
    return front.ErrorBody(GatewayError{status, ErrorKindForStatus(status), std::string(message)});
  };
  p->server = std::make_unique<AsyncHttpServer>(
      so, [p](const HttpRequest& req, AsyncResponder& resp) -> Task<void> { return p->Handle(req, resp); });
  if (p->config.hilo) {
    // Workers: the connection cap. A request holds its connection (not an io thread: it yields
    // while the upstream answers) for its whole life, so utilisation = busy connections / cap.
    if (Status s = p->StartHilo(so.max_connections); !s.ok()) return s;
  }
  auto& io = p->server->io_context();
  for (const UpstreamConfig& u : p->config.upstreams) {
    Upstream& up = p->upstreams[u.name];
    up.config = u;
    auto vendor = FindVendor(u.vendor.empty() ? VendorNameFor(u.format) : u.vendor);
    if (!vendor.ok()) return Status::InvalidArgument("upstream " + u.name + ": " + vendor.status().message());
    up.vendor = *vendor;
    ClientOptions co;
    co.connect_timeout_seconds = std::min(5.0, u.timeout_seconds);
    co.response_timeout_seconds = u.timeout_seconds;
    co.read_timeout_seconds = u.timeout_seconds;
    up.client = std::make_unique<HttpClient>(io, co);
  }
  GovernanceOptions go;
  go.policy_socket = p->config.policy_socket;
  go.policy_timeout_seconds = p->config.policy_timeout_seconds;
  p->governance = std::make_unique<Governance>(io, go, p->metrics);
  p->flush_timer = std::make_unique<boost::asio::steady_timer>(io);
  if (Status s = p->server->Start(); !s.ok()) return s;
  boost::asio::co_spawn(io, p->FlushLoop(), boost::asio::detached);
  Log().info("gateway: listening on {}:{} ({} upstreams, {} models, policy at {})", p->config.host, p->server->port(),
             p->config.upstreams.size(), p->config.models.size(), p->config.policy_socket);
  return std::unique_ptr<Gateway>(new Gateway(std::move(impl)));
}

void Gateway::Stop() {
  if (!impl_ || impl_->stopping.exchange(true)) return;
  auto& io = impl_->server->io_context();
  boost::asio::post(io, [this] { impl_->flush_timer->cancel(); });
  // Deliver what was settled before the threads go away.
  for (int i = 0; i < 3 && impl_->governance->queued_usage() > 0; ++i) {
    auto f = boost::asio::co_spawn(io, impl_->governance->Flush(), boost::asio::use_future);
    if (f.wait_for(std::chrono::seconds(2)) != std::future_status::ready) break;
  }
  impl_->server->Stop();
  if (impl_->hilo) impl_->hilo->Stop();
}

int RunGatewayMain(const std::string& config_path, const std::string& host_override, int port_override) {
  auto config = LoadGatewayConfig(config_path);
  if (!config.ok()) {
    Log().error("{}", config.status().ToString());
    return 2;
  }
  if (!host_override.empty()) config->host = host_override;
  if (port_override >= 0) config->port = port_override;
  const std::string host = config->host;
  auto gw = Gateway::Start(std::move(config).value());
  if (!gw.ok()) {
    Log().error("gateway: {}", gw.status().ToString());
    return 1;
  }
  std::printf("keel gateway listening on http://%s:%d\n", host.c_str(), (*gw)->port());
  std::fflush(stdout);
  auto sig = WaitForTerminationSignal();
  if (sig.ok()) Log().info("gateway: {} received, draining", SignalName(*sig));
  (*gw)->Stop();
  return 0;
}

}  // namespace keel::gateway
