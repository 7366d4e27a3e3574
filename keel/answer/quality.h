// Product quality of `keel answer` (issue 23, docs/answer.md "Quality"): what HiLO trades for
// capacity, measured per request and per request window on a 0..100 scale.
//
//   request quality = 100 x recall@10 x agreement
//     recall@10  = |first 10 retrieved ids ∩ first 10 ground-truth ids| / 10   (exact SIFT truth)
//     agreement  = word-level F1 (SQuAD style) of the answer against the answer the full-quality
//                  state gave to the same request
//   a shed (429) or failed request scores 0;
//   window quality = mean over the requests that *arrived* in the window.
//
// Consequence of the definition: a state with retrieval off retrieves nothing, so its
// recall and its quality are 0. Such a state is an emergency state only.
//
// Pure functions: no I/O, no clock, thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keel::answer {

inline constexpr int kRecallAt = 10;

// |retrieved[0..10) ∩ truth[0..10)| / 10. Duplicate ids in `retrieved` count once. Fewer than 10
// retrieved ids simply find fewer; `truth` must hold at least 10 ids, else the divisor is
// truth.size() (0 ids of truth: 0).
double RecallAt10(std::span<const uint64_t> retrieved, std::span<const int32_t> truth);

// The words of `text` for agreement: ASCII letters and digits lowercased, every other byte a
// separator (no article or punctuation rules beyond that).
std::vector<std::string> Words(std::string_view text);

// SQuAD-style F1 over the two multisets of Words: 2PR/(P+R) with P = common/|answer| and
// R = common/|reference|. Both empty: 1. Exactly one empty: 0.
double WordF1(std::string_view answer, std::string_view reference);

// 100 x recall x agreement, each clamped to [0, 1].
double RequestQuality(double recall, double agreement);

// One request as the quality window sees it. `quality` is ignored unless `served`.
struct RequestOutcome {
  int64_t arrival_ms = 0;  // when it arrived (any clock, same for all)
  bool served = false;     // false: shed or failed (scores 0)
  double quality = 0;      // RequestQuality for a served request
};

struct WindowQuality {
  int64_t start_ms = 0;  // window [start_ms, start_ms + window_ms)
  int64_t requests = 0;  // arrivals in the window
  double quality = 0;    // mean over them (0..100); 0 when the window had no arrivals
};

// Splits [first arrival, last arrival] into windows of `window_ms` (> 0) aligned at the first
// arrival and averages each. Windows with no arrivals are kept, with requests 0. Empty input:
// empty output. window_ms <= 0: empty output.
std::vector<WindowQuality> WindowMeans(std::span<const RequestOutcome> outcomes, int64_t window_ms);

}  // namespace keel::answer
