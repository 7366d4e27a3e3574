#include "keel/hilo/report.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace keel::hilo {
namespace {

using nlohmann::json;

LoadReport Sample() {
  LoadReport r;
  r.service = Service::kVector;
  r.instance = "vector-1";
  r.unix_ms = 1764900000123;
  r.arrival_rate = 412.5;
  r.recent_rate = 530.25;
  r.recent_span_ms = 500;
  r.in_flight = 17;
  r.queue_depth = 3;
  r.utilisation = 0.83;
  r.p99_ms = 41.25;
  r.applied_state = "fewer_docs";
  return r;
}

std::string ErrorOf(const json& j) {
  Result<LoadReport> r = ParseLoadReport(j.dump());
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return r.status().message();
}

TEST(HiloReport, RoundTrip) {
  const std::string text = WriteLoadReport(Sample());
  Result<LoadReport> r = ParseLoadReport(text);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->service, Service::kVector);
  EXPECT_EQ(r->instance, "vector-1");
  EXPECT_EQ(r->unix_ms, 1764900000123);
  EXPECT_EQ(r->arrival_rate, 412.5);
  EXPECT_EQ(r->recent_rate, 530.25);
  EXPECT_EQ(r->recent_span_ms, 500);
  EXPECT_EQ(r->in_flight, 17);
  EXPECT_EQ(r->queue_depth, 3);
  EXPECT_EQ(r->utilisation, 0.83);
  EXPECT_EQ(r->p99_ms, 41.25);
  EXPECT_EQ(r->applied_state, "fewer_docs");
  EXPECT_EQ(r->binaries, "");
  EXPECT_EQ(WriteLoadReport(*r), text);
  EXPECT_EQ(text.find("binaries"), std::string::npos);  // not sent when unknown

  LoadReport with = Sample();
  with.binaries = "keel-xxh3-0123456789abcdef0123456789abcdef";
  r = ParseLoadReport(WriteLoadReport(with));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->binaries, with.binaries);
}

TEST(HiloReport, UnknownFieldsAreIgnoredAndEmptyStateAccepted) {
  json j = json::parse(WriteLoadReport(Sample()));
  j["gpu_util"] = 0.5;
  j["applied_state"] = "";
  Result<LoadReport> r = ParseLoadReport(j.dump());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->applied_state, "");
}

TEST(HiloReport, EveryFieldIsRequired) {
  for (const char* field : {"service", "instance", "unix_ms", "arrival_rate", "in_flight", "queue_depth",
                            "utilisation", "p99_ms", "applied_state"}) {
    json j = json::parse(WriteLoadReport(Sample()));
    ASSERT_EQ(ErrorOf(j), "");
    j.erase(field);
    EXPECT_EQ(ErrorOf(j), std::string(field) + ": missing");
    j[field] = nullptr;
    EXPECT_EQ(ErrorOf(j), std::string(field) + ": missing");
  }
}

// recent_rate and recent_span_ms came later: a report without them (an older service) reads as
// 0, not an error.
TEST(HiloReport, RecentRateAndSpanAreOptional) {
  for (const char* field : {"recent_rate", "recent_span_ms"}) {
    json j = json::parse(WriteLoadReport(Sample()));
    j.erase(field);
    Result<LoadReport> r = ParseLoadReport(j.dump());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(std::string(field) == "recent_rate" ? r->recent_rate : static_cast<double>(r->recent_span_ms), 0)
        << field;
    j[field] = nullptr;
    EXPECT_EQ(ErrorOf(j), "") << field;
  }
}

TEST(HiloReport, HostileValuesNameTheField) {
  struct Case {
    const char* field;
    json value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"arrival_rate", -1, "arrival_rate: expected a number from 0 to 1e+09"},
      {"arrival_rate", 1e300, "arrival_rate: expected a number from 0 to 1e+09"},
      {"arrival_rate", "12", "arrival_rate: expected a number from 0 to 1e+09"},
      {"recent_rate", -1, "recent_rate: expected a number from 0 to 1e+09"},
      {"recent_rate", "fast", "recent_rate: expected a number from 0 to 1e+09"},
      {"recent_span_ms", -500, "recent_span_ms: expected a non-negative integer"},
      {"recent_span_ms", 3600001, "recent_span_ms: expected at most 3600000"},
      {"recent_span_ms", "500", "recent_span_ms: expected a non-negative integer"},
      {"utilisation", 1.5, "utilisation: expected a number from 0 to 1"},
      {"utilisation", -0.1, "utilisation: expected a number from 0 to 1"},
      {"p99_ms", true, "p99_ms: expected a number from 0 to 1e+09"},
      {"in_flight", -3, "in_flight: expected a non-negative integer"},
      {"in_flight", "3", "in_flight: expected a non-negative integer"},
      {"queue_depth", int64_t{1000000000000}, "queue_depth: expected at most 1000000000"},
      {"queue_depth", 4.5, "queue_depth: expected a non-negative integer"},
      {"unix_ms", -1, "unix_ms: expected a non-negative integer"},
      {"unix_ms", uint64_t{18446744073709551615u}, "unix_ms: expected at most 35184372088832"},
      {"service", "cache", "service: expected answer, vector, engine or gateway"},
      {"service", 3, "service: expected a string"},
      {"instance", "", "instance: expected a name of 1 to 64 characters [A-Za-z0-9_.:-]"},
      {"instance", "a b", "instance: expected a name of 1 to 64 characters [A-Za-z0-9_.:-]"},
      {"instance", std::string(3000, 'x'), "instance: longer than 64 bytes"},
      {"applied_state", json::array(), "applied_state: expected a string"},
      {"binaries", 7, "binaries: expected a string"},
      {"binaries", std::string(129, 'b'), "binaries: longer than 128 bytes"},
  };
  for (const Case& c : cases) {
    json j = json::parse(WriteLoadReport(Sample()));
    j[c.field] = c.value;
    EXPECT_EQ(ErrorOf(j), c.message) << c.field << " = " << c.value.dump().substr(0, 40);
  }
}

TEST(HiloReport, HostileTextIsRefused) {
  const std::string good = WriteLoadReport(Sample());
  EXPECT_EQ(ParseLoadReport(std::string(10 << 20, ' ')).status().message(), "load report: larger than 4096 bytes");
  EXPECT_EQ(ParseLoadReport(std::string(4000, '[')).status().message(),
            "load report: JSON nested deeper than 4 (byte 4)");
  EXPECT_EQ(ParseLoadReport("42").status().message(), "load report: expected a JSON object");
  std::string nan = good;
  nan.replace(nan.find("412.5"), 5, "NaN");
  EXPECT_FALSE(ParseLoadReport(nan).ok());
  std::string inf = good;
  inf.replace(inf.find("412.5"), 5, "1e999");
  EXPECT_FALSE(ParseLoadReport(inf).ok());
  EXPECT_FALSE(ParseLoadReport(good.substr(0, good.size() - 1)).ok());
}

}  // namespace
}  // namespace keel::hilo
