#include "keel/hilo/trace.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace keel::hilo {

namespace {

constexpr double kDuration = 300;

Trace Make(std::string name, std::vector<std::pair<double, double>> points, uint64_t seed = 0) {
  Trace t;
  t.name = std::move(name);
  t.duration_s = kDuration;
  t.seed = seed;
  t.points = std::move(points);
  return t;
}

// SplitMix64: a tiny, fully specified generator, so a trace's noise is the same on every platform.
double Uniform01(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

Trace Sawtooth() {
  // Five teeth, each a 30 s linear rise from 1x to 1.7x and an immediate fall.
  std::vector<std::pair<double, double>> p = {{0, 1}, {30, 1}};
  for (int i = 0; i < 5; ++i) {
    double top = 60 + 30 * i;
    p.push_back({top, 1.7});
    p.push_back({top + 0.5, 1});
  }
  p.push_back({kDuration, 1});
  return Make("sawtooth", std::move(p));
}

Trace FlashCrowd() {
  // 3 s rise to 2.3x, then exponential decay towards 1x (tau 40 s), sampled every 2 s, 1x at the end.
  std::vector<std::pair<double, double>> p = {{0, 1}, {60, 1}};
  for (double t = 63; t <= 290; t += 2) p.push_back({t, 1 + 1.3 * std::exp(-(t - 63) / 40)});
  p.push_back({kDuration, 1});
  return Make("flash_crowd", std::move(p));
}

Trace PlateauJitter(uint64_t seed) {
  // A plateau whose rate jitters between 1.35x and 1.6x every 2 s; the first plateau point is
  // exactly the peak so the stated peak holds for every seed.
  uint64_t state = seed;
  std::vector<std::pair<double, double>> p = {{0, 1}, {50, 1}, {60, 1.6}};
  for (double t = 62; t <= 240; t += 2) p.push_back({t, 1.6 - 0.25 * Uniform01(state)});
  p.push_back({250, 1});
  p.push_back({kDuration, 1});
  return Make("plateau_jitter", std::move(p), seed);
}

Trace DiurnalBump() {
  // A raised cosine over the whole trace, peak 1.5x at 150 s, sampled every 2 s.
  std::vector<std::pair<double, double>> p;
  for (double t = 0; t <= kDuration; t += 2) {
    p.push_back({t, 1 + 0.5 * 0.5 * (1 - std::cos(2 * M_PI * t / kDuration))});
  }
  return Make("diurnal_bump", std::move(p));
}

}  // namespace

double Trace::Multiplier(double t_s) const {
  if (points.empty()) return 0;
  if (t_s <= points.front().first) return points.front().second;
  if (t_s >= points.back().first) return points.back().second;
  auto hi = std::upper_bound(points.begin(), points.end(), t_s,
                             [](double t, const std::pair<double, double>& p) { return t < p.first; });
  auto lo = hi - 1;
  double f = (t_s - lo->first) / (hi->first - lo->first);
  return lo->second + f * (hi->second - lo->second);
}

double Trace::Peak() const {
  double peak = 0;
  for (const auto& p : points) peak = std::max(peak, p.second);
  return peak;
}

std::vector<Trace> SurgeTraces(uint64_t seed) {
  std::vector<Trace> v;
  v.push_back(Make("step", {{0, 1}, {60, 1}, {61, 1.8}, {240, 1.8}, {241, 1}, {kDuration, 1}}));
  v.push_back(Make("ramp", {{0, 1}, {60, 1}, {180, 2.0}, {240, 2.0}, {270, 1}, {kDuration, 1}}));
  v.push_back(Make("spike", {{0, 1}, {100, 1}, {105, 2.38}, {125, 2.38}, {130, 1}, {kDuration, 1}}));
  v.push_back(Make("double_peak",
                   {{0, 1}, {60, 1}, {80, 1.9}, {110, 1.2}, {150, 1.2}, {170, 2.2}, {200, 1}, {kDuration, 1}}));
  v.push_back(Sawtooth());
  v.push_back(Make("slow_swell", {{0, 1}, {30, 1}, {180, 1.9}, {270, 1}, {kDuration, 1}}));
  v.push_back(FlashCrowd());
  v.push_back(PlateauJitter(seed));
  v.push_back(DiurnalBump());
  return v;
}

Trace Surge3x() { return Make("surge_3x", {{0, 1}, {60, 1}, {90, 3}, {210, 3}, {240, 1}, {kDuration, 1}}); }

namespace {

bool ParseDouble(std::string_view s, double& out) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  if (s.empty()) return false;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size() && std::isfinite(out);
}

}  // namespace

Result<Trace> ParseCsvTrace(std::string_view text, std::string name, double baseline_rate) {
  Trace t;
  t.name = std::move(name);
  std::vector<std::pair<double, double>> rows;
  size_t line_no = 0;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    std::string_view trimmed = line;
    while (!trimmed.empty() && (trimmed.back() == '\r' || trimmed.back() == ' ')) trimmed.remove_suffix(1);
    if (trimmed.empty() || trimmed.front() == '#') continue;
    bool header = rows.empty() && line_no == 1 && !(trimmed.front() >= '0' && trimmed.front() <= '9');
    if (header) continue;
    std::string where = "line " + std::to_string(line_no) + ": ";
    size_t comma = trimmed.find(',');
    double ts = 0;
    double rate = 0;
    if (comma == std::string_view::npos || !ParseDouble(trimmed.substr(0, comma), ts) ||
        !ParseDouble(trimmed.substr(comma + 1), rate)) {
      return Status::InvalidArgument(where + "expected \"t_s,rate\" with two finite numbers");
    }
    if (ts < 0 || rate < 0) return Status::InvalidArgument(where + "negative time or rate");
    if (!rows.empty() && ts <= rows.back().first) {
      return Status::InvalidArgument(where + "time does not increase");
    }
    rows.push_back({ts, rate});
  }
  if (rows.size() < 2) return Status::InvalidArgument("trace " + t.name + ": fewer than 2 rows");
  if (baseline_rate <= 0) baseline_rate = rows.front().second;
  if (!(baseline_rate > 0)) return Status::InvalidArgument("trace " + t.name + ": first rate is 0, no baseline");
  for (auto& r : rows) r.second /= baseline_rate;
  t.duration_s = rows.back().first;
  t.points = std::move(rows);
  return t;
}

}  // namespace keel::hilo
