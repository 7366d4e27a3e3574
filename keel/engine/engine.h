// Engine: the pieces one inference instance needs, wired together — model, tokenizer, KV cache
// and scheduler — with the discovery rules the CLI and servers share. Thin by design: everything
// here is a composition of public APIs that can be used on their own.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "keel/core/status.h"
#include "keel/engine/feed_forward.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/kvstore_link.h"
#include "keel/engine/model.h"
#include "keel/engine/scheduler.h"
#include "keel/engine/tokenizer.h"

namespace keel::engine {

struct EngineOptions {
  std::string model_path;
  std::string tokenizer_path;   // empty: found beside the model (see FindTokenizer)
  std::string kv_codec = "raw";
  KvCacheOptions kv;
  SchedulerOptions scheduler;
  KvStoreLinkOptions kvstore;   // address empty: no shared kvstore
  // Builds the feed-forward stack (e.g. keel/moe's offloaded MoE runtime); empty: the model's own.
  // A history-dependent stack turns prefix sharing off and refuses a kvstore link.
  std::function<Result<std::unique_ptr<FeedForwardStack>>(const Model&)> feed_forward;
};

// Finds the tokenizer for a model: <dir>/tokenizer.bin, else the "*tok*.bin" file in the model's
// directory whose name shares the longest prefix with the model's file name. NotFound lists what
// was tried.
Result<std::string> FindTokenizer(const std::string& model_path);
// `tokenizer_path` when given, else FindTokenizer(model_path): the rule every command shares.
Result<std::string> TokenizerFor(const std::string& model_path, const std::string& tokenizer_path);

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Open(const EngineOptions& options, SchedulerObserver observer = {});

  const Model& model() const { return *model_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // The current KV cache; a codec switch (Scheduler::RequestCodec) replaces it, so read it on
  // the scheduler thread or while the scheduler is idle.
  KvCache& cache() { return *cache_; }
  Scheduler& scheduler() { return *scheduler_; }
  KvStoreLink* kvstore_link() { return link_.get(); }
  FeedForwardStack& feed_forward() { return scheduler_->feed_forward(); }
  // The canonical spec (kv::Codec::spec(), e.g. "raw" -> "raw:f32") of a codec this engine can
  // build for its cache (same model, block size and codec parameters), or why not.
  Result<std::string> ResolveCodec(const std::string& codec_spec) const;
  // Whether the scheduler may switch codecs at run time: not with a kvstore link, whose chunk
  // keys and stored bytes belong to one codec.
  bool can_switch_codec() const { return scheduler_->can_switch_codec(); }

  // Generates synchronously (runs the scheduler on the calling thread). `on_text` receives
  // text as it is produced. Returns the final event (finish reason, token counts). With
  // params.logprobs >= 0, *logprobs_out (when given) receives one entry per generated token.
  Result<GenerationEvent> Generate(const std::string& prompt, const GenerationParams& params,
                                   const std::function<void(const std::string&)>& on_text = {},
                                   std::vector<int>* tokens_out = nullptr,
                                   std::vector<TokenLogprob>* logprobs_out = nullptr);

 private:
  Engine() = default;
  // The scheduler's CacheSwapper: frees the old cache, then builds one with `codec_spec` in the
  // same budget; on failure rebuilds the old codec's.
  KvCache* SwapCache(const std::string& codec_spec, Status* error);

  KvCacheOptions kv_options_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<FeedForwardStack> ffn_;  // custom feed-forward (null: the Transformer's own)
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<KvStoreLink> link_;    // after cache_: its publisher reads cache blocks
  std::unique_ptr<Scheduler> scheduler_; // last: it uses the link
};

}  // namespace keel::engine
