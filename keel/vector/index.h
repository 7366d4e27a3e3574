// TextIndex: the ANN structure over a shard's text vectors, one FAISS index behind one interface
// (HNSW-Flat, IVF-Flat or IVF-PQ). Labels are dense and sequential: the n-th vector added gets
// label n, because FAISS 1.7.3's IndexIDMap cannot take per-query SearchParameters; the shard
// keeps its own label -> item id array. HNSW cannot remove, so deletes are tombstones that
// searches skip (through an IDSelector) until the shard rebuilds the index without them.
//
// An IVF index must be trained before it can hold vectors. Until `TrainSize()` vectors have
// arrived they sit in an exact flat index (searches are exact, which is what a small shard wants
// anyway); the Add that reaches TrainSize trains the quantizer on all of them and moves them in
// — or, with defer_training, leaves that to BuildTrained (which only reads the buffer, so the
// shard runs it without blocking searches) and InstallTrained (a swap under the shard's lock).
//
// Not thread-safe: the shard serialises Add/Tombstone/Save against Search with its own lock.
// Search itself only reads and may run concurrently with other Searches.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/shard.h"

namespace faiss {
struct Index;
}

namespace keel::vector {

struct IndexSearchParams {
  int k = 10;
  int ef = 0;      // HNSW efSearch; 0 = options default (raised to k when smaller)
  int nprobe = 0;  // IVF probes; 0 = options default (clamped to the list count)
  // Extra predicate on labels (attribute filters); tombstoned labels are always skipped.
  const std::function<bool(int64_t)>* accept = nullptr;
};

struct IndexHit {
  int64_t label = -1;
  float distance = 0;  // squared L2 as the index computes it (approximate for IVF-PQ)
};

class TextIndex {
 public:
  // InvalidArgument for a bad dimension or options (pq_m not dividing dim, lists < 1, ...).
  static Result<std::unique_ptr<TextIndex>> Create(const IndexOptions& options, int dim);
  // Restores what Save wrote. Corruption when the bytes do not parse or do not match `dim`.
  static Result<std::unique_ptr<TextIndex>> Load(const IndexOptions& options, int dim, std::string_view bytes);
  ~TextIndex();
  TextIndex(const TextIndex&) = delete;
  TextIndex& operator=(const TextIndex&) = delete;

  // Appends n vectors (n * dim floats); they get labels size() .. size()+n-1.
  Status Add(const float* x, int64_t n, bool defer_training = false);
  // IVF with TrainSize() vectors buffered and not trained yet.
  bool NeedsTraining() const { return !trained_ && size() >= TrainSize(); }
  // Trains an IVF index on the buffered vectors and adds them to it, kept aside until
  // InstallTrained. Reads the buffer only: Searches may run meanwhile, Add/Tombstone may not.
  Status BuildTrained();
  // Swaps the index built by BuildTrained in (tombstones carry over: labels are unchanged).
  void InstallTrained();
  // Marks a label deleted; searches never return it again. Out-of-range labels are ignored.
  void Tombstone(int64_t label);
  bool IsLive(int64_t label) const;

  // Up to k live, accepted labels nearest to q (dim floats), nearest first.
  Result<std::vector<IndexHit>> Search(const float* q, const IndexSearchParams& params) const;

  // The index, tombstones included, as bytes (FAISS's own serialisation inside a small header).
  Result<std::string> Save() const;

  int64_t size() const { return static_cast<int64_t>(live_.size()); }  // labels ever added
  int64_t tombstones() const { return tombstones_; }
  int64_t live() const { return size() - tombstones_; }
  bool trained() const { return trained_; }
  int lists() const { return lists_; }  // IVF lists in use (0 while untrained or for HNSW)
  int64_t TrainSize() const;            // IVF: vectors needed before training
  IndexKind kind() const { return options_.kind; }
  int dim() const { return dim_; }

 private:
  TextIndex(const IndexOptions& options, int dim);
  Status Train();  // IVF: builds the trained index from the flat buffer

  IndexOptions options_;
  int dim_;
  bool trained_ = false;   // HNSW is always "trained"
  int lists_ = 0;
  std::unique_ptr<faiss::Index> index_;  // HNSW, trained IVF, or the untrained flat buffer
  std::unique_ptr<faiss::Index> pending_;  // trained by BuildTrained, not installed yet
  int pending_lists_ = 0;
  std::vector<uint8_t> live_;            // per label: 1 live, 0 tombstoned
  int64_t tombstones_ = 0;
};

}  // namespace keel::vector
