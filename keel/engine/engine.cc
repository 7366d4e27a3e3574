#include "keel/engine/engine.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>

#include "keel/core/log.h"

namespace keel::engine {

namespace fs = std::filesystem;

Result<std::string> FindTokenizer(const std::string& model_path) {
  std::error_code ec;
  fs::path model(model_path);
  fs::path dir = fs::is_directory(model, ec) ? model : model.parent_path();
  if (dir.empty()) dir = ".";
  fs::path direct = dir / "tokenizer.bin";
  if (fs::is_regular_file(direct, ec)) return direct.string();
  const std::string stem = fs::is_directory(model, ec) ? std::string() : model.filename().string();
  std::string best;
  size_t best_common = 0;
  int candidates = 0;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == model.filename().string()) continue;
    if (name.find("tok") == std::string::npos || name.size() < 4 || name.substr(name.size() - 4) != ".bin") continue;
    ++candidates;
    size_t common = 0;
    while (common < name.size() && common < stem.size() && name[common] == stem[common]) ++common;
    if (best.empty() || common > best_common) {
      best = entry.path().string();
      best_common = common;
    }
  }
  if (!best.empty() && (best_common > 0 || candidates == 1)) return best;
  return Status::NotFound("no tokenizer found for " + model_path + ": tried " + direct.string() +
                          " and *tok*.bin files in " + dir.string() + "; pass --tokenizer");
}

Result<std::string> TokenizerFor(const std::string& model_path, const std::string& tokenizer_path) {
  if (!tokenizer_path.empty()) return tokenizer_path;
  return FindTokenizer(model_path);
}

Result<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options, SchedulerObserver observer) {
  std::unique_ptr<Engine> e(new Engine());
  KEEL_ASSIGN_OR_RETURN(Model m, LoadModel(options.model_path));
  e->model_ = std::make_unique<Model>(std::move(m));
  KEEL_ASSIGN_OR_RETURN(std::string tok_path, TokenizerFor(options.model_path, options.tokenizer_path));
  KEEL_ASSIGN_OR_RETURN(Tokenizer t, Tokenizer::Load(tok_path, e->model_->config.vocab_size));
  e->tokenizer_ = std::make_unique<Tokenizer>(std::move(t));
  KvCacheOptions kv = options.kv;
  if (!kv.prefix_sharing && !options.kvstore.address.empty()) {
    // The kvstore link publishes and adopts prompt-prefix blocks: it is prefix sharing.
    return Status::InvalidArgument("a kvstore link shares KV prefixes: it cannot run with prefix sharing off");
  }
  if (options.feed_forward) {
    KEEL_ASSIGN_OR_RETURN(e->ffn_, options.feed_forward(*e->model_));
    if (e->ffn_->history_dependent()) {
      // Its outputs depend on state built along the whole token history, which blocks computed
      // by another sequence (or instance) do not carry.
      if (!options.kvstore.address.empty()) {
        return Status::InvalidArgument("this feed-forward (PSR expert routing) depends on each sequence's whole "
                                       "history: it cannot share KV prefixes through a kvstore");
      }
      kv.prefix_sharing = false;
    }
  }
  KEEL_ASSIGN_OR_RETURN(e->cache_, KvCache::Create(*e->model_, options.kv_codec, kv));
  e->scheduler_ = std::make_unique<Scheduler>(*e->model_, *e->tokenizer_, *e->cache_, options.scheduler,
                                              std::move(observer));
  if (e->ffn_) e->scheduler_->SetFeedForward(e->ffn_.get());
  e->kv_options_ = kv;
  if (!options.kvstore.address.empty()) {
    KEEL_ASSIGN_OR_RETURN(e->link_, KvStoreLink::Create(options.kvstore, *e->cache_));
    e->scheduler_->SetKvStoreLink(e->link_.get());
  } else {
    Engine* self = e.get();
    e->scheduler_->SetCacheSwapper(
        [self](const std::string& spec, Status* error) { return self->SwapCache(spec, error); });
  }
  return e;
}

Result<std::string> Engine::ResolveCodec(const std::string& codec_spec) const {
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<kv::Codec> codec, MakeCacheCodec(*model_, codec_spec, kv_options_));
  return codec->spec();
}

KvCache* Engine::SwapCache(const std::string& codec_spec, Status* error) {
  Result<std::unique_ptr<kv::Codec>> codec = MakeCacheCodec(*model_, codec_spec, kv_options_);
  if (!codec.ok()) {
    *error = codec.status();
    return cache_.get();
  }
  const std::string old_spec = cache_->codec().spec();
  // One budget: the old arena is unmapped before the new one is mapped, so a switch never needs
  // twice the KV memory. No sequence holds blocks now (the scheduler drained or preempted them).
  cache_.reset();
  Result<std::unique_ptr<KvCache>> next = KvCache::Create(*model_, std::move(*codec), kv_options_);
  if (next.ok()) {
    cache_ = std::move(*next);
    return cache_.get();
  }
  *error = next.status();
  Result<std::unique_ptr<KvCache>> again = KvCache::Create(*model_, old_spec, kv_options_);
  if (!again.ok()) {
    // The same codec and budget worked a moment ago; only a failing mmap gets here.
    Log().error("kv cache: cannot rebuild the {} cache after a failed switch: {}", old_spec, again.status().ToString());
    std::abort();
  }
  cache_ = std::move(*again);
  return cache_.get();
}

Result<GenerationEvent> Engine::Generate(const std::string& prompt, const GenerationParams& params,
                                         const std::function<void(const std::string&)>& on_text,
                                         std::vector<int>* tokens_out,
                                         std::vector<TokenLogprob>* logprobs_out) {
  auto req = std::make_shared<Request>();
  req->prompt = tokenizer_->Encode(prompt, /*bos=*/true);
  req->params = params;
  GenerationEvent final_event;
  req->on_event = [&](const GenerationEvent& ev) {
    if (!ev.text.empty() && on_text) on_text(ev.text);
    if (tokens_out) tokens_out->insert(tokens_out->end(), ev.tokens.begin(), ev.tokens.end());
    if (logprobs_out) logprobs_out->insert(logprobs_out->end(), ev.logprobs.begin(), ev.logprobs.end());
    if (ev.finished) final_event = ev;
  };
  KEEL_RETURN_IF_ERROR(scheduler_->Submit(req));
  scheduler_->RunUntilIdle();
  if (final_event.finish_reason == FinishReason::kError) return final_event.error;
  return final_event;
}

}  // namespace keel::engine
