// DirLock: one process (one owner) per data directory. Two servers appending to one directory
// would interleave or overwrite each other's files and lose acknowledged writes, so an owner takes
// an exclusive flock on a lock file in it for as long as it lives. The kernel drops the lock when
// the process dies (kill -9 included), so a crash never leaves a stale lock behind.
#pragma once

#include <string>
#include <string_view>

#include "keel/core/status.h"

namespace keel {

class DirLock {
 public:
  // Locks dir/name (created when missing). Unavailable naming the directory and `owner` (what
  // would use it, for the message) when another DirLock holds it, in this process or another;
  // IOError when the file cannot be opened or locked.
  static Result<DirLock> Acquire(const std::string& dir, std::string_view name, std::string_view owner);

  DirLock() = default;
  DirLock(DirLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();

  bool held() const { return fd_ >= 0; }

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace keel
