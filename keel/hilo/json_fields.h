// Strict reading of one JSON object for keel::hilo's formats (the catalog, load reports): every
// error names the member's full path ("states[2].levels.vector.nprobe: expected a positive
// integer"), and NoUnknown() names the first member nobody asked for, so an operator's typo in a
// catalog is refused instead of silently ignored. Internal to keel::hilo. Thread-compatible.
#pragma once

#include <cstdint>
#include <limits>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "keel/core/status.h"

namespace keel::hilo::internal {

class ObjectReader {
 public:
  // InvalidArgument "<path>: expected an object" unless `v` is one. `v` must outlive the reader.
  static Result<ObjectReader> Open(const nlohmann::json& v, std::string path);

  // Each reads member `key` into *out. A missing (or null) member is "<path>.<key>: missing".
  Status Int(const char* key, int64_t lo, int64_t hi, int64_t* out);
  Status Number(const char* key, double lo, double hi, double* out);  // finite, lo <= x <= hi
  Status Bool(const char* key, bool* out);
  // A name: 1..64 characters of [A-Za-z0-9_.:-] (names end up in metric labels and logs).
  // `allow_empty` also accepts "".
  Status Name(const char* key, bool allow_empty, std::string* out);
  // Any string of at most max_bytes bytes.
  Status String(const char* key, size_t max_bytes, std::string* out);
  // The member (marked as read), or nullptr when it is absent or null.
  const nlohmann::json* Member(const char* key);

  // InvalidArgument "<path>.<key>: unknown field" for the first member no method above read.
  Status NoUnknown() const;
  std::string PathOf(const char* key) const;

 private:
  ObjectReader(const nlohmann::json& obj, std::string path) : obj_(&obj), path_(std::move(path)) {}
  Result<const nlohmann::json*> Required(const char* key);

  const nlohmann::json* obj_;
  std::string path_;
  std::set<std::string> read_;
};

inline constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

// True for 1..64 characters of [A-Za-z0-9_.:-].
bool IsValidName(std::string_view s);

}  // namespace keel::hilo::internal
