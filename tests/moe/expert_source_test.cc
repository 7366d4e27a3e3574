// The slow tier: both sources copy every expert's bytes exactly as the model's views hold them,
// into the slot layout; refuse what they cannot serve (dense models, indices out of range,
// tensors not in a file, tmpfs for direct I/O) with errors that say why; and report short reads
// of a file that shrank instead of handing out zeros.
#include <unistd.h>

#include <filesystem>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

#include "keel/engine/convert.h"
#include "keel/engine/model.h"
#include "keel/moe/expert_source.h"
#include "tests/moe/moe_test_model.h"

namespace keel::moe {
namespace {

using engine::ExpertWeights;
using engine::Model;
using test::DiskTempDir;
using test::Slot;
using test::SlotMismatch;

using SourceFactory = Result<std::unique_ptr<ExpertSource>> (*)(const Model&);

// Reads every expert of `m` through `src` into a slot pre-filled with a pattern and compares.
void ExpectEveryExpertExact(ExpertSource& src, const Model& m) {
  const ExpertLayout layout = LayoutOf(m.layers[0].moe.experts[0]);
  int checked = 0;
  for (int l = 0; l < int(m.layers.size()); ++l) {
    for (int e = 0; e < int(m.layers[l].moe.experts.size()); ++e) {
      Slot slot(layout.bytes);
      Status st = src.Read(l, e, slot.p);
      ASSERT_TRUE(st.ok()) << src.name() << " layer " << l << " expert " << e << ": "
                           << st.ToString();
      EXPECT_EQ(SlotMismatch(slot, m.layers[l].moe.experts[e]), "")
          << src.name() << " layer " << l << " expert " << e;
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

TEST(ExpertLayout, TensorsAlignedInOrderWithoutOverlap) {
  int dummy = 0;
  ExpertWeights x;
  x.w1 = {&dummy, DType::kBF16, 20, 25};  // 1000 bytes: not a multiple of 64
  x.w2 = {&dummy, DType::kBF16, 25, 20};
  x.w3 = {&dummy, DType::kF32, 3, 5};     // 60 bytes
  const ExpertLayout l = LayoutOf(x);
  EXPECT_EQ(l.w1_off, 0u);
  EXPECT_EQ(l.w2_off, 1024u);
  EXPECT_EQ(l.w3_off, 2048u);
  EXPECT_EQ(l.bytes, 2048u + 64);
  EXPECT_EQ(l.w2_off % 64, 0u);
  EXPECT_EQ(l.w3_off % 64, 0u);
  EXPECT_GE(l.w3_off, l.w2_off + x.w2.bytes());
  EXPECT_GE(l.bytes, l.w3_off + x.w3.bytes());
  EXPECT_EQ(l.bytes % 64, 0u);

  alignas(64) static uint8_t slot[4096];
  const ExpertWeights v = ViewsIn(slot, x, l);
  EXPECT_EQ(v.w1.data, slot);
  EXPECT_EQ(v.w2.data, slot + l.w2_off);
  EXPECT_EQ(v.w3.data, slot + l.w3_off);
  EXPECT_EQ(v.w3.dtype, DType::kF32);
  EXPECT_EQ(v.w2.rows, 25);
  EXPECT_EQ(v.w2.cols, 20);
}

class EnMoe8x : public ::testing::TestWithParam<SourceFactory> {};

TEST_P(EnMoe8x, EveryExpertMatchesTheModelViews) {
  if (!std::filesystem::exists(keel::test::ModelsDir() + "/en-moe8x/model.safetensors")) {
    GTEST_SKIP() << "en-moe8x not under " << keel::test::ModelsDir();
  }
  auto m = engine::LoadModel(keel::test::ModelsDir() + "/en-moe8x");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->layers.size(), 6u);
  ASSERT_EQ(m->layers[0].moe.experts.size(), 8u);
  auto src = GetParam()(*m);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ExpectEveryExpertExact(**src, *m);
}

INSTANTIATE_TEST_SUITE_P(Sources, EnMoe8x,
                         ::testing::Values(&MakeDramSource, &MakeDirectFileSource));

// make-model's random checkpoints of each MoE architecture, loaded by the engine's loader.
class MadeModel
    : public ::testing::TestWithParam<std::tuple<std::string, SourceFactory>> {};

TEST_P(MadeModel, EveryExpertMatchesTheModelViews) {
  DiskTempDir dir;
  if (dir.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
  engine::RandomModelOptions o;
  o.arch = std::get<0>(GetParam());
  o.layers = 2;
  o.dim = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.vocab = 300;
  o.experts = 5;
  o.expert_hidden = 40;
  o.dtype = DType::kBF16;
  o.seed = 9;
  o.out_dir = dir.path();
  ASSERT_TRUE(engine::MakeRandomModel(o).ok());
  auto m = engine::LoadModel(dir.path());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->layers[1].moe.experts.size(), 5u);
  auto src = std::get<1>(GetParam())(*m);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ExpectEveryExpertExact(**src, *m);
}

INSTANTIATE_TEST_SUITE_P(
    ArchsAndSources, MadeModel,
    ::testing::Combine(::testing::Values("mixtral", "olmoe", "qwen2_moe"),
                       ::testing::Values(&MakeDramSource, &MakeDirectFileSource)));

class TinyMoe : public ::testing::TestWithParam<SourceFactory> {};

TEST_P(TinyMoe, EveryExpertMatchesInBf16AndF32) {
  DiskTempDir dir;
  if (dir.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    auto path = test::WriteTinyMoe(dir.path(), 3, 5, 25, 20, dtype, 7);
    ASSERT_TRUE(path.ok()) << path.status().ToString();
    auto m = test::MoeViewsFromSafetensors(*path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ASSERT_EQ(m->layers.size(), 3u);
    auto src = GetParam()(*m);
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    ExpectEveryExpertExact(**src, *m);
  }
}

TEST_P(TinyMoe, IndicesOutOfRangeAreInvalidArgument) {
  DiskTempDir dir;
  if (dir.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
  auto path = test::WriteTinyMoe(dir.path(), 2, 3, 16, 8, DType::kBF16, 1);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto m = test::MoeViewsFromSafetensors(*path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto src = GetParam()(*m);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  Slot slot(LayoutOf(m->layers[0].moe.experts[0]).bytes);
  for (auto [l, e] : {std::pair{-1, 0}, {2, 0}, {0, -1}, {0, 3}, {1, 99}}) {
    Status st = (*src)->Read(l, e, slot.p);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << l << "," << e << ": " << st.ToString();
  }
  EXPECT_TRUE((*src)->Read(1, 2, slot.p).ok());
}

TEST_P(TinyMoe, ReadsFromManyThreadsAtOnce) {
  DiskTempDir dir;
  if (dir.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
  auto path = test::WriteTinyMoe(dir.path(), 4, 8, 64, 48, DType::kBF16, 3);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto m = test::MoeViewsFromSafetensors(*path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto src = GetParam()(*m);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  const size_t bytes = LayoutOf(m->layers[0].moe.experts[0]).bytes;
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Slot slot(bytes);
      for (int round = 0; round < 20; ++round) {
        for (int l = 0; l < 4; ++l) {
          int e = (t + round + l) % 8;
          if (!(*src)->Read(l, e, slot.p).ok() ||
              !SlotMismatch(slot, m->layers[l].moe.experts[e]).empty()) {
            ++bad[t];
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
}

TEST_P(TinyMoe, DenseModelIsInvalidArgument) {
  Model empty;
  empty.source = "in-memory";
  auto r = GetParam()(empty);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("dense"), std::string::npos) << r.status().ToString();

  const std::string dense = keel::test::ModelsDir() + "/aidreams260K.bin";
  if (!std::filesystem::exists(dense)) GTEST_SKIP() << dense << " missing";
  auto m = engine::LoadModel(dense);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto s = GetParam()(*m);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << s.status().ToString();
}

TEST_P(TinyMoe, MixedExpertShapesAreRefused) {
  DiskTempDir dir;
  if (dir.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
  auto path = test::WriteTinyMoe(dir.path(), 2, 2, 16, 8, DType::kBF16, 1);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto m = test::MoeViewsFromSafetensors(*path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  m->layers[1].moe.experts[1].w3.rows = 4;  // half of w3: a different slot size
  auto s = GetParam()(*m);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("layer 1 expert 1"), std::string::npos)
      << s.status().ToString();
}

INSTANTIATE_TEST_SUITE_P(Sources, TinyMoe, ::testing::Values(&MakeDramSource, &MakeDirectFileSource));

TEST(DirectFileSource, TensorNotInAFileIsNamed) {
  DiskTempDir dir;
  if (dir.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
  auto path = test::WriteTinyMoe(dir.path(), 2, 3, 16, 8, DType::kBF16, 1);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto m = test::MoeViewsFromSafetensors(*path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  // A tensor widened or built in memory: the DRAM tier serves it, the file tier cannot.
  engine::TensorView& w2 = m->layers[1].moe.experts[2].w2;
  auto copy = std::make_shared<std::vector<uint8_t>>(
      static_cast<const uint8_t*>(w2.data), static_cast<const uint8_t*>(w2.data) + w2.bytes());
  m->storage.push_back(copy);
  w2.data = copy->data();

  auto direct = MakeDirectFileSource(*m);
  ASSERT_FALSE(direct.ok());
  EXPECT_EQ(direct.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(direct.status().message().find("layer 1 expert 2 w2"), std::string::npos)
      << direct.status().ToString();
  EXPECT_NE(direct.status().message().find("not in a mapped weight file"), std::string::npos)
      << direct.status().ToString();

  auto dram = MakeDramSource(*m);
  ASSERT_TRUE(dram.ok()) << dram.status().ToString();
  ExpectEveryExpertExact(**dram, *m);
}

TEST(DirectFileSource, TmpfsIsRefusedByName) {
  if (!test::OnTmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  DiskTempDir dir("/dev/shm");
  ASSERT_FALSE(dir.path().empty());
  auto path = test::WriteTinyMoe(dir.path(), 1, 2, 16, 8, DType::kBF16, 1);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto m = test::MoeViewsFromSafetensors(*path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto direct = MakeDirectFileSource(*m);
  ASSERT_FALSE(direct.ok());
  EXPECT_EQ(direct.status().code(), StatusCode::kInvalidArgument);
  const std::string& msg = direct.status().message();
  EXPECT_NE(msg.find(*path), std::string::npos) << msg;
  EXPECT_NE(msg.find("O_DIRECT"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tmpfs"), std::string::npos) << msg;
  // The DRAM tier does not care where the map came from.
  auto dram = MakeDramSource(*m);
  ASSERT_TRUE(dram.ok()) << dram.status().ToString();
  ExpectEveryExpertExact(**dram, *m);
}

TEST(DirectFileSource, FileThatShrankGivesShortReadNotZeros) {
  DiskTempDir dir;
  if (dir.path().empty()) GTEST_SKIP() << "no scratch directory on a disk file system";
  auto path = test::WriteTinyMoe(dir.path(), 2, 4, 32, 24, DType::kBF16, 5);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto m = test::MoeViewsFromSafetensors(*path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto src = MakeDirectFileSource(*m);
  ASSERT_TRUE(src.ok()) << src.status().ToString();

  // Cut the file in the middle of the last expert's w2 (the map is not read past here again).
  const ExpertWeights last = m->layers[1].moe.experts[3];
  auto where = m->Locate(last.w2);
  ASSERT_TRUE(where.ok()) << where.status().ToString();
  const uint64_t cut = where->second + last.w2.bytes() / 2;
  const ExpertWeights first = m->layers[0].moe.experts[0];
  ASSERT_EQ(::truncate(path->c_str(), off_t(cut)), 0);

  Slot slot(LayoutOf(last).bytes);
  Status st = (*src)->Read(1, 3, slot.p);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("short read"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find(*path), std::string::npos) << st.ToString();
  // What is still in the file reads as before.
  Slot ok(LayoutOf(first).bytes);
  ASSERT_TRUE((*src)->Read(0, 0, ok.p).ok());
  EXPECT_EQ(SlotMismatch(ok, first), "");
}

}  // namespace
}  // namespace keel::moe
