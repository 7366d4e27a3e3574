// The Gemini front: routes and keys, generateContent bodies into ChatRequest (every field, every
// refusal), answers and stream chunks in Gemini's shapes, and the stream read back by the
// gateway's own Gemini decoder.
#include "keel/gateway/vendors/gemini/gemini_front.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/gateway/stream.h"
#include "tests/gateway/stream_by_format.h"
#include "keel/gateway/translate.h"

namespace keel::gateway {
namespace {

using stream_by_format::MakeStreamDecoder;

using Json = nlohmann::json;
using Kind = StreamEvent::Kind;
using Method = GeminiRoute::Method;

// ---- routes

TEST(GeminiPath, ServedRoutes) {
  Result<GeminiRoute> r = ParseGeminiPath("/v1beta/models/gemini-2.5-flash:generateContent");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "gemini-2.5-flash");
  EXPECT_EQ(r->method, Method::kGenerate);
  EXPECT_FALSE(r->sse);

  r = ParseGeminiPath("/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->method, Method::kStream);
  EXPECT_TRUE(r->sse);

  r = ParseGeminiPath("/v1beta/models/m:streamGenerateContent");  // a JSON array stream
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->sse);

  r = ParseGeminiPath("/v1/models/m:countTokens?key=abc&alt=json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->method, Method::kCountTokens);

  r = ParseGeminiPath("/v1alpha/models/m:streamGenerateContent?$alt=sse;enum-encoding=int");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->sse);
}

TEST(GeminiPath, ModelNamesWithDotsColonsSlashesAndEscapes) {
  const std::pair<const char*, const char*> cases[] = {
      {"/v1beta/models/my.model-v1_2:generateContent", "my.model-v1_2"},
      {"/v1beta/models/llama3:8b:generateContent", "llama3:8b"},  // the method is after the last ':'
      {"/v1beta/models/openai/gpt-4o:generateContent", "openai/gpt-4o"},
      {"/v1beta/models/my%2Emodel%3A1:generateContent", "my.model:1"},
      {"/v1beta/models/org%2fname:generateContent", "org/name"},
  };
  for (auto [target, model] : cases) {
    Result<GeminiRoute> r = ParseGeminiPath(target);
    ASSERT_TRUE(r.ok()) << target << ": " << r.status().ToString();
    EXPECT_EQ(r->model, model) << target;
  }
}

TEST(GeminiPath, HostilePathsAreRefused) {
  const char* bad_request[] = {
      "/v1beta/models/:generateContent",              // empty model
      "/v1beta/models/../admin:generateContent",      // dot segments
      "/v1beta/models/a/./b:generateContent",
      "/v1beta/models/%2e%2e:generateContent",         // dot segments, escaped
      "/v1beta/models/a//b:generateContent",           // empty segment
      "/v1beta/models/a/:generateContent",
      "/v1beta/models/%zz:generateContent",            // bad escapes
      "/v1beta/models/abc%:generateContent",
      "/v1beta/models/abc%4:generateContent",
      "/v1beta/models/a%0Ab:generateContent",          // control byte after decoding
      "/v1beta/models/a%00b:generateContent",
      "/v1beta/models/a%20b:generateContent",          // space
      "/v1beta/models/a%3Fb:generateContent",          // '?' after decoding
      "/v1beta/models/a%22b:generateContent",          // '"'
      "/v1beta/models/a%C3%A9:generateContent",        // non-ASCII
      "/v1beta/models/m:generateContent?alt=sse",      // SSE only for streaming
      "/v1beta/models/m:streamGenerateContent?alt=proto",
  };
  for (const char* target : bad_request) {
    Result<GeminiRoute> r = ParseGeminiPath(target);
    ASSERT_FALSE(r.ok()) << target;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << target << ": " << r.status().ToString();
  }
  EXPECT_FALSE(ParseGeminiPath("/v1beta/models/" + std::string(257, 'a') + ":generateContent").ok());
  EXPECT_TRUE(ParseGeminiPath("/v1beta/models/" + std::string(256, 'a') + ":generateContent").ok());

  const char* not_found[] = {
      "/v1beta/models/m:embedContent",
      "/v1beta/models/m:generatecontent",  // methods are case-sensitive, as Google's are
      "/v1beta/models/m",                  // models.get is not this route
      "/v1beta/models/",
      "/v1beta/models",
      "/v1beta/tunedModels/m:generateContent",
      "/v2/models/m:generateContent",
      "/v1beta/modelsx/m:generateContent",
      "/v1/chat/completions",
      "",
      "/v1beta/models/m:generateContent:",
  };
  for (const char* target : not_found) {
    Result<GeminiRoute> r = ParseGeminiPath(target);
    ASSERT_FALSE(r.ok()) << target;
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << target << ": " << r.status().ToString();
  }
}

TEST(GeminiKey, HeaderThenQueryParameter) {
  EXPECT_EQ(GeminiPresentedKey("hdr-key", "key=query-key"), "hdr-key");
  EXPECT_EQ(GeminiPresentedKey("", "alt=sse&key=query-key"), "query-key");
  EXPECT_EQ(GeminiPresentedKey("", "key=a%2Bb+c%3D"), "a+b c=");
  EXPECT_EQ(GeminiPresentedKey("", "alt=sse"), "");
  EXPECT_EQ(GeminiPresentedKey("", "apikey=x&key_=y"), "");  // only the exact name
  EXPECT_EQ(GeminiPresentedKey("", "key=bad%2"), "");
  EXPECT_EQ(GeminiPresentedKey("", ""), "");
}

// ---- requests

ChatRequest Parse(const Json& body, bool stream = false) {
  Result<ChatRequest> r = ParseGeminiClientRequest(body.dump(), "gemini-x", stream);
  EXPECT_TRUE(r.ok()) << body.dump() << "\n" << r.status().ToString();
  return r.ok() ? *r : ChatRequest{};
}

// The request must be refused with InvalidArgument naming `field`.
void ExpectRefused(const Json& body, const std::string& field) {
  Result<ChatRequest> r = ParseGeminiClientRequest(body.dump(), "gemini-x", false);
  ASSERT_FALSE(r.ok()) << body.dump();
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(field), std::string::npos)
      << "message \"" << r.status().message() << "\" should name " << field;
}

Json UserText(const std::string& text) { return {{"role", "user"}, {"parts", {{{"text", text}}}}}; }

TEST(GeminiRequest, EveryCarriedField) {
  const Json body = {
      {"contents", {UserText("Hi "), {{"role", "model"}, {"parts", {{{"text", "Hello"}}}}}, UserText("Weather?")}},
      {"systemInstruction", {{"parts", {{{"text", "Be brief. "}}, {{"text", "Be kind."}}}}}},
      {"tools",
       {{{"functionDeclarations",
          {{{"name", "get_weather"},
            {"description", "Weather for a city"},
            {"parameters",
             {{"type", "OBJECT"},
              {"properties", {{"city", {{"type", "STRING"}, {"nullable", true}}},
                              {"days", {{"type", "ARRAY"}, {"items", {{"type", "INTEGER"}}}, {"minItems", "1"}}}}},
              {"required", {"city"}},
              {"propertyOrdering", {"city", "days"}}}}},
           {{"name", "noop"}}}}}}},
      {"toolConfig", {{"functionCallingConfig", {{"mode", "AUTO"}}}}},
      {"generationConfig",
       {{"temperature", 0.5},
        {"topP", 0.9},
        {"topK", 40},
        {"maxOutputTokens", 128},
        {"stopSequences", {"END", "STOP"}},
        {"candidateCount", 1},
        {"presencePenalty", 0.25},
        {"frequencyPenalty", -0.5},
        {"seed", 42},
        {"responseMimeType", "text/plain"}}},
      {"safetySettings", {{{"category", "HARM_CATEGORY_HARASSMENT"}, {"threshold", "BLOCK_NONE"}}}},
      {"labels", {{"team", "a"}}},
  };
  ChatRequest r = Parse(body, /*stream=*/true);
  EXPECT_EQ(r.client_format, WireFormat::kGemini);
  EXPECT_EQ(r.model, "gemini-x");
  EXPECT_TRUE(r.stream);
  EXPECT_EQ(r.system, "Be brief. Be kind.");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "Hi ");
  EXPECT_EQ(r.messages[1].role, "assistant");
  EXPECT_EQ(r.messages[1].content, "Hello");
  EXPECT_EQ(r.messages[2].content, "Weather?");
  ASSERT_EQ(r.tools.size(), 2u);
  EXPECT_EQ(r.tools[0].name, "get_weather");
  EXPECT_EQ(r.tools[0].description, "Weather for a city");
  const Json schema = Json::parse(r.tools[0].parameters_json);
  EXPECT_EQ(schema, Json::parse(R"({"type":"object","required":["city"],"properties":{
      "city":{"type":["string","null"]},
      "days":{"type":"array","items":{"type":"integer"},"minItems":1}}})"));
  EXPECT_EQ(r.tools[1].parameters_json, "{}");
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_EQ(r.temperature, 0.5);
  EXPECT_EQ(r.top_p, 0.9);
  EXPECT_EQ(r.top_k, 40);
  EXPECT_EQ(r.max_tokens, 128);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"END", "STOP"}));
  EXPECT_EQ(r.presence_penalty, 0.25);
  EXPECT_EQ(r.frequency_penalty, -0.5);
  EXPECT_EQ(r.seed, 42);
  EXPECT_FALSE(r.response_format.has_value());  // text/plain is the default
}

TEST(GeminiRequest, SnakeCaseNamesAsInGoogleRestExamples) {
  const Json body = {
      {"system_instruction", {{"parts", {{{"text", "sys"}}}}}},
      {"contents", {UserText("q")}},
      {"tools", {{{"function_declarations", {{{"name", "f"}, {"parameters_json_schema", {{"type", "object"}}}}}}}}},
      {"tool_config", {{"function_calling_config", {{"mode", "ANY"}, {"allowed_function_names", {"f"}}}}}},
      {"generation_config", {{"max_output_tokens", 7}, {"stop_sequences", {"x"}}, {"top_k", 3}}},
  };
  ChatRequest r = Parse(body);
  EXPECT_EQ(r.system, "sys");
  ASSERT_EQ(r.tools.size(), 1u);
  EXPECT_EQ(r.tools[0].parameters_json, R"({"type":"object"})");
  EXPECT_EQ(r.tool_choice, "f");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.top_k, 3);
  EXPECT_EQ(r.stop, std::vector<std::string>{"x"});
}

TEST(GeminiRequest, FunctionCallsAndResponsesArePairedByNameInOrder) {
  const Json body = {
      {"contents",
       {UserText("weather in two cities"),
        {{"role", "model"},
         {"parts",
          {{{"text", "Checking."}},
           {{"functionCall", {{"name", "get_weather"}, {"args", {{"city", "Paris"}}}}}, {"thoughtSignature", "c2ln"}},
           {{"functionCall", {{"name", "get_weather"}, {"args", {{"city", "Rome"}}}}}},
           {{"functionCall", {{"name", "get_time"}, {"id", "t-1"}}}}}}},
        {{"role", "user"},
         {"parts",
          {{{"functionResponse", {{"name", "get_time"}, {"id", "t-1"}, {"response", {{"now", "noon"}}}}}},
           {{"functionResponse", {{"name", "get_weather"}, {"response", {{"temp", 20}}}}}},
           {{"text", "and be quick"}},
           {{"functionResponse", {{"name", "get_weather"}, {"response", {{"temp", 25}}}}}}}}}}},
  };
  ChatRequest r = Parse(body);
  ASSERT_EQ(r.messages.size(), 6u);
  const Message& a = r.messages[1];
  EXPECT_EQ(a.role, "assistant");
  EXPECT_EQ(a.content, "Checking.");
  ASSERT_EQ(a.tool_calls.size(), 3u);
  EXPECT_EQ(a.tool_calls[0].id, "call_0");
  EXPECT_EQ(a.tool_calls[0].name, "get_weather");
  EXPECT_EQ(Json::parse(a.tool_calls[0].arguments_json), Json({{"city", "Paris"}}));
  EXPECT_EQ(a.tool_calls[1].id, "call_1");
  EXPECT_EQ(a.tool_calls[2].id, "t-1");
  EXPECT_EQ(a.tool_calls[2].arguments_json, "{}");
  // Results come first (they must follow the calls), in their order, then the turn's text.
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_EQ(r.messages[2].tool_call_id, "t-1");
  EXPECT_EQ(r.messages[2].name, "get_time");
  EXPECT_EQ(Json::parse(r.messages[2].content), Json({{"now", "noon"}}));
  EXPECT_EQ(r.messages[3].tool_call_id, "call_0");
  EXPECT_EQ(Json::parse(r.messages[3].content), Json({{"temp", 20}}));
  EXPECT_EQ(r.messages[4].tool_call_id, "call_1");
  EXPECT_EQ(Json::parse(r.messages[4].content), Json({{"temp", 25}}));
  EXPECT_EQ(r.messages[5].role, "user");
  EXPECT_EQ(r.messages[5].content, "and be quick");
}

TEST(GeminiRequest, StreamedModelChunksKeptAsHistoryJoinIntoOneTurn) {
  // What the SDK's chats record after a streamed answer: one model content per chunk, the last
  // with an empty text; thought summaries are not part of the answer.
  const Json body = Json::parse(R"({"contents": [
      {"role": "user", "parts": [{"text": "q1"}]},
      {"role": "model", "parts": [{"text": "thinking...", "thought": true}]},
      {"role": "model", "parts": [{"text": "Hel"}]},
      {"role": "model", "parts": [{"text": "lo"}]},
      {"role": "model", "parts": [{"text": "", "thoughtSignature": "c2ln"}]},
      {"role": "model", "parts": []},
      {"role": "user", "parts": [{"text": "q2"}]},
      {"parts": [{"text": "q3, no role"}]}]})");
  ChatRequest r = Parse(body);
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[1].role, "assistant");
  EXPECT_EQ(r.messages[1].content, "Hello");
  EXPECT_EQ(r.messages[2].content, "q2");
  EXPECT_EQ(r.messages[3].role, "user");
  EXPECT_EQ(r.messages[3].content, "q3, no role");
}

TEST(GeminiRequest, FunctionCallingModes) {
  auto with_mode = [](Json fcc) {
    return Json{{"contents", {UserText("q")}},
                {"tools", {{{"functionDeclarations", {{{"name", "a"}}, {{"name", "b"}}, {{"name", "c"}}}}}}},
                {"toolConfig", {{"functionCallingConfig", std::move(fcc)}}}};
  };
  EXPECT_EQ(Parse(with_mode({{"mode", "NONE"}})).tool_choice, "none");
  EXPECT_EQ(Parse(with_mode({{"mode", "ANY"}})).tool_choice, "required");
  EXPECT_EQ(Parse(with_mode({{"mode", "VALIDATED"}})).tool_choice, "auto");
  EXPECT_EQ(Parse(with_mode({{"mode", "MODE_UNSPECIFIED"}})).tool_choice, "");
  EXPECT_EQ(Parse(with_mode({{"mode", "ANY"}, {"allowedFunctionNames", {"b"}}})).tool_choice, "b");
  ChatRequest two = Parse(with_mode({{"mode", "ANY"}, {"allowedFunctionNames", {"a", "c"}}}));
  EXPECT_EQ(two.tool_choice, "required");
  ASSERT_EQ(two.tools.size(), 2u);  // "call one of these": the others are withheld
  EXPECT_EQ(two.tools[0].name, "a");
  EXPECT_EQ(two.tools[1].name, "c");
  ExpectRefused(with_mode({{"mode", "SOMETIMES"}}), "functionCallingConfig.mode");
  ExpectRefused(with_mode({{"mode", "AUTO"}, {"allowedFunctionNames", {"a"}}}), "allowedFunctionNames");
}

TEST(GeminiRequest, StructuredOutput) {
  auto with = [](Json gc) { return Json{{"contents", {UserText("q")}}, {"generationConfig", std::move(gc)}}; };
  ChatRequest obj = Parse(with({{"responseMimeType", "application/json"}}));
  ASSERT_TRUE(obj.response_format.has_value());
  EXPECT_EQ(obj.response_format->kind, ResponseFormat::Kind::kJsonObject);

  ChatRequest gemini_schema = Parse(with({{"responseMimeType", "application/json"},
                                          {"responseSchema", {{"type", "ARRAY"}, {"items", {{"type", "STRING"}}}}}}));
  ASSERT_TRUE(gemini_schema.response_format.has_value());
  EXPECT_EQ(gemini_schema.response_format->kind, ResponseFormat::Kind::kJsonSchema);
  EXPECT_FALSE(gemini_schema.response_format->name.empty());  // OpenAI requires a name
  EXPECT_EQ(Json::parse(gemini_schema.response_format->schema_json),
            Json::parse(R"({"type":"array","items":{"type":"string"}})"));

  ChatRequest json_schema = Parse(with({{"responseMimeType", "application/json"},
                                        {"responseJsonSchema", {{"type", "object"}, {"additionalProperties", false}}}}));
  ASSERT_TRUE(json_schema.response_format.has_value());
  EXPECT_EQ(Json::parse(json_schema.response_format->schema_json),
            Json::parse(R"({"type":"object","additionalProperties":false})"));

  ExpectRefused(with({{"responseSchema", {{"type", "STRING"}}}}), "responseSchema");
  ExpectRefused(with({{"responseMimeType", "text/x.enum"}}), "responseMimeType");
  ExpectRefused(with({{"responseMimeType", "application/json"},
                      {"responseSchema", {{"type", "STRING"}}},
                      {"responseJsonSchema", {{"type", "string"}}}}),
                "mutually exclusive");
}

TEST(GeminiRequest, AcceptedAndIgnored) {
  ChatRequest r = Parse({{"contents", {UserText("q")}},
                         {"model", "models/something-else"},
                         {"safetySettings", {{{"category", "HARM_CATEGORY_HATE_SPEECH"}, {"threshold", "OFF"}}}},
                         {"labels", {{"k", "v"}}},
                         {"generationConfig",
                          {{"thinkingConfig", {{"thinkingBudget", 0}}},
                           {"mediaResolution", "MEDIA_RESOLUTION_LOW"},
                           {"responseModalities", {"TEXT"}},
                           {"responseLogprobs", false}}}});
  EXPECT_EQ(r.model, "gemini-x");  // the URL names the model
  ASSERT_EQ(r.messages.size(), 1u);
}

TEST(GeminiRequest, RefusalsNameTheField) {
  const Json q = {UserText("q")};
  auto parts = [](Json part) { return Json{{"contents", {{{"role", "user"}, {"parts", {std::move(part)}}}}}}; };
  auto gen = [&](Json gc) { return Json{{"contents", q}, {"generationConfig", std::move(gc)}}; };
  ExpectRefused(parts({{"inlineData", {{"mimeType", "image/png"}, {"data", "AAAA"}}}}), "contents[0].parts[0].inlineData");
  ExpectRefused(parts({{"file_data", {{"file_uri", "gs://x"}}}}), "contents[0].parts[0].file_data");
  ExpectRefused(parts({{"executableCode", {{"code", "1"}}}}), "executableCode");
  ExpectRefused(parts({{"text", "a"}, {"videoMetadata", Json::object()}}), "videoMetadata");
  ExpectRefused(parts({{"functionResponse", {{"name", "f"}, {"response", Json::object()},
                                             {"parts", {{{"inlineData", Json::object()}}}}}}}),
                "functionResponse.parts");
  ExpectRefused(parts({{"functionCall", {{"name", "f"}}}}), "functionCall");  // in a user turn
  ExpectRefused(parts(Json::object()), "contents[0].parts[0]");
  ExpectRefused(parts({{"text", 5}}), "contents[0].parts[0].text");
  ExpectRefused(parts({{"weird", 1}}), "weird");
  ExpectRefused({{"contents", {{{"role", "model"}, {"parts", {{{"functionCall", {{"args", Json::object()}}}}}}}}}},
                "functionCall.name");
  ExpectRefused({{"contents", {{{"role", "model"}, {"parts", {{{"functionCall", {{"name", "f"}, {"args", "x"}}}}}}}}}},
                "functionCall.args");
  ExpectRefused({{"contents", {{{"role", "system"}, {"parts", {{{"text", "x"}}}}}}}}, "contents[0].role");
  ExpectRefused({{"contents", {{{"role", "user"}, {"parts", "x"}}}}}, "contents[0].parts");
  ExpectRefused({{"contents", Json::array()}}, "contents");
  ExpectRefused({{"contents", "hello"}}, "contents");
  ExpectRefused(Json::object(), "contents");
  ExpectRefused({{"contents", q}, {"foo", 1}}, "foo");
  ExpectRefused({{"contents", q}, {"cachedContent", "cachedContents/abc"}}, "cachedContent");
  ExpectRefused({{"contents", q}, {"tools", {{{"googleSearch", Json::object()}}}}}, "tools[0].googleSearch");
  ExpectRefused({{"contents", q}, {"tools", {{{"code_execution", Json::object()}}}}}, "tools[0].code_execution");
  ExpectRefused({{"contents", q}, {"tools", {{{"functionDeclarations", {{{"description", "no name"}}}}}}}},
                "tools[0].functionDeclarations[0].name");
  ExpectRefused({{"contents", q},
                 {"tools", {{{"functionDeclarations", {{{"name", "f"}, {"parameters", {{"type", "OBJECT"}}},
                                                         {"parametersJsonSchema", {{"type", "object"}}}}}}}}}},
                "mutually exclusive");
  ExpectRefused({{"contents", q}, {"systemInstruction", {{"parts", {{{"inlineData", Json::object()}}}}}}},
                "systemInstruction.parts[0].inlineData");
  ExpectRefused(gen({{"candidateCount", 2}}), "generationConfig.candidateCount");
  ExpectRefused(gen({{"candidateCount", 0}}), "generationConfig.candidateCount");
  ExpectRefused(gen({{"responseLogprobs", true}}), "generationConfig.responseLogprobs");
  ExpectRefused(gen({{"logprobs", 3}}), "generationConfig.logprobs");
  ExpectRefused(gen({{"responseModalities", {"TEXT", "IMAGE"}}}), "generationConfig.responseModalities");
  ExpectRefused(gen({{"speechConfig", Json::object()}}), "generationConfig.speechConfig");
  ExpectRefused(gen({{"bogus", 1}}), "generationConfig.bogus");
  ExpectRefused(gen({{"maxOutputTokens", "many"}}), "generationConfig.maxOutputTokens");
  ExpectRefused(gen({{"maxOutputTokens", 0}}), "generationConfig.maxOutputTokens");
  ExpectRefused(gen({{"temperature", "hot"}}), "generationConfig.temperature");
  ExpectRefused(gen({{"stopSequences", "END"}}), "generationConfig.stopSequences");
  ExpectRefused(gen({{"seed", 1.5}}), "generationConfig.seed");
  ExpectRefused(gen("config"), "generationConfig");

  Result<ChatRequest> bad = ParseGeminiClientRequest("{\"contents\": [", "m", false);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  Json deep = UserText("x");
  for (int i = 0; i < 200; ++i) deep = Json::array({deep});
  EXPECT_FALSE(ParseGeminiClientRequest(Json{{"contents", deep}}.dump(), "m", false).ok());
}

TEST(GeminiRequest, ErrorBodyIsGeminiShaped) {
  Result<ChatRequest> r = ParseGeminiClientRequest(R"({"contents":[],"x":1})", "m", false);
  ASSERT_FALSE(r.ok());
  const Json body = Json::parse(
      FrontFor(WireFormat::kGemini).ErrorBody({400, ErrorKind::kInvalidRequest, r.status().message()}));
  EXPECT_EQ(body["error"]["code"], 400);
  EXPECT_EQ(body["error"]["status"], "INVALID_ARGUMENT");
  EXPECT_EQ(body["error"]["message"], r.status().message());
}

TEST(GeminiCountTokens, ContentsOrAWholeRequest) {
  Result<ChatRequest> r = ParseGeminiCountTokensRequest(Json{{"contents", {UserText("count me")}}}.dump(), "m");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->messages.size(), 1u);
  EXPECT_EQ(r->messages[0].content, "count me");

  r = ParseGeminiCountTokensRequest(
      Json{{"generateContentRequest",
            {{"model", "models/m"}, {"contents", {UserText("q")}}, {"systemInstruction", {{"parts", {{{"text", "s"}}}}}}}}}
          .dump(),
      "m");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->system, "s");

  for (const Json& bad : {Json::object(), Json{{"contents", {UserText("a")}}, {"generateContentRequest", Json::object()}},
                          Json{{"contents", {UserText("a")}}, {"systemInstruction", Json::object()}}}) {
    Result<ChatRequest> b = ParseGeminiCountTokensRequest(bad.dump(), "m");
    EXPECT_FALSE(b.ok()) << bad.dump();
  }
  Result<ChatRequest> nested = ParseGeminiCountTokensRequest(
      Json{{"generateContentRequest", {{"contents", {UserText("a")}}, {"generationConfig", {{"candidateCount", 3}}}}}}
          .dump(),
      "m");
  ASSERT_FALSE(nested.ok());
  EXPECT_NE(nested.status().message().find("generateContentRequest.generationConfig.candidateCount"), std::string::npos)
      << nested.status().message();

  const Json out = Json::parse(BuildGeminiCountTokensResponse(31));
  EXPECT_EQ(out["totalTokens"], 31);
  EXPECT_EQ(out["promptTokensDetails"][0]["tokenCount"], 31);
}

// ---- responses

TEST(GeminiResponse, TextAndUsage) {
  ChatResponse resp;
  resp.id = "resp-1";
  resp.model = "upstream-model";
  resp.content = "Hello there";
  resp.finish = FinishReason::kLength;
  resp.usage = {12, 5};
  const Json j = Json::parse(BuildGeminiClientResponse(resp, "my-model"));
  const Json& c = j["candidates"][0];
  EXPECT_EQ(c["content"]["role"], "model");
  EXPECT_EQ(c["content"]["parts"], Json::parse(R"([{"text":"Hello there"}])"));
  EXPECT_EQ(c["finishReason"], "MAX_TOKENS");
  EXPECT_EQ(c["index"], 0);
  EXPECT_EQ(j["usageMetadata"], Json::parse(R"({"promptTokenCount":12,"candidatesTokenCount":5,"totalTokenCount":17})"));
  EXPECT_EQ(j["modelVersion"], "my-model");
  EXPECT_EQ(j["responseId"], "resp-1");
}

TEST(GeminiResponse, FunctionCallsAreObjectsAndEndWithStop) {
  ChatResponse resp;
  resp.tool_calls = {{"call_1", "get_weather", R"({"city":"Paris"})"}, {"call_2", "noop", ""}};
  resp.finish = FinishReason::kToolCalls;
  const Json j = Json::parse(BuildGeminiClientResponse(resp, "m"));
  const Json& parts = j["candidates"][0]["content"]["parts"];
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0]["functionCall"], Json::parse(R"({"name":"get_weather","args":{"city":"Paris"}})"));
  EXPECT_EQ(parts[1]["functionCall"]["args"], Json::object());
  EXPECT_EQ(j["candidates"][0]["finishReason"], "STOP");
  EXPECT_FALSE(j["responseId"].get<std::string>().empty());
}

// ---- streams

StreamEvent Ev(Kind k) {
  StreamEvent e;
  e.kind = k;
  return e;
}
StreamEvent Text(std::string t) {
  StreamEvent e = Ev(Kind::kTextDelta);
  e.text = std::move(t);
  return e;
}
StreamEvent UsageEv(int64_t in, int64_t out) {
  StreamEvent e = Ev(Kind::kUsage);
  e.usage = {in, out};
  return e;
}
StreamEvent ToolStart(int index, std::string name) {
  StreamEvent e = Ev(Kind::kToolCallStart);
  e.tool_index = index;
  e.tool_call.id = "call_x" + std::to_string(index);
  e.tool_call.name = std::move(name);
  return e;
}
StreamEvent ToolDelta(int index, std::string piece) {
  StreamEvent e = Ev(Kind::kToolCallDelta);
  e.tool_index = index;
  e.text = std::move(piece);
  return e;
}
StreamEvent Finish(FinishReason r) {
  StreamEvent e = Ev(Kind::kFinish);
  e.finish = r;
  return e;
}
StreamEvent StartEv(std::string id) {
  StreamEvent e = Ev(Kind::kStart);
  e.id = std::move(id);
  return e;
}

std::string EncodeAll(const std::vector<StreamEvent>& events, bool sse = true) {
  auto enc = MakeGeminiStreamEncoder("client-model", sse);
  std::string out;
  for (const StreamEvent& e : events) enc->Encode(e, &out);
  return out;
}

// Splits an SSE body the way the @google/genai SDK does, checking Gemini's framing on the way:
// every event is one "data: " line ended by "\r\n\r\n", nothing else.
std::vector<Json> SseChunks(const std::string& body) {
  std::vector<Json> chunks;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\r\n\r\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated event at byte " << pos;
    if (end == std::string::npos) break;
    const std::string event = body.substr(pos, end - pos);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    EXPECT_EQ(event.find_first_of("\r\n"), std::string::npos) << "one line per event: " << event;
    chunks.push_back(Json::parse(event.substr(6)));
    pos = end + 4;
  }
  return chunks;
}

TEST(GeminiStream, TextChunksThenALastChunkWithFinishAndUsage) {
  const std::string body = EncodeAll({StartEv("up-7"), UsageEv(9, -1), Text("Hel"), Text(""), Text("lo"),
                                      Finish(FinishReason::kStop), UsageEv(-1, 2), Ev(Kind::kDone)});
  const std::vector<Json> chunks = SseChunks(body);
  ASSERT_EQ(chunks.size(), 3u) << body;
  std::string text;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Json& c = chunks[i];
    EXPECT_EQ(c["responseId"], "up-7");
    EXPECT_EQ(c["modelVersion"], "client-model");
    const Json& cand = c["candidates"][0];
    EXPECT_EQ(cand["content"]["role"], "model");
    ASSERT_FALSE(cand["content"]["parts"].empty());  // the SDK's chats drop turns with empty chunks
    for (const Json& p : cand["content"]["parts"]) text += p["text"].get<std::string>();
    EXPECT_EQ(cand.contains("finishReason"), i + 1 == chunks.size());
    EXPECT_EQ(c["usageMetadata"]["promptTokenCount"], 9);
  }
  EXPECT_EQ(text, "Hello");
  EXPECT_EQ(chunks.back()["candidates"][0]["finishReason"], "STOP");
  EXPECT_EQ(chunks.back()["usageMetadata"],
            Json::parse(R"({"promptTokenCount":9,"candidatesTokenCount":2,"totalTokenCount":11})"));
  EXPECT_FALSE(chunks[0]["usageMetadata"].contains("candidatesTokenCount"));
}

TEST(GeminiStream, FunctionCallsArriveWholeInTheLastChunk) {
  const std::string body = EncodeAll({Text("Let me check."), ToolStart(0, "get_weather"), ToolDelta(0, "{\"ci"),
                                      ToolDelta(0, "ty\":\"Paris\",\"b\":1}"), ToolStart(1, "noop"),
                                      ToolDelta(1, "not json"), Finish(FinishReason::kToolCalls), Ev(Kind::kDone)});
  const std::vector<Json> chunks = SseChunks(body);
  ASSERT_EQ(chunks.size(), 2u) << body;
  const Json& last = chunks[1]["candidates"][0];
  EXPECT_EQ(last["finishReason"], "STOP");
  ASSERT_EQ(last["content"]["parts"].size(), 2u);
  EXPECT_EQ(last["content"]["parts"][0]["functionCall"],
            Json::parse(R"({"name":"get_weather","args":{"city":"Paris","b":1}})"));
  EXPECT_EQ(last["content"]["parts"][1]["functionCall"]["args"], Json::parse(R"({"_raw":"not json"})"));
  // The model's key order survives (ordered output).
  EXPECT_NE(body.find(R"("args":{"city":"Paris","b":1})"), std::string::npos) << body;
}

TEST(GeminiStream, ReadBackByTheGatewaysGeminiDecoder) {
  const std::vector<StreamEvent> in = {StartEv("r1"), UsageEv(4, -1), Text("a"), Text("b"), ToolStart(0, "f"),
                                       ToolDelta(0, "{\"x\":[1,2]}"), Finish(FinishReason::kLength),
                                       UsageEv(4, 3), Ev(Kind::kDone)};
  const std::string body = EncodeAll(in);
  auto dec = MakeStreamDecoder(WireFormat::kGemini);
  std::vector<StreamEvent> out;
  // Byte by byte: the encoder's framing must hold at any boundary.
  for (char c : body) ASSERT_TRUE(dec->Feed(std::string_view(&c, 1), &out).ok());
  ASSERT_TRUE(dec->Finish(&out).ok());
  std::string text;
  std::string tool_name, tool_args;
  FinishReason finish = FinishReason::kNone;
  Usage usage;
  bool done = false;
  for (const StreamEvent& e : out) {
    if (e.kind == Kind::kTextDelta) text += e.text;
    if (e.kind == Kind::kToolCallStart) tool_name = e.tool_call.name;
    if (e.kind == Kind::kToolCallDelta) tool_args += e.text;
    if (e.kind == Kind::kFinish) finish = e.finish;
    if (e.kind == Kind::kUsage) {
      if (e.usage.input_tokens >= 0) usage.input_tokens = e.usage.input_tokens;
      if (e.usage.output_tokens >= 0) usage.output_tokens = e.usage.output_tokens;
    }
    if (e.kind == Kind::kDone) done = true;
  }
  EXPECT_EQ(text, "ab");
  EXPECT_EQ(tool_name, "f");
  EXPECT_EQ(Json::parse(tool_args), Json::parse(R"({"x":[1,2]})"));
  EXPECT_EQ(finish, FinishReason::kLength);
  EXPECT_EQ(usage.input_tokens, 4);
  EXPECT_EQ(usage.output_tokens, 3);
  EXPECT_TRUE(done);
}

TEST(GeminiStream, NothingButDoneStillEndsWellFormed) {
  const std::vector<Json> chunks = SseChunks(EncodeAll({Ev(Kind::kDone)}));
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0]["candidates"][0]["content"]["parts"], Json::parse(R"([{"text":""}])"));
  EXPECT_EQ(chunks[0]["candidates"][0]["finishReason"], "STOP");
  EXPECT_EQ(chunks[0]["usageMetadata"]["totalTokenCount"], 0);
  EXPECT_FALSE(chunks[0]["responseId"].get<std::string>().empty());
}

TEST(GeminiStream, ErrorMidStreamIsAnErrorChunkAndTheEnd) {
  auto enc = MakeGeminiStreamEncoder("m", true);
  std::string out;
  enc->Encode(Text("partial"), &out);
  enc->EncodeError({429, ErrorKind::kRateLimit, "budget exhausted"}, &out);
  enc->Encode(Text("after"), &out);
  enc->Encode(Ev(Kind::kDone), &out);
  enc->EncodeError({500, ErrorKind::kApi, "again"}, &out);
  const std::vector<Json> chunks = SseChunks(out);
  ASSERT_EQ(chunks.size(), 2u) << out;
  EXPECT_EQ(chunks[1], Json::parse(R"({"error":{"code":429,"message":"budget exhausted","status":"RESOURCE_EXHAUSTED"}})"));
  // The gateway's own decoder reports it as the vendor's error.
  auto dec = MakeStreamDecoder(WireFormat::kGemini);
  std::vector<StreamEvent> events;
  EXPECT_FALSE(dec->Feed(out, &events).ok());
  ASSERT_NE(dec->upstream_error(), nullptr);
  EXPECT_EQ(dec->upstream_error()->kind, ErrorKind::kRateLimit);
}

TEST(GeminiStream, OversizedArgumentsFailTheStreamInsteadOfBuffering) {
  auto enc = MakeGeminiStreamEncoder("m", true);
  std::string out;
  enc->Encode(ToolStart(0, "f"), &out);
  const std::string piece(1 << 20, 'x');
  for (int i = 0; i < 17; ++i) enc->Encode(ToolDelta(0, piece), &out);
  enc->Encode(Ev(Kind::kDone), &out);
  const std::vector<Json> chunks = SseChunks(out);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0]["error"]["code"], 502);
}

TEST(GeminiStream, JsonArrayWithoutAltSse) {
  EXPECT_STREQ(GeminiStreamContentType(false), "application/json");
  EXPECT_STREQ(GeminiStreamContentType(true), "text/event-stream");
  const std::string body = EncodeAll({Text("a"), Text("b"), Finish(FinishReason::kStop), Ev(Kind::kDone)}, false);
  const Json arr = Json::parse(body);
  ASSERT_TRUE(arr.is_array());
  ASSERT_EQ(arr.size(), 3u);
  EXPECT_EQ(arr[0]["candidates"][0]["content"]["parts"][0]["text"], "a");
  EXPECT_EQ(arr[2]["candidates"][0]["finishReason"], "STOP");

  auto enc = MakeGeminiStreamEncoder("m", false);
  std::string out;
  enc->EncodeError({503, ErrorKind::kOverloaded, "busy"}, &out);
  const Json err = Json::parse(out);
  ASSERT_TRUE(err.is_array());
  EXPECT_EQ(err[0]["error"]["status"], "UNAVAILABLE");
}

// Parts read the same way in user turns, model turns and the system instruction: exact messages.
TEST(GeminiRequest, PartErrorsAreWordForWordInEveryTurn) {
  auto turn = [](const char* role, Json parts) {
    return Json{{"contents", {{{"role", role}, {"parts", std::move(parts)}}}}};
  };
  auto system = [](Json parts) { return Json{{"contents", {UserText("q")}}, {"systemInstruction", {{"parts", std::move(parts)}}}}; };
  const std::vector<std::pair<Json, std::string>> cases = {
      {turn("user", {{{"text", 5}}}), "contents[0].parts[0].text: expected a string"},
      {turn("model", {{{"text", "a"}}, {{"text", false}}}), "contents[0].parts[1].text: expected a string"},
      {system({{{"text", "a"}}, {{"text", 5}}}), "systemInstruction.parts[1].text: expected a string"},
      {turn("user", "x"), "contents[0].parts: expected an array"},
      {turn("model", Json::object()), "contents[0].parts: expected an array"},
      {system("x"), "systemInstruction.parts: expected an array"},
      {system({"x"}), "systemInstruction.parts[0]: expected an object"},
      {turn("user", {"x"}), "contents[0].parts[0]: expected an object"},
      {turn("model", {{{"text", "a"}, {"thought", "yes"}}}), "contents[0].parts[0].thought: expected true or false"},
      {turn("user", {{{"functionCall", {{"name", "f"}}}}}), "contents[0].parts[0].functionCall: only in a model turn"},
      {turn("model", {{{"functionResponse", {{"name", "f"}}}}}),
       "contents[0].parts[0].functionResponse: only in a user turn"},
  };
  for (const auto& [body, message] : cases) {
    Result<ChatRequest> r = ParseGeminiClientRequest(body.dump(), "m", false);
    ASSERT_FALSE(r.ok()) << body.dump();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), message) << body.dump();
  }
  Json too_many = Json::array();
  for (size_t i = 0; i <= 10000; ++i) too_many.push_back({{"text", "a"}});
  const std::vector<std::pair<Json, std::string>> too_many_cases = {
      {turn("user", too_many), "contents[0].parts: at most 10000 parts"},
      {system(too_many), "systemInstruction.parts: at most 10000 parts"},
  };
  for (const auto& [body, message] : too_many_cases) {
    Result<ChatRequest> r = ParseGeminiClientRequest(body.dump(), "m", false);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().message(), message);
  }
  // Thought parts are skipped; text joins in order, in turns and in the system instruction.
  const Json user_parts = {{{"text", "a"}}, {{"text", "b"}, {"thought", true}}, {{"text", "c"}}};
  const Json system_parts = {{{"text", "s1"}}, {{"text", "s2"}}};
  Json body = turn("user", user_parts);
  body["systemInstruction"] = {{"parts", system_parts}};
  ChatRequest r = Parse(body);
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].content, "ac");
  EXPECT_EQ(r.system, "s1s2");
}

}  // namespace
}  // namespace keel::gateway
