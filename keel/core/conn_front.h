// ConnectionFront: the event-driven front shared by Keel's request/response servers (HttpServer,
// kvstore::Server). One epoll thread owns the listening socket and every connection that is not
// being served: it accepts without ever sleeping, reads partial requests without blocking, and
// enforces TOTAL deadlines per phase (a request's head from its first byte — or from accept — and
// its body from the head's end; an idle keep-alive limit), so a client trickling one byte at a
// time is closed when its deadline passes however steadily it sends. Only a complete request (as
// the protocol's Session decides) takes a thread: sessions are served on a pool of at most
// `max_workers` threads, started on demand and retired when idle. Idle and half-sent connections
// cost a file descriptor and their buffered bytes, no thread.
//
// Connection caps with shedding: at `max_connections` (or a client's `max_connections_per_client`,
// a client being a peer IP), a new connection displaces the longest-waiting connection that is not
// being served — taken from the client holding the most connections — so a fresh client always
// gets in while anyone merely holds connections open. Only when every connection is being served
// is the new one refused: the protocol's busy reply is written at once (non-blocking) and it is
// closed. A complete request arriving while all workers are busy gets the session's busy reply.
//
// Thread safety: Start, StopAccepting, Stop and the accessors may be called from any thread
// except a worker serving a session (Stop waits for them). Session methods are called from one
// thread at a time: OnReadable/OnTimeout on the I/O thread, Serve on a worker, never concurrently.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "keel/core/socket.h"
#include "keel/core/status.h"

namespace keel {

// What a session wants after reading what arrived.
struct FrontStep {
  enum Kind {
    kIdle,      // nothing of a next request yet: idle keep-alive limit applies
    kHead,      // a request has begun (or the connection is new): head deadline, from its first byte
    kBody,      // the head is complete, the body is arriving: body deadline, from the head's end
    kDispatch,  // a complete request: serve it on a worker
    kClose,     // write `reply` (may be empty), then close (draining input first when `linger`)
  };
  Kind kind = kIdle;
  std::string reply;
  bool linger = false;

  static FrontStep Close(std::string reply = {}, bool linger = false) {
    FrontStep s;
    s.kind = kClose;
    s.reply = std::move(reply);
    s.linger = linger;
    return s;
  }
};

// The protocol's view of one connection. The front owns the fd (it closes it); a session reads
// and writes it. The fd is non-blocking.
class FrontSession {
 public:
  virtual ~FrontSession() = default;
  // I/O thread. Reads what is available without blocking (recv until EAGAIN, or less) and says
  // what the connection waits for now. Also called right after a session was parked again by
  // Serve, so bytes it already buffered (pipelined requests) are looked at.
  virtual FrontStep OnReadable(int fd) = 0;
  // I/O thread. The deadline of `phase` (kHead, kBody or kIdle) passed: the reply to write before
  // the connection is closed (e.g. 408), or "".
  virtual std::string OnTimeout(FrontStep::Kind phase) = 0;
  // I/O thread. A complete request arrived while every worker is busy: the reply to write before
  // the connection is closed (e.g. 503).
  virtual std::string BusyReply() = 0;
  // Worker thread. Serves the request(s) that OnReadable completed; may block (bounded by the
  // protocol's own write deadlines). True parks the connection again (keep-alive), false closes.
  // `accepting` turns false once StopAccepting was called: answer, then close.
  virtual bool Serve(int fd, const std::atomic<bool>& accepting) = 0;
};

struct ConnectionFrontOptions {
  std::string tag = "server";           // log prefix
  int max_connections = 4096;           // also bounded by RLIMIT_NOFILE (see Start)
  int max_connections_per_client = 0;   // per peer IP; 0 = only max_connections
  int max_workers = 256;                // sessions served at once
  double head_timeout_seconds = 10;     // <= 0: none
  double body_timeout_seconds = 30;
  double idle_timeout_seconds = 60;
  double linger_seconds = 1;            // draining input after an error reply
};

struct ConnectionFrontStats {
  int64_t open = 0;             // connections open now
  int64_t active = 0;           // sessions being served now
  int64_t accepted = 0;         // total
  int64_t shed = 0;             // displaced by a newer connection at a cap
  int64_t rejected = 0;         // refused at a cap with every connection busy, or no free worker
  int64_t head_timeouts = 0;
  int64_t body_timeouts = 0;
  int64_t idle_timeouts = 0;
  int max_connections = 0;      // the cap in force (after the fd limit)
};

class ConnectionFront {
 public:
  // Makes the session for a new connection. `peer` is "ip:port" (or "unix:pid=P,uid=U").
  using SessionFactory = std::function<std::unique_ptr<FrontSession>(const std::string& peer)>;
  // The reply for a connection refused at a cap (every connection busy), written before closing.
  ConnectionFront(ConnectionFrontOptions options, SessionFactory factory, std::string busy_reply);
  ~ConnectionFront();  // Stop(0)
  ConnectionFront(const ConnectionFront&) = delete;
  ConnectionFront& operator=(const ConnectionFront&) = delete;

  // Takes ownership of `listening` (a bound, listening socket), raises RLIMIT_NOFILE's soft limit
  // toward the hard one when max_connections needs it, caps max_connections to what the limit
  // allows (with a reserve for the process's other files), and starts the I/O thread.
  Status Start(ListeningSocket listening);
  // Stops accepting and closes every connection not being served; returns at once. Served
  // connections close after their session returns.
  void StopAccepting();
  // StopAccepting, waits up to drain_seconds for sessions being served, then shuts their
  // sockets down (their writes fail), waits for them to return, and joins every thread.
  // Removes a Unix socket file (UnlinkUnixSocket). Idempotent.
  void Stop(double drain_seconds);

  int open_connections() const { return open_.load(); }
  int active() const { return active_.load(); }
  ConnectionFrontStats stats() const;

 private:
  struct Conn;
  struct Client;
  void Loop();
  void CloseListener();  // I/O thread, idempotent; before any connection is closed for the stop
  void AcceptReady();
  void Admit(int fd, std::string peer, const std::string& ip);
  void Reject(int fd);
  bool ShedFor(Client* client);
  void Step(Conn* c, FrontStep step);
  void SetPhase(Conn* c, FrontStep::Kind phase, double timeout_seconds);
  void Dispatch(Conn* c);
  void StartClosing(Conn* c, std::string reply, bool linger);
  void FlushClosing(Conn* c);
  void Drop(Conn* c);
  void Park(Conn* c);
  void Unpark(Conn* c);
  void ExpireTimers();
  void TakeReturned();
  void WorkerLoop();
  void CloseAllParked();

  ConnectionFrontOptions options_;
  SessionFactory factory_;
  std::string busy_reply_;
  ListeningSocket listening_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  int reserve_fd_ = -1;  // spare descriptor, freed to accept-and-close when the fd limit is hit
  std::thread io_thread_;
  bool started_ = false;
  bool stopped_ = false;

  // I/O thread only.
  std::list<std::unique_ptr<Conn>> conns_;
  std::vector<std::unique_ptr<Conn>> graveyard_;  // dropped this round; freed after the event batch
  std::set<std::pair<Deadline, Conn*>> timers_;
  bool listen_registered_ = false;
  bool closed_parked_ = false;
  Deadline accept_paused_until_{};
  std::unordered_map<std::string, std::unique_ptr<Client>> clients_;
  int max_connections_ = 0;
  int closing_rejects_ = 0;

  std::atomic<bool> accepting_{false};
  std::atomic<bool> quit_{false};
  std::atomic<int> open_{0}, active_{0};
  std::atomic<int64_t> accepted_{0}, shed_{0}, rejected_{0}, head_timeouts_{0}, body_timeouts_{0},
      idle_timeouts_{0};

  // Worker pool and hand-back; guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // workers wait for work
  std::condition_variable done_cv_;   // Stop waits for active_ == 0
  std::deque<Conn*> queue_;
  std::vector<std::pair<Conn*, bool>> returned_;  // served sessions: park again?
  std::vector<int> serving_fds_;                  // fds of sessions being served (for Stop)
  std::list<std::thread> workers_;
  std::vector<std::thread::id> retired_;
  int idle_workers_ = 0;
  int live_workers_ = 0;
  bool workers_quit_ = false;
};

}  // namespace keel
