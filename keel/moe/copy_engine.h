// CopyEngine: asynchronous copies of experts from an ExpertSource into fast-memory slots, standing
// in for PCIe DMA (on a GPU system: cudaMemcpyAsync from pinned host memory on one copy stream).
// One worker thread is one serial link. Each copy does the real source read, then is paced to a
// modelled completion time: a copy that starts when the link is free (at its submit time, or when
// the previous copy landed) lands at start + latency + bytes/bandwidth (+ jitter), or when its
// read finishes if the read is slower. Safe to call from any threads, except that no call may
// overlap the destructor.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "keel/core/status.h"
#include "keel/moe/expert_source.h"

namespace keel::moe {

struct CopyModel {
  double bandwidth_bytes_per_s = 0;  // 0: unpaced (copies take what the source read takes)
  double latency_s = 0;              // fixed cost per copy
  // Fault injection: extra uniform random delay in [0, jitter_s] per copy, and (reorder) queued
  // copies started in random order rather than FIFO. Seeded: the k-th copy to start gets the
  // same delay for the same seed (reorder draws come from a separate generator).
  double jitter_s = 0;
  bool reorder = false;
  uint64_t seed = 0;
};

struct CopyStats {
  int64_t copies = 0;   // copies that landed (source read succeeded)
  int64_t bytes = 0;    // expert_bytes per landed copy
  int64_t failed = 0;   // copies whose source read failed
  double busy_s = 0;    // link time: sum over copies of landing - start
  double stall_s = 0;   // time callers spent blocked in Wait
};

class CopyEngine {
 public:
  // Starts the worker (one link). `src` must outlive the engine; `expert_bytes` is what each copy
  // moves (LayoutOf(...).bytes), used for pacing and stats.
  CopyEngine(ExpertSource& src, size_t expert_bytes, CopyModel model);
  // Drops copies not yet started (their slots are never written), cuts short the pacing wait of
  // the one in flight (its read still completes), and joins: once it returns, no slot is written
  // any more. Nobody may be blocked in Wait (or call anything else) while it runs.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  using Ticket = uint64_t;  // 0 = none; tickets increase from 1 in submit order

  // Queues a copy of (layer, expert) into dst (LayoutOf(...).bytes long, owned by the caller and
  // not touched by anyone else until the copy lands). Never blocks on the link.
  // kDemand copies (compute waits for them) start before every queued kPrefetch copy; within a
  // priority, FIFO (or random with CopyModel::reorder).
  enum class Priority { kPrefetch, kDemand };
  Ticket Submit(int layer, int expert, uint8_t* dst, Priority priority = Priority::kPrefetch);
  // Blocks until copy `t` has finished, adding the blocked time to stall_s. OK when its bytes are
  // in dst (and visible to this thread); the source's error if the read failed. Returns at once
  // for ticket 0 and for finished tickets; InvalidArgument for a ticket never issued.
  Status Wait(Ticket t);
  // Whether copy `t` has finished (landed or failed) without waiting; true for ticket 0, false for
  // a ticket never issued.
  bool Ready(Ticket t) const;
  CopyStats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Job {
    Ticket ticket;
    int layer, expert;
    uint8_t* dst;
    Clock::time_point submitted;
    bool demand;
  };

  void Run();
  Job TakeNext();  // mu_ held, queue_ not empty
  Clock::duration ModelledTime();

  ExpertSource& src_;
  const size_t expert_bytes_;
  const CopyModel model_;
  std::mt19937_64 jitter_rng_, order_rng_;  // worker only

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // worker: a job arrived, or stop
  std::condition_variable done_cv_;  // waiters: a copy finished
  bool stop_ = false;
  std::deque<Job> queue_;
  std::unordered_set<Ticket> unfinished_;           // queued or in flight
  std::unordered_map<Ticket, Status> failures_;     // finished with an error
  Ticket next_ = 1;
  Clock::time_point link_free_at_{};                // when the last copy landed
  CopyStats stats_;
  std::thread worker_;  // last: starts after everything above exists
};

}  // namespace keel::moe
