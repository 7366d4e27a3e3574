// keel::kv::Codec: how K/V for one layer is stored in paged blocks, and attention that reads
// the stored blocks directly. The KV cache owns the memory (one arena per layer, fixed-size
// blocks); a codec only interprets the bytes of the blocks it is handed. The forward pass calls
// append() and attend() with a layer index and never touches stored bytes itself, so a new codec
// (zipfusion, bellows) plugs in without changing the forward pass.
//
// Contract: attend() over a lossless codec's blocks must equal attend() over raw fp32 blocks bit
// for bit. A codec object is shared by all sequences of one cache; append() for different
// blocks and attend() may run concurrently from several threads, so codecs keep no mutable
// per-call state (scratch comes from the caller).
#pragma once

#include <cstddef>
#include <cstdint>
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
  int kv_dim() const { return n_kv_heads * head_dim; }
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
  // Bytes one block (block_tokens tokens of one layer, K and V) occupies.
  virtual size_t block_bytes(int layer) const = 0;

  // Stores K and V (each kv_dim floats, RoPE already applied) of the token at `slot` in `block`.
  virtual void append(int layer, uint8_t* block, int slot, const float* k, const float* v) const = 0;

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

  // Reads back K and V of one stored token as fp32 (tests, export to other tiers).
  virtual void read(int layer, const uint8_t* block, int slot, float* k, float* v) const = 0;

  // ---- Compaction (optional). The cache allocates a block at block_bytes(), the worst case.
  // Once its last token is appended, a codec whose stored size depends on the data may offer a
  // smaller copy, and the cache moves the block there: compacts() says the codec does,
  // compact_bytes() is that copy's size (a multiple of 16, at most block_bytes()), compact()
  // writes it; attend() and read() accept both forms.
  virtual bool compacts() const { return false; }
  virtual size_t compact_bytes(int /*layer*/, const uint8_t* /*full_block*/) const { return 0; }
  virtual void compact(int /*layer*/, const uint8_t* /*full_block*/, uint8_t* /*out*/) const {}
  // Checks that `data` starts with a full block of `layer` as this codec stores full blocks
  // (compacted where it compacts), e.g. one fetched from a KV store, and returns the bytes it
  // spans (a multiple of 16). Corruption when it is not one: attention trusts stored blocks, so
  // untrusted bytes must pass here first. The default: any block_bytes() bytes are valid.
  virtual Result<size_t> validate_stored(int layer, const uint8_t* /*data*/, size_t size) const {
    if (size < block_bytes(layer)) {
      return Status::Corruption("kv block of layer " + std::to_string(layer) + ": " + std::to_string(size) +
                                " bytes, expected " + std::to_string(block_bytes(layer)));
    }
    return block_bytes(layer);
  }
};

// Builds a codec from its spec: "raw" (= "raw:f32"), "raw:f32", "raw:bf16".
// InvalidArgument names the spec and the known codecs when it is not recognised.
Result<std::unique_ptr<Codec>> MakeCodec(std::string_view spec, const KvShape& shape);

}  // namespace keel::kv
