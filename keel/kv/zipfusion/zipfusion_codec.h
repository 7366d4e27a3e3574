// ZipFusionCodec: a lossless KV codec. K/V are rounded to bf16 (or fp16) exactly as raw:bf16
// (raw:f16) does; each full cache block is then stored as one ZipFusion block per KV head and
// K/V (format.h), and attention widens the compressed rows straight into fp32 lanes. Outputs are
// bit-identical to raw:bf16 (raw:f16): both run the shared attention core (attention.h) on the
// same fp32 values.
//
// A block that is still filling keeps its tokens as plain 16-bit values; it is encoded once,
// when its last token arrives, so the append path encodes each block exactly once. The cache
// reserves the worst-case size per block (format.h: 8 + 2n bytes per region), so memory per
// block is that of raw plus headers; what shrinks is the bytes attention reads.
#pragma once

#include <memory>

#include "keel/core/dtype.h"
#include "keel/core/status.h"
#include "keel/kv/codec.h"

namespace keel::kv::zipfusion {

// dtype: DType::kBF16 or DType::kF16. InvalidArgument if the head dim is not a multiple of 8 or a
// block holds more than kMaxElements values per head.
Result<std::unique_ptr<Codec>> MakeZipFusionCodec(const KvShape& shape, DType dtype);

// Bytes attention would read for the first `n_tokens` tokens of one layer (headers, sections and
// exceptions of full blocks; 16-bit values of a filling block). For benchmarks and docs.
size_t StoredBytes(const Codec& codec, const uint8_t* const* blocks, int n_tokens);

}  // namespace keel::kv::zipfusion
