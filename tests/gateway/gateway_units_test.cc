// Unit tests of the gateway's own pieces: token counting and the config parser.
#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>

#include "keel/core/mapped_file.h"
#include "keel/engine/tokenizer.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/token_counter.h"
#include "tests/engine/test_util.h"

namespace keel::gateway {
namespace {

TEST(Estimator, CountsWordsDigitsPunctuationAndCodePoints) {
  auto est = MakeEstimator();
  EXPECT_EQ(est->Count(""), 0);
  EXPECT_EQ(est->Count("hello"), 2);           // 5 letters -> ceil(5/4)
  EXPECT_EQ(est->Count("hi there"), 1 + 2);    // the space joins "there"
  EXPECT_EQ(est->Count("1234567"), 3);         // digit groups of three
  EXPECT_EQ(est->Count("a,b"), 3);
  EXPECT_EQ(est->Count("\xC3\xA9t\xC3\xA9"), 3);  // "été": two code points + one letter run
  EXPECT_EQ(est->Count("x  y"), 1 + 1 + 1);    // a double space costs a token
  EXPECT_STREQ(est->name(), "estimator");
}

TEST(Estimator, IsWithinAReasonableBandOnProse) {
  // 1 token ~ 0.75 words on English prose (OpenAI's rule of thumb); the estimator must land in
  // a broad band around it, not be exact.
  const std::string prose =
      "The quick brown fox jumps over the lazy dog while the cat watches from the window, "
      "wondering whether any of this is worth getting up for on such a warm afternoon.";
  const int64_t words = 29;
  const int64_t n = MakeEstimator()->Count(prose);
  EXPECT_GT(n, words * 0.9);
  EXPECT_LT(n, words * 2.0);
}

TEST(KeelTokenizerCounter, MatchesTheEngineTokenizer) {
  const std::string path = test::ModelsDir() + "/aidreams_tok512.bin";
  auto counter = MakeKeelTokenizerCounter(path, 512);
  ASSERT_TRUE(counter.ok()) << counter.status().ToString();
  auto tok = engine::Tokenizer::Load(path, 512);
  ASSERT_TRUE(tok.ok());
  for (const std::string text : {"Once upon a time", "a", "The little dog ran to the park and played."}) {
    EXPECT_EQ((*counter)->Count(text), static_cast<int64_t>(tok->Encode(text, false).size())) << text;
  }
  EXPECT_EQ((*counter)->Count(""), 0);
  auto missing = MakeKeelTokenizerCounter("/nonexistent/tok.bin", 512);
  EXPECT_FALSE(missing.ok());
}

TEST(CountRequestTokens, AddsMessageFramingAndToolDefinitions) {
  auto est = MakeEstimator();
  ChatRequest r;
  r.messages.push_back({"user", "hello", {}, "", ""});
  const int64_t one = CountRequestTokens(*est, r);
  EXPECT_EQ(one, 3 + 3 + 2);
  r.system = "be brief";
  const int64_t with_system = CountRequestTokens(*est, r);
  EXPECT_EQ(with_system, one + 3 + est->Count("be brief"));
  r.tools.push_back({"get_weather", "Weather for a city", R"({"type":"object"})"});
  EXPECT_GT(CountRequestTokens(*est, r), with_system);
}

constexpr const char* kValidConfig = R"({
  "listen": {"host": "127.0.0.1", "port": 0, "threads": 3},
  "policy": {"socket": "/tmp/p.sock", "timeout_s": 0.2},
  "upstreams": [
    {"name": "oa", "format": "openai", "base_url": "http://127.0.0.1:9001/", "api_key": "k1"},
    {"name": "an", "format": "anthropic", "base_url": "http://127.0.0.1:9002", "timeout_s": 5}
  ],
  "models": [
    {"name": "chat", "targets": [{"upstream": "oa", "model": "gpt-x"}, {"upstream": "an", "model": "claude-x"}]}
  ]
})";

TEST(GatewayConfig, ParsesAValidConfig) {
  auto c = ParseGatewayConfig(kValidConfig);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->threads, 3);
  EXPECT_EQ(c->policy_socket, "/tmp/p.sock");
  ASSERT_EQ(c->upstreams.size(), 2u);
  EXPECT_EQ(c->upstreams[0].base_url, "http://127.0.0.1:9001");  // trailing slash dropped
  EXPECT_EQ(c->upstreams[1].format, WireFormat::kAnthropicMessages);
  EXPECT_DOUBLE_EQ(c->upstreams[1].timeout_seconds, 5);
  ASSERT_EQ(c->models.size(), 1u);
  ASSERT_EQ(c->models[0].targets.size(), 2u);
  EXPECT_EQ(c->models[0].targets[1].model, "claude-x");
}

TEST(GatewayConfig, RejectsBadConfigsNamingTheField) {
  struct Case {
    std::string json;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"{", "not a JSON object"},
      {R"({"models": []})", "upstreams"},
      {R"({"upstreams": [{"name": "a", "format": "cohere", "base_url": "http://x"}], "models": []})",
       "upstreams[0].format"},
      {R"({"upstreams": [{"name": "a", "base_url": "ftp://x"}], "models": []})", "upstreams[0].base_url"},
      {R"({"upstreams": [{"name": "a", "base_url": "http://x"}, {"name": "a", "base_url": "http://y"}], "models": []})",
       "duplicate upstream"},
      {R"({"upstreams": [{"name": "a", "base_url": "http://x"}], "models": [{"name": "m", "targets": [{"upstream": "b", "model": "z"}]}]})",
       "models[0].targets[0].upstream"},
      {R"({"upstreams": [{"name": "a", "base_url": "http://x"}], "models": [{"name": "m", "targets": []}]})",
       "models[0].targets"},
      {R"({"listen": {"port": 70000}, "upstreams": [], "models": []})", "listen.port"},
      {R"({"listen": {"tls_cert": "c.pem"}, "upstreams": [], "models": []})", "tls_key"},
      {R"({"upstreams": [{"name": "a", "base_url": "http://x", "api_key_env": "KEEL_TEST_SURELY_UNSET"}], "models": []})",
       "KEEL_TEST_SURELY_UNSET"},
  };
  for (const Case& c : cases) {
    auto r = ParseGatewayConfig(c.json);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
  }
}

TEST(GatewayConfig, ReadsApiKeysFromTheEnvironment) {
  ::setenv("KEEL_TEST_VENDOR_KEY", "secret-from-env", 1);
  auto c = ParseGatewayConfig(
      R"({"upstreams": [{"name": "a", "base_url": "http://x", "api_key_env": "KEEL_TEST_VENDOR_KEY"}], "models": []})");
  ::unsetenv("KEEL_TEST_VENDOR_KEY");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->upstreams[0].api_key, "secret-from-env");
}

TEST(GatewayConfig, LoadNamesTheFile) {
  auto r = LoadGatewayConfig("/nonexistent/gw.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("/nonexistent/gw.json"), std::string::npos);
}

TEST(GatewayConfig, LoadFindsTheFilesItNamesBesideTheConfig) {
  test::TempDir dir("keel-gw-config");
  ASSERT_EQ(WriteFileAtomic(dir.file("gw.json"), R"({
    "listen": {"tls_cert": "tls/cert.pem", "tls_key": "/etc/keel/key.pem"},
    "upstreams": [{"name": "local", "format": "keel", "base_url": "http://127.0.0.1:1"}],
    "models": [{"name": "m", "targets": [{"upstream": "local", "model": "x"}],
                "tokenizer": {"path": "../models/tok.bin", "vocab_size": 512}}]})").ok(), true);
  auto c = LoadGatewayConfig(dir.file("gw.json"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->tls_cert_file, dir.path() + "/tls/cert.pem");
  EXPECT_EQ(c->tls_key_file, "/etc/keel/key.pem");  // absolute paths are kept
  const std::string parent = std::filesystem::path(dir.path()).parent_path().string();
  EXPECT_EQ(c->models[0].tokenizer_path, parent + "/models/tok.bin");
  // Parsing text alone has no directory: the paths stay as written.
  auto text = ParseGatewayConfig(R"({"upstreams": [], "models": [], "listen": {"tls_cert": "c.pem", "tls_key": "k.pem"}})");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(text->tls_cert_file, "c.pem");
}

}  // namespace
}  // namespace keel::gateway
