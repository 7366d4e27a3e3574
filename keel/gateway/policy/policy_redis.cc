#include "keel/gateway/policy_redis.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

namespace keel::gateway {

namespace {

// KEYS[1]: the request marker; KEYS[2..n]: counter hashes.
// ARGV[1]: marker TTL (s), ARGV[2]: tokens, ARGV[3]: cost, ARGV[4..]: EXPIREAT per counter.
constexpr char kAddScript[] = R"lua(
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 2, #KEYS do
  redis.call('HINCRBY', KEYS[i], 'tokens', ARGV[2])
  redis.call('HINCRBYFLOAT', KEYS[i], 'cost', ARGV[3])
  redis.call('EXPIREAT', KEYS[i], ARGV[i + 2])
end
return 1
)lua";

constexpr int64_t kRequestMarkerTtl = 2 * 86400;  // longer than any gateway retries a batch

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

timeval ToTimeval(int ms) { return timeval{ms / 1000, (ms % 1000) * 1000}; }

std::string ReplyText(const redisReply* r) { return r->str != nullptr ? std::string(r->str, r->len) : std::string(); }

}  // namespace

Result<std::unique_ptr<SpendCounters>> SpendCounters::Connect(const std::string& url, std::string prefix,
                                                              int timeout_ms) {
  std::string_view rest = url;
  if (rest.rfind("redis://", 0) == 0) rest.remove_prefix(8);
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  std::string host(rest);
  int port = 6379;
  if (size_t colon = rest.rfind(':'); colon != std::string_view::npos) {
    host = std::string(rest.substr(0, colon));
    std::string_view p = rest.substr(colon + 1);
    auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
    if (ec != std::errc() || end != p.data() + p.size() || port < 1 || port > 65535) {
      return Status::InvalidArgument(fmt::format("redis url '{}': bad port", url));
    }
  }
  if (host.empty() || host.find_first_of("/@") != std::string::npos) {
    return Status::InvalidArgument(fmt::format("redis url '{}': want host:port or redis://host:port", url));
  }
  std::unique_ptr<SpendCounters> c(new SpendCounters(host, port, std::move(prefix), timeout_ms));
  std::lock_guard<std::mutex> lock(c->mu_);
  KEEL_RETURN_IF_ERROR(c->EnsureConnected());
  return c;
}

SpendCounters::SpendCounters(std::string host, int port, std::string prefix, int timeout_ms)
    : host_(std::move(host)), port_(port), prefix_(std::move(prefix)), timeout_ms_(timeout_ms) {}

SpendCounters::~SpendCounters() { Drop(); }

void SpendCounters::Drop() {
  if (ctx_ != nullptr) redisFree(ctx_);
  ctx_ = nullptr;
}

Status SpendCounters::EnsureConnected() {
  if (ctx_ != nullptr && ctx_->err == 0) return Status::Ok();
  Drop();
  ctx_ = redisConnectWithTimeout(host_.c_str(), port_, ToTimeval(timeout_ms_));
  if (ctx_ == nullptr || ctx_->err != 0) {
    std::string why = ctx_ != nullptr ? ctx_->errstr : "out of memory";
    Drop();
    return Status::Unavailable(fmt::format("redis {}:{}: {}", host_, port_, why));
  }
  redisSetTimeout(ctx_, ToTimeval(timeout_ms_));
  Reply pong(static_cast<redisReply*>(redisCommand(ctx_, "PING")));
  if (!pong || pong->type == REDIS_REPLY_ERROR) {
    std::string why = pong ? ReplyText(pong.get()) : std::string(ctx_->errstr);
    Drop();
    return Status::Unavailable(fmt::format("redis {}:{}: PING: {}", host_, port_, why));
  }
  return Status::Ok();
}

std::string SpendCounters::CounterKey(const std::string& scope, const std::string& subject, const std::string& window,
                                      int64_t window_start_unix) const {
  return fmt::format("{}spend:{}:{}:{}:{}", prefix_, scope, subject, window == "daily" ? "d" : "m", window_start_unix);
}

Status SpendCounters::AddAll(const std::vector<Add>& adds, std::vector<bool>* counted) {
  counted->assign(adds.size(), false);
  if (adds.empty()) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  KEEL_RETURN_IF_ERROR(EnsureConnected());
  const std::string ttl = std::to_string(kRequestMarkerTtl);
  for (const Add& a : adds) {
    std::vector<std::string> args = {"EVAL", kAddScript, std::to_string(a.counters.size() + 1),
                                     prefix_ + "req:" + a.request_id};
    for (const std::string& k : a.counters) args.push_back(k);
    args.push_back(ttl);
    args.push_back(std::to_string(a.tokens));
    args.push_back(fmt::format("{}", a.cost));
    for (int64_t e : a.expire_at) args.push_back(std::to_string(e));
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& s : args) {
      argv.push_back(s.data());
      lens.push_back(s.size());
    }
    if (redisAppendCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK) {
      Drop();
      return Status::Unavailable("redis: cannot queue a command");
    }
  }
  Status first_error;
  for (size_t i = 0; i < adds.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) {
      Status s = Status::Unavailable(fmt::format("redis {}:{}: {}", host_, port_, ctx_->errstr));
      Drop();  // the pipeline is out of step; the next call reconnects
      return s;
    }
    Reply r(static_cast<redisReply*>(raw));
    if (r->type == REDIS_REPLY_INTEGER) {
      (*counted)[i] = r->integer == 1;
    } else if (first_error.ok()) {
      first_error = Status::Unavailable(fmt::format("redis: spend script: {}", ReplyText(r.get())));
    }
  }
  return first_error;
}

Result<std::vector<SpendCounters::Totals>> SpendCounters::Get(const std::vector<std::string>& counters) {
  std::vector<Totals> out(counters.size());
  if (counters.empty()) return out;
  std::lock_guard<std::mutex> lock(mu_);
  KEEL_RETURN_IF_ERROR(EnsureConnected());
  for (const std::string& k : counters) {
    const char* argv[] = {"HMGET", k.data(), "tokens", "cost"};
    const size_t lens[] = {5, k.size(), 6, 4};
    if (redisAppendCommandArgv(ctx_, 4, argv, lens) != REDIS_OK) {
      Drop();
      return Status::Unavailable("redis: cannot queue a command");
    }
  }
  for (size_t i = 0; i < counters.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) {
      Status s = Status::Unavailable(fmt::format("redis {}:{}: {}", host_, port_, ctx_->errstr));
      Drop();
      return s;
    }
    Reply r(static_cast<redisReply*>(raw));
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2) {
      Drop();  // replies still queued; start over on the next call
      return Status::Unavailable(fmt::format("redis: HMGET {}: unexpected reply {}", counters[i], ReplyText(r.get())));
    }
    if (r->element[0]->type == REDIS_REPLY_STRING) out[i].tokens = std::strtoll(r->element[0]->str, nullptr, 10);
    if (r->element[1]->type == REDIS_REPLY_STRING) out[i].cost = std::strtod(r->element[1]->str, nullptr);
  }
  return out;
}

}  // namespace keel::gateway
