// openai_codec_bench: the OpenAI non-streamed codec functions the gateway runs per request, each
// through the DOM (nlohmann::json; tests/gateway/openai_dom_reference.h for the builders it
// replaced) and through the DOM-free path now in keel/gateway/vendors/openai/, on the bench's
// typical traffic: the client body bench/gateway/run.sh sends, and the answer a real fake OpenAI
// vendor (started here, on loopback) gives to it. Prints ns per call and the DOM/fast ratio.
//
//   openai_codec_bench [--seconds S]   (S: time per measurement, default 0.3; best of 3)
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "keel/gateway/fake_vendor.h"
#include "keel/gateway/vendors/openai/openai.h"
#include "keel/gateway/vendors/openai/openai_answer.h"
#include "tests/core/http_test_client.h"
#include "tests/gateway/openai_dom_reference.h"

namespace keel::gateway {
namespace {

const char kClientBody[] =
    "{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"},"
    "{\"role\":\"user\",\"content\":\"Say hello to the benchmark and then count slowly.\"}],\"max_tokens\":64,"
    "\"temperature\":0,\"stream\":false}";

// Nanoseconds per call of f: the best of 3 runs of about `seconds` each.
double NsPerCall(const std::function<void()>& f, double seconds) {
  double best = 1e300;
  for (int run = 0; run < 3; ++run) {
    size_t n = 0;
    const auto start = std::chrono::steady_clock::now();
    double elapsed = 0;
    do {
      for (int k = 0; k < 256; ++k) f();
      n += 256;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    } while (elapsed < seconds);
    best = std::min(best, elapsed * 1e9 / static_cast<double>(n));
  }
  return best;
}

int Main(int argc, char** argv) {
  double seconds = 0.3;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--seconds") == 0) seconds = std::atof(argv[i + 1]);
  }
  auto fv = FakeVendor::Start(FakeVendorOptions{});
  if (!fv.ok()) {
    std::fprintf(stderr, "fake vendor: %s\n", fv.status().ToString().c_str());
    return 1;
  }
  Result<ChatRequest> request = ParseOpenAIChatRequest(kClientBody);
  if (!request.ok()) return 1;
  Result<std::string> upstream_body = BuildOpenAIChatRequest(*request, "gpt-4o-mini");
  if (!upstream_body.ok()) return 1;
  test::HttpTestClient client((*fv)->port(), 20);
  test::HttpTestResponse res;
  if (!client.SendRaw(test::HttpTestClient::BuildRequest("POST", "/v1/chat/completions", *upstream_body,
                                                         "application/json", {{"Authorization", "Bearer sk-bench"}})) ||
      !client.ReadResponse(&res) || res.status != 200) {
    std::fprintf(stderr, "fake vendor did not answer: %d %s\n", res.status, res.body.c_str());
    return 1;
  }
  const std::string answer = res.body;
  ChatRequest fast_request;
  if (!internal::ReadOpenAIChatRequestFast(kClientBody, &fast_request)) {
    std::fprintf(stderr, "the fast reader declined the client body\n");
    return 1;
  }
  ChatResponse parsed;
  if (!internal::ReadOpenAIChatResponseFast(answer, &parsed)) {
    std::fprintf(stderr, "the fast reader declined the fake vendor's answer: %s\n", answer.c_str());
    return 1;
  }

  struct Row {
    const char* what;
    std::function<void()> dom, fast;
  };
  const Row rows[] = {
      {"ParseOpenAIChatRequest (client body)",
       [&] { benchmark::DoNotOptimize(internal::ParseOpenAIChatRequestDom(kClientBody)); },
       [&] { benchmark::DoNotOptimize(ParseOpenAIChatRequest(kClientBody)); }},
      {"ParseOpenAIChatResponse (upstream answer)",
       [&] { benchmark::DoNotOptimize(internal::ParseOpenAIChatResponseDom(answer)); },
       [&] { benchmark::DoNotOptimize(ParseOpenAIChatResponse(answer)); }},
      {"BuildOpenAIChatResponse (client answer)",
       [&] { benchmark::DoNotOptimize(dom_reference::BuildOpenAIChatResponse(parsed, "gpt-4o-mini")); },
       [&] { benchmark::DoNotOptimize(BuildOpenAIChatResponse(parsed, "gpt-4o-mini")); }},
      {"BuildOpenAIChatRequest (upstream request)",
       [&] { benchmark::DoNotOptimize(dom_reference::BuildOpenAIChatRequest(*request, "gpt-4o-mini")); },
       [&] { benchmark::DoNotOptimize(BuildOpenAIChatRequest(*request, "gpt-4o-mini")); }},
  };
  std::printf("answer: %zu bytes, upstream request: %zu bytes\n\n", answer.size(), upstream_body->size());
  std::printf("| function | DOM ns/call | fast ns/call | DOM / fast |\n|---|---:|---:|---:|\n");
  for (const Row& r : rows) {
    const double dom = NsPerCall(r.dom, seconds), fast = NsPerCall(r.fast, seconds);
    std::printf("| %s | %.0f | %.0f | %.1fx |\n", r.what, dom, fast, dom / fast);
  }
  return 0;
}

}  // namespace
}  // namespace keel::gateway

int main(int argc, char** argv) { return keel::gateway::Main(argc, argv); }
