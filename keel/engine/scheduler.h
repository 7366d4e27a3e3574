// Scheduler: continuous batching over one model and one KV cache.
//
// Requests enter a bounded queue (Submit fails with ResourceExhausted when it is full; servers
// answer 429). Each Step() admits queued requests whose prompt fits the free KV blocks, then runs
// one forward pass over every active sequence: one token for each decoding sequence, then
// prompt chunks for sequences still prefilling, up to max_batch_tokens. New requests join
// between steps. Decode blocks are allocated as sequences grow; when the budget runs out the
// youngest sequence is preempted (its blocks released, its context recomputed on re-admission,
// mostly from still-cached prefix blocks), so the oldest requests always make progress.
// Events (text deltas, finish) are delivered through the request's callback on the scheduler
// thread; callbacks must be quick and must not call back into the scheduler.
//
// The KV codec can change at run time (HiLO, docs/engine.md "Switching the KV codec"): after
// RequestCodec the scheduler stops admitting, lets running sequences finish for a bounded time,
// preempts what is left, has the owner's CacheSwapper replace the cache (the old cache and its
// prefix blocks are gone) and resumes. Queued and preempted requests wait through it; none fails.
//
// Submit, RequestCodec, codec_spec, QueueDepth and Stats are thread-safe; Step/Run belong to one
// thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/engine/kv_cache.h"
#include "keel/engine/kvstore_link.h"
#include "keel/engine/model.h"
#include "keel/engine/sampler.h"
#include "keel/engine/tokenizer.h"
#include "keel/engine/transformer.h"

namespace keel::engine {

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };
const char* FinishReasonName(FinishReason r);  // "stop", "length", "cancelled", "error"

// Most alternatives a request may ask for per generated token (vLLM's default max_logprobs).
inline constexpr int kMaxTopLogprobs = 20;

struct GenerationParams {
  SamplingOptions sampling;
  int max_tokens = 16;                 // generated tokens at most (0 only with prompt_logprobs)
  std::vector<std::string> stop;       // stop sequences (not included in the output)
  bool stop_at_eos = true;             // BOS/EOS end generation (llama2.c stops at BOS)
  // -1: no log-probabilities. 0..kMaxTopLogprobs: every generated token's log-probability
  // plus that many most likely alternatives (see TokenLogprob).
  int logprobs = -1;
  // Also score the prompt: for each prompt token after the first, its log-probability given the
  // tokens before it, with max(logprobs, 0) alternatives, in GenerationEvent::prompt_logprobs
  // before any generated token (what OpenAI's echo with logprobs returns, and how evaluation
  // harnesses score a text). Such a prompt is computed in full: no prefix-cache or kvstore reuse.
  // With max_tokens 0 the request only scores its prompt.
  bool prompt_logprobs = false;
};

// The log-probability of one generated token under the model's own distribution (softmax of
// the raw logits, before temperature/top-k/top-p), and the most likely tokens at that step.
struct TokenLogprob {
  int token = 0;
  int prev = 0;          // the token before it, which decides how it decodes (Tokenizer::Decode)
  float logprob = 0.0f;
  std::vector<std::pair<int, float>> top;  // (token, logprob), most likely first
};

struct GenerationEvent {
  std::string text;           // new text since the last event (may be empty)
  std::vector<int> tokens;    // token ids produced since the last event
  std::vector<TokenLogprob> logprobs;  // one per entry of `tokens` when params.logprobs >= 0
  // With params.prompt_logprobs: the prompt positions scored since the last event, in order, from
  // position 1 (the first prompt token has no log-probability); all of them come before the first
  // generated token.
  std::vector<TokenLogprob> prompt_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;               // set when finish_reason == kError
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_prompt_tokens = 0;  // prompt tokens served from shared KV blocks (local or kvstore)
  int kvstore_prompt_tokens = 0; // of those, fetched from the shared kvstore
};

struct Request {
  std::vector<int> prompt;  // token ids, BOS included when wanted
  GenerationParams params;
  std::function<void(const GenerationEvent&)> on_event;
  // Set by the owner (client went away) or by Shutdown; checked between steps.
  std::atomic<bool> cancelled{false};
  std::chrono::steady_clock::time_point submitted;  // set by Submit
  std::shared_ptr<const FetchedPrefix> fetched;     // set by Submit when a kvstore is linked
  // Called once, on the scheduler thread, when the request first enters the running batch (not
  // for one cancelled or shut down while queued). Load meters count "started" here.
  std::function<void()> on_admitted;
};

struct SchedulerOptions {
  int max_queue = 64;               // queued (not yet admitted) requests
  int max_running = 32;             // sequences in one batch
  int max_batch_tokens = 512;       // prompt tokens + decode tokens per step
};

struct SchedulerStats {
  int64_t queue_depth = 0;
  int64_t running = 0;
  int64_t steps = 0;
  int64_t prompt_tokens = 0;       // cumulative, computed (excludes cache and kvstore hits)
  int64_t generated_tokens = 0;    // cumulative
  int64_t requests_finished = 0;
  int64_t preemptions = 0;
  int64_t codec_switches = 0;        // KV cache replacements done (RequestCodec)
  double last_switch_drain_s = 0;    // the last switch: from its request to an empty batch
  double last_switch_build_s = 0;    // ...and the new cache's construction
  int64_t last_switch_preempted = 0; // ...sequences preempted at the drain deadline
  KvCacheStats kv;
};

// Replaces the KV cache with one using another codec (HiLO codec switching). Called on the
// scheduler thread when no sequence holds blocks of the current cache, which the swapper may
// destroy first (to stay within one memory budget). Returns the cache to use from now on, never
// null: the new one, or, with *error set, the current one or a rebuild with the current codec.
using CacheSwapper = std::function<KvCache*(const std::string& codec_spec, Status* error)>;

// Observers for metrics: called on the scheduler thread.
struct SchedulerObserver {
  std::function<void(double seconds)> time_to_first_token;
  std::function<void(double seconds)> inter_token_latency;
};

class Scheduler {
 public:
  Scheduler(const Model& model, const Tokenizer& tokenizer, KvCache& cache,
            const SchedulerOptions& options, SchedulerObserver observer = {});
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Shares prefixes through a kvstore (may be null). Set before the first Submit; the link
  // must outlive the scheduler's use of it.
  void SetKvStoreLink(KvStoreLink* link) { link_ = link; }
  KvStoreLink* kvstore_link() const { return link_; }
  // Replaces the model's own feed-forward (see Transformer::SetFeedForward). Set before the first
  // Submit; `stack` must outlive the scheduler.
  void SetFeedForward(FeedForwardStack* stack) { transformer_.SetFeedForward(stack); }
  FeedForwardStack& feed_forward() { return transformer_.feed_forward(); }

  // Makes RequestCodec possible (Engine does this when no kvstore is linked). Set before the
  // first Submit.
  void SetCacheSwapper(CacheSwapper swapper) { swapper_ = std::move(swapper); }
  bool can_switch_codec() const { return static_cast<bool>(swapper_); }
  // Asks for the KV cache to be rebuilt with `codec_spec` (kv::MakeCodec syntax). Returns at once;
  // the scheduler thread stops admitting, waits up to `drain` for running sequences to finish,
  // then preempts the rest (they recompute their context in the new cache), swaps and resumes.
  // A later request replaces a pending one (the drain bound still runs from the first request);
  // asking for the current codec cancels a pending switch.
  // Unavailable without a CacheSwapper. A codec the swapper cannot build is logged and the
  // current one kept.
  Status RequestCodec(const std::string& codec_spec, std::chrono::milliseconds drain);
  // The codec the cache uses now (kv::Codec::spec(), e.g. "raw:f32").
  std::string codec_spec() const;
  // The codec a pending switch will install, else codec_spec().
  std::string target_codec_spec() const;

  // Validates and enqueues. With a kvstore link, first looks the prompt up in the store, which
  // blocks the caller up to the link's lookup deadline. InvalidArgument when the prompt is empty, a token id is out of
  // range, max_tokens < 1 (< 0 with prompt_logprobs), prompt + max_tokens exceeds the context, or
  // the request could never fit the KV budget; ResourceExhausted when the queue is full; Unavailable after Shutdown.
  Status Submit(std::shared_ptr<Request> request);

  // Lowers every unfinished request's max_tokens to at most `max_tokens` (>= 1): queued,
  // preempted and running ones, at the start of the next step. A running sequence that has
  // already generated that many ends there with kLength, its text so far delivered. Never raises
  // a limit; a later call with a larger value than a pending one does not undo it. HiLO's engine
  // level uses it so that a degrade reaches the work already admitted: without it a surge's
  // backlog is still served at the old level after the switch (docs/engine.md, "HiLO levels").
  // Thread-safe; a request submitted after the call is not affected (its limit is its own).
  void ClampMaxTokens(int max_tokens);

  // Runs one iteration. Returns false when there was nothing to do.
  bool Step();
  // Steps until `stop` is set; sleeps while idle. Used by servers on a dedicated thread.
  void Run(const std::atomic<bool>& stop);
  // Stops admitting; running and queued requests finish with kCancelled when `cancel` is true,
  // otherwise running ones are left to finish (queued ones are cancelled).
  void Shutdown(bool cancel);
  // Steps until every submitted request has finished (CLI use).
  void RunUntilIdle();

  int QueueDepth() const;
  SchedulerStats Stats() const;
  const Model& model() const { return model_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  const SchedulerOptions& options() const { return options_; }
  // The current cache: read it on the scheduler thread or while the scheduler is idle (a codec
  // switch replaces it).
  const KvCache& cache() const { return *cache_; }

 private:
  struct Active;
  void Admit();
  bool ReserveDecode(size_t index);
  void Preempt(size_t index);
  void ReleaseSequence(SeqId seq);  // the cache's blocks and the feed-forward's per-sequence state
  void Finish(Active& a, FinishReason reason, Status error = Status::Ok());
  void Emit(Active& a, int token, TokenLogprob* logprob);
  // params.prompt_logprobs: the log-probability of prompt token pos + 1 from `logits` (row pos).
  void ScorePrompt(Active& a, int pos, const float* logits);
  void Deliver(Active& a, bool finished);
  void PublishStats();  // KV figures for Stats(), read by other threads
  void ApplyTokenClamp();  // a pending ClampMaxTokens, on the scheduler thread
  // A pending codec switch: true while it waits for running sequences (admission is paused).
  bool AdvanceCodecSwitch();
  void SetCacheFigures();  // the cache's block figures that Submit reads from other threads

  const Model& model_;
  const Tokenizer& tokenizer_;
  KvCache* cache_;
  KvStoreLink* link_ = nullptr;
  CacheSwapper swapper_;
  // Guarded by mu_: the codec in use, and a requested switch (empty: none).
  std::string codec_spec_;
  std::string pending_codec_;
  std::chrono::milliseconds pending_drain_{0};
  std::chrono::steady_clock::time_point pending_since_;
  bool switch_draining_ = false;  // scheduler thread: admission paused for the pending switch
  std::atomic<int64_t> block_tokens_{16}, total_blocks_{0};
  std::atomic<int64_t> codec_switches_{0};
  SchedulerOptions options_;
  SchedulerObserver observer_;
  Transformer transformer_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Request>> queue_;
  bool shutdown_ = false;
  // Sequences evicted from the KV cache to make room; they re-enter before new requests and
  // recompute their context (usually from still-cached prefix blocks).
  std::deque<std::unique_ptr<Active>> preempted_;  // scheduler thread only
  std::atomic<int64_t> preempted_count_{0};
  std::atomic<bool> cancel_all_{false};
  std::atomic<int> token_clamp_{0};  // pending ClampMaxTokens value, 0 = none

  std::vector<std::unique_ptr<Active>> active_;
  SeqId next_seq_ = 1;
  std::vector<float> logits_;
  std::vector<float> logprob_row_;  // a row's logits before the sampler modifies them
  std::atomic<int64_t> steps_{0}, prompt_tokens_{0}, generated_tokens_{0}, finished_{0}, running_{0},
      preemptions_{0};
  mutable std::mutex stats_mu_;
  KvCacheStats kv_stats_;
  double last_switch_drain_s_ = 0, last_switch_build_s_ = 0;  // under stats_mu_
  int64_t last_switch_preempted_ = 0;
};

}  // namespace keel::engine
