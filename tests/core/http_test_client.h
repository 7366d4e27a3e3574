// A deliberately small HTTP/1.1 client over a raw socket, for tests: it sends exactly the bytes
// a test asks for (including malformed ones) and parses responses itself, so it shares no code
// with the server under test. Every read is bounded by a timeout, so a broken server fails a
// test instead of hanging it. Not thread-safe; one client per thread.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::test {

// Raises RLIMIT_NOFILE's soft limit to the hard one; true when at least `need` descriptors fit.
inline bool EnsureFds(rlim_t need) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return false;
  if (rl.rlim_cur < need && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
    ::getrlimit(RLIMIT_NOFILE, &rl);
  }
  return rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= need;
}


struct HttpTestResponse {
  int status = 0;  // 0 when no response could be read
  std::string reason;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;                 // de-chunked
  std::vector<std::string> chunks;  // chunk payloads when chunked
  bool chunked = false;

  std::string Header(std::string_view name) const {
    for (const auto& [k, v] : headers) {
      if (k.size() == name.size() && ::strncasecmp(k.data(), name.data(), k.size()) == 0) return v;
    }
    return "";
  }
};

class HttpTestClient {
 public:
  explicit HttpTestClient(int port, double timeout_seconds = 60) : timeout_ms_(static_cast<int>(timeout_seconds * 1000)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
    int one = 1;
    if (fd_ >= 0) ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~HttpTestClient() { Close(); }
  HttpTestClient(const HttpTestClient&) = delete;
  HttpTestClient& operator=(const HttpTestClient&) = delete;

  bool connected() const { return fd_ >= 0; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // Half-closes: the server sees end-of-stream after what was sent.
  void ShutdownWrite() {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_WR);
  }

  bool SendRaw(std::string_view data) {
    while (!data.empty()) {
      if (fd_ < 0) return false;
      ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  static std::string BuildRequest(std::string_view method, std::string_view target, std::string_view body = {},
                                  std::string_view content_type = "application/json",
                                  const std::vector<std::pair<std::string, std::string>>& extra = {}) {
    std::string r = std::string(method) + " " + std::string(target) + " HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    for (const auto& [k, v] : extra) r += k + ": " + v + "\r\n";
    if (!body.empty() || method == "POST") {
      if (!content_type.empty()) r += "Content-Type: " + std::string(content_type) + "\r\n";
      r += "Content-Length: " + std::to_string(body.size()) + "\r\n";
    }
    r += "\r\n";
    r += body;
    return r;
  }

  // Sends one request and reads its response (status 0 on failure).
  HttpTestResponse Request(std::string_view method, std::string_view target, std::string_view body = {},
                           const std::function<bool(std::string_view)>& on_chunk = {}) {
    HttpTestResponse res;
    if (!SendRaw(BuildRequest(method, target, body))) return res;
    ReadResponse(&res, on_chunk);
    return res;
  }

  // Reads one response (skipping 1xx). `on_chunk` sees each chunk as it arrives; returning false
  // stops reading (the response is then incomplete). False on timeout, EOF or garbage.
  bool ReadResponse(HttpTestResponse* out, const std::function<bool(std::string_view)>& on_chunk = {}) {
    if (!ReadHead(out)) return false;
    return ReadBody(out, on_chunk);
  }

  // Reads one response's status line and headers (skipping 1xx), not its body: for an answer to
  // HEAD, whose Content-Length announces a body that is not sent.
  bool ReadHead(HttpTestResponse* out) {
    for (;;) {
      *out = HttpTestResponse();
      size_t end;
      while ((end = buf_.find("\r\n\r\n")) == std::string::npos) {
        if (!Fill()) return false;
      }
      std::string head = buf_.substr(0, end);
      buf_.erase(0, end + 4);
      size_t line_end = head.find("\r\n");
      std::string status_line = head.substr(0, line_end);
      // "HTTP/1.1 200 OK"
      size_t sp = status_line.find(' ');
      if (sp == std::string::npos) return false;
      out->status = std::atoi(status_line.c_str() + sp + 1);
      size_t sp2 = status_line.find(' ', sp + 1);
      if (sp2 != std::string::npos) out->reason = status_line.substr(sp2 + 1);
      size_t pos = line_end == std::string::npos ? head.size() : line_end + 2;
      while (pos < head.size()) {
        size_t e = head.find("\r\n", pos);
        if (e == std::string::npos) e = head.size();
        std::string line = head.substr(pos, e - pos);
        size_t colon = line.find(':');
        if (colon != std::string::npos) {
          std::string v = line.substr(colon + 1);
          while (!v.empty() && v.front() == ' ') v.erase(0, 1);
          out->headers.emplace_back(line.substr(0, colon), v);
        }
        pos = e + 2;
      }
      if (out->status >= 100 && out->status < 200) continue;
      return true;
    }
  }

 private:
  bool ReadBody(HttpTestResponse* out, const std::function<bool(std::string_view)>& on_chunk) {
    std::string te = out->Header("Transfer-Encoding");
    if (te.find("chunked") != std::string::npos) {
      out->chunked = true;
      for (;;) {
        size_t e;
        while ((e = buf_.find("\r\n")) == std::string::npos) {
          if (!Fill()) return false;
        }
        size_t size = std::strtoul(buf_.substr(0, e).c_str(), nullptr, 16);
        buf_.erase(0, e + 2);
        while (buf_.size() < size + 2) {
          if (!Fill()) return false;
        }
        std::string data = buf_.substr(0, size);
        buf_.erase(0, size + 2);
        if (size == 0) return true;
        out->body += data;
        out->chunks.push_back(data);
        if (on_chunk && !on_chunk(data)) return false;
      }
    }
    std::string cl = out->Header("Content-Length");
    if (!cl.empty()) {
      size_t n = std::strtoul(cl.c_str(), nullptr, 10);
      while (buf_.size() < n) {
        if (!Fill()) return false;
      }
      out->body = buf_.substr(0, n);
      buf_.erase(0, n);
      return true;
    }
    // Delimited by close (HTTP/1.0 streaming).
    while (Fill()) {
    }
    out->body = std::move(buf_);
    buf_.clear();
    return true;
  }

 public:
  // True when the server closes the connection (EOF or reset) within the timeout.
  bool WaitClosed() {
    while (Fill()) {
    }
    return eof_;
  }

 private:
  // Appends what arrives; false on EOF, error or timeout.
  bool Fill() {
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, timeout_ms_);
    if (r <= 0) return false;
    char tmp[16384];
    ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buf_.append(tmp, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  int timeout_ms_;
  std::string buf_;
  bool eof_ = false;
};

// Opens a chunked POST to `path` whose first chunk-size line (or, after a last chunk, trailer)
// starts with `head` and never ends: `blocks` blocks of `block_bytes` follow. Returns the
// server's answer (status 0 when none came).
inline HttpTestResponse SendEndlessChunkHeader(int port, const std::string& path, const std::string& head,
                                               size_t block_bytes, int blocks) {
  HttpTestClient c(port, 10);
  HttpTestResponse r;
  if (!c.SendRaw("POST " + path + " HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + head)) return r;
  const std::string block(block_bytes, 'b');
  for (int i = 0; i < blocks; ++i) {
    if (!c.SendRaw(block)) break;  // the server may close before all of it is sent
  }
  if (!c.ReadResponse(&r)) r.status = 0;
  return r;
}

}  // namespace keel::test
