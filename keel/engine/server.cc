#include "keel/engine/server.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include <fmt/format.h>

#include "keel/core/http_metrics.h"
#include "keel/core/log.h"
#include "keel/core/signal.h"
#include "keel/engine/hilo_levels.h"
#include "keel/engine/openai_protocol.h"

namespace keel::engine {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// GET /v1/models/{id}: the rest of the path is the id.
constexpr std::string_view kModelPrefix = "/v1/models/";

// Sends `e` as an OpenAI error body (429 also gets Retry-After), with `headers` added.
void SendError(HttpResponder& res, const ApiError& e, const HttpHeaderList& headers = {}) {
  HttpHeaderList extra = headers;
  if (e.status == 429) extra.emplace_back("Retry-After", "1");
  res.Send(e.status, "application/json", Dump(ErrorObject(e)), extra);
}

std::string RandomHex(int n) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* kHex = "0123456789abcdef";
  std::string s(static_cast<size_t>(n), '0');
  for (auto& c : s) c = kHex[rng() & 15];
  return s;
}

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Metrics

EngineMetrics::EngineMetrics()
    : requests(registry.AddCounter("keel_requests_total", "HTTP requests by route and status code.",
                                   {"route", "code"})),
      prompt_tokens(registry.AddCounter("keel_prompt_tokens_total",
                                        "Prompt tokens of accepted generation requests.").Get()),
      generation_tokens(registry.AddCounter("keel_generation_tokens_total",
                                            "Tokens generated for clients.").Get()),
      prefix_hit_tokens(registry.AddCounter("keel_prefix_cache_hit_tokens_total",
                                            "Prompt tokens served from shared KV blocks.").Get()),
      prompt_tokens_computed(registry.AddCounter("keel_prompt_tokens_computed_total",
                                                 "Prompt tokens prefilled by this instance (not reused).").Get()),
      kv_codec_switches(registry.AddCounter("keel_kv_codec_switches_total",
                                            "KV cache rebuilds with another codec (HiLO levels).").Get()),
      queue_depth(registry.AddGauge("keel_queue_depth", "Requests waiting for admission.").Get()),
      running(registry.AddGauge("keel_running_sequences", "Sequences in the running batch.").Get()),
      kv_blocks_used(registry.AddGauge("keel_kv_blocks_used", "KV blocks referenced by sequences.").Get()),
      kv_blocks_total(registry.AddGauge("keel_kv_blocks_total", "KV blocks in the cache budget.").Get()),
      kv_blocks_cached(registry.AddGauge("keel_kv_blocks_cached",
                                         "Unreferenced KV blocks still holding a reusable prefix.").Get()),
      kv_blocks_compacted(registry.AddGauge("keel_kv_blocks_compacted",
                                            "KV blocks stored in the codec's compact form.").Get()),
      kv_bytes_used(registry.AddGauge("keel_kv_bytes_used", "KV cache bytes held by used and cached blocks.").Get()),
      kv_bytes_total(registry.AddGauge("keel_kv_bytes_total", "KV cache budget in bytes.").Get()),
      open_connections(registry.AddGauge("keel_http_open_connections", "Open HTTP connections.").Get()),
      connections_shed(registry.AddCounter("keel_http_connections_shed_total",
                                           "Idle or half-sent connections closed to admit a newer one at a cap.").Get()),
      connections_rejected(registry.AddCounter("keel_http_connections_rejected_total",
                                               "Connections or requests answered 503 because all were busy.").Get()),
      request_timeouts(registry.AddCounter("keel_http_request_timeouts_total",
                                           "Requests whose head or body missed its deadline (408).").Get()),
      requests_refused(registry.AddCounter("keel_http_requests_refused_total",
                                           "Requests the HTTP layer refused before routing (malformed 400, "
                                           "body 413, headers 431, transfer coding 501).",
                                           {"code"})),
      time_to_first_token(registry.AddHistogram("keel_time_to_first_token_seconds",
                                                "Time from submission to the first generated token.",
                                                LatencyBuckets()).Get()),
      inter_token_latency(registry.AddHistogram("keel_inter_token_latency_seconds",
                                                "Time between consecutive generated tokens of a sequence.",
                                                LatencyBuckets()).Get()),
      request_duration(registry.AddHistogram("keel_request_duration_seconds",
                                             "Generation requests, from receipt to the last byte.",
                                             LatencyBuckets()).Get()) {}

namespace {
// keel_http_requests_refused_total's code label -> HttpRefusalStats field.
constexpr std::pair<const char*, int64_t HttpRefusalStats::*> kRefusalCodes[] = {
    {"400", &HttpRefusalStats::malformed},
    {"413", &HttpRefusalStats::body_too_large},
    {"431", &HttpRefusalStats::headers_too_large},
    {"501", &HttpRefusalStats::coding_not_implemented}};
}  // namespace

std::shared_ptr<EngineMetrics> MakeEngineMetrics() { return std::make_shared<EngineMetrics>(); }

SchedulerObserver ObserverFor(std::shared_ptr<EngineMetrics> metrics) {
  SchedulerObserver o;
  o.time_to_first_token = [metrics](double s) { metrics->time_to_first_token.Observe(s); };
  o.inter_token_latency = [metrics](double s) { metrics->inter_token_latency.Observe(s); };
  return o;
}

// ---------------------------------------------------------------------------------------------
// Event hand-off between the scheduler thread and the connection thread

namespace {

struct ChoiceEvent {
  int choice = 0;
  GenerationEvent ev;
};

// One queue per HTTP request, shared by its choices' sequences.
struct EventQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<ChoiceEvent> events;

  // `wake`: notify the connection thread now. A whole (non-streamed) answer needs only the last
  // event; waking its thread for every token cost a futex wake and a context switch per token,
  // about a tenth of a busy engine's CPU. The thread still wakes on its own every poll to drain.
  void Push(int choice, const GenerationEvent& ev, bool wake) {
    {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(ChoiceEvent{choice, ev});
    }
    if (wake) cv.notify_one();
  }
  // Takes the next event, waiting up to `timeout`. False on timeout.
  bool Pop(ChoiceEvent* out, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, timeout, [&] { return !events.empty(); })) return false;
    *out = std::move(events.front());
    events.pop_front();
    return true;
  }
};

// What the connection thread keeps of one choice while it is generated.
struct ChoiceState {
  std::shared_ptr<Request> request;
  std::string text;                    // non-streamed answers
  std::vector<TokenLogprob> logprobs;  // non-streamed answers with logprobs
  std::vector<TokenLogprob> prompt_logprobs;  // non-streamed echo with logprobs
  size_t text_offset = 0;              // of the next token (completions' text_offset)
  bool finished = false;
  GenerationEvent last;                // the final event: finish reason, error, token counts
};

void CancelAll(const std::vector<ChoiceState>& choices) {
  for (const ChoiceState& c : choices) {
    if (c.request) c.request->cancelled = true;  // the scheduler drops it at its next step
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Server

Server::Server(Scheduler& scheduler, const Tokenizer& tokenizer, ServerOptions options,
               std::shared_ptr<EngineMetrics> metrics)
    : scheduler_(scheduler), tokenizer_(tokenizer), options_(std::move(options)),
      metrics_(metrics ? std::move(metrics) : MakeEngineMetrics()), router_(OpenAiHttpErrorBody),
      created_(UnixNow()) {
  if (options_.model_name.empty()) {
    options_.model_name = std::filesystem::path(scheduler_.model().source).stem().string();
    if (options_.model_name.empty()) options_.model_name = "keel";
  }
  Scheduler* s = &scheduler_;
  metrics_->queue_depth.SetCallback([s] { return static_cast<double>(s->QueueDepth()); });
  metrics_->running.SetCallback([s] { return static_cast<double>(s->Stats().running); });
  metrics_->kv_blocks_used.SetCallback([s] { return static_cast<double>(s->Stats().kv.blocks_used); });
  metrics_->kv_blocks_total.SetCallback([s] { return static_cast<double>(s->Stats().kv.blocks_total); });
  metrics_->kv_blocks_cached.SetCallback([s] { return static_cast<double>(s->Stats().kv.blocks_cached); });
  metrics_->kv_blocks_compacted.SetCallback([s] { return static_cast<double>(s->Stats().kv.blocks_compacted); });
  metrics_->kv_bytes_used.SetCallback([s] { return static_cast<double>(s->Stats().kv.bytes_used); });
  metrics_->kv_bytes_total.SetCallback([s] { return static_cast<double>(s->Stats().kv.bytes_total); });
  metrics_->prefix_hit_tokens.SetCallback([s] { return static_cast<double>(s->Stats().kv.prefix_hit_tokens); });
  metrics_->prompt_tokens_computed.SetCallback([s] { return static_cast<double>(s->Stats().prompt_tokens); });
  metrics_->kv_codec_switches.SetCallback([s] { return static_cast<double>(s->Stats().codec_switches); });
  if (KvStoreLink* link = scheduler_.kvstore_link()) link->RegisterMetrics(metrics_->registry);

  router_.Handle("GET", "/healthz", [this](const HttpRequest& q, HttpResponder& r) { HandleHealth(q, r); });
  router_.Handle("GET", "/v1/models", [this](const HttpRequest& q, HttpResponder& r) { HandleModels(q, r); });
  for (const char* method : {"GET", "HEAD"}) {
    router_.HandlePrefix(method, std::string(kModelPrefix), "/v1/models/{id}", [this](const HttpRequest& q, HttpResponder& r) {
      HandleModel(r, std::string_view(q.path).substr(kModelPrefix.size()));
    });
  }
  router_.Handle("GET", "/metrics", [this](const HttpRequest& q, HttpResponder& r) { HandleMetrics(q, r); });
  router_.Handle("POST", "/v1/completions",
                 [this](const HttpRequest& q, HttpResponder& r) { HandleGenerate(q, r, false); });
  router_.Handle("POST", "/v1/chat/completions",
                 [this](const HttpRequest& q, HttpResponder& r) { HandleGenerate(q, r, true); });

  HttpServerOptions h;
  h.host = options_.host;
  h.port = options_.port;
  h.max_connections = options_.max_connections;
  h.max_body_bytes = options_.max_body_bytes;
  h.read_timeout_seconds = options_.read_timeout_seconds;
  h.drain_seconds = options_.drain_seconds;
  h.error_body = OpenAiHttpErrorBody;
  http_ = std::make_unique<HttpServer>(h, [this](const HttpRequest& q, HttpResponder& r) { Route(q, r); });
  HttpServer* hs = http_.get();
  metrics_->open_connections.SetCallback([hs] { return static_cast<double>(hs->open_connections()); });
  metrics_->connections_shed.SetCallback([hs] { return static_cast<double>(hs->connection_stats().shed); });
  metrics_->connections_rejected.SetCallback([hs] { return static_cast<double>(hs->connection_stats().rejected); });
  metrics_->request_timeouts.SetCallback([hs] {
    const ConnectionFrontStats st = hs->connection_stats();
    return static_cast<double>(st.head_timeouts + st.body_timeouts);
  });
  for (const auto& [code, field] : kRefusalCodes) {
    metrics_->requests_refused.WithLabels({code}).SetCallback(
        [hs, field] { return static_cast<double>(hs->refusal_stats().*field); });
  }
}

Server::~Server() {
  Stop(/*cancel_in_flight=*/true);
  // The metrics may outlive us (shared); unbind everything that points at this server.
  metrics_->queue_depth.SetCallback(nullptr);
  metrics_->running.SetCallback(nullptr);
  metrics_->kv_blocks_used.SetCallback(nullptr);
  metrics_->kv_blocks_total.SetCallback(nullptr);
  metrics_->kv_blocks_cached.SetCallback(nullptr);
  metrics_->kv_blocks_compacted.SetCallback(nullptr);
  metrics_->kv_bytes_used.SetCallback(nullptr);
  metrics_->kv_bytes_total.SetCallback(nullptr);
  metrics_->prefix_hit_tokens.SetCallback(nullptr);
  metrics_->prompt_tokens_computed.SetCallback(nullptr);
  metrics_->kv_codec_switches.SetCallback(nullptr);
  metrics_->open_connections.SetCallback(nullptr);
  metrics_->connections_shed.SetCallback(nullptr);
  metrics_->connections_rejected.SetCallback(nullptr);
  metrics_->request_timeouts.SetCallback(nullptr);
  for (const auto& [code, field] : kRefusalCodes) metrics_->requests_refused.WithLabels({code}).SetCallback(nullptr);
}

Status Server::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return Status::Internal("server already started");
  accepting_ = true;
  Status st = http_->Start();
  if (!st.ok()) {
    accepting_ = false;
    return st;
  }
  started_ = true;
  if (options_.run_scheduler) {
    scheduler_thread_ = std::thread([this] { scheduler_.Run(scheduler_stop_); });
  }
  Log().info("engine server: model '{}' on http://{}:{}", options_.model_name, options_.host, http_->port());
  return Status::Ok();
}

int Server::port() const { return http_->port(); }

void Server::Stop(bool cancel_in_flight) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!started_ || stopped_) return;
  stopped_ = true;
  accepting_ = false;
  lock.unlock();
  http_->StopAccepting();

  const auto drain = std::chrono::duration<double>(cancel_in_flight ? 0.0 : options_.drain_seconds);
  lock.lock();
  if (!cv_.wait_for(lock, drain, [this] { return in_flight_ == 0; })) {
    Log().warn("engine server: cancelling {} request(s) still in flight", in_flight_);
  }
  lock.unlock();
  // Cancel what is left; handlers turn the cancellation into an error event or a 503.
  scheduler_.Shutdown(/*cancel=*/true);
  lock.lock();
  cv_.wait_for(lock, std::chrono::seconds(5), [this] { return in_flight_ == 0; });
  lock.unlock();
  hard_stop_ = true;  // anything still waiting (scheduler not stepping) gives up now
  http_->Stop(/*drain_seconds=*/5);
  if (scheduler_thread_.joinable()) {
    scheduler_stop_ = true;
    scheduler_thread_.join();
  }
  Log().info("engine server stopped");
}

void Server::Route(const HttpRequest& req, HttpResponder& res) {
  CountingResponder counting(res, metrics_->requests, router_.RouteLabel(req.path));
  try {
    router_.Dispatch(req, counting);
  } catch (const std::exception& e) {
    // Nothing below should throw; a bug must not take the connection thread down.
    Log().error("engine server: {} {}: {}", req.method, req.path, e.what());
    if (counting.status() == 0) SendError(counting, ApiError{500, "internal error", "server_error", {}, {}});
  }
  counting.CountIfSilent();
}

void Server::HandleHealth(const HttpRequest&, HttpResponder& res) {
  if (!accepting_) {
    res.Send(503, "application/json", R"({"status":"draining"})");
    return;
  }
  res.Send(200, "application/json", R"({"status":"ok"})");
}

void Server::HandleModels(const HttpRequest&, HttpResponder& res) {
  json model = {{"id", options_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "keel"}};
  json body = {{"object", "list"}, {"data", json::array({model})}};
  res.Send(200, "application/json", Dump(body));
}

// GET /v1/models/{id}: the served model's object, or OpenAI's 404 for any other id.
void Server::HandleModel(HttpResponder& res, std::string_view id) {
  if (id != options_.model_name) {
    SendError(res, ApiError{404, "The model '" + std::string(id) + "' does not exist", "invalid_request_error",
                            std::nullopt, std::string("model_not_found")});
    return;
  }
  json model = {{"id", options_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "keel"}};
  res.Send(200, "application/json", Dump(model));
}

void Server::HandleMetrics(const HttpRequest&, HttpResponder& res) {
  res.Send(200, MetricsRegistry::kContentType, metrics_->registry.Render());
}

void Server::HandleGenerate(const HttpRequest& req, HttpResponder& res, bool chat) {
  {
    // Checked together with the count, so Stop never misses a request it should drain.
    std::unique_lock<std::mutex> lock(mu_);
    if (!accepting_) {
      lock.unlock();
      SendError(res, ApiError{503, "server is shutting down", "server_error", {}, "server_shutting_down"});
      return;
    }
    ++in_flight_;
  }
  struct Done {
    Server* s;
    ~Done() {
      {
        std::lock_guard<std::mutex> lock(s->mu_);
        --s->in_flight_;
      }
      s->cv_.notify_all();
    }
  } done{this};

  ServerJob job;
  job.chat = chat;
  job.start = Clock::now();
  job.created = UnixNow();
  job.id = (chat ? "chatcmpl-" : "cmpl-") + RandomHex(24);

  const ModelConfig& config = scheduler_.model().config;
  HttpHeaderList headers;
  std::optional<AppliedLevel> level;
  if (options_.hilo != nullptr) {
    level = options_.hilo->Current();
    headers.emplace_back("x-keel-hilo-state", level->state->name);
  }
  if (std::optional<ApiError> err =
          ParseGenerateRequest(req.body, chat, options_.model_name, tokenizer_, config.vocab_size, config.max_seq_len,
                               &job, level ? level->max_prompt_tokens : 0)) {
    SendError(res, *err, headers);
    return;
  }
  if (level) {
    for (JobPrompt& p : job.prompts) p.max_tokens = std::min(p.max_tokens, level->max_new_tokens);
  }
  if (job.prompt_tokens_cut() > 0) headers.emplace_back("x-keel-prompt-tokens-cut", std::to_string(job.prompt_tokens_cut()));
  RunJob(job, res, headers);
}

namespace {

// The answer to a request the scheduler refused at Submit.
ApiError SubmitError(const Status& st) {
  switch (st.code()) {
    case StatusCode::kInvalidArgument: return ApiError{400, st.message(), "invalid_request_error", {}, {}};
    case StatusCode::kResourceExhausted:
      return ApiError{429, st.message(), "rate_limit_exceeded", {}, "rate_limit_exceeded"};
    case StatusCode::kUnavailable: return ApiError{503, st.message(), "server_error", {}, "server_shutting_down"};
    default: return ApiError{500, st.message(), "server_error", {}, {}};
  }
}

// One request's passage through the HiLO load meter: exactly one of Shed (never admitted) or
// Started then Finish, whichever of the scheduler thread (admission) and the connection thread
// (the end of the request) comes first.
struct MeterTicket {
  hilo::LoadMeter* meter = nullptr;
  Clock::time_point start;  // receipt
  std::mutex mu;
  int phase = 0;            // 0 queued, 1 admitted, 2 closed
  Clock::time_point admitted;

  void Admitted() {
    std::lock_guard<std::mutex> lock(mu);
    if (phase != 0) return;
    phase = 1;
    admitted = Clock::now();
    meter->Started();
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu);
    if (phase == 0) meter->Shed();
    if (phase == 1) {
      const Clock::time_point now = Clock::now();
      meter->Finish(std::chrono::duration<double>(now - start).count(),
                    std::chrono::duration<double>(now - admitted).count());
    }
    phase = 2;
  }
};

// Submits every choice of `job` into `scheduler`, their events going to `queue`: all of them,
// or none (a refusal part-way cancels those already queued and is returned).
std::optional<ApiError> SubmitChoices(Scheduler& scheduler, const ServerJob& job, const std::shared_ptr<EventQueue>& queue,
                                      const std::shared_ptr<EngineMetrics>& metrics,
                                      const std::shared_ptr<MeterTicket>& ticket, std::vector<ChoiceState>* choices) {
  // More choices than the queue holds could never be admitted together: a 400, not a 429 that a
  // client would retry for ever.
  if (const int cap = scheduler.options().max_queue; job.choices() > cap) {
    return BadParam("n", fmt::format("{} choices (prompts x n) are more than this server queues at once ({}, "
                                     "keel serve --max-queue)",
                                     job.choices(), cap));
  }
  choices->assign(static_cast<size_t>(job.choices()), ChoiceState{});
  for (int i = 0; i < job.choices(); ++i) {
    auto request = std::make_shared<Request>();
    request->prompt = job.prompt_of(i).tokens;
    request->params = job.params_of(i);
    // Runs on the scheduler thread: copy and hand off, never touch the socket.
    request->on_event = [queue, metrics, i, last = 0, stream = job.stream](const GenerationEvent& ev) mutable {
      if (ev.completion_tokens > last) {
        metrics->generation_tokens.Inc(ev.completion_tokens - last);
        last = ev.completion_tokens;
      }
      queue->Push(i, ev, stream || ev.finished);
    };
    if (ticket) request->on_admitted = [ticket] { ticket->Admitted(); };
    Status st = scheduler.Submit(request);
    if (!st.ok()) {
      CancelAll(*choices);
      return SubmitError(st);
    }
    (*choices)[static_cast<size_t>(i)].request = std::move(request);
  }
  return std::nullopt;
}

// What a stream carries before any event: each chat choice's role, and with echo each choice's
// prompt (with logprobs, its first token, which nothing scores). False when the client is gone.
bool WriteStreamStart(HttpResponder& res, const ServerJob& job, const std::string& model, const Tokenizer& tok,
                      std::vector<ChoiceState>* choices) {
  for (int i = 0; job.chat && i < job.choices(); ++i) {
    if (!res.WriteChunk(StreamChunk(job, model, i, "", nullptr, true))) return false;
  }
  for (int i = 0; job.echo && i < job.choices(); ++i) {
    const JobPrompt& p = job.prompt_of(i);
    std::string chunk;
    if (job.params.prompt_logprobs) {
      json lp = PromptLogprobsObject(tok, true, p.tokens.front(), {}, &(*choices)[static_cast<size_t>(i)].text_offset);
      chunk = StreamChunk(job, model, i, lp["tokens"][0].get<std::string>(), nullptr, false, lp);
    } else {
      chunk = StreamChunk(job, model, i, p.echo_text, nullptr, false);
    }
    if (!res.WriteChunk(chunk)) return false;
  }
  return true;
}

// A request's usage once its choices all finished: each prompt once, every choice's completion.
Usage UsageOf(const ServerJob& job, const std::vector<ChoiceState>& choices) {
  Usage usage;
  usage.prompt_tokens = job.prompt_tokens();
  for (const ChoiceState& c : choices) usage.completion_tokens += c.last.completion_tokens;
  return usage;
}

// The body of a non-streamed answer whose choices all finished.
json FinishedBody(const ServerJob& job, const std::string& model, const Tokenizer& tok,
                  std::vector<ChoiceState>* choices) {
  const Usage usage = UsageOf(job, *choices);
  std::vector<ChoiceResult> results;
  results.reserve(choices->size());
  for (size_t i = 0; i < choices->size(); ++i) {
    ChoiceState& c = (*choices)[i];
    const JobPrompt& p = job.prompt_of(static_cast<int>(i));
    json lp_obj = nullptr;
    if (job.params.prompt_logprobs) {
      lp_obj = PromptLogprobsObject(tok, true, p.tokens.front(), c.prompt_logprobs, &c.text_offset);
    }
    if (job.params.logprobs >= 0) AppendLogprobs(&lp_obj, LogprobsObject(job.chat, tok, c.logprobs, &c.text_offset));
    std::string text = job.echo ? p.echo_text + c.text : std::move(c.text);
    results.push_back(ChoiceResult{std::move(text), OpenAiFinishReason(c.last.finish_reason), std::move(lp_obj)});
  }
  return CompletionBody(job, model, results, usage);
}

}  // namespace

void Server::RunJob(ServerJob& job, HttpResponder& res, const HttpHeaderList& headers) {
  auto queue = std::make_shared<EventQueue>();
  std::shared_ptr<MeterTicket> ticket;
  if (options_.hilo != nullptr) {
    ticket = std::make_shared<MeterTicket>();
    ticket->meter = &options_.hilo->meter();
    ticket->start = job.start;
    ticket->meter->Arrive();
  }
  struct CloseTicket {
    MeterTicket* t;
    ~CloseTicket() {
      if (t != nullptr) t->Close();
    }
  } close_ticket{ticket.get()};

  std::vector<ChoiceState> choices;
  if (std::optional<ApiError> refused = SubmitChoices(scheduler_, job, queue, metrics_, ticket, &choices)) {
    if (ticket) ticket->Close();  // before the answer, so a client holding it sees it counted
    SendError(res, *refused, headers);
    return;
  }
  metrics_->prompt_tokens.Inc(static_cast<double>(job.prompt_tokens()));

  bool gone = false;
  if (job.stream) {
    HttpHeaderList stream_headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
    stream_headers.insert(stream_headers.end(), headers.begin(), headers.end());
    gone = !res.BeginStream(200, "text/event-stream", stream_headers) ||
           !WriteStreamStart(res, job, options_.model_name, tokenizer_, &choices);
  }

  // Until every choice has finished, one has failed, or the client has gone. A client that went
  // away is looked for at least every poll, also while events keep coming, so that a long
  // generation for nobody is cancelled early.
  const bool want_logprobs = job.params.logprobs >= 0;
  int unfinished = job.choices();
  const ChoiceState* failed = nullptr;
  constexpr auto kPoll = std::chrono::milliseconds(50);
  Clock::time_point next_client_check = Clock::now() + kPoll;
  ChoiceEvent ce;
  while (unfinished > 0 && failed == nullptr && !gone) {
    const bool got = queue->Pop(&ce, kPoll);
    if (!got || Clock::now() >= next_client_check) {
      if (res.ClientGone()) gone = true;
      next_client_check = Clock::now() + kPoll;
    }
    if (!got) {
      if (hard_stop_) break;
      continue;
    }
    ChoiceState& c = choices[static_cast<size_t>(ce.choice)];
    const GenerationEvent& ev = ce.ev;
    if (job.stream && !ev.prompt_logprobs.empty() && !gone) {
      json lp = PromptLogprobsObject(tokenizer_, false, 0, ev.prompt_logprobs, &c.text_offset);
      std::string text;
      for (const json& t : lp["tokens"]) text += t.get<std::string>();
      gone = !res.WriteChunk(StreamChunk(job, options_.model_name, ce.choice, text, nullptr, false, lp));
    }
    if (job.stream) {
      // A chunk for new text, and for tokens that added none (a stop sequence held back, an
      // incomplete UTF-8 character) when their log-probabilities were asked for.
      const bool lp = want_logprobs && !ev.logprobs.empty();
      if (!ev.text.empty() || lp) {
        json lp_obj = lp ? LogprobsObject(job.chat, tokenizer_, ev.logprobs, &c.text_offset) : json(nullptr);
        if (!res.WriteChunk(StreamChunk(job, options_.model_name, ce.choice, ev.text, nullptr, false, lp_obj))) {
          gone = true;
        }
      }
    } else {
      c.text += ev.text;
      if (want_logprobs) c.logprobs.insert(c.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      c.prompt_logprobs.insert(c.prompt_logprobs.end(), ev.prompt_logprobs.begin(), ev.prompt_logprobs.end());
    }
    if (!ev.finished) continue;
    c.finished = true;
    c.last = ev;
    --unfinished;
    const char* finish = OpenAiFinishReason(ev.finish_reason);
    if (finish == nullptr) {
      failed = &c;
    } else if (job.stream && !gone) {
      gone = !res.WriteChunk(StreamChunk(job, options_.model_name, ce.choice, "", finish, false));
    }
  }
  if (unfinished > 0 || failed != nullptr) CancelAll(choices);
  if (gone) {
    metrics_->request_duration.Observe(std::chrono::duration<double>(Clock::now() - job.start).count());
    res.Abandon();  // a client that left is no server error (was answered and counted 500)
    return;
  }

  // Observed before the final write, so a client holding its response sees it counted.
  metrics_->request_duration.Observe(std::chrono::duration<double>(Clock::now() - job.start).count());
  if (ticket) ticket->Close();
  if (unfinished > 0 || failed != nullptr) {
    // Cancelled (by shutdown), failed, or abandoned at the hard stop.
    ApiError e;
    if (failed != nullptr && failed->last.finish_reason == FinishReason::kError) {
      e = ApiError{500, "generation failed: " + failed->last.error.ToString(), "server_error", {}, {}};
    } else if (!accepting_) {
      e = ApiError{503, "request cancelled: the server is shutting down", "server_error", {}, "server_shutting_down"};
    } else {
      e = ApiError{503, "request cancelled", "server_error", {}, "cancelled"};
    }
    if (job.stream) {
      res.WriteChunk(SseEvent(ErrorObject(e)));
      res.WriteChunk("data: [DONE]\n\n");
      res.EndStream();
    } else {
      SendError(res, e, headers);
    }
    return;
  }

  if (job.stream) {
    bool ok = !job.include_usage || res.WriteChunk(UsageChunk(job, options_.model_name, UsageOf(job, choices)));
    if (ok) ok = res.WriteChunk("data: [DONE]\n\n");
    if (ok) res.EndStream();
    return;
  }
  res.Send(200, "application/json", Dump(FinishedBody(job, options_.model_name, tokenizer_, &choices)), headers);
}

// ---------------------------------------------------------------------------------------------
// Signals

Status RunServerUntilSignal(Server& server, bool cancel_in_flight) {
  KEEL_ASSIGN_OR_RETURN(int sig, WaitForTerminationSignal());
  Log().info("received {}; stopping the server (drain {})", SignalName(sig),
             cancel_in_flight ? "off" : "on");
  server.Stop(cancel_in_flight);
  return Status::Ok();
}

}  // namespace keel::engine
