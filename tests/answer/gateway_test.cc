// keel answer through a real `keel gateway` (child processes of KEEL_BINARY: the gateway and its
// policy service, with a key made through the admin API) in front of a real engine in-process:
// the product's answer -> gateway -> engine hop, and the client's key forwarded to the gateway.
// Retrieval is not exercised here (server_test.cc does): requests carry no vector.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "keel/answer/server.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/model.h"
#include "keel/engine/scheduler.h"
#include "keel/engine/server.h"
#include "keel/engine/tokenizer.h"
#include "tests/answer/sse_payloads.h"
#include "tests/common/keel_process.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"
#include "tests/kvstore/redis_process.h"  // FreeLoopbackPort, PortAccepts

namespace keel::answer {
namespace {

using json = nlohmann::json;
using test::HttpTestClient;
using test::HttpTestResponse;

using Process = test::KeelProcess;
using test::ReadFile;
using test::WaitFor;

class AnswerGatewayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string d = dir_.path();
    const std::string socket = d + "/policy.sock";
    const std::string admin_key = "admin-test-key-0123456789";
    std::ofstream(d + "/admin.key") << admin_key;
    ::chmod((d + "/admin.key").c_str(), 0600);
    policy_.Start("gateway-policy --socket " + socket + " --db " + d + "/gw.db --admin-key-file " + d + "/admin.key",
                  d + "/policy.log");
    ASSERT_TRUE(WaitFor([&] { return test::PolicyAdmin(socket, admin_key, "GET", "/healthz").first == 200; }))
        << ReadFile(d + "/policy.log");
    auto key = test::PolicyAdmin(socket, admin_key, "POST", "/admin/keys", R"({"principal":"alice","team":"ml"})");
    ASSERT_EQ(key.first, 200) << key.second;
    api_key_ = json::parse(key.second).at("api_key").get<std::string>();

    auto model = engine::LoadLlama2c(test::ModelsDir() + "/en-dense6L.bin");
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::make_unique<engine::Model>(std::move(*model));
    auto tok = engine::Tokenizer::Load(test::ModelsDir() + "/tok354.bin", model_->config.vocab_size);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tokenizer_ = std::make_unique<engine::Tokenizer>(std::move(*tok));
    auto cache = engine::KvCache::Create(*model_, "raw", {});
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    cache_ = std::move(*cache);
    scheduler_ = std::make_unique<engine::Scheduler>(*model_, *tokenizer_, *cache_, engine::SchedulerOptions{});
    engine::ServerOptions so;
    so.port = 0;
    so.model_name = "en-dense6L";
    engine_ = std::make_unique<engine::Server>(*scheduler_, *tokenizer_, so);
    ASSERT_TRUE(engine_->Start().ok());

    gateway_port_ = test::FreeLoopbackPort();
    json cfg = {{"listen", {{"host", "127.0.0.1"}, {"port", gateway_port_}}},
                {"policy", {{"socket", socket}}},
                {"upstreams", {{{"name", "local"}, {"format", "keel"},
                                {"base_url", "http://127.0.0.1:" + std::to_string(engine_->port())}}}},
                {"models", {{{"name", "en-dense6L"}, {"targets", {{{"upstream", "local"}, {"model", "en-dense6L"}}}},
                             {"tokenizer", {{"path", test::ModelsDir() + "/tok354.bin"}, {"vocab_size", 354}}}}}}};
    std::ofstream(d + "/gateway.json") << cfg.dump();
    gateway_.Start("gateway --config " + d + "/gateway.json", d + "/gateway.log");
    ASSERT_TRUE(WaitFor([&] { return test::PortAccepts(gateway_port_); })) << ReadFile(d + "/gateway.log");
  }

  void TearDown() override {
    answer_.reset();
    if (engine_) engine_->Stop(true);
  }

  void StartAnswer(const std::string& key) {
    AnswerServerOptions o;
    o.vector_url = "http://127.0.0.1:1";  // never called: no request carries a vector
    o.gateway_url = "http://127.0.0.1:" + std::to_string(gateway_port_);
    o.default_model = "en-dense6L";
    o.gateway_api_key = key;
    auto s = AnswerServer::Start(corpus_, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    answer_ = std::move(*s);
  }

  HttpTestResponse Ask(const std::vector<std::pair<std::string, std::string>>& headers,
                       const std::string& body = R"({"messages":[{"role":"user","content":"Who said it?"}],"max_tokens":4})") {
    HttpTestClient c(answer_->port());
    if (!c.SendRaw(HttpTestClient::BuildRequest("POST", "/v1/chat/completions", body, "application/json", headers))) {
      return {};
    }
    HttpTestResponse r;
    c.ReadResponse(&r);
    return r;
  }

  test::TempDir dir_{"keel-answer-gw"};
  Corpus corpus_ = *Corpus::Parse("one document\n\nanother document");
  Process policy_, gateway_;
  std::string api_key_;
  int gateway_port_ = 0;
  std::unique_ptr<engine::Model> model_;
  std::unique_ptr<engine::Tokenizer> tokenizer_;
  std::unique_ptr<engine::KvCache> cache_;
  std::unique_ptr<engine::Scheduler> scheduler_;
  std::unique_ptr<engine::Server> engine_;
  std::unique_ptr<AnswerServer> answer_;
};

TEST_F(AnswerGatewayTest, AnswersThroughTheGatewayWithTheClientsOrItsOwnKey) {
  StartAnswer(api_key_);
  // No key from the client: the server's own key is used.
  HttpTestResponse own = Ask({});
  ASSERT_EQ(own.status, 200) << own.body;
  json j = json::parse(own.body);
  EXPECT_EQ(j["model"], "en-dense6L");
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_string());
  EXPECT_EQ(j["keel"]["state"], kBuiltinStateName);
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 0);
  // The client's key wins over the server's, and the gateway's 401 reaches the client as a 401.
  HttpTestResponse wrong = Ask({{"Authorization", "Bearer sk-keel-not-a-key"}});
  EXPECT_EQ(wrong.status, 401) << wrong.body;
  EXPECT_NE(wrong.body.find("gateway: "), std::string::npos) << wrong.body;
  HttpTestResponse client = Ask({{"Authorization", "Bearer " + api_key_}});
  EXPECT_EQ(client.status, 200) << client.body;
}

// Streamed through the real gateway: the same answer as without streaming, token by token (more
// than one content chunk), the usage chunk, "keel" on the finish chunk, then [DONE].
TEST_F(AnswerGatewayTest, StreamsThroughTheGatewayWithTheSameAnswer) {
  StartAnswer(api_key_);
  const std::string ask = R"({"messages":[{"role":"user","content":"Who said it?"}],"max_tokens":12)";
  HttpTestResponse whole = Ask({}, ask + "}");
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json want = json::parse(whole.body);
  HttpTestResponse r = Ask({}, ask + R"(,"stream":true,"stream_options":{"include_usage":true}})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.Header("Content-Type").rfind("text/event-stream", 0), 0u) << r.Header("Content-Type");
  std::string content;
  int content_chunks = 0;
  json usage, keel;
  for (const std::string& payload : test::SseChunksBeforeDone(r.body)) {
    const json e = json::parse(payload);
    ASSERT_FALSE(e.contains("error")) << payload;
    for (const auto& c : e["choices"]) {
      const std::string piece = c["delta"].value("content", "");
      content += piece;
      content_chunks += piece.empty() ? 0 : 1;
      if (c["finish_reason"].is_string()) {
        EXPECT_TRUE(e.contains("keel")) << payload;
      }
    }
    if (e.contains("usage") && !e["usage"].is_null()) usage = e["usage"];
    if (e.contains("keel")) keel = e["keel"];
  }
  EXPECT_EQ(content, want["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_GT(content_chunks, 1);
  EXPECT_EQ(usage["completion_tokens"], want["usage"]["completion_tokens"]);
  EXPECT_EQ(keel["state"], kBuiltinStateName);
}

// GET /v1/models is the real gateway's list for the key the answer service sends.
TEST_F(AnswerGatewayTest, ModelsComeFromTheGatewayWithTheKey) {
  StartAnswer(api_key_);
  auto get = [&](const std::string& path, const std::vector<std::pair<std::string, std::string>>& headers) {
    HttpTestClient c(answer_->port());
    HttpTestResponse r;
    if (c.SendRaw(HttpTestClient::BuildRequest("GET", path, "", "", headers))) c.ReadResponse(&r);
    return r;
  };
  HttpTestResponse list = get("/v1/models", {});
  ASSERT_EQ(list.status, 200) << list.body;
  bool found = false;
  const json models = json::parse(list.body);
  for (const auto& m : models["data"]) found = found || m["id"] == "en-dense6L";
  EXPECT_TRUE(found) << list.body;
  EXPECT_EQ(get("/v1/models/en-dense6L", {}).status, 200);
  HttpTestResponse wrong = get("/v1/models", {{"Authorization", "Bearer sk-keel-not-a-key"}});
  EXPECT_EQ(wrong.status, 401) << wrong.body;
}

TEST_F(AnswerGatewayTest, WithoutAnyKeyTheGatewayRefuses) {
  StartAnswer("");
  HttpTestResponse r = Ask({});
  EXPECT_EQ(r.status, 401) << r.body;
  EXPECT_NE(r.body.find("gateway: missing API key"), std::string::npos) << r.body;
}

}  // namespace
}  // namespace keel::answer
