// Surge traces for the HiLO evaluation: arrival rate as a function of time, as a multiple of a
// baseline rate, so one trace drives a small live run and a 100x simulation alike. A trace is a
// piecewise-linear curve through (t_s, multiplier) points; any noise is drawn once, when the trace
// is built, from its seed, so a trace is a fixed curve. Plain values; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/status.h"

namespace keel::hilo {

struct Trace {
  std::string name;
  double duration_s = 0;
  uint64_t seed = 0;  // the seed its noise was drawn from (0 for traces without noise)
  std::vector<std::pair<double, double>> points;  // (t_s, multiplier), t strictly increasing

  // The multiplier at t_s: linear between points, the end values outside them.
  double Multiplier(double t_s) const;
  // The largest multiplier (a piecewise-linear curve peaks at a point).
  double Peak() const;
};

// The nine surge shapes, in this order: step, ramp, spike, double_peak, sawtooth, slow_swell,
// flash_crowd, plateau_jitter, diurnal_bump. Each lasts 300 s, starts and ends at 1x, and peaks
// between 1.5x and 2.38x; the largest peak of the nine is exactly 2.38x (spike). `seed` draws
// plateau_jitter's noise; the others have none.
std::vector<Trace> SurgeTraces(uint64_t seed);
// surge_3x: a 30 s ramp to 3x, held 120 s, a 30 s ramp back; 300 s.
Trace Surge3x();

// Reads a CSV trace of "t_s,rate" rows (absolute req/s, e.g. measured live). An optional first
// header row that does not start with a digit, blank lines and lines starting with '#' are
// skipped. Times must be >= 0 and strictly increasing, rates finite and >= 0, at least 2 rows.
// Multipliers are rate / baseline_rate; baseline_rate <= 0 means the first row's rate (which must
// then be > 0). duration_s is the last row's time. InvalidArgument naming the line otherwise.
Result<Trace> ParseCsvTrace(std::string_view text, std::string name, double baseline_rate);

}  // namespace keel::hilo
