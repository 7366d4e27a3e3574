// KvStoreLink: how one engine instance shares prefix KV with a `keel kvstore` server, so that
// instances reuse each other's prefills.
//
//  * Fetch (request threads, before a request is queued): the prompt's chunk keys (KvCache
//    chain: same tokens + same model/codec fingerprint = same keys on every instance) are looked
//    up past the chunks this instance already holds; PREFIX then MGET bring the longest stored
//    run. The whole lookup has a deadline; on any failure (store down, slow, corrupt reply) the
//    request simply computes everything, and the link backs off for `retry_after_ms` so a dead
//    store costs one timeout, not one per request.
//  * Adopt (scheduler thread, at admission): KvCache::AdoptChunks copies fetched blocks in.
//  * Publish (scheduler thread hands off, a background thread sends): after a prompt's prefill,
//    its new full chunks are pinned and queued; the publisher skips keys the store already has
//    and sends the rest pipelined, reading the pinned blocks in place (one piece per layer). The
//    scheduler unpins finished blocks at its next step. Publishing never delays a token: the
//    hand-off is O(chunks) and a full queue drops the job (counted).
//  * Values are bound to their keys: a published value is the chunk's block bytes followed by a
//    16-byte tag, XXH3-128(chunk key || block bytes). A fetched value whose tag does not match the
//    key it was fetched for (a store that mixed keys up, a value of the right shape written under
//    another key, bytes damaged in a tier without checksums) is refused and counted like any
//    other rejected chunk; the prompt is computed from there. By default the tag is not a MAC:
//    whoever can write to the store can forge it. With `tag_key` (`--kvstore-key-file`, the same
//    on every instance) it is HMAC-SHA256(tag_key, chunk key || block bytes) cut to 16 bytes, so
//    a writer without the key cannot make the engines use a value it wrote.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "keel/core/hash.h"
#include "keel/core/metrics.h"
#include "keel/engine/kv_cache.h"
#include "keel/kvstore/client.h"
#include "keel/kvstore/tier.h"

namespace keel::engine {

struct KvStoreLinkOptions {
  std::string address;             // "host:port" of `keel kvstore`
  int lookup_timeout_ms = 250;     // PREFIX + MGET for one prompt, together
  int publish_timeout_ms = 10000;  // one publish job
  int retry_after_ms = 2000;       // after a failure, the store is skipped this long
  int max_pinned_blocks = 0;       // blocks held for publishing at once; 0: a quarter of the cache
  int64_t ttl_ms = 0;              // TTL of published chunks (0: the store's default)
  std::string tag_key;             // non-empty: chunk tags are keyed (HMAC-SHA256); see above
};

// The tag after a stored chunk's block bytes (see above).
inline constexpr size_t kChunkTagBytes = sizeof(Hash128);
// The tag of a chunk under `key` whose block bytes are `pieces` (in order): XXH3-128, or with a
// non-empty `tag_key` HMAC-SHA256 cut to 16 bytes.
Hash128 ChunkTag(const Hash128& key, const std::vector<std::pair<const uint8_t*, size_t>>& pieces,
                 std::string_view tag_key = {});
// The block bytes of stored value `value` if its tag matches `key`; nullopt otherwise.
std::optional<std::string_view> CheckChunkTag(const Hash128& key, std::string_view value, std::string_view tag_key = {});

// Chunks of one prompt fetched from the store: values[i] is chunk first_chunk + i, as stored
// (tag included); chunks[i] is its block bytes, checked against its key (a view into values[i]).
struct FetchedPrefix {
  int first_chunk = 0;
  std::vector<kvstore::BlobPtr> values;
  std::vector<std::string_view> chunks;
};

struct KvStoreLinkStats {
  int64_t lookups = 0;
  int64_t fetched_chunks = 0;
  int64_t fetched_bytes = 0;
  int64_t adopted_tokens = 0;   // prompt tokens served from the store (not recomputed)
  int64_t published_chunks = 0;
  int64_t published_bytes = 0;
  int64_t skipped_existing = 0; // chunks the store already had
  int64_t dropped_jobs = 0;     // publish jobs dropped (queue full or store down)
  int64_t failures = 0;         // lookups or publishes that failed (store down, timeout, bad reply)
  int64_t rejected_chunks = 0;  // fetched values refused (wrong size, tag not of their key, or corrupt for the codec)
};

class KvStoreLink {
 public:
  // Parses the address; connects lazily (a store that is down at start is not an error).
  static Result<std::unique_ptr<KvStoreLink>> Create(const KvStoreLinkOptions& options, const KvCache& cache);
  ~KvStoreLink();
  KvStoreLink(const KvStoreLink&) = delete;
  KvStoreLink& operator=(const KvStoreLink&) = delete;

  // Any thread. Never fails: an empty result means "compute everything".
  std::shared_ptr<const FetchedPrefix> Fetch(const std::vector<int>& prompt);

  // Scheduler thread, after `seq` finished its prompt: publishes full chunks [first, last).
  void Publish(KvCache& cache, SeqId seq, int first_chunk, int last_chunk);
  // Scheduler thread: unpins blocks whose publishing finished.
  void ReleaseFinished(KvCache& cache);
  // Scheduler thread: records tokens adopted at admission.
  void CountAdopted(int tokens) { adopted_tokens_.fetch_add(tokens, std::memory_order_relaxed); }
  // Scheduler thread: records fetched chunks AdoptChunks refused.
  void CountRejected(int chunks) { rejected_chunks_.fetch_add(chunks, std::memory_order_relaxed); }
  // Blocks until queued publish jobs are done (tests, shutdown).
  void Flush();

  KvStoreLinkStats Stats() const;
  void RegisterMetrics(MetricsRegistry& registry);

 private:
  KvStoreLink(const KvStoreLinkOptions& options, const KvCache& cache) : options_(options), cache_(cache) {}
  struct Job {
    std::vector<std::pair<Hash128, int32_t>> chunks;
  };
  bool Healthy() const;
  void MarkFailed();
  void PublishLoop();
  Status PublishJob(kvstore::Client& client, const Job& job);

  KvStoreLinkOptions options_;
  const KvCache& cache_;
  std::string host_;
  int port_ = 0;

  std::mutex pool_mu_;  // idle clients for Fetch
  std::vector<std::unique_ptr<kvstore::Client>> pool_;
  std::atomic<int64_t> retry_at_ns_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Job> jobs_;
  std::vector<int32_t> finished_;  // blocks to unpin
  int pinned_ = 0;                 // scheduler thread
  bool busy_ = false;
  bool stop_ = false;
  std::thread publisher_;

  std::atomic<int64_t> lookups_{0}, fetched_chunks_{0}, fetched_bytes_{0}, adopted_tokens_{0}, published_chunks_{0},
      published_bytes_{0}, skipped_existing_{0}, dropped_jobs_{0}, failures_{0}, rejected_chunks_{0};
};

}  // namespace keel::engine
