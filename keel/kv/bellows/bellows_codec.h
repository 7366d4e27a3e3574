// BellowsCodec: the BellowsKV runtime. Each group of adjacent layers stores ONE latent vector per
// token (bf16, the calibration's rank for that group) instead of every layer's K and V:
//   z = (concat of the group's layer inputs - x_mean) * compress          at group end
//   k_pre_l = k_mean_l + z_k * rk_l,  v_l = v_mean_l + z_v * rv_l            when attending
// then RoPE is re-applied to the restored key at its position (kv/rope.h, the engine's rotation).
// The matrices come from a calibration file (`keel bellows calibrate`, calibration.h) made for
// this very model: another model's file, or a truncated or corrupt one, is refused when the
// codec is built.
//
// Raw window rule: a token's K/V exist raw only while its group runs (one forward step); it
// attends to its own exact K/V and to the restored K/V of every earlier token, and is stored as
// a latent when the group's last layer has run. No raw copy outlives the step, so the cache
// holds latents only and prefill and decode leave identical caches (kv/codec.h).
//
// Block layout per group: z[block_tokens][rank] as little-endian bf16, padded to 16 bytes. No
// compaction, no per-block metadata.
//
// Attention, per (layer, KV head), over blocks of block_tokens tokens: keys are restored a block
// at a time into scratch (z_k * rk, then RoPE from a cos/sin table), scored with the shared
// arithmetic (DotF32, SoftmaxF32); values are never restored: the probabilities weight the
// latents, sum_t p_t v_t = v_mean * sum_t p_t + (sum_t p_t z_v,t) * rv, which costs rank_v per
// token instead of rank_v * head_dim.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/kv/bellows/calibration.h"
#include "keel/kv/codec.h"

namespace keel::kv::bellows {

// Builds the codec from context.params["bellows"] (the calibration file's path), checked against
// the model (context.model_checksum, the shape). `variant` must be empty.
Result<std::unique_ptr<Codec>> MakeBellowsCodec(std::string_view variant, const CodecContext& context);
// The same from a calibration in memory (tests, the calibration tool's own evaluation).
Result<std::unique_ptr<Codec>> MakeBellowsCodec(const Calibration& calibration, const KvShape& shape);

}  // namespace keel::kv::bellows
