// HttpClient: a synchronous HTTP/1.1 client for one peer ("http://host:port"). Blocking calls over
// a pool of keep-alive connections; every call is bounded by a deadline (connect, write and each
// read wait in poll(), keel/core/socket.h), and the response is parsed with Boost.Beast under a
// header and a body limit, so a silent, slow or hostile peer costs at most the deadline and
// `max_response_bytes` of memory. The vector router talks to its replicas with it
// (keel/vector/replica_client.h keeps the old names), HiLO services to the controller.
//
// CallPool runs calls concurrently: a fixed set of threads taking tasks from a queue. A fan-out
// submits one task per peer and waits for them (RunAll). Tasks must never wait for other pool
// tasks (they would deadlock a saturated pool); callers keep blocking waits on other threads.
//
// Thread safety: HttpClient::Call and CallPool::Submit may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "keel/core/http_server.h"
#include "keel/core/socket.h"
#include "keel/core/status.h"

namespace keel {

// "http://host:port" with an optional trailing "/" (no path, no userinfo, no https).
struct HttpEndpoint {
  std::string host;
  int port = 0;
};
// InvalidArgument naming what is wrong with `url`.
Result<HttpEndpoint> ParseHttpUrl(std::string_view url);

struct HttpReply {
  int status = 0;
  HttpHeaders headers;
  std::string body;
};

// What a streamed call (HttpClient::CallStreaming) hands over as it arrives. Either callback may
// return false to stop the call: the connection is closed and the call returns Cancelled.
struct HttpStreamSink {
  std::function<bool(int status, const HttpHeaders& headers)> on_head;  // once, before any body
  std::function<bool(std::string_view bytes)> on_body;                  // de-chunked body bytes, in order
};

struct HttpClientOptions {
  size_t max_response_bytes = size_t{64} << 20;  // larger bodies fail the call (Unavailable)
  size_t max_header_bytes = 64 << 10;
  int max_idle_connections = 16;                 // kept for reuse; more are closed after their call
};

class HttpClient {
 public:
  explicit HttpClient(HttpEndpoint endpoint, HttpClientOptions options = {});
  ~HttpClient();  // closes idle connections
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Sends one request and reads its response, all before `deadline`. Any HTTP status is a
  // successful call; Unavailable (naming host:port) when the peer cannot be reached, the
  // deadline passes, the response is malformed or over the limits. A pooled connection the peer
  // closed meanwhile is retried once on a fresh connection, so callers must only send requests
  // that are safe to repeat (the router's writes carry versions, log posts skip applied records;
  // HiLO's reports and state polls are idempotent).
  // `extra` headers are sent as given (e.g. Authorization); names and values must not hold CR or
  // LF (InvalidArgument: a header must not be able to inject another).
  Result<HttpReply> Call(std::string_view method, std::string_view target, std::string_view body,
                         std::string_view content_type, Deadline deadline, const HttpHeaderList& extra = {});

  // The same request, but the response is handed to `sink` as it arrives (the head once, then
  // the body in pieces, chunked encoding removed), for server-sent events and other long bodies.
  // Returns the response's status once the body has ended. The deadline and limits are Call's:
  // `max_response_bytes` bounds the whole streamed body. A pooled connection the peer closed is
  // retried once only when nothing was read from it, so `sink` never sees a response twice.
  Result<int> CallStreaming(std::string_view method, std::string_view target, std::string_view body,
                            std::string_view content_type, Deadline deadline, const HttpStreamSink& sink,
                            const HttpHeaderList& extra = {});

  const HttpEndpoint& endpoint() const { return endpoint_; }
  std::string Address() const;  // "host:port"

 private:
  Result<std::string> RequestHead(std::string_view method, std::string_view target, std::string_view body,
                                  std::string_view content_type, const HttpHeaderList& extra) const;
  // Runs `exchange(fd, &reusable, &nothing_read)` on a pooled or fresh connection, retrying once
  // on a fresh one when a pooled connection failed before a byte came back.
  template <typename T, typename Exchange>
  Result<T> WithConnection(Deadline deadline, Exchange&& exchange);
  Result<HttpReply> CallOn(int fd, std::string_view head, std::string_view body, Deadline deadline, bool* reusable,
                           bool* nothing_read);
  Result<int> StreamOn(int fd, std::string_view head, std::string_view body, Deadline deadline,
                       const HttpStreamSink& sink, bool* reusable, bool* nothing_read);
  int TakeIdle();
  void GiveBack(int fd);

  const HttpEndpoint endpoint_;
  const HttpClientOptions options_;
  std::mutex mu_;
  std::vector<int> idle_;  // keep-alive connections, most recently used last
};

// A fixed pool of threads running tasks in submission order.
class CallPool {
 public:
  explicit CallPool(int threads);
  ~CallPool();  // runs the tasks already queued, then joins
  CallPool(const CallPool&) = delete;
  CallPool& operator=(const CallPool&) = delete;

  void Submit(std::function<void()> task);
  // Runs fn(0..n-1) concurrently (fn(0) on the calling thread, the rest on the pool) and returns
  // when all have returned. The caller must not be a thread of this pool.
  void RunAll(int n, const std::function<void(int)>& fn);
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Work();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace keel
