#include "keel/kv/codec.h"

#include "keel/kv/raw_codec.h"
#include "keel/kv/zipfusion/zipfusion_codec.h"

namespace keel::kv {

Result<std::unique_ptr<Codec>> MakeCodec(std::string_view spec, const KvShape& shape) {
  if (shape.n_heads <= 0 || shape.n_kv_heads <= 0 || shape.head_dim <= 0 || shape.block_tokens <= 0 ||
      shape.n_heads % shape.n_kv_heads != 0) {
    return Status::InvalidArgument("kv codec: invalid KV shape");
  }
  if (spec == "raw" || spec == "raw:f32") return std::unique_ptr<Codec>(new RawCodec(shape, DType::kF32));
  if (spec == "raw:bf16") return std::unique_ptr<Codec>(new RawCodec(shape, DType::kBF16));
  if (spec == "raw:f16") return std::unique_ptr<Codec>(new RawCodec(shape, DType::kF16));
  if (spec == "zipfusion" || spec == "zipfusion:bf16") return zipfusion::MakeZipFusionCodec(shape, DType::kBF16);
  if (spec == "zipfusion:f16") return zipfusion::MakeZipFusionCodec(shape, DType::kF16);
  return Status::InvalidArgument("unknown KV codec '" + std::string(spec) +
                                 "'; known codecs: raw (= raw:f32), raw:f32, raw:bf16, raw:f16, "
                                 "zipfusion (= zipfusion:bf16), zipfusion:f16");
}

}  // namespace keel::kv
