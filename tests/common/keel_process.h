// What the end-to-end tests that start real `keel` servers share (tests/gateway, tests/answer):
// a child process running `keel <args>`, waiting with a bound, reading a log, and the gateway
// policy service's admin API over its Unix socket. KEEL_BINARY is defined by the test target.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

namespace keel::test {

// `keel <args>` in a child shell, stdout and stderr appended to `log_path`; SIGKILLed on
// destruction (Terminate stops it gracefully first where a test needs that).
class KeelProcess {
 public:
  KeelProcess() = default;
  KeelProcess(const KeelProcess&) = delete;
  KeelProcess& operator=(const KeelProcess&) = delete;
  ~KeelProcess() { Kill(); }

  void Start(const std::string& args, const std::string& log_path) {
    const std::string cmd = std::string("exec ") + KEEL_BINARY + " " + args + " >>" + log_path + " 2>&1";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  pid_t pid() const { return pid_; }
  void Kill() { Stop(SIGKILL); }
  void Terminate() { Stop(SIGTERM); }

 private:
  void Stop(int sig) {
    if (pid_ > 0) {
      ::kill(pid_, sig);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  pid_t pid_ = -1;
};

// Polls `ready` every 20 ms for up to `ms`: a bound on start-up, not a timing assertion.
inline bool WaitFor(const std::function<bool()>& ready, int ms = 30000) {
  for (int i = 0; i < ms / 20; ++i) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ready();
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// curl over the policy service's Unix socket (its admin API): the status and the body. The
// request body, if any, goes through a temporary file (popen is one-directional).
inline std::pair<int, std::string> PolicyAdmin(const std::string& socket, const std::string& admin_key,
                                               const std::string& method, const std::string& path,
                                               const std::string& body = "") {
  std::string cmd = "curl -s -o - -w '\\n%{http_code}' --max-time 10 --unix-socket " + socket + " -X " + method +
                    " -H 'Authorization: Bearer " + admin_key + "' -H 'Content-Type: application/json'";
  char tmpl[] = "/tmp/keel-policy-admin-XXXXXX";
  bool tmp = false;
  if (!body.empty()) {
    const int fd = ::mkstemp(tmpl);
    if (fd < 0) return {0, "mkstemp failed"};
    tmp = true;
    const bool wrote = ::write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size());
    ::close(fd);
    if (!wrote) {
      ::unlink(tmpl);
      return {0, "writing the request body failed"};
    }
    cmd += std::string(" --data-binary @") + tmpl;
  }
  cmd += " 'http://localhost" + path + "'";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = ::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  if (tmp) ::unlink(tmpl);
  const size_t nl = out.rfind('\n');
  if (nl == std::string::npos) return {0, out};
  return {std::atoi(out.c_str() + nl + 1), out.substr(0, nl)};
}

}  // namespace keel::test
