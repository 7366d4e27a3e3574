// Readers for the TEXMEX vector formats (corpus-texmex.irisa.fr): .bvecs (per record int32 dim,
// then dim uint8), .fvecs (int32 dim, dim float32) and .ivecs (int32 dim, dim int32), all
// little-endian. Used for the SIFT test data under $KEEL_SHARED/data/vectors/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "keel/core/status.h"

namespace keel::vector {

struct VectorSet {
  int dim = 0;
  int64_t count = 0;
  std::vector<float> values;  // count * dim, row-major
};

// Reads a whole file; every record must have the same dim (1..65536) and the file must end on
// a record boundary. Corruption naming the file and the offset otherwise. .bvecs values are
// widened to float exactly.
Result<VectorSet> ReadBvecs(const std::string& path, int64_t max_records = -1);
Result<VectorSet> ReadFvecs(const std::string& path, int64_t max_records = -1);

struct IdSet {
  int dim = 0;
  int64_t count = 0;
  std::vector<int32_t> values;  // count * dim
};
Result<IdSet> ReadIvecs(const std::string& path, int64_t max_records = -1);

}  // namespace keel::vector
