// Replaying the evaluation set against a running `keel answer` and scoring a state's answers
// against the full state's (docs/answer.md, "Quality"). This is the quality half of what
// `keel hilo validate` needs: pin a state, Replay, Score against the full state's replay.
//
// Replay is synchronous (one request at a time, temperature 0) so that load does not change the
// answers; Score is pure. Thread safety: Replay may run on any thread with its own client.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "keel/answer/corpus.h"
#include "keel/core/http_client.h"

namespace keel::answer {

struct ReplayOptions {
  std::string model;        // "" = the server's default model
  int64_t max_tokens = 16;
  int timeout_ms = 120000;  // per request
};

struct ReplayedAnswer {
  int status = 0;                   // HTTP status; 0 when no answer could be read
  std::vector<uint64_t> retrieved;  // keel.retrieved
  std::string content;              // choices[0].message.content
  std::string state;                // keel.state
  std::string error;                // the error message when status != 200
};

// Asks `answer` (a keel answer server) one query's question with its vector, at temperature 0.
// Never fails: an unreachable server is status 0 with the error; any thread, own client or not
// (HttpClient is thread-safe).
ReplayedAnswer AskOne(HttpClient& answer, const EvalQuery& query, const ReplayOptions& options);

// AskOne for each query, in order, one at a time.
std::vector<ReplayedAnswer> Replay(HttpClient& answer, std::span<const EvalQuery> queries, const ReplayOptions& options);

struct StateQuality {
  int64_t requests = 0;   // scored: queries whose reference answer was served
  int64_t served = 0;     // ...of which this state served (status 200)
  int64_t skipped = 0;    // queries whose reference failed (no agreement can be computed)
  double quality = 0;     // mean request quality, 0..100 (failed requests count 0)
  double recall = 0;      // mean recall@10 over served requests
  double agreement = 0;   // mean WordF1 against the reference over served requests
};

// Scores `answers` against `reference` (the full state's replay of the same queries): per query
// RequestQuality(RecallAt10(retrieved, truth), WordF1(content, reference content)), 0 when not
// served. The three spans must have the same length (else an empty result with requests 0).
StateQuality Score(std::span<const EvalQuery> queries, std::span<const ReplayedAnswer> reference,
                   std::span<const ReplayedAnswer> answers);

}  // namespace keel::answer
