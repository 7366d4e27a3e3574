// HttpServer on a Unix-domain socket ("unix:/path"): serves requests, the file is mode 0600,
// a stale file is replaced, a live server or a non-socket file is refused, Stop removes it.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "keel/core/http_server.h"
#include "keel/core/socket.h"

namespace keel {
namespace {

std::string TempSocketPath(const char* tag) {
  return "/tmp/keel-core-" + std::string(tag) + "-" + std::to_string(::getpid()) + ".sock";
}

int ConnectUnix(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// One GET with Connection: close; returns everything the server wrote (bounded wait).
std::string Get(const std::string& path, const std::string& target) {
  int fd = ConnectUnix(path);
  if (fd < 0) return "";
  std::string req = "GET " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)!::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10000) <= 0) break;
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

HttpServerOptions UnixOptions(const std::string& path) {
  HttpServerOptions o;
  o.host = "unix:" + path;
  o.drain_seconds = 1;
  return o;
}

HttpHandler Echo() {
  return [](const HttpRequest& q, HttpResponder& r) { r.Send(200, "text/plain", "peer=" + q.remote + " path=" + q.path); };
}

TEST(UnixSocketTest, ServesRequestsAndIsOwnerOnly) {
  const std::string path = TempSocketPath("serve");
  HttpServer server(UnixOptions(path), Echo());
  ASSERT_TRUE(server.Start().ok());
  EXPECT_EQ(server.port(), 0);
  struct stat st{};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::string resp = Get(path, "/hello");
  EXPECT_NE(resp.find("HTTP/1.1 200"), std::string::npos) << resp;
  EXPECT_NE(resp.find("path=/hello"), std::string::npos) << resp;
  EXPECT_NE(resp.find("peer=unix:pid=" + std::to_string(::getpid())), std::string::npos) << resp;
  server.Stop();
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "Stop must remove the socket file";
}

TEST(UnixSocketTest, ReplacesStaleSocketFile) {
  const std::string path = TempSocketPath("stale");
  {
    // A listener that dies without cleanup leaves its file behind.
    Result<ListeningSocket> dead = ListenUnix(path, 4);
    ASSERT_TRUE(dead.ok()) << dead.status().ToString();
    ::close(dead->fd);
  }
  ASSERT_EQ(::access(path.c_str(), F_OK), 0);
  HttpServer server(UnixOptions(path), Echo());
  ASSERT_TRUE(server.Start().ok());
  EXPECT_NE(Get(path, "/x").find("200"), std::string::npos);
}

TEST(UnixSocketTest, RefusesLiveServerAndNonSocketFile) {
  const std::string path = TempSocketPath("live");
  HttpServer first(UnixOptions(path), Echo());
  ASSERT_TRUE(first.Start().ok());
  HttpServer second(UnixOptions(path), Echo());
  Status s = second.Start();
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos);
  EXPECT_NE(Get(path, "/still-first").find("200"), std::string::npos) << "the live server must keep its socket";
  first.Stop();

  const std::string file = TempSocketPath("plainfile");
  { std::ofstream(file) << "not a socket"; }
  HttpServer third(UnixOptions(file), Echo());
  EXPECT_EQ(third.Start().code(), StatusCode::kIOError);
  EXPECT_EQ(::access(file.c_str(), F_OK), 0) << "a regular file must never be removed";
  ::unlink(file.c_str());
}

TEST(UnixSocketTest, RejectsTooLongPath) {
  HttpServer server(UnixOptions("/tmp/" + std::string(200, 'x')), Echo());
  EXPECT_EQ(server.Start().code(), StatusCode::kInvalidArgument);
}

TEST(UnixSocketTest, StopDoesNotRemoveASuccessorsSocket) {
  const std::string path = TempSocketPath("succ");
  Result<ListeningSocket> old = ListenUnix(path, 4);
  ASSERT_TRUE(old.ok());
  ::unlink(path.c_str());  // someone removes the file; a successor takes the path over
  HttpServer successor(UnixOptions(path), Echo());
  ASSERT_TRUE(successor.Start().ok());
  UnlinkUnixSocket(*old);  // the old owner's cleanup, while its socket is still open
  ::close(old->fd);
  EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  EXPECT_NE(Get(path, "/x").find("200"), std::string::npos);
}

}  // namespace
}  // namespace keel
