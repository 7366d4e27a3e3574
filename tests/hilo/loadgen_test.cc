// The open-loop generator and the live scoring. Timing-dependent facts are asserted only where no
// schedule could break them (a single worker that sleeps 200 ms cannot serve 100 arrivals/s).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "keel/hilo/loadgen.h"
#include "keel/hilo/sim.h"

namespace keel::hilo {
namespace {

Trace Flat(double duration_s) {
  Trace t;
  t.name = "flat";
  t.duration_s = duration_s;
  t.points = {{0, 1}, {duration_s, 1}};
  return t;
}

TEST(HiloOpenLoop, EveryScheduledArrivalIsIssuedOnceInOrder) {
  OpenLoopOptions o;
  o.baseline_rate = 200;
  o.time_scale = 0.5;  // 2 s of trace in 1 s
  o.seed = 7;
  o.workers = 64;
  std::atomic<int> ticks{0};
  o.tick_s = 0.25;
  o.on_tick = [&](double) { ++ticks; };
  std::vector<std::atomic<int>> seen(10000);
  auto r = RunOpenLoop(Flat(2), o, [&](int64_t seq, Outcome& out) {
    ++seen[static_cast<size_t>(seq)];
    out.status = 200;
    out.quality = seq % 2 ? 100 : 50;
    out.state = "full";
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::vector<double> expected = PoissonArrivals(Flat(2), 200, 7);
  ASSERT_EQ(r->size(), expected.size());
  ASSERT_GT(r->size(), 200u);
  for (size_t i = 0; i < r->size(); ++i) {
    const Outcome& out = (*r)[i];
    EXPECT_EQ(out.seq, static_cast<int64_t>(i));
    EXPECT_DOUBLE_EQ(out.arrival_s, expected[i] * 0.5);
    if (out.status == Outcome::kDropped) continue;  // 64 workers doing nothing: should not happen, but not the point
    EXPECT_EQ(seen[i].load(), 1);
    EXPECT_EQ(out.status, 200);
    EXPECT_GE(out.latency_ms, 0);
  }
  EXPECT_GE(ticks.load(), 4);  // at 0.25, 0.5, 0.75 s and the final one
}

TEST(HiloOpenLoop, ArrivalsBeyondTheWorkersAreDroppedNotDelayed) {
  OpenLoopOptions o;
  o.baseline_rate = 100;
  o.workers = 1;
  o.seed = 3;
  auto r = RunOpenLoop(Flat(1), o, [](int64_t, Outcome& out) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    out.status = 200;
    out.quality = 100;
  });
  ASSERT_TRUE(r.ok());
  int64_t dropped = 0, served = 0;
  for (const Outcome& out : *r) {
    if (out.status == Outcome::kDropped) {
      ++dropped;
      EXPECT_EQ(out.quality, 0);
    } else {
      ++served;
    }
  }
  EXPECT_EQ(dropped + served, static_cast<int64_t>(r->size()));
  EXPECT_GT(dropped, static_cast<int64_t>(r->size()) / 2);
  EXPECT_LE(served, 7);  // one worker, 200 ms each, 1 s of arrivals (+ the last one in flight)
}

TEST(HiloOpenLoop, RefusesBadOptions) {
  OpenLoopOptions o;
  auto noop = [](int64_t, Outcome&) {};
  Trace empty;
  EXPECT_FALSE(RunOpenLoop(empty, o, noop).ok());
  o.baseline_rate = 0;
  EXPECT_FALSE(RunOpenLoop(Flat(1), o, noop).ok());
  o.baseline_rate = 1;
  o.workers = 0;
  EXPECT_FALSE(RunOpenLoop(Flat(1), o, noop).ok());
  o.workers = 1;
  o.time_scale = -1;
  EXPECT_FALSE(RunOpenLoop(Flat(1), o, noop).ok());
  o.time_scale = 1;
  EXPECT_FALSE(RunOpenLoop(Flat(1), o, IssueFn()).ok());
}

Outcome At(double arrival_s, int status, double quality, double latency_ms) {
  Outcome o;
  o.arrival_s = arrival_s;
  o.status = status;
  o.quality = quality;
  o.latency_ms = latency_ms;
  return o;
}

TEST(HiloLiveSummary, WindowsScoreShedFailedAndLateAsZero) {
  std::vector<Outcome> v = {
      At(0.1, 200, 100, 10), At(0.5, 200, 80, 20),                          // window 0: mean 90
      At(1.2, 429, 0, 1), At(1.3, 200, 100, 5000), At(1.4, 200, 90, 30),   // window 1: shed, late, 90 -> 30
      At(2.5, Outcome::kDropped, 0, 0), At(2.6, Outcome::kNoReply, 0, 0),  // window 2: 0
      At(3.0, 500, 0, 3)};                                                 // window 3: failed
  LiveSummary s = Summarise(v, 100, 1.0, 1000, 1.0);
  EXPECT_EQ(s.arrived, 8);
  EXPECT_EQ(s.ok, 3);
  EXPECT_EQ(s.shed, 1);
  EXPECT_EQ(s.slo_violations, 1);
  EXPECT_EQ(s.failed, 3);
  ASSERT_EQ(s.windows.size(), 4u);
  EXPECT_DOUBLE_EQ(s.windows[0].mean_quality, 90);
  EXPECT_DOUBLE_EQ(s.windows[1].mean_quality, 30);
  EXPECT_DOUBLE_EQ(s.windows[2].mean_quality, 0);
  EXPECT_DOUBLE_EQ(s.max_drop, 100);
  EXPECT_DOUBLE_EQ(s.mean_drop, (10 + 70 + 100 + 100) / 4.0);
  EXPECT_DOUBLE_EQ(s.windows[1].p99_ms, 5000);  // p99 over answered requests, late ones included
  // time_scale maps real arrival seconds back to trace seconds: at 0.5 everything lands twice as late.
  LiveSummary half = Summarise(v, 100, 1.0, 1000, 0.5);
  EXPECT_EQ(half.windows.size(), 7u);
}

}  // namespace
}  // namespace keel::hilo

#include "keel/hilo/service_link.h"

namespace keel::hilo {
namespace {

TEST(HiloLoadMeterRateWindow, ArrivalRateSpansTheLastWindowsUpToTheRateWindow) {
  LoadMeter m(4, 0);
  m.SetRateWindow(1000);
  auto arrive = [&m](int n) {
    for (int i = 0; i < n; ++i) {
      m.Arrive();
      m.Shed();
    }
  };
  arrive(2);
  EXPECT_DOUBLE_EQ(m.Take(250).arrival_rate, 8);   // 2 in 0.25 s: only one window so far
  arrive(0);
  EXPECT_DOUBLE_EQ(m.Take(500).arrival_rate, 4);   // 2 in 0.5 s
  arrive(1);
  EXPECT_DOUBLE_EQ(m.Take(750).arrival_rate, 4);   // 3 in 0.75 s
  arrive(1);
  EXPECT_DOUBLE_EQ(m.Take(1000).arrival_rate, 4);  // 4 in 1 s
  arrive(0);
  EXPECT_DOUBLE_EQ(m.Take(1250).arrival_rate, 2);  // the first window (2 arrivals) dropped: 2 in 1 s
  // Without a rate window, the current window alone: 0 arrivals in it.
  m.SetRateWindow(0);
  EXPECT_DOUBLE_EQ(m.Take(1500).arrival_rate, 0);
}

// recent_rate is the same count over its own, shorter span: a burst shows there at full size while
// the longer window still averages it down.
TEST(HiloLoadMeterRateWindow, RecentRateSpansItsOwnWindow) {
  LoadMeter m(4, 0);
  m.SetRateWindow(2000);
  m.SetRecentWindow(500);
  auto arrive = [&m](int n) {
    for (int i = 0; i < n; ++i) m.Arrive(), m.Shed();
  };
  for (int t = 250; t <= 2000; t += 250) {
    arrive(25);  // 100 req/s
    LoadReport r = m.Take(t);
    EXPECT_DOUBLE_EQ(r.arrival_rate, 100);
    EXPECT_DOUBLE_EQ(r.recent_rate, 100);
  }
  arrive(75);  // 300 req/s for one window
  LoadReport r = m.Take(2250);
  EXPECT_DOUBLE_EQ(r.recent_rate, 200);      // (25 + 75) in 0.5 s
  EXPECT_DOUBLE_EQ(r.arrival_rate, 125);     // (7 x 25 + 75) in 2 s
  arrive(75);
  r = m.Take(2500);
  EXPECT_DOUBLE_EQ(r.recent_rate, 300);
  EXPECT_DOUBLE_EQ(r.arrival_rate, 150);     // (6 x 25 + 2 x 75) in 2 s
  EXPECT_EQ(r.recent_span_ms, 500);          // what the recent rate covered, for the controller
}

// The span a report gives is the time its recent rate covered: whole windows, so the configured
// span rounded up to them (400 ms in 300 ms windows: 600), and less before enough have passed.
TEST(HiloLoadMeterRateWindow, RecentSpanIsTheTimeTheRateCovered) {
  LoadMeter m(4, 0);
  m.SetRecentWindow(400);
  m.Arrive(), m.Shed();
  EXPECT_EQ(m.Take(300).recent_span_ms, 300);  // one window so far
  EXPECT_EQ(m.Take(600).recent_span_ms, 600);
  EXPECT_EQ(m.Take(900).recent_span_ms, 600);
  m.SetRecentWindow(0);
  EXPECT_EQ(m.Take(1200).recent_span_ms, 300);  // the current window alone
}

}  // namespace
}  // namespace keel::hilo
