// AsyncHttpServer: Boost.Beast HTTP/1.1 over C++20 coroutines.
//
// Threading model
// - One io_context, run by `threads` threads. The accept loop is a coroutine on its own strand;
//   every accepted connection gets a fresh strand and one session coroutine on it, so all I/O,
//   timers and the handler coroutine of a connection run serialized on that strand (Beast
//   streams are not thread-safe; the strand is what makes tcp_stream timeouts safe with
//   several threads). Different connections run in parallel.
// - Per connection: one flat_buffer (reused across keep-alive requests and keeping pipelined
//   bytes), one responder; requests are handled strictly one at a time.
// - Timeouts are tcp_stream expiries: the first request must arrive within read_timeout; later
//   ones may wait idle_timeout for their first byte and then must complete within
//   read_timeout; every write (Send, each chunk) gets write_timeout. An expiry closes only that
//   connection's socket.
// - Stop() is called from a non-io thread: it closes the acceptor (posted to its strand), posts
//   "stop" to every connection's strand (idle ones are shut down at once, busy ones finish
//   their response without keep-alive), polls until no handler runs or the drain time is up,
//   shuts the remaining sockets down, then stops the io_context and joins the threads. It must
//   not be called from a handler (it joins the handler's thread).
// - Handlers may co_await anything on the io_context (timers, HttpClient::Fetch); they resume on
//   their connection's strand.
#include "keel/core/http_beast.h"
#include "keel/gateway/async_http.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <array>
#include <thread>
#include <unordered_set>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "keel/core/log.h"
#include "keel/gateway/async_http_internal.h"

namespace keel::gateway {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;
using detail::Seconds;
using detail::Strand;

namespace {

constexpr auto kAwait = asio::use_awaitable;
auto Ec(error_code& ec) { return asio::redirect_error(asio::use_awaitable, ec); }

// The part of a connection that Stop() and the accept loop reach. Touched only on `strand`,
// except `idle` (atomic) and `seq`/`displaced` (under Impl::mu).
struct ConnCtl {
  explicit ConnCtl(Strand s) : strand(std::move(s)) {}
  Strand strand;
  beast::tcp_stream* lowest = nullptr;  // set while the session runs
  bool busy = false;                    // a handler is running
  bool stopping = false;
  uint64_t seq = 0;                     // accept order
  // Waiting for the first byte of a request (a fresh or a keep-alive connection): at the
  // connection cap the oldest such one is closed to admit a new client, so idle sockets cannot
  // lock everyone else out. `displaced`: chosen for that already (guarded by Impl::mu).
  std::atomic<bool> idle{false};
  bool displaced = false;

  void Shutdown() {
    if (lowest == nullptr) return;
    error_code ec;
    lowest->socket().shutdown(tcp::socket::shutdown_both, ec);
    lowest->cancel();
  }
};

std::string RemoteOf(const tcp::socket& s) {
  error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "";
  std::string addr = ep.address().to_string();
  if (ep.address().is_v6()) addr = "[" + addr + "]";
  return addr + ":" + std::to_string(ep.port());
}

void SetStatus(http::response_header<>& h, int status) {
  h.result(static_cast<unsigned>(status));
  std::string_view reason = HttpReason(status);
  if (!reason.empty()) h.reason(beast::string_view(reason.data(), reason.size()));
}

}  // namespace

struct AsyncHttpServer::Impl {
  Impl(AsyncServerOptions o, AsyncHandler h)
      : opt(std::move(o)), handler(std::move(h)), io(std::max(1, opt.threads)) {
    if (!opt.error_body) {
      opt.error_body = [](int s, std::string_view m, std::string_view) { return DefaultHttpErrorBody(s, m); };
    }
  }

  template <class Stream>
  class Responder;

  Task<void> AcceptLoop();
  Task<void> Serve(std::shared_ptr<ConnCtl> ctl, tcp::socket sock, bool reject);
  template <class Stream>
  Task<void> RunSession(ConnCtl& ctl, Stream& stream, const std::string& remote, bool reject);
  template <class Stream>
  Task<void> CloseGracefully(Stream& stream, bool linger);
  template <class Stream>
  Task<bool> WriteError(Stream& stream, int version, int status, std::string_view message,
                        std::string_view target = {});
  template <class Stream>
  Task<void> Handle(ConnCtl& ctl, Responder<Stream>& responder, HttpRequest& req);

  // Posts f(ctl) to every live connection's strand.
  template <class F>
  void ForEachConn(F f) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& c : conns) asio::post(c->strand, [c, f] { f(*c); });
  }

  AsyncServerOptions opt;
  AsyncHandler handler;
  // Declared before `io`: session frames destroyed with the io_context still unregister here.
  std::mutex mu;
  std::unordered_set<std::shared_ptr<ConnCtl>> conns;
  uint64_t accepted = 0;  // mu
  int displacing = 0;     // mu: chosen to be closed for a new connection, not yet gone
  std::atomic<int> open{0};       // accepted and counted against max_connections
  std::atomic<int> rejecting{0};  // being answered 503
  std::atomic<int> busy{0};       // handlers running
  std::atomic<bool> stopping{false};
  std::optional<asio::ssl::context> tls;

  asio::io_context io;
  std::optional<Strand> accept_strand;
  std::optional<tcp::acceptor> acceptor;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;
  std::mutex life_mu;
  bool started = false;
  bool stopped = false;
};

// ------------------------------------------------------------------------------------------
// Responder

// One write's worth of body: `data` as a chunk ("<hex size>\r\n" data "\r\n", nothing when empty)
// and, when `last`, the last-chunk and empty trailer ("0\r\n\r\n"); unframed data when not
// chunked (HTTP/1.0). buffers() refers to this object and `data`: both must outlive the write.
class ChunkFrame {
 public:
  ChunkFrame(std::string_view data, bool chunked, bool last) {
    static constexpr char kCrlf[] = "\r\n";
    static constexpr char kLast[] = "0\r\n\r\n";
    if (!chunked) {
      if (!data.empty()) bufs_[n_++] = asio::const_buffer(data.data(), data.size());
      return;
    }
    if (!data.empty()) {
      static constexpr char kHex[] = "0123456789abcdef";
      char digits[16];
      size_t d = 0;
      for (size_t v = data.size(); v > 0; v >>= 4) digits[d++] = kHex[v & 15];
      while (d > 0) size_line_[size_len_++] = digits[--d];
      size_line_[size_len_++] = '\r';
      size_line_[size_len_++] = '\n';
      bufs_[n_++] = asio::const_buffer(size_line_, size_len_);
      bufs_[n_++] = asio::const_buffer(data.data(), data.size());
      bufs_[n_++] = asio::const_buffer(kCrlf, 2);
    }
    if (last) bufs_[n_++] = asio::const_buffer(kLast, sizeof(kLast) - 1);
  }
  ChunkFrame(const ChunkFrame&) = delete;  // bufs_ points into size_line_
  ChunkFrame& operator=(const ChunkFrame&) = delete;
  std::span<const asio::const_buffer> buffers() const { return {bufs_.data(), n_}; }

 private:
  char size_line_[20];
  size_t size_len_ = 0;
  std::array<asio::const_buffer, 4> bufs_;
  size_t n_ = 0;
};


template <class Stream>
class AsyncHttpServer::Impl::Responder final : public AsyncResponder {
 public:
  Responder(Impl& impl, Stream& stream) : impl_(impl), stream_(stream) {}

  // head: the request was HEAD, so every answer is its header alone (RFC 9110 §9.3.2), with the
  // Content-Length the body would have had: a body sent anyway would be read as the next response.
  void Reset(int version, bool keep_alive, bool head) {
    version_ = version;
    keep_alive_ = keep_alive;
    head_ = head;
    status_ = 0;
    streaming_ = chunked_ = done_ = failed_ = false;
  }
  bool started() const { return status_ != 0; }
  bool streaming() const { return streaming_; }
  bool done() const { return done_; }
  bool failed() const { return failed_; }
  bool keep_alive() const { return keep_alive_; }
  void set_keep_alive(bool v) { keep_alive_ = v; }
  int status() const override { return status_; }

  bool ClientGone() override {
    if (failed_) return true;
    auto& sock = beast::get_lowest_layer(stream_).socket();
    if (!sock.is_open()) return true;
    char c;
    const ssize_t n = ::recv(sock.native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    return n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  }

  Task<bool> Send(int status, std::string_view content_type, std::string body,
                  const HttpHeaderList& extra) override {
    if (status_ != 0) co_return false;
    status_ = status;
    http::response<http::string_body> res;
    res.version(version_);
    Fill(res, status, content_type, extra);
    res.body() = std::move(body);
    res.keep_alive(keep_alive_);
    res.prepare_payload();
    error_code ec;
    beast::get_lowest_layer(stream_).expires_after(Seconds(impl_.opt.write_timeout_seconds));
    if (head_) {
      const http::fields::writer header(res.base(), res.version(), res.result_int());
      co_await asio::async_write(stream_, header.get(), Ec(ec));
    } else {
      co_await http::async_write(stream_, res, Ec(ec));
    }
    done_ = true;
    if (ec) failed_ = true;
    co_return !ec;
  }

  Task<bool> BeginStream(int status, std::string_view content_type, const HttpHeaderList& extra,
                         std::string_view first) override {
    if (status_ != 0) co_return false;
    status_ = status;
    streaming_ = true;
    http::response<http::empty_body> res;
    res.version(version_);
    Fill(res, status, content_type, extra);
    chunked_ = version_ >= 11;
    if (chunked_) {
      res.chunked(true);
    } else {
      keep_alive_ = false;  // HTTP/1.0: the body ends when the connection closes
    }
    res.keep_alive(keep_alive_);
    // The header's bytes (start line, fields, blank line) and the first chunk in one gather write.
    const http::fields::writer header(res.base(), res.version(), res.result_int());
    ChunkFrame frame(head_ ? std::string_view() : first, chunked_ && !head_, /*last=*/false);
    error_code ec;
    beast::get_lowest_layer(stream_).expires_after(Seconds(impl_.opt.write_timeout_seconds));
    co_await asio::async_write(stream_, beast::buffers_cat(header.get(), frame.buffers()), Ec(ec));
    if (ec) failed_ = true;
    co_return !ec;
  }

  Task<bool> WriteChunk(std::string_view data) override {
    if (!streaming_ || done_ || failed_) co_return false;
    if (data.empty()) co_return true;  // a zero-size chunk would end the body
    co_return co_await WriteFrame(data, /*last=*/false);
  }

  Task<bool> EndStream(std::string_view last) override {
    if (!streaming_ || done_ || failed_) co_return false;
    done_ = true;
    if (!chunked_ && last.empty()) co_return true;
    co_return co_await WriteFrame(last, /*last=*/chunked_);
  }

 private:
  Task<bool> WriteFrame(std::string_view data, bool last) {
    if (head_) co_return true;  // the header was the whole answer
    ChunkFrame frame(data, chunked_, last);
    error_code ec;
    beast::get_lowest_layer(stream_).expires_after(Seconds(impl_.opt.write_timeout_seconds));
    co_await asio::async_write(stream_, frame.buffers(), Ec(ec));
    if (ec) failed_ = true;
    co_return !ec;
  }

  template <class Message>
  void Fill(Message& res, int status, std::string_view content_type, const HttpHeaderList& extra) {
    SetStatus(res, status);
    if (impl_.stopping.load()) keep_alive_ = false;  // Stop() began while the handler ran
    res.set(http::field::server, impl_.opt.server_name);
    if (!content_type.empty()) {
      res.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
    }
    for (const auto& [k, v] : extra) res.insert(k, v);
  }

  Impl& impl_;
  Stream& stream_;
  int version_ = 11;
  bool keep_alive_ = true;
  bool head_ = false;
  int status_ = 0;
  bool streaming_ = false;
  bool chunked_ = false;
  bool done_ = false;
  bool failed_ = false;
};

// ------------------------------------------------------------------------------------------
// Accepting and sessions

Task<void> AsyncHttpServer::Impl::AcceptLoop() {
  for (;;) {
    Strand strand = asio::make_strand(io);
    tcp::socket sock(strand);
    error_code ec;
    co_await acceptor->async_accept(sock, Ec(ec));
    if (stopping.load()) co_return;
    if (ec) {
      if (ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor) co_return;
      // Out of descriptors and the like: back off briefly instead of spinning.
      Log().warn("gateway http: accept failed: {}", ec.message());
      asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(20));
      co_await t.async_wait(Ec(ec));
      continue;
    }
    sock.set_option(tcp::no_delay(true), ec);
    auto ctl = std::make_shared<ConnCtl>(strand);
    bool reject = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      ctl->seq = ++accepted;
      if (open.load() - displacing >= opt.max_connections) {
        ConnCtl* oldest = nullptr;
        std::shared_ptr<ConnCtl> victim;
        for (const auto& c : conns) {
          if (c->idle.load() && !c->displaced && (oldest == nullptr || c->seq < oldest->seq)) {
            oldest = c.get();
            victim = c;
          }
        }
        if (victim) {
          victim->displaced = true;
          ++displacing;
          asio::post(victim->strand, [victim] {
            if (victim->idle.load()) victim->Shutdown();
          });
        } else {
          reject = true;
        }
      }
      conns.insert(ctl);
    }
    (reject ? rejecting : open).fetch_add(1);
    asio::co_spawn(strand, Serve(std::move(ctl), std::move(sock), reject), asio::detached);
  }
}

Task<void> AsyncHttpServer::Impl::Serve(std::shared_ptr<ConnCtl> ctl, tcp::socket sock, bool reject) {
  struct Unregister {  // also runs when the frame is destroyed with the io_context
    Impl* impl;
    std::shared_ptr<ConnCtl> ctl;
    bool reject;
    ~Unregister() {
      ctl->lowest = nullptr;
      {
        std::lock_guard<std::mutex> lock(impl->mu);
        impl->conns.erase(ctl);
        if (ctl->displaced) --impl->displacing;
      }
      (reject ? impl->rejecting : impl->open).fetch_sub(1);
    }
  } unregister{this, ctl, reject};
  std::string remote = RemoteOf(sock);
  try {
    if (tls) {
      beast::ssl_stream<beast::tcp_stream> stream(std::move(sock), *tls);
      co_await RunSession(*ctl, stream, remote, reject);
    } else {
      beast::tcp_stream stream(std::move(sock));
      co_await RunSession(*ctl, stream, remote, reject);
    }
  } catch (const std::exception& e) {
    Log().error("gateway http: connection from {} failed: {}", remote, e.what());
  }
}

template <class Stream>
Task<bool> AsyncHttpServer::Impl::WriteError(Stream& stream, int version, int status, std::string_view message,
                                             std::string_view target) {
  http::response<http::string_body> res;
  res.version(version);
  SetStatus(res, status);
  res.set(http::field::server, opt.server_name);
  res.set(http::field::content_type, "application/json");
  res.body() = opt.error_body(status, message, target);
  res.keep_alive(false);
  res.prepare_payload();
  error_code ec;
  beast::get_lowest_layer(stream).expires_after(Seconds(std::min(opt.write_timeout_seconds, 5.0)));
  co_await http::async_write(stream, res, Ec(ec));
  co_return !ec;
}

// What a closing connection still reads from its client: several times any body the server
// accepts, so an SDK's oversize upload finishes and it sees the 413.
constexpr size_t kMaxLingerBytes = size_t{256} << 20;

// Reads and drops what the client is still sending: an SDK uploading an oversize body reads our
// 413 only after its upload, and closing with unread bytes would reset the connection and lose
// the answer. Bounded in bytes (kMaxLingerBytes) and time (10 s). `from` is the socket, or the
// TLS stream over it (TLS has no half-close, so the bytes must be read through it).
template <class ReadStream>
Task<void> DrainUpload(ReadStream& from, beast::tcp_stream& low) {
  low.expires_after(std::chrono::seconds(10));
  char scratch[16384];
  size_t total = 0;
  error_code ec;
  while (!ec && total < kMaxLingerBytes) total += co_await from.async_read_some(asio::buffer(scratch), Ec(ec));
}

// Ends the connection without losing the last answer: half-closes the sending side (TLS: sends
// close_notify) and, with `linger`, first drains the client's upload (DrainUpload).
template <class Stream>
Task<void> AsyncHttpServer::Impl::CloseGracefully(Stream& stream, bool linger) {
  auto& low = beast::get_lowest_layer(stream);
  error_code ec;
  if constexpr (!std::is_same_v<Stream, beast::tcp_stream>) {
    if (linger) co_await DrainUpload(stream, low);  // the 413 is written; the client closes after reading it
    low.expires_after(std::chrono::milliseconds(500));
    co_await stream.async_shutdown(Ec(ec));
  } else {
    low.socket().shutdown(tcp::socket::shutdown_send, ec);
    // The write side is already shut, so a client that keeps sending is cut off at the bounds.
    if (linger) co_await DrainUpload(low, low);
  }
  low.socket().close(ec);
}

template <class Stream>
Task<void> AsyncHttpServer::Impl::RunSession(ConnCtl& ctl, Stream& stream, const std::string& remote,
                                             bool reject) {
  auto& low = beast::get_lowest_layer(stream);
  ctl.lowest = &low;
  error_code ec;
  if constexpr (!std::is_same_v<Stream, beast::tcp_stream>) {
    low.expires_after(Seconds(opt.read_timeout_seconds));
    co_await stream.async_handshake(asio::ssl::stream_base::server, Ec(ec));
    if (ec) co_return;
  }
  if (reject) {
    if (co_await WriteError(stream, 11, 503, "too many connections")) co_await CloseGracefully(stream, false);
    co_return;
  }

  // Reused for every request; keeps pipelined bytes. Bounded: Beast applies header_limit to the
  // header block and body_limit to the body, but nothing to a chunk-size line or a trailer, which
  // would otherwise be buffered for as long as the client sends them.
  beast::flat_buffer buffer(MaxBufferedBytes(opt.max_header_bytes));
  Responder<Stream> responder(*this, stream);
  bool first = true;
  bool linger = false;
  for (;;) {
    if (ctl.stopping || stopping.load()) break;
    if (buffer.size() == 0) {
      // Wait for the first byte of the next request: idle (displaceable) until it comes.
      low.expires_after(Seconds(first ? opt.read_timeout_seconds : opt.idle_timeout_seconds));
      ctl.idle.store(true);
      size_t n = co_await stream.async_read_some(buffer.prepare(4096), Ec(ec));
      ctl.idle.store(false);
      if (ec) break;
      buffer.commit(n);
    }
    first = false;
    // RFC 9112 §2.2: empty lines before a request line are ignored (some clients send a CRLF
    // after a POST body).
    {
      const auto* bytes = static_cast<const char*>(buffer.data().data());
      size_t blank = 0;
      while (blank < buffer.size() && (bytes[blank] == '\r' || bytes[blank] == '\n')) ++blank;
      buffer.consume(blank);
      if (buffer.size() == 0) continue;
    }
    low.expires_after(Seconds(opt.read_timeout_seconds));
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(std::min<size_t>(opt.max_header_bytes, UINT32_MAX)));
    parser.body_limit(opt.max_body_bytes);
    co_await http::async_read_header(stream, buffer, parser, Ec(ec));
    if (!ec) {
      std::string why;
      int status = TransferCodingError(parser.get().base(), parser.chunked(), &why);
      if (status == 0 && MissingHost(parser.get().base(), &why)) status = 400;
      if (status == 0) status = ContentCodingError(parser.get().base(), &why);
      if (status != 0) {
        const std::string target(parser.get().target());
        if (co_await WriteError(stream, parser.get().version(), status, why, target)) linger = true;
        break;
      }
    }
    // An HTTP/1.0 client cannot read a 100 (RFC 9110 §10.1.1: ignore the expectation).
    if (!ec && !parser.is_done() && parser.get().version() >= 11 &&
        beast::iequals(parser.get()[http::field::expect], "100-continue")) {
      static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
      co_await asio::async_write(stream, asio::buffer(kContinue, sizeof(kContinue) - 1), Ec(ec));
      low.expires_after(Seconds(opt.read_timeout_seconds));
    }
    if (!ec && !parser.is_done()) co_await http::async_read(stream, buffer, parser, Ec(ec));
    if (ec) {
      const int version = parser.is_header_done() ? parser.get().version() : 11;
      // Known once the request line is parsed, even when the header ended in an error (a declared
      // Content-Length over the limit fails as the header completes).
      const std::string target(parser.get().target());
      int status = 0;
      std::string message;
      if (ec == http::error::body_limit) {
        status = 413;
        message = "request body exceeds " + std::to_string(opt.max_body_bytes) + " bytes";
      } else if (ec == http::error::header_limit) {
        status = 431;
        message = "request headers exceed " + std::to_string(opt.max_header_bytes) + " bytes";
      } else if (ec == http::error::buffer_overflow) {
        status = 400;
        message = "a chunk header or trailer exceeds " + std::to_string(MaxBufferedBytes(opt.max_header_bytes)) + " bytes";
      } else if (ec.category() == http::make_error_code(http::error::bad_target).category() &&
                 ec != http::error::end_of_stream && ec != http::error::partial_message) {
        status = 400;
        message = "malformed request: " + ec.message();
      }
      // Timeouts (the stream already closed the socket), resets and EOF: just close.
      if (status != 0 && co_await WriteError(stream, version, status, message, target)) linger = true;
      break;
    }

    auto& msg = parser.get();
    HttpRequest req = ToHttpRequest(msg, remote);

    responder.Reset(req.version, msg.keep_alive() && !ctl.stopping && !stopping.load(), req.method == "HEAD");
    co_await Handle(ctl, responder, req);
    if (!responder.keep_alive() || responder.failed() || ctl.stopping || stopping.load()) break;
  }
  if (low.socket().is_open()) co_await CloseGracefully(stream, linger);
}

template <class Stream>
Task<void> AsyncHttpServer::Impl::Handle(ConnCtl& ctl, Responder<Stream>& responder, HttpRequest& req) {
  ctl.busy = true;
  busy.fetch_add(1);
  bool threw = false;
  try {
    co_await handler(req, responder);
  } catch (const std::exception& e) {
    threw = true;
    Log().error("gateway http: handler for {} {} threw: {}", req.method, req.path, e.what());
  } catch (...) {
    threw = true;
    Log().error("gateway http: handler for {} {} threw", req.method, req.path);
  }
  if (!responder.started()) {
    co_await responder.Send(500, "application/json",
                            opt.error_body(500, threw ? "handler failed" : "handler sent no response", req.target),
                            {});
  } else if (responder.streaming() && !responder.done()) {
    if (threw) {
      responder.set_keep_alive(false);  // the body may be incomplete; end it by closing
    } else {
      co_await responder.EndStream({});
    }
  }
  ctl.busy = false;
  busy.fetch_sub(1);
}

// ------------------------------------------------------------------------------------------
// AsyncHttpServer

AsyncHttpServer::AsyncHttpServer(AsyncServerOptions options, AsyncHandler handler)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(handler))) {}

AsyncHttpServer::~AsyncHttpServer() {
  Stop();
  if (impl_) {
    impl_->acceptor.reset();
  }
}

boost::asio::io_context& AsyncHttpServer::io_context() { return impl_->io; }

int AsyncHttpServer::open_connections() const { return impl_->open.load(); }

int AsyncHttpServer::idle_connections() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  int idle = 0;
  for (const auto& c : impl_->conns) idle += c->idle.load() && !c->displaced ? 1 : 0;
  return idle;
}

Status AsyncHttpServer::Start() {
  Impl& im = *impl_;
  std::lock_guard<std::mutex> life(im.life_mu);
  if (im.started) return Status::Internal("gateway http server already started");
  const auto& o = im.opt;
  if (o.port < 0 || o.port > 65535) return Status::InvalidArgument("bad port " + std::to_string(o.port));
  const std::string where = o.host + ":" + std::to_string(o.port);
  if (!o.tls_cert_file.empty() || !o.tls_key_file.empty()) {
    if (o.tls_cert_file.empty() || o.tls_key_file.empty()) {
      return Status::InvalidArgument("TLS needs both tls_cert_file and tls_key_file");
    }
    im.tls.emplace(asio::ssl::context::tls_server);
    im.tls->set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                        asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 |
                        asio::ssl::context::no_tlsv1_1);
    error_code ec;
    im.tls->use_certificate_chain_file(o.tls_cert_file, ec);
    if (ec) return Status::InvalidArgument("TLS certificate " + o.tls_cert_file + ": " + ec.message());
    im.tls->use_private_key_file(o.tls_key_file, asio::ssl::context::pem, ec);
    if (ec) return Status::InvalidArgument("TLS key " + o.tls_key_file + ": " + ec.message());
  }

  error_code ec;
  tcp::endpoint ep;
  auto addr = asio::ip::make_address(o.host, ec);
  if (!ec) {
    ep = tcp::endpoint(addr, static_cast<unsigned short>(o.port));
  } else {
    tcp::resolver resolver(im.io);
    auto results = resolver.resolve(o.host, std::to_string(o.port), ec);
    if (ec || results.empty()) return Status::IOError("resolve " + where + ": " + ec.message());
    ep = results.begin()->endpoint();
  }
  im.accept_strand.emplace(asio::make_strand(im.io));
  im.acceptor.emplace(*im.accept_strand);
  im.acceptor->open(ep.protocol(), ec);
  if (!ec) im.acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) im.acceptor->bind(ep, ec);
  if (!ec) im.acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    im.acceptor.reset();
    return Status::IOError("listen on " + where + ": " + ec.message());
  }
  port_.store(im.acceptor->local_endpoint().port());
  im.started = true;
  im.work.emplace(im.io.get_executor());
  asio::co_spawn(*im.accept_strand, im.AcceptLoop(), asio::detached);
  for (int i = 0; i < std::max(1, o.threads); ++i) {
    im.threads.emplace_back([&im] { im.io.run(); });
  }
  return Status::Ok();
}

void AsyncHttpServer::Stop(double drain_seconds) {
  if (!impl_) return;
  Impl& im = *impl_;
  {
    std::lock_guard<std::mutex> life(im.life_mu);
    if (!im.started || im.stopped) return;
    im.stopped = true;
  }
  using Clock = std::chrono::steady_clock;
  auto wait_until = [](Clock::time_point deadline, auto done) {
    while (!done() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  im.stopping.store(true);
  asio::post(*im.accept_strand, [&im] {
    error_code ec;
    im.acceptor->close(ec);
  });
  // Idle connections go now; busy ones finish their response without keep-alive.
  im.ForEachConn([](ConnCtl& c) {
    c.stopping = true;
    if (!c.busy) c.Shutdown();
  });
  wait_until(Clock::now() + Seconds(drain_seconds), [&] { return im.busy.load() == 0; });
  im.ForEachConn([](ConnCtl& c) { c.Shutdown(); });
  // Sessions notice the shutdown at once; a handler that waits on something else (a timer) is
  // abandoned when the io_context stops.
  wait_until(Clock::now() + std::chrono::seconds(1),
             [&] { return im.open.load() == 0 && im.rejecting.load() == 0; });
  im.work.reset();
  im.io.stop();
  for (auto& t : im.threads) t.join();
  im.threads.clear();
}

}  // namespace keel::gateway
