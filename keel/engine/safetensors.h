// Safetensors: Hugging Face's weight file format. An 8-byte little-endian header length N, N
// bytes of JSON mapping each tensor name to {dtype, shape, data_offsets} (offsets relative to
// the byte after the header), an optional "__metadata__" map of strings, then the raw bytes.
//
// SafetensorsFile maps a file read-only and validates every header entry before anything points
// into the data, so a view it hands out always lies inside the file and has exactly
// product(shape) * element size bytes. Errors name the file and the byte offset. Immutable after
// Open; safe to read from any thread. The writers pad the header with spaces so the data starts
// 8-byte aligned, then store tensors back to back in the order given (the format forbids holes
// between tensors), and write atomically (temp file + rename): a reader never sees half a file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/core/mapped_file.h"
#include "keel/core/status.h"

namespace keel::engine {

// One tensor of an open file: a view into the map, valid while the SafetensorsFile (or a copy of
// its file() pointer) lives.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  const uint8_t* data = nullptr;
  size_t size = 0;    // bytes
  size_t offset = 0;  // absolute byte offset of the data in the file
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Largest header Open accepts; real headers are well under 1 MiB.
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  // Maps and validates `path`. NotFound/IOError from the OS; Corruption for malformed bytes
  // (message: "<path>: ... at byte offset N"), a header nested deeper than 8 or holding more than
  // 4M JSON values included; InvalidArgument for a well-formed tensor in a dtype Keel cannot
  // compute with (I8, F64, ...).
  static Result<SafetensorsFile> Open(const std::string& path);

  // Sorted by name.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const SafetensorsTensor* Find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::shared_ptr<MappedFile>& file() const { return file_; }
  const std::string& path() const { return file_->path(); }

 private:
  std::shared_ptr<MappedFile> file_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// What a writer needs to know about a tensor before its bytes exist.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t bytes() const;  // product(shape) * element size
};

// A tensor held in memory, for WriteSafetensors.
struct TensorData {
  TensorSpec spec;
  std::string_view bytes;  // must be exactly spec.bytes() long; not owned
};

// Writes a file tensor by tensor, so a large model never needs a second in-memory copy.
// Create() writes the header; then Write() takes each tensor's bytes in the order of `specs`
// (possibly in several calls per tensor); Finish() checks every byte arrived and renames the
// temp file into place. Destroying an unfinished writer removes the temp file.
class SafetensorsWriter {
 public:
  // InvalidArgument for an empty/duplicate/"__metadata__" name, a negative dimension or a size
  // that overflows; IOError if the temp file cannot be created.
  static Result<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, const std::vector<TensorSpec>& specs,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends the next bytes of the data section. InvalidArgument when more bytes arrive than the
  // specs declare.
  Status Write(const void* data, size_t n);
  // Flushes, fsyncs and renames. InvalidArgument if fewer bytes arrived than declared.
  Status Finish();

 private:
  SafetensorsWriter() = default;
  std::string path_, tmp_;
  std::FILE* f_ = nullptr;
  uint64_t expected_ = 0;  // data-section bytes declared by the specs
  uint64_t written_ = 0;
};

// Writes `tensors` (data in the given order) to `path` atomically.
Status WriteSafetensors(const std::string& path, const std::vector<TensorData>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

// "F32" -> kF32 etc.; false for anything else.
bool ParseSafetensorsDType(std::string_view name, DType* out);

}  // namespace keel::engine
