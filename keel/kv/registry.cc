#include "keel/kv/registry.h"

#include "keel/kv/bellows/bellows_codec.h"
#include "keel/kv/kivi/kivi_codec.h"
#include "keel/kv/minicache/minicache_codec.h"
#include "keel/kv/raw_codec.h"
#include "keel/kv/zipfusion/zipfusion_codec.h"

namespace keel::kv {

namespace {

Result<std::unique_ptr<Codec>> MakeRaw(std::string_view variant, const CodecContext& context) {
  if (variant.empty() || variant == "f32") return std::unique_ptr<Codec>(new RawCodec(context.shape, DType::kF32));
  if (variant == "bf16") return std::unique_ptr<Codec>(new RawCodec(context.shape, DType::kBF16));
  if (variant == "f16") return std::unique_ptr<Codec>(new RawCodec(context.shape, DType::kF16));
  return Status::InvalidArgument("unknown raw KV dtype '" + std::string(variant) + "'; known: f32, bf16, f16");
}

Result<std::unique_ptr<Codec>> MakeZipFusion(std::string_view variant, const CodecContext& context) {
  if (variant.empty() || variant == "bf16") return zipfusion::MakeZipFusionCodec(context.shape, DType::kBF16);
  if (variant == "f16") return zipfusion::MakeZipFusionCodec(context.shape, DType::kF16);
  return Status::InvalidArgument("unknown zipfusion dtype '" + std::string(variant) + "'; known: bf16, f16");
}

Result<std::unique_ptr<Codec>> MakeKivi(std::string_view variant, const CodecContext& context) {
  return MakeKiviCodec(variant, context.shape);
}

}  // namespace

const std::vector<CodecFamily>& CodecFamilies();

namespace {

// The registered family of spec ("name[:variant]"), or nullptr.
const CodecFamily* FindFamily(std::string_view spec) {
  const std::string_view name = CodecFamilyName(spec);
  for (const CodecFamily& family : CodecFamilies()) {
    if (family.name == name) return &family;
  }
  return nullptr;
}

}  // namespace

const std::vector<CodecFamily>& CodecFamilies() {
  static const std::vector<CodecFamily> families = {
      {"raw", "raw (= raw:f32), raw:f32, raw:bf16, raw:f16", MakeRaw, /*lossless=*/true},
      {"zipfusion", "zipfusion (= zipfusion:bf16), zipfusion:f16", MakeZipFusion, /*lossless=*/true},
      {"bellows", "bellows (with --bellows FILE)", bellows::MakeBellowsCodec, /*lossless=*/false},
      {"minicache", "minicache, minicache:q4 (options q4, keepD, fromL)", minicache::MakeMiniCacheCodec,
       /*lossless=*/false},
      {"kivi", "kivi (= kivi:2), kivi:4", MakeKivi, /*lossless=*/false},
  };
  return families;
}

Result<std::unique_ptr<Codec>> MakeCodec(std::string_view spec, const CodecContext& context) {
  const KvShape& shape = context.shape;
  if (shape.n_layers < 0 || shape.n_heads <= 0 || shape.n_kv_heads <= 0 || shape.head_dim <= 0 ||
      shape.block_tokens <= 0 || shape.n_heads % shape.n_kv_heads != 0) {
    return Status::InvalidArgument("kv codec: invalid KV shape");
  }
  const size_t colon = spec.find(':');
  const std::string_view variant = colon == std::string_view::npos ? std::string_view() : spec.substr(colon + 1);
  if (const CodecFamily* family = FindFamily(spec)) return family->make(variant, context);
  return Status::InvalidArgument("unknown KV codec '" + std::string(spec) + "'; known codecs: " + KnownCodecs());
}

Result<std::unique_ptr<Codec>> MakeCodec(std::string_view spec, const KvShape& shape) {
  CodecContext context;
  context.shape = shape;
  return MakeCodec(spec, context);
}

std::string_view CodecFamilyName(std::string_view spec) { return spec.substr(0, spec.find(':')); }

std::optional<bool> IsLosslessCodec(std::string_view spec) {
  const CodecFamily* family = FindFamily(spec);
  return family ? std::optional<bool>(family->lossless) : std::nullopt;
}

std::string KnownCodecs() {
  std::string out;
  for (const CodecFamily& family : CodecFamilies()) {
    if (!out.empty()) out += ", ";
    out += family.variants;
  }
  return out;
}

}  // namespace keel::kv
