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

#include <algorithm>
#include <array>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/http/write.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
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

// A Beast SyncWriteStream over a connected non-blocking socket, with a poll-based timeout per
// write (requests are read by the ConnectionFront's I/O thread, not here).
class FdStream {
 public:
  FdStream(int fd, int write_timeout_ms) : fd_(fd), write_ms_(write_timeout_ms) {}

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
  int write_ms_;
};

template <class Fields>
void AddExtra(Fields& fields, const HttpHeaderList& extra) {
  for (const auto& [k, v] : extra) fields.set(k, v);
}

// The responder for one request on one connection.
class ConnResponder final : public HttpResponder {
 public:
  // head: the request was HEAD, so every answer is its header alone (RFC 9110 §9.3.2): a body
  // after it would be read as the start of the next response on the connection.
  ConnResponder(FdStream& stream, const HttpServerOptions& options, int version, bool keep_alive, bool head)
      : stream_(stream), options_(options), version_(version), keep_alive_(keep_alive), head_(head) {}

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
    if (head_) {
      http::response_serializer<http::string_body> sr{res};
      http::write_header(stream_, sr, ec);
    } else {
      http::write(stream_, res, ec);
    }
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
    if (data.empty() || head_) return true;
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
    if (version_ >= 11 && !head_) {
      error_code ec;
      net::write(stream_, net::buffer("0\r\n\r\n", 5), ec);
      if (ec) failed_ = true;
    }
    return !failed_;
  }

  void Abandon() override {
    if (status_ != 0) return;
    status_ = kClientClosedRequest;
    done_ = true;
    failed_ = true;  // closes the connection
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
  bool head_;
  int status_ = 0;
  bool streaming_ = false;
  bool done_ = false;
  bool failed_ = false;
};

// A server-generated error as bytes (always with Connection: close), for the I/O thread to write
// without blocking.
std::string ErrorBytes(const HttpServerOptions& options, int version, int status, std::string_view message) {
  http::response<http::string_body> res{static_cast<http::status>(status), version};
  res.set(http::field::server, options.server_name);
  res.set(http::field::content_type, "application/json");
  res.keep_alive(false);
  res.body() = options.error_body(status, message);
  res.prepare_payload();
  std::ostringstream out;
  out << res;
  return out.str();
}

double Cap(double seconds, double cap) {
  if (cap <= 0) return seconds;
  if (seconds <= 0) return cap;
  return std::min(seconds, cap);
}

// One connection's HTTP state. OnReadable (I/O thread) feeds Beast's parser with what arrived
// until a request is complete; Serve (a pool thread) runs the handler for it.
class HttpSession final : public FrontSession {
 public:
  HttpSession(const HttpServerOptions& options, const HttpHandler& handler, HttpServer::RefusalCounters& refusals,
              std::string remote)
      : options_(options), handler_(handler), refusals_(refusals), remote_(std::move(remote)) {}

  FrontStep OnReadable(int fd) override {
    size_t read = 0;
    for (;;) {
      FrontStep step;
      if (Parse(fd, &step)) return step;
      if (eof_) return FrontStep::Close();  // the client left between requests (or mid-request)
      if (read >= kMaxReadPerEvent) return Waiting();  // let other connections have a turn
      char buf[16384];
      const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0) {
        auto dst = buffer_.prepare(static_cast<size_t>(n));
        std::memcpy(dst.data(), buf, static_cast<size_t>(n));
        buffer_.commit(static_cast<size_t>(n));
        read += static_cast<size_t>(n);
      } else if (n == 0) {
        eof_ = true;  // parse what is buffered first: a complete request is still answered
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return Waiting();
      } else if (errno != EINTR) {
        return FrontStep::Close();
      }
    }
  }

  std::string OnTimeout(FrontStep::Kind phase) override {
    if (phase == FrontStep::kIdle || (!(parser_ && parser_->got_some()) && buffer_.size() == 0)) return {};
    return ErrorBytes(options_, Version(), 408, "request timed out");
  }

  std::string BusyReply() override {
    return ErrorBytes(options_, Version(), 503, "server busy: too many requests in progress");
  }

  bool Serve(int fd, const std::atomic<bool>& accepting) override {
    auto& msg = parser_->get();
    HttpRequest req = ToHttpRequest(msg, remote_);
    const bool keep_alive = msg.keep_alive() && accepting.load();
    parser_.reset();
    continue_sent_ = false;
    served_ = true;
    if (buffer_.size() == 0) buffer_.shrink_to_fit();  // an idle connection keeps no buffer
    FdStream stream(fd, ToMillis(options_.write_timeout_seconds));
    ConnResponder responder(stream, options_, req.version, keep_alive, req.method == "HEAD");
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
    return responder.keep_alive() && !responder.failed() && accepting.load();
  }

 private:
  static constexpr size_t kMaxReadPerEvent = 256 << 10;

  int Version() const { return parser_ && parser_->is_header_done() ? parser_->get().version() : 11; }

  FrontStep Waiting() const {
    if (parser_ && parser_->is_header_done()) return {FrontStep::kBody};
    if ((parser_ && parser_->got_some()) || buffer_.size() > 0 || !served_) return {FrontStep::kHead};
    return {FrontStep::kIdle};
  }

  // Feeds buffered bytes to the parser. True with *step set when the request is complete or bad.
  bool Parse(int fd, FrontStep* step) {
    if (buffer_.size() == 0) return false;
    if (!parser_) {
      parser_.emplace();
      parser_->header_limit(static_cast<std::uint32_t>(
          std::min<size_t>(options_.max_header_bytes, std::numeric_limits<std::uint32_t>::max())));
      parser_->body_limit(options_.max_body_bytes);
      parser_->eager(true);
    }
    // RFC 9112 §2.2: empty lines before a request line are ignored (some clients send a CRLF
    // after a POST body).
    while (!parser_->got_some() && buffer_.size() > 0) {
      const char c = *static_cast<const char*>(buffer_.data().data());
      if (c != '\r' && c != '\n') break;
      buffer_.consume(1);
    }
    while (buffer_.size() > 0 && !parser_->is_done()) {
      error_code ec;
      const size_t used = parser_->put(buffer_.data(), ec);
      buffer_.consume(used);
      if (ec == http::error::need_more) break;
      if (ec) {
        *step = ErrorStep(ec);
        return true;
      }
      if (used == 0) break;
    }
    if (parser_->is_header_done()) {
      std::string why;
      if (const int status = TransferCodingError(parser_->get().base(), parser_->chunked(), &why)) {
        (status == 501 ? refusals_.coding_not_implemented : refusals_.malformed).fetch_add(1, std::memory_order_relaxed);
        *step = FrontStep::Close(ErrorBytes(options_, Version(), status, why), true);
        return true;
      }
      if (const int status = ContentCodingError(parser_->get().base(), &why)) {
        refusals_.coding_not_implemented.fetch_add(1, std::memory_order_relaxed);
        *step = FrontStep::Close(ErrorBytes(options_, Version(), status, why), true);
        return true;
      }
      if (MissingHost(parser_->get().base(), &why)) {
        refusals_.malformed.fetch_add(1, std::memory_order_relaxed);
        *step = FrontStep::Close(ErrorBytes(options_, Version(), 400, why), true);
        return true;
      }
    }
    if (parser_->is_done()) {
      *step = {FrontStep::kDispatch};
      return true;
    }
    // Bytes the parser cannot take yet: a header block (header_limit bounds it) or a chunk-size
    // line or trailer, which Beast bounds by nothing.
    if (buffer_.size() > MaxBufferedBytes(options_.max_header_bytes)) {
      refusals_.malformed.fetch_add(1, std::memory_order_relaxed);
      *step = FrontStep::Close(
          ErrorBytes(options_, Version(), 400,
                     fmt::format("a chunk header or trailer exceeds {} bytes", MaxBufferedBytes(options_.max_header_bytes))),
          true);
      return true;
    }
    // An HTTP/1.0 client cannot read a 100 (RFC 9110 §10.1.1: ignore the expectation).
    if (parser_->is_header_done() && !continue_sent_ && parser_->get().version() >= 11 &&
        beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
      continue_sent_ = true;
      static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
      // 25 bytes into an empty send buffer: the non-blocking send does not come up short.
      (void)!::send(fd, kContinue, sizeof(kContinue) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    return false;
  }

  FrontStep ErrorStep(const error_code& ec) {
    const int version = Version();
    if (ec == http::error::body_limit) {
      refusals_.body_too_large.fetch_add(1, std::memory_order_relaxed);
      return FrontStep::Close(ErrorBytes(options_, version, 413,
                                         fmt::format("request body exceeds {} bytes", options_.max_body_bytes)),
                              true);
    }
    if (ec == http::error::header_limit) {
      refusals_.headers_too_large.fetch_add(1, std::memory_order_relaxed);
      return FrontStep::Close(ErrorBytes(options_, version, 431,
                                         fmt::format("request headers exceed {} bytes", options_.max_header_bytes)),
                              true);
    }
    refusals_.malformed.fetch_add(1, std::memory_order_relaxed);
    return FrontStep::Close(ErrorBytes(options_, version, 400, fmt::format("malformed request: {}", ec.message())),
                            true);
  }

  const HttpServerOptions& options_;
  const HttpHandler& handler_;
  HttpServer::RefusalCounters& refusals_;
  const std::string remote_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool continue_sent_ = false;
  bool served_ = false;  // a request was answered: waiting for the next one is idle, not head
  bool eof_ = false;
};

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

void HttpRouter::HandlePrefix(std::string method, std::string prefix, std::string name, HttpHandler handler) {
  auto it = std::find_if(prefixes_.begin(), prefixes_.end(), [&](const PrefixRoute& r) { return r.prefix == prefix; });
  if (it == prefixes_.end()) {
    // Kept longest first, so the first match is the longest.
    it = std::find_if(prefixes_.begin(), prefixes_.end(),
                      [&](const PrefixRoute& r) { return r.prefix.size() < prefix.size(); });
    it = prefixes_.insert(it, PrefixRoute{std::move(prefix), std::move(name), {}});
  } else {
    it->name = std::move(name);
  }
  it->methods[std::move(method)] = std::move(handler);
}

const HttpRouter::Methods* HttpRouter::Find(std::string_view path, std::string_view* name) const {
  if (auto it = routes_.find(path); it != routes_.end()) {
    *name = it->first;
    return &it->second;
  }
  for (const PrefixRoute& r : prefixes_) {
    if (path.size() > r.prefix.size() && path.substr(0, r.prefix.size()) == r.prefix) {
      *name = r.name;
      return &r.methods;
    }
  }
  return nullptr;
}

std::string_view HttpRouter::RouteName(std::string_view path) const {
  std::string_view name;
  return Find(path, &name) != nullptr ? name : std::string_view();
}

std::string HttpRouter::RouteLabel(std::string_view path) const {
  const std::string_view name = RouteName(path);
  return std::string(name.empty() ? std::string_view("other") : name);
}

void HttpRouter::Dispatch(const HttpRequest& request, HttpResponder& responder, bool* matched) const {
  std::string_view name;
  const Methods* methods = Find(request.path, &name);
  if (matched) *matched = methods != nullptr;
  if (methods == nullptr) {
    responder.Send(404, "application/json",
                   error_body_(404, fmt::format("no route for {}", request.path)), {});
    return;
  }
  auto m = methods->find(request.method);
  // HEAD is GET without the body (RFC 9110 §9.3.2; servers must support it): the responder of
  // a HEAD request sends the header alone.
  if (m == methods->end() && request.method == "HEAD") m = methods->find("GET");
  if (m == methods->end()) {
    std::string allow;
    for (const auto& [method, h] : *methods) {
      if (!allow.empty()) allow += ", ";
      allow += method;
      if (method == "GET" && methods->count("HEAD") == 0) allow += ", HEAD";
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
  if (front_) return Status::Internal("http server already started");
  const bool is_unix = options_.host.rfind("unix:", 0) == 0;
  if (!is_unix && (options_.port < 0 || options_.port > 65535)) {
    return Status::InvalidArgument(fmt::format("bad port {}", options_.port));
  }
  if (options_.max_connections < 1 || options_.max_active_requests < 1) {
    return Status::InvalidArgument("http: max_connections and max_active_requests must be >= 1");
  }
  KEEL_ASSIGN_OR_RETURN(ListeningSocket listening,
                        is_unix ? ListenUnix(options_.host.substr(5), options_.backlog)
                                : ListenTcp(options_.host, options_.port, options_.backlog));
  const int bound = listening.port;
  ConnectionFrontOptions fo;
  fo.tag = "http";
  fo.max_connections = options_.max_connections;
  fo.max_connections_per_client = options_.max_connections_per_client;
  fo.max_workers = options_.max_active_requests;
  fo.head_timeout_seconds = Cap(options_.head_timeout_seconds, options_.read_timeout_seconds);
  fo.body_timeout_seconds = Cap(options_.body_timeout_seconds, options_.read_timeout_seconds);
  fo.idle_timeout_seconds = Cap(options_.idle_timeout_seconds, options_.read_timeout_seconds);
  auto front = std::make_unique<ConnectionFront>(
      fo,
      [this](const std::string& peer) -> std::unique_ptr<FrontSession> {
        return std::make_unique<HttpSession>(options_, handler_, refusals_, peer);
      },
      ErrorBytes(options_, 11, 503, "too many connections"));
  KEEL_RETURN_IF_ERROR(front->Start(listening));
  front_ = std::move(front);
  port_ = bound;
  if (is_unix) Log().info("http: listening on {}", options_.host);
  else Log().info("http: listening on {}:{}", options_.host, bound);
  return Status::Ok();
}

void HttpServer::StopAccepting() {
  std::lock_guard<std::mutex> lock(mu_);
  if (front_) front_->StopAccepting();
}

void HttpServer::Stop(double drain_seconds) {
  ConnectionFront* front;
  {
    std::lock_guard<std::mutex> lock(mu_);
    front = front_.get();
  }
  if (front == nullptr) return;
  front->Stop(drain_seconds < 0 ? options_.drain_seconds : drain_seconds);
}

HttpRefusalStats HttpServer::refusal_stats() const {
  return {refusals_.malformed.load(std::memory_order_relaxed), refusals_.body_too_large.load(std::memory_order_relaxed),
          refusals_.headers_too_large.load(std::memory_order_relaxed),
          refusals_.coding_not_implemented.load(std::memory_order_relaxed)};
}

int HttpServer::open_connections() const {
  std::lock_guard<std::mutex> lock(mu_);
  return front_ ? front_->open_connections() : 0;
}

int HttpServer::active_requests() const {
  std::lock_guard<std::mutex> lock(mu_);
  return front_ ? front_->active() : 0;
}

ConnectionFrontStats HttpServer::connection_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return front_ ? front_->stats() : ConnectionFrontStats{};
}

}  // namespace keel
