#include "keel/engine/kv_cache.h"

#include <algorithm>
#include <cstring>

namespace keel::engine {

namespace {
// Ranges are multiples of a granule of 64..256 bytes (cache-line aligned; about 1/32 of a layer's
// block): compact blocks of slightly different sizes then fit each other's holes. Measured under
// churn (kv_capacity_bench --churn, 99M GQA model): 64-byte ranges stranded ~6 % of the arena in
// slivers, 256-byte ones ~2 %; coarser granules waste more in rounding than they save.
uint64_t RangeGranule(const std::vector<uint64_t>& group_sizes) {
  uint64_t g = 256;
  for (uint64_t size : group_sizes)
    while (size > 0 && g > 64 && g * 32 > size) g /= 2;
  return g;
}
uint64_t RoundUp16(uint64_t x) { return RoundUp(x, 16); }
}  // namespace

Result<std::unique_ptr<kv::Codec>> MakeCacheCodec(const Model& model, const std::string& codec_spec,
                                                  const KvCacheOptions& options) {
  const ModelConfig& c = model.config;
  if (options.block_tokens <= 0 || options.block_tokens > 4096) {
    return Status::InvalidArgument("kv cache: block_tokens must be in 1..4096");
  }
  kv::CodecContext context;
  context.shape = kv::KvShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), options.block_tokens};
  context.shape.dim = c.dim;
  context.shape.rope_theta = c.rope_theta;
  context.shape.max_positions = c.max_seq_len;
  context.shape.vocab_size = c.vocab_size;
  context.model_checksum = model.checksum.hex();
  context.params = options.codec_params;
  return kv::MakeCodec(codec_spec, context);
}

Result<std::unique_ptr<KvCache>> KvCache::Create(const Model& model, const std::string& codec_spec,
                                                 const KvCacheOptions& options) {
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<kv::Codec> codec, MakeCacheCodec(model, codec_spec, options));
  return Create(model, std::move(codec), options);
}

Result<std::unique_ptr<KvCache>> KvCache::Create(const Model& model, std::unique_ptr<kv::Codec> codec,
                                                 const KvCacheOptions& options) {
  const ModelConfig& c = model.config;
  const kv::KvShape& shape = codec->shape();
  if (shape.n_layers != c.n_layers || shape.n_heads != c.n_heads || shape.n_kv_heads != c.n_kv_heads ||
      shape.head_dim != c.head_dim() || shape.block_tokens != options.block_tokens) {
    return Status::InvalidArgument("kv cache: the codec's KV shape does not match the model and block size");
  }

  std::unique_ptr<KvCache> cache(new KvCache());
  cache->n_groups_ = codec->n_groups();
  for (int l = 0; l < c.n_layers; ++l) cache->group_of_.push_back(codec->group_of(l));
  cache->block_tokens_ = options.block_tokens;
  cache->prefix_sharing_ = options.prefix_sharing;
  uint64_t per_block = 0;
  for (int g = 0; g < cache->n_groups_; ++g) {
    cache->open_sizes_.push_back(RoundUp16(codec->block_bytes(g)));
    per_block += RoundUp16(codec->block_bytes(g));
  }
  for (uint64_t size : cache->open_sizes_) {
    if (size > UINT32_MAX) return Status::InvalidArgument("kv cache: one layer group's block exceeds 4 GiB");
  }
  const uint64_t granule = RangeGranule(cache->open_sizes_);
  uint64_t slot = 0;  // arena bytes of a block of the open layout
  for (uint64_t size : cache->open_sizes_) slot += RoundUp(size, granule);
  const uint64_t n_blocks = slot == 0 ? 0 : options.budget_bytes / slot;
  if (n_blocks == 0) {
    return Status::ResourceExhausted("kv cache: budget of " + std::to_string(options.budget_bytes) +
                                     " bytes cannot hold one block (" + std::to_string(per_block) +
                                     " bytes for " + std::to_string(options.block_tokens) + " tokens)");
  }
  if (n_blocks > (1u << 30)) return Status::InvalidArgument("kv cache: budget too large");
  // Left uninitialised: pages are only touched when blocks are written.
  auto arena = PageArena::Map(n_blocks * slot);
  if (!arena.ok()) return Status::ResourceExhausted("kv cache: " + arena.status().message());
  cache->arena_ = std::move(arena).value();
  cache->ranges_ = RangeAllocator(n_blocks * slot, granule);
  cache->open_bytes_ = slot;
  cache->total_blocks_ = static_cast<int64_t>(n_blocks);
  cache->budget_bytes_ = n_blocks * slot;
  cache->chunk_value_bytes_ = per_block;
  cache->codec_compacts_ = codec->compacts();
  cache->fingerprint_ = "model=" + model.checksum.hex() + ";codec=" + codec->fingerprint() + ";tp=0/1;value=tagged1";
  cache->fingerprint_hash_ = Xxh3_128(cache->fingerprint_);
  cache->codec_ = std::move(codec);
  return cache;
}

Hash128 KvCache::NextKey(const Hash128& parent, const int* chunk) const {
  Hasher128 h;
  h.update_pod(parent.lo);
  h.update_pod(parent.hi);
  for (int i = 0; i < block_tokens_; ++i) h.update_pod(static_cast<int32_t>(chunk[i]));
  h.update_pod(fingerprint_hash_.lo);
  h.update_pod(fingerprint_hash_.hi);
  return h.digest();
}

std::vector<Hash128> KvCache::ChunkKeys(const int* tokens, int n) const {
  std::vector<Hash128> keys;
  Hash128 parent = fingerprint_hash_;
  for (int i = 0; i + block_tokens_ <= n; i += block_tokens_) {
    parent = NextKey(parent, tokens + i);
    keys.push_back(parent);
  }
  return keys;
}

Result<uint64_t> KvCache::AllocateRange(uint64_t bytes, bool transient) {
  // With a codec that compacts, blocks being filled are transient (they move once full): they
  // take ranges from the top of the arena, compact blocks from the bottom (RangeAllocator::End).
  // Raw blocks all have one size: best fit.
  const auto end = !codec_compacts_ ? RangeAllocator::End::kBestFit
                                    : transient ? RangeAllocator::End::kHighest : RangeAllocator::End::kLowest;
  for (;;) {
    if (std::optional<uint64_t> off = ranges_.Allocate(bytes, end)) return *off;
    if (cached_.empty()) {
      return Status::ResourceExhausted(
          "kv cache: no room for a block of " + std::to_string(bytes) + " bytes: " +
          std::to_string(ranges_.size() - ranges_.free_bytes()) + " of " + std::to_string(budget_bytes_) +
          " bytes are held by sequences (largest free range " + std::to_string(ranges_.largest_free()) + ")");
    }
    const int32_t victim = cached_.front();  // least recently released prefix goes first
    cached_.pop_front();
    {
      std::lock_guard<std::mutex> lock(keys_mu_);
      by_key_.erase(blocks_[victim].key);
    }
    blocks_[victim].has_key = false;
    cached_bytes_ -= blocks_[victim].bytes;
    FreeBlock(victim);
  }
}

Result<int32_t> KvCache::Allocate(const std::vector<uint64_t>& group_sizes, bool open) {
  int32_t b;
  if (!free_ids_.empty()) {
    b = free_ids_.back();
    free_ids_.pop_back();
  } else {
    b = static_cast<int32_t>(blocks_.size());
    std::lock_guard<std::mutex> lock(keys_mu_);  // ChunkPieces reads these from other threads
    blocks_.emplace_back();
    group_offset_.resize(blocks_.size() * n_groups_);
    group_size_.resize(blocks_.size() * n_groups_);
  }
  // One range per layer group: a block being filled needs no contiguous room for all of its
  // groups, so the holes between compact blocks stay usable. A group of zero bytes takes none.
  uint64_t total = 0;
  for (int g = 0; g < n_groups_; ++g) {
    group_offset_[Slot(b, g)] = 0;
    group_size_[Slot(b, g)] = 0;
    if (group_sizes[g] == 0) continue;
    Result<uint64_t> off = AllocateRange(group_sizes[g], open);
    if (!off.ok()) {
      FreeRanges(b, g);
      free_ids_.push_back(b);
      return off.status();
    }
    group_offset_[Slot(b, g)] = *off;
    group_size_[Slot(b, g)] = static_cast<uint32_t>(group_sizes[g]);
    total += ranges_.RoundUp(group_sizes[g]);
  }
  Block& blk = blocks_[b];
  blk = Block{};
  blk.bytes = total;
  blk.refcount = 1;
  ++used_;
  return b;
}

void KvCache::FreeRanges(int32_t b, int n) {
  for (int g = 0; g < n; ++g) {
    if (group_size_[Slot(b, g)] > 0) ranges_.Free(group_offset_[Slot(b, g)], group_size_[Slot(b, g)]);
  }
}

void KvCache::FreeBlock(int32_t b) {
  Block& blk = blocks_[b];
  FreeRanges(b, n_groups_);
  if (blk.compact) --compacted_;
  blk = Block{};
  free_ids_.push_back(b);
}

void KvCache::Ref(int32_t b) {
  Block& blk = blocks_[b];
  if (blk.refcount == 0) {
    cached_.erase(blk.lru);
    cached_bytes_ -= blk.bytes;
    ++used_;
  }
  ++blk.refcount;
}

void KvCache::Unref(int32_t b) {
  Block& blk = blocks_[b];
  if (--blk.refcount > 0) return;
  --used_;
  if (blk.has_key) {
    cached_.push_back(b);
    blk.lru = std::prev(cached_.end());
    cached_bytes_ += blk.bytes;
  } else {
    FreeBlock(b);
  }
}

void KvCache::Compact(int32_t b) {
  if (!codec_compacts_ || blocks_[b].compact) return;
  thread_local std::vector<uint8_t> scratch;
  Block& blk = blocks_[b];
  for (int l = 0; l < n_groups_; ++l) {  // l: a layer group
    if (group_size_[Slot(b, l)] == 0) continue;
    const size_t bytes = codec_->compact_bytes(l, BlockData(l, b));
    if (bytes == 0 || bytes > group_size_[Slot(b, l)]) continue;  // keep this group as it is
    // Write the compact copy beside the open one when there is room; else through a scratch
    // buffer, releasing the open range first (then the allocation cannot fail: the range just
    // released is at least as large).
    uint8_t* src = BlockData(l, b);
    std::optional<uint64_t> off = ranges_.Allocate(bytes, RangeAllocator::End::kLowest);
    if (off) {
      codec_->compact(l, src, arena_.data() + *off);
      ranges_.Free(group_offset_[Slot(b, l)], group_size_[Slot(b, l)]);
    } else {
      if (scratch.size() < bytes) scratch.resize(bytes);
      codec_->compact(l, src, scratch.data());
      ranges_.Free(group_offset_[Slot(b, l)], group_size_[Slot(b, l)]);
      off = ranges_.Allocate(bytes, RangeAllocator::End::kLowest);
      std::memcpy(arena_.data() + *off, scratch.data(), bytes);
    }
    blk.bytes -= ranges_.RoundUp(group_size_[Slot(b, l)]) - ranges_.RoundUp(bytes);
    group_offset_[Slot(b, l)] = *off;
    group_size_[Slot(b, l)] = static_cast<uint32_t>(bytes);
  }
  blk.compact = true;
  ++compacted_;
}

void KvCache::RefreshPointers(Sequence& s) {
  s.group_ptrs.resize(n_groups_);
  for (int l = 0; l < n_groups_; ++l) {
    auto& ptrs = s.group_ptrs[l];
    ptrs.resize(s.blocks.size());
    for (size_t i = 0; i < s.blocks.size(); ++i) ptrs[i] = BlockData(l, s.blocks[i]);
  }
}

Result<int> KvCache::BeginSequence(SeqId seq, const std::vector<int>& prompt, int max_reuse) {
  if (seqs_.count(seq)) return Status::InvalidArgument("kv cache: sequence " + std::to_string(seq) + " exists");
  Sequence s;
  s.last_key = fingerprint_hash_;
  lookup_tokens_ += static_cast<int64_t>(prompt.size());
  if (prefix_sharing_ && !prompt.empty()) {
    // Keep at least the last prompt token to compute: its logits start generation.
    const int shareable = std::min(static_cast<int>(prompt.size() - 1), std::max(max_reuse, 0)) / block_tokens_;
    Hash128 parent = fingerprint_hash_;
    for (int i = 0; i < shareable; ++i) {
      Hash128 key = NextKey(parent, prompt.data() + i * block_tokens_);
      auto it = by_key_.find(key);
      if (it == by_key_.end()) break;
      Ref(it->second);
      s.blocks.push_back(it->second);
      parent = key;
    }
    s.last_key = parent;
    s.registered = static_cast<int>(s.blocks.size());
    s.sealed = s.registered;
    s.tokens.assign(prompt.begin(), prompt.begin() + s.registered * block_tokens_);
  }
  hit_tokens_ += static_cast<int64_t>(s.tokens.size());
  RefreshPointers(s);
  int reused = static_cast<int>(s.tokens.size());
  seqs_.emplace(seq, std::move(s));
  return reused;
}

Status KvCache::Reserve(SeqId seq, int n_tokens) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return Status::InvalidArgument("kv cache: unknown sequence " + std::to_string(seq));
  Sequence& s = it->second;
  const int64_t need = BlocksFor(n_tokens) - static_cast<int64_t>(s.blocks.size());
  if (need <= 0) return Status::Ok();
  if (need > AvailableBlocks()) {
    return Status::ResourceExhausted("kv cache: sequence needs " + std::to_string(need) + " more blocks for " +
                                     std::to_string(n_tokens) + " tokens but only " +
                                     std::to_string(AvailableBlocks()) + " of " + std::to_string(blocks_.size()) +
                                     " are available (budget " + std::to_string(budget_bytes_) + " bytes)");
  }
  Status st;
  for (int64_t i = 0; i < need && st.ok(); ++i) {
    Result<int32_t> b = Allocate(open_sizes_, /*open=*/true);
    if (b.ok()) {
      s.blocks.push_back(*b);
    } else {
      st = b.status();  // fragmentation: the blocks allocated so far stay with the sequence
    }
  }
  RefreshPointers(s);
  return st;
}

void KvCache::Commit(SeqId seq, const int* tokens, int n) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  Sequence& s = it->second;
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  bool moved = false;
  while ((s.sealed + 1) * block_tokens_ <= static_cast<int>(s.tokens.size()) &&
         s.sealed < static_cast<int>(s.blocks.size())) {
    if (codec_compacts_ && !blocks_[s.blocks[s.sealed]].compact) {
      Compact(s.blocks[s.sealed]);
      moved = true;
    }
    ++s.sealed;
  }
  if (moved) RefreshPointers(s);
  if (!prefix_sharing_) return;
  while ((s.registered + 1) * block_tokens_ <= static_cast<int>(s.tokens.size()) &&
         s.registered < static_cast<int>(s.blocks.size())) {
    Hash128 key = NextKey(s.last_key, s.tokens.data() + s.registered * block_tokens_);
    Block& blk = blocks_[s.blocks[s.registered]];
    // Another sequence may have computed the same chunk concurrently: the first one registered
    // stays the shared copy, this block remains private.
    if (!blk.has_key && by_key_.find(key) == by_key_.end()) {
      blk.has_key = true;
      blk.key = key;
      std::lock_guard<std::mutex> lock(keys_mu_);
      by_key_.emplace(key, s.blocks[s.registered]);
    }
    s.last_key = key;
    ++s.registered;
  }
}

void KvCache::Release(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  // Deepest chunks first, so the LRU evicts a prefix's tail before its head.
  for (auto b = it->second.blocks.rbegin(); b != it->second.blocks.rend(); ++b) Unref(*b);
  seqs_.erase(it);
}

const uint8_t* const* KvCache::LayerBlocks(SeqId seq, int layer) {
  return seqs_.at(seq).group_ptrs[group_of_[layer]].data();
}

uint8_t* KvCache::BlockFor(SeqId seq, int layer, int pos, int* slot) {
  Sequence& s = seqs_.at(seq);
  *slot = pos % block_tokens_;
  return BlockData(group_of_[layer], s.blocks[pos / block_tokens_]);
}

int KvCache::SequenceLength(SeqId seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? -1 : static_cast<int>(it->second.tokens.size());
}

int KvCache::Capacity(SeqId seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : static_cast<int>(it->second.blocks.size()) * block_tokens_;
}

int64_t KvCache::AvailableBlocks() const {
  return static_cast<int64_t>((ranges_.free_bytes() + cached_bytes_) / open_bytes_);
}

bool KvCache::HasChunk(const Hash128& key) const {
  std::lock_guard<std::mutex> lock(keys_mu_);
  return by_key_.count(key) != 0;
}

Result<int> KvCache::AdoptChunks(SeqId seq, const std::vector<int>& prompt, int first_chunk,
                                 const std::vector<std::string_view>& values) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return Status::InvalidArgument("kv cache: unknown sequence " + std::to_string(seq));
  Sequence& s = it->second;
  const int have = static_cast<int>(s.blocks.size());
  if (!prefix_sharing_ || s.registered != have || have < first_chunk) return 0;
  const int shareable = prompt.empty() ? 0 : static_cast<int>(prompt.size() - 1) / block_tokens_;
  int end = std::min(first_chunk + static_cast<int>(values.size()), shareable);
  if (end <= have) return 0;
  // Validate every value before touching the cache: each layer group must be a block the codec
  // wrote, and the groups must fill the value exactly.
  std::vector<std::vector<uint64_t>> sizes(end - have, std::vector<uint64_t>(n_groups_));
  for (int c = have; c < end; ++c) {
    const std::string_view v = values[c - first_chunk];
    const auto* data = reinterpret_cast<const uint8_t*>(v.data());
    auto bad = [&](const std::string& why) {
      return Status::InvalidArgument("kv cache: fetched chunk " + std::to_string(c) + " (" + std::to_string(v.size()) +
                                     " bytes): " + why);
    };
    if (v.empty() || v.size() > chunk_value_bytes_) {
      return bad("expected 1.." + std::to_string(chunk_value_bytes_) + " bytes");
    }
    size_t at = 0;
    for (int l = 0; l < n_groups_; ++l) {
      if (at >= v.size() && codec_->block_bytes(l) > 0) return bad("ends before layer group " + std::to_string(l));
      Result<size_t> size = codec_->validate_stored(l, data + at, v.size() - at);
      if (!size.ok()) return bad(size.status().message());
      sizes[c - have][l] = RoundUp16(*size);
      at += RoundUp16(*size);
    }
    if (at != v.size()) return bad("layer groups end at byte " + std::to_string(at));
  }
  const uint64_t need = [&] {
    uint64_t bytes = 0;
    for (int c = have; c < end; ++c) bytes += ranges_.RoundUp(values[c - first_chunk].size());
    return bytes;
  }();
  if (need > ranges_.free_bytes() + cached_bytes_) {
    return Status::ResourceExhausted("kv cache: no room to adopt " + std::to_string(end - have) + " fetched blocks");
  }
  for (int c = have; c < end; ++c) {
    const std::string_view v = values[c - first_chunk];
    Hash128 key = NextKey(s.last_key, prompt.data() + c * block_tokens_);
    Result<int32_t> got = Allocate(sizes[c - have], /*open=*/false);
    if (!got.ok()) {  // fragmentation: keep what was adopted so far
      if (c == have) return got.status();
      end = c;
      break;
    }
    const int32_t b = *got;
    size_t at = 0;
    for (int l = 0; l < n_groups_; ++l) {
      if (sizes[c - have][l] > 0) std::memcpy(BlockData(l, b), v.data() + at, sizes[c - have][l]);
      at += sizes[c - have][l];
    }
    if (codec_compacts_) {
      blocks_[b].compact = true;
      ++compacted_;
    }
    s.blocks.push_back(b);
    s.tokens.insert(s.tokens.end(), prompt.begin() + c * block_tokens_, prompt.begin() + (c + 1) * block_tokens_);
    Block& blk = blocks_[b];
    {
      std::lock_guard<std::mutex> lock(keys_mu_);
      if (by_key_.find(key) == by_key_.end()) {
        blk.has_key = true;
        blk.key = key;
        by_key_.emplace(key, b);
      }
    }
    s.last_key = key;
    ++s.registered;
    ++s.sealed;
  }
  RefreshPointers(s);
  const int adopted = (end - have) * block_tokens_;
  hit_tokens_ += adopted;
  return adopted;
}

std::vector<std::pair<Hash128, int32_t>> KvCache::PinChunks(SeqId seq, int first, int last) {
  std::vector<std::pair<Hash128, int32_t>> out;
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return out;
  Sequence& s = it->second;
  last = std::min({last, s.registered, static_cast<int>(s.blocks.size())});
  if (first >= last) return out;
  std::vector<Hash128> keys = ChunkKeys(s.tokens.data(), last * block_tokens_);
  for (int c = std::max(first, 0); c < last; ++c) {
    // A full block the codec could not compact is not in the chunk format peers expect.
    if (codec_compacts_ && !blocks_[s.blocks[c]].compact) break;
    Ref(s.blocks[c]);
    out.emplace_back(keys[c], s.blocks[c]);
  }
  return out;
}

std::vector<std::pair<const uint8_t*, size_t>> KvCache::ChunkPieces(int32_t block) const {
  // blocks_ may grow (and move) on the cache's thread meanwhile: read the pinned block's range
  // under keys_mu_, which Allocate holds while it grows blocks_.
  std::lock_guard<std::mutex> lock(keys_mu_);
  std::vector<std::pair<const uint8_t*, size_t>> pieces;
  pieces.reserve(n_groups_);
  for (int g = 0; g < n_groups_; ++g) {
    if (group_size_[Slot(block, g)] > 0) pieces.emplace_back(BlockData(g, block), group_size_[Slot(block, g)]);
  }
  return pieces;
}

KvCacheStats KvCache::Stats() const {
  KvCacheStats st;
  st.blocks_total = total_blocks_;
  st.bytes_total = static_cast<int64_t>(budget_bytes_);
  st.bytes_used = static_cast<int64_t>(ranges_.size() - ranges_.free_bytes());
  st.blocks_compacted = compacted_;
  st.blocks_used = used_;
  st.blocks_cached = static_cast<int64_t>(cached_.size());
  st.prefix_hit_tokens = hit_tokens_;
  st.prefix_lookup_tokens = lookup_tokens_;
  return st;
}

}  // namespace keel::engine
