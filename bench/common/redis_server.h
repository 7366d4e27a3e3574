// A private redis-server for benchmarks: started on a free loopback port with persistence off,
// killed at the end. Header-only; benches include it by path.
#pragma once

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

namespace keel::bench {

// A loopback port that was free a moment ago (-1 when none could be bound).
inline int FreeLoopbackPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

inline pid_t StartRedis(const std::string& bin, int port) {
  pid_t pid = fork();
  if (pid == 0) {
    std::string p = std::to_string(port);
    execlp(bin.c_str(), bin.c_str(), "--port", p.c_str(), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
           "--loglevel", "warning", static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// True once the server answers PING (up to ~15 s).
inline bool WaitRedis(int port) {
  for (int i = 0; i < 100; ++i) {
    timeval tv{0, 200000};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c && !c->err) {
      auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
      bool ok = r && r->type == REDIS_REPLY_STATUS;
      if (r) freeReplyObject(r);
      redisFree(c);
      if (ok) return true;
    } else if (c) {
      redisFree(c);
    }
    usleep(50000);
  }
  return false;
}

inline void RedisFlush(int port) {
  redisContext* c = redisConnect("127.0.0.1", port);
  if (c && !c->err) {
    auto* r = static_cast<redisReply*>(redisCommand(c, "FLUSHALL"));
    if (r) freeReplyObject(r);
  }
  if (c) redisFree(c);
}

inline void StopRedis(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
}

}  // namespace keel::bench
