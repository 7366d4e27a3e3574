// Throughput measurement for `keel bench` and bench/engine: prefill and decode tokens/s for one
// sequence and for a batch of concurrent sequences, next to a roofline estimate built from the
// bytes each token must read (weights once per step, plus each sequence's K/V) and this machine's
// measured memory bandwidth.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "keel/core/status.h"
#include "keel/engine/model.h"

namespace keel::engine {

struct ThroughputOptions {
  int prompt_tokens = 64;
  int decode_tokens = 64;
  std::vector<int> concurrency = {1, 16};
  std::string kv_codec = "raw";
  std::map<std::string, std::string> kv_codec_params;  // KvCacheOptions::codec_params
  int repeats = 3;  // best of
};

struct ThroughputRow {
  int sequences = 0;
  double prefill_tok_s = 0;     // prompt tokens per second (all sequences' prompts in batches)
  double decode_tok_s = 0;      // generated tokens per second summed over sequences
  double roofline_tok_s = 0;    // decode upper bound from bytes read per step / bandwidth
  double compute_bound_tok_s = 0;  // decode upper bound from matmul FLOPs / measured kernel peak
  double bytes_per_step = 0;    // weights + K/V read by one decode step at mid-generation
};

struct ThroughputReport {
  double bandwidth_gb_s = 0;  // measured read bandwidth, all threads
  double matmul_gflops = 0;   // measured MatMul peak (in-cache f32 weights, 64 rows), all threads
  double weight_bytes = 0;
  int threads = 0;
  std::vector<ThroughputRow> rows;
  std::string Table(const std::string& title) const;  // Markdown, ready for docs/results.md
};

// Streams a buffer much larger than the caches and returns the read bandwidth in GB/s.
double MeasureReadBandwidth(size_t bytes = 512ull << 20);
// MatMul throughput with weights in cache (the compute ceiling), GFLOP/s.
double MeasureMatMulPeak();

Result<ThroughputReport> MeasureThroughput(const Model& model, const ThroughputOptions& options);

}  // namespace keel::engine
