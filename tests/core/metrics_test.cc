#include "keel/core/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace keel {
namespace {

bool Contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

TEST(MetricsTest, CounterIncrementsAndIgnoresNegative) {
  Counter c;
  EXPECT_EQ(c.Value(), 0);
  c.Inc();
  c.Inc(2.5);
  c.Inc(-10);
  c.Inc(std::numeric_limits<double>::quiet_NaN());
  EXPECT_DOUBLE_EQ(c.Value(), 3.5);
  c.SetCallback([] { return 42.0; });
  EXPECT_DOUBLE_EQ(c.Value(), 42.0);
}

TEST(MetricsTest, GaugeSetIncDecAndCallback) {
  Gauge g;
  g.Set(5);
  g.Inc();
  g.Dec(3);
  EXPECT_DOUBLE_EQ(g.Value(), 3);
  int calls = 0;
  g.SetCallback([&] { return static_cast<double>(++calls); });
  EXPECT_DOUBLE_EQ(g.Value(), 1);
  EXPECT_DOUBLE_EQ(g.Value(), 2);
  g.SetCallback(nullptr);
  EXPECT_DOUBLE_EQ(g.Value(), 3);
}

TEST(MetricsTest, HistogramBucketsAreCumulativeAndInclusive) {
  Histogram h({0.1, 1, 10});
  h.Observe(0.05);
  h.Observe(0.1);  // "le" is inclusive
  h.Observe(0.5);
  h.Observe(100);
  h.Observe(std::nan(""));  // ignored
  auto s = h.Snap();
  ASSERT_EQ(s.cumulative.size(), 4u);
  EXPECT_EQ(s.cumulative[0], 2u);
  EXPECT_EQ(s.cumulative[1], 3u);
  EXPECT_EQ(s.cumulative[2], 3u);
  EXPECT_EQ(s.cumulative[3], 4u);
  EXPECT_EQ(s.count, 4u);
  EXPECT_DOUBLE_EQ(s.sum, 100.65);
}

TEST(MetricsTest, HistogramSortsAndDedupsBounds) {
  Histogram h({5, 1, 1, std::numeric_limits<double>::infinity()});
  EXPECT_EQ(h.bounds(), (std::vector<double>{1, 5}));
}

TEST(MetricsTest, RenderExactText) {
  MetricsRegistry reg;
  reg.AddCounter("b_total", "A counter.").Get().Inc(3);
  reg.AddGauge("a_gauge", "A gauge.").Get().Set(1.5);
  auto& h = reg.AddHistogram("c_seconds", "Latency.", {0.5, 1}).Get();
  h.Observe(0.25);
  h.Observe(2);
  const std::string want =
      "# HELP a_gauge A gauge.\n"
      "# TYPE a_gauge gauge\n"
      "a_gauge 1.5\n"
      "# HELP b_total A counter.\n"
      "# TYPE b_total counter\n"
      "b_total 3\n"
      "# HELP c_seconds Latency.\n"
      "# TYPE c_seconds histogram\n"
      "c_seconds_bucket{le=\"0.5\"} 1\n"
      "c_seconds_bucket{le=\"1\"} 1\n"
      "c_seconds_bucket{le=\"+Inf\"} 2\n"
      "c_seconds_sum 2.25\n"
      "c_seconds_count 2\n";
  EXPECT_EQ(reg.Render(), want);
}

TEST(MetricsTest, LabelledFamiliesRenderEachInstance) {
  MetricsRegistry reg;
  auto& req = reg.AddCounter("keel_requests_total", "Requests.", {"route", "code"});
  req.WithLabels({"/v1/completions", "200"}).Inc();
  req.WithLabels({"/v1/completions", "200"}).Inc();
  req.WithLabels({"/healthz", "200"}).Inc();
  std::string text = reg.Render();
  EXPECT_TRUE(Contains(text, "keel_requests_total{route=\"/v1/completions\",code=\"200\"} 2\n")) << text;
  EXPECT_TRUE(Contains(text, "keel_requests_total{route=\"/healthz\",code=\"200\"} 1\n")) << text;
  auto& lat = reg.AddHistogram("lat_seconds", "L.", {1}, {"route"});
  lat.WithLabels({"/x"}).Observe(0.5);
  text = reg.Render();
  EXPECT_TRUE(Contains(text, "lat_seconds_bucket{route=\"/x\",le=\"1\"} 1\n")) << text;
  EXPECT_TRUE(Contains(text, "lat_seconds_sum{route=\"/x\"} 0.5\n")) << text;
  EXPECT_TRUE(Contains(text, "lat_seconds_count{route=\"/x\"} 1\n")) << text;
}

TEST(MetricsTest, EscapesLabelValuesAndHelp) {
  MetricsRegistry reg;
  reg.AddCounter("x_total", "Help with \\ and\nnewline.", {"v"}).WithLabels({"a\"b\\c\nd"}).Inc();
  std::string text = reg.Render();
  EXPECT_TRUE(Contains(text, "# HELP x_total Help with \\\\ and\\nnewline.\n")) << text;
  EXPECT_TRUE(Contains(text, "x_total{v=\"a\\\"b\\\\c\\nd\"} 1\n")) << text;
}

TEST(MetricsTest, WrongLabelCountIsPaddedOrTruncated) {
  MetricsRegistry reg;
  auto& f = reg.AddCounter("y_total", "Y.", {"a", "b"});
  f.WithLabels({"1"}).Inc();
  f.WithLabels({"1", "2", "3"}).Inc();
  std::string text = reg.Render();
  EXPECT_TRUE(Contains(text, "y_total{a=\"1\",b=\"\"} 1\n")) << text;
  EXPECT_TRUE(Contains(text, "y_total{a=\"1\",b=\"2\"} 1\n")) << text;
}

TEST(MetricsTest, ReRegistrationReturnsSameFamilyAndBadOnesAreDetached) {
  MetricsRegistry reg;
  auto& a = reg.AddCounter("dup_total", "First.");
  auto& b = reg.AddCounter("dup_total", "Second.");
  EXPECT_EQ(&a, &b);
  // Same name as another type, bad names, reserved label: usable but never rendered.
  reg.AddGauge("dup_total", "Gauge.").Get().Set(7);
  reg.AddCounter("bad name", "Bad.").Get().Inc();
  reg.AddCounter("9starts_with_digit", "Bad.").Get().Inc();
  reg.AddHistogram("h_seconds", "Bad label.", {1}, {"le"}).Get().Observe(1);
  std::string text = reg.Render();
  EXPECT_TRUE(Contains(text, "# HELP dup_total First.\n")) << text;
  EXPECT_FALSE(Contains(text, "Gauge.")) << text;
  EXPECT_FALSE(Contains(text, "bad name")) << text;
  EXPECT_FALSE(Contains(text, "9starts")) << text;
  EXPECT_FALSE(Contains(text, "h_seconds")) << text;
}

TEST(MetricsTest, ValueFormatting) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(42), "42");
  EXPECT_EQ(FormatMetricValue(0.005), "0.005");
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatMetricValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatMetricValue(std::nan("")), "NaN");
  EXPECT_TRUE(IsValidMetricName("keel:requests_total"));
  EXPECT_FALSE(IsValidMetricName("keel:x", /*label=*/true));
  EXPECT_FALSE(IsValidMetricName(""));
}

TEST(MetricsTest, BucketHelpers) {
  auto e = ExponentialBuckets(1, 2, 4);
  EXPECT_EQ(e, (std::vector<double>{1, 2, 4, 8}));
  auto l = LatencyBuckets();
  ASSERT_FALSE(l.empty());
  for (size_t i = 1; i < l.size(); ++i) EXPECT_LT(l[i - 1], l[i]);
}

TEST(MetricsTest, ConcurrentUpdatesAndRendersAreConsistent) {
  MetricsRegistry reg;
  auto& fam = reg.AddCounter("c_total", "C.", {"t"});
  auto& hist = reg.AddHistogram("h_seconds", "H.", {0.5}).Get();
  auto& gauge = reg.AddGauge("g", "G.").Get();
  constexpr int kThreads = 8, kIters = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters; ++i) {
        fam.WithLabels({std::to_string(t % 2)}).Inc();
        hist.Observe(i % 2 ? 0.25 : 1.0);
        gauge.Inc();
      }
    });
  }
  // Render while writers run: it must never crash or produce a torn histogram.
  for (int i = 0; i < 50; ++i) {
    auto s = hist.Snap();
    EXPECT_EQ(s.cumulative.back(), s.count);
    (void)reg.Render();
  }
  for (auto& th : threads) th.join();
  EXPECT_DOUBLE_EQ(fam.WithLabels({"0"}).Value() + fam.WithLabels({"1"}).Value(), kThreads * kIters);
  EXPECT_EQ(hist.Snap().count, static_cast<uint64_t>(kThreads * kIters));
  EXPECT_DOUBLE_EQ(gauge.Value(), kThreads * kIters);
}

}  // namespace
}  // namespace keel
