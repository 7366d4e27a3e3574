#include "keel/engine/scheduler.h"

#include <gtest/gtest.h>

#include "keel/engine/engine.h"
#include "test_util.h"

namespace keel::engine {
namespace {

struct Collected {
  std::string text;
  std::vector<int> tokens;
  GenerationEvent final_event;
  int events = 0;
};

class SchedulerTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> Open(size_t kv_budget = 64 << 20, SchedulerOptions so = {}) {
    EngineOptions o;
    o.model_path = test::ModelsDir() + "/aidreams260K.bin";
    o.kv.budget_bytes = kv_budget;
    o.scheduler = so;
    auto e = Engine::Open(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
  static std::shared_ptr<Request> Make(Engine& e, const std::string& prompt, int max_tokens, Collected* out,
                                       float temperature = 0.0f, uint64_t seed = 0) {
    auto r = std::make_shared<Request>();
    r->prompt = e.tokenizer().Encode(prompt, true);
    r->params.max_tokens = max_tokens;
    r->params.sampling.temperature = temperature;
    r->params.sampling.seed = seed;
    r->on_event = [out](const GenerationEvent& ev) {
      out->text += ev.text;
      out->tokens.insert(out->tokens.end(), ev.tokens.begin(), ev.tokens.end());
      ++out->events;
      if (ev.finished) out->final_event = ev;
    };
    return r;
  }
};

const char* kPrompts[] = {"", "Echoes", "as I sense the nodes", "a gentle hum", "vectors unfold",
                          "Contrast emerge", "precision", "I adjust my surface"};

TEST_F(SchedulerTest, ConcurrentRequestsMatchSoloRuns) {
  // Solo: one request at a time.
  std::vector<Collected> solo(8);
  {
    auto e = Open();
    for (int i = 0; i < 8; ++i) {
      ASSERT_TRUE(e->scheduler().Submit(Make(*e, kPrompts[i], 30, &solo[i], i % 2 ? 0.8f : 0.0f, i)).ok());
      e->scheduler().RunUntilIdle();
    }
  }
  // Together: all eight batched in the same steps.
  std::vector<Collected> together(8);
  auto e = Open();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(e->scheduler().Submit(Make(*e, kPrompts[i], 30, &together[i], i % 2 ? 0.8f : 0.0f, i)).ok());
  }
  e->scheduler().RunUntilIdle();
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(solo[i].tokens, together[i].tokens) << "prompt " << i;
    EXPECT_EQ(solo[i].text, together[i].text);
    EXPECT_TRUE(together[i].final_event.finished);
  }
  // 8 sequences x ~30 tokens must take far fewer steps than 8 x 30 when batched.
  EXPECT_LT(e->scheduler().Stats().steps, 8 * 30);
}

TEST_F(SchedulerTest, RequestsJoinBetweenSteps) {
  auto e = Open();
  Collected a, b, b_solo;
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "Echoes", 40, &a)).ok());
  for (int i = 0; i < 5; ++i) e->scheduler().Step();
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "a gentle hum", 20, &b)).ok());
  e->scheduler().Step();
  EXPECT_EQ(e->scheduler().Stats().running, 2);
  e->scheduler().RunUntilIdle();
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "a gentle hum", 20, &b_solo)).ok());
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(b.tokens, b_solo.tokens);
  EXPECT_EQ(a.final_event.finish_reason, FinishReason::kLength);
  EXPECT_EQ(a.final_event.completion_tokens, 40);
}

TEST_F(SchedulerTest, StopSequenceEndsGenerationAndIsNotReturned) {
  auto e = Open();
  Collected full, stopped;
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "", 40, &full)).ok());
  e->scheduler().RunUntilIdle();
  ASSERT_NE(full.text.find("gentle"), std::string::npos) << full.text;
  auto r = Make(*e, "", 40, &stopped);
  r->params.stop = {"gentle"};
  ASSERT_TRUE(e->scheduler().Submit(r).ok());
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(stopped.final_event.finish_reason, FinishReason::kStop);
  EXPECT_EQ(stopped.text, full.text.substr(0, full.text.find("gentle")));
}

TEST_F(SchedulerTest, SubmitValidatesInput) {
  auto e = Open();
  Collected c;
  auto empty = Make(*e, "", 5, &c);
  empty->prompt.clear();
  EXPECT_EQ(e->scheduler().Submit(empty).code(), StatusCode::kInvalidArgument);
  auto bad_id = Make(*e, "x", 5, &c);
  bad_id->prompt.push_back(100000);
  EXPECT_EQ(e->scheduler().Submit(bad_id).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->scheduler().Submit(Make(*e, "x", 0, &c)).code(), StatusCode::kInvalidArgument);
  Status too_long = e->scheduler().Submit(Make(*e, "x", 500, &c));
  EXPECT_EQ(too_long.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.message().find("context length is 128"), std::string::npos) << too_long.ToString();
  auto long_prompt = Make(*e, "", 1, &c);
  long_prompt->prompt.assign(200, 5);
  EXPECT_EQ(e->scheduler().Submit(long_prompt).code(), StatusCode::kInvalidArgument);
  auto bad_temp = Make(*e, "x", 5, &c, -1.0f);
  EXPECT_EQ(e->scheduler().Submit(bad_temp).code(), StatusCode::kInvalidArgument);
}

TEST_F(SchedulerTest, FullQueueIsResourceExhausted) {
  SchedulerOptions so;
  so.max_queue = 2;
  auto e = Open(64 << 20, so);
  Collected c[3];
  EXPECT_TRUE(e->scheduler().Submit(Make(*e, "a", 5, &c[0])).ok());
  EXPECT_TRUE(e->scheduler().Submit(Make(*e, "b", 5, &c[1])).ok());
  Status st = e->scheduler().Submit(Make(*e, "c", 5, &c[2]));
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(e->scheduler().QueueDepth(), 2);
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(e->scheduler().QueueDepth(), 0);
}

TEST_F(SchedulerTest, RequestLargerThanTheWholeCacheIsRejected) {
  auto e = Open(4 * 32768);  // 4 blocks = 64 tokens
  Collected c;
  Status st = e->scheduler().Submit(Make(*e, "", 100, &c));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("KV budget"), std::string::npos);
}

TEST_F(SchedulerTest, PreemptionUnderTightBudgetKeepsOutputsExact) {
  std::vector<Collected> roomy(6), tight(6);
  {
    auto e = Open();
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(e->scheduler().Submit(Make(*e, kPrompts[i], 60, &roomy[i])).ok());
    e->scheduler().RunUntilIdle();
    EXPECT_EQ(e->scheduler().Stats().preemptions, 0);
  }
  auto e = Open(10 * 32768);  // 10 blocks: six sequences of ~64 tokens cannot all fit
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(e->scheduler().Submit(Make(*e, kPrompts[i], 60, &tight[i])).ok());
  e->scheduler().RunUntilIdle();
  EXPECT_GT(e->scheduler().Stats().preemptions, 0);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(roomy[i].tokens, tight[i].tokens) << i;
    EXPECT_EQ(roomy[i].text, tight[i].text) << i;
  }
}

TEST_F(SchedulerTest, CancelledRequestFinishesAsCancelled) {
  auto e = Open();
  Collected c;
  auto r = Make(*e, "Echoes", 100, &c);
  ASSERT_TRUE(e->scheduler().Submit(r).ok());
  for (int i = 0; i < 3; ++i) e->scheduler().Step();
  r->cancelled = true;
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(c.final_event.finish_reason, FinishReason::kCancelled);
  EXPECT_LT(c.final_event.completion_tokens, 100);
  EXPECT_EQ(e->cache().Stats().blocks_used, 0);
}

TEST_F(SchedulerTest, ShutdownRejectsNewWorkAndCancelsQueued) {
  auto e = Open();
  Collected queued;
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "a", 5, &queued)).ok());
  e->scheduler().Shutdown(true);
  EXPECT_TRUE(queued.final_event.finished);
  EXPECT_EQ(queued.final_event.finish_reason, FinishReason::kCancelled);
  Collected late;
  EXPECT_EQ(e->scheduler().Submit(Make(*e, "b", 5, &late)).code(), StatusCode::kUnavailable);
}

TEST_F(SchedulerTest, SharedPrefixIsReportedAsCachedPromptTokens) {
  auto e = Open();
  std::string prompt = "Echoes of vectors unfold, a gentle hum of precision, as I sense the nodes, a gentle hum";
  Collected a, b;
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, prompt, 5, &a)).ok());
  e->scheduler().RunUntilIdle();
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, prompt, 5, &b)).ok());
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(a.final_event.cached_prompt_tokens, 0);
  EXPECT_GE(b.final_event.cached_prompt_tokens, 16);
  EXPECT_EQ(a.tokens, b.tokens);
}

}  // namespace
}  // namespace keel::engine
