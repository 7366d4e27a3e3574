#include "keel/engine/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "keel/core/json_reader.h"

namespace keel::engine {
namespace {

using json = nlohmann::json;

// Tensors larger than this are certainly a corrupt header (and keep every size product far from
// overflowing size_t).
constexpr uint64_t kMaxTensorBytes = 1ull << 50;

// About 12 values per tensor entry: 4M allows ~300k tensors in one file (real shards hold a few
// thousand) and bounds the parsed header to ~400 MB at worst.
constexpr JsonLimits kHeaderJsonLimits{.max_depth = 8, .max_values = size_t{4} << 20};

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Well-formed safetensors dtypes that Keel does not compute with: reported as unsupported rather
// than as corruption, because the file itself is fine.
bool IsOtherSafetensorsDType(std::string_view s) {
  static const std::set<std::string_view> kKnown = {
      "BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F64",
      "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"};
  return kKnown.count(s) > 0;
}

// Product of dims times elem_size, or false when it exceeds kMaxTensorBytes.
bool CheckedBytes(const std::vector<int64_t>& shape, size_t elem_size, uint64_t* out) {
  uint64_t n = elem_size;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > kMaxTensorBytes / static_cast<uint64_t>(d)) return false;
    n *= static_cast<uint64_t>(d);
  }
  *out = n;
  return true;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Parses one header entry; `where` is the approximate byte offset of its key, for messages.
class HeaderParser {
 public:
  HeaderParser(const std::string& path, std::string_view header, size_t data_start,
               size_t data_size)
      : path_(path), header_(header), data_start_(data_start), data_size_(data_size) {}

  Status Corrupt(const std::string& name, size_t offset, const std::string& what) const {
    return Status::Corruption(path_ + ": tensor '" + name + "' at byte offset " +
                              std::to_string(offset) + ": " + what);
  }

  // Where the key `name` appears in the header text; the header start when it cannot be found
  // (another writer may have escaped it differently).
  size_t KeyOffset(const std::string& name) const {
    std::string quoted = json(name).dump();
    size_t at = header_.find(quoted);
    return 8 + (at == std::string_view::npos ? 0 : at);
  }

  Status Entry(const std::string& name, const json& v, SafetensorsTensor* t) const {
    size_t where = KeyOffset(name);
    if (!v.is_object()) return Corrupt(name, where, "entry is not a JSON object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || sh == v.end() || off == v.end()) {
      return Corrupt(name, where, "entry needs \"dtype\", \"shape\" and \"data_offsets\"");
    }
    if (!dt->is_string()) return Corrupt(name, where, "\"dtype\" is not a string");
    std::string dtype = dt->get<std::string>();
    if (!ParseSafetensorsDType(dtype, &t->dtype)) {
      if (IsOtherSafetensorsDType(dtype)) {
        return Status::InvalidArgument(path_ + ": tensor '" + name + "' at byte offset " +
                                       std::to_string(where) + ": dtype " + dtype +
                                       " is not supported (Keel reads F32, F16 and BF16)");
      }
      return Corrupt(name, where, "unknown dtype \"" + dtype + "\" (Keel reads F32, F16, BF16)");
    }
    if (!sh->is_array()) return Corrupt(name, where, "\"shape\" is not an array");
    for (const json& d : *sh) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > kMaxTensorBytes) {
        return Corrupt(name, where, "\"shape\" holds " + d.dump() + ", not a dimension");
      }
      t->shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return Corrupt(name, where, "\"data_offsets\" must be two non-negative integers, got " +
                                      off->dump());
    }
    uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end) {
      return Corrupt(name, where, "data_offsets [" + std::to_string(begin) + ", " +
                                      std::to_string(end) + ") run backwards");
    }
    if (end > data_size_) {
      // Relative numbers only: begin/end straight from the header may be near 2^64.
      return Corrupt(name, where,
                     "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                         ") run past the end of the file (the data section holds " +
                         std::to_string(data_size_) + " bytes from byte offset " +
                         std::to_string(data_start_) + ")");
    }
    uint64_t bytes = 0;
    if (!CheckedBytes(t->shape, DTypeSize(t->dtype), &bytes)) {
      return Corrupt(name, where, "shape " + ShapeString(t->shape) + " is too large");
    }
    if (bytes != end - begin) {
      return Corrupt(name, data_start_ + begin,
                     "shape " + ShapeString(t->shape) + " of " + dtype + " needs " +
                         std::to_string(bytes) + " bytes but data_offsets [" +
                         std::to_string(begin) + ", " + std::to_string(end) + ") hold " +
                         std::to_string(end - begin));
    }
    t->name = name;
    t->size = static_cast<size_t>(bytes);
    t->offset = data_start_ + static_cast<size_t>(begin);
    return Status::Ok();
  }

 private:
  const std::string& path_;
  std::string_view header_;
  size_t data_start_;
  size_t data_size_;
};

Status ParseMetadata(const std::string& path, const json& v, std::map<std::string, std::string>* out) {
  if (v.is_null()) return Status::Ok();
  if (!v.is_object()) {
    return Status::Corruption(path + ": \"__metadata__\" in the header at byte offset 8 is not an object");
  }
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it->is_string()) {
      return Status::Corruption(path + ": \"__metadata__\" value for '" + it.key() +
                                "' in the header at byte offset 8 is not a string");
    }
    (*out)[it.key()] = it->get<std::string>();
  }
  return Status::Ok();
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t TensorSpec::bytes() const {
  uint64_t n = 0;
  return CheckedBytes(shape, DTypeSize(dtype), &n) ? static_cast<size_t>(n) : 0;
}

bool ParseSafetensorsDType(std::string_view name, DType* out) {
  if (name == "F32") *out = DType::kF32;
  else if (name == "F16") *out = DType::kF16;
  else if (name == "BF16") *out = DType::kBF16;
  else return false;
  return true;
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file, MappedFile::Open(path));
  const size_t size = file->size();
  if (size < 8) {
    return Status::Corruption(path + ": file is " + std::to_string(size) +
                              " bytes, truncated inside the 8-byte header length at byte offset 0");
  }
  const uint64_t n = ReadLe64(file->data());
  if (n > kMaxHeaderBytes) {
    return Status::Corruption(path + ": header length " + std::to_string(n) +
                              " at byte offset 0 exceeds the " + std::to_string(kMaxHeaderBytes) +
                              "-byte limit");
  }
  if (n > size - 8) {
    return Status::Corruption(path + ": header length " + std::to_string(n) +
                              " at byte offset 0 runs past the end of the file (" +
                              std::to_string(size) + " bytes)");
  }
  std::string_view header(reinterpret_cast<const char*>(file->data()) + 8, n);
  // Bounded before nlohmann allocates: 100 MiB of '[' would cost gigabytes, and a deep value
  // reaching dump() in an error message would overflow the stack. Real headers nest 3 deep.
  size_t at = 0;
  switch (CheckJsonLimits(header, kHeaderJsonLimits, &at)) {
    case JsonReadError::kTooDeep:
      return Status::Corruption(path + ": JSON header nested deeper than " +
                                std::to_string(kHeaderJsonLimits.max_depth) + " at byte offset " +
                                std::to_string(8 + at));
    case JsonReadError::kTooManyValues:
      return Status::Corruption(path + ": JSON header holds more than " +
                                std::to_string(kHeaderJsonLimits.max_values) + " values at byte offset " +
                                std::to_string(8 + at));
    default:
      break;
  }
  json root;
  try {
    root = json::parse(header.begin(), header.end());
  } catch (const json::parse_error& e) {
    // e.byte is 1-based within the header text.
    size_t at = 8 + (e.byte > 0 ? e.byte - 1 : 0);
    return Status::Corruption(path + ": malformed JSON header at byte offset " +
                              std::to_string(at) + ": " + e.what());
  } catch (const json::exception& e) {  // e.g. a number too large for a double
    return Status::Corruption(path + ": malformed JSON header at byte offset 8: " + e.what());
  }
  if (!root.is_object()) {
    return Status::Corruption(path + ": header at byte offset 8 is not a JSON object");
  }

  SafetensorsFile out;
  out.file_ = file;
  const size_t data_start = 8 + static_cast<size_t>(n);
  HeaderParser parser(path, header, data_start, size - data_start);
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      KEEL_RETURN_IF_ERROR(ParseMetadata(path, *it, &out.metadata_));
      continue;
    }
    SafetensorsTensor t;
    KEEL_RETURN_IF_ERROR(parser.Entry(it.key(), *it, &t));
    t.data = file->data() + t.offset;
    out.tensors_.push_back(std::move(t));
  }
  // nlohmann's object is a std::map, so tensors_ is already sorted by name. Overlapping tensors
  // would alias each other's bytes: a corrupt (or hostile) header.
  std::vector<const SafetensorsTensor*> by_offset;
  for (const auto& t : out.tensors_) {
    if (t.size > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto* prev = by_offset[i - 1];
    if (by_offset[i]->offset < prev->offset + prev->size) {
      return Status::Corruption(path + ": tensor '" + by_offset[i]->name + "' at byte offset " +
                                std::to_string(by_offset[i]->offset) + " overlaps '" +
                                prev->name + "'");
    }
  }
  return out;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const SafetensorsTensor& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, const std::vector<TensorSpec>& specs,
    const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorSpec& s : specs) {
    if (s.name.empty() || s.name == "__metadata__" || !names.insert(s.name).second) {
      return Status::InvalidArgument(path + ": tensor name '" + s.name +
                                     "' is empty, reserved or repeated");
    }
    uint64_t bytes = 0;
    if (!CheckedBytes(s.shape, DTypeSize(s.dtype), &bytes)) {
      return Status::InvalidArgument(path + ": tensor '" + s.name + "' has shape " +
                                     ShapeString(s.shape) + ", negative or too large");
    }
    json shape = json::array();
    for (int64_t d : s.shape) shape.push_back(static_cast<uint64_t>(d));
    header[s.name] = {{"dtype", std::string(DTypeName(s.dtype))},
                      {"shape", shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception&) {  // names and metadata must be valid UTF-8 to be JSON
    return Status::InvalidArgument(path + ": a tensor name or metadata string is not valid UTF-8");
  }
  // Spaces are valid JSON whitespace. Padding puts the data on a 64-byte (cache-line) boundary in
  // the map (the format asks for 8): with row sizes that are multiples of 64 bytes, the matmul's
  // 32-byte loads then never straddle two cache lines.
  text.append((64 - (8 + text.size()) % 64) % 64, ' ');

  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  w->tmp_ = path + ".tmp." + std::to_string(::getpid());
  w->expected_ = offset;
  w->f_ = std::fopen(w->tmp_.c_str(), "wb");
  if (w->f_ == nullptr) {
    return Status::IOError(w->tmp_ + ": cannot create: " + std::strerror(errno));
  }
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, w->f_) != 8 || std::fwrite(text.data(), 1, text.size(), w->f_) != text.size()) {
    return Status::IOError(w->tmp_ + ": write failed: " + std::strerror(errno));
  }
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (f_ != nullptr) {
    std::fclose(f_);
    std::remove(tmp_.c_str());
  }
}

Status SafetensorsWriter::Write(const void* data, size_t n) {
  if (f_ == nullptr) return Status::Internal(path_ + ": write after Finish");
  if (n > expected_ - written_) {
    return Status::InvalidArgument(path_ + ": " + std::to_string(written_ + n) +
                                   " data bytes written but the tensors declare " +
                                   std::to_string(expected_));
  }
  if (n > 0 && std::fwrite(data, 1, n, f_) != n) {
    return Status::IOError(tmp_ + ": write failed: " + std::strerror(errno));
  }
  written_ += n;
  return Status::Ok();
}

Status SafetensorsWriter::Finish() {
  if (f_ == nullptr) return Status::Internal(path_ + ": Finish called twice");
  if (written_ != expected_) {
    return Status::InvalidArgument(path_ + ": only " + std::to_string(written_) + " of " +
                                   std::to_string(expected_) + " data bytes were written");
  }
  bool ok = std::fflush(f_) == 0 && ::fsync(::fileno(f_)) == 0;
  int err = errno;
  ok = (std::fclose(f_) == 0) && ok;
  f_ = nullptr;
  if (!ok) {
    std::remove(tmp_.c_str());
    return Status::IOError(tmp_ + ": flush failed: " + std::strerror(err));
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    err = errno;
    std::remove(tmp_.c_str());
    return Status::IOError(path_ + ": rename failed: " + std::strerror(err));
  }
  return Status::Ok();
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorData>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorData& t : tensors) {
    if (t.bytes.size() != t.spec.bytes()) {
      return Status::InvalidArgument(path + ": tensor '" + t.spec.name + "' has " +
                                     std::to_string(t.bytes.size()) + " bytes but shape " +
                                     ShapeString(t.spec.shape) + " of " +
                                     std::string(DTypeName(t.spec.dtype)) + " needs " +
                                     std::to_string(t.spec.bytes()));
    }
    specs.push_back(t.spec);
  }
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                        SafetensorsWriter::Create(path, specs, metadata));
  for (const TensorData& t : tensors) KEEL_RETURN_IF_ERROR(w->Write(t.bytes.data(), t.bytes.size()));
  return w->Finish();
}

}  // namespace keel::engine
