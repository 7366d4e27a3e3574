// libFuzzer target for the BellowsKV calibration file parser (built by CMake with clang when
// available; see the "Fuzzing" block in CMakeLists.txt).
//
// Each input is parsed twice: as it is, and "resealed" (total_bytes and the trailer checksum
// rewritten to match), so that mutations reach the field checks behind the checksum. For each:
//   1. ParseCalibration either fails with Corruption or returns a calibration that is valid,
//      re-serializes to exactly the parsed bytes (the format is canonical), and whose
//      fingerprint is the file's trailer.
//   2. Nothing reads outside the input or allocates beyond what the input's size implies
//      (ASan; -rss_limit_mb in the CTest run).
// Any violation calls abort(). Longer runs by hand:
//   build/bellows_calibration_fuzz -max_total_time=600 /tmp/bkvcorpus tests/kv/bellows_corpus
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "keel/kv/bellows/calibration.h"

namespace bk = keel::kv::bellows;

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "bellows_calibration_fuzz: %s\n", what);
    std::abort();
  }
}

void ParseOne(const std::string& bytes) {
  auto c = bk::ParseCalibration(bytes, "fuzz.bkv");
  if (!c.ok()) {
    Check(c.status().code() == keel::StatusCode::kCorruption, "non-Corruption parse error");
    Check(c.status().message().rfind("fuzz.bkv: ", 0) == 0, "error does not name the file");
    return;
  }
  Check(bk::ValidateCalibration(*c).ok(), "parsed calibration does not validate");
  auto again = bk::SerializeCalibration(*c);
  Check(again.ok() && *again == bytes, "parsed calibration does not re-serialize to the same bytes");
  keel::Hash128 trailer;
  std::memcpy(&trailer.lo, bytes.data() + bytes.size() - 16, 8);
  std::memcpy(&trailer.hi, bytes.data() + bytes.size() - 8, 8);
  Check(bk::CalibrationFingerprint(*c) == trailer.hex(), "fingerprint is not the trailer");
  keel::kv::KvShape shape;
  shape.n_layers = c->n_layers;
  shape.n_heads = c->n_heads;
  shape.n_kv_heads = c->n_kv_heads;
  shape.head_dim = c->head_dim;
  Check(bk::CheckCalibrationFits(*c, shape, c->dim, c->rope_theta, c->model_checksum.hex()).ok(),
        "a calibration does not fit its own shape");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  ParseOne(bytes);
  if (size >= 24 + 16) {
    const uint64_t total = size;
    std::memcpy(bytes.data() + 16, &total, 8);
    const keel::Hash128 h = keel::Xxh3_128(bytes.data(), size - 16);
    std::memcpy(bytes.data() + size - 16, &h.lo, 8);
    std::memcpy(bytes.data() + size - 8, &h.hi, 8);
    ParseOne(bytes);
  }
  return 0;
}
