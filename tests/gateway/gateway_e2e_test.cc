// End-to-end tests of `keel gateway` as users run it: real processes on loopback — the policy
// service on a Unix socket (SQLite state), one fake vendor per wire format, `keel serve` with
// the reference model, and the gateway in front of them — talking real HTTP.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "keel/core/http_server.h"
#include "tests/common/keel_process.h"
#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"
#include "tests/kvstore/redis_process.h"  // FreeLoopbackPort, PortAccepts

namespace keel::gateway {
namespace {

using nlohmann::json;

// Children's logs are checked for leaked keys; the helpers are shared with tests/answer.
using Process = test::KeelProcess;
using test::ReadFile;
using test::WaitFor;

// Events of an SSE body: (event name, data).
std::vector<std::pair<std::string, std::string>> ParseSse(const std::string& body) {
  std::vector<std::pair<std::string, std::string>> events;
  std::string event, data;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) {
      if (!data.empty() || !event.empty()) events.emplace_back(event, data);
      event.clear();
      data.clear();
    } else if (line.rfind("event:", 0) == 0) {
      event = line.substr(line.find_first_not_of(' ', 6));
    } else if (line.rfind("data:", 0) == 0) {
      if (!data.empty()) data += "\n";
      data += line.size() > 6 ? line.substr(6) : "";
    }
  }
  return events;
}

// The text a stream carried, in any client format: OpenAI chat chunks, Anthropic
// content_block_delta events, Gemini chunks or Responses output_text.delta events.
std::string StreamedText(const std::string& body) {
  std::string text;
  for (const auto& [name, data] : ParseSse(body)) {
    json j = json::parse(data, nullptr, false);
    if (!j.is_object()) continue;
    const std::string type = j.value("type", "");
    if (type == "content_block_delta" && j["delta"].is_object()) text += j["delta"].value("text", "");
    if (type == "response.output_text.delta") text += j.value("delta", "");
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty() &&
        j["choices"][0]["delta"].is_object()) {
      const json& content = j["choices"][0]["delta"]["content"];
      if (content.is_string()) text += content.get<std::string>();
    }
    if (j.contains("candidates") && j["candidates"].is_array() && !j["candidates"].empty()) {
      for (const json& part : j["candidates"][0]["content"]["parts"]) text += part.value("text", "");
    }
  }
  return text;
}

// Team names are unique per test process: with Redis counters, spend is keyed by team and
// window, and ctest runs the tests of this file as separate processes sharing one Redis.
std::string Team(const std::string& name) { return name + "-" + std::to_string(::getpid()); }

// With $KEEL_REDIS_URL (scripts/test starts a redis-server) the policy service keeps spend
// counters in Redis, as several instances would.
std::string RedisFlag() {
  const char* url = std::getenv("KEEL_REDIS_URL");
  return url != nullptr && *url != '\0' ? std::string(" --redis-url ") + url : std::string();
}

// What the fakes cannot play: an Anthropic-format vendor whose every answer is a 200 stream that
// opens with an error event (Anthropic reports errors such as overload this way once its 200 is
// out), so nothing of it can have reached the gateway's client when the error arrives.
std::atomic<int> error_stream_requests{0};
void ServeErrorStream(const HttpRequest&, HttpResponder& res) {
  ++error_stream_requests;
  if (!res.BeginStream(200, "text/event-stream", {{"request-id", "req_standin"}})) return;
  res.WriteChunk(
      "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n");
  res.EndStream();
}

class GatewayE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir("keel-gw-e2e");
    const std::string d = dir_->path();
    socket_ = d + "/policy.sock";
    admin_key_ = "admin-test-key-0123456789";
    std::ofstream(d + "/admin.key") << admin_key_;
    ::chmod((d + "/admin.key").c_str(), 0600);

    policy_ = new Process();
    policy_->Start("gateway-policy --socket " + socket_ + " --db " + d + "/gw.db --admin-key-file " + d +
                       "/admin.key --decision-ttl-ms 300" + RedisFlag(),
                   d + "/policy.log");
    ASSERT_TRUE(WaitFor([] { return test::PolicyAdmin(socket_, admin_key_, "GET", "/healthz").first == 200; }))
        << ReadFile(d + "/policy.log");

    const char* kinds[] = {"openai", "anthropic", "gemini"};
    for (int i = 0; i < 3; ++i) {
      vendor_port_[i] = test::FreeLoopbackPort();
      vendors_[i] = new Process();
      vendors_[i]->Start(std::string("fake-vendor --kind ") + kinds[i] + " --port " + std::to_string(vendor_port_[i]) +
                             " --api-key vendor-secret-" + kinds[i] + " --reply-tokens 12",
                         d + "/vendor.log");
    }
    // Paced like a real vendor: one token every 50 ms, each SSE event its own HTTP chunk.
    paced_vendor_port_ = test::FreeLoopbackPort();
    paced_vendor_ = new Process();
    paced_vendor_->Start("fake-vendor --kind openai --port " + std::to_string(paced_vendor_port_) +
                             " --api-key vendor-secret-openai --reply-tokens 20 --tokens-per-second 20",
                         d + "/vendor.log");
    keel_port_ = test::FreeLoopbackPort();
    serve_ = new Process();
    serve_->Start("serve -m " + test::ModelsDir() + "/aidreams260K.bin -z " + test::ModelsDir() +
                      "/aidreams_tok512.bin --port " + std::to_string(keel_port_),
                  d + "/serve.log");
    error_stream_vendor_ = new HttpServer(HttpServerOptions{}, ServeErrorStream);
    ASSERT_TRUE(error_stream_vendor_->Start().ok());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(WaitFor([i] { return test::PortAccepts(vendor_port_[i]); }));
    ASSERT_TRUE(WaitFor([] { return test::PortAccepts(paced_vendor_port_); }));
    ASSERT_TRUE(WaitFor([] { return test::PortAccepts(keel_port_); }));

    auto url = [](int port) { return "http://127.0.0.1:" + std::to_string(port); };
    json config = {
        {"listen", {{"host", "127.0.0.1"}, {"port", 0}, {"threads", 2}, {"client_timeout_s", 1.0},
                    {"max_body_bytes", 65536}}},
        {"policy", {{"socket", socket_}, {"timeout_s", 0.3}, {"usage_flush_s", 0.05}}},
        {"upstreams",
         {{{"name", "oa"}, {"format", "openai"}, {"base_url", url(vendor_port_[0])}, {"api_key", "vendor-secret-openai"}},
          {{"name", "an"}, {"format", "anthropic"}, {"base_url", url(vendor_port_[1])},
           {"api_key", "vendor-secret-anthropic"}},
          {{"name", "ge"}, {"format", "gemini"}, {"base_url", url(vendor_port_[2])}, {"api_key", "vendor-secret-gemini"}},
          {{"name", "keel"}, {"format", "keel"}, {"base_url", url(keel_port_)}, {"timeout_s", 30}},
          {{"name", "oa-paced"}, {"format", "openai"}, {"base_url", url(paced_vendor_port_)},
           {"api_key", "vendor-secret-openai"}},
          {{"name", "oa-short"}, {"format", "openai"}, {"base_url", url(vendor_port_[0])},
           {"api_key", "vendor-secret-openai"}, {"timeout_s", 0.5}},
          {{"name", "an-badkey"}, {"format", "anthropic"}, {"base_url", url(vendor_port_[1])}, {"api_key", "wrong"}},
          {{"name", "an-stream-error"}, {"format", "anthropic"}, {"base_url", url(error_stream_vendor_->port())},
           {"api_key", "any"}}}},
        {"models",
         {{{"name", "m-openai"}, {"targets", {{{"upstream", "oa"}, {"model", "gpt-test"}}}}},
          {{"name", "m-anthropic"}, {"targets", {{{"upstream", "an"}, {"model", "claude-test"}}}}},
          {{"name", "m-gemini"}, {"targets", {{{"upstream", "ge"}, {"model", "gemini-test"}}}}},
          {{"name", "m-tools"}, {"targets", {{{"upstream", "an"}, {"model", "claude-tools"}}}}},
          {{"name", "m-fallback"},
           {"targets",
            {{{"upstream", "oa"}, {"model", "gpt-error-429"}},
             {{"upstream", "ge"}, {"model", "gemini-error-503"}},
             {{"upstream", "an"}, {"model", "claude-ok"}}}}},
          {{"name", "m-garbage"},
           {"targets", {{{"upstream", "oa"}, {"model", "gpt-garbage"}}, {{"upstream", "an"}, {"model", "claude-garbage"}}}}},
          {{"name", "m-truncate"}, {"targets", {{{"upstream", "oa"}, {"model", "gpt-truncate"}}}}},
          {{"name", "m-paced"}, {"targets", {{{"upstream", "oa-paced"}, {"model", "gpt-test"}}}}},
          {{"name", "m-slow"}, {"targets", {{{"upstream", "oa"}, {"model", "gpt-slow"}}}}},
          // Shaped like an OpenAI fine-tune id: colons must not make a GET of it a Gemini method.
          {{"name", "ft:m-openai:acme::x1"}, {"targets", {{{"upstream", "oa"}, {"model", "gpt-test"}}}}},
          {{"name", "m-timeout"},
           {"targets", {{{"upstream", "oa-short"}, {"model", "gpt-slow"}}, {{"upstream", "an"}, {"model", "claude-ok"}}}}},
          {{"name", "m-badkey"}, {"targets", {{{"upstream", "an-badkey"}, {"model", "claude-x"}}}}},
          {{"name", "m-tools-openai"}, {"targets", {{{"upstream", "oa"}, {"model", "gpt-tools"}}}}},
          {{"name", "m-tools-gemini"}, {"targets", {{{"upstream", "ge"}, {"model", "gemini-tools"}}}}},
          {{"name", "m-429"}, {"targets", {{{"upstream", "oa"}, {"model", "gpt-error-429"}}}}},
          {{"name", "m-all-fail"},
           {"targets", {{{"upstream", "oa"}, {"model", "gpt-error-429"}}, {{"upstream", "an"}, {"model", "claude-error-500"}}}}},
          {{"name", "m-openai-then-anthropic"},
           {"targets", {{{"upstream", "oa"}, {"model", "gpt-test"}}, {{"upstream", "an"}, {"model", "claude-ok"}}}}},
          {{"name", "m-stream-error"},
           {"targets", {{{"upstream", "an-stream-error"}, {"model", "claude-x"}}, {{"upstream", "an"}, {"model", "claude-ok"}}}}},
          {{"name", "m-stream-error-only"}, {"targets", {{{"upstream", "an-stream-error"}, {"model", "claude-x"}}}}},
          // Outside team alpha's allow list ("m-*", "aidreams").
          {{"name", "x-private"}, {"targets", {{{"upstream", "oa"}, {"model", "gpt-test"}}}}},
          {{"name", "aidreams"},
           {"targets", {{{"upstream", "keel"}, {"model", "aidreams260K"}}}},
           {"tokenizer", {{"path", test::ModelsDir() + "/aidreams_tok512.bin"}, {"vocab_size", 512}}}}}}};
    std::ofstream(d + "/gw.json") << config.dump(2);
    config_ = new json(config);
    gateway_port_ = test::FreeLoopbackPort();
    gateway_ = new Process();
    gateway_->Start("gateway --config " + d + "/gw.json --port " + std::to_string(gateway_port_), d + "/gateway.log");
    ASSERT_TRUE(WaitFor([] { return test::PortAccepts(gateway_port_); })) << ReadFile(d + "/gateway.log");

    // Team "alpha" may use everything except m-gemini and gets a deny rule; team "beta" has a
    // tiny token budget.
    key_a_ = CreateKey("alice", Team("alpha"));
    key_b_ = CreateKey("bob", Team("beta"));
    key_open_ = CreateKey("olga", Team("open"));  // no policy, no budget
    auto [s1, b1] = test::PolicyAdmin(socket_, admin_key_, "PUT", "/admin/policies",
                          R"({"team":")" + Team("alpha") + R"(","allowed_models":["m-*","aidreams"],"max_tokens":64,
                              "rewrites":{"cheap":"m-openai"},
                              "deny":[{"contains":"forbidden-topic","message":"that topic is not allowed here"}]})");
    ASSERT_EQ(s1, 200) << b1;
    auto [s2, b2] = test::PolicyAdmin(socket_, admin_key_, "PUT", "/admin/budgets",
                          R"({"scope":"team","subject":")" + Team("beta") + R"(","window":"daily","limit_tokens":120})");
    ASSERT_EQ(s2, 200) << b2;
    auto [s3, b3] = test::PolicyAdmin(socket_, admin_key_, "PUT", "/admin/prices",
                          R"({"model":"gpt-test","input_per_mtok":1.0,"output_per_mtok":2.0})");
    ASSERT_EQ(s3, 200) << b3;
  }

  static void TearDownTestSuite() {
    delete gateway_;
    delete serve_;
    for (Process* p : vendors_) delete p;
    delete paced_vendor_;
    delete policy_;
    delete error_stream_vendor_;
    delete dir_;
    delete config_;
  }

  static std::string CreateKey(const std::string& principal, const std::string& team) {
    auto [status, body] = test::PolicyAdmin(socket_, admin_key_, "POST", "/admin/keys",
                                json{{"principal", principal}, {"team", team}}.dump());
    EXPECT_EQ(status, 200) << body;
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded() || !j.contains("api_key")) return "";
    key_ids_.push_back(j["key_id"].get<std::string>());
    return j["api_key"].get<std::string>();
  }

  static test::HttpTestResponse Post(const std::string& path, const std::string& body, const std::string& key,
                                     bool anthropic_header = false) {
    test::HttpTestClient http(gateway_port_);
    std::vector<std::pair<std::string, std::string>> headers;
    if (!key.empty()) headers.emplace_back(anthropic_header ? "x-api-key" : "Authorization",
                                           anthropic_header ? key : "Bearer " + key);
    test::HttpTestResponse res;
    if (!http.SendRaw(test::HttpTestClient::BuildRequest("POST", path, body, "application/json", headers))) return res;
    http.ReadResponse(&res);
    return res;
  }

  // Any method, target and headers; status 0 when no response could be read.
  static test::HttpTestResponse Send(const std::string& method, const std::string& target, const std::string& body,
                                     const std::vector<std::pair<std::string, std::string>>& headers) {
    test::HttpTestClient http(gateway_port_);
    test::HttpTestResponse res;
    if (!http.SendRaw(test::HttpTestClient::BuildRequest(method, target, body, "application/json", headers))) return res;
    http.ReadResponse(&res);
    return res;
  }

  // What Anthropic's SDK sends.
  static std::vector<std::pair<std::string, std::string>> AnthropicHeaders(const std::string& key) {
    return {{"x-api-key", key}, {"anthropic-version", "2023-06-01"}};
  }

  // The last request a fake vendor received: its JSON body.
  static json LastVendorBody(int vendor) {
    test::HttpTestClient http(vendor_port_[vendor]);
    json last = json::parse(http.Request("GET", "/_fake/last_request").body, nullptr, false);
    if (last.is_discarded() || !last.contains("body")) return json();
    return json::parse(last["body"].get<std::string>(), nullptr, false);
  }
  // Vendor API requests a fake has received so far.
  static int VendorRequests(int vendor) {
    test::HttpTestClient http(vendor_port_[vendor]);
    json stats = json::parse(http.Request("GET", "/_fake/stats").body, nullptr, false);
    return stats.is_object() ? stats.value("requests", -1) : -1;
  }

  static json Anthropic(const std::string& model, const std::string& text, bool stream = false) {
    return {{"model", model}, {"max_tokens", 32}, {"stream", stream}, {"messages", {{{"role", "user"}, {"content", text}}}}};
  }

  static json Chat(const std::string& model, const std::string& text, bool stream = false, int max_tokens = 0) {
    json req = {{"model", model}, {"messages", {{{"role", "user"}, {"content", text}}}}, {"stream", stream}};
    if (max_tokens > 0) req["max_tokens"] = max_tokens;
    return req;
  }

  static test::TempDir* dir_;
  static json* config_;
  static Process* policy_;
  static Process* vendors_[3];
  static Process* paced_vendor_;
  static int paced_vendor_port_;
  static Process* serve_;
  static Process* gateway_;
  static HttpServer* error_stream_vendor_;
  static int vendor_port_[3];
  static int keel_port_;
  static int gateway_port_;
  static std::string socket_, admin_key_, key_a_, key_b_, key_open_;
  static std::vector<std::string> key_ids_;
};

test::TempDir* GatewayE2E::dir_ = nullptr;
json* GatewayE2E::config_ = nullptr;
Process* GatewayE2E::policy_ = nullptr;
Process* GatewayE2E::vendors_[3] = {nullptr, nullptr, nullptr};
Process* GatewayE2E::paced_vendor_ = nullptr;
int GatewayE2E::paced_vendor_port_ = 0;
Process* GatewayE2E::serve_ = nullptr;
Process* GatewayE2E::gateway_ = nullptr;
HttpServer* GatewayE2E::error_stream_vendor_ = nullptr;
int GatewayE2E::vendor_port_[3] = {0, 0, 0};
int GatewayE2E::keel_port_ = 0;
int GatewayE2E::gateway_port_ = 0;
std::string GatewayE2E::socket_, GatewayE2E::admin_key_, GatewayE2E::key_a_, GatewayE2E::key_b_, GatewayE2E::key_open_;
std::vector<std::string> GatewayE2E::key_ids_;

TEST_F(GatewayE2E, MissingOrUnknownKeyIs401InTheClientsFormat) {
  auto r = Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), "");
  EXPECT_EQ(r.status, 401);
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.contains("error")) << r.body;
  EXPECT_TRUE(j["error"].contains("message"));

  json anth = {{"model", "m-openai"}, {"max_tokens", 16}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  r = Post("/v1/messages", anth.dump(), "sk-keel-not-a-real-key", /*anthropic_header=*/true);
  EXPECT_EQ(r.status, 401);
  j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j.value("type", ""), "error") << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "authentication_error") << r.body;
}

TEST_F(GatewayE2E, OpenAIClientReachesEveryVendorFormat) {
  for (const std::string model : {"m-openai", "m-anthropic", "aidreams"}) {
    auto r = Post("/v1/chat/completions", Chat(model, "Once upon a time").dump(), key_a_);
    ASSERT_EQ(r.status, 200) << model << ": " << r.body;
    json j = json::parse(r.body);
    EXPECT_EQ(j["object"], "chat.completion");
    EXPECT_EQ(j["model"], model);
    ASSERT_EQ(j["choices"].size(), 1u);
    EXPECT_FALSE(j["choices"][0]["message"]["content"].get<std::string>().empty()) << model;
    EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 0);
    EXPECT_GT(j["usage"]["completion_tokens"].get<int>(), 0);
    EXPECT_FALSE(r.Header("x-request-id").empty());
  }
}

TEST_F(GatewayE2E, TeamPolicyAllowsDeniesRewritesAndCaps) {
  // m-gemini matches "m-*", so use the key of team beta (no policy) for gemini and check alpha's
  // deny rule, rewrite and max_tokens cap.
  auto r = Post("/v1/chat/completions", Chat("m-gemini", "hello").dump(), key_b_);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["model"], "m-gemini");

  r = Post("/v1/chat/completions", Chat("m-openai", "tell me about the Forbidden-Topic please").dump(), key_a_);
  EXPECT_EQ(r.status, 403) << r.body;
  EXPECT_NE(r.body.find("that topic is not allowed here"), std::string::npos) << r.body;

  // The rule reads every text the model gets: embedding input, tool-call arguments, tool
  // definitions (each passed it once).
  r = Post("/v1/embeddings", json{{"model", "m-openai"}, {"input", {"fine", "the forbidden-topic"}}}.dump(), key_a_);
  EXPECT_EQ(r.status, 403) << r.body;
  json with_call = Chat("m-openai", "go on");
  with_call["messages"] = {{{"role", "user"}, {"content", "hi"}},
                           {{"role", "assistant"},
                            {"content", nullptr},
                            {"tool_calls",
                             {{{"id", "call_1"},
                               {"type", "function"},
                               {"function", {{"name", "look"}, {"arguments", R"({"q":"forbidden-topic"})"}}}}}}},
                           {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "ok"}}};
  r = Post("/v1/chat/completions", with_call.dump(), key_a_);
  EXPECT_EQ(r.status, 403) << r.body;
  json with_tool = Chat("m-openai", "hi");
  with_tool["tools"] = {{{"type", "function"},
                         {"function", {{"name", "look"}, {"description", "explains the forbidden-topic"},
                                       {"parameters", {{"type", "object"}}}}}}};
  r = Post("/v1/chat/completions", with_tool.dump(), key_a_);
  EXPECT_EQ(r.status, 403) << r.body;

  r = Post("/v1/chat/completions", Chat("not-allowed-model", "hi").dump(), key_a_);
  EXPECT_EQ(r.status, 403) << r.body;

  r = Post("/v1/chat/completions", Chat("cheap", "hi").dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;

  // The cap (64) reaches the vendor even when the client asks for more.
  r = Post("/v1/chat/completions", Chat("m-openai", "hi", false, 5000).dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  test::HttpTestClient vendor(vendor_port_[0]);
  auto last = vendor.Request("GET", "/_fake/last_request");
  ASSERT_EQ(last.status, 200);
  json sent = json::parse(json::parse(last.body)["body"].get<std::string>());
  EXPECT_EQ(sent["max_completion_tokens"], 64) << sent.dump();  // OpenAI's current name for the cap
  EXPECT_EQ(sent["model"], "gpt-test");
}

TEST_F(GatewayE2E, AnthropicClientStreamsFromAnOpenAIUpstream) {
  json req = {{"model", "m-openai"},
              {"max_tokens", 32},
              {"stream", true},
              {"system", "be brief"},
              {"messages", {{{"role", "user"}, {"content", "Say something"}}}}};
  auto r = Post("/v1/messages", req.dump(), key_a_, true);
  ASSERT_EQ(r.status, 200) << r.body;
  auto events = ParseSse(r.body);
  ASSERT_GE(events.size(), 4u) << r.body;
  EXPECT_EQ(events.front().first, "message_start");
  EXPECT_EQ(events.back().first, "message_stop");
  std::string text;
  bool saw_delta_usage = false;
  for (const auto& [name, data] : events) {
    json j = json::parse(data, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << data;
    EXPECT_EQ(j.value("type", ""), name);
    if (name == "content_block_delta") text += j["delta"].value("text", "");
    if (name == "message_delta") {
      saw_delta_usage = j["usage"].value("output_tokens", 0) > 0;
      EXPECT_EQ(j["delta"].value("stop_reason", ""), "end_turn");
    }
  }
  EXPECT_TRUE(saw_delta_usage) << r.body;
  // The same request without streaming gives the same text.
  req["stream"] = false;
  auto whole = Post("/v1/messages", req.dump(), key_a_, true);
  ASSERT_EQ(whole.status, 200) << whole.body;
  json w = json::parse(whole.body);
  EXPECT_EQ(w["content"][0]["text"].get<std::string>(), text);
  EXPECT_EQ(w["stop_reason"], "end_turn");
}

TEST_F(GatewayE2E, OpenAIClientStreamsFromAnthropicAndGemini) {
  for (const std::string model : {"m-anthropic", "m-gemini"}) {
    json req = Chat(model, "Say something", true);
    req["stream_options"] = {{"include_usage", true}};
    auto r = Post("/v1/chat/completions", req.dump(), key_b_);
    ASSERT_EQ(r.status, 200) << model << r.body;
    auto events = ParseSse(r.body);
    ASSERT_GE(events.size(), 3u);
    EXPECT_EQ(events.back().second, "[DONE]");
    std::string text, finish;
    bool usage = false;
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      json j = json::parse(events[i].second, nullptr, false);
      ASSERT_FALSE(j.is_discarded()) << events[i].second;
      EXPECT_EQ(j["object"], "chat.completion.chunk");
      if (j.contains("usage") && j["usage"].is_object()) usage = j["usage"]["completion_tokens"].get<int>() > 0;
      if (!j["choices"].empty()) {
        text += j["choices"][0]["delta"].value("content", "");
        if (j["choices"][0]["finish_reason"].is_string()) finish = j["choices"][0]["finish_reason"];
      }
    }
    EXPECT_FALSE(text.empty()) << model;
    EXPECT_EQ(finish, "stop") << model;
    EXPECT_TRUE(usage) << model;
  }
}

// A streamed answer goes out as the upstream paces it, not when the upstream ends. It once went
// out in one piece at the end: after each upstream chunk its trailing CRLF stayed buffered (the
// parser needs the next chunk header to use it), and those two bytes read as "more of the burst
// is already here", so the relay kept reading instead of writing. Counted in HTTP chunks the
// client receives, not in time: 20 tokens 50 ms apart arrive in about 20 writes, not 2.
TEST_F(GatewayE2E, PacedUpstreamStreamsThroughAsItArrives) {
  json chat = Chat("m-paced", "Say something", true);
  auto r = Post("/v1/chat/completions", chat.dump(), key_open_);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_GE(r.chunks.size(), 8u) << "the answer came in " << r.chunks.size() << " writes";
  EXPECT_NE(r.body.find("[DONE]"), std::string::npos);
  auto a = Send("POST", "/v1/messages", Anthropic("m-paced", "Say something", true).dump(), AnthropicHeaders(key_open_));
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_GE(a.chunks.size(), 8u) << "the answer came in " << a.chunks.size() << " writes";
  EXPECT_NE(a.body.find("message_stop"), std::string::npos);
}

TEST_F(GatewayE2E, ToolCallsTranslateBetweenFormats) {
  json req = Chat("m-tools", "weather in Paris?");
  req["tools"] = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "description": "weather for a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  auto r = Post("/v1/chat/completions", req.dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
  ASSERT_EQ(j["choices"][0]["message"]["tool_calls"].size(), 1u) << r.body;
  json call = j["choices"][0]["message"]["tool_calls"][0];
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>())["x"], 1);
  // The Anthropic upstream got the tool in its own shape.
  test::HttpTestClient vendor(vendor_port_[1]);
  json sent = json::parse(json::parse(vendor.Request("GET", "/_fake/last_request").body)["body"].get<std::string>());
  EXPECT_EQ(sent["tools"][0]["name"], "get_weather");
  EXPECT_TRUE(sent["tools"][0].contains("input_schema"));
}

TEST_F(GatewayE2E, FallsBackOn429And5xxAndReportsUpstreamGarbage) {
  auto r = Post("/v1/chat/completions", Chat("m-fallback", "hello").dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_FALSE(json::parse(r.body)["choices"][0]["message"]["content"].get<std::string>().empty());

  r = Post("/v1/chat/completions", Chat("m-garbage", "hello").dump(), key_a_);
  EXPECT_EQ(r.status, 502) << r.body;
  EXPECT_NE(r.body.find("unreadable"), std::string::npos) << r.body;

  test::HttpTestClient http(gateway_port_);
  auto metrics = http.Request("GET", "/metrics");
  EXPECT_NE(metrics.body.find("keel_gateway_fallbacks_total"), std::string::npos);
  // Still serving.
  EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
}

// A client that hangs up on a whole (non-streamed) answer takes the upstream's work with it: the
// fake's "slow" answer (5 s) sees its connection closed long before it would answer.
TEST_F(GatewayE2E, ClientLeavingAWholeAnswerAbandonsItsUpstreamRequest) {
  auto vendor_stat = [](const char* name) {
    test::HttpTestClient http(vendor_port_[0]);
    json stats = json::parse(http.Request("GET", "/_fake/stats").body, nullptr, false);
    return stats.is_object() ? stats.value(name, int64_t{-1}) : int64_t{-1};
  };
  const int64_t cancelled_before = vendor_stat("cancelled");
  {
    test::HttpTestClient c(gateway_port_);
    ASSERT_TRUE(c.SendRaw(test::HttpTestClient::BuildRequest("POST", "/v1/chat/completions",
                                                             Chat("m-slow", "hello").dump(), "application/json",
                                                             {{"Authorization", "Bearer " + key_open_}})));
    ASSERT_TRUE(WaitFor([&] { return vendor_stat("active") == 1; }));
  }  // hangs up while the upstream works
  ASSERT_TRUE(WaitFor([&] { return vendor_stat("active") == 0; }));
  // Cancelled, not answered: the fake counts an exchange whose client left before its answer.
  EXPECT_EQ(vendor_stat("cancelled"), cancelled_before + 1);
  test::HttpTestClient http(gateway_port_);
  const std::string metrics = http.Request("GET", "/metrics").body;
  EXPECT_NE(metrics.find(R"(keel_gateway_upstream_requests_total{upstream="oa",outcome="abandoned"} 1)"),
            std::string::npos) << metrics;
  EXPECT_NE(metrics.find(R"(code="499"} 1)"), std::string::npos) << metrics;
  // Still serving, and a client that stays gets its answer.
  EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_open_).status, 200);
}

TEST_F(GatewayE2E, UpstreamTimeoutFallsBackAndVendorAuthFailureIs502InTheClientsFormat) {
  auto r = Post("/v1/chat/completions", Chat("m-timeout", "hello").dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;  // the slow target timed out after 0.5 s; the next one answered

  json anth = {{"model", "m-badkey"}, {"max_tokens", 16}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  r = Post("/v1/messages", anth.dump(), key_a_, true);
  EXPECT_EQ(r.status, 502) << r.body;
  json j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j.value("type", ""), "error") << r.body;
  EXPECT_NE(r.body.find("credentials"), std::string::npos) << r.body;
}

TEST_F(GatewayE2E, ModelsAndEmbeddings) {
  test::HttpTestClient http(gateway_port_);
  test::HttpTestResponse res;
  ASSERT_TRUE(http.SendRaw(test::HttpTestClient::BuildRequest("GET", "/v1/models", "", "",
                                                              {{"Authorization", "Bearer " + key_a_}})));
  http.ReadResponse(&res);
  ASSERT_EQ(res.status, 200) << res.body;
  json models = json::parse(res.body);
  EXPECT_EQ(models["object"], "list");
  bool has_openai = false;
  for (const json& m : models["data"]) has_openai = has_openai || m["id"] == "m-openai";
  EXPECT_TRUE(has_openai) << res.body;

  json req = {{"model", "m-openai"}, {"input", {"first text", "second text"}}};
  auto r = Post("/v1/embeddings", req.dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  ASSERT_EQ(j["data"].size(), 2u);
  EXPECT_EQ(j["model"], "m-openai");
  EXPECT_FALSE(j["data"][0]["embedding"].empty());

  // An Anthropic-only model has no embeddings endpoint: a clear 400.
  req["model"] = "m-anthropic";
  r = Post("/v1/embeddings", req.dump(), key_a_);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("embeddings"), std::string::npos) << r.body;
}

TEST_F(GatewayE2E, TruncatedUpstreamStreamEndsWithAnErrorEventAndTheGatewayKeepsServing) {
  auto r = Post("/v1/chat/completions", Chat("m-truncate", "hello", true).dump(), key_a_);
  // Either the stream broke before anything was sent (502) or mid-way (an error event).
  if (r.status == 200) {
    EXPECT_NE(r.body.find("error"), std::string::npos) << r.body;
  } else {
    EXPECT_EQ(r.status, 502) << r.body;
  }
  EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
}

TEST_F(GatewayE2E, BadInputGetsClearErrors) {
  auto r = Post("/v1/chat/completions", "{not json", key_a_);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_TRUE(json::parse(r.body, nullptr, false).contains("error"));

  r = Post("/v1/chat/completions", json{{"model", "m-openai"}, {"messages", "nope"}}.dump(), key_a_);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("messages"), std::string::npos) << r.body;

  json anth = {{"model", "m-openai"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};  // no max_tokens
  r = Post("/v1/messages", anth.dump(), key_a_, true);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(json::parse(r.body, nullptr, false).value("type", ""), "error");

  r = Post("/v1/chat/completions", Chat("m-openai", std::string(100000, 'x')).dump(), key_a_);
  EXPECT_EQ(r.status, 413);

  r = Post("/v1/chat/completions", Chat("no-such-model", "hi").dump(), key_b_);
  EXPECT_EQ(r.status, 404) << r.body;

  // Header injection: a CR/LF inside a header value is malformed HTTP.
  test::HttpTestClient raw(gateway_port_);
  const std::string body = Chat("m-openai", "hi").dump();
  raw.SendRaw("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key_a_ +
              "\r\nX-Evil: a\rInjected: yes\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  test::HttpTestResponse res;
  raw.ReadResponse(&res);
  EXPECT_EQ(res.status, 400);

  // The vendor never sees client headers.
  EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
  test::HttpTestClient vendor(vendor_port_[0]);
  auto last = vendor.Request("GET", "/_fake/last_request");
  EXPECT_EQ(last.body.find(key_a_), std::string::npos);
}

// A depth bomb as large as the body limit allows is a 400 in the client's format on every JSON
// front (checked before parsing, keel/core/json_reader.h), and the gateway keeps serving.
// A Transfer-Encoding that does not end in chunked leaves the body unread by the parser; it must
// be refused, never parsed as a second request carrying its own key (request smuggling).
TEST_F(GatewayE2E, TransferCodingsOtherThanChunkedAreRefusedNotSmuggled) {
  const std::string inner = Chat("m-openai", "smuggled").dump();
  const std::string smuggled = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key_open_ +
                               "\r\nContent-Type: application/json\r\nContent-Length: " +
                               std::to_string(inner.size()) + "\r\n\r\n" + inner;
  for (const std::string coding : {"gzip", "identity"}) {
    test::HttpTestClient http(gateway_port_, 10);
    ASSERT_TRUE(http.SendRaw("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding +
                             "\r\n\r\n" + smuggled));
    test::HttpTestResponse r;
    ASSERT_TRUE(http.ReadResponse(&r)) << coding;
    EXPECT_EQ(r.status, 400) << coding << ": " << r.body;
    EXPECT_TRUE(http.WaitClosed()) << coding << ": the smuggled request was answered";
  }
}

// A gzip-compressed body is a 415 in the client's error format, not "malformed JSON at byte 8".
TEST_F(GatewayE2E, CompressedRequestBodiesAre415) {
  test::HttpTestClient http(gateway_port_, 10);
  ASSERT_TRUE(http.SendRaw("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key_open_ +
                           "\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\n"
                           "\x1f\x8b\x08\x00"));
  test::HttpTestResponse r;
  ASSERT_TRUE(http.ReadResponse(&r));
  EXPECT_EQ(r.status, 415) << r.body;
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_NE(j["error"].value("message", "").find("Content-Encoding gzip"), std::string::npos) << r.body;
}

TEST_F(GatewayE2E, JsonDepthBombsAre400OnEveryFront) {
  const std::string bomb(60000, '[');  // under listen.max_body_bytes (64 KiB)
  for (const char* path : {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/embeddings"}) {
    const bool anthropic = std::string(path) == "/v1/messages";
    auto r = Post(path, bomb, key_a_, anthropic);
    EXPECT_EQ(r.status, 400) << path << " -> " << r.body;
    json j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << path << " -> " << r.body;
    if (anthropic) {
      EXPECT_EQ(j.value("type", ""), "error") << r.body;
    }
    EXPECT_NE(r.body.find("nested deeper than"), std::string::npos) << path << " -> " << r.body;
    EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200) << "after " << path;
  }
}

// /healthz and /metrics answer GET and HEAD (no body); any other method is 405 with Allow.
TEST_F(GatewayE2E, HealthAndMetricsAreGetOrHeadOnly) {
  for (const char* path : {"/healthz", "/metrics"}) {
    for (const char* method : {"DELETE", "POST", "PUT", "BREW"}) {
      test::HttpTestClient http(gateway_port_);
      auto r = http.Request(method, path);
      EXPECT_EQ(r.status, 405) << method << " " << path << " -> " << r.body;
      EXPECT_EQ(r.Header("Allow"), "GET, HEAD") << method << " " << path;
      json j = json::parse(r.body, nullptr, false);
      ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
      EXPECT_NE(j["error"].value("message", "").find(method), std::string::npos) << r.body;
    }
    test::HttpTestClient http(gateway_port_);
    auto get = http.Request("GET", path);
    EXPECT_EQ(get.status, 200) << path;
    EXPECT_FALSE(get.body.empty()) << path;
    // HEAD: the same status and header with no body; the connection stays usable for the next request.
    ASSERT_TRUE(http.SendRaw(test::HttpTestClient::BuildRequest("HEAD", path, "", "", {})));
    test::HttpTestResponse head;
    ASSERT_TRUE(http.ReadHead(&head));
    EXPECT_EQ(head.status, 200) << path;
    if (std::string(path) == "/healthz") EXPECT_EQ(head.Header("Content-Length"), std::to_string(get.body.size()));
    EXPECT_NE(head.Header("Content-Length"), "0") << path;
    auto again = http.Request("GET", "/healthz");
    EXPECT_EQ(again.status, 200);
  }
  // Metrics counted the refusals under the route.
  test::HttpTestClient http(gateway_port_);
  EXPECT_NE(http.Request("GET", "/metrics").body.find(R"(keel_gateway_requests_total{route="/healthz",code="405"} 4)"),
            std::string::npos);
}

TEST_F(GatewayE2E, SlowClientIsDroppedWhileOthersAreServed) {
  test::HttpTestClient slow(gateway_port_);
  ASSERT_TRUE(slow.SendRaw("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo"));
  EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
  EXPECT_TRUE(slow.WaitClosed());  // client_timeout_s is 1 s
}

TEST_F(GatewayE2E, BudgetExhaustionIs429NamingTheBudgetAndSpendIsRecorded) {
  int status = 200;
  std::string body;
  for (int i = 0; i < 40 && status == 200; ++i) {
    auto r = Post("/v1/chat/completions", Chat("m-openai", "count these words please", false, 8).dump(), key_b_);
    status = r.status;
    body = r.body;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(status, 429) << body;
  EXPECT_NE(body.find("daily budget of team " + Team("beta")), std::string::npos) << body;

  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // usage flush
  auto [s, spend] = test::PolicyAdmin(socket_, admin_key_, "GET", "/admin/spend?team=beta");
  ASSERT_EQ(s, 200) << spend;
  EXPECT_NE(spend.find("tokens"), std::string::npos) << spend;
}

TEST_F(GatewayE2E, KeelServeUpstreamIsCountedWithTheModelsTokenizer) {
  json req = {{"model", "aidreams"}, {"prompt", "Once upon a time"}, {"max_tokens", 8}, {"temperature", 0}};
  auto r = Post("/v1/completions", req.dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_FALSE(j["choices"][0]["text"].get<std::string>().empty());
  EXPECT_GT(j["usage"]["completion_tokens"].get<int>(), 0);
}

// A client's seed reaches `keel serve`: the same seed gives the same sampled text through the
// gateway, another seed another text (the gateway used to drop it, so each call drew a random one).
TEST_F(GatewayE2E, SeedReachesKeelServe) {
  const std::string key = CreateKey("sam", Team("seed"));  // a team of its own: no shared budget
  auto sample = [&](int seed) {
    json req = {{"model", "aidreams"}, {"prompt", "Once upon a time"}, {"max_tokens", 24},
                {"temperature", 1.0}, {"seed", seed}};
    auto r = Post("/v1/completions", req.dump(), key);
    EXPECT_EQ(r.status, 200) << r.body;
    json j = json::parse(r.body, nullptr, false);
    return j.is_discarded() ? std::string() : j["choices"][0]["text"].get<std::string>();
  };
  const std::string a = sample(7), b = sample(7), c = sample(8);
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST_F(GatewayE2E, RevokedKeyIsRefusedWithinTheCacheTtl) {
  const std::string key = CreateKey("carol", Team("gamma"));  // beta's budget is spent by another test
  ASSERT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key).status, 200);
  auto [s, b] = test::PolicyAdmin(socket_, admin_key_, "POST", "/admin/keys/revoke", json{{"key_id", key_ids_.back()}}.dump());
  ASSERT_EQ(s, 200) << b;
  // TTL is 300 ms; allow a refresh round trip.
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  auto r = Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key);
  EXPECT_EQ(r.status, 401) << r.body;
  EXPECT_NE(r.body.find("revoked"), std::string::npos) << r.body;
}

TEST_F(GatewayE2E, TwoGatewayInstancesShareABudgetThroughThePolicyService) {
  const std::string d = dir_->path();
  const int port_b = test::FreeLoopbackPort();
  Process second;
  second.Start("gateway --config " + d + "/gw.json --port " + std::to_string(port_b), d + "/gateway-b.log");
  ASSERT_TRUE(WaitFor([port_b] { return test::PortAccepts(port_b); }));
  const std::string key = CreateKey("dave", Team("delta"));
  auto [s, b] = test::PolicyAdmin(socket_, admin_key_, "PUT", "/admin/budgets",
                      R"({"scope":"team","subject":")" + Team("delta") + R"(","window":"monthly","limit_tokens":100})");
  ASSERT_EQ(s, 200) << b;
  // Spend the whole budget through the first gateway.
  int status = 200;
  for (int i = 0; i < 30 && status == 200; ++i) {
    status = Post("/v1/chat/completions", Chat("m-openai", "spend some tokens", false, 8).dump(), key).status;
  }
  ASSERT_EQ(status, 429);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // usage flushed, TTL passed
  // The second instance never served this key: its first decision already carries the spend.
  test::HttpTestClient http(port_b);
  test::HttpTestResponse res;
  const std::string body = Chat("m-openai", "spend some tokens", false, 8).dump();
  ASSERT_TRUE(http.SendRaw(test::HttpTestClient::BuildRequest("POST", "/v1/chat/completions", body,
                                                              "application/json", {{"Authorization", "Bearer " + key}})));
  http.ReadResponse(&res);
  EXPECT_EQ(res.status, 429) << res.body;
  EXPECT_NE(res.body.find("budget of team " + Team("delta")), std::string::npos) << res.body;
}

TEST_F(GatewayE2E, UsageFromEveryGatewayProcessIsCountedOnce) {
  // A second gateway process numbers its requests from scratch; its usage must still count
  // (request ids are unique per process, so the policy service's dedupe keeps both).
  const std::string d = dir_->path();
  ASSERT_EQ(Post("/v1/chat/completions", Chat("m-openai", "warm up the first gateway").dump(), key_a_).status, 200);
  const int port_b = test::FreeLoopbackPort();
  Process second;
  second.Start("gateway --config " + d + "/gw.json --port " + std::to_string(port_b), d + "/gateway-b2.log");
  ASSERT_TRUE(WaitFor([port_b] { return test::PortAccepts(port_b); }));
  const std::string team = Team("epsilon");
  const std::string key = CreateKey("erin", team);
  int64_t expected = 0;
  for (int port : {gateway_port_, port_b}) {
    test::HttpTestClient http(port);
    test::HttpTestResponse res;
    const std::string body = Chat("m-openai", "count me once").dump();
    ASSERT_TRUE(http.SendRaw(test::HttpTestClient::BuildRequest("POST", "/v1/chat/completions", body,
                                                                "application/json", {{"Authorization", "Bearer " + key}})));
    http.ReadResponse(&res);
    ASSERT_EQ(res.status, 200) << res.body;
    expected += json::parse(res.body)["usage"]["total_tokens"].get<int64_t>();
  }
  int64_t recorded = -1;
  for (int i = 0; i < 50 && recorded != expected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto [s, spend] = test::PolicyAdmin(socket_, admin_key_, "GET", "/admin/spend?team=" + team);
    ASSERT_EQ(s, 200) << spend;
    recorded = json::parse(spend)["daily"]["tokens"].get<int64_t>();
  }
  EXPECT_EQ(recorded, expected);
}

TEST_F(GatewayE2E, SigtermDeliversSettledUsageBeforeExit) {
  // A gateway that would only report usage once a minute still reports it when stopped.
  const std::string d = dir_->path();
  json config = *config_;
  config["policy"]["usage_flush_s"] = 60;
  std::ofstream(d + "/gw-slowflush.json") << config.dump(2);
  const int port = test::FreeLoopbackPort();
  Process gw;
  gw.Start("gateway --config " + d + "/gw-slowflush.json --port " + std::to_string(port), d + "/gateway-c.log");
  ASSERT_TRUE(WaitFor([port] { return test::PortAccepts(port); }));
  const std::string team = Team("zeta");
  const std::string key = CreateKey("zoe", team);
  test::HttpTestClient http(port);
  test::HttpTestResponse res;
  const std::string body = Chat("m-openai", "remember me").dump();
  ASSERT_TRUE(http.SendRaw(test::HttpTestClient::BuildRequest("POST", "/v1/chat/completions", body, "application/json",
                                                              {{"Authorization", "Bearer " + key}})));
  http.ReadResponse(&res);
  ASSERT_EQ(res.status, 200) << res.body;
  const int64_t tokens = json::parse(res.body)["usage"]["total_tokens"].get<int64_t>();
  auto [s0, before] = test::PolicyAdmin(socket_, admin_key_, "GET", "/admin/spend?team=" + team);
  ASSERT_EQ(s0, 200) << before;
  EXPECT_EQ(json::parse(before)["daily"]["tokens"].get<int64_t>(), 0);  // not flushed yet
  gw.Terminate();
  auto [s1, after] = test::PolicyAdmin(socket_, admin_key_, "GET", "/admin/spend?team=" + team);
  ASSERT_EQ(s1, 200) << after;
  EXPECT_EQ(json::parse(after)["daily"]["tokens"].get<int64_t>(), tokens);
}

// popen() a command and return its stdout.
std::string RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = ::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

TEST_F(GatewayE2E, ServesTlsWhenConfigured) {
  const std::string d = dir_->path();
  const std::string gen = "openssl req -x509 -newkey rsa:2048 -nodes -keyout " + d + "/key.pem -out " + d +
                          "/cert.pem -days 1 -subj /CN=localhost -addext subjectAltName=DNS:localhost 2>&1";
  RunCommand(gen);
  ASSERT_FALSE(ReadFile(d + "/cert.pem").empty()) << "openssl could not make a certificate";
  json config = *config_;
  config["listen"]["tls_cert"] = d + "/cert.pem";
  config["listen"]["tls_key"] = d + "/key.pem";
  std::ofstream(d + "/gw-tls.json") << config.dump(2);
  const int port = test::FreeLoopbackPort();
  Process tls;
  tls.Start("gateway --config " + d + "/gw-tls.json --port " + std::to_string(port), d + "/gateway-tls.log");
  ASSERT_TRUE(WaitFor([port] { return test::PortAccepts(port); })) << ReadFile(d + "/gateway-tls.log");

  const std::string body = Chat("m-openai", "over tls").dump();
  std::ofstream(d + "/tls-body.json") << body;
  const std::string out =
      RunCommand("curl -s --max-time 10 --cacert " + d + "/cert.pem -w '\n%{http_code}' -H 'Authorization: Bearer " + key_a_ +
          "' -H 'Content-Type: application/json' --data-binary @" + d + "/tls-body.json https://localhost:" +
          std::to_string(port) + "/v1/chat/completions");
  const size_t nl = out.rfind('\n');
  ASSERT_NE(nl, std::string::npos) << out;
  EXPECT_EQ(out.substr(nl + 1), "200") << out;
  json j = json::parse(out.substr(0, nl), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["object"], "chat.completion");
  // Plain HTTP to the TLS port gets no HTTP answer.
  test::HttpTestClient plain(port, 5);
  auto res = plain.Request("GET", "/healthz");
  EXPECT_NE(res.status, 200);
}

// ---- Issue 22: streamed upstream errors, new routes, headers, 413, structured output.

// A streamed request whose first targets answer errors with a Content-Length body (429 from
// OpenAI, 503 from Gemini) moves on to the next target, which streams the answer (the client's
// HTTP code used to be a 504 "exceeds 67108864 bytes" and the fallback was never tried).
TEST_F(GatewayE2E, StreamedRequestFallsBackPastUpstreamErrorBodies) {
  for (const bool anthropic_client : {false, true}) {
    const json req = anthropic_client ? Anthropic("m-fallback", "hello there", true) : Chat("m-fallback", "hello there", true);
    auto r = Post(anthropic_client ? "/v1/messages" : "/v1/chat/completions", req.dump(), key_a_, anthropic_client);
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_TRUE(r.chunked);
    EXPECT_EQ(StreamedText(r.body).rfind("hello there", 0), 0u) << r.body;  // the fake echoes the prompt
    const auto events = ParseSse(r.body);
    ASSERT_FALSE(events.empty());
    EXPECT_EQ(anthropic_client ? events.back().first : events.back().second,
              anthropic_client ? "message_stop" : "[DONE]") << r.body;
    const json sent = LastVendorBody(1);  // the Anthropic fake streamed it
    EXPECT_EQ(sent.value("model", ""), "claude-ok") << sent.dump();
    EXPECT_EQ(sent.value("stream", false), true) << sent.dump();
  }
}

// When no target answers, a streamed request gets the last upstream error as a plain response in
// the client's own format, with the vendor's status and message.
TEST_F(GatewayE2E, StreamedRequestGetsTheUpstreamErrorInTheClientsFormat) {
  // One target, a 429: OpenAI's error JSON for an OpenAI client, Anthropic's for an Anthropic one.
  auto r = Post("/v1/chat/completions", Chat("m-429", "hi", true).dump(), key_a_);
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_FALSE(r.chunked);
  EXPECT_EQ(r.Header("retry-after"), "1");  // the vendor's, so SDKs wait as long as it asked
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "rate_limit_error") << r.body;
  EXPECT_NE(j["error"].value("message", "").find("Rate limit reached"), std::string::npos) << r.body;  // the vendor's

  r = Post("/v1/messages", Anthropic("m-429", "hi", true).dump(), key_a_, true);
  EXPECT_EQ(r.status, 429) << r.body;
  j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.body;
  EXPECT_EQ(j.value("type", ""), "error") << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "rate_limit_error") << r.body;
  EXPECT_NE(j["error"].value("message", "").find("Rate limit reached"), std::string::npos) << r.body;

  // 429 then 500: the fallback is tried, and its error is the one the client gets.
  r = Post("/v1/chat/completions", Chat("m-all-fail", "hi", true).dump(), key_a_);
  EXPECT_EQ(r.status, 500) << r.body;
  j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "server_error") << r.body;
  EXPECT_NE(j["error"].value("message", "").find("Internal server error"), std::string::npos) << r.body;
  EXPECT_EQ(LastVendorBody(1).value("model", ""), "claude-error-500");

  // A 400 is the client's own error: answered at once, the next target is not tried. (OpenAI
  // refuses json_object mode when the messages never say "json".)
  const int anthropic_before = VendorRequests(1);
  json bad = Chat("m-openai-then-anthropic", "hi there", true);
  bad["response_format"] = {{"type", "json_object"}};
  r = Post("/v1/chat/completions", bad.dump(), key_a_);
  EXPECT_EQ(r.status, 400) << r.body;
  j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "invalid_request_error") << r.body;
  EXPECT_NE(j["error"].value("message", "").find("json"), std::string::npos) << r.body;
  EXPECT_EQ(VendorRequests(1), anthropic_before);
}

// An error event that opens the vendor's 200 stream (nothing reached the client yet) is a
// failed attempt like an error status: it keeps its kind (overloaded -> retryable) and falls back.
TEST_F(GatewayE2E, InStreamVendorErrorBeforeAnyByteFallsBackOrReachesTheClient) {
  const int before = error_stream_requests.load();
  auto r = Post("/v1/chat/completions", Chat("m-stream-error", "hello there", true).dump(), key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(StreamedText(r.body).rfind("hello there", 0), 0u) << r.body;
  EXPECT_EQ(r.body.find("Overloaded"), std::string::npos) << r.body;  // nothing of the failed attempt
  EXPECT_EQ(error_stream_requests.load(), before + 1);

  // With no other target: the overload, as a plain error response in the client's format.
  r = Post("/v1/chat/completions", Chat("m-stream-error-only", "hi", true).dump(), key_a_);
  EXPECT_EQ(r.status, 503) << r.body;
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_EQ(j["error"].value("code", ""), "overloaded") << r.body;
  EXPECT_NE(j["error"].value("message", "").find("Overloaded"), std::string::npos) << r.body;

  r = Post("/v1/messages", Anthropic("m-stream-error-only", "hi", true).dump(), key_a_, true);
  EXPECT_EQ(r.status, 529) << r.body;  // Anthropic's own status for overloaded_error
  j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.body;
  EXPECT_EQ(j.value("type", ""), "error") << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "overloaded_error") << r.body;
  EXPECT_EQ(error_stream_requests.load(), before + 3);
}

TEST_F(GatewayE2E, ModelByIdAndAnthropicShapedModelLists) {
  const std::vector<std::pair<std::string, std::string>> bearer = {{"Authorization", "Bearer " + key_a_}};
  auto r = Send("GET", "/v1/models/m-openai", "", bearer);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j.value("id", ""), "m-openai") << r.body;
  EXPECT_EQ(j.value("object", ""), "model") << r.body;
  EXPECT_TRUE(j.contains("created") && j["created"].is_number_integer()) << r.body;
  EXPECT_TRUE(j.contains("owned_by") && j["owned_by"].is_string()) << r.body;

  // Unknown, and outside the team's allow list (which exists, for another team): the same 404.
  for (const std::string id : {"no-such-model", "x-private"}) {
    r = Send("GET", "/v1/models/" + id, "", bearer);
    EXPECT_EQ(r.status, 404) << id << ": " << r.body;
    j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
    EXPECT_EQ(j["error"].value("code", ""), "model_not_found") << r.body;
    EXPECT_NE(j["error"].value("message", "").find(id), std::string::npos) << r.body;
  }
  r = Send("GET", "/v1/models/x-private", "", {{"Authorization", "Bearer " + key_open_}});
  EXPECT_EQ(r.status, 200) << r.body;

  // With anthropic-version, Anthropic's shapes.
  r = Send("GET", "/v1/models", "", AnthropicHeaders(key_a_));
  ASSERT_EQ(r.status, 200) << r.body;
  j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["data"].is_array() && !j["data"].empty()) << r.body;
  EXPECT_FALSE(j.contains("object")) << r.body;
  EXPECT_EQ(j.value("has_more", true), false) << r.body;
  EXPECT_EQ(j["first_id"], j["data"].front()["id"]) << r.body;
  EXPECT_EQ(j["last_id"], j["data"].back()["id"]) << r.body;
  bool has_anthropic = false, has_private = false;
  for (const json& m : j["data"]) {
    EXPECT_EQ(m.value("type", ""), "model") << m.dump();
    EXPECT_TRUE(m["display_name"].is_string()) << m.dump();
    EXPECT_TRUE(m["created_at"].is_string()) << m.dump();
    has_anthropic = has_anthropic || m["id"] == "m-anthropic";
    has_private = has_private || m["id"] == "x-private";
  }
  EXPECT_TRUE(has_anthropic) << r.body;
  EXPECT_FALSE(has_private) << r.body;  // the list honours the allow list too

  r = Send("GET", "/v1/models/m-anthropic", "", AnthropicHeaders(key_a_));
  ASSERT_EQ(r.status, 200) << r.body;
  j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j.value("type", ""), "model") << r.body;
  EXPECT_EQ(j.value("id", ""), "m-anthropic") << r.body;
  EXPECT_TRUE(j["display_name"].is_string() && j["created_at"].is_string()) << r.body;
  r = Send("GET", "/v1/models/no-such-model", "", AnthropicHeaders(key_a_));
  EXPECT_EQ(r.status, 404) << r.body;
  EXPECT_EQ(json::parse(r.body, nullptr, false).value("type", ""), "error") << r.body;
}

TEST_F(GatewayE2E, AnthropicCountTokensCountsUnderPolicyAndAuth) {
  // count_tokens bodies have no max_tokens.
  auto count = [](const std::string& model, const std::string& text, const std::string& key) {
    json req = {{"model", model}, {"system", "be brief"}, {"messages", {{{"role", "user"}, {"content", text}}}}};
    return Send("POST", "/v1/messages/count_tokens", req.dump(), AnthropicHeaders(key));
  };
  auto r = count("m-anthropic", "How many tokens is this?", key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["input_tokens"].is_number_integer()) << r.body;
  const int64_t short_count = j["input_tokens"].get<int64_t>();
  EXPECT_GT(short_count, 0);
  EXPECT_EQ(j.size(), 1u) << r.body;

  std::string longer;
  for (int i = 0; i < 50; ++i) longer += "How many tokens is this? ";
  r = count("m-anthropic", longer, key_a_);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_GT(json::parse(r.body)["input_tokens"].get<int64_t>(), short_count + 100) << r.body;

  r = count("x-private", "hi", key_a_);  // outside alpha's allow list
  EXPECT_EQ(r.status, 403) << r.body;
  j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j.value("type", ""), "error") << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "permission_error") << r.body;

  for (const std::string& key : {std::string(), std::string("sk-keel-not-a-real-key")}) {
    r = count("m-anthropic", "hi", key);
    EXPECT_EQ(r.status, 401) << r.body;
    j = json::parse(r.body, nullptr, false);
    EXPECT_EQ(j.value("type", ""), "error") << r.body;
    EXPECT_EQ(j["error"].value("type", ""), "authentication_error") << r.body;
  }
}

// OpenAI's SDKs read x-request-id, Anthropic's request-id: one id under both names on every answer.
TEST_F(GatewayE2E, EveryAnswerCarriesTheRequestIdUnderBothNames) {
  std::vector<std::pair<std::string, test::HttpTestResponse>> answers;
  answers.emplace_back("200", Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_));
  answers.emplace_back("streamed 200", Post("/v1/messages", Anthropic("m-openai", "hi", true).dump(), key_a_, true));
  answers.emplace_back("401", Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), ""));
  answers.emplace_back("404", Post("/v1/chat/completions", Chat("no-such-model", "hi").dump(), key_a_));
  answers.emplace_back("400", Post("/v1/messages", Chat("m-openai", "hi").dump(), key_a_, true));  // no max_tokens
  answers.emplace_back("models", Send("GET", "/v1/models", "", {{"Authorization", "Bearer " + key_a_}}));
  answers.emplace_back("upstream 429", Post("/v1/chat/completions", Chat("m-429", "hi", true).dump(), key_a_));
  std::set<std::string> ids;
  for (const auto& [what, r] : answers) {
    EXPECT_NE(r.status, 0) << what;
    const std::string id = r.Header("x-request-id");
    EXPECT_FALSE(id.empty()) << what << " (" << r.status << ")";
    EXPECT_EQ(r.Header("request-id"), id) << what << " (" << r.status << ")";
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), answers.size());  // one id per request
  EXPECT_EQ(answers[1].second.status, 200);
  EXPECT_TRUE(answers[1].second.chunked);
}

// SDKs retry a 429 by default: a budget refusal says when the budget's window rolls over
// (retry-after) and whether retrying is worth it at all (x-should-retry).
TEST_F(GatewayE2E, BudgetRefusalSaysWhenToRetry) {
  const std::string team = Team("eta");
  const std::string key = CreateKey("eve", team);
  auto [s, b] = test::PolicyAdmin(socket_, admin_key_, "PUT", "/admin/budgets",
                      R"({"scope":"team","subject":")" + team + R"(","window":"daily","limit_tokens":100})");
  ASSERT_EQ(s, 200) << b;

  // The daily window rolls over at the next UTC midnight.
  auto seconds_to_midnight = [] { return 86400 - static_cast<int64_t>(std::time(nullptr)) % 86400; };

  // A request larger than the whole budget never fits, even in a fresh window: do not retry.
  auto r = Post("/v1/chat/completions", Chat("m-openai", "hi", false, 1000).dump(), key);
  ASSERT_EQ(r.status, 429) << r.body;
  EXPECT_NEAR(static_cast<double>(std::atoll(r.Header("retry-after").c_str())),
              static_cast<double>(seconds_to_midnight()), 5.0) << r.Header("retry-after");
  EXPECT_EQ(r.Header("x-should-retry"), "false");
  EXPECT_FALSE(r.Header("x-request-id").empty());
  EXPECT_EQ(json::parse(r.body, nullptr, false)["error"].value("type", ""), "rate_limit_error") << r.body;

  // A spent budget: the request fits again when the window rolls over.
  int status = 200;
  for (int i = 0; i < 40 && status == 200; ++i) {
    r = Post("/v1/chat/completions", Chat("m-openai", "spend it", false, 8).dump(), key);
    status = r.status;
  }
  ASSERT_EQ(status, 429) << r.body;
  const std::string retry_after = r.Header("retry-after");
  ASSERT_FALSE(retry_after.empty()) << r.body;
  const int64_t seconds = std::atoll(retry_after.c_str());
  EXPECT_GE(seconds, 1);
  EXPECT_NEAR(static_cast<double>(seconds), static_cast<double>(seconds_to_midnight()), 5.0) << retry_after;
  // Worth retrying only when the window rolls over within an SDK's backoff (a minute), which a
  // daily window almost never does.
  EXPECT_EQ(r.Header("x-should-retry"), seconds <= 60 ? "true" : "false") << retry_after;

  // The same through the Anthropic front.
  r = Post("/v1/messages", Anthropic("m-openai", "spend it").dump(), key, true);
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_FALSE(r.Header("retry-after").empty());
  EXPECT_FALSE(r.Header("x-should-retry").empty());
  EXPECT_EQ(json::parse(r.body, nullptr, false)["error"].value("type", ""), "rate_limit_error") << r.body;
}

// POST /v1/responses to each vendor format, whole: a Response object with one output_text.
TEST_F(GatewayE2E, ResponsesApiReachesEveryVendor) {
  for (const std::string model : {"m-openai", "m-anthropic", "m-gemini"}) {
    json req = {{"model", model}, {"input", "tell me a story"}, {"instructions", "be brief"}, {"max_output_tokens", 64}};
    auto r = Post("/v1/responses", req.dump(), key_open_);
    ASSERT_EQ(r.status, 200) << model << ": " << r.body;
    EXPECT_FALSE(r.Header("x-request-id").empty());
    json j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.body;
    EXPECT_EQ(j.value("object", ""), "response") << r.body;
    EXPECT_EQ(j.value("status", ""), "completed") << r.body;
    EXPECT_EQ(j.value("model", ""), model) << r.body;
    EXPECT_EQ(j.value("instructions", ""), "be brief") << r.body;
    EXPECT_EQ(j["id"].get<std::string>().rfind("resp_", 0), 0u) << r.body;
    ASSERT_TRUE(j["output"].is_array() && !j["output"].empty()) << r.body;
    const json& item = j["output"][0];
    EXPECT_EQ(item.value("type", ""), "message") << r.body;
    EXPECT_EQ(item.value("role", ""), "assistant") << r.body;
    ASSERT_TRUE(item["content"].is_array() && !item["content"].empty()) << r.body;
    EXPECT_EQ(item["content"][0].value("type", ""), "output_text") << r.body;
    EXPECT_EQ(item["content"][0].value("text", "").rfind("tell me a story", 0), 0u) << r.body;
    ASSERT_TRUE(j["usage"].is_object()) << r.body;
    EXPECT_GT(j["usage"].value("input_tokens", 0), 0) << r.body;
    EXPECT_GT(j["usage"].value("output_tokens", 0), 0) << r.body;
    EXPECT_EQ(j["usage"].value("total_tokens", 0),
              j["usage"].value("input_tokens", 0) + j["usage"].value("output_tokens", 0));
  }
  // The instructions reached the vendor as its system prompt.
  EXPECT_NE(LastVendorBody(2).dump().find("be brief"), std::string::npos);
}

// The Responses event stream: created first, completed last with usage, sequence numbers rising,
// deltas joining to the same text as the whole answer.
TEST_F(GatewayE2E, ResponsesApiStreamsFromEveryVendor) {
  for (const std::string model : {"m-openai", "m-anthropic", "m-gemini"}) {
    json req = {{"model", model}, {"input", "tell me a story"}, {"stream", true}};
    auto r = Post("/v1/responses", req.dump(), key_open_);
    ASSERT_EQ(r.status, 200) << model << ": " << r.body;
    EXPECT_TRUE(r.chunked);
    EXPECT_NE(r.Header("Content-Type").find("text/event-stream"), std::string::npos);
    const auto events = ParseSse(r.body);
    ASSERT_GE(events.size(), 4u) << r.body;
    EXPECT_EQ(events.front().first, "response.created") << r.body;
    EXPECT_EQ(events.back().first, "response.completed") << r.body;
    int64_t last_seq = -1;
    for (const auto& [name, data] : events) {
      json j = json::parse(data, nullptr, false);
      ASSERT_TRUE(j.is_object()) << data;
      EXPECT_EQ(j.value("type", ""), name);
      ASSERT_TRUE(j["sequence_number"].is_number_integer()) << data;
      ASSERT_GT(j["sequence_number"].get<int64_t>(), last_seq) << data;
      last_seq = j["sequence_number"].get<int64_t>();
    }
    const json done = json::parse(events.back().second);
    EXPECT_EQ(done["response"].value("status", ""), "completed") << model;
    EXPECT_GT(done["response"]["usage"].value("output_tokens", 0), 0) << events.back().second;
    const std::string text = StreamedText(r.body);
    EXPECT_EQ(text.rfind("tell me a story", 0), 0u) << r.body;
    EXPECT_EQ(done["response"]["output"][0]["content"][0].value("text", ""), text) << model;
    req["stream"] = false;
    auto whole = Post("/v1/responses", req.dump(), key_open_);
    ASSERT_EQ(whole.status, 200) << whole.body;
    EXPECT_EQ(json::parse(whole.body)["output"][0]["content"][0].value("text", ""), text) << model;
  }
}

// A function tool through /v1/responses: the call comes back as a function_call item, and its
// output sent back (function_call + function_call_output items) gets the model's text answer.
TEST_F(GatewayE2E, ResponsesApiFunctionToolRoundTrip) {
  const json tools = json::parse(R"([{"type": "function", "name": "get_weather", "description": "weather for a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])");
  const std::pair<std::string, int> models[] = {{"m-tools", 1}, {"m-tools-openai", 0}, {"m-tools-gemini", 2}};
  for (const auto& [model, vendor] : models) {
    json req = {{"model", model}, {"input", "weather in Paris?"}, {"tools", tools}};
    auto r = Post("/v1/responses", req.dump(), key_open_);
    ASSERT_EQ(r.status, 200) << model << ": " << r.body;
    json j = json::parse(r.body);
    json call;
    for (const json& item : j["output"]) {
      if (item.value("type", "") == "function_call") call = item;
    }
    ASSERT_TRUE(call.is_object()) << model << ": " << r.body;
    EXPECT_EQ(call.value("name", ""), "get_weather") << r.body;
    EXPECT_EQ(json::parse(call.value("arguments", "null"), nullptr, false), json({{"x", 1}})) << r.body;
    const std::string call_id = call.value("call_id", "");
    ASSERT_FALSE(call_id.empty()) << r.body;

    req["input"] = json::array({{{"role", "user"}, {"content", "weather in Paris?"}},
                                {{"type", "function_call"}, {"call_id", call_id}, {"name", "get_weather"},
                                 {"arguments", call["arguments"]}},
                                {{"type", "function_call_output"}, {"call_id", call_id}, {"output", "sunny, 21 C"}}});
    r = Post("/v1/responses", req.dump(), key_open_);
    ASSERT_EQ(r.status, 200) << model << ": " << r.body;
    j = json::parse(r.body);
    ASSERT_FALSE(j["output"].empty()) << r.body;
    EXPECT_EQ(j["output"][0].value("type", ""), "message") << model << ": " << r.body;
    EXPECT_EQ(j["output"][0]["content"][0].value("type", ""), "output_text") << r.body;
    EXPECT_FALSE(j["output"][0]["content"][0].value("text", "").empty()) << r.body;
    // The vendor got the tool's result, in its own format.
    EXPECT_NE(LastVendorBody(vendor).dump().find("sunny, 21 C"), std::string::npos) << model;
  }
}

TEST_F(GatewayE2E, ResponsesApiRefusesStatefulRequestsInOpenAIsShape) {
  json req = {{"model", "m-openai"}, {"input", "and then?"}, {"previous_response_id", "resp_123"}};
  auto r = Post("/v1/responses", req.dump(), key_open_);
  EXPECT_EQ(r.status, 400) << r.body;
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "invalid_request_error") << r.body;
  EXPECT_NE(j["error"].value("message", "").find("previous_response_id"), std::string::npos) << r.body;
  // Auth applies to the route as to chat.
  r = Post("/v1/responses", json{{"model", "m-openai"}, {"input", "hi"}}.dump(), "sk-keel-not-a-real-key");
  EXPECT_EQ(r.status, 401) << r.body;
  EXPECT_TRUE(json::parse(r.body, nullptr, false)["error"].is_object()) << r.body;
}

// Gemini SDK users switch by pointing at the gateway: generateContent and streamGenerateContent
// with a virtual model in the URL, answered from OpenAI and Anthropic upstreams in Gemini's shapes.
TEST_F(GatewayE2E, GeminiFrontReachesOpenAIAndAnthropicUpstreams) {
  const json body = {{"contents", {{{"role", "user"}, {"parts", {{{"text", "tell me a story"}}}}}}},
                     {"systemInstruction", {{"parts", {{{"text", "be brief"}}}}}},
                     {"generationConfig", {{"maxOutputTokens", 64}}}};
  const std::vector<std::pair<std::string, std::string>> goog = {{"x-goog-api-key", key_open_}};
  for (const std::string model : {"m-openai", "m-anthropic"}) {
    auto r = Send("POST", "/v1beta/models/" + model + ":generateContent", body.dump(), goog);
    ASSERT_EQ(r.status, 200) << model << ": " << r.body;
    json j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j["candidates"].is_array() && !j["candidates"].empty()) << r.body;
    const json& cand = j["candidates"][0];
    EXPECT_EQ(cand["content"].value("role", ""), "model") << r.body;
    const std::string text = cand["content"]["parts"][0].value("text", "");
    EXPECT_EQ(text.rfind("tell me a story", 0), 0u) << r.body;
    EXPECT_EQ(cand.value("finishReason", ""), "STOP") << r.body;
    ASSERT_TRUE(j["usageMetadata"].is_object()) << r.body;
    EXPECT_GT(j["usageMetadata"].value("promptTokenCount", 0), 0) << r.body;
    EXPECT_GT(j["usageMetadata"].value("candidatesTokenCount", 0), 0) << r.body;
    EXPECT_EQ(j.value("modelVersion", ""), model) << r.body;
    EXPECT_FALSE(r.Header("x-request-id").empty());

    // The key as ?key= works too (the REST examples' way).
    r = Send("POST", "/v1beta/models/" + model + ":generateContent?key=" + key_open_, body.dump(), {});
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["candidates"][0]["content"]["parts"][0].value("text", ""), text);

    // Streamed as SSE chunks, the last one with finishReason and usage.
    r = Send("POST", "/v1beta/models/" + model + ":streamGenerateContent?alt=sse", body.dump(), goog);
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_NE(r.Header("Content-Type").find("text/event-stream"), std::string::npos);
    const auto events = ParseSse(r.body);
    ASSERT_GE(events.size(), 2u) << r.body;
    for (const auto& [name, data] : events) {
      json chunk = json::parse(data, nullptr, false);
      ASSERT_TRUE(chunk.is_object() && chunk["candidates"].is_array()) << data;
    }
    const json last = json::parse(events.back().second);
    EXPECT_EQ(last["candidates"][0].value("finishReason", ""), "STOP") << r.body;
    EXPECT_GT(last["usageMetadata"].value("candidatesTokenCount", 0), 0) << r.body;
    EXPECT_EQ(StreamedText(r.body), text) << r.body;
  }
  // The system instruction reached the vendor.
  EXPECT_NE(LastVendorBody(1).dump().find("be brief"), std::string::npos);
}

TEST_F(GatewayE2E, GeminiFrontCountsTokensListsModelsAndRefusesUnknownKeys) {
  auto contents = [](const std::string& text) {
    return json{{"contents", {{{"role", "user"}, {"parts", {{{"text", text}}}}}}}};
  };
  const std::vector<std::pair<std::string, std::string>> goog = {{"x-goog-api-key", key_open_}};
  auto r = Send("POST", "/v1beta/models/m-openai:countTokens", contents("how many tokens").dump(), goog);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["totalTokens"].is_number_integer()) << r.body;
  const int64_t short_count = j["totalTokens"].get<int64_t>();
  EXPECT_GT(short_count, 0);
  std::string longer;
  for (int i = 0; i < 50; ++i) longer += "how many tokens ";
  r = Send("POST", "/v1beta/models/m-openai:countTokens", contents(longer).dump(), goog);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_GT(json::parse(r.body)["totalTokens"].get<int64_t>(), short_count + 50) << r.body;

  r = Send("GET", "/v1beta/models", "", goog);
  ASSERT_EQ(r.status, 200) << r.body;
  j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["models"].is_array()) << r.body;
  bool listed = false;
  for (const json& m : j["models"]) listed = listed || m.value("name", "") == "models/m-anthropic";
  EXPECT_TRUE(listed) << r.body;

  // Unknown and missing keys: 401 in Gemini's error shape, on every Gemini route.
  for (const std::string target : {"/v1beta/models/m-openai:generateContent", "/v1beta/models/m-openai:countTokens",
                                   "/v1beta/models/m-openai:streamGenerateContent?alt=sse"}) {
    for (const std::string& key : {std::string("sk-keel-not-a-real-key"), std::string()}) {
      std::vector<std::pair<std::string, std::string>> headers;
      if (!key.empty()) headers.emplace_back("x-goog-api-key", key);
      r = Send("POST", target, contents("hi").dump(), headers);
      EXPECT_EQ(r.status, 401) << target << ": " << r.body;
      j = json::parse(r.body, nullptr, false);
      ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
      EXPECT_EQ(j["error"].value("code", 0), 401) << r.body;
      EXPECT_EQ(j["error"].value("status", ""), "UNAUTHENTICATED") << r.body;
      EXPECT_FALSE(j["error"].value("message", "").empty()) << r.body;
    }
  }
  r = Send("GET", "/v1beta/models?key=sk-keel-not-a-real-key", "", {});
  EXPECT_EQ(r.status, 401) << r.body;
  EXPECT_EQ(json::parse(r.body, nullptr, false)["error"].value("status", ""), "UNAUTHENTICATED") << r.body;

  // @google/genai with apiVersion "v1": the list and a model under /v1/, with Gemini's key.
  r = Send("GET", "/v1/models", "", goog);
  ASSERT_EQ(r.status, 200) << r.body;
  j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["models"].is_array()) << r.body;
  r = Send("GET", "/v1/models/m-openai?key=" + key_open_, "", {});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body, nullptr, false).value("name", ""), "models/m-openai") << r.body;
  // The same paths with OpenAI's key stay OpenAI's.
  r = Send("GET", "/v1/models", "", {{"Authorization", "Bearer " + key_open_}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body, nullptr, false).value("object", ""), "list") << r.body;
}

// An API the gateway lacks is a 404 in the caller's own format (SDKs raise their NotFound error
// with the vendor's error type), never an OpenAI "model_not_found".
TEST_F(GatewayE2E, UnknownRoutesAre404InTheFormatThePathSpeaks) {
  auto r = Send("GET", "/v1/messages/batches", "", {{"x-api-key", key_open_}, {"anthropic-version", "2023-06-01"}});
  EXPECT_EQ(r.status, 404) << r.body;
  json j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j.value("type", ""), "error") << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "not_found_error") << r.body;
  r = Send("POST", "/v1beta/tunedModels/x:generateContent", "{}", {{"x-goog-api-key", key_open_}});
  EXPECT_EQ(r.status, 404) << r.body;
  j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j["error"].value("status", ""), "NOT_FOUND") << r.body;
  EXPECT_EQ(j["error"].value("code", 0), 404) << r.body;
  r = Send("GET", "/v1/fine_tuning/jobs", "", {{"Authorization", "Bearer " + key_open_}});
  EXPECT_EQ(r.status, 404) << r.body;
  j = json::parse(r.body, nullptr, false);
  EXPECT_EQ(j["error"].value("type", ""), "invalid_request_error") << r.body;
  EXPECT_TRUE(j["error"]["code"].is_null()) << r.body;
  EXPECT_NE(j["error"].value("message", "").find("GET /v1/fine_tuning/jobs"), std::string::npos) << r.body;
}

// A model id with colons (OpenAI's fine-tunes: "ft:gpt-4o:org::id") is looked up, not read as a
// Gemini method call, by every SDK's GET.
TEST_F(GatewayE2E, ModelIdsWithColonsAreLookedUp) {
  const std::string id = "ft:m-openai:acme::x1";
  auto r = Send("GET", "/v1/models/" + id, "", {{"Authorization", "Bearer " + key_open_}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body, nullptr, false).value("id", ""), id) << r.body;
  r = Send("GET", "/v1/models/" + id, "", {{"x-api-key", key_open_}, {"anthropic-version", "2023-06-01"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body, nullptr, false).value("id", ""), id) << r.body;
  // And chat with it works as before.
  EXPECT_EQ(Post("/v1/chat/completions", Chat(id, "hi").dump(), key_open_).status, 200);
}

// An SDK uploads its whole body before it reads the answer: a body over listen.max_body_bytes
// gets the 413 after the upload, not a connection reset.
TEST_F(GatewayE2E, OversizeUploadGetsThe413NotAReset) {
  test::HttpTestClient c(gateway_port_, 30);
  const size_t body_bytes = size_t{24} << 20;  // far beyond the socket buffers on loopback
  ASSERT_TRUE(c.SendRaw("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key_a_ +
                        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body_bytes) +
                        "\r\n\r\n"));
  const std::string piece(64 << 10, ' ');
  for (size_t sent = 0; sent < body_bytes; sent += piece.size()) {
    ASSERT_TRUE(c.SendRaw(piece)) << "upload cut off after " << sent << " bytes";
  }
  test::HttpTestResponse r;
  ASSERT_TRUE(c.ReadResponse(&r)) << "no answer: the connection was reset";
  EXPECT_EQ(r.status, 413);
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_NE(j["error"].value("message", "").find("65536 bytes"), std::string::npos) << r.body;
  EXPECT_TRUE(c.WaitClosed());
  EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
  // Refused before routing, yet in the wire format of the path (each SDK reads its own errors).
  const std::string big(70000, ' ');
  auto anthropic = Send("POST", "/v1/messages", big, AnthropicHeaders(key_a_));
  EXPECT_EQ(anthropic.status, 413);
  json a = json::parse(anthropic.body, nullptr, false);
  ASSERT_TRUE(a.is_object()) << anthropic.body;
  EXPECT_EQ(a.value("type", ""), "error") << anthropic.body;
  EXPECT_TRUE(a["error"].is_object() && a["error"]["type"].is_string()) << anthropic.body;
  auto gemini = Send("POST", "/v1beta/models/m-gemini:generateContent", big, {{"x-goog-api-key", key_a_}});
  EXPECT_EQ(gemini.status, 413);
  json g = json::parse(gemini.body, nullptr, false);
  ASSERT_TRUE(g.is_object() && g["error"].is_object()) << gemini.body;
  EXPECT_EQ(g["error"].value("code", 0), 413) << gemini.body;
  EXPECT_TRUE(g["error"]["status"].is_string()) << gemini.body;
}

// response_format json_schema reaches every vendor in its own terms (the fakes answer an instance
// of the schema), whole and streamed.
TEST_F(GatewayE2E, StructuredOutputIsJsonOfTheSchemaFromEveryVendor) {
  const json format = json::parse(R"({"type": "json_schema", "json_schema": {"name": "city", "strict": true,
      "schema": {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
                 "required": ["city", "population"], "additionalProperties": false}}})");
  for (const std::string model : {"m-openai", "m-anthropic", "m-gemini"}) {
    for (const bool stream : {false, true}) {
      json req = Chat(model, "name a city", stream);
      req["response_format"] = format;
      auto r = Post("/v1/chat/completions", req.dump(), key_open_);
      ASSERT_EQ(r.status, 200) << model << ": " << r.body;
      const std::string content =
          stream ? StreamedText(r.body) : json::parse(r.body)["choices"][0]["message"].value("content", "");
      json answer = json::parse(content, nullptr, false);
      ASSERT_TRUE(answer.is_object()) << model << (stream ? " streamed" : "") << ": " << content;
      EXPECT_TRUE(answer["city"].is_string()) << content;
      EXPECT_TRUE(answer["population"].is_number_integer()) << content;
    }
  }
}

// A field an upstream has no equivalent for is refused naming it, not silently dropped.
TEST_F(GatewayE2E, LogitBiasToAnAnthropicModelIs400NamingTheField) {
  json req = Chat("m-anthropic", "hi");
  req["logit_bias"] = {{"50256", -100}};
  auto r = Post("/v1/chat/completions", req.dump(), key_open_);
  EXPECT_EQ(r.status, 400) << r.body;
  json j = json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j["error"].is_object()) << r.body;
  EXPECT_EQ(j["error"].value("type", ""), "invalid_request_error") << r.body;
  EXPECT_NE(j["error"].value("message", "").find("logit_bias"), std::string::npos) << r.body;
  // OpenAI has it: carried.
  req["model"] = "m-openai";
  r = Post("/v1/chat/completions", req.dump(), key_open_);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(LastVendorBody(0)["logit_bias"], req["logit_bias"]);
}

// Runs last (gtest runs tests in order of definition): it takes the policy service down.
TEST_F(GatewayE2E, ZPolicyServiceDownServesCachedKeysAndFailsClosedForUnknownOnes) {
  ASSERT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
  policy_->Kill();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // past the 300 ms TTL
  auto known = Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_);
  EXPECT_EQ(known.status, 200) << known.body;
  // After one failed fetch the key is served stale at once while a single background refresh
  // retries: not one policy call per request (a hung service added its timeout to each).
  auto resolve_failures = [] {
    test::HttpTestClient http(gateway_port_);
    const std::string body = http.Request("GET", "/metrics").body;
    const std::string name = "keel_gateway_policy_unavailable_total{call=\"resolve\"} ";
    const size_t at = body.find(name);
    return at == std::string::npos ? -1.0 : std::stod(body.substr(at + name.size()));
  };
  const double failures_before = resolve_failures();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
  }
  EXPECT_EQ(resolve_failures(), failures_before) << "each request asked the failed policy service again";
  auto unknown = Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), "sk-keel-never-seen-before");
  EXPECT_EQ(unknown.status, 503) << unknown.body;
  test::HttpTestClient http(gateway_port_);
  auto metrics = http.Request("GET", "/metrics");
  EXPECT_NE(metrics.body.find("keel_gateway_policy_unavailable_total{call=\"resolve\"}"), std::string::npos);

  // Keys never appear in logs or metrics.
  gateway_->Terminate();
  const std::string logs = ReadFile(dir_->file("gateway.log")) + ReadFile(dir_->file("policy.log"));
  for (const std::string& key : {key_a_, key_b_, admin_key_}) {
    EXPECT_EQ(logs.find(key), std::string::npos);
    EXPECT_EQ(metrics.body.find(key), std::string::npos);
  }
  EXPECT_NE(logs.find("policy service unavailable"), std::string::npos);
}

}  // namespace
}  // namespace keel::gateway
