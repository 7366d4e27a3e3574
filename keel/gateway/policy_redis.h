// SpendCounters: budget spend kept in Redis so that every policy instance pointed at the same
// Redis adds to, and reads, the same totals (layout in policy_store.h). One connection behind a
// mutex, reconnected after an error; every call is bounded by the timeout. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "keel/core/status.h"

struct redisContext;

namespace keel::gateway {

class SpendCounters {
 public:
  // url: "host:port", "host" (port 6379) or "redis://host[:port]". Unavailable when Redis does
  // not answer PING; InvalidArgument for a URL it cannot read.
  static Result<std::unique_ptr<SpendCounters>> Connect(const std::string& url, std::string prefix, int timeout_ms);
  ~SpendCounters();
  SpendCounters(const SpendCounters&) = delete;
  SpendCounters& operator=(const SpendCounters&) = delete;

  // "<prefix>spend:<scope>:<subject>:<d|m>:<window_start_unix>"
  std::string CounterKey(const std::string& scope, const std::string& subject, const std::string& window,
                         int64_t window_start_unix) const;

  struct Add {
    std::string request_id;
    std::vector<std::string> counters;  // hashes to add to
    std::vector<int64_t> expire_at;     // unix seconds, one per counter
    int64_t tokens = 0;
    double cost = 0;
  };
  // Adds each record to its counters unless its request id was counted before (by anyone);
  // (*counted)[i] tells which were. Per record atomic (a Lua script), pipelined per batch.
  // Unavailable on a Redis error; records before the failure may already be counted, and
  // sending them again counts them as duplicates.
  Status AddAll(const std::vector<Add>& adds, std::vector<bool>* counted);

  struct Totals {
    int64_t tokens = 0;
    double cost = 0;
  };
  Result<std::vector<Totals>> Get(const std::vector<std::string>& counters);

 private:
  SpendCounters(std::string host, int port, std::string prefix, int timeout_ms);
  Status EnsureConnected();  // mu_ held
  void Drop();               // mu_ held

  const std::string host_;
  const int port_;
  const std::string prefix_;
  const int timeout_ms_;
  std::mutex mu_;
  redisContext* ctx_ = nullptr;
};

}  // namespace keel::gateway
