#include "keel/engine/kv_cache.h"

#include <algorithm>
#include <cstring>

namespace keel::engine {

Result<std::unique_ptr<KvCache>> KvCache::Create(const Model& model, const std::string& codec_spec,
                                                 const KvCacheOptions& options) {
  const ModelConfig& c = model.config;
  if (options.block_tokens <= 0 || options.block_tokens > 4096) {
    return Status::InvalidArgument("kv cache: block_tokens must be in 1..4096");
  }
  kv::KvShape shape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), options.block_tokens};
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<kv::Codec> codec, kv::MakeCodec(codec_spec, shape));

  std::unique_ptr<KvCache> cache(new KvCache());
  cache->n_layers_ = c.n_layers;
  cache->block_tokens_ = options.block_tokens;
  cache->prefix_sharing_ = options.prefix_sharing;
  size_t per_block = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    cache->layer_bytes_.push_back(codec->block_bytes(l));
    per_block += codec->block_bytes(l);
  }
  const size_t n_blocks = per_block == 0 ? 0 : options.budget_bytes / per_block;
  if (n_blocks == 0) {
    return Status::ResourceExhausted("kv cache: budget of " + std::to_string(options.budget_bytes) +
                                     " bytes cannot hold one block (" + std::to_string(per_block) +
                                     " bytes for " + std::to_string(options.block_tokens) + " tokens)");
  }
  if (n_blocks > (1u << 30)) return Status::InvalidArgument("kv cache: budget too large");
  for (int l = 0; l < c.n_layers; ++l) {
    // Left uninitialised: pages are only touched when blocks are written.
    auto arena = PageArena::Map(cache->layer_bytes_[l] * n_blocks);
    if (!arena.ok()) return Status::ResourceExhausted("kv cache: " + arena.status().message());
    cache->arenas_.push_back(std::move(arena).value());
  }
  cache->blocks_.resize(n_blocks);
  cache->free_.reserve(n_blocks);
  for (size_t b = n_blocks; b-- > 0;) cache->free_.push_back(static_cast<int32_t>(b));
  cache->budget_bytes_ = per_block * n_blocks;
  cache->chunk_value_bytes_ = per_block;
  cache->fingerprint_ = "model=" + model.checksum.hex() + ";codec=" + codec->fingerprint() + ";tp=0/1";
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

Result<int32_t> KvCache::Allocate() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!cached_.empty()) {
    b = cached_.front();  // least recently released prefix goes first
    cached_.pop_front();
    std::lock_guard<std::mutex> lock(keys_mu_);
    by_key_.erase(blocks_[b].key);
    blocks_[b].has_key = false;
  } else {
    return Status::ResourceExhausted("kv cache: all " + std::to_string(blocks_.size()) + " blocks (" +
                                     std::to_string(budget_bytes_) + " bytes) are in use");
  }
  blocks_[b].refcount = 1;
  ++used_;
  return b;
}

void KvCache::Ref(int32_t b) {
  Block& blk = blocks_[b];
  if (blk.refcount == 0) {
    cached_.erase(blk.lru);
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
  } else {
    free_.push_back(b);
  }
}

void KvCache::RefreshPointers(Sequence& s) {
  s.layer_ptrs.resize(n_layers_);
  for (int l = 0; l < n_layers_; ++l) {
    auto& ptrs = s.layer_ptrs[l];
    ptrs.resize(s.blocks.size());
    for (size_t i = 0; i < s.blocks.size(); ++i) ptrs[i] = BlockData(l, s.blocks[i]);
  }
}

Result<int> KvCache::BeginSequence(SeqId seq, const std::vector<int>& prompt) {
  if (seqs_.count(seq)) return Status::InvalidArgument("kv cache: sequence " + std::to_string(seq) + " exists");
  Sequence s;
  s.last_key = fingerprint_hash_;
  lookup_tokens_ += static_cast<int64_t>(prompt.size());
  if (prefix_sharing_ && !prompt.empty()) {
    // Keep at least the last prompt token to compute: its logits start generation.
    const int shareable = static_cast<int>(prompt.size() - 1) / block_tokens_;
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
  for (int64_t i = 0; i < need; ++i) {
    KEEL_ASSIGN_OR_RETURN(int32_t b, Allocate());
    s.blocks.push_back(b);
  }
  RefreshPointers(s);
  return Status::Ok();
}

void KvCache::Commit(SeqId seq, const int* tokens, int n) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  Sequence& s = it->second;
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
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
  return seqs_.at(seq).layer_ptrs[layer].data();
}

uint8_t* KvCache::BlockFor(SeqId seq, int layer, int pos, int* slot) {
  Sequence& s = seqs_.at(seq);
  *slot = pos % block_tokens_;
  return BlockData(layer, s.blocks[pos / block_tokens_]);
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
  return static_cast<int64_t>(free_.size() + cached_.size());
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
  const int end = std::min(first_chunk + static_cast<int>(values.size()), shareable);
  if (end <= have) return 0;
  for (int c = have; c < end; ++c) {
    if (values[c - first_chunk].size() != chunk_value_bytes_) {
      return Status::InvalidArgument("kv cache: fetched chunk " + std::to_string(c) + " has " +
                                     std::to_string(values[c - first_chunk].size()) + " bytes, expected " +
                                     std::to_string(chunk_value_bytes_));
    }
  }
  if (end - have > AvailableBlocks()) {
    return Status::ResourceExhausted("kv cache: no room to adopt " + std::to_string(end - have) + " fetched blocks");
  }
  for (int c = have; c < end; ++c) {
    Hash128 key = NextKey(s.last_key, prompt.data() + c * block_tokens_);
    KEEL_ASSIGN_OR_RETURN(int32_t b, Allocate());
    const uint8_t* src = reinterpret_cast<const uint8_t*>(values[c - first_chunk].data());
    for (int l = 0; l < n_layers_; ++l) {
      std::memcpy(BlockData(l, b), src, layer_bytes_[l]);
      src += layer_bytes_[l];
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
    Ref(s.blocks[c]);
    out.emplace_back(keys[c], s.blocks[c]);
  }
  return out;
}

std::vector<std::pair<const uint8_t*, size_t>> KvCache::ChunkPieces(int32_t block) const {
  std::vector<std::pair<const uint8_t*, size_t>> pieces;
  pieces.reserve(n_layers_);
  for (int l = 0; l < n_layers_; ++l) pieces.emplace_back(BlockData(l, block), layer_bytes_[l]);
  return pieces;
}

KvCacheStats KvCache::Stats() const {
  KvCacheStats st;
  st.blocks_total = static_cast<int64_t>(blocks_.size());
  st.blocks_used = used_;
  st.blocks_cached = static_cast<int64_t>(cached_.size());
  st.prefix_hit_tokens = hit_tokens_;
  st.prefix_lookup_tokens = lookup_tokens_;
  return st;
}

}  // namespace keel::engine
