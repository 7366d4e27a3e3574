// BellowsKV end to end on the real aidreams260K model: calibration from real text, the codec in
// the engine (prefill == decode, preemption, chunk sharing), and the errors a user can hit.
#include "keel/kv/bellows/bellows_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include "keel/engine/bellows_calibration.h"
#include "keel/engine/engine.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/transformer.h"
#include "test_util.h"

namespace keel::engine {
namespace {

namespace kb = kv::bellows;

class BellowsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = new Model(std::move(m).value());
    auto t = Tokenizer::Load(test::ModelsDir() + "/aidreams_tok512.bin", model_->config.vocab_size);
    ASSERT_TRUE(t.ok());
    tok_ = new Tokenizer(std::move(t).value());
    dir_ = new test::TempDir("keel-bellows-test");
    // Rank 256 = n_layers * dim: X W has at most that rank, so this calibration is lossless up
    // to the bf16 latent. Ratio 8: a real lossy one.
    full_ = Calibrate(0, 256, "full.bkv");
    lossy_ = Calibrate(8.0, 0, "lossy.bkv");
    table_ = Calibrate(0, 63, "table.bkv", /*token_table=*/true);
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tok_;
    delete dir_;
  }
  static std::string Calibrate(double ratio, int rank, const std::string& name, bool token_table = false) {
    BellowsCalibrationOptions o;
    o.token_table = token_table;
    o.text_path = test::SharedDir() + "/data/text/train.txt";
    o.tokens = 4096;
    o.ratio = ratio;
    o.rank = rank;
    o.objective = kb::Objective::kPlain;
    auto cal = CalibrateBellows(*model_, *tok_, o);
    EXPECT_TRUE(cal.ok()) << cal.status().ToString();
    const std::string path = dir_->file(name);
    EXPECT_TRUE(kb::WriteCalibration(path, *cal).ok());
    return path;
  }
  static std::unique_ptr<KvCache> Cache(const std::string& codec, const std::string& file, size_t budget = 4 << 20,
                                        bool sharing = false) {
    KvCacheOptions o;
    o.budget_bytes = budget;
    o.prefix_sharing = sharing;
    if (!file.empty()) o.codec_params["bellows"] = file;
    auto c = KvCache::Create(*model_, codec, o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  // Logits of every position of `ids`, prefilled in chunks of `chunk`.
  static std::vector<float> Logits(KvCache& cache, const std::vector<int>& ids, int chunk, SeqId seq = 1) {
    Transformer tf(*model_);
    EXPECT_TRUE(cache.BeginSequence(seq, {}).ok());
    EXPECT_TRUE(cache.Reserve(seq, static_cast<int>(ids.size())).ok());
    std::vector<float> all, logits;
    for (int p = 0; p < static_cast<int>(ids.size()); p += chunk) {
      std::vector<BatchToken> batch;
      for (int i = p; i < std::min<int>(p + chunk, ids.size()); ++i) batch.push_back({seq, ids[i], i, true});
      EXPECT_TRUE(tf.Forward(batch, cache, logits).ok());
      cache.Commit(seq, ids.data() + p, static_cast<int>(batch.size()));
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  }
  static std::vector<int> Text(int n) {
    std::ifstream in(test::SharedDir() + "/data/text/val.txt");
    std::string text((std::istreambuf_iterator<char>(in)), {});
    std::vector<int> ids = tok_->Encode(text.substr(0, 4000), true);
    ids.resize(n);
    return ids;
  }
  static int Argmax(const float* x, int n) { return static_cast<int>(std::max_element(x, x + n) - x); }
  // Positions (of `n`) where two runs' logits have the same top-1 token.
  static int Agreement(const std::vector<float>& a, const std::vector<float>& b, int n) {
    const int V = model_->config.vocab_size;
    int agree = 0;
    for (int i = 0; i < n; ++i) agree += Argmax(&a[i * V], V) == Argmax(&b[i * V], V);
    return agree;
  }

  static Model* model_;
  static Tokenizer* tok_;
  static test::TempDir* dir_;
  static std::string full_, lossy_, table_;
};
Model* BellowsTest::model_ = nullptr;
Tokenizer* BellowsTest::tok_ = nullptr;
test::TempDir* BellowsTest::dir_ = nullptr;
std::string BellowsTest::full_, BellowsTest::lossy_, BellowsTest::table_;

TEST_F(BellowsTest, FullRankCalibrationTracksRawKv) {
  const std::vector<int> ids = Text(120);
  auto raw = Cache("raw:f32", "");
  auto bel = Cache("bellows", full_);
  ASSERT_TRUE(raw && bel);
  const std::vector<float> a = Logits(*raw, ids, 120), b = Logits(*bel, ids, 120);
  const int agree = Agreement(a, b, 120);
  std::printf("[ agree ] full rank: %d/120 top-1 agreement with raw:f32\n", agree);
  // Only bf16 rounding of the latent separates them.
  EXPECT_GE(agree, 117) << "top-1 agreement of a lossless-rank calibration";
  // One latent of 256 bf16 per token for all four layers: 512 bytes vs raw f32's 2048.
  EXPECT_EQ(bel->ChunkValueBytes(), 16u * 256 * 2);
}

TEST_F(BellowsTest, LossyCalibrationStillPredictsMostlyAlikeAndIsEightTimesSmallerThanBf16) {
  const std::vector<int> ids = Text(120);
  auto raw = Cache("raw:bf16", "");
  auto bel = Cache("bellows", lossy_);
  ASSERT_TRUE(raw && bel);
  EXPECT_EQ(raw->ChunkValueBytes(), 8 * bel->ChunkValueBytes());  // 4 layers * 128 bf16 vs 64 bf16
  const std::vector<float> a = Logits(*raw, ids, 120), b = Logits(*bel, ids, 120);
  const int agree = Agreement(a, b, 120);
  std::printf("[ agree ] 8x: %d/120 top-1 agreement with raw:bf16\n", agree);
  EXPECT_GE(agree, 80) << "measured 95/120 with 4096 calibration tokens, plain objective";
  EXPECT_LT(agree, 120) << "a rank-64 latent cannot be lossless";
}

TEST_F(BellowsTest, TokenTableRestoresLayerZeroExactly) {
  const std::vector<int> ids = Text(40);
  auto raw = Cache("raw:f32", "");
  auto bel = Cache("bellows", table_);
  ASSERT_TRUE(raw && bel);
  EXPECT_EQ(bel->ChunkValueBytes(), 16u * 64 * 2);  // token id + 63 latent values per token
  Logits(*raw, ids, 40);
  Logits(*bel, ids, 40);
  const int kvd = model_->config.kv_dim();
  std::vector<float> k1(kvd), v1(kvd), k2(kvd), v2(kvd);
  int exact0 = 0, exact1 = 0, v_exact0 = 0;
  for (int pos = 0; pos < 40; ++pos) {
    for (int layer : {0, 1}) {
      int s1, s2;
      const uint8_t* b1 = raw->BlockFor(1, layer, pos, &s1);
      const uint8_t* b2 = bel->BlockFor(1, layer, pos, &s2);
      raw->codec().read_at(layer, b1, s1, pos, k1.data(), v1.data());
      bel->codec().read_at(layer, b2, s2, pos, k2.data(), v2.data());
      const bool same = std::memcmp(k1.data(), k2.data(), sizeof(float) * kvd) == 0 &&
                        std::memcmp(v1.data(), v2.data(), sizeof(float) * kvd) == 0;
      (layer == 0 ? exact0 : exact1) += same;
      if (layer == 0) v_exact0 += std::memcmp(v1.data(), v2.data(), sizeof(float) * kvd) == 0;
    }
  }
  EXPECT_EQ(v_exact0, 40) << "layer 0's V comes from the token table: bit for bit";
  EXPECT_EQ(exact0, 40) << "layer 0 comes from the token table: bit for bit";
  EXPECT_LT(exact1, 5) << "layer 1 comes from the latent: lossy";
  // A fetched block naming a token outside the vocabulary is refused.
  std::vector<uint8_t> block(bel->codec().block_bytes(0), 0);
  reinterpret_cast<uint16_t*>(block.data())[64 * 3] = 600;  // slot 3's token id
  auto v = bel->codec().validate_stored(0, block.data(), block.size());
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("outside the vocabulary"), std::string::npos) << v.status().message();
}

TEST_F(BellowsTest, InputPcaBaselineAtFullRankStoresTheLayerInputs) {
  BellowsCalibrationOptions o;
  o.text_path = test::SharedDir() + "/data/text/train.txt";
  o.tokens = 2048;
  o.rank = 64;  // = dim: the PCA keeps every direction of the layer input
  o.input_pca = true;
  auto cal = CalibrateBellows(*model_, *tok_, o);
  ASSERT_TRUE(cal.ok()) << cal.status().ToString();
  EXPECT_EQ(cal->group_size, 1);
  const std::string path = dir_->file("input.bkv");
  ASSERT_TRUE(kb::WriteCalibration(path, *cal).ok());
  const std::vector<int> ids = Text(100);
  auto raw = Cache("raw:f32", "");
  auto bel = Cache("bellows", path);
  ASSERT_TRUE(raw && bel);
  const std::vector<float> a = Logits(*raw, ids, 100), b = Logits(*bel, ids, 100);
  const int agree = Agreement(a, b, 100);
  EXPECT_GE(agree, 97) << "only the bf16 latent separates them";
  // Options that do not make sense together are refused.
  o.token_table = true;
  EXPECT_FALSE(CalibrateBellows(*model_, *tok_, o).ok());
  o.token_table = false;
  o.rank = 65;
  EXPECT_FALSE(CalibrateBellows(*model_, *tok_, o).ok());
}

TEST_F(BellowsTest, PrefillChunksAndDecodeGiveIdenticalLogitsAndCache) {
  const std::vector<int> ids = Text(70);
  auto a = Cache("bellows", lossy_), b = Cache("bellows", lossy_), c = Cache("bellows", lossy_);
  const std::vector<float> la = Logits(*a, ids, 70), lb = Logits(*b, ids, 1), lc = Logits(*c, ids, 13);
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), sizeof(float) * la.size()), 0);
  EXPECT_EQ(std::memcmp(la.data(), lc.data(), sizeof(float) * la.size()), 0);
  for (int pos = 0; pos < 70; pos += 16) {
    int sa, sb;
    const uint8_t* ba = a->BlockFor(1, 0, pos, &sa);
    const uint8_t* bb = b->BlockFor(1, 0, pos, &sb);
    const size_t bytes = std::min<size_t>(16, 70 - pos) * 64 * 2;  // rank 64 bf16 per token
    EXPECT_EQ(std::memcmp(ba, bb, bytes), 0) << "block at " << pos;
  }
}

TEST_F(BellowsTest, PreemptionUnderTightBudgetKeepsOutputsExact) {
  const char* prompts[] = {"Echoes", "as I sense the nodes", "a gentle hum", "vectors unfold", "precision", ""};
  auto run = [&](size_t budget, std::vector<std::vector<int>>* out) -> int64_t {
    EngineOptions o;
    o.model_path = test::ModelsDir() + "/aidreams260K.bin";
    o.kv_codec = "bellows";
    o.kv.codec_params["bellows"] = lossy_;
    o.kv.budget_bytes = budget;
    auto e = Engine::Open(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return -1;
    out->assign(6, {});
    for (int i = 0; i < 6; ++i) {
      auto r = std::make_shared<Request>();
      r->prompt = (*e)->tokenizer().Encode(prompts[i], true);
      r->params.max_tokens = 60;
      r->params.sampling.temperature = 0;
      std::vector<int>* dst = &(*out)[i];
      r->on_event = [dst](const GenerationEvent& ev) { dst->insert(dst->end(), ev.tokens.begin(), ev.tokens.end()); };
      EXPECT_TRUE((*e)->scheduler().Submit(r).ok());
    }
    (*e)->scheduler().RunUntilIdle();
    return (*e)->scheduler().Stats().preemptions;
  };
  std::vector<std::vector<int>> roomy, tight;
  EXPECT_EQ(run(4 << 20, &roomy), 0);
  EXPECT_GT(run(10 * 2048, &tight), 0);  // 10 blocks of 2 KiB: six ~64-token sequences cannot all fit
  for (int i = 0; i < 6; ++i) EXPECT_EQ(roomy[i], tight[i]) << i;
}

TEST_F(BellowsTest, ChunksCarryTheCalibrationAndAreValidatedWhenAdopted) {
  auto a = Cache("bellows", lossy_, 4 << 20, true), b = Cache("bellows", lossy_, 4 << 20, true);
  auto other = Cache("bellows", full_, 4 << 20, true);
  const std::vector<int> ids = Text(40);
  EXPECT_NE(a->fingerprint(), other->fingerprint());
  EXPECT_NE(a->ChunkKeys(ids.data(), 32), other->ChunkKeys(ids.data(), 32)) << "keys must cover the calibration";
  EXPECT_EQ(a->ChunkKeys(ids.data(), 32), b->ChunkKeys(ids.data(), 32));
  Logits(*a, ids, 40);
  auto pinned = a->PinChunks(1, 0, 2);
  ASSERT_EQ(pinned.size(), 2u);
  std::vector<std::string> values;
  for (auto& [key, block] : pinned) {
    std::string v;
    for (auto [p, n] : a->ChunkPieces(block)) v.append(reinterpret_cast<const char*>(p), n);
    values.push_back(v);
    a->Unpin(block);
  }
  // A NaN latent (bf16 0x7fc0) is refused before anything is adopted.
  std::string bad = values[1];
  bad[10] = static_cast<char>(0xc0);
  bad[11] = static_cast<char>(0x7f);
  ASSERT_TRUE(b->BeginSequence(2, ids).ok());
  auto refused = b->AdoptChunks(2, ids, 0, {values[0], bad});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("not finite"), std::string::npos) << refused.status().message();
  auto adopted = b->AdoptChunks(2, ids, 0, {values[0], values[1]});
  ASSERT_TRUE(adopted.ok()) << adopted.status().ToString();
  EXPECT_EQ(*adopted, 32);
}

TEST_F(BellowsTest, ClearErrors) {
  KvCacheOptions o;
  auto missing = KvCache::Create(*model_, "bellows", o);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--bellows FILE"), std::string::npos);
  EXPECT_FALSE(KvCache::Create(*model_, "bellows:x", o).ok());
  // A file made for another model.
  auto dense = LoadLlama2c(test::ModelsDir() + "/en-dense6L.bin");
  ASSERT_TRUE(dense.ok());
  o.codec_params["bellows"] = lossy_;
  auto wrong = KvCache::Create(*dense, "bellows", o);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find(model_->checksum.hex()), std::string::npos) << wrong.status().message();
  // Truncated and corrupted files.
  std::ifstream in(lossy_, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  const std::string cut = dir_->file("cut.bkv");
  std::ofstream(cut, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  o.codec_params["bellows"] = cut;
  auto truncated = KvCache::Create(*model_, "bellows", o);
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find("cut.bkv"), std::string::npos) << truncated.status().message();
  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x40;
  const std::string flip = dir_->file("flip.bkv");
  std::ofstream(flip, std::ios::binary).write(flipped.data(), static_cast<std::streamsize>(flipped.size()));
  o.codec_params["bellows"] = flip;
  EXPECT_FALSE(KvCache::Create(*model_, "bellows", o).ok());
  // Calibration options that do not fit the model.
  BellowsCalibrationOptions bad;
  bad.text_path = test::SharedDir() + "/data/text/train.txt";
  bad.tokens = 256;
  bad.ratio = 8;
  bad.group_size = 9;
  EXPECT_FALSE(CalibrateBellows(*model_, *tok_, bad).ok());
  bad.group_size = 2;
  bad.rank = 4;  // and --ratio: two latent sizes
  EXPECT_FALSE(CalibrateBellows(*model_, *tok_, bad).ok());
  bad.rank = 0;
  bad.text_path = dir_->file("does-not-exist.txt");
  EXPECT_FALSE(CalibrateBellows(*model_, *tok_, bad).ok());
  // Text that never ends a line (/dev/zero) or one line past the bound: refused, not read whole.
  bad.text_path = "/dev/zero";
  auto device = CalibrateBellows(*model_, *tok_, bad);
  ASSERT_FALSE(device.ok());
  EXPECT_NE(device.status().message().find("not a regular file"), std::string::npos) << device.status().message();
  bad.text_path = dir_->file("one-line.txt");
  std::ofstream(bad.text_path) << std::string((1 << 20) + 10, 'a') << "\n";
  auto long_line = CalibrateBellows(*model_, *tok_, bad);
  ASSERT_FALSE(long_line.ok());
  EXPECT_NE(long_line.status().message().find("a line longer than"), std::string::npos)
      << long_line.status().message();
}

}  // namespace
}  // namespace keel::engine
