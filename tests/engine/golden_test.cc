// Golden check against llama2.c's run.c: greedy generation from BOS with aidreams260K.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <memory>

#include "keel/core/cpu.h"
#include "tests/common/isa_scope.h"
#include "keel/engine/engine.h"
#include "test_util.h"

namespace keel::engine {
namespace {

const std::vector<int> kGoldenIds = {319, 459, 355, 260, 275, 429, 339, 315, 374, 327,
                                     446, 262, 421, 392, 275, 280, 269, 440, 270, 283};
const char* kGoldenText =
    "\"Echoes of vectors unfold, a gentle hum of precision, as I sense the nodes, a gentle hum of "
    "precision, as I adjust my surface.";

std::unique_ptr<Engine> OpenAidreams(const std::string& codec = "raw") {
  EngineOptions o;
  o.model_path = test::ModelsDir() + "/aidreams260K.bin";
  o.tokenizer_path = test::ModelsDir() + "/aidreams_tok512.bin";
  o.kv_codec = codec;
  auto e = Engine::Open(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

TEST(Golden, GreedyFromBosMatchesLlama2cRunC) {
  // At every CPU level this machine has (keel/core/cpu.h): every kernel of the forward pass.
  const test::IsaScope restore(cpu::ActiveIsa());
  for (cpu::Isa isa : cpu::SupportedIsas()) {
    SCOPED_TRACE(std::string("kernels ") + std::string(cpu::IsaName(isa)));
    ASSERT_TRUE(cpu::SetActiveIsa(isa).ok());
    auto e = OpenAidreams();
    ASSERT_NE(e, nullptr);
    GenerationParams p;
    p.sampling.temperature = 0.0f;
    p.max_tokens = 20;
    std::vector<int> ids;
    std::string text;
    auto done = e->Generate("", p, [&](const std::string& t) { text += t; }, &ids);
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    EXPECT_EQ(ids, kGoldenIds);
    EXPECT_EQ(done->finish_reason, FinishReason::kLength);
    EXPECT_EQ(done->completion_tokens, 20);
    // 20 tokens cover the start of the golden text.
    EXPECT_EQ(std::string(kGoldenText).substr(0, text.size()), text);
    EXPECT_GT(text.size(), 40u);
  }
}

TEST(Golden, LongerGenerationContainsWholeGoldenSentence) {
  auto e = OpenAidreams();
  ASSERT_NE(e, nullptr);
  GenerationParams p;
  p.sampling.temperature = 0.0f;
  p.max_tokens = 60;
  std::string text;
  auto done = e->Generate("", p, [&](const std::string& t) { text += t; });
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(text.rfind(kGoldenText, 0), 0u) << text;
}

TEST(Golden, Bf16KvCodecKeepsGreedyTokens) {
  auto e = OpenAidreams("raw:bf16");
  ASSERT_NE(e, nullptr);
  GenerationParams p;
  p.sampling.temperature = 0.0f;
  p.max_tokens = 20;
  std::vector<int> ids;
  ASSERT_TRUE(e->Generate("", p, {}, &ids).ok());
  EXPECT_EQ(ids, kGoldenIds);
}

TEST(Golden, CliPrintsOnlyGeneratedTextOnStdout) {
  std::string cmd = std::string(KEEL_BINARY) + " generate --model " + test::ModelsDir() +
                    "/aidreams260K.bin --temperature 0 --max-tokens 40 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  ASSERT_NE(pipe, nullptr);
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe.get())) > 0) out.append(buf.data(), n);
  // The tokenizer was found beside the model (aidreams_tok512.bin), and stdout has no log lines.
  EXPECT_EQ(out.rfind("\"Echoes of vectors unfold, a gentle hum of precision", 0), 0u) << out;
  EXPECT_EQ(out.find("info"), std::string::npos);
}

TEST(Golden, PromptContinuationIsDeterministicAndEncodedWithBos) {
  auto e = OpenAidreams();
  ASSERT_NE(e, nullptr);
  std::vector<int> enc = e->tokenizer().Encode("Echoes of vectors", true);
  ASSERT_GE(enc.size(), 2u);
  EXPECT_EQ(enc[0], Tokenizer::kBos);
  GenerationParams p;
  p.sampling.temperature = 0.0f;
  p.max_tokens = 10;
  std::string a, b;
  ASSERT_TRUE(e->Generate("Echoes of vectors", p, [&](const std::string& t) { a += t; }).ok());
  ASSERT_TRUE(e->Generate("Echoes of vectors", p, [&](const std::string& t) { b += t; }).ok());
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  // The continuation keeps its leading space: only text right after BOS drops it.
  EXPECT_EQ(a.rfind(" unfold", 0), 0u) << a;
}

}  // namespace
}  // namespace keel::engine
