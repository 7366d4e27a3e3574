// ColdTier: the "compressed cold segment" tier of a TieredStore (tiered_store.h): a
// kvstore::SsdTier whose values are zstd frames. Cold vectors are the bulk of a shard and are
// read rarely, so they trade CPU (decompression) for bytes on disk. Everything about segments —
// append-only files with per-record checksums, recovery (torn tails cut, rotted records skipped),
// io_uring batched reads, reads around the page cache — is SsdTier's; this class only adds the
// codec. Reads verify the stored bytes' checksum (SsdTier) before they reach the decompressor and
// the decompressed size after; a mismatch is Corruption, never wrong data.
//
// Stats().bytes counts compressed bytes. Thread-safe as SsdTier is.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"
#include "keel/kvstore/ssd_tier.h"
#include "keel/kvstore/tier.h"

namespace keel::vector::coloc {

// Values above this are rejected on write and treated as corruption on read.
inline constexpr uint64_t kColdMaxValueBytes = uint64_t{256} << 20;

struct ColdTierOptions {
  std::string dir;                            // created if missing; holds only this tier's files
  int zstd_level = 3;
  int64_t segment_bytes = int64_t{64} << 20;  // roll to a new segment file past this size
  bool uncached_reads = true;                 // drop read ranges from the page cache
  bool sync_each_put = false;                 // fdatasync before Put/Delete return
  bool use_io_uring = true;                   // false, or io_uring unavailable: pread
};

using ColdRecovery = kvstore::SsdRecovery;

class ColdTier : public kvstore::Tier {
 public:
  // Opens (or creates) the tier in options.dir. InvalidArgument for bad options (zstd level
  // outside 1..19); otherwise SsdTier::Open's errors.
  static Result<std::unique_ptr<ColdTier>> Open(const ColdTierOptions& options);

  std::string_view name() const override { return "cold"; }
  Status Put(std::string_view key, const kvstore::Entry& entry) override;
  Result<kvstore::Entry> Get(std::string_view key) override;
  // One io_uring submission for the batch (SsdTier::GetMany), then each value decompressed.
  std::vector<Result<kvstore::Entry>> GetMany(const std::vector<std::string_view>& keys) override;
  Result<bool> Contains(std::string_view key) override { return segments_->Contains(key); }
  Status Delete(std::string_view key) override { return segments_->Delete(key); }
  kvstore::TierStats Stats() const override;

  const ColdRecovery& recovery() const { return segments_->recovery(); }
  int64_t DiskBytes() const { return segments_->DiskBytes(); }
  // Compressed bytes of the live records.
  int64_t StoredBytes() const { return segments_->Stats().bytes; }

 private:
  ColdTier(ColdTierOptions options, std::unique_ptr<kvstore::SsdTier> segments)
      : options_(std::move(options)), segments_(std::move(segments)) {}
  Result<kvstore::Entry> Decompress(std::string_view key, Result<kvstore::Entry> stored) const;

  const ColdTierOptions options_;
  std::unique_ptr<kvstore::SsdTier> segments_;
};

}  // namespace keel::vector::coloc
