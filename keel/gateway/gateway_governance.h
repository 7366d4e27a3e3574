// The gateway's side of governance: a TTL cache of KeyDecisions (refreshed in the background at
// half their TTL, served stale when the policy service is down), local budget accounting
// (reserve before a request, settle after it) and the usage reporter that sends settled usage
// to the policy service in batches. Thread-safe; coroutines on any io thread may call it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "keel/core/metrics.h"
#include "keel/gateway/async_http.h"
#include "keel/gateway/policy.h"

namespace keel::gateway {

struct GovernanceOptions {
  std::string policy_socket;
  double policy_timeout_seconds = 0.5;
  size_t max_cached_keys = 100000;
  size_t max_queued_usage = 100000;  // records kept while the policy service is down
};

// What a request holds between Reserve and Settle.
struct Reservation {
  std::vector<std::string> budget_ids;
  int64_t tokens = 0;
  double cost = 0;
};

class Governance {
 public:
  enum class Source { kFresh, kCached, kStale };
  struct Lookup {
    std::shared_ptr<const KeyDecision> decision;  // null: policy service unreachable, key not cached
    Source source = Source::kFresh;
    Status error;      // why the service could not answer (when it could not)
    uint64_t ack_generation = 0;  // usage batches acknowledged before the decision was asked for
  };

  Governance(boost::asio::io_context& io, GovernanceOptions options, MetricsRegistry& metrics);
  ~Governance();

  // The decision for `key_hash`: cached when fresh (a refresh starts in the background past half
  // the TTL), fetched when missing or expired; when the fetch fails a cached decision is served
  // stale, otherwise `decision` is null.
  Task<Lookup> Resolve(const std::string& key_hash);

  // Reserves `tokens`/`cost` against every budget of the decision. On exhaustion returns
  // ResourceExhausted naming the budget (scope, subject, window, spent/limit) and reserves
  // nothing.
  // Spent = the decision's figure + usage acknowledged by the policy service after the decision
  // was asked for + usage settled here but not yet acknowledged + reservations in flight.
  // `denial` (optional) says, on exhaustion, when waiting could help.
  struct Denial {
    int64_t retry_after_seconds = -1;  // until the exhausted budget's window rolls over; -1: no window
    bool retry_helps = false;          // windowed, and the request fits the budget once it is empty
  };
  Status Reserve(const Lookup& lookup, int64_t tokens, double cost, Reservation* out, Denial* denial = nullptr);
  // Replaces the reservation by the actual usage and queues the usage record.
  void Settle(const Reservation& reservation, UsageRecord record);
  // Drops a reservation without usage (request failed before any tokens were spent).
  void Release(const Reservation& reservation);

  // Sends queued usage (one batch); OK when nothing was queued.
  Task<Status> Flush();
  size_t queued_usage() const;

 private:
  struct Entry {
    std::shared_ptr<const KeyDecision> decision;
    std::chrono::steady_clock::time_point fetched;
    std::chrono::steady_clock::time_point expires;
    uint64_t ack_generation = 0;  // ack_generation_ when the decision was asked for
    bool refreshing = false;
    // When a fetch for this key last failed (policy service down or hung); none after a success.
    std::optional<std::chrono::steady_clock::time_point> failed_at;
  };
  // After a failed fetch, requests for that key are served its stale decision at once for this
  // long while one background refresh retries: a hung policy service must not add its whole
  // timeout to every request.
  static constexpr std::chrono::seconds kStaleAfterFailure{2};
  // Usage of one acknowledged batch for one budget: a decision asked for before the batch was
  // acknowledged does not include it yet.
  struct Acked {
    uint64_t generation;
    int64_t tokens;
    double cost;
  };
  struct BudgetLocal {
    int64_t pending_tokens = 0;  // reserved by requests in flight
    double pending_cost = 0;
    int64_t unreported_tokens = 0;  // settled, not yet acknowledged by the policy service
    double unreported_cost = 0;
    std::deque<Acked> acked;        // recent acknowledged batches (bounded)
  };
  struct QueuedUsage {
    UsageRecord record;
    std::vector<std::string> budget_ids;
  };

  Task<Result<KeyDecision>> Fetch(const std::string& key_hash);
  Task<void> Refresh(std::string key_hash);
  void Store(const std::string& key_hash, KeyDecision decision, uint64_t ack_generation);
  uint64_t AckGeneration() const;

  boost::asio::io_context& io_;
  GovernanceOptions options_;
  HttpClient client_;
  CounterFamily& cache_lookups_;
  CounterFamily& policy_unavailable_;
  CounterFamily& usage_records_;
  CounterFamily& budget_denied_;

  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> cache_;
  std::map<std::string, BudgetLocal> budgets_;
  std::deque<QueuedUsage> queue_;
  bool flushing_ = false;
  uint64_t ack_generation_ = 0;  // successful usage batches so far
};

}  // namespace keel::gateway
