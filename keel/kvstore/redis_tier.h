// RedisTier: the shared, cross-instance tier of the KV cache, backed by Redis (standalone or
// Redis Cluster) through hiredis.
//
// Each key is stored as the Redis hash `key_prefix + key` = {v: the value bytes unchanged,
// s: the write's sequence number as 20 decimal digits}, written by a Lua script that refuses a
// write older than the stored one (tier.h: ordering), atomically inside Redis, so every instance
// sharing the server and every late write-behind agree on the newest write. DeleteAt leaves a
// tombstone {s} for 10 minutes for the same reason; Delete is an unordered DEL. An entry with
// expires_at_ms is given PEXPIREAT, so Redis itself expires it. Get reads the expiry back with
// PEXPIRETIME (Redis >= 7.0; older servers give expires_at_ms = 0). A key holding another type
// (a plain string written by an older Keel) reads as absent and is replaced by the next Put.
//
// Thread-safe. Each node gets a small connection pool (created lazily, up to max_connections);
// a connection that fails is closed together with the node's idle ones, and the next call
// reconnects, so the tier recovers by itself when Redis comes back. Every failure to reach a
// node (refused, timed out, dropped mid-reply) is Unavailable naming host:port and the hiredis
// error; no call blocks longer than the connect/command timeouts (per round trip).
//
// Cluster (cluster = true): the slot of a key is CRC16(key) mod 16384 exactly as Redis computes
// it, over the full prefixed key. The slot map comes from CLUSTER SLOTS and is refreshed on a
// MOVED reply; ASK is followed with ASKING. Hash tags: by default the tier adds none, so the
// chunks of one namespace spread over the whole cluster (best for capacity and load). A user
// who wants every key of a namespace on one node (e.g. to MULTI over them) puts a tag in the
// prefix, e.g. key_prefix = "keel:{model7}:" - then only the "{model7}" part is hashed.
// GetMany/ContainsMany pipeline: keys are grouped by node and each node gets one round trip,
// all nodes in parallel.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/kvstore/tier.h"

namespace keel::kvstore {

struct RedisOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  int connect_timeout_ms = 200;
  int command_timeout_ms = 500;  // per round trip (read or write of one request/batch)
  std::string key_prefix = "keel:kv:";
  bool cluster = false;          // seed node of a Redis Cluster; follow slots and redirects
  int max_connections = 8;       // per node
};

// "host:port", "redis://host:port" or "redis+cluster://host:port" (cluster = true); the port
// defaults to 6379, IPv6 hosts go in brackets ("[::1]:6379"). Other fields keep their
// defaults. InvalidArgument naming what is wrong otherwise (credentials and database paths are
// not supported).
Result<RedisOptions> ParseRedisUrl(std::string_view url);

// CRC16-XMODEM (poly 0x1021, init 0), the checksum Redis Cluster hashes keys with.
uint16_t Crc16Xmodem(std::string_view data);
// The cluster slot of `key`: CRC16 of the first non-empty {hash tag} if there is one, else of
// the whole key, mod 16384.
int RedisClusterSlot(std::string_view key);

class RedisTier : public Tier {
 public:
  // Connects to the seed node (PING, or CLUSTER SLOTS with cluster = true). Unavailable when
  // it cannot be reached; InvalidArgument for bad options or a non-cluster server with
  // cluster = true.
  static Result<std::unique_ptr<RedisTier>> Connect(const RedisOptions& options);
  ~RedisTier() override;
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  std::string_view name() const override { return "redis"; }
  Status Put(std::string_view key, const Entry& entry) override;
  Result<Entry> Get(std::string_view key) override;
  Result<bool> Contains(std::string_view key) override;
  Status Delete(std::string_view key) override;
  // A delete ordered as write `seq`: ignored when the key holds a newer write.
  Status DeleteAt(std::string_view key, uint64_t seq);
  // items = -1 (DBSIZE would count other users' keys); bytes = value bytes written so far.
  TierStats Stats() const override;
  std::vector<Result<Entry>> GetMany(const std::vector<std::string_view>& keys) override;
  std::vector<Result<bool>> ContainsMany(const std::vector<std::string_view>& keys) override;

  const RedisOptions& options() const;

  // Cluster bookkeeping, for metrics and tests.
  struct ClusterCounters {
    int64_t moved = 0;           // MOVED replies followed
    int64_t ask = 0;             // ASK replies followed
    int64_t map_refreshes = 0;   // successful CLUSTER SLOTS fetches
  };
  ClusterCounters cluster_counters() const;
  // Forgets the slot map so every key goes to the seed node until a MOVED refreshes it (tests).
  void ForgetSlotMapForTesting();

 private:
  class Impl;
  explicit RedisTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::kvstore
