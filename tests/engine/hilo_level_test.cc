// The engine applies its HiLO level at run time (keel/engine/hilo_levels.h): max_new_tokens clamps,
// max_context cuts prompts from the front, kv_codec switches the KV cache (drain, then swap) with no
// request lost, an unknown codec keeps the old one, lossless levels stay on lossless codecs, and
// every generation request is metered. Real model (en-dense6L + tok354), real HTTP on loopback, a
// pinned ServiceLink. No wall-clock assertions: waits are bounded only to turn a hang into a failure.
#include "keel/engine/hilo_levels.h"

#include <gtest/gtest.h>

#include <atomic>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "keel/engine/engine.h"
#include "keel/kv/registry.h"
#include "keel/engine/openai_protocol.h"
#include "keel/engine/server.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/service_link.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;
using test::HttpTestClient;
using test::HttpTestResponse;

constexpr const char* kModel = "en";
constexpr const char* kPrompt = "Once upon a time";
// shared/data/README.md: the PyTorch float64 reference greedy continuation of kPrompt.
constexpr const char* kReference = " of the American Ander American and American and American";
// A prompt whose greedy continuations under raw (f32) and raw:bf16 (= zipfusion) part after ~150
// tokens, so an answer shows which codec computed it.
constexpr const char* kDivergent = "import numpy as";
constexpr int kDivergentTokens = 200;

template <typename Pred>
bool Eventually(Pred pred) {
  for (int i = 0; i < 6000; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

hilo::State MakeState(std::string name, std::string codec, bool lossless, int64_t max_context,
                      int64_t max_new_tokens) {
  hilo::State s;
  s.name = std::move(name);
  s.answer = {true, 4};
  s.vector = {8, 10, false, 1};
  s.engine = {std::move(codec), lossless, max_context, max_new_tokens};
  s.gateway = {"small", 256};
  return s;
}

// Unvalidated states are fine for a pinned link (only the controller needs figures).
hilo::Catalog TestCatalog() {
  hilo::Catalog c;
  c.states.push_back(MakeState("full", "raw", true, 1 << 20, 256));          // 0
  c.states.push_back(MakeState("zip", "zipfusion", true, 1024, 256));        // 1
  c.states.push_back(MakeState("short", "raw", true, 8, 5));                 // 2
  c.states.push_back(MakeState("odd", "raw:f8", true, 1024, 7));             // 3: a codec the engine lacks
  c.states.push_back(MakeState("kivi", "kivi", false, 1024, 256));           // 4: lossy
  c.safe_state = "short";
  c.max_quality_drop = 1;
  return c;
}

Result<std::unique_ptr<Engine>> OpenEngine(const std::string& codec, int max_queue = 64) {
  EngineOptions o;
  o.model_path = test::ModelsDir() + "/en-dense6L.bin";
  o.tokenizer_path = test::ModelsDir() + "/tok354.bin";
  o.kv_codec = codec;
  o.kv.budget_bytes = 16 << 20;
  o.scheduler.max_queue = max_queue;
  o.scheduler.max_running = 8;
  return Engine::Open(o);
}

// Greedy continuation of `prompt` by a fresh engine with `codec`: the reference a switched engine
// must reproduce token for token.
std::vector<int> Reference(const std::string& codec, const std::string& prompt, int max_tokens) {
  auto e = OpenEngine(codec);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return {};
  GenerationParams p;
  p.sampling.temperature = 0;
  p.max_tokens = max_tokens;
  std::vector<int> tokens;
  auto r = (*e)->Generate(prompt, p, {}, &tokens);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return tokens;
}

std::string Decode(const Tokenizer& tok, int prev, const std::vector<int>& tokens) {
  std::string s;
  for (int t : tokens) {
    s += tok.Decode(prev, t);
    prev = t;
  }
  return s;
}

class HiloLevelTest : public ::testing::Test {
 protected:
  void Open(const std::string& pin, int max_queue = 64, bool run_scheduler = true,
            std::function<int64_t()> clock = nullptr) {
    auto e = OpenEngine("raw", max_queue);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(*e);
    hilo::ServiceLinkOptions lo;
    lo.service = hilo::Service::kEngine;
    lo.workers = engine_->scheduler().options().max_running;
    lo.clock = std::move(clock);
    auto link = hilo::ServiceLink::Pinned(TestCatalog(), pin, lo);
    ASSERT_TRUE(link.ok()) << link.status().ToString();
    link_ = std::move(*link);
    HiloLevelOptions ho;
    ho.switch_drain = std::chrono::milliseconds(2000);
    auto levels = HiloLevels::Create(*link_, *engine_, ho);
    ASSERT_TRUE(levels.ok()) << levels.status().ToString();
    levels_ = std::move(*levels);
    ASSERT_TRUE(link_->Start().ok());
    ServerOptions so;
    so.port = 0;
    so.model_name = kModel;
    so.run_scheduler = run_scheduler;
    so.hilo = levels_.get();
    server_ = std::make_unique<Server>(engine_->scheduler(), engine_->tokenizer(), so);
    ASSERT_TRUE(server_->Start().ok());
    port_ = server_->port();
  }

  void TearDown() override {
    if (server_) server_->Stop(true);
    if (link_) link_->Stop();
    server_.reset();
    levels_.reset();
    link_.reset();
    engine_.reset();
  }

  HttpTestResponse Complete(const std::string& prompt, int max_tokens) {
    json body = {{"model", kModel}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
    HttpTestClient c(port_);
    return c.Request("POST", "/v1/completions", body.dump());
  }
  HttpTestResponse CompleteIds(const std::vector<int>& ids, int max_tokens) {
    json body = {{"model", kModel}, {"prompt", ids}, {"max_tokens", max_tokens}, {"temperature", 0}};
    HttpTestClient c(port_);
    return c.Request("POST", "/v1/completions", body.dump());
  }
  static json Body(const HttpTestResponse& r) { return json::parse(r.body, nullptr, false); }
  static std::string Text(const HttpTestResponse& r) {
    json j = Body(r);
    if (!j.is_object() || !j.contains("choices")) return "<no choices: " + r.body + ">";
    return j["choices"][0]["text"].get<std::string>();
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<hilo::ServiceLink> link_;
  std::unique_ptr<HiloLevels> levels_;
  std::unique_ptr<Server> server_;
  int port_ = 0;
};

TEST(HiloLevelUnit, CutPromptFrontKeepsBosAndTheNewestTokens) {
  std::vector<int> p = {Tokenizer::kBos, 10, 11, 12, 13, 14};
  EXPECT_EQ(CutPromptFront(&p, 3), 3);
  EXPECT_EQ(p, (std::vector<int>{Tokenizer::kBos, 13, 14}));
  std::vector<int> no_bos = {10, 11, 12, 13};
  EXPECT_EQ(CutPromptFront(&no_bos, 2), 2);
  EXPECT_EQ(no_bos, (std::vector<int>{12, 13}));
  std::vector<int> fits = {Tokenizer::kBos, 10};
  EXPECT_EQ(CutPromptFront(&fits, 2), 0);
  EXPECT_EQ(fits.size(), 2u);
  std::vector<int> one = {Tokenizer::kBos, 10, 11};
  EXPECT_EQ(CutPromptFront(&one, 1), 2);
  EXPECT_EQ(one, (std::vector<int>{Tokenizer::kBos}));
}

TEST(HiloLevelUnit, LosslessClassification) {
  EXPECT_EQ(kv::IsLosslessCodec("raw"), true);
  EXPECT_EQ(kv::IsLosslessCodec("raw:bf16"), true);
  EXPECT_EQ(kv::IsLosslessCodec("zipfusion:f16"), true);
  EXPECT_EQ(kv::IsLosslessCodec("bellows"), false);
  EXPECT_EQ(kv::IsLosslessCodec("kivi:4"), false);
  EXPECT_EQ(kv::IsLosslessCodec("minicache:q4"), false);
  EXPECT_EQ(kv::IsLosslessCodec("nosuchcodec"), std::nullopt);
  EXPECT_EQ(kv::CodecFamilyName("bellows"), "bellows");
  EXPECT_EQ(kv::CodecFamilyName("bellows:x"), "bellows");
  EXPECT_EQ(kv::CodecFamilyName("bellowsx"), "bellowsx");
  EXPECT_EQ(kv::CodecFamilyName(""), "");
}

TEST(HiloLevelUnit, RefusesLosslessLevelOnLossyCodecAndForeignLinks) {
  auto e = OpenEngine("raw");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  hilo::Catalog c = TestCatalog();
  c.states[1].engine.kv_codec = "bellows";  // lossless=true stays: a contradiction
  hilo::ServiceLinkOptions lo;
  lo.service = hilo::Service::kEngine;
  auto link = hilo::ServiceLink::Pinned(c, "full", lo);
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  auto levels = HiloLevels::Create(**link, **e);
  ASSERT_FALSE(levels.ok());
  EXPECT_EQ(levels.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(levels.status().message().find("'zip'"), std::string::npos) << levels.status().message();
  EXPECT_NE(levels.status().message().find("lossy"), std::string::npos) << levels.status().message();

  // A name no codec family has is the catalog's mistake, refused at start (not a fallback later).
  c = TestCatalog();
  c.states[3].engine.kv_codec = "nosuchcodec";
  auto misspelt_link = hilo::ServiceLink::Pinned(c, "full", lo);
  ASSERT_TRUE(misspelt_link.ok()) << misspelt_link.status().ToString();
  auto misspelt = HiloLevels::Create(**misspelt_link, **e);
  ASSERT_FALSE(misspelt.ok());
  EXPECT_NE(misspelt.status().message().find("'nosuchcodec' is not a KV codec"), std::string::npos)
      << misspelt.status().message();

  lo.service = hilo::Service::kVector;
  auto vlink = hilo::ServiceLink::Pinned(TestCatalog(), "full", lo);
  ASSERT_TRUE(vlink.ok());
  auto wrong = HiloLevels::Create(**vlink, **e);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("'vector'"), std::string::npos) << wrong.status().message();
}

TEST(HiloLevelUnit, OpenHiloLinkFlags) {
  HiloFlags f;
  auto none = OpenHiloLink(f, 8, nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
  f.state = "full";
  EXPECT_EQ(OpenHiloLink(f, 8, nullptr).status().code(), StatusCode::kInvalidArgument);
  test::TempDir dir;
  f.catalog = dir.file("catalog.json");
  {
    FILE* out = std::fopen(f.catalog.c_str(), "w");
    ASSERT_NE(out, nullptr);
    const std::string text = hilo::WriteCatalog(TestCatalog());
    std::fwrite(text.data(), 1, text.size(), out);
    std::fclose(out);
  }
  auto pinned = OpenHiloLink(f, 8, nullptr);
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  EXPECT_EQ((*pinned)->Current().name, "full");
  EXPECT_EQ((*pinned)->service(), hilo::Service::kEngine);
  f.url = "http://127.0.0.1:1";
  EXPECT_EQ(OpenHiloLink(f, 8, nullptr).status().code(), StatusCode::kInvalidArgument);
  f.url.clear();
  f.state.clear();
  EXPECT_EQ(OpenHiloLink(f, 8, nullptr).status().code(), StatusCode::kInvalidArgument);
}

// `keel serve` refuses bad HiLO flags and a contradictory catalog before it serves anything.
TEST(HiloLevelCli, ServeRefusesBadFlagsAndALosslessLevelOnALossyCodec) {
  const std::string model = " --model " + test::ModelsDir() + "/en-dense6L.bin --tokenizer " + test::ModelsDir() +
                            "/tok354.bin --port 0";
  test::CmdResult r = test::RunKeel("serve" + model + " --hilo-state full");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--hilo-state and --hilo-instance need --hilo URL or --hilo-catalog FILE"), std::string::npos)
      << r.out;

  test::TempDir dir;
  hilo::Catalog c = TestCatalog();
  c.states[4].engine.lossless = true;  // "kivi" is lossy
  const std::string path = dir.file("catalog.json");
  FILE* out = std::fopen(path.c_str(), "w");
  ASSERT_NE(out, nullptr);
  const std::string text = hilo::WriteCatalog(c);
  std::fwrite(text.data(), 1, text.size(), out);
  std::fclose(out);
  r = test::RunKeel("serve" + model + " --hilo-catalog " + path + " --hilo-state full");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("state 'kivi': engine.kv_codec 'kivi' is a lossy codec but engine.lossless is true"),
            std::string::npos)
      << r.out;
}

TEST_F(HiloLevelTest, MaxNewTokensClampsEveryRequest) {
  Open("short");  // max_new_tokens 5
  HttpTestResponse r = Complete(kPrompt, 50);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header("x-keel-hilo-state"), "short");
  json j = Body(r);
  EXPECT_LE(j["usage"]["completion_tokens"].get<int>(), 5);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");

  // Chat without max_tokens (its default is what the context leaves): the clamp applies too.
  json chat = {{"model", kModel}, {"messages", {{{"role", "user"}, {"content", "Hello"}}}}, {"temperature", 0}};
  HttpTestClient c(port_);
  r = c.Request("POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header("x-keel-hilo-state"), "short");
  EXPECT_LE(Body(r)["usage"]["completion_tokens"].get<int>(), 5);

  // Another state, another clamp: no restart.
  ASSERT_TRUE(link_->Pin("full").ok());
  r = Complete(kPrompt, 50);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header("x-keel-hilo-state"), "full");
  EXPECT_EQ(Body(r)["usage"]["completion_tokens"], 50);
  // Error answers name the state too.
  r = Complete("", 0);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.Header("x-keel-hilo-state"), "full");
}

// A degrade reaches a request already generating: it ends soon after the switch, with the
// prefix of what the old level would have answered, instead of finishing at the old level.
TEST_F(HiloLevelTest, DegradeClampsRequestsAlreadyRunning) {
  Open("full", 64, /*run_scheduler=*/false);
  Scheduler& s = engine_->scheduler();
  HttpTestResponse during;
  std::thread client([&] { during = Complete(kPrompt, 50); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (s.Stats().generated_tokens < 10 && std::chrono::steady_clock::now() < deadline) {
    if (!s.Step()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GE(s.Stats().generated_tokens, 10);
  ASSERT_TRUE(link_->Pin("short").ok());  // max_new_tokens 5: below what it has already
  levels_->Current();                     // applies it (the link's OnChange may have already)
  std::atomic<bool> stop{false};
  std::thread stepper([&] { s.Run(stop); });
  client.join();
  ASSERT_EQ(during.status, 200) << during.body;
  EXPECT_EQ(during.Header("x-keel-hilo-state"), "full");  // the state it arrived in
  json j = Body(during);
  const int got = j["usage"]["completion_tokens"].get<int>();
  EXPECT_GE(got, 10);
  EXPECT_LT(got, 20) << "the clamp should land within a step or two, not at the old limit of 50";
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");

  ASSERT_TRUE(link_->Pin("full").ok());
  HttpTestResponse whole = Complete(kPrompt, 50);
  stop = true;
  stepper.join();
  ASSERT_EQ(whole.status, 200) << whole.body;
  EXPECT_EQ(Body(whole)["usage"]["completion_tokens"], 50);  // a recovery clamps nothing below its level
  const std::string cut = Text(during);
  EXPECT_EQ(Text(whole).substr(0, cut.size()), cut);
}

TEST_F(HiloLevelTest, MaxContextCutsThePromptFromTheFront) {
  Open("short");  // max_context 8
  const Tokenizer& tok = engine_->tokenizer();
  const std::vector<int> full = tok.Encode(kPrompt, true);
  ASSERT_GT(full.size(), 8u);
  HttpTestResponse r = Complete(kPrompt, 5);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Body(r)["usage"]["prompt_tokens"], 8);
  EXPECT_EQ(r.Header("x-keel-prompt-tokens-cut"), std::to_string(full.size() - 8));
  // What was answered is exactly BOS + the last 7 tokens.
  std::vector<int> cut = {Tokenizer::kBos};
  cut.insert(cut.end(), full.end() - 7, full.end());
  ASSERT_TRUE(link_->Pin("full").ok());
  HttpTestResponse same = CompleteIds(cut, 5);
  ASSERT_EQ(same.status, 200) << same.body;
  EXPECT_EQ(same.Header("x-keel-prompt-tokens-cut"), "");
  EXPECT_EQ(Text(same), Text(r));

  // Never above the model's context: "full" allows 2^20, yet a 300-token prompt (the model has
  // 256) is cut to 255 and answered, where a server without HiLO answers 400.
  std::vector<int> longp(300, 259 + ('a' - 32));
  longp[0] = Tokenizer::kBos;
  r = CompleteIds(longp, 1);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Body(r)["usage"]["prompt_tokens"], engine_->model().config.max_seq_len - 1);
  EXPECT_EQ(r.Header("x-keel-prompt-tokens-cut"), std::to_string(300 - (engine_->model().config.max_seq_len - 1)));
}

TEST_F(HiloLevelTest, CodecSwitchMidRunGivesEachCodecsExactAnswer) {
  Open("full");
  const Tokenizer& tok = engine_->tokenizer();
  {
    const std::vector<int> readme = Reference("raw", kPrompt, 30);
    ASSERT_EQ(Decode(tok, tok.Encode(kPrompt, true).back(), readme), std::string(kReference).substr(0, 30));
  }
  const int n = kDivergentTokens;
  const std::vector<int> raw_ref = Reference("raw", kDivergent, n);
  const std::vector<int> bf16_ref = Reference("raw:bf16", kDivergent, n);  // zipfusion is exact over bf16
  EXPECT_NE(raw_ref, bf16_ref) << "kDivergent no longer tells the codecs apart; pick another prompt";
  const int last = tok.Encode(kDivergent, true).back();

  HttpTestResponse a = Complete(kDivergent, n);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(engine_->scheduler().codec_spec(), "raw:f32");
  EXPECT_EQ(Text(a), Decode(tok, last, raw_ref));

  ASSERT_TRUE(link_->Pin("zip").ok());
  HttpTestResponse b = Complete(kDivergent, n);
  ASSERT_EQ(b.status, 200) << b.body;
  EXPECT_EQ(b.Header("x-keel-hilo-state"), "zip");
  EXPECT_EQ(engine_->scheduler().codec_spec(), "zipfusion:bf16");
  EXPECT_EQ(Text(b), Decode(tok, last, bf16_ref));
  EXPECT_GE(engine_->scheduler().Stats().codec_switches, 1);

  ASSERT_TRUE(link_->Pin("full").ok());
  HttpTestResponse c = Complete(kDivergent, n);
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(engine_->scheduler().codec_spec(), "raw:f32");
  EXPECT_EQ(Text(c), Text(a));
  const SchedulerStats st = engine_->scheduler().Stats();
  std::cout << "[ switch   ] idle codec switch: drain " << st.last_switch_drain_s * 1e3 << " ms, new cache "
            << st.last_switch_build_s * 1e3 << " ms (16 MiB budget)\n";
}

TEST_F(HiloLevelTest, NoRequestLostWhileSwitching) {
  Open("full");
  constexpr int kClients = 8;
  constexpr int kTokens = 30;
  std::vector<HttpTestResponse> out(kClients);
  std::atomic<bool> done{false};
  std::thread switcher([&] {
    for (int i = 0; i < 8 && !done.load(); ++i) {
      // Applied by the link's report thread (OnChange) or by the next request, whichever is first.
      EXPECT_TRUE(link_->Pin(i % 2 == 0 ? "zip" : "full").ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    }
  });
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      for (int k = 0; k < 2; ++k) {
        out[i] = Complete(std::string(kPrompt) + " " + std::to_string(i * 2 + k), kTokens);
        if (out[i].status != 200) return;
      }
    });
  }
  for (auto& t : clients) t.join();
  done = true;
  switcher.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(out[i].status, 200) << i << ": " << out[i].body;
    json j = Body(out[i]);
    EXPECT_EQ(j["usage"]["completion_tokens"], kTokens) << out[i].body;
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  }
  const SchedulerStats st = engine_->scheduler().Stats();
  EXPECT_EQ(st.requests_finished, 2 * kClients);
  std::cout << "[ switch   ] " << st.codec_switches << " switches under load; last: drain "
            << st.last_switch_drain_s * 1e3 << " ms, new cache " << st.last_switch_build_s * 1e3 << " ms, "
            << st.last_switch_preempted << " preempted\n";
}

// The scheduler's switch, stepped by hand so each phase is observable: running sequences finish on
// the old codec (exact raw answers), requests queued meanwhile wait and then run entirely on the
// new one (exact bf16 answers); with no drain time, running sequences are preempted and still finish.
TEST(HiloSchedulerSwitch, DrainThenSwapThenPreempt) {
  auto e = OpenEngine("raw");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Scheduler& s = (*e)->scheduler();
  const Tokenizer& tok = (*e)->tokenizer();
  struct Out {
    std::vector<int> tokens;
    FinishReason reason = FinishReason::kNone;
    std::string admitted_on;
  };
  auto submit = [&](Out* o, const char* prompt, int max_tokens) {
    auto r = std::make_shared<Request>();
    r->prompt = tok.Encode(prompt, true);
    r->params.sampling.temperature = 0;
    r->params.max_tokens = max_tokens;
    r->on_event = [o](const GenerationEvent& ev) {
      o->tokens.insert(o->tokens.end(), ev.tokens.begin(), ev.tokens.end());
      if (ev.finished) o->reason = ev.finish_reason;
    };
    r->on_admitted = [o, &s] { o->admitted_on = s.codec_spec(); };
    ASSERT_TRUE(s.Submit(r).ok());
  };
  const std::vector<int> raw_ref = Reference("raw", kDivergent, kDivergentTokens);
  const std::vector<int> bf16_ref = Reference("raw:bf16", kDivergent, kDivergentTokens);
  EXPECT_NE(raw_ref, bf16_ref) << "kDivergent no longer tells the codecs apart; pick another prompt";

  std::vector<Out> first(3), second(3);
  for (auto& o : first) submit(&o, kDivergent, kDivergentTokens);
  for (int i = 0; i < 3; ++i) s.Step();  // running, mid-generation
  ASSERT_TRUE(s.RequestCodec("zipfusion:bf16", std::chrono::milliseconds(600000)).ok());
  for (auto& o : second) submit(&o, kDivergent, kDivergentTokens);  // arrive while draining: wait, not fail
  s.RunUntilIdle();
  for (const Out& o : first) {
    EXPECT_EQ(o.reason, FinishReason::kLength);
    EXPECT_EQ(o.admitted_on, "raw:f32");
    EXPECT_EQ(o.tokens, raw_ref);
  }
  for (const Out& o : second) {
    EXPECT_EQ(o.reason, FinishReason::kLength);
    EXPECT_EQ(o.admitted_on, "zipfusion:bf16");
    EXPECT_EQ(o.tokens, bf16_ref);
  }
  SchedulerStats st = s.Stats();
  EXPECT_EQ(st.codec_switches, 1);
  EXPECT_EQ(st.last_switch_preempted, 0);
  EXPECT_EQ(s.codec_spec(), "zipfusion:bf16");
  EXPECT_EQ((*e)->cache().codec().spec(), "zipfusion:bf16");
  std::cout << "[ switch   ] drained 3 running sequences in " << st.last_switch_drain_s * 1e3
            << " ms (stepped by hand), new cache in " << st.last_switch_build_s * 1e3 << " ms\n";

  // No drain time: the running sequences are preempted, recompute in the new cache, and finish.
  constexpr int kTokens = 24;
  std::vector<Out> third(3);
  for (auto& o : third) submit(&o, kPrompt, kTokens);
  for (int i = 0; i < 3; ++i) s.Step();
  ASSERT_TRUE(s.RequestCodec("raw", std::chrono::milliseconds(0)).ok());
  s.RunUntilIdle();
  for (const Out& o : third) {
    EXPECT_EQ(o.reason, FinishReason::kLength);
    EXPECT_EQ(o.tokens.size(), static_cast<size_t>(kTokens));
  }
  st = s.Stats();
  EXPECT_EQ(st.codec_switches, 2);
  EXPECT_EQ(st.last_switch_preempted, 3);
  EXPECT_EQ(s.codec_spec(), "raw:f32");
  EXPECT_EQ(st.kv.blocks_used, 0);

  // A codec the engine cannot build: logged, the current cache kept.
  ASSERT_TRUE(s.RequestCodec("nosuchcodec", std::chrono::milliseconds(0)).ok());
  s.Step();
  EXPECT_EQ(s.codec_spec(), "raw:f32");
  EXPECT_EQ(s.Stats().codec_switches, 2);
}

TEST_F(HiloLevelTest, UnknownCodecKeepsTheCurrentOneButAppliesTheOtherKnobs) {
  Open("zip");
  EXPECT_EQ(levels_->codec_for(3), "");
  HttpTestResponse r = Complete(kPrompt, 20);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(engine_->scheduler().codec_spec(), "zipfusion:bf16");

  ASSERT_TRUE(link_->Pin("odd").ok());  // "raw:f8", max_new_tokens 7
  r = Complete(kPrompt, 20);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header("x-keel-hilo-state"), "odd");
  EXPECT_EQ(Body(r)["usage"]["completion_tokens"], 7);
  EXPECT_EQ(engine_->scheduler().codec_spec(), "zipfusion:bf16");

  // From a lossy codec, a lossless state whose codec is missing falls back to raw.
  ASSERT_TRUE(link_->Pin("kivi").ok());
  r = Complete(kPrompt, 20);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(engine_->scheduler().codec_spec().rfind("kivi", 0), 0u) << engine_->scheduler().codec_spec();
  ASSERT_TRUE(link_->Pin("odd").ok());
  r = Complete(kPrompt, 20);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(engine_->scheduler().codec_spec(), "raw:f32");
}

TEST_F(HiloLevelTest, MeterCountsArrivalsShedsAndFinishes) {
  std::atomic<int64_t> now_ms{1'000'000};
  Open("full", /*max_queue=*/2, /*run_scheduler=*/false, [&now_ms] { return now_ms.load(); });
  hilo::LoadMeter& meter = levels_->meter();
  meter.SetRateWindow(0);  // rates per report window: this test counts each window's arrivals
  // The engine's probe reports the scheduler's queue; without it the meter's own count shows
  // whether every arrival left the queue again (Shed or Started).
  meter.SetQueueDepthProbe(nullptr);
  std::vector<HttpTestResponse> out(4);  // each written by its client; read here after the joins
  std::atomic<int> refused{0};           // what this thread may read while the clients still run
  std::vector<std::thread> clients;
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back([&, i] {
      out[i] = Complete(kPrompt, 5);
      if (out[i].status == 429) ++refused;
    });
  }
  // Two wait in the queue (nobody steps the scheduler), two are refused with 429.
  ASSERT_TRUE(Eventually([&] { return refused.load() == 2 && engine_->scheduler().QueueDepth() == 2; }));
  now_ms += 1000;
  hilo::LoadReport r1 = meter.Take(now_ms.load());
  EXPECT_DOUBLE_EQ(r1.arrival_rate, 4.0);  // sheds count as arrivals
  EXPECT_EQ(r1.queue_depth, 2);            // 4 arrived, 2 shed
  EXPECT_EQ(r1.in_flight, 0);

  std::atomic<bool> stop{false};
  std::thread stepper([&] { engine_->scheduler().Run(stop); });
  for (auto& t : clients) t.join();
  int ok = 0;
  for (const auto& r : out) ok += r.status == 200;
  EXPECT_EQ(ok, 2);
  // A response is sent before the scheduler retires its sequence: wait for that, so "nothing
  // running now" below is what the probe reads, not a race with the stepper.
  ASSERT_TRUE(Eventually([&] { return engine_->scheduler().Stats().running == 0; }));
  now_ms += 1000;
  hilo::LoadReport r2 = meter.Take(now_ms.load());
  EXPECT_DOUBLE_EQ(r2.arrival_rate, 0.0);
  EXPECT_EQ(r2.queue_depth, 0);
  EXPECT_EQ(r2.in_flight, 0);
  EXPECT_GT(r2.p99_ms, 0.0);  // the two served requests' latencies
  EXPECT_DOUBLE_EQ(r2.utilisation, 0.0);  // the probe: nothing running now
  server_->Stop(false);
  stop = true;
  stepper.join();
}

}  // namespace
}  // namespace keel::engine
