// libFuzzer target for what `keel serve` reads from a client: a /v1/chat/completions or
// /v1/completions body through ParseGenerateRequest with a real tokenizer (tok512.bin from the
// shared data: $KEEL_SHARED, else the checkout's sibling "shared"), which runs the BPE encoder on
// whatever text the body carries. An accepted request must fit the context it was checked against
// (prompt plus max_tokens), hold only token ids of the vocabulary, and never be empty; a refused
// one must name a 4xx status and a message. The errors' JSON must dump.
//
// Input: byte 0 picks chat or completions, the context and the prompt cut; the rest is the body.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "keel/engine/openai_protocol.h"

#ifndef KEEL_SOURCE_DIR
#define KEEL_SOURCE_DIR "."
#endif

namespace {

using namespace keel::engine;

constexpr int kVocab = 512;
std::unique_ptr<Tokenizer> g_tokenizer;

[[noreturn]] void Broken(const char* what, const std::string& text) {
  std::fprintf(stderr, "openai_request_fuzz: %s\n--- body ---\n%s\n", what, text.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* env = std::getenv("KEEL_SHARED");
  const std::string shared = env && *env ? env : std::string(KEEL_SOURCE_DIR) + "/../shared";
  auto tok = Tokenizer::Load(shared + "/data/models/tok512.bin", kVocab);
  if (!tok.ok()) {
    std::fprintf(stderr, "openai_request_fuzz: %s (set KEEL_SHARED)\n", tok.status().ToString().c_str());
    std::exit(1);
  }
  g_tokenizer = std::make_unique<Tokenizer>(std::move(tok).value());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool chat = data[0] & 1;
  const int context = 16 + (data[0] >> 1 & 7) * 32;
  const int max_prompt_tokens = (data[0] & 0x80) ? 12 : 0;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  ServerJob job;
  auto error = ParseGenerateRequest(body, chat, "model", *g_tokenizer, kVocab, context, &job, max_prompt_tokens);
  if (error) {
    if (error->status < 400 || error->status > 499 || error->message.empty()) Broken("a refusal without a 4xx and a message", body);
    (void)Dump(ErrorObject(*error));
    return 0;
  }
  if (job.prompts.empty() || job.n < 1 || job.choices() > kMaxChoicesPerRequest) {
    Broken("an accepted request without prompts or with too many choices", body);
  }
  for (const JobPrompt& p : job.prompts) {
    if (p.tokens.empty()) Broken("an accepted request with an empty prompt", body);
    if (max_prompt_tokens > 0 && static_cast<int>(p.tokens.size()) > max_prompt_tokens) Broken("a prompt past its cut", body);
    for (int t : p.tokens) {
      if (t < 0 || t >= kVocab) Broken("a prompt token outside the vocabulary", body);
    }
    if (p.max_tokens < (job.echo ? 0 : 1) || static_cast<int64_t>(p.tokens.size()) + p.max_tokens > context) {
      Broken("an accepted request that does not fit its context", body);
    }
  }
  return 0;
}
