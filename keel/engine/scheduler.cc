#include "keel/engine/scheduler.h"

#include <algorithm>

#include "keel/core/log.h"

namespace keel::engine {

using Clock = std::chrono::steady_clock;

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "none";
}

struct Scheduler::Active {
  std::shared_ptr<Request> req;
  SeqId seq = 0;
  Sampler sampler;
  std::vector<int> context;    // tokens whose K/V must be in the cache before decoding
  int computed = 0;            // leading context tokens already in the cache
  int cached_prompt = 0;       // prompt tokens served from shared blocks (first admission)
  int store_prompt = 0;        // of those, adopted from the kvstore
  bool published = false;      // prompt chunks handed to the kvstore link
  std::vector<int> generated;
  int prev_token = Tokenizer::kBos;
  std::string pending;         // decoded text not yet delivered
  std::string out_text;        // text ready for the next event
  std::vector<int> out_tokens;
  std::vector<TokenLogprob> out_logprobs;
  // params.prompt_logprobs: the next prompt position to score (its row is the one before), and
  // the scores not yet delivered. Kept across preemption, so nothing is scored twice.
  int prompt_scored = 1;
  std::vector<TokenLogprob> out_prompt_logprobs;
  Clock::time_point last_token_time;
  bool first_token_seen = false;
  bool done = false;
  FinishReason reason = FinishReason::kNone;
  Status error;

  explicit Active(std::shared_ptr<Request> r) : req(std::move(r)), sampler(req->params.sampling) {}
  bool prefilling() const { return computed < static_cast<int>(context.size()); }
  // Whether the row at context position `pos` scores a prompt token (the one at pos + 1).
  bool scores(int pos) const {
    return req->params.prompt_logprobs && pos + 1 >= prompt_scored && pos + 1 < static_cast<int>(req->prompt.size());
  }
  // Leading context tokens that may come from shared blocks: none that a pending score needs.
  int max_reuse() const {
    if (!req->params.prompt_logprobs) return static_cast<int>(context.size());
    return std::max(0, prompt_scored - 1);
  }
  int length() const { return static_cast<int>(req->prompt.size() + generated.size()); }
};

Scheduler::Scheduler(const Model& model, const Tokenizer& tokenizer, KvCache& cache,
                     const SchedulerOptions& options, SchedulerObserver observer)
    : model_(model), tokenizer_(tokenizer), cache_(&cache), options_(options),
      observer_(std::move(observer)), transformer_(model) {
  options_.max_running = std::max(1, options_.max_running);
  options_.max_batch_tokens = std::max(1, options_.max_batch_tokens);
  codec_spec_ = cache_->codec().spec();
  SetCacheFigures();
}

void Scheduler::SetCacheFigures() {
  block_tokens_ = cache_->block_tokens();
  total_blocks_ = cache_->TotalBlocks();
}

Scheduler::~Scheduler() = default;

Status Scheduler::Submit(std::shared_ptr<Request> request) {
  const ModelConfig& c = model_.config;
  const auto& p = request->params;
  const int n = static_cast<int>(request->prompt.size());
  if (n == 0) return Status::InvalidArgument("prompt is empty");
  for (int t : request->prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return Status::InvalidArgument("prompt token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                                     std::to_string(c.vocab_size - 1) + ")");
    }
  }
  if (p.max_tokens < (p.prompt_logprobs ? 0 : 1)) {
    return Status::InvalidArgument(p.prompt_logprobs ? "max_tokens must be at least 0" : "max_tokens must be at least 1");
  }
  if (n >= c.max_seq_len) {
    return Status::InvalidArgument("prompt has " + std::to_string(n) + " tokens but the model's context is " +
                                   std::to_string(c.max_seq_len) + " tokens");
  }
  if (static_cast<int64_t>(n) + p.max_tokens > c.max_seq_len) {
    return Status::InvalidArgument("this model's maximum context length is " + std::to_string(c.max_seq_len) +
                                   " tokens; the request asks for " + std::to_string(n) + " prompt + " +
                                   std::to_string(p.max_tokens) + " completion tokens");
  }
  if (!(p.sampling.temperature >= 0.0f) || p.sampling.temperature > 100.0f) {
    return Status::InvalidArgument("temperature must be between 0 and 100");
  }
  if (!(p.sampling.top_p >= 0.0f && p.sampling.top_p <= 1.0f)) return Status::InvalidArgument("top_p must be in [0, 1]");
  if (p.sampling.top_k < 0) return Status::InvalidArgument("top_k must be >= 0");
  if (p.logprobs < -1 || p.logprobs > kMaxTopLogprobs) {
    return Status::InvalidArgument("logprobs must be -1 (off) or 0.." + std::to_string(kMaxTopLogprobs));
  }
  // From the cache's figures as published, not the cache: a codec switch may replace it meanwhile.
  const int64_t bt = block_tokens_.load();
  const int64_t need = (static_cast<int64_t>(n) + p.max_tokens + bt - 1) / bt;
  if (need > total_blocks_.load()) {
    // Can never succeed with this server's budget, whatever the load: the request is at fault.
    return Status::InvalidArgument("request needs " + std::to_string(need) + " KV blocks but the whole cache holds " +
                                   std::to_string(total_blocks_.load()) + "; raise the KV budget");
  }
  request->submitted = Clock::now();
  // A prompt to be scored is computed in full, so its stored chunks would not be used.
  if (link_ != nullptr && !p.prompt_logprobs && QueueDepth() < options_.max_queue) {
    request->fetched = link_->Fetch(request->prompt);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return Status::Unavailable("server is shutting down");
    if (static_cast<int>(queue_.size()) >= options_.max_queue) {
      return Status::ResourceExhausted("request queue is full (" + std::to_string(options_.max_queue) +
                                       " waiting); retry later");
    }
    queue_.push_back(std::move(request));
  }
  cv_.notify_one();
  return Status::Ok();
}

int Scheduler::QueueDepth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(queue_.size()) + static_cast<int>(preempted_count_.load());
}

SchedulerStats Scheduler::Stats() const {
  SchedulerStats s;
  s.queue_depth = QueueDepth();
  s.running = running_.load();
  s.steps = steps_.load();
  s.prompt_tokens = prompt_tokens_.load();
  s.generated_tokens = generated_tokens_.load();
  s.requests_finished = finished_.load();
  s.preemptions = preemptions_.load();
  s.codec_switches = codec_switches_.load();
  std::lock_guard<std::mutex> lock(stats_mu_);
  s.kv = kv_stats_;
  s.last_switch_drain_s = last_switch_drain_s_;
  s.last_switch_build_s = last_switch_build_s_;
  s.last_switch_preempted = last_switch_preempted_;
  return s;
}

void Scheduler::Admit() {
  while (static_cast<int>(active_.size()) < options_.max_running) {
    std::unique_ptr<Active> a;
    bool resumed = false;
    if (!preempted_.empty()) {
      a = std::move(preempted_.front());
      preempted_.pop_front();
      --preempted_count_;
      resumed = true;
    } else {
      std::shared_ptr<Request> req;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (queue_.empty()) return;
        req = queue_.front();
        queue_.pop_front();
      }
      a = std::make_unique<Active>(std::move(req));
      a->context = a->req->prompt;
      // The first generated piece is decoded after the last prompt token (a leading space is
      // dropped only right after BOS).
      a->prev_token = a->req->prompt.back();
    }
    if (a->req->cancelled.load()) {
      Finish(*a, FinishReason::kCancelled);
      continue;
    }
    a->seq = next_seq_++;
    Result<int> reused = cache_->BeginSequence(a->seq, a->context, a->max_reuse());
    int adopted = 0;
    if (reused.ok() && !resumed && a->req->fetched && !a->req->fetched->values.empty()) {
      const FetchedPrefix& f = *a->req->fetched;
      const std::vector<std::string_view>& views = f.chunks;
      Result<int> got = cache_->AdoptChunks(a->seq, a->context, f.first_chunk, views);
      if (got.ok()) {
        adopted = *got;
      } else {
        Log().warn("kvstore chunks not adopted: {}", got.status().ToString());
        if (link_ != nullptr) link_->CountRejected(static_cast<int>(views.size()));
      }
      reused = *reused + adopted;
    }
    Status st = reused.ok() ? cache_->Reserve(a->seq, static_cast<int>(a->context.size())) : reused.status();
    if (!st.ok()) {
      ReleaseSequence(a->seq);
      if (st.code() == StatusCode::kResourceExhausted && !active_.empty()) {
        // Not enough room yet: wait at the head of the line for running sequences to finish.
        if (resumed) {
          preempted_.push_front(std::move(a));
          ++preempted_count_;
        } else {
          std::lock_guard<std::mutex> lock(mu_);
          queue_.push_front(a->req);
        }
        return;
      }
      Finish(*a, FinishReason::kError, st);
      continue;
    }
    a->computed = *reused;
    if (!resumed && a->req->on_admitted) a->req->on_admitted();
    if (!resumed) {
      a->cached_prompt = *reused;
      a->store_prompt = adopted;
      a->req->fetched.reset();  // the blocks are in the cache now; free the fetched copies
      if (link_ != nullptr && adopted > 0) link_->CountAdopted(adopted);
    }
    ++running_;
    active_.push_back(std::move(a));
  }
}

void Scheduler::ReleaseSequence(SeqId seq) {
  cache_->Release(seq);
  transformer_.feed_forward().EndSequence(seq);
}

void Scheduler::Preempt(size_t index) {
  std::unique_ptr<Active> a = std::move(active_[index]);
  active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(index));
  ReleaseSequence(a->seq);
  // On re-admission the whole context (prompt + generated) is prefilled and the next token is
  // sampled from its last row, exactly where decoding stopped.
  a->context = a->req->prompt;
  a->context.insert(a->context.end(), a->generated.begin(), a->generated.end());
  a->computed = 0;
  --running_;
  ++preemptions_;
  preempted_.push_front(std::move(a));
  ++preempted_count_;
}

bool Scheduler::ReserveDecode(size_t index) {
  Active& a = *active_[index];
  while (true) {
    Status st = cache_->Reserve(a.seq, a.length());
    if (st.ok()) return true;
    if (index + 1 < active_.size()) {
      Preempt(active_.size() - 1);  // the youngest yields
      continue;
    }
    // `a` is the youngest itself: it waits for older sequences to finish. Alone, it can never
    // fit (Submit rules that out unless the budget is fragmented by other state): an error.
    if (index > 0) {
      Preempt(index);
    } else {
      Finish(a, FinishReason::kError, st);
    }
    return false;
  }
}

void Scheduler::Deliver(Active& a, bool finished) {
  if (!finished && a.out_text.empty() && a.out_prompt_logprobs.empty()) return;
  GenerationEvent ev;
  ev.text = std::move(a.out_text);
  ev.tokens = std::move(a.out_tokens);
  ev.logprobs = std::move(a.out_logprobs);
  ev.prompt_logprobs = std::move(a.out_prompt_logprobs);
  a.out_text.clear();
  a.out_tokens.clear();
  a.out_logprobs.clear();
  a.out_prompt_logprobs.clear();
  ev.finished = finished;
  ev.finish_reason = a.reason;
  ev.error = a.error;
  ev.prompt_tokens = static_cast<int>(a.req->prompt.size());
  ev.completion_tokens = static_cast<int>(a.generated.size());
  ev.cached_prompt_tokens = a.cached_prompt;
  ev.kvstore_prompt_tokens = a.store_prompt;
  if (a.req->on_event) a.req->on_event(ev);
}

void Scheduler::Finish(Active& a, FinishReason reason, Status error) {
  if (a.done) return;
  a.done = true;
  a.reason = reason;
  a.error = std::move(error);
  if (reason != FinishReason::kCancelled && reason != FinishReason::kError) a.out_text += a.pending;
  a.pending.clear();
  // Counted before the last event goes out: a client that has its answer (and reads the stats or
  // /metrics next) must find it counted.
  ++finished_;
  Deliver(a, true);
}

namespace {

// Bytes at the end of `s` that may start a stop sequence, or an incomplete UTF-8 character:
// they are held back until the next token decides.
size_t HoldBack(const std::string& s, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& stop : stops) {
    for (size_t k = std::min(stop.size() - 1, s.size()); k > hold; --k) {
      if (s.compare(s.size() - k, k, stop, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  // Incomplete UTF-8 sequence at the end.
  for (size_t back = 1; back <= 4 && back <= s.size(); ++back) {
    unsigned char c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = (c & 0x80) == 0 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    if (need > back) hold = std::max(hold, back);
    break;
  }
  return hold;
}

}  // namespace

void Scheduler::Emit(Active& a, int token, TokenLogprob* logprob) {
  const GenerationParams& p = a.req->params;
  auto now = Clock::now();
  if (!a.first_token_seen) {
    a.first_token_seen = true;
    if (observer_.time_to_first_token) {
      observer_.time_to_first_token(std::chrono::duration<double>(now - a.req->submitted).count());
    }
  } else if (observer_.inter_token_latency) {
    observer_.inter_token_latency(std::chrono::duration<double>(now - a.last_token_time).count());
  }
  a.last_token_time = now;
  ++generated_tokens_;
  if (p.stop_at_eos && (token == Tokenizer::kBos || token == Tokenizer::kEos)) {
    a.generated.push_back(token);
    Finish(a, FinishReason::kStop);
    return;
  }
  a.generated.push_back(token);
  a.out_tokens.push_back(token);
  if (logprob != nullptr) {
    logprob->prev = a.prev_token;
    a.out_logprobs.push_back(std::move(*logprob));
  }
  a.pending += tokenizer_.Decode(a.prev_token, token);
  a.prev_token = token;
  for (const std::string& stop : p.stop) {
    size_t at = stop.empty() ? std::string::npos : a.pending.find(stop);
    if (at != std::string::npos) {
      a.out_text += a.pending.substr(0, at);
      a.pending.clear();
      Finish(a, FinishReason::kStop);
      return;
    }
  }
  size_t hold = HoldBack(a.pending, p.stop);
  a.out_text += a.pending.substr(0, a.pending.size() - hold);
  a.pending.erase(0, a.pending.size() - hold);
  if (static_cast<int>(a.generated.size()) >= p.max_tokens || a.length() >= model_.config.max_seq_len) {
    Finish(a, FinishReason::kLength);
    return;
  }
  Deliver(a, false);
}

void Scheduler::ClampMaxTokens(int max_tokens) {
  max_tokens = std::max(max_tokens, 1);
  int pending = token_clamp_.load();
  while ((pending == 0 || max_tokens < pending) && !token_clamp_.compare_exchange_weak(pending, max_tokens)) {
  }
}

void Scheduler::ApplyTokenClamp() {
  const int limit = token_clamp_.exchange(0);
  if (limit <= 0) return;
  {
    // Queued requests are only read by this thread once popped, under mu_.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& req : queue_) req->params.max_tokens = std::min(req->params.max_tokens, limit);
  }
  auto clamp = [&](Active& a) {
    int& max_tokens = a.req->params.max_tokens;
    if (max_tokens <= limit) return;
    max_tokens = limit;
    if (!a.done && static_cast<int>(a.generated.size()) >= limit) Finish(a, FinishReason::kLength);
  };
  for (auto& a : active_) clamp(*a);  // done ones leave in Step's drop_done
  for (auto it = preempted_.begin(); it != preempted_.end();) {
    clamp(**it);
    if ((*it)->done) {  // a preempted sequence holds no cache blocks
      it = preempted_.erase(it);
      --preempted_count_;
    } else {
      ++it;
    }
  }
}

void Scheduler::ScorePrompt(Active& a, int pos, const float* logits) {
  const int vocab = model_.config.vocab_size;
  TokenLogprob lp;
  lp.token = a.req->prompt[static_cast<size_t>(pos + 1)];
  lp.prev = a.req->prompt[static_cast<size_t>(pos)];
  const double log_norm = LogNormalizer(logits, vocab);
  TopLogprobs(logits, vocab, std::max(a.req->params.logprobs, 0), log_norm, &lp.top);
  lp.logprob = static_cast<float>(logits[lp.token] - log_norm);
  a.out_prompt_logprobs.push_back(std::move(lp));
  a.prompt_scored = pos + 2;
}

bool Scheduler::Step() {
  if (cancel_all_.load()) {
    for (auto& a : active_) a->req->cancelled = true;
    for (auto& a : preempted_) a->req->cancelled = true;
  }
  if (link_ != nullptr) link_->ReleaseFinished(*cache_);
  ApplyTokenClamp();
  if (!AdvanceCodecSwitch()) Admit();
  // Drop cancelled sequences before spending compute on them.
  for (auto& a : active_) {
    if (a->req->cancelled.load()) Finish(*a, FinishReason::kCancelled);
  }
  auto drop_done = [&] {
    for (size_t i = 0; i < active_.size();) {
      if (active_[i]->done) {
        ReleaseSequence(active_[i]->seq);
        active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
        --running_;
      } else {
        ++i;
      }
    }
  };
  drop_done();
  if (active_.empty()) {
    PublishStats();
    return false;
  }

  // Decoders first (one token each, cheap and latency-bound), then prompt chunks.
  std::vector<BatchToken> batch;
  std::vector<Active*> owners;  // per batch row
  int budget = options_.max_batch_tokens;
  for (size_t i = 0; i < active_.size(); ++i) {
    Active& a = *active_[i];
    if (a.prefilling() || a.done) continue;
    if (!ReserveDecode(i)) continue;
    batch.push_back({a.seq, a.generated.back(), a.length() - 1, true});
    owners.push_back(&a);
    --budget;
  }
  for (auto& ap : active_) {
    Active& a = *ap;
    if (!a.prefilling() || a.done || budget <= 0) continue;
    const int remaining = static_cast<int>(a.context.size()) - a.computed;
    const int chunk = std::min(remaining, budget);
    for (int j = 0; j < chunk; ++j) {
      const int pos = a.computed + j;
      batch.push_back({a.seq, a.context[pos], pos, j == remaining - 1 || a.scores(pos)});
      owners.push_back(&a);
    }
    budget -= chunk;
  }
  if (batch.empty()) {
    drop_done();
    return !active_.empty();
  }

  Status st = transformer_.Forward(batch, *cache_, logits_);
  ++steps_;
  if (!st.ok()) {
    Log().error("forward pass failed: {}", st.ToString());
    for (Active* a : owners) Finish(*a, FinishReason::kError, st);
    drop_done();
    return true;
  }
  // Commit stored tokens per sequence (rows of one sequence are contiguous), then sample.
  for (size_t r = 0; r < batch.size();) {
    size_t e = r;
    while (e < batch.size() && owners[e] == owners[r]) ++e;
    Active& a = *owners[r];
    std::vector<int> toks;
    for (size_t j = r; j < e; ++j) toks.push_back(batch[j].token);
    cache_->Commit(a.seq, toks.data(), static_cast<int>(toks.size()));
    if (a.prefilling()) {
      a.computed += static_cast<int>(e - r);
      prompt_tokens_ += static_cast<int64_t>(e - r);
    }
    r = e;
  }
  int row = 0;
  const int vocab = model_.config.vocab_size;
  bool scored = false;
  for (size_t r = 0; r < batch.size(); ++r) {
    if (!batch[r].want_logits) continue;
    Active& a = *owners[r];
    float* logits = &logits_[static_cast<size_t>(row) * vocab];
    ++row;
    if (a.done) continue;
    if (a.scores(batch[r].pos)) {
      ScorePrompt(a, batch[r].pos, logits);
      scored = true;
      continue;
    }
    if (a.req->params.max_tokens == 0) {  // scoring only: the prompt is done
      Finish(a, FinishReason::kLength);
      continue;
    }
    const int want_logprobs = a.req->params.logprobs;
    if (want_logprobs < 0) {
      Emit(a, a.sampler.Sample(logits, vocab), nullptr);
      continue;
    }
    // Log-probabilities come from the raw logits; the sampler overwrites them in place.
    TokenLogprob lp;
    const double log_norm = LogNormalizer(logits, vocab);
    TopLogprobs(logits, vocab, want_logprobs, log_norm, &lp.top);
    logprob_row_.assign(logits, logits + vocab);
    lp.token = a.sampler.Sample(logits, vocab);
    lp.logprob = static_cast<float>(logprob_row_[static_cast<size_t>(lp.token)] - log_norm);
    Emit(a, lp.token, &lp);
  }
  if (scored) {
    // Scores of prompt chunks that did not end the prefill go out now.
    for (Active* a : owners) {
      if (!a->done && !a->out_prompt_logprobs.empty()) Deliver(*a, false);
    }
  }
  if (link_ != nullptr) {
    // Prompts that finished prefilling this step: their full chunks go to the shared store.
    // After the tokens above were emitted, so publishing never delays one.
    const int bt = cache_->block_tokens();
    for (Active* a : owners) {
      if (a->published || a->prefilling() || a->req->prompt.size() != a->context.size()) continue;
      a->published = true;
      link_->Publish(*cache_, a->seq, 0, static_cast<int>(a->req->prompt.size()) / bt);
    }
  }
  drop_done();
  PublishStats();
  return true;
}

Status Scheduler::RequestCodec(const std::string& codec_spec, std::chrono::milliseconds drain) {
  if (!swapper_) {
    return Status::Unavailable("this engine cannot switch its KV codec at run time (a kvstore link ties the cache "
                               "to one codec)");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (codec_spec == codec_spec_) {
      pending_codec_.clear();  // back to the codec in use: nothing to do
    } else if (codec_spec != pending_codec_) {
      // A switch already pending keeps its start: the drain bound runs from the first pause, so
      // a controller flipping states cannot hold admission off for ever.
      if (pending_codec_.empty()) pending_since_ = Clock::now();
      pending_codec_ = codec_spec;
      pending_drain_ = std::max(drain, std::chrono::milliseconds(0));
    }
  }
  cv_.notify_all();
  return Status::Ok();
}

std::string Scheduler::codec_spec() const {
  std::lock_guard<std::mutex> lock(mu_);
  return codec_spec_;
}

std::string Scheduler::target_codec_spec() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_codec_.empty() ? codec_spec_ : pending_codec_;
}

bool Scheduler::AdvanceCodecSwitch() {
  std::string target, from;
  std::chrono::milliseconds drain{0};
  Clock::time_point since;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_codec_.empty()) {
      if (switch_draining_) Log().info("kv codec switch cancelled; keeping {}", codec_spec_);
      switch_draining_ = false;
      return false;
    }
    target = pending_codec_;
    from = codec_spec_;
    drain = pending_drain_;
    since = pending_since_;
  }
  if (!switch_draining_) {
    switch_draining_ = true;
    Log().info("kv codec switch {} -> {}: admission paused, {} running, draining up to {} ms", from, target,
               active_.size(), drain.count());
  }
  int64_t preempted = 0;
  if (!active_.empty()) {
    if (Clock::now() - since < drain) return true;  // running sequences keep going; nobody new joins
    // Past the bound: the youngest first, so the oldest end up at the head of the resume line;
    // each recomputes its context (prompt + what it generated) in the new cache.
    while (!active_.empty()) {
      if (active_.back()->done) {
        ReleaseSequence(active_.back()->seq);
        active_.pop_back();
        --running_;
        continue;
      }
      Preempt(active_.size() - 1);
      ++preempted;
    }
  }
  const Clock::time_point drained = Clock::now();
  Status error;
  cache_ = swapper_(target, &error);
  SetCacheFigures();
  const Clock::time_point built = Clock::now();
  const std::string now_spec = cache_->codec().spec();
  {
    std::lock_guard<std::mutex> lock(mu_);
    codec_spec_ = now_spec;
    if (pending_codec_ == target || pending_codec_ == now_spec) pending_codec_.clear();
  }
  switch_draining_ = false;
  const double drain_s = std::chrono::duration<double>(drained - since).count();
  const double build_s = std::chrono::duration<double>(built - drained).count();
  if (!error.ok()) {
    Log().error("kv codec switch {} -> {} failed after {:.1f} ms: {}; the cache uses {}", from, target,
                (drain_s + build_s) * 1e3, error.ToString(), now_spec);
  } else {
    ++codec_switches_;
    Log().info("kv codec switch {} -> {}: drained in {:.1f} ms ({} preempted), new cache in {:.1f} ms", from,
               now_spec, drain_s * 1e3, preempted, build_s * 1e3);
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    last_switch_drain_s_ = drain_s;
    last_switch_build_s_ = build_s;
    last_switch_preempted_ = preempted;
  }
  PublishStats();
  return false;
}

void Scheduler::PublishStats() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  kv_stats_ = cache_->Stats();
}

void Scheduler::Run(const std::atomic<bool>& stop) {
  while (!stop.load()) {
    if (Step()) continue;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(20),
                 [&] { return !queue_.empty() || !pending_codec_.empty() || stop.load(); });
  }
}

void Scheduler::RunUntilIdle() {
  while (true) {
    if (Step()) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty() && preempted_.empty() && active_.empty()) return;
  }
}

void Scheduler::Shutdown(bool cancel) {
  std::deque<std::shared_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
    queued.swap(queue_);
  }
  for (auto& r : queued) {
    r->cancelled = true;
    GenerationEvent ev;
    ev.finished = true;
    ev.finish_reason = FinishReason::kCancelled;
    ev.prompt_tokens = static_cast<int>(r->prompt.size());
    if (r->on_event) r->on_event(ev);
  }
  // The scheduler thread notices at its next step and finishes running sequences as cancelled.
  if (cancel) cancel_all_ = true;
  cv_.notify_all();
}

}  // namespace keel::engine
