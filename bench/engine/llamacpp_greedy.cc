// llamacpp_greedy: greedy (argmax) generation with llama.cpp, printing token ids, so that
// bench/engine/vs_llamacpp.sh can check a GGUF conversion token for token against
// `keel generate --temperature 0 --print-ids`. Built by that script against llama.cpp's llama.h
// (not part of Keel's CMake build: Keel does not depend on llama.cpp).
//
//   llamacpp_greedy MODEL.gguf N_PREDICT [PROMPT]
//
// Tokenizes PROMPT with BOS (empty: BOS alone), decodes the prompt as one batch, then generates up
// to N_PREDICT tokens, stopping at an end-of-generation token as `keel generate` does. The KV cache
// is F32 and the context holds the whole run, so nothing is rounded that Keel's default raw:f32
// cache keeps exact. Prints "prompt: ID ..." and "ids: ID ..." on stdout and llama.cpp's
// "system_info: ..." line (the CPU features its loaded backend uses) on stderr; exits 1 on any
// failure.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "llama.h"

namespace {

void PrintIds(const char* label, const std::vector<llama_token>& ids) {
  std::printf("%s:", label);
  for (llama_token t : ids) std::printf(" %d", t);
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT [PROMPT]\n", argv[0]);
    return 1;
  }
  const std::string model_path = argv[1];
  const int n_predict = std::atoi(argv[2]);
  const std::string prompt = argc == 4 ? argv[3] : "";

  ggml_backend_load_all();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (model == nullptr) {
    std::fprintf(stderr, "llamacpp_greedy: cannot load %s\n", model_path.c_str());
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  std::fprintf(stderr, "system_info: %s\n", llama_print_system_info());

  const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), nullptr, 0, true, false);
  std::vector<llama_token> tokens(n_prompt);
  if (llama_tokenize(vocab, prompt.c_str(), prompt.size(), tokens.data(), n_prompt, true, false) < 0) {
    std::fprintf(stderr, "llamacpp_greedy: cannot tokenize the prompt\n");
    return 1;
  }
  PrintIds("prompt", tokens);

  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = n_prompt + n_predict;
  cp.n_batch = n_prompt;
  cp.n_threads = 2;
  cp.n_threads_batch = 2;
  cp.type_k = GGML_TYPE_F32;
  cp.type_v = GGML_TYPE_F32;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "llamacpp_greedy: cannot create a context\n");
    return 1;
  }
  llama_sampler* greedy = llama_sampler_init_greedy();

  std::vector<llama_token> out;
  llama_batch batch = llama_batch_get_one(tokens.data(), static_cast<int32_t>(tokens.size()));
  llama_token next = 0;
  while (static_cast<int>(out.size()) < n_predict) {
    if (llama_decode(ctx, batch) != 0) {
      std::fprintf(stderr, "llamacpp_greedy: llama_decode failed\n");
      return 1;
    }
    next = llama_sampler_sample(greedy, ctx, -1);
    if (llama_vocab_is_eog(vocab, next)) break;
    out.push_back(next);
    batch = llama_batch_get_one(&next, 1);
  }
  PrintIds("ids", out);

  llama_sampler_free(greedy);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
