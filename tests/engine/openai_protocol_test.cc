// Direct tests of the OpenAI protocol parsers and response shapers (no HTTP, no scheduler).
// The end-to-end behaviour over real HTTP is covered by server_test.cc.
#include "keel/engine/openai_protocol.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/engine/tokenizer.h"
#include "tests/engine/test_util.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;

Tokenizer LoadAidreams() {
  auto t = Tokenizer::Load(test::ModelsDir() + "/aidreams_tok512.bin", 512);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

TEST(OpenAiProtocol, RenderChatJoinsContentsWithNewlines) {
  EXPECT_EQ(RenderChat({}), "");
  EXPECT_EQ(RenderChat({"A"}), "A");
  EXPECT_EQ(RenderChat({"A", "B"}), "A\nB");
  EXPECT_EQ(RenderChat({"A", "", "C"}), "A\n\nC");
}

TEST(OpenAiProtocol, BadParamAndErrorObject) {
  ApiError e = BadParam("top_p", "'top_p' must be in (0, 1]");
  EXPECT_EQ(e.status, 400);
  json j = ErrorObject(e);
  EXPECT_EQ(j["error"]["message"], "'top_p' must be in (0, 1]");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "top_p");
  EXPECT_TRUE(j["error"]["code"].is_null());
  EXPECT_TRUE(ErrorObject(BadParam("", "whole body"))["error"]["param"].is_null());
}

TEST(OpenAiProtocol, HttpErrorBodyTypesAndCodes) {
  json nf = json::parse(OpenAiHttpErrorBody(404, "no such path"));
  EXPECT_EQ(nf["error"]["type"], "invalid_request_error");
  EXPECT_EQ(nf["error"]["code"], "not_found");
  EXPECT_EQ(nf["error"]["message"], "no such path");
  json busy = json::parse(OpenAiHttpErrorBody(503, "busy"));
  EXPECT_EQ(busy["error"]["type"], "server_error");
  EXPECT_TRUE(busy["error"]["code"].is_null());
}

TEST(OpenAiProtocol, DumpReplacesInvalidUtf8) {
  EXPECT_EQ(Dump(json("a\xff")), "\"a\xEF\xBF\xBD\"");
}

TEST(OpenAiProtocol, FieldReaders) {
  json body = {{"i", 5}, {"big", 18446744073709551615ull}, {"f", 1.5}, {"s", "x"}, {"b", true}, {"n", nullptr}};
  int64_t i = -1;
  bool present = true;
  EXPECT_FALSE(GetInt(body, "missing", &i, &present));
  EXPECT_FALSE(present);
  EXPECT_EQ(i, -1);
  EXPECT_FALSE(GetInt(body, "n", &i, &present));
  EXPECT_FALSE(present);
  EXPECT_FALSE(GetInt(body, "i", &i, &present));
  EXPECT_TRUE(present);
  EXPECT_EQ(i, 5);
  EXPECT_FALSE(GetInt(body, "big", &i, &present));
  EXPECT_EQ(i, std::numeric_limits<int64_t>::max());
  auto e = GetInt(body, "f", &i, &present);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "'f' must be an integer");
  EXPECT_EQ(e->param, "f");

  double d = 0;
  EXPECT_FALSE(GetNumber(body, "f", &d, &present));
  EXPECT_DOUBLE_EQ(d, 1.5);
  EXPECT_FALSE(GetNumber(body, "i", &d, &present));
  EXPECT_DOUBLE_EQ(d, 5);
  e = GetNumber(body, "s", &d, &present);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "'s' must be a number");

  bool b = false;
  EXPECT_FALSE(GetBool(body, "b", &b));
  EXPECT_TRUE(b);
  e = GetBool(body, "i", &b);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "'i' must be a boolean");
}

TEST(OpenAiProtocol, ParseMaxTokensBounds) {
  GenerationParams p;
  // Defaults: completions take min(16, what is left); chat takes what is left.
  EXPECT_FALSE(ParseMaxTokens(json::object(), false, 10, 512, &p));
  EXPECT_EQ(p.max_tokens, 16);
  EXPECT_FALSE(ParseMaxTokens(json::object(), false, 500, 512, &p));
  EXPECT_EQ(p.max_tokens, 12);
  EXPECT_FALSE(ParseMaxTokens(json::object(), true, 10, 512, &p));
  EXPECT_EQ(p.max_tokens, 502);

  // Explicit values: 1 .. context - prompt.
  EXPECT_FALSE(ParseMaxTokens({{"max_tokens", 1}}, false, 10, 512, &p));
  EXPECT_EQ(p.max_tokens, 1);
  EXPECT_FALSE(ParseMaxTokens({{"max_tokens", 502}}, false, 10, 512, &p));
  EXPECT_EQ(p.max_tokens, 502);
  auto e = ParseMaxTokens({{"max_tokens", 503}}, false, 10, 512, &p);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "max_tokens");
  EXPECT_EQ(e->message,
            "This model's maximum context length is 512 tokens. However, you requested 513 tokens "
            "(10 in the prompt, 503 for the completion). Please reduce the length of the prompt or completion.");
  EXPECT_EQ(e->code, "context_length_exceeded");
  e = ParseMaxTokens({{"max_tokens", 0}}, false, 10, 512, &p);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "'max_tokens' must be at least 1");
  // A huge value neither overflows nor passes.
  e = ParseMaxTokens({{"max_tokens", 18446744073709551615ull}}, false, 10, 512, &p);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "max_tokens");

  // Chat prefers max_completion_tokens and names it in errors.
  EXPECT_FALSE(ParseMaxTokens({{"max_completion_tokens", 3}, {"max_tokens", 7}}, true, 10, 512, &p));
  EXPECT_EQ(p.max_tokens, 3);
  e = ParseMaxTokens({{"max_completion_tokens", 0}}, true, 10, 512, &p);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "max_completion_tokens");
  // Completions ignore max_completion_tokens.
  EXPECT_FALSE(ParseMaxTokens({{"max_completion_tokens", 3}}, false, 10, 512, &p));
  EXPECT_EQ(p.max_tokens, 16);

  // A prompt that fills the context is an error on the prompt field.
  e = ParseMaxTokens(json::object(), false, 512, 512, &p);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "prompt");
  EXPECT_EQ(e->message,
            "This model's maximum context length is 512 tokens. However, your prompt resulted in 512 tokens. Please "
            "reduce the length of the prompt.");
  EXPECT_EQ(e->code, "context_length_exceeded");  // what clients that trim history look for
  e = ParseMaxTokens(json::object(), true, 600, 512, &p);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "messages");
}

TEST(OpenAiProtocol, ParsePromptForms) {
  Tokenizer tok = LoadAidreams();
  const std::vector<int> hello = tok.Encode("Hello", /*bos=*/true);
  const std::vector<int> world = tok.Encode("World", /*bos=*/true);
  using Prompts = std::vector<std::vector<int>>;
  Prompts out;
  EXPECT_FALSE(ParsePrompt({{"prompt", "Hello"}}, tok, 512, &out));
  EXPECT_EQ(out, Prompts{hello});
  out.clear();
  EXPECT_FALSE(ParsePrompt(json::parse(R"({"prompt":["Hello"]})"), tok, 512, &out));
  EXPECT_EQ(out, Prompts{hello});
  out.clear();
  EXPECT_FALSE(ParsePrompt(json::parse(R"({"prompt":[5,6,511]})"), tok, 512, &out));
  EXPECT_EQ(out, (Prompts{{5, 6, 511}}));  // no BOS added to ids
  out.clear();
  EXPECT_FALSE(ParsePrompt(json::parse(R"({"prompt":[[7,8]]})"), tok, 512, &out));
  EXPECT_EQ(out, (Prompts{{7, 8}}));
  // Several prompts, in order, in either form and mixed.
  out.clear();
  EXPECT_FALSE(ParsePrompt(json::parse(R"({"prompt":["Hello",[7,8],"World"]})"), tok, 512, &out));
  EXPECT_EQ(out, (Prompts{hello, {7, 8}, world}));
  out.clear();
  json most = {{"prompt", json::array()}};
  for (int i = 0; i < kMaxPromptsPerRequest; ++i) most["prompt"].push_back(json::array({i}));
  EXPECT_FALSE(ParsePrompt(most, tok, 512, &out));
  EXPECT_EQ(out.size(), static_cast<size_t>(kMaxPromptsPerRequest));
  EXPECT_EQ(out.back(), std::vector<int>{kMaxPromptsPerRequest - 1});

  struct Bad {
    const char* body;
    const char* message;
  };
  for (const Bad& b : std::vector<Bad>{
           {R"({})", "'prompt' is required"},
           {R"({"prompt":null})", "'prompt' is required"},
           {R"({"prompt":5})", "'prompt' must be a string, an array of strings, or an array of token ids"},
           {R"({"prompt":[]})", "'prompt' must not be empty"},
           {R"({"prompt":[[]]})", "'prompt' must not be empty"},
           {R"({"prompt":["a",[]]})", "'prompt' must not be empty"},
           {R"({"prompt":[1,"b"]})", "token ids must be integers"},
           {R"({"prompt":["a",1]})", "an array of prompts must hold only strings or arrays of token ids"},
           {R"({"prompt":["a",null]})", "an array of prompts must hold only strings or arrays of token ids"},
           {R"({"prompt":[[1,[2]]]})", "token ids must be integers"},
           {R"({"prompt":["a",[600]]})", "token id 600 is outside the vocabulary (0..511)"},
           {R"({"prompt":[1.5]})", "token ids must be integers"},
           {R"({"prompt":[512]})", "token id 512 is outside the vocabulary (0..511)"},
           {R"({"prompt":[-1]})", "token id -1 is outside the vocabulary (0..511)"},
           {R"({"prompt":[18446744073709551615]})",
            "token id 18446744073709551615 is outside the vocabulary (0..511)"},
       }) {
    out.clear();
    auto e = ParsePrompt(json::parse(b.body), tok, 512, &out);
    ASSERT_TRUE(e) << b.body;
    EXPECT_EQ(e->status, 400) << b.body;
    EXPECT_EQ(e->param, "prompt") << b.body;
    EXPECT_EQ(e->message, b.message) << b.body;
  }
  most["prompt"].push_back("one too many");
  auto e = ParsePrompt(most, tok, 512, &out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, fmt::format("'prompt' holds at most {} prompts", kMaxPromptsPerRequest));
}

TEST(OpenAiProtocol, ParseMessagesRendersWithTemplate) {
  Tokenizer tok = LoadAidreams();
  std::vector<int> out;
  json body = json::parse(R"({"messages":[{"role":"system","content":"A"},
                                           {"role":"user","content":[{"type":"text","text":"B"},
                                                                     {"type":"text","text":"C"}]},
                                           {"role":"assistant","content":null}]})");
  EXPECT_FALSE(ParseMessages(body, tok, &out));
  EXPECT_EQ(out, tok.Encode("A\nBC\n", /*bos=*/true));

  // A conversation replayed from a model with tools: the call and its result are turns of text.
  body = json::parse(R"({"messages":[{"role":"user","content":"x"},
                                     {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                                       "function":{"name":"f","arguments":"{}"}}]},
                                     {"role":"tool","tool_call_id":"c1","content":[{"type":"text","text":"y"}]}]})");
  EXPECT_FALSE(ParseMessages(body, tok, &out));
  EXPECT_EQ(out, tok.Encode("x\n\ny", /*bos=*/true));
  auto e = ParseMessages(json::parse(R"({"messages":[{"role":"user","content":"x"},{"role":"tool","content":"y"}]})"),
                         tok, &out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "messages[1].tool_call_id");
  EXPECT_EQ(e->message, "Missing required parameter: 'messages[1].tool_call_id'");
  e = ParseMessages(json::parse(R"({"messages":[{"role":"function","content":"y","name":"f"}]})"), tok, &out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "messages[0].role");
  EXPECT_EQ(e->message, "messages[0].role 'function' is not supported (system, developer, user, assistant, tool)");
  e = ParseMessages(json::parse(R"({"messages":[{"role":"user","content":null}]})"), tok, &out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "messages[0].content");
  EXPECT_EQ(e->message, "messages[0].content must be a string");
  e = ParseMessages(json::parse(R"({"messages":[]})"), tok, &out);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "'messages' must be a non-empty array");
}

TEST(OpenAiProtocol, ParseCommonSamplingAndModel) {
  ServerJob job;
  json body = json::parse(R"({"model":"m","temperature":0,"top_p":0.5,"top_k":3,"seed":7,
                              "stop":["a","b"],"stream":true,"stream_options":{"include_usage":true}})");
  EXPECT_FALSE(ParseCommon(body, "m", &job));
  EXPECT_EQ(job.params.sampling.temperature, 0.0f);
  EXPECT_EQ(job.params.sampling.top_p, 0.5f);
  EXPECT_EQ(job.params.sampling.top_k, 3);
  EXPECT_EQ(job.params.sampling.seed, 7u);
  EXPECT_EQ(job.params.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(job.stream);
  EXPECT_TRUE(job.include_usage);

  ServerJob other;
  auto e = ParseCommon({{"model", "x"}}, "m", &other);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 404);
  EXPECT_EQ(e->code, "model_not_found");
  e = ParseCommon({{"model", "m"}, {"temperature", 2.5}}, "m", &other);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "temperature");
  e = ParseCommon(json::parse(R"({"model":"m","stream_options":{"include_usage":1}})"), "m", &other);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "stream_options.include_usage");
  e = ParseCommon(json::parse(R"({"model":"m","stream_options":{"include_usage":true}})"), "m", &other);
  ASSERT_TRUE(e);  // without "stream": true, as OpenAI refuses it
  EXPECT_EQ(e->param, "stream_options");
  e = ParseCommon(json::parse(R"({"model":"m","stream":false,"stream_options":null})"), "m", &other);
  EXPECT_FALSE(e);  // null is absent
  e = ParseCommon(json::parse(R"({"model":"m","stop":["a",""]})"), "m", &other);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "stop sequences must not be empty");
}

TEST(OpenAiProtocol, RejectUnsupportedPerEndpoint) {
  EXPECT_FALSE(RejectUnsupported(json::parse(R"({"logprobs":false,"echo":false,"suffix":""})"), false));
  EXPECT_FALSE(RejectUnsupported(json::parse(R"({"logprobs":true,"tools":[]})"), true));
  EXPECT_FALSE(RejectUnsupported(json::parse(R"({"echo":true})"), false));  // supported: ParseEcho
  EXPECT_EQ(RejectUnsupported(json::parse(R"({"suffix":"x"})"), false)->param, "suffix");
  EXPECT_EQ(RejectUnsupported(json::parse(R"({"tools":[{}]})"), true)->param, "tools");
  EXPECT_FALSE(RejectUnsupported(json::parse(R"({"tools":[{}]})"), false));
}

TEST(OpenAiProtocol, ParseLogprobsPerEndpoint) {
  auto parse = [](const char* body, bool chat, int* out) {
    GenerationParams p;
    p.logprobs = 7;  // overwritten on success
    auto e = ParseLogprobs(json::parse(body), chat, &p);
    *out = p.logprobs;
    return e;
  };
  int n = 0;
  // Completions: an integer count of alternatives; false/null/absent mean none.
  EXPECT_FALSE(parse(R"({})", false, &n));
  EXPECT_EQ(n, -1);
  EXPECT_FALSE(parse(R"({"logprobs":null})", false, &n));
  EXPECT_EQ(n, -1);
  EXPECT_FALSE(parse(R"({"logprobs":false})", false, &n));
  EXPECT_EQ(n, -1);
  EXPECT_FALSE(parse(R"({"logprobs":0})", false, &n));
  EXPECT_EQ(n, 0);
  EXPECT_FALSE(parse(R"({"logprobs":20})", false, &n));
  EXPECT_EQ(n, 20);
  for (const char* bad : {R"({"logprobs":21})", R"({"logprobs":-1})", R"({"logprobs":true})",
                          R"({"logprobs":"5"})", R"({"logprobs":2.5})", R"({"logprobs":18446744073709551615})"}) {
    auto e = parse(bad, false, &n);
    ASSERT_TRUE(e) << bad;
    EXPECT_EQ(e->param, "logprobs") << bad;
    EXPECT_EQ(e->status, 400);
  }
  // Chat: a boolean plus top_logprobs, which needs logprobs true.
  EXPECT_FALSE(parse(R"({"logprobs":false})", true, &n));
  EXPECT_EQ(n, -1);
  EXPECT_FALSE(parse(R"({"logprobs":true})", true, &n));
  EXPECT_EQ(n, 0);
  EXPECT_FALSE(parse(R"({"logprobs":true,"top_logprobs":5})", true, &n));
  EXPECT_EQ(n, 5);
  EXPECT_FALSE(parse(R"({"logprobs":true,"top_logprobs":null})", true, &n));
  EXPECT_EQ(n, 0);
  auto e = parse(R"({"logprobs":1})", true, &n);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "logprobs");
  e = parse(R"({"top_logprobs":2})", true, &n);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "top_logprobs");
  EXPECT_NE(e->message.find("needs 'logprobs'"), std::string::npos) << e->message;
  e = parse(R"({"logprobs":true,"top_logprobs":21})", true, &n);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "top_logprobs");
  e = parse(R"({"logprobs":true,"top_logprobs":"3"})", true, &n);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "top_logprobs");
}

TEST(OpenAiProtocol, LogprobsObjectShapes) {
  Tokenizer tok = LoadAidreams();
  // Two tokens: the first follows BOS (its leading space is dropped, as in the text), the
  // second is a byte-fallback token for a byte that is not UTF-8 on its own.
  const int word = tok.Encode("Echoes", false).back();
  const int byte_e2 = 3 + 0xE2;
  std::vector<TokenLogprob> entries(2);
  entries[0] = {word, Tokenizer::kBos, -0.25f, {{word, -0.25f}, {byte_e2, -2.5f}}};
  entries[1] = {byte_e2, word, -1.5f, {{word, -0.75f}}};
  const std::string t0 = tok.Decode(Tokenizer::kBos, word);
  ASSERT_FALSE(t0.empty());

  size_t offset = 10;
  json c = LogprobsObject(/*chat=*/false, tok, entries, &offset);
  EXPECT_EQ(offset, 10 + t0.size() + 1);
  ASSERT_EQ(c["tokens"].size(), 2u);
  EXPECT_EQ(c["tokens"][0], t0);
  EXPECT_EQ(c["token_logprobs"][0].get<double>(), -0.25);
  EXPECT_EQ(c["token_logprobs"][1].get<double>(), -1.5);
  EXPECT_EQ(c["text_offset"], json::parse("[10, " + std::to_string(10 + t0.size()) + "]"));
  // The dictionaries hold the alternatives and the sampled token.
  EXPECT_EQ(c["top_logprobs"][0].size(), 2u);
  EXPECT_EQ(c["top_logprobs"][0][t0].get<double>(), -0.25);
  EXPECT_EQ(c["top_logprobs"][1].size(), 2u);
  EXPECT_EQ(c["top_logprobs"][1]["\xEF\xBF\xBD"].get<double>(), -1.5);  // U+FFFD for the lone byte
  EXPECT_EQ(c["top_logprobs"][1][tok.Decode(byte_e2, word)].get<double>(), -0.75);
  EXPECT_NO_THROW(Dump(c));

  offset = 0;
  json h = LogprobsObject(/*chat=*/true, tok, entries, &offset);
  EXPECT_TRUE(h["refusal"].is_null());
  ASSERT_EQ(h["content"].size(), 2u);
  EXPECT_EQ(h["content"][0]["token"], t0);
  EXPECT_EQ(h["content"][0]["logprob"].get<double>(), -0.25);
  EXPECT_EQ(h["content"][0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(h["content"][0]["top_logprobs"][1]["bytes"], json::parse("[226]"));
  EXPECT_EQ(h["content"][1]["bytes"], json::parse("[226]"));  // the exact byte
  // Serialised, the lone byte becomes U+FFFD in "token" and stays exact in "bytes".
  json back = json::parse(Dump(h));
  EXPECT_EQ(back["content"][1]["token"], "\xEF\xBF\xBD");
  EXPECT_EQ(back["content"][1]["bytes"], json::parse("[226]"));
  EXPECT_EQ(back["content"][1]["logprob"].get<float>(), -1.5f);
}

TEST(OpenAiProtocol, ParseGenerateRequestOrderAndBodyErrors) {
  Tokenizer tok = LoadAidreams();
  auto parse = [&](const std::string& body, bool chat) {
    ServerJob job;
    return ParseGenerateRequest(body, chat, "m", tok, 512, 512, &job);
  };
  auto e = parse(std::string(40, '[') + std::string(40, ']'), false);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "request JSON nests too deeply");
  EXPECT_FALSE(e->param);
  e = parse("{", false);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "We could not parse the JSON body of your request: it is not valid JSON");
  e = parse("[1]", false);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "the request body must be a JSON object");
  // A flat array of more values than any prompt needs is refused before it is parsed.
  std::string many = R"({"prompt":[)";
  for (size_t i = 0; i < (size_t{1} << 20); ++i) many += "1,";
  many += "1]}";
  e = parse(many, false);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 400);
  EXPECT_EQ(e->message.rfind("request JSON has more than 1048576 values (byte ", 0), 0u) << e->message;
  // The model is checked before the prompt.
  e = parse(R"({"model":"x"})", false);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 404);
  e = parse(R"({"model":"m","prompt":[]})", false);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "'prompt' must not be empty");

  ServerJob job;
  EXPECT_FALSE(ParseGenerateRequest(R"({"model":"m","prompt":[1,2,3],"max_tokens":4})", false, "m", tok, 512, 512,
                                    &job));
  ASSERT_EQ(job.prompts.size(), 1u);
  EXPECT_EQ(job.prompts[0].tokens, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(job.prompts[0].max_tokens, 4);
  EXPECT_EQ(job.n, 1);
  EXPECT_EQ(job.choices(), 1);
}

TEST(OpenAiProtocol, SeveralPromptsAndChoices) {
  Tokenizer tok = LoadAidreams();
  ServerJob job;
  // Each prompt is cut and fitted on its own: the default max_tokens is what its context leaves.
  ASSERT_FALSE(ParseGenerateRequest(R"({"model":"m","prompt":[[1,2,3,4,5,6],[7]],"n":3,"seed":10})", false, "m",
                                    tok, 512, 10, &job, /*max_prompt_tokens=*/4));
  ASSERT_EQ(job.prompts.size(), 2u);
  EXPECT_EQ(job.prompts[0].tokens, (std::vector<int>{1, 4, 5, 6}));  // BOS (1) stays
  EXPECT_EQ(job.prompts[0].tokens_cut, 2);
  EXPECT_EQ(job.prompts[0].max_tokens, 6);
  EXPECT_EQ(job.prompts[1].tokens, (std::vector<int>{7}));
  EXPECT_EQ(job.prompts[1].max_tokens, 9);
  EXPECT_EQ(job.n, 3);
  EXPECT_EQ(job.choices(), 6);
  EXPECT_EQ(job.prompt_tokens(), 5);       // each prompt once, not n times
  EXPECT_EQ(job.prompt_tokens_cut(), 2);
  // Choice p * n + j: prompt p, seed + j.
  EXPECT_EQ(job.prompt_of(2).tokens, job.prompts[0].tokens);
  EXPECT_EQ(job.prompt_of(3).tokens, job.prompts[1].tokens);
  EXPECT_EQ(job.params_of(0).sampling.seed, 10u);
  EXPECT_EQ(job.params_of(2).sampling.seed, 12u);
  EXPECT_EQ(job.params_of(3).sampling.seed, 10u);
  EXPECT_EQ(job.params_of(3).max_tokens, 9);
  EXPECT_EQ(job.params_of(1).max_tokens, 6);
  // A seed at the top wraps instead of overflowing.
  ServerJob top;
  ASSERT_FALSE(ParseGenerateRequest(R"({"model":"m","prompt":"x","n":2,"seed":18446744073709551615})", false, "m",
                                    tok, 512, 512, &top));
  EXPECT_EQ(top.params_of(1).sampling.seed, 0u);

  auto refusal = [&](const std::string& body, bool chat = false) {
    ServerJob j;
    auto e = ParseGenerateRequest(body, chat, "m", tok, 512, 512, &j);
    return e ? e->param.value_or("") + ": " + e->message : std::string("accepted");
  };
  EXPECT_EQ(refusal(R"({"model":"m","prompt":"x","n":0})"), "n: 'n' must be between 1 and 128");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":"x","n":129})"), "n: 'n' must be between 1 and 128");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":"x","n":1.5})"), "n: 'n' must be an integer");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":"x","n":128})"), "accepted");
  EXPECT_EQ(refusal(R"({"model":"m","messages":[{"role":"user","content":"x"}],"n":4})", true), "accepted");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":"x","n":2,"best_of":2})"), "accepted");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":"x","n":2,"best_of":3})"), "best_of: 'best_of' must equal 'n' (2) when given");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":"x","best_of":2})"), "best_of: 'best_of' must equal 'n' (1) when given");
  EXPECT_EQ(refusal(R"({"model":"m","prompt":["a","b","c"],"n":43})"),
            "n: 3 prompts x n = 43 asks for 129 choices; at most 128 per request");
  // max_tokens must fit beside every prompt, the longest included.
  EXPECT_EQ(refusal(R"({"model":"m","prompt":[[1],[2,3]],"max_tokens":511})"),
            "max_tokens: This model's maximum context length is 512 tokens. However, you requested 513 tokens (2 in the "
            "prompt, 511 for the completion). Please reduce the length of the prompt or completion.");
}

TEST(OpenAiProtocol, EchoAllowsScoringOnly) {
  Tokenizer tok = LoadAidreams();
  auto parse = [&](const std::string& body, ServerJob* job) {
    auto e = ParseGenerateRequest(body, false, "m", tok, 512, 512, job);
    return e ? e->param.value_or("") + ": " + e->message : std::string("accepted");
  };
  ServerJob job;
  EXPECT_EQ(parse(R"({"model":"m","prompt":"Echoes of","echo":true,"max_tokens":0,"logprobs":1})", &job), "accepted");
  EXPECT_TRUE(job.echo);
  EXPECT_TRUE(job.params.prompt_logprobs);
  EXPECT_EQ(job.prompts[0].max_tokens, 0);
  EXPECT_EQ(job.prompts[0].echo_text, "Echoes of");  // BOS is no text; no leading space after it
  ServerJob no_lp;
  EXPECT_EQ(parse(R"({"model":"m","prompt":"x","echo":true})", &no_lp), "accepted");
  EXPECT_TRUE(no_lp.echo);
  EXPECT_FALSE(no_lp.params.prompt_logprobs);  // nothing to score without logprobs
  ServerJob off;
  EXPECT_EQ(parse(R"({"model":"m","prompt":"x","echo":false,"logprobs":2})", &off), "accepted");
  EXPECT_FALSE(off.echo);
  EXPECT_FALSE(off.params.prompt_logprobs);
  ServerJob bad;
  EXPECT_EQ(parse(R"({"model":"m","prompt":"x","echo":"yes"})", &bad), "echo: 'echo' must be a boolean");
  EXPECT_EQ(parse(R"({"model":"m","prompt":"x","max_tokens":0})", &bad), "max_tokens: 'max_tokens' must be at least 1");
  EXPECT_EQ(parse(R"({"model":"m","prompt":"x","echo":true,"max_tokens":-1})", &bad),
            "max_tokens: 'max_tokens' must be at least 0 (with echo)");
  // Chat has no echo: the field is not read there.
  ServerJob chat;
  EXPECT_FALSE(ParseGenerateRequest(R"({"model":"m","messages":[{"role":"user","content":"x"}],"echo":true})", true,
                                    "m", tok, 512, 512, &chat));
  EXPECT_FALSE(chat.echo);

  EXPECT_EQ(EchoText(tok, {Tokenizer::kBos}), "");
  // The prompt's logprobs object: the first token with nulls, then the scored ones.
  const std::vector<int> ids = tok.Encode("Echoes of", true);
  std::vector<TokenLogprob> scored;
  for (size_t i = 1; i < ids.size(); ++i) scored.push_back(TokenLogprob{ids[i], ids[i - 1], -0.5f * i, {}});
  size_t offset = 0;
  json lp = PromptLogprobsObject(tok, true, ids[0], scored, &offset);
  ASSERT_EQ(lp["tokens"].size(), ids.size());
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_EQ(lp["token_logprobs"][1], -0.5f);
  EXPECT_EQ(offset, std::string("Echoes of").size());
  json more = PromptLogprobsObject(tok, false, 0, {TokenLogprob{ids[1], ids[0], -1.0f, {}}}, &offset);
  AppendLogprobs(&lp, more);
  EXPECT_EQ(lp["tokens"].size(), ids.size() + 1);
  EXPECT_EQ(lp["text_offset"].back(), std::string("Echoes of").size());
}

TEST(OpenAiProtocol, FinishReasonsAndSse) {
  EXPECT_STREQ(OpenAiFinishReason(FinishReason::kStop), "stop");
  EXPECT_STREQ(OpenAiFinishReason(FinishReason::kLength), "length");
  EXPECT_EQ(OpenAiFinishReason(FinishReason::kCancelled), nullptr);
  EXPECT_EQ(OpenAiFinishReason(FinishReason::kError), nullptr);
  EXPECT_EQ(SseEvent(json{{"a", 1}}), "data: {\"a\":1}\n\n");
}

json SsePayload(const std::string& event) {
  EXPECT_EQ(event.rfind("data: ", 0), 0u);
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n");
  return json::parse(event.substr(6, event.size() - 8));
}

TEST(OpenAiProtocol, ResponseShapes) {
  ServerJob job;
  job.chat = true;
  job.id = "chatcmpl-1";
  job.created = 42;
  json first = SsePayload(StreamChunk(job, "m", 0, "", nullptr, true));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["index"], 0);
  EXPECT_EQ(first["choices"][0]["delta"], (json{{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(first.contains("usage"));
  json last = SsePayload(StreamChunk(job, "m", 2, "", "stop", false));
  EXPECT_EQ(last["choices"][0]["index"], 2);
  EXPECT_EQ(last["choices"][0]["delta"], json::object());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");

  Usage u{3, 4};
  job.include_usage = true;
  EXPECT_TRUE(SsePayload(StreamChunk(job, "m", 0, "x", nullptr, false))["usage"].is_null());
  json usage = SsePayload(UsageChunk(job, "m", u));
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"], (json{{"prompt_tokens", 3}, {"completion_tokens", 4}, {"total_tokens", 7}}));

  json chat = CompletionBody(job, "m", {ChoiceResult{"hi", "length", nullptr}}, u);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"], (json{{"role", "assistant"}, {"content", "hi"}, {"refusal", nullptr}, {"annotations", json::array()}}));
  EXPECT_EQ(chat["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(chat["usage"]["total_tokens"], 7);

  job.chat = false;
  json text = CompletionBody(job, "m", {ChoiceResult{"hi", "stop", nullptr}, ChoiceResult{"yo", "length", nullptr}}, u);
  EXPECT_EQ(text["object"], "text_completion");
  ASSERT_EQ(text["choices"].size(), 2u);
  EXPECT_EQ(text["choices"][0]["text"], "hi");
  EXPECT_EQ(text["choices"][1]["index"], 1);
  EXPECT_EQ(text["choices"][1]["text"], "yo");
  EXPECT_EQ(text["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(SsePayload(StreamChunk(job, "m", 1, "yo", nullptr, false))["choices"][0]["text"], "yo");
}

}  // namespace
}  // namespace keel::engine
