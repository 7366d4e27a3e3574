// Server: the engine's OpenAI-compatible HTTP API over one Scheduler.
//
// Routes (exact paths):
//   GET  /healthz               {"status":"ok"} (503 {"status":"draining"} while stopping)
//   GET  /v1/models             the one served model, OpenAI list format
//   POST /v1/completions        OpenAI legacy completions, streaming (SSE) or not
//   POST /v1/chat/completions   OpenAI chat completions, streaming (SSE) or not
//   GET  /metrics               Prometheus text (EngineMetrics)
// Errors use OpenAI's body {"error":{"message","type","param","code"}}: 400 for malformed JSON,
// wrong types, missing fields and limits (prompt + max_tokens beyond the context), 404 for an
// unknown model (code "model_not_found") or path, 413 for bodies over the limit, 429 (code
// "rate_limit_exceeded") when the scheduler's queue is full, 503 while shutting down.
//
// Threads: the HTTP layer runs one thread per connection (keel::HttpServer); the Server also
// owns the thread that steps the scheduler (unless options.run_scheduler is false). Scheduler
// events arrive on that thread and are handed to the connection's thread through a per-request
// queue, so a slow client never stalls the batch; a client that goes away has its request
// cancelled. Start/Stop/port/metrics are thread-safe.
//
// Typical use (this is what `keel serve` does):
//   auto metrics = MakeEngineMetrics();
//   auto engine = Engine::Open(engine_options, ObserverFor(metrics));   // scheduler built here
//   Server server((*engine)->scheduler(), (*engine)->tokenizer(), server_options, metrics);
//   KEEL_RETURN_IF_ERROR(server.Start());
//   return RunServerUntilSignal(server);   // SIGINT/SIGTERM -> graceful Stop
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "keel/core/http_server.h"
#include "keel/core/metrics.h"
#include "keel/core/status.h"
#include "keel/engine/scheduler.h"
#include "keel/engine/tokenizer.h"

namespace keel::engine {

struct ServerJob;  // one parsed generation request (defined in openai_protocol.h)
class HiloLevels;  // hilo_levels.h

// The engine's metrics and the registry that renders them. Create it before the Scheduler so
// its observer (ObserverFor) can record time-to-first-token and inter-token latency, then hand
// the same object to the Server, which binds the scheduler gauges and counts requests. All
// members are safe to update from any thread.
struct EngineMetrics {
  EngineMetrics();
  EngineMetrics(const EngineMetrics&) = delete;
  EngineMetrics& operator=(const EngineMetrics&) = delete;

  MetricsRegistry registry;
  CounterFamily& requests;           // keel_requests_total{route,code}
  Counter& prompt_tokens;            // keel_prompt_tokens_total (accepted requests' prompts)
  Counter& generation_tokens;        // keel_generation_tokens_total
  Counter& prefix_hit_tokens;        // keel_prefix_cache_hit_tokens_total (KV cache + kvstore)
  Counter& prompt_tokens_computed;   // keel_prompt_tokens_computed_total (prefilled, not reused)
  Counter& kv_codec_switches;        // keel_kv_codec_switches_total (HiLO run-time codec changes)
  Gauge& queue_depth;                // keel_queue_depth
  Gauge& running;                    // keel_running_sequences
  Gauge& kv_blocks_used;             // keel_kv_blocks_used
  Gauge& kv_blocks_total;            // keel_kv_blocks_total
  Gauge& kv_blocks_cached;           // keel_kv_blocks_cached
  Gauge& kv_blocks_compacted;        // keel_kv_blocks_compacted
  Gauge& kv_bytes_used;              // keel_kv_bytes_used
  Gauge& kv_bytes_total;             // keel_kv_bytes_total
  Gauge& open_connections;           // keel_http_open_connections
  Counter& connections_shed;         // keel_http_connections_shed_total (idle/half-sent, at a cap)
  Counter& connections_rejected;     // keel_http_connections_rejected_total (503: all busy)
  Counter& request_timeouts;         // keel_http_request_timeouts_total (head or body deadline)
  CounterFamily& requests_refused;   // keel_http_requests_refused_total{code}: 400/413/431/501 before routing
  Histogram& time_to_first_token;    // keel_time_to_first_token_seconds
  Histogram& inter_token_latency;    // keel_inter_token_latency_seconds
  Histogram& request_duration;       // keel_request_duration_seconds (generation requests)
};

std::shared_ptr<EngineMetrics> MakeEngineMetrics();
// An observer that records into `metrics` (kept alive by the observer's closures).
SchedulerObserver ObserverFor(std::shared_ptr<EngineMetrics> metrics);

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                   // 0 = pick a free port (see Server::port)
  std::string model_name;            // the "model" clients must name; empty: model file's stem
  int max_connections = 256;
  size_t max_body_bytes = 1 << 20;
  double read_timeout_seconds = 30;
  double drain_seconds = 10;         // Stop(false) lets requests in flight run this long
  // When false the caller steps the scheduler itself (Run/Step on its own thread); the Server
  // then only submits and cancels. Tests use this to hold requests in the queue.
  bool run_scheduler = true;
  // HiLO (hilo_levels.h; may be null): each generation request gets the current state's level
  // (max_tokens clamped to max_new_tokens, the prompt cut from the front to max_context), the
  // answer carries an `x-keel-hilo-state: <state>` header (and `x-keel-prompt-tokens-cut: N` when
  // a prompt was cut), and the request is metered into the link's LoadMeter: Arrive once parsed,
  // Shed when refused at submit (429 queue full, or a 400/503 from the scheduler) or cancelled
  // before admission, Started when the scheduler admits it, Finish with its whole latency and
  // the time it spent in the batch. Must outlive the Server.
  HiloLevels* hilo = nullptr;
};

class Server {
 public:
  // `scheduler` and `tokenizer` must outlive the Server. `metrics` may be null, in which case
  // the Server makes its own (without TTFT/ITL samples unless the scheduler was built with
  // ObserverFor on it).
  Server(Scheduler& scheduler, const Tokenizer& tokenizer, ServerOptions options,
         std::shared_ptr<EngineMetrics> metrics = nullptr);
  ~Server();  // Stop(true) if still running
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and starts serving (and stepping the scheduler). IOError naming host:port when the
  // address cannot be bound; Internal when called twice.
  Status Start();
  // The bound port (useful with options.port == 0); 0 before Start.
  int port() const;
  // Stops accepting connections and new requests (503), then lets requests in flight finish
  // for up to options.drain_seconds (at once when `cancel_in_flight`). Whatever is still
  // running is then cancelled: streams end with an error event and `data: [DONE]`, other
  // requests get 503. Then joins every thread. Shuts the scheduler down for good
  // (Scheduler::Shutdown). Idempotent; blocks until done.
  void Stop(bool cancel_in_flight);

  MetricsRegistry& metrics() { return metrics_->registry; }
  EngineMetrics& engine_metrics() { return *metrics_; }
  const std::string& model_name() const { return options_.model_name; }

 private:
  void Route(const HttpRequest& req, HttpResponder& res);
  void HandleHealth(const HttpRequest& req, HttpResponder& res);
  void HandleModels(const HttpRequest& req, HttpResponder& res);
  void HandleModel(HttpResponder& res, std::string_view id);
  void HandleMetrics(const HttpRequest& req, HttpResponder& res);
  void HandleGenerate(const HttpRequest& req, HttpResponder& res, bool chat);
  void RunJob(ServerJob& job, HttpResponder& res, const HttpHeaderList& headers);

  Scheduler& scheduler_;
  const Tokenizer& tokenizer_;
  ServerOptions options_;
  std::shared_ptr<EngineMetrics> metrics_;
  HttpRouter router_;
  std::unique_ptr<HttpServer> http_;
  int64_t created_ = 0;  // unix seconds at construction ("created" in /v1/models)

  std::mutex mu_;
  std::condition_variable cv_;    // in_flight_ changes
  bool started_ = false;
  bool stopped_ = false;
  int in_flight_ = 0;             // generation requests being handled
  std::atomic<bool> accepting_{false};
  std::atomic<bool> hard_stop_{false};  // handlers still waiting give up
  std::atomic<bool> scheduler_stop_{false};
  std::thread scheduler_thread_;
};

// Blocks until SIGINT or SIGTERM arrives, then calls server.Stop(cancel_in_flight) and returns
// OK. The handlers are installed for the duration of the wait only: a second signal during the
// drain gets the previous (default: terminate) behaviour, so an operator can force an exit.
// Internal if another call is already waiting or the handlers cannot be installed.
Status RunServerUntilSignal(Server& server, bool cancel_in_flight = false);

}  // namespace keel::engine
