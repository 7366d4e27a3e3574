// libFuzzer target for the kvstore frame parser: arbitrary bytes are parsed as a stream of
// frames exactly as the server does (header, header checksum over the key section, key lists,
// MGET item tables). Crashes, sanitizer reports or reads past the input are bugs.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "keel/core/hash.h"
#include "keel/kvstore/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel::kvstore;
  FrameLimits limits;
  limits.max_value_bytes = 1 << 20;
  size_t off = 0;
  while (size - off >= kHeaderBytes) {
    auto h = DecodeHeader(data + off, limits);
    if (!h.ok()) return 0;
    const size_t body = static_cast<size_t>(h->key_bytes) + h->value_bytes;
    if (size - off - kHeaderBytes < body) return 0;  // truncated: the server would wait, then time out
    std::string_view keys(reinterpret_cast<const char*>(data + off + kHeaderBytes), h->key_bytes);
    if (!CheckHeaderChecksum(data + off, keys, h->header_checksum).ok()) {
      // Also exercise the key-list parser on unverified input.
      (void)ParseKeyList(keys, h->count);
      return 0;
    }
    const uint8_t* value = data + off + kHeaderBytes + h->key_bytes;
    if (keel::Xxh3_64(value, h->value_bytes) != h->value_checksum) return 0;
    if (h->op == Op::kExists || h->op == Op::kPrefix || h->op == Op::kMget) {
      auto list = ParseKeyList(keys, h->count);
      if (!list.ok()) return 0;
    }
    if (h->op == Op::kMget) {
      for (size_t i = 0; i + kMgetItemBytes <= h->value_bytes; i += kMgetItemBytes) {
        volatile auto item = DecodeMgetItem(value + i).length;
        (void)item;
      }
    }
    off += kHeaderBytes + body;
  }
  return 0;
}
