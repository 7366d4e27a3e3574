// `keel hilo replay`: a surge trace replayed live through the running product (issue 23), scored
// per request against the FULL state's answers, with the product state sampled as it runs.
//
// Two runs make one measurement:
//   1. references (--write-references F): the product pinned to its full state answers every
//      evaluation query once, one at a time at temperature 0; one JSON line per query
//      {"query":i,"retrieved":[ids],"content":"..."} is written. The full state's quality is
//      100 x mean recall@10 of these answers (what `keel hilo validate` computes for state 0).
//   2. the surge (--trace NAME): open-loop Poisson arrivals of the trace (keel/hilo/loadgen.h);
//      request seq asks query seq mod n, and its answer scores
//      RequestQuality(RecallAt10(retrieved, truth), WordF1(content, reference content)),
//      0 when not 200 or slower than the SLO. Every tick the controller's GET /v1/state (product
//      state) and GET /v1/services (each service's applied_state) are sampled.
// Why references from a separate run: during a surge the product is not in its full state, so the
// answers to score against cannot come from the same run.
//
// The parsing and scoring functions are pure; RunLiveReplay and WriteReferences do network I/O.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/answer/corpus.h"
#include "keel/answer/replay.h"
#include "keel/core/status.h"
#include "keel/hilo/catalog.h"
#include "keel/hilo/loadgen.h"
#include "keel/hilo/trace.h"

namespace keel::hilo {

inline constexpr size_t kMaxReferenceFileBytes = size_t{64} << 20;
inline constexpr size_t kMaxReferenceLineBytes = size_t{1} << 20;

// One reference line (no trailing newline) for query index `query` of the evaluation set.
std::string WriteReferenceLine(int query, const answer::ReplayedAnswer& a);

// Parses a reference file into one answer per evaluation query (index = query), each with status
// 200. Every index 0..n_queries-1 must appear exactly once; indices >= n_queries are ignored (a
// file written over more queries serves a run over fewer). Blank lines are skipped.
// InvalidArgument naming the line for: a file over kMaxReferenceFileBytes, a line over
// kMaxReferenceLineBytes, malformed JSON, a missing/mistyped field, a negative or duplicate index,
// a missing index.
Result<std::vector<answer::ReplayedAnswer>> ParseReferences(std::string_view text, size_t n_queries);

// The quality of one answer to `query` against the full state's `reference`: 0 unless status 200.
double ScoreAnswer(const answer::EvalQuery& query, const answer::ReplayedAnswer& reference,
                   const answer::ReplayedAnswer& answer);

// The full state's quality: 100 x mean recall@10 of the references (each agrees with itself).
// 0 for empty input; `eval` and `references` must have the same length (else 0).
double FullQuality(std::span<const answer::EvalQuery> eval, std::span<const answer::ReplayedAnswer> references);

// One sample of the product, taken during the run.
struct StateSample {
  double t_s = 0;        // trace seconds since the start
  int index = -1;        // product state (GET /v1/state "index"); -1 when the controller did not answer
  std::string name;
  // Per service (kAllServices order): the cheapest catalog index applied by a fresh instance
  // (two engines: the cheaper one); -1 when no fresh instance reported a known state.
  std::array<int, kNumServices> applied{-1, -1, -1, -1};
};

// Parses GET /v1/state's body into index and name (the rest of `out` is untouched).
Status ParseStateReply(std::string_view body, size_t n_states, StateSample* out);
// Parses GET /v1/services' body into out->applied, mapping applied_state names to catalog indices;
// instances whose age_ms exceeds fresh_ms are skipped.
Status ParseServicesReply(std::string_view body, const Catalog& catalog, int64_t fresh_ms, StateSample* out);

struct LiveOptions {
  std::string answer_url;
  std::string controller_url;  // "" = no state sampling
  std::vector<answer::EvalQuery> eval;
  std::vector<answer::ReplayedAnswer> references;  // same length as eval
  answer::ReplayOptions replay;
  Trace trace;
  double baseline_rate = 1;  // real req/s at 1x, whatever the time scale (the load the product sees)
  double time_scale = 1;     // real s per trace s: < 1 compresses the trace's shape, not its rates
  double slo_ms = 2000;
  double window_s = 5;       // quality windows, trace seconds
  // Real seconds of 1x load before the trace, not scored: the controller predicts with a trend, so
  // load jumping from zero to 1x at t = 0 reads as a surge of its own. The load rises from 0.1x
  // to 1x over the first third (a cold start's burst stepped the per-service baseline down).
  double warmup_s = 0;
  int workers = 256;
  uint64_t seed = 1;
};

struct LiveResult {
  std::string trace;
  double peak = 0;
  double full_quality = 0;
  double limit = 0;  // the controller's catalog's max_quality_drop (0 without a controller)
  std::vector<std::string> state_names;  // the controller's catalog
  LiveSummary summary;
  std::vector<StateSample> samples;
  std::vector<double> time_in_state_s;  // per catalog state, trace seconds (from samples)
  int64_t transitions = 0;             // product state changes seen between samples
};

// Time in each state and transitions from samples taken every `tick_s` trace seconds. A sample
// without a product state (index -1: `keel hilo serve --policy per-service` has none) counts at the
// cheapest level any service applied, as the simulation counts its baseline; one with neither
// counts nowhere. Fills result->time_in_state_s (sized to state_names) and transitions.
void TallyStates(double tick_s, LiveResult* result);

// Runs the trace. InvalidArgument for options out of range (eval empty, references of another
// length, rates, scales); Unavailable when the controller's catalog cannot be read.
Result<LiveResult> RunLiveReplay(const LiveOptions& options);

// Per-window CSV: header, then one row per window of the summary:
// t_s,arrived,mean_quality,p99_ms,state_index,state,answer_level,vector_level,engine_level,gateway_level
// The state columns are the last sample taken before the window's end (-1 and "" when none).
std::string WriteLiveCsv(const LiveResult& result, double window_s);

// One JSON object (one line): trace, peak, full_quality, limit, the LiveSummary counts, max/mean drop,
// within_085_limit, time_in_state_s {name: s}, transitions, and `label` when not empty.
std::string WriteLiveSummaryJson(const LiveResult& result, std::string_view label);

// Asks every evaluation query once, in order (retrying a failed one up to `retries` times), and
// returns the reference file's text. Unavailable naming the query when one never answers 200, or
// when `expect_state` is not empty and an answer ran in another state.
Result<std::string> WriteReferences(const std::string& answer_url, std::span<const answer::EvalQuery> eval,
                                    const answer::ReplayOptions& replay, const std::string& expect_state, int retries,
                                    double* full_quality);

}  // namespace keel::hilo
