// keel::vector: one vector shard. Items carry a text vector (searched through a FAISS index) and
// an image vector (fetched by id after the search, optionally used to rerank), plus string
// attributes for filters. The full-precision vectors that queries read live in a
// coloc::TieredStore (DRAM / SSD / cold / Redis); the FAISS index is the search structure.
//
// Query kinds:
//   text       : ANN search on the text index (k' = max(k, rerank) candidates, rerank per
//                request, default ShardOptions::rerank), fetch the
//                candidates' text vectors from the tiers, rerank by exact L2, return top k.
//   multimodal : as text, then also fetch the top k's image vectors (in the same Fetch as the
//                candidates' text vectors when no rerank is needed, i.e. candidates == k; else a
//                second Fetch); with an image query, the hits are re-ordered by image distance.
//   image      : image-only lookup: fetch the image vectors of the given ids.
// Every query's fetched keys go to the query log that placement learns from.
//
// Durability: Upsert/Delete append to a write-ahead log and fsync it before they return (one
// fsync per call, so batch). Snapshot() writes the index and the items (ids, vectors,
// attributes) to files with magic, version, sizes and XXH3 checksums, then truncates the log.
// Open() loads the snapshot, replays the log (a torn tail is cut; a checksum mismatch inside the
// log is Corruption naming file and offset) and repopulates the tiers.
//
// Versions: the index version counts the writes applied (every successful Upsert or Delete call,
// an empty one included, is one; a rejected one is none). The snapshot stores it and replaying
// the log adds one per record, so it survives restarts. A replica's writes may carry the version
// the router gave them: version <= current is a duplicate (nothing applied), current + 1 applies,
// anything later is a gap (refused until the replica catches up). The log since the last
// snapshot is readable by version (ReadLog) and a peer's log applies through ApplyLog: the
// replication stream of keel/vector/records.h. Writes, ReadLog and ApplyLog take one lock in turn,
// so versions follow the log's order; searches never wait for them except while a write's
// changes are put into memory.
// Thread-safe: searches run concurrently with each other and with writes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/coloc/placement.h"
#include "keel/vector/coloc/tiered_store.h"

namespace keel::vector {

enum class IndexKind { kHnsw, kIvfFlat, kIvfPq };
Result<IndexKind> ParseIndexKind(std::string_view name);  // "hnsw" | "ivf-flat" | "ivf-pq"
std::string_view IndexKindName(IndexKind kind);

struct IndexOptions {
  IndexKind kind = IndexKind::kHnsw;
  int hnsw_m = 32;
  int hnsw_ef_construction = 80;
  int hnsw_ef_search = 64;      // default per query; a request may override (ef)
  int ivf_lists = 1024;         // clamped for small shards (the index trains on the first upserts)
  int ivf_nprobe = 16;          // default per query; a request may override (nprobe)
  int pq_m = 16;                // IVF-PQ sub-quantizers (must divide text_dim)
  int pq_bits = 8;
  // Seed of HNSW's level generator (12345 is FAISS's own). Replicas given different seeds build
  // different graphs from the same writes, so their approximate answers are independent.
  int64_t hnsw_seed = 12345;
};

struct ShardOptions {
  std::string dir;              // snapshot + write-ahead log; created if missing
  int text_dim = 128;
  int image_dim = 128;
  IndexOptions index;
  coloc::TieredStoreOptions tiers;
  int max_k = 1000;             // larger k is InvalidArgument
  int rerank = 32;              // ANN candidates fetched and reranked exactly (>= k); the
                                // default of a request's own `rerank` (SearchRequest)
  bool wal_sync = true;         // fsync the log before acknowledging a write
  size_t query_log_window = 100000;
};

struct Item {
  uint64_t id = 0;
  std::vector<float> text;      // text_dim floats, finite
  std::vector<float> image;     // image_dim floats, finite; empty = no image vector
  std::map<std::string, std::string> attributes;
};

// InvalidArgument naming `where` and `what` unless v has `dim` finite values whose squared length
// keeps every L2 distance finite in float32 (the check every item and query vector passes).
Status CheckVector(const std::vector<float>& v, int dim, const char* what, const std::string& where);

enum class QueryKind { kText, kMultimodal, kImage };

struct SearchRequest {
  QueryKind kind = QueryKind::kText;
  std::vector<float> text_query;            // text and multimodal
  std::vector<float> image_query;           // optional for multimodal: rerank by image distance
  std::vector<uint64_t> ids;                // image lookup
  int k = 10;
  int ef = 0;                               // 0 = index default
  int nprobe = 0;                           // 0 = index default
  // ANN candidates reranked by exact distance: max(k, rerank) are fetched, the best k returned.
  // -1 = ShardOptions::rerank; 0..k = no rerank beyond k (what a HiLO level with rerank off asks).
  // At most max(max_k, ShardOptions::rerank): each candidate costs a tier read.
  int rerank = -1;
  std::map<std::string, std::string> filter;  // every attribute must equal
  bool include_vectors = false;
};

struct SearchHit {
  uint64_t id = 0;
  float text_distance = 0;   // exact squared L2 to text_query (text, multimodal)
  float image_distance = 0;  // exact squared L2 to image_query (multimodal with image_query)
  std::vector<float> text;   // when include_vectors
  std::vector<float> image;  // when include_vectors (multimodal, image)
};

struct SearchResult {
  std::vector<SearchHit> hits;
  coloc::FetchTrace trace;   // union over the query's fetches
  int64_t search_ns = 0;     // ANN search
  int64_t fetch_ns = 0;      // tier reads
  uint64_t index_version = 0;  // writes applied to the state the search read
};

struct ShardStats {
  int64_t items = 0;
  int64_t deleted_pending = 0;   // tombstoned in the index, removed at the next rebuild
  int64_t wal_bytes = 0;
  int64_t searches = 0;
  int64_t cross_tier_searches = 0;
  uint64_t index_version = 0;      // writes applied
  uint64_t log_start_version = 0;  // the log holds versions after this one (the last snapshot's)
  std::vector<coloc::TierUsage> tiers;
};

// What a versioned write did.
struct WriteOutcome {
  uint64_t version = 0;    // the shard's index version after the call
  bool duplicate = false;  // the write's version was already applied: nothing was done
  bool gap = false;        // the write's version is beyond version + 1: refused (Unavailable)
};

// A piece of the log read for a peer (ReadLog).
struct LogRead {
  std::string bytes;            // replication stream records (records.h)
  uint64_t records = 0;
  uint64_t version = 0;         // the shard's index version when read
  uint64_t log_start = 0;       // versions up to this one are no longer in the log
  bool truncated = false;       // `after` < log_start: the versions asked for are gone
};

// What ApplyLog did, also on error (the records before a bad one stay applied).
struct LogApplied {
  uint64_t version = 0;         // the shard's index version afterwards
  uint64_t applied = 0;         // records applied
  uint64_t skipped = 0;         // records at or below the version already held
  bool gap = false;             // a record's version was beyond version + 1 (Unavailable)
};

class Shard {
 public:
  static Result<std::unique_ptr<Shard>> Open(const ShardOptions& options);
  ~Shard();

  // InvalidArgument (wrong dimension, NaN/inf, duplicate id in one batch) before anything is
  // written: a rejected batch changes nothing.
  Status Upsert(std::span<const Item> items);
  Status Delete(std::span<const uint64_t> ids);  // unknown ids are ignored
  // The same with the version the write must get (nullopt: the next one). A duplicate is OK
  // with outcome->duplicate; a gap is Unavailable ("stale: replica at version V, write is
  // version W") with outcome->gap. `outcome` (optional) is filled in every case.
  Status Upsert(std::span<const Item> items, std::optional<uint64_t> version, WriteOutcome* outcome);
  Status Delete(std::span<const uint64_t> ids, std::optional<uint64_t> version, WriteOutcome* outcome);

  // Index version: writes applied.
  uint64_t version() const;
  // The writes with versions after `after`, as replication records, up to `max_bytes` of them
  // (always at least one when there is one). NotFound with out->truncated when a snapshot has
  // dropped version after + 1 from the log; Corruption when the log file is damaged.
  Status ReadLog(uint64_t after, size_t max_bytes, LogRead* out) const;
  // Applies a replication stream in order: records at or below the current version are skipped,
  // the next version is applied (logged, as a write), a later one stops with Unavailable and
  // out->gap. A truncated or corrupt record, or one whose write is invalid for this shard, stops
  // with InvalidArgument naming its byte offset; nothing after it is applied.
  Status ApplyLog(std::string_view stream, LogApplied* out);
  Result<SearchResult> Search(const SearchRequest& request);
  Status Snapshot();
  ShardStats Stats() const;

  const ShardOptions& options() const;
  coloc::TieredStore& store();
  coloc::QueryLog& query_log();

 private:
  Shard() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::vector
