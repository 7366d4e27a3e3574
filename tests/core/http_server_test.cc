#include "keel/core/http_server.h"
#include "keel/core/http_beast.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <fcntl.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/core/http_test_client.h"

namespace keel {
namespace {

using test::HttpTestClient;
using test::HttpTestResponse;

// A one-shot latch for ordering steps across threads without sleeping.
class Latch {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Waits at most 30 s (a bound against hangs, not a timing assertion).
  bool Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// A raw loopback connection for floods and trickles (no HTTP of its own).
class RawConn {
 public:
  // Non-blocking connect: many can be opened before any completes (see WaitConnected).
  explicit RawConn(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd_ < 0) return;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno != EINPROGRESS) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConn() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConn(const RawConn&) = delete;
  RawConn& operator=(const RawConn&) = delete;
  int fd() const { return fd_; }
  // Waits (bounded) until the connect completed; true when connected.
  bool WaitConnected(int timeout_ms) {
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLOUT, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return false;
    int err = 0;
    socklen_t len = sizeof(err);
    return ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
  }
  bool Send(std::string_view data) {
    return fd_ >= 0 && ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
  }
  // Sends `data` one byte every gap_ms, watching for the server to answer or close meanwhile.
  // True when the server closed the connection before every byte was sent (what it sent is in
  // *reply); false when the trickle completed with the connection still open.
  bool TrickleUntilClosed(std::string_view data, int gap_ms, std::string* reply) {
    for (char ch : data) {
      if (::send(fd_, &ch, 1, MSG_NOSIGNAL) != 1) return true;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, gap_ms) > 0) {
        char buf[4096];
        ssize_t n;
        // The server answered (408) or closed: read to the end (bounded).
        while ((n = ::recv(fd_, buf, sizeof(buf), 0)) > 0) {
          reply->append(buf, static_cast<size_t>(n));
          if (::poll(&p, 1, 5000) <= 0) return false;
        }
        return true;
      }
    }
    return false;
  }

 private:
  int fd_ = -1;
};

// Opens n connections and waits (bounded) for all to complete; returns how many did.
int OpenMany(int port, int n, std::vector<std::unique_ptr<RawConn>>* out) {
  const size_t first = out->size();
  for (int i = 0; i < n; ++i) out->push_back(std::make_unique<RawConn>(port));
  // One overall bound (connects complete concurrently; a full accept queue delays some).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int ok = 0;
  for (size_t i = first; i < out->size(); ++i) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    ok += (*out)[i]->WaitConnected(std::max<int>(0, static_cast<int>(left.count()))) ? 1 : 0;
  }
  return ok;
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options = {}) {
    router_.Handle("GET", "/hello", [](const HttpRequest& req, HttpResponder& res) {
      res.Send(200, "text/plain", "hello " + req.query, {{"X-Test", "1"}});
    });
    router_.Handle("POST", "/echo", [](const HttpRequest& req, HttpResponder& res) {
      nlohmann::json j = {{"body", req.body},
                          {"content_type", std::string(req.headers.Get("content-TYPE"))},
                          {"method", req.method},
                          {"path", req.path}};
      res.Send(200, "application/json", j.dump());
    });
    router_.Handle("GET", "/stream", [this](const HttpRequest&, HttpResponder& res) {
      ASSERT_TRUE(res.BeginStream(200, "text/event-stream"));
      ASSERT_TRUE(res.WriteChunk("first"));
      first_sent_.Open();
      release_.Wait();
      for (int i = 0; i < 3; ++i) res.WriteChunk("chunk" + std::to_string(i));
      res.EndStream();
    });
    router_.Handle("GET", "/until-gone", [this](const HttpRequest&, HttpResponder& res) {
      res.BeginStream(200, "text/plain");
      res.WriteChunk("x");
      first_sent_.Open();
      // Keep writing until the client is seen to be gone (bounded as a safety net).
      for (int i = 0; i < 30000; ++i) {
        if (res.ClientGone() || !res.WriteChunk("tick\n")) {
          saw_gone_ = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      gone_.Open();
    });
    router_.Handle("GET", "/block", [this](const HttpRequest&, HttpResponder& res) {
      blocked_.fetch_add(1);
      release_.Wait();
      res.Send(200, "text/plain", "released");
    });
    router_.Handle("GET", "/silent", [](const HttpRequest&, HttpResponder&) {});
    router_.Handle("GET", "/throws", [](const HttpRequest&, HttpResponder&) { throw std::runtime_error("boom"); });
    server_ = std::make_unique<HttpServer>(options, [this](const HttpRequest& q, HttpResponder& r) { router_(q, r); });
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_GT(server_->port(), 0);
  }
  void TearDown() override {
    release_.Open();
    if (server_) server_->Stop(1);
  }

  HttpRouter router_;
  std::unique_ptr<HttpServer> server_;
  Latch first_sent_, release_, gone_;
  std::atomic<bool> saw_gone_{false};
  std::atomic<int> blocked_{0};

  // Waits (bounded, 30 s) until no handler runs: the answered connections are idle again.
  bool WaitIdle() {
    for (int i = 0; i < 3000 && server_->active_requests() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return server_->active_requests() == 0;
  }

  // Waits (bounded, 30 s) until n handlers of /block are running.
  bool WaitBlocked(int n) {
    for (int i = 0; i < 3000 && blocked_.load() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return blocked_.load() >= n;
  }
};

// An empty --host (an unset shell variable) used to listen on every interface.
TEST(HttpServerBind, AnEmptyHostIsRefusedNotTheWildcard) {
  HttpServerOptions o;
  o.host = "";
  HttpServer server(o, [](const HttpRequest&, HttpResponder& r) { r.Send(200, "text/plain", "x"); });
  Status s = server.Start();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("empty host"), std::string::npos) << s.ToString();
}

TEST_F(HttpServerTest, GetAndPost) {
  StartServer();
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.connected());
  HttpTestResponse r = c.Request("GET", "/hello?name=x");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "hello name=x");
  EXPECT_EQ(r.Header("x-test"), "1");
  EXPECT_EQ(r.Header("Content-Type"), "text/plain");
  r = c.Request("POST", "/echo", R"({"a":1})");
  ASSERT_EQ(r.status, 200);
  auto j = nlohmann::json::parse(r.body);
  EXPECT_EQ(j["body"], R"({"a":1})");
  EXPECT_EQ(j["content_type"], "application/json");
  EXPECT_EQ(j["path"], "/echo");
}

TEST_F(HttpServerTest, UnknownPathIs404AndWrongMethodIs405) {
  StartServer();
  HttpTestClient c(server_->port());
  HttpTestResponse r = c.Request("GET", "/nope");
  EXPECT_EQ(r.status, 404);
  auto j = nlohmann::json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object());
  EXPECT_TRUE(j["error"]["message"].is_string());
  r = c.Request("POST", "/hello", "{}");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.Header("Allow"), "GET, HEAD");
  // The connection is still usable after client errors.
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
}

TEST_F(HttpServerTest, KeepAliveServesTwoRequestsOnOneConnection) {
  StartServer();
  HttpTestClient c(server_->port());
  EXPECT_EQ(c.Request("GET", "/hello?1").body, "hello 1");
  EXPECT_EQ(c.Request("GET", "/hello?2").body, "hello 2");
  EXPECT_EQ(server_->open_connections(), 1);
}

TEST_F(HttpServerTest, PipelinedRequestsAnsweredInOrder) {
  StartServer();
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("GET", "/hello?a") +
                        HttpTestClient::BuildRequest("GET", "/hello?b")));
  HttpTestResponse r1, r2;
  ASSERT_TRUE(c.ReadResponse(&r1));
  ASSERT_TRUE(c.ReadResponse(&r2));
  EXPECT_EQ(r1.body, "hello a");
  EXPECT_EQ(r2.body, "hello b");
}

TEST_F(HttpServerTest, Http10ClosesUnlessKeepAlive) {
  StartServer();
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw("GET /hello HTTP/1.0\r\n\r\n"));
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(c.WaitClosed());
}

TEST_F(HttpServerTest, OversizeBodyIs413) {
  HttpServerOptions o;
  o.max_body_bytes = 1024;
  StartServer(o);
  {
    // Declared too large: refused after the headers, before the body is read.
    HttpTestClient c(server_->port());
    std::string body(4096, 'x');
    ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("POST", "/echo", body)));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.status, 413);
    auto j = nlohmann::json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.body;
    EXPECT_EQ(j["error"]["code"], 413);
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    // With Expect: 100-continue the client never has to send the body.
    HttpTestClient c(server_->port());
    ASSERT_TRUE(c.SendRaw("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.status, 413);
  }
  {
    // Chunked bodies are bounded too.
    HttpTestClient c(server_->port());
    std::string req = "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int i = 0; i < 3; ++i) req += "200\r\n" + std::string(512, 'y') + "\r\n";
    req += "0\r\n\r\n";
    ASSERT_TRUE(c.SendRaw(req));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.status, 413);
  }
  // A body within the limit still works.
  HttpTestClient ok(server_->port());
  EXPECT_EQ(ok.Request("POST", "/echo", std::string(1000, 'z')).status, 200);
}

TEST_F(HttpServerTest, ExpectContinueWithinLimit) {
  StartServer();
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"));
  ASSERT_TRUE(c.SendRaw("{}"));
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 200);
}

TEST_F(HttpServerTest, MalformedRequestsAre400AndClosed) {
  StartServer();
  const std::vector<std::string> bad = {
      "GARBAGE\r\n\r\n",
      "GET /hello HTTP/1.1\r\nBad Header Line\r\n\r\n",
      "POST /echo HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
      "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
      std::string("GET /\0 HTTP/1.1\r\n\r\n", 20),
  };
  for (const std::string& req : bad) {
    HttpTestClient c(server_->port());
    ASSERT_TRUE(c.SendRaw(req));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r)) << req;
    EXPECT_EQ(r.status, 400) << req;
    EXPECT_TRUE(c.WaitClosed()) << req;
  }
  // Still serving.
  HttpTestClient c(server_->port());
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
}

// RFC 9112 §6.3. Beast reads no body when the last coding is not chunked, so the body used to
// be served as a second, smuggled request on the same connection.
TEST_F(HttpServerTest, TransferCodingsOtherThanChunkedAreRefusedNotSmuggled) {
  StartServer();
  const std::string smuggled = HttpTestClient::BuildRequest("GET", "/hello?smuggled");
  const std::vector<std::pair<std::string, int>> cases = {
      {"gzip", 400}, {"identity", 400}, {"chunked, gzip", 400}, {"gzip, chunked", 501}};
  for (const auto& [coding, status] : cases) {
    HttpTestClient c(server_->port());
    ASSERT_TRUE(c.SendRaw("GET /hello?outer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding + "\r\n\r\n" +
                          (coding == "gzip, chunked" ? "0\r\n\r\n" : "") + smuggled));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r)) << coding;
    EXPECT_EQ(r.status, status) << coding << ": " << r.body;
    EXPECT_EQ(r.body.find("hello"), std::string::npos) << coding;
    EXPECT_TRUE(c.WaitClosed()) << coding << ": the smuggled request was answered";
  }
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"));
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 200) << r.body;  // plain chunked still works
}

// RFC 9110 §8.4: a body in a content coding the server cannot decode is a 415 naming it, not a
// handler's "malformed JSON"; "identity" is no coding.
TEST_F(HttpServerTest, CompressedBodiesAre415) {
  StartServer();
  for (const std::string coding : {"gzip", "br", "deflate"}) {
    HttpTestClient c(server_->port());
    ASSERT_TRUE(c.SendRaw("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Encoding: " + coding +
                          "\r\nContent-Length: 4\r\n\r\n\x1f\x8b\x08\x00"));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r)) << coding;
    EXPECT_EQ(r.status, 415) << coding << ": " << r.body;
    EXPECT_NE(r.body.find("Content-Encoding " + coding), std::string::npos) << r.body;
  }
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Encoding: identity\r\nContent-Length: 2\r\n\r\n{}"));
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 200) << r.body;
}

// RFC 9112 §3.2.2: a server must accept the absolute form a proxy sends.
TEST_F(HttpServerTest, AbsoluteFormTargetsAreServedAsTheirPath) {
  StartServer();
  HttpTestClient c(server_->port());
  HttpTestResponse r = c.Request("GET", "http://127.0.0.1:" + std::to_string(server_->port()) + "/hello?q=1");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body, "hello q=1");
  r = c.Request("POST", "HTTPS://example.test/echo", "{}");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["path"], "/echo");
}

TEST(HttpTargetTest, PathEscapesAreDecodedUnlessBroken) {
  EXPECT_EQ(DecodePath("/v1/models/org%2Fmodel"), "/v1/models/org/model");
  EXPECT_EQ(DecodePath("/a%3ab%20c"), "/a:b c");
  EXPECT_EQ(DecodePath("/plain"), "/plain");
  EXPECT_EQ(DecodePath("/bad%2"), "/bad%2");
  EXPECT_EQ(DecodePath("/bad%zz"), "/bad%zz");
  EXPECT_EQ(DecodePath("/nul%00x"), "/nul%00x");
}

TEST_F(HttpServerTest, EscapedPathsRouteByTheirDecodedForm) {
  StartServer();
  HttpTestClient c(server_->port());
  HttpTestResponse r = c.Request("GET", "/hell%6F?x=%2F");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body, "hello x=%2F");  // the query is the handler's to decode
}

TEST(HttpTargetTest, OriginFormDropsSchemeAndAuthorityOnly) {
  EXPECT_EQ(OriginForm("/v1/models?x=1"), "/v1/models?x=1");
  EXPECT_EQ(OriginForm("http://h:8080/v1/models?x=1"), "/v1/models?x=1");
  EXPECT_EQ(OriginForm("http://h:8080"), "/");
  EXPECT_EQ(OriginForm("http://h?x=1"), "/?x=1");
  EXPECT_EQ(OriginForm("/a?u=http://b/c"), "/a?u=http://b/c");  // origin form with a URL in its query
  EXPECT_EQ(OriginForm("ftp://h/x"), "ftp://h/x");                // not HTTP: left for the router to refuse
  EXPECT_EQ(OriginForm("*"), "*");
}

// A HEAD answer is its header alone, whatever the handler sent: a body after it is read by a
// keep-alive client as the start of the next response.
TEST_F(HttpServerTest, HeadAnswersCarryNoBody) {
  StartServer();
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("HEAD", "/hello") + HttpTestClient::BuildRequest("GET", "/hello?b")));
  HttpTestResponse head;
  ASSERT_TRUE(c.ReadHead(&head));  // ReadResponse would take Content-Length bytes as a body
  EXPECT_EQ(head.status, 200);     // a GET route answers HEAD (RFC 9110 §9.1: servers must)
  EXPECT_FALSE(head.Header("Content-Length").empty());
  HttpTestResponse next;
  ASSERT_TRUE(c.ReadResponse(&next));
  EXPECT_EQ(next.status, 200) << "bytes after the HEAD answer's header were read as a response";
  EXPECT_EQ(next.body, "hello b");
}

// A chunk-size line or trailer has no header_limit or body_limit of its own: without a bound it
// was buffered until the read timeout (a gigabyte in ten seconds from one client).
TEST_F(HttpServerTest, EndlessChunkHeaderIsRefusedNotBuffered) {
  StartServer();
  for (const std::string head : {std::string("1;ext="), std::string("0\r\nX-Trailer: ")}) {
    const HttpTestResponse r = test::SendEndlessChunkHeader(server_->port(), "/echo", head, 64 << 10, 64);
    EXPECT_EQ(r.status, 400) << head;
    EXPECT_NE(r.body.find("chunk header or trailer"), std::string::npos) << r.body;
  }
  HttpTestClient ok(server_->port());
  EXPECT_EQ(ok.Request("GET", "/hello").status, 200);
}

// RFC 9112: HTTP/1.1 needs exactly one Host (400 otherwise); empty lines before a request line
// are ignored; an HTTP/1.0 client is sent no 100 Continue.
TEST_F(HttpServerTest, HostLeadingEmptyLinesAndHttp10Expect) {
  StartServer();
  for (const std::string raw : {std::string("GET /hello HTTP/1.1\r\n\r\n"),
                                std::string("GET /hello HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")}) {
    HttpTestClient c(server_->port());
    ASSERT_TRUE(c.SendRaw(raw));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r));
    EXPECT_EQ(r.status, 400) << raw;
    EXPECT_NE(r.body.find("Host"), std::string::npos) << r.body;
  }
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw("\r\n\r\n" + HttpTestClient::BuildRequest("GET", "/hello?x")));
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "hello x");
  HttpTestClient old(server_->port());
  ASSERT_TRUE(old.SendRaw("POST /echo HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(old.SendRaw("{}"));
  ASSERT_TRUE(old.ReadResponse(&r));
  EXPECT_EQ(r.status, 200) << "a 100 Continue was sent to an HTTP/1.0 client";
}

TEST_F(HttpServerTest, RandomAndMutatedRequestsNeverCrash) {
  HttpServerOptions o;
  o.read_timeout_seconds = 2;  // a mutated Content-Length may promise bytes that never come
  StartServer(o);
  std::mt19937 rng(1234);
  const std::string valid = HttpTestClient::BuildRequest("POST", "/echo", R"({"a":[1,2,3]})");
  for (int i = 0; i < 300; ++i) {
    std::string msg;
    if (i % 3 == 0) {
      msg.resize(rng() % 400);
      for (char& c : msg) c = static_cast<char>(rng());
    } else {
      msg = valid;
      int flips = 1 + static_cast<int>(rng() % 8);
      for (int f = 0; f < flips; ++f) msg[rng() % msg.size()] = static_cast<char>(rng());
      if (i % 3 == 2) msg.resize(rng() % msg.size());
    }
    HttpTestClient c(server_->port(), /*timeout_seconds=*/5);
    ASSERT_TRUE(c.connected());
    c.SendRaw(msg);
    c.ShutdownWrite();
    HttpTestResponse r;
    if (c.ReadResponse(&r)) {
      EXPECT_TRUE(r.status == 200 || (r.status >= 400 && r.status < 600)) << r.status;
    }
  }
  HttpTestClient c(server_->port());
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
}

TEST_F(HttpServerTest, HeadersTooLargeAre431) {
  HttpServerOptions o;
  o.max_header_bytes = 1024;
  StartServer(o);
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw("GET /hello HTTP/1.1\r\nX-Big: " + std::string(4000, 'a') + "\r\n\r\n"));
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 431);
}

TEST_F(HttpServerTest, StreamingChunksArriveBeforeTheHandlerEnds) {
  StartServer();
  HttpTestClient c(server_->port());
  std::vector<std::string> seen;
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("GET", "/stream")));
  HttpTestResponse r;
  bool ok = c.ReadResponse(&r, [&](std::string_view chunk) {
    seen.emplace_back(chunk);
    // The handler is blocked until we have seen the first chunk: it really was streamed.
    if (seen.size() == 1) release_.Open();
    return true;
  });
  ASSERT_TRUE(ok);
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(r.chunked);
  EXPECT_EQ(r.Header("Content-Type"), "text/event-stream");
  EXPECT_EQ(seen, (std::vector<std::string>{"first", "chunk0", "chunk1", "chunk2"}));
  // Keep-alive after a chunked response.
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
}

TEST_F(HttpServerTest, HandlerSeesClientGone) {
  StartServer();
  {
    HttpTestClient c(server_->port());
    ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("GET", "/until-gone")));
    ASSERT_TRUE(first_sent_.Wait());
  }  // closes the socket
  ASSERT_TRUE(gone_.Wait());
  EXPECT_TRUE(saw_gone_);
}

TEST_F(HttpServerTest, SilentOrThrowingHandlerGets500) {
  StartServer();
  HttpTestClient c(server_->port());
  EXPECT_EQ(c.Request("GET", "/silent").status, 500);
  EXPECT_EQ(c.Request("GET", "/throws").status, 500);
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
}

TEST_F(HttpServerTest, AtTheCapAnIdleConnectionIsShedForANewOne) {
  HttpServerOptions o;
  o.max_connections = 1;
  StartServer(o);
  HttpTestClient a(server_->port(), 10);
  ASSERT_EQ(a.Request("GET", "/hello").status, 200);  // a is open, idle and counted
  ASSERT_TRUE(WaitIdle());
  HttpTestClient b(server_->port(), 10);
  EXPECT_EQ(b.Request("GET", "/hello").status, 200);  // a made room for b
  EXPECT_TRUE(a.WaitClosed());
  EXPECT_EQ(server_->connection_stats().shed, 1);
  EXPECT_EQ(b.Request("GET", "/hello").status, 200);
}

TEST_F(HttpServerTest, AtTheCapWithEveryConnectionBusyANewOneGets503) {
  HttpServerOptions o;
  o.max_connections = 2;
  StartServer(o);
  HttpTestClient a(server_->port(), 30), b(server_->port(), 30);
  ASSERT_TRUE(a.SendRaw(HttpTestClient::BuildRequest("GET", "/block")));
  ASSERT_TRUE(b.SendRaw(HttpTestClient::BuildRequest("GET", "/block")));
  ASSERT_TRUE(WaitBlocked(2));
  HttpTestClient c(server_->port(), 10);
  HttpTestResponse r = c.Request("GET", "/hello");
  EXPECT_EQ(r.status, 503);
  EXPECT_TRUE(c.WaitClosed());
  EXPECT_GE(server_->connection_stats().rejected, 1);
  release_.Open();
  HttpTestResponse ra, rb;
  ASSERT_TRUE(a.ReadResponse(&ra));
  ASSERT_TRUE(b.ReadResponse(&rb));
  EXPECT_EQ(ra.body, "released");
  ASSERT_TRUE(WaitIdle());
  // Both are idle again now: a newcomer displaces one of them.
  HttpTestClient d(server_->port(), 10);
  EXPECT_EQ(d.Request("GET", "/hello").status, 200);
}

TEST_F(HttpServerTest, RequestsBeyondMaxActiveGet503AtOnce) {
  HttpServerOptions o;
  o.max_active_requests = 1;
  StartServer(o);
  HttpTestClient a(server_->port(), 30);
  ASSERT_TRUE(a.SendRaw(HttpTestClient::BuildRequest("GET", "/block")));
  ASSERT_TRUE(WaitBlocked(1));
  HttpTestClient b(server_->port(), 10);
  HttpTestResponse r = b.Request("GET", "/hello");
  EXPECT_EQ(r.status, 503);
  EXPECT_TRUE(b.WaitClosed());
  release_.Open();
  HttpTestResponse ra;
  ASSERT_TRUE(a.ReadResponse(&ra));
  EXPECT_EQ(ra.status, 200);
  EXPECT_EQ(a.Request("GET", "/hello").status, 200);  // the worker is free again
}

TEST_F(HttpServerTest, AClientOverItsOwnCapLosesItsOldestIdleConnection) {
  HttpServerOptions o;
  o.max_connections_per_client = 2;
  StartServer(o);
  HttpTestClient a(server_->port(), 10), b(server_->port(), 10);
  ASSERT_EQ(a.Request("GET", "/hello?a").status, 200);
  ASSERT_EQ(b.Request("GET", "/hello?b").status, 200);
  ASSERT_TRUE(WaitIdle());
  HttpTestClient c(server_->port(), 10);
  EXPECT_EQ(c.Request("GET", "/hello?c").status, 200);
  // The longest idle one went: a, unless (under load) a's worker handed it back after b's did.
  for (int i = 0; i < 3000 && server_->open_connections() > 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(server_->open_connections(), 2);
  const HttpTestResponse ra = a.Request("GET", "/hello?a2"), rb = b.Request("GET", "/hello?b2");
  EXPECT_NE(ra.status == 200, rb.status == 200) << "exactly one of a and b was closed: " << ra.status << ", " << rb.status;
  EXPECT_EQ((ra.status == 200 ? ra : rb).body, ra.status == 200 ? "hello a2" : "hello b2");  // the other stays
}

TEST_F(HttpServerTest, SlowlorisHeadIsClosedByTheHeadDeadline) {
  HttpServerOptions o;
  o.head_timeout_seconds = 1;
  StartServer(o);
  RawConn slow(server_->port());
  ASSERT_TRUE(slow.WaitConnected(10000));
  // One byte every 300 ms would take 18 s; each byte resets a per-read timeout, never a total one.
  const std::string head = "GET /hello HTTP/1.1\r\nHost: x\r\nX-Slow: " + std::string(20, 'a') + "\r\n\r\n";
  std::string reply;
  EXPECT_TRUE(slow.TrickleUntilClosed(head, 300, &reply)) << "the trickling client was never cut off";
  EXPECT_EQ(reply.rfind("HTTP/1.1 408", 0), 0u) << reply;
  EXPECT_GE(server_->connection_stats().head_timeouts, 1);
  HttpTestClient c(server_->port(), 10);
  EXPECT_EQ(c.Request("GET", "/hello").status, 200);
}

TEST_F(HttpServerTest, TricklingBodyIsClosedByTheBodyDeadline) {
  HttpServerOptions o;
  o.body_timeout_seconds = 1;
  StartServer(o);
  RawConn slow(server_->port());
  ASSERT_TRUE(slow.WaitConnected(10000));
  ASSERT_TRUE(slow.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 60\r\n\r\n"));
  std::string reply;
  EXPECT_TRUE(slow.TrickleUntilClosed(std::string(60, 'b'), 300, &reply)) << "the trickling body was never cut off";
  EXPECT_EQ(reply.rfind("HTTP/1.1 408", 0), 0u) << reply;
  EXPECT_GE(server_->connection_stats().body_timeouts, 1);
}

// 300 slow-header connections and 2,000 idle ones: a fresh client is still answered, with the
// default limits and with a cap far below the flood (shedding).
void FloodThenProbe(HttpServer& server, int slow, int idle, std::vector<std::unique_ptr<RawConn>>& flood) {
  const int connected = OpenMany(server.port(), slow + idle, &flood);
  EXPECT_EQ(connected, slow + idle);
  // Probe only once the server has taken the whole flood in (a connect can complete on the client
  // side while the server has yet to accept it).
  for (int i = 0; i < 3000 && server.connection_stats().accepted < slow + idle; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GE(server.connection_stats().accepted, slow + idle);
  for (int i = 0; i < slow; ++i) flood[i]->Send("GET /hello HTTP/1.1\r\nHost: x\r\nX-Slow: a");
  for (int i = 0; i < 3; ++i) {
    HttpTestClient probe(server.port(), /*timeout_seconds=*/20);
    ASSERT_TRUE(probe.connected());
    HttpTestResponse r = probe.Request("GET", "/hello?probe");
    EXPECT_EQ(r.status, 200) << "probe " << i;
    EXPECT_EQ(r.body, "hello probe");
  }
}

TEST_F(HttpServerTest, SlowAndIdleFloodDoesNotStarveAFreshClient) {
  ASSERT_TRUE(test::EnsureFds(2 * 2400 + 256)) << "RLIMIT_NOFILE's hard limit is below the ~5,100 descriptors this test needs";
  StartServer();
  std::vector<std::unique_ptr<RawConn>> flood;
  FloodThenProbe(*server_, 300, 2000, flood);
  const ConnectionFrontStats st = server_->connection_stats();
  EXPECT_GE(server_->open_connections(), 2000)  // the flood was held, not refused
      << "accepted " << st.accepted << " shed " << st.shed << " rejected " << st.rejected << " head timeouts "
      << st.head_timeouts << " cap " << st.max_connections;
}

TEST_F(HttpServerTest, FloodBeyondTheCapIsShedForAFreshClient) {
  ASSERT_TRUE(test::EnsureFds(2 * 2400 + 256)) << "RLIMIT_NOFILE's hard limit is below the ~5,100 descriptors this test needs";
  HttpServerOptions o;
  o.max_connections = 256;
  StartServer(o);
  std::vector<std::unique_ptr<RawConn>> flood;
  FloodThenProbe(*server_, 300, 2000, flood);
  EXPECT_LE(server_->open_connections(), 256);
  EXPECT_GE(server_->connection_stats().shed, 2300 - 256);
}

TEST_F(HttpServerTest, IncompleteRequestTimesOut) {
  HttpServerOptions o;
  o.read_timeout_seconds = 0.2;
  StartServer(o);
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw("GET /hello HTTP/1.1\r\nHost: x\r\n"));  // never finished
  HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r));
  EXPECT_EQ(r.status, 408);
  EXPECT_TRUE(c.WaitClosed());
}

TEST_F(HttpServerTest, BindFailureNamesTheAddress) {
  StartServer();
  HttpServerOptions o;
  o.port = server_->port();
  HttpServer second(o, [](const HttpRequest&, HttpResponder& r) { r.Send(200, "text/plain", ""); });
  Status st = second.Start();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kIOError);
  EXPECT_NE(st.message().find("127.0.0.1:" + std::to_string(server_->port())), std::string::npos) << st.message();
}

TEST_F(HttpServerTest, StopClosesIdleConnectionsAndDrainsInFlight) {
  StartServer();
  HttpTestClient idle(server_->port());
  ASSERT_EQ(idle.Request("GET", "/hello").status, 200);

  HttpTestClient streaming(server_->port());
  ASSERT_TRUE(streaming.SendRaw(HttpTestClient::BuildRequest("GET", "/stream")));
  ASSERT_TRUE(first_sent_.Wait());
  std::thread stopper([&] { server_->Stop(30); });
  // The idle keep-alive connection is closed at once; the in-flight stream completes.
  EXPECT_TRUE(idle.WaitClosed());
  // A new client is refused at once (the listener is closed with the parked connections), not
  // left in the backlog until the process exits.
  HttpTestClient fresh(server_->port());
  EXPECT_FALSE(fresh.connected()) << "a connection during the drain was accepted into the backlog";
  release_.Open();
  HttpTestResponse r;
  ASSERT_TRUE(streaming.ReadResponse(&r));
  EXPECT_EQ(r.body, "firstchunk0chunk1chunk2");
  EXPECT_TRUE(streaming.WaitClosed());  // no keep-alive once stopping
  stopper.join();
  EXPECT_EQ(server_->open_connections(), 0);
}

TEST_F(HttpServerTest, StopAfterDrainTimeoutShutsSocketsDown) {
  StartServer();
  HttpTestClient c(server_->port());
  ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest("GET", "/until-gone")));
  ASSERT_TRUE(first_sent_.Wait());
  server_->Stop(0);  // the handler never finishes on its own; Stop must still return
  EXPECT_TRUE(saw_gone_);
  EXPECT_TRUE(c.WaitClosed());
}

TEST(HttpHeadersTest, CaseInsensitiveLookup) {
  HttpHeaders h;
  h.Add("Content-Type", "a");
  h.Add("X-Thing", "b");
  EXPECT_EQ(h.Get("content-type"), "a");
  EXPECT_EQ(h.Get("X-THING"), "b");
  EXPECT_EQ(h.Get("missing"), "");
  EXPECT_TRUE(h.Has("x-thing"));
  EXPECT_FALSE(h.Has("x-thin"));
  EXPECT_EQ(HttpReason(404), "Not Found");
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// Records what a handler or the router answered, without a socket.
class RecordingResponder : public HttpResponder {
 public:
  bool Send(int status, std::string_view, std::string body, const HttpHeaderList& extra) override {
    if (status_ != 0) return false;
    status_ = status;
    body_ = std::move(body);
    extra_ = extra;
    return true;
  }
  bool BeginStream(int status, std::string_view, const HttpHeaderList&) override { return Send(status, "", "", {}); }
  bool WriteChunk(std::string_view) override { return false; }
  bool EndStream() override { return false; }
  bool ClientGone() override { return false; }
  int status() const override { return status_; }
  const std::string& body() const { return body_; }
  std::string Header(std::string_view name) const {
    for (const auto& [k, v] : extra_) {
      if (k == name) return v;
    }
    return "";
  }

 private:
  int status_ = 0;
  std::string body_;
  HttpHeaderList extra_;
};

HttpRequest Req(std::string method, std::string path) {
  HttpRequest q;
  q.method = std::move(method);
  q.path = q.target = std::move(path);
  return q;
}

TEST(HttpRouterTest, PrefixRoutesHoldLongerPathsExactRoutesWinLongestPrefixNext) {
  HttpRouter router;
  auto answer = [](std::string body) {
    return [body](const HttpRequest& q, HttpResponder& r) { r.Send(200, "text/plain", body + " " + q.path); };
  };
  router.Handle("GET", "/v1/models", answer("list"));
  router.Handle("GET", "/v1/models/special", answer("exact"));
  router.HandlePrefix("GET", "/v1/models/", "/v1/models/{id}", answer("one"));
  router.HandlePrefix("HEAD", "/v1/models/", "/v1/models/{id}", answer("head"));
  router.HandlePrefix("GET", "/v1/", "/v1/{rest}", answer("v1"));
  router.HandlePrefix("GET", "/v1/models/x/", "/v1/models/x/{sub}", answer("deeper"));

  auto dispatch = [&](std::string method, std::string path, bool* matched = nullptr) {
    RecordingResponder r;
    router.Dispatch(Req(std::move(method), std::move(path)), r, matched);
    return std::make_pair(r.status(), r.body());
  };
  EXPECT_EQ(dispatch("GET", "/v1/models").second, "list /v1/models");
  EXPECT_EQ(dispatch("GET", "/v1/models/special").second, "exact /v1/models/special");
  EXPECT_EQ(dispatch("GET", "/v1/models/gpt-4o").second, "one /v1/models/gpt-4o");
  EXPECT_EQ(dispatch("HEAD", "/v1/models/gpt-4o").second, "head /v1/models/gpt-4o");
  EXPECT_EQ(dispatch("GET", "/v1/models/x/y").second, "deeper /v1/models/x/y");  // the longest prefix
  EXPECT_EQ(dispatch("GET", "/v1/other").second, "v1 /v1/other");
  // A prefix holds only longer paths: "/v1/" itself has no route.
  bool matched = true;
  EXPECT_EQ(dispatch("GET", "/v1/", &matched).first, 404);
  EXPECT_FALSE(matched);
  EXPECT_EQ(dispatch("GET", "/v2/models/a").first, 404);

  // Another method on a prefix route: 405 naming the prefix route's methods.
  RecordingResponder r;
  router.Dispatch(Req("POST", "/v1/models/gpt-4o"), r, &matched);
  EXPECT_TRUE(matched);
  EXPECT_EQ(r.status(), 405);
  EXPECT_EQ(r.Header("Allow"), "GET, HEAD");

  // Route names: exact paths as they are, prefix routes by their name, nothing else.
  EXPECT_EQ(router.RouteName("/v1/models"), "/v1/models");
  EXPECT_EQ(router.RouteName("/v1/models/anything-a-client-sends"), "/v1/models/{id}");
  EXPECT_EQ(router.RouteName("/v1/models/x/1"), "/v1/models/x/{sub}");
  EXPECT_EQ(router.RouteName("/elsewhere"), "");
  EXPECT_EQ(router.RouteLabel("/v1/models/anything-a-client-sends"), "/v1/models/{id}");
  EXPECT_EQ(router.RouteLabel("/elsewhere"), "other");
  EXPECT_EQ(router.RouteName("/v1/models/abc"), "/v1/models/{id}");
  EXPECT_EQ(router.RouteName("/v1/"), "");
}

TEST(HttpRouterTest, ReRegisteringAPrefixReplacesItsHandlerAndName) {
  HttpRouter router;
  router.HandlePrefix("GET", "/a/", "/a/{old}", [](const HttpRequest&, HttpResponder& r) { r.Send(200, "text/plain", "old"); });
  router.HandlePrefix("GET", "/a/", "/a/{new}", [](const HttpRequest&, HttpResponder& r) { r.Send(200, "text/plain", "new"); });
  RecordingResponder r;
  router.Dispatch(Req("GET", "/a/b"), r);
  EXPECT_EQ(r.body(), "new");
  EXPECT_EQ(router.RouteName("/a/b"), "/a/{new}");
}

}  // namespace
}  // namespace keel
