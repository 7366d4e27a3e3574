// KvCache: paged K/V storage for every sequence of one engine instance.
//
// Memory is one arena holding blocks (block_tokens tokens each; each layer group of a block -- see
// kv::Codec: a layer for per-layer codecs -- in a range of its own); a block id means the same
// token range in every layer. A block is allocated at
// the codec's worst-case size; when its last token is committed and the codec
// has a compact form (zipfusion), the block moves to a range of its stored size, so the budget
// holds as many more tokens as the data compresses. Each sequence has a block table. Blocks are
// refcounted: a full block is registered under its chunk key, a hash chain over token chunks
//   key_i = XXH3-128(key_{i-1} || token ids of chunk i || fingerprint)
// where the fingerprint covers the model checksum, the codec and its parameters, the block
// layout and the stored value's format (KvStoreLink's key tag), so values written in an older
// format are never looked up. A new sequence whose prompt starts with registered chunks reuses
// those blocks instead of recomputing them. Blocks whose refcount drops to zero stay cached (and findable) until the
// allocator needs them, least recently released first.
//
// The byte budget is fixed at creation; allocation beyond it (after evicting cached prefixes)
// fails with ResourceExhausted and a message giving the numbers. Not thread-safe: one scheduler thread owns the cache; the block
// pointers it hands out may be read by worker threads during a forward step.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <unordered_map>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/hash.h"
#include "keel/core/page_arena.h"
#include "keel/core/range_allocator.h"
#include "keel/core/status.h"
#include "keel/engine/model.h"
#include "keel/kv/codec.h"

namespace keel::engine {

using SeqId = int64_t;

struct KvCacheOptions {
  size_t budget_bytes = 256ull << 20;  // all layers, K and V
  int block_tokens = 16;
  bool prefix_sharing = true;
  // Named codec parameters (kv::CodecContext::params), e.g. {"bellows": "/path/model.bkv"}.
  std::map<std::string, std::string> codec_params;
};

// The codec a cache for `model` would use: shape and context from the model and options.
Result<std::unique_ptr<kv::Codec>> MakeCacheCodec(const Model& model, const std::string& codec_spec,
                                                  const KvCacheOptions& options);

struct KvCacheStats {
  int64_t blocks_total = 0;     // blocks the budget holds at the worst-case (uncompacted) size
  int64_t blocks_used = 0;      // referenced by at least one sequence
  int64_t blocks_cached = 0;    // unreferenced but still holding a registered prefix
  int64_t prefix_hit_tokens = 0;    // prompt tokens served from shared blocks, cumulative
  int64_t prefix_lookup_tokens = 0; // prompt tokens looked up, cumulative
  int64_t bytes_total = 0;      // the arena
  int64_t bytes_used = 0;       // held by used and cached blocks
  int64_t blocks_compacted = 0; // used or cached blocks stored in a codec's compact form
};

class KvCache {
 public:
  // codec_spec: see kv::MakeCodec. InvalidArgument for a bad spec; ResourceExhausted when the
  // budget cannot hold even one block per layer.
  static Result<std::unique_ptr<KvCache>> Create(const Model& model, const std::string& codec_spec,
                                                 const KvCacheOptions& options);
  // The same with a codec built elsewhere (its shape must be `model`'s with options.block_tokens).
  static Result<std::unique_ptr<KvCache>> Create(const Model& model, std::unique_ptr<kv::Codec> codec,
                                                 const KvCacheOptions& options);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Starts a sequence. Reuses registered blocks for the longest chain of full chunks of
  // `prompt`, leaving at least the last prompt token to compute, and at most `max_reuse` tokens
  // (a caller that needs some positions computed: prompt scoring). Returns how many leading
  // prompt tokens are already in the cache (a multiple of block_tokens).
  Result<int> BeginSequence(SeqId seq, const std::vector<int>& prompt,
                            int max_reuse = std::numeric_limits<int>::max());
  // Ensures blocks exist for positions [0, n_tokens). ResourceExhausted if the budget is spent;
  // the sequence keeps what it had.
  Status Reserve(SeqId seq, int n_tokens);
  // Records that tokens (their K/V now stored) occupy positions [len, len + n); compacts (see
  // above) and registers under its chunk key any block that became full. Block pointers of
  // `seq` change.
  void Commit(SeqId seq, const int* tokens, int n);
  // Drops the sequence; its blocks' refcounts fall and unreferenced blocks become cached/free.
  void Release(SeqId seq);

  // Block pointers of `seq` for `layer` (its layer group's blocks), in position order (valid
  // until the next Reserve, Commit or Release of `seq`).
  const uint8_t* const* LayerBlocks(SeqId seq, int layer);
  // Block holding position `pos` of `seq` in `layer`'s group, and the slot inside it.
  uint8_t* BlockFor(SeqId seq, int layer, int pos, int* slot);

  int SequenceLength(SeqId seq) const;
  // Positions with blocks reserved for `seq` (0 for an unknown sequence).
  int Capacity(SeqId seq) const;
  // Blocks a sequence of n tokens needs.
  int64_t BlocksFor(int n_tokens) const { return (n_tokens + block_tokens_ - 1) / block_tokens_; }
  // Blocks the budget holds at their worst-case size: what admission can promise. Fixed at
  // creation, so safe to read from any thread.
  int64_t TotalBlocks() const { return total_blocks_; }
  // Worst-case blocks that could be handed out now (free bytes + cached blocks' bytes); an
  // allocation may still fail when free space is fragmented.
  int64_t AvailableBlocks() const;
  KvCacheStats Stats() const;

  const kv::Codec& codec() const { return *codec_; }
  int block_tokens() const { return block_tokens_; }
  bool prefix_sharing() const { return prefix_sharing_; }
  size_t budget_bytes() const { return budget_bytes_; }
  // Fingerprint string hashed into every chunk key.
  const std::string& fingerprint() const { return fingerprint_; }
  // The chunk-key chain for `tokens` (one key per full chunk); deterministic across processes.
  // Thread-safe.
  std::vector<Hash128> ChunkKeys(const int* tokens, int n) const;

  // ---- Sharing chunks with a kvstore (kvstore_link.h) ----
  // A chunk value is every layer group's block of one chunk as stored (compacted where the codec
  // compacts), in layer order, each group's bytes rounded up to 16: at most ChunkValueBytes().
  size_t ChunkValueBytes() const { return chunk_value_bytes_; }
  // Thread-safe hint: whether `key` is registered now (it may be evicted by the next step).
  bool HasChunk(const Hash128& key) const;
  // Right after BeginSequence: appends fetched chunk values as the sequence's next blocks.
  // `values[i]` holds chunk `first_chunk + i` of `prompt`; only the chunks that directly follow
  // what the sequence already has are used, and at least the last prompt token is left to
  // compute. Each adopted block is registered under its chunk key. Returns the tokens adopted
  // (0 when nothing fits or the chunks do not continue the sequence); InvalidArgument when a
  // value is not a valid chunk (wrong size, or a layer the codec rejects: validate_stored), and
  // then nothing is adopted; ResourceExhausted leaves the sequence as it was.
  Result<int> AdoptChunks(SeqId seq, const std::vector<int>& prompt, int first_chunk,
                          const std::vector<std::string_view>& values);
  // Pins the full blocks of chunks [first, last) of `seq` so that another thread may read them
  // (ChunkPieces) after the sequence is gone; each pinned block must be Unpin()ned later, on
  // the cache's thread. Returns (chunk key, block) pairs.
  std::vector<std::pair<Hash128, int32_t>> PinChunks(SeqId seq, int first, int last);
  void Unpin(int32_t block) { Unref(block); }
  // The bytes of a pinned block (its chunk value), in pieces. A full block never moves, so this
  // is safe from any thread while the block is pinned.
  std::vector<std::pair<const uint8_t*, size_t>> ChunkPieces(int32_t block) const;

 private:
  KvCache() = default;
  struct Sequence {
    std::vector<int32_t> blocks;
    std::vector<std::vector<const uint8_t*>> group_ptrs;  // cached pointer tables per layer group
    std::vector<int> tokens;
    Hash128 last_key;   // key of the last registered full chunk
    int registered = 0; // full chunks registered
    int sealed = 0;     // leading full blocks already compacted (or found compacted)
  };
  struct Block {
    int refcount = 0;
    bool has_key = false;
    bool compact = false;
    Hash128 key;
    std::list<int32_t>::iterator lru;  // position in cached_ when refcount == 0 && has_key
    uint64_t bytes = 0;   // arena bytes of all its layer groups; 0: the id is free
  };
  // A block id whose group g holds group_sizes[g] bytes of arena (none for 0), evicting cached
  // prefixes (oldest first) for room. `open`: the worst-case layout of a block being filled.
  Result<int32_t> Allocate(const std::vector<uint64_t>& group_sizes, bool open);
  Result<uint64_t> AllocateRange(uint64_t bytes, bool transient);
  void FreeBlock(int32_t block);
  void Unref(int32_t block);
  void Ref(int32_t block);
  // Moves a full block to its codec's compact form (no-op when the codec has none).
  void Compact(int32_t block);
  void RefreshPointers(Sequence& s);
  size_t Slot(int32_t block, int group) const { return static_cast<size_t>(block) * n_groups_ + group; }
  uint8_t* BlockData(int group, int32_t block) { return arena_.data() + group_offset_[Slot(block, group)]; }
  const uint8_t* BlockData(int group, int32_t block) const { return arena_.data() + group_offset_[Slot(block, group)]; }
  // Frees the ranges of groups [0, n) of `block`.
  void FreeRanges(int32_t block, int n);
  Hash128 NextKey(const Hash128& parent, const int* chunk) const;

  std::unique_ptr<kv::Codec> codec_;
  int n_groups_ = 0;                     // storage units per block: the codec's layer groups
  std::vector<int> group_of_;            // [layer]
  int block_tokens_ = 16;
  bool prefix_sharing_ = true;
  size_t budget_bytes_ = 0;
  int64_t total_blocks_ = 0;
  bool codec_compacts_ = false;
  std::vector<uint64_t> open_sizes_;     // per layer group, a block of the open layout
  uint64_t open_bytes_ = 0;              // arena bytes of a block of the open layout, all groups
  PageArena arena_;                      // huge-page advised
  RangeAllocator ranges_{0, 64};
  std::vector<Block> blocks_;
  std::vector<uint64_t> group_offset_;   // [block][group]: its range in arena_
  std::vector<uint32_t> group_size_;     // [block][group]: that range's bytes (0: no range)
  std::vector<int32_t> free_ids_;        // block ids holding no memory
  std::list<int32_t> cached_;            // unreferenced registered blocks, oldest first
  uint64_t cached_bytes_ = 0;
  int64_t compacted_ = 0;
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
