// Internal to gateway*.cc: the gateway's state and the request each filter works on.
//
// A chat request runs a chain of small filters (gateway_chat.cc), in this order:
//   Authenticate  key -> KeyDecision. Fails CLOSED for a key the gateway has never seen while the
//                 policy service is down (503); serves a known key from its cached decision
//                 (fails open on staleness, logged and counted).
//   Parse         the front's format -> ChatRequest (400 naming the field).
//   ApplyPolicy   the team's rewrites, allow list, deny rules, max_tokens clamp (closed: 403).
//   ApplyHilo     with a "hilo" config: the product state's gateway level -- the tier's model
//                 for a tiered virtual model, and max_tokens clamped to the level's clamp. The
//                 state is read once per request (Handle), so one request sees one state.
//   Route         the virtual model (404).
//   Reserve       counts input tokens, reserves them plus max_tokens against every budget
//                 (closed: 429 with retry-after; local figures, so it works while the policy
//                 service is down).
//   Relay         tries the model's targets in order (fallback on 429/408/5xx, timeouts and
//                 connection errors before anything reached the client), translates back,
//                 streamed or whole, then settles the usage (or releases the reservation).
// A filter either continues (true) or has answered the client and stops the chain (false).
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <vector>
#include <memory>
#include <string>

#include <boost/asio/steady_timer.hpp>

#include "keel/core/metrics.h"
#include "keel/gateway/async_http.h"
#include "keel/gateway/front.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/gateway_governance.h"
#include "keel/gateway/token_counter.h"
#include "keel/gateway/vendor.h"
#include "keel/hilo/service_link.h"

namespace keel::gateway {

using Clock = std::chrono::steady_clock;

// One client request on its way through the filters.
struct Exchange {
  Exchange(const HttpRequest& h, AsyncResponder& r, const ClientFront& f, std::string rt)
      : http(h), resp(r), front(f), route(std::move(rt)) {}
  const HttpRequest& http;
  AsyncResponder& resp;
  const ClientFront& front;
  std::string route;          // the metrics label
  std::string path_model;     // a model named by the URL (Gemini), else ""
  bool stream_by_path = false;
  std::string request_id;     // minted on arrival
  HttpHeaderList headers;     // sent with every answer: x-request-id, request-id
  Governance::Lookup auth;
  ChatRequest request;
  std::string client_model;   // as the client named it
  std::string model;          // after the team's rewrites
  const VirtualModel* vm = nullptr;
  const TokenCounter* counter = nullptr;
  int64_t input_tokens = 0;
  Reservation reservation;
  int hilo_index = -1;        // the HiLO state applied to this request (catalog index); -1 = none
  bool shed = false;          // the gateway itself refused it with a 429 (budget): the meter's Shed
};

// What one attempt at one target came to.
enum class Attempt { kAnswered, kNextTarget, kGiveUp };

struct Upstream {
  UpstreamConfig config;
  const VendorAdapter* vendor = nullptr;
  std::unique_ptr<HttpClient> client;
};

struct Gateway::Impl {
  GatewayConfig config;
  MetricsRegistry metrics;
  // HiLO (null without a "hilo" config member). Declared before the server so that it outlives
  // every request that read a state from it.
  std::unique_ptr<hilo::ServiceLink> hilo;
  // Tiered virtual model -> per catalog state index, the virtual model the state's tier routes to.
  std::map<std::string, std::vector<std::string>, std::less<>> hilo_routes;
  std::unique_ptr<AsyncHttpServer> server;
  std::map<std::string, Upstream> upstreams;  // by name
  std::map<std::string, VirtualModel> models;
  std::map<std::string, std::unique_ptr<TokenCounter>> counters;  // by virtual model
  std::unique_ptr<TokenCounter> estimator = MakeEstimator();
  std::unique_ptr<Governance> governance;
  // Request ids must be unique across gateway processes and restarts: the policy service counts
  // a usage record once per id (and remembers ids in Redis for days), so a per-process counter
  // alone would make a restarted gateway's usage look like duplicates.
  std::string request_prefix;
  std::atomic<uint64_t> next_request{1};
  std::atomic<bool> stopping{false};
  std::unique_ptr<boost::asio::steady_timer> flush_timer;

  CounterFamily* requests = nullptr;
  CounterFamily* upstream_requests = nullptr;
  CounterFamily* fallbacks = nullptr;
  CounterFamily* tokens = nullptr;
  HistogramFamily* request_seconds = nullptr;
  HistogramFamily* upstream_seconds = nullptr;

  std::string NextRequestId() { return request_prefix + std::to_string(next_request.fetch_add(1)); }
  void RegisterMetrics();
  const TokenCounter& CounterFor(const std::string& model) const {
    auto it = counters.find(model);
    return it == counters.end() ? *estimator : *it->second;
  }

  // gateway.cc: routing and answers.
  Task<void> Handle(const HttpRequest& req, AsyncResponder& resp);
  // Call sites pass named values: GCC 12 miscompiles temporaries (braced lists, string
  // concatenations) inside a co_await expression, so every co_await here takes lvalues.
  Task<void> Fail(Exchange& x, const GatewayError& error, const HttpHeaderList& extra = kNoHeaders);
  static inline const HttpHeaderList kNoHeaders;
  Task<void> FlushLoop();

  // gateway_chat.cc: the chat filter chain.
  Task<void> HandleChat(Exchange& x);
  Task<bool> Authenticate(Exchange& x);
  Task<bool> Parse(Exchange& x);
  Task<bool> ApplyPolicy(Exchange& x);
  // Never stops the chain and never waits: a plain function, no coroutine frame per request.
  void ApplyHilo(Exchange& x);
  Status StartHilo(int workers);  // gateway.cc: the link, the tier table, the catalog checks
  Task<bool> Route(Exchange& x);
  Task<bool> Reserve(Exchange& x);
  Task<bool> Relay(Exchange& x);
  // Reserves `tokens`/`cost` against the key's budgets; answers 429 (with retry-after and
  // x-should-retry) and returns false when one is exhausted.
  Task<bool> ReserveBudget(Exchange& x, int64_t tokens, double cost);
  Task<Attempt> RelayWhole(Exchange& x, const RouteTarget& target, Upstream& up, ClientRequest request,
                           GatewayError* last_error);
  Task<Attempt> RelayStream(Exchange& x, const RouteTarget& target, Upstream& up, ClientRequest request,
                            GatewayError* last_error);

  // gateway_endpoints.cc: the other API routes (they reuse the filters they need).
  // What the model lists show: the configured models and the tiered (HiLO) names, sorted.
  bool ModelExists(const std::string& name) const;
  std::vector<std::string> ModelNames() const;
  Task<void> HandleEmbeddings(Exchange& x);
  Task<void> HandleModels(Exchange& x, std::string_view id);
  Task<void> HandleGeminiModels(Exchange& x, std::string_view id);
  Task<void> HandleCountTokens(Exchange& x);

  // Settles a finished request's usage against its reservation and the metrics; `status` is
  // the request's label on keel_gateway_requests_total (499: the client left before its answer).
  void Settle(Exchange& x, const RouteTarget& target, int64_t input_tokens, int64_t output_tokens,
              std::string_view status = "200");
  // A whole (non-streamed) answer's upstream request whose client left while it was awaited:
  // the upstream connection is closed, so the upstream stops generating for nobody.
  void SettleAbandoned(Exchange& x, const RouteTarget& target, const Upstream& up);
};

// The model a team's policy maps `requested` to (its rewrites), and whether its allow list
// admits `model` (an empty list admits every model).
std::string RewrittenModel(const PolicyRules& policy, const std::string& requested);
bool ModelAllowed(const PolicyRules& policy, const std::string& model);
int64_t UnixMillis();
// A budget 429's retry-after (when the budget has a window) and x-should-retry: SDKs retry 429s
// within seconds by default, which only helps when the window rolls over within their wait
// (60 s) and the request fits an empty budget.
HttpHeaderList BudgetDenialHeaders(const Governance::Denial& denial);
// Whether an upstream's HTTP status should move on to the next target (429, 408, 5xx).
bool Retryable(int http_status);
// An upstream's error as the client should see it (the vendor refusing the gateway's own
// credentials is a 502, not the vendor's 401/403).
GatewayError ClientFacingError(const Upstream& up, int status, std::string_view body, const HttpHeaders& headers);
double SecondsSince(Clock::time_point t);

}  // namespace keel::gateway
