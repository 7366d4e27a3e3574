// The KV codec registry: a codec family is a name and a factory; MakeCodec (codec.h) parses
// "name[:variant]", finds the family and calls its factory with the variant and the context.
// The built-in families are listed in registry.cc, one line each: adding a codec is a folder
// under keel/kv/ plus that line.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/kv/codec.h"

namespace keel::kv {

using CodecFactory = Result<std::unique_ptr<Codec>> (*)(std::string_view variant, const CodecContext& context);

struct CodecFamily {
  std::string_view name;      // the spec's part before ':'
  std::string_view variants;  // for --help and errors, e.g. "raw (= raw:f32), raw:f32, raw:bf16, raw:f16"
  CodecFactory make;
  // Stores K/V with no approximation beyond its 16- or 32-bit float dtype (raw; zipfusion, which
  // is bit-identical to raw:bf16), as opposed to low rank, merged layers or few-bit quantisation.
  // A HiLO level with engine.lossless = true may only name such a family.
  bool lossless = false;
};

// Every registered family, in the order --help lists them.
const std::vector<CodecFamily>& CodecFamilies();
// One line naming every accepted spec, for --help and error messages.
std::string KnownCodecs();
// The family part of a spec: "bellows" for "bellows" and "bellows:x". Not checked against the
// registry.
std::string_view CodecFamilyName(std::string_view spec);
// Whether spec's family is lossless (above); nullopt for a family that is not registered. The
// variant is not checked: MakeCodec does that.
std::optional<bool> IsLosslessCodec(std::string_view spec);

}  // namespace keel::kv
