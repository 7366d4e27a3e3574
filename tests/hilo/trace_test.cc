#include "keel/hilo/trace.h"

#include <gtest/gtest.h>

#include <set>

namespace keel::hilo {
namespace {

TEST(Trace, NineShapesPeakAtMost238AndOneExactly) {
  std::vector<Trace> v = SurgeTraces(7);
  ASSERT_EQ(v.size(), 9u);
  std::set<std::string> names;
  double largest = 0;
  for (const Trace& t : v) {
    names.insert(t.name);
    EXPECT_EQ(t.duration_s, 300) << t.name;
    EXPECT_EQ(t.Multiplier(0), 1) << t.name;
    EXPECT_EQ(t.Multiplier(t.duration_s), 1) << t.name;
    EXPECT_GE(t.Peak(), 1.5) << t.name;
    EXPECT_LE(t.Peak(), 2.38) << t.name;
    largest = std::max(largest, t.Peak());
  }
  EXPECT_EQ(names.size(), 9u);
  EXPECT_EQ(largest, 2.38);
  EXPECT_EQ(v[2].name, "spike");
  EXPECT_EQ(v[2].Peak(), 2.38);
}

TEST(Trace, Surge3xPeaksAt3) {
  Trace t = Surge3x();
  EXPECT_EQ(t.name, "surge_3x");
  EXPECT_EQ(t.Peak(), 3);
  EXPECT_EQ(t.Multiplier(150), 3);
  EXPECT_DOUBLE_EQ(t.Multiplier(75), 2);  // halfway up the 60..90 s ramp
  EXPECT_EQ(t.duration_s, 300);
}

TEST(Trace, ShapesHaveTheirStatedPeaks) {
  std::vector<Trace> v = SurgeTraces(1);
  const std::vector<std::pair<std::string, double>> want = {
      {"step", 1.8},        {"ramp", 2.0},        {"spike", 2.38},          {"double_peak", 2.2},
      {"sawtooth", 1.7},    {"slow_swell", 1.9},  {"flash_crowd", 2.3},     {"plateau_jitter", 1.6},
      {"diurnal_bump", 1.5}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(v[i].name, want[i].first);
    EXPECT_NEAR(v[i].Peak(), want[i].second, 1e-12) << v[i].name;
  }
  // The step holds its peak; the flash crowd rises fast and decays slowly.
  EXPECT_EQ(v[0].Multiplier(150), 1.8);
  EXPECT_GT(v[6].Multiplier(100), 1.3);
  EXPECT_LT(v[6].Multiplier(100), 1.8);
}

TEST(Trace, JitterIsDeterministicForASeed) {
  Trace a = SurgeTraces(5)[7];
  Trace b = SurgeTraces(5)[7];
  Trace c = SurgeTraces(6)[7];
  ASSERT_EQ(a.name, "plateau_jitter");
  EXPECT_EQ(a.seed, 5u);
  EXPECT_EQ(a.points, b.points);
  EXPECT_NE(a.points, c.points);
  EXPECT_EQ(c.Peak(), 1.6);
  for (double t = 62; t <= 240; t += 2) {
    EXPECT_GE(a.Multiplier(t), 1.35);
    EXPECT_LE(a.Multiplier(t), 1.6);
  }
}

TEST(Trace, MultiplierInterpolatesLinearly) {
  Trace t;
  t.points = {{0, 1}, {10, 3}};
  t.duration_s = 10;
  EXPECT_DOUBLE_EQ(t.Multiplier(5), 2);
  EXPECT_EQ(t.Multiplier(-1), 1);
  EXPECT_EQ(t.Multiplier(20), 3);
}

TEST(Trace, CsvReadsRatesRelativeToTheBaseline) {
  Result<Trace> t = ParseCsvTrace("t_s,rate\n# measured\n0,100\n\n10,250\r\n20,100\n", "live", 0);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->name, "live");
  EXPECT_EQ(t->duration_s, 20);
  EXPECT_DOUBLE_EQ(t->Peak(), 2.5);
  EXPECT_DOUBLE_EQ(t->Multiplier(5), 1.75);
  Result<Trace> given = ParseCsvTrace("0,100\n10,250\n", "live", 50);
  ASSERT_TRUE(given.ok());
  EXPECT_DOUBLE_EQ(given->Peak(), 5);
}

TEST(Trace, CsvRefusesBadRows) {
  EXPECT_FALSE(ParseCsvTrace("0,1\n", "x", 0).ok());                 // one row
  EXPECT_FALSE(ParseCsvTrace("0,1\n0,2\n", "x", 0).ok());            // time does not increase
  EXPECT_FALSE(ParseCsvTrace("0,1\n1,-2\n", "x", 0).ok());           // negative rate
  EXPECT_FALSE(ParseCsvTrace("0,1\n1,nan\n", "x", 0).ok());          // not finite
  EXPECT_FALSE(ParseCsvTrace("0,1\n1;2\n", "x", 0).ok());            // no comma
  EXPECT_FALSE(ParseCsvTrace("0,0\n1,2\n", "x", 0).ok());            // no baseline
  Result<Trace> r = ParseCsvTrace("0,1\n1,2\n2,x\n", "x", 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().ToString().find("line 3"), std::string::npos) << r.status().ToString();
}

}  // namespace
}  // namespace keel::hilo
