// Vendor adapters (keel/gateway/vendor.h): the request each vendor gets, and what each refuses.
#include "keel/gateway/vendor.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "keel/gateway/front.h"
#include "keel/gateway/gateway.h"

namespace keel::gateway {
namespace {

using nlohmann::json;

std::string Header(const ClientRequest& r, std::string_view name) {
  for (const auto& [k, v] : r.headers) {
    if (k == name) return v;
  }
  return "<absent>";
}

ChatRequest Hello() {
  ChatRequest r;
  r.model = "virtual";
  Message m;
  m.role = "user";
  m.content = "hello";
  r.messages.push_back(m);
  return r;
}

UpstreamConfig Upstream(const std::string& base_url, const std::string& api_key) {
  UpstreamConfig up;
  up.name = "u";
  up.base_url = base_url;
  up.api_key = api_key;
  return up;
}

const VendorAdapter& Vendor(std::string_view name) {
  auto v = FindVendor(name);
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  return **v;
}

TEST(VendorTest, RegistryNamesEveryVendorAndRefusesUnknownOnes) {
  EXPECT_EQ(VendorNames(), (std::vector<std::string>{"anthropic", "gemini", "keel", "openai"}));
  auto missing = FindVendor("azure");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("azure"), std::string::npos);
  EXPECT_NE(missing.status().message().find("anthropic, gemini, keel, openai"), std::string::npos);
  EXPECT_EQ(Vendor(VendorNameFor(WireFormat::kGemini)).format(), WireFormat::kGemini);
  EXPECT_EQ(Vendor(VendorNameFor(WireFormat::kAnthropicMessages)).format(), WireFormat::kAnthropicMessages);
}

// The registries are filled by each vendor folder's Register* call (vendors/vendor.cc, front.cc):
// exactly these names and formats, each adapter and front answering for the format it is found by.
TEST(VendorTest, RegistriesHoldEveryFolderAndFormatsRoundTrip) {
  const std::pair<const char*, WireFormat> vendors[] = {{"anthropic", WireFormat::kAnthropicMessages},
                                                        {"gemini", WireFormat::kGemini},
                                                        {"keel", WireFormat::kOpenAIChat},
                                                        {"openai", WireFormat::kOpenAIChat}};
  std::vector<std::string> names;
  for (const auto& [name, format] : vendors) {
    names.push_back(name);
    const VendorAdapter& v = Vendor(name);
    EXPECT_EQ(v.format(), format) << name;
    EXPECT_NE(v.MakeDecoder(), nullptr) << name;
    EXPECT_EQ(v.ParseFinishReason(""), FinishReason::kNone) << name;
  }
  EXPECT_EQ(VendorNames(), names);
  // The first adapter a folder registers for a format is that format's default.
  EXPECT_EQ(VendorNameFor(WireFormat::kOpenAIChat), "openai");
  EXPECT_EQ(VendorNameFor(WireFormat::kAnthropicMessages), "anthropic");
  EXPECT_EQ(VendorNameFor(WireFormat::kGemini), "gemini");
  EXPECT_EQ(VendorNameFor(WireFormat::kOpenAICompletions), "openai");  // no adapter of its own

  const std::vector<WireFormat> fronts = {WireFormat::kOpenAIChat, WireFormat::kOpenAICompletions,
                                          WireFormat::kAnthropicMessages, WireFormat::kGemini,
                                          WireFormat::kOpenAIResponses};
  EXPECT_EQ(FrontFormats(), fronts);
  for (WireFormat f : fronts) {
    EXPECT_EQ(FrontFor(f).format(), f) << WireFormatName(f);
    EXPECT_NE(FrontFor(f).MakeEncoder(Hello(), "m"), nullptr) << WireFormatName(f);
  }
  EXPECT_EQ(GeminiFrontFor(true).format(), WireFormat::kGemini);
  EXPECT_EQ(GeminiFrontFor(false).format(), WireFormat::kGemini);
  EXPECT_STREQ(GeminiFrontFor(true).StreamContentType(), "text/event-stream");
  EXPECT_STREQ(GeminiFrontFor(false).StreamContentType(), "application/json");
}

TEST(VendorTest, EachVendorGetsItsUrlAndAuth) {
  const UpstreamConfig up = Upstream("http://127.0.0.1:9", "k1");
  ChatRequest req = Hello();

  auto openai = Vendor("openai").BuildChat(up, req, "gpt-x", 4096);
  ASSERT_TRUE(openai.ok()) << openai.status().ToString();
  EXPECT_EQ(openai->url, "http://127.0.0.1:9/v1/chat/completions");
  EXPECT_EQ(Header(*openai, "Authorization"), "Bearer k1");
  EXPECT_EQ(json::parse(openai->body)["model"], "gpt-x");

  auto anthropic = Vendor("anthropic").BuildChat(up, req, "claude-x", 4096);
  ASSERT_TRUE(anthropic.ok());
  EXPECT_EQ(anthropic->url, "http://127.0.0.1:9/v1/messages");
  EXPECT_EQ(Header(*anthropic, "x-api-key"), "k1");
  EXPECT_EQ(Header(*anthropic, "anthropic-version"), "2023-06-01");
  EXPECT_EQ(json::parse(anthropic->body)["max_tokens"], 4096);

  auto gemini = Vendor("gemini").BuildChat(up, req, "gemini-x", 4096);
  ASSERT_TRUE(gemini.ok());
  EXPECT_EQ(gemini->url, "http://127.0.0.1:9/v1beta/models/gemini-x:generateContent");
  EXPECT_EQ(Header(*gemini, "x-goog-api-key"), "k1");
  req.stream = true;
  gemini = Vendor("gemini").BuildChat(up, req, "gemini-x", 4096);
  ASSERT_TRUE(gemini.ok());
  EXPECT_EQ(gemini->url, "http://127.0.0.1:9/v1beta/models/gemini-x:streamGenerateContent?alt=sse");
  EXPECT_EQ(Header(*gemini, "Accept"), "text/event-stream");

  // `keel serve` without a key gets no Authorization header at all.
  const UpstreamConfig keel = Upstream("http://127.0.0.1:9", "");
  auto local = Vendor("keel").BuildChat(keel, Hello(), "m", 4096);
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(Header(*local, "Authorization"), "<absent>");
}

TEST(VendorTest, OpenAIAndKeelServeRefuseWhatTheyLack) {
  const UpstreamConfig up = Upstream("http://127.0.0.1:9", "");
  ChatRequest top_k = Hello();
  top_k.top_k = 40;
  auto refused = Vendor("openai").BuildChat(up, top_k, "gpt-x", 0);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("top_k"), std::string::npos);
  auto carried = Vendor("keel").BuildChat(up, top_k, "m", 0);
  ASSERT_TRUE(carried.ok()) << carried.status().ToString();
  EXPECT_EQ(json::parse(carried->body)["top_k"], 40);

  // keel serve applies logit_bias and the penalties (since it does, they are carried).
  ChatRequest bias = Hello();
  bias.logit_bias_json = R"({"50256":-100})";
  bias.frequency_penalty = 0.5;
  EXPECT_TRUE(Vendor("openai").BuildChat(up, bias, "gpt-x", 0).ok());
  auto keel_bias = Vendor("keel").BuildChat(up, bias, "m", 0);
  ASSERT_TRUE(keel_bias.ok()) << keel_bias.status().ToString();
  EXPECT_EQ(json::parse(keel_bias->body)["frequency_penalty"], 0.5);

  ChatRequest effort = Hello();
  effort.reasoning_effort = "high";
  EXPECT_TRUE(Vendor("openai").BuildChat(up, effort, "o3", 0).ok());
  auto keel_effort = Vendor("keel").BuildChat(up, effort, "m", 0);
  EXPECT_NE(keel_effort.status().message().find("reasoning_effort"), std::string::npos);

  ChatRequest structured = Hello();
  structured.response_format.emplace();
  structured.response_format->kind = ResponseFormat::Kind::kJsonObject;
  EXPECT_TRUE(Vendor("openai").BuildChat(up, structured, "gpt-x", 0).ok());
  auto keel_structured = Vendor("keel").BuildChat(up, structured, "m", 0);
  EXPECT_NE(keel_structured.status().message().find("response_format"), std::string::npos);
}

TEST(VendorTest, OnlyOpenAIShapedVendorsHaveEmbeddings) {
  const UpstreamConfig up = Upstream("http://h:1", "k");
  auto openai = Vendor("openai").BuildEmbeddings(up, R"({"model":"e","input":"x"})");
  ASSERT_TRUE(openai.ok());
  EXPECT_EQ(openai->url, "http://h:1/v1/embeddings");
  EXPECT_EQ(Header(*openai, "Authorization"), "Bearer k");
  EXPECT_EQ(Vendor("anthropic").BuildEmbeddings(up, "{}").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Vendor("gemini").BuildEmbeddings(up, "{}").status().code(), StatusCode::kNotFound);
}

TEST(VendorTest, AnswersAndErrorsAreReadInTheVendorsFormat) {
  auto answer = Vendor("anthropic").ParseChat(
      R"({"id":"msg_1","type":"message","role":"assistant","model":"c","content":[{"type":"text","text":"hi"}],)"
      R"("stop_reason":"stop_sequence","stop_sequence":"END","usage":{"input_tokens":3,"output_tokens":1}})");
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  EXPECT_EQ(answer->content, "hi");
  EXPECT_EQ(answer->stop_sequence, "END");
  GatewayError e = Vendor("anthropic").ParseError(529, R"({"type":"error","error":{"type":"overloaded_error","message":"busy"}})");
  EXPECT_EQ(e.status, 503);
  EXPECT_EQ(e.kind, ErrorKind::kOverloaded);
  EXPECT_EQ(e.message, "busy");
  EXPECT_NE(Vendor("gemini").MakeDecoder(), nullptr);
}

}  // namespace
}  // namespace keel::gateway
