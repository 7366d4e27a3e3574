// HttpClient and CallPool against real HTTP servers on loopback.
#include "keel/core/http_client.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

namespace keel {
namespace {

TEST(ParseHttpUrlTest, AcceptsHostPortOnly) {
  auto u = ParseHttpUrl("http://127.0.0.1:7410");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->host, "127.0.0.1");
  EXPECT_EQ(u->port, 7410);
  EXPECT_TRUE(ParseHttpUrl("http://replica-a.local:80/").ok());
  EXPECT_EQ(ParseHttpUrl("http://[::1]:7410")->host, "::1");
  for (const char* bad : {"https://h:1", "h:1", "http://h", "http://h:0", "http://h:70000", "http://h:1/v1", "http://u@h:1", "http://:1"}) {
    EXPECT_FALSE(ParseHttpUrl(bad).ok()) << bad;
  }
}

class HttpClientTest : public ::testing::Test {
 protected:
  void Serve(HttpHandler handler, HttpServerOptions o = {}) {
    o.host = "127.0.0.1";
    o.port = 0;
    server_ = std::make_unique<HttpServer>(o, std::move(handler));
    ASSERT_TRUE(server_->Start().ok());
  }
  HttpEndpoint endpoint() const { return {"127.0.0.1", server_->port()}; }
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpClientTest, SendsExtraHeadersAndRefusesInjectedOnes) {
  Serve([&](const HttpRequest& req, HttpResponder& res) {
    res.Send(200, "text/plain", std::string(req.headers.Get("authorization")) + "|" + std::string(req.headers.Get("x-two")) +
                                    "|" + (req.headers.Has("x-evil") ? "evil" : "clean"));
  });
  HttpClient client(endpoint());
  auto r = client.Call("GET", "/", "", "", DeadlineIn(5000), {{"Authorization", "Bearer abc"}, {"X-Two", "2"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->body, "Bearer abc|2|clean");
  for (const HttpHeaderList& bad : {HttpHeaderList{{"Authorization", "x\r\nX-Evil: 1"}}, HttpHeaderList{{"X-Evil: 1\r\nA", "b"}},
                                    HttpHeaderList{{"", "b"}}, HttpHeaderList{{"A:B", "c"}}}) {
    auto refused = client.Call("GET", "/", "", "", DeadlineIn(5000), bad);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  }
  // The connection is still usable after the refusals (nothing was sent).
  auto again = client.Call("GET", "/", "", "", DeadlineIn(5000));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->body, "||clean");
}

TEST_F(HttpClientTest, KeepsConnectionsAlive) {
  std::mutex mu;
  std::set<std::string> peers;
  Serve([&](const HttpRequest& req, HttpResponder& res) {
    {
      std::lock_guard lock(mu);
      peers.insert(req.remote);
    }
    res.Send(req.path == "/echo" ? 200 : 404, "text/plain", req.method + " " + req.body);
  });
  HttpClient client(endpoint());
  for (int i = 0; i < 5; ++i) {
    auto r = client.Call("POST", "/echo", "x" + std::to_string(i), "text/plain", DeadlineIn(5000));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "POST x" + std::to_string(i));
    EXPECT_EQ(r->headers.Get("content-type"), "text/plain");
  }
  auto missing = client.Call("GET", "/nope", "", "", DeadlineIn(5000));
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->status, 404);  // any HTTP status is an answer
  std::lock_guard lock(mu);
  EXPECT_EQ(peers.size(), 1u);  // six calls, one connection
}

TEST_F(HttpClientTest, ReconnectsWhenTheServerClosedAnIdleConnection) {
  std::atomic<int> calls{0};
  HttpServerOptions o;
  o.idle_timeout_seconds = 0.1;
  Serve([&](const HttpRequest&, HttpResponder& res) {
    ++calls;
    res.Send(200, "text/plain", "ok");
  }, o);
  HttpClient client(endpoint());
  ASSERT_TRUE(client.Call("GET", "/", "", "", DeadlineIn(5000)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the server closes the pooled one
  auto r = client.Call("GET", "/", "", "", DeadlineIn(5000));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->body, "ok");
  EXPECT_EQ(calls.load(), 2);
}

TEST_F(HttpClientTest, SilentPeerFailsAtTheDeadline) {
  // Listens (so the connect completes in the kernel) but never reads or answers.
  auto listener = ListenTcp("127.0.0.1", 0, 16);
  ASSERT_TRUE(listener.ok());
  HttpClient client({"127.0.0.1", listener->port});
  const auto t0 = std::chrono::steady_clock::now();
  auto r = client.Call("GET", "/", "", "", DeadlineIn(200));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("deadline"), std::string::npos) << r.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));  // bounded, not hung
  ::close(listener->fd);
}

TEST_F(HttpClientTest, PeerThatDiesBeforeAnsweringIsUnavailableNotACrash) {
  // Accepts, reads the request, closes without a byte of response (a replica killed mid-query),
  // then once more after half a status line.
  auto listener = ListenTcp("127.0.0.1", 0, 16);
  ASSERT_TRUE(listener.ok());
  std::thread peer([fd = listener->fd] {
    for (const char* reply : {"", "HTTP/1.1 20"}) {
      const int c = ::accept(fd, nullptr, nullptr);
      if (c < 0) return;
      char buf[4096];
      (void)!::read(c, buf, sizeof buf);
      (void)!::write(c, reply, std::strlen(reply));
      ::close(c);
    }
  });
  HttpClient client({"127.0.0.1", listener->port});
  for (int i = 0; i < 2; ++i) {
    auto r = client.Call("POST", "/v1/search", "{}", "application/json", DeadlineIn(5000));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
    EXPECT_NE(r.status().message().find("closed"), std::string::npos) << r.status().message();
  }
  peer.join();
  ::close(listener->fd);
}

TEST_F(HttpClientTest, RefusedAndOversizedAnswersFail) {
  Serve([](const HttpRequest&, HttpResponder& res) { res.Send(200, "text/plain", std::string(1 << 20, 'x')); });
  HttpClientOptions small;
  small.max_response_bytes = 64 << 10;
  HttpClient client(endpoint(), small);
  auto r = client.Call("GET", "/", "", "", DeadlineIn(5000));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(client.Address()), std::string::npos) << r.status().message();
  HttpClient big(endpoint());
  auto ok = big.Call("GET", "/", "", "", DeadlineIn(5000));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->body.size(), size_t{1} << 20);
  const int port = server_->port();
  server_->Stop();
  HttpClient gone({"127.0.0.1", port});
  EXPECT_EQ(gone.Call("GET", "/", "", "", DeadlineIn(5000)).status().code(), StatusCode::kUnavailable);
}

// A streamed call hands each piece over as it arrives: the server sends its second chunk only
// after the client has seen the first, so a client that waited for the whole body would never
// get it (the server gives up after 20 s and the test fails on `first_seen_before_end`).
TEST_F(HttpClientTest, StreamingHandsEachChunkOverAsItArrives) {
  std::mutex mu;
  std::condition_variable cv;
  bool first_seen = false;
  std::atomic<bool> first_seen_before_end{false};
  Serve([&](const HttpRequest&, HttpResponder& res) {
    ASSERT_TRUE(res.BeginStream(200, "text/event-stream", {{"X-Kind", "sse"}}));
    res.WriteChunk("data: one\n\n");
    {
      std::unique_lock lock(mu);
      first_seen_before_end = cv.wait_for(lock, std::chrono::seconds(20), [&] { return first_seen; });
    }
    res.WriteChunk("data: two\n\n");
    res.EndStream();
  });
  HttpClient client(endpoint());
  int head_status = 0;
  std::string kind, got;
  HttpStreamSink sink;
  sink.on_head = [&](int status, const HttpHeaders& h) {
    head_status = status;
    kind = std::string(h.Get("x-kind"));
    return true;
  };
  sink.on_body = [&](std::string_view bytes) {
    got.append(bytes);
    if (got.find("data: one\n\n") != std::string::npos) {
      std::lock_guard lock(mu);
      first_seen = true;
      cv.notify_all();
    }
    return true;
  };
  auto r = client.CallStreaming("POST", "/v1/chat/completions", "{}", "application/json", DeadlineIn(60000), sink);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, 200);
  EXPECT_EQ(head_status, 200);
  EXPECT_EQ(kind, "sse");
  EXPECT_EQ(got, "data: one\n\ndata: two\n\n");
  EXPECT_TRUE(first_seen_before_end.load());
  // The connection went back to the pool and carries a plain call.
  auto again = client.Call("GET", "/", "", "", DeadlineIn(5000));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
}

// A Content-Length body streams too, in pieces that add up to it; the response limit bounds the
// streamed body as it bounds a whole one; a non-200 status is handed over like any other.
TEST_F(HttpClientTest, StreamingBoundsTheBodyAndPassesAnyStatus) {
  Serve([](const HttpRequest& req, HttpResponder& res) {
    res.Send(req.target == "/big" ? 200 : 404, "text/plain", std::string(req.target == "/big" ? 1 << 20 : 7, 'x'));
  });
  HttpClient client(endpoint());
  size_t bytes = 0, pieces = 0;
  HttpStreamSink sink;
  sink.on_body = [&](std::string_view b) {
    bytes += b.size();
    ++pieces;
    return true;
  };
  auto r = client.CallStreaming("GET", "/big", "", "", DeadlineIn(5000), sink);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(bytes, size_t{1} << 20);
  EXPECT_GT(pieces, 1u);
  bytes = 0;
  auto missing = client.CallStreaming("GET", "/nope", "", "", DeadlineIn(5000), sink);
  ASSERT_TRUE(missing.ok()) << missing.status().ToString();
  EXPECT_EQ(*missing, 404);
  EXPECT_EQ(bytes, 7u);
  HttpClientOptions small;
  small.max_response_bytes = 64 << 10;
  HttpClient bounded(endpoint(), small);
  bytes = 0;
  auto over = bounded.CallStreaming("GET", "/big", "", "", DeadlineIn(5000), sink);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kUnavailable);
  EXPECT_LE(bytes, size_t{64} << 10);
}

// A sink that returns false stops the call (Cancelled, the connection closed, no retry); a peer
// that dies inside a chunked body is Unavailable after the bytes it did send.
TEST_F(HttpClientTest, StreamingStopsOnTheSinksWordAndOnATruncatedBody) {
  std::atomic<int> calls{0};
  Serve([&](const HttpRequest&, HttpResponder& res) {
    ++calls;
    res.BeginStream(200, "text/event-stream");
    for (int i = 0; i < 50 && res.WriteChunk("data: x\n\n"); ++i) {
    }
    res.EndStream();
  });
  HttpClient client(endpoint());
  HttpStreamSink stop_at_head;
  stop_at_head.on_head = [](int, const HttpHeaders&) { return false; };
  auto r = client.CallStreaming("GET", "/", "", "", DeadlineIn(5000), stop_at_head);
  EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status().ToString();
  EXPECT_EQ(calls.load(), 1);
  auto again = client.Call("GET", "/", "", "", DeadlineIn(5000));
  EXPECT_TRUE(again.ok()) << again.status().ToString();

  auto listener = ListenTcp("127.0.0.1", 0, 16);
  ASSERT_TRUE(listener.ok());
  std::thread peer([fd = listener->fd] {
    const int c = ::accept(fd, nullptr, nullptr);
    if (c < 0) return;
    char buf[4096];
    (void)!::read(c, buf, sizeof buf);
    const char* reply =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        "b\r\ndata: a\n\n\r\n20\r\ndata: cut";
    (void)!::write(c, reply, std::strlen(reply));
    ::close(c);
  });
  HttpClient dying({"127.0.0.1", listener->port});
  std::string got;
  HttpStreamSink keep;
  keep.on_body = [&](std::string_view b) {
    got.append(b);
    return true;
  };
  auto cut = dying.CallStreaming("GET", "/", "", "", DeadlineIn(5000), keep);
  peer.join();
  ::close(listener->fd);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.status().code(), StatusCode::kUnavailable) << cut.status().ToString();
  EXPECT_EQ(got.rfind("data: a\n\n", 0), 0u) << got;
}

TEST_F(HttpClientTest, RunAllCallsConcurrently) {
  std::atomic<int> in_flight{0}, most{0};
  Serve([&](const HttpRequest&, HttpResponder& res) {
    const int now = ++in_flight;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    --in_flight;
    res.Send(200, "text/plain", "ok");
  });
  HttpClient client(endpoint());
  CallPool pool(8);
  std::vector<int> status(6, 0);
  pool.RunAll(6, [&](int i) {
    auto r = client.Call("GET", "/", "", "", DeadlineIn(10000));
    status[static_cast<size_t>(i)] = r.ok() ? r->status : -1;
  });
  EXPECT_EQ(status, std::vector<int>(6, 200));
  EXPECT_EQ(most.load(), 6);  // all six were in the server at once
}

}  // namespace
}  // namespace keel
