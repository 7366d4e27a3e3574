#include "keel/core/conn_front.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "keel/core/log.h"

namespace keel {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxClosingRejects = 64;     // refused connections lingering at once; more: plain close
constexpr double kRejectLingerSeconds = 0.2;
constexpr size_t kMaxDrainPerEvent = 64 << 10;
constexpr auto kWorkerIdleRetire = std::chrono::seconds(30);

Deadline After(double seconds) {
  if (seconds <= 0) return Deadline::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// The client key: the peer's address without the port ("unix" for every Unix-socket peer).
std::string PeerIp(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, host, sizeof(host));
  } else if (ss.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, host, sizeof(host));
  } else {
    return "unix";
  }
  return host;
}

// Best effort, never blocks: the reply to a connection being closed at once.
void SendNow(int fd, const std::string& bytes) {
  if (!bytes.empty()) (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

char kListenTag, kWakeTag;

}  // namespace

struct ConnectionFront::Client {
  int count = 0;                 // connections open from this client
  std::list<Conn*> parked;       // those not being served, longest-waiting first
};

struct ConnectionFront::Conn {
  int fd = -1;
  std::string ip;
  Client* client = nullptr;      // null for a refused connection
  std::unique_ptr<FrontSession> session;
  FrontStep::Kind phase = FrontStep::kHead;  // kDispatch while served, kClose while closing
  bool dead = false;
  bool timed = false;
  Deadline deadline{};
  bool parked = false;
  std::list<Conn*>::iterator parked_it;
  std::list<std::unique_ptr<Conn>>::iterator self;
  uint32_t events = 0;           // registered epoll events; 0 = not registered
  // Closing: bytes still to write, then shutdown(SHUT_WR) and (linger) drain until EOF.
  std::string out;
  size_t out_off = 0;
  bool linger = false;
  bool write_shut = false;
};

ConnectionFront::ConnectionFront(ConnectionFrontOptions options, SessionFactory factory, std::string busy_reply)
    : options_(std::move(options)), factory_(std::move(factory)), busy_reply_(std::move(busy_reply)) {}

ConnectionFront::~ConnectionFront() { Stop(0); }

Status ConnectionFront::Start(ListeningSocket listening) {
  if (started_) return Status::Internal(options_.tag + ": already started");
  if (options_.max_connections < 1 || options_.max_workers < 1) {
    ::close(listening.fd);
    UnlinkUnixSocket(listening);
    return Status::InvalidArgument(options_.tag + ": max_connections and max_workers must be >= 1");
  }
  // Idle connections cost only a descriptor, so allow many: raise the soft limit toward the hard
  // one, and keep a fifth of it (at least 64) for the process's other files and servers.
  rlimit rl{};
  max_connections_ = options_.max_connections;
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    const rlim_t want = static_cast<rlim_t>(options_.max_connections) * 5 / 4 + 256;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want && rl.rlim_cur < rl.rlim_max) {
      rlimit raised = rl;
      raised.rlim_cur = rl.rlim_max == RLIM_INFINITY ? want : std::min(want, rl.rlim_max);
      if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
    }
    if (rl.rlim_cur != RLIM_INFINITY) {
      const int64_t cur = static_cast<int64_t>(rl.rlim_cur);
      const int64_t allowed = std::max<int64_t>(1, cur - std::max<int64_t>(64, cur / 5));
      if (allowed < max_connections_) {
        Log().warn("{}: max_connections {} lowered to {} (open-file limit {})", options_.tag, max_connections_,
                   allowed, cur);
        max_connections_ = static_cast<int>(allowed);
      }
    }
  }
  const int fl = ::fcntl(listening.fd, F_GETFL);
  ::fcntl(listening.fd, F_SETFL, fl | O_NONBLOCK);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    const std::string err = std::strerror(errno);
    for (int fd : {epoll_fd_, wake_fd_, reserve_fd_}) if (fd >= 0) ::close(fd);
    epoll_fd_ = wake_fd_ = reserve_fd_ = -1;
    UnlinkUnixSocket(listening);
    ::close(listening.fd);
    return Status::IOError(fmt::format("{}: epoll/eventfd: {}", options_.tag, err));
  }
  listening_ = listening;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &kWakeTag;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  ev.data.ptr = &kListenTag;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listening_.fd, &ev);
  listen_registered_ = true;
  accepting_ = true;
  started_ = true;
  io_thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void ConnectionFront::StopAccepting() {
  {
    // Under mu_: Dispatch checks accepting_ under it too, so Stop never misses a session.
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_.exchange(false)) return;
  }
  uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof(one));
}

void ConnectionFront::Stop(double drain_seconds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_ || stopped_) return;
    stopped_ = true;
  }
  StopAccepting();
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait_for(lock, std::chrono::duration<double>(std::max(0.0, drain_seconds)),
                      [this] { return active_.load() == 0; });
    if (!serving_fds_.empty()) {
      Log().warn("{}: drain timed out; shut down {} connection(s) in progress", options_.tag, serving_fds_.size());
      for (int fd : serving_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    // Sessions must return once their writes fail; the fds stay open (owned by the I/O thread).
    done_cv_.wait(lock, [this] { return active_.load() == 0; });
    workers_quit_ = true;
  }
  work_cv_.notify_all();
  quit_ = true;
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (io_thread_.joinable()) io_thread_.join();
  std::list<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    workers.splice(workers.end(), workers_);
  }
  for (std::thread& t : workers) t.join();
  // Before close: the open socket pins its inode (see socket.h). Closed already when accepting
  // stopped (then its path went with it).
  if (listening_.fd >= 0) UnlinkUnixSocket(listening_);
  for (int* fd : {&listening_.fd, &epoll_fd_, &wake_fd_, &reserve_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

ConnectionFrontStats ConnectionFront::stats() const {
  ConnectionFrontStats s;
  s.open = open_.load();
  s.active = active_.load();
  s.accepted = accepted_.load();
  s.shed = shed_.load();
  s.rejected = rejected_.load();
  s.head_timeouts = head_timeouts_.load();
  s.body_timeouts = body_timeouts_.load();
  s.idle_timeouts = idle_timeouts_.load();
  s.max_connections = max_connections_;
  return s;
}

void ConnectionFront::CloseListener() {
  if (listen_registered_) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listening_.fd, nullptr);
    listen_registered_ = false;
  }
  if (listening_.fd >= 0) {
    // Closed now, not at the end of Stop: an open listener keeps completing handshakes that
    // no one accepts, so a client connecting during the drain hangs until the process exits
    // (then is reset) instead of being refused at once and trying another instance.
    UnlinkUnixSocket(listening_);  // before close: the open socket pins its inode
    ::close(listening_.fd);
    listening_.fd = -1;
  }
}

void ConnectionFront::Loop() {
  std::vector<epoll_event> events(256);
  while (!quit_.load()) {
    int timeout_ms = 1000;  // also the cadence for retiring idle workers
    if (!timers_.empty()) timeout_ms = std::min(timeout_ms, MillisLeft(timers_.begin()->first) + 1);
    if (!listen_registered_ && accepting_.load()) timeout_ms = std::min(timeout_ms, 50);
    const int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), timeout_ms);
    if (n < 0 && errno != EINTR) {
      Log().error("{}: epoll_wait: {}", options_.tag, std::strerror(errno));
      break;
    }
    // Before anything below closes a connection: a client that sees its connection closed by the
    // stop and reconnects at once must find the port refused, not a listener about to close.
    if (!accepting_.load()) CloseListener();
    for (int i = 0; i < n; ++i) {
      void* p = events[i].data.ptr;
      if (p == &kWakeTag) {
        uint64_t v;
        (void)!::read(wake_fd_, &v, sizeof(v));
      } else if (p == &kListenTag) {
        AcceptReady();
      } else {
        Conn* c = static_cast<Conn*>(p);
        if (c->dead) continue;
        if (c->phase == FrontStep::kClose) {
          FlushClosing(c);
        } else if (c->phase != FrontStep::kDispatch) {
          Step(c, c->session->OnReadable(c->fd));
        }
      }
    }
    TakeReturned();
    if (!accepting_.load()) {
      if (!closed_parked_) CloseAllParked();
      closed_parked_ = true;
    } else if (!listen_registered_ && Clock::now() >= accept_paused_until_) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = &kListenTag;
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listening_.fd, &ev);
      listen_registered_ = true;
    }
    ExpireTimers();
    graveyard_.clear();
    // Join workers that retired after idling.
    std::list<std::thread> retired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = workers_.begin(); it != workers_.end() && !retired_.empty();) {
        auto next = std::next(it);
        auto r = std::find(retired_.begin(), retired_.end(), it->get_id());
        if (r != retired_.end()) {
          retired_.erase(r);
          retired.splice(retired.end(), workers_, it);
        }
        it = next;
      }
    }
    for (std::thread& t : retired) t.join();
  }
  // Stop: every session has returned; close everything.
  TakeReturned();
  while (!conns_.empty()) Drop(conns_.front().get());
  graveyard_.clear();
}

void ConnectionFront::AcceptReady() {
  for (int i = 0; i < 256 && accepting_.load(); ++i) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = ::accept4(listening_.fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        rejected_.fetch_add(1);
        // Out of descriptors: free one by shedding, or refuse this connection through the spare.
        if (ShedFor(nullptr)) continue;
        if (reserve_fd_ >= 0) {
          ::close(reserve_fd_);
          reserve_fd_ = -1;
          int c = ::accept4(listening_.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (c >= 0) {
            SendNow(c, busy_reply_);
            ::close(c);
          }
          reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          continue;
        }
      }
      // Nothing to free (or another failure): pause accepting briefly instead of spinning.
      Log().warn("{}: accept: {}", options_.tag, std::strerror(errno));
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listening_.fd, nullptr);
      listen_registered_ = false;
      accept_paused_until_ = Clock::now() + std::chrono::milliseconds(50);
      return;
    }
    std::string peer;
    if (ss.ss_family == AF_UNIX) {
      ucred cred{};
      socklen_t cred_len = sizeof(cred);
      peer = ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) == 0
                 ? fmt::format("unix:pid={},uid={}", cred.pid, cred.uid)
                 : "unix";
    } else {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      peer = PeerName(ss);
    }
    Admit(fd, std::move(peer), PeerIp(ss));
  }
}

void ConnectionFront::Admit(int fd, std::string peer, const std::string& ip) {
  auto [it, inserted] = clients_.try_emplace(ip);
  if (inserted) it->second = std::make_unique<Client>();
  Client* client = it->second.get();
  ++client->count;  // counts the newcomer now, so shedding this client's last one cannot erase it
  const int per_client = options_.max_connections_per_client;
  bool room = true;
  if (per_client > 0 && client->count > per_client) room = ShedFor(client);
  if (room && open_.load() >= max_connections_) room = ShedFor(nullptr);
  if (!room) {
    // A session may have just finished without the I/O thread having seen it yet: park those
    // first, so an idle connection is never mistaken for a busy one.
    TakeReturned();
    room = (per_client <= 0 || client->count <= per_client || ShedFor(client)) &&
           (open_.load() < max_connections_ || ShedFor(nullptr));
  }
  if (!room) {
    if (--client->count == 0) clients_.erase(ip);
    Reject(fd);
    return;
  }
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->ip = ip;
  c->client = client;
  c->session = factory_(peer);
  Conn* raw = c.get();
  conns_.push_back(std::move(c));
  raw->self = std::prev(conns_.end());
  open_.fetch_add(1);
  accepted_.fetch_add(1);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = raw;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  raw->events = EPOLLIN;
  Park(raw);
  // The session says what a new connection waits for (HTTP: its head; kvstore: an idle limit),
  // and bytes that came with the connect are read at once.
  raw->phase = FrontStep::kDispatch;  // no phase yet: the first SetPhase starts its deadline now
  Step(raw, raw->session->OnReadable(fd));
}

void ConnectionFront::Reject(int fd) {
  rejected_.fetch_add(1);
  if (closing_rejects_ >= kMaxClosingRejects) {
    SendNow(fd, busy_reply_);
    ::close(fd);
    return;
  }
  // Linger briefly so the request bytes already sent do not turn the close into a reset that
  // destroys the reply before the client reads it.
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  Conn* raw = c.get();
  conns_.push_back(std::move(c));
  raw->self = std::prev(conns_.end());
  ++closing_rejects_;
  raw->phase = FrontStep::kClose;
  raw->out = busy_reply_;
  raw->linger = true;
  raw->timed = true;
  raw->deadline = After(kRejectLingerSeconds);
  timers_.emplace(raw->deadline, raw);
  FlushClosing(raw);
}

bool ConnectionFront::ShedFor(Client* only) {
  Client* from = only;
  if (from == nullptr) {
    for (auto& [ip, cl] : clients_) {
      if (!cl->parked.empty() && (from == nullptr || cl->count > from->count)) from = cl.get();
    }
  }
  if (from == nullptr || from->parked.empty()) return false;
  shed_.fetch_add(1);
  Drop(from->parked.front());
  return true;
}

void ConnectionFront::Step(Conn* c, FrontStep step) {
  switch (step.kind) {
    case FrontStep::kIdle:
      SetPhase(c, FrontStep::kIdle, options_.idle_timeout_seconds);
      break;
    case FrontStep::kHead:
      SetPhase(c, FrontStep::kHead, options_.head_timeout_seconds);
      break;
    case FrontStep::kBody:
      SetPhase(c, FrontStep::kBody, options_.body_timeout_seconds);
      break;
    case FrontStep::kDispatch:
      Dispatch(c);
      break;
    case FrontStep::kClose:
      StartClosing(c, std::move(step.reply), step.linger);
      break;
  }
}

void ConnectionFront::SetPhase(Conn* c, FrontStep::Kind phase, double timeout_seconds) {
  if (c->phase == phase) return;  // the deadline counts from the phase's start, not the last byte
  if (c->timed) timers_.erase({c->deadline, c});
  c->phase = phase;
  c->deadline = After(timeout_seconds);
  c->timed = c->deadline != Deadline::max();
  if (c->timed) timers_.emplace(c->deadline, c);
}

void ConnectionFront::Dispatch(Conn* c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_.load()) {
      // Stopping: requests not yet started are not served.
      CloseListener();
      Drop(c);
      return;
    }
    if (active_.load() < options_.max_workers) {
      if (c->timed) timers_.erase({c->deadline, c});
      c->timed = false;
      Unpark(c);
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
      c->events = 0;
      c->phase = FrontStep::kDispatch;
      active_.fetch_add(1);
      serving_fds_.push_back(c->fd);
      queue_.push_back(c);
      if (idle_workers_ < static_cast<int>(queue_.size()) && live_workers_ < options_.max_workers) {
        try {
          workers_.emplace_back([this] { WorkerLoop(); });
          ++live_workers_;
        } catch (const std::exception& e) {
          Log().error("{}: cannot start a worker thread: {}", options_.tag, e.what());
        }
      }
      if (live_workers_ > 0) {
        work_cv_.notify_one();
        return;
      }
      // No worker could be started at all: refuse below.
      queue_.pop_back();
      serving_fds_.pop_back();
      active_.fetch_sub(1);
      Park(c);
      c->phase = FrontStep::kBody;
    }
  }
  rejected_.fetch_add(1);
  StartClosing(c, c->session->BusyReply(), /*linger=*/true);
}

void ConnectionFront::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ++idle_workers_;
    const bool woken = work_cv_.wait_for(lock, kWorkerIdleRetire, [this] { return !queue_.empty() || workers_quit_; });
    --idle_workers_;
    if (queue_.empty() && (workers_quit_ || !woken)) break;
    Conn* c = queue_.front();
    queue_.pop_front();
    lock.unlock();
    bool again = false;
    try {
      again = c->session->Serve(c->fd, accepting_);
    } catch (const std::exception& e) {
      Log().error("{}: session threw: {}", options_.tag, e.what());
    } catch (...) {
      Log().error("{}: session threw", options_.tag);
    }
    lock.lock();
    serving_fds_.erase(std::find(serving_fds_.begin(), serving_fds_.end(), c->fd));
    returned_.emplace_back(c, again);
    active_.fetch_sub(1);
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
    done_cv_.notify_all();
  }
  --live_workers_;
  retired_.push_back(std::this_thread::get_id());
}

void ConnectionFront::TakeReturned() {
  std::vector<std::pair<Conn*, bool>> back;
  {
    std::lock_guard<std::mutex> lock(mu_);
    back.swap(returned_);
  }
  for (auto [c, again] : back) {
    if (!again || !accepting_.load()) {
      if (!accepting_.load()) CloseListener();
      Drop(c);
      continue;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = c;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &ev);
    c->events = EPOLLIN;
    Park(c);
    // Pipelined bytes may already sit in the session's buffer, where epoll cannot see them.
    Step(c, c->session->OnReadable(c->fd));
  }
}

void ConnectionFront::StartClosing(Conn* c, std::string reply, bool linger) {
  if (reply.empty() && !linger) {
    Drop(c);
    return;
  }
  if (c->timed) timers_.erase({c->deadline, c});
  c->phase = FrontStep::kClose;
  c->out = std::move(reply);
  c->out_off = 0;
  c->linger = linger;
  c->deadline = After(options_.linger_seconds > 0 ? options_.linger_seconds : 0.1);
  c->timed = true;
  timers_.emplace(c->deadline, c);
  FlushClosing(c);
}

void ConnectionFront::FlushClosing(Conn* c) {
  while (c->out_off < c->out.size()) {
    ssize_t n = ::send(c->fd, c->out.data() + c->out_off, c->out.size() - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c->out_off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!(c->events & EPOLLOUT)) {
        epoll_event ev{};
        ev.events = EPOLLIN | EPOLLOUT;
        ev.data.ptr = c;
        ::epoll_ctl(epoll_fd_, c->events ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fd, &ev);
        c->events = ev.events;
      }
      // Keep the receive queue from filling while we wait to write.
      char buf[16384];
      (void)!::recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
      return;
    }
    Drop(c);  // the peer is gone
    return;
  }
  if (!c->write_shut) {
    c->write_shut = true;
    ::shutdown(c->fd, SHUT_WR);
    if (!c->linger) {
      Drop(c);
      return;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = c;
    ::epoll_ctl(epoll_fd_, c->events ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fd, &ev);
    c->events = EPOLLIN;
  }
  // Drain what the client still sends until it closes (or the deadline drops it).
  char buf[16384];
  size_t drained = 0;
  while (drained < kMaxDrainPerEvent) {
    ssize_t n = ::recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) {
      drained += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    Drop(c);
    return;
  }
}

void ConnectionFront::Park(Conn* c) {
  if (c->parked || c->client == nullptr) return;
  c->client->parked.push_back(c);
  c->parked_it = std::prev(c->client->parked.end());
  c->parked = true;
}

void ConnectionFront::Unpark(Conn* c) {
  if (!c->parked) return;
  c->client->parked.erase(c->parked_it);
  c->parked = false;
}

void ConnectionFront::Drop(Conn* c) {
  if (c->dead) return;
  c->dead = true;
  if (c->timed) timers_.erase({c->deadline, c});
  c->timed = false;
  Unpark(c);
  ::close(c->fd);  // also removes it from the epoll set
  if (c->client != nullptr) {
    open_.fetch_sub(1);
    if (--c->client->count == 0) clients_.erase(c->ip);
  } else {
    --closing_rejects_;
  }
  graveyard_.push_back(std::move(*c->self));
  conns_.erase(c->self);
}

void ConnectionFront::ExpireTimers() {
  const Deadline now = Clock::now();
  while (!timers_.empty() && timers_.begin()->first <= now) {
    Conn* c = timers_.begin()->second;
    timers_.erase(timers_.begin());
    c->timed = false;
    const FrontStep::Kind phase = c->phase;
    if (phase == FrontStep::kClose) {
      Drop(c);
      continue;
    }
    if (phase == FrontStep::kHead) head_timeouts_.fetch_add(1);
    if (phase == FrontStep::kBody) body_timeouts_.fetch_add(1);
    if (phase == FrontStep::kIdle) idle_timeouts_.fetch_add(1);
    std::string reply = c->session->OnTimeout(phase);
    StartClosing(c, std::move(reply), /*linger=*/!reply.empty());
  }
}

void ConnectionFront::CloseAllParked() {
  std::vector<Conn*> victims;
  for (auto& c : conns_) {
    if (c->phase != FrontStep::kDispatch && c->phase != FrontStep::kClose) victims.push_back(c.get());
  }
  for (Conn* c : victims) Drop(c);
}

}  // namespace keel
