// KvCache: paged K/V storage for every sequence of one engine instance.
//
// Memory is one arena per layer cut into fixed-size blocks (block_tokens tokens each); a block id
// means the same token range in every layer. Each sequence has a block table. Blocks are
// refcounted: a full block is registered under its chunk key, a hash chain over token chunks
//   key_i = XXH3-128(key_{i-1} || token ids of chunk i || fingerprint)
// where the fingerprint covers the model checksum, the codec and its parameters and the block
// layout. A new sequence whose prompt starts with registered chunks reuses those blocks instead
// of recomputing them. Blocks whose refcount drops to zero stay cached (and findable) until the
// allocator needs them, least recently released first.
//
// The byte budget is fixed at creation; allocation beyond it fails with ResourceExhausted and a
// message giving the numbers. Not thread-safe: one scheduler thread owns the cache; the block
// pointers it hands out may be read by worker threads during a forward step.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <unordered_map>
#include <vector>

#include "keel/core/hash.h"
#include "keel/core/page_arena.h"
#include "keel/core/status.h"
#include "keel/engine/model.h"
#include "keel/kv/codec.h"

namespace keel::engine {

using SeqId = int64_t;

struct KvCacheOptions {
  size_t budget_bytes = 256ull << 20;  // all layers, K and V
  int block_tokens = 16;
  bool prefix_sharing = true;
};

struct KvCacheStats {
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;      // referenced by at least one sequence
  int64_t blocks_cached = 0;    // unreferenced but still holding a registered prefix
  int64_t prefix_hit_tokens = 0;    // prompt tokens served from shared blocks, cumulative
  int64_t prefix_lookup_tokens = 0; // prompt tokens looked up, cumulative
};

class KvCache {
 public:
  // codec_spec: see kv::MakeCodec. InvalidArgument for a bad spec; ResourceExhausted when the
  // budget cannot hold even one block per layer.
  static Result<std::unique_ptr<KvCache>> Create(const Model& model, const std::string& codec_spec,
                                                 const KvCacheOptions& options);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Starts a sequence. Reuses registered blocks for the longest chain of full chunks of
  // `prompt`, leaving at least the last prompt token to compute. Returns how many leading
  // prompt tokens are already in the cache (a multiple of block_tokens).
  Result<int> BeginSequence(SeqId seq, const std::vector<int>& prompt);
  // Ensures blocks exist for positions [0, n_tokens). ResourceExhausted if the budget is spent;
  // the sequence keeps what it had.
  Status Reserve(SeqId seq, int n_tokens);
  // Records that tokens (their K/V now stored) occupy positions [len, len + n); registers any
  // block that became full under its chunk key.
  void Commit(SeqId seq, const int* tokens, int n);
  // Drops the sequence; its blocks' refcounts fall and unreferenced blocks become cached/free.
  void Release(SeqId seq);

  // Block pointers of `seq` for `layer`, in position order (valid until the next Reserve/Release).
  const uint8_t* const* LayerBlocks(SeqId seq, int layer);
  // Block holding position `pos` of `seq` in `layer`, and the slot inside it.
  uint8_t* BlockFor(SeqId seq, int layer, int pos, int* slot);

  int SequenceLength(SeqId seq) const;
  // Positions with blocks reserved for `seq` (0 for an unknown sequence).
  int Capacity(SeqId seq) const;
  // Blocks a sequence of n tokens needs.
  int64_t BlocksFor(int n_tokens) const { return (n_tokens + block_tokens_ - 1) / block_tokens_; }
  // Blocks in the budget; fixed at creation, so safe to read from any thread.
  int64_t TotalBlocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Blocks that could be handed out now (free + cached).
  int64_t AvailableBlocks() const;
  KvCacheStats Stats() const;

  const kv::Codec& codec() const { return *codec_; }
  int block_tokens() const { return block_tokens_; }
  size_t budget_bytes() const { return budget_bytes_; }
  // Fingerprint string hashed into every chunk key.
  const std::string& fingerprint() const { return fingerprint_; }
  // The chunk-key chain for `tokens` (one key per full chunk); deterministic across processes.
  // Thread-safe.
  std::vector<Hash128> ChunkKeys(const int* tokens, int n) const;

  // ---- Sharing chunks with a kvstore (kvstore_link.h) ----
  // A chunk value is every layer's block of one chunk, in layer order: ChunkValueBytes() bytes.
  size_t ChunkValueBytes() const { return chunk_value_bytes_; }
  // Thread-safe hint: whether `key` is registered now (it may be evicted by the next step).
  bool HasChunk(const Hash128& key) const;
  // Right after BeginSequence: appends fetched chunk values as the sequence's next blocks.
  // `values[i]` holds chunk `first_chunk + i` of `prompt`; only the chunks that directly follow
  // what the sequence already has are used, and at least the last prompt token is left to
  // compute. Each adopted block is registered under its chunk key. Returns the tokens adopted
  // (0 when nothing fits or the chunks do not continue the sequence); InvalidArgument when a
  // value has the wrong size; ResourceExhausted leaves the sequence as it was.
  Result<int> AdoptChunks(SeqId seq, const std::vector<int>& prompt, int first_chunk,
                          const std::vector<std::string_view>& values);
  // Pins the full blocks of chunks [first, last) of `seq` so that another thread may read them
  // (ChunkPieces) after the sequence is gone; each pinned block must be Unpin()ned later, on
  // the cache's thread. Returns (chunk key, block) pairs.
  std::vector<std::pair<Hash128, int32_t>> PinChunks(SeqId seq, int first, int last);
  void Unpin(int32_t block) { Unref(block); }
  // The bytes of a block, one piece per layer (arena memory never moves). Thread-safe.
  std::vector<std::pair<const uint8_t*, size_t>> ChunkPieces(int32_t block) const;

 private:
  KvCache() = default;
  struct Sequence {
    std::vector<int32_t> blocks;
    std::vector<std::vector<const uint8_t*>> layer_ptrs;  // cached pointer tables per layer
    std::vector<int> tokens;
    Hash128 last_key;   // key of the last registered full chunk
    int registered = 0; // full chunks registered
  };
  struct Block {
    int refcount = 0;
    bool has_key = false;
    Hash128 key;
    std::list<int32_t>::iterator lru;  // position in cached_ when refcount == 0 && has_key
  };
  Result<int32_t> Allocate();
  void Unref(int32_t block);
  void Ref(int32_t block);
  void RefreshPointers(Sequence& s);
  uint8_t* BlockData(int layer, int32_t block) { return arenas_[layer].data() + layer_bytes_[layer] * block; }
  Hash128 NextKey(const Hash128& parent, const int* chunk) const;
  const uint8_t* BlockData(int layer, int32_t block) const {
    return arenas_[layer].data() + layer_bytes_[layer] * block;
  }

  std::unique_ptr<kv::Codec> codec_;
  int n_layers_ = 0;
  int block_tokens_ = 16;
  bool prefix_sharing_ = true;
  size_t budget_bytes_ = 0;
  std::vector<size_t> layer_bytes_;
  std::vector<PageArena> arenas_;  // one per layer, huge-page advised
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;       // never-registered free blocks
  std::list<int32_t> cached_;       // unreferenced registered blocks, oldest first
  // Written only on the cache's thread; keys_mu_ guards those writes against HasChunk readers.
  std::unordered_map<Hash128, int32_t, Hash128Hasher> by_key_;
  mutable std::mutex keys_mu_;
  size_t chunk_value_bytes_ = 0;
  std::unordered_map<SeqId, Sequence> seqs_;
  std::string fingerprint_;
  Hash128 fingerprint_hash_;
  int64_t used_ = 0;
  int64_t hit_tokens_ = 0;
  int64_t lookup_tokens_ = 0;
};

}  // namespace keel::engine
