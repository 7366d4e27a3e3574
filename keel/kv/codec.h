// keel::kv::Codec: how K/V for a group of adjacent layers is stored in paged blocks, and
// attention that reads the stored blocks directly. The KV cache owns the memory (one arena,
// fixed-size blocks, one range per (block, layer group)); a codec only interprets the bytes of
// the blocks it is handed. The forward pass calls append_token()/store_group() and attend() with
// a layer index and never touches stored bytes itself, so a new codec plugs in without changing
// the forward pass: one folder under keel/kv/ plus one line in registry.cc.
//
// Layer groups: group_size() adjacent layers share one storage unit per block (the last group
// may be smaller). Per-layer codecs (raw, zipfusion) have groups of one, so "group" == "layer"
// for them. Storage-level calls (block_bytes, compact*, validate_stored) take a group index;
// token-level calls (append, attend, read) take the layer.
//
// Two ways a token reaches storage:
//  - per layer (stores_at_group_end() false): append_token() at each layer, right after the
//    layer computed the token's K/V; attention reads stored tokens only.
//  - at group end (true; BellowsKV, cross-layer merging): the codec needs what every layer of the
//    group computed for the token, so the token is stored by store_group() once the group's last
//    layer has run. Until then attention reads the token's own K/V raw (attend_pending). The
//    forward pass therefore runs such a group one token step at a time per sequence, and every
//    token attends to exactly the stored tokens before it plus itself, whether it came in a
//    prompt chunk or a decode step: prefill and decode produce the same cache bit for bit.
//
// Contract: attend() over a lossless codec's blocks must equal attend() over raw fp32 blocks bit
// for bit. A codec object is shared by all sequences of one cache; append() for different
// blocks and attend() may run concurrently from several threads, so codecs keep no mutable
// per-call state (scratch comes from the caller).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"

namespace keel::kv {

struct KvShape {
  int n_layers = 0;
  int n_heads = 0;      // query heads
  int n_kv_heads = 0;   // K/V heads (GQA: n_heads is a multiple)
  int head_dim = 0;
  int block_tokens = 16;
  int dim = 0;                  // model hidden size: the width of a layer's input
  float rope_theta = 10000.0f;  // RoPE base; keys are rotated on interleaved pairs (rope.h)
  int max_positions = 0;        // the model's context length (0: unknown), for position tables
  int vocab_size = 0;           // the model's vocabulary (0: unknown), for token-indexed tables
  int kv_dim() const { return n_kv_heads * head_dim; }
};

// What the forward pass knows about one token at one layer; codecs take what they need.
struct TokenKv {
  int pos = 0;
  int token = -1;                // the token id
  const float* x = nullptr;      // the layer input: hidden state after the layer's attention RMSNorm (dim)
  const float* k_pre = nullptr;  // K before RoPE (bias added), RoPE pairs interleaved (2j, 2j+1) (kv_dim)
  const float* k = nullptr;      // K after RoPE (kv_dim)
  const float* v = nullptr;      // V (kv_dim)
};

// Everything a codec is built from: the shape, the model it serves (codecs with model-specific
// data, such as calibration files, check it) and named parameters from the command line
// (e.g. {"bellows": "/path/model.bkv"}).
struct CodecContext {
  KvShape shape;
  std::string model_checksum;  // hex XXH3-128 of the model weights; empty when not tied to a model
  std::map<std::string, std::string> params;
};

// Per-thread scratch for attend(); sized by the codec's scratch_floats().
struct AttendScratch {
  std::vector<float> buf;
  float* get(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};

class Codec {
 public:
  virtual ~Codec() = default;

  // Short spec as typed on the command line, e.g. "raw:f32".
  virtual std::string spec() const = 0;
  // Everything that changes stored bytes (codec, dtype, parameters, block layout); part of the
  // prefix-cache fingerprint.
  virtual std::string fingerprint() const = 0;
  virtual const KvShape& shape() const = 0;

  // ---- Layer groups (see above). group_size() is fixed for the codec's lifetime.
  virtual int group_size() const { return 1; }
  int n_groups() const { return (shape().n_layers + group_size() - 1) / group_size(); }
  int group_of(int layer) const { return layer / group_size(); }
  int first_layer(int group) const { return group * group_size(); }
  int layers_in(int group) const { return std::min(group_size(), shape().n_layers - first_layer(group)); }

  // Bytes one block (block_tokens tokens of one layer group, K and V) occupies while being filled.
  virtual size_t block_bytes(int group) const = 0;

  // Per-layer storing: stores K and V (each kv_dim floats, RoPE already applied) of the token at
  // `slot` in `block` (the block of the layer's group).
  virtual void append(int layer, uint8_t* block, int slot, const float* k, const float* v) const = 0;
  // What the forward pass calls; the default stores t.k and t.v through append().
  virtual void append_token(int layer, uint8_t* block, int slot, const TokenKv& t) const {
    append(layer, block, slot, t.k, t.v);
  }

  // ---- Storing at group end (see above). Codecs that return true implement both calls below
  // and are never given append_token(); attend()/attend_many() then only see stored tokens.
  virtual bool stores_at_group_end() const { return false; }
  // Stores the token at `slot` of `block` once its group has run: layers[i] is what layer
  // first_layer(group) + i computed for it.
  virtual void store_group(int /*group*/, uint8_t* /*block*/, int /*slot*/, const TokenKv* /*layers*/) const {}
  // Attention of one query over `n_stored` stored tokens followed by `n_pending` tokens given
  // raw (pending_k/pending_v: [n_pending][kv_dim], RoPE applied): what attend() would compute if
  // all n_stored + n_pending tokens were stored.
  virtual void attend_pending(int layer, const uint8_t* const* blocks, int n_stored, const float* q,
                              const float* pending_k, const float* pending_v, int n_pending, float* out,
                              AttendScratch& scratch) const;

  // Attention of one query token over the first `n_tokens` stored tokens, which live in
  // `blocks[0..ceil(n_tokens/block_tokens))` in order. `q` is n_heads*head_dim floats; `out`
  // receives n_heads*head_dim floats: softmax(q k^T / sqrt(head_dim)) v per head, query head h
  // reading K/V head h / (n_heads / n_kv_heads).
  virtual void attend(int layer, const uint8_t* const* blocks, int n_tokens, const float* q,
                      float* out, AttendScratch& scratch) const = 0;

  // Attention of `n_queries` query tokens of one sequence: query i attends over the first
  // n_tokens[i] stored tokens (n_tokens increasing, as in a prompt chunk); q and out are
  // [n_queries][n_heads*head_dim]. Must equal attend() per query bit for bit; codecs override it
  // to read each stored row once for all queries (prefill).
  virtual void attend_many(int layer, const uint8_t* const* blocks, int n_queries, const int* n_tokens,
                           const float* q, float* out, AttendScratch& scratch) const {
    const size_t stride = static_cast<size_t>(shape().n_heads) * shape().head_dim;
    for (int i = 0; i < n_queries; ++i) attend(layer, blocks, n_tokens[i], q + i * stride, out + i * stride, scratch);
  }

  // Reads back K and V of one stored token as fp32 (tests, export to other tiers). Codecs that
  // store keys before RoPE cannot rotate without the position: their read() returns K unrotated,
  // read_at() rotates it for position `pos`.
  virtual void read(int layer, const uint8_t* block, int slot, float* k, float* v) const = 0;
  virtual void read_at(int layer, const uint8_t* block, int slot, int /*pos*/, float* k, float* v) const {
    read(layer, block, slot, k, v);
  }

  // ---- Compaction (optional; `group` as above). The cache allocates a block at block_bytes(), the worst case.
  // Once its last token is appended, a codec whose stored size depends on the data may offer a
  // smaller copy, and the cache moves the block there: compacts() says the codec does,
  // compact_bytes() is that copy's size (a multiple of 16, at most block_bytes()), compact()
  // writes it; attend() and read() accept both forms.
  virtual bool compacts() const { return false; }
  virtual size_t compact_bytes(int /*group*/, const uint8_t* /*full_block*/) const { return 0; }
  virtual void compact(int /*group*/, const uint8_t* /*full_block*/, uint8_t* /*out*/) const {}
  // Checks that `data` starts with a full block of `group` as this codec stores full blocks
  // (compacted where it compacts), e.g. one fetched from a KV store, and returns the bytes it
  // spans (a multiple of 16). Corruption when it is not one: attention trusts stored blocks, so
  // untrusted bytes must pass here first. The default: any block_bytes() bytes are valid.
  virtual Result<size_t> validate_stored(int group, const uint8_t* /*data*/, size_t size) const {
    if (size < block_bytes(group)) {
      return Status::Corruption("kv block of layer group " + std::to_string(group) + ": " + std::to_string(size) +
                                " bytes, expected " + std::to_string(block_bytes(group)));
    }
    return block_bytes(group);
  }
};

// Builds a codec from its spec "name[:variant]" through the registry (registry.h; defined in
// registry.cc, so that the interface alone does not pull in every codec), e.g. "raw"
// (= "raw:f32"), "raw:bf16", "zipfusion", "bellows" (needs params["bellows"]).
// InvalidArgument names the spec and the known codecs when it is not recognised, and the codec's
// own reason when its variant, shape or parameters do not fit.
Result<std::unique_ptr<Codec>> MakeCodec(std::string_view spec, const CodecContext& context);
// The same for codecs that need neither a model nor parameters (tests, benchmarks).
Result<std::unique_ptr<Codec>> MakeCodec(std::string_view spec, const KvShape& shape);

}  // namespace keel::kv
