// Child processes for side-by-side benchmarks: `keel <args>` started with its output in a log
// file and killed with the driver (PR_SET_PDEATHSIG), a free loopback port, a log's tail.
// Header-only; benchmarks only.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

namespace keel::bench {

using Clock = std::chrono::steady_clock;

inline double MsSince(Clock::time_point t0, Clock::time_point t1 = Clock::now()) {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}
inline void SleepMs(double ms) { std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(ms * 1000))); }


// `keel <args>` with stdout and stderr appended to a log. Started and stopped from the main
// thread only: PR_SET_PDEATHSIG fires when the *thread* that forked exits.
class Child {
 public:
  Child(std::string keel, std::vector<std::string> args, std::string log)
      : keel_(std::move(keel)), args_(std::move(args)), log_(std::move(log)) {}
  ~Child() { Kill9(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  bool Start() {
    std::vector<std::string> argv = {keel_};
    argv.insert(argv.end(), args_.begin(), args_.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    const int log_fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) return false;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the driver
      ::dup2(log_fd, 1);
      ::dup2(log_fd, 2);
      ::execv(cargv[0], cargv.data());
      const char msg[] = "bench: exec of the keel binary failed\n";
      (void)!::write(2, msg, sizeof msg - 1);
      ::_exit(127);
    }
    ::close(log_fd);
    return pid_ > 0;
  }
  // SIGKILL and reap: the crash under test.
  void Kill9() { Signal(SIGKILL); }
  void Signal(int sig) {
    if (pid_ > 0) {
      ::kill(pid_, sig);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  bool Exited() {
    if (pid_ <= 0) return true;
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return true;
    }
    return false;
  }
  // Starts and waits until `ready` (60 s at most). A child that exits first is started again,
  // twice at most: the binary may be being relinked by a concurrent build (exec fails).
  bool StartReady(const std::function<bool()>& ready) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (!Start()) return false;
      const auto t0 = Clock::now();
      while (MsSince(t0) < 60000) {
        if (ready()) return true;
        if (Exited()) break;
        SleepMs(20);
      }
      if (pid_ > 0) return false;  // alive but never ready
      SleepMs(2000);
    }
    return false;
  }
  const std::string& log() const { return log_; }

 private:
  std::string keel_;
  std::vector<std::string> args_;
  std::string log_;
  pid_t pid_ = -1;
};

inline std::string Tail(const std::string& path, size_t bytes = 2000) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

inline int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace keel::bench
