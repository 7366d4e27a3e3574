// libFuzzer target for the vector shard's binary records (keel/vector/records.h), which it reads
// from its write-ahead log and snapshots on disk and from replicas over the network (the
// replication log, GET and POST /v1/log): the input as one WAL payload (DecodeRecord) and as a
// log stream (NextLogRecord, DecodeRecord on each payload). A payload that decodes must encode
// back to bytes that decode to the same record (records are replayed and re-sent); a
// refused log record must leave the stream where it was. Crashes, sanitizer reports and broken
// invariants (abort with a message) are bugs. (The JSON side of the wire goes through
// ParseUntrustedJson: tests/core/json_reader_fuzz.cc.)
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "keel/vector/records.h"

namespace {

using namespace keel::vector;

[[noreturn]] void Broken(const char* what) {
  std::fprintf(stderr, "records_fuzz: %s\n", what);
  std::abort();
}

std::string Encode(const DecodedRecord& r) {
  return r.type == RecordType::kUpsert ? EncodeUpsert(r.items) : EncodeDelete(r.ids);
}

void Log(std::string_view bytes) {
  // The bytes both as a log stream and as one bare payload (the WAL's records). Decoding accepts
  // encodings the encoder does not write (attributes out of order or repeated), so the check is
  // that a decoded record encodes to bytes that decode to the same record.
  if (auto record = DecodeRecord(bytes); record.ok()) {
    const std::string again = Encode(*record);
    auto back = DecodeRecord(again);
    if (!back.ok() || Encode(*back) != again) Broken("a decoded record does not survive encoding");
  }
  size_t offset = 0;
  std::string_view in = bytes;
  while (!in.empty()) {
    uint64_t version = 0;
    std::string_view payload;
    const size_t before = in.size();
    if (!NextLogRecord(&in, offset, &version, &payload).ok()) {
      if (in.size() != before) Broken("a refused log record moved the stream");
      return;
    }
    if (in.size() != before - payload.size() - kLogRecordOverhead) Broken("a log record's size is off");
    offset += before - in.size();
    (void)DecodeRecord(payload);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Log(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
