#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "keel/core/mapped_file.h"
#include "keel/engine/model.h"
#include "test_util.h"

namespace keel::engine {
namespace {

TEST(Llama2cLoader, AidreamsHeader) {
  auto m = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 4);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 128);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(m->classifier.data, m->embedding.data);
  EXPECT_EQ(c.ParameterCount(), 230976);
  EXPECT_EQ(m->format, "llama2c");
}

TEST(Llama2cLoader, Stories260kHasGroupedQueryAttention) {
  auto m = LoadLlama2c(test::ModelsDir() + "/stories260K.bin");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->config.n_layers, 5);
  EXPECT_EQ(m->config.n_heads, 8);
  EXPECT_EQ(m->config.n_kv_heads, 4);
  EXPECT_EQ(m->config.kv_dim(), 32);
  EXPECT_EQ(m->layers[0].wk.rows, 32);
  EXPECT_EQ(m->config.ParameterCount(), 260032);
  // Weights are viewed in place: the first embedding float is at byte 28 of the mapped file.
  auto raw = ReadFileToString(test::ModelsDir() + "/stories260K.bin");
  ASSERT_TRUE(raw.ok());
  float first;
  std::memcpy(&first, raw->data() + 28, 4);
  EXPECT_EQ(static_cast<const float*>(m->embedding.data)[0], first);
}

TEST(Llama2cLoader, ChecksumIsStableAndDistinguishesModels) {
  auto a = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
  auto b = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
  auto c = LoadLlama2c(test::ModelsDir() + "/stories260K.bin");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->checksum, b->checksum);
  EXPECT_NE(a->checksum, c->checksum);
}

class CorruptModel : public ::testing::Test {
 protected:
  void SetUp() override {
    auto r = ReadFileToString(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(r.ok());
    bytes_ = *r;
  }
  std::string Write(const std::string& name, const std::string& data) {
    std::string p = dir_.file(name);
    EXPECT_TRUE(WriteFileAtomic(p, data).ok());
    return p;
  }
  std::string bytes_;
  test::TempDir dir_;
};

TEST_F(CorruptModel, TruncatedWeightsNameFileAndOffset) {
  for (size_t cut : {size_t{0}, size_t{27}, size_t{28}, size_t{5000}, bytes_.size() - 4}) {
    std::string p = Write("cut" + std::to_string(cut) + ".bin", bytes_.substr(0, cut));
    auto m = LoadLlama2c(p);
    ASSERT_FALSE(m.ok()) << cut;
    EXPECT_EQ(m.status().code(), StatusCode::kCorruption);
    EXPECT_NE(m.status().message().find(p), std::string::npos) << m.status().ToString();
    EXPECT_NE(m.status().message().find("offset"), std::string::npos) << m.status().ToString();
  }
}

TEST_F(CorruptModel, TrailingBytesAreReported) {
  std::string p = Write("long.bin", bytes_ + std::string(12, '\0'));
  auto m = LoadLlama2c(p);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("trailing"), std::string::npos);
}

TEST_F(CorruptModel, HostileHeaderIsRejectedBeforeAnyAllocation) {
  std::string hdr = bytes_;
  int32_t huge = 1 << 30;
  std::memcpy(hdr.data(), &huge, 4);  // dim
  auto m = LoadLlama2c(Write("huge.bin", hdr));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("offset 0"), std::string::npos) << m.status().ToString();

  std::string neg = bytes_;
  int32_t minus = -4;
  std::memcpy(neg.data() + 12, &minus, 4);  // n_heads
  EXPECT_FALSE(LoadLlama2c(Write("neg.bin", neg)).ok());

  std::string odd = bytes_;
  int32_t heads = 3;
  std::memcpy(odd.data() + 12, &heads, 4);  // 64 % 3 != 0
  EXPECT_FALSE(LoadLlama2c(Write("odd.bin", odd)).ok());

  // One head of 1024: the forward pass's per-head buffers hold 512 (it overflowed the stack).
  std::string wide = bytes_;
  const int32_t dim = 1024, one = 1;
  std::memcpy(wide.data(), &dim, 4);
  std::memcpy(wide.data() + 12, &one, 4);
  std::memcpy(wide.data() + 16, &one, 4);
  auto w = LoadLlama2c(Write("wide.bin", wide));
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("head_dim 1024"), std::string::npos) << w.status().ToString();
}

TEST_F(CorruptModel, MissingFileIsNotFound) {
  auto m = LoadModel(dir_.file("nope.bin"));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace keel::engine
