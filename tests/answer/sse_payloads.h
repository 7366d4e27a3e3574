// Test helper: an SSE body (what a `keel answer` stream sends) split into its events' "data: "
// payloads, in order, "[DONE]" included. A blank-line-terminated event is expected per payload;
// an unterminated tail or a line that is not "data: ..." fails the calling test.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace keel::test {

inline std::vector<std::string> SsePayloads(const std::string& body) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos < body.size();) {
    const size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) {
      ADD_FAILURE() << "unterminated event at byte " << pos << " of: " << body;
      break;
    }
    const std::string line = body.substr(pos, end - pos);
    pos = end + 2;
    if (line.rfind("data: ", 0) != 0) {
      ADD_FAILURE() << "not a data line: " << line;
      continue;
    }
    out.push_back(line.substr(6));
  }
  return out;
}

// A whole OpenAI stream: its JSON chunks as text, without the final "[DONE]". Fails the calling
// test when [DONE] is missing or anything follows it.
inline std::vector<std::string> SseChunksBeforeDone(const std::string& body) {
  std::vector<std::string> chunks;
  bool done = false;
  for (std::string& payload : SsePayloads(body)) {
    EXPECT_FALSE(done) << "an event after [DONE]: " << payload;
    if (payload == "[DONE]") {
      done = true;
      continue;
    }
    chunks.push_back(std::move(payload));
  }
  EXPECT_TRUE(done) << "no [DONE] in: " << body;
  return chunks;
}

}  // namespace keel::test
