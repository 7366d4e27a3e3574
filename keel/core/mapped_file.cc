#include "keel/core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <algorithm>
#include <fstream>

namespace keel {

Result<std::shared_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer before the type check below.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    std::string msg = path + ": " + std::strerror(err);
    if (err == ENOENT) return Status::NotFound(msg);
    return Status::IOError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string msg = path + ": fstat: " + std::strerror(errno);
    ::close(fd);
    return Status::IOError(msg);
  }
  if (!S_ISREG(st.st_mode)) {
    const bool dir = S_ISDIR(st.st_mode);
    ::close(fd);
    return Status::InvalidArgument(path + (dir ? ": is a directory, not a file" : ": not a regular file"));
  }
  size_t size = static_cast<size_t>(st.st_size);
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string msg = path + ": mmap: " + std::strerror(errno);
      ::close(fd);
      return Status::IOError(msg);
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file referenced
  return std::shared_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

Result<std::string> ReadFileToString(const std::string& path, size_t max_bytes) {
  return ReadSmallFile(path, max_bytes);
}

Result<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer before the type check below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::IOError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const bool dir = S_ISDIR(st.st_mode);
    ::close(fd);
    return Status::InvalidArgument(path + (dir ? ": is a directory, not a file" : ": not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return Status::InvalidArgument(path + ": " + std::to_string(st.st_size) + " bytes, larger than the limit of " +
                                   std::to_string(max_bytes));
  }
  // Sized by the file, not the limit; one byte more catches a file that grew since fstat, and
  // it may grow on up to one byte past the limit.
  std::string out(static_cast<size_t>(st.st_size) + 1, '\0');
  size_t got = 0;
  for (;;) {
    if (got == out.size()) {
      if (out.size() > max_bytes) break;
      out.resize(std::min(max_bytes + 1, out.size() * 2));
    }
    const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      return Status::IOError(path + ": read failed: " + err);
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got > max_bytes) return Status::InvalidArgument(path + ": larger than the limit of " + std::to_string(max_bytes) + " bytes");
  out.resize(got);
  return out;
}

Status WriteFileAtomic(const std::string& path, std::string_view data) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::IOError(tmp + ": cannot open for writing");
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    out.flush();
    if (!out) return Status::IOError(tmp + ": write failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::IOError(path + ": rename failed: " + std::strerror(errno));
  }
  return Status::Ok();
}

Status WriteAllToFd(int fd, const std::string& path, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return Status::IOError(path + ": write: " + std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status SyncParentDir(const std::string& file) {
  std::string dir = std::filesystem::path(file).parent_path().string();
  if (dir.empty()) dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(dir + ": open: " + std::strerror(errno));
  int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? Status::Ok() : Status::IOError(dir + ": fsync: " + std::strerror(errno));
}

}  // namespace keel
