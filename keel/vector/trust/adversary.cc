#include "keel/vector/trust/adversary.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/core/hash.h"

namespace keel::vector::trust {

namespace {

// A deterministic 64-bit value of (seed, digest, salt): what colluders share.
uint64_t Mix(uint64_t seed, const QueryDigest& digest, uint64_t salt) {
  uint64_t buf[6];
  buf[0] = seed;
  std::memcpy(&buf[1], digest.bytes.data(), 32);
  buf[5] = salt;
  return Xxh3_64(buf, sizeof buf);
}

}  // namespace

Result<AdversaryMode> ParseAdversaryMode(std::string_view name) {
  if (name == "honest") return AdversaryMode::kHonest;
  if (name == "drop") return AdversaryMode::kDrop;
  if (name == "inject") return AdversaryMode::kInject;
  if (name == "reorder") return AdversaryMode::kReorder;
  if (name == "stale") return AdversaryMode::kStale;
  if (name == "slow") return AdversaryMode::kSlow;
  return Status::InvalidArgument("unknown adversary mode '" + std::string(name) +
                                 "' (honest, drop, inject, reorder, stale, slow)");
}

std::string_view AdversaryModeName(AdversaryMode mode) {
  switch (mode) {
    case AdversaryMode::kHonest: return "honest";
    case AdversaryMode::kDrop: return "drop";
    case AdversaryMode::kInject: return "inject";
    case AdversaryMode::kReorder: return "reorder";
    case AdversaryMode::kStale: return "stale";
    case AdversaryMode::kSlow: return "slow";
  }
  return "unknown";
}

Status Adversary::Validate() const {
  if (strength < 1 || strength > 1000) return Status::InvalidArgument("adversary strength must be in [1, 1000]");
  if (!(fraction >= 0 && fraction <= 1)) return Status::InvalidArgument("adversary fraction must be in [0, 1]");
  if (delay.count() < 0 || delay.count() > 600000) return Status::InvalidArgument("adversary delay must be in [0, 600000] ms");
  return Status::Ok();
}

bool Adversary::Targets(const QueryDigest& digest) const {
  if (mode == AdversaryMode::kHonest) return false;
  if (fraction >= 1) return true;
  const double u = static_cast<double>(Mix(seed, digest, 0) >> 11) * 0x1.0p-53;
  return u < fraction;
}

void Adversary::Apply(const QueryDigest& digest, int k, const std::function<bool(uint64_t)>& in_shard,
                      std::vector<SignedHit>* hits, uint64_t* index_version) const {
  const size_t want = static_cast<size_t>(std::max(k, 0));
  if (!Targets(digest)) {
    if (hits->size() > want) hits->resize(want);
    return;
  }
  const size_t n = std::min(hits->size(), want);
  switch (mode) {
    case AdversaryMode::kHonest:
    case AdversaryMode::kSlow:
      break;
    case AdversaryMode::kDrop: {
      // The best `strength` go; those ranked below k move up (the shard was asked for more).
      const size_t d = std::min(static_cast<size_t>(strength), hits->size());
      hits->erase(hits->begin(), hits->begin() + static_cast<std::ptrdiff_t>(d));
      break;
    }
    case AdversaryMode::kInject: {
      if (n == 0) break;
      const size_t d = std::min(static_cast<size_t>(strength), n);
      for (size_t j = 0; j < d; ++j) {
        // Spread over the ranks: 0, n/d, 2n/d, ... (the best rank always hit).
        const size_t rank = j * n / d;
        // Attacker ids live far above any real id; pick one the shard owns.
        uint64_t id = (uint64_t{1} << 62) + (Mix(seed, digest, j + 1) >> 24);
        for (int step = 0; step < 4096 && in_shard && !in_shard(id); ++step) ++id;
        SignedHit& h = (*hits)[rank];
        h.id = id;
        h.vector_digest = 0;
      }
      break;
    }
    case AdversaryMode::kReorder: {
      std::vector<float> text(n), image(n);
      for (size_t i = 0; i < n; ++i) {
        text[i] = (*hits)[i].text_distance;
        image[i] = (*hits)[i].image_distance;
      }
      std::reverse(hits->begin(), hits->begin() + static_cast<std::ptrdiff_t>(n));
      for (size_t i = 0; i < n; ++i) {
        (*hits)[i].text_distance = text[i];
        (*hits)[i].image_distance = image[i];
      }
      break;
    }
    case AdversaryMode::kStale:
      *index_version = *index_version > static_cast<uint64_t>(strength) ? *index_version - strength : 0;
      break;
  }
  if (hits->size() > want) hits->resize(want);
}

}  // namespace keel::vector::trust
