// KiviCodec: a lossy, tuning-free 2- or 4-bit KV codec after KIVI (Liu et al., arXiv 2402.02750),
// kept as a baseline for the lossy codecs (BellowsKV). K is quantized per channel over the tokens
// of a cache block, V per token over a head's channels: keys have a few outlier channels, values
// do not, and the error of V stays within the token it belongs to. Both use KIVI's asymmetric
// integer quantization, x ~ q * scale + min with q = round((x - min) / scale) in [0, 2^bits).
//
// KIVI keeps the most recent tokens in full precision (its residual); here that is the block
// being filled, whose tokens are stored as bf16 exactly as raw:bf16 stores them, so attention over
// it equals raw:bf16 bit for bit. When a block is full the cache compacts it (Codec::compact) to
// the quantized form; only then is anything lost. A per-layer codec: group_size() is 1.
//
// Block layout (per layer), both forms starting with a 16-byte header whose first byte says which:
//   open:    header[0] = 0, then K[n_kv_heads][block_tokens][head_dim] and V likewise, bf16.
//   packed:  header = 'Q', bits, param type (0 fp16, 1 bf16), 13 zero bytes; then per KV head
//            K scale[head_dim], K min[head_dim], K codes[block_tokens][head_dim],
//            V scale[block_tokens], V min[block_tokens], V codes[block_tokens][head_dim],
//            scales and mins as 16-bit floats of the param type, codes `bits` wide, packed
//            little-endian in element order (element e of a row at bits [e*bits, (e+1)*bits));
//            the block is zero-padded to a multiple of 16 bytes. The param type is fp16 (11
//            significant bits, what KIVI keeps) unless a value falls outside fp16's range, then
//            bf16 for that whole block.
// The min is rounded down and the scale up to the param type, so [min, min + (2^bits-1) * scale]
// covers every stored value and each is within scale/2 (plus fp32 rounding) of its dequantized
// value. Non-finite K/V (a model that overflowed) is stored clamped to +-1e30 (NaN as 0).
// validate_stored() accepts a packed block only (a full block is always packed) with this
// codec's bits, zero reserved and padding bytes, finite params, non-negative scales and every
// dequantized value within +-2^100, so attention over an accepted block cannot overflow.
//
// Attention runs the shared core (attention.h): its readers widen 8 codes at a time into fp32
// lanes (q * scale + min, one FMA); attend() equals the core over the dequantized fp32 rows bit for
// bit. Thread safety as for every Codec: the object is immutable after construction.
#pragma once

#include <memory>
#include <string_view>

#include "keel/core/status.h"
#include "keel/kv/codec.h"

namespace keel::kv {

// variant: "2" or "4" (bits), "" = "2". InvalidArgument for another variant, a head_dim that is
// not a multiple of 8 (or above kMaxHeadDim), or a block too small for the packed form to be
// smaller than the open one.
Result<std::unique_ptr<Codec>> MakeKiviCodec(std::string_view variant, const KvShape& shape);

// Bytes of one packed block of one layer: the header, the codes and the 16-bit params, rounded
// up to 16. For benchmarks and docs (compression = 2 * block_tokens * kv_dim * 2 / this).
size_t KiviPackedBytes(const KvShape& shape, int bits);

}  // namespace keel::kv
