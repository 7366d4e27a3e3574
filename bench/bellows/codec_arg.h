// A KV codec as the bellows benchmarks take it on the command line:
//   [label=]spec[@name=value[,name=value...]]
// e.g. "raw:bf16", "kivi:2", "plain14x=bellows@bellows=/tmp/p.bkv". The label names the table row
// (default: the whole argument); the named parameters go to the cache's codec
// (KvCacheOptions::codec_params, see ApplyCodecParams). Header-only: each bench is one file.
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "keel/core/status.h"
#include "keel/engine/kv_cache.h"

namespace keel::bench {

struct CodecArg {
  std::string text;   // as typed
  std::string label;  // table row name
  std::string spec;   // what kv::MakeCodec / KvCache::Create get
  std::map<std::string, std::string> params;
};

// InvalidArgument names the argument and what is wrong with it.
inline Result<CodecArg> ParseCodecArg(std::string_view text) {
  CodecArg a;
  a.text = std::string(text);
  std::string_view head = text, tail;
  bool has_params = false;
  if (size_t at = text.find('@'); at != std::string_view::npos) {
    head = text.substr(0, at);
    tail = text.substr(at + 1);
    has_params = true;
  }
  // A spec never holds '=', so one in the head ends a label.
  if (size_t eq = head.find('='); eq != std::string_view::npos) {
    a.label = std::string(head.substr(0, eq));
    head = head.substr(eq + 1);
    if (a.label.empty()) return Status::InvalidArgument("codec '" + a.text + "': empty label before '='");
  }
  a.spec = std::string(head);
  if (a.spec.empty()) return Status::InvalidArgument("codec '" + a.text + "': no codec spec");
  if (a.label.empty()) a.label = a.text;
  while (has_params) {
    size_t comma = tail.find(',');
    std::string_view item = tail.substr(0, comma);
    size_t eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      return Status::InvalidArgument("codec '" + a.text + "': parameter '" + std::string(item) +
                                     "' is not name=value");
    }
    std::string name(item.substr(0, eq));
    if (a.params.count(name) != 0) {
      return Status::InvalidArgument("codec '" + a.text + "': parameter '" + name + "' given twice");
    }
    a.params[name] = std::string(item.substr(eq + 1));
    if (comma == std::string_view::npos) break;
    tail = tail.substr(comma + 1);
  }
  return a;
}

// Hands the codec parameters to the cache options. Written against any options type so that it
// compiles both before and after KvCacheOptions gained `codec_params`; without that field a codec
// that needs parameters cannot be run, which is an error rather than silently running without.
template <typename Options>
Status ApplyCodecParams(const CodecArg& a, Options& o) {
  if constexpr (requires { o.codec_params = a.params; }) {
    o.codec_params = a.params;
    return Status::Ok();
  } else {
    if (a.params.empty()) return Status::Ok();
    return Status::InvalidArgument("codec '" + a.text +
                                   "': this build's KvCacheOptions has no codec_params to pass parameters through");
  }
}

}  // namespace keel::bench
