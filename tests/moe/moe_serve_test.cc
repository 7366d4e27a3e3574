// Offloaded MoE through the real engine, server and CLI: PSR outputs per sequence do not depend
// on which other requests share the batch, nor on copy timing; /metrics reports copies, stalls and
// the hit ratio; `keel generate --moe-*` is deterministic under injected copy faults and refuses
// bad options with exit code 2.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/engine/engine.h"
#include "keel/engine/server.h"
#include "keel/moe/offload.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"

namespace keel::moe {
namespace {

using json = nlohmann::json;

std::string MoeModel() { return test::ModelsDir() + "/en-moe8x"; }

engine::EngineOptions PsrEngine(uint64_t copy_seed) {
  engine::EngineOptions o;
  o.model_path = MoeModel();
  OffloadOptions off;
  off.policy = Policy::kPsr;
  off.slots = 2;
  off.bonus = 4.0f;  // large, so routing really differs from exact routing
  off.copy.latency_s = 100e-6;
  off.copy.jitter_s = 2e-3;
  off.copy.reorder = true;
  off.copy.seed = copy_seed;
  o.feed_forward = [off](const engine::Model& m) -> Result<std::unique_ptr<engine::FeedForwardStack>> {
    KEEL_ASSIGN_OR_RETURN(std::unique_ptr<OffloadedMoe> s, OffloadedMoe::Create(m, off));
    return std::unique_ptr<engine::FeedForwardStack>(std::move(s));
  };
  return o;
}

std::string Greedy(engine::Engine& e, const std::string& prompt, int n) {
  engine::GenerationParams p;
  p.sampling.temperature = 0.0f;
  p.max_tokens = n;
  std::string text;
  auto done = e.Generate(prompt, p, [&](const std::string& t) { text += t; });
  EXPECT_TRUE(done.ok()) << done.status().ToString();
  return text;
}

TEST(MoeServe, PsrSequencesAreIndependentOfBatchingAndMetricsAreExported) {
  const std::vector<std::string> prompts = {"The ", "Once upon a time", "A computer is"};
  // Alone, one at a time.
  std::vector<std::string> alone;
  {
    auto e = engine::Engine::Open(PsrEngine(1));
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    for (const auto& p : prompts) alone.push_back(Greedy(**e, p, 40));
  }
  // Together, batched by the server's scheduler, with other copy timings.
  auto metrics = engine::MakeEngineMetrics();
  auto e = engine::Engine::Open(PsrEngine(2), engine::ObserverFor(metrics));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_FALSE((*e)->cache().prefix_sharing()) << "PSR state is per sequence: prefix reuse must be off";
  (*e)->feed_forward().RegisterMetrics(metrics->registry);
  engine::ServerOptions so;
  so.port = 0;
  so.model_name = "moe";
  engine::Server server((*e)->scheduler(), (*e)->tokenizer(), so, metrics);
  ASSERT_TRUE(server.Start().ok());
  const int port = server.port();
  std::vector<std::future<test::HttpTestResponse>> replies;
  for (const auto& p : prompts) {
    replies.push_back(std::async(std::launch::async, [port, p] {
      test::HttpTestClient c(port);
      json body = {{"model", "moe"}, {"prompt", p}, {"max_tokens", 40}, {"temperature", 0}};
      return c.Request("POST", "/v1/completions", body.dump());
    }));
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    test::HttpTestResponse r = replies[i].get();
    ASSERT_EQ(r.status, 200) << r.body;
    json j = json::parse(r.body);
    EXPECT_EQ(j["choices"][0]["text"].get<std::string>(), alone[i]) << "prompt \"" << prompts[i] << "\"";
  }
  test::HttpTestClient c(port);
  test::HttpTestResponse m = c.Request("GET", "/metrics");
  ASSERT_EQ(m.status, 200);
  for (const char* name : {"keel_moe_copies_total{policy=\"psr\",cause=\"demand\"}", "keel_moe_hit_ratio{policy=\"psr\"}",
                           "keel_moe_stall_seconds_total{policy=\"psr\"}", "keel_moe_copy_bytes_total{policy=\"psr\"}",
                           "keel_moe_expert_hits_total{policy=\"psr\"}"}) {
    EXPECT_NE(m.body.find(std::string("\n") + name + " "), std::string::npos) << name << "\n" << m.body;
  }
  const std::string tokens_line = "\nkeel_moe_tokens_total{policy=\"psr\"} ";
  const size_t at = m.body.find(tokens_line);
  ASSERT_NE(at, std::string::npos);
  EXPECT_GT(std::stod(m.body.substr(at + tokens_line.size())), 3 * 40);
  server.Stop(true);
}

TEST(MoeServe, PsrRefusesAKvstoreLink) {
  engine::EngineOptions o = PsrEngine(1);
  o.kvstore.address = "127.0.0.1:1";
  auto e = engine::Engine::Open(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("kvstore"), std::string::npos) << e.status().ToString();
}

using test::CmdResult;

CmdResult Keel(const std::string& args) { return test::RunKeel(args); }

TEST(MoeCli, GenerateWithPsrIsDeterministicUnderInjectedCopyFaults) {
  auto run = [](int seed) {
    return Keel("generate -m " + MoeModel() + " -i 'A computer is' -t 0 -n 30 --log-level error --moe-slots 2 " +
                "--moe-policy psr --moe-bonus 4 --moe-copy-jitter-us 2000 --moe-copy-reorder --moe-copy-seed " +
                std::to_string(seed));
  };
  CmdResult a = run(1), b = run(2);
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(a.out, b.out);
  EXPECT_GT(a.out.size(), 20u);
}

TEST(MoeCli, ReportsExpertStatisticsAndRefusesBadOptions) {
  CmdResult ok = Keel("generate -m " + MoeModel() + " -i 'The ' -t 0 -n 8 --moe-slots 4 --moe-policy lru");
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("experts (lru, 4 slots/layer): hit ratio"), std::string::npos) << ok.out;
  CmdResult few = Keel("generate -m " + MoeModel() + " -i x -n 2 --moe-slots 1");
  EXPECT_EQ(few.code, 2) << few.out;
  EXPECT_NE(few.out.find("--moe-slots 1 must be between top_k 2"), std::string::npos) << few.out;
  CmdResult policy = Keel("generate -m " + MoeModel() + " -i x -n 2 --moe-slots 2 --moe-policy belady");
  EXPECT_EQ(policy.code, 2) << policy.out;
  EXPECT_NE(policy.out.find("unknown MoE policy \"belady\""), std::string::npos) << policy.out;
  CmdResult dense = Keel("generate -m " + test::ModelsDir() + "/en-dense6L.bin -z " + test::ModelsDir() + "/tok354.bin -i x -n 2 --moe-slots 2");
  EXPECT_EQ(dense.code, 2) << dense.out;
  EXPECT_NE(dense.out.find("dense"), std::string::npos) << dense.out;
  CmdResult help = Keel("serve --help");
  for (const char* flag : {"--moe-slots", "--moe-policy", "--moe-bonus", "--moe-lookahead", "--moe-decay", "--moe-source",
                           "--moe-link-gbps"}) {
    EXPECT_NE(help.out.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
}  // namespace keel::moe
