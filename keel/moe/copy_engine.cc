#include "keel/moe/copy_engine.h"

#include <algorithm>
#include <vector>
#include <string>
#include <utility>

namespace keel::moe {

CopyEngine::CopyEngine(ExpertSource& src, size_t expert_bytes, CopyModel model)
    : src_(src),
      expert_bytes_(expert_bytes),
      model_(model),
      jitter_rng_(model.seed),
      order_rng_(model.seed ^ 0x9e3779b97f4a7c15ull),
      worker_([this] { Run(); }) {}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  worker_.join();  // copies still queued never started: their slots are untouched
}

CopyEngine::Ticket CopyEngine::Submit(int layer, int expert, uint8_t* dst, Priority priority) {
  Ticket t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t = next_++;
    queue_.push_back(Job{t, layer, expert, dst, Clock::now(), priority == Priority::kDemand});
    unfinished_.insert(t);
  }
  work_cv_.notify_one();
  return t;
}

Status CopyEngine::Wait(Ticket t) {
  if (t == 0) return Status::Ok();
  std::unique_lock<std::mutex> lock(mu_);
  if (t >= next_) {
    return Status::InvalidArgument("copy engine: ticket " + std::to_string(t) +
                                   " was never issued");
  }
  if (unfinished_.count(t) != 0) {
    const auto t0 = Clock::now();
    done_cv_.wait(lock, [&] { return unfinished_.count(t) == 0; });
    stats_.stall_s += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  // Acquiring mu_ after the worker released it (having written dst before) orders the bytes
  // before anything this thread does next.
  auto it = failures_.find(t);
  return it == failures_.end() ? Status::Ok() : it->second;
}

bool CopyEngine::Ready(Ticket t) const {
  if (t == 0) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return t < next_ && unfinished_.count(t) == 0;
}

CopyStats CopyEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

CopyEngine::Job CopyEngine::TakeNext() {
  // Demand copies go before queued prefetches (compute is waiting for them).
  std::vector<size_t> candidates;
  for (size_t k = 0; k < queue_.size(); ++k) {
    if (queue_[k].demand) candidates.push_back(k);
  }
  if (candidates.empty()) {
    for (size_t k = 0; k < queue_.size(); ++k) candidates.push_back(k);
  }
  size_t i = candidates[0];
  if (model_.reorder && candidates.size() > 1) {
    i = candidates[std::uniform_int_distribution<size_t>(0, candidates.size() - 1)(order_rng_)];
  }
  Job j = queue_[i];
  queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i));
  return j;
}

CopyEngine::Clock::duration CopyEngine::ModelledTime() {
  double s = model_.latency_s;
  if (model_.bandwidth_bytes_per_s > 0) s += double(expert_bytes_) / model_.bandwidth_bytes_per_s;
  if (model_.jitter_s > 0) s += std::uniform_real_distribution<double>(0, model_.jitter_s)(jitter_rng_);
  // An out-of-range double converts to an undefined count (it came out as no delay at all).
  constexpr double kMaxCopySeconds = 24 * 3600;
  if (!(s < kMaxCopySeconds)) s = kMaxCopySeconds;
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

void CopyEngine::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;  // what is queued is dropped
    const Job job = TakeNext();
    // The link serialises copies: this one starts when it was submitted or when the previous one
    // landed, whichever is later, however late the worker woke up.
    const Clock::time_point start = std::max(job.submitted, link_free_at_);
    lock.unlock();

    Status st = src_.Read(job.layer, job.expert, job.dst);
    const Clock::time_point deadline = start + ModelledTime();  // the read counts inside it

    lock.lock();
    // A sleep on the condition variable rather than sleep_until, so the destructor cuts it short.
    work_cv_.wait_until(lock, deadline, [&] { return stop_; });
    const Clock::time_point landed = Clock::now();
    link_free_at_ = landed;
    stats_.busy_s += std::chrono::duration<double>(landed - start).count();
    if (st.ok()) {
      ++stats_.copies;
      stats_.bytes += static_cast<int64_t>(expert_bytes_);
    } else {
      ++stats_.failed;
      failures_.emplace(job.ticket, std::move(st));
    }
    unfinished_.erase(job.ticket);
    done_cv_.notify_all();
  }
}

}  // namespace keel::moe
