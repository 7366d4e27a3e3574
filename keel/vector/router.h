// Router: what `keel vector-router` runs — one HTTP front over S shards x R replicas (each a
// `keel vector` with an identity), exposing the API of one shard (keel/vector/service.h) plus
// verification of what the replicas answer (TrustANN, keel/vector/trust/verifier.h).
//
//   POST /v1/upsert, /v1/delete   items/ids split by trust::ShardOf(id, S); per shard one write at
//       a time, numbered with the shard's next version and sent to every replica in parallel;
//       acknowledged when a majority applied it, else 503 naming the replicas that did not. A
//       replica answering 409 (it missed writes) is caught up from a peer's log (GET /v1/log on
//       the peer, POST /v1/log to it) and the write re-sent.
//       -> {"upserted"|"deleted": n, "shards":[{"shard","version","applied":[ids]}]}
//   POST /v1/search   text and multimodal queries fan out to every shard, image lookups to the
//       shards owning the ids; each shard request carries a fresh nonce. Per shard, mode trust:
//       the Verifier over signed replies (keel/vector/replica_reply.h says what is refused);
//       mode plain: the first valid reply of `plain_fanout` replicas, signatures unchecked.
//       Shards merge by (text_distance, id) cut to k (then, with an image query, re-ranked by
//       image distance, as one shard ranks). -> the shard answer plus "verified": bool (every
//       shard verified; always false in plain mode) and "shards":[{"shard","status":
//       "verified"|"unverified"|"unchecked","reason","replicas":[ids],"index_version"}]. A shard
//       without a valid reply: in trust mode it is "unverified" (the verifier's reason says
//       why) and the answer is 200; in plain mode, which has no verdict to carry the hole, 503.
//   POST /v1/snapshot   every replica snapshots (503 naming any that failed)
//   GET /v1/stats ("hilo_state": null without a HiLO link), /healthz, /metrics
//
// HiLO (RouterOptions::hilo): a router applies its state's vector `fanout` and nothing else. The
// replicas have links of their own and clamp nprobe/k/rerank themselves, so the router forwards a
// client's request unchanged. Plain mode asks PlainFanout(level, R) replicas per shard at first
// (in place of plain_fanout), and the next ones only when all of those failed. Trust mode ignores
// the level's fanout: how many replicas answer is the verifier's quorum and zone rule, and asking
// fewer than the quorum saves nothing (the verifier escalates to reach it) while a load
// controller must not be able to weaken verification. Search answers carry x-keel-hilo-state.
// Searches are metered on the link as in keel/vector/service.h (the server's own 503s folded in
// as shed); writes, snapshots and stats are not.
//
// Versions: a shard's committed version is the highest a majority of its replicas applied; a
// search reply from an older index is stale. At start the router reads every replica's
// /v1/stats; a background loop repeats that every `sync_interval_ms` and catches laggards up.
//
// Start/Stop are for one owner thread; requests are served concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/core/metrics.h"
#include "keel/core/status.h"
#include "keel/hilo/service_link.h"
#include "keel/vector/hilo_link.h"
#include "keel/vector/replica_client.h"
#include "keel/vector/trust/verifier.h"

namespace keel::vector {

enum class RouterMode { kTrust, kPlain };

struct RouterReplica {
  std::string id;          // unique in the cluster; the id the replica signs with
  std::string url;         // http://host:port
  std::string zone;        // failure domain
  std::string public_key;  // PEM file (trust mode), resolved against the config file's directory
};

struct RouterShard {
  uint32_t id = 0;  // shards are 0..S-1, in order
  std::vector<RouterReplica> replicas;
};

struct RouterOptions {
  std::string host = "127.0.0.1";
  int port = 7403;  // 0 = any free port
  int text_dim = 128;
  int image_dim = 128;
  int max_k = 1000;
  RouterMode mode = RouterMode::kTrust;
  trust::VerifierOptions trust;  // its deadline also bounds plain-mode searches
  int plain_fanout = 0;          // replicas asked per shard in plain mode; 0 = all
  std::vector<RouterShard> shards;

  size_t max_body_bytes = size_t{64} << 20;
  size_t max_json_values = size_t{4} << 20;  // per client body and per replica answer
  int max_connections = 128;
  int max_active_requests = 256;   // HTTP handler threads (searches served at once)
  int write_timeout_ms = 10000;    // one write, log read or log post to one replica
  int stats_timeout_ms = 1000;     // one /v1/stats read
  int sync_interval_ms = 1000;     // background stats + catch-up; 0 = no loop
  size_t log_batch_bytes = size_t{16} << 20;  // max_bytes of one GET /v1/log during catch-up
  int call_threads = 0;            // replica calls in flight at once; 0 = 16 x replicas within [128, 1024]
  ReplicaClientOptions client;
  // The HiLO link whose state's fanout plain-mode searches apply (started and stopped by its
  // owner). Null: plain_fanout. Its workers should be max_active_requests.
  std::shared_ptr<hilo::ServiceLink> hilo;

  // InvalidArgument naming the field: dimensions, k, shard ids 0..S-1, replica ids unique,
  // urls, zones, keys present in trust mode, verifier options.
  Status Validate() const;
};

// Reads the cluster config (JSON; see docs and the header above):
//   {"text_dim":128,"image_dim":128,"max_k":1000,"mode":"trust"|"plain",
//    "trust":{"quorum":2,"min_zones":2,"threshold":0.95,"overlap_weight":0.5,"fanout":0,
//             "depth":1.0,"deadline_ms":1000,"hedge_ms":100},
//    "plain":{"fanout":0}, "host":"127.0.0.1", "port":7403,
//    "shards":[{"id":0,"replicas":[{"id":"s0-a","url":"http://127.0.0.1:7410","zone":"a",
//                                   "public_key":"keys/s0-a.pub"}, ...]}, ...]}
// Unknown keys are refused (a typo must not silently fall back to a default). NotFound / IOError
// for the file; InvalidArgument naming the file and the field ("shards[1].replicas[0].url: ...").
Result<RouterOptions> LoadRouterConfig(const std::string& path);
// The same from text; relative key paths resolve against `base_dir`.
Result<RouterOptions> ParseRouterConfig(std::string_view text, const std::string& base_dir);

class Router {
 public:
  // Loads the replicas' public keys (trust mode), reads every replica's version, starts the HTTP
  // server and the sync loop. Errors: Validate's, the key files', IOError when the address
  // cannot be bound. Unreachable replicas are not an error (the loop keeps trying).
  static Result<std::unique_ptr<Router>> Start(const RouterOptions& options);
  ~Router();  // Stop()
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // Stops the HTTP server (draining requests in progress) and the sync loop. Idempotent.
  void Stop();
  int port() const;
  MetricsRegistry& metrics();
  // One round of the sync loop now: read every replica's version, catch laggards up.
  void SyncNow();

  class Impl;

 private:
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `keel vector-router --config F [--host H] [--port P]`: loads, starts, serves until SIGINT or
// SIGTERM. Returns the process exit code (2 for a bad config).
int RunVectorRouterMain(const std::string& config_path, const std::string& host_override, int port_override);
// The same following HiLO (`--hilo URL` or `--hilo-catalog F --hilo-state S`, keel/vector/hilo_link.h).
int RunVectorRouterMain(const std::string& config_path, const std::string& host_override, int port_override,
                        const HiloLinkFlags& hilo);

}  // namespace keel::vector
