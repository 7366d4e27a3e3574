#include "keel/hilo/agent.h"

#include <gtest/gtest.h>

#include "tests/hilo/test_catalog.h"

namespace keel::hilo {
namespace {

using Mode = StateAgent::Mode;

StateAgent Make(Catalog c = testing::TestCatalog()) {
  Result<StateAgent> a = StateAgent::Create(std::move(c), AgentOptions{.hold_s = 3, .fallback_s = 30});
  EXPECT_TRUE(a.ok()) << a.status().ToString();
  return std::move(a).value();
}

TEST(HiloAgent, SafeStateBeforeAnyPush) {
  StateAgent a = Make();
  StateAgent::View v = a.Current(0);
  EXPECT_EQ(v.index, 4);
  EXPECT_EQ(v.state->name, "bare");
  EXPECT_EQ(v.mode, Mode::kNeverHeard);
}

TEST(HiloAgent, FollowsThenHoldsThenFallsBack) {
  StateAgent a = Make();
  ASSERT_TRUE(*a.Push(1, "small_model", 1000));
  EXPECT_EQ(a.Current(1000).index, 1);
  EXPECT_EQ(a.Current(4000).mode, Mode::kFollowing);  // exactly hold_s
  EXPECT_EQ(a.Current(4001).mode, Mode::kHolding);
  EXPECT_EQ(a.Current(4001).index, 1);
  EXPECT_EQ(a.Current(31000).index, 1);
  EXPECT_EQ(a.Current(31001).mode, Mode::kFallback);
  EXPECT_EQ(a.Current(31001).index, 4);
  EXPECT_EQ(a.Current(31001).state->name, "bare");
}

TEST(HiloAgent, OlderVersionIsIgnoredAndDoesNotCountAsHeard) {
  StateAgent a = Make();
  ASSERT_TRUE(*a.Push(5, "fewer_docs", 0));
  Result<bool> r = a.Push(4, "full", 20000);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
  EXPECT_EQ(a.version(), 5);
  EXPECT_EQ(a.Current(20000).index, 2);
  EXPECT_EQ(a.Current(20000).mode, Mode::kHolding);   // heard at 0, not 20000
  EXPECT_EQ(a.Current(30001).mode, Mode::kFallback);
}

TEST(HiloAgent, SameVersionIsAHeartbeat) {
  StateAgent a = Make();
  ASSERT_TRUE(*a.Push(5, "fewer_docs", 0));
  EXPECT_FALSE(*a.Push(5, "fewer_docs", 20000));
  EXPECT_EQ(a.Current(22000).mode, Mode::kFollowing);
  EXPECT_EQ(a.Current(49000).mode, Mode::kHolding);
  EXPECT_TRUE(*a.Push(6, "full", 49000));
  EXPECT_EQ(a.Current(49000).index, 0);
  EXPECT_EQ(a.Current(49000).mode, Mode::kFollowing);
}

TEST(HiloAgent, UnknownStateIsRefusedAndChangesNothing) {
  StateAgent a = Make();
  ASSERT_TRUE(*a.Push(1, "full", 0));
  Result<bool> r = a.Push(2, "fulll", 100);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "pushed state 'fulll' is not in the catalog");
  EXPECT_EQ(a.version(), 1);
  EXPECT_EQ(a.Current(100).index, 0);
}

TEST(HiloAgent, FallbackKeepsAStateCheaperThanTheSafeOne) {
  Catalog c = testing::TestCatalog();
  c.states[3].figures->capacity = c.states[4].figures->capacity;
  c.safe_state = "no_rerank";
  StateAgent a = Make(c);
  ASSERT_TRUE(*a.Push(1, "bare", 0));
  EXPECT_EQ(a.Current(60000).mode, Mode::kFallback);
  EXPECT_EQ(a.Current(60000).index, 4);
  ASSERT_TRUE(*a.Push(2, "full", 60000));
  EXPECT_EQ(a.Current(120000).index, 3);
}

TEST(HiloAgent, CreateRefusesBadOptions) {
  EXPECT_FALSE(StateAgent::Create(testing::TestCatalog(), AgentOptions{.hold_s = 10, .fallback_s = 5}).ok());
  Catalog c = testing::TestCatalog();
  c.safe_state = "nope";
  EXPECT_FALSE(StateAgent::Create(c, AgentOptions{}).ok());
}

}  // namespace
}  // namespace keel::hilo
