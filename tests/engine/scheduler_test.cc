#include "keel/engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/engine/engine.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"
#include "test_util.h"

namespace keel::engine {
namespace {

struct Collected {
  std::string text;
  std::vector<int> tokens;
  std::vector<TokenLogprob> logprobs;
  std::vector<TokenLogprob> prompt_logprobs;
  bool prompt_scored_after_text = false;  // a prompt score came after generated text: wrong order
  GenerationEvent final_event;
  int events = 0;
};

class SchedulerTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> Open(size_t kv_budget = 64 << 20, SchedulerOptions so = {},
                               const std::string& codec = "raw") {
    EngineOptions o;
    o.model_path = test::ModelsDir() + "/aidreams260K.bin";
    o.kv_codec = codec;
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
      out->logprobs.insert(out->logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      if (!ev.prompt_logprobs.empty() && !out->tokens.empty() && ev.tokens.empty()) out->prompt_scored_after_text = true;
      out->prompt_logprobs.insert(out->prompt_logprobs.end(), ev.prompt_logprobs.begin(), ev.prompt_logprobs.end());
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

// A HiLO degrade lowers the limit of work already admitted (ClampMaxTokens): the running sequence
// that has generated past the new limit ends at the next step with what it has, the queued one
// generates only the new limit, and neither changes the tokens it would have produced.
TEST_F(SchedulerTest, ClampMaxTokensReachesRunningAndQueuedRequests) {
  SchedulerOptions so;
  so.max_running = 1;  // one runs, one waits in the queue
  auto e = Open(64 << 20, so);
  Collected solo_a, solo_b;
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "Echoes", 40, &solo_a)).ok());
  e->scheduler().RunUntilIdle();
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "a gentle hum", 40, &solo_b)).ok());
  e->scheduler().RunUntilIdle();
  ASSERT_GE(solo_a.tokens.size(), 12u) << "the model must not stop early for this test";
  ASSERT_GE(solo_b.tokens.size(), 6u);

  Collected a, b, c;
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "Echoes", 40, &a)).ok());
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "a gentle hum", 40, &b)).ok());
  while (a.tokens.size() < 8) ASSERT_TRUE(e->scheduler().Step());
  ASSERT_FALSE(a.final_event.finished);
  const size_t had = a.tokens.size();
  e->scheduler().ClampMaxTokens(20);  // a larger pending value does not undo a smaller one
  e->scheduler().ClampMaxTokens(5);
  e->scheduler().ClampMaxTokens(30);
  e->scheduler().Step();
  EXPECT_TRUE(a.final_event.finished);
  EXPECT_EQ(a.final_event.finish_reason, FinishReason::kLength);
  EXPECT_EQ(a.tokens.size(), had);  // not one token more than it had when the clamp landed
  EXPECT_EQ(a.final_event.completion_tokens, static_cast<int>(had));
  EXPECT_EQ(a.tokens, std::vector<int>(solo_a.tokens.begin(), solo_a.tokens.begin() + had));
  // Submitted after the clamp: its own limit stands.
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "Echoes", 12, &c)).ok());
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(b.final_event.finish_reason, FinishReason::kLength);
  EXPECT_EQ(b.tokens, std::vector<int>(solo_b.tokens.begin(), solo_b.tokens.begin() + 5));
  EXPECT_EQ(c.tokens, std::vector<int>(solo_a.tokens.begin(), solo_a.tokens.begin() + 12));
}

TEST_F(SchedulerTest, RequestLargerThanTheWholeCacheIsRejected) {
  auto e = Open(4 * 32768);  // 4 blocks = 64 tokens
  Collected c;
  Status st = e->scheduler().Submit(Make(*e, "", 100, &c));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("KV budget"), std::string::npos);
}

TEST_F(SchedulerTest, PreemptionUnderTightBudgetKeepsOutputsExact) {
  // Also with scored prompts: a preempted sequence recomputes its context but scores no prompt
  // position twice.
  for (bool score : {false, true}) {
    auto make = [&](Engine& e, int i, Collected* out) {
      auto r = Make(e, kPrompts[i], 60, out);
      r->params.prompt_logprobs = score;
      return r;
    };
    std::vector<Collected> roomy(6), tight(6);
    {
      auto e = Open();
      for (int i = 0; i < 6; ++i) ASSERT_TRUE(e->scheduler().Submit(make(*e, i, &roomy[i])).ok());
      e->scheduler().RunUntilIdle();
      EXPECT_EQ(e->scheduler().Stats().preemptions, 0);
    }
    // 10 blocks: six sequences of ~64 tokens cannot all fit. With scoring, at most 9 tokens go
    // through per step, so prompts are prefilled in pieces beside the decoders and a sequence
    // may be preempted between two pieces of its prompt.
    SchedulerOptions so;
    so.max_batch_tokens = score ? 9 : 512;
    auto e = Open(10 * 32768, so);
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(e->scheduler().Submit(make(*e, i, &tight[i])).ok());
    e->scheduler().RunUntilIdle();
    EXPECT_GT(e->scheduler().Stats().preemptions, 0);
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(roomy[i].tokens, tight[i].tokens) << i;
      EXPECT_EQ(roomy[i].text, tight[i].text) << i;
      const size_t scored = score ? e->tokenizer().Encode(kPrompts[i], true).size() - 1 : 0;
      ASSERT_EQ(tight[i].prompt_logprobs.size(), scored) << i;
      ASSERT_EQ(roomy[i].prompt_logprobs.size(), scored) << i;
      for (size_t k = 0; k < scored; ++k) {
        EXPECT_EQ(tight[i].prompt_logprobs[k].token, roomy[i].prompt_logprobs[k].token);
        EXPECT_EQ(tight[i].prompt_logprobs[k].logprob, roomy[i].prompt_logprobs[k].logprob);
      }
    }
  }
}

// Log-probabilities are those of the model's logits: checked against a forward pass run here.
TEST_F(SchedulerTest, LogprobsAreTheLogSoftmaxOfTheLogits) {
  auto e = Open();
  Collected c;
  auto r = Make(*e, "Echoes", 12, &c, 0.9f, 5);
  r->params.logprobs = 4;
  ASSERT_TRUE(e->scheduler().Submit(r).ok());
  e->scheduler().RunUntilIdle();
  ASSERT_EQ(c.logprobs.size(), c.tokens.size());
  ASSERT_EQ(c.tokens.size(), 12u);

  // Replay prompt + generated tokens through a fresh cache and compare every step.
  const Model& model = e->model();
  const int vocab = model.config.vocab_size;
  auto cache = KvCache::Create(model, "raw", {});
  ASSERT_TRUE(cache.ok());
  Transformer tf(model);
  ASSERT_TRUE((*cache)->BeginSequence(1, {}).ok());
  std::vector<int> seq = r->prompt;
  seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
  ASSERT_TRUE((*cache)->Reserve(1, static_cast<int>(seq.size())).ok());
  std::vector<float> logits;
  const int prompt_len = static_cast<int>(r->prompt.size());
  for (int p = 0; p < static_cast<int>(seq.size()) - 1; ++p) {
    ASSERT_TRUE(tf.Forward({{1, seq[p], p, true}}, **cache, logits).ok());
    (*cache)->Commit(1, &seq[p], 1);
    if (p < prompt_len - 1) continue;
    const TokenLogprob& lp = c.logprobs[p - prompt_len + 1];
    // Reference in double: log p_i = x_i - log sum_j exp(x_j).
    double mx = logits[0];
    for (int i = 1; i < vocab; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
    double sum = 0;
    for (int i = 0; i < vocab; ++i) sum += std::exp(logits[i] - mx);
    const double lse = mx + std::log(sum);
    EXPECT_EQ(lp.token, seq[p + 1]);
    EXPECT_NEAR(lp.logprob, logits[lp.token] - lse, 1e-5) << p;
    EXPECT_LE(lp.logprob, 0.0f);
    ASSERT_EQ(lp.top.size(), 4u);
    // The top four are the four largest logits, most likely first.
    std::vector<int> order(vocab);
    for (int i = 0; i < vocab; ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + 4, order.end(),
                      [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    for (int k = 0; k < 4; ++k) {
      EXPECT_EQ(lp.top[k].first, order[k]) << p << " " << k;
      EXPECT_NEAR(lp.top[k].second, logits[order[k]] - lse, 1e-5);
    }
  }
  // Sampling (temperature 0.9) picked some token that is not the most likely one at least once
  // in 12 steps on this model; the reported logprob is then below the top one.
  bool below_top = false;
  for (const TokenLogprob& lp : c.logprobs) below_top |= lp.logprob < lp.top[0].second;
  EXPECT_TRUE(below_top);
}

// A scored prompt: position i's log-probability is what the model gave token i after the tokens
// before it, the very number it reports for the same token when it generates it. So scoring the
// prompt + a greedy continuation reproduces the continuation's logprobs bit for bit, whether the
// prompt's prefix is cached, the prefill is cut into chunks, or the request only scores.
TEST_F(SchedulerTest, PromptLogprobsEqualTheLogprobsOfGeneratingTheSameTokens) {
  for (int chunk : {512, 5}) {
    SchedulerOptions so;
    so.max_batch_tokens = chunk;
    auto e = Open(64 << 20, so);
    Collected gen;
    auto g = Make(*e, "Echoes of vectors unfold", 12, &gen);
    g->params.logprobs = 3;
    ASSERT_TRUE(e->scheduler().Submit(g).ok());
    e->scheduler().RunUntilIdle();
    ASSERT_EQ(gen.logprobs.size(), gen.tokens.size());
    ASSERT_GE(gen.tokens.size(), 4u);
    EXPECT_TRUE(gen.prompt_logprobs.empty());  // not asked for

    std::vector<int> whole = g->prompt;
    whole.insert(whole.end(), gen.tokens.begin(), gen.tokens.end());
    for (int round = 0; round < 2; ++round) {  // the second finds the prompt's blocks cached
      for (int max_tokens : {0, 3}) {
        Collected sc;
        auto s = Make(*e, "", max_tokens, &sc);
        s->prompt = whole;
        s->params.logprobs = 3;
        s->params.prompt_logprobs = true;
        ASSERT_TRUE(e->scheduler().Submit(s).ok());
        e->scheduler().RunUntilIdle();
        EXPECT_FALSE(sc.prompt_scored_after_text);
        ASSERT_EQ(sc.prompt_logprobs.size(), whole.size() - 1) << "chunk " << chunk << " round " << round;
        for (size_t i = 0; i + 1 < whole.size(); ++i) {
          EXPECT_EQ(sc.prompt_logprobs[i].token, whole[i + 1]);
          EXPECT_EQ(sc.prompt_logprobs[i].prev, whole[i]);
        }
        const size_t first_gen = g->prompt.size() - 1;
        for (size_t k = 0; k < gen.logprobs.size(); ++k) {
          const TokenLogprob& want = gen.logprobs[k];
          const TokenLogprob& got = sc.prompt_logprobs[first_gen + k];
          EXPECT_EQ(got.logprob, want.logprob) << k;
          EXPECT_EQ(got.top, want.top) << k;
        }
        EXPECT_EQ(static_cast<int>(sc.tokens.size()), max_tokens);
        EXPECT_EQ(sc.final_event.finish_reason, FinishReason::kLength);
        EXPECT_EQ(sc.final_event.cached_prompt_tokens, 0);  // computed in full, cached or not
      }
    }
  }
  // max_tokens 0 needs prompt scoring.
  auto e = Open();
  Collected c;
  auto r = Make(*e, "Echoes", 0, &c);
  EXPECT_EQ(e->scheduler().Submit(r).code(), StatusCode::kInvalidArgument);
  r->params.prompt_logprobs = true;
  EXPECT_TRUE(e->scheduler().Submit(r).ok());
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(c.final_event.completion_tokens, 0);
  EXPECT_EQ(c.prompt_logprobs.size(), r->prompt.size() - 1);
}

TEST_F(SchedulerTest, LogprobsOffByDefaultAndBounded) {
  auto e = Open();
  Collected c;
  ASSERT_TRUE(e->scheduler().Submit(Make(*e, "Echoes", 5, &c)).ok());
  e->scheduler().RunUntilIdle();
  EXPECT_EQ(c.tokens.size(), 5u);
  EXPECT_TRUE(c.logprobs.empty());
  for (int bad : {-2, kMaxTopLogprobs + 1}) {
    Collected d;
    auto r = Make(*e, "Echoes", 5, &d);
    r->params.logprobs = bad;
    EXPECT_EQ(e->scheduler().Submit(r).code(), StatusCode::kInvalidArgument) << bad;
  }
}

// ZipFusion under a budget tight enough to preempt gives the tokens and log-probabilities of
// raw:bf16 with room to spare, bit for bit.
TEST_F(SchedulerTest, ZipFusionUnderPreemptionMatchesRawBf16Logprobs) {
  std::vector<Collected> roomy(6), tight(6);
  auto run = [&](const std::string& codec, size_t budget, std::vector<Collected>* out) -> int64_t {
    auto e = Open(budget, {}, codec);
    for (int i = 0; i < 6; ++i) {
      auto r = Make(*e, kPrompts[i], 60, &(*out)[i], i % 2 ? 0.8f : 0.0f, 100 + i);
      r->params.logprobs = 3;
      Status st = e->scheduler().Submit(r);
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok()) return -1;
    }
    e->scheduler().RunUntilIdle();
    return e->scheduler().Stats().preemptions;
  };
  EXPECT_EQ(run("raw:bf16", 64 << 20, &roomy), 0);
  // 11 worst-case ZipFusion blocks (~17 KiB each for this model): six sequences of ~64 tokens
  // (4-5 blocks each) cannot all fit.
  EXPECT_GT(run("zipfusion", 11 * 17 * 1024, &tight), 0);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(roomy[i].tokens, tight[i].tokens) << i;
    EXPECT_EQ(roomy[i].text, tight[i].text) << i;
    ASSERT_EQ(roomy[i].logprobs.size(), tight[i].logprobs.size()) << i;
    for (size_t t = 0; t < roomy[i].logprobs.size(); ++t) {
      const TokenLogprob& a = roomy[i].logprobs[t];
      const TokenLogprob& b = tight[i].logprobs[t];
      EXPECT_EQ(a.token, b.token);
      EXPECT_EQ(std::memcmp(&a.logprob, &b.logprob, sizeof(float)), 0) << i << " " << t;
      EXPECT_EQ(a.top, b.top) << i << " " << t;
    }
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

TEST_F(SchedulerTest, PrefixSharingOffPrefillsEveryPrompt) {
  EngineOptions o;
  o.model_path = test::ModelsDir() + "/aidreams260K.bin";
  o.kv.prefix_sharing = false;
  auto e = Engine::Open(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  std::string prompt = "Echoes of vectors unfold, a gentle hum of precision, as I sense the nodes, a gentle hum";
  Collected a, b;
  ASSERT_TRUE((*e)->scheduler().Submit(Make(**e, prompt, 5, &a)).ok());
  (*e)->scheduler().RunUntilIdle();
  ASSERT_TRUE((*e)->scheduler().Submit(Make(**e, prompt, 5, &b)).ok());
  (*e)->scheduler().RunUntilIdle();
  EXPECT_EQ(b.final_event.cached_prompt_tokens, 0);
  EXPECT_EQ((*e)->cache().Stats().prefix_hit_tokens, 0);
  EXPECT_EQ(a.tokens, b.tokens);  // the same answer, computed twice
}

TEST_F(SchedulerTest, PrefixSharingOffRefusesAKvstoreLink) {
  EngineOptions o;
  o.model_path = test::ModelsDir() + "/aidreams260K.bin";
  o.kv.prefix_sharing = false;
  o.kvstore.address = "127.0.0.1:1";
  auto e = Engine::Open(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("prefix sharing off"), std::string::npos) << e.status().ToString();
}

}  // namespace
}  // namespace keel::engine
