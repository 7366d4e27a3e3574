#include "keel/core/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include <fmt/format.h>

#include <thread>

#include "keel/core/log.h"

namespace keel {

int MillisLeft(Deadline deadline) {
  if (deadline == Deadline::max()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
  if (left <= 0) return 0;
  return left > 2000000000 ? 2000000000 : static_cast<int>(left);
}

int PollFd(int fd, short events, int timeout_ms, short* revents) {
  pollfd p{fd, events, 0};
  for (;;) {
    int r = ::poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;  // timeout restarts; acceptable for our bounds
    if (revents) *revents = p.revents;
    return r;
  }
}

Result<ListeningSocket> ListenTcp(const std::string& host, int port, int backlog) {
  if (port < 0 || port > 65535) return Status::InvalidArgument(fmt::format("bad port {}", port));
  // An empty host would mean every interface (getaddrinfo's passive wildcard); an unset shell
  // variable must not expose a service, so that takes an explicit 0.0.0.0 or ::.
  if (host.empty()) {
    return Status::InvalidArgument("empty host: name the address to listen on (127.0.0.1 for this machine only, "
                                   "0.0.0.0 or :: for every interface)");
  }
  const std::string where = fmt::format("{}:{}", host, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(port);
  int gai = ::getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
  if (gai != 0) return Status::IOError(fmt::format("cannot resolve {}: {}", where, gai_strerror(gai)));
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, backlog) == 0) break;
    last_error = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) return Status::IOError(fmt::format("cannot listen on {}: {}", where, last_error));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  ListeningSocket out;
  out.fd = fd;
  out.port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return out;
}

Result<ListeningSocket> ListenUnix(const std::string& path, int backlog) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(fmt::format("unix socket path '{}' must have 1..{} bytes", path,
                                               sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const auto* sa = reinterpret_cast<const sockaddr*>(&addr);
  const socklen_t sa_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return Status::IOError(fmt::format("cannot listen on unix:{}: exists and is not a socket", path));
    int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    const bool live = probe >= 0 && (::connect(probe, sa, sa_len) == 0 || errno == EAGAIN);  // EAGAIN: backlog full
    if (probe >= 0) ::close(probe);
    if (live) return Status::IOError(fmt::format("cannot listen on unix:{}: another server is accepting there", path));
    ::unlink(path.c_str());  // stale: its server died without cleaning up
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::IOError(fmt::format("cannot listen on unix:{}: socket: {}", path, std::strerror(errno)));
  // Connecting needs write permission on the file; until listen() nobody can connect at all, so
  // tightening the mode between bind and listen leaves no window for other users.
  if (::bind(fd, sa, sa_len) != 0 || ::chmod(path.c_str(), 0600) != 0 || ::lstat(path.c_str(), &st) != 0 ||
      ::listen(fd, backlog) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    return Status::IOError(fmt::format("cannot listen on unix:{}: {}", path, err));
  }
  ListeningSocket out;
  out.fd = fd;
  out.unix_path = path;
  out.unix_dev = static_cast<uint64_t>(st.st_dev);
  out.unix_ino = static_cast<uint64_t>(st.st_ino);
  return out;
}

void UnlinkUnixSocket(const ListeningSocket& socket) {
  if (socket.unix_path.empty()) return;
  struct stat st{};
  if (::lstat(socket.unix_path.c_str(), &st) != 0) return;
  if (static_cast<uint64_t>(st.st_dev) == socket.unix_dev && static_cast<uint64_t>(st.st_ino) == socket.unix_ino) {
    ::unlink(socket.unix_path.c_str());
  }
}

Result<int> ConnectTcp(const std::string& host, int port, int timeout_ms) {
  const std::string where = fmt::format("{}:{}", host, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(port);
  int gai = ::getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
  if (gai != 0) return Status::Unavailable(fmt::format("cannot resolve {}: {}", where, gai_strerror(gai)));
  const Deadline deadline = DeadlineIn(timeout_ms);
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int r = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      short rev = 0;
      int p = PollFd(fd, POLLOUT, MillisLeft(deadline), &rev);
      int err = 0;
      socklen_t len = sizeof(err);
      if (p > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (p > 0 && err == 0) r = 0;
      else last_error = p == 0 ? "connect timed out" : std::strerror(p < 0 ? errno : err);
    } else if (r != 0) {
      last_error = std::strerror(errno);
    }
    if (r == 0) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      break;
    }
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) return Status::Unavailable(fmt::format("cannot connect to {}: {}", where, last_error));
  return fd;
}

Status ReadFull(int fd, void* buf, size_t n, Deadline deadline) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return Status::Unavailable("connection closed by peer");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Status::Unavailable(fmt::format("recv: {}", std::strerror(errno)));
    int pr = PollFd(fd, POLLIN, MillisLeft(deadline));
    if (pr == 0) return Status::Unavailable("read timed out");
    if (pr < 0) return Status::Unavailable(fmt::format("poll: {}", std::strerror(errno)));
  }
  return Status::Ok();
}

Status WriteFullV(int fd, iovec* iov, int count, Deadline deadline) {
  while (count > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --count;
      continue;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(std::min(count, IOV_MAX));
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return Status::Unavailable(fmt::format("send: {}", std::strerror(errno)));
      int pr = PollFd(fd, POLLOUT, MillisLeft(deadline));
      if (pr == 0) return Status::Unavailable("write timed out");
      if (pr < 0) return Status::Unavailable(fmt::format("poll: {}", std::strerror(errno)));
      continue;
    }
    size_t left = static_cast<size_t>(w);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0 && left > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return Status::Ok();
}

AcceptResult AcceptConnection(int listen_fd, int wake_fd, int poll_ms, const char* tag, int* fd, std::string* peer) {
  pollfd fds[2] = {{listen_fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
  int r = ::poll(fds, 2, poll_ms);
  if (r < 0 && errno != EINTR) {
    Log().error("{}: poll: {}", tag, std::strerror(errno));
    return AcceptResult::kStop;
  }
  if (r > 0 && fds[1].revents) return AcceptResult::kStop;
  if (r <= 0 || !(fds[0].revents & POLLIN)) return AcceptResult::kNone;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  int c = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
  if (c < 0) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      Log().warn("{}: accept: {}", tag, std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return AcceptResult::kNone;
  }
  if (ss.ss_family == AF_UNIX) {
    ucred cred{};
    socklen_t cred_len = sizeof(cred);
    *peer = ::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) == 0
                ? fmt::format("unix:pid={},uid={}", cred.pid, cred.uid)
                : "unix";
  } else {
    int one = 1;
    ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    *peer = PeerName(ss);
  }
  *fd = c;
  return AcceptResult::kAccepted;
}

std::string PeerName(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return fmt::format("{}:{}", host, ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
  }
  return "unknown";
}

void LingeringClose(int fd, int max_ms) {
  ::shutdown(fd, SHUT_WR);
  const Deadline deadline = DeadlineIn(max_ms);
  char buf[16384];
  size_t drained = 0;
  while (drained < (64u << 20)) {
    int left = MillisLeft(deadline);
    if (left <= 0) break;
    if (PollFd(fd, POLLIN, left) <= 0) break;
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
}

}  // namespace keel
