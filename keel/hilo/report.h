// LoadReport: what every service instance tells the HiLO controller every few hundred ms, and its
// JSON codec. The reader takes any bytes (reports come over the network): sizes and depth are
// bounded, and a missing, mistyped, negative, non-finite or absurdly large field is
// InvalidArgument naming the field. Unknown fields are ignored, so a newer service can report
// more than an older controller reads. Plain values; thread-safe functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/hilo/catalog.h"

namespace keel::hilo {

struct LoadReport {
  Service service = Service::kAnswer;
  std::string instance;       // a name unique within the service ("vector-0", "127.0.0.1:8080")
  int64_t unix_ms = 0;        // when the figures were taken, by the reporting machine's clock
  double arrival_rate = 0;    // requests/s arriving (admitted or not) over the last window
  // requests/s over the newest ~500 ms only (ServiceLinkOptions::recent_window_ms): noisier, but
  // it shows a fast onset a second or more before the smoothed rate does. Optional on the wire
  // (0 when a service does not send it).
  double recent_rate = 0;
  // The time recent_rate covers, ms (whole report windows, so about recent_window_ms): the
  // controller bounds the rate's noise with it. Optional (0: not sent; the controller then
  // assumes its own recent_window_s).
  int64_t recent_span_ms = 0;
  int64_t in_flight = 0;      // requests being served
  int64_t queue_depth = 0;    // requests waiting
  double utilisation = 0;     // busy fraction of the service's workers, 0..1
  double p99_ms = 0;          // latency p99 over the last window
  std::string applied_state;  // the product state the instance runs in now ("" before the first)
  // The instance's own binaries (ExecutableFingerprint, fingerprint.h). The controller refuses
  // reports from binaries other than those its catalog was validated with: their capacities are
  // not the measured ones. Optional on the wire ("": not sent, as by an older service).
  std::string binaries;
};

inline constexpr size_t kMaxReportBytes = 4096;
inline constexpr size_t kMaxBinariesBytes = 128;
// The span recent_rate covers by default. A report says what its rate covered (recent_span_ms);
// for one that does not (an older service) the controller assumes its recent_window_s, whose
// default is this same value.
inline constexpr int kDefaultRecentWindowMs = 500;
inline constexpr int64_t kMaxRecentSpanMs = 3600 * 1000;

// Reads one report. Bounds: arrival_rate and recent_rate (optional) 0..1e9, recent_span_ms
// (optional) 0..3600000, in_flight and queue_depth 0..1e9, utilisation 0..1, p99_ms 0..1e9,
// unix_ms 0..2^45 (year ~3084); instance and applied_state are names (1..64 of [A-Za-z0-9_.:-];
// applied_state may be ""); binaries (optional) a string of at most kMaxBinariesBytes; service one
// of the catalog's services.
Result<LoadReport> ParseLoadReport(std::string_view text);
// Writes `r` as one line of JSON that ParseLoadReport reads back to an equal report.
std::string WriteLoadReport(const LoadReport& r);

}  // namespace keel::hilo
