#include "keel/hilo/baseline.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace keel::hilo {
namespace {

bool FiniteNonNegative(double v) { return std::isfinite(v) && v >= 0; }

}  // namespace

Status CheckBaselineOptions(const BaselineOptions& b) {
  if (!FiniteNonNegative(b.degrade_queue_ms) || !FiniteNonNegative(b.recover_queue_ms) ||
      b.recover_queue_ms > b.degrade_queue_ms) {
    return Status::InvalidArgument("expected 0 <= recover_queue_ms <= degrade_queue_ms, finite");
  }
  if (!FiniteNonNegative(b.recover_dwell_s) || !FiniteNonNegative(b.min_dwell_s)) {
    return Status::InvalidArgument("recover_dwell_s and min_dwell_s must be finite and >= 0");
  }
  return Status::Ok();
}

Result<ServicePolicy> ServicePolicy::Create(int num_levels, ServicePolicyOptions o) {
  auto bad = [](const std::string& what) { return Status::InvalidArgument("service policy: " + what); };
  if (num_levels < 1) return bad("num_levels must be >= 1");
  if (Status s = CheckBaselineOptions(o.baseline); !s.ok()) return bad(s.message());
  if (!(o.utilisation_threshold >= 0 && o.utilisation_threshold <= 1)) {
    return bad("utilisation_threshold must be in [0, 1] (0 = not used)");
  }
  if (!FiniteNonNegative(o.p99_bound_ms)) return bad("p99_bound_ms must be finite and >= 0 (0 = not used)");
  if (!FiniteNonNegative(o.degrade_gap_s)) return bad("degrade_gap_s must be finite and >= 0");
  if (o.initial_level < 0 || o.initial_level >= num_levels) return bad("initial_level must be in [0, num_levels)");
  return ServicePolicy(num_levels, o);
}

double ServicePolicy::QueueDelayMs(const LoadReport& r) {
  if (r.queue_depth <= 0) return 0;
  if (!(r.arrival_rate > 0)) return std::numeric_limits<double>::infinity();  // a queue nothing drains into
  return 1000.0 * static_cast<double>(r.queue_depth) / r.arrival_rate;
}

bool ServicePolicy::Overloaded(const LoadReport& r, std::string* why) const {
  const double qd = QueueDelayMs(r);
  if (qd > opt_.baseline.degrade_queue_ms) {
    if (why) {
      *why = fmt::format("queue {} at {:.1f} req/s: ~{:.0f} ms queueing > {} ms", r.queue_depth, r.arrival_rate, qd,
                         opt_.baseline.degrade_queue_ms);
    }
    return true;
  }
  if (opt_.utilisation_threshold > 0 && r.utilisation >= opt_.utilisation_threshold) {
    if (why) *why = fmt::format("utilisation {:.3f} >= {}", r.utilisation, opt_.utilisation_threshold);
    return true;
  }
  if (opt_.p99_bound_ms > 0 && r.p99_ms > opt_.p99_bound_ms) {
    if (why) *why = fmt::format("p99 {:.1f} ms > {} ms", r.p99_ms, opt_.p99_bound_ms);
    return true;
  }
  return false;
}

bool ServicePolicy::Calm(const LoadReport& r) const {
  return !Overloaded(r) && QueueDelayMs(r) < opt_.baseline.recover_queue_ms;
}

ServiceStep ServicePolicy::Observe(const LoadReport& r, int64_t now_ms) {
  ServiceStep step;
  step.from = level_;
  step.to = level_;
  const double since_change_s = changed_once_ ? (now_ms - last_change_ms_) / 1000.0
                                              : std::numeric_limits<double>::infinity();
  std::string why;
  if (Overloaded(r, &why)) {
    calm_since_ms_ = -1;
    if (level_ + 1 < num_levels_ && since_change_s >= opt_.degrade_gap_s) {
      ++level_;
      step.reason = "overloaded (" + r.instance + "): " + why;
    }
  } else if (!Calm(r)) {
    calm_since_ms_ = -1;
  } else {
    if (calm_since_ms_ < 0) calm_since_ms_ = now_ms;
    const double calm_s = (now_ms - calm_since_ms_) / 1000.0;
    if (level_ > 0 && calm_s >= opt_.baseline.recover_dwell_s && since_change_s >= opt_.baseline.min_dwell_s) {
      --level_;
      calm_since_ms_ = now_ms;  // each further step needs another full dwell
      step.reason = fmt::format("calm for {:.1f} s", calm_s);
    }
  }
  if (level_ != step.from) {
    step.changed = true;
    step.to = level_;
    changed_once_ = true;
    last_change_ms_ = now_ms;
  }
  return step;
}

}  // namespace keel::hilo
