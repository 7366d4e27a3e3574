#include "keel/kvstore/protocol.h"

#include "keel/kvstore/tier.h"

#include <cstring>

#include "keel/core/hash.h"

namespace keel::kvstore {
namespace {

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));  // x86-64 is little-endian, as the format
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

uint64_t HeaderChecksum(const uint8_t* header_bytes, std::string_view key_section) {
  Hasher64 h;
  h.update(header_bytes, 48);
  h.update(key_section);
  return h.digest();
}

}  // namespace

const char* OpName(Op op) {
  switch (op) {
    case Op::kPut: return "PUT";
    case Op::kGet: return "GET";
    case Op::kDel: return "DEL";
    case Op::kExists: return "EXISTS";
    case Op::kPrefix: return "PREFIX";
    case Op::kMget: return "MGET";
    case Op::kStats: return "STATS";
    case Op::kPing: return "PING";
    case Op::kError: return "ERROR";
  }
  return "UNKNOWN";
}

bool IsRequestOp(uint8_t op) { return op >= 1 && op <= 8; }

uint16_t WireStatus(StatusCode code) { return static_cast<uint16_t>(code); }

StatusCode StatusFromWire(uint16_t wire) {
  if (wire > static_cast<uint16_t>(StatusCode::kInternal)) return StatusCode::kInternal;
  return static_cast<StatusCode>(wire);
}

void EncodeHeader(FrameHeader h, std::string_view key_section, uint8_t* out) {
  Put<uint32_t>(out + 0, kFrameMagic);
  out[4] = h.version;
  out[5] = static_cast<uint8_t>(h.op);
  Put<uint16_t>(out + 6, h.status);
  Put<uint32_t>(out + 8, h.flags);
  Put<uint32_t>(out + 12, h.count);
  Put<uint32_t>(out + 16, h.key_bytes);
  Put<uint32_t>(out + 20, h.value_bytes);
  Put<uint64_t>(out + 24, h.request_id);
  Put<uint64_t>(out + 32, h.aux);
  Put<uint64_t>(out + 40, h.value_checksum);
  Put<uint64_t>(out + 48, HeaderChecksum(out, key_section));
}

Result<FrameHeader> DecodeHeader(const uint8_t* in, const FrameLimits& limits) {
  if (Get<uint32_t>(in) != kFrameMagic) return Status::Corruption("kvstore frame: bad magic");
  FrameHeader h;
  h.version = in[4];
  if (h.version != kProtocolVersion) {
    return Status::Corruption("kvstore frame: unsupported version " + std::to_string(h.version));
  }
  const uint8_t op = in[5];
  if (!IsRequestOp(op) && op != static_cast<uint8_t>(Op::kError)) {
    return Status::InvalidArgument("kvstore frame: unknown op " + std::to_string(op));
  }
  h.op = static_cast<Op>(op);
  h.status = Get<uint16_t>(in + 6);
  h.flags = Get<uint32_t>(in + 8);
  h.count = Get<uint32_t>(in + 12);
  h.key_bytes = Get<uint32_t>(in + 16);
  h.value_bytes = Get<uint32_t>(in + 20);
  h.request_id = Get<uint64_t>(in + 24);
  h.aux = Get<uint64_t>(in + 32);
  h.value_checksum = Get<uint64_t>(in + 40);
  h.header_checksum = Get<uint64_t>(in + 48);
  if (h.key_bytes > limits.max_key_section) {
    return Status::ResourceExhausted("kvstore frame: key section of " + std::to_string(h.key_bytes) +
                                     " bytes exceeds the limit of " + std::to_string(limits.max_key_section));
  }
  if (h.count > limits.max_keys) {
    return Status::ResourceExhausted("kvstore frame: " + std::to_string(h.count) + " keys exceed the limit of " +
                                     std::to_string(limits.max_keys));
  }
  if (h.value_bytes > limits.max_value_bytes) {
    return Status::ResourceExhausted("kvstore frame: value of " + std::to_string(h.value_bytes) +
                                     " bytes exceeds the limit of " + std::to_string(limits.max_value_bytes));
  }
  return h;
}

Status CheckHeaderChecksum(const uint8_t* header_bytes, std::string_view key_section, uint64_t expected) {
  if (HeaderChecksum(header_bytes, key_section) != expected) {
    return Status::Corruption("kvstore frame: header checksum mismatch");
  }
  return Status::Ok();
}

void AppendKey(std::string& section, std::string_view key) {
  uint8_t len[2];
  Put<uint16_t>(len, static_cast<uint16_t>(key.size()));
  section.append(reinterpret_cast<const char*>(len), 2);
  section.append(key);
}

Result<std::vector<std::string_view>> ParseKeyList(std::string_view section, uint32_t count) {
  std::vector<std::string_view> keys;
  keys.reserve(count);
  size_t off = 0;
  for (uint32_t i = 0; i < count; ++i) {
    if (section.size() - off < 2) {
      return Status::Corruption("kvstore frame: key list truncated at key " + std::to_string(i));
    }
    const uint16_t len = Get<uint16_t>(reinterpret_cast<const uint8_t*>(section.data()) + off);
    off += 2;
    if (len == 0 || len > kMaxKeyBytes) {
      return Status::InvalidArgument("kvstore frame: key " + std::to_string(i) + " has length " + std::to_string(len) +
                                     " (must be 1.." + std::to_string(kMaxKeyBytes) + ")");
    }
    if (section.size() - off < len) {
      return Status::Corruption("kvstore frame: key list truncated at key " + std::to_string(i));
    }
    keys.push_back(section.substr(off, len));
    off += len;
  }
  if (off != section.size()) return Status::Corruption("kvstore frame: trailing bytes after the key list");
  return keys;
}

void EncodeMgetItem(const MgetItem& item, uint8_t* out) {
  Put<uint32_t>(out, item.status);
  Put<uint32_t>(out + 4, item.length);
  Put<uint64_t>(out + 8, item.checksum);
}

MgetItem DecodeMgetItem(const uint8_t* in) {
  MgetItem item;
  item.status = static_cast<uint16_t>(Get<uint32_t>(in));
  item.length = Get<uint32_t>(in + 4);
  item.checksum = Get<uint64_t>(in + 8);
  return item;
}

}  // namespace keel::kvstore
