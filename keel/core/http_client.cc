#include "keel/core/http_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/buffer.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>

#include <fmt/format.h>

#include "keel/core/log.h"

namespace keel {

namespace http = boost::beast::http;

Result<HttpEndpoint> ParseHttpUrl(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return Status::InvalidArgument(fmt::format("url '{}' must start with http://", url));
  }
  std::string_view rest = url.substr(kScheme.size());
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  const size_t colon = rest.rfind(':');
  if (rest.find_first_of("/@?#") != std::string_view::npos || colon == std::string_view::npos || colon == 0) {
    return Status::InvalidArgument(fmt::format("url '{}' must be http://host:port", url));
  }
  std::string_view host = rest.substr(0, colon), port = rest.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int p = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (ec != std::errc() || end != port.data() + port.size() || p < 1 || p > 65535) {
    return Status::InvalidArgument(fmt::format("url '{}' has no valid port (1..65535)", url));
  }
  return HttpEndpoint{std::string(host), p};
}

HttpClient::HttpClient(HttpEndpoint endpoint, HttpClientOptions options)
    : endpoint_(std::move(endpoint)), options_(options) {}

HttpClient::~HttpClient() {
  for (int fd : idle_) ::close(fd);
}

std::string HttpClient::Address() const { return fmt::format("{}:{}", endpoint_.host, endpoint_.port); }

int HttpClient::TakeIdle() {
  std::lock_guard lock(mu_);
  while (!idle_.empty()) {
    const int fd = idle_.back();
    idle_.pop_back();
    // An idle connection has nothing to read: readable means the peer closed it (or sent
    // garbage); either way it cannot carry a request.
    if (PollFd(fd, POLLIN, 0) == 0) return fd;
    ::close(fd);
  }
  return -1;
}

void HttpClient::GiveBack(int fd) {
  std::lock_guard lock(mu_);
  if (static_cast<int>(idle_.size()) >= options_.max_idle_connections) {
    ::close(fd);
    return;
  }
  idle_.push_back(fd);
}

namespace {

// Appends what the peer sent next to `pending`, waiting until `deadline`. False at end of stream.
Result<bool> ReadMore(int fd, Deadline deadline, std::string* pending) {
  char chunk[64 << 10];
  for (;;) {
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n == 0) return false;
    if (n > 0) {
      pending->append(chunk, static_cast<size_t>(n));
      return true;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Status::Unavailable(fmt::format("recv: {}", std::strerror(errno)));
    const int r = PollFd(fd, POLLIN, MillisLeft(deadline));
    if (r == 0) return Status::Unavailable("deadline passed waiting for the response");
    if (r < 0) return Status::Unavailable(fmt::format("poll: {}", std::strerror(errno)));
  }
}

// The end of the stream reached `parser`: Beast asserts that put_eof follows some input, so a peer
// that died before answering (no byte of a response) must not reach it.
template <typename Parser>
Status PutEof(Parser& parser, const std::string& pending, bool* nothing_read) {
  if (!parser.got_some()) {
    if (pending.empty()) return Status::Unavailable("connection closed before a response");
    *nothing_read = false;
    return Status::Unavailable("connection closed inside the response head");
  }
  boost::beast::error_code ec;
  parser.put_eof(ec);
  if (ec || !parser.is_done()) return Status::Unavailable("connection closed before the end of the response");
  return Status::Ok();
}

// Writes the request and marks the connection as neither reusable nor read from yet.
Status WriteRequest(int fd, std::string_view head, std::string_view body, Deadline deadline, bool* reusable,
                    bool* nothing_read) {
  *reusable = false;
  *nothing_read = true;
  iovec iov[2] = {{const_cast<char*>(head.data()), head.size()}, {const_cast<char*>(body.data()), body.size()}};
  return WriteFullV(fd, iov, 2, deadline);
}

template <typename Parser>
void LimitParser(Parser& parser, const HttpClientOptions& options) {
  parser.header_limit(static_cast<std::uint32_t>(options.max_header_bytes));
  parser.body_limit(options.max_response_bytes);
  // Not eager: Boost 1.74 Beast's eager put() loses the body_limit error raised at the end of the
  // header (it parses on into the body), so an oversized Content-Length would be read whole.
}

}  // namespace

Result<HttpReply> HttpClient::CallOn(int fd, std::string_view head, std::string_view body, Deadline deadline,
                                     bool* reusable, bool* nothing_read) {
  KEEL_RETURN_IF_ERROR(WriteRequest(fd, head, body, deadline, reusable, nothing_read));
  http::response_parser<http::string_body> parser;
  LimitParser(parser, options_);
  std::string pending;  // received, not yet consumed by the parser
  boost::beast::error_code ec;
  while (!parser.is_done()) {
    KEEL_ASSIGN_OR_RETURN(const bool more, ReadMore(fd, deadline, &pending));
    if (!more) {
      KEEL_RETURN_IF_ERROR(PutEof(parser, pending, nothing_read));
      break;
    }
    *nothing_read = false;
    while (!pending.empty() && !parser.is_done()) {
      const size_t used = parser.put(boost::asio::buffer(pending), ec);
      pending.erase(0, used);
      if (ec == http::error::need_more) {
        ec = {};
        break;
      }
      if (ec) return Status::Unavailable("bad response: " + ec.message());
      if (used == 0) break;
    }
  }
  auto& msg = parser.get();
  HttpReply reply;
  reply.status = static_cast<int>(msg.result_int());
  for (const auto& f : msg) reply.headers.Add(std::string(f.name_string()), std::string(f.value()));
  reply.body = std::move(msg.body());
  *reusable = msg.keep_alive() && pending.empty();
  return reply;
}

Result<int> HttpClient::StreamOn(int fd, std::string_view head, std::string_view body, Deadline deadline,
                                 const HttpStreamSink& sink, bool* reusable, bool* nothing_read) {
  KEEL_RETURN_IF_ERROR(WriteRequest(fd, head, body, deadline, reusable, nothing_read));
  // buffer_body: the parser writes body bytes into `out` and says how much room is left, so each
  // piece goes to the sink as soon as it is parsed.
  http::response_parser<http::buffer_body> parser;
  LimitParser(parser, options_);
  std::string pending;
  char out[16 << 10];
  bool head_given = false;
  auto give_head = [&]() -> Status {
    if (head_given || !parser.is_header_done()) return Status::Ok();
    head_given = true;
    HttpHeaders headers;
    for (const auto& f : parser.get()) headers.Add(std::string(f.name_string()), std::string(f.value()));
    if (sink.on_head && !sink.on_head(static_cast<int>(parser.get().result_int()), headers)) {
      return Status::Cancelled("stopped by the caller");
    }
    return Status::Ok();
  };
  boost::beast::error_code ec;
  while (!parser.is_done()) {
    KEEL_ASSIGN_OR_RETURN(const bool more, ReadMore(fd, deadline, &pending));
    if (!more) {
      parser.get().body().data = out;
      parser.get().body().size = sizeof(out);
      KEEL_RETURN_IF_ERROR(PutEof(parser, pending, nothing_read));
      break;
    }
    *nothing_read = false;
    while (!pending.empty() && !parser.is_done()) {
      parser.get().body().data = out;
      parser.get().body().size = sizeof(out);
      const size_t used = parser.put(boost::asio::buffer(pending), ec);
      pending.erase(0, used);
      KEEL_RETURN_IF_ERROR(give_head());
      const size_t produced = sizeof(out) - parser.get().body().size;
      if (produced > 0 && sink.on_body && !sink.on_body(std::string_view(out, produced))) {
        return Status::Cancelled("stopped by the caller");
      }
      if (ec == http::error::need_buffer) {  // `out` is full: hand it over, then parse on
        ec = {};
        continue;
      }
      if (ec == http::error::need_more) {
        ec = {};
        break;
      }
      if (ec) return Status::Unavailable("bad response: " + ec.message());
      if (used == 0 && produced == 0) break;
    }
  }
  KEEL_RETURN_IF_ERROR(give_head());  // a response with no body is done at its head
  *reusable = parser.get().keep_alive() && pending.empty();
  return static_cast<int>(parser.get().result_int());
}

Result<std::string> HttpClient::RequestHead(std::string_view method, std::string_view target, std::string_view body,
                                            std::string_view content_type, const HttpHeaderList& extra) const {
  std::string head = fmt::format("{} {} HTTP/1.1\r\nHost: {}\r\n", method, target, Address());
  if (!body.empty() || method == "POST") {
    head += fmt::format("Content-Type: {}\r\nContent-Length: {}\r\n", content_type, body.size());
  }
  for (const auto& [name, value] : extra) {
    if (name.empty() || name.find_first_of("\r\n:") != std::string::npos || value.find_first_of("\r\n") != std::string::npos) {
      return Status::InvalidArgument("http client: header name or value holds CR, LF or ':' in the name");
    }
    head += fmt::format("{}: {}\r\n", name, value);
  }
  head += "\r\n";
  return head;
}

template <typename T, typename Exchange>
Result<T> HttpClient::WithConnection(Deadline deadline, Exchange&& exchange) {
  for (int attempt = 0;; ++attempt) {
    int fd = attempt == 0 ? TakeIdle() : -1;
    const bool pooled = fd >= 0;
    if (fd < 0) {
      const int ms = MillisLeft(deadline);
      if (ms == 0) return Status::Unavailable(fmt::format("{}: deadline passed before connecting", Address()));
      KEEL_ASSIGN_OR_RETURN(fd, ConnectTcp(endpoint_.host, endpoint_.port, ms));
    }
    bool reusable = false, nothing_read = true;
    Result<T> reply = exchange(fd, &reusable, &nothing_read);
    if (reply.ok() && reusable) {
      GiveBack(fd);
    } else {
      ::close(fd);
    }
    if (reply.ok()) return reply;
    if (reply.status().code() == StatusCode::kCancelled) return reply.status();
    // A pooled connection that failed before a byte came back was most likely closed by the
    // peer while idle: one more try on a fresh connection.
    if (!(pooled && nothing_read && MillisLeft(deadline) != 0)) {
      return Status::Unavailable(fmt::format("{}: {}", Address(), reply.status().message()));
    }
  }
}

Result<HttpReply> HttpClient::Call(std::string_view method, std::string_view target, std::string_view body,
                                   std::string_view content_type, Deadline deadline, const HttpHeaderList& extra) {
  KEEL_ASSIGN_OR_RETURN(const std::string head, RequestHead(method, target, body, content_type, extra));
  return WithConnection<HttpReply>(deadline, [&](int fd, bool* reusable, bool* nothing_read) {
    return CallOn(fd, head, body, deadline, reusable, nothing_read);
  });
}

Result<int> HttpClient::CallStreaming(std::string_view method, std::string_view target, std::string_view body,
                                      std::string_view content_type, Deadline deadline, const HttpStreamSink& sink,
                                      const HttpHeaderList& extra) {
  KEEL_ASSIGN_OR_RETURN(const std::string head, RequestHead(method, target, body, content_type, extra));
  return WithConnection<int>(deadline, [&](int fd, bool* reusable, bool* nothing_read) {
    return StreamOn(fd, head, body, deadline, sink, reusable, nothing_read);
  });
}

CallPool::CallPool(int threads) {
  threads_.reserve(static_cast<size_t>(std::max(threads, 1)));
  for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Work(); });
}

CallPool::~CallPool() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CallPool::Submit(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void CallPool::Work() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    try {
      task();
    } catch (const std::exception& e) {
      Log().error("call pool: task threw: {}", e.what());
    }
  }
}

void CallPool::RunAll(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  std::mutex mu;
  std::condition_variable done;
  int left = n - 1;
  for (int i = 1; i < n; ++i) {
    Submit([&, i] {
      try {
        fn(i);
      } catch (const std::exception& e) {
        Log().error("call pool: task threw: {}", e.what());
      }
      std::lock_guard lock(mu);
      if (--left == 0) done.notify_one();  // under the lock: the waiter cannot leave before
    });
  }
  fn(0);
  std::unique_lock lock(mu);
  done.wait(lock, [&] { return left == 0; });
}

}  // namespace keel
