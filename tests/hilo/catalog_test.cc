#include "keel/hilo/catalog.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/hilo/test_catalog.h"

namespace keel::hilo {
namespace {

using nlohmann::json;
using testing::TestCatalog;

json TestJson() { return json::parse(WriteCatalog(TestCatalog())); }

// The message ParseCatalog gives for `doc`; "" when it parses.
std::string ErrorOf(const json& doc) {
  Result<Catalog> c = ParseCatalog(doc.dump());
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  return c.status().message();
}

std::string ErrorOfText(std::string_view text) {
  Result<Catalog> c = ParseCatalog(text);
  return c.ok() ? "" : c.status().message();
}

TEST(HiloCatalog, ParsesWhatItWrites) {
  const std::string text = WriteCatalog(TestCatalog());
  Result<Catalog> c = ParseCatalog(text);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->states.size(), 5u);
  EXPECT_EQ(c->states[3].name, "no_rerank");
  EXPECT_FALSE(c->states[3].vector.rerank);
  EXPECT_EQ(c->states[3].engine.kv_codec, "bellows");
  EXPECT_FALSE(c->states[3].engine.lossless);
  EXPECT_EQ(c->states[4].answer.retrieval, false);
  EXPECT_EQ(c->states[2].vector.nprobe, 16);
  EXPECT_DOUBLE_EQ(c->states[1].figures->quality, 99.8);
  EXPECT_DOUBLE_EQ(c->states[2].figures->Capacity(Service::kVector), 600);
  EXPECT_EQ(c->states[0].figures->validated_at, testing::kValidatedAt);
  EXPECT_EQ(c->safe_state, "bare");
  EXPECT_EQ(c->SafeIndex(), 4);
  EXPECT_DOUBLE_EQ(c->max_quality_drop, 0.5);
  EXPECT_EQ(c->binaries, "keel-0.9.0+abc123");
  // Round trip: writing what was read gives the same text.
  EXPECT_EQ(WriteCatalog(*c), text);
}

// The goodput under overload is optional: a catalog without it reads as before, and one with it
// round-trips.
TEST(HiloCatalog, GoodputUnderOverloadRoundTrips) {
  Catalog c = TestCatalog();
  EXPECT_FALSE(c.states[0].figures->HasGoodput());
  EXPECT_EQ(WriteCatalog(c).find("overload"), std::string::npos);
  c.states[0].figures->offered = 150;
  c.states[0].figures->goodput = 81.5;
  const std::string text = WriteCatalog(c);
  Result<Catalog> back = ParseCatalog(text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_TRUE(back->states[0].figures->HasGoodput());
  EXPECT_DOUBLE_EQ(back->states[0].figures->offered, 150);
  EXPECT_DOUBLE_EQ(back->states[0].figures->goodput, 81.5);
  EXPECT_FALSE(back->states[1].figures->HasGoodput());
  EXPECT_EQ(WriteCatalog(*back), text);
}

// docs/hilo.md's full example is the test catalog, so the documented format cannot drift.
TEST(HiloCatalog, DocsExampleParsesToTheTestCatalog) {
  std::ifstream f(std::string(KEEL_SOURCE_DIR) + "/docs/hilo.md");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string doc = ss.str();
  const size_t start = doc.find("```json\n");
  ASSERT_NE(start, std::string::npos);
  const size_t end = doc.find("```", start + 8);
  ASSERT_NE(end, std::string::npos);
  Result<Catalog> c = ParseCatalog(std::string_view(doc).substr(start + 8, end - start - 8));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(WriteCatalog(*c), WriteCatalog(TestCatalog()));
}

TEST(HiloCatalog, RoundTripKeepsUnvalidatedStatesAndOddNumbers) {
  Catalog c = TestCatalog();
  c.states[2].figures.reset();
  c.states[0].figures->quality = 99.99999999999997;
  c.states[0].figures->capacity[1] = 123.456789012345;
  c.binaries.clear();
  Result<Catalog> back = ParseCatalog(WriteCatalog(c));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->states[2].figures.has_value());
  EXPECT_EQ(back->states[0].figures->quality, 99.99999999999997);
  EXPECT_EQ(back->states[0].figures->capacity[1], 123.456789012345);
  EXPECT_EQ(back->binaries, "");
  EXPECT_EQ(WriteCatalog(*back), WriteCatalog(c));
}

TEST(HiloCatalog, FieldErrorsNameThePath) {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"zero nprobe", [](json& j) { j["states"][2]["levels"]["vector"]["nprobe"] = 0; },
       "states[2].levels.vector.nprobe: expected a positive integer"},
      {"string nprobe", [](json& j) { j["states"][2]["levels"]["vector"]["nprobe"] = "8"; },
       "states[2].levels.vector.nprobe: expected a positive integer"},
      {"fractional k", [](json& j) { j["states"][0]["levels"]["vector"]["k"] = 2.5; },
       "states[0].levels.vector.k: expected a positive integer"},
      {"unknown knob", [](json& j) { j["states"][1]["levels"]["vector"]["nprobes"] = 8; },
       "states[1].levels.vector.nprobes: unknown field"},
      {"unknown service", [](json& j) { j["states"][0]["levels"]["cache"] = json::object(); },
       "states[0].levels.cache: unknown field"},
      {"missing service", [](json& j) { j["states"][0]["levels"].erase("gateway"); },
       "states[0].levels.gateway: missing (every state sets every service)"},
      {"missing knob", [](json& j) { j["states"][3]["levels"]["engine"].erase("kv_codec"); },
       "states[3].levels.engine.kv_codec: missing"},
      {"bool as string", [](json& j) { j["states"][3]["levels"]["engine"]["lossless"] = "false"; },
       "states[3].levels.engine.lossless: expected true or false"},
      {"level not object", [](json& j) { j["states"][1]["levels"]["answer"] = 3; },
       "states[1].levels.answer: expected an object"},
      {"docs without retrieval", [](json& j) { j["states"][4]["levels"]["answer"]["context_docs"] = 2; },
       "states[4].levels.answer.context_docs: must be 0 when retrieval is off"},
      {"no docs with retrieval", [](json& j) { j["states"][0]["levels"]["answer"]["context_docs"] = 0; },
       "states[0].levels.answer.context_docs: must be at least 1 when retrieval is on"},
      {"bad model name", [](json& j) { j["states"][0]["levels"]["gateway"]["model"] = "large model"; },
       "states[0].levels.gateway.model: expected a name of 1 to 64 characters [A-Za-z0-9_.:-]"},
      {"three states", [](json& j) { j["states"].erase(3); j["states"].erase(3); },
       "states: expected 4 to 6 states, got 3"},
      {"seven states", [](json& j) { j["states"].push_back(j["states"][4]); j["states"].push_back(j["states"][4]); },
       "states: expected 4 to 6 states, got 7"},
      {"duplicate name", [](json& j) { j["states"][2]["name"] = "full"; },
       "states[2].name: 'full' names an earlier state too"},
      {"unknown safe state", [](json& j) { j["safe_state"] = "nope"; }, "safe_state: 'nope' is not a state"},
      {"zero limit", [](json& j) { j["max_quality_drop"] = 0; },
       "max_quality_drop: expected a number above 0 and at most 100"},
      {"limit over 100", [](json& j) { j["max_quality_drop"] = 101; },
       "max_quality_drop: expected a number from 0 to 100"},
      {"quality over 100", [](json& j) { j["states"][0]["figures"]["quality"] = 100.5; },
       "states[0].figures.quality: expected a number from 0 to 100"},
      {"zero capacity", [](json& j) { j["states"][0]["figures"]["capacity"]["engine"] = 0; },
       "states[0].figures.capacity.engine: expected a positive number"},
      {"missing capacity", [](json& j) { j["states"][1]["figures"]["capacity"].erase("vector"); },
       "states[1].figures.capacity.vector: missing"},
      {"capacity for unknown service", [](json& j) { j["states"][1]["figures"]["capacity"]["cache"] = 5; },
       "states[1].figures.capacity.cache: unknown field"},
      {"RFC 3339 instead of unix seconds", [](json& j) { j["states"][1]["figures"]["validated_at"] = "2025-12-05T02:00:00Z"; },
       "states[1].figures.validated_at: expected a non-negative integer"},
      {"overload without goodput", [](json& j) { j["states"][1]["figures"]["overload"] = {{"offered", 300}}; },
       "states[1].figures.overload.goodput: missing"},
      {"goodput above offered", [](json& j) { j["states"][1]["figures"]["overload"] = {{"offered", 300}, {"goodput", 301}}; },
       "states[1].figures.overload.goodput: more than was offered"},
      {"zero offered", [](json& j) { j["states"][1]["figures"]["overload"] = {{"offered", 0}, {"goodput", 0}}; },
       "states[1].figures.overload.offered: expected a positive number"},
      {"negative goodput", [](json& j) { j["states"][1]["figures"]["overload"] = {{"offered", 300}, {"goodput", -1}}; },
       "states[1].figures.overload.goodput: expected a number from 0 to 1e+09"},
      {"overload typo", [](json& j) { j["states"][1]["figures"]["overload"] = {{"offered", 300}, {"goodput", 1}, {"godput", 1}}; },
       "states[1].figures.overload.godput: unknown field"},
      {"quality rises", [](json& j) { j["states"][2]["figures"]["quality"] = 99.9; },
       "states[2].figures.quality: 99.9 is above states[1]'s 99.8 (quality must not rise down the list)"},
      {"capacity falls", [](json& j) { j["states"][3]["figures"]["capacity"]["engine"] = 120; },
       "states[3].figures.capacity.engine: 120 is below states[2]'s 200 (a cheaper state must not have less "
       "capacity)"},
      {"safe state not the largest", [](json& j) { j["safe_state"] = "fewer_docs"; },
       "safe_state: 'fewer_docs' has less answer capacity than states[3] 'no_rerank' (the safe state's capacity "
       "must be the largest)"},
      {"top-level typo", [](json& j) { j["max_quality_dorp"] = 1; }, "max_quality_dorp: unknown field"},
      {"wrong format", [](json& j) { j["format"] = "other"; }, "format: expected \"keel-hilo-catalog\""},
      {"future version", [](json& j) { j["version"] = 2; }, "version: expected 1"},
      {"states not array", [](json& j) { j["states"] = json::object(); }, "states: expected an array"},
  };
  for (const Case& c : cases) {
    json doc = TestJson();
    ASSERT_EQ(ErrorOf(doc), "");  // the base document is valid, so the edit alone is refused
    c.edit(doc);
    EXPECT_EQ(ErrorOf(doc), c.message) << c.what;
  }
}

TEST(HiloCatalog, OrderingSkipsUnvalidatedStates) {
  // states[2] has no figures: states[3] is compared with states[1], so a capacity below
  // states[2]'s old figure but above states[1]'s is fine, and one below states[1]'s is not.
  json doc = TestJson();
  doc["states"][2].erase("figures");
  doc["states"][3]["figures"]["capacity"]["engine"] = 160;
  EXPECT_EQ(ErrorOf(doc), "");
  doc["states"][3]["figures"]["capacity"]["engine"] = 140;
  EXPECT_EQ(ErrorOf(doc), "states[3].figures.capacity.engine: 140 is below states[1]'s 150 (a cheaper state must "
                          "not have less capacity)");
}

TEST(HiloCatalog, HostileInputIsRefusedWithBoundedMessages) {
  EXPECT_EQ(ErrorOfText(""), "catalog: malformed JSON at byte 0: syntax error while parsing value - unexpected end of "
                             "input; expected '[', '{', or a literal");
  EXPECT_EQ(ErrorOfText("[]"), "catalog: expected a JSON object");
  EXPECT_EQ(ErrorOfText(std::string(100000, '[')), "catalog: JSON nested deeper than 6 (byte 6)");
  // A structurally valid document nested too deep inside a level.
  json doc = TestJson();
  doc["states"][0]["levels"]["vector"]["nprobe"] = json::parse("[[[[1]]]]");
  EXPECT_NE(ErrorOf(doc).find("nested deeper than 6"), std::string::npos) << ErrorOf(doc);
  // 10 MB string: refused by size before any parsing.
  doc = TestJson();
  doc["states"][0]["name"] = std::string(10 << 20, 'a');
  EXPECT_EQ(ErrorOf(doc), "catalog: larger than 1048576 bytes");
  // A long string within the size bound: refused by the name rule, message stays short.
  doc = TestJson();
  doc["states"][0]["name"] = std::string(500000, 'a');
  EXPECT_EQ(ErrorOf(doc), "states[0].name: longer than 64 bytes");
  doc = TestJson();
  doc["states"][0]["levels"][std::string(500000, 'k')] = 1;
  const std::string long_key = ErrorOf(doc);
  EXPECT_LT(long_key.size(), 200u);
  EXPECT_NE(long_key.find(": unknown field"), std::string::npos);
  // NaN and infinities are not JSON; huge numbers are out of range.
  std::string text = TestJson().dump();
  const std::string quality = "\"quality\":100.0";
  ASSERT_NE(text.find(quality), std::string::npos);
  for (const char* bad : {"NaN", "Infinity", "-1e999", "1e999"}) {
    std::string t = text;
    t.replace(t.find(quality), quality.size(), std::string("\"quality\":") + bad);
    EXPECT_FALSE(ErrorOfText(t).empty()) << bad;
  }
  doc = TestJson();
  doc["states"][0]["levels"]["engine"]["max_context"] = 1e30;
  EXPECT_EQ(ErrorOf(doc), "states[0].levels.engine.max_context: expected a positive integer");
  doc["states"][0]["levels"]["engine"]["max_context"] = 2000000;
  EXPECT_EQ(ErrorOf(doc), "states[0].levels.engine.max_context: expected at most 1048576");
  doc = TestJson();
  doc["states"][0]["levels"]["engine"]["max_context"] = uint64_t{18446744073709551615u};
  EXPECT_EQ(ErrorOf(doc), "states[0].levels.engine.max_context: expected at most 1048576");
}

// The file is checked before it is read: a 1.5 GB catalog was read whole (3 GB resident) before
// the 1 MiB check, /dev/zero never ended and a FIFO blocked.
TEST(HiloCatalog, CatalogFilesAreBoundedBeforeTheyAreRead) {
  const std::string dir = ::testing::TempDir() + "/hilo-catalog-files-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string good = dir + "/good.json", big = dir + "/big.json", fifo = dir + "/fifo.json";
  std::ofstream(good) << WriteCatalog(TestCatalog());
  EXPECT_TRUE(ReadCatalogFile(good).ok());
  std::ofstream(big).close();
  std::filesystem::resize_file(big, uint64_t{3} << 30);  // sparse: nothing is written
  Result<Catalog> b = ReadCatalogFile(big);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("larger than the limit"), std::string::npos) << b.status().message();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Result<Catalog> f = ReadCatalogFile(fifo);  // would block forever if it were opened for reading
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("not a regular file"), std::string::npos) << f.status().message();
  Result<Catalog> z = ReadCatalogFile("/dev/zero");
  ASSERT_FALSE(z.ok());
  std::filesystem::remove_all(dir);
}

TEST(HiloCatalog, ValidateCatalogAppliesTheReadersRulesToBuiltCatalogs) {
  EXPECT_TRUE(ValidateCatalog(TestCatalog()).ok());
  Catalog c = TestCatalog();
  c.states[1].vector.fanout = 0;
  EXPECT_EQ(ValidateCatalog(c).message(), "states[1].levels.vector.fanout: expected a positive integer");
  c = TestCatalog();
  c.states[1].figures->quality = std::nan("");
  EXPECT_EQ(ValidateCatalog(c).message(), "states[1].figures.quality: missing");
  c = TestCatalog();
  c.states.pop_back();
  c.safe_state = "no_rerank";
  EXPECT_TRUE(ValidateCatalog(c).ok());
  c.states.pop_back();
  EXPECT_EQ(ValidateCatalog(c).message(), "states: expected 4 to 6 states, got 3");
}

TEST(HiloCatalog, CheckUsableRefusesUnvalidatedStaleAndOld) {
  const Catalog good = TestCatalog();
  const int64_t now = testing::kValidatedAt + 3600;
  EXPECT_TRUE(CheckUsable(good, good.binaries, now, 86400).ok());

  Catalog c = good;
  c.states[3].figures.reset();
  Status s = CheckUsable(c, good.binaries, now, 86400);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "catalog not usable: state 'no_rerank' (states[3]) is not validated; run keel hilo validate");

  s = CheckUsable(good, "keel-0.9.1+def456", now, 86400);
  EXPECT_EQ(s.message(), "catalog not usable: stale: validated with binaries 'keel-0.9.0+abc123', running "
                         "'keel-0.9.1+def456'; run keel hilo validate");

  c = good;
  c.binaries.clear();
  EXPECT_EQ(CheckUsable(c, "", now, 86400).message(),
            "catalog not usable: no binaries fingerprint; run keel hilo validate");

  c = good;
  c.states[1].figures->validated_at = now - 90000;
  EXPECT_EQ(CheckUsable(c, good.binaries, now, 86400).message(),
            "catalog not usable: state 'small_model' was validated 90000 s ago, more than the 86400 s allowed; run "
            "keel hilo validate");
  EXPECT_TRUE(CheckUsable(c, good.binaries, now, 90000).ok());

  // Validated in the future: its age would never grow (a clock skew of a few minutes passes).
  c = good;
  c.states[2].figures->validated_at = now + 100;
  EXPECT_TRUE(CheckUsable(c, good.binaries, now, 86400).ok());
  c.states[2].figures->validated_at = now + 86400;
  s = CheckUsable(c, good.binaries, now, 86400);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("86400 s in the future"), std::string::npos) << s.message();
}

// SameLevel compares every knob of one service and nothing of the others'.
TEST(HiloCatalog, SameLevelComparesEveryKnobOfOneService) {
  const Catalog c = TestCatalog();
  const State& full = c.states[0];
  for (Service s : kAllServices) EXPECT_TRUE(SameLevel(full, full, s));
  auto differs_only_in = [&](const State& other, Service changed) {
    for (Service s : kAllServices) EXPECT_EQ(SameLevel(full, other, s), s != changed) << ServiceName(s);
  };
  State x = full;
  x.answer.context_docs = 7;
  differs_only_in(x, Service::kAnswer);
  x = full;
  x.answer.retrieval = false;
  differs_only_in(x, Service::kAnswer);
  for (int knob = 0; knob < 4; ++knob) {
    x = full;
    if (knob == 0) x.vector.nprobe = 8;
    if (knob == 1) x.vector.k = 5;
    if (knob == 2) x.vector.rerank = false;
    if (knob == 3) x.vector.fanout = 2;
    differs_only_in(x, Service::kVector);
    x = full;
    if (knob == 0) x.engine.kv_codec = "raw";
    if (knob == 1) x.engine.lossless = false;
    if (knob == 2) x.engine.max_context = 512;
    if (knob == 3) x.engine.max_new_tokens = 16;
    differs_only_in(x, Service::kEngine);
  }
  x = full;
  x.gateway.model = "small";
  differs_only_in(x, Service::kGateway);
  x = full;
  x.gateway.max_tokens_clamp = 8;
  differs_only_in(x, Service::kGateway);
}

}  // namespace
}  // namespace keel::hilo
