#include "keel/hilo/json_fields.h"

#include <cmath>
#include <cstdio>

namespace keel::hilo::internal {

using nlohmann::json;

Result<ObjectReader> ObjectReader::Open(const json& v, std::string path) {
  if (!v.is_object()) return Status::InvalidArgument((path.empty() ? "document" : path) + ": expected an object");
  return ObjectReader(v, std::move(path));
}

std::string ObjectReader::PathOf(const char* key) const { return path_.empty() ? key : path_ + "." + key; }

const json* ObjectReader::Member(const char* key) {
  read_.insert(key);
  auto it = obj_->find(key);
  if (it == obj_->end() || it->is_null()) return nullptr;
  return &*it;
}

Result<const json*> ObjectReader::Required(const char* key) {
  const json* v = Member(key);
  if (!v) return Status::InvalidArgument(PathOf(key) + ": missing");
  return v;
}

Status ObjectReader::Int(const char* key, int64_t lo, int64_t hi, int64_t* out) {
  KEEL_ASSIGN_OR_RETURN(const json* v, Required(key));
  const bool huge = v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(kMaxInt);
  const bool integer = v->is_number_integer() && !huge;
  const int64_t x = integer ? v->get<int64_t>() : 0;
  if (integer && x >= lo && x <= hi) {
    *out = x;
    return Status::Ok();
  }
  // Say what kind of value is wanted; only a valid but too large integer gets the upper bound.
  std::string want;
  if (huge || (integer && x > hi)) {
    want = lo == hi ? std::to_string(hi) : "at most " + std::to_string(hi);
  } else if (lo == 1) {
    want = "a positive integer";
  } else if (lo == 0) {
    want = "a non-negative integer";
  } else {
    want = "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  }
  return Status::InvalidArgument(PathOf(key) + ": expected " + want);
}

Status ObjectReader::Number(const char* key, double lo, double hi, double* out) {
  KEEL_ASSIGN_OR_RETURN(const json* v, Required(key));
  const double x = v->is_number() ? v->get<double>() : NAN;
  if (std::isfinite(x) && x >= lo && x <= hi) {
    *out = x;
    return Status::Ok();
  }
  char want[96];
  std::snprintf(want, sizeof want, ": expected a number from %g to %g", lo, hi);
  return Status::InvalidArgument(PathOf(key) + want);
}

Status ObjectReader::Bool(const char* key, bool* out) {
  KEEL_ASSIGN_OR_RETURN(const json* v, Required(key));
  if (!v->is_boolean()) return Status::InvalidArgument(PathOf(key) + ": expected true or false");
  *out = v->get<bool>();
  return Status::Ok();
}

Status ObjectReader::String(const char* key, size_t max_bytes, std::string* out) {
  KEEL_ASSIGN_OR_RETURN(const json* v, Required(key));
  if (!v->is_string()) return Status::InvalidArgument(PathOf(key) + ": expected a string");
  const auto& s = v->get_ref<const std::string&>();
  if (s.size() > max_bytes) {
    return Status::InvalidArgument(PathOf(key) + ": longer than " + std::to_string(max_bytes) + " bytes");
  }
  *out = s;
  return Status::Ok();
}

Status ObjectReader::Name(const char* key, bool allow_empty, std::string* out) {
  std::string s;
  KEEL_RETURN_IF_ERROR(String(key, 64, &s));
  if (!(allow_empty && s.empty()) && !IsValidName(s)) {
    return Status::InvalidArgument(PathOf(key) + ": expected a name of 1 to 64 characters [A-Za-z0-9_.:-]");
  }
  *out = std::move(s);
  return Status::Ok();
}

Status ObjectReader::NoUnknown() const {
  for (const auto& [key, value] : obj_->items()) {
    // A hostile key can be megabytes long: the message quotes at most its first 64 bytes.
    if (!read_.count(key)) return Status::InvalidArgument(PathOf(key.substr(0, 64).c_str()) + ": unknown field");
  }
  return Status::Ok();
}

bool IsValidName(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '.' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace keel::hilo::internal
