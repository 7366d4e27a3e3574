#include "keel/vector/coloc/cold_tier.h"

#include <zstd.h>

#include <limits>

namespace keel::vector::coloc {

using kvstore::Blob;
using kvstore::Entry;

Result<std::unique_ptr<ColdTier>> ColdTier::Open(const ColdTierOptions& options) {
  if (options.zstd_level < 1 || options.zstd_level > 19) {
    return Status::InvalidArgument("cold tier: zstd level " + std::to_string(options.zstd_level) +
                                   " outside 1..19");
  }
  kvstore::SsdOptions so;
  so.dir = options.dir;
  // Capacity is the owning TieredStore's business: the segments must never evict on their own.
  so.capacity_bytes = std::numeric_limits<int64_t>::max() / 4;
  so.segment_bytes = options.segment_bytes;
  so.sync_each_put = options.sync_each_put;
  so.use_io_uring = options.use_io_uring;
  so.uncached_reads = options.uncached_reads;
  auto segments = kvstore::SsdTier::Open(so);
  if (!segments.ok()) return Status(segments.status().code(), "cold tier: " + segments.status().message());
  return std::unique_ptr<ColdTier>(new ColdTier(options, std::move(segments).value()));
}

Status ColdTier::Put(std::string_view key, const Entry& entry) {
  const std::string_view raw = entry.value ? entry.value->view() : std::string_view();
  if (raw.size() > kColdMaxValueBytes) {
    return Status::ResourceExhausted("cold tier: value of " + std::to_string(raw.size()) + " bytes over the limit");
  }
  auto frame = Blob::Allocate(ZSTD_compressBound(raw.size()));
  const size_t n = ZSTD_compress(frame->data(), frame->size(), raw.data(), raw.size(), options_.zstd_level);
  if (ZSTD_isError(n)) return Status::Internal(std::string("cold tier: zstd: ") + ZSTD_getErrorName(n));
  return segments_->Put(key, Entry{Blob::Copy(frame->data(), n), entry.expires_at_ms});
}

Result<Entry> ColdTier::Decompress(std::string_view key, Result<Entry> stored) const {
  if (!stored.ok()) return stored;
  const std::string_view frame = stored->value->view();
  const unsigned long long raw = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (raw == ZSTD_CONTENTSIZE_ERROR || raw == ZSTD_CONTENTSIZE_UNKNOWN || raw > kColdMaxValueBytes) {
    return Status::Corruption("cold tier: key of " + std::to_string(key.size()) + " bytes: not a zstd frame of a known size");
  }
  auto value = Blob::Allocate(raw);
  const size_t n = ZSTD_decompress(value->data(), raw, frame.data(), frame.size());
  if (ZSTD_isError(n) || n != raw) {
    return Status::Corruption("cold tier: key of " + std::to_string(key.size()) + " bytes: zstd frame does not decompress to " +
                              std::to_string(raw) + " bytes");
  }
  return Entry{std::move(value), stored->expires_at_ms};
}

Result<Entry> ColdTier::Get(std::string_view key) { return Decompress(key, segments_->Get(key)); }

std::vector<Result<Entry>> ColdTier::GetMany(const std::vector<std::string_view>& keys) {
  std::vector<Result<Entry>> stored = segments_->GetMany(keys);
  std::vector<Result<Entry>> out;
  out.reserve(stored.size());
  for (size_t i = 0; i < stored.size(); ++i) out.push_back(Decompress(keys[i], std::move(stored[i])));
  return out;
}

kvstore::TierStats ColdTier::Stats() const {
  kvstore::TierStats s = segments_->Stats();
  s.name = "cold";
  return s;
}

}  // namespace keel::vector::coloc
