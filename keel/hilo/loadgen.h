// Open-loop load: replays a Trace as Poisson arrivals against a live target. Open loop because
// users do not wait for each other's answers: a slow product must see its queue grow, which a
// closed loop (wrk, a fixed set of clients) hides. Each arrival runs `issue` on a worker thread;
// when every worker is busy the arrival is dropped at the client and recorded (status kDropped), so
// the generator's own limit is visible in the results instead of silently lowering the rate.
//
// Used by `keel hilo validate` (load ramps) and the live surge replay (bench/hilo/live.sh).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/hilo/trace.h"

namespace keel::hilo {

struct Outcome {
  static constexpr int kDropped = -1;  // no worker free at the arrival time: never sent
  static constexpr int kNoReply = 0;   // sent, but no HTTP reply (refused, reset, deadline)
  int64_t seq = 0;          // arrival number, from 0
  double arrival_s = 0;     // scheduled arrival, seconds from the start
  double latency_ms = 0;    // from the scheduled arrival (so a late send counts against us)
  int status = kNoReply;    // HTTP status, or kDropped / kNoReply
  double quality = 0;       // what `issue` scored the answer (0..100); 0 unless status is 200
  std::string state;        // the product state the answer says it ran in, if any
};

struct OpenLoopOptions {
  double baseline_rate = 1;   // req/s at the trace's 1x
  double time_scale = 1;      // real seconds per trace second (< 1 replays faster)
  uint64_t seed = 1;
  int workers = 256;          // concurrent requests at most
  // Called every `tick_s` of real time with the seconds elapsed (progress, sampling a state).
  double tick_s = 1;
  std::function<void(double elapsed_s)> on_tick;
};

// What one arrival does: send the request numbered `seq`, fill status, quality and state
// (latency and arrival are filled by the generator). Called from worker threads.
using IssueFn = std::function<void(int64_t seq, Outcome& out)>;

// Runs the whole trace (duration_s x time_scale real seconds), then waits for requests in flight.
// Outcomes are in arrival order. InvalidArgument for options out of range or an empty trace.
Result<std::vector<Outcome>> RunOpenLoop(const Trace& trace, const OpenLoopOptions& options, const IssueFn& issue);

struct LiveWindow {
  double t_s = 0;          // window start, trace seconds
  int64_t arrived = 0;
  double mean_quality = 0;  // over arrivals; dropped, failed, non-200 and late answers score 0
  double p99_ms = 0;        // of answered (status 200) requests
};

struct LiveSummary {
  int64_t arrived = 0;
  int64_t ok = 0;            // 200 within the SLO
  int64_t shed = 0;          // 429 or 503 from the product
  int64_t failed = 0;        // other statuses, no reply, dropped at the client
  int64_t slo_violations = 0;  // 200 but slower than slo_ms
  double max_drop = 0;       // max over windows of full_quality - mean_quality
  double mean_drop = 0;
  std::vector<LiveWindow> windows;
};

// Scores outcomes in `window_s` windows of trace time (by arrival); `full_quality` is what the
// full state scores at light load. time_scale converts arrival seconds back to trace seconds.
LiveSummary Summarise(const std::vector<Outcome>& outcomes, double full_quality, double window_s, double slo_ms,
                      double time_scale);

}  // namespace keel::hilo
