#include "keel/hilo/report.h"

#include <nlohmann/json.hpp>

#include "keel/core/json_reader.h"
#include "keel/hilo/json_fields.h"

namespace keel::hilo {

using internal::ObjectReader;

namespace {
constexpr int64_t kMaxCount = 1000000000;
constexpr double kMaxRate = 1e9;
constexpr int64_t kMaxUnixMs = int64_t{1} << 45;
}  // namespace

Result<LoadReport> ParseLoadReport(std::string_view text) {
  if (text.size() > kMaxReportBytes) {
    return Status::InvalidArgument("load report: larger than " + std::to_string(kMaxReportBytes) + " bytes");
  }
  JsonLimits limits;
  limits.max_depth = 4;  // a report is flat; a little room for fields a newer service adds
  limits.max_values = 256;
  limits.require_object = true;
  limits.reject_duplicate_keys = true;
  Result<nlohmann::json> doc = ParseUntrustedJson(text, limits);
  if (!doc.ok()) return Status::InvalidArgument("load report: " + doc.status().message());
  KEEL_ASSIGN_OR_RETURN(ObjectReader r, ObjectReader::Open(*doc, ""));
  LoadReport out;
  std::string service;
  KEEL_RETURN_IF_ERROR(r.String("service", 64, &service));
  std::optional<Service> s = ServiceFromName(service);
  if (!s) return Status::InvalidArgument("service: expected answer, vector, engine or gateway");
  out.service = *s;
  KEEL_RETURN_IF_ERROR(r.Name("instance", false, &out.instance));
  KEEL_RETURN_IF_ERROR(r.Int("unix_ms", 0, kMaxUnixMs, &out.unix_ms));
  KEEL_RETURN_IF_ERROR(r.Number("arrival_rate", 0, kMaxRate, &out.arrival_rate));
  if (r.Member("recent_rate") != nullptr) KEEL_RETURN_IF_ERROR(r.Number("recent_rate", 0, kMaxRate, &out.recent_rate));
  if (r.Member("recent_span_ms") != nullptr) {
    KEEL_RETURN_IF_ERROR(r.Int("recent_span_ms", 0, kMaxRecentSpanMs, &out.recent_span_ms));
  }
  KEEL_RETURN_IF_ERROR(r.Int("in_flight", 0, kMaxCount, &out.in_flight));
  KEEL_RETURN_IF_ERROR(r.Int("queue_depth", 0, kMaxCount, &out.queue_depth));
  KEEL_RETURN_IF_ERROR(r.Number("utilisation", 0, 1, &out.utilisation));
  KEEL_RETURN_IF_ERROR(r.Number("p99_ms", 0, kMaxRate, &out.p99_ms));
  KEEL_RETURN_IF_ERROR(r.Name("applied_state", true, &out.applied_state));
  if (r.Member("binaries") != nullptr) KEEL_RETURN_IF_ERROR(r.String("binaries", kMaxBinariesBytes, &out.binaries));
  return out;
}

std::string WriteLoadReport(const LoadReport& r) {
  nlohmann::ordered_json j;
  j["service"] = ServiceName(r.service);
  j["instance"] = r.instance;
  j["unix_ms"] = r.unix_ms;
  j["arrival_rate"] = r.arrival_rate;
  j["recent_rate"] = r.recent_rate;
  j["recent_span_ms"] = r.recent_span_ms;
  j["in_flight"] = r.in_flight;
  j["queue_depth"] = r.queue_depth;
  j["utilisation"] = r.utilisation;
  j["p99_ms"] = r.p99_ms;
  j["applied_state"] = r.applied_state;
  if (!r.binaries.empty()) j["binaries"] = r.binaries;
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace keel::hilo
