#include "keel/vector/texmex.h"

#include <cstring>

#include <fmt/format.h>

#include "keel/core/mapped_file.h"

namespace keel::vector {
namespace {

// Walks records of `elem_bytes`-sized elements, calling emit(record_ptr, dim) for each.
template <typename Emit>
Status WalkRecords(const std::string& path, size_t elem_bytes, int64_t max_records, int* dim_out,
                   Emit emit) {
  KEEL_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  const uint8_t* p = file->data();
  const size_t size = file->size();
  size_t off = 0;
  int dim = 0;
  int64_t n = 0;
  while (off < size && (max_records < 0 || n < max_records)) {
    if (size - off < 4) return Status::Corruption(fmt::format("{}: truncated record header at offset {}", path, off));
    int32_t d;
    std::memcpy(&d, p + off, 4);
    if (d < 1 || d > 65536)
      return Status::Corruption(fmt::format("{}: impossible dimension {} at offset {}", path, d, off));
    if (dim == 0) dim = d;
    if (d != dim)
      return Status::Corruption(fmt::format("{}: dimension {} at offset {} differs from {}", path, d, off, dim));
    if (size - off - 4 < static_cast<size_t>(d) * elem_bytes)
      return Status::Corruption(fmt::format("{}: truncated record at offset {}", path, off));
    emit(p + off + 4, d);
    off += 4 + static_cast<size_t>(d) * elem_bytes;
    ++n;
  }
  if (n == 0) return Status::Corruption(fmt::format("{}: no records", path));
  *dim_out = dim;
  return Status::Ok();
}

}  // namespace

Result<VectorSet> ReadBvecs(const std::string& path, int64_t max_records) {
  VectorSet set;
  KEEL_RETURN_IF_ERROR(WalkRecords(path, 1, max_records, &set.dim, [&](const uint8_t* r, int d) {
    for (int i = 0; i < d; ++i) set.values.push_back(static_cast<float>(r[i]));
    ++set.count;
  }));
  return set;
}

// .fvecs and .ivecs: 4-byte elements copied as they are into Set::values.
template <typename Set>
Result<Set> ReadFourByteRecords(const std::string& path, int64_t max_records) {
  Set set;
  KEEL_RETURN_IF_ERROR(WalkRecords(path, 4, max_records, &set.dim, [&](const uint8_t* r, int d) {
    size_t at = set.values.size();
    set.values.resize(at + d);
    std::memcpy(set.values.data() + at, r, static_cast<size_t>(d) * 4);
    ++set.count;
  }));
  return set;
}

Result<VectorSet> ReadFvecs(const std::string& path, int64_t max_records) {
  return ReadFourByteRecords<VectorSet>(path, max_records);
}

Result<IdSet> ReadIvecs(const std::string& path, int64_t max_records) {
  return ReadFourByteRecords<IdSet>(path, max_records);
}

}  // namespace keel::vector
