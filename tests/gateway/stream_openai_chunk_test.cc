// The OpenAI decoder reads plain chunks with a fast path (json_scanner.h's scanner, else nlohmann's SAX
// parser) and falls back to a DOM for anything else. A named SSE event (other than "error") always takes the DOM path with the same meaning, so
// decoding a chunk with and without an "event:" line must give the same events and status: this
// compares the two on generated chunks, ordinary and hostile (repeated keys, wrong types, huge and
// fractional numbers, nulls, nesting, escapes, tool calls, error members, malformed text).
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "keel/gateway/stream.h"
#include "tests/gateway/stream_by_format.h"

namespace keel::gateway {
namespace {

using stream_by_format::MakeStreamDecoder;

std::string Show(const StreamEvent& e) {
  return std::to_string(static_cast<int>(e.kind)) + "|" + e.id + "|" + e.model + "|" + e.text + "|" +
         std::to_string(e.tool_index) + "|" + e.tool_call.id + "|" + e.tool_call.name + "|" +
         std::to_string(static_cast<int>(e.finish)) + "|" + e.stop_sequence + "|" +
         std::to_string(e.usage.input_tokens) + "|" + std::to_string(e.usage.output_tokens);
}

// Decodes `chunks` (JSON texts), each as one SSE event, named `event` when not empty.
std::string Decode(WireFormat format, const std::vector<std::string>& chunks, const std::string& event) {
  auto dec = MakeStreamDecoder(format);
  std::vector<StreamEvent> out;
  std::string log;
  Status s = Status::Ok();
  for (const std::string& c : chunks) {
    s = dec->Feed((event.empty() ? "" : "event: " + event + "\n") + "data: " + c + "\n\n", &out);
    if (!s.ok()) break;
  }
  if (s.ok()) s = dec->Feed("data: [DONE]\n\n", &out);
  if (s.ok()) s = dec->Finish(&out);
  for (const StreamEvent& e : out) log += Show(e) + "\n";
  log += "status " + std::to_string(static_cast<int>(s.code()));
  if (const GatewayError* e = dec->upstream_error()) log += " vendor " + std::to_string(e->status) + " " + e->message;
  return log;
}

class ChunkGen {
 public:
  explicit ChunkGen(uint32_t seed) : rng_(seed) {}

  std::string Chunk() {
    std::string s = "{";
    const int n = Pick(7);
    for (int i = 0; i < n; ++i) {
      if (i) s += ",";
      static const char* kKeys[] = {"id", "model", "choices", "usage", "object", "created", "error", "choices", "id"};
      const std::string key = kKeys[Pick(9)];
      s += "\"" + key + "\":";
      if (key == "choices") {
        s += Pick(6) ? Choices() : Scalar();
      } else if (key == "usage") {
        s += Pick(5) ? Usage() : Scalar();
      } else if (key == "error") {
        s += Pick(3) ? "null" : R"({"message":"boom","type":"rate_limit_error","code":429})";
      } else {
        s += Pick(4) ? Str() : Any(2);
      }
    }
    s += "}";
    if (Pick(15) == 0) s.resize(Pick(static_cast<int>(s.size()) + 1));  // malformed: cut short
    if (Pick(20) == 0) s = Any(3);                                        // not (always) an object
    return s;
  }

 private:
  int Pick(int n) { return static_cast<int>(rng_() % static_cast<uint32_t>(n)); }

  std::string Str() {
    static const char* kStrs[] = {R"("")", R"("chatcmpl-1")", R"("gpt-4o")", R"("Hi")", R"(" there\n")",
                                  R"("\"q\" \\ \u00e9 \ud83d\ude00")", R"("stop")", R"("length")",
                                  R"("tool_calls")", R"("\u0000x")", "\"\xc3\xa9\""};
    return kStrs[Pick(11)];
  }
  std::string Number() {
    static const char* kNums[] = {"0", "1", "-1", "2", "7", "1.5", "-0.0", "1e3", "1e300", "18446744073709551615",
                                  "9223372036854775807", "-9223372036854775808", "3.9e18"};
    return kNums[Pick(13)];
  }
  std::string Scalar() {
    switch (Pick(5)) {
      case 0: return "null";
      case 1: return Pick(2) ? "true" : "false";
      case 2: return Number();
      default: return Str();
    }
  }
  std::string Any(int depth) {
    if (depth == 0 || Pick(3)) return Scalar();
    if (Pick(2)) return "[" + Any(depth - 1) + "," + Any(depth - 1) + "]";
    return R"({"content":)" + Any(depth - 1) + R"(,"x":)" + Any(depth - 1) + "}";
  }
  std::string Choices() {
    std::string s = "[";
    const int n = Pick(4);
    for (int i = 0; i < n; ++i) {
      if (i) s += ",";
      s += Pick(8) ? Choice() : Any(2);
    }
    return s + "]";
  }
  std::string Choice() {
    std::string s = "{";
    const int n = Pick(6);
    for (int i = 0; i < n; ++i) {
      if (i) s += ",";
      static const char* kKeys[] = {"index", "delta", "finish_reason", "text", "logprobs", "delta", "index"};
      const std::string key = kKeys[Pick(7)];
      s += "\"" + key + "\":";
      if (key == "index") s += Pick(3) ? (Pick(3) ? "0" : Number()) : Scalar();
      else if (key == "delta") s += Pick(5) ? Delta() : Any(2);
      else s += Pick(4) ? Str() : Any(1);
    }
    return s + "}";
  }
  std::string Delta() {
    std::string s = "{";
    const int n = Pick(4);
    for (int i = 0; i < n; ++i) {
      if (i) s += ",";
      static const char* kKeys[] = {"content", "role", "tool_calls", "content", "refusal"};
      const std::string key = kKeys[Pick(5)];
      s += "\"" + key + "\":";
      if (key == "tool_calls") {
        s += Pick(2) ? R"([{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\""}}])"
                     : Scalar();
      } else {
        s += Pick(4) ? Str() : Any(2);
      }
    }
    return s + "}";
  }
  std::string Usage() {
    std::string s = "{";
    const int n = Pick(4);
    for (int i = 0; i < n; ++i) {
      if (i) s += ",";
      static const char* kKeys[] = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens"};
      s += "\"" + std::string(kKeys[Pick(4)]) + "\":" + (Pick(4) ? Number() : Scalar());
    }
    return s + "}";
  }

  std::mt19937 rng_;
};

TEST(OpenAIChunkFastPath, SameAsDomPathOnGeneratedChunks) {
  ChunkGen gen(22);
  int declined_or_failed = 0;
  for (int n = 0; n < 20000; ++n) {
    std::vector<std::string> chunks;
    const int k = 1 + n % 4;
    for (int i = 0; i < k; ++i) chunks.push_back(gen.Chunk());
    for (WireFormat f : {WireFormat::kOpenAIChat, WireFormat::kOpenAICompletions}) {
      const std::string fast = Decode(f, chunks, "");
      ASSERT_EQ(fast, Decode(f, chunks, "chunk")) << testing::PrintToString(chunks);
      if (fast.find("status 0") == std::string::npos) ++declined_or_failed;
    }
  }
  EXPECT_GT(declined_or_failed, 100);  // the generator does reach the failure paths
}

// Byte-level damage to chunks: every text the fast path's scanner accepts must be JSON that
// the DOM path reads the same way, and everything else must fail or decline the same way.
TEST(OpenAIChunkFastPath, SameAsDomPathOnMutatedChunks) {
  ChunkGen gen(23);
  std::mt19937 rng(24);
  static const char kBytes[] = "{}[]\",:\\ \t\n0123456789-+.eEtrufalsn/u\x7f\x80\xbf\xc3\xe2\xf0\xff";
  for (int n = 0; n < 30000; ++n) {
    std::string c = gen.Chunk();
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !c.empty(); ++e) {
      const size_t at = rng() % c.size();
      switch (rng() % 3) {
        case 0: c.erase(at, 1); break;
        case 1: c.insert(at, 1, kBytes[rng() % (sizeof(kBytes) - 1)]); break;
        default: c[at] = kBytes[rng() % (sizeof(kBytes) - 1)];
      }
    }
    if (c.find_first_of("\r\n") != std::string::npos) continue;  // one SSE data line only
    ASSERT_EQ(Decode(WireFormat::kOpenAIChat, {c}, ""), Decode(WireFormat::kOpenAIChat, {c}, "chunk"))
        << testing::PrintToString(c);
  }
}

TEST(OpenAIChunkFastPath, DeepAndWideEventsKeepTheirBounds) {
  const std::string deep = R"({"choices":[{"delta":{"content":"x"},"logprobs":)" + std::string(70, '[') +
                           std::string(70, ']') + "}]}";
  EXPECT_EQ(Decode(WireFormat::kOpenAIChat, {deep}, ""), Decode(WireFormat::kOpenAIChat, {deep}, "chunk"));
  EXPECT_NE(Decode(WireFormat::kOpenAIChat, {deep}, "").find("status " + std::to_string(static_cast<int>(
                                                                             StatusCode::kCorruption))),
            std::string::npos);
}

}  // namespace
}  // namespace keel::gateway
