#include "keel/core/signal.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

namespace keel {
namespace {

std::atomic<int> g_signal_write_fd{-1};

// Async-signal-safe: only write() to a pipe the waiting thread reads.
void OnShutdownSignal(int sig) {
  int saved = errno;
  int fd = g_signal_write_fd.load();
  if (fd >= 0) {
    unsigned char b = static_cast<unsigned char>(sig);
    (void)!::write(fd, &b, 1);
  }
  errno = saved;
}

}  // namespace

const char* SignalName(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  return "signal";
}

Result<int> WaitForTerminationSignal() {
  static std::mutex busy;
  std::unique_lock<std::mutex> guard(busy, std::try_to_lock);
  if (!guard.owns_lock()) return Status::Internal("another thread is already waiting for a termination signal");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::Internal(std::string("pipe: ") + std::strerror(errno));
  g_signal_write_fd = fds[1];
  struct sigaction sa {}, old_int{}, old_term{};
  sa.sa_handler = OnShutdownSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (::sigaction(SIGINT, &sa, &old_int) != 0 || ::sigaction(SIGTERM, &sa, &old_term) != 0) {
    g_signal_write_fd = -1;
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::Internal(std::string("sigaction: ") + std::strerror(errno));
  }
  unsigned char sig = 0;
  for (;;) {
    ssize_t n = ::read(fds[0], &sig, 1);
    if (n == 1) break;
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  g_signal_write_fd = -1;
  ::close(fds[0]);
  ::close(fds[1]);
  return static_cast<int>(sig);
}

}  // namespace keel
