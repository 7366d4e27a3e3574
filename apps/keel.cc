// keel: the command-line front end. Each subcommand is a thin layer over a library call.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "keel/core/log.h"
#include "keel/engine/engine.h"

namespace {

using namespace keel;
using namespace keel::engine;

int Fail(const Status& s) {
  Log().error("{}", s.ToString());
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

struct GenerateArgs {
  std::string model, tokenizer, prompt, codec = "raw";
  float temperature = 1.0f, top_p = 1.0f;
  int top_k = 0, max_tokens = 256;
  uint64_t seed = 0;
  bool seed_set = false;
  std::vector<std::string> stop;
  bool print_ids = false;
};

int RunGenerate(const GenerateArgs& a) {
  EngineOptions opt;
  opt.model_path = a.model;
  opt.tokenizer_path = a.tokenizer;
  opt.kv_codec = a.codec;
  auto engine = Engine::Open(opt);
  if (!engine.ok()) return Fail(engine.status());
  Engine& e = **engine;
  GenerationParams p;
  p.sampling.temperature = a.temperature;
  p.sampling.top_k = a.top_k;
  p.sampling.top_p = a.top_p;
  p.sampling.seed = a.seed_set ? a.seed : static_cast<uint64_t>(std::random_device{}());
  p.stop = a.stop;
  const int prompt_len = static_cast<int>(e.tokenizer().Encode(a.prompt, true).size());
  // Like llama2.c, clamp the length to what the context can hold.
  p.max_tokens = std::min(a.max_tokens, e.model().config.max_seq_len - prompt_len);
  if (p.max_tokens < 1) {
    return Fail(Status::InvalidArgument("prompt has " + std::to_string(prompt_len) +
                                        " tokens, which fills the model's context of " +
                                        std::to_string(e.model().config.max_seq_len)));
  }
  std::vector<int> ids;
  auto t0 = std::chrono::steady_clock::now();
  auto done = e.Generate(a.prompt, p, [](const std::string& text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  }, &ids);
  std::fputc('\n', stdout);
  if (!done.ok()) return Fail(done.status());
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (a.print_ids) {
    std::string s;
    for (int id : ids) s += std::to_string(id) + " ";
    std::fprintf(stderr, "ids: %s\n", s.c_str());
  }
  Log().info("{} prompt + {} generated tokens in {:.3f} s ({:.1f} tok/s), finish_reason={}", prompt_len,
             done->completion_tokens, secs, done->completion_tokens / std::max(secs, 1e-9),
             FinishReasonName(done->finish_reason));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel: LLM and retrieval services under tight resources"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")->capture_default_str();

  GenerateArgs gen;
  auto* generate = app.add_subcommand("generate", "Generate text from a prompt (text on stdout, logs on stderr)");
  generate->add_option("--model,-m", gen.model, "llama2.c .bin checkpoint or Hugging Face model directory")->required();
  generate->add_option("--tokenizer,-z", gen.tokenizer, "llama2.c tokenizer.bin (default: found beside the model)");
  generate->add_option("--prompt,-i", gen.prompt, "prompt text (default: empty, generation starts from BOS)");
  generate->add_option("--temperature,-t", gen.temperature, "0 = greedy")->capture_default_str()->check(CLI::Range(0.0f, 100.0f));
  generate->add_option("--top-p,-p", gen.top_p, "nucleus sampling threshold")->capture_default_str()->check(CLI::Range(0.0f, 1.0f));
  generate->add_option("--top-k", gen.top_k, "0 = off")->capture_default_str()->check(CLI::NonNegativeNumber);
  generate->add_option("--max-tokens,-n", gen.max_tokens, "tokens to generate at most (clamped to the context)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  generate->add_option("--seed,-s", gen.seed, "random seed (default: random)")->each([&](const std::string&) { gen.seed_set = true; });
  generate->add_option("--stop", gen.stop, "stop sequence (repeatable)");
  generate->add_option("--kv-codec", gen.codec, "KV cache codec: raw, raw:f32, raw:bf16")->capture_default_str();
  generate->add_flag("--print-ids", gen.print_ids, "print generated token ids on stderr");

  CLI11_PARSE(app, argc, argv);
  SetLogLevel(log_level);
  if (generate->parsed()) return RunGenerate(gen);
  return 0;
}
