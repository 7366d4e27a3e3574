// HttpServer: a small HTTP/1.1 server (Boost.Beast parser and serializer over POSIX sockets) on
// the event-driven ConnectionFront (conn_front.h): one epoll thread accepts and reads every
// request head and body without blocking; only a complete request takes a thread, from a pool of
// at most `max_active_requests` handler threads. Idle keep-alive and half-sent connections cost a
// descriptor and their buffered bytes, so thousands of them (or slow clients) cannot starve
// others: a fresh client is always answered.
//
// Bounded everywhere: total deadlines for a request's head (from its first byte, or from
// accept) and body (from the head's end) answer 408 and close, however steadily a client
// trickles bytes; idle keep-alive connections close after `idle_timeout_seconds`. At
// `max_connections` (or `max_connections_per_client` from one peer IP) a new connection displaces
// the longest-waiting idle or half-sent connection, taken from the client holding the most; only
// when every connection runs a handler is the new one answered 503 at once and closed. A
// complete request while `max_active_requests` handlers run gets 503 and its connection closes.
// Request headers at most `max_header_bytes` (431), bodies at most `max_body_bytes` (413), writes
// time out. Malformed requests get 400 and the connection is closed; nothing a client sends can
// crash the server. Keep-alive and pipelining follow HTTP/1.1 (HTTP/1.0 clients get keep-alive
// only when they ask for it).
//
// The handler runs on a pool thread and may block (e.g. waiting for generated tokens); it answers
// through an HttpResponder, either with one Send or with a chunked stream (BeginStream,
// WriteChunk..., EndStream). A handler that returns without answering gets 500; one that leaves a
// stream open has it closed for it.
//
// Start, Stop, StopAccepting and the accessors are thread-safe. Stop drains: it stops accepting,
// closes idle and half-sent connections, waits up to `drain_seconds` for handlers in progress,
// then shuts the remaining sockets down (their writes fail, ClientGone() turns true) and joins
// every thread. Handlers must therefore return once writes fail or ClientGone() is true, and must
// not call Stop themselves (it waits for them).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "keel/core/conn_front.h"
#include "keel/core/socket.h"
#include "keel/core/status.h"

namespace keel {

// Header list with case-insensitive lookup (names keep the client's spelling).
class HttpHeaders {
 public:
  void Add(std::string name, std::string value) { fields_.emplace_back(std::move(name), std::move(value)); }
  // The first value for `name` (any case), or "" when absent.
  std::string_view Get(std::string_view name) const;
  bool Has(std::string_view name) const;
  const std::vector<std::pair<std::string, std::string>>& fields() const { return fields_; }

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

struct HttpRequest {
  std::string method;   // "GET", "POST", ... as sent
  std::string target;   // path plus query, as sent ("/v1/models?x=1")
  std::string path;     // target up to '?', percent-escapes decoded ("/v1/models/a%2Fb" -> "/v1/models/a/b")
  std::string query;    // after '?', without it ("" when none)
  int version = 11;     // 10 or 11
  HttpHeaders headers;
  std::string body;
  std::string remote;   // "ip:port" of the peer
};

using HttpHeaderList = std::vector<std::pair<std::string, std::string>>;

// How a handler answers one request. Used only on the handler's thread, only during the call.
// Status and body are written once: the second Send/BeginStream is refused (returns false).
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;

  // Writes a complete response with Content-Length. False if the write failed (client gone)
  // or a response was already started.
  virtual bool Send(int status, std::string_view content_type, std::string body,
                    const HttpHeaderList& extra = {}) = 0;
  // Writes the status line and headers of a chunked response. False as for Send.
  virtual bool BeginStream(int status, std::string_view content_type,
                           const HttpHeaderList& extra = {}) = 0;
  // Writes one chunk (empty data is skipped, since a zero-size chunk ends the body). False when
  // the client is gone, the write timed out, the server is shutting the socket down, or no
  // stream is open.
  virtual bool WriteChunk(std::string_view data) = 0;
  // Ends the chunked body. False when it could not be written.
  virtual bool EndStream() = 0;
  // True when the peer has closed or reset the connection, or half-closed it (a client that
  // shuts down its sending side is treated as gone), or the server shut it down. Non-blocking;
  // a peer that vanished without a FIN is only noticed when a write fails.
  virtual bool ClientGone() = 0;
  // The status written so far, 0 before Send/BeginStream.
  virtual int status() const = 0;
  // The client left before an answer began (ClientGone, a failed write): the connection is
  // closed with nothing written, and the request counts as kClientClosedRequest, not as a
  // server error. Ignored once an answer has started.
  virtual void Abandon() {}
  static constexpr int kClientClosedRequest = 499;  // nginx's code; never sent to anyone
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponder&)>;

// Builds the body of an error the server itself produces (400, 404, 405, 413, 431, 500, 503).
using HttpErrorBody = std::function<std::string(int status, std::string_view message)>;
// {"error":{"message":..., "code":<status>}}
std::string DefaultHttpErrorBody(int status, std::string_view message);

// Router: method + path -> handler. A route is an exact path, or a prefix that holds every longer
// path starting with it (HandlePrefix: "/v1/models/" for /v1/models/{id}). An exact route wins,
// then the longest prefix. Unknown path: 404; known path with another method: 405 with an Allow
// header. Both answer with `error_body` as application/json. Configure before the server starts;
// immutable (and thread-safe to call) afterwards.
class HttpRouter {
 public:
  explicit HttpRouter(HttpErrorBody error_body = DefaultHttpErrorBody)
      : error_body_(std::move(error_body)) {}
  void Handle(std::string method, std::string path, HttpHandler handler);
  // Every path that starts with `prefix` and is longer than it; the handler reads the rest from
  // request.path. `name` names the route where a path must not, as in metric labels (a client
  // picks the rest): e.g. "/v1/models/{id}".
  void HandlePrefix(std::string method, std::string prefix, std::string name, HttpHandler handler);
  // Dispatches; `matched` (if given) is set to true when a route for the path exists.
  void Dispatch(const HttpRequest& request, HttpResponder& responder, bool* matched = nullptr) const;
  void operator()(const HttpRequest& request, HttpResponder& responder) const {
    Dispatch(request, responder);
  }
  // The route that holds `path`: the path itself for an exact route, a prefix route's name, ""
  // for none. Bounded by the routes configured, so safe as a metric label.
  std::string_view RouteName(std::string_view path) const;
  // RouteName, or "other" for a path no route holds: the request counters' route label.
  std::string RouteLabel(std::string_view path) const;

 private:
  using Methods = std::map<std::string, HttpHandler>;
  struct PrefixRoute {
    std::string prefix;
    std::string name;
    Methods methods;
  };
  // The methods of the route that holds `path` (nullptr for none) and its name.
  const Methods* Find(std::string_view path, std::string_view* name) const;

  HttpErrorBody error_body_;
  std::map<std::string, Methods, std::less<>> routes_;  // exact path -> method
  std::vector<PrefixRoute> prefixes_;                   // longest prefix first
};

// Reason phrase for a status code ("OK", "Not Found", ...); "" for unknown codes.
std::string_view HttpReason(int status);

struct HttpServerOptions {
  // Numeric address or resolvable name; "unix:/path/to.sock" listens on a Unix-domain socket
  // instead (mode 0600, stale file replaced, removed by Stop; see ListenUnix). port is then unused.
  std::string host = "127.0.0.1";
  int port = 0;                        // 0 = pick a free port; see HttpServer::port()
  // Open connections (idle ones cost no thread). At the cap a new connection displaces the
  // longest-waiting connection not running a handler; when all run one: 503 and close. Lowered at
  // Start to what RLIMIT_NOFILE allows (whose soft limit is raised toward the hard one).
  int max_connections = 4096;
  int max_connections_per_client = 0;  // per peer IP, with the same displacement; 0 = no own cap
  int max_active_requests = 256;       // handlers running at once (one thread each); beyond: 503
  size_t max_body_bytes = 1 << 20;     // 413 beyond
  size_t max_header_bytes = 8 << 10;   // request line + headers; 431 beyond
  double head_timeout_seconds = 10;    // accept (or a request's first byte) to end of head: 408
  double body_timeout_seconds = 30;    // end of head to end of body: 408
  double idle_timeout_seconds = 60;    // keep-alive with no next request: close
  double read_timeout_seconds = 30;    // upper bound on each of the three above (<= 0: none)
  double write_timeout_seconds = 30;   // a client not reading: the write fails
  double drain_seconds = 10;           // Stop waits this long for handlers in progress
  int backlog = 1024;                  // a burst of connects waits here, not in SYN retries
  std::string server_name = "keel";    // Server header
  HttpErrorBody error_body = DefaultHttpErrorBody;
};

// Requests the server refused itself, before any handler saw them (each answered and closed).
struct HttpRefusalStats {
  int64_t malformed = 0;               // 400: bad request line, header or chunking; bad Transfer-Encoding
  int64_t body_too_large = 0;          // 413
  int64_t headers_too_large = 0;       // 431
  int64_t coding_not_implemented = 0;  // 501: a transfer coding other than chunked; 415: a content coding
};

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandler handler);
  ~HttpServer();  // Stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds, listens and starts the I/O thread. IOError naming host:port (or the socket path)
  // when the address cannot be resolved or bound; InvalidArgument for a bad port; Internal if already started.
  Status Start();
  // The bound port (the real one when options.port was 0); 0 before Start.
  int port() const { return port_.load(); }
  // Stops accepting and closes idle and half-sent connections; returns at once. Requests already
  // being handled continue; their connections close after the response.
  void StopAccepting();
  // StopAccepting, then waits up to `drain_seconds` (options.drain_seconds when negative) for
  // handlers in progress, shuts the rest down and joins every thread. Idempotent.
  void Stop(double drain_seconds = -1);

  // Connections open now, and requests being handled now.
  int open_connections() const;
  int active_requests() const;
  // Connection counters: shed, rejected (503 at a cap), head/body/idle timeouts, the cap in force.
  ConnectionFrontStats connection_stats() const;
  // Requests refused by the HTTP layer (never counted by a handler's metrics).
  HttpRefusalStats refusal_stats() const;

  // One counter per refusal kind; sessions add to it from the I/O thread.
  struct RefusalCounters {
    std::atomic<int64_t> malformed{0}, body_too_large{0}, headers_too_large{0}, coding_not_implemented{0};
  };

 private:
  HttpServerOptions options_;
  HttpHandler handler_;
  RefusalCounters refusals_;
  std::atomic<int> port_{0};
  std::unique_ptr<ConnectionFront> front_;
  mutable std::mutex mu_;  // guards front_ against Start racing the accessors
};

}  // namespace keel
