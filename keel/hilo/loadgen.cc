#include "keel/hilo/loadgen.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "keel/hilo/sim.h"

namespace keel::hilo {
namespace {

using Clock = std::chrono::steady_clock;

double Percentile99(std::vector<double>& v) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(0.99 * static_cast<double>(v.size()))) - 1);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

}  // namespace

Result<std::vector<Outcome>> RunOpenLoop(const Trace& trace, const OpenLoopOptions& o, const IssueFn& issue) {
  if (trace.points.empty() || !(trace.duration_s > 0)) {
    return Status::InvalidArgument("open loop: trace " + trace.name + " has no points or no duration");
  }
  if (!(o.baseline_rate > 0) || o.baseline_rate > 1e6) return Status::InvalidArgument("open loop: baseline_rate must be in (0, 1e6]");
  if (!(o.time_scale > 0) || o.time_scale > 1e3) return Status::InvalidArgument("open loop: time_scale must be in (0, 1000]");
  if (o.workers < 1 || o.workers > 4096) return Status::InvalidArgument("open loop: workers must be 1..4096");
  if (!(o.tick_s > 0)) return Status::InvalidArgument("open loop: tick_s must be > 0");
  if (!issue) return Status::InvalidArgument("open loop: no issue function");

  // Arrivals in trace time at the trace's rate; real time is trace time x time_scale.
  const std::vector<double> arrivals = PoissonArrivals(trace, o.baseline_rate, o.seed);
  std::vector<Outcome> out(arrivals.size());
  for (size_t i = 0; i < arrivals.size(); ++i) {
    out[i].seq = static_cast<int64_t>(i);
    out[i].arrival_s = arrivals[i] * o.time_scale;
  }

  std::mutex mu;
  std::condition_variable cv;
  std::deque<size_t> ready;
  int idle = o.workers;
  bool done = false;
  const Clock::time_point start = Clock::now();
  auto since_start_ms = [&start] { return std::chrono::duration<double, std::milli>(Clock::now() - start).count(); };

  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(o.workers));
  for (int w = 0; w < o.workers; ++w) {
    workers.emplace_back([&] {
      std::unique_lock<std::mutex> lock(mu);
      while (true) {
        cv.wait(lock, [&] { return done || !ready.empty(); });
        if (ready.empty()) return;
        const size_t i = ready.front();
        ready.pop_front();
        lock.unlock();
        Outcome& r = out[i];
        issue(r.seq, r);
        r.latency_ms = since_start_ms() - r.arrival_s * 1000;
        if (r.status != 200) r.quality = 0;
        lock.lock();
        ++idle;
      }
    });
  }

  double next_tick = o.tick_s;
  for (size_t i = 0; i < out.size(); ++i) {
    const auto at = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(out[i].arrival_s));
    while (o.on_tick && std::chrono::duration<double>(at - start).count() >= next_tick) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(next_tick)));
      o.on_tick(next_tick);
      next_tick += o.tick_s;
    }
    std::this_thread::sleep_until(at);
    std::lock_guard<std::mutex> lock(mu);
    if (idle == 0) {
      out[i].status = Outcome::kDropped;
      continue;
    }
    --idle;
    ready.push_back(i);
    cv.notify_one();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
  }
  cv.notify_all();
  for (auto& t : workers) t.join();
  if (o.on_tick) o.on_tick(std::chrono::duration<double>(Clock::now() - start).count());
  return out;
}

LiveSummary Summarise(const std::vector<Outcome>& outcomes, double full_quality, double window_s, double slo_ms,
                      double time_scale) {
  LiveSummary s;
  if (!(window_s > 0) || !(time_scale > 0)) return s;
  struct Acc {
    int64_t n = 0;
    double q = 0;
    std::vector<double> lat;
  };
  std::vector<Acc> acc;
  for (const Outcome& o : outcomes) {
    const double t = o.arrival_s / time_scale;
    const size_t w = static_cast<size_t>(std::max(0.0, std::floor(t / window_s)));
    if (w >= acc.size()) acc.resize(w + 1);
    Acc& a = acc[w];
    ++a.n;
    ++s.arrived;
    const bool answered = o.status == 200;
    const bool late = answered && o.latency_ms > slo_ms;
    if (answered) a.lat.push_back(o.latency_ms);
    if (answered && !late) {
      ++s.ok;
      a.q += o.quality;
    } else if (late) {
      ++s.slo_violations;
    } else if (o.status == 429 || o.status == 503) {
      ++s.shed;
    } else {
      ++s.failed;
    }
  }
  double drop_sum = 0;
  int64_t with_arrivals = 0;
  for (size_t w = 0; w < acc.size(); ++w) {
    LiveWindow lw;
    lw.t_s = static_cast<double>(w) * window_s;
    lw.arrived = acc[w].n;
    lw.p99_ms = Percentile99(acc[w].lat);
    if (acc[w].n > 0) {
      lw.mean_quality = acc[w].q / static_cast<double>(acc[w].n);
      const double drop = full_quality - lw.mean_quality;
      s.max_drop = std::max(s.max_drop, drop);
      drop_sum += drop;
      ++with_arrivals;
    }
    s.windows.push_back(lw);
  }
  s.mean_drop = with_arrivals ? drop_sum / static_cast<double>(with_arrivals) : 0;
  return s;
}

}  // namespace keel::hilo
