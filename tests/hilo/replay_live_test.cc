// The pure parts of `keel hilo replay` (keel/hilo/validate/replay_live.h): the reference file
// (round trip and bad input), per-request scoring against the full state's answer, the controller
// replies a sample is read from, state tallies and the per-window CSV / JSON summary. The live
// run itself drives the whole product in bench/hilo/live.sh.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "keel/hilo/validate/replay_live.h"
#include "tests/hilo/test_catalog.h"

namespace keel::hilo {
namespace {

answer::EvalQuery Query(int i) {
  answer::EvalQuery q;
  q.query = i;
  for (int k = 0; k < 10; ++k) q.truth.push_back(100 * i + k);
  return q;
}

answer::ReplayedAnswer Answer(std::vector<uint64_t> ids, std::string content, int status = 200) {
  answer::ReplayedAnswer a;
  a.status = status;
  a.retrieved = std::move(ids);
  a.content = std::move(content);
  return a;
}

TEST(HiloReplayReferences, RoundTripKeepsIdsAndContent) {
  std::string text = WriteReferenceLine(1, Answer({7, 8}, "second \"quoted\"\nline")) + "\n\n" +
                     WriteReferenceLine(0, Answer({1, 2, 3}, "first")) + "\r\n";
  auto refs = ParseReferences(text, 2);
  ASSERT_TRUE(refs.ok()) << refs.status().ToString();
  ASSERT_EQ(refs->size(), 2u);
  EXPECT_EQ((*refs)[0].retrieved, (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ((*refs)[0].content, "first");
  EXPECT_EQ((*refs)[1].content, "second \"quoted\"\nline");
  EXPECT_EQ((*refs)[1].status, 200);
  // A file over more queries serves a run over fewer.
  auto fewer = ParseReferences(text, 1);
  ASSERT_TRUE(fewer.ok()) << fewer.status().ToString();
  EXPECT_EQ(fewer->size(), 1u);
}

TEST(HiloReplayReferences, BadInputNamesTheLine) {
  const std::string ok0 = WriteReferenceLine(0, Answer({1}, "a")) + "\n";
  struct Case {
    std::string text;
    std::string needle;
  } cases[] = {
      {ok0 + "not json\n", "line 2"},
      {ok0 + "{\"query\":\"1\",\"retrieved\":[],\"content\":\"\"}\n", "\"query\""},
      {ok0 + "{\"query\":-1,\"retrieved\":[],\"content\":\"\"}\n", "negative"},
      {ok0 + "{\"query\":1,\"retrieved\":[-3],\"content\":\"\"}\n", "non-negative"},
      {ok0 + "{\"query\":1,\"retrieved\":{},\"content\":\"\"}\n", "\"retrieved\""},
      {ok0 + "{\"query\":1,\"retrieved\":[]}\n", "\"content\""},
      {ok0 + "[1,2]\n", "line 2"},
      {ok0 + ok0, "appears twice"},
      {ok0, "query 1 missing"},
      {std::string(kMaxReferenceLineBytes + 10, ' ') + "x\n", "longer than"},
  };
  for (const Case& c : cases) {
    auto r = ParseReferences(c.text, 2);
    ASSERT_FALSE(r.ok()) << c.needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
  }
  EXPECT_FALSE(ParseReferences(ok0, 0).ok());
  EXPECT_FALSE(ParseReferences(std::string(kMaxReferenceFileBytes + 1, '\n'), 1).ok());
}

TEST(HiloReplayScore, RecallTimesAgreementAndZeroWhenNotServed) {
  const answer::EvalQuery q = Query(0);
  const answer::ReplayedAnswer ref = Answer({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, "the cat sat");
  // Full recall, identical text: 100.
  EXPECT_DOUBLE_EQ(ScoreAnswer(q, ref, ref), 100.0);
  // Half the truth retrieved, same text: 50.
  EXPECT_DOUBLE_EQ(ScoreAnswer(q, ref, Answer({0, 1, 2, 3, 4, 50, 51, 52, 53, 54}, "the cat sat")), 50.0);
  // Full recall, 2 of 3 words (P = 1, R = 2/3, F1 = 0.8): 80.
  EXPECT_NEAR(ScoreAnswer(q, ref, Answer({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, "the cat")), 80.0, 1e-9);
  // Shed or failed: 0 whatever it carries.
  EXPECT_EQ(ScoreAnswer(q, ref, Answer({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, "the cat sat", 429)), 0.0);
  // Full quality = 100 x mean recall of the references.
  std::vector<answer::EvalQuery> eval = {Query(0), Query(1)};
  std::vector<answer::ReplayedAnswer> refs = {ref, Answer({100, 101, 102, 103, 104, 105, 1, 2, 3, 4}, "x")};
  EXPECT_DOUBLE_EQ(FullQuality(eval, refs), 80.0);
  EXPECT_EQ(FullQuality(eval, std::span<const answer::ReplayedAnswer>(refs).first(1)), 0.0);
}

TEST(HiloReplaySample, ParsesStateAndServices) {
  const Catalog c = testing::TestCatalog();  // full, small_model, fewer_docs, no_rerank, bare
  StateSample s;
  ASSERT_TRUE(ParseStateReply(R"({"version":3,"state":"fewer_docs","index":2,"pinned":false})", c.states.size(), &s).ok());
  EXPECT_EQ(s.index, 2);
  EXPECT_EQ(s.name, "fewer_docs");
  EXPECT_FALSE(ParseStateReply(R"({"state":"x","index":9})", c.states.size(), &s).ok());
  EXPECT_FALSE(ParseStateReply(R"({"state":"x"})", c.states.size(), &s).ok());
  EXPECT_FALSE(ParseStateReply("nope", c.states.size(), &s).ok());

  const char* services = R"({"services":[
    {"service":"engine","instance":"engine-large","applied_state":"small_model","age_ms":100},
    {"service":"engine","instance":"engine-small","applied_state":"no_rerank","age_ms":100},
    {"service":"vector","instance":"vector-0","applied_state":"full","age_ms":100},
    {"service":"gateway","instance":"gateway-0","applied_state":"bare","age_ms":99999},
    {"service":"answer","instance":"answer-0","applied_state":"unknown_state","age_ms":10},
    {"service":"nope","instance":"x","applied_state":"full","age_ms":10}]})";
  ASSERT_TRUE(ParseServicesReply(services, c, 3000, &s).ok());
  EXPECT_EQ(s.applied[static_cast<size_t>(Service::kEngine)], 3);   // the cheaper engine
  EXPECT_EQ(s.applied[static_cast<size_t>(Service::kVector)], 0);
  EXPECT_EQ(s.applied[static_cast<size_t>(Service::kGateway)], -1);  // stale report
  EXPECT_EQ(s.applied[static_cast<size_t>(Service::kAnswer)], -1);   // unknown state
  EXPECT_FALSE(ParseServicesReply(R"({"services":3})", c, 3000, &s).ok());
}

LiveResult SampleResult() {
  LiveResult r;
  r.trace = "step";
  r.peak = 2;
  r.full_quality = 90;
  r.limit = 20;
  r.state_names = {"full", "cheap", "bare"};
  r.summary.arrived = 10;
  r.summary.ok = 8;
  r.summary.shed = 1;
  r.summary.failed = 1;
  r.summary.max_drop = 15;
  r.summary.mean_drop = 5;
  r.summary.windows = {{0, 4, 90, 120}, {5, 6, 75, 300}};
  for (int i = 0; i < 6; ++i) {
    StateSample s;
    s.t_s = 1.0 + 2 * i;  // 1, 3, 5, 7, 9, 11
    s.index = i < 2 ? 0 : (i < 5 ? 1 : -1);  // the last sample: controller did not answer
    s.name = s.index < 0 ? "" : r.state_names[static_cast<size_t>(s.index)];
    s.applied = s.index < 0 ? std::array<int, kNumServices>{-1, -1, -1, -1} : std::array<int, kNumServices>{s.index, 0, s.index, 0};
    r.samples.push_back(s);
  }
  return r;
}

TEST(HiloReplayOutput, TalliesStatesAndTransitions) {
  LiveResult r = SampleResult();
  r.samples.insert(r.samples.begin() + 3, r.samples[0]);  // 0 0 1 0 1 1 -1
  TallyStates(2.0, &r);
  ASSERT_EQ(r.time_in_state_s.size(), 3u);
  EXPECT_DOUBLE_EQ(r.time_in_state_s[0], 6.0);
  EXPECT_DOUBLE_EQ(r.time_in_state_s[1], 6.0);
  EXPECT_DOUBLE_EQ(r.time_in_state_s[2], 0.0);
  EXPECT_EQ(r.transitions, 3);
}

TEST(HiloReplayOutput, PerServiceSamplesCountAtTheCheapestAppliedLevel) {
  LiveResult r = SampleResult();
  for (StateSample& s : r.samples) s.index = -1;  // per-service: no product state
  r.samples[2].applied = {0, 2, 1, 0};
  TallyStates(1.0, &r);  // cheapest levels: 0 0 2 1 1 (none)
  EXPECT_DOUBLE_EQ(r.time_in_state_s[0], 2.0);
  EXPECT_DOUBLE_EQ(r.time_in_state_s[1], 2.0);
  EXPECT_DOUBLE_EQ(r.time_in_state_s[2], 1.0);
  EXPECT_EQ(r.transitions, 2);
}

TEST(HiloReplayOutput, CsvRowPerWindowWithTheLastSampleInIt) {
  LiveResult r = SampleResult();
  const std::string csv = WriteLiveCsv(r, 5);
  EXPECT_EQ(csv,
            "t_s,arrived,mean_quality,p99_ms,state_index,state,answer_level,vector_level,engine_level,gateway_level\n"
            "0.000,4,90.0000,120.00,0,full,0,0,0,0\n"   // samples at 1 and 3: state full
            "5.000,6,75.0000,300.00,1,cheap,1,0,1,0\n");  // last sample before 10 is at 9: cheap
  LiveResult empty;
  empty.summary.windows = {{0, 0, 0, 0}};
  EXPECT_EQ(WriteLiveCsv(empty, 5).substr(WriteLiveCsv(empty, 5).find('\n') + 1), "0.000,0,0.0000,0.00,-1,,-1,-1,-1,-1\n");
}

TEST(HiloReplayOutput, SummaryJsonCarriesCountsStatesAndVerdict) {
  LiveResult r = SampleResult();
  TallyStates(2.0, &r);
  auto j = nlohmann::json::parse(WriteLiveSummaryJson(r, "hilo"));
  EXPECT_EQ(j["label"], "hilo");
  EXPECT_EQ(j["trace"], "step");
  EXPECT_EQ(j["shed"], 1);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_DOUBLE_EQ(j["max_drop"].get<double>(), 15.0);
  EXPECT_TRUE(j["within_085_limit"].get<bool>());  // 15 <= 17
  EXPECT_DOUBLE_EQ(j["time_in_state_s"]["cheap"].get<double>(), 6.0);
  EXPECT_EQ(j["transitions"], 1);
  r.summary.max_drop = 18;
  EXPECT_FALSE(nlohmann::json::parse(WriteLiveSummaryJson(r, ""))["within_085_limit"].get<bool>());
  EXPECT_FALSE(nlohmann::json::parse(WriteLiveSummaryJson(r, "")).contains("label"));
}

TEST(HiloReplayRun, RefusesBadOptions) {
  LiveOptions o;
  o.answer_url = "http://127.0.0.1:1";
  o.trace = Surge3x();
  EXPECT_FALSE(RunLiveReplay(o).ok());  // no evaluation set
  o.eval = {Query(0)};
  EXPECT_FALSE(RunLiveReplay(o).ok());  // no references
  o.references = {Answer({0}, "x")};
  o.time_scale = 0;
  auto r = RunLiveReplay(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("time scale"), std::string::npos);
  o.time_scale = 1;
  o.window_s = 1000;
  r = RunLiveReplay(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("window"), std::string::npos);
  o.window_s = 5;
  o.warmup_s = -1;
  r = RunLiveReplay(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("warmup"), std::string::npos);
  o.warmup_s = 0;
  o.answer_url = "not a url";
  EXPECT_FALSE(RunLiveReplay(o).ok());
}

}  // namespace
}  // namespace keel::hilo
