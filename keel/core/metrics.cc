#include "keel/core/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "keel/core/log.h"

namespace keel {

namespace {

// Atomic add for doubles without relying on fetch_add support for floating types.
void AtomicAdd(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

// HELP text escapes backslash and newline; label values also escape the double quote.
std::string Escape(std::string_view s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}` from names and values, plus an optional trailing extra pair (histogram "le").
std::string LabelSet(const std::vector<std::string>& names, const std::vector<std::string>& values,
                     std::string_view extra_name = {}, std::string_view extra_value = {}) {
  if (names.empty() && extra_name.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += ',';
    out += names[i];
    out += "=\"";
    out += Escape(i < values.size() ? values[i] : std::string(), true);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out += ',';
    out += extra_name;
    out += "=\"";
    out += extra_value;
    out += '"';
  }
  out += '}';
  return out;
}

void RenderHeader(std::string& out, const std::string& name, const std::string& help, MetricType t) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, Escape(help, false), name,
                     MetricTypeName(t));
}

template <typename M>
void RenderSimple(std::string& out, const MetricFamily<M>& f, MetricType t) {
  RenderHeader(out, f.name(), f.help(), t);
  f.ForEach([&](const std::vector<std::string>& labels, const M& m) {
    out += f.name();
    out += LabelSet(f.label_names(), labels);
    out += ' ';
    out += FormatMetricValue(m.Value());
    out += '\n';
  });
}

void RenderHistogram(std::string& out, const HistogramFamily& f) {
  RenderHeader(out, f.name(), f.help(), MetricType::kHistogram);
  f.ForEach([&](const std::vector<std::string>& labels, const Histogram& h) {
    Histogram::Snapshot s = h.Snap();
    for (size_t i = 0; i <= s.bounds.size(); ++i) {
      std::string le = i < s.bounds.size() ? FormatMetricValue(s.bounds[i]) : "+Inf";
      out += fmt::format("{}_bucket{} {}\n", f.name(), LabelSet(f.label_names(), labels, "le", le),
                         s.cumulative[i]);
    }
    std::string ls = LabelSet(f.label_names(), labels);
    out += fmt::format("{}_sum{} {}\n", f.name(), ls, FormatMetricValue(s.sum));
    out += fmt::format("{}_count{} {}\n", f.name(), ls, s.count);
  });
}

bool ValidLabels(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    if (!IsValidMetricName(n, /*label=*/true) || n == "le") return false;
  }
  return true;
}

}  // namespace

void Counter::Inc(double v) {
  if (!(v > 0)) return;  // also drops NaN
  AtomicAdd(value_.stored(), v);
}

void Gauge::Set(double v) { value_.stored().store(v, std::memory_order_relaxed); }

void Gauge::Inc(double v) { AtomicAdd(value_.stored(), v); }

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  // Keep only a strictly increasing, finite prefix-free list; +Inf is implicit.
  std::sort(bounds_.begin(), bounds_.end());
  bounds_.erase(std::unique(bounds_.begin(), bounds_.end()), bounds_.end());
  bounds_.erase(std::remove_if(bounds_.begin(), bounds_.end(),
                               [](double b) { return !std::isfinite(b); }),
                bounds_.end());
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::Observe(double v) {
  if (std::isnan(v)) return;
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

Histogram::Snapshot Histogram::Snap() const {
  Snapshot s;
  s.bounds = bounds_;
  std::lock_guard<std::mutex> lock(mu_);
  s.cumulative.resize(counts_.size());
  uint64_t acc = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    acc += counts_[i];
    s.cumulative[i] = acc;
  }
  s.sum = sum_;
  s.count = count_;
  return s;
}

std::vector<double> LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> out;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) out.push_back(v);
  return out;
}

std::string_view MetricTypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
  }
  return "untyped";
}

bool IsValidMetricName(std::string_view name, bool label) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (!label && c == ':');
    bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

std::string FormatMetricValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

MetricsRegistry::Entry* MetricsRegistry::Find(const std::string& name, MetricType type,
                                              bool* wrong_type) {
  *wrong_type = false;
  auto it = families_.find(name);
  if (it == families_.end()) return nullptr;
  if (it->second.type != type) {
    *wrong_type = true;
    return nullptr;
  }
  return &it->second;
}

CounterFamily& MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                           std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  bool wrong = false;
  if (Entry* e = Find(name, MetricType::kCounter, &wrong)) return *e->counter;
  Entry entry{MetricType::kCounter, nullptr, nullptr, nullptr};
  bool valid = !wrong && IsValidMetricName(name) && ValidLabels(label_names);
  entry.counter = std::make_unique<CounterFamily>(name, help, std::move(label_names),
                                                  [] { return std::make_unique<Counter>(); });
  if (!valid) {
    Log().error("metrics: cannot register counter '{}' (bad name/labels or registered as another type)", name);
    detached_.push_back(std::move(entry));
    return *detached_.back().counter;
  }
  return *families_.emplace(name, std::move(entry)).first->second.counter;
}

GaugeFamily& MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                       std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  bool wrong = false;
  if (Entry* e = Find(name, MetricType::kGauge, &wrong)) return *e->gauge;
  Entry entry{MetricType::kGauge, nullptr, nullptr, nullptr};
  bool valid = !wrong && IsValidMetricName(name) && ValidLabels(label_names);
  entry.gauge = std::make_unique<GaugeFamily>(name, help, std::move(label_names),
                                              [] { return std::make_unique<Gauge>(); });
  if (!valid) {
    Log().error("metrics: cannot register gauge '{}' (bad name/labels or registered as another type)", name);
    detached_.push_back(std::move(entry));
    return *detached_.back().gauge;
  }
  return *families_.emplace(name, std::move(entry)).first->second.gauge;
}

HistogramFamily& MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                               std::vector<double> bounds,
                                               std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  bool wrong = false;
  if (Entry* e = Find(name, MetricType::kHistogram, &wrong)) return *e->histogram;
  Entry entry{MetricType::kHistogram, nullptr, nullptr, nullptr};
  bool valid = !wrong && IsValidMetricName(name) && ValidLabels(label_names);
  entry.histogram = std::make_unique<HistogramFamily>(
      name, help, std::move(label_names),
      [bounds = std::move(bounds)] { return std::make_unique<Histogram>(bounds); });
  if (!valid) {
    Log().error("metrics: cannot register histogram '{}' (bad name/labels or registered as another type)", name);
    detached_.push_back(std::move(entry));
    return *detached_.back().histogram;
  }
  return *families_.emplace(name, std::move(entry)).first->second.histogram;
}

std::string MetricsRegistry::Render() const {
  // Families are never removed, so rendering outside the registry lock is safe once we hold
  // pointers; that keeps a slow gauge callback from blocking registrations.
  std::vector<const Entry*> entries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    entries.reserve(families_.size());
    for (const auto& [name, e] : families_) entries.push_back(&e);
  }
  std::string out;
  for (const Entry* e : entries) {
    switch (e->type) {
      case MetricType::kCounter: RenderSimple(out, *e->counter, e->type); break;
      case MetricType::kGauge: RenderSimple(out, *e->gauge, e->type); break;
      case MetricType::kHistogram: RenderHistogram(out, *e->histogram); break;
    }
  }
  return out;
}

}  // namespace keel
