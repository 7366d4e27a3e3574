// The kvstore wire protocol: length-prefixed binary frames over one TCP connection, requests
// pipelined (a client may send many before reading), answered strictly in order.
//
// Frame = 56-byte header, key section, value section. All integers little-endian.
//   0  u32 magic "KVS1"          24 u64 request_id (echoed in the response)
//   4  u8  version (1)           32 u64 aux  (PUT: TTL in ms, 0 = none; PREFIX reply: matched keys)
//   5  u8  op                    40 u64 value_checksum: XXH3-64 of the value section
//   6  u16 status (replies)      48 u64 header_checksum: XXH3-64 of bytes [0,48) + key section
//   8  u32 flags (PUT: kPersist)
//   12 u32 count (keys in a list)
//   16 u32 key_bytes
//   20 u32 value_bytes
// Key section: one key (PUT/GET/DEL) or `count` keys, each u16 length + bytes (EXISTS, PREFIX,
// MGET). Value section: PUT value; GET reply value; EXISTS reply one byte per key; STATS reply
// JSON; an error reply's message. MGET reply: a table of `count` items {u32 status, u32 length,
// u64 checksum} then the found values back to back; value_checksum covers only the table and
// each item carries its own checksum, so a server can send stored values without hashing them
// again (they were verified once, on PUT).
//
// Why two checksums: the header checksum guards lengths before any allocation happens; the
// value checksum is stored with the value and reused for every reply.
//
// A frame that breaks the format (bad magic, version, checksum, sizes over the limits, unknown
// op) is answered with an ERROR frame and the connection is closed; the server keeps serving
// everyone else. A well-formed request that fails (key absent, store full) gets a reply with a
// non-zero status and the connection stays open.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"

namespace keel::kvstore {

inline constexpr uint32_t kFrameMagic = 0x3153564B;  // "KVS1"
inline constexpr uint8_t kProtocolVersion = 1;
inline constexpr size_t kHeaderBytes = 56;

enum class Op : uint8_t {
  kPut = 1,
  kGet = 2,
  kDel = 3,
  kExists = 4,   // one byte per key: 1 present, 0 absent
  kPrefix = 5,   // longest prefix: reply aux = how many leading keys are present
  kMget = 6,
  kStats = 7,
  kPing = 8,
  kError = 255,  // reply only: the frame was rejected; the connection closes after it
};
const char* OpName(Op op);
bool IsRequestOp(uint8_t op);

enum FrameFlags : uint32_t {
  kPersist = 1u << 0,  // PUT: reply only after the value is durable in the SSD tier
};

// Wire status codes mirror keel::StatusCode.
uint16_t WireStatus(StatusCode code);
StatusCode StatusFromWire(uint16_t wire);

struct FrameLimits {
  uint32_t max_key_section = 1u << 20;     // bytes of keys in one frame
  uint32_t max_keys = 4096;                // keys in one list
  uint64_t max_value_bytes = 64ull << 20;  // one value / one reply section
};

struct FrameHeader {
  uint8_t version = kProtocolVersion;
  Op op = Op::kPing;
  uint16_t status = 0;
  uint32_t flags = 0;
  uint32_t count = 0;
  uint32_t key_bytes = 0;
  uint32_t value_bytes = 0;
  uint64_t request_id = 0;
  uint64_t aux = 0;
  uint64_t value_checksum = 0;
  uint64_t header_checksum = 0;
};

// Serialises `h` (computing header_checksum over it and `key_section`) into out[kHeaderBytes].
// The caller sets value_checksum.
void EncodeHeader(FrameHeader h, std::string_view key_section, uint8_t* out);
// Parses the fixed fields; Corruption for a wrong magic/version, InvalidArgument for an unknown
// op or sizes beyond `limits`. The header checksum needs the key section: CheckHeaderChecksum.
Result<FrameHeader> DecodeHeader(const uint8_t* in, const FrameLimits& limits);
Status CheckHeaderChecksum(const uint8_t* header_bytes, std::string_view key_section, uint64_t expected);

// Key lists: u16 length + bytes per key.
void AppendKey(std::string& section, std::string_view key);
// Splits a key section into `count` keys (views into `section`). Corruption when the lengths
// do not add up; InvalidArgument for an empty or oversized key.
Result<std::vector<std::string_view>> ParseKeyList(std::string_view section, uint32_t count);

// One MGET reply item as sent in the table.
struct MgetItem {
  uint16_t status = 0;
  uint32_t length = 0;
  uint64_t checksum = 0;
};
inline constexpr size_t kMgetItemBytes = 16;
void EncodeMgetItem(const MgetItem& item, uint8_t* out);
MgetItem DecodeMgetItem(const uint8_t* in);

}  // namespace keel::kvstore
