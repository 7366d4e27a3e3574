// Arrival rate over the newest report windows that together just cover a span: what a service's
// LoadMeter reports (service_link.h) and what the simulation models (sim.h). A 250 ms window at a
// few req/s holds 0 to 2 arrivals, and the controller's trend would read that noise as surges.
// Pure; not thread-safe (LoadMeter calls it under its lock).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <utility>

namespace keel::hilo {

class WindowedRate {
 public:
  // 0 (the default) = the newest window alone.
  void SetSpan(int64_t ms) { span_ms_ = std::max<int64_t>(ms, 0); }

  // Records a finished window of `window_ms` holding `arrivals` (a window of no time is not kept)
  // and returns arrivals per second over the newest windows covering the span, at most 1e9; 0 when
  // they cover no time.
  double Add(int64_t window_ms, int64_t arrivals) {
    int64_t rate_ms = std::max<int64_t>(window_ms, 0), rate_arrivals = arrivals;
    if (window_ms > 0) recent_.emplace_back(window_ms, arrivals);
    int64_t covered = 0;
    size_t keep = 0;
    for (auto it = recent_.rbegin(); it != recent_.rend() && covered < span_ms_; ++it, ++keep) covered += it->first;
    while (recent_.size() > std::max<size_t>(keep, 1)) recent_.pop_front();
    if (span_ms_ > 0 && !recent_.empty()) {
      rate_ms = 0;
      rate_arrivals = 0;
      for (const auto& [ms, n] : recent_) rate_ms += ms, rate_arrivals += n;
    }
    covered_ms_ = rate_ms;
    return rate_ms > 0 ? std::min(static_cast<double>(rate_arrivals) / (static_cast<double>(rate_ms) / 1000.0), 1e9) : 0;
  }

  // The time the last rate Add returned covers: whole windows, so the span rounded up to them (or
  // less while fewer have been recorded).
  int64_t covered_ms() const { return covered_ms_; }

 private:
  int64_t span_ms_ = 0;
  int64_t covered_ms_ = 0;
  std::deque<std::pair<int64_t, int64_t>> recent_;  // (window ms, arrivals), newest last
};

}  // namespace keel::hilo
