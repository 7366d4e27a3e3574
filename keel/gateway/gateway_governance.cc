#include "keel/gateway/gateway_governance.h"

#include <ctime>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <nlohmann/json.hpp>

#include "keel/core/log.h"

namespace keel::gateway {
namespace {

ClientOptions PolicyClientOptions(double timeout) {
  ClientOptions o;
  o.connect_timeout_seconds = timeout;
  o.response_timeout_seconds = timeout;
  o.read_timeout_seconds = timeout;
  o.max_response_bytes = 4 << 20;
  return o;
}

std::string BudgetLabel(const BudgetState& b) {
  std::string s = b.window + " budget of " + b.scope + " " + b.subject;
  if (!b.budget_id.empty()) s += " (" + b.budget_id + ")";
  return s;
}

}  // namespace

Governance::Governance(boost::asio::io_context& io, GovernanceOptions options, MetricsRegistry& metrics)
    : io_(io),
      options_(std::move(options)),
      client_(io, PolicyClientOptions(options_.policy_timeout_seconds)),
      cache_lookups_(metrics.AddCounter("keel_gateway_decision_lookups_total",
                                        "Key decisions by where they came from (fresh fetch, cache, stale cache).",
                                        {"source"})),
      policy_unavailable_(metrics.AddCounter("keel_gateway_policy_unavailable_total",
                                             "Calls to the policy service that failed, by call.", {"call"})),
      usage_records_(metrics.AddCounter("keel_gateway_usage_records_total",
                                        "Usage records by outcome (queued, sent, dropped).", {"outcome"})),
      budget_denied_(metrics.AddCounter("keel_gateway_budget_denied_total", "Requests refused for budget.")) {}

Governance::~Governance() = default;

Task<Result<KeyDecision>> Governance::Fetch(const std::string& key_hash) {
  ClientRequest req;
  req.method = "POST";
  req.url = "unix:" + options_.policy_socket + ":/v1/resolve";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = nlohmann::json{{"key_hash", key_hash}}.dump();
  auto resp = co_await client_.Fetch(std::move(req));
  if (!resp.ok()) co_return resp.status();
  if (resp->status != 200) {
    co_return Status::Unavailable("policy service answered " + std::to_string(resp->status));
  }
  co_return KeyDecisionFromJson(resp->body);
}

uint64_t Governance::AckGeneration() const {
  std::lock_guard lock(mu_);
  return ack_generation_;
}

void Governance::Store(const std::string& key_hash, KeyDecision decision, uint64_t ack_generation) {
  const auto now = std::chrono::steady_clock::now();
  const auto ttl = std::chrono::milliseconds(std::max<int64_t>(decision.ttl_ms, 0));
  std::lock_guard lock(mu_);
  if (cache_.size() >= options_.max_cached_keys && !cache_.count(key_hash)) {
    // Bounded: drop expired entries first, then an arbitrary one.
    for (auto it = cache_.begin(); it != cache_.end();) {
      it = it->second.expires < now ? cache_.erase(it) : std::next(it);
    }
    if (cache_.size() >= options_.max_cached_keys) cache_.erase(cache_.begin());
  }
  Entry& e = cache_[key_hash];
  e.decision = std::make_shared<const KeyDecision>(std::move(decision));
  e.fetched = now;
  e.expires = now + ttl;
  e.ack_generation = ack_generation;
  e.refreshing = false;
  e.failed_at.reset();
}

Task<void> Governance::Refresh(std::string key_hash) {
  const uint64_t generation = AckGeneration();
  auto fetched = co_await Fetch(key_hash);
  if (fetched.ok()) {
    Store(key_hash, std::move(fetched).value(), generation);
    co_return;
  }
  policy_unavailable_.WithLabels({"refresh"}).Inc();
  Log().warn("gateway: policy service unavailable during a background refresh: {}", fetched.status().ToString());
  std::lock_guard lock(mu_);
  if (auto it = cache_.find(key_hash); it != cache_.end()) {
    it->second.refreshing = false;
    it->second.failed_at = std::chrono::steady_clock::now();
  }
}

Task<Governance::Lookup> Governance::Resolve(const std::string& key_hash) {
  const auto now = std::chrono::steady_clock::now();
  std::shared_ptr<const KeyDecision> cached;
  uint64_t cached_generation = 0;
  {
    std::lock_guard lock(mu_);
    auto it = cache_.find(key_hash);
    if (it != cache_.end()) {
      Entry& e = it->second;
      if (now < e.expires) {
        // Past half the TTL: refresh in the background so steady traffic never waits.
        if (!e.refreshing && now - e.fetched > (e.expires - e.fetched) / 2) {
          e.refreshing = true;
          boost::asio::co_spawn(io_, Refresh(key_hash), boost::asio::detached);
        }
        cache_lookups_.WithLabels({"cache"}).Inc();
        co_return Lookup{e.decision, Source::kCached, Status::Ok(), e.ack_generation};
      }
      cached = e.decision;
      cached_generation = e.ack_generation;
      if (e.failed_at && now - *e.failed_at < kStaleAfterFailure) {
        // The service failed this key moments ago: answer from the stale decision now, and let
        // one background refresh (not every request) find out whether it is back.
        if (!e.refreshing) {
          e.refreshing = true;
          boost::asio::co_spawn(io_, Refresh(key_hash), boost::asio::detached);
        }
        cache_lookups_.WithLabels({"stale"}).Inc();
        co_return Lookup{cached, Source::kStale, Status::Unavailable("policy service failed moments ago"),
                         cached_generation};
      }
    }
  }
  const uint64_t generation = AckGeneration();
  auto fetched = co_await Fetch(key_hash);
  if (fetched.ok()) {
    Store(key_hash, std::move(fetched).value(), generation);
    std::lock_guard lock(mu_);
    cache_lookups_.WithLabels({"fresh"}).Inc();
    co_return Lookup{cache_[key_hash].decision, Source::kFresh, Status::Ok(), generation};
  }
  policy_unavailable_.WithLabels({"resolve"}).Inc();
  if (cached) {
    {
      std::lock_guard lock(mu_);
      if (auto it = cache_.find(key_hash); it != cache_.end()) it->second.failed_at = std::chrono::steady_clock::now();
    }
    Log().warn("gateway: policy service unavailable ({}); serving a cached decision past its TTL",
               fetched.status().ToString());
    cache_lookups_.WithLabels({"stale"}).Inc();
    co_return Lookup{cached, Source::kStale, fetched.status(), cached_generation};
  }
  Log().warn("gateway: policy service unavailable ({}); refusing an uncached key", fetched.status().ToString());
  co_return Lookup{nullptr, Source::kFresh, fetched.status(), 0};
}

Status Governance::Reserve(const Lookup& lookup, int64_t tokens, double cost, Reservation* out, Denial* denial) {
  const KeyDecision& decision = *lookup.decision;
  const int64_t now_unix = static_cast<int64_t>(std::time(nullptr));
  std::lock_guard lock(mu_);
  for (const BudgetState& b : decision.budgets) {
    // A window that ended since the decision was made starts from zero.
    const bool rolled = b.window_end_unix > 0 && now_unix >= b.window_end_unix;
    const BudgetLocal& local = budgets_[b.budget_id];
    int64_t spent_tokens = (rolled ? 0 : b.spent_tokens) + local.unreported_tokens + local.pending_tokens;
    double spent_cost = (rolled ? 0 : b.spent_cost) + local.unreported_cost + local.pending_cost;
    for (const Acked& a : local.acked) {
      if (a.generation > lookup.ack_generation) {
        spent_tokens += a.tokens;
        spent_cost += a.cost;
      }
    }
    if (denial) {
      const bool windowed = b.window_end_unix > 0;
      denial->retry_after_seconds = windowed ? std::max<int64_t>(1, b.window_end_unix - now_unix) : -1;
      // Waiting helps only when the window rolls over and the request fits an empty budget.
      denial->retry_helps = windowed && (b.limit_tokens < 0 || tokens <= b.limit_tokens) &&
                            (b.limit_cost < 0 || cost <= b.limit_cost);
    }
    if (b.limit_tokens >= 0 && spent_tokens + tokens > b.limit_tokens) {
      budget_denied_.Get().Inc();
      return Status::ResourceExhausted(BudgetLabel(b) + " exhausted: " + std::to_string(spent_tokens) + " of " +
                                       std::to_string(b.limit_tokens) + " tokens used, this request needs " +
                                       std::to_string(tokens));
    }
    if (b.limit_cost >= 0 && spent_cost + cost > b.limit_cost) {
      budget_denied_.Get().Inc();
      char buf[160];
      std::snprintf(buf, sizeof(buf), " exhausted: $%.6f of $%.6f spent, this request needs up to $%.6f", spent_cost,
                    b.limit_cost, cost);
      return Status::ResourceExhausted(BudgetLabel(b) + buf);
    }
  }
  out->budget_ids.clear();
  for (const BudgetState& b : decision.budgets) {
    BudgetLocal& local = budgets_[b.budget_id];
    local.pending_tokens += tokens;
    local.pending_cost += cost;
    out->budget_ids.push_back(b.budget_id);
  }
  out->tokens = tokens;
  out->cost = cost;
  return Status::Ok();
}

void Governance::Release(const Reservation& r) {
  std::lock_guard lock(mu_);
  for (const std::string& id : r.budget_ids) {
    BudgetLocal& local = budgets_[id];
    local.pending_tokens -= r.tokens;
    local.pending_cost -= r.cost;
  }
}

void Governance::Settle(const Reservation& r, UsageRecord record) {
  std::lock_guard lock(mu_);
  const int64_t tokens = record.input_tokens + record.output_tokens;
  for (const std::string& id : r.budget_ids) {
    BudgetLocal& local = budgets_[id];
    local.pending_tokens -= r.tokens;
    local.pending_cost -= r.cost;
    local.unreported_tokens += tokens;
    local.unreported_cost += record.cost;
  }
  if (queue_.size() >= options_.max_queued_usage) {
    usage_records_.WithLabels({"dropped"}).Inc();
    Log().error("gateway: usage queue full ({} records); dropping the oldest record", queue_.size());
    queue_.pop_front();
  }
  usage_records_.WithLabels({"queued"}).Inc();
  queue_.push_back(QueuedUsage{std::move(record), r.budget_ids});
}

size_t Governance::queued_usage() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

Task<Status> Governance::Flush() {
  std::vector<QueuedUsage> batch;
  {
    std::lock_guard lock(mu_);
    if (flushing_ || queue_.empty()) co_return Status::Ok();
    flushing_ = true;
    const size_t n = std::min<size_t>(queue_.size(), 1000);
    batch.assign(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.begin() + n));
    queue_.erase(queue_.begin(), queue_.begin() + n);
  }
  std::vector<UsageRecord> records;
  records.reserve(batch.size());
  for (const QueuedUsage& q : batch) records.push_back(q.record);
  ClientRequest req;
  req.method = "POST";
  req.url = "unix:" + options_.policy_socket + ":/v1/usage";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = UsageBatchToJson(records);
  auto resp = co_await client_.Fetch(std::move(req));
  Status status = Status::Ok();
  if (!resp.ok()) {
    status = resp.status();
  } else if (resp->status == 400) {
    // The service refused the batch as malformed: retrying it would fail forever. Say so loudly
    // and drop it (its reservations were already settled locally).
    Log().error("gateway: policy service rejected a usage batch of {} records: {}", batch.size(),
                resp->body.substr(0, 300));
    usage_records_.WithLabels({"rejected"}).Inc(static_cast<double>(batch.size()));
  } else if (resp->status != 200) {
    status = Status::Unavailable("policy service answered " + std::to_string(resp->status) + " to a usage batch");
  }
  std::lock_guard lock(mu_);
  flushing_ = false;
  if (!status.ok()) {
    // Keep the records (in order, ahead of newer ones); the service dedupes by request_id.
    policy_unavailable_.WithLabels({"usage"}).Inc();
    for (auto it = batch.rbegin(); it != batch.rend(); ++it) queue_.push_front(std::move(*it));
    while (queue_.size() > options_.max_queued_usage) {
      usage_records_.WithLabels({"dropped"}).Inc();
      queue_.pop_front();
    }
    co_return status;
  }
  // The batch moves from "not yet acknowledged" to "acknowledged at this generation": decisions
  // asked for before now still count it locally, later ones get it from the service.
  const uint64_t generation = ++ack_generation_;
  std::map<std::string, Acked> per_budget;
  for (const QueuedUsage& q : batch) {
    const int64_t tokens = q.record.input_tokens + q.record.output_tokens;
    for (const std::string& id : q.budget_ids) {
      BudgetLocal& local = budgets_[id];
      local.unreported_tokens -= tokens;
      local.unreported_cost -= q.record.cost;
      Acked& a = per_budget.try_emplace(id, Acked{generation, 0, 0}).first->second;
      a.tokens += tokens;
      a.cost += q.record.cost;
    }
  }
  // Keep what a cached decision may still lack: batches newer than the oldest cached decision
  // (bounded, so a decision older than kMaxAcked batches undercounts rather than growing memory).
  uint64_t oldest = generation;
  for (const auto& [hash, e] : cache_) oldest = std::min(oldest, e.ack_generation);
  constexpr size_t kMaxAcked = 1024;
  for (auto& [id, a] : per_budget) {
    BudgetLocal& local = budgets_[id];
    local.acked.push_back(a);
    while (!local.acked.empty() && (local.acked.front().generation <= oldest || local.acked.size() > kMaxAcked)) {
      local.acked.pop_front();
    }
  }
  usage_records_.WithLabels({"sent"}).Inc(static_cast<double>(batch.size()));
  co_return Status::Ok();
}

}  // namespace keel::gateway
