// Pure parts of keel answer: quality (recall@10, word F1, windows), the corpus and its
// evaluation set on the real shared data, the prompt builder and the request parser.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "keel/answer/corpus.h"
#include "keel/answer/quality.h"
#include "keel/answer/replay.h"
#include "keel/answer/request.h"
#include "keel/answer/sse.h"
#include "tests/answer/sse_payloads.h"
#include "tests/engine/test_util.h"

namespace keel::answer {
namespace {

TEST(Quality, RecallAt10CountsTheFirstTenOnce) {
  const std::vector<int32_t> truth = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<uint64_t> all = {10, 9, 8, 7, 6, 5, 4, 3, 2, 1};
  EXPECT_DOUBLE_EQ(RecallAt10(all, truth), 1.0);
  // Only truth[0..10) counts: 11 and 12 are not hits.
  const std::vector<uint64_t> late = {11, 12, 1, 2};
  EXPECT_DOUBLE_EQ(RecallAt10(late, truth), 0.2);
  // Only retrieved[0..10) counts, and a duplicate counts once.
  const std::vector<uint64_t> dup = {1, 1, 1, 50, 51, 52, 53, 54, 55, 56, 2};
  EXPECT_DOUBLE_EQ(RecallAt10(dup, truth), 0.1);
  EXPECT_DOUBLE_EQ(RecallAt10({}, truth), 0.0);
  EXPECT_DOUBLE_EQ(RecallAt10(all, std::vector<int32_t>{}), 0.0);
  // Short truth: its size is the divisor.
  EXPECT_DOUBLE_EQ(RecallAt10(all, std::vector<int32_t>{1, 99}), 0.5);
}

TEST(Quality, WordsLowercaseAndSplitOnNonAlphanumerics) {
  EXPECT_EQ(Words("Hello, World! it's 42nd-st."),
            (std::vector<std::string>{"hello", "world", "it", "s", "42nd", "st"}));
  EXPECT_TRUE(Words(" ,.;\n").empty());
  EXPECT_EQ(Words("caf\xc3\xa9"), (std::vector<std::string>{"caf"}));  // non-ASCII bytes separate
}

TEST(Quality, WordF1IsSquadStyle) {
  EXPECT_DOUBLE_EQ(WordF1("The cat sat", "the CAT sat."), 1.0);
  // answer {a b c d}, reference {a b}: P = 1/2, R = 1, F1 = 2/3.
  EXPECT_NEAR(WordF1("a b c d", "a b"), 2.0 / 3.0, 1e-12);
  // Multisets: "a a" vs "a": common 1, P = 1/2, R = 1.
  EXPECT_NEAR(WordF1("a a", "a"), 2.0 / 3.0, 1e-12);
  EXPECT_DOUBLE_EQ(WordF1("x y", "a b"), 0.0);
  // Edge cases: both empty agree fully; one empty not at all.
  EXPECT_DOUBLE_EQ(WordF1("", ""), 1.0);
  EXPECT_DOUBLE_EQ(WordF1("...", " "), 1.0);
  EXPECT_DOUBLE_EQ(WordF1("", "a"), 0.0);
  EXPECT_DOUBLE_EQ(WordF1("a", ""), 0.0);
}

TEST(Quality, RequestQualityMultipliesAndClamps) {
  EXPECT_DOUBLE_EQ(RequestQuality(1, 1), 100.0);
  EXPECT_DOUBLE_EQ(RequestQuality(0.5, 0.5), 25.0);
  EXPECT_DOUBLE_EQ(RequestQuality(0, 1), 0.0);  // retrieval off: recall 0, quality 0
  EXPECT_DOUBLE_EQ(RequestQuality(2, 1), 100.0);
  EXPECT_DOUBLE_EQ(RequestQuality(-1, 1), 0.0);
}

TEST(Quality, WindowMeansAverageArrivalsAndScoreShedAsZero) {
  std::vector<RequestOutcome> o = {
      {1000, true, 80}, {1500, false, 99},  // shed: 0 whatever its quality field says
      {2100, true, 60},                      // window 1
      {4999, true, 100},                     // window 3 (window 2 empty)
  };
  auto w = WindowMeans(o, 1000);
  ASSERT_EQ(w.size(), 4u);
  EXPECT_EQ(w[0].start_ms, 1000);
  EXPECT_EQ(w[0].requests, 2);
  EXPECT_DOUBLE_EQ(w[0].quality, 40.0);
  EXPECT_EQ(w[1].requests, 1);
  EXPECT_DOUBLE_EQ(w[1].quality, 60.0);
  EXPECT_EQ(w[2].requests, 0);
  EXPECT_DOUBLE_EQ(w[2].quality, 0.0);
  EXPECT_EQ(w[3].start_ms, 4000);
  EXPECT_DOUBLE_EQ(w[3].quality, 100.0);
  EXPECT_TRUE(WindowMeans({}, 1000).empty());
  EXPECT_TRUE(WindowMeans(o, 0).empty());
}

TEST(Quality, ScoreAgainstTheReference) {
  std::vector<EvalQuery> q(3);
  for (auto& e : q) e.truth = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  std::vector<ReplayedAnswer> ref(3), ans(3);
  for (auto& r : ref) {
    r.status = 200;
    r.content = "a b";
  }
  ref[2].status = 503;  // no reference: skipped
  ans[0].status = 200;
  ans[0].retrieved = {1, 2, 3, 4, 5};  // recall 0.5
  ans[0].content = "a b c d";          // F1 2/3
  ans[1].status = 429;                 // shed: 0
  const StateQuality s = Score(q, ref, ans);
  EXPECT_EQ(s.requests, 2);
  EXPECT_EQ(s.served, 1);
  EXPECT_EQ(s.skipped, 1);
  EXPECT_NEAR(s.quality, (100 * 0.5 * 2.0 / 3.0) / 2, 1e-9);
  EXPECT_DOUBLE_EQ(s.recall, 0.5);
  EXPECT_NEAR(s.agreement, 2.0 / 3.0, 1e-12);
  EXPECT_EQ(Score(q, ref, std::span<const ReplayedAnswer>(ans.data(), 2)).requests, 0);  // length mismatch
}

TEST(Corpus, SplitsOnBlankLines) {
  auto c = Corpus::Parse("one\ntwo\n\n\n  \nthree\r\n\r\nfour");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->size(), 3u);
  EXPECT_EQ(c->doc(0), "one\ntwo");
  EXPECT_EQ(c->doc(1), "three");
  EXPECT_EQ(c->doc(2), "four");
  EXPECT_EQ(c->DocFor(4), 1u);
  auto empty = Corpus::Parse("\n \n\n");
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("no documents"), std::string::npos);
  auto missing = Corpus::Load("/nonexistent/corpus.txt");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/corpus.txt"), std::string::npos);
}

TEST(Corpus, QuestionIsTheFirstSentenceBounded) {
  EXPECT_EQ(Question("I am a deeply superficial person.\n -- Andy Warhol"), "I am a deeply superficial person.");
  EXPECT_EQ(Question("Badges?  We ain't got\nno badges!"), "Badges?");
  EXPECT_EQ(Question("e.g.x is fine. Next"), "e.g.x is fine.");
  const std::string long_doc(39, 'a');
  const std::string q = Question(long_doc + " " + long_doc + " " + long_doc);
  EXPECT_EQ(q, long_doc + " " + long_doc);  // cut at the last word boundary within 80 bytes
  EXPECT_EQ(Question(std::string(200, 'b')).size(), kMaxQuestionBytes);
}

TEST(Corpus, RealCorpusAndEvalSet) {
  auto c = Corpus::Load(test::SharedDir() + "/data/text/val.txt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->size(), 4134u);  // shared/data/text/val.txt: paragraphs
  auto eval = LoadEvalSet(test::SharedDir() + "/data/vectors", *c);
  ASSERT_TRUE(eval.ok()) << eval.status().ToString();
  ASSERT_EQ(eval->size(), 100u);
  for (const EvalQuery& e : *eval) {
    ASSERT_EQ(e.vector.size(), 128u);
    ASSERT_EQ(e.truth.size(), 10u);
    EXPECT_EQ(e.doc, static_cast<size_t>(e.truth[0]) % c->size());
    EXPECT_FALSE(e.question.empty());
    EXPECT_LE(e.question.size(), kMaxQuestionBytes);
    EXPECT_EQ(e.question, Question(c->doc(e.doc)));
  }
  auto bad = LoadEvalSet("/nonexistent", *c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("/nonexistent"), std::string::npos) << bad.status().message();
}

TEST(Prompt, HoldsTheDocumentsSharingTheBudget) {
  const std::string a = "Alpha doc\nsecond line", b = "Beta", c = "Gamma gamma gamma";
  EXPECT_EQ(BuildPrompt({a, b}, "Why?", 100), "Context:\n- Alpha doc second line\n- Beta\nQuestion: Why?\nAnswer:");
  // Budget 10 over two docs: 5 bytes each.
  EXPECT_EQ(BuildPrompt({a, c}, "Q", 10), "Context:\n- Alpha\n- Gamma\nQuestion: Q\nAnswer:");
  EXPECT_EQ(BuildPrompt({}, "Q", 10), "Question: Q\nAnswer:");
  // A cut never splits a UTF-8 sequence ("é" is two bytes).
  EXPECT_EQ(BuildPrompt({"ab\xc3\xa9z"}, "Q", 3), "Context:\n- ab\nQuestion: Q\nAnswer:");
}

// Earlier turns go in only within the history budget: the newest whole turns that fit, in their
// order; a turn that does not fit drops itself and every older one.
TEST(Prompt, HistoryTakesTheNewestWholeTurnsThatFit) {
  const std::vector<Turn> history = {{true, "old question"}, {false, "old\nanswer"}, {true, "hi"}, {false, "hello"}};
  EXPECT_EQ(BuildPrompt({}, "Q", 10, history), "Question: Q\nAnswer:");  // no budget: none
  // "User: hi\n" is 9 bytes, "Assistant: hello\n" 17: 26 fits both, 25 only the last.
  EXPECT_EQ(BuildPrompt({}, "Q", 10, history, 26), "Conversation:\nUser: hi\nAssistant: hello\nQuestion: Q\nAnswer:");
  EXPECT_EQ(BuildPrompt({}, "Q", 10, history, 25), "Conversation:\nAssistant: hello\nQuestion: Q\nAnswer:");
  EXPECT_EQ(BuildPrompt({}, "Q", 10, history, 16), "Question: Q\nAnswer:");
  EXPECT_EQ(BuildPrompt({"doc"}, "Q", 10, history, 1000),
            "Conversation:\nUser: old question\nAssistant: old answer\nUser: hi\nAssistant: hello\n"
            "Context:\n- doc\nQuestion: Q\nAnswer:");
}

std::string Vec(int n, const std::string& x = "1.5") {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? "," : "") + x;
  return s + "]";
}

TEST(Request, ParsesAGoodBody) {
  RequestLimits l;
  l.dim = 4;
  auto r = ParseAnswerRequest(R"({"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"first"},
      {"role":"assistant","content":null},{"role":"user","content":"last"}],"max_tokens":7,"temperature":0.5,
      "keel_retrieval":{"vector":[1,2.5,-3,4e3]},"user":"ignored","stream":false})",
                              l);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "m");
  EXPECT_EQ(r->question, "last");
  // The history: user and assistant turns before the question (system dropped, null content skipped).
  ASSERT_EQ(r->history.size(), 1u);
  EXPECT_TRUE(r->history[0].user);
  EXPECT_EQ(r->history[0].content, "first");
  EXPECT_EQ(r->max_tokens, 7);
  EXPECT_DOUBLE_EQ(r->temperature, 0.5);
  ASSERT_TRUE(r->vector.has_value());
  EXPECT_EQ(*r->vector, (std::vector<float>{1, 2.5f, -3, 4000}));
  auto d = ParseAnswerRequest(R"({"messages":[{"role":"user","content":"q"}],"max_completion_tokens":3,"max_tokens":9})", l);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->model, "");
  EXPECT_EQ(d->max_tokens, 3);  // max_completion_tokens wins
  EXPECT_DOUBLE_EQ(d->temperature, 0.0);
  EXPECT_FALSE(d->vector.has_value());
  auto dflt = ParseAnswerRequest(R"({"messages":[{"role":"user","content":"q"}],"keel_retrieval":null})", l);
  ASSERT_TRUE(dflt.ok());
  EXPECT_EQ(dflt->max_tokens, l.default_max_tokens);
  EXPECT_FALSE(dflt->stream);
  auto st = ParseAnswerRequest(R"({"messages":[{"role":"user","content":"q"}],"stream":true,
      "stream_options":{"include_usage":true}})", l);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_TRUE(st->stream);
  EXPECT_TRUE(st->include_usage);
}

// The SSE events of a body: the JSON of every "data:" line but the last, which must be [DONE].
std::vector<nlohmann::ordered_json> SseEvents(const std::string& body) {
  std::vector<nlohmann::ordered_json> out;
  for (const std::string& chunk : test::SseChunksBeforeDone(body)) out.push_back(nlohmann::ordered_json::parse(chunk));
  return out;
}

TEST(Sse, ACompletionBecomesOpenAIChunks) {
  const auto completion = nlohmann::ordered_json::parse(R"({"id":"chatcmpl-7","object":"chat.completion",
      "created":1700000000,"model":"en-dense6L","choices":[{"index":0,"message":{"role":"assistant",
      "content":"Once upon\na time"},"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":4,
      "total_tokens":9},"keel":{"state":"full","docs":[3]}})");
  const std::vector<nlohmann::ordered_json> ev = SseEvents(CompletionAsSse(completion, false));
  ASSERT_EQ(ev.size(), 3u);
  for (const auto& e : ev) {
    EXPECT_EQ(e["id"], "chatcmpl-7");
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    EXPECT_EQ(e["created"], 1700000000);
    EXPECT_EQ(e["model"], "en-dense6L");
    EXPECT_FALSE(e.contains("usage"));  // not asked for
    ASSERT_EQ(e["choices"].size(), 1u);
    EXPECT_EQ(e["choices"][0]["index"], 0);
  }
  EXPECT_EQ(ev[0]["choices"][0]["delta"], (nlohmann::ordered_json{{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(ev[0]["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["content"], "Once upon\na time");
  EXPECT_TRUE(ev[2]["choices"][0]["delta"].empty());
  EXPECT_EQ(ev[2]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(ev[2]["keel"]["state"], "full");
  EXPECT_FALSE(ev[0].contains("keel"));

  // include_usage: usage null on every choice chunk, then a usage chunk with no choices.
  const std::vector<nlohmann::ordered_json> eu = SseEvents(CompletionAsSse(completion, true));
  ASSERT_EQ(eu.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(eu[i]["usage"].is_null()) << i;
  EXPECT_TRUE(eu[3]["choices"].empty());
  EXPECT_EQ(eu[3]["usage"]["total_tokens"], 9);
}

TEST(Sse, EmptyContentAndMissingMembersStillMakeAValidStream) {
  const auto bare = nlohmann::ordered_json::parse(R"({"choices":[{"message":{"role":"assistant","content":""}}]})");
  const std::vector<nlohmann::ordered_json> ev = SseEvents(CompletionAsSse(bare, false));
  ASSERT_EQ(ev.size(), 2u);  // no content chunk for empty content
  EXPECT_EQ(ev[1]["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(ev[1]["id"].is_string());
  EXPECT_TRUE(ev[1]["created"].is_number_integer());
  EXPECT_EQ(SseEvents(CompletionAsSse(nlohmann::ordered_json::object(), false)).size(), 0u);
}

TEST(Request, BadInputIsRefusedNamingTheMember) {
  RequestLimits l;
  l.dim = 3;
  l.max_messages = 2;
  l.max_message_bytes = 10;
  const std::string user = R"("messages":[{"role":"user","content":"q"}])";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "request body: malformed JSON"},
      {"[1]", "request body: expected a JSON object"},
      {R"({"a":[[[[[[[[[1]]]]]]]]]})", "nested deeper"},
      {"{}", "messages: required"},
      {R"({"messages":{}})", "messages: expected an array"},
      {R"({"messages":[]})", "messages: expected at least one"},
      {R"({"messages":[{"role":"user","content":"a"},{"role":"user","content":"b"},{"role":"user","content":"c"}]})",
       "messages: more than 2"},
      {R"({"messages":[{"role":"system","content":"a"}]})", "messages: no user message"},
      {R"({"messages":[{"role":"wizard","content":"a"}]})", "messages[0].role"},
      {R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]})", "messages[0].content: expected a string"},
      {R"({"messages":[{"role":"user","content":"01234567890"}]})", "messages[0].content: longer than 10"},
      {R"({"messages":[{"role":"user"}]})", "messages[0].content: required"},
      {"{" + user + R"(,"stream":"yes"})", "stream: expected a boolean"},
      {"{" + user + R"(,"stream_options":{"include_usage":true}})", "stream_options: only allowed when stream is true"},
      {"{" + user + R"(,"stream":true,"stream_options":[]})", "stream_options: expected an object"},
      {"{" + user + R"(,"stream":true,"stream_options":{"include_usage":1}})", "stream_options.include_usage: expected a boolean"},
      {"{" + user + R"(,"model":""})", "model: expected 1 to 256"},
      {"{" + user + R"(,"model":3})", "model: expected a string"},
      {"{" + user + R"(,"max_tokens":0})", "max_tokens: expected an integer from 1"},
      {"{" + user + R"(,"max_tokens":18446744073709551615})", "max_tokens: expected an integer from 1"},
      {"{" + user + R"(,"max_tokens":2.5})", "max_tokens: expected an integer"},
      {"{" + user + R"(,"temperature":3})", "temperature: expected a number from 0 to 2"},
      {"{" + user + R"(,"temperature":"hot"})", "temperature: expected a number"},
      {"{" + user + R"(,"n":2})", "n: only 1 is supported"},
      {"{" + user + R"(,"n":1.5})", "n: only 1 is supported"},
      {"{" + user + R"(,"keel_retrieval":[1,2,3]})", "keel_retrieval: expected an object"},
      {"{" + user + R"(,"keel_retrieval":{"vector":[1,2,3],"k":5}})", "keel_retrieval: unknown member"},
      {"{" + user + R"(,"keel_retrieval":{}})", "keel_retrieval.vector: expected an array"},
      {"{" + user + R"(,"keel_retrieval":{"vector":[1,2]}})", "keel_retrieval.vector: expected 3 numbers, got 2"},
      {"{" + user + R"(,"keel_retrieval":{"vector":[1,"2",3]}})", "keel_retrieval.vector[1]: expected a number"},
      {"{" + user + R"(,"keel_retrieval":{"vector":[1,2,1e39]}})", "keel_retrieval.vector[2]: expected a finite float32"},
  };
  for (const auto& [body, want] : cases) {
    auto r = ParseAnswerRequest(body, l);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << body;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << body << " -> " << r.status().message();
  }
  // Too many values is refused before parsing.
  RequestLimits small = l;
  small.dim = 200;
  small.max_json_values = 100;
  auto many = ParseAnswerRequest("{" + user + R"(,"keel_retrieval":{"vector":)" + Vec(200) + "}}", small);
  ASSERT_FALSE(many.ok());
  EXPECT_NE(many.status().message().find("more than 100 values"), std::string::npos) << many.status().message();
}

TEST(Request, ErrorBodyIsOpenAIs) {
  EXPECT_EQ(OpenAIErrorBody(400, "bad \"x\""),
            R"({"error":{"message":"bad \"x\"","type":"invalid_request_error","param":null,"code":"invalid_request_error"}})");
  EXPECT_NE(OpenAIErrorBody(429, "m").find("rate_limit_exceeded"), std::string::npos);
  EXPECT_NE(OpenAIErrorBody(503, "m").find("upstream_error"), std::string::npos);
}

}  // namespace
}  // namespace keel::answer
