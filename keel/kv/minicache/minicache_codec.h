// MiniCacheCodec: cross-layer KV merging after MiniCache (Liu et al., NeurIPS'24, arXiv 2405.14366),
// kept as a baseline for BellowsKV (issue 18). Adjacent layers are paired, (0,1), (2,3), ...
// (group_size 2; an odd last layer is a group of one stored as bf16). A token is stored at group
// end (Codec::store_group): for each KV head, separately for K (post-RoPE) and V, the two layers'
// vectors x0, x1 are split into norms n_i = |x_i| and directions u_i = x_i / n_i; the directions
// are merged by SLERP at t = 0.5 (MiniCache's default)
//   e = sin((1-t) W) / sin W * u0 + sin(t W) / sin W * u1,   W = acos(u0 . u1)
// (linear, (1-t) u0 + t u1, where sin W < 1e-6) and stored once with both norms (fp32, exact); layer i
// is restored as n_i * e. Both layers share the same RoPE rotation at a token's position, which
// preserves angles and norms, so merging post-RoPE keys is merging pre-RoPE ones rotated.
//
// Variant: comma-separated options, any subset of "q4", "keepD", "fromL" (e.g. "minicache",
// "minicache:q4", "minicache:q4,keep0.3,from2"):
//  - q4: the stored directions are quantized to 4 bits per element, one min/scale pair (fp16;
//    min rounded down, scale up, so each element is within scale/2 of its value) per token, head
//    and K/V (MiniCache + 4-bit quantization, the paper's ~5x setting). Otherwise bf16.
//  - keepD: MiniCache's token retention. A (token, head, K/V) pair whose angular distance W / pi
//    exceeds D (0 < D < 1) is not merged: each layer keeps its own direction (same precision)
//    and its norm. MiniCache sets the threshold at d_min + (d_max - d_min) * gamma over a whole
//    prompt; a codec that stores one token at a time knows no d_min or d_max, so D is absolute.
//    The share of pairs kept depends on the data, so a block is allocated for the worst case
//    (every pair kept) and compacted once full (Codec::compact): kept directions are written in
//    row order, so the compact form is the full block cut after the last kept direction, and
//    both forms read alike.
//  - fromL: pairs starting before layer L are stored as bf16, not merged. MiniCache merges only
//    from about half depth, where it finds adjacent layers alike; default 0: every pair.
//
// Block layout of a pair group (little-endian). Row r = (slot * 2 + kv) * n_kv_heads + head,
// kv 0 = K, 1 = V; R = block_tokens * 2 * n_kv_heads rows.
//   flags   (only with keep): ceil(R / 32) uint32 words, bit r set = row r kept unmerged; bits
//           past R are zero.
//   records [R]: norm0 f32, norm1 f32, direction (layer 0's own direction when kept)
//   kept    [number of kept rows]: layer 1's direction, in row order
// A direction is bf16[head_dim] (2 * head_dim bytes), or with q4: min f16, scale f16, then
// head_dim 4-bit codes, element 2j in the low nibble of byte j (4 + head_dim / 2 bytes). The
// block is zero-padded to 16 bytes. Bytes per token of a pair: 2 * n_kv_heads * (8 + dir), plus
// dir per kept row (and the flags); e.g. head_dim 32, 2 KV heads, nothing kept: 288 (bf16) or
// 112 (q4) against 512 for raw:bf16 of the two layers.
// A group stored as bf16 (a lone last layer, pairs before L): per layer, K[block_tokens][kv_dim]
// then V[block_tokens][kv_dim].
//
// Attention reads every stored token back (read_at) and runs the shared arithmetic (DotF32,
// SoftmaxF32, AxpyF32): Codec::attend_pending's reference. The token being stored attends to
// its own K/V exact (kv/codec.h). Thread safety as for every Codec: immutable after construction.
#pragma once

#include <memory>
#include <string_view>

#include "keel/core/status.h"
#include "keel/kv/codec.h"

namespace keel::kv::minicache {

// InvalidArgument for an unknown variant, a keep threshold outside (0, 1), a first merged layer
// that is not a layer, or an odd head_dim.
Result<std::unique_ptr<Codec>> MakeMiniCacheCodec(std::string_view variant, const KvShape& shape);
// The registry's factory (registry.h): the same, from the context's shape.
Result<std::unique_ptr<Codec>> MakeMiniCacheCodec(std::string_view variant, const CodecContext& context);

}  // namespace keel::kv::minicache
