// Open-loop HTTP/1.1 load client for the gateway benchmark (bench/gateway/run.sh). Request i is
// scheduled at start + i / rate whatever happened to earlier requests, and its latency is measured
// from that scheduled time, so a stalled server is charged for the requests that queued behind
// the stall (no coordinated omission, as in wrk2). Requests go over a fixed pool of keep-alive
// connections to a loopback address, one blocking thread per connection; a request whose
// connection is busy past its scheduled time waits, and the wait counts as latency.
//
// Non-streaming: latency = scheduled time -> whole response read. Streaming (--stream): the
// chunked SSE body is de-chunked; time to first chunk (ttfc) = scheduled time -> first decoded body
// bytes containing "data:", latency = scheduled time -> terminating chunk. Any status but 200, a
// malformed or truncated response, or a socket error is an error (counted, not timed).
//
// Prints one JSON line per run:
//   {"label","rate","duration_s","stream","connections","count","errors","achieved_rps",
//    "p50_us","p90_us","p99_us","max_us","mean_us","svc_p50_us","svc_p99_us",
//    "ttfc_p50_us","ttfc_p99_us","late_p99_us","client_cpu_us_per_req","first_error"}
// svc_* are measured from the moment the request was actually written (service time, with
// coordinated omission — for diagnosis only); late_p99_us is how late writes were behind schedule;
// client_cpu_us_per_req is this process's user + system CPU over the run (warmup included) per
// scheduled request, so a reader can tell how much of a shared machine the load itself took.
//
//   gateway_bench --port 8080 --path /v1/chat/completions --rate 1000 --duration-s 10
//                 --connections 32 --header "Authorization: Bearer sk-..." [--stream]
//
// Report mode: `gateway_bench --report results.jsonl` reads such lines (with "mode" and
// "cpu_us_per_req" added by run.sh; label = direct | nginx | gateway) and prints the Markdown
// table for docs/results.md: each proxy's latency next to direct's, what it adds, and the
// gateway's added median over nginx's. "cores busy" is (client + vendor + proxy CPU per request)
// x rate: how much of the machine the point used, to spot a saturated point. Repeated points
// (ROUNDS > 1) are reduced to the median of each figure across rounds.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int port = 0;
  std::string path = "/v1/chat/completions";
  std::string body;
  std::vector<std::string> headers;
  double rate = 100;
  double duration_s = 10;
  double warmup_s = 2;
  int connections = 32;
  bool stream = false;
  std::string label;
  std::string model = "gpt-4o-mini";
  double timeout_s = 10;
};

struct Sample {
  double latency_us = 0;  // scheduled -> done
  double service_us = 0;  // written -> done
  double ttfc_us = -1;    // scheduled -> first "data:" chunk (stream only)
  double late_us = 0;     // written - scheduled
};

// Per-thread results, merged at the end (no locking on the hot path).
struct ThreadResult {
  std::vector<Sample> samples;
  int64_t errors = 0;
  std::string first_error;
};

[[noreturn]] void Usage(const char* msg) {
  std::fprintf(stderr,
               "gateway_bench: %s\n"
               "usage: gateway_bench (--url http://127.0.0.1:PORT/PATH | --port N [--path P])\n"
               "  [--body-file F | --model M] [--header 'Name: value']... [--rate RPS]\n"
               "  [--duration-s S] [--warmup-s S] [--connections N] [--stream] [--label L]\n"
               "  [--timeout-s S]\n"
               "       gateway_bench --report results.jsonl\n",
               msg);
  std::exit(2);
}

std::string DefaultBody(const Options& o) {
  return std::string("{\"model\":\"") + o.model +
         "\",\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"},"
         "{\"role\":\"user\",\"content\":\"Say hello to the benchmark and then count slowly.\"}],"
         "\"max_tokens\":64,\"temperature\":0" +
         (o.stream ? ",\"stream\":true" : "") + "}";
}

// Accepts only loopback URLs: the benchmark must never load anything but this machine.
void ParseUrl(const std::string& url, Options& o) {
  const std::string prefix = "http://127.0.0.1:";
  if (url.rfind(prefix, 0) != 0) Usage("--url must start with http://127.0.0.1:");
  size_t slash = url.find('/', prefix.size());
  o.port = std::atoi(url.substr(prefix.size(), slash - prefix.size()).c_str());
  if (slash != std::string::npos) o.path = url.substr(slash);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  std::string body_file;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    if (a == "--url") ParseUrl(next(), o);
    else if (a == "--port") o.port = std::atoi(next().c_str());
    else if (a == "--path") o.path = next();
    else if (a == "--body-file") body_file = next();
    else if (a == "--model") o.model = next();
    else if (a == "--header") o.headers.push_back(next());
    else if (a == "--rate") o.rate = std::atof(next().c_str());
    else if (a == "--duration-s") o.duration_s = std::atof(next().c_str());
    else if (a == "--warmup-s") o.warmup_s = std::atof(next().c_str());
    else if (a == "--connections") o.connections = std::atoi(next().c_str());
    else if (a == "--stream") o.stream = true;
    else if (a == "--label") o.label = next();
    else if (a == "--timeout-s") o.timeout_s = std::atof(next().c_str());
    else if (a == "--help" || a == "-h") Usage("help");
    else Usage(("unknown flag " + a).c_str());
  }
  if (o.port <= 0 || o.port > 65535) Usage("--port or --url is required");
  if (o.rate <= 0 || o.duration_s <= 0 || o.warmup_s < 0 || o.connections <= 0)
    Usage("--rate, --duration-s and --connections must be positive");
  if (!body_file.empty()) {
    std::ifstream in(body_file, std::ios::binary);
    if (!in) Usage(("cannot read " + body_file).c_str());
    std::stringstream ss;
    ss << in.rdbuf();
    o.body = ss.str();
  } else {
    o.body = DefaultBody(o);
  }
  return o;
}

// One keep-alive connection and the parser state for the response in flight.
class Connection {
 public:
  explicit Connection(const Options& o) : o_(o) {}
  ~Connection() { Close(); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Sends one request and reads its response. On success fills ttfc (stream) and returns "";
  // otherwise returns what went wrong and leaves the connection closed.
  std::string RoundTrip(const std::string& request, Clock::time_point scheduled, double* ttfc_us) {
    if (fd_ < 0) {
      std::string err = Connect();
      if (!err.empty()) return err;
    }
    if (!SendAll(request)) {
      // A keep-alive connection the server closed while idle: retry once on a fresh one.
      Close();
      std::string err = Connect();
      if (!err.empty()) return err;
      if (!SendAll(request)) return Fail("send failed");
    }
    return ReadResponse(scheduled, ttfc_us);
  }

 private:
  std::string Connect() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return "socket failed";
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(o_.timeout_s);
    tv.tv_usec = static_cast<suseconds_t>((o_.timeout_s - static_cast<double>(tv.tv_sec)) * 1e6);
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(o_.port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Fail(std::string("connect: ") + std::strerror(errno));
    }
    buf_.clear();
    return "";
  }

  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  std::string Fail(std::string why) {
    Close();
    return why;
  }

  bool SendAll(const std::string& data) {
    size_t off = 0;
    while (off < data.size()) {
      ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

  // Appends more bytes to buf_; false on EOF, error or timeout.
  bool Fill() {
    char tmp[65536];
    ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
    if (n <= 0) return false;
    buf_.append(tmp, static_cast<size_t>(n));
    return true;
  }

  static bool HeaderHas(std::string_view headers, std::string_view name, std::string_view value) {
    std::string lower(headers);
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    size_t p = lower.find(std::string("\r\n") + std::string(name) + ":");
    if (p == std::string::npos) return false;
    size_t eol = lower.find("\r\n", p + 2);
    return lower.substr(p, eol - p).find(value) != std::string::npos;
  }

  static int64_t ContentLength(std::string_view headers) {
    std::string lower(headers);
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    size_t p = lower.find("\r\ncontent-length:");
    if (p == std::string::npos) return -1;
    return std::atoll(lower.c_str() + p + 17);
  }

  std::string ReadResponse(Clock::time_point scheduled, double* ttfc_us) {
    size_t hend;
    while ((hend = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return Fail(buf_.empty() ? "no response" : "truncated headers");
    }
    std::string_view head(buf_.data(), hend + 2);  // keep the last CRLF for HeaderHas
    if (head.size() < 12 || head.compare(0, 5, "HTTP/") != 0) return Fail("not HTTP");
    std::string status(head.substr(9, 3));
    bool chunked = HeaderHas(head, "transfer-encoding", "chunked");
    bool close = HeaderHas(head, "connection", "close") || head.compare(0, 8, "HTTP/1.0") == 0;
    int64_t length = ContentLength(head);
    size_t pos = hend + 4;
    bool ok_status = status == "200";

    bool seen_data = false;
    if (chunked) {
      std::string carry;  // tail of the previous chunk, so "data:" split across chunks is seen
      while (true) {
        size_t eol;
        while ((eol = buf_.find("\r\n", pos)) == std::string::npos) {
          if (!Fill()) return Fail("truncated chunked body");
        }
        size_t size = std::strtoul(buf_.c_str() + pos, nullptr, 16);
        size_t data = eol + 2;
        while (buf_.size() < data + size + 2) {
          if (!Fill()) return Fail("truncated chunk");
        }
        if (size == 0) {
          // Trailers are not expected; the terminating chunk ends with an empty line.
          pos = data + 2;
          break;
        }
        if (o_.stream && !seen_data) {
          std::string window = carry + buf_.substr(data, size);
          if (window.find("data:") != std::string::npos) {
            seen_data = true;
            *ttfc_us = std::chrono::duration<double, std::micro>(Clock::now() - scheduled).count();
          } else {
            carry = window.substr(window.size() > 4 ? window.size() - 4 : 0);
          }
        }
        pos = data + size + 2;
      }
    } else if (length >= 0) {
      while (buf_.size() < pos + static_cast<size_t>(length)) {
        if (!Fill()) return Fail("truncated body");
      }
      if (o_.stream && ok_status &&
          std::string_view(buf_).substr(pos, static_cast<size_t>(length)).find("data:") !=
              std::string_view::npos) {
        seen_data = true;
        *ttfc_us = std::chrono::duration<double, std::micro>(Clock::now() - scheduled).count();
      }
      pos += static_cast<size_t>(length);
    } else {
      // Body delimited by close.
      while (Fill()) {
      }
      pos = buf_.size();
      close = true;
    }
    buf_.erase(0, pos);
    if (close) Close();
    if (!ok_status) return "status " + status;
    if (o_.stream && !seen_data) return "stream without data: events";
    return "";
  }

  const Options& o_;
  int fd_ = -1;
  std::string buf_;
};

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  size_t k = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}


// ---- report mode

// The value of "key" in one flat JSON line: a number, or the text of a string.
std::string Field(const std::string& line, const std::string& key) {
  size_t p = line.find("\"" + key + "\":");
  if (p == std::string::npos) return "";
  p += key.size() + 3;
  if (p < line.size() && line[p] == '"') {
    size_t e = line.find('"', p + 1);
    return line.substr(p + 1, e - p - 1);
  }
  size_t e = line.find_first_of(",}", p);
  return line.substr(p, e - p);
}

double Num(const std::string& line, const std::string& key) {
  std::string v = Field(line, key);
  return v.empty() ? -1 : std::atof(v.c_str());
}

struct Point {
  std::vector<double> p50, p99, ttfc50, ttfc99, cpu;
  std::vector<double> all_cpu;  // client + vendor + proxy CPU µs per request
  double errors = 0, count = 0;
};

double Median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string Fmt(double v, const char* fmt = "%.0f") {
  if (v < 0) return "–";
  char b[64];
  std::snprintf(b, sizeof(b), fmt, v);
  return b;
}

std::string Signed(double v) {
  char b[64];
  std::snprintf(b, sizeof(b), "%+.0f", v);
  return b;
}

int Report(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "gateway_bench: cannot read %s\n", path.c_str());
    return 2;
  }
  // (mode, rate) in first-seen order; targets within each.
  std::vector<std::pair<std::string, double>> groups;
  std::vector<std::vector<std::pair<std::string, Point>>> points;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::string mode = Field(line, "mode");
    double rate = Num(line, "rate");
    std::string target = Field(line, "label");
    size_t g = 0;
    while (g < groups.size() && !(groups[g].first == mode && groups[g].second == rate)) ++g;
    if (g == groups.size()) {
      groups.emplace_back(mode, rate);
      points.emplace_back();
    }
    auto& ts = points[g];
    size_t t = 0;
    while (t < ts.size() && ts[t].first != target) ++t;
    if (t == ts.size()) ts.emplace_back(target, Point{});
    Point& pt = ts[t].second;
    pt.p50.push_back(Num(line, "p50_us"));
    pt.p99.push_back(Num(line, "p99_us"));
    if (Field(line, "stream") == "true") {
      pt.ttfc50.push_back(Num(line, "ttfc_p50_us"));
      pt.ttfc99.push_back(Num(line, "ttfc_p99_us"));
    }
    double cpu = Num(line, "cpu_us_per_req");
    if (cpu >= 0) pt.cpu.push_back(cpu);
    double client = Num(line, "client_cpu_us_per_req"), vendor = Num(line, "vendor_cpu_us_per_req");
    if (client >= 0 && vendor >= 0) pt.all_cpu.push_back(client + vendor + std::max(cpu, 0.0));
    pt.errors += Num(line, "errors");
    pt.count += Num(line, "count");
  }
  std::printf("| mode | rate (req/s) | target | p50 µs | p99 µs | added p50 µs | added p99 µs | "
              "TTFC p50 µs (added) | proxy CPU µs/req | cores busy | ok / errors |\n");
  std::printf("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::string ratios;
  for (size_t g = 0; g < groups.size(); ++g) {
    const Point* direct = nullptr;
    for (const auto& [name, pt] : points[g]) {
      if (name == "direct") direct = &pt;
    }
    double added_nginx = -1, added_gateway = -1;
    for (const auto& [name, pt] : points[g]) {
      double p50 = Median(pt.p50), p99 = Median(pt.p99), t50 = Median(pt.ttfc50);
      std::string add50 = "", add99 = "", ttfc = Fmt(t50);
      if (direct && &pt != direct) {
        double a = p50 - Median(direct->p50);
        add50 = Signed(a);
        add99 = Signed(p99 - Median(direct->p99));
        if (t50 >= 0) ttfc += " (" + Signed(t50 - Median(direct->ttfc50)) + ")";
        if (name == "nginx") added_nginx = a;
        if (name == "gateway") added_gateway = a;
      }
      double all = Median(pt.all_cpu);
      std::printf("| %s | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %.0f / %.0f |\n",
                  groups[g].first.c_str(), groups[g].second, name.c_str(), Fmt(p50).c_str(),
                  Fmt(p99).c_str(), add50.c_str(), add99.c_str(), ttfc.c_str(),
                  Fmt(Median(pt.cpu), "%.1f").c_str(),
                  Fmt(all < 0 ? -1 : all * groups[g].second / 1e6, "%.2f").c_str(), pt.count,
                  pt.errors);
    }
    char b[256];
    if (added_nginx > 0 && added_gateway >= 0) {
      std::snprintf(b, sizeof(b), "* %s, %.0f req/s: gateway adds %.0f µs at the median, nginx %.0f µs: ratio %.2f\n",
                    groups[g].first.c_str(), groups[g].second, added_gateway, added_nginx,
                    added_gateway / added_nginx);
    } else {
      std::snprintf(b, sizeof(b), "* %s, %.0f req/s: gateway adds %.0f µs at the median, nginx %.0f µs: ratio undefined\n",
                    groups[g].first.c_str(), groups[g].second, added_gateway, added_nginx);
    }
    ratios += b;
  }
  std::printf("\nGateway added median / nginx added median:\n\n%s", ratios.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--report") return Report(argv[2]);
  Options o = ParseArgs(argc, argv);
  std::string request = "POST " + o.path +
                        " HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(o.port) +
                        "\r\nContent-Type: application/json\r\n";
  if (o.stream) request += "Accept: text/event-stream\r\n";
  for (const auto& h : o.headers) request += h + "\r\n";
  request += "Content-Length: " + std::to_string(o.body.size()) + "\r\n\r\n" + o.body;

  const auto interval = std::chrono::duration<double>(1.0 / o.rate);
  const int64_t warmup_n = static_cast<int64_t>(o.warmup_s * o.rate);
  const int64_t total_n = warmup_n + static_cast<int64_t>(o.duration_s * o.rate);
  // Start a little in the future so every thread is parked before the first slot.
  const auto start = Clock::now() + std::chrono::milliseconds(50);
  std::atomic<int64_t> next{0};
  std::vector<ThreadResult> results(static_cast<size_t>(o.connections));
  std::vector<std::thread> threads;
  for (int t = 0; t < o.connections; ++t) {
    threads.emplace_back([&, t] {
      // Default timer slack (50 µs) would add to every scheduled send; ask for the tightest.
      ::prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
      Connection conn(o);
      ThreadResult& r = results[static_cast<size_t>(t)];
      r.samples.reserve(static_cast<size_t>(total_n / o.connections + 16));
      while (true) {
        int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= total_n) break;
        auto scheduled = start + std::chrono::duration_cast<Clock::duration>(
                                     interval * static_cast<double>(i));
        std::this_thread::sleep_until(scheduled);
        auto sent = Clock::now();
        double ttfc = -1;
        std::string err = conn.RoundTrip(request, scheduled, &ttfc);
        auto done = Clock::now();
        if (i < warmup_n) continue;
        if (!err.empty()) {
          if (r.errors++ == 0) r.first_error = err;
          continue;
        }
        Sample s;
        s.latency_us = std::chrono::duration<double, std::micro>(done - scheduled).count();
        s.service_us = std::chrono::duration<double, std::micro>(done - sent).count();
        s.late_us = std::chrono::duration<double, std::micro>(sent - scheduled).count();
        s.ttfc_us = ttfc;
        r.samples.push_back(s);
      }
    });
  }
  for (auto& th : threads) th.join();
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  const double client_cpu_us =
      static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
      static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  const double wall_s =
      std::chrono::duration<double>(Clock::now() - start).count() - o.warmup_s;

  std::vector<double> lat, svc, ttfc, late;
  int64_t errors = 0;
  std::string first_error;
  double sum = 0;
  for (const auto& r : results) {
    errors += r.errors;
    if (first_error.empty()) first_error = r.first_error;
    for (const auto& s : r.samples) {
      lat.push_back(s.latency_us);
      svc.push_back(s.service_us);
      late.push_back(s.late_us);
      if (s.ttfc_us >= 0) ttfc.push_back(s.ttfc_us);
      sum += s.latency_us;
    }
  }
  const size_t count = lat.size();
  const double max_us = count ? *std::max_element(lat.begin(), lat.end()) : 0;
  std::printf(
      "{\"label\":\"%s\",\"rate\":%g,\"duration_s\":%g,\"stream\":%s,\"connections\":%d,"
      "\"count\":%zu,\"errors\":%lld,\"achieved_rps\":%.1f,\"p50_us\":%.1f,\"p90_us\":%.1f,"
      "\"p99_us\":%.1f,\"max_us\":%.1f,\"mean_us\":%.1f,\"svc_p50_us\":%.1f,\"svc_p99_us\":%.1f,"
      "\"ttfc_p50_us\":%.1f,\"ttfc_p99_us\":%.1f,\"late_p99_us\":%.1f,"
      "\"client_cpu_us_per_req\":%.1f,\"first_error\":\"%s\"}\n",
      JsonEscape(o.label).c_str(), o.rate, o.duration_s, o.stream ? "true" : "false",
      o.connections, count, static_cast<long long>(errors),
      wall_s > 0 ? static_cast<double>(count + static_cast<size_t>(errors)) / wall_s : 0.0,
      Percentile(lat, 0.5), Percentile(lat, 0.9), Percentile(lat, 0.99), max_us,
      count ? sum / static_cast<double>(count) : 0.0, Percentile(svc, 0.5), Percentile(svc, 0.99),
      Percentile(ttfc, 0.5), Percentile(ttfc, 0.99), Percentile(late, 0.99),
      client_cpu_us / static_cast<double>(total_n), JsonEscape(first_error).c_str());
  return errors > 0 && count == 0 ? 1 : 0;
}
