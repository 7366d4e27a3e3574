// libFuzzer target for what `keel answer` reads from others:
//
//   mode 0, a client's request body (keel/answer/request.h): ParseAnswerRequest; an accepted
//           request's prompt (BuildPrompt, with documents and history) must be valid UTF-8, since
//           it goes on to the gateway as JSON, and must hold the question whole.
//   mode 1, the gateway's stream (keel/answer/sse.h): SseRelay fed in chunks of a size the input
//           picks, then Finish. What the client gets must be a well-formed OpenAI stream: every
//           event one "data: <payload>\n\n", every payload a JSON object or [DONE], nothing after
//           the end, and it ends in [DONE] exactly when the relay says it finished, otherwise in
//           one error object (never both: a cut answer must not look whole).
//
// Input: byte 0 the mode and chunk size, the rest the body. Crashes, sanitizer reports and broken
// invariants (abort with the offending text) are bugs.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "keel/answer/request.h"
#include "keel/answer/sse.h"
#include "keel/core/json_reader.h"

namespace {

using namespace keel::answer;

[[noreturn]] void Broken(const char* what, std::string_view text) {
  std::fprintf(stderr, "answer_fuzz: %s\n--- text ---\n%.*s\n", what, static_cast<int>(text.size()), text.data());
  std::abort();
}

void Request(uint8_t pick, std::string_view body) {
  RequestLimits limits;
  limits.dim = 4;
  limits.max_messages = 8;
  limits.max_message_bytes = 512;
  auto request = ParseAnswerRequest(body, limits);
  if (!request.ok()) return;
  const std::vector<std::string_view> docs = {"first document\nwith a line break", "second, caf\xc3\xa9 \xe2\x82\xac end"};
  const std::string prompt = BuildPrompt(docs, request->question, pick, request->history, pick * 3u);
  if (prompt.find(request->question) == std::string::npos) Broken("the prompt lost its question", prompt);
  try {
    (void)nlohmann::json(prompt).dump();  // strict: throws on invalid UTF-8
  } catch (const nlohmann::json::exception&) {
    Broken("the prompt is not valid UTF-8", prompt);
  }
}

void Stream(uint8_t pick, std::string_view body) {
  std::string out;
  SseRelay relay([&out](std::string_view bytes) { out.append(bytes); return true; },
                 [] { return nlohmann::ordered_json{{"state", "full"}}; }, "gateway", 4096);
  const size_t chunk = (pick >> 1) == 0 ? body.size() + 1 : (pick >> 1);
  for (size_t off = 0; off < body.size(); off += chunk) {
    if (!relay.Feed(body.substr(off, chunk))) break;
  }
  const bool whole = relay.Finish(relay.done() ? "" : "the upstream closed the stream");
  // Read back what the client got.
  std::string_view rest = out;
  bool ended = false, saw_done = false, saw_error = false;
  while (!rest.empty()) {
    if (ended) Broken("an event after the stream's end", out);
    if (rest.substr(0, 6) != "data: ") Broken("an event that is not a data line", out);
    const size_t end = rest.find("\n\n");
    if (end == std::string_view::npos) Broken("an unterminated event", out);
    const std::string_view payload = rest.substr(6, end - 6);
    if (payload.find('\n') != std::string_view::npos) Broken("a payload over several lines", out);
    rest.remove_prefix(end + 2);
    if (payload == "[DONE]") {
      saw_done = ended = true;
      continue;
    }
    auto json = keel::ParseUntrustedJson(payload, keel::JsonLimits{});
    if (!json.ok() || !json->is_object()) Broken("a payload that is not a JSON object", out);
    if (auto err = json->find("error"); err != json->end() && !err->is_null() && *err != false) saw_error = ended = true;
  }
  if (whole != saw_done) Broken("[DONE] sent and Finish's answer disagree", out);
  if (!saw_done && !saw_error) Broken("a stream that ends in neither [DONE] nor an error", out);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] & 1) {
    Stream(data[0], body);
  } else {
    Request(data[0], body);
  }
  return 0;
}
