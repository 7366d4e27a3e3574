// DelayProxy: a loopback TCP proxy that holds every chunk of bytes for a fixed time before
// forwarding it, in both directions — a stand-in for a network round trip where `tc netem`
// cannot add one (this machine's kernel has no sch_netem). A request/response exchange through it
// gains about 2 x delay. Benchmarks only; header-only; two threads per proxied connection.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace keel::bench {

class DelayProxy {
 public:
  // Listens on 127.0.0.1:<any free port> and forwards to upstream_host:upstream_port (an IPv4
  // address: another network namespace's veth end, say).
  DelayProxy(int upstream_port, std::chrono::microseconds delay, const char* upstream_host = "127.0.0.1")
      : upstream_(upstream_port), delay_(delay) {
    ::inet_pton(AF_INET, upstream_host, &upstream_addr_);
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(listen_fd_, 64) != 0) {
      close(listen_fd_);
      listen_fd_ = -1;
      return;
    }
    socklen_t len = sizeof a;
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~DelayProxy() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    if (listen_fd_ >= 0) close(listen_fd_);
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    for (auto& t : pumps_) t.join();
    for (int fd : fds_) close(fd);
  }
  DelayProxy(const DelayProxy&) = delete;
  DelayProxy& operator=(const DelayProxy&) = delete;

  bool ok() const { return listen_fd_ >= 0; }
  int port() const { return port_; }

 private:
  void Accept() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      int client = accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      int server = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr = upstream_addr_;
      a.sin_port = htons(static_cast<uint16_t>(upstream_));
      if (connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        close(client);
        close(server);
        continue;
      }
      int one = 1;
      setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(client);
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server] { Pump(client, server); });
      pumps_.emplace_back([this, server, client] { Pump(server, client); });
    }
  }

  // Forwards from -> to, each chunk `delay` after it was read. Bytes that arrive meanwhile are
  // read after it, so a burst's later bytes may wait up to twice as long (fine for the
  // request/response traffic of a Redis tier).
  void Pump(int from, int to) {
    std::vector<char> buf(1 << 16);
    while (!stop_) {
      ssize_t n = read(from, buf.data(), buf.size());
      if (n <= 0) break;
      std::this_thread::sleep_until(std::chrono::steady_clock::now() + delay_);
      for (ssize_t off = 0; off < n;) {
        ssize_t w = write(to, buf.data() + off, static_cast<size_t>(n - off));
        if (w <= 0) return;
        off += w;
      }
    }
    shutdown(to, SHUT_WR);
  }

  int upstream_;
  in_addr upstream_addr_{};
  std::chrono::microseconds delay_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
};

}  // namespace keel::bench
