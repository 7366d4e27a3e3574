// Tests for the gateway's async HTTP layer: the server is driven by a raw-socket client that
// shares no code with it; the client is tested against the server and against tiny raw servers
// (threads with blocking sockets) that misbehave on purpose.
#include "keel/gateway/async_http.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "tests/core/http_test_client.h"

namespace keel::gateway {
namespace {

namespace asio = boost::asio;
using test::HttpTestClient;
using test::HttpTestResponse;
using Clock = std::chrono::steady_clock;

Task<void> SleepMs(int ms) {
  asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(ms));
  co_await t.async_wait(asio::use_awaitable);
}

// Runs `task` on `ex` and waits for its value (bounded, so a hang fails the test).
template <class T, class Executor>
T RunSync(Executor ex, Task<T> task) {
  std::promise<T> promise;
  auto future = promise.get_future();
  asio::co_spawn(
      ex,
      [](Task<T> t, std::promise<T>* p) -> Task<void> { p->set_value(co_await std::move(t)); }(std::move(task),
                                                                                               &promise),
      asio::detached);
  if (future.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "task did not finish within 30 s";
    std::abort();
  }
  return future.get();
}

// An io_context with threads, for clients.
class IoThreads {
 public:
  explicit IoThreads(int n = 2) : work_(io_.get_executor()) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { io_.run(); });
  }
  ~IoThreads() {
    work_.reset();
    io_.stop();
    for (auto& t : threads_) t.join();
  }
  asio::io_context& io() { return io_; }

 private:
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::vector<std::thread> threads_;
};

// A listening socket on 127.0.0.1 for hand-written servers.
int ListenLoopback(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0) {
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

// Reads from `fd` until "\r\n\r\n" (plus Content-Length body bytes); returns the head, "" on EOF.
std::string ReadRequestHead(int fd) {
  std::string got;
  char buf[4096];
  while (got.find("\r\n\r\n") == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return "";
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

void SendAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

// ------------------------------------------------------------------------------------------
// Server fixture: a few routes, with counters the tests assert on.

class AsyncServerTest : public ::testing::Test {
 protected:
  void Start(AsyncServerOptions options = {}) {
    server_ = std::make_unique<AsyncHttpServer>(std::move(options),
                                                [this](const HttpRequest& r, AsyncResponder& w) { return Route(r, w); });
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_GT(server_->port(), 0);
  }
  void TearDown() override {
    if (server_) server_->Stop(1);
  }

  // Waits (bounded, 30 s) until exactly n connections wait for their next request.
  bool WaitIdleConnections(int n) {
    for (int i = 0; i < 3000 && server_->idle_connections() != n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return server_->idle_connections() == n;
  }

  Task<void> Route(const HttpRequest& req, AsyncResponder& w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      remotes_.insert(req.remote);
    }
    ++requests_;
    if (req.path == "/hello") {
      static const HttpHeaderList kExtra = {{"X-Test", "1"}};  // not inline: GCC 12 coroutine bug
      co_await w.Send(200, "text/plain", "hello " + req.query, kExtra);
    } else if (req.path == "/echo") {
      std::string ct(req.headers.Get("content-type"));
      co_await w.Send(200, "text/plain", req.method + " " + req.path + " " + ct + " " + req.body);
    } else if (req.path == "/slow") {
      co_await SleepMs(std::atoi(req.query.c_str()));
      co_await w.Send(200, "text/plain", "slow done");
    } else if (req.path == "/stream") {
      co_await w.BeginStream(200, "text/event-stream");
      co_await w.WriteChunk("a");
      co_await w.WriteChunk("bb");
      co_await w.WriteChunk("");  // skipped, must not end the body
      co_await w.WriteChunk("ccc");
      co_await w.EndStream();
    } else if (req.path == "/merged") {
      // Headers with the first chunk, and the last chunk with the end of the body.
      static const HttpHeaderList kNone;  // not inline: GCC 12 coroutine bug
      co_await w.BeginStream(200, "text/event-stream", kNone, "first");
      co_await w.WriteChunk("mid");
      co_await w.EndStream("last");
    } else if (req.path == "/merged-empty") {
      static const HttpHeaderList kNone;
      co_await w.BeginStream(200, "text/plain", kNone, "");
      co_await w.EndStream("only");
    } else if (req.path == "/gated") {
      // One chunk, then waits for the test to release the rest.
      co_await w.BeginStream(200, "text/plain");
      co_await w.WriteChunk("first");
      for (int i = 0; i < 2000 && !release_.load(); ++i) co_await SleepMs(5);
      second_written_ = true;
      co_await w.WriteChunk("second");
      co_await w.EndStream();
    } else if (req.path == "/flood") {
      // Streams until the client stops reading and a write times out.
      co_await w.BeginStream(200, "application/octet-stream");
      std::string block(64 << 10, 'x');
      bool ok = true;
      for (int i = 0; i < 4096 && ok; ++i) ok = co_await w.WriteChunk(block);
      flood_write_failed_ = !ok;
      flood_done_ = true;
    } else if (req.path == "/until-gone") {
      // A whole answer that takes long (up to 10 s) unless its client leaves first.
      for (int i = 0; i < 2000 && !w.ClientGone(); ++i) co_await SleepMs(5);
      if (w.ClientGone()) {
        saw_gone_ = true;
        co_return;
      }
      co_await w.Send(200, "text/plain", "nobody left");
    } else if (req.path == "/silent") {
      co_return;  // no answer: the server sends 500
    } else if (req.path == "/throw") {
      throw std::runtime_error("boom");
    } else {
      co_await w.Send(404, "text/plain", "no route");
    }
  }

  std::unique_ptr<AsyncHttpServer> server_;
  std::mutex mu_;
  std::set<std::string> remotes_;  // one per server-side connection
  std::atomic<int> requests_{0};
  std::atomic<bool> release_{false};
  std::atomic<bool> second_written_{false};
  std::atomic<bool> flood_write_failed_{false};
  std::atomic<bool> flood_done_{false};
  std::atomic<bool> saw_gone_{false};

  size_t connections_seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return remotes_.size();
  }
};

TEST_F(AsyncServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  Start();
  HttpTestClient c(server_->port(), 10);
  for (int i = 0; i < 3; ++i) {
    HttpTestResponse r = c.Request("GET", "/hello?n=" + std::to_string(i));
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(r.body, "hello n=" + std::to_string(i));
    EXPECT_EQ(r.Header("X-Test"), "1");
    EXPECT_EQ(r.Header("Server"), "keel-gateway");
  }
  HttpTestResponse r = c.Request("POST", "/echo", "payload");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "POST /echo application/json payload");
  EXPECT_EQ(connections_seen(), 1u);
  EXPECT_EQ(server_->open_connections(), 1);
  EXPECT_EQ(requests_.load(), 4);
}

TEST_F(AsyncServerTest, PipelinedRequestsAreAnsweredInOrder) {
  Start();
  HttpTestClient c(server_->port(), 10);
  // The first request is slow; the second one, already buffered, must not overtake it.
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("GET", "/slow?100") + HttpTestClient::BuildRequest("GET", "/hello?x") +
                        HttpTestClient::BuildRequest("GET", "/stream")));
  HttpTestResponse r1, r2, r3;
  ASSERT_TRUE(c.ReadResponse(&r1));
  ASSERT_TRUE(c.ReadResponse(&r2));
  ASSERT_TRUE(c.ReadResponse(&r3));
  EXPECT_EQ(r1.body, "slow done");
  EXPECT_EQ(r2.body, "hello x");
  EXPECT_EQ(r3.body, "abbccc");
  EXPECT_EQ(connections_seen(), 1u);
}

// An SDK uploads its whole body before it reads the answer: a 413 for a declared oversize body
// must survive that upload (the server discards it, bounded) instead of a connection reset.
TEST_F(AsyncServerTest, OversizeUploadStillReadsThe413) {
  AsyncServerOptions o;
  o.max_body_bytes = 1000;
  Start(o);
  HttpTestClient c(server_->port(), 30);
  const size_t body_bytes = size_t{24} << 20;  // far beyond any socket buffers on loopback
  ASSERT_TRUE(c.SendRaw("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                        std::to_string(body_bytes) + "\r\n\r\n"));
  const std::string piece(64 << 10, 'b');
  for (size_t sent = 0; sent < body_bytes; sent += piece.size()) {
    ASSERT_TRUE(c.SendRaw(piece)) << "upload cut off after " << sent << " bytes";
  }
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 413);
  EXPECT_NE(r.body.find("1000 bytes"), std::string::npos) << r.body;
  EXPECT_TRUE(c.WaitClosed());
}

TEST_F(AsyncServerTest, LimitsAndMalformedRequests) {
  AsyncServerOptions o;
  o.max_body_bytes = 100;
  o.max_header_bytes = 1024;
  Start(o);
  {
    HttpTestClient c(server_->port(), 10);
    HttpTestResponse r = c.Request("POST", "/echo", std::string(101, 'b'));
    EXPECT_EQ(r.status, 413);
    EXPECT_NE(r.body.find("100 bytes"), std::string::npos) << r.body;
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    HttpTestClient c(server_->port(), 10);
    ASSERT_TRUE(c.SendRaw("GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(2000, 'h') + "\r\n\r\n"));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.status, 431);
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    HttpTestClient c(server_->port(), 10);
    ASSERT_TRUE(c.SendRaw("GET /hello HTTP/1.1\r\nHost x\r\n\r\n"));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(r.Header("Connection"), "close");
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    HttpTestClient c(server_->port(), 10);  // a body exactly at the limit is fine
    EXPECT_EQ(c.Request("POST", "/echo", std::string(100, 'b')).status, 200);
  }
}

TEST_F(AsyncServerTest, MissingAnswerAndThrowingHandlerGive500) {
  Start();
  HttpTestClient c(server_->port(), 10);
  EXPECT_EQ(c.Request("GET", "/silent").status, 500);
  EXPECT_EQ(c.Request("GET", "/throw").status, 500);
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);  // the connection survived both
  EXPECT_EQ(connections_seen(), 1u);
}

TEST_F(AsyncServerTest, Http10ClosesUnlessKeepAliveAndStreamsByClose) {
  Start();
  {
    HttpTestClient c(server_->port(), 10);
    ASSERT_TRUE(c.SendRaw("GET /hello?a HTTP/1.0\r\n\r\n"));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.body, "hello a");
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    HttpTestClient c(server_->port(), 10);
    ASSERT_TRUE(c.SendRaw("GET /hello?b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.body, "hello b");
    ASSERT_TRUE(c.SendRaw("GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
    ASSERT_TRUE(c.ReadResponse(&r));  // no chunking for 1.0: the body ends with the connection
    EXPECT_FALSE(r.chunked);
    EXPECT_EQ(r.body, "abbccc");
  }
}

TEST_F(AsyncServerTest, FirstAndLastChunksShareTheHeaderAndEndWrites) {
  Start();
  HttpTestClient c(server_->port(), 10);
  HttpTestResponse r = c.Request("GET", "/merged");
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(r.chunked);
  EXPECT_EQ(r.Header("Content-Type"), "text/event-stream");
  EXPECT_EQ(r.chunks, (std::vector<std::string>{"first", "mid", "last"}));
  r = c.Request("GET", "/merged-empty");  // same connection: the body ended where it should
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.chunks, (std::vector<std::string>{"only"}));
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
  // HTTP/1.0: no chunk framing, the body ends with the connection.
  HttpTestClient old(server_->port(), 10);
  ASSERT_TRUE(old.SendRaw("GET /merged HTTP/1.0\r\n\r\n"));
  HttpTestResponse r10;
  ASSERT_TRUE(old.ReadResponse(&r10));
  EXPECT_FALSE(r10.chunked);
  EXPECT_EQ(r10.body, "firstmidlast");
}

TEST_F(AsyncServerTest, ChunkedStreamReadByRawClient) {
  Start();
  HttpTestClient c(server_->port(), 10);
  HttpTestResponse r = c.Request("GET", "/stream");
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(r.chunked);
  EXPECT_EQ(r.Header("Content-Type"), "text/event-stream");
  EXPECT_EQ(r.chunks, (std::vector<std::string>{"a", "bb", "ccc"}));
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);  // keep-alive after a stream
}

TEST_F(AsyncServerTest, SlowClientIsDroppedWhileOthersAreServed) {
  AsyncServerOptions o;
  o.read_timeout_seconds = 0.3;
  Start(o);
  HttpTestClient slow(server_->port(), 5);
  ASSERT_TRUE(slow.SendRaw("GET /hello HTTP/1.1\r\nHost: x\r\n"));  // never finished
  HttpTestClient fast(server_->port(), 5);
  EXPECT_EQ(fast.Request("GET", "/hello").status, 200);
  auto t0 = Clock::now();
  EXPECT_TRUE(slow.WaitClosed());
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  EXPECT_EQ(fast.Request("GET", "/hello").status, 200);
  EXPECT_EQ(requests_.load(), 2);  // the slow request never reached the handler
}

TEST_F(AsyncServerTest, IdleKeepAliveConnectionIsClosed) {
  AsyncServerOptions o;
  o.idle_timeout_seconds = 0.2;
  Start(o);
  HttpTestClient c(server_->port(), 5);
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
  auto t0 = Clock::now();
  EXPECT_TRUE(c.WaitClosed());
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
}

TEST_F(AsyncServerTest, WriteTimeoutDropsNonReadingClient) {
  AsyncServerOptions o;
  o.write_timeout_seconds = 0.3;
  Start(o);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  int small = 4096;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  SendAll(fd, "GET /flood HTTP/1.1\r\nHost: x\r\n\r\n");  // and never read
  HttpTestClient other(server_->port(), 5);
  EXPECT_EQ(other.Request("GET", "/hello").status, 200);
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!flood_done_ && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(flood_done_.load());
  EXPECT_TRUE(flood_write_failed_.load());  // 256 MiB cannot fit in socket buffers
  EXPECT_EQ(other.Request("GET", "/hello").status, 200);
  ::close(fd);
}

// At the cap the oldest idle connection makes room (idle sockets must not lock every other
// client out); only when every connection is busy is a new one answered 503.
TEST_F(AsyncServerTest, AtTheConnectionLimitTheOldestIdleConnectionMakesRoom) {
  AsyncServerOptions o;
  o.max_connections = 2;
  Start(o);
  HttpTestClient a(server_->port(), 5), b(server_->port(), 5);
  ASSERT_EQ(a.Request("GET", "/hello").status, 200);
  ASSERT_EQ(b.Request("GET", "/hello").status, 200);
  ASSERT_TRUE(WaitIdleConnections(2));  // a client sees its answer before its connection is idle
  HttpTestClient c(server_->port(), 5);
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
  EXPECT_TRUE(a.WaitClosed());  // the oldest idle one
  EXPECT_EQ(b.Request("GET", "/hello").status, 200);
  // Both busy in a handler: nothing to displace.
  ASSERT_TRUE(b.SendRaw(HttpTestClient::BuildRequest("GET", "/slow?3000")));
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("GET", "/slow?3000")));
  ASSERT_TRUE(WaitIdleConnections(0));
  HttpTestClient d(server_->port(), 5);
  HttpTestResponse r;
  ASSERT_TRUE(d.ReadResponse(&r));  // answered without asking
  EXPECT_EQ(r.status, 503);
  EXPECT_TRUE(d.WaitClosed());
  HttpTestResponse done;
  ASSERT_TRUE(b.ReadResponse(&done));
  EXPECT_EQ(done.body, "slow done");
  ASSERT_TRUE(c.ReadResponse(&done));
  EXPECT_EQ(done.body, "slow done");
}

// A chunk-size line or trailer has no header_limit or body_limit of its own: without a bound it
// was buffered until the read timeout (a gigabyte in ten seconds from one client).
TEST_F(AsyncServerTest, EndlessChunkHeaderIsRefusedNotBuffered) {
  AsyncServerOptions o;
  o.max_header_bytes = 1024;
  Start(o);
  for (const std::string head : {std::string("1;ext="), std::string("0\r\nX-Trailer: ")}) {
    const HttpTestResponse r = test::SendEndlessChunkHeader(server_->port(), "/echo", head, 16 << 10, 16);
    EXPECT_EQ(r.status, 400) << head;
    EXPECT_NE(r.body.find("chunk header or trailer"), std::string::npos) << r.body;
  }
  HttpTestClient ok(server_->port(), 10);
  EXPECT_EQ(ok.Request("GET", "/hello").status, 200);
}

// HEAD: the header alone, Content-Length as GET's; the next response on the connection intact.
TEST_F(AsyncServerTest, HeadAnswersCarryNoBody) {
  Start();
  HttpTestClient c(server_->port(), 5);
  const std::string get_body = c.Request("GET", "/hello").body;
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("HEAD", "/hello") + HttpTestClient::BuildRequest("HEAD", "/nowhere") +
                        HttpTestClient::BuildRequest("GET", "/hello")));
  HttpTestResponse head;
  ASSERT_TRUE(c.ReadHead(&head));
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.Header("Content-Length"), std::to_string(get_body.size()));
  ASSERT_TRUE(c.ReadHead(&head));
  EXPECT_EQ(head.status, 404);
  HttpTestResponse next;
  ASSERT_TRUE(c.ReadResponse(&next));
  EXPECT_EQ(next.status, 200) << "bytes after a HEAD answer's header were read as a response";
  EXPECT_EQ(next.body, get_body);
}

TEST_F(AsyncServerTest, StopDrainsInFlightRequest) {
  Start();
  HttpTestClient idle(server_->port(), 5);
  ASSERT_EQ(idle.Request("GET", "/hello").status, 200);
  HttpTestResponse r;
  std::thread client([&] {
    HttpTestClient c(server_->port(), 10);
    r = c.Request("GET", "/slow?300");
  });
  while (requests_.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  auto t0 = Clock::now();
  server_->Stop(5);
  auto took = Clock::now() - t0;
  client.join();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "slow done");
  EXPECT_EQ(r.Header("Connection"), "close");
  EXPECT_GE(took, std::chrono::milliseconds(200));
  EXPECT_LT(took, std::chrono::seconds(4));
  EXPECT_TRUE(idle.WaitClosed());
  HttpTestClient late(server_->port(), 1);
  EXPECT_EQ(late.Request("GET", "/hello").status, 0);  // not accepting any more
}

TEST_F(AsyncServerTest, StopGivesUpOnHandlersAfterDrainTime) {
  Start();
  std::thread client([&] {
    HttpTestClient c(server_->port(), 10);
    c.Request("GET", "/slow?20000");
  });
  while (requests_.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  auto t0 = Clock::now();
  server_->Stop(0.2);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  client.join();
}

TEST(AsyncServerStartTest, BadAddressAndTlsFilesFail) {
  AsyncServerOptions bad;
  bad.host = "256.1.1.1";
  AsyncHttpServer a(bad, [](const HttpRequest&, AsyncResponder&) -> Task<void> { co_return; });
  Status s = a.Start();
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find("256.1.1.1"), std::string::npos) << s.ToString();
  AsyncServerOptions o;
  o.tls_cert_file = "/nonexistent/cert.pem";
  o.tls_key_file = "/nonexistent/key.pem";
  AsyncHttpServer b(o, [](const HttpRequest&, AsyncResponder&) -> Task<void> { co_return; });
  EXPECT_EQ(b.Start().code(), StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------------------------------
// Client against the server

class AsyncClientTest : public AsyncServerTest {
 protected:
  std::string Url(std::string_view path) { return "http://127.0.0.1:" + std::to_string(server_->port()) + std::string(path); }
  Result<ClientResponse> Fetch(HttpClient& client, ClientRequest req) {
    return RunSync(io_.io().get_executor(), client.Fetch(std::move(req)));
  }
  IoThreads io_;
};

TEST_F(AsyncClientTest, ReadsMergedFirstAndLastChunks) {
  Start();
  HttpClient client(io_.io());
  auto s = Fetch(client, {.method = "GET", .url = Url("/merged")});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->body, "firstmidlast");
}

TEST_F(AsyncClientTest, FetchGetAndPost) {
  Start();
  HttpClient client(io_.io());
  auto r = Fetch(client, {.method = "GET", .url = Url("/hello?q=1")});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "hello q=1");
  EXPECT_EQ(r->headers.Get("x-test"), "1");
  auto p = Fetch(client, {.url = Url("/echo"), .headers = {{"Content-Type", "text/x-test"}}, .body = "data"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->body, "POST /echo text/x-test data");
  auto s = Fetch(client, {.method = "GET", .url = Url("/stream")});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->body, "abbccc");
  auto n = Fetch(client, {.method = "GET", .url = Url("/nothing")});
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->status, 404);
}

TEST_F(AsyncClientTest, PoolReusesConnections) {
  Start();
  HttpClient client(io_.io());
  for (int i = 0; i < 5; ++i) {
    auto r = Fetch(client, {.method = "GET", .url = Url(i % 2 ? "/stream" : "/hello")});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  EXPECT_EQ(connections_seen(), 1u);
  // Two requests at once need two connections; both go back to the pool.
  auto a = client.Fetch({.method = "GET", .url = Url("/slow?100")});
  auto b = client.Fetch({.method = "GET", .url = Url("/slow?100")});
  auto both = [](Task<Result<ClientResponse>> x, Task<Result<ClientResponse>> y) -> Task<int> {
    // Sequential awaits would serialize; spawn one and await the other.
    auto ex = co_await asio::this_coro::executor;
    std::promise<int> first;
    auto f = first.get_future();
    asio::co_spawn(ex, [](Task<Result<ClientResponse>> t, std::promise<int>* p) -> Task<void> {
      auto r = co_await std::move(t);
      p->set_value(r.ok() ? r->status : 0);
    }(std::move(x), &first), asio::detached);
    auto r = co_await std::move(y);
    while (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) co_await SleepMs(5);
    co_return (r.ok() ? r->status : 0) + f.get();
  };
  EXPECT_EQ(RunSync(io_.io().get_executor(), both(std::move(a), std::move(b))), 400);
  EXPECT_EQ(connections_seen(), 2u);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Fetch(client, {.method = "GET", .url = Url("/hello")}).ok());
  EXPECT_EQ(connections_seen(), 2u);
}

TEST_F(AsyncClientTest, SequentialFetchesStayOnOneConnection) {
  Start();
  HttpClient client(io_.io());
  // From a coroutine, as a gateway handler would; prints the round trip for a rough idea only
  // (the build machine is shared, so no timing assertion).
  auto loop = [](HttpClient* c, std::string url) -> Task<std::vector<double>> {
    std::vector<double> micros;
    for (int i = 0; i < 500; ++i) {
      ClientRequest req{.method = "GET", .url = url};
      auto t0 = Clock::now();
      auto r = co_await c->Fetch(std::move(req));
      micros.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (!r.ok() || r->body != "hello ") co_return std::vector<double>{};
    }
    co_return micros;
  };
  auto micros = RunSync(asio::make_strand(io_.io()), loop(&client, Url("/hello")));
  ASSERT_EQ(micros.size(), 500u);
  std::sort(micros.begin(), micros.end());
  std::printf("loopback Fetch round trip: p50 %.0f us, p99 %.0f us\n", micros[250], micros[495]);
  EXPECT_EQ(connections_seen(), 1u);
  EXPECT_EQ(requests_.load(), 500);
}

TEST_F(AsyncClientTest, IdleConnectionClosedByServerIsReplaced) {
  AsyncServerOptions o;
  o.idle_timeout_seconds = 0.1;
  Start(o);
  HttpClient client(io_.io());
  ASSERT_TRUE(Fetch(client, {.method = "GET", .url = Url("/hello")}).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  auto r = Fetch(client, {.method = "GET", .url = Url("/hello")});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(connections_seen(), 2u);
}

TEST_F(AsyncClientTest, StreamDeliversChunksAsTheyAreWritten) {
  Start();
  HttpClient client(io_.io());
  auto opened = RunSync(io_.io().get_executor(), client.Open({.method = "GET", .url = Url("/gated")}));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  ResponseStream& s = **opened;
  EXPECT_EQ(s.status(), 200);
  EXPECT_EQ(s.headers().Get("Transfer-Encoding"), "chunked");
  std::string body;
  Status st = RunSync(io_.io().get_executor(), s.Read(&body));
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(body, "first");
  EXPECT_FALSE(second_written_.load());  // the first chunk arrived before the rest was written
  release_ = true;
  for (int i = 0; i < 10; ++i) {
    size_t before = body.size();
    st = RunSync(io_.io().get_executor(), s.Read(&body));
    ASSERT_TRUE(st.ok()) << st.ToString();
    if (body.size() == before) break;
  }
  EXPECT_EQ(body, "firstsecond");
  opened->reset();
  // The fully read stream returned its connection to the pool.
  ASSERT_TRUE(Fetch(client, {.method = "GET", .url = Url("/hello")}).ok());
  EXPECT_EQ(connections_seen(), 1u);
}

// An upstream's error to a streamed request usually comes with a Content-Length, not chunked:
// Open must read it (Boost 1.74 fails such bodies when the parser's limit is "none").
TEST_F(AsyncClientTest, StreamReadsAContentLengthBody) {
  Start();
  HttpClient client(io_.io());
  for (int round = 0; round < 2; ++round) {  // the second reuses the pooled connection
    auto opened = RunSync(io_.io().get_executor(), client.Open({.method = "GET", .url = Url("/hello?cl")}));
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    ResponseStream& s = **opened;
    EXPECT_EQ(s.status(), 200);
    EXPECT_FALSE(s.headers().Get("Content-Length").empty());
    std::string body;
    for (int i = 0; i < 10; ++i) {
      const size_t before = body.size();
      Status st = RunSync(io_.io().get_executor(), s.Read(&body));
      ASSERT_TRUE(st.ok()) << st.ToString();
      if (body.size() == before) break;
    }
    EXPECT_EQ(body, "hello cl");
  }
  EXPECT_EQ(connections_seen(), 1u);
}

TEST_F(AsyncClientTest, AbandonedStreamIsNotPooled) {
  Start();
  HttpClient client(io_.io());
  {
    auto opened = RunSync(io_.io().get_executor(), client.Open({.method = "GET", .url = Url("/gated")}));
    ASSERT_TRUE(opened.ok());
  }  // dropped mid-body
  release_ = true;
  auto r = Fetch(client, {.method = "GET", .url = Url("/hello")});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->body, "hello ");
  EXPECT_EQ(connections_seen(), 2u);
}

TEST_F(AsyncServerTest, ClientGoneSeesAClosedConnectionButNotAWaitingOne) {
  Start();
  {
    HttpTestClient c(server_->port());
    ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("GET", "/until-gone")));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(saw_gone_.load());  // still waiting for its answer
  }  // leaves
  for (int i = 0; i < 1000 && !saw_gone_.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(saw_gone_.load());
  // A client that sends its next request early is still there.
  saw_gone_ = false;
  HttpTestClient early(server_->port());
  ASSERT_TRUE(early.SendRaw(HttpTestClient::BuildRequest("GET", "/until-gone") +
                            HttpTestClient::BuildRequest("GET", "/hello")));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(saw_gone_.load());
}

TEST_F(AsyncClientTest, FetchWhileAbandonsTheUpstreamWhenTheCallerLosesInterest) {
  Start();
  HttpClient client(io_.io());
  std::atomic<int> asked{0};
  auto wanted = [&asked] { return ++asked < 3; };  // gives up at the third poll
  auto r = RunSync(io_.io().get_executor(), client.FetchWhile({.method = "GET", .url = Url("/until-gone")}, wanted,
                                                              std::chrono::milliseconds(20)));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status().ToString();
  EXPECT_EQ(asked.load(), 3);
  // The upstream saw its client leave: the connection was closed, not left to finish.
  for (int i = 0; i < 1000 && !saw_gone_.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(saw_gone_.load());
  // A caller that stays gets its answer, and the connection goes back to the pool.
  auto ok = RunSync(io_.io().get_executor(),
                    client.FetchWhile({.method = "GET", .url = Url("/slow?50")}, [] { return true; },
                                      std::chrono::milliseconds(5)));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->body, "slow done");
  const size_t seen = connections_seen();
  ASSERT_TRUE(Fetch(client, {.method = "GET", .url = Url("/hello")}).ok());
  EXPECT_EQ(connections_seen(), seen);  // reused: the abandoned one was not pooled, this one was
  // Errors still come through as errors, not as cancellations.
  auto refused = RunSync(io_.io().get_executor(),
                         client.FetchWhile({.method = "GET", .url = "http://127.0.0.1:1/x"}, [] { return true; }));
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().ToString();
}

TEST_F(AsyncClientTest, ResponseTimeoutAndBodyLimit) {
  Start();
  HttpClient client(io_.io(), {.response_timeout_seconds = 0.2, .max_response_bytes = 6});
  auto t0 = Clock::now();
  auto r = Fetch(client, {.method = "GET", .url = Url("/slow?3000")});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("response timeout"), std::string::npos) << r.status().ToString();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  // Timeouts race socket completions unless the client serializes them on a strand; callers on
  // the plain multi-threaded io_context must still get a clean "response timeout" every time.
  HttpClient quick(io_.io(), {.response_timeout_seconds = 0.02});
  for (int i = 0; i < 20; ++i) {
    auto q = Fetch(quick, {.method = "GET", .url = Url("/slow?1000")});
    ASSERT_EQ(q.status().code(), StatusCode::kUnavailable) << q.status().ToString();
    ASSERT_NE(q.status().message().find("response timeout"), std::string::npos) << q.status().ToString();
  }
  // Content-Length over the limit, and a chunked body at exactly the limit (6 bytes).
  auto big = Fetch(client, {.method = "GET", .url = Url("/hello?x")});
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted) << big.status().ToString();
  auto fits = Fetch(client, {.method = "GET", .url = Url("/stream")});
  ASSERT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_EQ(fits->body, "abbccc");
  HttpClient tight(io_.io(), {.max_response_bytes = 5});  // chunked, one byte over
  auto chunked = Fetch(tight, {.method = "GET", .url = Url("/stream")});
  EXPECT_EQ(chunked.status().code(), StatusCode::kResourceExhausted) << chunked.status().ToString();
}

TEST_F(AsyncClientTest, FetchFromAHandlerProxiesUpstream) {
  Start();  // the upstream
  HttpClient* client_ptr = nullptr;
  AsyncHttpServer proxy({}, [&](const HttpRequest& req, AsyncResponder& w) -> Task<void> {
    // A named request: GCC 12 mishandles brace-initialized temporaries inside co_await.
    ClientRequest upstream{.method = "GET", .url = Url("/hello?" + req.query)};
    auto up = co_await client_ptr->Fetch(std::move(upstream));
    if (!up.ok()) {
      co_await w.Send(502, "text/plain", up.status().ToString());
    } else {
      co_await w.Send(up->status, "text/plain", "proxied " + up->body);
    }
  });
  ASSERT_TRUE(proxy.Start().ok());
  HttpClient client(proxy.io_context());  // the client shares the proxy's threads
  client_ptr = &client;
  HttpTestClient c(proxy.port(), 10);
  for (int i = 0; i < 3; ++i) {
    HttpTestResponse r = c.Request("GET", "/x?" + std::to_string(i));
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, "proxied hello " + std::to_string(i));
  }
  EXPECT_EQ(connections_seen(), 1u);  // upstream connection pooled across handler calls
  proxy.Stop(1);
}

// ------------------------------------------------------------------------------------------
// Client against hand-written servers

TEST(AsyncClientRawTest, StalePooledConnectionIsRetriedOnce) {
  int port = 0;
  int lfd = ListenLoopback(&port);
  ASSERT_GE(lfd, 0);
  std::atomic<int> accepted{0};
  std::thread server([&] {
    // Connection 1: answers one request, then takes the second and closes without answering.
    int c1 = ::accept(lfd, nullptr, nullptr);
    ++accepted;
    ReadRequestHead(c1);
    SendAll(c1, "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none");
    ReadRequestHead(c1);
    ::close(c1);
    // Connection 2: the retry.
    int c2 = ::accept(lfd, nullptr, nullptr);
    ++accepted;
    ReadRequestHead(c2);
    SendAll(c2, "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\ntwo");
    ::close(c2);
  });
  IoThreads io;
  HttpClient client(io.io());
  std::string url = "http://127.0.0.1:" + std::to_string(port) + "/";
  auto a = RunSync(io.io().get_executor(), client.Fetch({.method = "GET", .url = url}));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->body, "one");
  auto b = RunSync(io.io().get_executor(), client.Fetch({.method = "GET", .url = url}));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->body, "two");
  server.join();
  EXPECT_EQ(accepted.load(), 2);
  ::close(lfd);
}

TEST(AsyncClientRawTest, NoRetryOnFreshConnectionThatFails) {
  int port = 0;
  int lfd = ListenLoopback(&port);
  std::atomic<int> accepted{0};
  std::thread server([&] {
    int c = ::accept(lfd, nullptr, nullptr);
    ++accepted;
    ReadRequestHead(c);
    ::close(c);
  });
  IoThreads io;
  HttpClient client(io.io());
  auto r = RunSync(io.io().get_executor(),
                   client.Fetch({.method = "GET", .url = "http://127.0.0.1:" + std::to_string(port) + "/"}));
  server.join();
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_EQ(accepted.load(), 1);
  ::close(lfd);
}

TEST(AsyncClientRawTest, TruncatedBodiesAreCorruption) {
  int port = 0;
  int lfd = ListenLoopback(&port);
  std::thread server([&] {
    for (const char* reply : {"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
                              "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
                              "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"}) {
      int c = ::accept(lfd, nullptr, nullptr);
      ReadRequestHead(c);
      SendAll(c, reply);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ::close(c);
    }
  });
  IoThreads io;
  HttpClient client(io.io());
  std::string url = "http://127.0.0.1:" + std::to_string(port) + "/";
  for (int i = 0; i < 2; ++i) {
    auto r = RunSync(io.io().get_executor(), client.Fetch({.method = "GET", .url = url}));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
    EXPECT_NE(r.status().message().find("truncated body"), std::string::npos) << r.status().ToString();
  }
  // As a stream: the bytes that arrived are delivered first, then the error.
  auto opened = RunSync(io.io().get_executor(), client.Open({.method = "GET", .url = url}));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  std::string body;
  Status st;
  for (int i = 0; i < 5 && st.ok(); ++i) st = RunSync(io.io().get_executor(), (*opened)->Read(&body));
  EXPECT_EQ(body, "hello");
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  server.join();
  ::close(lfd);
}

TEST(AsyncClientRawTest, CloseDelimitedBody) {
  int port = 0;
  int lfd = ListenLoopback(&port);
  std::thread server([&] {
    int c = ::accept(lfd, nullptr, nullptr);
    ReadRequestHead(c);
    SendAll(c, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end");
    ::close(c);
  });
  IoThreads io;
  HttpClient client(io.io());
  auto r = RunSync(io.io().get_executor(), client.Fetch({.method = "GET", .url = "http://127.0.0.1:" + std::to_string(port)}));
  server.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->body, "until the end");
  ::close(lfd);
}

TEST(AsyncClientRawTest, ConnectRefusedAndBadUrls) {
  int port = 0;
  int lfd = ListenLoopback(&port);
  ::close(lfd);  // nobody listens there now
  IoThreads io;
  HttpClient client(io.io());
  auto r = RunSync(io.io().get_executor(), client.Fetch({.method = "GET", .url = "http://127.0.0.1:" + std::to_string(port) + "/x"}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("refused"), std::string::npos) << r.status().ToString();
  for (const char* bad : {"ftp://x/", "http://", "http://host:99999/", "http://h:p/", "unix:relative.sock", "nonsense"}) {
    auto b = RunSync(io.io().get_executor(), client.Fetch({.url = bad}));
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(AsyncClientRawTest, UnixSocketUrl) {
  std::string path = (std::filesystem::temp_directory_path() / ("keel_gw_" + std::to_string(::getpid()) + ".sock")).string();
  ::unlink(path.c_str());
  int lfd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(lfd, 4), 0);
  std::string head;
  std::thread server([&] {
    int c = ::accept(lfd, nullptr, nullptr);
    head = ReadRequestHead(c);
    SendAll(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nlocal");
    ::close(c);
  });
  IoThreads io;
  HttpClient client(io.io());
  auto r = RunSync(io.io().get_executor(), client.Fetch({.method = "GET", .url = "unix:" + path + ":/v1/models?x=1"}));
  server.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->body, "local");
  EXPECT_EQ(head.rfind("GET /v1/models?x=1 HTTP/1.1\r\n", 0), 0u) << head;
  ::close(lfd);
  ::unlink(path.c_str());
  auto gone = RunSync(io.io().get_executor(), client.Fetch({.method = "GET", .url = "unix:" + path + ":/"}));
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable) << gone.status().ToString();
}

// ------------------------------------------------------------------------------------------
// TLS

TEST(AsyncTlsTest, HttpsWithSelfSignedCertificate) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) GTEST_SKIP() << "no openssl binary";
  auto dir = std::filesystem::temp_directory_path() / ("keel_gw_tls_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::string cert = (dir / "cert.pem").string(), key = (dir / "key.pem").string();
  std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -keyout " + key +
                    " -out " + cert + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  AsyncServerOptions o;
  o.tls_cert_file = cert;
  o.tls_key_file = key;
  AsyncHttpServer server(o, [](const HttpRequest& req, AsyncResponder& w) -> Task<void> {
    if (req.path == "/stream") {
      co_await w.BeginStream(200, "text/plain");
      co_await w.WriteChunk("se");
      co_await w.WriteChunk("cure");
      co_await w.EndStream();
    } else {
      co_await w.Send(200, "text/plain", "tls " + req.body);
    }
  });
  ASSERT_TRUE(server.Start().ok());
  AsyncServerOptions small = o;
  small.max_body_bytes = 1000;
  AsyncHttpServer tight(small, [](const HttpRequest&, AsyncResponder& w) -> Task<void> {
    co_await w.Send(200, "text/plain", "accepted");
  });
  ASSERT_TRUE(tight.Start().ok());
  std::string base = "https://127.0.0.1:" + std::to_string(server.port());
  IoThreads io;
  HttpClient insecure(io.io(), {.verify_tls = false});
  for (int i = 0; i < 2; ++i) {
    auto r = RunSync(io.io().get_executor(), insecure.Fetch({.url = base + "/", .body = "hi"}));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->body, "tls hi");
  }
  auto s = RunSync(io.io().get_executor(), insecure.Fetch({.method = "GET", .url = base + "/stream"}));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->body, "secure");
  // An oversize upload over TLS (no half-close there): the server reads and drops the rest of
  // the body, so a client that writes its whole body before reading still gets the 413.
  auto big = RunSync(io.io().get_executor(),
                     insecure.Fetch({.url = "https://127.0.0.1:" + std::to_string(tight.port()) + "/",
                                     .body = std::string(size_t{8} << 20, 'b')}));
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ(big->status, 413);
  tight.Stop(1);
  HttpClient strict(io.io());  // self-signed: verification must fail
  auto v = RunSync(io.io().get_executor(), strict.Fetch({.url = base + "/"}));
  EXPECT_EQ(v.status().code(), StatusCode::kUnavailable) << v.status().ToString();
  HttpClient plain(io.io());  // plain HTTP to a TLS port gets no valid response
  auto p = RunSync(io.io().get_executor(), plain.Fetch({.url = "http://127.0.0.1:" + std::to_string(server.port()) + "/"}));
  EXPECT_FALSE(p.ok());
  server.Stop(1);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace keel::gateway
