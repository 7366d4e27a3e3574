// ApplyFigures: measured figures into the catalog, with the conservative adjustments the catalog's
// ordering rules need, and the refusals. MeasureStates runs against the real product in
// bench/hilo/validate.sh and its CTest smoke run.
#include <gtest/gtest.h>

#include "keel/hilo/validate/validate.h"
#include "tests/hilo/test_catalog.h"

namespace keel::hilo {
namespace {

Catalog Unvalidated() {
  Catalog c = testing::TestCatalog();
  for (State& s : c.states) s.figures.reset();
  c.binaries.clear();
  return c;
}

std::vector<StateMeasurement> Measured(const Catalog& c, std::vector<double> quality, std::vector<double> capacity) {
  std::vector<StateMeasurement> out;
  for (size_t i = 0; i < c.states.size(); ++i) {
    StateMeasurement m;
    m.state = c.states[i].name;
    m.quality.quality = quality[i];
    m.capacity = capacity[i];
    out.push_back(m);
  }
  return out;
}

TEST(HiloApplyFigures, WritesEveryStateAndTheFingerprint) {
  Catalog c = Unvalidated();
  std::vector<std::string> notes;
  auto out = ApplyFigures(c, Measured(c, {98, 97, 90, 80, 40}, {10, 12, 15, 20, 40}), "keel-xxh3-ab", 1765000000, &notes);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(notes.empty());
  EXPECT_EQ(out->binaries, "keel-xxh3-ab");
  for (size_t i = 0; i < out->states.size(); ++i) {
    ASSERT_TRUE(out->states[i].figures.has_value());
    EXPECT_EQ(out->states[i].figures->validated_at, 1765000000);
    for (Service s : kAllServices) EXPECT_DOUBLE_EQ(out->states[i].figures->Capacity(s), (std::vector<double>{10, 12, 15, 20, 40})[i]);
  }
  EXPECT_DOUBLE_EQ(out->states[2].figures->quality, 90);
  // Usable by the controller that reports this fingerprint.
  EXPECT_TRUE(CheckUsable(*out, "keel-xxh3-ab", 1765000100, 86400).ok());
  EXPECT_FALSE(CheckUsable(*out, "keel-xxh3-cd", 1765000100, 86400).ok());
}

TEST(HiloApplyFigures, AdjustsOutOfOrderMeasurements) {
  Catalog c = Unvalidated();
  std::vector<std::string> notes;
  // State 2 measured better quality than state 1; state 2 measured less capacity than state 1.
  auto out = ApplyFigures(c, Measured(c, {98, 90, 92, 80, 40}, {10, 18, 15, 20, 40}), "fp", 1, &notes);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_DOUBLE_EQ(out->states[2].figures->quality, 90);  // lowered to the state above
  // Raised to the costlier state's passing rate; the costlier state keeps its own figure.
  EXPECT_DOUBLE_EQ(out->states[2].figures->Capacity(Service::kEngine), 18);
  EXPECT_DOUBLE_EQ(out->states[1].figures->Capacity(Service::kEngine), 18);
  EXPECT_DOUBLE_EQ(out->states[3].figures->Capacity(Service::kEngine), 20);
  EXPECT_NE(notes[0].find("fewer_docs"), std::string::npos);
  EXPECT_NE(notes[1].find("fewer_docs"), std::string::npos);
}

TEST(HiloApplyFigures, RefusesMismatchesAndStatesWithoutCapacity) {
  Catalog c = Unvalidated();
  auto m = Measured(c, {98, 97, 90, 80, 40}, {10, 12, 15, 20, 40});
  m[3].capacity = 0;  // failed its SLO at the first ramp step
  auto none = ApplyFigures(c, m, "fp", 1, nullptr);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no_rerank"), std::string::npos);
  m = Measured(c, {98, 97, 90, 80, 40}, {10, 12, 15, 20, 40});
  m[1].state = "other";
  EXPECT_FALSE(ApplyFigures(c, m, "fp", 1, nullptr).ok());
  m.pop_back();
  EXPECT_FALSE(ApplyFigures(c, m, "fp", 1, nullptr).ok());
}

TEST(HiloApplyFigures, SafeStateNotLastMustStillHaveTheLargestCapacity) {
  Catalog c = Unvalidated();
  c.safe_state = "fewer_docs";  // index 2; states below it measure more capacity
  auto out = ApplyFigures(c, Measured(c, {98, 97, 90, 80, 40}, {10, 12, 15, 20, 40}), "fp", 1, nullptr);
  ASSERT_FALSE(out.ok());  // the catalog rule, reported rather than papered over
}

// A service's own capacity from the chosen round's highest passing step: rate x 0.9 / its
// utilisation, never below the product's figure, at most 100x it; other rounds' steps and failing
// steps do not count.
TEST(HiloValidate, ServiceCapacitiesFromTheHighestPassingStep) {
  StateMeasurement m;
  auto step = [](int round, double rate, bool pass, std::array<double, kNumServices> u) {
    RampStep s;
    s.round = round;
    s.rate = rate;
    s.sent = 100;
    s.pass = pass;
    s.utilisation = u;
    return s;
  };
  // answer, vector, engine, gateway
  m.steps = {step(0, 100, true, {0.30, 0.001, 0.50, 0.01}), step(0, 178, true, {0.63, 0, 0.91, 0.01}),
             step(0, 211, false, {1, 0, 1, 0.02}), step(1, 190, true, {0.5, 0.5, 0.5, 0.5})};
  const auto est = ServiceCapacities(m, 0, 178);
  EXPECT_NEAR(est[0], 178 * 0.9 / 0.63, 1e-9);  // the answer: 254 req/s
  EXPECT_DOUBLE_EQ(est[1], 17800);              // no utilisation reported: 100x
  EXPECT_DOUBLE_EQ(est[2], 178);                // the bottleneck: the product's figure
  EXPECT_DOUBLE_EQ(est[3], 16020);
  const auto none = ServiceCapacities(m, 2, 178);  // no step in that round
  for (double v : none) EXPECT_EQ(v, 0);
  m.steps = {step(0, 2, true, {0.01, 0, 0.02, 0})};  // nothing near a limit: no estimate
  for (double v : ServiceCapacities(m, 0, 2)) EXPECT_EQ(v, 0);
}

// Estimates replace the product's figure per service and are raised down the list per service.
TEST(HiloApplyFigures, ServiceEstimatesArePerServiceAndMonotone) {
  Catalog c = Unvalidated();
  auto m = Measured(c, {98, 97, 90, 80, 40}, {10, 12, 15, 20, 40});
  m[0].service_capacity = {50, 1000, 10, 500};
  m[1].service_capacity = {40, 1200, 12, 500};  // the answer's estimate fell: raised to 50
  std::vector<std::string> notes;
  auto out = ApplyFigures(c, m, "fp", 1, &notes);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_DOUBLE_EQ(out->states[0].figures->Capacity(Service::kVector), 1000);
  EXPECT_DOUBLE_EQ(out->states[0].figures->Capacity(Service::kEngine), 10);
  EXPECT_DOUBLE_EQ(out->states[1].figures->Capacity(Service::kAnswer), 50);
  EXPECT_DOUBLE_EQ(out->states[1].figures->Capacity(Service::kVector), 1200);
  // States without estimates keep the raised figures above them, or their own when larger.
  EXPECT_DOUBLE_EQ(out->states[2].figures->Capacity(Service::kVector), 1200);
  EXPECT_DOUBLE_EQ(out->states[2].figures->Capacity(Service::kEngine), 15);
  EXPECT_DOUBLE_EQ(out->states[4].figures->Capacity(Service::kEngine), 40);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("answer's estimated capacity"), std::string::npos) << notes[0];
}

// The goodput under overload goes into the figures where it was measured, never above what was
// offered; a state without it (factor 0) has none.
TEST(HiloApplyFigures, RecordsTheGoodputUnderOverload) {
  Catalog c = Unvalidated();
  auto m = Measured(c, {98, 97, 90, 80, 40}, {10, 12, 15, 20, 40});
  m[0].offered = 15;
  m[0].goodput = 8.5;
  m[1].offered = 18;
  m[1].goodput = 18.5;  // rounding in the scaling: clamped to the offered rate
  auto out = ApplyFigures(c, m, "fp", 1, nullptr);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_DOUBLE_EQ(out->states[0].figures->offered, 15);
  EXPECT_DOUBLE_EQ(out->states[0].figures->goodput, 8.5);
  EXPECT_DOUBLE_EQ(out->states[1].figures->goodput, 18);
  EXPECT_FALSE(out->states[2].figures->HasGoodput());
  // It survives the catalog's text form.
  auto back = ParseCatalog(WriteCatalog(*out));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_DOUBLE_EQ(back->states[0].figures->goodput, 8.5);
}

// An overload step never counts as the ramp's highest passing step, even marked passing.
TEST(HiloValidate, ServiceCapacitiesIgnoreTheOverloadStep) {
  StateMeasurement m;
  RampStep ramp;
  ramp.rate = 100;
  ramp.sent = 100;
  ramp.pass = true;
  ramp.utilisation = {0.45, 0.1, 0.9, 0.1};
  RampStep over = ramp;
  over.rate = 150;
  over.overload = true;
  over.utilisation = {1, 1, 1, 1};
  m.steps = {ramp, over};
  const auto est = ServiceCapacities(m, 0, 100);
  EXPECT_DOUBLE_EQ(est[0], 200);  // from the 100 req/s step: 100 x 0.9 / 0.45
  EXPECT_DOUBLE_EQ(est[2], 100);
}

// The recorded round: one stalled round (147.6, as measured) does not move the lower median, and
// neither does one lucky round; "lowest" takes the stalled one.
TEST(HiloValidate, ChosenRoundIsTheLowerMedianOrTheLowest) {
  const std::vector<double> full = {178.2, 189.9, 147.6};
  EXPECT_EQ(ChosenRound(full, RoundFigure::kLowerMedian), 0u);
  EXPECT_EQ(ChosenRound(full, RoundFigure::kLowest), 2u);
  EXPECT_EQ(ChosenRound({349.2, 265.9, 342.3}, RoundFigure::kLowerMedian), 2u);
  EXPECT_EQ(ChosenRound({200, 100}, RoundFigure::kLowerMedian), 1u);  // two rounds: the lower
  EXPECT_EQ(ChosenRound({5, 1, 4, 2}, RoundFigure::kLowerMedian), 3u);
  EXPECT_EQ(ChosenRound({7, 7, 7}, RoundFigure::kLowerMedian), 1u);  // ties keep round order
  EXPECT_EQ(ChosenRound({42}, RoundFigure::kLowest), 0u);
  EXPECT_EQ(ChosenRound({}, RoundFigure::kLowerMedian), 0u);
}

TEST(HiloValidate, MeasureStatesRefusesBadOptionsBeforeAnyCall) {
  Catalog c = Unvalidated();
  ValidateOptions o;
  o.controller_url = "http://127.0.0.1:1";
  o.answer_url = "http://127.0.0.1:1";
  o.admin_token = "t";
  EXPECT_FALSE(MeasureStates(c, o).ok());  // empty evaluation set
  o.eval.resize(1);
  o.growth = 1;
  EXPECT_FALSE(MeasureStates(c, o).ok());
  o.growth = 1.5;
  o.rounds = 0;
  EXPECT_FALSE(MeasureStates(c, o).ok());
  o.rounds = 2;
  o.later_round_start = 1.5;
  EXPECT_FALSE(MeasureStates(c, o).ok());
  o.later_round_start = 0.5;
  for (double bad : {1.0, 0.5, -1.0, 11.0}) {
    o.overload_factor = bad;
    auto r = MeasureStates(c, o);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().message(), "validate: overload_factor must be 0 (not measured) or in (1, 10]");
  }
  o.overload_factor = 0;
  o.admin_token.clear();
  EXPECT_FALSE(MeasureStates(c, o).ok());
  o.admin_token = "t";
  auto unreachable = MeasureStates(c, o);  // nothing listens on port 1
  ASSERT_FALSE(unreachable.ok());
  EXPECT_EQ(unreachable.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace keel::hilo
