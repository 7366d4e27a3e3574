// HttpClient: upstream HTTP/1.1 client on coroutines, with per-origin keep-alive pools.
//
// A connection is used by one request at a time and is driven only from a strand: when the
// caller's coroutine already runs on a strand (a server handler does) the work runs inline,
// otherwise it is co_spawned onto a fresh strand of the client's io_context and awaited. The
// idle pools are shared by all threads and guarded by a mutex; a connection leaves the pool
// for the duration of one request and returns only after its response body was read to the end
// with keep-alive.
#include <limits>
#include <sys/socket.h>

#include <cerrno>
#include <functional>
#include <memory>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "keel/gateway/async_http.h"
#include "keel/gateway/async_http_internal.h"

namespace keel::gateway {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;
using detail::Seconds;

namespace {

auto Ec(error_code& ec) { return asio::redirect_error(asio::use_awaitable, ec); }

using Parser = http::response_parser<http::buffer_body>;
using Request = http::request<http::string_body>;

// ------------------------------------------------------------------------------------------
// URLs

struct Url {
  enum Scheme { kHttp, kHttps, kUnix } scheme = kHttp;
  std::string host;         // without brackets
  std::string port;         // decimal
  std::string socket_path;  // unix
  std::string target;       // "/path?q"
  std::string origin;       // pool key and name in messages
  std::string host_header;
};

bool AllDigits(std::string_view s) {
  if (s.empty() || s.size() > 5) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

Result<Url> ParseUrl(std::string_view url) {
  auto bad = [&](std::string_view why) {
    return Status::InvalidArgument("bad URL '" + std::string(url) + "': " + std::string(why));
  };
  Url u;
  std::string_view rest;
  if (url.starts_with("unix:")) {
    u.scheme = Url::kUnix;
    rest = url.substr(5);
    if (!rest.starts_with("/")) return bad("unix socket path must be absolute");
    size_t sep = rest.find(":/");
    u.socket_path = std::string(rest.substr(0, sep));
    u.target = sep == std::string_view::npos ? "/" : std::string(rest.substr(sep + 1));
    u.origin = "unix:" + u.socket_path;
    u.host_header = "localhost";
    return u;
  }
  if (url.starts_with("http://")) {
    rest = url.substr(7);
  } else if (url.starts_with("https://")) {
    u.scheme = Url::kHttps;
    rest = url.substr(8);
  } else {
    return bad("scheme must be http://, https:// or unix:");
  }
  size_t end = rest.find_first_of("/?#");
  std::string_view authority = rest.substr(0, end);
  std::string_view target = end == std::string_view::npos ? std::string_view() : rest.substr(end);
  if (size_t hash = target.find('#'); hash != std::string_view::npos) target = target.substr(0, hash);
  if (authority.find('@') != std::string_view::npos) return bad("user info is not supported");
  std::string_view host = authority, port;
  if (authority.starts_with("[")) {
    size_t close = authority.find(']');
    if (close == std::string_view::npos) return bad("unterminated IPv6 address");
    host = authority.substr(1, close - 1);
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return bad("junk after IPv6 address");
      port = after.substr(1);
    }
  } else if (size_t colon = authority.rfind(':'); colon != std::string_view::npos) {
    host = authority.substr(0, colon);
    port = authority.substr(colon + 1);
  }
  if (host.empty()) return bad("missing host");
  const char* default_port = u.scheme == Url::kHttps ? "443" : "80";
  if (port.empty()) port = default_port;
  if (!AllDigits(port) || std::stoi(std::string(port)) == 0 || std::stoi(std::string(port)) > 65535) {
    return bad("bad port");
  }
  u.host = std::string(host);
  u.port = std::string(port);
  u.target = target.empty() ? "/" : (target[0] == '?' ? "/" + std::string(target) : std::string(target));
  std::string bracketed = authority.starts_with("[") ? "[" + u.host + "]" : u.host;
  u.host_header = port == default_port ? bracketed : bracketed + ":" + u.port;
  u.origin = (u.scheme == Url::kHttps ? "https://" : "http://") + bracketed + ":" + u.port;
  return u;
}

// ------------------------------------------------------------------------------------------
// Connections

using TcpStream = beast::tcp_stream;
using TlsStream = beast::ssl_stream<beast::tcp_stream>;
using UnixStream = beast::basic_stream<asio::local::stream_protocol>;

class Conn;

// How FetchWhile reaches the connection its request is on, to close it when the caller loses
// interest. Touched only on the request's strand; a connection detaches before it is pooled or
// destroyed, so `conn` never outlives what it points to.
struct Abandon {
  Conn* conn = nullptr;
  bool requested = false;
};

class Conn {
 public:
  virtual ~Conn() { Unwatch(); }
  // Closes the socket: pending reads and writes end with operation_aborted.
  virtual void Close() = 0;
  void Watch(Abandon* a) {
    Unwatch();
    watcher_ = a;
    a->conn = this;
  }
  void Unwatch() {
    if (watcher_ && watcher_->conn == this) watcher_->conn = nullptr;
    watcher_ = nullptr;
  }
  virtual void Expire(std::chrono::steady_clock::duration d) = 0;
  virtual void NoExpire() = 0;
  virtual Task<error_code> Write(Request& req) = 0;
  virtual Task<error_code> ReadHeader(Parser& p) = 0;
  virtual Task<error_code> ReadSome(Parser& p) = 0;
  // True when an idle connection cannot be reused: the peer closed it, or sent something
  // unasked (a late byte, a TLS alert).
  virtual bool Stale() = 0;
  // Response bytes in the socket, not yet read (under TLS possibly a partial record).
  virtual size_t InSocket() = 0;

  // Beast reads at most max(512, free capacity) per recv: without room reserved, a streamed
  // answer arrives 512 bytes per system call (and per Relay pass).
  Conn() { buffer.reserve(16384); }
  beast::flat_buffer buffer;  // bytes read past the parser's needs (none after a full response)

 private:
  Abandon* watcher_ = nullptr;
};

// A FetchWhile's request, shared by the fetch it spawns and the loop that polls its caller.
struct FetchWhileState {
  explicit FetchWhileState(const asio::any_io_executor& ex) : wake(ex) {}
  asio::steady_timer wake;  // the poll's clock; cancelled when the fetch ends
  Abandon abandon;
  std::optional<Result<ClientResponse>> result;
  bool done = false;
};

template <class Stream>
class ConnOf final : public Conn {
 public:
  template <class... Args>
  explicit ConnOf(Args&&... args) : stream(std::forward<Args>(args)...) {}
  void Expire(std::chrono::steady_clock::duration d) override { beast::get_lowest_layer(stream).expires_after(d); }
  void NoExpire() override { beast::get_lowest_layer(stream).expires_never(); }
  void Close() override { beast::get_lowest_layer(stream).close(); }
  Task<error_code> Write(Request& req) override {
    error_code ec;
    co_await http::async_write(stream, req, Ec(ec));
    co_return ec;
  }
  Task<error_code> ReadHeader(Parser& p) override {
    error_code ec;
    co_await http::async_read_header(stream, buffer, p, Ec(ec));
    co_return ec;
  }
  Task<error_code> ReadSome(Parser& p) override {
    error_code ec;
    co_await http::async_read_some(stream, buffer, p, Ec(ec));
    co_return ec;
  }
  bool Stale() override {
    auto& sock = beast::get_lowest_layer(stream).socket();
    if (!sock.is_open()) return true;
    char c;
    ssize_t n = ::recv(sock.native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }
  size_t InSocket() override {
    error_code ec;
    const size_t n = beast::get_lowest_layer(stream).socket().available(ec);
    return ec ? 0 : n;
  }

  Stream stream;
};

bool IsClosedError(const error_code& ec) {
  return ec == http::error::end_of_stream || ec == asio::error::eof || ec == asio::error::connection_reset ||
         ec == asio::error::broken_pipe || ec == http::error::partial_message ||
         ec == asio::ssl::error::stream_truncated;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Impl

struct HttpClient::Impl : std::enable_shared_from_this<HttpClient::Impl> {
  Impl(asio::io_context& io_, ClientOptions o) : io(io_), opt(std::move(o)) {}

  class Stream;

  Task<Result<std::unique_ptr<Conn>>> Connect(const Url& u);
  Task<void> OpenInto(ClientRequest request, bool whole, std::optional<Result<std::unique_ptr<Stream>>>* out,
                      Abandon* abandon = nullptr);
  Task<void> FetchInto(ClientRequest request, std::optional<Result<ClientResponse>>* out,
                       Abandon* abandon = nullptr);
  static Task<void> RunAbandonable(std::shared_ptr<Impl> impl, std::shared_ptr<FetchWhileState> st,
                                   ClientRequest request);
  Task<void> FetchWhileInto(ClientRequest request, std::function<bool()> wanted, std::chrono::milliseconds poll,
                            std::optional<Result<ClientResponse>>* out);
  asio::ssl::context& TlsContext();

  std::unique_ptr<Conn> TakeIdle(const std::string& origin) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = idle.find(origin);
    while (it != idle.end() && !it->second.empty()) {
      std::unique_ptr<Conn> c = std::move(it->second.back());
      it->second.pop_back();
      if (!c->Stale()) return c;
    }
    return nullptr;
  }
  void Release(const std::string& origin, std::unique_ptr<Conn> c) {
    c->Unwatch();
    c->NoExpire();
    std::lock_guard<std::mutex> lock(mu);
    auto& list = idle[origin];
    if (list.size() < opt.max_idle_per_origin) list.push_back(std::move(c));
  }

  asio::io_context& io;
  ClientOptions opt;
  std::mutex mu;
  std::map<std::string, std::vector<std::unique_ptr<Conn>>, std::less<>> idle;
  std::once_flag tls_once;
  std::optional<asio::ssl::context> tls;
};

asio::ssl::context& HttpClient::Impl::TlsContext() {
  std::call_once(tls_once, [this] {
    tls.emplace(asio::ssl::context::tls_client);
    tls->set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                     asio::ssl::context::no_sslv3);
    if (opt.verify_tls) {
      error_code ec;
      tls->set_default_verify_paths(ec);
      tls->set_verify_mode(asio::ssl::verify_peer);
    } else {
      tls->set_verify_mode(asio::ssl::verify_none);
    }
  });
  return *tls;
}

// An open response. Reads run on a strand (see the file comment); `strand` is where they are
// spawned when the caller is not on one.
class HttpClient::Impl::Stream final : public ResponseStream {
 public:
  Stream(std::shared_ptr<Impl> client, std::string origin) : client_(std::move(client)), origin_(std::move(origin)) {}

  int status() const override { return status_; }
  const HttpHeaders& headers() const override { return headers_; }
  Task<Status> Read(std::string* out) override;
  // Bytes a Read can make progress on without waiting: buffered ones beyond what the parser
  // already stalled on (a chunk's trailing CRLF waits for the next chunk's header: counting
  // those two bytes made every paced stream look busy, so nothing was sent until it ended),
  // else those in the socket.
  size_t BytesReady() const override {
    if (done_ || !error_.ok() || !conn_) return 0;
    const size_t buffered = conn_->buffer.size();
    if (buffered > stalled_) return buffered - stalled_;
    return conn_->InSocket();
  }
  // Read without the strand check (the caller is on a strand).
  Task<Status> ReadHere(std::string* out);
  void ParseBuffered(std::string* out);
  size_t stalled_ = 0;  // buffered bytes the parser could not use yet (need more to follow)
  Task<void> ReadInto(std::string* out, Status* st) { *st = co_await ReadHere(out); }

  std::shared_ptr<Impl> client_;
  std::string origin_;
  std::unique_ptr<Conn> conn_;
  std::optional<Parser> parser_;
  int status_ = 0;
  HttpHeaders headers_;
  bool done_ = false;
  Status error_;  // sticky after a failed read

 private:
  void Finish() {
    done_ = true;
    if (conn_ && parser_->keep_alive() && conn_->buffer.size() == 0) {
      client_->Release(origin_, std::move(conn_));
    }
    conn_.reset();
  }
};

Task<Status> HttpClient::Impl::Stream::Read(std::string* out) {
  auto ex = co_await asio::this_coro::executor;
  if (detail::IsStrand(ex)) co_return co_await ReadHere(out);
  Status st;
  co_await asio::co_spawn(asio::make_strand(client_->io), ReadInto(out, &st), asio::use_awaitable);
  co_return st;
}

Task<Status> HttpClient::Impl::Stream::ReadHere(std::string* out) {
  if (done_) co_return Status::Ok();
  if (!error_.ok()) co_return error_;
  Parser& p = *parser_;
  if (p.is_done()) {
    Finish();
    co_return Status::Ok();
  }
  conn_->Expire(Seconds(client_->opt.read_timeout_seconds));
  const size_t old = out->size();
  for (;;) {
    size_t want = std::max<size_t>(16384, conn_->buffer.size());
    if (auto remaining = p.content_length_remaining()) want = std::clamp<size_t>(*remaining, 1, 1 << 20);
    out->resize(old + want);
    p.get().body().data = out->data() + old;
    p.get().body().size = want;
    error_code ec = co_await conn_->ReadSome(p);
    const size_t got = want - p.get().body().size;
    out->resize(old + got);
    if (ec == http::error::need_buffer) ec = {};
    if (ec) {
      if (ec == beast::error::timeout) {
        error_ = Status::Unavailable("read timeout from " + origin_);
      } else if (IsClosedError(ec)) {
        error_ = Status::Corruption("truncated body from " + origin_ + " (" + ec.message() + ")");
      } else if (ec == http::error::body_limit) {
        error_ = Status::ResourceExhausted("response body from " + origin_ + " exceeds " +
                                           std::to_string(client_->opt.max_response_bytes) + " bytes");
      } else {
        error_ = Status::Corruption("malformed response body from " + origin_ + ": " + ec.message());
      }
      conn_.reset();
      co_return error_;
    }
    ParseBuffered(out);
    if (p.is_done()) {
      Finish();
      co_return Status::Ok();  // possibly with the last bytes; the next Read returns 0 bytes
    }
    if (out->size() > old) co_return Status::Ok();
  }
}

// A read returns after one piece of progress (one chunk); a burst of small chunks (one per SSE
// event from most vendors) would then cost one trip through the io_context per chunk. This takes
// whatever else is already buffered, stopping where the buffered bytes end (a partial chunk
// header: the parser's need_more) -- it never waits (the parser's eager mode would: its read waits
// for the next chunk header). A parse error is left for the next read to report.
void HttpClient::Impl::Stream::ParseBuffered(std::string* out) {
  Parser& p = *parser_;
  beast::flat_buffer& buffer = conn_->buffer;
  if (p.is_done() || buffer.size() == 0) {
    stalled_ = buffer.size();
    return;
  }
  // The body bytes in the buffer are fewer than the buffered bytes: room for all at once.
  size_t end = out->size();
  out->resize(end + buffer.size());
  while (!p.is_done() && buffer.size() > 0) {
    p.get().body().data = out->data() + end;
    p.get().body().size = out->size() - end;
    error_code ec;
    const size_t used = p.put(buffer.data(), ec);
    buffer.consume(used);
    end = out->size() - p.get().body().size;
    if (ec == http::error::need_buffer) ec = {};
    if (ec || used == 0) break;
  }
  out->resize(end);
  stalled_ = buffer.size();
}

Task<Result<std::unique_ptr<Conn>>> HttpClient::Impl::Connect(const Url& u) {
  error_code ec;
  const auto timeout = Seconds(opt.connect_timeout_seconds);
  auto connect_error = [&](const error_code& e) {
    if (e == beast::error::timeout) {
      return Status::Unavailable("connect to " + u.origin + " timed out after " +
                                 std::to_string(opt.connect_timeout_seconds) + "s");
    }
    if (e == asio::error::connection_refused) return Status::Unavailable("connect to " + u.origin + " refused");
    return Status::Unavailable("connect to " + u.origin + " failed: " + e.message());
  };
  if (u.scheme == Url::kUnix) {
    auto c = std::make_unique<ConnOf<UnixStream>>(io.get_executor());
    c->stream.expires_after(timeout);
    co_await c->stream.async_connect(asio::local::stream_protocol::endpoint(u.socket_path), Ec(ec));
    if (ec) co_return connect_error(ec);
    c->stream.expires_never();
    co_return std::unique_ptr<Conn>(std::move(c));
  }

  std::vector<tcp::endpoint> endpoints;
  auto addr = asio::ip::make_address(u.host, ec);
  if (!ec) {
    endpoints.emplace_back(addr, static_cast<unsigned short>(std::stoi(u.port)));
  } else {
    tcp::resolver resolver(io);
    auto results = co_await resolver.async_resolve(u.host, u.port, Ec(ec));
    if (ec) co_return Status::Unavailable("resolve " + u.host + " failed: " + ec.message());
    for (const auto& r : results) endpoints.push_back(r.endpoint());
  }

  auto connect = [&](beast::tcp_stream& low) -> Task<error_code> {
    error_code e;
    low.expires_after(timeout);
    co_await low.async_connect(endpoints, Ec(e));
    if (!e) low.socket().set_option(tcp::no_delay(true), e);
    co_return e;
  };
  if (u.scheme == Url::kHttp) {
    auto c = std::make_unique<ConnOf<TcpStream>>(io.get_executor());
    ec = co_await connect(c->stream);
    if (ec) co_return connect_error(ec);
    c->stream.expires_never();
    co_return std::unique_ptr<Conn>(std::move(c));
  }

  auto c = std::make_unique<ConnOf<TlsStream>>(io.get_executor(), TlsContext());
  ec = co_await connect(beast::get_lowest_layer(c->stream));
  if (ec) co_return connect_error(ec);
  SSL* ssl = c->stream.native_handle();
  if (asio::ip::make_address(u.host, ec), ec) {
    SSL_set_tlsext_host_name(ssl, u.host.c_str());  // SNI only for names
    if (opt.verify_tls) SSL_set1_host(ssl, u.host.c_str());
  } else if (opt.verify_tls) {
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), u.host.c_str());
  }
  beast::get_lowest_layer(c->stream).expires_after(timeout);
  co_await c->stream.async_handshake(asio::ssl::stream_base::client, Ec(ec));
  if (ec) {
    if (ec == beast::error::timeout) co_return connect_error(ec);
    co_return Status::Unavailable("TLS handshake with " + u.origin + " failed: " + ec.message());
  }
  beast::get_lowest_layer(c->stream).expires_never();
  co_return std::unique_ptr<Conn>(std::move(c));
}

Task<void> HttpClient::Impl::OpenInto(ClientRequest request, bool whole,
                                      std::optional<Result<std::unique_ptr<Stream>>>* out, Abandon* abandon) {
  auto url = ParseUrl(request.url);
  if (!url.ok()) {
    out->emplace(url.status());
    co_return;
  }
  const Url& u = *url;
  Request req;
  req.version(11);
  http::verb verb = http::string_to_verb(request.method);
  if (verb == http::verb::unknown) {
    req.method_string(request.method);
  } else {
    req.method(verb);
  }
  req.target(u.target);
  req.set(http::field::host, u.host_header);
  for (const auto& [k, v] : request.headers) req.insert(k, v);
  const bool has_body = !request.body.empty() || verb == http::verb::post || verb == http::verb::put ||
                        verb == http::verb::patch;
  req.body() = std::move(request.body);
  if (has_body) req.prepare_payload();

  auto stream = std::make_unique<Stream>(shared_from_this(), u.origin);
  std::unique_ptr<Conn> conn;
  for (int attempt = 0;; ++attempt) {
    conn = attempt == 0 ? TakeIdle(u.origin) : nullptr;
    const bool reused = conn != nullptr;
    if (!conn) {
      auto c = co_await Connect(u);
      if (!c.ok()) {
        out->emplace(c.status());
        co_return;
      }
      conn = std::move(c).value();
    }
    if (abandon) {
      if (abandon->requested) {
        out->emplace(Status::Cancelled("request to " + u.origin + " abandoned by its caller"));
        co_return;
      }
      conn->Watch(abandon);
    }
    // A pooled connection the server closed meanwhile fails here or before any response byte:
    // retry once on a fresh one (the request cannot have been processed without an answer
    // starting... as far as HTTP/1.1 lets a client tell).
    const bool may_retry = reused && attempt == 0;
    conn->Expire(Seconds(opt.response_timeout_seconds));
    error_code ec = co_await conn->Write(req);
    if (ec) {
      if (may_retry && ec != beast::error::timeout) continue;
      out->emplace(ec == beast::error::timeout
                       ? Status::Unavailable("response timeout from " + u.origin + " (sending the request)")
                       : Status::Unavailable("sending to " + u.origin + " failed: " + ec.message()));
      co_return;
    }
    stream->parser_.emplace();
    Parser& p = *stream->parser_;
    p.header_limit(64 << 10);
    // A streamed body has no size limit: the reader bounds what it keeps. Not body_limit(none):
    // Boost 1.74 compares a Content-Length with the empty optional as "larger" and fails every
    // streamed response that has one (an upstream's error body, typically) with body_limit.
    p.body_limit(whole ? std::uint64_t{opt.max_response_bytes} : std::numeric_limits<std::uint64_t>::max());
    if (verb == http::verb::head) p.skip(true);
    ec = co_await conn->ReadHeader(p);
    if (ec) {
      if (may_retry && !p.got_some() && IsClosedError(ec)) continue;
      if (ec == beast::error::timeout) {
        out->emplace(Status::Unavailable("response timeout from " + u.origin + " after " +
                                         std::to_string(opt.response_timeout_seconds) + "s"));
      } else if (IsClosedError(ec)) {
        out->emplace(Status::Unavailable("connection reset by " + u.origin + " before the response (" +
                                         ec.message() + ")"));
      } else if (ec == http::error::body_limit) {
        out->emplace(Status::ResourceExhausted("response body from " + u.origin + " exceeds " +
                                               std::to_string(opt.max_response_bytes) + " bytes"));
      } else if (ec == http::error::header_limit) {
        out->emplace(Status::ResourceExhausted("response headers from " + u.origin + " exceed 64 KiB"));
      } else {
        out->emplace(Status::Corruption("malformed response from " + u.origin + ": " + ec.message()));
      }
      co_return;
    }
    break;
  }
  auto& msg = stream->parser_->get();
  stream->status_ = static_cast<int>(msg.result_int());
  for (const auto& f : msg) stream->headers_.Add(std::string(f.name_string()), std::string(f.value()));
  stream->conn_ = std::move(conn);
  out->emplace(std::move(stream));
}

Task<void> HttpClient::Impl::FetchInto(ClientRequest request, std::optional<Result<ClientResponse>>* out,
                                       Abandon* abandon) {
  std::optional<Result<std::unique_ptr<Stream>>> opened;
  co_await OpenInto(std::move(request), /*whole=*/true, &opened, abandon);
  if (!opened->ok()) {
    out->emplace(opened->status());
    co_return;
  }
  Stream& s = *opened->value();
  if (auto cl = s.parser_->content_length()) {
    if (*cl > opt.max_response_bytes) {
      out->emplace(Status::ResourceExhausted("response body from " + s.origin_ + " is " + std::to_string(*cl) +
                                             " bytes, over the limit of " +
                                             std::to_string(opt.max_response_bytes)));
      co_return;
    }
  }
  ClientResponse r;
  r.status = s.status_;
  if (auto cl = s.parser_->content_length()) r.body.reserve(*cl);
  while (!s.done_) {
    Status st = co_await s.ReadHere(&r.body);
    if (!st.ok()) {
      out->emplace(std::move(st));
      co_return;
    }
  }
  r.headers = std::move(s.headers_);
  out->emplace(std::move(r));
}

// Runs on the caller's strand beside FetchWhileInto's poll loop (so Abandon is never touched
// from two threads).
Task<void> HttpClient::Impl::RunAbandonable(std::shared_ptr<Impl> impl, std::shared_ptr<FetchWhileState> st,
                                            ClientRequest request) {
  try {
    co_await impl->FetchInto(std::move(request), &st->result, &st->abandon);
  } catch (const std::exception& e) {
    st->result.emplace(Status::Internal(std::string("upstream request failed: ") + e.what()));
  }
  st->done = true;
  st->wake.cancel();
}

Task<void> HttpClient::Impl::FetchWhileInto(ClientRequest request, std::function<bool()> wanted,
                                            std::chrono::milliseconds poll,
                                            std::optional<Result<ClientResponse>>* out) {
  auto ex = co_await asio::this_coro::executor;
  auto st = std::make_shared<FetchWhileState>(ex);
  asio::co_spawn(ex, RunAbandonable(shared_from_this(), st, std::move(request)), asio::detached);
  bool gave_up = false;
  while (!st->done) {
    st->wake.expires_after(poll);
    error_code ec;
    co_await st->wake.async_wait(Ec(ec));
    if (st->done || gave_up || wanted()) continue;
    gave_up = true;
    st->abandon.requested = true;
    if (st->abandon.conn) st->abandon.conn->Close();
  }
  if (gave_up) {
    out->emplace(Status::Cancelled("the caller abandoned the request"));
  } else {
    out->emplace(std::move(*st->result));
  }
}

// ------------------------------------------------------------------------------------------
// HttpClient

HttpClient::HttpClient(boost::asio::io_context& io, ClientOptions options)
    : impl_(std::make_shared<Impl>(io, std::move(options))) {}

HttpClient::~HttpClient() = default;

Task<Result<ClientResponse>> HttpClient::Fetch(ClientRequest request) {
  std::shared_ptr<Impl> impl = impl_;
  std::optional<Result<ClientResponse>> out;
  auto ex = co_await asio::this_coro::executor;
  if (detail::IsStrand(ex)) {
    co_await impl->FetchInto(std::move(request), &out);
  } else {
    co_await asio::co_spawn(asio::make_strand(impl->io), impl->FetchInto(std::move(request), &out),
                            asio::use_awaitable);
  }
  co_return std::move(*out);
}

Task<Result<ClientResponse>> HttpClient::FetchWhile(ClientRequest request, std::function<bool()> wanted,
                                                    std::chrono::milliseconds poll) {
  std::shared_ptr<Impl> impl = impl_;
  std::optional<Result<ClientResponse>> out;
  auto ex = co_await asio::this_coro::executor;
  if (detail::IsStrand(ex)) {
    co_await impl->FetchWhileInto(std::move(request), std::move(wanted), poll, &out);
  } else {
    co_await asio::co_spawn(asio::make_strand(impl->io),
                            impl->FetchWhileInto(std::move(request), std::move(wanted), poll, &out),
                            asio::use_awaitable);
  }
  co_return std::move(*out);
}

Task<Result<std::unique_ptr<ResponseStream>>> HttpClient::Open(ClientRequest request) {
  std::shared_ptr<Impl> impl = impl_;
  std::optional<Result<std::unique_ptr<Impl::Stream>>> out;
  auto ex = co_await asio::this_coro::executor;
  if (detail::IsStrand(ex)) {
    co_await impl->OpenInto(std::move(request), /*whole=*/false, &out);
  } else {
    co_await asio::co_spawn(asio::make_strand(impl->io), impl->OpenInto(std::move(request), false, &out),
                            asio::use_awaitable);
  }
  if (!out->ok()) co_return out->status();
  co_return std::unique_ptr<ResponseStream>(std::move(*out).value());
}

}  // namespace keel::gateway
