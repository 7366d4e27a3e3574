// The byte encoding of shard writes, shared by the write-ahead log (one record per Upsert or
// Delete call) and the snapshot's item section. Little-endian, length-prefixed; decoding never
// trusts a length (Corruption when one runs past the end).
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/vector/shard.h"

namespace keel::vector {

// Little-endian POD append / read (the host is little-endian, as every format here assumes).
template <typename T>
void PutPod(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
// False (and `in` untouched) when fewer than sizeof(T) bytes remain.
template <typename T>
bool GetPod(std::string_view* in, T* v) {
  if (in->size() < sizeof(T)) return false;
  std::memcpy(v, in->data(), sizeof(T));
  in->remove_prefix(sizeof(T));
  return true;
}

enum class RecordType : uint8_t { kUpsert = 1, kDelete = 2 };

// id, text floats, image floats, attributes.
void EncodeItem(const Item& item, std::string* out);
Status DecodeItem(std::string_view* in, Item* item);

std::string EncodeUpsert(std::span<const Item> items);
std::string EncodeDelete(std::span<const uint64_t> ids);

struct DecodedRecord {
  RecordType type = RecordType::kUpsert;
  std::vector<Item> items;      // kUpsert
  std::vector<uint64_t> ids;    // kDelete
};
Result<DecodedRecord> DecodeRecord(std::string_view payload);

// The replication log stream (GET and POST /v1/log): one record per applied write, in version
// order: u64 version, u64 payload length, payload (an EncodeUpsert/EncodeDelete record, as in the
// write-ahead log), u64 XXH3-64 of the payload.
inline constexpr size_t kLogRecordOverhead = 24;
void AppendLogRecord(uint64_t version, std::string_view payload, std::string* out);
// Reads the record at the front of *in and advances past it. `offset` is where *in starts in
// the whole stream (for messages). Corruption naming the offset when the record is cut short or
// its checksum does not match; *in is then unchanged. The payload is not decoded.
Status NextLogRecord(std::string_view* in, size_t offset, uint64_t* version, std::string_view* payload);

}  // namespace keel::vector
