// End-to-end tests of `keel gateway` as users run it: real processes on loopback — the policy
// service on a Unix socket (SQLite state), one fake vendor per wire format, `keel serve` with
// the reference model, and the gateway in front of them — talking real HTTP.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/core/http_test_client.h"
#include "tests/engine/test_util.h"
#include "tests/kvstore/redis_process.h"  // FreeLoopbackPort, PortAccepts

namespace keel::gateway {
namespace {

using nlohmann::json;

// A child process running `keel <args>`, stderr to a log file (checked for leaked keys).
class Process {
 public:
  Process() = default;
  void Start(const std::string& args, const std::string& log_path) {
    const std::string cmd = std::string("exec ") + KEEL_BINARY + " " + args + " >>" + log_path + " 2>&1";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Process() { Kill(); }
  void Kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  void Terminate() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

 private:
  pid_t pid_ = -1;
};

bool WaitFor(const std::function<bool()>& ready, int ms = 15000) {
  for (int i = 0; i < ms / 20; ++i) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// curl over the policy service's Unix socket (the admin API); returns status and body.
std::pair<int, std::string> Admin(const std::string& socket, const std::string& admin_key, const std::string& method,
                                  const std::string& path, const std::string& body = "") {
  std::string cmd = "curl -s -o - -w '\\n%{http_code}' --max-time 10 --unix-socket " + socket + " -X " + method +
                    " -H 'Authorization: Bearer " + admin_key + "' -H 'Content-Type: application/json'";
  if (!body.empty()) cmd += " --data-binary @-";
  cmd += " 'http://localhost" + path + "'";
  std::string out;
  // popen is one-directional: write the body through a temp file.
  if (!body.empty()) {
    char tmpl[] = "/tmp/keel-gw-admin-XXXXXX";
    int fd = ::mkstemp(tmpl);
    (void)!::write(fd, body.data(), body.size());
    ::close(fd);
    cmd += std::string(" < ") + tmpl;
    FILE* p = ::popen(cmd.c_str(), "r");
    char buf[4096];
    size_t n;
    while ((n = ::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ::pclose(p);
    ::unlink(tmpl);
  } else {
    FILE* p = ::popen(cmd.c_str(), "r");
    char buf[4096];
    size_t n;
    while ((n = ::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  const size_t nl = out.rfind('\n');
  if (nl == std::string::npos) return {0, out};
  return {std::atoi(out.c_str() + nl + 1), out.substr(0, nl)};
}

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

// Team names are unique per test process: with Redis counters, spend is keyed by team and
// window, and ctest runs the tests of this file as separate processes sharing one Redis.
std::string Team(const std::string& name) { return name + "-" + std::to_string(::getpid()); }

// With $KEEL_REDIS_URL (scripts/test starts a redis-server) the policy service keeps spend
// counters in Redis, as several instances would.
std::string RedisFlag() {
  const char* url = std::getenv("KEEL_REDIS_URL");
  return url != nullptr && *url != '\0' ? std::string(" --redis-url ") + url : std::string();
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
    ASSERT_TRUE(WaitFor([] { return Admin(socket_, admin_key_, "GET", "/healthz").first == 200; }))
        << ReadFile(d + "/policy.log");

    const char* kinds[] = {"openai", "anthropic", "gemini"};
    for (int i = 0; i < 3; ++i) {
      vendor_port_[i] = test::FreeLoopbackPort();
      vendors_[i] = new Process();
      vendors_[i]->Start(std::string("fake-vendor --kind ") + kinds[i] + " --port " + std::to_string(vendor_port_[i]) +
                             " --api-key vendor-secret-" + kinds[i] + " --reply-tokens 12",
                         d + "/vendor.log");
    }
    keel_port_ = test::FreeLoopbackPort();
    serve_ = new Process();
    serve_->Start("serve -m " + test::ModelsDir() + "/aidreams260K.bin -z " + test::ModelsDir() +
                      "/aidreams_tok512.bin --port " + std::to_string(keel_port_),
                  d + "/serve.log");
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(WaitFor([i] { return test::PortAccepts(vendor_port_[i]); }));
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
          {{"name", "oa-short"}, {"format", "openai"}, {"base_url", url(vendor_port_[0])},
           {"api_key", "vendor-secret-openai"}, {"timeout_s", 0.5}},
          {{"name", "an-badkey"}, {"format", "anthropic"}, {"base_url", url(vendor_port_[1])}, {"api_key", "wrong"}}}},
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
          {{"name", "m-timeout"},
           {"targets", {{{"upstream", "oa-short"}, {"model", "gpt-slow"}}, {{"upstream", "an"}, {"model", "claude-ok"}}}}},
          {{"name", "m-badkey"}, {"targets", {{{"upstream", "an-badkey"}, {"model", "claude-x"}}}}},
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
    auto [s1, b1] = Admin(socket_, admin_key_, "PUT", "/admin/policies",
                          R"({"team":")" + Team("alpha") + R"(","allowed_models":["m-*","aidreams"],"max_tokens":64,
                              "rewrites":{"cheap":"m-openai"},
                              "deny":[{"contains":"forbidden-topic","message":"that topic is not allowed here"}]})");
    ASSERT_EQ(s1, 200) << b1;
    auto [s2, b2] = Admin(socket_, admin_key_, "PUT", "/admin/budgets",
                          R"({"scope":"team","subject":")" + Team("beta") + R"(","window":"daily","limit_tokens":120})");
    ASSERT_EQ(s2, 200) << b2;
    auto [s3, b3] = Admin(socket_, admin_key_, "PUT", "/admin/prices",
                          R"({"model":"gpt-test","input_per_mtok":1.0,"output_per_mtok":2.0})");
    ASSERT_EQ(s3, 200) << b3;
  }

  static void TearDownTestSuite() {
    delete gateway_;
    delete serve_;
    for (Process* p : vendors_) delete p;
    delete policy_;
    delete dir_;
    delete config_;
  }

  static std::string CreateKey(const std::string& principal, const std::string& team) {
    auto [status, body] = Admin(socket_, admin_key_, "POST", "/admin/keys",
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

  static json Chat(const std::string& model, const std::string& text, bool stream = false, int max_tokens = 0) {
    json req = {{"model", model}, {"messages", {{{"role", "user"}, {"content", text}}}}, {"stream", stream}};
    if (max_tokens > 0) req["max_tokens"] = max_tokens;
    return req;
  }

  static test::TempDir* dir_;
  static json* config_;
  static Process* policy_;
  static Process* vendors_[3];
  static Process* serve_;
  static Process* gateway_;
  static int vendor_port_[3];
  static int keel_port_;
  static int gateway_port_;
  static std::string socket_, admin_key_, key_a_, key_b_;
  static std::vector<std::string> key_ids_;
};

test::TempDir* GatewayE2E::dir_ = nullptr;
json* GatewayE2E::config_ = nullptr;
Process* GatewayE2E::policy_ = nullptr;
Process* GatewayE2E::vendors_[3] = {nullptr, nullptr, nullptr};
Process* GatewayE2E::serve_ = nullptr;
Process* GatewayE2E::gateway_ = nullptr;
int GatewayE2E::vendor_port_[3] = {0, 0, 0};
int GatewayE2E::keel_port_ = 0;
int GatewayE2E::gateway_port_ = 0;
std::string GatewayE2E::socket_, GatewayE2E::admin_key_, GatewayE2E::key_a_, GatewayE2E::key_b_;
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
    // HEAD: the same status with an empty body; the connection stays usable for the next request.
    ASSERT_TRUE(http.SendRaw(test::HttpTestClient::BuildRequest("HEAD", path, "", "", {})));
    test::HttpTestResponse head;
    ASSERT_TRUE(http.ReadResponse(&head));
    EXPECT_EQ(head.status, 200) << path;
    EXPECT_TRUE(head.body.empty()) << head.body;
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
  auto [s, spend] = Admin(socket_, admin_key_, "GET", "/admin/spend?team=beta");
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
  auto [s, b] = Admin(socket_, admin_key_, "POST", "/admin/keys/revoke", json{{"key_id", key_ids_.back()}}.dump());
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
  auto [s, b] = Admin(socket_, admin_key_, "PUT", "/admin/budgets",
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
    auto [s, spend] = Admin(socket_, admin_key_, "GET", "/admin/spend?team=" + team);
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
  auto [s0, before] = Admin(socket_, admin_key_, "GET", "/admin/spend?team=" + team);
  ASSERT_EQ(s0, 200) << before;
  EXPECT_EQ(json::parse(before)["daily"]["tokens"].get<int64_t>(), 0);  // not flushed yet
  gw.Terminate();
  auto [s1, after] = Admin(socket_, admin_key_, "GET", "/admin/spend?team=" + team);
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

// Runs last (gtest runs tests in order of definition): it takes the policy service down.
TEST_F(GatewayE2E, ZPolicyServiceDownServesCachedKeysAndFailsClosedForUnknownOnes) {
  ASSERT_EQ(Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_).status, 200);
  policy_->Kill();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // past the 300 ms TTL
  auto known = Post("/v1/chat/completions", Chat("m-openai", "hi").dump(), key_a_);
  EXPECT_EQ(known.status, 200) << known.body;
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
