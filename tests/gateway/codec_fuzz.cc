// libFuzzer target for the gateway's wire codecs, every format through its registry (front.h,
// vendor.h), with the properties the gateway relies on checked on every input that gets through:
//
//   mode 0, a client's request body: each front's Parse; an accepted request is built into every
//           vendor's upstream request (BuildChat), whose body must be valid JSON, and answered in
//           the client's format (BuildAnswer, ErrorBody: valid JSON).
//   mode 1, an upstream's answer body: each vendor's ParseChat and ParseError; what they read is
//           written back in every client format, which must be valid JSON.
//   mode 2, an upstream's stream: each vendor's decoder, fed in chunks of a size the input picks
//           (a chunk may end mid-line or mid-UTF-8 sequence), then Finish; the events (and the error,
//           when decoding failed) go through every front's encoder, whose SSE events must each carry
//           valid JSON (or [DONE]).
//
// Input: byte 0 the mode, byte 1 the format/vendor and flags, the rest the body. Crashes,
// sanitizer reports and broken invariants (abort with the offending text) are bugs.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/json_reader.h"
#include "keel/gateway/front.h"
#include "keel/gateway/gateway.h"
#include "keel/gateway/stream.h"
#include "keel/gateway/vendor.h"

namespace {

using namespace keel::gateway;

[[noreturn]] void Broken(const char* what, std::string_view detail, std::string_view text) {
  std::fprintf(stderr, "codec_fuzz: %s (%.*s)\n--- text ---\n%.*s\n", what, static_cast<int>(detail.size()),
               detail.data(), static_cast<int>(text.size()), text.data());
  std::abort();
}

void ExpectJson(const char* what, std::string_view text) {
  keel::JsonLimits limits;
  limits.max_depth = 256;  // what we write nests no deeper than what we accepted (64) plus wrappers
  auto parsed = keel::ParseUntrustedJson(text, limits);
  if (!parsed.ok()) Broken(what, parsed.status().message(), text);
}

// Every SSE event an encoder wrote must carry JSON (or OpenAI's [DONE] sentinel).
void ExpectSseOfJson(const char* what, std::string_view sse) {
  SseParser parser(size_t{64} << 20);
  std::vector<SseParser::Event> events;
  auto st = parser.Feed(sse, &events);
  if (!st.ok()) Broken(what, st.message(), sse);
  if (parser.HasPartialEvent()) Broken(what, "an unterminated event", sse);
  for (const auto& e : events) {
    if (e.data == "[DONE]") continue;
    ExpectJson(what, e.data);
  }
}

UpstreamConfig UpstreamFor(const VendorAdapter& adapter) {
  UpstreamConfig u;
  u.name = "u";
  u.format = adapter.format();
  u.base_url = "http://127.0.0.1:9";
  u.api_key = "k";
  return u;
}

const std::vector<std::string>& Vendors() {
  static const std::vector<std::string> names = VendorNames();
  return names;
}
// Every client front: one per format, and Gemini's two (?alt=sse and the JSON-array stream).
const std::vector<const ClientFront*>& Fronts() {
  static const std::vector<const ClientFront*> fronts = [] {
    std::vector<const ClientFront*> out;
    for (WireFormat f : FrontFormats()) {
      if (f != WireFormat::kGemini) out.push_back(&FrontFor(f));
    }
    out.push_back(&GeminiFrontFor(true));
    out.push_back(&GeminiFrontFor(false));
    return out;
  }();
  return fronts;
}

// A stream as the client reads it: SSE events of JSON, or (Gemini without alt=sse) one JSON array.
void ExpectStream(const char* what, const ClientFront& front, std::string_view bytes) {
  if (front.StreamContentType() == std::string_view("text/event-stream")) {
    ExpectSseOfJson(what, bytes);
  } else {
    ExpectJson(what, bytes);
  }
}

ChatResponse SampleResponse() {
  ChatResponse r;
  r.id = "x";
  r.model = "m";
  r.content = "hi";
  r.finish = FinishReason::kStop;
  r.usage = {3, 1};
  return r;
}

void FromClient(uint8_t pick, std::string_view body) {
  const ClientFront& front = *Fronts()[pick % Fronts().size()];
  const bool stream_by_path = pick & 0x40;
  auto request = front.Parse(body, (pick & 0x80) ? "path-model" : "", stream_by_path);
  if (!request.ok()) {
    GatewayError e{400, ErrorKind::kInvalidRequest, request.status().message(), ""};
    ExpectJson("ErrorBody of a refused request", front.ErrorBody(e));
    return;
  }
  for (const auto& name : Vendors()) {
    auto adapter = FindVendor(name);
    if (!adapter.ok()) Broken("a listed vendor is not found", name, "");
    auto built = (*adapter)->BuildChat(UpstreamFor(**adapter), *request, "upstream-model", 256);
    if (built.ok()) ExpectJson("BuildChat body", built->body);
  }
  ExpectJson("BuildAnswer", front.BuildAnswer(SampleResponse(), *request, request->model));
  auto encoder = front.MakeEncoder(*request, request->model);
  std::string sse;
  StreamEvent text;
  text.text = "hi";
  encoder->Encode(text, &sse);
  StreamEvent done;
  done.kind = StreamEvent::Kind::kDone;
  encoder->Encode(done, &sse);
  ExpectStream("encoder", front, sse);
}

void FromUpstreamAnswer(uint8_t pick, std::string_view body) {
  auto adapter = FindVendor(Vendors()[pick % Vendors().size()]);
  auto answer = (*adapter)->ParseChat(body);
  const GatewayError error = (*adapter)->ParseError(400 + (pick >> 3) % 200, body);
  for (const ClientFront* f : Fronts()) {
    const ClientFront& front = *f;
    ChatRequest request;
    request.client_format = front.format();
    request.model = "m";
    if (answer.ok()) ExpectJson("BuildAnswer of a parsed upstream answer", front.BuildAnswer(*answer, request, "m"));
    ExpectJson("ErrorBody of a parsed upstream error", front.ErrorBody(error));
    (void)front.ErrorStatus(error);
  }
}

void FromUpstreamStream(uint8_t pick, std::string_view body) {
  auto adapter = FindVendor(Vendors()[pick % Vendors().size()]);
  auto decoder = (*adapter)->MakeDecoder();
  const size_t chunk = (pick >> 4) == 0 ? body.size() + 1 : (pick >> 4);
  std::vector<StreamEvent> events;
  keel::Status status;
  for (size_t off = 0; off < body.size() && status.ok(); off += chunk) {
    status = decoder->Feed(body.substr(off, chunk), &events);
  }
  if (status.ok()) status = decoder->Finish(&events);
  for (const ClientFront* f : Fronts()) {
    const ClientFront& front = *f;
    ChatRequest request;
    request.client_format = front.format();
    request.model = "m";
    request.stream = true;
    request.stream_include_usage = pick & 1;
    auto encoder = front.MakeEncoder(request, "m");
    std::string sse;
    for (const auto& e : events) encoder->Encode(e, &sse);
    if (!status.ok()) {
      const GatewayError* upstream = decoder->upstream_error();
      GatewayError e = upstream ? *upstream : GatewayError{502, ErrorKind::kBadGateway, status.message(), ""};
      encoder->EncodeError(e, &sse);
    }
    ExpectStream("stream encoder", front, sse);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const std::string_view body(reinterpret_cast<const char*>(data + 2), size - 2);
  switch (data[0] % 3) {
    case 0: FromClient(data[1], body); break;
    case 1: FromUpstreamAnswer(data[1], body); break;
    default: FromUpstreamStream(data[1], body); break;
  }
  return 0;
}
