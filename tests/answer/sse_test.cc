// SseRelay: an upstream OpenAI stream relayed to a client, fed in arbitrary pieces.
#include "keel/answer/sse.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/answer/sse_payloads.h"

namespace keel::answer {
namespace {

using ojson = nlohmann::ordered_json;

// What the client received, split into events ("data: <payload>").
std::vector<std::string> Events(const std::string& out) {
  std::vector<std::string> events;
  for (const std::string& payload : test::SsePayloads(out)) events.push_back("data: " + payload);
  return events;
}

struct Rig {
  std::string out;
  int keel_calls = 0;
  bool client_gone = false;
  SseRelay relay{[this](std::string_view b) {
                   if (client_gone) return false;
                   out.append(b);
                   return true;
                 },
                 [this] {
                   ++keel_calls;
                   return ojson{{"state", "full"}};
                 },
                 "gateway at 127.0.0.1:1", 4096};
};

const std::string kStream =
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n"
    ": keep-alive\n\n"
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"content\":\"Hel\"},\"finish_reason\":null}]}\r\n\r\n"
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,"
    "\"delta\":{\"content\":\"lo\"},\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,"
    "\"delta\":{},\"finish_reason\":\"length\"}]}\n\n"
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[],"
    "\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n"
    "data: [DONE]\n\n";

// Whatever the piece size, the client gets the same events: the content in order, "keel" once on
// the finish chunk, the usage chunk, then [DONE]; the keep-alive comment is dropped.
TEST(SseRelayTest, RelaysEventsWhateverThePiecesAndAddsKeelToTheFinishChunk) {
  std::string reference;
  for (size_t piece : {kStream.size(), size_t{1}, size_t{2}, size_t{7}, size_t{64}}) {
    Rig rig;
    for (size_t i = 0; i < kStream.size(); i += piece) {
      ASSERT_TRUE(rig.relay.Feed(std::string_view(kStream).substr(i, piece))) << piece;
    }
    EXPECT_TRUE(rig.relay.done());
    EXPECT_TRUE(rig.relay.Finish(""));
    EXPECT_EQ(rig.keel_calls, 1);
    if (reference.empty()) reference = rig.out;
    EXPECT_EQ(rig.out, reference) << "piece " << piece;
  }
  const std::vector<std::string> events = Events(reference);
  ASSERT_EQ(events.size(), 6u) << reference;
  std::string content;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    ASSERT_EQ(events[i].rfind("data: ", 0), 0u);
    const ojson e = ojson::parse(events[i].substr(6));
    for (const auto& c : e["choices"]) content += c["delta"].value("content", "");
    EXPECT_EQ(e.contains("keel"), i == 3) << events[i];
  }
  EXPECT_EQ(content, "Hello");
  EXPECT_EQ(ojson::parse(events[3].substr(6))["keel"]["state"], "full");
  EXPECT_EQ(ojson::parse(events[4].substr(6))["usage"]["total_tokens"], 5);
  EXPECT_EQ(events[5], "data: [DONE]");
}

// A stream cut before [DONE] ends with an OpenAI error event and no [DONE], whether it broke
// (the connection failed) or ended early; a payload that is not a JSON object and an event over
// the bound do the same, and the relay then asks to stop reading.
TEST(SseRelayTest, BrokenUpstreamsEndWithAnErrorEventAndNoDone) {
  const std::string head = kStream.substr(0, kStream.find("data: {", 10));  // the first event and the comment
  {
    Rig rig;
    ASSERT_TRUE(rig.relay.Feed(head));
    ASSERT_TRUE(rig.relay.Feed("data: {\"choices\":[{\"delta\":{\"content\":\"cu"));  // an unterminated event
    EXPECT_FALSE(rig.relay.Finish("connection closed before the end of the response"));
    const std::vector<std::string> events = Events(rig.out);
    ASSERT_EQ(events.size(), 2u) << rig.out;
    const ojson err = ojson::parse(events[1].substr(6));
    EXPECT_EQ(err["error"]["type"], "upstream_error");
    const std::string msg = err["error"]["message"];
    EXPECT_NE(msg.find("gateway at 127.0.0.1:1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("connection closed"), std::string::npos) << msg;
    EXPECT_EQ(rig.out.find("data: [DONE]"), std::string::npos);
  }
  {
    Rig rig;
    ASSERT_TRUE(rig.relay.Feed(head));
    EXPECT_FALSE(rig.relay.Finish(""));
    EXPECT_NE(rig.out.find("ended before [DONE]"), std::string::npos) << rig.out;
  }
  for (const std::string bad : {"data: [1,2]\n\n", "data: {\"a\":\n\n", "data: not json\n\n"}) {
    Rig rig;
    EXPECT_FALSE(rig.relay.Feed(bad)) << bad;
    EXPECT_TRUE(rig.relay.failed());
    EXPECT_FALSE(rig.relay.Feed("data: [DONE]\n\n"));
    EXPECT_FALSE(rig.relay.Finish(""));
    EXPECT_EQ(Events(rig.out).size(), 1u) << rig.out;
    EXPECT_NE(rig.out.find("not a JSON object"), std::string::npos) << rig.out;
  }
  {
    // The gateway's OpenAI encoder sends [DONE] after an error event: relayed, it made a cut
    // answer look whole. The error goes on as it is, and nothing after it.
    Rig rig;
    ASSERT_TRUE(rig.relay.Feed(head));
    EXPECT_FALSE(rig.relay.Feed("data: {\"error\":{\"message\":\"upstream large: truncated body\",\"code\":\"bad_gateway\"}}\n\n"
                                "data: [DONE]\n\n"));
    EXPECT_TRUE(rig.relay.failed());
    EXPECT_FALSE(rig.relay.Finish(""));
    EXPECT_NE(rig.relay.failure().find("truncated body"), std::string::npos) << rig.relay.failure();
    const std::vector<std::string> events = Events(rig.out);
    ASSERT_EQ(events.size(), 2u) << rig.out;
    EXPECT_EQ(ojson::parse(events[1].substr(6))["error"]["code"], "bad_gateway");
    EXPECT_EQ(rig.out.find("data: [DONE]"), std::string::npos) << rig.out;
  }
  {
    // An "error" that is not an object still ends the answer (the OpenAI SDKs raise on any
    // truthy one): relayed once, then the relay's own error is not added after it.
    Rig rig;
    ASSERT_TRUE(rig.relay.Feed(head));
    EXPECT_FALSE(rig.relay.Feed("data: {\"error\":\"overloaded\"}\n\n"));
    EXPECT_FALSE(rig.relay.Finish("the upstream closed the stream"));
    EXPECT_NE(rig.relay.failure().find("overloaded"), std::string::npos) << rig.relay.failure();
    ASSERT_EQ(Events(rig.out).size(), 2u) << rig.out;
    // null and false are not errors.
    Rig quiet;
    EXPECT_TRUE(quiet.relay.Feed("data: {\"error\":null,\"choices\":[]}\n\ndata: {\"error\":false,\"choices\":[]}\n\n"));
    EXPECT_FALSE(quiet.relay.failed());
  }
  {
    Rig rig;  // bound 4096: one data line past it, and an event split over many lines past it
    EXPECT_FALSE(rig.relay.Feed("data: {\"x\":\"" + std::string(5000, 'a')));
    EXPECT_NE(rig.out.find("over 4096 bytes"), std::string::npos) << rig.out;
    Rig lines;
    bool ok = true;
    for (int i = 0; i < 200 && ok; ++i) ok = lines.relay.Feed("data: " + std::string(40, 'b') + "\n");
    EXPECT_FALSE(ok);
    EXPECT_TRUE(lines.relay.failed());
  }
}

// [DONE] without a finish chunk still carries "keel", on an extra chunk with no choices; bytes
// after [DONE] are read and ignored; a client that went away stops the relay.
TEST(SseRelayTest, KeelWithoutAFinishChunkAndAGoneClient) {
  {
    Rig rig;
    ASSERT_TRUE(rig.relay.Feed(
        "data: {\"id\":\"c9\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":null}]}\n\n"
        "data: [DONE]\n\ndata: {\"late\":true}\n\n"));
    EXPECT_TRUE(rig.relay.Feed("trailing bytes"));
    EXPECT_TRUE(rig.relay.Finish(""));
    const std::vector<std::string> events = Events(rig.out);
    ASSERT_EQ(events.size(), 3u) << rig.out;
    const ojson extra = ojson::parse(events[1].substr(6));
    EXPECT_EQ(extra["id"], "c9");
    EXPECT_TRUE(extra["choices"].empty());
    EXPECT_EQ(extra["keel"]["state"], "full");
    EXPECT_EQ(events[2], "data: [DONE]");
  }
  {
    Rig rig;
    rig.client_gone = true;
    EXPECT_FALSE(rig.relay.Feed(kStream));
    EXPECT_FALSE(rig.relay.Finish(""));
    EXPECT_TRUE(rig.out.empty());
  }
}

}  // namespace
}  // namespace keel::answer
