#include "keel/kvstore/uring_batch.h"

#include <liburing.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "keel/core/log.h"

namespace keel::kvstore {
namespace {

std::string Errno(int err) { return std::strerror(err); }

// One io_uring per thread. A read is synchronous for its caller (submit, wait for the
// completions), so a ring owned by the calling thread needs no lock and a reader never waits
// behind another's completion; a shared pool would add a mutex hand-off per read and cap
// parallelism at the pool size. A ring is small (kUringEntries entries, a few pages) and goes
// away with its thread. Not tied to any file, so every tier in the process shares the thread's
// ring.
class ThreadRing {
 public:
  ~ThreadRing() {
    if (state_ == State::kReady) io_uring_queue_exit(&ring_);
  }
  io_uring* Get() {
    if (state_ == State::kUntried) {
      const int rc = io_uring_queue_init(kUringEntries, &ring_, 0);
      state_ = rc == 0 ? State::kReady : State::kFailed;
      if (rc != 0 && !warned_.exchange(true)) {
        Log().warn("io_uring unavailable ({}); reads fall back to pread", Errno(-rc));
      }
    }
    return state_ == State::kReady ? &ring_ : nullptr;
  }
  // After a failure that may leave reads in flight we cannot account for: stop using the ring
  // on this thread (it is never torn down, so late completions land in memory it still owns).
  void Abandon() { state_ = State::kFailed; }

 private:
  enum class State { kUntried, kReady, kFailed };
  State state_ = State::kUntried;
  io_uring ring_{};
  static inline std::atomic<bool> warned_{false};
};

thread_local ThreadRing t_ring;

// user_data of a submission entry whose read was taken back (turned into a no-op): its
// completion arrives in some later reap and is skipped there.
constexpr uint64_t kAbandoned = ~uint64_t{0};

// Marks `n` more bytes of `r` as read: advances offset and iovecs, keeping r.iov compact.
void Consume(BatchRead& r, size_t n) {
  iovec* iov = r.iov;
  int cnt = r.iovcnt;
  AdvanceIov(iov, cnt, n);
  std::memmove(r.iov, iov, static_cast<size_t>(cnt) * sizeof(iovec));
  r.iovcnt = cnt;
  r.offset += n;
}

Status PastEnd(const BatchRead& r) {
  return Status::Corruption(*r.path + ": record at offset " + std::to_string(r.offset) +
                            " runs past the end of the file");
}

// preadv until the read is complete.
Status PreadAll(BatchRead& r) {
  while (r.iovcnt > 0) {
    ssize_t n = 0;
    do {
      n = ::preadv(r.fd, r.iov, r.iovcnt, static_cast<off_t>(r.offset));
    } while (n < 0 && errno == EINTR);
    if (n < 0) return Status::IOError(*r.path + ": read at offset " + std::to_string(r.offset) + ": " + Errno(errno));
    if (n == 0) return PastEnd(r);
    Consume(r, static_cast<size_t>(n));
  }
  return Status::Ok();
}

}  // namespace

void AdvanceIov(iovec*& iov, int& iovcnt, size_t n) {
  while (iovcnt > 0 && n >= iov->iov_len) {
    n -= iov->iov_len;
    ++iov;
    --iovcnt;
  }
  if (iovcnt > 0 && n > 0) {
    iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + n;
    iov->iov_len -= n;
  }
}

bool ThreadHasIoUring() { return t_ring.Get() != nullptr; }

void ReadBatch(std::span<BatchRead> reads, std::span<Status> out, bool use_io_uring) {
  std::vector<size_t> pending;  // reads with bytes still to come, in submission order
  pending.reserve(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    Consume(reads[i], 0);  // drops empty iovecs: a zero-length read is complete already
    out[i] = Status::Ok();
    if (reads[i].iovcnt > 0) pending.push_back(i);
  }
  std::vector<size_t> fallback;  // the ring refused these: preadv answers with the real error if any
  io_uring* ring = use_io_uring ? t_ring.Get() : nullptr;
  std::vector<size_t> next;
  io_uring_sqe* sqes[kUringEntries];
  size_t ids[kUringEntries];
  while (ring != nullptr && !pending.empty()) {
    next.clear();
    // Entries left in the queue by an earlier failed submit go to the kernel ahead of ours.
    const unsigned stale = io_uring_sq_ready(ring);
    unsigned queued = 0;
    for (size_t i : pending) {
      io_uring_sqe* sqe = queued < kUringEntries ? io_uring_get_sqe(ring) : nullptr;
      if (sqe == nullptr) {  // the ring is full: next round
        next.push_back(i);
        continue;
      }
      BatchRead& r = reads[i];
      io_uring_prep_readv(sqe, r.fd, r.iov, static_cast<unsigned>(r.iovcnt), r.offset);
      sqe->user_data = i;
      sqes[queued] = sqe;
      ids[queued++] = i;
    }
    if (queued == 0) {  // no room at all (stale entries fill the queue): give up on the ring
      fallback.insert(fallback.end(), pending.begin(), pending.end());
      break;
    }
    // One system call submits the whole chunk and waits for it.
    int rc = 0;
    do {
      rc = io_uring_submit_and_wait(ring, queued);
    } while (rc == -EINTR);
    unsigned inflight = queued;
    const unsigned taken = rc < 0 ? 0 : static_cast<unsigned>(rc) > stale ? static_cast<unsigned>(rc) - stale : 0;
    if (taken < queued) {
      // The kernel took only the first `taken` of ours; the rest still sit in the submission
      // queue pointing at the caller's buffers, and would be submitted by the next call. Make
      // them no-ops whose completions are skipped, and read those records with preadv.
      for (unsigned k = taken; k < queued; ++k) {
        io_uring_prep_nop(sqes[k]);
        sqes[k]->user_data = kAbandoned;
        fallback.push_back(ids[k]);
      }
      inflight = taken;
    }
    while (inflight > 0) {
      io_uring_cqe* cqe = nullptr;
      int wrc = 0;
      do {
        wrc = io_uring_wait_cqe(ring, &cqe);
      } while (wrc == -EINTR || wrc == -EAGAIN);
      if (wrc < 0) {
        // Cannot happen with a completion queue we always drain; if it does, reads may still be
        // in flight into the caller's buffers, so the ring must never be used again.
        Log().error("io_uring: wait for completions failed ({}); reads fall back to pread", Errno(-wrc));
        t_ring.Abandon();
        for (size_t i = 0; i < reads.size(); ++i) {
          if (out[i].ok() && reads[i].iovcnt > 0) {
            out[i] = Status::IOError(*reads[i].path + ": io_uring: wait for completions: " + Errno(-wrc));
          }
        }
        return;
      }
      const uint64_t id = cqe->user_data;
      const int res = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      if (id == kAbandoned) continue;
      --inflight;
      BatchRead& r = reads[id];
      if (res < 0) {
        fallback.push_back(id);
      } else if (res == 0) {
        out[id] = PastEnd(r);
      } else {
        Consume(r, static_cast<size_t>(res));
        if (r.iovcnt > 0) next.push_back(id);  // a short read: the rest goes in the next round
      }
    }
    pending.swap(next);
  }
  if (ring == nullptr) fallback.insert(fallback.end(), pending.begin(), pending.end());
  for (size_t i : fallback) out[i] = PreadAll(reads[i]);
}

}  // namespace keel::kvstore
