// Async HTTP/1.1 for the gateway's data path: a Boost.Beast server and an upstream client, both
// on C++20 coroutines (boost::asio::awaitable) over one io_context run by N threads.
//
// Server: keep-alive, pipelining-safe (one request at a time per connection), bounded header
// (431) and body (413) sizes, read/idle/write timeouts (a slow client is dropped, others keep
// being served), connection limit (503), optional TLS (OpenSSL) when cert and key are given.
// Malformed requests get 400 and the connection closes. Handlers are coroutines; they answer
// once (Send) or stream (BeginStream, WriteChunk..., EndStream) with chunked encoding.
//
// Client: per-origin pools of keep-alive connections (http:// and https://, or unix:/path for a
// local socket), connect/response timeouts, bounded response sizes; a response can be read
// whole or as a stream of body bytes as they arrive (chunked or Content-Length).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/io_context.hpp>

#include "keel/core/http_server.h"  // HttpRequest, HttpHeaders, HttpHeaderList, HttpReason
#include "keel/core/status.h"

namespace keel::gateway {

template <typename T>
using Task = boost::asio::awaitable<T>;

// ------------------------------------------------------------------------------------------
// Server

struct AsyncServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                       // 0 = pick a free one; see AsyncHttpServer::port()
  int threads = 2;                    // io_context threads
  int max_connections = 4096;
  size_t max_body_bytes = 4 << 20;    // 413 beyond
  size_t max_header_bytes = 16 << 10; // 431 beyond
  double read_timeout_seconds = 30;   // a request must arrive completely within this
  double idle_timeout_seconds = 60;   // keep-alive idle limit
  double write_timeout_seconds = 30;  // a client that stops reading is dropped
  std::string tls_cert_file;          // PEM; TLS on when both are set
  std::string tls_key_file;
  std::string server_name = "keel-gateway";
  // Body for errors the server itself produces (400/413/431/503, 500 for a silent handler).
  // `target` is the request target when its header was read, else empty: a server with several
  // wire formats answers in the one its path speaks.
  std::function<std::string(int status, std::string_view message, std::string_view target)> error_body;
};

// How a handler answers. Valid only during the handler coroutine.
class AsyncResponder {
 public:
  virtual ~AsyncResponder() = default;
  virtual Task<bool> Send(int status, std::string_view content_type, std::string body,
                          const HttpHeaderList& extra = {}) = 0;
  // Sends the status and headers, and `first` (when not empty) as the first chunk in the same
  // write: a proxy that starts its answer when the first bytes are ready saves one write per
  // stream. False when the client is gone or the write timed out.
  virtual Task<bool> BeginStream(int status, std::string_view content_type, const HttpHeaderList& extra = {},
                                 std::string_view first = {}) = 0;
  // One chunk; false when the client is gone or the write timed out.
  virtual Task<bool> WriteChunk(std::string_view data) = 0;
  // Ends the body, sending `last` (when not empty) as its final chunk in the same write.
  virtual Task<bool> EndStream(std::string_view last = {}) = 0;
  virtual int status() const = 0;
  // Whether the client has closed or reset its connection while its answer is being prepared
  // (a non-blocking peek: end of stream or a socket error; bytes it sent meanwhile, a pipelined
  // request or a TLS record, are not a departure). A proxy waiting on an upstream polls it to
  // abandon work nobody will read.
  virtual bool ClientGone() { return false; }
};

using AsyncHandler = std::function<Task<void>(const HttpRequest&, AsyncResponder&)>;

class AsyncHttpServer {
 public:
  AsyncHttpServer(AsyncServerOptions options, AsyncHandler handler);
  ~AsyncHttpServer();  // Stop()
  AsyncHttpServer(const AsyncHttpServer&) = delete;
  AsyncHttpServer& operator=(const AsyncHttpServer&) = delete;

  // Binds, listens, starts the threads. IOError naming host:port on failure; InvalidArgument
  // for unreadable TLS files.
  Status Start();
  int port() const { return port_.load(); }
  // Stops accepting, lets requests in progress finish for up to `drain_seconds`, closes the
  // rest and joins the threads. Idempotent.
  void Stop(double drain_seconds = 10);
  boost::asio::io_context& io_context();
  int open_connections() const;
  // Connections waiting for the first byte of their next request: the ones a newcomer at the
  // connection cap may displace (a client can see its response before its connection is idle).
  int idle_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::atomic<int> port_{0};
};

// ------------------------------------------------------------------------------------------
// Client

struct ClientOptions {
  double connect_timeout_seconds = 5;
  double response_timeout_seconds = 60;   // until the response headers arrive
  double read_timeout_seconds = 60;       // between body bytes of a streamed response
  size_t max_response_bytes = 64 << 20;   // whole-body reads beyond this fail
  size_t max_idle_per_origin = 256;       // pooled keep-alive connections per origin
  bool verify_tls = true;                 // https: verify the peer (system CA store)
};

struct ClientRequest {
  std::string method = "POST";
  std::string url;  // http://host:port/path?q, https://..., or unix:/path/to/sock:/http/path
  HttpHeaderList headers;
  std::string body;
};

struct ClientResponse {
  int status = 0;
  HttpHeaders headers;
  std::string body;
};

// An open response whose body is read as it arrives. Returns its connection to the pool
// when the body was read to the end; otherwise the connection is closed on destruction.
class ResponseStream {
 public:
  virtual ~ResponseStream() = default;
  virtual int status() const = 0;
  virtual const HttpHeaders& headers() const = 0;
  // Appends the next body bytes to `out`: OK with >0 bytes appended, OK with 0 bytes at the end
  // of the body, or an error (timeout: Unavailable "read timeout"; connection closed before the
  // end of a chunked / Content-Length body: Corruption "truncated body").
  virtual Task<Status> Read(std::string* out) = 0;
  // Whether a Read would make progress without waiting for the peer: > 0 when body bytes (or,
  // under TLS, record bytes) have arrived that the parser has not stalled on. A proxy uses it
  // to forward bursts in one write instead of one write per upstream segment; it must read 0
  // between a paced upstream's chunks, or nothing is forwarded until the stream ends.
  virtual size_t BytesReady() const { return 0; }
};

class HttpClient {
 public:
  HttpClient(boost::asio::io_context& io, ClientOptions options = {});
  ~HttpClient();
  // Whole response. Errors: InvalidArgument (bad URL), Unavailable (connect refused/timeout,
  // response timeout, connection reset; the message says which), Corruption (malformed response,
  // truncated body), ResourceExhausted (body over max_response_bytes).
  Task<Result<ClientResponse>> Fetch(ClientRequest request);
  // Fetch for a caller that may lose interest: `wanted` is asked every `poll` while the
  // response is awaited, and once it answers false the upstream connection is closed (the
  // upstream sees the request abandoned; the connection is not reused) and the result is
  // Cancelled. `wanted` runs on the caller's strand.
  Task<Result<ClientResponse>> FetchWhile(ClientRequest request, std::function<bool()> wanted,
                                          std::chrono::milliseconds poll = std::chrono::milliseconds(200));
  // Sends the request and returns once the response headers have arrived.
  Task<Result<std::unique_ptr<ResponseStream>>> Open(ClientRequest request);

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace keel::gateway
