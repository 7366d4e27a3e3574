#include "keel/vector/records.h"

#include <cstring>

#include "keel/core/hash.h"

namespace keel::vector {

namespace {

// An encoded item's least size: id, text and image counts, attribute count.
constexpr size_t kMinItemBytes = sizeof(uint64_t) + 3 * sizeof(uint32_t);

void PutFloats(std::string* out, const std::vector<float>& v) {
  PutPod(out, static_cast<uint32_t>(v.size()));
  out->append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

bool GetFloats(std::string_view* in, std::vector<float>* v) {
  uint32_t n = 0;
  if (!GetPod(in, &n) || in->size() / sizeof(float) < n) return false;
  v->resize(n);
  if (n > 0) std::memcpy(v->data(), in->data(), n * sizeof(float));  // an empty vector's data() may be null
  in->remove_prefix(n * sizeof(float));
  return true;
}

void PutString(std::string* out, const std::string& s) {
  PutPod(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}

bool GetString(std::string_view* in, std::string* s) {
  uint32_t n = 0;
  if (!GetPod(in, &n) || in->size() < n) return false;
  s->assign(in->data(), n);
  in->remove_prefix(n);
  return true;
}

}  // namespace

void EncodeItem(const Item& item, std::string* out) {
  PutPod(out, item.id);
  PutFloats(out, item.text);
  PutFloats(out, item.image);
  PutPod(out, static_cast<uint32_t>(item.attributes.size()));
  for (const auto& [k, v] : item.attributes) {
    PutString(out, k);
    PutString(out, v);
  }
}

Status DecodeItem(std::string_view* in, Item* item) {
  uint32_t attrs = 0;
  if (!GetPod(in, &item->id) || !GetFloats(in, &item->text) || !GetFloats(in, &item->image) || !GetPod(in, &attrs)) {
    return Status::Corruption("item record truncated");
  }
  item->attributes.clear();
  for (uint32_t i = 0; i < attrs; ++i) {
    std::string k, v;
    if (!GetString(in, &k) || !GetString(in, &v)) return Status::Corruption("item attributes truncated");
    item->attributes.emplace(std::move(k), std::move(v));
  }
  return Status::Ok();
}

std::string EncodeUpsert(std::span<const Item> items) {
  size_t guess = 5;
  for (const auto& it : items) guess += 32 + (it.text.size() + it.image.size()) * sizeof(float);
  std::string out;
  out.reserve(guess);
  PutPod(&out, static_cast<uint8_t>(RecordType::kUpsert));
  PutPod(&out, static_cast<uint32_t>(items.size()));
  for (const auto& it : items) EncodeItem(it, &out);
  return out;
}

std::string EncodeDelete(std::span<const uint64_t> ids) {
  std::string out;
  PutPod(&out, static_cast<uint8_t>(RecordType::kDelete));
  PutPod(&out, static_cast<uint32_t>(ids.size()));
  out.append(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(uint64_t));
  return out;
}

Result<DecodedRecord> DecodeRecord(std::string_view payload) {
  DecodedRecord r;
  uint8_t type = 0;
  uint32_t n = 0;
  if (!GetPod(&payload, &type) || !GetPod(&payload, &n)) return Status::Corruption("record header truncated");
  if (type == static_cast<uint8_t>(RecordType::kUpsert)) {
    r.type = RecordType::kUpsert;
    // The count is untrusted: check it against the bytes before allocating for it (5 bytes
    // claiming 2^32 items asked for ~400 GiB of Items).
    if (payload.size() / kMinItemBytes < n) {
      return Status::Corruption("upsert record claims " + std::to_string(n) + " items in " +
                                std::to_string(payload.size()) + " bytes");
    }
    r.items.resize(n);
    for (auto& it : r.items) KEEL_RETURN_IF_ERROR(DecodeItem(&payload, &it));
  } else if (type == static_cast<uint8_t>(RecordType::kDelete)) {
    r.type = RecordType::kDelete;
    if (payload.size() / sizeof(uint64_t) < n) return Status::Corruption("delete record truncated");
    r.ids.resize(n);
    if (n > 0) std::memcpy(r.ids.data(), payload.data(), n * sizeof(uint64_t));
    payload.remove_prefix(n * sizeof(uint64_t));
  } else {
    return Status::Corruption("unknown record type " + std::to_string(type));
  }
  if (!payload.empty()) return Status::Corruption("record has " + std::to_string(payload.size()) + " trailing bytes");
  return r;
}

void AppendLogRecord(uint64_t version, std::string_view payload, std::string* out) {
  PutPod(out, version);
  PutPod(out, static_cast<uint64_t>(payload.size()));
  out->append(payload);
  PutPod(out, Xxh3_64(payload.data(), payload.size()));
}

Status NextLogRecord(std::string_view* in, size_t offset, uint64_t* version, std::string_view* payload) {
  auto bad = [&](const std::string& why) {
    return Status::Corruption("log record at byte " + std::to_string(offset) + ": " + why);
  };
  std::string_view rest = *in;
  uint64_t len = 0, sum = 0;
  if (!GetPod(&rest, version) || !GetPod(&rest, &len)) return bad("truncated header");
  if (rest.size() < len || rest.size() - len < sizeof(sum)) return bad("truncated (payload of " + std::to_string(len) + " bytes)");
  std::string_view p = rest.substr(0, len);
  rest.remove_prefix(len);
  GetPod(&rest, &sum);
  if (Xxh3_64(p.data(), p.size()) != sum) return bad("checksum mismatch");
  *payload = p;
  *in = rest;
  return Status::Ok();
}

}  // namespace keel::vector
