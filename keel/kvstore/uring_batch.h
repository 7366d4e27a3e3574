// Positional reads for the file-backed tiers (SsdTier, coloc::ColdTier): one read, or a batch of
// them submitted to the calling thread's io_uring together, so a GetMany of N records costs about
// one device round trip instead of N sequential ones. Falls back to preadv when io_uring is
// unavailable or refuses a read.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "keel/core/status.h"

namespace keel::kvstore {

// Submission queue entries of each thread's ring: a batch bigger than this goes in chunks of at
// most this many reads, one submit-and-wait per chunk.
inline constexpr unsigned kUringEntries = 64;

// One read of exactly the iovecs' total bytes at `offset` of `fd`. The iovecs are consumed (the
// array is advanced in place as bytes arrive); the caller owns the buffers.
struct BatchRead {
  int fd = -1;
  const std::string* path = nullptr;  // for error messages
  uint64_t offset = 0;
  iovec iov[2] = {};
  int iovcnt = 0;
};

// Runs every read; `out[i]` is read i's outcome: OK, Corruption when the file ends before the
// read does (the index promised more), IOError when the OS fails. `out` must be as long as
// `reads`. With use_io_uring the reads are submitted together (in chunks of kUringEntries),
// else each is a preadv.
void ReadBatch(std::span<BatchRead> reads, std::span<Status> out, bool use_io_uring);

// ReadBatch of one.
Status ReadFully(int fd, const std::string& path, uint64_t offset, iovec* iov, int iovcnt, bool use_io_uring);

// Whether this thread can have an io_uring (tries to set up its ring on first use).
bool ThreadHasIoUring();

// Drops `n` consumed bytes from the front of an iovec array (skipping empty entries too).
void AdvanceIov(iovec*& iov, int& iovcnt, size_t n);

}  // namespace keel::kvstore
