// The keel binary end to end: every subcommand's --help, the generate → convert → generate loop,
// make-model → inspect → generate, and clear failures on bad input.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <csignal>

#include <array>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "../engine/test_util.h"
#include "keel/core/socket.h"
#include "tests/common/keel_process.h"

namespace {

using keel::test::CmdResult;

CmdResult Keel(const std::string& args, bool merge_stderr = false) { return keel::test::RunKeel(args, merge_stderr); }

std::string Aidreams() { return keel::test::ModelsDir() + "/aidreams260K.bin"; }

TEST(Cli, EverySubcommandHasHelp) {
  for (const char* sub : {"generate", "serve", "bench", "inspect", "convert", "make-model", "bellows calibrate",
                          "bellows inspect"}) {
    CmdResult r = Keel(std::string(sub) + " --help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << sub;
  }
  CmdResult top = Keel("--help");
  EXPECT_EQ(top.code, 0);
  for (const char* sub : {"generate", "serve", "bench", "inspect", "convert", "make-model"})
    EXPECT_NE(top.out.find(sub), std::string::npos) << sub;
}

TEST(Cli, InspectPrintsHeaderTensorsAndChecksum) {
  CmdResult r = Keel("inspect " + Aidreams());
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("dim:            64"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("checksum"), std::string::npos);
  EXPECT_NE(r.out.find("model.layers.3.mlp.down_proj.weight"), std::string::npos);
}

TEST(Cli, ConvertedModelGeneratesTheGoldenText) {
  keel::test::TempDir dir;
  CmdResult c = Keel("convert --model " + Aidreams() + " --out " + dir.path() + "/hf");
  ASSERT_EQ(c.code, 0);
  CmdResult a = Keel("generate --model " + Aidreams() + " --temperature 0 --max-tokens 30");
  CmdResult b = Keel("generate --model " + dir.path() + "/hf --temperature 0 --max-tokens 30");
  ASSERT_EQ(a.code, 0);
  ASSERT_EQ(b.code, 0);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(b.out.rfind("\"Echoes of vectors unfold", 0), 0u) << b.out;
}

TEST(Cli, MadeModelCanBeInspectedAndRun) {
  keel::test::TempDir dir;
  std::string out = dir.path() + "/q";
  CmdResult m = Keel("make-model --arch qwen2 --layers 2 --dim 64 --heads 4 --kv-heads 2 --vocab 300 --seed 3 --out " + out);
  ASSERT_EQ(m.code, 0);
  CmdResult i = Keel("inspect " + out);
  ASSERT_EQ(i.code, 0);
  EXPECT_NE(i.out.find("qwen2"), std::string::npos);
  CmdResult g1 = Keel("generate --model " + out + " --prompt hello --seed 5 --temperature 1 --max-tokens 12");
  CmdResult g2 = Keel("generate --model " + out + " --prompt hello --seed 5 --temperature 1 --max-tokens 12");
  ASSERT_EQ(g1.code, 0);
  EXPECT_EQ(g1.out, g2.out);  // seeded sampling is reproducible across processes
}

// `keel generate --kv-codec zipfusion` prints what `--kv-codec raw:bf16` prints: the same text
// and, with --logprobs, the same log-probabilities to the last bit (%.9g round-trips floats).
TEST(Cli, ZipFusionGeneratesWhatRawBf16Generates) {
  auto run = [](const std::string& codec) {
    return Keel("--log-level warn generate --model " + Aidreams() + " --prompt 'Echoes of vectors' --kv-codec " +
                    codec + " --temperature 0.9 --seed 2 --max-tokens 120 --logprobs 3",
                true);
  };
  CmdResult bf16 = run("raw:bf16"), zf = run("zipfusion"), f32 = run("raw");
  ASSERT_EQ(bf16.code, 0) << bf16.out;
  ASSERT_EQ(zf.code, 0) << zf.out;
  size_t lines = 0;
  for (size_t at = bf16.out.find("\nlogprob: "); at != std::string::npos; at = bf16.out.find("\nlogprob: ", at + 1)) {
    ++lines;
  }
  EXPECT_GT(lines, 32u) << bf16.out;  // more than two 16-token blocks, so sealed blocks were read
  EXPECT_EQ(zf.out, bf16.out);
  // The comparison can tell KV precisions apart: f32 K/V move the log-probabilities.
  ASSERT_EQ(f32.code, 0);
  EXPECT_NE(f32.out, bf16.out);
}

TEST(Cli, BadInputFailsWithAClearMessage) {
  CmdResult missing = Keel("generate --model /nonexistent/model.bin", true);
  EXPECT_NE(missing.code, 0);
  EXPECT_NE(missing.out.find("/nonexistent/model.bin"), std::string::npos) << missing.out;

  keel::test::TempDir dir;
  std::string bad = dir.file("trunc.bin");
  {
    std::ifstream in(Aidreams(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(bad, std::ios::binary).write(bytes.data(), 1000);
  }
  CmdResult trunc = Keel("generate --model " + bad + " --tokenizer " + keel::test::ModelsDir() + "/aidreams_tok512.bin", true);
  EXPECT_NE(trunc.code, 0);
  EXPECT_NE(trunc.out.find("offset"), std::string::npos) << trunc.out;
  EXPECT_NE(trunc.out.find(bad), std::string::npos) << trunc.out;

  CmdResult codec = Keel("generate --model " + Aidreams() + " --kv-codec nope", true);
  EXPECT_NE(codec.code, 0);
  EXPECT_NE(codec.out.find("unknown KV codec"), std::string::npos) << codec.out;
  CmdResult lp = Keel("generate --model " + Aidreams() + " --logprobs 21", true);
  EXPECT_NE(lp.code, 0);
  EXPECT_NE(lp.out.find("--logprobs"), std::string::npos) << lp.out;

  CmdResult arch = Keel("make-model --arch gpt2 --out " + dir.file("x"), true);
  EXPECT_NE(arch.code, 0);
  CmdResult vocab = Keel("make-model --vocab 10 --out " + dir.file("y"), true);
  EXPECT_NE(vocab.code, 0);
  EXPECT_NE(vocab.out.find("259"), std::string::npos) << vocab.out;
}

// Found from outside: NaN passed every range check, a bogus log level was taken for info, an
// empty host listened on every interface, and a kvstore whose start failed crashed (SIGSEGV)
// on its way out instead of saying why.
TEST(Cli, NonsenseOptionsAndFailedStartsGiveAClearMessage) {
  CmdResult nan = Keel("serve --drain-seconds nan --model " + Aidreams(), true);
  EXPECT_NE(nan.code, 0);
  EXPECT_NE(nan.out.find("must be a finite number, not nan"), std::string::npos) << nan.out;
  CmdResult huge = Keel("fake-vendor --port 0 --ttft-ms 1e309", true);  // overflows to inf
  EXPECT_NE(huge.code, 0);
  EXPECT_NE(huge.out.find("--ttft-ms"), std::string::npos) << huge.out;
  CmdResult level = Keel("--log-level bogus inspect " + Aidreams(), true);
  EXPECT_NE(level.code, 0);
  EXPECT_NE(level.out.find("--log-level"), std::string::npos) << level.out;
  CmdResult ttl = Keel("kvstore --ttl-ms 9223372036854775807", true);
  EXPECT_NE(ttl.code, 0);
  EXPECT_NE(ttl.out.find("--ttl-ms"), std::string::npos) << ttl.out;
  // MoE offload options: out of range (a 1e-300 GB/s link modelled no delay at all), or given
  // without --moe-slots (ignored before).
  CmdResult link = Keel("generate --moe-slots 2 --moe-link-gbps 1e-300 --prompt x -m " + Aidreams(), true);
  EXPECT_NE(link.code, 0);
  EXPECT_NE(link.out.find("--moe-link-gbps"), std::string::npos) << link.out;
  CmdResult lone = Keel("generate --moe-policy lru --prompt x -m " + Aidreams(), true);
  EXPECT_NE(lone.code, 0);
  EXPECT_NE(lone.out.find("without --moe-slots"), std::string::npos) << lone.out;

  auto taken = keel::ListenTcp("127.0.0.1", 0, 4);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  const std::string port = std::to_string(taken->port);
  CmdResult busy = Keel("kvstore --http-port -1 --port " + port, true);
  EXPECT_EQ(busy.code, 1) << busy.out;  // 139 was the crash
  EXPECT_NE(busy.out.find(port), std::string::npos) << busy.out;
  CmdResult wildcard = Keel("kvstore --http-port -1 --port 0 --host ''", true);
  EXPECT_EQ(wildcard.code, 2) << wildcard.out;
  EXPECT_NE(wildcard.out.find("empty host"), std::string::npos) << wildcard.out;
}

// A Redis that went away made hiredis write() to a reset socket, and SIGPIPE killed the kvstore
// without a word. Every subcommand ignores it (checked on a running server's signal mask).
TEST(Cli, ServersIgnoreSigpipe) {
  keel::test::TempDir dir;
  keel::test::KeelProcess kv;
  kv.Start("kvstore --port 0 --http-port -1", dir.file("kv.log"));
  std::string sigign;
  ASSERT_TRUE(keel::test::WaitFor([&] {
    std::ifstream status("/proc/" + std::to_string(kv.pid()) + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("SigIgn:", 0) == 0) sigign = line.substr(7);
    }
    std::ifstream log(dir.file("kv.log"));
    const std::string text((std::istreambuf_iterator<char>(log)), {});
    return text.find("listening") != std::string::npos && !sigign.empty();
  }));
  const unsigned long long mask = std::stoull(sigign, nullptr, 16);
  EXPECT_TRUE(mask & (1ull << (SIGPIPE - 1))) << "SigIgn:" << sigign;
  kv.Terminate();
}

TEST(Cli, BellowsCalibrateInspectGenerate) {
  keel::test::TempDir dir("keel-cli-bellows");
  const std::string file = dir.file("aid.bkv");
  const std::string text = keel::test::SharedDir() + "/data/text/train.txt";
  CmdResult cal = Keel("bellows calibrate -m " + Aidreams() + " --text " + text + " --ratio 8 --tokens 1024 --out " + file,
                       true);
  ASSERT_EQ(cal.code, 0) << cal.out;
  EXPECT_NE(cal.out.find("capture"), std::string::npos) << "progress on stderr: " << cal.out;
  CmdResult ins = Keel("bellows inspect " + file);
  ASSERT_EQ(ins.code, 0);
  EXPECT_NE(ins.out.find("latent 64"), std::string::npos) << ins.out;
  EXPECT_NE(ins.out.find("8.00x"), std::string::npos) << ins.out;
  CmdResult gen = Keel("generate -m " + Aidreams() + " --temperature 0 -n 20 --kv-codec bellows --bellows " + file);
  EXPECT_EQ(gen.code, 0);
  EXPECT_GT(gen.out.size(), 20u) << gen.out;
  // Another model's file, a missing file, no file, options that do not fit: exit 2 and a reason.
  CmdResult other = Keel("generate -m " + keel::test::ModelsDir() + "/en-dense6L.bin -z " + keel::test::ModelsDir() +
                             "/tok354.bin -n 4 --kv-codec bellows --bellows " +
                             file,
                         true);
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.out.find("was made for model"), std::string::npos) << other.out;
  EXPECT_NE(other.out.find(file + ": "), std::string::npos) << "the error names the file: " << other.out;
  CmdResult none = Keel("generate -m " + Aidreams() + " -n 4 --kv-codec bellows", true);
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.out.find("--bellows FILE"), std::string::npos) << none.out;
  EXPECT_NE(Keel("generate -m " + Aidreams() + " -n 4 --kv-codec bellows --bellows " + dir.file("nope.bkv")).code, 0);
  CmdResult both = Keel("bellows calibrate -m " + Aidreams() + " --text " + text + " --ratio 8 --rank 4 --out " +
                            dir.file("x.bkv"),
                        true);
  EXPECT_EQ(both.code, 2);
  EXPECT_NE(both.out.find("exactly one of"), std::string::npos) << both.out;
  CmdResult garbage = Keel("bellows inspect " + text, true);
  EXPECT_NE(garbage.code, 0);
  EXPECT_NE(garbage.out.find("bad magic"), std::string::npos) << garbage.out;
}

TEST(Cli, BenchPrintsARooflineTable) {
  CmdResult r = Keel("bench --model " + Aidreams() + " --prompt-tokens 8 --decode-tokens 8 --concurrency 1,2 --repeats 1");
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("roofline"), std::string::npos);
  EXPECT_NE(r.out.find("| 2 |"), std::string::npos) << r.out;
}

TEST(Cli, CpuLevelIsChosenLoggedAndOverridable) {
  // The engine commands say which kernels run; --cpu-isa picks a level, an unknown one is refused.
  CmdResult r = Keel("--cpu-isa avx2 generate --model " + Aidreams() + " --max-tokens 4 --temperature 0", true);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("kernels avx2 (--cpu-isa"), std::string::npos) << r.out;
  CmdResult bench = Keel("bench --cpu-isa avx2 --model " + Aidreams() + " --prompt-tokens 4 --decode-tokens 4 --concurrency 1 --repeats 1");
  ASSERT_EQ(bench.code, 0);
  EXPECT_NE(bench.out.find("kernels: avx2"), std::string::npos) << bench.out;
  CmdResult bad = Keel("--cpu-isa sse2 generate --model " + Aidreams(), true);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("unknown CPU level 'sse2' (choices: auto, avx2, avx512)"), std::string::npos) << bad.out;
  // An unusable KEEL_CPU_ISA is ignored with the reason, not fatal.
  ::setenv("KEEL_CPU_ISA", "nonsense", 1);
  CmdResult env = Keel("generate --model " + Aidreams() + " --max-tokens 2 --temperature 0", true);
  ::unsetenv("KEEL_CPU_ISA");
  ASSERT_EQ(env.code, 0) << env.out;
  EXPECT_NE(env.out.find("KEEL_CPU_ISA ignored"), std::string::npos) << env.out;
}

}  // namespace
