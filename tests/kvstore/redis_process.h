// A real redis-server for tests. scripts/test starts one and exports KEEL_REDIS_URL=host:port;
// without it (a test binary run by hand) the fixture starts a private redis-server on a free
// loopback port and stops it on destruction. No Redis binary and no URL is a failure, never a
// skip: the Redis tier is part of what the tests must cover.
//
// Tests sharing one server keep apart by key prefix (UniquePrefix), never by FLUSHALL.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>

namespace keel::test {

inline int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

inline bool PortAccepts(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

class RedisProcess {
 public:
  // extra_args: appended to the redis-server command line (e.g. "--cluster-enabled yes").
  explicit RedisProcess(const std::string& extra_args = "", bool force_private = false) {
    const char* url = std::getenv("KEEL_REDIS_URL");
    if (!force_private && extra_args.empty() && url != nullptr && *url != '\0') {
      std::string u = url;
      size_t colon = u.rfind(':');
      host_ = u.substr(0, colon);
      port_ = std::atoi(u.substr(colon + 1).c_str());
      return;
    }
    port_ = FreeLoopbackPort();
    dir_ = "/tmp/keel-redis-" + std::to_string(::getpid()) + "-" + std::to_string(port_);
    std::string cmd = "mkdir -p " + dir_ + " && cd " + dir_ +
                      " && exec redis-server --bind 127.0.0.1 --port " + std::to_string(port_) +
                      " --save '' --appendonly no --daemonize no --loglevel warning " + extra_args;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 200 && !PortAccepts(port_); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ~RedisProcess() { Stop(); }
  RedisProcess(const RedisProcess&) = delete;
  RedisProcess& operator=(const RedisProcess&) = delete;

  bool ok() const { return port_ > 0 && PortAccepts(port_); }
  const std::string& host() const { return host_; }
  int port() const { return port_; }
  bool owned() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }  // a private server's (-1 for the shared one)
  // Kills a private server (to test "Redis went away"); no-op for the shared one.
  void Stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
      std::string rm = "rm -rf " + dir_;
      (void)std::system(rm.c_str());
    }
  }

 private:
  std::string host_ = "127.0.0.1";
  int port_ = -1;
  pid_t pid_ = -1;
  std::string dir_;
};

// Sends one inline command to a Redis server and returns its first reply line.
inline std::string RedisCommand(int port, const std::string& command) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string line = command + "\r\n";
    if (::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size())) {
      char buf[256];
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n > 0) reply.assign(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return reply;
}

// A key prefix no other test process uses.
inline std::string UniquePrefix(const std::string& tag) {
  std::random_device rd;
  return "keeltest:" + tag + ":" + std::to_string(::getpid()) + ":" + std::to_string(rd()) + ":";
}

}  // namespace keel::test
