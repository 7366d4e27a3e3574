// End-to-end tests of the OpenAI-compatible server: real HTTP on 127.0.0.1, the real aidreams
// model, the real scheduler. No wall-clock assertions: waits are bounded only to turn a hang
// into a failure.
#include "keel/engine/server.h"
#include "keel/engine/openai_protocol.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/scheduler.h"
#include "keel/engine/tokenizer.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;
using test::HttpTestClient;
using test::HttpTestResponse;

// The reference text of greedy generation from BOS (shared/data/README.md); it opens with a quote.
constexpr const char* kGolden = "\"Echoes of vectors unfold";
constexpr const char* kModel = "aidreams";

// Polls `pred` until it holds (bounded at ~60 s so a bug fails instead of hanging).
template <typename Pred>
bool Eventually(Pred pred) {
  for (int i = 0; i < 6000; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

struct SseResult {
  std::vector<json> events;  // parsed data: payloads except [DONE]
  bool done = false;         // the last frame was data: [DONE]
  bool well_formed = true;   // every frame was "data: <json>\n\n"
};

SseResult ParseSse(const std::string& body) {
  SseResult out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) {
      out.well_formed = false;
      break;
    }
    std::string frame = body.substr(pos, end - pos);
    pos = end + 2;
    if (frame.rfind("data: ", 0) != 0 || out.done) {
      out.well_formed = false;
      continue;
    }
    std::string data = frame.substr(6);
    if (data == "[DONE]") {
      out.done = true;
      continue;
    }
    json j = json::parse(data, nullptr, false);
    if (j.is_discarded()) {
      out.well_formed = false;
      continue;
    }
    out.events.push_back(std::move(j));
  }
  return out;
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto model = LoadLlama2c(test::ModelsDir() + "/aidreams260K.bin");
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = new Model(std::move(*model));
    auto tok = Tokenizer::Load(test::ModelsDir() + "/aidreams_tok512.bin", model_->config.vocab_size);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tokenizer_ = new Tokenizer(std::move(*tok));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete model_;
    tokenizer_ = nullptr;
    model_ = nullptr;
  }

  void Start(SchedulerOptions sched = {}, ServerOptions opts = {}, const std::string& kv_codec = "raw") {
    ASSERT_NE(model_, nullptr);
    auto cache = KvCache::Create(*model_, kv_codec, {});
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    cache_ = std::move(*cache);
    metrics_ = MakeEngineMetrics();
    scheduler_ = std::make_unique<Scheduler>(*model_, *tokenizer_, *cache_, sched, ObserverFor(metrics_));
    opts.port = 0;
    opts.model_name = kModel;
    server_ = std::make_unique<Server>(*scheduler_, *tokenizer_, opts, metrics_);
    Status st = server_->Start();
    ASSERT_TRUE(st.ok()) << st.ToString();
    port_ = server_->port();
    ASSERT_GT(port_, 0);
  }

  void TearDown() override {
    if (server_) server_->Stop(true);
    server_.reset();
    scheduler_.reset();
    cache_.reset();
  }

  HttpTestResponse Post(const std::string& path, const std::string& body) {
    HttpTestClient c(port_);
    return c.Request("POST", path, body);
  }
  HttpTestResponse Get(const std::string& path) {
    HttpTestClient c(port_);
    return c.Request("GET", path);
  }
  // Asserts an OpenAI error body and returns it.
  static json ErrorBody(const HttpTestResponse& r) {
    json j = json::parse(r.body, nullptr, false);
    EXPECT_TRUE(j.is_object() && j.contains("error")) << r.body;
    if (!j.is_object() || !j.contains("error")) return json::object();
    const json& e = j["error"];
    EXPECT_TRUE(e["message"].is_string()) << r.body;
    EXPECT_TRUE(e["type"].is_string()) << r.body;
    EXPECT_TRUE(e.contains("param")) << r.body;
    EXPECT_TRUE(e.contains("code")) << r.body;
    EXPECT_EQ(r.Header("Content-Type"), "application/json");
    return e;
  }
  // Concatenated text deltas of a completion or chat stream.
  static std::string StreamText(const SseResult& s, bool chat) {
    std::string text;
    for (const json& e : s.events) {
      if (!e.contains("choices") || e["choices"].empty()) continue;
      const json& c = e["choices"][0];
      if (chat) {
        if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
      } else {
        text += c["text"].get<std::string>();
      }
    }
    return text;
  }
  void ExpectStillServing() {
    HttpTestResponse r = Get("/healthz");
    EXPECT_EQ(r.status, 200);
  }
  double MetricValue(const std::string& line_prefix) {
    std::string text = Get("/metrics").body;
    size_t at = text.find("\n" + line_prefix + " ");
    if (at == std::string::npos) return -1;
    return std::stod(text.substr(at + 1 + line_prefix.size() + 1));
  }

  static Model* model_;
  static Tokenizer* tokenizer_;
  std::unique_ptr<KvCache> cache_;
  std::shared_ptr<EngineMetrics> metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Server> server_;
  int port_ = 0;
};

Model* ServerTest::model_ = nullptr;
Tokenizer* ServerTest::tokenizer_ = nullptr;

TEST_F(ServerTest, HealthzAndModels) {
  Start();
  HttpTestResponse r = Get("/healthz");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(json::parse(r.body), json({{"status", "ok"}}));
  r = Get("/v1/models");
  ASSERT_EQ(r.status, 200);
  json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], kModel);
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["owned_by"], "keel");
  EXPECT_TRUE(j["data"][0]["created"].is_number_integer());
  // GET /v1/models/{id}: the model object for the served id, OpenAI's 404 for any other.
  r = Get(std::string("/v1/models/") + kModel);
  ASSERT_EQ(r.status, 200) << r.body;
  json one = json::parse(r.body);
  EXPECT_EQ(one["id"], kModel);
  EXPECT_EQ(one["object"], "model");
  EXPECT_EQ(one["created"], j["data"][0]["created"]);
  r = Get("/v1/models/gpt-4o");
  ASSERT_EQ(r.status, 404);
  json missing = json::parse(r.body);
  EXPECT_EQ(missing["error"]["code"], "model_not_found");
  EXPECT_NE(missing["error"]["message"].get<std::string>().find("gpt-4o"), std::string::npos);
  // Only GET and HEAD read a model; the route tells which.
  r = Post(std::string("/v1/models/") + kModel, "{}");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.Header("Allow"), "GET, HEAD");
  EXPECT_TRUE(json::parse(r.body)["error"].is_object()) << r.body;
}

TEST_F(ServerTest, GreedyCompletionMatchesGolden) {
  Start();
  HttpTestResponse r = Post("/v1/completions",
                            R"({"model":"aidreams","prompt":"","max_tokens":20,"temperature":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], kModel);
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_TRUE(j["created"].is_number_integer());
  ASSERT_EQ(j["choices"].size(), 1u);
  const json& c = j["choices"][0];
  EXPECT_EQ(c["index"], 0);
  EXPECT_TRUE(c["logprobs"].is_null());
  EXPECT_EQ(c["finish_reason"], "length");
  std::string text = c["text"];
  EXPECT_EQ(text.rfind(kGolden, 0), 0u) << text;
  EXPECT_EQ(j["usage"]["prompt_tokens"], 1);  // BOS
  EXPECT_EQ(j["usage"]["completion_tokens"], 20);
  EXPECT_EQ(j["usage"]["total_tokens"], 21);

  // The same prompt given as token ids, and as an array of one string, gives the same text.
  r = Post("/v1/completions", R"({"model":"aidreams","prompt":[1],"max_tokens":20,"temperature":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"][0]["text"], text);
  r = Post("/v1/completions", R"({"model":"aidreams","prompt":[""],"max_tokens":20,"temperature":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"][0]["text"], text);
}

TEST_F(ServerTest, DefaultMaxTokensIs16) {
  Start();
  HttpTestResponse r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","temperature":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["usage"]["completion_tokens"], 16);
}

TEST_F(ServerTest, StopSequenceEndsWithStop) {
  Start();
  HttpTestResponse r = Post("/v1/completions",
                            R"({"model":"aidreams","prompt":"","max_tokens":40,"temperature":0,"stop":[","]})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["choices"][0]["text"], kGolden);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerTest, StreamedCompletionEqualsNonStreamed) {
  Start();
  const std::string req = R"({"model":"aidreams","prompt":"","max_tokens":30,"temperature":0)";
  HttpTestResponse plain = Post("/v1/completions", req + "}");
  ASSERT_EQ(plain.status, 200) << plain.body;
  const std::string want = json::parse(plain.body)["choices"][0]["text"];

  HttpTestResponse r = Post("/v1/completions", req + R"(,"stream":true})");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.Header("Content-Type"), "text/event-stream");
  EXPECT_TRUE(r.chunked);
  SseResult s = ParseSse(r.body);
  EXPECT_TRUE(s.well_formed) << r.body;
  EXPECT_TRUE(s.done) << r.body;
  ASSERT_GE(s.events.size(), 2u);
  for (size_t i = 0; i < s.events.size(); ++i) {
    const json& e = s.events[i];
    EXPECT_EQ(e["object"], "text_completion");
    EXPECT_EQ(e["model"], kModel);
    EXPECT_EQ(e["id"], s.events[0]["id"]);
    const json& fr = e["choices"][0]["finish_reason"];
    if (i + 1 < s.events.size()) {
      EXPECT_TRUE(fr.is_null()) << e.dump();
    } else {
      EXPECT_EQ(fr, "length");
    }
  }
  EXPECT_EQ(StreamText(s, false), want);
  // The body ends with the [DONE] sentinel.
  EXPECT_EQ(r.body.substr(r.body.size() - 14), "data: [DONE]\n\n");
}

TEST_F(ServerTest, StreamIncludeUsage) {
  Start();
  HttpTestResponse r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":5,"temperature":0,
      "stream":true,"stream_options":{"include_usage":true}})");
  ASSERT_EQ(r.status, 200);
  SseResult s = ParseSse(r.body);
  ASSERT_TRUE(s.done);
  ASSERT_FALSE(s.events.empty());
  const json& last = s.events.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"]["completion_tokens"], 5);
  EXPECT_EQ(last["usage"]["total_tokens"], 6);
}

// Completions with logprobs: per token the sampled token's log-probability, a dictionary of
// the alternatives (plus the sampled token), and byte offsets into the text.
TEST_F(ServerTest, CompletionLogprobs) {
  Start();
  HttpTestResponse r = Post("/v1/completions",
                            R"({"model":"aidreams","prompt":"","max_tokens":20,"temperature":0,"logprobs":3})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  const json& c = j["choices"][0];
  const std::string text = c["text"];
  EXPECT_EQ(text.rfind(kGolden, 0), 0u) << text;  // logprobs change nothing about the text
  const json& lp = c["logprobs"];
  ASSERT_TRUE(lp.is_object()) << r.body;
  ASSERT_EQ(lp["tokens"].size(), 20u);
  ASSERT_EQ(lp["token_logprobs"].size(), 20u);
  ASSERT_EQ(lp["top_logprobs"].size(), 20u);
  ASSERT_EQ(lp["text_offset"].size(), 20u);
  std::string joined;
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(lp["text_offset"][i].get<size_t>(), joined.size()) << i;
    const std::string tok = lp["tokens"][i];
    joined += tok;
    const double v = lp["token_logprobs"][i];
    EXPECT_LE(v, 0.0);
    const json& top = lp["top_logprobs"][i];
    // Greedy: the sampled token is the most likely one, so it is among the 3 alternatives.
    EXPECT_EQ(top.size(), 3u) << top.dump();
    ASSERT_TRUE(top.contains(tok)) << top.dump();
    EXPECT_EQ(top[tok].get<double>(), v);
    double mass = 0;
    for (auto& [k, x] : top.items()) {
      EXPECT_LE(x.get<double>(), v) << k;
      mass += std::exp(x.get<double>());
    }
    EXPECT_LE(mass, 1.0 + 1e-6);
  }
  EXPECT_EQ(joined, text);

  // Streamed: the same entries, split over the chunks, offsets continuing.
  r = Post("/v1/completions",
           R"({"model":"aidreams","prompt":"","max_tokens":20,"temperature":0,"logprobs":3,"stream":true})");
  ASSERT_EQ(r.status, 200);
  SseResult s = ParseSse(r.body);
  ASSERT_TRUE(s.well_formed && s.done);
  json streamed = {{"tokens", json::array()}, {"token_logprobs", json::array()},
                   {"top_logprobs", json::array()}, {"text_offset", json::array()}};
  for (const json& e : s.events) {
    const json& l = e["choices"][0]["logprobs"];
    if (l.is_null()) continue;
    for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
      for (const json& x : l[key]) streamed[key].push_back(x);
    }
  }
  EXPECT_EQ(streamed, lp);
}

// Chat with logprobs and top_logprobs, sampled: streamed entries equal the non-streamed ones.
TEST_F(ServerTest, ChatLogprobsStreamedEqualNonStreamed) {
  Start();
  const std::string req =
      R"({"model":"aidreams","messages":[{"role":"user","content":"Echoes"}],"max_tokens":30,)"
      R"("temperature":0.9,"seed":11,"logprobs":true,"top_logprobs":2)";
  HttpTestResponse r = Post("/v1/chat/completions", req + "}");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), j["usage"]["completion_tokens"].get<size_t>() -
                                (j["choices"][0]["finish_reason"] == "stop" ? 1 : 0));
  std::string joined;
  for (const json& e : content) {
    std::string bytes;
    for (const json& b : e["bytes"]) bytes.push_back(static_cast<char>(b.get<int>()));
    joined += bytes;
    ASSERT_EQ(e["top_logprobs"].size(), 2u);
    EXPECT_GE(e["top_logprobs"][0]["logprob"].get<double>(), e["top_logprobs"][1]["logprob"].get<double>());
    EXPECT_GE(e["top_logprobs"][0]["logprob"].get<double>(), e["logprob"].get<double>());
  }
  EXPECT_EQ(joined, j["choices"][0]["message"]["content"].get<std::string>());

  r = Post("/v1/chat/completions", req + R"(,"stream":true})");
  ASSERT_EQ(r.status, 200);
  SseResult s = ParseSse(r.body);
  ASSERT_TRUE(s.well_formed && s.done);
  json streamed = json::array();
  for (const json& e : s.events) {
    const json& l = e["choices"][0]["logprobs"];
    if (l.is_null()) continue;
    for (const json& x : l["content"]) streamed.push_back(x);
  }
  EXPECT_EQ(streamed, content);
}

// `keel serve --kv-codec zipfusion` answers like `--kv-codec raw:bf16` (and zipfusion:f16 like
// raw:f16): the same text and the same log-probabilities bit for bit, for concurrent (batched)
// sampled requests.
TEST_F(ServerTest, ZipFusionServesWhatRawServes) {
  constexpr int kClients = 6;
  auto run = [&](const std::string& codec, double* blocks_compacted) {
    Start({}, {}, codec);
    std::vector<HttpTestResponse> out(kClients);
    std::vector<std::thread> threads;
    for (int i = 0; i < kClients; ++i) {
      threads.emplace_back([&, i] {
        out[i] = Post("/v1/completions",
                      R"({"model":"aidreams","prompt":"Echoes of vectors )" + std::to_string(i) +
                          R"(","max_tokens":90,"temperature":0.8,"seed":)" + std::to_string(i) +
                          R"(,"logprobs":5})");
      });
    }
    for (auto& t : threads) t.join();
    if (blocks_compacted) *blocks_compacted = MetricValue("keel_kv_blocks_compacted");
    TearDown();
    return out;
  };
  for (const auto& [raw_spec, zf_spec] : {std::pair{"raw:bf16", "zipfusion"}, std::pair{"raw:f16", "zipfusion:f16"}}) {
    SCOPED_TRACE(zf_spec);
    double compacted = -1;
    std::vector<HttpTestResponse> raw = run(raw_spec, nullptr), zf = run(zf_spec, &compacted);
    // Full blocks were sealed, i.e. encoded and compacted: attention read ZipFusion blocks.
    EXPECT_GT(compacted, 0);
    int total_tokens = 0;
    for (int i = 0; i < kClients; ++i) {
      ASSERT_EQ(raw[i].status, 200) << raw[i].body;
      ASSERT_EQ(zf[i].status, 200) << zf[i].body;
      json a = json::parse(raw[i].body), b = json::parse(zf[i].body);
      total_tokens += a["usage"]["completion_tokens"].get<int>();
      // Numbers were printed with enough digits to round-trip: equal JSON is equal floats.
      EXPECT_EQ(a["choices"], b["choices"]) << i;
      EXPECT_EQ(a["usage"], b["usage"]) << i;
    }
    EXPECT_GT(total_tokens, kClients * 32);  // most requests run to 90 tokens (seeded: fixed)
  }
}

TEST_F(ServerTest, ChatCompletionNonStreamAndStream) {
  Start();
  const std::string req =
      R"({"model":"aidreams","messages":[{"role":"system","content":"You dream."},)"
      R"({"role":"user","content":"Echoes"}],"max_tokens":12,"temperature":0)";
  HttpTestResponse plain = Post("/v1/chat/completions", req + "}");
  ASSERT_EQ(plain.status, 200) << plain.body;
  json j = json::parse(plain.body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(j["choices"][0]["message"]["refusal"].is_null()) << j.dump();
  EXPECT_EQ(j["choices"][0]["message"]["annotations"], json::array());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  const std::string want = j["choices"][0]["message"]["content"];
  // The documented template: contents joined by "\n", encoded with BOS.
  EXPECT_EQ(j["usage"]["prompt_tokens"], tokenizer_->Encode("You dream.\nEchoes", true).size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);

  HttpTestResponse r = Post("/v1/chat/completions", req + R"(,"stream":true})");
  ASSERT_EQ(r.status, 200);
  SseResult s = ParseSse(r.body);
  EXPECT_TRUE(s.well_formed) << r.body;
  EXPECT_TRUE(s.done);
  ASSERT_GE(s.events.size(), 2u);
  for (const json& e : s.events) EXPECT_EQ(e["object"], "chat.completion.chunk");
  EXPECT_EQ(s.events.front()["choices"][0]["delta"]["role"], "assistant");
  const json& last = s.events.back()["choices"][0];
  EXPECT_EQ(last["finish_reason"], "length");
  EXPECT_FALSE(last["delta"].contains("content"));
  EXPECT_EQ(StreamText(s, true), want);
}

TEST_F(ServerTest, ChatDefaultMaxTokensFillsTheContext) {
  Start();
  HttpTestResponse r = Post("/v1/chat/completions",
                            R"({"model":"aidreams","messages":[{"role":"user","content":""}],"temperature":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  int prompt = j["usage"]["prompt_tokens"], completion = j["usage"]["completion_tokens"];
  // Either the model stopped on its own or it used the whole context.
  if (j["choices"][0]["finish_reason"] == "length") {
    EXPECT_EQ(prompt + completion, model_->config.max_seq_len);
  } else {
    EXPECT_LE(prompt + completion, model_->config.max_seq_len);
  }
}

// What OpenAI SDK users send and OpenAI honours: logit_bias and the penalties change the text
// (they used to be accepted and ignored), top_p 0 is greedy, tools with tool_choice "none" and a
// replayed refusal are accepted.
TEST_F(ServerTest, SamplingControlsOpenAiHonoursAreHonoured) {
  Start();
  auto text = [&](const std::string& extra) {
    HttpTestResponse r = Post("/v1/chat/completions",
                              R"({"model":"aidreams","messages":[{"role":"user","content":"Once upon a time"}],)"
                              R"("max_tokens":24,"temperature":0)" + extra + "}");
    EXPECT_EQ(r.status, 200) << extra << " -> " << r.body;
    return json::parse(r.body)["choices"][0]["message"]["content"].get<std::string>();
  };
  const std::string plain = text("");
  ASSERT_FALSE(plain.empty());
  EXPECT_NE(text(R"(,"presence_penalty":2)"), plain);
  EXPECT_NE(text(R"(,"frequency_penalty":2)"), plain);
  EXPECT_EQ(text(R"(,"presence_penalty":0,"frequency_penalty":0)"), plain);
  // Ban the greedy first token: the answer must start differently.
  HttpTestResponse first = Post("/v1/completions", R"({"model":"aidreams","prompt":"Once upon a time","max_tokens":1,"temperature":0,"logprobs":0})");
  ASSERT_EQ(first.status, 200) << first.body;
  const json lp = json::parse(first.body)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 1u);
  std::vector<int> ids = tokenizer_->Encode("Once upon a time", true);
  // Every id whose piece is that text (the greedy one among them), found by decoding each id.
  std::string bias;
  for (int id = 0; id < model_->config.vocab_size; ++id) {
    if (tokenizer_->Decode(ids.back(), id) != lp["tokens"][0].get<std::string>()) continue;
    bias += (bias.empty() ? "" : ",") + std::string("\"") + std::to_string(id) + "\":-100";
  }
  ASSERT_FALSE(bias.empty());
  const std::string banned = text(R"(,"logit_bias":{)" + bias + "}");
  EXPECT_NE(banned.substr(0, 4), plain.substr(0, 4)) << banned << " vs " << plain;
  EXPECT_EQ(text(R"(,"temperature":1,"top_p":0,"seed":3)"), plain);
  EXPECT_EQ(text(R"(,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"tool_choice":"none")"),
            plain);
  HttpTestResponse refusal = Post("/v1/chat/completions",
                                  R"({"model":"aidreams","max_tokens":4,"messages":[{"role":"user","content":"x"},)"
                                  R"({"role":"assistant","content":[{"type":"refusal","refusal":"no"}]},)"
                                  R"({"role":"user","content":"y"}]})");
  EXPECT_EQ(refusal.status, 200) << refusal.body;
}

TEST_F(ServerTest, BadRequestsGetOpenAiErrorsAndTheServerKeepsServing) {
  Start();
  struct Case {
    std::string path, body;
    int status;
    std::string param;  // "" = null
  };
  const std::string long_prompt = [] {
    std::string s;
    for (int i = 0; i < 200; ++i) s += "vectors unfold ";
    return s;
  }();
  const std::vector<Case> cases = {
      {"/v1/completions", "{not json", 400, ""},
      {"/v1/completions", "[1,2]", 400, ""},
      {"/v1/completions", std::string(100, '[') + std::string(100, ']'), 400, ""},
      {"/v1/completions", R"({"prompt":""})", 400, "model"},
      {"/v1/completions", R"({"model":7,"prompt":""})", 400, "model"},
      {"/v1/completions", R"({"model":"aidreams"})", 400, "prompt"},
      {"/v1/completions", R"({"model":"aidreams","prompt":5})", 400, "prompt"},
      {"/v1/completions", R"({"model":"aidreams","prompt":["a",7]})", 400, "prompt"},
      {"/v1/completions", R"({"model":"aidreams","prompt":[1,99999]})", 400, "prompt"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":-1})", 400, "max_tokens"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":0})", 400, "max_tokens"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":"5"})", 400, "max_tokens"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":1.5})", 400, "max_tokens"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":100000000000})", 400, "max_tokens"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":18446744073709551615})", 400, "max_tokens"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":128})", 400, "max_tokens"},
      {"/v1/completions", R"({"model":"aidreams","prompt":")" + long_prompt + R"("})", 400, "prompt"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","temperature":"hot"})", 400, "temperature"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","temperature":2.5})", 400, "temperature"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","top_p":-0.1})", 400, "top_p"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","presence_penalty":2.5})", 400, "presence_penalty"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","logit_bias":{"9999":5}})", 400, "logit_bias"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","logit_bias":{"5":101}})", 400, "logit_bias"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}})",
       400, "response_format.type"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","response_format":{"type":"json_object"}})", 400,
       "response_format.type"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]})",
       400, "tools"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","top_k":-1})", 400, "top_k"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","seed":"x"})", 400, "seed"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","stop":[1]})", 400, "stop"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","stop":["a","b","c","d","e"]})", 400, "stop"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","stream":"yes"})", 400, "stream"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","n":200})", 400, "n"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","best_of":2})", 400, "best_of"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","logprobs":21})", 400, "logprobs"},
      {"/v1/completions", R"({"model":"aidreams","prompt":"","logprobs":true})", 400, "logprobs"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[{"role":"user","content":"x"}],"top_logprobs":2})",
       400, "top_logprobs"},
      {"/v1/chat/completions", R"({"model":"aidreams"})", 400, "messages"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[]})", 400, "messages"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":["hi"]})", 400, "messages[0]"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[{"role":"user"}]})", 400, "messages[0].content"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[{"role":"user","content":5}]})", 400,
       "messages[0].content"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[{"role":"wizard","content":"x"}]})", 400,
       "messages[0].role"},
      {"/v1/chat/completions", R"({"model":"aidreams","messages":[{"role":"user","content":"x"}],"max_completion_tokens":-3})",
       400, "max_completion_tokens"},
  };
  for (const Case& c : cases) {
    HttpTestResponse r = Post(c.path, c.body);
    EXPECT_EQ(r.status, c.status) << c.body.substr(0, 200) << " -> " << r.body;
    json e = ErrorBody(r);
    EXPECT_EQ(e["type"], "invalid_request_error") << r.body;
    if (c.param.empty()) {
      EXPECT_TRUE(e["param"].is_null()) << c.body.substr(0, 200) << " -> " << r.body;
    } else {
      EXPECT_EQ(e["param"], c.param) << c.body.substr(0, 200) << " -> " << r.body;
    }
    ExpectStillServing();
  }

  // Unknown model: 404 with code model_not_found.
  HttpTestResponse r = Post("/v1/completions", R"({"model":"gpt-4","prompt":"hi"})");
  EXPECT_EQ(r.status, 404);
  json e = ErrorBody(r);
  EXPECT_EQ(e["code"], "model_not_found");
  EXPECT_TRUE(e["param"].is_null()) << r.body;  // as OpenAI answers it
  // Unknown path and wrong method.
  r = Get("/v1/nothing");
  EXPECT_EQ(r.status, 404);
  ErrorBody(r);
  r = Get("/v1/completions");
  EXPECT_EQ(r.status, 405);
  ErrorBody(r);
  // A body over the limit.
  r = Post("/v1/completions", std::string(2 << 20, ' '));
  EXPECT_EQ(r.status, 413);
  ErrorBody(r);
  ExpectStillServing();
  // And a good request still works.
  r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":3,"temperature":0})");
  EXPECT_EQ(r.status, 200) << r.body;
}

// JSON bombs at the body limit: a depth bomb and a flat array of more values than the reader
// allows (keel/core/json_reader.h) are 400s on both endpoints, and the server keeps serving.
TEST_F(ServerTest, JsonBombsAre400OnEveryEndpoint) {
  ServerOptions opts;
  opts.max_body_bytes = 8 << 20;
  Start({}, opts);
  const std::string depth_bomb(8 << 20, '[');
  std::string flat = R"({"model":"aidreams","prompt":[)";
  while (flat.size() < (size_t{3} << 20)) flat += "1,";
  flat += "1]}";
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    HttpTestResponse r = Post(path, depth_bomb);
    EXPECT_EQ(r.status, 400) << path << " -> " << r.body.substr(0, 200);
    EXPECT_EQ(ErrorBody(r)["message"], "request JSON nests too deeply") << r.body;
    ExpectStillServing();
    r = Post(path, flat);
    EXPECT_EQ(r.status, 400) << path << " -> " << r.body.substr(0, 200);
    EXPECT_NE(ErrorBody(r)["message"].get<std::string>().find("more than 1048576 values"), std::string::npos) << r.body;
    ExpectStillServing();
  }
  HttpTestResponse r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":3,"temperature":0})");
  EXPECT_EQ(r.status, 200) << r.body;
}

TEST_F(ServerTest, QueueFullIs429) {
  // The server does not step the scheduler here, so the first request stays queued and the
  // queue (capacity 1) is full for the second: no timing involved.
  ServerOptions opts;
  opts.run_scheduler = false;
  Start(SchedulerOptions{/*max_queue=*/1, /*max_running=*/1}, opts);

  HttpTestResponse first;
  std::thread t([&] {
    first = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":16,"temperature":0,"stream":true})");
  });
  ASSERT_TRUE(Eventually([&] { return scheduler_->QueueDepth() == 1; }));

  HttpTestResponse r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":8})");
  EXPECT_EQ(r.status, 429);
  EXPECT_EQ(r.Header("Retry-After"), "1");
  json e = ErrorBody(r);
  EXPECT_EQ(e["code"], "rate_limit_exceeded");
  // Same for a streaming request: refused before any stream starts.
  r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":8,"stream":true})");
  EXPECT_EQ(r.status, 429);

  // Now let the scheduler run: the queued request completes normally.
  std::atomic<bool> stop{false};
  std::thread stepper([&] { scheduler_->Run(stop); });
  t.join();
  EXPECT_EQ(first.status, 200);
  SseResult s = ParseSse(first.body);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(StreamText(s, false).rfind(kGolden, 0), 0u) << first.body;
  server_->Stop(false);
  stop = true;
  stepper.join();
  EXPECT_GE(metrics_->requests.WithLabels({"/v1/completions", "429"}).Value(), 2);
}

// n samples per prompt and several prompts per request: choice p * n + j is what a request for
// prompt p alone with seed + j answers, streamed or not, and usage counts each prompt once.
TEST_F(ServerTest, SeveralPromptsAndChoicesAnswerAsSingleRequestsWould) {
  Start();
  auto text_of = [&](const std::string& body) {
    HttpTestResponse r = Post("/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
    json j = json::parse(r.body);
    EXPECT_EQ(j["choices"].size(), 1u) << r.body;
    return std::make_pair(j["choices"][0]["text"].get<std::string>(), j["usage"]);
  };
  const auto [a, a_usage] = text_of(R"({"model":"aidreams","prompt":"The dream","max_tokens":12,"seed":7})");
  const auto [a8, a8_usage] = text_of(R"({"model":"aidreams","prompt":"The dream","max_tokens":12,"seed":8})");
  const auto [b, b_usage] = text_of(R"({"model":"aidreams","prompt":[1,5,9],"max_tokens":12,"seed":7})");
  const auto [b8, b8_usage] = text_of(R"({"model":"aidreams","prompt":[1,5,9],"max_tokens":12,"seed":8})");
  ASSERT_NE(a, a8);  // the seeds sample differently, so the check below can tell choices apart

  HttpTestResponse r =
      Post("/v1/completions", R"({"model":"aidreams","prompt":["The dream",[1,5,9]],"n":2,"max_tokens":12,"seed":7})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), 4u) << r.body;
  const std::vector<std::string> want = {a, a8, b, b8};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], want[i]) << i;
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], a_usage["prompt_tokens"].get<int>() + b_usage["prompt_tokens"].get<int>());
  EXPECT_EQ(j["usage"]["completion_tokens"],
            a_usage["completion_tokens"].get<int>() + a8_usage["completion_tokens"].get<int>() +
                b_usage["completion_tokens"].get<int>() + b8_usage["completion_tokens"].get<int>());

  // Chat, streamed: each choice opens with its role, its deltas make its text, it finishes once,
  // and one usage chunk closes the stream.
  const std::string chat = R"({"model":"aidreams","messages":[{"role":"user","content":"Dream"}],"max_tokens":10,"seed":3)";
  HttpTestResponse one = Post("/v1/chat/completions", chat + "}");
  HttpTestResponse plain = Post("/v1/chat/completions", chat + R"(,"n":3})");
  ASSERT_EQ(plain.status, 200) << plain.body;
  json pj = json::parse(plain.body);
  ASSERT_EQ(pj["choices"].size(), 3u);
  EXPECT_EQ(pj["choices"][0]["message"], json::parse(one.body)["choices"][0]["message"]);
  r = Post("/v1/chat/completions", chat + R"(,"n":3,"stream":true,"stream_options":{"include_usage":true}})");
  ASSERT_EQ(r.status, 200);
  SseResult s = ParseSse(r.body);
  ASSERT_TRUE(s.well_formed && s.done) << r.body;
  std::vector<std::string> texts(3);
  std::vector<int> finishes(3, 0), roles(3, 0);
  for (size_t e = 0; e + 1 < s.events.size(); ++e) {
    ASSERT_EQ(s.events[e]["choices"].size(), 1u) << s.events[e].dump();
    const json& c = s.events[e]["choices"][0];
    const int i = c["index"].get<int>();
    ASSERT_TRUE(i >= 0 && i < 3) << c.dump();
    EXPECT_EQ(finishes[i], 0) << "a chunk after choice " << i << " finished";
    if (c["delta"].contains("role")) {
      EXPECT_EQ(texts[i], "");
      ++roles[i];
    } else {
      EXPECT_EQ(roles[i], 1) << "choice " << i << " spoke before its role";
    }
    if (c["delta"].contains("content")) texts[i] += c["delta"]["content"].get<std::string>();
    if (!c["finish_reason"].is_null()) {
      ++finishes[i];
      EXPECT_EQ(c["finish_reason"], pj["choices"][i]["finish_reason"]);
    }
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(roles[i], 1);
    EXPECT_EQ(finishes[i], 1);
    EXPECT_EQ(texts[i], pj["choices"][i]["message"]["content"]) << i;
  }
  EXPECT_TRUE(s.events.back()["choices"].empty());
  EXPECT_EQ(s.events.back()["usage"], pj["usage"]);
}

// echo: the text starts with the prompt as the model read it; with logprobs the prompt's tokens
// lead the logprobs (the first with nulls), scored as the model would generate them; max_tokens 0
// only scores; streamed, the chunks add up to the same text and logprobs.
TEST_F(ServerTest, EchoReturnsThePromptAndScoresIt) {
  Start();
  const std::vector<int> prompt = tokenizer_->Encode("Echoes of", true);
  json ids = json::array();
  for (int t : prompt) ids.push_back(t);
  auto post = [&](json body) {
    body["model"] = "aidreams";
    body["prompt"] = ids;
    HttpTestResponse r = Post("/v1/completions", body.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    return r;
  };
  // Greedy generation with logprobs, then the same with echo.
  const json gen = json::parse(post({{"max_tokens", 6}, {"temperature", 0}, {"logprobs", 2}}).body)["choices"][0];
  const std::string continuation = gen["text"];
  const json& gen_lp = gen["logprobs"];
  const json echoed = json::parse(post({{"max_tokens", 6}, {"temperature", 0}, {"logprobs", 2}, {"echo", true}}).body);
  const json& e = echoed["choices"][0];
  EXPECT_EQ(e["text"], "Echoes of" + continuation);
  const json& lp = e["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), prompt.size() + gen_lp["tokens"].size()) << echoed.dump();
  EXPECT_EQ(lp["tokens"][0], "");  // BOS is no text
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t k = 0; k < gen_lp["tokens"].size(); ++k) {  // the generated part, as without echo
    EXPECT_EQ(lp["tokens"][prompt.size() + k], gen_lp["tokens"][k]) << k;
    EXPECT_EQ(lp["token_logprobs"][prompt.size() + k], gen_lp["token_logprobs"][k]) << k;
  }
  // text_offset: byte offsets into the whole text, the prompt's included.
  std::string joined;
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    EXPECT_EQ(lp["text_offset"][i].get<size_t>(), joined.size()) << i;
    joined += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(joined, e["text"]);
  EXPECT_EQ(echoed["usage"]["prompt_tokens"], prompt.size());

  // Echo without logprobs: the text only.
  const json plain = json::parse(post({{"max_tokens", 6}, {"temperature", 0}, {"echo", true}}).body)["choices"][0];
  EXPECT_EQ(plain["text"], "Echoes of" + continuation);
  EXPECT_TRUE(plain["logprobs"].is_null());

  // Scoring only (max_tokens 0): the prompt's scores as above, nothing generated. (That a scored
  // position equals the logprob the model generated its token with is the scheduler's test.)
  const json zero = json::parse(post({{"max_tokens", 0}, {"logprobs", 1}, {"echo", true}}).body);
  const json& z = zero["choices"][0];
  EXPECT_EQ(z["text"], "Echoes of");
  EXPECT_EQ(z["finish_reason"], "length");
  EXPECT_EQ(z["logprobs"]["tokens"].size(), prompt.size());
  EXPECT_EQ(zero["usage"]["completion_tokens"], 0);
  for (size_t i = 1; i < prompt.size(); ++i) {
    EXPECT_EQ(z["logprobs"]["token_logprobs"][i], lp["token_logprobs"][i]) << i;
  }
  // Without echo, max_tokens 0 stays an error.
  EXPECT_EQ(Post("/v1/completions", R"({"model":"aidreams","prompt":"x","max_tokens":0})").status, 400);

  // Streamed: the same text and logprobs, in pieces.
  HttpTestResponse st = post({{"max_tokens", 6}, {"temperature", 0}, {"logprobs", 2}, {"echo", true}, {"stream", true}});
  SseResult s = ParseSse(st.body);
  ASSERT_TRUE(s.well_formed && s.done) << st.body;
  EXPECT_EQ(StreamText(s, false), "Echoes of" + continuation);
  json streamed = nullptr;
  for (const json& ev : s.events) {
    const json& c = ev["choices"][0];
    if (!c["logprobs"].is_null()) AppendLogprobs(&streamed, c["logprobs"]);
  }
  EXPECT_EQ(streamed, lp);
}

// A request whose choices do not all fit the queue is refused whole: none of them runs.
TEST_F(ServerTest, ChoicesThatDoNotFitTheQueueAreRefusedTogether) {
  ServerOptions opts;
  opts.run_scheduler = false;
  Start(SchedulerOptions{/*max_queue=*/2, /*max_running=*/4}, opts);
  // Two fit the queue; one is taken, so the second of two finds it full.
  std::thread holder;
  HttpTestResponse held;
  holder = std::thread([&] { held = Post("/v1/completions", R"({"model":"aidreams","prompt":"y","max_tokens":8})"); });
  ASSERT_TRUE(Eventually([&] { return scheduler_->QueueDepth() == 1; }));
  HttpTestResponse r = Post("/v1/completions", R"({"model":"aidreams","prompt":"x","n":2,"max_tokens":8})");
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_EQ(ErrorBody(r)["code"], "rate_limit_exceeded");
  // More than the queue holds at all: a 400 naming n, not a 429 to retry.
  r = Post("/v1/completions", R"({"model":"aidreams","prompt":"x","n":3,"max_tokens":8})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(ErrorBody(r)["param"], "n");
  EXPECT_NE(r.body.find("3 choices (prompts x n) are more than this server queues at once (2"), std::string::npos) << r.body;
  std::atomic<bool> stop{false};
  std::thread stepper([&] { scheduler_->Run(stop); });
  holder.join();
  ASSERT_EQ(held.status, 200) << held.body;
  const int held_tokens = json::parse(held.body)["usage"]["completion_tokens"].get<int>();
  EXPECT_TRUE(Eventually([&] { return scheduler_->QueueDepth() == 0 && scheduler_->Stats().running == 0; }));
  // Two fit: they run.
  r = Post("/v1/completions", R"({"model":"aidreams","prompt":"x","n":2,"max_tokens":8,"temperature":0})");
  ASSERT_EQ(r.status, 200) << r.body;
  const int generated = json::parse(r.body)["usage"]["completion_tokens"].get<int>();
  EXPECT_GT(generated, 0);
  server_->Stop(false);
  stop = true;
  stepper.join();
  // Only the held request and the two admitted choices generated: the refused ones never ran.
  EXPECT_EQ(metrics_->generation_tokens.Value(), held_tokens + generated);
}

TEST_F(ServerTest, MetricsExposeEngineCounters) {
  Start();
  const double before = MetricValue(R"(keel_requests_total{route="/v1/completions",code="200"})");
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":10,"temperature":0})").status, 200);
  }
  HttpTestResponse r = Get("/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.Header("Content-Type").rfind("text/plain", 0), 0u);
  for (const char* name :
       {"keel_requests_total", "keel_prompt_tokens_total", "keel_generation_tokens_total", "keel_queue_depth",
        "keel_running_sequences", "keel_kv_blocks_used", "keel_kv_blocks_total", "keel_kv_blocks_cached",
        "keel_kv_blocks_compacted", "keel_kv_bytes_used", "keel_kv_bytes_total",
        "keel_prefix_cache_hit_tokens_total", "keel_time_to_first_token_seconds_bucket",
        "keel_inter_token_latency_seconds_count", "keel_request_duration_seconds_sum"}) {
    EXPECT_NE(r.body.find(std::string("\n") + name), std::string::npos) << name << "\n" << r.body;
  }
  const double after = MetricValue(R"(keel_requests_total{route="/v1/completions",code="200"})");
  EXPECT_EQ(after - std::max(before, 0.0), 2);
  EXPECT_EQ(MetricValue("keel_generation_tokens_total"), 20);
  EXPECT_EQ(MetricValue("keel_prompt_tokens_total"), 2);
  EXPECT_EQ(MetricValue("keel_time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(MetricValue("keel_inter_token_latency_seconds_count"), 18);
  EXPECT_EQ(MetricValue("keel_request_duration_seconds_count"), 2);
  EXPECT_GT(MetricValue("keel_kv_blocks_total"), 0);
  EXPECT_GT(MetricValue("keel_kv_bytes_total"), MetricValue("keel_kv_bytes_used"));
  EXPECT_GE(MetricValue(R"(keel_requests_total{route="/healthz",code="200"})"), -1);
  Get("/nope");
  EXPECT_EQ(MetricValue(R"(keel_requests_total{route="other",code="404"})"), 1);
}

// What the HTTP layer refuses never reaches a handler, so keel_requests_total cannot see it.
TEST_F(ServerTest, MetricsCountRequestsTheHttpLayerRefused) {
  Start();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"GARBAGE\r\n\r\n", "400"},
      {"POST /v1/completions HTTP/1.1\r\nContent-Length: " + std::to_string(size_t{64} << 20) + "\r\n\r\n", "413"},
      {"GET /healthz HTTP/1.1\r\nX-Big: " + std::string(64 << 10, 'a') + "\r\n\r\n", "431"},
      {"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "501"}};
  for (const auto& [raw, code] : cases) {
    HttpTestClient c(port_);
    ASSERT_TRUE(c.SendRaw(raw));
    HttpTestResponse r;
    ASSERT_TRUE(c.ReadResponse(&r)) << code;
    EXPECT_EQ(std::to_string(r.status), code) << r.body;
    EXPECT_EQ(MetricValue(R"(keel_http_requests_refused_total{code=")" + code + R"("})"), 1) << code;
  }
  EXPECT_EQ(MetricValue(R"(keel_requests_total{route="other",code="400"})"), -1);  // -1: absent
}

TEST_F(ServerTest, ThirtyTwoConcurrentStreamsAllComplete) {
  Start();
  constexpr int kClients = 32;
  std::vector<HttpTestResponse> results(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const bool chat = i % 2 == 1;
      results[i] = Post(chat ? "/v1/chat/completions" : "/v1/completions",
                        chat ? R"({"model":"aidreams","messages":[{"role":"user","content":""}],"max_tokens":24,"temperature":0,"stream":true})"
                             : R"({"model":"aidreams","prompt":"","max_tokens":24,"temperature":0,"stream":true})");
    });
  }
  for (auto& t : threads) t.join();
  std::string first_text;
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(results[i].status, 200) << i << ": " << results[i].body;
    SseResult s = ParseSse(results[i].body);
    EXPECT_TRUE(s.well_formed) << i;
    EXPECT_TRUE(s.done) << i;
    std::string text = StreamText(s, i % 2 == 1);
    EXPECT_EQ(text.rfind(kGolden, 0), 0u) << i << ": " << text;
    if (i == 0) first_text = text;
    EXPECT_EQ(text, first_text) << i;  // same prompt, greedy: batching must not change the text
  }
  ExpectStillServing();
}

TEST_F(ServerTest, ClientDisconnectCancelsTheRequest) {
  ServerOptions opts;
  opts.run_scheduler = false;  // the test steps the scheduler, so nothing races
  Start({}, opts);
  {
    HttpTestClient c(port_);
    ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest(
        "POST", "/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":100,"temperature":0,"stream":true})")));
    ASSERT_TRUE(Eventually([&] { return scheduler_->QueueDepth() == 1; }));
    for (int i = 0; i < 3; ++i) scheduler_->Step();
    HttpTestResponse r;
    c.ReadResponse(&r, [](std::string_view) { return false; });  // read the first chunk, then leave
    EXPECT_EQ(r.status, 200);
  }
  // The handler notices, cancels and returns; its connection then closes.
  ASSERT_TRUE(Eventually([&] { return metrics_->open_connections.Value() == 0; }));
  while (scheduler_->Step()) {
  }
  SchedulerStats st = scheduler_->Stats();
  EXPECT_EQ(st.requests_finished, 1);
  EXPECT_EQ(st.running, 0);
  EXPECT_LT(st.generated_tokens, 100);
}

// A whole (non-streamed) answer wakes its handler only at the end, so the handler must look for a
// client that went away on its own while tokens keep coming. Before it did, a handler woken for
// every token never looked, and a long answer was generated to the end for nobody.
TEST_F(ServerTest, ClientDisconnectCancelsANonStreamedRequestWhileTokensFlow) {
  ServerOptions opts;
  opts.run_scheduler = false;  // the test steps the scheduler
  Start({}, opts);
  {
    HttpTestClient c(port_);
    ASSERT_TRUE(c.SendRaw(HttpTestClient::BuildRequest(
        "POST", "/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":100,"temperature":0})")));
    ASSERT_TRUE(Eventually([&] { return scheduler_->QueueDepth() == 1; }));
  }  // the client leaves without reading
  // One token every 20 ms: the handler's queue is never empty for a whole 50 ms poll. Greedy from
  // BOS the answer runs to all 100 tokens (a handler that never looks generates them all).
  // (A step that drops the cancelled request may come before the handler has closed.)
  bool closed = false;
  for (int i = 0; i < 150 && !closed; ++i) {
    closed = metrics_->open_connections.Value() == 0;
    if (!closed) scheduler_->Step();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(closed);
  while (scheduler_->Step()) {
  }
  SchedulerStats st = scheduler_->Stats();
  EXPECT_EQ(st.requests_finished, 1);
  // Noticed within about a second at most, however loaded the machine (50 ms polls).
  EXPECT_LT(st.generated_tokens, 50) << "the handler noticed only after the answer was complete";
  // Counted as the client's doing, not as a server error (it was a 500 "handler sent no response").
  EXPECT_EQ(MetricValue(R"(keel_requests_total{route="/v1/completions",code="499"})"), 1);
  EXPECT_LE(MetricValue(R"(keel_requests_total{route="/v1/completions",code="500"})"), 0);
  ExpectStillServing();
}

TEST_F(ServerTest, StopCancelsQueuedStreamsWithAnErrorEvent) {
  ServerOptions opts;
  opts.run_scheduler = false;  // the request can never progress on its own
  Start({}, opts);
  HttpTestResponse r;
  std::thread t([&] {
    r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":8,"stream":true})");
  });
  ASSERT_TRUE(Eventually([&] { return scheduler_->QueueDepth() == 1; }));
  server_->Stop(/*cancel_in_flight=*/true);
  t.join();
  ASSERT_EQ(r.status, 200);
  SseResult s = ParseSse(r.body);
  EXPECT_TRUE(s.well_formed) << r.body;
  EXPECT_TRUE(s.done) << r.body;
  ASSERT_FALSE(s.events.empty());
  EXPECT_EQ(s.events.back()["error"]["code"], "server_shutting_down") << r.body;
  // Nothing is accepted any more.
  HttpTestClient c(port_);
  EXPECT_NE(c.Request("GET", "/healthz").status, 200);
}

TEST_F(ServerTest, GracefulStopLetsRunningRequestsFinish) {
  ServerOptions opts;
  opts.run_scheduler = false;
  opts.drain_seconds = 60;
  Start({}, opts);
  HttpTestResponse r;
  std::thread t([&] {
    r = Post("/v1/completions", R"({"model":"aidreams","prompt":"","max_tokens":8,"temperature":0,"stream":true})");
  });
  ASSERT_TRUE(Eventually([&] { return scheduler_->QueueDepth() == 1; }));
  std::thread stopper([&] { server_->Stop(/*cancel_in_flight=*/false); });
  // While Stop drains, new generation requests are refused; the one in flight completes.
  std::atomic<bool> stop{false};
  std::thread stepper([&] { scheduler_->Run(stop); });
  t.join();
  stopper.join();
  stop = true;
  stepper.join();
  ASSERT_EQ(r.status, 200);
  SseResult s = ParseSse(r.body);
  EXPECT_TRUE(s.done);
  ASSERT_FALSE(s.events.empty());
  EXPECT_EQ(s.events.back()["choices"][0]["finish_reason"], "length") << r.body;
}

TEST_F(ServerTest, RunServerUntilSignalStopsOnSigterm) {
  Start();
  std::thread killer([] {
    // Wait until the handler is installed, then signal the process.
    struct sigaction sa {};
    for (int i = 0; i < 60000; ++i) {
      sigaction(SIGTERM, nullptr, &sa);
      if (sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    kill(getpid(), SIGTERM);
  });
  Status st = RunServerUntilSignal(*server_);
  killer.join();
  EXPECT_TRUE(st.ok()) << st.ToString();
  // The previous disposition is back.
  struct sigaction sa {};
  sigaction(SIGTERM, nullptr, &sa);
  EXPECT_EQ(sa.sa_handler, SIG_DFL);
  HttpTestClient c(port_);
  EXPECT_NE(c.Request("GET", "/healthz").status, 200);
}

}  // namespace
}  // namespace keel::engine
