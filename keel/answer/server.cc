#include "keel/answer/server.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/answer/sse.h"
#include "keel/core/http_metrics.h"
#include "keel/core/json_reader.h"
#include "keel/core/json_writer.h"
#include "keel/core/log.h"
#include "keel/core/mapped_file.h"
#include "keel/hilo/agent_client.h"

namespace keel::answer {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The "error.message" of an error body, else the body itself cut to 200 bytes.
std::string UpstreamMessage(const std::string& body) {
  auto j = ParseUntrustedJson(body, UpstreamJsonLimits());
  if (j.ok()) {
    auto e = j->find("error");
    if (e != j->end() && e->is_object()) {
      auto m = e->find("message");
      if (m != e->end() && m->is_string()) return m->get<std::string>();
    }
  }
  std::string cut = body.substr(0, 200);
  for (char& c : cut) {
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  return cut;
}

// Runs `release` once, just before the response's last write (a whole response, or the end of a
// stream), or when dropped without one. A client that sends its next request as soon as it has an
// answer must find this request's in-flight slot free, not race the handler's return.
class ReleaseBeforeLastWrite final : public HttpResponder {
 public:
  ReleaseBeforeLastWrite(HttpResponder& inner, std::function<void()> release)
      : inner_(inner), release_(std::move(release)) {}
  ~ReleaseBeforeLastWrite() override { Release(); }
  ReleaseBeforeLastWrite(const ReleaseBeforeLastWrite&) = delete;
  ReleaseBeforeLastWrite& operator=(const ReleaseBeforeLastWrite&) = delete;

  bool Send(int status, std::string_view content_type, std::string body, const HttpHeaderList& extra) override {
    Release();
    return inner_.Send(status, content_type, std::move(body), extra);
  }
  bool BeginStream(int status, std::string_view content_type, const HttpHeaderList& extra) override {
    return inner_.BeginStream(status, content_type, extra);
  }
  bool WriteChunk(std::string_view data) override { return inner_.WriteChunk(data); }
  bool EndStream() override {
    Release();
    return inner_.EndStream();
  }
  bool ClientGone() override { return inner_.ClientGone(); }
  int status() const override { return inner_.status(); }
  void Abandon() override {
    Release();
    inner_.Abandon();
  }

 private:
  void Release() {
    if (release_) std::exchange(release_, nullptr)();
  }
  HttpResponder& inner_;
  std::function<void()> release_;
};

}  // namespace

AnswerServer::AnswerServer(const Corpus& corpus, AnswerServerOptions options, hilo::ServiceLink* link)
    : corpus_(corpus), opt_(std::move(options)), link_(link) {
  requests_ = &metrics_.AddCounter("keel_answer_requests_total", "Answer requests by route and HTTP status.", {"route", "code"});
  broken_streams_ = &metrics_.AddCounter("keel_answer_broken_streams_total",
                                         "Streamed answers cut after they opened (an error event was sent instead of [DONE]).")
                         .Get();
  inflight_gauge_ = &metrics_.AddGauge("keel_answer_inflight", "Answer requests being served now.").Get();
  search_seconds_ = &metrics_.AddHistogram("keel_answer_search_seconds", "Vector search calls.", LatencyBuckets()).Get();
  generate_seconds_ =
      &metrics_.AddHistogram("keel_answer_generate_seconds", "Gateway chat-completion calls.", LatencyBuckets()).Get();
}

AnswerServer::~AnswerServer() { Stop(); }

Result<std::unique_ptr<AnswerServer>> AnswerServer::Start(const Corpus& corpus, AnswerServerOptions options,
                                                          hilo::ServiceLink* link) {
  if (options.max_inflight < 1 || options.max_inflight > 100000) {
    return Status::InvalidArgument("max_inflight: expected 1..100000");
  }
  if (options.k < 1 || options.k > 1000) return Status::InvalidArgument("k: expected 1..1000");
  if (options.limits.dim < 1 || options.limits.dim > 65536) return Status::InvalidArgument("dim: expected 1..65536");
  if (options.context_bytes > (size_t{1} << 20)) return Status::InvalidArgument("context_bytes: at most 1 MiB");
  if (options.history_bytes > (size_t{1} << 20)) return Status::InvalidArgument("history_bytes: at most 1 MiB");
  if (link != nullptr && link->service() != hilo::Service::kAnswer) {
    return Status::InvalidArgument("the HiLO link must be the answer service's");
  }
  // A large --dim must not trip the generic bounds: room for the vector plus the rest.
  const size_t dim = static_cast<size_t>(options.limits.dim);
  options.limits.max_json_values = std::max(options.limits.max_json_values, dim + 10000);
  if (options.max_body_bytes < dim * 16 + 4096) {
    return Status::InvalidArgument("max_body_bytes: at least dim x 16 + 4096 bytes, so a request's vector fits");
  }
  auto vec = ParseHttpUrl(options.vector_url);
  if (!vec.ok()) return Status::InvalidArgument("vector URL: " + vec.status().message());
  auto gw = ParseHttpUrl(options.gateway_url);
  if (!gw.ok()) return Status::InvalidArgument("gateway URL: " + gw.status().message());

  std::unique_ptr<AnswerServer> s(new AnswerServer(corpus, std::move(options), link));
  HttpClientOptions co;
  co.max_response_bytes = size_t{16} << 20;
  co.max_idle_connections = s->opt_.max_inflight;
  s->vector_ = std::make_unique<HttpClient>(*vec, co);
  s->gateway_ = std::make_unique<HttpClient>(*gw, co);

  HttpRouter router(OpenAIErrorBody);
  AnswerServer* self = s.get();
  router.Handle("POST", "/v1/chat/completions", [self](const HttpRequest& req, HttpResponder& r) {
    CountingResponder cr(r, *self->requests_, "/v1/chat/completions");
    self->HandleChat(req, cr);
  });
  router.Handle("GET", "/v1/models", [self](const HttpRequest& req, HttpResponder& r) {
    CountingResponder cr(r, *self->requests_, "/v1/models");
    self->HandleModels(req, "/v1/models", cr);
  });
  router.HandlePrefix("GET", "/v1/models/", "/v1/models/{id}", [self](const HttpRequest& req, HttpResponder& r) {
    CountingResponder cr(r, *self->requests_, "/v1/models/{id}");
    // The id goes upstream as part of a path: no dot segments that could name another route.
    if (req.path.find("/..") != std::string::npos || req.path.find("/./") != std::string::npos) {
      cr.Send(400, "application/json", OpenAIErrorBody(400, "model id: dot segments are not allowed"), {});
      return;
    }
    self->HandleModels(req, req.path, cr);
  });
  HandleHealthAndMetrics(router, s->metrics_);
  HttpServerOptions ho;
  ho.host = s->opt_.host;
  ho.port = s->opt_.port;
  // Room above max_inflight so the requests beyond it still get a thread to be told 429.
  ho.max_active_requests = s->opt_.max_inflight + 16;
  ho.max_body_bytes = s->opt_.max_body_bytes;
  ho.server_name = "keel-answer";
  ho.error_body = OpenAIErrorBody;
  s->http_ = std::make_unique<HttpServer>(ho, std::move(router));
  KEEL_RETURN_IF_ERROR(s->http_->Start());
  Log().info("keel answer listening on {}:{} (vector {}, gateway {}, <= {} in flight, {})", s->opt_.host,
             s->http_->port(), s->vector_->Address(), s->gateway_->Address(), s->opt_.max_inflight,
             link != nullptr ? "HiLO link" : "built-in full level");
  return s;
}

void AnswerServer::Stop() {
  if (http_) http_->Stop();
}

void AnswerServer::HandleChat(const HttpRequest& req, HttpResponder& res) {
  const auto t0 = Clock::now();
  hilo::LoadMeter* meter = link_ != nullptr ? &link_->meter() : nullptr;
  if (meter != nullptr) meter->Arrive();
  const int now_inflight = inflight_.fetch_add(1) + 1;
  if (now_inflight > opt_.max_inflight) {
    inflight_.fetch_sub(1);
    if (meter != nullptr) meter->Shed();
    res.Send(429, "application/json",
             OpenAIErrorBody(429, "keel answer is at its limit of " + std::to_string(opt_.max_inflight) +
                                      " requests in flight; retry"),
             {{"Retry-After", "1"}});
    return;
  }
  inflight_gauge_->Set(now_inflight);
  if (meter != nullptr) meter->Started();
  // The level is read once, so a state change mid-request cannot mix two levels in one answer.
  hilo::AnswerLevel level = kBuiltinLevel;
  std::string state = kBuiltinStateName;
  if (link_ != nullptr) {
    const hilo::State& st = link_->Current();
    level = st.answer;
    state = st.name;
  }
  ReleaseBeforeLastWrite releasing(res, [this, meter, t0] {
    inflight_gauge_->Set(inflight_.fetch_sub(1) - 1);
    if (meter != nullptr) {
      const double s = SecondsSince(t0);
      meter->Finish(s, s);
    }
  });
  Serve(req, releasing, level, state);
}

// The models the answer service can be asked for are the gateway's: the list (or one model) is the
// gateway's answer to the same key, checked to be a JSON object and passed on.
void AnswerServer::HandleModels(const HttpRequest& req, const std::string& path, HttpResponder& res) {
  auto reply = gateway_->Call("GET", path, "", "", DeadlineIn(opt_.gateway_timeout_ms), GatewayKeys(req));
  if (!reply.ok()) return SendFailure(res, GatewayUnreachable(reply.status()));
  if (auto f = GatewayRefusal(reply->status, reply->body)) return SendFailure(res, *f);
  // UpstreamJsonLimits requires an object.
  auto j = ParseUntrustedOrderedJson(reply->body, UpstreamJsonLimits());
  if (!j.ok()) return SendFailure(res, {502, GatewayName() + " sent a malformed model answer: " + j.status().message(), {}});
  res.Send(200, "application/json", j->dump(-1, ' ', false, ojson::error_handler_t::replace));
}

// The three steps of a request. Each returns the error to answer with, or nullopt.
std::optional<AnswerServer::Failure> AnswerServer::Search(const std::vector<float>& vector,
                                                          std::vector<uint64_t>* retrieved, double* ms) {
  std::string body = "{\"kind\":\"text\",\"text\":[";
  for (size_t i = 0; i < vector.size(); ++i) {
    if (i > 0) body.push_back(',');
    AppendJsonNumber(static_cast<double>(vector[i]), &body);
  }
  body += "],\"k\":";
  AppendJsonNumber(static_cast<int64_t>(opt_.k), &body);
  body += '}';
  const auto ts = Clock::now();
  searches_.fetch_add(1);
  auto reply = vector_->Call("POST", "/v1/search", body, "application/json", DeadlineIn(opt_.vector_timeout_ms));
  const double secs = SecondsSince(ts);
  *ms = secs * 1e3;
  search_seconds_->Observe(secs);
  const std::string who = "vector service at " + vector_->Address();
  if (!reply.ok()) return Failure{503, who + " unreachable: " + reply.status().message(), {}};
  if (reply->status != 200) {
    return Failure{502, who + " answered " + std::to_string(reply->status) + ": " + UpstreamMessage(reply->body), {}};
  }
  auto j = ParseUntrustedJson(reply->body, UpstreamJsonLimits());
  if (!j.ok()) return Failure{502, who + " sent a malformed answer: " + j.status().message(), {}};
  auto hits = j->find("hits");
  if (hits == j->end() || !hits->is_array()) return Failure{502, who + " sent an answer without \"hits\"", {}};
  for (const auto& h : *hits) {
    auto id = h.is_object() ? h.find("id") : h.end();
    if (!h.is_object() || id == h.end() || !id->is_number_unsigned()) {
      return Failure{502, who + " sent a hit without an unsigned \"id\"", {}};
    }
    retrieved->push_back(id->get<uint64_t>());
  }
  return std::nullopt;
}

std::string AnswerServer::GenerationBody(const AnswerRequest& q, const std::string& prompt, bool stream) const {
  std::string gen = "{\"model\":";
  AppendJsonString(q.model, &gen);
  gen += ",\"messages\":[{\"role\":\"user\",\"content\":";
  AppendJsonString(prompt, &gen);
  gen += "}],\"max_tokens\":";
  AppendJsonNumber(q.max_tokens, &gen);
  gen += ",\"temperature\":";
  AppendJsonNumber(q.temperature, &gen);
  if (stream) {
    gen += q.include_usage ? ",\"stream\":true,\"stream_options\":{\"include_usage\":true}}" : ",\"stream\":true}";
  } else {
    gen += ",\"stream\":false}";
  }
  return gen;
}

std::string AnswerServer::GatewayName() const { return "gateway at " + gateway_->Address(); }

AnswerServer::Failure AnswerServer::GatewayUnreachable(const Status& why) const {
  return Failure{503, GatewayName() + " unreachable: " + why.message(), {}};
}

void AnswerServer::SendFailure(HttpResponder& res, const Failure& f) {
  res.Send(f.status, "application/json", OpenAIErrorBody(f.status, f.message), f.extra);
}

HttpHeaderList AnswerServer::GatewayKeys(const HttpRequest& req) const {
  HttpHeaderList keys;
  for (const char* name : {"Authorization", "x-api-key"}) {
    const std::string_view v = req.headers.Get(name);
    if (!v.empty()) keys.emplace_back(name, std::string(v));
  }
  if (keys.empty() && !opt_.gateway_api_key.empty()) keys.emplace_back("Authorization", "Bearer " + opt_.gateway_api_key);
  return keys;
}

std::optional<AnswerServer::Failure> AnswerServer::GatewayRefusal(int status, const std::string& body) const {
  if (status == 200) return std::nullopt;
  // The client's own mistakes and limits pass through with their status.
  if (status == 400 || status == 401 || status == 403 || status == 404 || status == 413 || status == 429) {
    Failure f{status, "gateway: " + UpstreamMessage(body), {}};
    if (status == 429) f.extra.emplace_back("Retry-After", "1");
    return f;
  }
  return Failure{502, GatewayName() + " answered " + std::to_string(status) + ": " + UpstreamMessage(body), {}};
}

std::optional<AnswerServer::Failure> AnswerServer::ParseCompletion(const std::string& body, ojson* answer) const {
  const std::string who = GatewayName();
  auto parsed = ParseUntrustedOrderedJson(body, UpstreamJsonLimits());
  if (!parsed.ok()) return Failure{502, who + " sent a malformed answer: " + parsed.status().message(), {}};
  // What the client's SDK reads: choices[0].message must be there (choices: null reached the
  // client as a 200 that the SDK then failed on).
  auto choices = parsed->find("choices");
  if (choices == parsed->end() || !choices->is_array() || choices->empty()) {
    return Failure{502, who + " sent an answer without a non-empty \"choices\" array", {}};
  }
  for (const auto& c : *choices) {
    if (!c.is_object() || !c.contains("message") || !c["message"].is_object()) {
      return Failure{502, who + " sent a choice that is not an object with a \"message\" object", {}};
    }
  }
  *answer = std::move(*parsed);
  return std::nullopt;
}

std::optional<AnswerServer::Failure> AnswerServer::Generate(const HttpRequest& req, const AnswerRequest& q,
                                                            const std::string& prompt, ojson* answer, double* ms) {
  const auto tg = Clock::now();
  auto reply = gateway_->Call("POST", "/v1/chat/completions", GenerationBody(q, prompt, false), "application/json",
                              DeadlineIn(opt_.gateway_timeout_ms), GatewayKeys(req));
  const double gsecs = SecondsSince(tg);
  *ms = gsecs * 1e3;
  generate_seconds_->Observe(gsecs);
  if (!reply.ok()) return GatewayUnreachable(reply.status());
  if (auto f = GatewayRefusal(reply->status, reply->body)) return f;
  return ParseCompletion(reply->body, answer);
}

std::optional<AnswerServer::Failure> AnswerServer::GenerateStream(const HttpRequest& req, const AnswerRequest& q,
                                                                  const std::string& prompt, HttpResponder& res,
                                                                  const std::function<ojson(double)>& keel_member) {
  const auto tg = Clock::now();
  const std::string who = GatewayName();
  // The gateway's event stream is relayed as it arrives. Any other answer (an error, or a whole
  // completion from an upstream that does not stream) is read whole, as without streaming.
  enum class Mode { kHead, kRelay, kWhole } mode = Mode::kHead;
  bool opened = false;
  int status = 0;
  std::string whole;
  auto open_stream = [&res] { return res.BeginStream(200, "text/event-stream", {{"Cache-Control", "no-cache"}}); };
  SseRelay relay([&res](std::string_view b) { return res.WriteChunk(b); },
                 [&] { return keel_member(SecondsSince(tg) * 1e3); }, who);
  HttpStreamSink sink;
  sink.on_head = [&](int st, const HttpHeaders& h) {
    status = st;
    if (st == 200 && h.Get("content-type").substr(0, 17) == "text/event-stream") {
      mode = Mode::kRelay;
      // The first token goes out as soon as it is generated: errors from here on are events.
      opened = open_stream();
      return opened;
    }
    mode = Mode::kWhole;
    return true;
  };
  sink.on_body = [&](std::string_view b) {
    if (mode == Mode::kRelay) return relay.Feed(b);
    whole.append(b);
    return true;
  };
  auto reply = gateway_->CallStreaming("POST", "/v1/chat/completions", GenerationBody(q, prompt, true),
                                       "application/json", DeadlineIn(opt_.gateway_timeout_ms), sink, GatewayKeys(req));
  generate_seconds_->Observe(SecondsSince(tg));
  if (mode == Mode::kRelay) {
    if (opened) {
      if (!relay.Finish(reply.ok() || reply.status().code() == StatusCode::kCancelled ? "" : reply.status().message()) &&
          !relay.failure().empty()) {
        // The status line said 200 long ago: the cut answer is counted and logged here.
        broken_streams_->Inc();
        Log().warn("answer: a stream from {} was cut: {}", who, relay.failure());
      }
      res.EndStream();
    }
    return std::nullopt;  // answered (or the client is gone)
  }
  if (!reply.ok()) return GatewayUnreachable(reply.status());
  if (auto f = GatewayRefusal(status, whole)) return f;
  ojson answer;
  if (auto f = ParseCompletion(whole, &answer)) return f;
  answer["keel"] = keel_member(SecondsSince(tg) * 1e3);
  if (open_stream()) {
    res.WriteChunk(CompletionAsSse(answer, q.include_usage));
    res.EndStream();
  }
  return std::nullopt;
}

void AnswerServer::Serve(const HttpRequest& req, HttpResponder& res, const hilo::AnswerLevel& level,
                         const std::string& state) {
  auto fail = [&res](const Failure& f) { SendFailure(res, f); };
  auto parsed = ParseAnswerRequest(req.body, opt_.limits);
  if (!parsed.ok()) return fail({400, parsed.status().message(), {}});
  AnswerRequest& q = *parsed;
  if (q.model.empty()) q.model = opt_.default_model;
  if (q.model.empty()) return fail({400, "model: required (this server has no default model; start it with --model)", {}});

  std::vector<uint64_t> retrieved;
  double search_ms = 0;
  if (level.retrieval && q.vector.has_value()) {
    if (auto f = Search(*q.vector, &retrieved, &search_ms)) return fail(*f);
  }
  std::vector<std::string_view> docs;
  std::vector<size_t> doc_ids;
  const size_t want = level.retrieval ? static_cast<size_t>(std::max<int64_t>(level.context_docs, 0)) : 0;
  for (size_t i = 0; i < retrieved.size() && docs.size() < want; ++i) {
    const size_t d = corpus_.DocFor(retrieved[i]);
    doc_ids.push_back(d);
    docs.push_back(corpus_.doc(d));
  }
  auto keel_member = [&](double generate_ms) {
    ojson keel;
    keel["retrieved"] = retrieved;
    keel["docs"] = doc_ids;
    keel["state"] = state;
    keel["retrieval"] = level.retrieval;
    keel["context_docs"] = level.context_docs;
    keel["search_ms"] = search_ms;
    keel["generate_ms"] = generate_ms;
    return keel;
  };
  // A client that left while its request waited for the search is not generated for: under
  // overload that would be engine time spent on answers nobody reads (a client that timed out, or
  // a load generator's cut-off). Once generating, the gateway and the engine notice on their own.
  if (res.ClientGone()) {
    res.Abandon();
    return;
  }
  const std::string prompt = BuildPrompt(docs, q.question, opt_.context_bytes, q.history, opt_.history_bytes);
  if (q.stream) {
    // Errors before the stream opens are answered as JSON with their status, as OpenAI does.
    if (auto f = GenerateStream(req, q, prompt, res, keel_member)) return fail(*f);
    return;
  }
  ojson answer;
  double generate_ms = 0;
  if (auto f = Generate(req, q, prompt, &answer, &generate_ms)) return fail(*f);
  answer["keel"] = keel_member(generate_ms);
  res.Send(200, "application/json", answer.dump(-1, ' ', false, ojson::error_handler_t::replace));
}

Result<std::unique_ptr<hilo::ServiceLink>> OpenAnswerLink(const AnswerHiloFlags& f, int workers) {
  hilo::ServiceLinkOptions o;
  o.service = hilo::Service::kAnswer;
  o.workers = std::max(workers, 1);
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<hilo::ServiceLink> link, hilo::OpenServiceLink(f, std::move(o)));
  if (link) KEEL_RETURN_IF_ERROR(link->Start());
  return link;
}

}  // namespace keel::answer
