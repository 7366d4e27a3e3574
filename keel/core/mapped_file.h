// MappedFile: a read-only memory map of a whole file. Model weights are used straight from the
// map, so a model's bytes exist once in memory (the page cache). Immutable after Open and safe
// to read from any thread. Not copyable; the mapping lives as long as the object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "keel/core/status.h"

namespace keel {

class MappedFile {
 public:
  // Maps `path` read-only. NotFound if it does not exist, IOError if it cannot be mapped.
  // An empty file maps to size() == 0 and data() == nullptr.
  static Result<std::shared_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_;
  size_t size_;
};

// Reads a whole regular file of at most max_bytes into a string: ReadSmallFile with a limit
// for files of any kind a program reads whole (tokenizers, configs, calibrations, traces).
inline constexpr size_t kMaxWholeFileBytes = size_t{1} << 30;
Result<std::string> ReadFileToString(const std::string& path, size_t max_bytes = kMaxWholeFileBytes);
// For small files that a user names (catalogs, keys, tokens): reads at most max_bytes, refusing
// anything that is not a regular file (a FIFO would block, /dev/zero never end) and a file
// larger than max_bytes (InvalidArgument naming both), without reading it whole first.
Result<std::string> ReadSmallFile(const std::string& path, size_t max_bytes);
// Writes `data` to `path` atomically (temp file + rename).
Status WriteFileAtomic(const std::string& path, std::string_view data);
// Writes all n bytes to fd, retrying short writes and EINTR. IOError naming `path` otherwise.
Status WriteAllToFd(int fd, const std::string& path, const void* data, size_t n);
// fsyncs the directory that holds `file`, so that a rename into it survives a crash.
Status SyncParentDir(const std::string& file);

}  // namespace keel
