// keel answer end to end on loopback with real parts: a `keel vector` service in-process holding
// 1,000 real SIFT base vectors, and a real engine server (en-dense6L + tok354). The gateway is
// skipped here: --gateway points at the engine, which serves the same OpenAI chat API.
// No wall-clock assertions; waits are bounded only to turn a hang into a failure.
#include "keel/answer/server.h"

#include <cstdio>

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "keel/answer/replay.h"
#include "keel/core/http_client.h"
#include "keel/core/http_server.h"
#include "keel/answer/quality.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/scheduler.h"
#include "keel/engine/server.h"
#include "keel/engine/tokenizer.h"
#include "keel/hilo/service_link.h"
#include "keel/vector/service.h"
#include "keel/vector/texmex.h"
#include "tests/answer/sse_payloads.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"
#include "tests/hilo/test_catalog.h"

namespace keel::answer {
namespace {

using json = nlohmann::json;
using test::HttpTestClient;
using test::HttpTestResponse;

constexpr const char* kModel = "en-dense6L";
constexpr int kBase = 1000;  // SIFT base vectors upserted

template <typename Pred>
bool Eventually(Pred pred) {
  for (int i = 0; i < 6000; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// A loopback port nothing listens on (bound, then closed).
int DeadPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string Url(int port) { return "http://127.0.0.1:" + std::to_string(port); }

// An engine behind its OpenAI server, on a fresh cache and scheduler.
struct EngineRig {
  std::unique_ptr<engine::KvCache> cache;
  std::unique_ptr<engine::Scheduler> scheduler;
  std::unique_ptr<engine::Server> server;
  ~EngineRig() {
    if (server) server->Stop(true);
  }
};

class AnswerServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto corpus = Corpus::Load(test::SharedDir() + "/data/text/val.txt");
    ASSERT_TRUE(corpus.ok()) << corpus.status().ToString();
    corpus_ = new Corpus(std::move(*corpus));
    auto eval = LoadEvalSet(test::SharedDir() + "/data/vectors", *corpus_);
    ASSERT_TRUE(eval.ok()) << eval.status().ToString();
    eval_ = new std::vector<EvalQuery>(std::move(*eval));
    auto model = engine::LoadLlama2c(test::ModelsDir() + "/en-dense6L.bin");
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = new engine::Model(std::move(*model));
    auto tok = engine::Tokenizer::Load(test::ModelsDir() + "/tok354.bin", model_->config.vocab_size);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tokenizer_ = new engine::Tokenizer(std::move(*tok));

    dir_ = new test::TempDir("keel-answer");
    vector::ServiceOptions vo;
    vo.shard.dir = dir_->path() + "/shard";
    vo.shard.text_dim = 128;
    vo.shard.image_dim = 128;
    vo.shard.wal_sync = false;
    vo.port = 0;
    auto vs = vector::Service::Start(vo);
    ASSERT_TRUE(vs.ok()) << vs.status().ToString();
    vector_ = vs->release();
    Upsert(0, kBase);

    engine_ = new EngineRig;
    StartEngine(*engine_, true);
  }
  static void TearDownTestSuite() {
    delete engine_;
    if (vector_ != nullptr) (void)vector_->Stop();
    delete vector_;
    delete dir_;
    delete tokenizer_;
    delete model_;
    delete eval_;
    delete corpus_;
    engine_ = nullptr;
    vector_ = nullptr;
  }

  // Upserts SIFT base vectors [begin, end) with their ids, in batches.
  static void Upsert(int begin, int end) {
    auto base = vector::ReadBvecs(test::SharedDir() + "/data/vectors/bigann10k_base.bvecs", end);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    for (int b = begin; b < end; b += 2000) {
      json items = json::array();
      for (int i = b; i < std::min(end, b + 2000); ++i) {
        std::vector<float> v(base->values.begin() + i * 128, base->values.begin() + (i + 1) * 128);
        items.push_back({{"id", i}, {"text", v}});
      }
      HttpTestClient c(vector_->port());
      HttpTestResponse r = c.Request("POST", "/v1/upsert", json{{"items", items}}.dump());
      ASSERT_EQ(r.status, 200) << r.body;
    }
  }

  static void StartEngine(EngineRig& rig, bool run_scheduler) {
    auto cache = engine::KvCache::Create(*model_, "raw", {});
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    rig.cache = std::move(*cache);
    rig.scheduler = std::make_unique<engine::Scheduler>(*model_, *tokenizer_, *rig.cache, engine::SchedulerOptions{});
    engine::ServerOptions so;
    so.port = 0;
    so.model_name = kModel;
    so.run_scheduler = run_scheduler;
    rig.server = std::make_unique<engine::Server>(*rig.scheduler, *tokenizer_, so);
    Status st = rig.server->Start();
    ASSERT_TRUE(st.ok()) << st.ToString();
  }

  void StartAnswer(AnswerServerOptions o, hilo::ServiceLink* link = nullptr) {
    if (o.vector_url.empty()) o.vector_url = Url(vector_->port());
    if (o.gateway_url.empty()) o.gateway_url = Url(engine_->server->port());
    o.default_model = kModel;
    auto s = AnswerServer::Start(*corpus_, o, link);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    answer_ = std::move(*s);
  }

  HttpTestResponse Ask(const std::string& body) {
    HttpTestClient c(answer_->port());
    return c.Request("POST", "/v1/chat/completions", body);
  }

  static json AskBody(const EvalQuery& q, int max_tokens = 4) {
    return {{"model", kModel},
            {"messages", {{{"role", "user"}, {"content", q.question}}}},
            {"max_tokens", max_tokens},
            {"keel_retrieval", {{"vector", q.vector}}}};
  }

  // The ids a direct search of the vector service returns.
  static std::vector<uint64_t> DirectSearch(const std::vector<float>& v) {
    HttpTestClient c(vector_->port());
    HttpTestResponse r = c.Request("POST", "/v1/search", json{{"kind", "text"}, {"text", v}, {"k", 10}}.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    std::vector<uint64_t> ids;
    const json j = json::parse(r.body);
    EXPECT_TRUE(j.contains("hits")) << r.body.substr(0, 300);
    for (const auto& h : j.value("hits", json::array())) ids.push_back(h["id"].get<uint64_t>());
    return ids;
  }

  static std::string ErrorMessage(const HttpTestResponse& r) {
    json j = json::parse(r.body, nullptr, false);
    EXPECT_TRUE(j.is_object() && j.contains("error") && j["error"].contains("type") && j["error"].contains("param"))
        << r.body;
    if (!j.is_object() || !j.contains("error") || !j["error"]["message"].is_string()) return "";
    return j["error"]["message"].get<std::string>();
  }

  static inline Corpus* corpus_ = nullptr;
  static inline std::vector<EvalQuery>* eval_ = nullptr;
  static inline engine::Model* model_ = nullptr;
  static inline engine::Tokenizer* tokenizer_ = nullptr;
  static inline test::TempDir* dir_ = nullptr;
  static inline vector::Service* vector_ = nullptr;
  static inline EngineRig* engine_ = nullptr;
  std::unique_ptr<AnswerServer> answer_;
};

TEST_F(AnswerServerTest, RetrievesLikeADirectSearchAndPromptsWithTheDocs) {
  StartAnswer({});
  for (int i = 0; i < 3; ++i) {
    const EvalQuery& q = (*eval_)[i];
    HttpTestResponse r = Ask(AskBody(q).dump());
    ASSERT_EQ(r.status, 200) << r.body;
    json j = json::parse(r.body);
    ASSERT_TRUE(j["choices"][0]["message"]["content"].is_string()) << r.body;
    const json& k = j["keel"];
    const std::vector<uint64_t> ids = k["retrieved"].get<std::vector<uint64_t>>();
    EXPECT_EQ(ids, DirectSearch(q.vector));
    ASSERT_EQ(ids.size(), 10u);
    EXPECT_EQ(k["state"], kBuiltinStateName);
    EXPECT_EQ(k["retrieval"], true);
    EXPECT_EQ(k["context_docs"], kBuiltinLevel.context_docs);
    std::vector<size_t> docs;
    std::vector<std::string_view> texts;
    for (int d = 0; d < kBuiltinLevel.context_docs; ++d) {
      docs.push_back(corpus_->DocFor(ids[d]));
      texts.push_back(corpus_->doc(docs.back()));
    }
    EXPECT_EQ(k["docs"].get<std::vector<size_t>>(), docs);
    EXPECT_GE(k["search_ms"].get<double>(), 0.0);
    EXPECT_GT(k["generate_ms"].get<double>(), 0.0);
    // The engine saw exactly BuildPrompt's text: tok354 encodes a prompt as BOS, the dummy-prefix
    // space, then one token per byte.
    const std::string prompt = BuildPrompt(texts, q.question, AnswerServerOptions{}.context_bytes);
    EXPECT_EQ(j["usage"]["prompt_tokens"].get<size_t>(), prompt.size() + 2) << prompt;
  }
  EXPECT_EQ(answer_->searches(), 3u);
  // Without keel_retrieval there is nothing to search with: no call, no documents.
  json body = AskBody((*eval_)[0]);
  body.erase("keel_retrieval");
  HttpTestResponse r = Ask(body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(json::parse(r.body)["keel"]["retrieved"].empty());
  EXPECT_EQ(answer_->searches(), 3u);
}

// stream: true gets OpenAI's SSE (chunked, text/event-stream) carrying the same answer the
// non-streamed request gets: the concatenated deltas equal its content, the usage chunk its usage.
TEST_F(AnswerServerTest, StreamCarriesTheSameAnswerAsSse) {
  StartAnswer({});
  const EvalQuery& q = (*eval_)[2];
  HttpTestResponse plain = Ask(AskBody(q, 8).dump());
  ASSERT_EQ(plain.status, 200) << plain.body;
  const json want = json::parse(plain.body);
  json body = AskBody(q, 8);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  HttpTestResponse r = Ask(body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.chunked);
  EXPECT_EQ(r.Header("Content-Type").rfind("text/event-stream", 0), 0u) << r.Header("Content-Type");
  std::string content;
  json usage;
  json keel;
  std::string finish;
  for (const std::string& payload : test::SseChunksBeforeDone(r.body)) {
    const json e = json::parse(payload);
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    EXPECT_EQ(e["model"], want["model"]);
    for (const auto& c : e["choices"]) {
      if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
      if (c["finish_reason"].is_string()) finish = c["finish_reason"];
    }
    if (!e["usage"].is_null()) usage = e["usage"];
    if (e.contains("keel")) keel = e["keel"];
  }
  EXPECT_EQ(content, want["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_EQ(finish, want["choices"][0]["finish_reason"].get<std::string>());
  EXPECT_EQ(usage, want["usage"]);
  EXPECT_EQ(keel["retrieved"], want["keel"]["retrieved"]);
  // Before the stream opens, errors are JSON with their status, as OpenAI sends them.
  json bad = body;
  bad["keel_retrieval"]["vector"] = {1, 2};
  HttpTestResponse e = Ask(bad.dump());
  EXPECT_EQ(e.status, 400) << e.body;
  EXPECT_FALSE(e.chunked);
  EXPECT_NE(ErrorMessage(e).find("expected 128 numbers"), std::string::npos) << e.body;
}

// A stand-in gateway (a real HTTP server on loopback) that streams an answer in OpenAI's format
// and sends its second content chunk only after the test's client has seen the first: an answer
// service that waited for the whole generation would never get it.
TEST_F(AnswerServerTest, StreamRelaysTheGatewaysChunksAsTheyArrive) {
  std::mutex mu;
  std::condition_variable cv;
  bool client_saw_first = false;
  std::atomic<bool> relayed_before_end{false};
  std::string gateway_body;
  auto chunk = [](const std::string& delta, const char* finish) {
    json c = {{"id", "chatcmpl-x"}, {"object", "chat.completion.chunk"}, {"created", 1}, {"model", kModel},
              {"choices", {{{"index", 0}, {"delta", json::parse(delta)}, {"finish_reason", finish ? json(finish) : json()}}}}};
    return "data: " + c.dump() + "\n\n";
  };
  HttpServerOptions go;
  go.host = "127.0.0.1";
  go.port = 0;
  HttpServer gateway(go, [&](const HttpRequest& req, HttpResponder& res) {
    gateway_body = req.body;
    ASSERT_TRUE(res.BeginStream(200, "text/event-stream"));
    res.WriteChunk(chunk(R"({"role":"assistant","content":""})", nullptr) + chunk(R"({"content":"Hel"})", nullptr));
    {
      std::unique_lock lock(mu);
      relayed_before_end = cv.wait_for(lock, std::chrono::seconds(20), [&] { return client_saw_first; });
    }
    res.WriteChunk(chunk(R"({"content":"lo"})", nullptr) + chunk("{}", "stop") + "data: [DONE]\n\n");
    res.EndStream();
  });
  ASSERT_TRUE(gateway.Start().ok());
  AnswerServerOptions o;
  o.gateway_url = Url(gateway.port());
  StartAnswer(o);
  json body = AskBody((*eval_)[1], 8);
  body["stream"] = true;
  HttpClient client({"127.0.0.1", answer_->port()});
  std::string got;
  std::string content_type;
  HttpStreamSink sink;
  sink.on_head = [&](int status, const HttpHeaders& h) {
    content_type = std::string(h.Get("content-type"));
    return status == 200;
  };
  sink.on_body = [&](std::string_view b) {
    got.append(b);
    if (got.find("\"Hel\"") != std::string::npos) {
      std::lock_guard lock(mu);
      client_saw_first = true;
      cv.notify_all();
    }
    return true;
  };
  auto r = client.CallStreaming("POST", "/v1/chat/completions", body.dump(), "application/json", DeadlineIn(60000), sink);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, 200);
  EXPECT_EQ(content_type.rfind("text/event-stream", 0), 0u) << content_type;
  EXPECT_TRUE(relayed_before_end.load()) << "the first chunk reached the client only after the gateway finished";
  const json asked = json::parse(gateway_body);
  EXPECT_EQ(asked["stream"], true);
  std::string content;
  json keel;
  for (const std::string& payload : test::SseChunksBeforeDone(got)) {
    const json e = json::parse(payload);
    for (const auto& c : e["choices"]) content += c["delta"].value("content", "");
    if (e.contains("keel")) keel = e["keel"];
  }
  EXPECT_EQ(content, "Hello");
  EXPECT_EQ(keel["retrieved"].size(), 10u) << keel.dump();
  EXPECT_EQ(keel["state"], kBuiltinStateName);
  gateway.Stop();
}

// Streamed requests: a gateway that refuses before streaming (429) is answered as JSON with its
// status; one whose stream is cut mid-answer leaves the client an error event and no [DONE].
TEST_F(AnswerServerTest, StreamErrorsBeforeAndAfterTheStreamOpens) {
  HttpServerOptions go;
  go.host = "127.0.0.1";
  go.port = 0;
  HttpServer busy(go, [](const HttpRequest&, HttpResponder& res) {
    res.Send(429, "application/json", R"({"error":{"message":"budget spent","type":"rate_limit_exceeded"}})");
  });
  ASSERT_TRUE(busy.Start().ok());
  json body = AskBody((*eval_)[0], 8);
  body["stream"] = true;
  {
    AnswerServerOptions o;
    o.gateway_url = Url(busy.port());
    StartAnswer(o);
    HttpTestResponse r = Ask(body.dump());
    EXPECT_EQ(r.status, 429) << r.body;
    EXPECT_FALSE(r.chunked);
    EXPECT_EQ(r.Header("Retry-After"), "1");
    EXPECT_NE(ErrorMessage(r).find("gateway: budget spent"), std::string::npos) << r.body;
    answer_->Stop();
  }
  busy.Stop();
  auto listener = ListenTcp("127.0.0.1", 0, 16);
  ASSERT_TRUE(listener.ok());
  std::thread cut([fd = listener->fd] {
    const int c = ::accept(fd, nullptr, nullptr);
    if (c < 0) return;
    char buf[65536];
    (void)!::read(c, buf, sizeof buf);
    const std::string event =
        R"(data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hal"},"finish_reason":null}]})"
        "\n\n";
    char size[16];
    std::snprintf(size, sizeof size, "%zx\r\n", event.size());
    const std::string reply = std::string("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n") +
                              size + event + "\r\n";
    (void)!::write(c, reply.data(), reply.size());
    ::close(c);
  });
  AnswerServerOptions o;
  o.gateway_url = Url(listener->port);
  StartAnswer(o);
  HttpTestResponse r = Ask(body.dump());
  cut.join();
  ::close(listener->fd);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.chunked);
  EXPECT_NE(r.body.find("\"Hal\""), std::string::npos) << r.body;
  EXPECT_EQ(r.body.find("data: [DONE]"), std::string::npos) << r.body;
  const size_t last = r.body.rfind("data: ", r.body.size() - 3);
  ASSERT_NE(last, std::string::npos) << r.body;
  const json err = json::parse(r.body.substr(last + 6));
  EXPECT_EQ(err["error"]["type"], "upstream_error") << r.body;
  EXPECT_NE(err["error"]["message"].get<std::string>().find("before [DONE]"), std::string::npos) << r.body;
}

TEST_F(AnswerServerTest, PinnedStatesApplyTheirAnswerLevelAtRunTime) {
  hilo::ServiceLinkOptions lo;
  lo.service = hilo::Service::kAnswer;
  auto link = hilo::ServiceLink::Pinned(hilo::testing::TestCatalog(), "bare", lo);
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  ASSERT_TRUE((*link)->Start().ok());
  AnswerServerOptions o;
  o.vector_url = Url(DeadPort());  // retrieval off must not need the vector service at all
  StartAnswer(o, link->get());
  const EvalQuery& q = (*eval_)[5];
  HttpTestResponse r = Ask(AskBody(q).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  json k = json::parse(r.body)["keel"];
  EXPECT_EQ(k["state"], "bare");
  EXPECT_EQ(k["retrieval"], false);
  EXPECT_TRUE(k["retrieved"].empty());
  EXPECT_TRUE(k["docs"].empty());
  EXPECT_EQ(answer_->searches(), 0u);
  // The prompt was the question alone.
  EXPECT_EQ(json::parse(r.body)["usage"]["prompt_tokens"].get<size_t>(), BuildPrompt({}, q.question, 100).size() + 2);

  // Same server, a state with retrieval on: now the (dead) vector service is needed, and named.
  ASSERT_TRUE((*link)->Pin("fewer_docs").ok());
  r = Ask(AskBody(q).dump());
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_NE(ErrorMessage(r).find("vector service at 127.0.0.1:"), std::string::npos) << r.body;
  EXPECT_EQ(answer_->searches(), 1u);
  (*link)->Stop();
}

TEST_F(AnswerServerTest, ContextDocsFollowsTheState) {
  hilo::ServiceLinkOptions lo;
  lo.service = hilo::Service::kAnswer;
  auto link = hilo::ServiceLink::Pinned(hilo::testing::TestCatalog(), "full", lo);
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  ASSERT_TRUE((*link)->Start().ok());
  StartAnswer({}, link->get());
  const EvalQuery& q = (*eval_)[7];
  for (const auto& [state, docs] : std::vector<std::pair<std::string, size_t>>{{"full", 8}, {"fewer_docs", 3}}) {
    ASSERT_TRUE((*link)->Pin(state).ok());
    HttpTestResponse r = Ask(AskBody(q).dump());
    ASSERT_EQ(r.status, 200) << state << ": " << r.body;
    json k = json::parse(r.body)["keel"];
    EXPECT_EQ(k["state"], state);
    EXPECT_EQ(k["context_docs"], docs);
    EXPECT_EQ(k["retrieved"].size(), 10u);  // all k ids, whatever the state puts in the prompt
    ASSERT_EQ(k["docs"].size(), docs) << state;
    for (size_t d = 0; d < docs; ++d) EXPECT_EQ(k["docs"][d], corpus_->DocFor(k["retrieved"][d].get<uint64_t>()));
  }
  (*link)->Stop();
}

TEST_F(AnswerServerTest, BeyondMaxInflightIs429) {
  EngineRig held;  // an engine whose scheduler the test steps: a request waits in its queue
  StartEngine(held, false);
  // A pinned link, so the HiLO meter is there to read (its windows are taken at test times).
  hilo::ServiceLinkOptions lo;
  lo.service = hilo::Service::kAnswer;
  auto link = hilo::ServiceLink::Pinned(hilo::testing::TestCatalog(), "fewer_docs", lo);
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  hilo::LoadMeter& meter = (*link)->meter();
  meter.SetRateWindow(0);  // rates per report window: this test counts each window's arrivals
  meter.Take(1000000);  // opens a window at t = 1000 s
  AnswerServerOptions o;
  o.max_inflight = 1;
  o.gateway_url = Url(held.server->port());
  StartAnswer(o, link->get());
  json body = AskBody((*eval_)[0]);
  HttpTestResponse first;
  std::thread t([&] { first = Ask(body.dump()); });
  ASSERT_TRUE(Eventually([&] { return held.scheduler->QueueDepth() == 1; }));
  HttpTestResponse r = Ask(body.dump());
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_EQ(r.Header("Retry-After"), "1");
  EXPECT_NE(ErrorMessage(r).find("limit of 1 requests in flight"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("rate_limit_exceeded"), std::string::npos);
  // Both arrived (the shed one too), one is being served, none waits.
  const hilo::LoadReport during = meter.Take(1001000);
  EXPECT_DOUBLE_EQ(during.arrival_rate, 2.0);
  EXPECT_EQ(during.in_flight, 1);
  EXPECT_EQ(during.queue_depth, 0);
  std::atomic<bool> stop{false};
  std::thread stepper([&] { held.scheduler->Run(stop); });
  t.join();
  EXPECT_EQ(first.status, 200) << first.body;
  // The slot is free again.
  HttpTestResponse again = Ask(body.dump());
  EXPECT_EQ(again.status, 200) << again.body;
  stop = true;
  stepper.join();
  const hilo::LoadReport after = meter.Take(1002000);
  EXPECT_DOUBLE_EQ(after.arrival_rate, 1.0);
  EXPECT_EQ(after.in_flight, 0);
  EXPECT_GT(after.p99_ms, 0.0);  // two finished in this window
}

TEST_F(AnswerServerTest, BadInputIs400And413) {
  AnswerServerOptions o;
  o.max_body_bytes = 8192;
  StartAnswer(o);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "malformed JSON"},
      {R"({"messages":[{"role":"user","content":"q"}],"stream":1})", "stream: expected a boolean"},
      {R"({"messages":[{"role":"user","content":"q"}],"keel_retrieval":{"vector":[1,2]}})", "expected 128 numbers, got 2"},
      {R"({"messages":[]})", "messages: expected at least one"},
  };
  for (const auto& [b, want] : cases) {
    HttpTestResponse r = Ask(b);
    EXPECT_EQ(r.status, 400) << b;
    EXPECT_NE(ErrorMessage(r).find(want), std::string::npos) << b << " -> " << r.body;
  }
  HttpTestResponse big = Ask(R"({"messages":[{"role":"user","content":")" + std::string(9000, 'x') + "\"}]}");
  EXPECT_EQ(big.status, 413) << big.body;
  // An unknown model is the gateway's (here the engine's) 404, passed through.
  HttpTestResponse m = Ask(R"({"model":"nope","messages":[{"role":"user","content":"q"}],"max_tokens":2})");
  EXPECT_EQ(m.status, 404) << m.body;
  EXPECT_EQ(ErrorMessage(m).rfind("gateway: ", 0), 0u) << m.body;
  EXPECT_EQ(answer_->searches(), 0u);
  // Every answer is counted by route and status.
  HttpTestClient c(answer_->port());
  HttpTestResponse metrics = c.Request("GET", "/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("keel_answer_requests_total{route=\"/v1/chat/completions\",code=\"400\"} 4"),
            std::string::npos)
      << metrics.body;
  EXPECT_NE(metrics.body.find("keel_answer_requests_total{route=\"/v1/chat/completions\",code=\"404\"} 1"),
            std::string::npos)
      << metrics.body;
}

TEST_F(AnswerServerTest, UpstreamFailuresNameTheUpstream) {
  // Vector service down: 503 naming it.
  {
    AnswerServerOptions o;
    const int dead = DeadPort();
    o.vector_url = Url(dead);
    StartAnswer(o);
    HttpTestResponse r = Ask(AskBody((*eval_)[0]).dump());
    EXPECT_EQ(r.status, 503) << r.body;
    EXPECT_NE(ErrorMessage(r).find("vector service at 127.0.0.1:" + std::to_string(dead) + " unreachable"),
              std::string::npos)
        << r.body;
    answer_->Stop();
  }
  // Vector service refuses the search (a 64-dim query to a 128-dim shard): 502 with its message.
  {
    AnswerServerOptions o;
    o.limits.dim = 64;
    StartAnswer(o);
    json body = AskBody((*eval_)[0]);
    body["keel_retrieval"]["vector"] = std::vector<float>(64, 1.0f);
    HttpTestResponse r = Ask(body.dump());
    EXPECT_EQ(r.status, 502) << r.body;
    const std::string msg = ErrorMessage(r);
    EXPECT_NE(msg.find("vector service at 127.0.0.1:" + std::to_string(vector_->port()) + " answered 400: "),
              std::string::npos)
        << r.body;
    answer_->Stop();
  }
  // Gateway down: 503 naming it.
  {
    AnswerServerOptions o;
    const int dead = DeadPort();
    o.gateway_url = Url(dead);
    StartAnswer(o);
    HttpTestResponse r = Ask(AskBody((*eval_)[0]).dump());
    EXPECT_EQ(r.status, 503) << r.body;
    EXPECT_NE(ErrorMessage(r).find("gateway at 127.0.0.1:" + std::to_string(dead) + " unreachable"), std::string::npos)
        << r.body;
  }
  // Bad options are refused at start.
  AnswerServerOptions small;
  small.vector_url = small.gateway_url = Url(1);
  small.max_body_bytes = 1000;
  auto tiny = AnswerServer::Start(*corpus_, small);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("max_body_bytes"), std::string::npos) << tiny.status().message();
  AnswerServerOptions bad;
  bad.vector_url = "ftp://x";
  bad.gateway_url = Url(1);
  auto s = AnswerServer::Start(*corpus_, bad);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("vector URL"), std::string::npos) << s.status().message();
}

// An answer the client's SDK cannot read is the gateway's failure (502), not a 200 passed on:
// choices null, empty, or holding something other than {message: {...}}.
TEST_F(AnswerServerTest, AGatewayAnswerWithoutReadableChoicesIs502) {
  std::string choices;
  HttpServerOptions go;
  go.host = "127.0.0.1";
  go.port = 0;
  HttpServer gateway(go, [&](const HttpRequest&, HttpResponder& res) {
    res.Send(200, "application/json", R"({"id":"x","object":"chat.completion","choices":)" + choices + "}");
  });
  ASSERT_TRUE(gateway.Start().ok());
  AnswerServerOptions o;
  o.gateway_url = Url(gateway.port());
  StartAnswer(o);
  for (const std::string bad : {"null", "[]", "[5]", R"([{"index":0}])", R"([{"message":"hi"}])"}) {
    choices = bad;
    HttpTestResponse r = Ask(AskBody((*eval_)[0]).dump());
    EXPECT_EQ(r.status, 502) << bad << ": " << r.body;
    EXPECT_NE(ErrorMessage(r).find("choice"), std::string::npos) << r.body;
  }
  choices = R"([{"index":0,"message":{"role":"assistant","content":"fine"},"finish_reason":"stop"}])";
  HttpTestResponse r = Ask(AskBody((*eval_)[0]).dump());
  EXPECT_EQ(r.status, 200) << r.body;
  answer_->Stop();
}

// A client that hung up while its search ran gets no generation: the gateway is never asked. One
// that stays gets its answer. The vector service here holds each search until the test lets it go.
TEST_F(AnswerServerTest, AClientThatLeftDuringTheSearchIsNotGeneratedFor) {
  std::mutex mu;
  std::condition_variable cv;
  int searches = 0;
  bool release = false;
  HttpServerOptions ho;
  ho.host = "127.0.0.1";
  ho.port = 0;
  HttpServer vector(ho, [&](const HttpRequest&, HttpResponder& res) {
    std::unique_lock lock(mu);
    ++searches;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return release; });
    res.Send(200, "application/json", R"({"hits":[{"id":1},{"id":2}]})");
  });
  std::atomic<int> generations{0};
  HttpServer gateway(ho, [&](const HttpRequest&, HttpResponder& res) {
    ++generations;
    res.Send(200, "application/json",
             R"({"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]})");
  });
  ASSERT_TRUE(vector.Start().ok());
  ASSERT_TRUE(gateway.Start().ok());
  AnswerServerOptions o;
  o.vector_url = Url(vector.port());
  o.gateway_url = Url(gateway.port());
  StartAnswer(o);

  // The client sends its request and hangs up while the search is held.
  const std::string body = AskBody((*eval_)[0]).dump();
  const std::string request = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(answer_->port()));
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return searches == 1; }));
  }
  ::close(fd);
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  // Counted as the client's 499 once the worker saw it leave.
  ASSERT_TRUE(Eventually([&] {
    HttpTestClient c(answer_->port());
    const std::string m = c.Request("GET", "/metrics").body;
    return m.find("keel_answer_requests_total{route=\"/v1/chat/completions\",code=\"499\"} 1") != std::string::npos &&
           m.find("\nkeel_answer_inflight 0") != std::string::npos;
  }));
  EXPECT_EQ(generations.load(), 0) << "the gateway was asked for an answer nobody waited for";

  // A client that waits gets its answer (the search is no longer held).
  HttpTestResponse r = Ask(body);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(generations.load(), 1);
  answer_->Stop();
}

TEST_F(AnswerServerTest, ModelsAreTheGatewaysForTheClientsKey) {
  StartAnswer({});
  HttpTestClient c(answer_->port());
  HttpTestResponse list = c.Request("GET", "/v1/models");
  ASSERT_EQ(list.status, 200) << list.body;
  HttpTestClient e(engine_->server->port());
  const json direct = json::parse(e.Request("GET", "/v1/models").body);
  EXPECT_EQ(json::parse(list.body), direct);  // passed on as the gateway answered
  EXPECT_EQ(direct["data"][0]["id"], kModel);

  HttpTestResponse one = c.Request("GET", std::string("/v1/models/") + kModel);
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(json::parse(one.body)["id"], kModel);
  // The gateway's 404 for an unknown model passes through with its message.
  HttpTestResponse unknown = c.Request("GET", "/v1/models/no-such-model");
  EXPECT_EQ(unknown.status, 404) << unknown.body;
  EXPECT_NE(ErrorMessage(unknown).find("no-such-model"), std::string::npos) << unknown.body;
  // An id with dot segments could name another upstream route: refused here.
  EXPECT_EQ(c.Request("GET", "/v1/models/../healthz").status, 400);
  EXPECT_EQ(c.Request("POST", "/v1/models").status, 405);
  answer_->Stop();

  AnswerServerOptions o;
  const int dead = DeadPort();
  o.gateway_url = Url(dead);
  StartAnswer(o);
  HttpTestClient d(answer_->port());
  HttpTestResponse r = d.Request("GET", "/v1/models");
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_NE(ErrorMessage(r).find("gateway at 127.0.0.1:" + std::to_string(dead) + " unreachable"), std::string::npos)
      << r.body;
}

// The quality half of `keel hilo validate` on real parts: all 10,000 SIFT base vectors (so the
// exact ground truth applies), 30 evaluation queries, three pinned states scored against the full
// state's answers. Runs last in this file: it grows the shared shard (the other tests compare with
// direct searches, so the size does not matter to them).
TEST_F(AnswerServerTest, ReplayScoresStatesAgainstTheFullState) {
  Upsert(kBase, 10000);
  hilo::ServiceLinkOptions lo;
  lo.service = hilo::Service::kAnswer;
  auto link = hilo::ServiceLink::Pinned(hilo::testing::TestCatalog(), "full", lo);
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  ASSERT_TRUE((*link)->Start().ok());
  StartAnswer({}, link->get());
  HttpClient client(HttpEndpoint{"127.0.0.1", answer_->port()});
  const std::span<const EvalQuery> queries(eval_->data(), 30);
  ReplayOptions ro;
  ro.max_tokens = 8;

  const std::vector<ReplayedAnswer> full = Replay(client, queries, ro);
  const std::vector<ReplayedAnswer> again = Replay(client, queries, ro);
  ASSERT_EQ(full.size(), queries.size());
  for (size_t i = 0; i < full.size(); ++i) {
    ASSERT_EQ(full[i].status, 200) << full[i].error;
    EXPECT_EQ(full[i].state, "full");
    // Temperature 0: the reference is stable, so agreement measures the state, not sampling.
    EXPECT_EQ(again[i].content, full[i].content) << i;
  }
  const StateQuality self = Score(queries, full, again);
  EXPECT_EQ(self.served, 30);
  EXPECT_DOUBLE_EQ(self.agreement, 1.0);
  EXPECT_NEAR(self.quality, 100 * self.recall, 1e-9);
  EXPECT_GE(self.recall, 0.8);  // HNSW (ef 64) against exact truth on 10k SIFT vectors

  ASSERT_TRUE((*link)->Pin("fewer_docs").ok());
  const std::vector<ReplayedAnswer> fewer = Replay(client, queries, ro);
  const StateQuality fq = Score(queries, full, fewer);
  EXPECT_EQ(fq.served, 30);
  EXPECT_DOUBLE_EQ(fq.recall, self.recall);  // same vector level, same hits; fewer in the prompt
  EXPECT_LE(fq.quality, self.quality);

  ASSERT_TRUE((*link)->Pin("bare").ok());
  const std::vector<ReplayedAnswer> bare = Replay(client, queries, ro);
  const StateQuality bq = Score(queries, full, bare);
  EXPECT_EQ(bq.served, 30);
  EXPECT_DOUBLE_EQ(bq.recall, 0.0);
  EXPECT_DOUBLE_EQ(bq.quality, 0.0);  // retrieval off scores 0 by definition
  std::printf("quality over %zu eval queries (max_tokens 8): full %.2f (recall %.3f), fewer_docs %.2f (recall %.3f, "
              "agreement %.3f), bare %.2f (agreement %.3f)\n",
              queries.size(), self.quality, self.recall, fq.quality, fq.recall, fq.agreement, bq.quality, bq.agreement);
  (*link)->Stop();
}

}  // namespace
}  // namespace keel::answer
