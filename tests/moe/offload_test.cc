// The offloaded MoE runtime on the real en-moe8x model: exact policies equal the in-memory model
// bit for bit whatever the copy timing; PSR is deterministic under injected copy delays and
// reorderings, while a policy that biases routing toward *physically* resident experts is not;
// PSR's hit ratio beats LRU's; bad options give clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "keel/engine/kv_cache.h"
#include "keel/engine/tokenizer.h"
#include "keel/engine/transformer.h"
#include "keel/moe/logical_cache.h"
#include "keel/moe/offload.h"
#include "../engine/test_util.h"

namespace keel::moe {
namespace {

using engine::BatchToken;
using engine::KvCache;
using engine::Model;
using engine::Transformer;

class OffloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = engine::LoadModel(test::ModelsDir() + "/en-moe8x");
    if (!m.ok()) {
      load_error_ = m.status().ToString();
      return;
    }
    model_ = new Model(std::move(m).value());
    auto tok = engine::Tokenizer::Load(test::ModelsDir() + "/en-moe8x/tokenizer.bin", model_->config.vocab_size);
    if (tok.ok()) prompt_ = tok->Encode("A computer is a machine that", /*bos=*/true);
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(model_, nullptr) << load_error_; ASSERT_FALSE(prompt_.empty()); }

  // Greedy: the prompt in chunks of `chunk` (0: token by token), then `decode` tokens; every
  // row's logits, in order. `stack` null: the model's own (in-memory) feed-forward.
  static std::vector<float> Run(engine::FeedForwardStack* stack, int chunk, int decode, engine::SeqId seq = 1) {
    engine::KvCacheOptions o;
    o.prefix_sharing = false;
    auto cache = KvCache::Create(*model_, "raw", o);
    EXPECT_TRUE(cache.ok());
    Transformer tf(*model_);
    tf.SetFeedForward(stack);
    std::vector<int> tokens = prompt_;
    EXPECT_TRUE((*cache)->BeginSequence(seq, {}).ok());
    EXPECT_TRUE((*cache)->Reserve(seq, static_cast<int>(tokens.size()) + decode).ok());
    std::vector<float> all, logits;
    const int n = static_cast<int>(tokens.size()), step = chunk > 0 ? chunk : 1;
    for (int p = 0; p < n; p += step) {
      std::vector<BatchToken> batch;
      for (int i = p; i < std::min(p + step, n); ++i) batch.push_back({seq, tokens[i], i, true});
      Status st = tf.Forward(batch, **cache, logits);
      EXPECT_TRUE(st.ok()) << st.ToString();
      (*cache)->Commit(seq, tokens.data() + p, static_cast<int>(batch.size()));
      all.insert(all.end(), logits.begin(), logits.end());
    }
    const int vocab = model_->config.vocab_size;
    for (int d = 0; d < decode; ++d) {
      const float* last = &all[all.size() - vocab];
      tokens.push_back(static_cast<int>(std::max_element(last, last + vocab) - last));
      const int pos = static_cast<int>(tokens.size()) - 1;
      Status st = tf.Forward({{seq, tokens[pos], pos, true}}, **cache, logits);
      EXPECT_TRUE(st.ok()) << st.ToString();
      (*cache)->Commit(seq, &tokens[pos], 1);
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  }

  static std::unique_ptr<OffloadedMoe> Make(OffloadOptions o) {
    auto r = OffloadedMoe::Create(*model_, o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : nullptr;
  }

  // Copies that land late and out of order: 0-3 ms of random delay each, reordered queue.
  static CopyModel Chaotic(uint64_t seed) {
    CopyModel c;
    c.latency_s = 200e-6;
    c.jitter_s = 3e-3;
    c.reorder = true;
    c.seed = seed;
    return c;
  }

  static inline Model* model_ = nullptr;
  static inline std::string load_error_;
  static inline std::vector<int> prompt_;
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_F(OffloadTest, ExactPoliciesEqualTheInMemoryModelBitForBit) {
  const std::vector<float> resident = Run(nullptr, 0, 12);
  for (Policy p : {Policy::kLru, Policy::kPrefetch}) {
    for (int slots : {2, 4}) {
      OffloadOptions o;
      o.policy = p;
      o.slots = slots;
      o.copy = Chaotic(7 + slots);
      auto moe = Make(o);
      ASSERT_NE(moe, nullptr);
      EXPECT_TRUE(SameBits(Run(moe.get(), 0, 12), resident)) << PolicyName(p) << " slots " << slots;
      const OffloadStats s = moe->stats();
      EXPECT_EQ(s.tokens, static_cast<int64_t>(prompt_.size()) + 12);
      EXPECT_GT(s.demand_copies, 0);
      // Bytes of landed copies: a prefetch nobody waited for may still be in flight.
      const int64_t issued = s.demand_copies + s.prefetch_copies, eb = static_cast<int64_t>(moe->expert_bytes());
      EXPECT_LE(s.bytes, issued * eb);
      EXPECT_GE(s.bytes, (issued - slots * model_->config.n_layers) * eb);
      if (p == Policy::kLru) EXPECT_EQ(s.prefetch_copies, 0);
      if (p == Policy::kPrefetch) EXPECT_GT(s.prefetch_copies, 0);
    }
  }
}

TEST_F(OffloadTest, PsrWithoutBonusIsExactRouting) {
  OffloadOptions o;
  o.policy = Policy::kPsr;
  o.slots = 2;
  o.bonus = 0.0f;
  o.copy = Chaotic(3);
  auto moe = Make(o);
  ASSERT_NE(moe, nullptr);
  EXPECT_TRUE(SameBits(Run(moe.get(), 0, 12), Run(nullptr, 0, 12)));
}

TEST_F(OffloadTest, PsrIsBitIdenticalUnderRandomCopyDelaysAndReordering) {
  std::vector<float> first;
  for (uint64_t seed : {1, 2, 3}) {
    OffloadOptions o;
    o.policy = Policy::kPsr;
    o.slots = 2;
    o.bonus = 4.0f;
    o.copy = Chaotic(seed);
    auto moe = Make(o);
    ASSERT_NE(moe, nullptr);
    std::vector<float> out = Run(moe.get(), 0, 16);
    if (first.empty()) {
      first = out;
      // The bonus really changes routing (else this test would prove nothing).
      EXPECT_FALSE(SameBits(out, Run(nullptr, 0, 16)));
    } else {
      EXPECT_TRUE(SameBits(out, first)) << "seed " << seed;
    }
  }
}

TEST_F(OffloadTest, ResidentBiasedRoutingDependsOnCopyTiming) {
  // Same weights, same tokens, same bonus; only the injected copy delays differ.
  std::set<std::vector<float>> outcomes;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    OffloadOptions o;
    o.policy = Policy::kResidentBias;
    o.slots = 2;
    o.bonus = 4.0f;
    o.copy = Chaotic(seed);
    o.copy.latency_s = 1e-3;
    auto moe = Make(o);
    ASSERT_NE(moe, nullptr);
    outcomes.insert(Run(moe.get(), 0, 16));
  }
  EXPECT_GT(outcomes.size(), 1u) << "a timing-dependent policy gave the same outputs under 4 different copy timings";
}

TEST_F(OffloadTest, PsrPrefillEqualsTokenByTokenDecoding) {
  OffloadOptions o;
  o.policy = Policy::kPsr;
  o.slots = 2;
  o.bonus = 4.0f;
  auto a = Make(o);
  auto b = Make(o);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(SameBits(Run(a.get(), 7, 8), Run(b.get(), 0, 8)));
}

TEST_F(OffloadTest, PsrHitRatioBeatsLruAtAQuarterOfTheExperts) {
  auto hit_ratio = [&](Policy p) {
    OffloadOptions o;
    o.policy = p;
    o.slots = 2;
    o.bonus = 4.0f;
    auto moe = Make(o);
    Run(moe.get(), 0, 24);
    return moe->stats().hit_ratio();
  };
  // Residency (not landing time) decides a hit, so these are deterministic.
  const double lru = hit_ratio(Policy::kLru), psr = hit_ratio(Policy::kPsr);
  EXPECT_GT(psr, lru + 0.1) << "lru " << lru << " psr " << psr;
}

TEST_F(OffloadTest, MetricsNameCopiesStallsAndHitRatio) {
  OffloadOptions o;
  o.policy = Policy::kPrefetch;
  o.slots = 4;
  auto moe = Make(o);
  Run(moe.get(), 0, 4);
  MetricsRegistry registry;
  moe->RegisterMetrics(registry);
  const std::string text = registry.Render();
  EXPECT_NE(text.find("keel_moe_tokens_total{policy=\"prefetch\"} " + std::to_string(prompt_.size() + 4)), std::string::npos)
      << text;
  for (const char* name : {"keel_moe_copies_total{policy=\"prefetch\",cause=\"demand\"}", "keel_moe_hit_ratio",
                           "keel_moe_stall_seconds_total", "keel_moe_copy_bytes_total", "keel_moe_expert_lookups_total"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name << "\n" << text;
  }
}

TEST_F(OffloadTest, DirectFileSourceGivesTheSameOutputs) {
  OffloadOptions o;
  o.policy = Policy::kLru;
  o.slots = 2;
  o.source = "file-direct";
  auto r = OffloadedMoe::Create(*model_, o);
  if (!r.ok() && r.status().message().find("O_DIRECT") != std::string::npos) {
    GTEST_SKIP() << "file system without O_DIRECT: " << r.status().ToString();
  }
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(SameBits(Run(r->get(), 0, 6), Run(nullptr, 0, 6)));
}

TEST_F(OffloadTest, BadOptionsAreRefusedClearly) {
  auto msg = [&](OffloadOptions o) {
    auto r = OffloadedMoe::Create(*model_, o);
    return r.ok() ? std::string("ok") : r.status().message();
  };
  OffloadOptions o;
  o.slots = 1;  // below top_k 2
  EXPECT_NE(msg(o).find("--moe-slots 1"), std::string::npos) << msg(o);
  o.slots = 9;
  EXPECT_NE(msg(o).find("number of experts 8"), std::string::npos) << msg(o);
  o.slots = 2;
  o.lookahead = 3;
  EXPECT_NE(msg(o).find("--moe-lookahead"), std::string::npos);
  o.lookahead = 1;
  o.decay = 1.0f;
  EXPECT_NE(msg(o).find("--moe-decay"), std::string::npos);
  o.decay = 0.9f;
  o.source = "nvme";
  EXPECT_NE(msg(o).find("--moe-source"), std::string::npos);
  EXPECT_FALSE(ParsePolicy("belady").ok());
  EXPECT_EQ(*ParsePolicy("psr"), Policy::kPsr);
  auto dense = engine::LoadModel(test::ModelsDir() + "/en-dense6L.bin");
  ASSERT_TRUE(dense.ok());
  OffloadOptions d;
  d.slots = 2;
  auto r = OffloadedMoe::Create(*dense, d);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("dense"), std::string::npos);
}

TEST(LogicalCache, EvictsTheLowestMovingAverageAndRespectsProtection) {
  LogicalCache c(8, 2, 0.5f);
  EXPECT_EQ(c.Insert(3, nullptr, 0), -1);
  EXPECT_EQ(c.Insert(5, nullptr, 0), -1);
  EXPECT_EQ(c.Insert(5, nullptr, 0), -1);  // already a member
  const int chosen[] = {5, 1};
  c.Observe(chosen, 2);                    // 5 and 1 rise, 3 stays 0
  EXPECT_GT(c.average(5), c.average(3));
  EXPECT_EQ(c.Insert(6, nullptr, 0), 3);   // lowest average goes
  EXPECT_TRUE(c.Contains(6));
  EXPECT_FALSE(c.Contains(3));
  // 6 (average 0) is protected: 5 goes even though its average is higher.
  const int keep[] = {6};
  EXPECT_EQ(c.Insert(2, keep, 1), 5);
  const int all[] = {6, 2};
  EXPECT_EQ(c.Insert(7, all, 2), -2);      // every member protected: nothing inserted
  EXPECT_FALSE(c.Contains(7));
  std::vector<float> bonus(8);
  c.Bonus(1.5f, bonus.data());
  EXPECT_EQ(bonus[6], 1.5f);
  EXPECT_EQ(bonus[2], 1.5f);
  EXPECT_EQ(bonus[5], 0.0f);
}

TEST(LogicalCache, TiesEvictTheLowerExpertId) {
  LogicalCache c(8, 2, 0.9f);
  c.Insert(4, nullptr, 0);
  c.Insert(2, nullptr, 0);
  EXPECT_EQ(c.Insert(7, nullptr, 0), 2);
}

}  // namespace
}  // namespace keel::moe
