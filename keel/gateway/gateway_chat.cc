// The chat filter chain (order and fail-open/closed choices: gateway_internal.h).
#include "keel/core/log.h"
#include "keel/gateway/gateway_internal.h"
#include "keel/gateway/vendors/gemini/gemini_front.h"
#include "keel/gateway/policy.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

// The API key a client presented: "Authorization: Bearer <key>" (OpenAI style), "x-api-key"
// (Anthropic style), or for Gemini routes "x-goog-api-key" / ?key=.
std::string PresentedKey(const Exchange& x) {
  std::string_view auth = x.http.headers.Get("authorization");
  if (auth.size() > 7 && (auth.substr(0, 7) == "Bearer " || auth.substr(0, 7) == "bearer ")) {
    auth.remove_prefix(7);
    while (!auth.empty() && auth.front() == ' ') auth.remove_prefix(1);
    return std::string(auth);
  }
  if (std::string_view k = x.http.headers.Get("x-api-key"); !k.empty()) return std::string(k);
  if (x.front.format() == WireFormat::kGemini) {
    return GeminiPresentedKey(x.http.headers.Get("x-goog-api-key"), x.http.query);
  }
  return "";
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// All text a deny rule's "contains" is matched against: what the model will read, tool calls'
// arguments and the tools' own descriptions included (each carries text to the model as well).
std::string PromptText(const ChatRequest& r) {
  std::string text = r.system;
  text += '\n';
  text += r.prompt;
  for (const Message& m : r.messages) {
    text += '\n';
    text += m.content;
    for (const ToolCall& c : m.tool_calls) {
      text += '\n';
      text += c.name;
      text += '\n';
      text += c.arguments_json;
    }
  }
  for (const Tool& t : r.tools) {
    text += '\n';
    text += t.name;
    text += '\n';
    text += t.description;
    text += '\n';
    text += t.parameters_json;
  }
  return Lower(text);
}

// Whether an upstream failure (no answer at all) should move on to the next target.
bool RetryableStatus(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kCorruption ||
         s.code() == StatusCode::kIOError || s.code() == StatusCode::kResourceExhausted;
}

GatewayError TransportError(const Upstream& up, const Status& s) {
  // Unavailable also covers a refused connection or a failed resolve, which are a bad gateway
  // (502), not a timeout (504); the HTTP client names its timeouts ("timed out", "read timeout").
  const bool timeout = s.code() == StatusCode::kUnavailable && (s.message().find("timed out") != std::string::npos ||
                                                                 s.message().find("timeout") != std::string::npos);
  return {timeout ? 504 : 502, timeout ? ErrorKind::kTimeout : ErrorKind::kBadGateway,
          "upstream " + up.config.name + ": " + s.message()};
}


}  // namespace

bool Retryable(int http_status) { return http_status == 429 || http_status == 408 || http_status >= 500; }

// An upstream's error as the client should see it. The vendor rejecting the gateway's own
// credentials is the gateway's problem, not the client's: 502, not the vendor's 401/403.
GatewayError ClientFacingError(const Upstream& up, int status, std::string_view body, const HttpHeaders& headers) {
  GatewayError e = up.vendor->ParseError(status, body);
  // Delay-seconds only (an HTTP date would need the upstream's clock), and bounded: it is an
  // upstream's word passed to the client's retry loop.
  const std::string_view ra = headers.Get("retry-after");
  if (!ra.empty() && ra.size() <= 6 && ra.find_first_not_of("0123456789") == std::string_view::npos) {
    e.retry_after = std::string(ra);
  }
  if (status == 401 || status == 403) {
    return {502, ErrorKind::kBadGateway, "upstream " + up.config.name + " rejected the gateway's credentials (" +
                                             std::to_string(status) + "): " + e.message};
  }
  return e;
}

Task<void> Gateway::Impl::HandleChat(Exchange& x) {
  // Each filter answers the client itself when it stops the chain. Results are named before they
  // are tested: GCC 12 miscompiles `if (!co_await f(x))` here (the callee got a bad reference).
  //
  // With HiLO the chain is metered for the load report: arrived now; shed when the gateway itself
  // answers 429; otherwise started once admitted (or refused for another reason: a 4xx that cost
  // the gateway a little work) and finished with its whole latency. A request holds its
  // connection all along, so its busy time is its latency (workers = the connection cap).
  const auto arrived = Clock::now();
  hilo::LoadMeter* meter = hilo ? &hilo->meter() : nullptr;
  if (meter) meter->Arrive();
  bool go = co_await Authenticate(x);
  if (go) go = co_await Parse(x);
  if (go) go = co_await ApplyPolicy(x);
  if (go && hilo) ApplyHilo(x);
  if (go) go = co_await Route(x);
  if (go) go = co_await Reserve(x);
  if (meter && x.shed) {
    meter->Shed();
    co_return;
  }
  if (meter) meter->Started();
  if (go) co_await Relay(x);
  if (meter) {
    const double seconds = SecondsSince(arrived);
    meter->Finish(seconds, seconds);
  }
}

// The product state's gateway level (docs/gateway.md "HiLO"), after the team's policy: the allow
// list and deny rules see the model the client asked for ("answer"), not the tier's model, so a
// state change never turns an allowed request into a 403.
void Gateway::Impl::ApplyHilo(Exchange& x) {
  const hilo::GatewayLevel& level = hilo->catalog().states[x.hilo_index].gateway;
  if (auto it = hilo_routes.find(x.model); it != hilo_routes.end()) {
    x.model = it->second[x.hilo_index];
    x.headers.emplace_back("x-keel-hilo-tier", level.model);
  }
  // Clamped in the neutral request, so every client form (max_tokens, max_completion_tokens,
  // max_output_tokens, maxOutputTokens) and every upstream form is covered, and Reserve (next)
  // reserves the clamped figure. No max_tokens at all means "as long as the model likes": the
  // clamp then sets it, as a team policy's max_tokens does.
  if (!x.request.max_tokens || *x.request.max_tokens > level.max_tokens_clamp) {
    x.request.max_tokens = level.max_tokens_clamp;
  }
}

Task<bool> Gateway::Impl::Authenticate(Exchange& x) {
  const std::string key = PresentedKey(x);
  if (key.empty() || key.size() > 512) {
    const GatewayError e{401, ErrorKind::kAuthentication,
                         key.empty() ? "missing API key (send \"Authorization: Bearer <key>\" or \"x-api-key: <key>\")"
                                     : "invalid API key"};
    co_await Fail(x, e);
    co_return false;
  }
  const std::string key_hash = HashApiKey(key);
  x.auth = co_await governance->Resolve(key_hash);
  if (!x.auth.decision) {
    // Fail closed: a key we have never seen cannot be checked.
    const GatewayError e{503, ErrorKind::kOverloaded,
                         "the gateway's policy service is unavailable and this key is not cached; try again later"};
    co_await Fail(x, e);
    co_return false;
  }
  if (!x.auth.decision->known || x.auth.decision->revoked) {
    const GatewayError e{401, ErrorKind::kAuthentication,
                         x.auth.decision->revoked ? "API key revoked" : "invalid API key"};
    co_await Fail(x, e);
    co_return false;
  }
  co_return true;
}

Task<bool> Gateway::Impl::Parse(Exchange& x) {
  auto parsed = x.front.Parse(x.http.body, x.path_model, x.stream_by_path);
  if (!parsed.ok()) {
    const GatewayError e{400, ErrorKind::kInvalidRequest, parsed.status().message()};
    co_await Fail(x, e);
    co_return false;
  }
  x.request = std::move(parsed).value();
  x.client_model = x.request.model;
  co_return true;
}

Task<bool> Gateway::Impl::ApplyPolicy(Exchange& x) {
  const KeyDecision& decision = *x.auth.decision;
  const PolicyRules& policy = decision.policy;
  x.model = RewrittenModel(policy, x.client_model);
  if (!ModelAllowed(policy, x.model)) {
    const GatewayError e{403, ErrorKind::kPermission,
                         "model \"" + x.model + "\" is not allowed for team " + decision.team};
    co_await Fail(x, e);
    co_return false;
  }
  if (!policy.deny.empty()) {
    const std::string text = PromptText(x.request);
    for (const DenyRule& rule : policy.deny) {
      if (!rule.model_glob.empty() && !GlobMatch(rule.model_glob, x.model)) continue;
      if (!rule.contains.empty() && text.find(Lower(rule.contains)) == std::string::npos) continue;
      const GatewayError e{403, ErrorKind::kPermission,
                           rule.message.empty() ? "request denied by policy" : rule.message};
      co_await Fail(x, e);
      co_return false;
    }
  }
  if (policy.max_tokens >= 0 && (!x.request.max_tokens || *x.request.max_tokens > policy.max_tokens)) {
    x.request.max_tokens = policy.max_tokens;  // clamp rather than refuse: the client still gets an answer
  }
  co_return true;
}

Task<bool> Gateway::Impl::Route(Exchange& x) {
  auto it = models.find(x.model);
  if (it == models.end()) {
    const GatewayError e{404, ErrorKind::kNotFound, "model \"" + x.model + "\" does not exist"};
    co_await Fail(x, e);
    co_return false;
  }
  x.vm = &it->second;
  x.counter = &CounterFor(x.vm->name);
  co_return true;
}

Task<bool> Gateway::Impl::Reserve(Exchange& x) {
  // Input tokens plus the most the answer may use, at the dearest target's prices.
  x.input_tokens = CountRequestTokens(*x.counter, x.request);
  const int64_t max_out = x.request.max_tokens.value_or(0);
  double cost = 0;
  for (const RouteTarget& t : x.vm->targets) {
    cost = std::max(cost, CostOf(x.auth.decision->prices, t.model, x.input_tokens, max_out));
  }
  const bool reserved = co_await ReserveBudget(x, x.input_tokens + max_out, cost);
  co_return reserved;
}

Task<bool> Gateway::Impl::ReserveBudget(Exchange& x, int64_t tokens, double cost) {
  Governance::Denial denial;
  if (Status s = governance->Reserve(x.auth, tokens, cost, &x.reservation, &denial); !s.ok()) {
    // SDKs retry 429s by default: tell them when the budget's window rolls over, and not to retry
    // sooner than that (or at all, for a budget without a window) -- their backoff is seconds.
    const HttpHeaderList extra = BudgetDenialHeaders(denial);
    const GatewayError e{429, ErrorKind::kRateLimit, s.message()};
    x.shed = true;
    co_await Fail(x, e, extra);
    co_return false;
  }
  co_return true;
}

Task<bool> Gateway::Impl::Relay(Exchange& x) {
  GatewayError last_error{502, ErrorKind::kBadGateway, "no upstream answered"};
  for (size_t i = 0; i < x.vm->targets.size(); ++i) {
    const RouteTarget& target = x.vm->targets[i];
    if (i > 0) fallbacks->Get().Inc();
    Upstream& up = upstreams.at(target.upstream);
    auto built = up.vendor->BuildChat(up.config, x.request, target.model, config.default_max_tokens);
    if (!built.ok()) {
      // A field this upstream cannot honour: the client's error, answered as such (no fallback).
      last_error = {400, ErrorKind::kInvalidRequest, built.status().message()};
      break;
    }
    Attempt attempt = Attempt::kGiveUp;  // named, not tested inside co_await (GCC 12, see HandleChat)
    if (x.request.stream) {
      attempt = co_await RelayStream(x, target, up, std::move(built).value(), &last_error);
    } else {
      attempt = co_await RelayWhole(x, target, up, std::move(built).value(), &last_error);
    }
    if (attempt == Attempt::kAnswered) co_return true;
    if (attempt == Attempt::kGiveUp) break;
  }
  governance->Release(x.reservation);
  co_await Fail(x, last_error);
  co_return false;
}

// One target, answered whole.
Task<Attempt> Gateway::Impl::RelayWhole(Exchange& x, const RouteTarget& target, Upstream& up,
                                        ClientRequest request, GatewayError* last_error) {
  const auto sent = Clock::now();
  // The client is watched while the upstream works: one that leaves takes the upstream's work
  // with it (streams notice at their next write, RelayStream).
  auto r = co_await up.client->FetchWhile(std::move(request), [&x] { return !x.resp.ClientGone(); });
  if (!r.ok() && r.status().code() == StatusCode::kCancelled) {
    SettleAbandoned(x, target, up);
    co_return Attempt::kAnswered;  // nobody to answer, and no fallback for nobody
  }
  if (!r.ok()) {
    upstream_requests->WithLabels({up.config.name, "error"}).Inc();
    *last_error = TransportError(up, r.status());
    co_return RetryableStatus(r.status()) ? Attempt::kNextTarget : Attempt::kGiveUp;
  }
  upstream_seconds->WithLabels({up.config.name}).Observe(SecondsSince(sent));
  if (r->status != 200) {
    upstream_requests->WithLabels({up.config.name, std::to_string(r->status)}).Inc();
    *last_error = ClientFacingError(up, r->status, r->body, r->headers);
    co_return Retryable(r->status) ? Attempt::kNextTarget : Attempt::kGiveUp;
  }
  auto answer = up.vendor->ParseChat(r->body);
  if (!answer.ok()) {
    upstream_requests->WithLabels({up.config.name, "garbage"}).Inc();
    *last_error = {502, ErrorKind::kBadGateway,
                  "upstream " + up.config.name + " sent an unreadable answer: " + answer.status().message()};
    co_return Attempt::kNextTarget;
  }
  upstream_requests->WithLabels({up.config.name, "200"}).Inc();
  ChatResponse& whole = answer.value();
  const int64_t whole_in = whole.usage.input_tokens >= 0 ? whole.usage.input_tokens : x.input_tokens;
  int64_t whole_out = whole.usage.output_tokens;
  if (whole_out < 0) {
    whole_out = x.counter->Count(whole.content);
    for (const ToolCall& c : whole.tool_calls) {
      whole_out += x.counter->Count(c.name) + x.counter->Count(c.arguments_json);
    }
  }
  whole.usage = {whole_in, whole_out};
  Settle(x, target, whole_in, whole_out);
  std::string body = x.front.BuildAnswer(whole, x.request, x.client_model);
  co_await x.resp.Send(200, "application/json", std::move(body), x.headers);
  co_return Attempt::kAnswered;
}

// One target, streamed: nothing reaches the client until the upstream's first events are
// decoded, so a failure before that still moves on to the next target.
Task<Attempt> Gateway::Impl::RelayStream(Exchange& x, const RouteTarget& target, Upstream& up,
                                         ClientRequest request, GatewayError* last_error) {
  const auto sent = Clock::now();
  auto opened = co_await up.client->Open(std::move(request));
  if (!opened.ok()) {
    upstream_requests->WithLabels({up.config.name, "error"}).Inc();
    *last_error = TransportError(up, opened.status());
    co_return RetryableStatus(opened.status()) ? Attempt::kNextTarget : Attempt::kGiveUp;
  }
  upstream_seconds->WithLabels({up.config.name}).Observe(SecondsSince(sent));
  std::unique_ptr<ResponseStream> stream = std::move(opened).value();
  if (stream->status() != 200) {
    // The vendor's error, in full (bounded), so the client gets it in its own format.
    std::string err;
    for (int n = 0; n < 64 && err.size() < (64 << 10); ++n) {
      const size_t before = err.size();
      if (!(co_await stream->Read(&err)).ok() || err.size() == before) break;
    }
    upstream_requests->WithLabels({up.config.name, std::to_string(stream->status())}).Inc();
    *last_error = ClientFacingError(up, stream->status(), err, stream->headers());
    co_return Retryable(stream->status()) ? Attempt::kNextTarget : Attempt::kGiveUp;
  }
  auto decoder = up.vendor->MakeDecoder();
  auto encoder = x.front.MakeEncoder(x.request, x.client_model);
  std::vector<StreamEvent> events;
  std::string out, chunk, generated;
  Usage vendor_usage;
  bool started = false;  // headers sent to the client: no fallback from here on
  bool client_gone = false;
  Status failure = Status::Ok();
  // The client's format may need input tokens at the start (Anthropic's message_start).
  StreamEvent input_usage;
  input_usage.kind = StreamEvent::Kind::kUsage;
  input_usage.usage = {x.input_tokens, -1};
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
      if (ev.kind == StreamEvent::Kind::kUsage) MergeUsage(ev.usage, &vendor_usage);
      encoder->Encode(ev, &out);
    }
    if (!failure.ok() || done) break;  // what is left goes out with the end of the body
    // After the first chunk (sent at once, for time to first token): when more of the
    // upstream's burst is already here, take it before writing so a burst goes out in one
    // write (no waiting: BytesReady only counts bytes that have arrived).
    if (started && out.size() < (64 << 10) && stream->BytesReady() > 0) continue;
    if (!out.empty()) {
      bool written = false;  // named, not tested inside co_await (GCC 12, see HandleChat)
      if (!started) {
        started = true;
        written = co_await x.resp.BeginStream(200, x.front.StreamContentType(), x.headers, out);
      } else {
        written = co_await x.resp.WriteChunk(out);
      }
      if (!written) {
        client_gone = true;
        break;
      }
      out.clear();
    }
  }
  if (!failure.ok() && !started) {
    // Nothing reached the client yet: this target failed like any other. An error event the
    // vendor sent in its stream keeps its kind (overloaded, rate limited...).
    upstream_requests->WithLabels({up.config.name, "broken_stream"}).Inc();
    if (const GatewayError* vendor_error = decoder->upstream_error()) {
      *last_error = *vendor_error;
      last_error->message = "upstream " + up.config.name + ": " + vendor_error->message;
      co_return Retryable(vendor_error->status) ? Attempt::kNextTarget : Attempt::kGiveUp;
    } else {
      *last_error = {502, ErrorKind::kBadGateway, "upstream " + up.config.name + ": " + failure.message()};
    }
    co_return Attempt::kNextTarget;
  }
  upstream_requests->WithLabels({up.config.name, failure.ok() ? "200" : "broken_stream"}).Inc();
  if (!client_gone) {
    if (!failure.ok()) {
      // What was decoded before the failure still reaches the client, then the error event.
      const GatewayError* vendor_error = decoder->upstream_error();
      GatewayError e = vendor_error ? *vendor_error
                                    : GatewayError{502, ErrorKind::kBadGateway, failure.message()};
      e.message = "upstream " + up.config.name + ": " + e.message;
      encoder->EncodeError(e, &out);
      Log().warn("gateway: {} stream from {} broke after it started: {}", x.request_id, up.config.name,
                 failure.message());
    }
    // The rest of the body and its end in one write (with the headers when nothing was sent).
    std::string_view last = out;
    if (!started) {
      started = co_await x.resp.BeginStream(200, x.front.StreamContentType(), x.headers, out);
      last = {};
    }
    if (started) co_await x.resp.EndStream(last);
  }
  const int64_t in = vendor_usage.input_tokens >= 0 ? vendor_usage.input_tokens : x.input_tokens;
  const int64_t outn = vendor_usage.output_tokens >= 0 ? vendor_usage.output_tokens : x.counter->Count(generated);
  Settle(x, target, in, outn);
  co_return Attempt::kAnswered;
}

}  // namespace keel::gateway
