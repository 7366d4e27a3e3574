#include "keel/core/http_beast.h"
#include "keel/core/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <strings.h>

#include <fmt/format.h>

#include "keel/core/log.h"
#include "keel/core/socket.h"

namespace keel {

namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace net = boost::asio;
using boost::system::error_code;

namespace {

int ToMillis(double seconds) {
  if (seconds <= 0) return -1;  // no timeout
  double ms = seconds * 1000.0;
  return ms > 2e9 ? 2000000000 : static_cast<int>(ms) + (ms > static_cast<int>(ms) ? 1 : 0);
}

// A Beast SyncReadStream / SyncWriteStream over a connected blocking socket, with poll-based
// timeouts (SO_RCVTIMEO does not help: Asio's sync ops re-poll forever after EAGAIN).
class FdStream {
 public:
  FdStream(int fd, int read_timeout_ms, int write_timeout_ms)
      : fd_(fd), read_ms_(read_timeout_ms), write_ms_(write_timeout_ms) {}

  template <class MutableBufferSequence>
  size_t read_some(const MutableBufferSequence& buffers, error_code& ec) {
    ec = {};
    net::mutable_buffer b;
    for (auto it = net::buffer_sequence_begin(buffers); it != net::buffer_sequence_end(buffers); ++it) {
      net::mutable_buffer cur(*it);
      if (cur.size() > 0) {
        b = cur;
        break;
      }
    }
    if (b.size() == 0) return 0;
    for (;;) {
      short rev = 0;
      int r = PollFd(fd_, POLLIN, read_ms_, &rev);
      if (r == 0) {
        ec = net::error::timed_out;
        return 0;
      }
      if (r < 0) {
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
      ssize_t n = ::recv(fd_, b.data(), b.size(), MSG_DONTWAIT);
      if (n > 0) return static_cast<size_t>(n);
      if (n == 0) {
        ec = net::error::eof;
        return 0;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      ec = error_code(errno, boost::system::system_category());
      return 0;
    }
  }
  template <class MutableBufferSequence>
  size_t read_some(const MutableBufferSequence& buffers) {
    error_code ec;
    size_t n = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  template <class ConstBufferSequence>
  size_t write_some(const ConstBufferSequence& buffers, error_code& ec) {
    ec = {};
    std::array<iovec, 16> iov;
    size_t n_iov = 0;
    for (auto it = net::buffer_sequence_begin(buffers);
         it != net::buffer_sequence_end(buffers) && n_iov < iov.size(); ++it) {
      net::const_buffer cur(*it);
      if (cur.size() == 0) continue;
      iov[n_iov].iov_base = const_cast<void*>(cur.data());
      iov[n_iov].iov_len = cur.size();
      ++n_iov;
    }
    if (n_iov == 0) return 0;
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = n_iov;
    for (;;) {
      ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) return static_cast<size_t>(n);
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
      int r = PollFd(fd_, POLLOUT, write_ms_);
      if (r == 0) {
        ec = net::error::timed_out;
        return 0;
      }
      if (r < 0) {
        ec = error_code(errno, boost::system::system_category());
        return 0;
      }
    }
  }
  template <class ConstBufferSequence>
  size_t write_some(const ConstBufferSequence& buffers) {
    error_code ec;
    size_t n = write_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  int fd() const { return fd_; }

 private:
  int fd_;
  int read_ms_;
  int write_ms_;
};

template <class Fields>
void AddExtra(Fields& fields, const HttpHeaderList& extra) {
  for (const auto& [k, v] : extra) fields.set(k, v);
}

// The responder for one request on one connection.
class ConnResponder final : public HttpResponder {
 public:
  ConnResponder(FdStream& stream, const HttpServerOptions& options, int version, bool keep_alive)
      : stream_(stream), options_(options), version_(version), keep_alive_(keep_alive) {}

  bool Send(int status, std::string_view content_type, std::string body,
            const HttpHeaderList& extra) override {
    if (status_ != 0) return false;
    status_ = status;
    http::response<http::string_body> res{static_cast<http::status>(status), version_};
    res.set(http::field::server, options_.server_name);
    if (!content_type.empty()) res.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
    AddExtra(res, extra);
    NoteConnectionHeader(res);
    res.keep_alive(keep_alive_);
    res.body() = std::move(body);
    res.prepare_payload();
    error_code ec;
    http::write(stream_, res, ec);
    if (ec) failed_ = true;
    done_ = true;
    return !failed_;
  }

  bool BeginStream(int status, std::string_view content_type, const HttpHeaderList& extra) override {
    if (status_ != 0) return false;
    status_ = status;
    streaming_ = true;
    http::response<http::empty_body> res{static_cast<http::status>(status), version_};
    res.set(http::field::server, options_.server_name);
    if (!content_type.empty()) res.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
    AddExtra(res, extra);
    NoteConnectionHeader(res);
    // HTTP/1.0 has no chunked encoding: the body then ends when the connection closes.
    if (version_ >= 11) {
      res.chunked(true);
    } else {
      keep_alive_ = false;
    }
    res.keep_alive(keep_alive_);
    http::response_serializer<http::empty_body> sr{res};
    error_code ec;
    http::write_header(stream_, sr, ec);
    if (ec) failed_ = true;
    return !failed_;
  }

  bool WriteChunk(std::string_view data) override {
    if (!streaming_ || done_ || failed_) return false;
    if (data.empty()) return true;
    error_code ec;
    if (version_ >= 11) {
      std::string size = fmt::format("{:x}\r\n", data.size());
      std::array<net::const_buffer, 3> bufs{net::buffer(size), net::buffer(data.data(), data.size()),
                                            net::buffer("\r\n", 2)};
      net::write(stream_, bufs, ec);
    } else {
      net::write(stream_, net::buffer(data.data(), data.size()), ec);
    }
    if (ec) failed_ = true;
    return !failed_;
  }

  bool EndStream() override {
    if (!streaming_ || done_) return false;
    done_ = true;
    if (failed_) return false;
    if (version_ >= 11) {
      error_code ec;
      net::write(stream_, net::buffer("0\r\n\r\n", 5), ec);
      if (ec) failed_ = true;
    }
    return !failed_;
  }

  bool ClientGone() override {
    if (failed_) return true;
    short rev = 0;
    int r = PollFd(stream_.fd(), POLLIN | POLLRDHUP, 0, &rev);
    if (r < 0) return true;
    if (r == 0) return false;
    if (rev & (POLLHUP | POLLERR | POLLNVAL | POLLRDHUP)) return true;
    if (rev & POLLIN) {
      char c;
      ssize_t n = ::recv(stream_.fd(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n == 0) return true;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
    }
    return false;
  }

  int status() const override { return status_; }

  bool started() const { return status_ != 0; }
  bool streaming() const { return streaming_; }
  bool done() const { return done_; }
  bool failed() const { return failed_; }
  bool keep_alive() const { return keep_alive_; }

 private:
  // A handler may ask to close the connection with its own "Connection: close".
  template <class Msg>
  void NoteConnectionHeader(const Msg& res) {
    auto it = res.find(http::field::connection);
    if (it != res.end() && beast::iequals(it->value(), "close")) keep_alive_ = false;
  }

  FdStream& stream_;
  const HttpServerOptions& options_;
  int version_;
  bool keep_alive_;
  int status_ = 0;
  bool streaming_ = false;
  bool done_ = false;
  bool failed_ = false;
};

// Writes a server-generated error (always with Connection: close).
void WriteError(FdStream& stream, const HttpServerOptions& options, int version, int status,
                std::string_view message) {
  ConnResponder r(stream, options, version, /*keep_alive=*/false);
  r.Send(status, "application/json", options.error_body(status, message), {});
}

}  // namespace

std::string DefaultHttpErrorBody(int status, std::string_view message) {
  nlohmann::json j = {{"error", {{"message", std::string(message)}, {"code", status}}}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string_view HttpReason(int status) {
  beast::string_view r = http::obsolete_reason(static_cast<http::status>(status));
  if (r == "<unknown-status>") return {};
  return std::string_view(r.data(), r.size());
}

std::string_view HttpHeaders::Get(std::string_view name) const {
  for (const auto& [k, v] : fields_) {
    if (k.size() == name.size() && ::strncasecmp(k.data(), name.data(), k.size()) == 0) return v;
  }
  return {};
}

bool HttpHeaders::Has(std::string_view name) const {
  for (const auto& [k, v] : fields_) {
    if (k.size() == name.size() && ::strncasecmp(k.data(), name.data(), k.size()) == 0) return true;
  }
  return false;
}

void HttpRouter::Handle(std::string method, std::string path, HttpHandler handler) {
  routes_[std::move(path)][std::move(method)] = std::move(handler);
}

bool HttpRouter::HasPath(std::string_view path) const { return routes_.find(path) != routes_.end(); }

void HttpRouter::Dispatch(const HttpRequest& request, HttpResponder& responder, bool* matched) const {
  auto it = routes_.find(request.path);
  if (matched) *matched = it != routes_.end();
  if (it == routes_.end()) {
    responder.Send(404, "application/json",
                   error_body_(404, fmt::format("no route for {}", request.path)), {});
    return;
  }
  auto m = it->second.find(request.method);
  if (m == it->second.end()) {
    std::string allow;
    for (const auto& [method, h] : it->second) {
      if (!allow.empty()) allow += ", ";
      allow += method;
    }
    responder.Send(405, "application/json",
                   error_body_(405, fmt::format("method {} not allowed for {}; use {}",
                                                request.method, request.path, allow)),
                   {{"Allow", allow}});
    return;
  }
  m->second(request, responder);
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : options_(std::move(options)), handler_(std::move(handler)) {
  if (!options_.error_body) options_.error_body = DefaultHttpErrorBody;
}

HttpServer::~HttpServer() { Stop(); }

Status HttpServer::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return Status::Internal("http server already started");
  const bool is_unix = options_.host.rfind("unix:", 0) == 0;
  if (!is_unix && (options_.port < 0 || options_.port > 65535)) {
    return Status::InvalidArgument(fmt::format("bad port {}", options_.port));
  }
  KEEL_ASSIGN_OR_RETURN(ListeningSocket listening,
                        is_unix ? ListenUnix(options_.host.substr(5), options_.backlog)
                                : ListenTcp(options_.host, options_.port, options_.backlog));
  const int fd = listening.fd;
  const int bound = listening.port;
  int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    ::close(fd);
    UnlinkUnixSocket(listening);
    return Status::IOError(fmt::format("eventfd: {}", std::strerror(errno)));
  }
  listen_fd_ = fd;
  listening_ = listening;
  wake_fd_ = wake;
  port_ = bound;
  started_ = true;
  accepting_ = true;
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  if (is_unix) Log().info("http: listening on {}", options_.host);
  else Log().info("http: listening on {}:{}", options_.host, bound);
  return Status::Ok();
}

void HttpServer::AcceptLoop() {
  for (;;) {
    int fd = -1;
    std::string remote;
    AcceptResult got = AcceptConnection(listen_fd_, wake_fd_, 1000, "http", &fd, &remote);
    if (got == AcceptResult::kStop) break;
    ReapDone();
    if (got == AcceptResult::kNone) continue;

    std::unique_lock<std::mutex> lock(mu_);
    if (!accepting_) {
      ::close(fd);
      break;
    }
    int open = 0;
    for (const Conn& c : conns_) open += c.closed ? 0 : 1;
    if (open >= options_.max_connections) {
      lock.unlock();
      RejectOverloaded(fd);
      continue;
    }
    conns_.emplace_back();
    Conn* c = &conns_.back();
    c->fd = fd;
    try {
      c->thread = std::thread([this, c, remote = std::move(remote)] { Serve(c, remote); });
    } catch (const std::exception& e) {
      Log().error("http: cannot start a connection thread: {}", e.what());
      conns_.pop_back();
      lock.unlock();
      RejectOverloaded(fd);
    }
  }
}

void HttpServer::RejectOverloaded(int fd) {
  FdStream stream(fd, 50, 1000);
  // Read whatever request bytes already arrived, so the close below does not turn into a RST.
  char buf[8192];
  if (PollFd(fd, POLLIN, 50) > 0) (void)::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  WriteError(stream, options_, 11, 503, "too many connections");
  LingeringClose(fd, 200);
  ::close(fd);
}

void HttpServer::ReapDone() {
  std::list<Conn> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      auto next = std::next(it);
      if (it->done) done.splice(done.end(), conns_, it);
      it = next;
    }
  }
  for (Conn& c : done) {
    if (c.thread.joinable()) c.thread.join();
  }
}

void HttpServer::Serve(Conn* conn, std::string remote) {
  const int fd = conn->fd;
  FdStream stream(fd, ToMillis(options_.read_timeout_seconds), ToMillis(options_.write_timeout_seconds));
  beast::flat_buffer buffer;
  bool linger = false;  // answered before reading the whole request

  for (;;) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(
        std::min<size_t>(options_.max_header_bytes, std::numeric_limits<std::uint32_t>::max())));
    parser.body_limit(options_.max_body_bytes);
    error_code ec;
    http::read_header(stream, buffer, parser, ec);
    if (!ec && !parser.is_done() &&
        beast::iequals(parser.get()[http::field::expect], "100-continue")) {
      static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
      net::write(stream, net::buffer(kContinue, sizeof(kContinue) - 1), ec);
      if (ec) break;
    }
    if (!ec && !parser.is_done()) http::read(stream, buffer, parser, ec);
    if (ec) {
      const int version = parser.is_header_done() ? parser.get().version() : 11;
      if (ec == http::error::end_of_stream || ec == net::error::eof ||
          ec == net::error::connection_reset || ec == net::error::broken_pipe) {
        break;  // the client left between requests (or mid-request)
      }
      if (ec == net::error::timed_out) {
        if (parser.got_some()) WriteError(stream, options_, version, 408, "request timed out");
        break;
      }
      if (ec == http::error::body_limit) {
        WriteError(stream, options_, version, 413,
                   fmt::format("request body exceeds {} bytes", options_.max_body_bytes));
        linger = true;
      } else if (ec == http::error::header_limit) {
        WriteError(stream, options_, version, 431,
                   fmt::format("request headers exceed {} bytes", options_.max_header_bytes));
        linger = true;
      } else if (ec.category() == http::make_error_code(http::error::bad_target).category()) {
        WriteError(stream, options_, version, 400, fmt::format("malformed request: {}", ec.message()));
        linger = true;
      }
      break;  // other I/O errors: just close
    }

    auto& msg = parser.get();
    HttpRequest req = ToHttpRequest(msg, remote);

    bool keep_alive = msg.keep_alive();
    {
      std::lock_guard<std::mutex> lock(mu_);
      conn->busy = true;
      ++busy_;
      if (!accepting_) keep_alive = false;
    }
    ConnResponder responder(stream, options_, req.version, keep_alive);
    try {
      handler_(req, responder);
    } catch (const std::exception& e) {
      Log().error("http: handler for {} {} threw: {}", req.method, req.path, e.what());
    } catch (...) {
      Log().error("http: handler for {} {} threw", req.method, req.path);
    }
    if (!responder.started()) {
      responder.Send(500, "application/json", options_.error_body(500, "handler sent no response"), {});
    } else if (responder.streaming() && !responder.done()) {
      responder.EndStream();
    }
    bool again = responder.keep_alive() && !responder.failed();
    {
      std::lock_guard<std::mutex> lock(mu_);
      conn->busy = false;
      --busy_;
      if (!accepting_) again = false;
    }
    cv_.notify_all();
    if (!again) break;
  }

  if (linger) LingeringClose(fd, 1000);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ::close(fd);
    conn->closed = true;
    conn->done = true;
  }
  cv_.notify_all();
}

void HttpServer::StopAccepting() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!accepting_) return;
  accepting_ = false;
  uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof(one));
  // Idle keep-alive connections: wake their blocked read; their threads then exit.
  for (Conn& c : conns_) {
    if (!c.closed && !c.busy) ::shutdown(c.fd, SHUT_RDWR);
  }
}

void HttpServer::Stop(double drain_seconds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_ || stopped_) return;
    stopped_ = true;
  }
  StopAccepting();
  if (accept_thread_.joinable()) accept_thread_.join();
  if (drain_seconds < 0) drain_seconds = options_.drain_seconds;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::duration<double>(drain_seconds), [this] { return busy_ == 0; });
    int forced = 0;
    for (Conn& c : conns_) {
      if (!c.closed) {
        ::shutdown(c.fd, SHUT_RDWR);
        forced += c.busy ? 1 : 0;
      }
    }
    if (forced) Log().warn("http: drain timed out; shut down {} connection(s) in progress", forced);
  }
  // No new connections can appear now; join everything.
  for (;;) {
    std::list<Conn> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (conns_.empty()) break;
      all.splice(all.end(), conns_);
    }
    for (Conn& c : all) {
      if (c.thread.joinable()) c.thread.join();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  UnlinkUnixSocket(listening_);  // before close: the open socket pins its inode (see socket.h)
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  listen_fd_ = wake_fd_ = -1;
}

int HttpServer::open_connections() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const Conn& c : conns_) n += c.closed ? 0 : 1;
  return n;
}

int HttpServer::active_requests() const {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_;
}

}  // namespace keel
