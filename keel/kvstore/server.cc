#include "keel/kvstore/server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "keel/core/log.h"
#include "keel/core/hash.h"
#include "keel/core/socket.h"

namespace keel::kvstore {

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

// A reply without stored values as bytes, for the I/O thread to write without blocking.
std::string ReplyBytes(Reply& r) {
  r.h.value_bytes = static_cast<uint32_t>(r.small.size());
  std::string out(kHeaderBytes, '\0');
  EncodeHeader(r.h, {}, reinterpret_cast<uint8_t*>(out.data()));
  return out + r.small;
}

Reply ErrorReply(const FrameHeader& req, const Status& s) {
  FrameHeader h = req;
  h.op = Op::kError;
  return StatusReply(h, s);
}

}  // namespace

// One connection's frame being read. OnReadable (I/O thread) gathers the whole frame — header,
// keys and a PUT's value, straight into its Blob — without blocking, so a client trickling any
// part of it holds no thread and meets the frame's deadline; Serve (a worker) answers it, then
// keeps going while whole pipelined frames are already waiting.
class Server::Session final : public FrontSession {
 public:
  Session(Server& server, std::string remote) : server_(server), remote_(std::move(remote)) {}
  ~Session() override { Release(); }

  FrontStep OnReadable(int fd) override {
    size_t read = 0;
    for (;;) {
      uint8_t* dst = nullptr;
      size_t want = 0;
      if (have_ < kHeaderBytes) {
        dst = header_ + have_;
        want = kHeaderBytes - have_;
      } else if (keys_have_ < keys_want_) {
        // Grown as the bytes arrive: a header alone must not commit a 1 MiB key section.
        if (keys_have_ == keys_.size()) keys_.resize(std::min(keys_want_, std::max<size_t>(2 * keys_.size(), 4096)));
        dst = reinterpret_cast<uint8_t*>(keys_.data()) + keys_have_;
        want = keys_.size() - keys_have_;
      } else if (!checked_) {
        Status st = server_.CheckFrame(header_, req_, keys_);
        if (!st.ok()) return FrontStep::Close(server_.RejectBytes(req_, st, remote_), true);
        checked_ = true;
        // The value counts against max_inflight_bytes as its bytes arrive, not as declared: 16
        // headers declaring 64 MiB each and sending nothing used to refuse every other PUT.
        // (The allocation is address space until written.)
        if (req_.op == Op::kPut && req_.value_bytes > 0) value_ = Blob::Allocate(req_.value_bytes);
        continue;
      } else if (value_have_ < req_.value_bytes) {
        want = req_.value_bytes - value_have_;
        if (value_) {
          dst = value_->data() + value_have_;
        } else {
          dst = scratch_;
          want = std::min(want, sizeof(scratch_));
        }
      } else {
        Release();  // the value is whole: it no longer counts as being received
        return {FrontStep::kDispatch};
      }
      if (read >= kMaxReadPerEvent) return {FrontStep::kHead};  // let other connections have a turn
      const ssize_t n = ::recv(fd, dst, want, MSG_DONTWAIT);
      if (n == 0) return FrontStep::Close();
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return {have_ == 0 ? FrontStep::kIdle : FrontStep::kHead};
        return FrontStep::Close();
      }
      read += static_cast<size_t>(n);
      if (have_ < kHeaderBytes) {
        have_ += static_cast<size_t>(n);
        if (have_ == kHeaderBytes) {
          Status st = Decode();
          if (!st.ok()) return FrontStep::Close(server_.RejectBytes(req_, st, remote_), true);
        }
      } else if (keys_have_ < keys_want_) {
        keys_have_ += static_cast<size_t>(n);
      } else {
        value_have_ += static_cast<size_t>(n);
        if (value_ && !Reserve(n)) {
          value_.reset();   // the rest is drained into scratch_, then answered ResourceExhausted
          refused_ = true;
          Release();
        }
      }
    }
  }

  // Counts n more received value bytes against the server's bound; false when it is full.
  bool Reserve(int64_t n) {
    if (server_.inflight_bytes_.fetch_add(n) + n > server_.options_.max_inflight_bytes) {
      server_.inflight_bytes_.fetch_sub(n);
      return false;
    }
    reserved_ += n;
    return true;
  }

  std::string OnTimeout(FrontStep::Kind) override { return {}; }

  std::string BusyReply() override {
    Reply r = ErrorReply(req_, Status::ResourceExhausted("kvstore: server busy; retry later"));
    return ReplyBytes(r);
  }

  bool Serve(int fd, const std::atomic<bool>& accepting) override {
    for (;;) {
      const bool ok = server_.HandleFrame(fd, req_, keys_, std::move(value_), refused_, remote_);
      Reset();
      if (!ok || !accepting.load()) return false;
      // Keep serving the client's next frames while they come at once (see ReadNextFrame).
      FrontStep step = ReadNextFrame(fd);
      if (step.kind == FrontStep::kDispatch) continue;
      if (step.kind != FrontStep::kClose) return true;  // the I/O thread goes on from here
      if (!step.reply.empty()) {
        iovec iov{step.reply.data(), step.reply.size()};
        (void)WriteFullV(fd, &iov, 1, DeadlineIn(server_.options_.io_timeout_ms));
        LingeringClose(fd, 200);
      }
      return false;
    }
  }

 private:
  static constexpr size_t kMaxReadPerEvent = 1 << 20;
  // A worker waits this long for a client's next request, and at most kFrameBudgetNanos for it
  // to arrive whole, before handing the connection back: a client answering its replies at once
  // (request/response in a loop) then skips two thread hand-offs per request, while an idle or
  // trickling one holds a worker no longer than that. A partial frame's state stays in the
  // session; the I/O thread goes on from it.
  static constexpr long kLingerNanos = 200'000;
  static constexpr long kFrameBudgetNanos = 2'000'000;

  FrontStep ReadNextFrame(int fd) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      FrontStep step = OnReadable(fd);
      if (step.kind == FrontStep::kDispatch || step.kind == FrontStep::kClose) return step;
      const long budget = step.kind == FrontStep::kIdle ? kLingerNanos : kFrameBudgetNanos;
      const long left = budget - static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                       std::chrono::steady_clock::now() - start)
                                                       .count());
      if (left <= 0) return step;
      pollfd p{fd, POLLIN, 0};
      const timespec wait{0, left};
      if (::ppoll(&p, 1, &wait, nullptr) <= 0) return step;
    }
  }

  Status Decode() {
    Result<FrameHeader> parsed = DecodeHeader(header_, server_.options_.limits);
    if (!parsed.ok()) {
      req_ = FrameHeader{};
      return parsed.status();
    }
    req_ = *parsed;
    if (req_.op == Op::kError) return Status::InvalidArgument("kvstore frame: ERROR is a reply, not a request");
    keys_.clear();
    keys_want_ = req_.key_bytes;
    keys_have_ = 0;
    return Status::Ok();
  }

  void Release() {
    if (reserved_ > 0) server_.inflight_bytes_.fetch_sub(reserved_);
    reserved_ = 0;
  }

  void Reset() {
    Release();
    have_ = 0;
    keys_have_ = 0;
    keys_want_ = 0;
    keys_.clear();
    if (keys_.capacity() > 4096) keys_.shrink_to_fit();  // an idle connection keeps little
    req_ = FrameHeader{};
    checked_ = false;
    refused_ = false;
    value_.reset();
    value_have_ = 0;
  }

  Server& server_;
  const std::string remote_;
  uint8_t header_[kHeaderBytes];
  size_t have_ = 0;
  FrameHeader req_;
  std::string keys_;
  size_t keys_want_ = 0;  // the header's key_bytes
  size_t keys_have_ = 0;
  bool checked_ = false;   // header checksum and op/value checked, value memory reserved
  bool refused_ = false;   // no memory for the value: drained and answered ResourceExhausted
  std::shared_ptr<Blob> value_;
  uint64_t value_have_ = 0;
  int64_t reserved_ = 0;   // bytes counted in inflight_bytes_ for value_
  uint8_t scratch_[4096];  // a refused value's bytes are read here and dropped
};

Server::Server(Store& store, const ServerOptions& options) : store_(store), options_(options) {}

Result<std::unique_ptr<Server>> Server::Start(Store& store, const ServerOptions& options, MetricsRegistry* metrics) {
  KEEL_ASSIGN_OR_RETURN(ListeningSocket listening, ListenTcp(options.host, options.port, 1024));
  std::unique_ptr<Server> server(new Server(store, options));
  Server* s = server.get();
  ConnectionFrontOptions fo;
  fo.tag = "kvstore";
  fo.max_connections = options.max_connections;
  fo.max_connections_per_client = options.max_connections_per_client;
  fo.max_workers = options.max_workers;
  fo.head_timeout_seconds = options.io_timeout_ms / 1000.0;
  fo.body_timeout_seconds = options.io_timeout_ms / 1000.0;
  fo.idle_timeout_seconds = options.idle_timeout_ms / 1000.0;
  fo.linger_seconds = 0.2;
  FrameHeader none;
  none.op = Op::kError;
  Reply full = StatusReply(none, Status::ResourceExhausted("kvstore: too many connections"));
  server->front_ = std::make_unique<ConnectionFront>(
      fo, [s](const std::string& peer) -> std::unique_ptr<FrontSession> { return std::make_unique<Session>(*s, peer); },
      ReplyBytes(full));
  server->port_ = listening.port;
  KEEL_RETURN_IF_ERROR(server->front_->Start(listening));
  if (metrics != nullptr) {
    ConnectionFront* front = server->front_.get();
    server->latency_ = &metrics->AddHistogram("keel_kvstore_request_seconds", "kvstore request service time.",
                                              ExponentialBuckets(1e-5, 2.5, 14), {"op"});
    metrics->AddGauge("keel_kvstore_connections", "Open client connections.").Get().SetCallback([front] {
      return static_cast<double>(front->open_connections());
    });
    metrics->AddCounter("keel_kvstore_connections_rejected_total",
                        "Connections refused (every connection or every worker busy).")
        .Get()
        .SetCallback([front] { return static_cast<double>(front->stats().rejected); });
    metrics->AddCounter("keel_kvstore_connections_shed_total",
                        "Idle connections closed to make room for a newer one at a connection cap.")
        .Get()
        .SetCallback([front] { return static_cast<double>(front->stats().shed); });
    metrics->AddCounter("keel_kvstore_frame_timeouts_total", "Frames not complete within the I/O timeout (closed).")
        .Get()
        .SetCallback([front] {
          const ConnectionFrontStats st = front->stats();
          return static_cast<double>(st.head_timeouts + st.body_timeouts);
        });
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
  Log().info("kvstore: listening on {}:{}", options.host, listening.port);
  return server;
}

Server::~Server() { Stop(); }

void Server::Stop() {
  if (front_) front_->Stop(0);
}

ServerStats Server::Stats() const {
  ServerStats s;
  const ConnectionFrontStats f = front_->stats();
  s.connections_open = f.open;
  s.connections_total = f.accepted;
  s.connections_busy = f.active;
  s.connections_rejected = f.rejected;
  s.connections_shed = f.shed;
  s.frame_timeouts = f.head_timeouts + f.body_timeouts;
  s.frames_rejected = bad_frames_.load();
  s.requests = requests_.load();
  s.bytes_in = bytes_in_.load();
  s.bytes_out = bytes_out_.load();
  return s;
}

Status Server::CheckFrame(const uint8_t* header, const FrameHeader& req, const std::string& keys) const {
  KEEL_RETURN_IF_ERROR(CheckHeaderChecksum(header, keys, req.header_checksum));
  if (req.value_bytes > 0 && req.op != Op::kPut) {
    return Status::InvalidArgument(std::string("kvstore frame: ") + OpName(req.op) + " carries no value");
  }
  return Status::Ok();
}

std::string Server::RejectBytes(const FrameHeader& req, const Status& s, const std::string& remote) {
  bad_frames_.fetch_add(1);
  Log().warn("kvstore: closing {}: {}", remote, s.ToString());
  Reply r = ErrorReply(req, s);
  return ReplyBytes(r);
}

bool Server::HandleFrame(int fd, const FrameHeader& req, const std::string& keys, std::shared_ptr<Blob> value,
                         bool refused_memory, const std::string& remote) {
  const auto started = std::chrono::steady_clock::now();
  auto reject = [&](const Status& s) {
    bad_frames_.fetch_add(1);
    Log().warn("kvstore: closing {}: {}", remote, s.ToString());
    Reply rep = ErrorReply(req, s);
    int64_t out = 0;
    (void)SendReply(fd, rep, DeadlineIn(options_.io_timeout_ms), &out);
    LingeringClose(fd, 200);
    return false;
  };
  {
    bytes_in_.fetch_add(static_cast<int64_t>(kHeaderBytes + req.key_bytes + req.value_bytes));
    requests_.fetch_add(1);

    Status refused;
    if (refused_memory) {
      refused = Status::ResourceExhausted("kvstore: server memory for incoming values is exhausted; retry later");
    } else if (req.op == Op::kPut) {
      if (!value) value = Blob::Allocate(0);
      if (Xxh3_64(value->data(), value->size()) != req.value_checksum) {
        return reject(Status::Corruption("kvstore frame: value checksum mismatch"));
      }
      value->set_checksum(req.value_checksum);
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
        return reject(parsed_keys.status());
      }
      list = std::move(*parsed_keys);
    }
    if (!refused.ok()) {
      st = refused;
    } else if (st.ok()) {
      switch (req.op) {
        case Op::kPut: {
          // Clamped before the cast: a u64 above INT64_MAX must not turn into "the default".
          const int64_t ttl = req.aux == 0 ? -1 : static_cast<int64_t>(std::min<uint64_t>(req.aux, Store::kMaxTtlMs + 1));
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
    return ws.ok();
  }
}

}  // namespace keel::kvstore
