// Streaming load client for `keel serve`: C concurrent clients each send R streaming completion
// requests over loopback and time every SSE event. Reports generated tokens/s, time to first
// token and inter-token latency percentiles. Only talks to 127.0.0.1.
//
//   server_load_bench --port 8080 --clients 32 --requests 4 --max-tokens 64 --model NAME
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  double ttft = 0;
  std::vector<double> itl;
  int events = 0;
  bool ok = false;
};

// Reads one streaming response, de-chunking it and timing each "data: " event.
Sample OneRequest(int port, const std::string& body) {
  Sample s;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return s;
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return s;
  }
  std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  auto t0 = Clock::now();
  if (::send(fd, req.data(), req.size(), 0) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return s;
  }
  std::string raw, payload;
  bool headers_done = false, chunked = false;
  size_t pos = 0;
  auto last = t0;
  char buf[16384];
  while (true) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    auto now = Clock::now();
    raw.append(buf, static_cast<size_t>(n));
    if (!headers_done) {
      size_t h = raw.find("\r\n\r\n");
      if (h == std::string::npos) continue;
      if (raw.compare(0, 12, "HTTP/1.1 200") != 0) break;
      chunked = raw.find("chunked") < h;
      headers_done = true;
      pos = h + 4;
    }
    // Move complete chunks (or everything, when not chunked) into payload.
    while (pos < raw.size()) {
      if (!chunked) {
        payload.append(raw, pos, std::string::npos);
        pos = raw.size();
        break;
      }
      size_t eol = raw.find("\r\n", pos);
      if (eol == std::string::npos) break;
      size_t len = std::strtoul(raw.c_str() + pos, nullptr, 16);
      if (raw.size() < eol + 2 + len + 2) break;
      payload.append(raw, eol + 2, len);
      pos = eol + 2 + len + 2;
    }
    size_t ev;
    while ((ev = payload.find("\n\n")) != std::string::npos) {
      std::string event = payload.substr(0, ev);
      payload.erase(0, ev + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      if (event == "data: [DONE]") {
        s.ok = true;
        continue;
      }
      if (event.find("\"text\":\"\"") != std::string::npos) continue;  // final chunk carries no token
      double since_start = std::chrono::duration<double>(now - t0).count();
      if (s.events == 0) {
        s.ttft = since_start;
      } else {
        s.itl.push_back(std::chrono::duration<double>(now - last).count());
      }
      last = now;
      ++s.events;
    }
  }
  ::close(fd);
  return s;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1));
  return v[i];
}

}  // namespace

int main(int argc, char** argv) {
  int port = 8080, clients = 32, requests = 4, max_tokens = 64;
  std::string model = "aidreams260K", prompt = "Echoes of vectors";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--port") port = std::atoi(v.c_str());
    else if (k == "--clients") clients = std::atoi(v.c_str());
    else if (k == "--requests") requests = std::atoi(v.c_str());
    else if (k == "--max-tokens") max_tokens = std::atoi(v.c_str());
    else if (k == "--model") model = v;
    else if (k == "--prompt") prompt = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  clients = std::clamp(clients, 1, 1024);
  requests = std::clamp(requests, 1, 10000);
  std::mutex mu;
  std::vector<Sample> samples;
  auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      for (int r = 0; r < requests; ++r) {
        std::string body = "{\"model\":\"" + model + "\",\"prompt\":\"" + prompt + "\",\"max_tokens\":" +
                           std::to_string(max_tokens) + ",\"temperature\":0.8,\"seed\":" +
                           std::to_string(c * 1000 + r) + ",\"stream\":true}";
        Sample s = OneRequest(port, body);
        std::lock_guard<std::mutex> lock(mu);
        samples.push_back(std::move(s));
      }
    });
  }
  for (auto& t : threads) t.join();
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> ttft, itl;
  long events = 0;
  int ok = 0;
  for (const Sample& s : samples) {
    if (!s.ok) continue;
    ++ok;
    events += s.events;
    ttft.push_back(s.ttft);
    itl.insert(itl.end(), s.itl.begin(), s.itl.end());
  }
  std::printf("| clients | requests ok | streamed events/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| %d | %d/%zu | %.1f | %.1f | %.1f | %.2f | %.2f |\n", clients, ok, samples.size(), events / secs,
              Percentile(ttft, 0.5) * 1e3, Percentile(ttft, 0.99) * 1e3, Percentile(itl, 0.5) * 1e3,
              Percentile(itl, 0.99) * 1e3);
  return ok == static_cast<int>(samples.size()) ? 0 : 1;
}
