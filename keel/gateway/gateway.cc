#include "keel/gateway/gateway.h"

#include <atomic>
#include <chrono>
#include <map>
#include <random>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/core/log.h"
#include "keel/core/metrics.h"
#include "keel/core/signal.h"
#include "keel/gateway/async_http.h"
#include "keel/gateway/gateway_governance.h"
#include "keel/gateway/policy.h"
#include "keel/gateway/stream.h"
#include "keel/gateway/token_counter.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The API key a client presented: "Authorization: Bearer <key>" (OpenAI style) or "x-api-key"
// (Anthropic style).
std::string_view PresentedKey(const HttpRequest& req) {
  std::string_view auth = req.headers.Get("authorization");
  if (auth.size() > 7 && (auth.substr(0, 7) == "Bearer " || auth.substr(0, 7) == "bearer ")) {
    auth.remove_prefix(7);
    while (!auth.empty() && auth.front() == ' ') auth.remove_prefix(1);
    return auth;
  }
  return req.headers.Get("x-api-key");
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// All text a deny rule's "contains" is matched against.
std::string PromptText(const ChatRequest& r) {
  std::string text = r.system;
  text += '\n';
  text += r.prompt;
  for (const Message& m : r.messages) {
    text += '\n';
    text += m.content;
  }
  return Lower(text);
}

// The model a team's policy maps `requested` to (its rewrites).
std::string RewrittenModel(const PolicyRules& policy, const std::string& requested) {
  auto it = policy.rewrites.find(requested);
  return it == policy.rewrites.end() ? requested : it->second;
}

// Whether the team's allow list admits `model` (an empty list admits every model).
bool ModelAllowed(const PolicyRules& policy, const std::string& model) {
  if (policy.allowed_models.empty()) return true;
  for (const std::string& glob : policy.allowed_models) {
    if (GlobMatch(glob, model)) return true;
  }
  return false;
}

// "gw-<16 hex digits from the OS CSPRNG>-".
std::string NewRequestPrefix() {
  uint64_t r = 0;
  std::random_device rd;
  r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[32];
  std::snprintf(buf, sizeof(buf), "gw-%016llx-", static_cast<unsigned long long>(r));
  return buf;
}

bool Retryable(int http_status) { return http_status == 429 || http_status == 408 || http_status >= 500; }

// An upstream's error as the client should see it. The vendor rejecting the gateway's own
// credentials is the gateway's problem, not the client's: 502, not the vendor's 401/403.
GatewayError ClientFacingError(const std::string& upstream, WireFormat format, int status, std::string_view body) {
  GatewayError e = ParseUpstreamError(format, status, body);
  if (status == 401 || status == 403) {
    return {502, ErrorKind::kBadGateway, "upstream " + upstream + " rejected the gateway's credentials (" +
                                             std::to_string(status) + "): " + e.message};
  }
  return e;
}

// Whether an upstream failure (no answer at all) should move on to the next target.
bool RetryableStatus(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kCorruption ||
         s.code() == StatusCode::kIOError;
}

}  // namespace

struct Gateway::Impl {
  GatewayConfig config;
  MetricsRegistry metrics;
  std::unique_ptr<AsyncHttpServer> server;
  std::map<std::string, UpstreamConfig> upstreams;
  std::map<std::string, std::unique_ptr<HttpClient>> clients;  // by upstream name
  std::map<std::string, VirtualModel> models;
  std::map<std::string, std::unique_ptr<TokenCounter>> counters;  // by virtual model
  std::unique_ptr<TokenCounter> estimator = MakeEstimator();
  std::unique_ptr<Governance> governance;
  // Request ids must be unique across gateway processes and restarts: the policy service counts
  // a usage record once per id (and remembers ids in Redis for days), so a per-process counter
  // alone would make a restarted gateway's usage look like duplicates.
  std::string request_prefix = NewRequestPrefix();
  std::atomic<uint64_t> next_request{1};
  std::string NextRequestId() { return request_prefix + std::to_string(next_request.fetch_add(1)); }
  std::atomic<bool> stopping{false};
  std::unique_ptr<boost::asio::steady_timer> flush_timer;

  CounterFamily* requests = nullptr;
  CounterFamily* upstream_requests = nullptr;
  CounterFamily* fallbacks = nullptr;
  CounterFamily* tokens = nullptr;
  HistogramFamily* request_seconds = nullptr;
  HistogramFamily* upstream_seconds = nullptr;

  void RegisterMetrics();
  Task<void> Handle(const HttpRequest& req, AsyncResponder& resp);
  Task<void> HandleChat(const HttpRequest& req, AsyncResponder& resp, WireFormat client_format, std::string route);
  Task<void> HandleEmbeddings(const HttpRequest& req, AsyncResponder& resp);
  Task<void> HandleModels(const HttpRequest& req, AsyncResponder& resp);
  // Authenticates the request; on failure answers it and returns null.
  Task<Governance::Lookup> Authorize(const HttpRequest& req, AsyncResponder& resp,
                                                     WireFormat format, const std::string& route);
  // Call sites pass named values: GCC 12 miscompiles temporaries (braced lists, string
  // concatenations) inside a co_await expression, so every co_await here takes lvalues.
  Task<void> SendError(AsyncResponder& resp, WireFormat format, const std::string& route, const GatewayError& error,
                       const HttpHeaderList& extra = kNoHeaders);
  static inline const HttpHeaderList kNoHeaders;
  Task<void> FlushLoop();
  const TokenCounter& CounterFor(const std::string& model) const {
    auto it = counters.find(model);
    return it == counters.end() ? *estimator : *it->second;
  }
  ClientRequest UpstreamRequest(const UpstreamConfig& up, const RouteTarget& target, const std::string& body,
                                bool stream) const;
};

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

Task<void> Gateway::Impl::SendError(AsyncResponder& resp, WireFormat format, const std::string& route,
                                    const GatewayError& error, const HttpHeaderList& extra) {
  requests->WithLabels({route, std::to_string(error.status)}).Inc();
  std::string body = BuildErrorBody(format, error);
  co_await resp.Send(error.status, "application/json", std::move(body), extra);
}

ClientRequest Gateway::Impl::UpstreamRequest(const UpstreamConfig& up, const RouteTarget& target,
                                             const std::string& body, bool stream) const {
  ClientRequest r;
  r.method = "POST";
  r.body = body;
  r.headers.emplace_back("Content-Type", "application/json");
  switch (up.format) {
    case WireFormat::kAnthropicMessages:
      r.url = up.base_url + "/v1/messages";
      r.headers.emplace_back("x-api-key", up.api_key);
      r.headers.emplace_back("anthropic-version", "2023-06-01");
      break;
    case WireFormat::kGemini:
      r.url = up.base_url + "/v1beta/models/" + target.model +
              (stream ? ":streamGenerateContent?alt=sse" : ":generateContent");
      r.headers.emplace_back("x-goog-api-key", up.api_key);
      break;
    default:
      r.url = up.base_url + "/v1/chat/completions";
      if (!up.api_key.empty()) r.headers.emplace_back("Authorization", "Bearer " + up.api_key);
      break;
  }
  if (stream) r.headers.emplace_back("Accept", "text/event-stream");
  return r;
}

Task<Governance::Lookup> Gateway::Impl::Authorize(const HttpRequest& req, AsyncResponder& resp,
                                                                  WireFormat format, const std::string& route) {
  std::string_view key = PresentedKey(req);
  if (key.empty()) {
    {
      const GatewayError e{401, ErrorKind::kAuthentication, "missing API key (send \"Authorization: Bearer <key>\" or \"x-api-key: <key>\")"};
      co_await SendError(resp, format, route, e);
    }
    co_return Governance::Lookup{};
  }
  if (key.size() > 512) {
    {
      const GatewayError e{401, ErrorKind::kAuthentication, "invalid API key"};
      co_await SendError(resp, format, route, e);
    }
    co_return Governance::Lookup{};
  }
  const std::string key_hash = HashApiKey(key);
  Governance::Lookup lookup = co_await governance->Resolve(key_hash);
  if (!lookup.decision) {
    // Fail closed: a key we have never seen cannot be checked.
    {
      const GatewayError e{503, ErrorKind::kOverloaded, "the gateway's policy service is unavailable and this key is not cached; try again later"};
      co_await SendError(resp, format, route, e);
    }
    co_return Governance::Lookup{};
  }
  if (!lookup.decision->known || lookup.decision->revoked) {
    {
      const GatewayError e{401, ErrorKind::kAuthentication, lookup.decision->revoked ? "API key revoked" : "invalid API key"};
      co_await SendError(resp, format, route, e);
    }
    co_return Governance::Lookup{};
  }
  co_return lookup;
}

Task<void> Gateway::Impl::Handle(const HttpRequest& req, AsyncResponder& resp) {
  const auto start = Clock::now();
  std::string route = req.path;
  if (req.path == "/healthz" || req.path == "/metrics") {
    // Read-only endpoints: GET, or HEAD answered the same without a body; anything else is 405
    // (a DELETE or a typo must not look like it did something).
    if (req.method != "GET" && req.method != "HEAD") {
      {
        const GatewayError e{405, ErrorKind::kInvalidRequest, "method " + req.method + " not allowed on " + req.path};
        const HttpHeaderList allow = {{"Allow", "GET, HEAD"}};
        co_await SendError(resp, WireFormat::kOpenAIChat, route, e, allow);
      }
      co_return;
    }
    const bool health = req.path == "/healthz";
    std::string body = req.method == "HEAD" ? std::string() : health ? "{\"status\":\"ok\"}" : metrics.Render();
    co_await resp.Send(200, health ? "application/json" : MetricsRegistry::kContentType, std::move(body));
    co_return;
  }
  const bool post = req.method == "POST";
  if (req.path == "/v1/chat/completions" && post) {
    co_await HandleChat(req, resp, WireFormat::kOpenAIChat, route);
  } else if (req.path == "/v1/completions" && post) {
    co_await HandleChat(req, resp, WireFormat::kOpenAICompletions, route);
  } else if (req.path == "/v1/messages" && post) {
    co_await HandleChat(req, resp, WireFormat::kAnthropicMessages, route);
  } else if (req.path == "/v1/embeddings" && post) {
    co_await HandleEmbeddings(req, resp);
  } else if (req.path == "/v1/models" && req.method == "GET") {
    co_await HandleModels(req, resp);
  } else {
    const bool known = req.path == "/v1/chat/completions" || req.path == "/v1/completions" ||
                       req.path == "/v1/messages" || req.path == "/v1/embeddings" || req.path == "/v1/models";
    route = known ? req.path : "other";
    const WireFormat f = req.path == "/v1/messages" ? WireFormat::kAnthropicMessages : WireFormat::kOpenAIChat;
    const int status = known ? 405 : 404;
    const ErrorKind kind = known ? ErrorKind::kInvalidRequest : ErrorKind::kNotFound;
    std::string message = known ? "method " + req.method + " not allowed on " + req.path : "no route for " + req.path;
    HttpHeaderList extra;
    if (known) extra.emplace_back("Allow", req.path == "/v1/models" ? "GET" : "POST");
    {
      const GatewayError e{status, kind, std::move(message)};
      co_await SendError(resp, f, route, e, extra);
    }
  }
  request_seconds->WithLabels({route}).Observe(SecondsSince(start));
}

Task<void> Gateway::Impl::HandleChat(const HttpRequest& req, AsyncResponder& resp, WireFormat client_format,
                                     std::string route) {
  const Governance::Lookup auth = co_await Authorize(req, resp, client_format, route);
  if (!auth.decision) co_return;
  const std::shared_ptr<const KeyDecision>& decision = auth.decision;

  auto parsed = ParseClientRequest(client_format, req.body);
  if (!parsed.ok()) {
    {
      const GatewayError e{400, ErrorKind::kInvalidRequest, parsed.status().message()};
      co_await SendError(resp, client_format, route, e);
    }
    co_return;
  }
  ChatRequest request = std::move(parsed).value();
  const std::string client_model = request.model;

  // Policy: rewrite, allow list, deny rules, max_tokens cap.
  const PolicyRules& policy = decision->policy;
  const std::string model = RewrittenModel(policy, request.model);
  if (!ModelAllowed(policy, model)) {
    const GatewayError e{403, ErrorKind::kPermission, "model \"" + model + "\" is not allowed for team " + decision->team};
    co_await SendError(resp, client_format, route, e);
    co_return;
  }
  if (!policy.deny.empty()) {
    const std::string text = PromptText(request);
    for (const DenyRule& rule : policy.deny) {
      if (!rule.model_glob.empty() && !GlobMatch(rule.model_glob, model)) continue;
      if (!rule.contains.empty() && text.find(Lower(rule.contains)) == std::string::npos) continue;
      {
        const GatewayError e{403, ErrorKind::kPermission, rule.message.empty() ? "request denied by policy" : rule.message};
        co_await SendError(resp, client_format, route, e);
      }
      co_return;
    }
  }
  if (policy.max_tokens >= 0 && (!request.max_tokens || *request.max_tokens > policy.max_tokens)) {
    request.max_tokens = policy.max_tokens;  // clamp rather than refuse: the client still gets an answer
  }
  auto vm_it = models.find(model);
  if (vm_it == models.end()) {
    {
      const GatewayError e{404, ErrorKind::kNotFound, "model \"" + model + "\" does not exist"};
      co_await SendError(resp, client_format, route, e);
    }
    co_return;
  }
  const VirtualModel& vm = vm_it->second;
  const TokenCounter& counter = CounterFor(vm.name);

  // Count and reserve: input tokens plus the most the answer may use.
  const int64_t input_tokens = CountRequestTokens(counter, request);
  const int64_t reserve_tokens = input_tokens + request.max_tokens.value_or(0);
  double reserve_cost = 0;
  for (const RouteTarget& t : vm.targets) {
    reserve_cost = std::max(reserve_cost, CostOf(decision->prices, t.model, input_tokens, request.max_tokens.value_or(0)));
  }
  Reservation reservation;
  if (Status s = governance->Reserve(auth, reserve_tokens, reserve_cost, &reservation); !s.ok()) {
    {
      const GatewayError e{429, ErrorKind::kRateLimit, s.message()};
      co_await SendError(resp, client_format, route, e);
    }
    co_return;
  }

  const std::string request_id = NextRequestId();
  const HttpHeaderList id_header = {{"x-request-id", request_id}};
  GatewayError last_error{502, ErrorKind::kBadGateway, "no upstream answered"};
  ChatRequest upstream_request = request;
  upstream_request.stream_include_usage = true;  // ask for usage so the ledger gets the vendor's count

  for (size_t attempt = 0; attempt < vm.targets.size(); ++attempt) {
    const RouteTarget& target = vm.targets[attempt];
    if (attempt > 0) fallbacks->Get().Inc();
    const UpstreamConfig& up = upstreams.at(target.upstream);
    HttpClient& client = *clients.at(up.name);
    auto built = BuildUpstreamRequest(up.format, upstream_request, target.model, config.default_max_tokens);
    if (!built.ok()) {
      // A field this upstream cannot honour: the client's error, answered as such (no fallback).
      last_error = {400, ErrorKind::kInvalidRequest, built.status().message()};
      break;
    }
    const std::string body = std::move(built).value();
    const auto sent = Clock::now();

    if (!request.stream) {
      ClientRequest upstream_req = UpstreamRequest(up, target, body, false);
      auto r = co_await client.Fetch(std::move(upstream_req));
      if (!r.ok()) {
        upstream_requests->WithLabels({up.name, "error"}).Inc();
        last_error = {r.status().code() == StatusCode::kUnavailable ? 504 : 502,
                      r.status().code() == StatusCode::kUnavailable ? ErrorKind::kTimeout : ErrorKind::kBadGateway,
                      "upstream " + up.name + ": " + r.status().message()};
        if (RetryableStatus(r.status())) continue;
        break;
      }
      upstream_seconds->WithLabels({up.name}).Observe(SecondsSince(sent));
      if (r->status != 200) {
        upstream_requests->WithLabels({up.name, std::to_string(r->status)}).Inc();
        last_error = ClientFacingError(up.name, up.format, r->status, r->body);
        if (Retryable(r->status)) continue;
        break;
      }
      auto answer = ParseUpstreamResponse(up.format, r->body);
      if (!answer.ok()) {
        upstream_requests->WithLabels({up.name, "garbage"}).Inc();
        last_error = {502, ErrorKind::kBadGateway, "upstream " + up.name + " sent an unreadable answer: " +
                                                       answer.status().message()};
        continue;
      }
      upstream_requests->WithLabels({up.name, "200"}).Inc();
      ChatResponse& out = answer.value();
      int64_t in = out.usage.input_tokens >= 0 ? out.usage.input_tokens : input_tokens;
      int64_t outn = out.usage.output_tokens;
      if (outn < 0) {
        outn = counter.Count(out.content);
        for (const ToolCall& c : out.tool_calls) outn += counter.Count(c.name) + counter.Count(c.arguments_json);
      }
      out.usage = {in, outn};
      governance->Settle(reservation, UsageRecord{request_id, decision->key_id, decision->team, target.model, in, outn,
                                                  CostOf(decision->prices, target.model, in, outn), UnixMillis()});
      tokens->WithLabels({"input"}).Inc(static_cast<double>(in));
      tokens->WithLabels({"output"}).Inc(static_cast<double>(outn));
      requests->WithLabels({route, "200"}).Inc();
      std::string answer_body = BuildClientResponse(client_format, out, client_model);
      co_await resp.Send(200, "application/json", std::move(answer_body), id_header);
      co_return;
    }

    // Streaming.
    ClientRequest upstream_req = UpstreamRequest(up, target, body, true);
    auto opened = co_await client.Open(std::move(upstream_req));
    if (!opened.ok()) {
      upstream_requests->WithLabels({up.name, "error"}).Inc();
      last_error = {504, ErrorKind::kTimeout, "upstream " + up.name + ": " + opened.status().message()};
      if (RetryableStatus(opened.status())) continue;
      break;
    }
    upstream_seconds->WithLabels({up.name}).Observe(SecondsSince(sent));
    std::unique_ptr<ResponseStream> stream = std::move(opened).value();
    if (stream->status() != 200) {
      std::string err;
      for (int i = 0; i < 64 && err.size() < (64 << 10); ++i) {
        const size_t before = err.size();
        if (!(co_await stream->Read(&err)).ok() || err.size() == before) break;
      }
      upstream_requests->WithLabels({up.name, std::to_string(stream->status())}).Inc();
      last_error = ClientFacingError(up.name, up.format, stream->status(), err);
      if (Retryable(stream->status())) continue;
      break;
    }
    auto decoder = MakeStreamDecoder(up.format);
    auto encoder = MakeStreamEncoder(client_format, client_model, request.stream_include_usage);
    std::vector<StreamEvent> events;
    std::string out, chunk, generated;
    Usage vendor_usage;
    const HttpHeaderList stream_headers = {{"Cache-Control", "no-cache"}, {"x-request-id", request_id}};
    bool started = false;  // headers sent to the client: no fallback from here on
    bool client_gone = false;
    Status failure = Status::Ok();
    // The client's format may need input tokens at the start (Anthropic's message_start).
    StreamEvent input_usage;
    input_usage.kind = StreamEvent::Kind::kUsage;
    input_usage.usage = {input_tokens, -1};
    encoder->Encode(input_usage, &out);
    for (bool done = false; !done;) {
      chunk.clear();
      Status rs = co_await stream->Read(&chunk);
      events.clear();
      if (!rs.ok()) {
        failure = rs;
        break;
      }
      if (chunk.empty()) {
        failure = decoder->Finish(&events);
        done = true;
      } else {
        failure = decoder->Feed(chunk, &events);
      }
      for (const StreamEvent& ev : events) {
        if (ev.kind == StreamEvent::Kind::kTextDelta) generated += ev.text;
        if (ev.kind == StreamEvent::Kind::kToolCallDelta || ev.kind == StreamEvent::Kind::kToolCallStart) {
          generated += ev.tool_call.name;
          generated += ev.text;
        }
        if (ev.kind == StreamEvent::Kind::kUsage) {
          if (ev.usage.input_tokens >= 0) vendor_usage.input_tokens = ev.usage.input_tokens;
          if (ev.usage.output_tokens >= 0) vendor_usage.output_tokens = ev.usage.output_tokens;
        }
        encoder->Encode(ev, &out);
      }
      if (!failure.ok()) break;
      // After the first chunk (sent at once, for time to first token): when more of the
      // upstream's burst is already here, take it before writing so a burst goes out in one
      // write (no waiting: BytesReady only counts bytes that have arrived).
      if (started && !done && out.size() < (64 << 10) && stream->BytesReady() > 0) continue;
      if (!out.empty()) {
        if (!started) {
          started = true;
          if (!co_await resp.BeginStream(200, "text/event-stream", stream_headers)) {
            client_gone = true;
            break;
          }
        }
        if (!co_await resp.WriteChunk(out)) {
          client_gone = true;
          break;
        }
        out.clear();
      }
    }
    if (!failure.ok() && !started) {
      // Nothing reached the client yet: this target failed like any other.
      upstream_requests->WithLabels({up.name, "broken_stream"}).Inc();
      last_error = {502, ErrorKind::kBadGateway, "upstream " + up.name + ": " + failure.message()};
      continue;
    }
    upstream_requests->WithLabels({up.name, failure.ok() ? "200" : "broken_stream"}).Inc();
    if (!client_gone) {
      if (!failure.ok()) {
        out.clear();
        encoder->EncodeError(GatewayError{502, ErrorKind::kBadGateway, "upstream " + up.name + ": " + failure.message()},
                             &out);
        Log().warn("gateway: {} stream from {} broke after it started: {}", request_id, up.name, failure.message());
      }
      if (!started) {
        started = co_await resp.BeginStream(200, "text/event-stream", stream_headers);
      }
      if (started && !out.empty()) co_await resp.WriteChunk(out);
      if (started) co_await resp.EndStream();
    }
    const int64_t in = vendor_usage.input_tokens >= 0 ? vendor_usage.input_tokens : input_tokens;
    const int64_t outn = vendor_usage.output_tokens >= 0 ? vendor_usage.output_tokens : counter.Count(generated);
    governance->Settle(reservation, UsageRecord{request_id, decision->key_id, decision->team, target.model, in, outn,
                                                CostOf(decision->prices, target.model, in, outn), UnixMillis()});
    tokens->WithLabels({"input"}).Inc(static_cast<double>(in));
    tokens->WithLabels({"output"}).Inc(static_cast<double>(outn));
    requests->WithLabels({route, "200"}).Inc();
    co_return;
  }
  governance->Release(reservation);
  {
    const GatewayError e{last_error.status, last_error.kind, last_error.message};
    co_await SendError(resp, client_format, route, e, id_header);
  }
}

Task<void> Gateway::Impl::HandleEmbeddings(const HttpRequest& req, AsyncResponder& resp) {
  const std::string route = "/v1/embeddings";
  const WireFormat f = WireFormat::kOpenAIChat;
  const Governance::Lookup auth = co_await Authorize(req, resp, f, route);
  if (!auth.decision) co_return;
  const std::shared_ptr<const KeyDecision>& decision = auth.decision;
  JsonReadError why = JsonReadError::kNone;
  Result<json> parsed = ParseUntrustedJson(req.body, JsonLimits{.require_object = true}, &why);
  if (!parsed.ok()) {
    {
      const bool limit = why == JsonReadError::kTooDeep || why == JsonReadError::kTooManyValues;
      const GatewayError e{400, ErrorKind::kInvalidRequest,
                           limit ? "request body: " + parsed.status().message() : "request body is not a JSON object"};
      co_await SendError(resp, f, route, e);
    }
    co_return;
  }
  json body = std::move(parsed).value();
  if (!body.contains("model") || !body["model"].is_string()) {
    {
      const GatewayError e{400, ErrorKind::kInvalidRequest, "model: expected a string"};
      co_await SendError(resp, f, route, e);
    }
    co_return;
  }
  if (!body.contains("input") || !(body["input"].is_string() || body["input"].is_array())) {
    {
      const GatewayError e{400, ErrorKind::kInvalidRequest, "input: expected a string or an array"};
      co_await SendError(resp, f, route, e);
    }
    co_return;
  }
  std::string model = body["model"].get<std::string>();
  model = RewrittenModel(decision->policy, model);
  if (!ModelAllowed(decision->policy, model)) {
    {
      const GatewayError e{403, ErrorKind::kPermission, "model \"" + model + "\" is not allowed for team " + decision->team};
      co_await SendError(resp, f, route, e);
    }
    co_return;
  }
  auto vm_it = models.find(model);
  if (vm_it == models.end()) {
    {
      const GatewayError e{404, ErrorKind::kNotFound, "model \"" + model + "\" does not exist"};
      co_await SendError(resp, f, route, e);
    }
    co_return;
  }
  const TokenCounter& counter = CounterFor(model);
  int64_t input_tokens = 0;
  if (body["input"].is_string()) {
    input_tokens = counter.Count(body["input"].get<std::string>());
  } else {
    for (const json& item : body["input"]) {
      if (item.is_string()) input_tokens += counter.Count(item.get<std::string>());
      else if (item.is_array()) input_tokens += static_cast<int64_t>(item.size());  // pre-tokenized input
    }
  }
  Reservation reservation;
  double reserve_cost = CostOf(decision->prices, vm_it->second.targets.front().model, input_tokens, 0);
  if (Status s = governance->Reserve(auth, input_tokens, reserve_cost, &reservation); !s.ok()) {
    {
      const GatewayError e{429, ErrorKind::kRateLimit, s.message()};
      co_await SendError(resp, f, route, e);
    }
    co_return;
  }
  const std::string request_id = NextRequestId();
  GatewayError last_error{400, ErrorKind::kInvalidRequest, "no upstream of model \"" + model + "\" serves embeddings"};
  for (const RouteTarget& target : vm_it->second.targets) {
    const UpstreamConfig& up = upstreams.at(target.upstream);
    if (up.format != WireFormat::kOpenAIChat) continue;  // only OpenAI-format upstreams have /v1/embeddings
    body["model"] = target.model;
    ClientRequest r = UpstreamRequest(up, target, body.dump(), false);
    r.url = up.base_url + "/v1/embeddings";
    auto got = co_await clients.at(up.name)->Fetch(std::move(r));
    if (!got.ok()) {
      last_error = {504, ErrorKind::kTimeout, "upstream " + up.name + ": " + got.status().message()};
      continue;
    }
    if (got->status != 200) {
      last_error = ClientFacingError(up.name, up.format, got->status, got->body);
      if (Retryable(got->status)) continue;
      break;
    }
    // Upstream answers are larger than requests (thousands of vectors) but still bounded.
    Result<json> answer_or =
        ParseUntrustedJson(got->body, JsonLimits{.max_values = size_t{16} << 20, .require_object = true});
    if (!answer_or.ok()) {
      last_error = {502, ErrorKind::kBadGateway, "upstream " + up.name + " sent an unreadable answer"};
      continue;
    }
    json answer = std::move(answer_or).value();
    int64_t in = input_tokens;
    if (answer.contains("usage") && answer["usage"].is_object() && answer["usage"].contains("prompt_tokens") &&
        answer["usage"]["prompt_tokens"].is_number_integer()) {
      in = answer["usage"]["prompt_tokens"].get<int64_t>();
    }
    answer["model"] = vm_it->first;  // the name the client asked for, as for chat
    governance->Settle(reservation, UsageRecord{request_id, decision->key_id, decision->team, target.model, in, 0,
                                                CostOf(decision->prices, target.model, in, 0), UnixMillis()});
    tokens->WithLabels({"input"}).Inc(static_cast<double>(in));
    requests->WithLabels({route, "200"}).Inc();
    const HttpHeaderList id_header = {{"x-request-id", request_id}};
    std::string answer_body = answer.dump();
    co_await resp.Send(200, "application/json", std::move(answer_body), id_header);
    co_return;
  }
  governance->Release(reservation);
  {
    const GatewayError e{last_error.status, last_error.kind, last_error.message};
    co_await SendError(resp, f, route, e);
  }
}

Task<void> Gateway::Impl::HandleModels(const HttpRequest& req, AsyncResponder& resp) {
  const std::string route = "/v1/models";
  const Governance::Lookup auth = co_await Authorize(req, resp, WireFormat::kOpenAIChat, route);
  if (!auth.decision) co_return;
  const std::shared_ptr<const KeyDecision>& decision = auth.decision;
  json data = json::array();
  for (const auto& [name, vm] : models) {
    if (!ModelAllowed(decision->policy, name)) continue;
    data.push_back({{"id", name}, {"object", "model"}, {"created", 0}, {"owned_by", "keel-gateway"}});
  }
  requests->WithLabels({route, "200"}).Inc();
  json list = {{"object", "list"}, {"data", std::move(data)}};
  std::string list_body = list.dump();
  co_await resp.Send(200, "application/json", std::move(list_body));
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

Gateway::Gateway(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Gateway::~Gateway() { Stop(); }

int Gateway::port() const { return impl_->server ? impl_->server->port() : 0; }

Result<std::unique_ptr<Gateway>> Gateway::Start(GatewayConfig config) {
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  Impl* p = impl.get();
  p->RegisterMetrics();
  for (const UpstreamConfig& u : p->config.upstreams) p->upstreams[u.name] = u;
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
  so.error_body = [](int status, std::string_view message) {
    return BuildErrorBody(WireFormat::kOpenAIChat, GatewayError{status, ErrorKindForStatus(status), std::string(message)});
  };
  p->server = std::make_unique<AsyncHttpServer>(
      so, [p](const HttpRequest& req, AsyncResponder& resp) -> Task<void> { return p->Handle(req, resp); });
  auto& io = p->server->io_context();
  for (const UpstreamConfig& u : p->config.upstreams) {
    ClientOptions co;
    co.connect_timeout_seconds = std::min(5.0, u.timeout_seconds);
    co.response_timeout_seconds = u.timeout_seconds;
    co.read_timeout_seconds = u.timeout_seconds;
    p->clients[u.name] = std::make_unique<HttpClient>(io, co);
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
