// AgentClient: what a service embeds to follow the HiLO controller. A thread long-polls the
// controller's GET /v1/state and feeds each answer to a StateAgent; Report() posts a LoadReport to
// POST /v1/report. Every call is bounded by a deadline; errors are logged (rate-limited to one line
// per failure streak) and returned as values, never thrown. A lost controller is covered by the
// StateAgent's rules: the last state is held for hold_s, then the safe state after fallback_s.
//
// Transport: the caller passes a ControllerCall that sends one HTTP request to the controller;
// HttpControllerCall builds one on keel::HttpClient (keel/core/http_client.h). Tests may pass any
// function (e.g. one that fails on demand).
//
// Thread safety: every method may be called from any thread. Start and Stop from the owner.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "keel/core/http_client.h"
#include "keel/core/socket.h"
#include "keel/core/status.h"
#include "keel/hilo/agent.h"
#include "keel/hilo/report.h"

namespace keel::hilo {

struct ControllerReply {
  int status = 0;
  std::string body;
};
// Sends one request (method, target such as "/v1/state?version=1", body, content type) and reads
// the reply before `deadline`. Any HTTP status is a reply; an error when none could be read.
using ControllerCall = std::function<Result<ControllerReply>(std::string_view method, std::string_view target,
                                                              std::string_view body, std::string_view content_type,
                                                              Deadline deadline)>;

// What a controller sends is small (a catalog is at most kMaxCatalogBytes): replies are bounded
// to 2 MiB rather than HttpClient's 64 MiB default.
inline HttpClientOptions ControllerHttpOptions() {
  HttpClientOptions o;
  o.max_response_bytes = size_t{2} << 20;
  o.max_idle_connections = 4;  // the poll and a report, with room to spare
  return o;
}
// A ControllerCall over keel::HttpClient: keep-alive connections to `endpoint`, shared by the
// copies of the returned function. Replies over options.max_response_bytes fail the call.
ControllerCall HttpControllerCall(const HttpEndpoint& endpoint, HttpClientOptions options = ControllerHttpOptions());
// The same for "http://host:port" (ParseHttpUrl); InvalidArgument naming what is wrong with `url`.
Result<ControllerCall> HttpControllerCallForUrl(std::string_view url,
                                                HttpClientOptions options = ControllerHttpOptions());

struct AgentClientOptions {
  AgentOptions agent;
  // The service this client follows for ("answer", "vector", "engine", "gateway"), sent as
  // `service=` on every poll: a controller under the per-service policy answers that service's own
  // level (and refuses a poll without it); one under the hilo policy ignores it. "" = not sent.
  // ServiceLink always sets it.
  std::string service;
  // Long-poll wait asked of the controller (<= its max_wait_ms). Short: Stop() waits for the poll
  // in flight, and each answer is a heartbeat, so under the agent's hold_s the agent never counts a
  // healthy controller as lost. One request a second per instance costs the controller nothing.
  int wait_ms = 1000;
  int slack_ms = 2000;          // a poll's deadline is wait_ms + slack_ms
  int retry_ms = 500;           // pause after a failed poll
  int report_timeout_ms = 1000;  // deadline of one Report()
  std::function<int64_t()> clock;  // unix ms at which a push was heard; null = the system clock
  // Called on the poll thread after each state answer the agent accepted (a newer version, or
  // the same version heard again), outside the client's lock: ServiceLink re-reads Current() at
  // once instead of at its next report tick. It may call Current() and version(); it must not
  // call Stop() or block for long (the next poll waits for it). Null = nothing.
  std::function<void()> on_push;
};

class AgentClient {
 public:
  // `catalog` must pass ValidateCatalog (it should be the controller's catalog: GET /v1/catalog).
  static Result<std::unique_ptr<AgentClient>> Create(Catalog catalog, ControllerCall call, AgentClientOptions options);
  ~AgentClient();  // Stop()
  AgentClient(const AgentClient&) = delete;
  AgentClient& operator=(const AgentClient&) = delete;

  // Starts the long-poll thread. Internal if already started.
  Status Start();
  // Stops the thread. It waits for a poll in flight: until the controller answers, at most
  // wait_ms + slack_ms (a stopping controller answers its waiters at once). Idempotent.
  void Stop();

  // The state to apply at now_ms (StateAgent::Current). The View's state pointer stays valid
  // while the client lives.
  StateAgent::View Current(int64_t now_ms) const;
  int64_t version() const;
  // Posts `r`. Unavailable when the controller could not be reached, InvalidArgument with its
  // message when it refused the report; also logged.
  Status Report(const LoadReport& r);

  uint64_t polls_ok() const { return polls_ok_.load(); }
  uint64_t poll_errors() const { return poll_errors_.load(); }

 private:
  AgentClient(StateAgent agent, ControllerCall call, AgentClientOptions options)
      : agent_(std::move(agent)), call_(std::move(call)), opt_(std::move(options)) {}
  void Loop();
  Status PollOnce();

  mutable std::mutex mu_;  // guards agent_, epoch_, stopping_
  StateAgent agent_;
  std::string epoch_;  // the controller instance last heard ("" before, or from one without epochs)
  ControllerCall call_;
  AgentClientOptions opt_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread thread_;
  std::atomic<uint64_t> polls_ok_{0};
  std::atomic<uint64_t> poll_errors_{0};
  std::atomic<bool> report_failing_{false};
};

}  // namespace keel::hilo
