// Metrics in the Prometheus text exposition format (version 0.0.4), served on /metrics.
//
// A MetricsRegistry owns metric families by name; a family owns one metric per set of label
// values (an unlabelled family has exactly one, reached with Get()). Counters, gauges and
// histograms are updated from any thread without locks on the hot path except the histogram,
// whose short mutex keeps _bucket, _sum and _count consistent within one scrape.
// Everything here is thread-safe: register, update and Render may run concurrently.
//
// References returned by the registry and by families stay valid for the registry's lifetime.
//
//   MetricsRegistry reg;
//   auto& requests = reg.AddCounter("keel_requests_total", "HTTP requests.", {"route", "code"});
//   requests.WithLabels({"/v1/completions", "200"}).Inc();
//   auto& ttft = reg.AddHistogram("keel_time_to_first_token_seconds", "TTFT.", LatencyBuckets());
//   ttft.Get().Observe(0.012);
//   std::string text = reg.Render();
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

namespace internal {
// The value behind a Counter or a Gauge: a stored atomic double, or, once a callback is set, the
// callback's result (read at scrape time). Thread-safe.
class StoredOrComputed {
 public:
  std::atomic<double>& stored() { return value_; }
  void SetCallback(std::function<double()> fn) {
    std::lock_guard<std::mutex> lock(fn_mu_);
    fn_ = std::move(fn);
  }
  double Value() const {
    {
      std::lock_guard<std::mutex> lock(fn_mu_);
      if (fn_) return fn_();
    }
    return value_.load(std::memory_order_relaxed);
  }

 private:
  std::atomic<double> value_{0.0};
  mutable std::mutex fn_mu_;
  std::function<double()> fn_;
};
}  // namespace internal

// A monotonically increasing value. Either updated with Inc, or read from a callback at render
// time (for totals another component already keeps); a callback, once set, wins.
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds `v`; negative values are ignored (a counter never goes down).
  void Inc(double v = 1.0);
  void SetCallback(std::function<double()> fn) { value_.SetCallback(std::move(fn)); }
  double Value() const { return value_.Value(); }

 private:
  internal::StoredOrComputed value_;
};

// A value that goes up and down, or is read from a callback at render time.
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double v);
  void Inc(double v = 1.0);
  void Dec(double v = 1.0) { Inc(-v); }
  // Evaluated by Value() (so on every scrape, on the scraping thread); it must be quick and
  // thread-safe. An empty function returns the gauge to Set/Inc mode.
  void SetCallback(std::function<double()> fn) { value_.SetCallback(std::move(fn)); }
  double Value() const { return value_.Value(); }

 private:
  internal::StoredOrComputed value_;
};

// Counts observations into fixed buckets. `bounds` are the upper bounds (inclusive, "le"),
// strictly increasing; a +Inf bucket is always added. Rendered cumulatively as Prometheus does.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void Observe(double v);

  struct Snapshot {
    std::vector<double> bounds;        // without +Inf
    std::vector<uint64_t> cumulative;  // bounds.size() + 1 entries; the last is the count
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Snap() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last = +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Bucket bounds for latencies in seconds: 1 ms .. 60 s, roughly x2.5 apart.
std::vector<double> LatencyBuckets();
// `count` bounds start, start*factor, ... (Prometheus' ExponentialBuckets).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

enum class MetricType { kCounter, kGauge, kHistogram };
std::string_view MetricTypeName(MetricType t);  // "counter", "gauge", "histogram"

// One named metric with HELP and TYPE, and one metric instance per label-value tuple.
// Instances are created on first use and live as long as the family. Keep label values to a
// small fixed set (route names, status codes): each distinct tuple is a time series forever.
template <typename M>
class MetricFamily {
 public:
  MetricFamily(std::string name, std::string help, std::vector<std::string> label_names,
               std::function<std::unique_ptr<M>()> make)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)),
        make_(std::move(make)) {
    // An unlabelled family renders its single sample from the start, even before first use.
    if (label_names_.empty()) instances_[{}] = make_();
  }
  MetricFamily(const MetricFamily&) = delete;
  MetricFamily& operator=(const MetricFamily&) = delete;

  // The instance for `values`, one per label name, in the same order. Missing values are
  // rendered as "" and extra ones are dropped, so a wrong call cannot break the exposition.
  M& WithLabels(const std::vector<std::string>& values) {
    std::vector<std::string> key = values;
    key.resize(label_names_.size());
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = instances_[key];
    if (!slot) slot = make_();
    return *slot;
  }
  // The unlabelled instance (or the one with all label values empty).
  M& Get() { return WithLabels({}); }

  // Calls fn(label_values, metric) for every instance, in label order.
  template <typename Fn>
  void ForEach(Fn&& fn) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [labels, m] : instances_) fn(labels, *m);
  }

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::function<std::unique_ptr<M>()> make_;
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> instances_;
};

using CounterFamily = MetricFamily<Counter>;
using GaugeFamily = MetricFamily<Gauge>;
using HistogramFamily = MetricFamily<Histogram>;

// Owns metric families by name and renders them all. Thread-safe.
//
// Adding a name that already exists with the same type returns the existing family (its HELP,
// labels and buckets stay as first registered). Adding it with a different type, or with a name
// that is not a valid Prometheus metric name, is a programming error: it is logged, and a
// detached family is returned that works but is never rendered.
class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  CounterFamily& AddCounter(const std::string& name, const std::string& help,
                            std::vector<std::string> label_names = {});
  GaugeFamily& AddGauge(const std::string& name, const std::string& help,
                        std::vector<std::string> label_names = {});
  HistogramFamily& AddHistogram(const std::string& name, const std::string& help,
                                std::vector<double> bounds,
                                std::vector<std::string> label_names = {});

  // All families in name order, as Prometheus text (Content-Type kContentType).
  std::string Render() const;

  static constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

 private:
  struct Entry {
    MetricType type;
    std::unique_ptr<CounterFamily> counter;
    std::unique_ptr<GaugeFamily> gauge;
    std::unique_ptr<HistogramFamily> histogram;
  };
  Entry* Find(const std::string& name, MetricType type, bool* wrong_type);

  mutable std::mutex mu_;
  std::map<std::string, Entry> families_;
  std::vector<Entry> detached_;  // wrong registrations; kept alive, never rendered
};

// True for names matching [a-zA-Z_:][a-zA-Z0-9_:]* (metric names) or, with `label`,
// [a-zA-Z_][a-zA-Z0-9_]* (label names).
bool IsValidMetricName(std::string_view name, bool label = false);
// Formats a sample value as Prometheus expects: shortest round-trip decimal, "+Inf", "-Inf",
// "NaN".
std::string FormatMetricValue(double v);

}  // namespace keel
