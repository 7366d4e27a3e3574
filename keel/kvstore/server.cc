#include "keel/kvstore/server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "keel/core/log.h"
#include "keel/core/hash.h"
#include "keel/core/socket.h"

namespace keel::kvstore {

struct Server::Conn {
  int fd = -1;
  std::string remote;
  std::thread thread;
  std::atomic<bool> done{false};
};

namespace {

// One reply: header plus gathered pieces that stay alive until it is written.
struct Reply {
  FrameHeader h;
  std::string small;              // owned bytes (EXISTS bitmap, MGET table, STATS JSON, errors)
  std::vector<BlobPtr> values;    // stored values sent in place
};

Status SendReply(int fd, Reply& r, Deadline deadline, int64_t* bytes_out) {
  uint64_t total = r.small.size();
  for (const BlobPtr& v : r.values) total += v->size();
  r.h.value_bytes = static_cast<uint32_t>(total);
  uint8_t header[kHeaderBytes];
  EncodeHeader(r.h, {}, header);
  std::vector<iovec> iov;
  iov.reserve(2 + r.values.size());
  iov.push_back({header, kHeaderBytes});
  if (!r.small.empty()) iov.push_back({r.small.data(), r.small.size()});
  for (const BlobPtr& v : r.values) iov.push_back({const_cast<uint8_t*>(v->data()), v->size()});
  *bytes_out += static_cast<int64_t>(kHeaderBytes + total);
  return WriteFullV(fd, iov.data(), static_cast<int>(iov.size()), deadline);
}

Reply StatusReply(const FrameHeader& req, const Status& s) {
  Reply r;
  r.h.op = req.op;
  r.h.request_id = req.request_id;
  r.h.status = WireStatus(s.code());
  if (!s.ok()) r.small = s.message();
  r.h.value_checksum = Xxh3_64(r.small.data(), r.small.size());
  return r;
}

// Drops `n` bytes of input (a PUT refused before its value was read), keeping the stream in step.
Status Discard(int fd, uint64_t n, Deadline deadline) {
  char buf[65536];
  while (n > 0) {
    const size_t chunk = n < sizeof(buf) ? static_cast<size_t>(n) : sizeof(buf);
    KEEL_RETURN_IF_ERROR(ReadFull(fd, buf, chunk, deadline));
    n -= chunk;
  }
  return Status::Ok();
}

}  // namespace

Server::Server(Store& store, const ServerOptions& options) : store_(store), options_(options) {}

Result<std::unique_ptr<Server>> Server::Start(Store& store, const ServerOptions& options, MetricsRegistry* metrics) {
  KEEL_ASSIGN_OR_RETURN(ListeningSocket listening, ListenTcp(options.host, options.port, 256));
  int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    ::close(listening.fd);
    return Status::IOError(std::string("eventfd: ") + std::strerror(errno));
  }
  std::unique_ptr<Server> server(new Server(store, options));
  server->listen_fd_ = listening.fd;
  server->wake_fd_ = wake;
  server->port_ = listening.port;
  if (metrics != nullptr) {
    Server* s = server.get();
    server->latency_ = &metrics->AddHistogram("keel_kvstore_request_seconds", "kvstore request service time.",
                                              ExponentialBuckets(1e-5, 2.5, 14), {"op"});
    metrics->AddGauge("keel_kvstore_connections", "Open client connections.").Get().SetCallback([s] {
      return static_cast<double>(s->open_.load());
    });
    metrics->AddCounter("keel_kvstore_connections_rejected_total", "Connections refused (limit reached).")
        .Get()
        .SetCallback([s] { return static_cast<double>(s->rejected_.load()); });
    metrics->AddCounter("keel_kvstore_frames_rejected_total", "Malformed frames (their connections were closed).")
        .Get()
        .SetCallback([s] { return static_cast<double>(s->bad_frames_.load()); });
    metrics->AddCounter("keel_kvstore_bytes_received_total", "Frame bytes received.").Get().SetCallback([s] {
      return static_cast<double>(s->bytes_in_.load());
    });
    metrics->AddCounter("keel_kvstore_bytes_sent_total", "Frame bytes sent.").Get().SetCallback([s] {
      return static_cast<double>(s->bytes_out_.load());
    });
  }
  Server* self = server.get();
  server->accept_thread_ = std::thread([self] { self->AcceptLoop(); });
  Log().info("kvstore: listening on {}:{}", options.host, listening.port);
  return server;
}

Server::~Server() { Stop(); }

void Server::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    for (Conn& c : conns_) ::shutdown(c.fd, SHUT_RDWR);
  }
  uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof(one));
  if (accept_thread_.joinable()) accept_thread_.join();
  std::list<Conn> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Conn& c : conns_) ::shutdown(c.fd, SHUT_RDWR);  // accepted after the first sweep
    conns.splice(conns.end(), conns_);
  }
  for (Conn& c : conns) {
    if (c.thread.joinable()) c.thread.join();
  }
  ::close(listen_fd_);
  ::close(wake_fd_);
}

ServerStats Server::Stats() const {
  ServerStats s;
  s.connections_open = open_.load();
  s.connections_total = total_.load();
  s.connections_rejected = rejected_.load();
  s.frames_rejected = bad_frames_.load();
  s.requests = requests_.load();
  s.bytes_in = bytes_in_.load();
  s.bytes_out = bytes_out_.load();
  return s;
}

void Server::ReapDone() {
  std::list<Conn> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      auto next = std::next(it);
      if (it->done.load()) done.splice(done.end(), conns_, it);
      it = next;
    }
  }
  for (Conn& c : done) c.thread.join();
}

void Server::AcceptLoop() {
  for (;;) {
    int fd = -1;
    std::string remote;
    AcceptResult got = AcceptConnection(listen_fd_, wake_fd_, 1000, "kvstore", &fd, &remote);
    if (got == AcceptResult::kStop) return;
    ReapDone();
    if (got == AcceptResult::kNone) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      ::close(fd);
      return;
    }
    if (open_.load() >= options_.max_connections) {
      rejected_.fetch_add(1);
      FrameHeader req;
      req.op = Op::kError;
      Reply rep = StatusReply(req, Status::ResourceExhausted("kvstore: too many connections"));
      int64_t ignored = 0;
      (void)SendReply(fd, rep, DeadlineIn(100), &ignored);
      ::close(fd);
      continue;
    }
    conns_.emplace_back();
    Conn* c = &conns_.back();
    c->fd = fd;
    c->remote = std::move(remote);
    open_.fetch_add(1);
    total_.fetch_add(1);
    c->thread = std::thread([this, c] { Serve(c); });
  }
}

void Server::Serve(Conn* c) {
  const int fd = c->fd;
  std::string keys;
  auto reject = [&](const FrameHeader& req, const Status& s) {
    bad_frames_.fetch_add(1);
    Log().warn("kvstore: closing {}: {}", c->remote, s.ToString());
    FrameHeader h = req;
    h.op = Op::kError;
    Reply rep = StatusReply(h, s);
    int64_t out = 0;
    (void)SendReply(fd, rep, DeadlineIn(options_.io_timeout_ms), &out);
    LingeringClose(fd, 200);
  };
  for (;;) {
    // Idle wait for the next request; Stop() shuts the socket down, which wakes this poll.
    short rev = 0;
    int pr = PollFd(fd, POLLIN, options_.idle_timeout_ms, &rev);
    if (pr <= 0) break;
    const Deadline deadline = DeadlineIn(options_.io_timeout_ms);
    uint8_t header[kHeaderBytes];
    if (!ReadFull(fd, header, kHeaderBytes, deadline).ok()) break;
    const auto started = std::chrono::steady_clock::now();
    Result<FrameHeader> parsed = DecodeHeader(header, options_.limits);
    if (!parsed.ok()) {
      reject(FrameHeader{}, parsed.status());
      break;
    }
    FrameHeader req = *parsed;
    if (req.op == Op::kError) {
      reject(req, Status::InvalidArgument("kvstore frame: ERROR is a reply, not a request"));
      break;
    }
    keys.resize(req.key_bytes);
    if (!ReadFull(fd, keys.data(), keys.size(), deadline).ok()) break;
    Status hc = CheckHeaderChecksum(header, keys, req.header_checksum);
    if (!hc.ok()) {
      reject(req, hc);
      break;
    }
    if (req.value_bytes > 0 && req.op != Op::kPut) {
      reject(req, Status::InvalidArgument(std::string("kvstore frame: ") + OpName(req.op) + " carries no value"));
      break;
    }
    bytes_in_.fetch_add(static_cast<int64_t>(kHeaderBytes + req.key_bytes + req.value_bytes));
    requests_.fetch_add(1);

    std::shared_ptr<Blob> value;
    Status refused;
    if (req.op == Op::kPut) {
      const int64_t n = req.value_bytes;
      if (inflight_bytes_.fetch_add(n) + n > options_.max_inflight_bytes) {
        inflight_bytes_.fetch_sub(n);
        refused = Status::ResourceExhausted("kvstore: server memory for incoming values is exhausted; retry later");
        if (!Discard(fd, req.value_bytes, deadline).ok()) break;
      } else {
        value = Blob::Allocate(req.value_bytes);
        Status rs = ReadFull(fd, value->data(), req.value_bytes, deadline);
        inflight_bytes_.fetch_sub(n);
        if (!rs.ok()) break;
        if (Xxh3_64(value->data(), value->size()) != req.value_checksum) {
          reject(req, Status::Corruption("kvstore frame: value checksum mismatch"));
          break;
        }
        value->set_checksum(req.value_checksum);
      }
    }

    Reply rep;
    rep.h.op = req.op;
    rep.h.request_id = req.request_id;
    const bool single_key = req.op == Op::kPut || req.op == Op::kGet || req.op == Op::kDel;
    const bool key_list = req.op == Op::kExists || req.op == Op::kPrefix || req.op == Op::kMget;
    Status st;
    if (single_key) st = ValidateKey(keys);
    std::vector<std::string_view> list;
    if (key_list) {
      Result<std::vector<std::string_view>> parsed_keys = ParseKeyList(keys, req.count);
      if (!parsed_keys.ok()) {
        reject(req, parsed_keys.status());
        break;
      }
      list = std::move(*parsed_keys);
    }
    if (!refused.ok()) {
      st = refused;
    } else if (st.ok()) {
      switch (req.op) {
        case Op::kPut: {
          const int64_t ttl = req.aux == 0 ? -1 : static_cast<int64_t>(req.aux);
          st = store_.Put(keys, std::move(value), ttl, (req.flags & kPersist) != 0);
          break;
        }
        case Op::kGet: {
          Result<StoredValue> got = store_.Get(keys);
          if (got.ok()) rep.values.push_back(std::move(got->value));
          else st = got.status();
          break;
        }
        case Op::kDel:
          st = store_.Delete(keys);
          break;
        case Op::kExists:
          rep.small.resize(list.size());
          for (size_t i = 0; i < list.size(); ++i) {
            Result<bool> has = store_.Contains(list[i]);
            rep.small[i] = has.ok() && *has ? 1 : 0;
          }
          rep.h.count = static_cast<uint32_t>(list.size());
          break;
        case Op::kPrefix:
          rep.h.aux = static_cast<uint64_t>(store_.LongestPrefix(list));
          break;
        case Op::kMget: {
          rep.small.resize(list.size() * kMgetItemBytes);
          uint64_t total = 0;
          for (size_t i = 0; i < list.size(); ++i) {
            MgetItem item;
            Result<StoredValue> got = store_.Get(list[i]);
            if (got.ok() && total + got->value->size() <= options_.limits.max_value_bytes) {
              item.length = static_cast<uint32_t>(got->value->size());
              item.checksum = got->value->checksum();
              total += got->value->size();
              rep.values.push_back(std::move(got->value));
            } else {
              item.status = WireStatus(got.ok() ? StatusCode::kResourceExhausted : got.status().code());
            }
            EncodeMgetItem(item, reinterpret_cast<uint8_t*>(rep.small.data()) + i * kMgetItemBytes);
          }
          rep.h.count = static_cast<uint32_t>(list.size());
          break;
        }
        case Op::kStats:
          rep.small = store_.StatsJson();
          break;
        case Op::kPing:
        case Op::kError:
          break;
      }
    }
    rep.h.status = WireStatus(st.code());
    if (!st.ok()) {
      rep.values.clear();
      rep.small = st.message();
    }
    if (rep.values.size() == 1 && rep.small.empty()) {
      rep.h.value_checksum = rep.values[0]->checksum();  // verified on PUT, reused here
    } else {
      rep.h.value_checksum = Xxh3_64(rep.small.data(), rep.small.size());
    }
    int64_t out = 0;
    Status ws = SendReply(fd, rep, DeadlineIn(options_.io_timeout_ms), &out);
    bytes_out_.fetch_add(out);
    if (latency_ != nullptr) {
      latency_->WithLabels({OpName(req.op)})
          .Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    }
    if (!ws.ok()) break;
  }
  ::close(fd);
  open_.fetch_sub(1);
  c->done.store(true);
}

}  // namespace keel::kvstore
