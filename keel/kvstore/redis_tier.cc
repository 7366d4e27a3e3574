#include "keel/kvstore/redis_tier.h"

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>

#include "keel/core/log.h"

namespace keel::kvstore {

// ---- URL parsing and slot hashing ---------------------------------------------------------------

namespace {

Status BadUrl(std::string_view url, const std::string& why) {
  return Status::InvalidArgument("redis url '" + std::string(url) + "': " + why);
}

constexpr std::array<uint16_t, 256> MakeCrc16Table() {
  std::array<uint16_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    uint16_t crc = static_cast<uint16_t>(i << 8);
    for (int b = 0; b < 8; ++b) crc = static_cast<uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
    t[i] = crc;
  }
  return t;
}
constexpr std::array<uint16_t, 256> kCrc16Table = MakeCrc16Table();

}  // namespace

Result<RedisOptions> ParseRedisUrl(std::string_view url) {
  RedisOptions o;
  std::string_view rest = url;
  if (size_t scheme_end = rest.find("://"); scheme_end != std::string_view::npos) {
    std::string_view scheme = rest.substr(0, scheme_end);
    if (scheme == "redis+cluster") {
      o.cluster = true;
    } else if (scheme != "redis") {
      return BadUrl(url, "unknown scheme '" + std::string(scheme) + "' (want redis:// or redis+cluster://)");
    }
    rest.remove_prefix(scheme_end + 3);
  }
  if (rest.find('@') != std::string_view::npos) return BadUrl(url, "credentials are not supported");
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  if (rest.find('/') != std::string_view::npos) return BadUrl(url, "paths (database numbers) are not supported");
  if (rest.empty()) return BadUrl(url, "no host");

  std::string_view host = rest, port;
  if (rest.front() == '[') {  // [IPv6]:port
    size_t close = rest.find(']');
    if (close == std::string_view::npos) return BadUrl(url, "unterminated '[' in host");
    host = rest.substr(1, close - 1);
    std::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return BadUrl(url, "expected ':port' after ']'");
      port = after.substr(1);
      if (port.empty()) return BadUrl(url, "empty port");
    }
  } else if (size_t colon = rest.rfind(':'); colon != std::string_view::npos) {
    if (rest.find(':') != colon) return BadUrl(url, "IPv6 hosts must be written in brackets, e.g. [::1]:6379");
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
    if (port.empty()) return BadUrl(url, "empty port");
  }
  if (host.empty()) return BadUrl(url, "no host");
  o.host = std::string(host);
  if (!port.empty()) {
    int p = 0;
    auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
    if (ec != std::errc() || end != port.data() + port.size() || p < 1 || p > 65535) {
      return BadUrl(url, "port '" + std::string(port) + "' is not a number in 1..65535");
    }
    o.port = p;
  }
  return o;
}

uint16_t Crc16Xmodem(std::string_view data) {
  uint16_t crc = 0;
  for (unsigned char c : data) crc = static_cast<uint16_t>((crc << 8) ^ kCrc16Table[((crc >> 8) ^ c) & 0xff]);
  return crc;
}

int RedisClusterSlot(std::string_view key) {
  if (size_t open = key.find('{'); open != std::string_view::npos) {
    size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return Crc16Xmodem(key) & 16383;
}

// ---- hiredis plumbing ---------------------------------------------------------------------------

namespace {

constexpr int kSlotCount = 16384;
constexpr int kMaxRedirects = 5;

struct ReplyFree { void operator()(redisReply* r) const { freeReplyObject(r); } };
using Reply = std::unique_ptr<redisReply, ReplyFree>;
struct ContextFree { void operator()(redisContext* c) const { redisFree(c); } };
using Context = std::unique_ptr<redisContext, ContextFree>;

timeval ToTimeval(int ms) { return timeval{ms / 1000, (ms % 1000) * 1000}; }

// One command; arguments point at caller-owned bytes that outlive the round trip.
struct Command {
  int argc = 0;
  std::array<const char*, 8> argv{};
  std::array<size_t, 8> len{};
  Command& Arg(std::string_view s) {
    argv[argc] = s.data();
    len[argc] = s.size();
    ++argc;
    return *this;
  }
};

bool IsTimeout(const redisContext* c) {
  // hiredis reports an expired SO_RCVTIMEO/SO_SNDTIMEO as strerror(EAGAIN).
  return c->err == REDIS_ERR_IO &&
         (std::strstr(c->errstr, "temporarily unavailable") != nullptr ||
          std::strstr(c->errstr, "timed out") != nullptr);
}

bool IsError(const redisReply* r, std::string_view prefix) {
  return r->type == REDIS_REPLY_ERROR && std::string_view(r->str, r->len).substr(0, prefix.size()) == prefix;
}

// "host:port" of a MOVED/ASK target; an empty host means "the node you asked".
bool SplitHostPort(std::string_view s, std::string* host, int* port) {
  size_t colon = s.rfind(':');
  if (colon == std::string_view::npos) return false;
  *host = std::string(s.substr(0, colon));
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  auto [end, ec] = std::from_chars(s.data() + colon + 1, s.data() + s.size(), *port);
  return ec == std::errc() && end == s.data() + s.size() && *port > 0 && *port <= 65535;
}

struct Redirect {
  bool ask = false;
  int slot = -1, port = 0;
  std::string host;
};

// Parses "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381".
std::optional<Redirect> ParseRedirect(const redisReply* r) {
  bool moved = IsError(r, "MOVED ");
  if (!moved && !IsError(r, "ASK ")) return std::nullopt;
  std::string_view s(r->str, r->len);
  s.remove_prefix(moved ? 6 : 4);
  size_t space = s.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  Redirect d;
  d.ask = !moved;
  auto [end, ec] = std::from_chars(s.data(), s.data() + space, d.slot);
  if (ec != std::errc() || d.slot < 0 || d.slot >= kSlotCount) return std::nullopt;
  if (!SplitHostPort(s.substr(space + 1), &d.host, &d.port)) return std::nullopt;
  return d;
}

// A bounded pool of connections to one node.
class NodePool {
 public:
  NodePool(std::string host, int port, const RedisOptions& o)
      : host_(std::move(host)),
        port_(port),
        address_((host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_) + ":" + std::to_string(port)),
        connect_timeout_ms_(o.connect_timeout_ms),
        command_timeout_ms_(o.command_timeout_ms),
        max_connections_(o.max_connections) {}

  const std::string& address() const { return address_; }

  struct Lease {
    Context ctx;
    bool reused = false;      // came from the idle list: may have gone stale since
    uint64_t generation = 0;  // pool generation when handed out
  };

  // An idle connection, a new one while under max_connections, or waits for one to come back
  // (holders give them back within their own timeouts).
  Result<Lease> Borrow() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !idle_.empty() || open_ < max_connections_; });
    if (!idle_.empty()) {
      Lease l{std::move(idle_.back()), true, generation_};
      idle_.pop_back();
      return l;
    }
    ++open_;
    uint64_t generation = generation_;
    lock.unlock();
    Result<Context> ctx = Open();
    if (!ctx.ok()) {
      lock.lock();
      --open_;
      cv_.notify_one();
      return ctx.status();
    }
    return Lease{std::move(ctx).value(), false, generation};
  }

  void Return(Lease lease) {
    std::lock_guard<std::mutex> lock(mu_);
    if (lease.generation == generation_) {
      idle_.push_back(std::move(lease.ctx));
    } else {
      --open_;  // opened before the node failed; do not trust it
    }
    cv_.notify_one();
  }

  // The connection failed: close it and the idle ones too (after a restart they are all dead,
  // and each would otherwise cost a failed call).
  void Discard(Lease lease, const std::string& why) {
    std::vector<Context> dead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --open_;
      ++generation_;
      open_ -= static_cast<int>(idle_.size());
      dead.swap(idle_);
      cv_.notify_all();
    }
    if (!failed_.exchange(true)) Log().warn("{} (dropping its idle connections)", why);
  }

  // Unavailable naming the node and hiredis's reason.
  Status ErrorOf(const redisContext* c, std::string_view what) const {
    std::string reason = c->errstr[0] != '\0' ? c->errstr : "unknown hiredis error";
    if (IsTimeout(c)) reason = "timed out after " + std::to_string(command_timeout_ms_) + " ms (" + reason + ")";
    return Status::Unavailable("redis " + address_ + ": " + std::string(what) + ": " + reason);
  }

 private:
  Result<Context> Open() {
    Context c(redisConnectWithTimeout(host_.c_str(), port_, ToTimeval(connect_timeout_ms_)));
    if (c == nullptr) return Status::Unavailable("redis " + address_ + ": connect: out of memory");
    if (c->err != 0) {
      std::string why = c->errstr;
      if (!failed_.exchange(true)) Log().warn("redis {}: connect failed: {}", address_, why);
      return Status::Unavailable("redis " + address_ + ": connect: " + why);
    }
    if (redisSetTimeout(c.get(), ToTimeval(command_timeout_ms_)) != REDIS_OK) return ErrorOf(c.get(), "set timeout");
    redisEnableKeepAlive(c.get());  // notice a peer that vanished without a FIN
    if (failed_.exchange(false)) Log().info("redis {}: reconnected", address_);
    return c;
  }

  const std::string host_;
  const int port_;
  const std::string address_;
  const int connect_timeout_ms_;
  const int command_timeout_ms_;
  const int max_connections_;
  std::atomic<bool> failed_{false};  // logs once per outage, not per call
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Context> idle_;
  int open_ = 0;  // idle + borrowed
  uint64_t generation_ = 0;
};

// One node's share of a request: its commands and, after the round trip, their replies.
struct NodeBatch {
  NodePool* pool = nullptr;
  std::vector<Command> commands;
  std::vector<size_t> owners;  // per command: which caller key it serves
  std::vector<Reply> replies;
  Status status;
};

// The three phases of a round trip on one connection, split so that several nodes can be
// written to before any is read from.
Status Append(NodePool& pool, redisContext* c, const std::vector<Command>& commands) {
  for (const Command& cmd : commands) {
    if (redisAppendCommandArgv(c, cmd.argc, const_cast<const char**>(cmd.argv.data()), cmd.len.data()) != REDIS_OK) {
      return pool.ErrorOf(c, "append");
    }
  }
  return Status::Ok();
}

Status Flush(NodePool& pool, redisContext* c) {
  int done = 0;
  while (!done) {
    if (redisBufferWrite(c, &done) != REDIS_OK) return pool.ErrorOf(c, "write");
  }
  return Status::Ok();
}

Status ReadReplies(NodePool& pool, redisContext* c, size_t count, std::vector<Reply>* replies) {
  replies->clear();
  replies->reserve(count);
  for (size_t i = 0; i < count; ++i) {
    void* r = nullptr;
    if (redisGetReply(c, &r) != REDIS_OK || r == nullptr) return pool.ErrorOf(c, "read");
    replies->emplace_back(static_cast<redisReply*>(r));
  }
  return Status::Ok();
}

// One round trip of `commands` on `pool`. A failure on a reused idle connection (the server
// may have closed it, or restarted) is retried once on a fresh one; all our commands are
// idempotent. Timeouts are not retried: that would double the wait.
Result<std::vector<Reply>> RoundTrip(NodePool& pool, const std::vector<Command>& commands) {
  for (int attempt = 0;; ++attempt) {
    KEEL_ASSIGN_OR_RETURN(NodePool::Lease lease, pool.Borrow());
    redisContext* c = lease.ctx.get();
    std::vector<Reply> replies;
    Status s = Append(pool, c, commands);
    if (s.ok()) s = Flush(pool, c);
    if (s.ok()) s = ReadReplies(pool, c, commands.size(), &replies);
    if (s.ok()) {
      pool.Return(std::move(lease));
      return replies;
    }
    bool retry = lease.reused && attempt == 0 && !IsTimeout(c);
    pool.Discard(std::move(lease), s.message());
    if (!retry) return s;
  }
}

// Round trips for several nodes at once: borrow every connection (in address order, so two
// callers cannot each hold one pool while waiting on the other's), write all, then read all.
void RoundTripAll(std::vector<NodeBatch>& batches) {
  std::vector<NodeBatch*> order;
  for (NodeBatch& b : batches) order.push_back(&b);
  std::sort(order.begin(), order.end(),
            [](const NodeBatch* a, const NodeBatch* b) { return a->pool->address() < b->pool->address(); });
  std::vector<std::optional<NodePool::Lease>> leases(order.size());
  std::vector<bool> retry(order.size(), false);
  auto fail = [&](size_t i, Status s) {
    retry[i] = leases[i]->reused && !IsTimeout(leases[i]->ctx.get());
    order[i]->pool->Discard(std::move(*leases[i]), s.message());
    leases[i].reset();
    order[i]->status = std::move(s);
  };
  for (size_t i = 0; i < order.size(); ++i) {
    Result<NodePool::Lease> l = order[i]->pool->Borrow();
    if (!l.ok()) {
      order[i]->status = l.status();
      continue;
    }
    leases[i] = std::move(l).value();
    if (Status s = Append(*order[i]->pool, leases[i]->ctx.get(), order[i]->commands); !s.ok()) fail(i, s);
  }
  for (size_t i = 0; i < order.size(); ++i) {
    if (!leases[i]) continue;
    if (Status s = Flush(*order[i]->pool, leases[i]->ctx.get()); !s.ok()) fail(i, s);
  }
  for (size_t i = 0; i < order.size(); ++i) {
    if (!leases[i]) continue;
    Status s = ReadReplies(*order[i]->pool, leases[i]->ctx.get(), order[i]->commands.size(), &order[i]->replies);
    if (!s.ok()) {
      fail(i, s);
      continue;
    }
    order[i]->pool->Return(std::move(*leases[i]));
    leases[i].reset();
  }
  // A stale idle connection gets one more try, alone, now that nothing else is held.
  for (size_t i = 0; i < order.size(); ++i) {
    if (!retry[i]) continue;
    Result<std::vector<Reply>> r = RoundTrip(*order[i]->pool, order[i]->commands);
    order[i]->status = r.status();
    if (r.ok()) order[i]->replies = std::move(r).value();
  }
}

Status ReplyError(const NodePool& pool, std::string_view cmd, const redisReply* r) {
  std::string msg = "redis " + pool.address() + ": " + std::string(cmd) + ": ";
  if (r->type != REDIS_REPLY_ERROR) return Status::IOError(msg + "unexpected reply type " + std::to_string(r->type));
  std::string_view err(r->str, r->len);
  if (err.substr(0, 6) == "MOVED " || err.substr(0, 4) == "ASK ") {
    return Status::IOError(msg + std::string(err) +
                           " (the server is a cluster node: use cluster = true, redis+cluster://)");
  }
  if (err.substr(0, 11) == "CLUSTERDOWN" || err.substr(0, 8) == "TRYAGAIN" || err.substr(0, 7) == "LOADING") {
    return Status::Unavailable(msg + std::string(err));
  }
  return Status::IOError(msg + std::string(err));
}

constexpr std::string_view kHmget = "HMGET", kHexists = "HEXISTS", kPexpiretime = "PEXPIRETIME", kEval = "EVAL",
                           kDel = "DEL", kPing = "PING", kValueField = "v", kSeqField = "s";

// Writes are ordered by sequence number (tier.h) inside Redis itself, so instances sharing it
// and a write-behind that arrives late agree on the newest: each key is a hash {v: value,
// s: seq as 20 decimal digits (so that string order is number order)}, replaced only by a write
// whose s is not lower. A delete leaves a tombstone {s} for kTombstoneMs so an older write still
// in flight cannot resurrect the key. A key of another type (a plain string of an older Keel)
// is replaced.
constexpr std::string_view kPutScript = R"lua(
local t = redis.call('TYPE', KEYS[1]).ok
if t == 'hash' then
  local cur = redis.call('HGET', KEYS[1], 's')
  if cur and cur > ARGV[1] then return 0 end
elseif t ~= 'none' then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 's', ARGV[1])
if ARGV[3] ~= '0' then redis.call('PEXPIREAT', KEYS[1], ARGV[3]) else redis.call('PERSIST', KEYS[1]) end
return 1
)lua";
constexpr std::string_view kDeleteScript = R"lua(
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  local cur = redis.call('HGET', KEYS[1], 's')
  if cur and cur > ARGV[1] then return 0 end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 's', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
)lua";
constexpr int64_t kTombstoneMs = 10 * 60 * 1000;  // far longer than any write-behind delay

std::string SeqDigits(uint64_t seq) { return fmt::format("{:020}", seq); }

// A WRONGTYPE reply: the key holds a value in an older Keel's format, i.e. nothing readable.
bool IsWrongType(const redisReply* r) { return IsError(r, "WRONGTYPE"); }

// HMGET v s + PEXPIRETIME replies → the entry.
Result<Entry> DecodeEntry(const NodePool& pool, const redisReply* get, const redisReply* ttl) {
  if (IsWrongType(get)) return Status::NotFound("redis: no such key (a value in an older format)");
  if (get->type != REDIS_REPLY_ARRAY || get->elements != 2) return ReplyError(pool, "HMGET", get);
  const redisReply* value = get->element[0];
  const redisReply* seq = get->element[1];
  if (value->type == REDIS_REPLY_NIL) return Status::NotFound("redis: no such key");
  if (value->type != REDIS_REPLY_STRING) return ReplyError(pool, "HMGET", value);
  Entry e;
  if (seq->type == REDIS_REPLY_STRING) {
    std::string_view digits(seq->str, seq->len);
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), e.seq);
    if (ec != std::errc() || end != digits.data() + digits.size()) {
      return Status::Corruption("redis " + pool.address() + ": sequence field is not a number");
    }
  }
  if (ttl->type == REDIS_REPLY_INTEGER) {
    if (ttl->integer == -2) return Status::NotFound("redis: no such key");  // expired between the two
    if (ttl->integer > 0) e.expires_at_ms = ttl->integer;
  }  // an error here is a server before 7.0 without PEXPIRETIME: expiry unknown, report none
  std::shared_ptr<Blob> blob = Blob::Allocate(value->len);
  if (value->len > 0) std::memcpy(blob->data(), value->str, value->len);
  e.value = std::move(blob);
  return e;
}

// HEXISTS key v → whether a live value is there (a tombstone or an old-format value is not).
Result<bool> ContainsReply(const NodePool& pool, const redisReply* r, std::atomic<int64_t>& errors) {
  if (r->type == REDIS_REPLY_INTEGER) return r->integer > 0;
  if (IsWrongType(r)) return false;
  errors.fetch_add(1, std::memory_order_relaxed);
  return ReplyError(pool, "HEXISTS", r);
}

// Batch set-up: the prefixed keys, and invalid ones answered in place.
template <typename T>
void PrepareKeys(const std::string& prefix, const std::vector<std::string_view>& keys, std::vector<Result<T>>* out,
                 std::vector<std::string>* full, std::vector<bool>* valid) {
  out->assign(keys.size(), Result<T>(Status::Internal("redis: no reply")));
  full->resize(keys.size());
  valid->resize(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    Status s = ValidateKey(keys[i]);
    (*valid)[i] = s.ok();
    if (!s.ok()) (*out)[i] = s;
    else (*full)[i] = prefix + std::string(keys[i]);
  }
}

}  // namespace

// ---- RedisTier::Impl ----------------------------------------------------------------------------

class RedisTier::Impl {
 public:
  explicit Impl(const RedisOptions& o) : options_(o), slot_owner_(kSlotCount, nullptr) {
    seed_ = PoolFor(o.host, o.port);
  }

  const RedisOptions& options() const { return options_; }
  NodePool& seed() { return *seed_; }

  // The node owning `slot` (the seed when standalone or the slot is unknown) and the slot map
  // epoch it was read at.
  NodePool* Route(int slot, uint64_t* epoch) {
    std::shared_lock<std::shared_mutex> lock(map_mu_);
    *epoch = map_epoch_;
    if (!options_.cluster) return seed_;
    NodePool* p = slot_owner_[slot];
    return p != nullptr ? p : seed_;
  }

  NodePool* PoolFor(const std::string& host, int port) {
    std::lock_guard<std::shared_mutex> lock(map_mu_);
    return PoolForLocked(host, port);
  }

  // Fetches CLUSTER SLOTS (seed first, then every node we know) unless someone refreshed the
  // map after `seen_epoch`.
  Status RefreshSlotMap(uint64_t seen_epoch) {
    std::lock_guard<std::mutex> refresh_lock(refresh_mu_);
    std::vector<NodePool*> candidates{seed_};
    {
      std::shared_lock<std::shared_mutex> lock(map_mu_);
      if (map_epoch_ != seen_epoch) return Status::Ok();
      for (auto& [addr, pool] : pools_) {
        if (pool.get() != seed_) candidates.push_back(pool.get());
      }
    }
    static const std::string_view kCluster = "CLUSTER", kSlots = "SLOTS";
    std::vector<Command> cmd(1);
    cmd[0].Arg(kCluster).Arg(kSlots);
    Status last;
    for (NodePool* node : candidates) {
      Result<std::vector<Reply>> r = RoundTrip(*node, cmd);
      if (!r.ok()) {
        last = r.status();
        continue;
      }
      const redisReply* reply = (*r)[0].get();
      if (reply->type == REDIS_REPLY_ERROR) {
        std::string_view err(reply->str, reply->len);
        last = err.find("cluster support disabled") != std::string_view::npos
                   ? Status::InvalidArgument("redis " + node->address() + ": cluster = true but " + std::string(err))
                   : ReplyError(*node, "CLUSTER SLOTS", reply);
        continue;
      }
      last = InstallSlotMap(*node, reply);
      if (last.ok()) return last;
    }
    return last;
  }

  // MOVED: point the slot at its new owner (the full refresh may fail or lag).
  void SetSlotOwner(int slot, const std::string& host, int port) {
    std::lock_guard<std::shared_mutex> lock(map_mu_);
    slot_owner_[slot] = PoolForLocked(host.empty() ? options_.host : host, port);
  }

  void ForgetSlotMap() {
    std::lock_guard<std::shared_mutex> lock(map_mu_);
    std::fill(slot_owner_.begin(), slot_owner_.end(), nullptr);
    ++map_epoch_;
  }

  // Runs `commands` (all on keys of `slot`) where the slot lives, following MOVED and ASK.
  // *served_by: the node that answered (for error messages).
  Result<std::vector<Reply>> RunOnSlot(int slot, const std::vector<Command>& commands, NodePool** served_by) {
    uint64_t epoch = 0;
    NodePool* node = Route(slot, &epoch);
    bool asking = false;
    static const std::string_view kAsking = "ASKING";
    for (int hop = 0; hop <= kMaxRedirects; ++hop) {
      // ASKING holds for the next command only, so each command gets its own.
      std::vector<Command> sent;
      if (asking) {
        for (const Command& c : commands) {
          sent.emplace_back().Arg(kAsking);
          sent.push_back(c);
        }
      }
      KEEL_ASSIGN_OR_RETURN(std::vector<Reply> replies, RoundTrip(*node, asking ? sent : commands));
      if (asking) {
        std::vector<Reply> answers;
        for (size_t i = 1; i < replies.size(); i += 2) answers.push_back(std::move(replies[i]));
        replies = std::move(answers);
      }
      std::optional<Redirect> redirect;
      if (options_.cluster) {
        for (const Reply& r : replies) {
          if ((redirect = ParseRedirect(r.get()))) break;
        }
      }
      if (!redirect) {
        *served_by = node;
        return replies;
      }
      if (redirect->host.empty()) redirect->host = options_.host;
      if (redirect->ask) {
        ask_.fetch_add(1, std::memory_order_relaxed);
        node = PoolFor(redirect->host, redirect->port);
        asking = true;
      } else {
        moved_.fetch_add(1, std::memory_order_relaxed);
        if (Status s = RefreshSlotMap(epoch); !s.ok()) {
          Log().warn("redis: slot map refresh after MOVED failed: {}", s.ToString());
        }
        // After the refresh: the node that said MOVED knows better than a map that may lag it.
        SetSlotOwner(redirect->slot, redirect->host, redirect->port);
        node = Route(slot, &epoch);
        asking = false;
      }
    }
    return Status::Unavailable("redis: slot " + std::to_string(slot) + " still redirected after " +
                               std::to_string(kMaxRedirects) + " hops (cluster resharding?)");
  }

  // Groups per-key commands by owning node, for one pipelined round trip per node. `make`
  // appends the commands of key i (consecutive, so replies of one key stay together).
  template <typename MakeCommands>
  std::vector<NodeBatch> GroupByNode(const std::vector<std::string>& full_keys, const std::vector<bool>& valid,
                                     MakeCommands make) {
    std::vector<NodeBatch> batches;
    std::map<NodePool*, size_t> index;
    for (size_t i = 0; i < full_keys.size(); ++i) {
      if (!valid[i]) continue;
      uint64_t epoch;
      NodePool* node = Route(RedisClusterSlot(full_keys[i]), &epoch);
      auto [it, inserted] = index.emplace(node, batches.size());
      if (inserted) batches.emplace_back().pool = node;
      NodeBatch& b = batches[it->second];
      size_t before = b.commands.size();
      make(i, &b.commands);
      b.owners.insert(b.owners.end(), b.commands.size() - before, i);
    }
    return batches;
  }

  // One command on the key `full`; an error reply becomes its Status. Counts failures.
  Result<Reply> RunKeyCommand(const std::string& full, const Command& cmd, std::string_view name) {
    NodePool* node = nullptr;
    Result<std::vector<Reply>> r = RunOnSlot(RedisClusterSlot(full), {cmd}, &node);
    Status s = r.status();
    if (s.ok() && (*r)[0]->type == REDIS_REPLY_ERROR) s = ReplyError(*node, name, (*r)[0].get());
    if (!s.ok()) {
      errors.fetch_add(1, std::memory_order_relaxed);
      return s;
    }
    return std::move((*r)[0]);
  }

  void CountLookup(const Result<Entry>& e) {
    if (e.ok()) hits.fetch_add(1, std::memory_order_relaxed);
    else if (e.status().code() == StatusCode::kNotFound) misses.fetch_add(1, std::memory_order_relaxed);
    else errors.fetch_add(1, std::memory_order_relaxed);
  }

  std::atomic<int64_t> hits{0}, misses{0}, puts{0}, errors{0}, bytes{0}, stale_puts{0};
  std::atomic<int64_t> moved_{0}, ask_{0}, refreshes_{0};

 private:
  NodePool* PoolForLocked(const std::string& host, int port) {
    std::string key = host + ":" + std::to_string(port);
    auto it = pools_.find(key);
    if (it == pools_.end()) it = pools_.emplace(key, std::make_unique<NodePool>(host, port, options_)).first;
    return it->second.get();
  }

  // CLUSTER SLOTS: [[start, end, [ip, port, id, ...], replicas...], ...]; masters only.
  Status InstallSlotMap(const NodePool& from, const redisReply* reply) {
    auto bad = [&](const std::string& why) {
      return Status::IOError("redis " + from.address() + ": malformed CLUSTER SLOTS reply: " + why);
    };
    if (reply->type != REDIS_REPLY_ARRAY) return bad("not an array");
    struct Range {
      int start, end;
      std::string host;
      int port;
    };
    std::vector<Range> ranges;
    for (size_t i = 0; i < reply->elements; ++i) {
      const redisReply* e = reply->element[i];
      if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
          e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
          e->element[2]->elements < 2 || e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
          e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
        return bad("entry " + std::to_string(i));
      }
      Range r{static_cast<int>(e->element[0]->integer), static_cast<int>(e->element[1]->integer),
              std::string(e->element[2]->element[0]->str, e->element[2]->element[0]->len),
              static_cast<int>(e->element[2]->element[1]->integer)};
      if (r.start < 0 || r.end >= kSlotCount || r.start > r.end) return bad("slot range out of bounds");
      if (r.host.empty() || r.host == "?") r.host = options_.host;  // "the node you asked"
      ranges.push_back(std::move(r));
    }
    if (ranges.empty()) return Status::Unavailable("redis " + from.address() + ": no cluster slots assigned yet");
    std::lock_guard<std::shared_mutex> lock(map_mu_);
    std::fill(slot_owner_.begin(), slot_owner_.end(), nullptr);
    for (const Range& r : ranges) {
      NodePool* p = PoolForLocked(r.host, r.port);
      std::fill(slot_owner_.begin() + r.start, slot_owner_.begin() + r.end + 1, p);
    }
    ++map_epoch_;
    refreshes_.fetch_add(1, std::memory_order_relaxed);
    return Status::Ok();
  }

  const RedisOptions options_;
  NodePool* seed_ = nullptr;
  std::mutex refresh_mu_;          // one CLUSTER SLOTS fetch at a time
  mutable std::shared_mutex map_mu_;  // guards pools_, slot_owner_, map_epoch_
  std::map<std::string, std::unique_ptr<NodePool>> pools_;  // by "host:port"; never removed
  std::vector<NodePool*> slot_owner_;  // nullptr: unknown, ask the seed
  uint64_t map_epoch_ = 0;
};

// ---- RedisTier ----------------------------------------------------------------------------------

RedisTier::RedisTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisTier::~RedisTier() = default;

Result<std::unique_ptr<RedisTier>> RedisTier::Connect(const RedisOptions& o) {
  if (o.host.empty()) return Status::InvalidArgument("redis: empty host");
  if (o.port < 1 || o.port > 65535) {
    return Status::InvalidArgument("redis: port " + std::to_string(o.port) + " not in 1..65535");
  }
  if (o.connect_timeout_ms <= 0 || o.command_timeout_ms <= 0) {
    return Status::InvalidArgument("redis: connect_timeout_ms and command_timeout_ms must be > 0");
  }
  if (o.max_connections < 1) return Status::InvalidArgument("redis: max_connections must be >= 1");
  std::unique_ptr<RedisTier> tier(new RedisTier(std::make_unique<Impl>(o)));
  if (o.cluster) {
    KEEL_RETURN_IF_ERROR(tier->impl_->RefreshSlotMap(0));
  } else {
    std::vector<Command> ping(1);
    ping[0].Arg(kPing);
    KEEL_ASSIGN_OR_RETURN(std::vector<Reply> r, RoundTrip(tier->impl_->seed(), ping));
    if (r[0]->type == REDIS_REPLY_ERROR) return ReplyError(tier->impl_->seed(), "PING", r[0].get());
  }
  return tier;
}

const RedisOptions& RedisTier::options() const { return impl_->options(); }

Status RedisTier::Put(std::string_view key, const Entry& entry) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  if (entry.value == nullptr) return Status::InvalidArgument("redis: entry has no value");
  // Replacing with an already expired entry leaves only a tombstone behind.
  if (entry.expires_at_ms != 0 && entry.expires_at_ms <= NowUnixMs()) return DeleteAt(key, entry.seq);
  std::string full = impl_->options().key_prefix + std::string(key);
  const std::string seq = SeqDigits(entry.seq);
  const std::string expiry = std::to_string(entry.expires_at_ms);
  Command cmd;
  cmd.Arg(kEval).Arg(kPutScript).Arg("1").Arg(full).Arg(seq).Arg(entry.value->view()).Arg(expiry);
  KEEL_ASSIGN_OR_RETURN(Reply r, impl_->RunKeyCommand(full, cmd, "EVAL (put)"));
  if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) {
    impl_->stale_puts.fetch_add(1, std::memory_order_relaxed);
    return Status::Ok();
  }
  impl_->puts.fetch_add(1, std::memory_order_relaxed);
  impl_->bytes.fetch_add(static_cast<int64_t>(entry.value->size()), std::memory_order_relaxed);
  return Status::Ok();
}

Status RedisTier::DeleteAt(std::string_view key, uint64_t seq) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  std::string full = impl_->options().key_prefix + std::string(key);
  const std::string digits = SeqDigits(seq);
  const std::string ttl = std::to_string(kTombstoneMs);
  Command cmd;
  cmd.Arg(kEval).Arg(kDeleteScript).Arg("1").Arg(full).Arg(digits).Arg(ttl);
  KEEL_ASSIGN_OR_RETURN(Reply r, impl_->RunKeyCommand(full, cmd, "EVAL (delete)"));
  if (r->type == REDIS_REPLY_INTEGER && r->integer == 0) impl_->stale_puts.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

Result<Entry> RedisTier::Get(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  std::string full = impl_->options().key_prefix + std::string(key);
  std::vector<Command> cmds(2);
  cmds[0].Arg(kHmget).Arg(full).Arg(kValueField).Arg(kSeqField);
  cmds[1].Arg(kPexpiretime).Arg(full);
  NodePool* node = nullptr;
  Result<std::vector<Reply>> r = impl_->RunOnSlot(RedisClusterSlot(full), cmds, &node);
  Result<Entry> e = r.ok() ? DecodeEntry(*node, (*r)[0].get(), (*r)[1].get()) : Result<Entry>(r.status());
  impl_->CountLookup(e);
  return e;
}

Result<bool> RedisTier::Contains(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  std::string full = impl_->options().key_prefix + std::string(key);
  NodePool* node = nullptr;
  Result<std::vector<Reply>> r =
      impl_->RunOnSlot(RedisClusterSlot(full), {Command().Arg(kHexists).Arg(full).Arg(kValueField)}, &node);
  if (!r.ok()) {
    impl_->errors.fetch_add(1, std::memory_order_relaxed);
    return r.status();
  }
  return ContainsReply(*node, (*r)[0].get(), impl_->errors);
}

Status RedisTier::Delete(std::string_view key) {
  KEEL_RETURN_IF_ERROR(ValidateKey(key));
  std::string full = impl_->options().key_prefix + std::string(key);
  return impl_->RunKeyCommand(full, Command().Arg(kDel).Arg(full), kDel).status();
}

std::vector<Result<Entry>> RedisTier::GetMany(const std::vector<std::string_view>& keys) {
  std::vector<Result<Entry>> out;
  std::vector<std::string> full;
  std::vector<bool> valid;
  PrepareKeys(impl_->options().key_prefix, keys, &out, &full, &valid);
  std::vector<NodeBatch> batches = impl_->GroupByNode(full, valid, [&](size_t i, std::vector<Command>* cmds) {
    cmds->emplace_back().Arg(kHmget).Arg(full[i]).Arg(kValueField).Arg(kSeqField);
    cmds->emplace_back().Arg(kPexpiretime).Arg(full[i]);
  });
  RoundTripAll(batches);
  for (NodeBatch& b : batches) {
    for (size_t c = 0; c < b.commands.size(); c += 2) {
      size_t i = b.owners[c];
      if (!b.status.ok()) {
        out[i] = b.status;
        impl_->errors.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      if (impl_->options().cluster && (ParseRedirect(b.replies[c].get()) || ParseRedirect(b.replies[c + 1].get()))) {
        out[i] = Get(keys[i]);  // moved or migrating: the single-key path follows it (and counts)
        continue;
      }
      out[i] = DecodeEntry(*b.pool, b.replies[c].get(), b.replies[c + 1].get());
      impl_->CountLookup(out[i]);
    }
  }
  return out;
}

std::vector<Result<bool>> RedisTier::ContainsMany(const std::vector<std::string_view>& keys) {
  std::vector<Result<bool>> out;
  std::vector<std::string> full;
  std::vector<bool> valid;
  PrepareKeys(impl_->options().key_prefix, keys, &out, &full, &valid);
  std::vector<NodeBatch> batches = impl_->GroupByNode(full, valid, [&](size_t i, std::vector<Command>* cmds) {
    cmds->emplace_back().Arg(kHexists).Arg(full[i]).Arg(kValueField);
  });
  RoundTripAll(batches);
  for (NodeBatch& b : batches) {
    for (size_t c = 0; c < b.commands.size(); ++c) {
      size_t i = b.owners[c];
      if (!b.status.ok()) {
        out[i] = b.status;
        impl_->errors.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      const redisReply* r = b.replies[c].get();
      if (impl_->options().cluster && ParseRedirect(r)) {
        out[i] = Contains(keys[i]);
      } else {
        out[i] = ContainsReply(*b.pool, r, impl_->errors);
      }
    }
  }
  return out;
}

TierStats RedisTier::Stats() const {
  TierStats s;
  s.name = "redis";
  s.items = -1;
  s.bytes = impl_->bytes.load(std::memory_order_relaxed);
  s.hits = impl_->hits.load(std::memory_order_relaxed);
  s.misses = impl_->misses.load(std::memory_order_relaxed);
  s.puts = impl_->puts.load(std::memory_order_relaxed);
  s.stale_puts = impl_->stale_puts.load(std::memory_order_relaxed);
  s.errors = impl_->errors.load(std::memory_order_relaxed);
  return s;
}

RedisTier::ClusterCounters RedisTier::cluster_counters() const {
  return {impl_->moved_.load(std::memory_order_relaxed), impl_->ask_.load(std::memory_order_relaxed),
          impl_->refreshes_.load(std::memory_order_relaxed)};
}

void RedisTier::ForgetSlotMapForTesting() { impl_->ForgetSlotMap(); }

}  // namespace keel::kvstore
