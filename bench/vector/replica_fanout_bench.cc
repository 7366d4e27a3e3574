// replica_fanout_bench: what fanning one request out to R replicas costs the router over one call
// (keel/vector/replica_client.h: keep-alive connections, calls run in parallel on a CallPool), on
// loopback against R in-process HTTP servers that answer a POST with a fixed body after
// --delay-us (0: at once, so the table shows the client's, the servers' and the loopback's CPU
// cost, which on a 2-core machine cannot overlap; a delay stands for the replica's search and the
// network, which a fan-out should overlap).
//
//   replica_fanout_bench [--requests 3000] [--body 1024] [--fanouts 1,2,3,6] [--delay-us 0]
//
// Prints, per fan-out, p50 / p99 / mean microseconds per request (all R answers in) and the
// ratio of p50 to the single call's p50.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/http_server.h"
#include "keel/vector/replica_client.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int requests = 3000;
  size_t body = 1024;
  std::vector<int> fanouts = {1, 2, 3, 6};
  int delay_us = 0;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--requests") a.requests = std::atoi(value.c_str());
    else if (flag == "--delay-us") a.delay_us = std::atoi(value.c_str());
    else if (flag == "--body") a.body = static_cast<size_t>(std::atol(value.c_str()));
    else if (flag == "--fanouts") {
      a.fanouts.clear();
      std::stringstream ss(value);
      for (std::string item; std::getline(ss, item, ',');) a.fanouts.push_back(std::atoi(item.c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return a;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  const int most = *std::max_element(args.fanouts.begin(), args.fanouts.end());
  const std::string answer(args.body, 'x');
  std::vector<std::unique_ptr<keel::HttpServer>> servers;
  std::vector<std::unique_ptr<keel::vector::ReplicaClient>> clients;
  for (int i = 0; i < most; ++i) {
    keel::HttpServerOptions o;
    o.port = 0;
    servers.push_back(std::make_unique<keel::HttpServer>(o, [&answer, &args](const keel::HttpRequest&, keel::HttpResponder& res) {
      if (args.delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(args.delay_us));
      res.Send(200, "application/json", answer);
    }));
    if (!servers.back()->Start().ok()) return 1;
    clients.push_back(std::make_unique<keel::vector::ReplicaClient>(keel::vector::HttpEndpoint{"127.0.0.1", servers.back()->port()}));
  }
  keel::vector::CallPool pool(most);
  const std::string body = R"({"kind":"text","k":10,"text":[0.1,0.2,0.3,0.4]})";
  std::printf("server delay %d us, %zu-byte answers, %d requests per row\n\n", args.delay_us, args.body, args.requests);
  std::printf("| fan-out | p50 us | p99 us | mean us | p50 / one call |\n|---:|---:|---:|---:|---:|\n");
  double one_p50 = 0;
  for (int fanout : args.fanouts) {
    std::vector<double> us;
    std::atomic<int> failed{0};
    for (int r = 0; r < args.requests + 200; ++r) {  // the first 200 warm connections and threads
      const auto t0 = Clock::now();
      pool.RunAll(fanout, [&](int i) {
        auto reply = clients[static_cast<size_t>(i)]->Call("POST", "/v1/search", body, "application/json", keel::DeadlineIn(5000));
        if (!reply.ok() || reply->status != 200) ++failed;
      });
      if (r >= 200) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    double mean = 0;
    for (double v : us) mean += v;
    mean /= static_cast<double>(us.size());
    const double p50 = Percentile(us, 0.5);
    if (fanout == args.fanouts.front()) one_p50 = p50;
    std::printf("| %d | %.1f | %.1f | %.1f | %.2f |%s\n", fanout, p50, Percentile(us, 0.99), mean, p50 / one_p50,
                failed.load() ? " (calls failed!)" : "");
  }
  for (auto& s : servers) s->Stop();
  return 0;
}
