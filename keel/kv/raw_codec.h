// RawCodec: K/V stored uncompressed as fp32, bf16 or fp16. The reference every other codec is
// measured and checked against. Block layout per layer: K[n_kv_heads][block_tokens][head_dim]
// then V[n_kv_heads][block_tokens][head_dim] (head-major, so one head's rows are contiguous for
// attention), elements little-endian in the chosen type.
#pragma once

#include "keel/core/dtype.h"
#include "keel/kv/codec.h"

namespace keel::kv {

class RawCodec final : public Codec {
 public:
  RawCodec(const KvShape& shape, DType dtype);

  std::string spec() const override;
  std::string fingerprint() const override;
  const KvShape& shape() const override { return shape_; }
  size_t block_bytes(int layer) const override;
  void append(int layer, uint8_t* block, int slot, const float* k, const float* v) const override;
  void attend(int layer, const uint8_t* const* blocks, int n_tokens, const float* q, float* out,
              AttendScratch& scratch) const override;
  void attend_many(int layer, const uint8_t* const* blocks, int n_queries, const int* n_tokens, const float* q,
                   float* out, AttendScratch& scratch) const override;
  void read(int layer, const uint8_t* block, int slot, float* k, float* v) const override;
  // Any bytes of the right size, except non-finite elements: a fetched block of NaN or Inf (its
  // checksum intact) would otherwise be attended to and turn every answer into garbage.
  Result<size_t> validate_stored(int layer, const uint8_t* data, size_t size) const override;

 private:
  // Row `slot` of KV head `kvh` of K (which=0) or V (which=1) inside a block.
  const uint8_t* row(const uint8_t* block, int which, int kvh, int slot) const;
  KvShape shape_;
  DType dtype_;
  size_t elem_ = 4;
};

}  // namespace keel::kv
