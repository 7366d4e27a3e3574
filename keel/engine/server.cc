#include "keel/engine/server.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cmath>
#include <deque>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include <fmt/format.h>

#include "keel/core/log.h"

namespace keel::engine {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// ---------------------------------------------------------------------------------------------
// OpenAI error bodies

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::optional<std::string> param;
  std::optional<std::string> code;
};

// Generated text may hold bytes that are not valid UTF-8 (byte-fallback tokens); JSON output
// replaces them with U+FFFD instead of throwing.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json ErrorObject(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param ? json(*e.param) : json(nullptr)},
            {"code", e.code ? json(*e.code) : json(nullptr)}}}};
}

void SendError(HttpResponder& res, const ApiError& e) {
  HttpHeaderList extra;
  if (e.status == 429) extra.emplace_back("Retry-After", "1");
  res.Send(e.status, "application/json", Dump(ErrorObject(e)), extra);
}

// An invalid_request_error naming the offending field ("" for the body as a whole: null).
ApiError BadParam(std::string param, std::string message) {
  std::optional<std::string> p;
  if (!param.empty()) p = std::move(param);
  return ApiError{400, std::move(message), "invalid_request_error", std::move(p), std::nullopt};
}

// Errors the HTTP layer itself produces (404, 405, 413, 431, 400 for broken HTTP, 503).
std::string OpenAiHttpErrorBody(int status, std::string_view message) {
  ApiError e;
  e.status = status;
  e.message = std::string(message);
  e.type = status >= 500 ? "server_error" : "invalid_request_error";
  if (status == 404) e.code = "not_found";
  return Dump(ErrorObject(e));
}

// Deep nesting is rejected before parsing: nothing in this API nests more than a few levels,
// and a megabyte of '[' must not cost recursion.
bool NestingWithin(std::string_view s, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

std::string RandomHex(int n) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* kHex = "0123456789abcdef";
  std::string s(static_cast<size_t>(n), '0');
  for (auto& c : s) c = kHex[rng() & 15];
  return s;
}

uint64_t RandomSeed() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------------------------
// Request parsing

// Reads an optional integer field. Absent or null leaves *out untouched and returns nullopt.
std::optional<ApiError> GetInt(const json& body, const char* name, int64_t* out, bool* present) {
  *present = false;
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_number_unsigned()) {
    uint64_t v = it->get<uint64_t>();
    *out = v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
               ? std::numeric_limits<int64_t>::max()
               : static_cast<int64_t>(v);
  } else if (it->is_number_integer()) {
    *out = it->get<int64_t>();
  } else {
    return BadParam(name, fmt::format("'{}' must be an integer", name));
  }
  *present = true;
  return std::nullopt;
}

std::optional<ApiError> GetNumber(const json& body, const char* name, double* out, bool* present) {
  *present = false;
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return BadParam(name, fmt::format("'{}' must be a number", name));
  *out = it->get<double>();
  if (!std::isfinite(*out)) return BadParam(name, fmt::format("'{}' must be finite", name));
  *present = true;
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& body, const char* name, bool* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return BadParam(name, fmt::format("'{}' must be a boolean", name));
  *out = it->get<bool>();
  return std::nullopt;
}

// The chat template. The llama2.c models Keel serves by default were trained on plain text and
// know no role markers, so a conversation is rendered as the messages' contents in order, each
// separated by a single "\n", with no role labels and no trailing separator:
//   [{system,"A"},{user,"B"}]  ->  "A\nB"
// which is then encoded with BOS. Models with a real chat template need their own renderer.
std::string RenderChat(const std::vector<std::string>& contents) {
  std::string out;
  for (size_t i = 0; i < contents.size(); ++i) {
    if (i) out += '\n';
    out += contents[i];
  }
  return out;
}

}  // namespace

// Everything about one generation request, parsed and validated.
struct ServerJob {
  bool chat = false;
  std::string route;
  std::vector<int> prompt;
  GenerationParams params;
  bool stream = false;
  bool include_usage = false;
  std::string id;
  int64_t created = 0;
  Clock::time_point start;
};

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
      queue_depth(registry.AddGauge("keel_queue_depth", "Requests waiting for admission.").Get()),
      running(registry.AddGauge("keel_running_sequences", "Sequences in the running batch.").Get()),
      kv_blocks_used(registry.AddGauge("keel_kv_blocks_used", "KV blocks referenced by sequences.").Get()),
      kv_blocks_total(registry.AddGauge("keel_kv_blocks_total", "KV blocks in the cache budget.").Get()),
      kv_blocks_cached(registry.AddGauge("keel_kv_blocks_cached",
                                         "Unreferenced KV blocks still holding a reusable prefix.").Get()),
      open_connections(registry.AddGauge("keel_http_open_connections", "Open HTTP connections.").Get()),
      time_to_first_token(registry.AddHistogram("keel_time_to_first_token_seconds",
                                                "Time from submission to the first generated token.",
                                                LatencyBuckets()).Get()),
      inter_token_latency(registry.AddHistogram("keel_inter_token_latency_seconds",
                                                "Time between consecutive generated tokens of a sequence.",
                                                LatencyBuckets()).Get()),
      request_duration(registry.AddHistogram("keel_request_duration_seconds",
                                             "Generation requests, from receipt to the last byte.",
                                             LatencyBuckets()).Get()) {}

std::shared_ptr<EngineMetrics> MakeEngineMetrics() { return std::make_shared<EngineMetrics>(); }

SchedulerObserver ObserverFor(std::shared_ptr<EngineMetrics> metrics) {
  SchedulerObserver o;
  o.time_to_first_token = [metrics](double s) { metrics->time_to_first_token.Observe(s); };
  o.inter_token_latency = [metrics](double s) { metrics->inter_token_latency.Observe(s); };
  return o;
}

// ---------------------------------------------------------------------------------------------
// Parsing

namespace {

// Parses the fields common to both endpoints (model, n, sampling, stop, stream).
std::optional<ApiError> ParseCommon(const json& body, const std::string& model_name, ServerJob* job) {
  auto model = body.find("model");
  if (model == body.end() || model->is_null()) return BadParam("model", "'model' is required");
  if (!model->is_string()) return BadParam("model", "'model' must be a string");
  if (model->get<std::string>() != model_name) {
    ApiError e{404, fmt::format("The model `{}` does not exist; this server serves `{}`",
                                model->get<std::string>(), model_name),
               "invalid_request_error", "model", "model_not_found"};
    return e;
  }

  bool present = false;
  int64_t n = 1;
  if (auto e = GetInt(body, "n", &n, &present)) return e;
  if (present && n != 1) return BadParam("n", "only n = 1 is supported");
  int64_t best_of = 1;
  if (auto e = GetInt(body, "best_of", &best_of, &present)) return e;
  if (present && best_of != 1) return BadParam("best_of", "only best_of = 1 is supported");

  SamplingOptions& s = job->params.sampling;
  double temperature = 1.0;
  if (auto e = GetNumber(body, "temperature", &temperature, &present)) return e;
  if (temperature < 0 || temperature > 2) {
    return BadParam("temperature", "'temperature' must be between 0 and 2");
  }
  s.temperature = static_cast<float>(temperature);
  double top_p = 1.0;
  if (auto e = GetNumber(body, "top_p", &top_p, &present)) return e;
  if (!(top_p > 0 && top_p <= 1)) return BadParam("top_p", "'top_p' must be in (0, 1]");
  s.top_p = static_cast<float>(top_p);
  int64_t top_k = 0;
  if (auto e = GetInt(body, "top_k", &top_k, &present)) return e;
  if (top_k < 0) return BadParam("top_k", "'top_k' must be >= 0");
  s.top_k = static_cast<int>(std::min<int64_t>(top_k, std::numeric_limits<int>::max()));
  auto seed = body.find("seed");
  if (seed != body.end() && !seed->is_null()) {
    if (seed->is_number_unsigned()) {
      s.seed = seed->get<uint64_t>();
    } else if (seed->is_number_integer()) {
      s.seed = static_cast<uint64_t>(seed->get<int64_t>());
    } else {
      return BadParam("seed", "'seed' must be an integer");
    }
  } else {
    s.seed = RandomSeed();
  }

  auto stop = body.find("stop");
  if (stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      job->params.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > 4) return BadParam("stop", "'stop' holds at most 4 sequences");
      for (const auto& v : *stop) {
        if (!v.is_string()) return BadParam("stop", "'stop' must be a string or an array of strings");
        job->params.stop.push_back(v.get<std::string>());
      }
    } else {
      return BadParam("stop", "'stop' must be a string or an array of strings");
    }
    for (const auto& st : job->params.stop) {
      if (st.empty()) return BadParam("stop", "stop sequences must not be empty");
    }
  }

  if (auto e = GetBool(body, "stream", &job->stream)) return e;
  auto so = body.find("stream_options");
  if (so != body.end() && !so->is_null()) {
    if (!so->is_object()) return BadParam("stream_options", "'stream_options' must be an object");
    if (auto e = GetBool(*so, "include_usage", &job->include_usage)) {
      e->param = "stream_options.include_usage";
      return e;
    }
  }
  auto user = body.find("user");
  if (user != body.end() && !user->is_null() && !user->is_string()) {
    return BadParam("user", "'user' must be a string");
  }
  return std::nullopt;
}

// Prompt of /v1/completions: a string, an array of one string, an array of token ids, or an
// array of one array of token ids. Token ids are used as given (no BOS added).
std::optional<ApiError> ParsePrompt(const json& body, const Tokenizer& tok, int vocab, std::vector<int>* out) {
  auto p = body.find("prompt");
  if (p == body.end() || p->is_null()) return BadParam("prompt", "'prompt' is required");
  const json* v = &*p;
  if (v->is_array() && v->size() == 1 && ((*v)[0].is_string() || (*v)[0].is_array())) v = &(*v)[0];
  if (v->is_string()) {
    *out = tok.Encode(v->get<std::string>(), /*bos=*/true);
    return std::nullopt;
  }
  if (!v->is_array()) {
    return BadParam("prompt", "'prompt' must be a string, an array of one string, or an array of token ids");
  }
  if (v->empty()) return BadParam("prompt", "'prompt' must not be empty");
  for (const auto& t : *v) {
    if (t.is_string() || t.is_array()) return BadParam("prompt", "only one prompt per request is supported");
    if (!t.is_number_integer()) return BadParam("prompt", "token ids must be integers");
    int64_t id = t.is_number_unsigned() && t.get<uint64_t>() > static_cast<uint64_t>(vocab)
                     ? static_cast<int64_t>(vocab)
                     : t.get<int64_t>();
    if (id < 0 || id >= vocab) {
      return BadParam("prompt", fmt::format("token id {} is outside the vocabulary (0..{})", t.dump(), vocab - 1));
    }
    out->push_back(static_cast<int>(id));
  }
  return std::nullopt;
}

std::optional<ApiError> ParseMessages(const json& body, const Tokenizer& tok, std::vector<int>* out) {
  auto m = body.find("messages");
  if (m == body.end() || m->is_null()) return BadParam("messages", "'messages' is required");
  if (!m->is_array() || m->empty()) return BadParam("messages", "'messages' must be a non-empty array");
  std::vector<std::string> contents;
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    std::string where = fmt::format("messages[{}]", i);
    if (!msg.is_object()) return BadParam(where, where + " must be an object");
    auto role = msg.find("role");
    if (role == msg.end() || !role->is_string()) {
      return BadParam(where + ".role", where + ".role must be a string");
    }
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "developer") {
      return BadParam(where + ".role",
                      fmt::format("{}.role '{}' is not supported (system, developer, user, assistant)", where, r));
    }
    auto content = msg.find("content");
    if (content == msg.end()) return BadParam(where + ".content", where + ".content is required");
    if (content->is_string()) {
      contents.push_back(content->get<std::string>());
    } else if (content->is_null() && r == "assistant") {
      contents.emplace_back();
    } else if (content->is_array()) {
      // Content parts: only text parts are supported; they are concatenated.
      std::string text;
      for (const auto& part : *content) {
        auto type = part.is_object() ? part.find("type") : part.end();
        auto t = part.is_object() ? part.find("text") : part.end();
        if (!part.is_object() || type == part.end() || *type != "text" || t == part.end() || !t->is_string()) {
          return BadParam(where + ".content", where + ".content parts must be {\"type\":\"text\",\"text\":...}");
        }
        text += t->get<std::string>();
      }
      contents.push_back(std::move(text));
    } else {
      return BadParam(where + ".content", where + ".content must be a string");
    }
  }
  *out = tok.Encode(RenderChat(contents), /*bos=*/true);
  return std::nullopt;
}

// Fills max_tokens: explicit values must be >= 1 and fit the context with the prompt; the
// default is `default_tokens` clamped to what the context leaves.
std::optional<ApiError> ParseMaxTokens(const json& body, bool chat, int prompt_len, int context,
                                       GenerationParams* params) {
  const char* name = "max_tokens";
  int64_t value = 0;
  bool present = false;
  if (chat) {
    if (auto e = GetInt(body, "max_completion_tokens", &value, &present)) return e;
    if (present) name = "max_completion_tokens";
  }
  if (!present) {
    if (auto e = GetInt(body, "max_tokens", &value, &present)) return e;
  }
  if (prompt_len >= context) {
    return BadParam(chat ? "messages" : "prompt",
                    fmt::format("This model's maximum context length is {} tokens, but the prompt has {} tokens",
                                context, prompt_len));
  }
  if (!present) {
    const int64_t left = context - prompt_len;
    params->max_tokens = static_cast<int>(chat ? left : std::min<int64_t>(16, left));
    return std::nullopt;
  }
  if (value < 1) return BadParam(name, fmt::format("'{}' must be at least 1", name));
  if (value > static_cast<int64_t>(context - prompt_len)) {  // no overflow for huge values
    return BadParam(name, fmt::format("This model's maximum context length is {} tokens. However, you "
                                      "requested {} tokens ({} in the prompt, {} for the completion)",
                                      context, static_cast<double>(prompt_len) + static_cast<double>(value), prompt_len, value));
  }
  params->max_tokens = static_cast<int>(value);
  return std::nullopt;
}

std::optional<ApiError> RejectUnsupported(const json& body, bool chat) {
  auto lp = body.find("logprobs");
  if (lp != body.end() && !lp->is_null() && !(lp->is_boolean() && !lp->get<bool>()) &&
      !(lp->is_number_integer() && lp->get<int64_t>() == 0)) {
    return BadParam("logprobs", "logprobs are not supported");
  }
  if (!chat) {
    auto echo = body.find("echo");
    if (echo != body.end() && !echo->is_null() && !(echo->is_boolean() && !echo->get<bool>())) {
      return BadParam("echo", "echo is not supported");
    }
    auto suffix = body.find("suffix");
    if (suffix != body.end() && !suffix->is_null() && !(suffix->is_string() && suffix->get<std::string>().empty())) {
      return BadParam("suffix", "suffix is not supported");
    }
  } else {
    auto tools = body.find("tools");
    if (tools != body.end() && !tools->is_null() && !(tools->is_array() && tools->empty())) {
      return BadParam("tools", "tools are not supported");
    }
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Event hand-off between the scheduler thread and the connection thread

struct EventQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<GenerationEvent> events;

  void Push(const GenerationEvent& ev) {
    {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(ev);
    }
    cv.notify_one();
  }
  // Takes the next event, waiting up to `timeout`. False on timeout.
  bool Pop(GenerationEvent* out, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, timeout, [&] { return !events.empty(); })) return false;
    *out = std::move(events.front());
    events.pop_front();
    return true;
  }
};

const char* OpenAiFinishReason(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    default: return nullptr;
  }
}

std::string SseEvent(const json& j) { return "data: " + Dump(j) + "\n\n"; }

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
  metrics_->prefix_hit_tokens.SetCallback([s] { return static_cast<double>(s->Stats().kv.prefix_hit_tokens); });

  router_.Handle("GET", "/healthz", [this](const HttpRequest& q, HttpResponder& r) { HandleHealth(q, r); });
  router_.Handle("GET", "/v1/models", [this](const HttpRequest& q, HttpResponder& r) { HandleModels(q, r); });
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
}

Server::~Server() {
  Stop(/*cancel_in_flight=*/true);
  // The metrics may outlive us (shared); unbind everything that points at this server.
  metrics_->queue_depth.SetCallback(nullptr);
  metrics_->running.SetCallback(nullptr);
  metrics_->kv_blocks_used.SetCallback(nullptr);
  metrics_->kv_blocks_total.SetCallback(nullptr);
  metrics_->kv_blocks_cached.SetCallback(nullptr);
  metrics_->prefix_hit_tokens.SetCallback(nullptr);
  metrics_->open_connections.SetCallback(nullptr);
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

namespace {

// Counts a request in keel_requests_total the moment its status is written, so a client that
// has its response can rely on the count already including it.
class CountingResponder final : public HttpResponder {
 public:
  CountingResponder(HttpResponder& inner, CounterFamily& requests, std::string route)
      : inner_(inner), requests_(requests), route_(std::move(route)) {}

  bool Send(int status, std::string_view content_type, std::string body,
            const HttpHeaderList& extra) override {
    Count(status);
    return inner_.Send(status, content_type, std::move(body), extra);
  }
  bool BeginStream(int status, std::string_view content_type, const HttpHeaderList& extra) override {
    Count(status);
    return inner_.BeginStream(status, content_type, extra);
  }
  bool WriteChunk(std::string_view data) override { return inner_.WriteChunk(data); }
  bool EndStream() override { return inner_.EndStream(); }
  bool ClientGone() override { return inner_.ClientGone(); }
  int status() const override { return inner_.status(); }
  // A handler that never answered is answered 500 by the HTTP layer; count that too.
  void CountIfSilent() { Count(500); }

 private:
  void Count(int status) {
    if (counted_ || inner_.status() != 0) return;
    counted_ = true;
    requests_.WithLabels({route_, std::to_string(status)}).Inc();
  }
  HttpResponder& inner_;
  CounterFamily& requests_;
  std::string route_;
  bool counted_ = false;
};

}  // namespace

void Server::Route(const HttpRequest& req, HttpResponder& res) {
  // The route label takes only the fixed set of known paths; anything else is "other".
  CountingResponder counting(res, metrics_->requests, router_.HasPath(req.path) ? req.path : "other");
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

  // The body is parsed as JSON whatever the Content-Type says: `curl -d` sends form encoding.
  if (!NestingWithin(req.body, 32)) {
    SendError(res, BadParam("", "request JSON nests too deeply"));
    return;
  }
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    SendError(res, ApiError{400, "We could not parse the JSON body of your request: it is not valid JSON",
                            "invalid_request_error", std::nullopt, std::nullopt});
    return;
  }
  if (!body.is_object()) {
    SendError(res, BadParam("", "the request body must be a JSON object"));
    return;
  }
  const ModelConfig& config = scheduler_.model().config;
  std::optional<ApiError> err = ParseCommon(body, options_.model_name, &job);
  if (!err) err = RejectUnsupported(body, chat);
  if (!err) {
    err = chat ? ParseMessages(body, tokenizer_, &job.prompt)
               : ParsePrompt(body, tokenizer_, config.vocab_size, &job.prompt);
  }
  if (!err) {
    err = ParseMaxTokens(body, chat, static_cast<int>(job.prompt.size()), config.max_seq_len, &job.params);
  }
  if (!err && job.prompt.empty()) err = BadParam(chat ? "messages" : "prompt", "the prompt is empty");
  if (err) {
    SendError(res, *err);
    return;
  }
  RunJob(job, res);
}

void Server::RunJob(ServerJob& job, HttpResponder& res) {
  auto queue = std::make_shared<EventQueue>();
  auto request = std::make_shared<Request>();
  request->prompt = job.prompt;
  request->params = job.params;
  std::shared_ptr<EngineMetrics> metrics = metrics_;
  // Runs on the scheduler thread: copy and hand off, never touch the socket.
  request->on_event = [queue, metrics, last = 0](const GenerationEvent& ev) mutable {
    if (ev.completion_tokens > last) {
      metrics->generation_tokens.Inc(ev.completion_tokens - last);
      last = ev.completion_tokens;
    }
    queue->Push(ev);
  };

  Status st = scheduler_.Submit(request);
  if (!st.ok()) {
    switch (st.code()) {
      case StatusCode::kInvalidArgument:
        SendError(res, ApiError{400, st.message(), "invalid_request_error", {}, {}});
        break;
      case StatusCode::kResourceExhausted:
        SendError(res, ApiError{429, st.message(), "rate_limit_exceeded", {}, "rate_limit_exceeded"});
        break;
      case StatusCode::kUnavailable:
        SendError(res, ApiError{503, st.message(), "server_error", {}, "server_shutting_down"});
        break;
      default:
        SendError(res, ApiError{500, st.message(), "server_error", {}, {}});
        break;
    }
    return;
  }
  metrics_->prompt_tokens.Inc(static_cast<double>(job.prompt.size()));

  const std::string object = job.chat ? "chat.completion.chunk" : "text_completion";
  auto chunk = [&](const std::string& text, const char* finish, bool first) {
    json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
    if (job.chat) {
      json delta = json::object();
      if (first) delta["role"] = "assistant";
      if (first || !text.empty()) delta["content"] = text;
      choice["delta"] = std::move(delta);
    } else {
      choice["text"] = text;
    }
    json j = {{"id", job.id}, {"object", object}, {"created", job.created},
              {"model", options_.model_name}, {"choices", json::array({choice})}};
    if (job.include_usage) j["usage"] = nullptr;
    return SseEvent(j);
  };
  auto usage = [](const GenerationEvent& ev) {
    return json{{"prompt_tokens", ev.prompt_tokens},
                {"completion_tokens", ev.completion_tokens},
                {"total_tokens", ev.prompt_tokens + ev.completion_tokens}};
  };

  bool client_ok = true;
  if (job.stream) {
    client_ok = res.BeginStream(200, "text/event-stream",
                                {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}});
    if (client_ok && job.chat) client_ok = res.WriteChunk(chunk("", nullptr, true));
  }

  std::string text;
  GenerationEvent ev;
  bool finished = false;
  bool gone = !client_ok;
  while (!finished && !gone) {
    if (!queue->Pop(&ev, std::chrono::milliseconds(50))) {
      if (res.ClientGone()) gone = true;
      if (hard_stop_) break;
      continue;
    }
    finished = ev.finished;
    if (job.stream && !ev.text.empty()) {
      if (!res.WriteChunk(chunk(ev.text, nullptr, false))) gone = true;
    } else {
      text += ev.text;
    }
  }
  if (gone) {
    request->cancelled = true;  // the scheduler drops it at its next step
    metrics_->request_duration.Observe(std::chrono::duration<double>(Clock::now() - job.start).count());
    return;
  }

  const char* finish = finished ? OpenAiFinishReason(ev.finish_reason) : nullptr;
  // Observed before the final write, so a client holding its response sees it counted.
  metrics_->request_duration.Observe(std::chrono::duration<double>(Clock::now() - job.start).count());
  if (!finish) {
    // Cancelled (by shutdown), failed, or abandoned at the hard stop.
    request->cancelled = true;
    ApiError e;
    if (finished && ev.finish_reason == FinishReason::kError) {
      e = ApiError{500, "generation failed: " + ev.error.ToString(), "server_error", {}, {}};
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
      SendError(res, e);
    }
  } else if (job.stream) {
    bool ok = res.WriteChunk(chunk("", finish, false));
    if (ok && job.include_usage) {
      json j = {{"id", job.id}, {"object", object}, {"created", job.created},
                {"model", options_.model_name}, {"choices", json::array()}, {"usage", usage(ev)}};
      ok = res.WriteChunk(SseEvent(j));
    }
    if (ok) ok = res.WriteChunk("data: [DONE]\n\n");
    if (ok) res.EndStream();
  } else {
    json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}};
    if (job.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      choice["text"] = text;
    }
    json body = {{"id", job.id}, {"object", job.chat ? "chat.completion" : "text_completion"},
                 {"created", job.created}, {"model", options_.model_name},
                 {"choices", json::array({choice})}, {"usage", usage(ev)}};
    res.Send(200, "application/json", Dump(body));
  }
}

// ---------------------------------------------------------------------------------------------
// Signals

namespace {

std::atomic<int> g_signal_write_fd{-1};

void OnShutdownSignal(int sig) {
  int saved = errno;
  int fd = g_signal_write_fd.load();
  if (fd >= 0) {
    unsigned char b = static_cast<unsigned char>(sig);
    (void)!::write(fd, &b, 1);
  }
  errno = saved;
}

}  // namespace

Status RunServerUntilSignal(Server& server, bool cancel_in_flight) {
  static std::mutex busy;
  std::unique_lock<std::mutex> guard(busy, std::try_to_lock);
  if (!guard.owns_lock()) return Status::Internal("RunServerUntilSignal is already waiting");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::Internal(fmt::format("pipe: {}", std::strerror(errno)));
  g_signal_write_fd = fds[1];
  struct sigaction sa {}, old_int{}, old_term{};
  sa.sa_handler = OnShutdownSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (::sigaction(SIGINT, &sa, &old_int) != 0 || ::sigaction(SIGTERM, &sa, &old_term) != 0) {
    g_signal_write_fd = -1;
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::Internal(fmt::format("sigaction: {}", std::strerror(errno)));
  }
  unsigned char sig = 0;
  for (;;) {
    ssize_t n = ::read(fds[0], &sig, 1);
    if (n == 1) break;
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  g_signal_write_fd = -1;
  ::close(fds[0]);
  ::close(fds[1]);
  Log().info("received {}; stopping the server (drain {})", sig == SIGINT ? "SIGINT" : "SIGTERM",
             cancel_in_flight ? "off" : "on");
  server.Stop(cancel_in_flight);
  return Status::Ok();
}

}  // namespace keel::engine
