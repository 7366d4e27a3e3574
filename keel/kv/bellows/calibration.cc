// BellowsKV calibration file: writer, validating reader, model-fit check. The layout and its
// invariants are specified in calibration.h; the same rule functions (HeaderProblem,
// GroupProblem) serve the in-memory validator and the parser, so the two cannot drift apart.
#include "keel/kv/bellows/calibration.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "keel/core/mapped_file.h"

namespace keel::kv::bellows {
namespace {

static_assert(std::endian::native == std::endian::little, "the .bkv layout is little-endian");

constexpr size_t kFixedHeaderBytes = 8 + 4 + 4 + 8;  // magic, version, reserved, total_bytes
constexpr size_t kTrailerBytes = 16;
constexpr int kGroupHeaderFields = 7;
constexpr int kErrorFloats = 4;

std::string Shape(int dim, int n_layers, int n_heads, int n_kv_heads, int head_dim, float theta) {
  char buf[200];
  std::snprintf(buf, sizeof(buf), "dim %d, %d layers, %d heads, %d kv heads, head_dim %d, rope theta %g", dim,
                n_layers, n_heads, n_kv_heads, head_dim, static_cast<double>(theta));
  return buf;
}

int GroupCount(int n_layers, int group_size) { return (n_layers + group_size - 1) / group_size; }

// Header rules (everything before the first group). Empty when fine.
std::string HeaderProblem(const Calibration& c) {
  auto range = [](const char* what, long long v, long long lo, long long hi) -> std::string {
    if (v >= lo && v <= hi) return "";
    return std::string(what) + " " + std::to_string(v) + " outside [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "]";
  };
  std::string p;
  if (!(p = range("dim", c.dim, 1, kMaxDim)).empty()) return p;
  if (!(p = range("n_layers", c.n_layers, 1, kMaxLayers)).empty()) return p;
  if (!(p = range("n_heads", c.n_heads, 1, kMaxHeads)).empty()) return p;
  if (!(p = range("n_kv_heads", c.n_kv_heads, 1, c.n_heads)).empty()) return p;
  if (c.n_heads % c.n_kv_heads != 0) {
    return "n_heads " + std::to_string(c.n_heads) + " is not a multiple of n_kv_heads " + std::to_string(c.n_kv_heads);
  }
  if (!(p = range("head_dim", c.head_dim, 2, kMaxHeadDim)).empty()) return p;
  if (c.head_dim % 2 != 0) return "head_dim " + std::to_string(c.head_dim) + " is odd (RoPE rotates pairs)";
  if (!(p = range("kv_dim", static_cast<long long>(c.n_kv_heads) * c.head_dim, 2, kMaxDim)).empty()) return p;
  if (!std::isfinite(c.rope_theta) || c.rope_theta <= 0.f) return "rope_theta is not a positive finite number";
  if (!(p = range("group_size", c.group_size, 1, c.n_layers)).empty()) return p;
  if (!(p = range("group_size*dim", static_cast<long long>(c.group_size) * c.dim, 1, kMaxDim)).empty()) return p;
  if (c.method.size() > kMaxMethodBytes) return "method text of " + std::to_string(c.method.size()) + " bytes is too long";
  return "";
}

// Group header rules for group `g` (the header must already be fine). Empty when fine.
std::string GroupProblem(const Calibration& c, int g, const CalibrationGroup& gr) {
  const std::string at = "group " + std::to_string(g) + ": ";
  const int first = g * c.group_size;
  const int n = std::min(c.group_size, c.n_layers - first);
  if (gr.first_layer != first || gr.n_layers != n) {
    return at + "layers [" + std::to_string(gr.first_layer) + ", +" + std::to_string(gr.n_layers) +
           ") but groups of " + std::to_string(c.group_size) + " over " + std::to_string(c.n_layers) +
           " layers need [" + std::to_string(first) + ", +" + std::to_string(n) + ")";
  }
  const int max_rank = std::min(kMaxRank, n * c.dim);
  if (gr.rank < 1 || gr.rank > max_rank) {
    return at + "rank " + std::to_string(gr.rank) + " outside [1, " + std::to_string(max_rank) + "]";
  }
  auto range_ok = [&](int b, int e) { return 0 <= b && b < e && e <= gr.rank; };
  if (!range_ok(gr.k_begin, gr.k_end)) {
    return at + "k range [" + std::to_string(gr.k_begin) + ", " + std::to_string(gr.k_end) +
           ") is empty or outside the latent [0, " + std::to_string(gr.rank) + ")";
  }
  if (!range_ok(gr.v_begin, gr.v_end)) {
    return at + "v range [" + std::to_string(gr.v_begin) + ", " + std::to_string(gr.v_end) +
           ") is empty or outside the latent [0, " + std::to_string(gr.rank) + ")";
  }
  return "";
}

// Calibration values above this overflow float32 in the products the codec forms (a value of
// 3e38 is finite but turned every answer into garbage); real calibrations stay far below.
constexpr float kMaxCalibrationMagnitude = 1e15f;

// Index of the first value that is not finite or is beyond kMaxCalibrationMagnitude, or -1.
int64_t FirstNonFinite(const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!(std::fabs(v[i]) <= kMaxCalibrationMagnitude)) return static_cast<int64_t>(i);
  }
  return -1;
}

std::string NonFiniteName(float f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return "infinite";
  return "out of range (" + std::to_string(f) + ", beyond +-1e15)";
}

// ---- Writer ------------------------------------------------------------------------------

class Writer {
 public:
  template <typename T>
  void pod(T v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void floats(const std::vector<float>& v) {
    if (!v.empty()) out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  }
  void bytes(std::string_view s) { out_.append(s); }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

// The file bytes, trailer included, without validation (callers validate first where it
// matters; the fingerprint of an invalid calibration is still a deterministic hash).
std::string Encode(const Calibration& c) {
  Writer w;
  w.bytes(std::string_view(kMagic, sizeof(kMagic)));
  w.pod<uint32_t>(kVersion);
  w.pod<uint32_t>(0);
  w.pod<uint64_t>(0);  // total_bytes, patched below
  w.pod<uint64_t>(c.model_checksum.lo);
  w.pod<uint64_t>(c.model_checksum.hi);
  for (int v : {c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim}) w.pod<uint32_t>(static_cast<uint32_t>(v));
  w.pod<float>(c.rope_theta);
  w.pod<uint32_t>(static_cast<uint32_t>(c.group_size));
  w.pod<uint32_t>(static_cast<uint32_t>(c.groups.size()));
  w.pod<uint32_t>(static_cast<uint32_t>(c.method.size()));
  w.bytes(c.method);
  for (const CalibrationGroup& g : c.groups) {
    for (int v : {g.first_layer, g.n_layers, g.rank, g.k_begin, g.k_end, g.v_begin, g.v_end}) {
      w.pod<uint32_t>(static_cast<uint32_t>(v));
    }
    w.floats(g.x_mean);
    w.floats(g.compress);
    for (const LayerRestore& l : g.layers) {
      w.pod<float>(l.errors.k_rel);
      w.pod<float>(l.errors.v_rel);
      w.pod<float>(l.errors.k_weighted_rel);
      w.pod<float>(l.errors.v_weighted_rel);
      w.floats(l.k_mean);
      w.floats(l.v_mean);
      w.floats(l.rk);
      w.floats(l.rv);
    }
  }
  w.pod<uint32_t>(static_cast<uint32_t>(c.vocab));
  w.floats(c.token_kv);
  std::string& s = w.str();
  const uint64_t total = s.size() + kTrailerBytes;
  std::memcpy(s.data() + 16, &total, 8);
  const Hash128 h = Xxh3_128(s.data(), s.size());
  w.pod<uint64_t>(h.lo);
  w.pod<uint64_t>(h.hi);
  return std::move(w.str());
}

// ---- Reader ------------------------------------------------------------------------------

// Reads fields front to back inside [0, end); every failure names the file and the offset.
class Reader {
 public:
  Reader(std::string_view bytes, size_t end, const std::string& name) : b_(bytes), end_(end), name_(name) {}

  size_t offset() const { return off_; }
  size_t remaining() const { return end_ - off_; }

  Status Corrupt(size_t offset, const std::string& what) const {
    return Status::Corruption(name_ + ": " + what + " at offset " + std::to_string(offset));
  }

  Status U32(const char* field, uint32_t* v) { return Pod(field, v); }
  Status I32(const char* field, int* v) {
    uint32_t u = 0;
    KEEL_RETURN_IF_ERROR(Pod(field, &u));
    // Every count in the format is far below 2^31; a larger one is hostile, and shows as
    // negative here so that every range check rejects it.
    *v = u > 0x7fffffffu ? -1 : static_cast<int>(u);
    return Status::Ok();
  }
  template <typename T>
  Status Pod(const char* field, T* v) {
    if (remaining() < sizeof(T)) return Truncated(field, sizeof(T));
    std::memcpy(v, b_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return Status::Ok();
  }
  Status Bytes(const char* field, size_t n, std::string* out) {
    if (remaining() < n) return Truncated(field, n);
    out->assign(b_.data() + off_, n);
    off_ += n;
    return Status::Ok();
  }
  // `count` floats into `out`, all finite. The count is checked against the bytes left before
  // anything is allocated, so a hostile size costs nothing.
  Status Floats(const std::string& field, uint64_t count, std::vector<float>* out) {
    if (count > remaining() / sizeof(float)) {
      return Corrupt(off_, "truncated: " + field + " needs " + std::to_string(count * sizeof(float)) +
                               " bytes, " + std::to_string(remaining()) + " left before the trailer");
    }
    out->resize(count);
    if (count == 0) return Status::Ok();  // an empty vector's data() may be null: no memcpy
    std::memcpy(out->data(), b_.data() + off_, count * sizeof(float));
    const int64_t bad = FirstNonFinite(out->data(), count);
    if (bad >= 0) {
      return Corrupt(off_ + 4 * static_cast<size_t>(bad),
                     field + "[" + std::to_string(bad) + "] is " + NonFiniteName((*out)[bad]));
    }
    off_ += count * sizeof(float);
    return Status::Ok();
  }

 private:
  Status Truncated(const char* field, size_t need) const {
    return Corrupt(off_, std::string("truncated: ") + field + " needs " + std::to_string(need) + " bytes, " +
                             std::to_string(remaining()) + " left before the trailer");
  }

  std::string_view b_;
  size_t end_;
  const std::string& name_;
  size_t off_ = 0;
};

Status ParseLayer(Reader& r, const std::string& at, int kv, const CalibrationGroup& g, LayerRestore* l) {
  float e[kErrorFloats];
  const size_t e_off = r.offset();
  for (float& x : e) KEEL_RETURN_IF_ERROR(r.Pod("layer errors", &x));
  for (int i = 0; i < kErrorFloats; ++i) {
    if (!std::isfinite(e[i]) || e[i] < 0.f) {
      return r.Corrupt(e_off + 4 * i, at + "error " + std::to_string(i) + " is not a finite value >= 0");
    }
  }
  l->errors = LayerErrors{e[0], e[1], e[2], e[3]};
  KEEL_RETURN_IF_ERROR(r.Floats(at + "k_mean", kv, &l->k_mean));
  KEEL_RETURN_IF_ERROR(r.Floats(at + "v_mean", kv, &l->v_mean));
  KEEL_RETURN_IF_ERROR(r.Floats(at + "rk", static_cast<uint64_t>(g.k_end - g.k_begin) * kv, &l->rk));
  KEEL_RETURN_IF_ERROR(r.Floats(at + "rv", static_cast<uint64_t>(g.v_end - g.v_begin) * kv, &l->rv));
  return Status::Ok();
}

Status ParseGroup(Reader& r, const Calibration& c, int gi, CalibrationGroup* g) {
  const size_t start = r.offset();
  int f[kGroupHeaderFields];
  for (int& x : f) KEEL_RETURN_IF_ERROR(r.I32("group header", &x));
  g->first_layer = f[0];
  g->n_layers = f[1];
  g->rank = f[2];
  g->k_begin = f[3];
  g->k_end = f[4];
  g->v_begin = f[5];
  g->v_end = f[6];
  const std::string problem = GroupProblem(c, gi, *g);
  if (!problem.empty()) return r.Corrupt(start, problem);
  const std::string at = "group " + std::to_string(gi) + " ";
  const uint64_t in = static_cast<uint64_t>(g->n_layers) * c.dim;
  KEEL_RETURN_IF_ERROR(r.Floats(at + "x_mean", in, &g->x_mean));
  KEEL_RETURN_IF_ERROR(r.Floats(at + "compress", in * static_cast<uint64_t>(g->rank), &g->compress));
  // Every layer's arrays must fit before any is allocated.
  const uint64_t layer_floats =
      kErrorFloats + static_cast<uint64_t>(c.kv_dim()) * (2 + (g->k_end - g->k_begin) + (g->v_end - g->v_begin));
  if (layer_floats * g->n_layers > r.remaining() / sizeof(float)) {
    return r.Corrupt(r.offset(), "truncated: " + at + "layers need " +
                                     std::to_string(layer_floats * g->n_layers * sizeof(float)) + " bytes, " +
                                     std::to_string(r.remaining()) + " left before the trailer");
  }
  g->layers.resize(static_cast<size_t>(g->n_layers));
  for (int i = 0; i < g->n_layers; ++i) {
    const std::string lat = at + "layer " + std::to_string(g->first_layer + i) + " ";
    KEEL_RETURN_IF_ERROR(ParseLayer(r, lat, c.kv_dim(), *g, &g->layers[i]));
  }
  return Status::Ok();
}

Status ParseBody(Reader& r, Calibration* c) {
  KEEL_RETURN_IF_ERROR(r.Pod("model checksum", &c->model_checksum.lo));
  KEEL_RETURN_IF_ERROR(r.Pod("model checksum", &c->model_checksum.hi));
  const size_t shape_off = r.offset();
  for (int* v : {&c->dim, &c->n_layers, &c->n_heads, &c->n_kv_heads, &c->head_dim}) {
    KEEL_RETURN_IF_ERROR(r.I32("model shape", v));
  }
  KEEL_RETURN_IF_ERROR(r.Pod("rope_theta", &c->rope_theta));
  KEEL_RETURN_IF_ERROR(r.I32("group_size", &c->group_size));
  int n_groups = 0;
  KEEL_RETURN_IF_ERROR(r.I32("n_groups", &n_groups));
  uint32_t method_bytes = 0;
  const size_t method_off = r.offset();
  KEEL_RETURN_IF_ERROR(r.U32("method length", &method_bytes));
  // The method text is checked by HeaderProblem too; refuse a hostile length before reading it.
  if (method_bytes > kMaxMethodBytes) {
    return r.Corrupt(method_off, "method length " + std::to_string(method_bytes) + " > " +
                                     std::to_string(kMaxMethodBytes));
  }
  KEEL_RETURN_IF_ERROR(r.Bytes("method text", method_bytes, &c->method));
  const std::string problem = HeaderProblem(*c);
  if (!problem.empty()) return r.Corrupt(shape_off, problem);
  const int want_groups = GroupCount(c->n_layers, c->group_size);
  if (n_groups != want_groups) {
    return r.Corrupt(shape_off + 28, "n_groups " + std::to_string(n_groups) + " but groups of " +
                                         std::to_string(c->group_size) + " over " + std::to_string(c->n_layers) +
                                         " layers make " + std::to_string(want_groups));
  }
  c->groups.resize(static_cast<size_t>(n_groups));
  for (int g = 0; g < n_groups; ++g) KEEL_RETURN_IF_ERROR(ParseGroup(r, *c, g, &c->groups[g]));
  const size_t vocab_off = r.offset();
  KEEL_RETURN_IF_ERROR(r.I32("token table vocab", &c->vocab));
  if (c->vocab < 0 || c->vocab > kMaxVocab) {
    return r.Corrupt(vocab_off, "token table vocab " + std::to_string(c->vocab) + " outside 0.." +
                                    std::to_string(kMaxVocab));
  }
  KEEL_RETURN_IF_ERROR(
      r.Floats("token table", static_cast<uint64_t>(c->vocab) * 2 * static_cast<uint64_t>(c->kv_dim()), &c->token_kv));
  if (r.remaining() != 0) {
    return r.Corrupt(r.offset(), std::to_string(r.remaining()) + " unexpected bytes after the token table");
  }
  return Status::Ok();
}

std::string Lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// Compares the parts of the shape every KvShape has; dim and theta when the caller knows them.
Status CheckFits(const Calibration& c, const KvShape& s, int dim, float theta, const std::string& model_hex) {
  const std::string file_hex = c.model_checksum.hex();
  if (Lower(model_hex) != file_hex) {
    return Status::InvalidArgument("bellows calibration was made for model " + file_hex +
                                   ", but this model's weights checksum is " + model_hex);
  }
  const int want_dim = dim > 0 ? dim : c.dim;
  const float want_theta = theta > 0.f ? theta : c.rope_theta;
  if (s.n_layers != c.n_layers || s.n_heads != c.n_heads || s.n_kv_heads != c.n_kv_heads ||
      s.head_dim != c.head_dim || want_dim != c.dim || want_theta != c.rope_theta) {
    return Status::InvalidArgument(
        "bellows calibration shape (" + Shape(c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta) +
        ") does not match the model (" + Shape(want_dim, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, want_theta) +
        ")");
  }
  return Status::Ok();
}

// KvShape gains dim and rope_theta with the BellowsKV engine seam; compare them once it has them.
template <typename S>
Status CheckFitsShape(const Calibration& c, const S& shape, const std::string& model_hex) {
  if constexpr (requires { shape.dim; shape.rope_theta; }) {
    return CheckFits(c, shape, shape.dim, shape.rope_theta, model_hex);
  } else {
    return CheckFits(c, shape, 0, 0.f, model_hex);
  }
}

}  // namespace

Status ValidateCalibration(const Calibration& c) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("bellows calibration: " + m); };
  std::string p = HeaderProblem(c);
  if (!p.empty()) return bad(p);
  const int want_groups = GroupCount(c.n_layers, c.group_size);
  if (static_cast<int>(c.groups.size()) != want_groups) {
    return bad(std::to_string(c.groups.size()) + " groups, but groups of " + std::to_string(c.group_size) +
               " over " + std::to_string(c.n_layers) + " layers make " + std::to_string(want_groups));
  }
  const size_t kv = static_cast<size_t>(c.kv_dim());
  for (int gi = 0; gi < want_groups; ++gi) {
    const CalibrationGroup& g = c.groups[gi];
    if (!(p = GroupProblem(c, gi, g)).empty()) return bad(p);
    const std::string at = "group " + std::to_string(gi) + " ";
    auto check = [&](const std::string& field, const std::vector<float>& v, size_t want) -> Status {
      if (v.size() != want) {
        return bad(at + field + " has " + std::to_string(v.size()) + " values, expected " + std::to_string(want));
      }
      const int64_t i = FirstNonFinite(v.data(), v.size());
      if (i >= 0) return bad(at + field + "[" + std::to_string(i) + "] is " + NonFiniteName(v[i]));
      return Status::Ok();
    };
    const size_t in = static_cast<size_t>(g.n_layers) * c.dim;
    KEEL_RETURN_IF_ERROR(check("x_mean", g.x_mean, in));
    KEEL_RETURN_IF_ERROR(check("compress", g.compress, in * g.rank));
    if (static_cast<int>(g.layers.size()) != g.n_layers) {
      return bad(at + "has " + std::to_string(g.layers.size()) + " layer entries for " + std::to_string(g.n_layers) +
                 " layers");
    }
    for (int i = 0; i < g.n_layers; ++i) {
      const LayerRestore& l = g.layers[i];
      const std::string lf = "layer " + std::to_string(g.first_layer + i) + " ";
      KEEL_RETURN_IF_ERROR(check(lf + "k_mean", l.k_mean, kv));
      KEEL_RETURN_IF_ERROR(check(lf + "v_mean", l.v_mean, kv));
      KEEL_RETURN_IF_ERROR(check(lf + "rk", l.rk, kv * (g.k_end - g.k_begin)));
      KEEL_RETURN_IF_ERROR(check(lf + "rv", l.rv, kv * (g.v_end - g.v_begin)));
      for (float e : {l.errors.k_rel, l.errors.v_rel, l.errors.k_weighted_rel, l.errors.v_weighted_rel}) {
        if (!std::isfinite(e) || e < 0.f) return bad(at + lf + "has an error figure that is not finite and >= 0");
      }
    }
  }
  if (c.vocab < 0 || c.vocab > kMaxVocab) {
    return bad("token table vocab " + std::to_string(c.vocab) + " outside 0.." + std::to_string(kMaxVocab));
  }
  if (c.token_kv.size() != static_cast<size_t>(c.vocab) * 2 * kv) {
    return bad("token table has " + std::to_string(c.token_kv.size()) + " values, expected vocab " +
               std::to_string(c.vocab) + " x 2 x kv_dim " + std::to_string(kv));
  }
  if (const int64_t i = FirstNonFinite(c.token_kv.data(), c.token_kv.size()); i >= 0) {
    return bad("token table[" + std::to_string(i) + "] is " + NonFiniteName(c.token_kv[i]));
  }
  return Status::Ok();
}

Result<std::string> SerializeCalibration(const Calibration& c) {
  KEEL_RETURN_IF_ERROR(ValidateCalibration(c));
  return Encode(c);
}

Status WriteCalibration(const std::string& path, const Calibration& c) {
  KEEL_ASSIGN_OR_RETURN(std::string bytes, SerializeCalibration(c));
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(tmp + ": open: " + std::strerror(errno));
  Status st = WriteAllToFd(fd, tmp, bytes.data(), bytes.size());
  if (st.ok() && ::fsync(fd) != 0) st = Status::IOError(tmp + ": fsync: " + std::strerror(errno));
  if (::close(fd) != 0 && st.ok()) st = Status::IOError(tmp + ": close: " + std::strerror(errno));
  if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    st = Status::IOError(path + ": rename: " + std::strerror(errno));
  }
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  return SyncParentDir(path);
}

Result<Calibration> ParseCalibration(std::string_view bytes, const std::string& name) {
  auto corrupt = [&](size_t off, const std::string& what) {
    return Status::Corruption(name + ": " + what + " at offset " + std::to_string(off));
  };
  const size_t size = bytes.size();
  if (size < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    if (size < sizeof(kMagic) && (size == 0 || std::memcmp(bytes.data(), kMagic, size) == 0)) {
      return corrupt(size, "truncated: " + std::to_string(size) + " bytes, not even the magic");
    }
    return corrupt(0, "bad magic (not a BellowsKV calibration file)");
  }
  if (size < kFixedHeaderBytes) {
    return corrupt(size, "truncated header (" + std::to_string(size) + " of " + std::to_string(kFixedHeaderBytes) +
                             " bytes)");
  }
  uint32_t version = 0, reserved = 0;
  uint64_t total = 0;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&reserved, bytes.data() + 12, 4);
  std::memcpy(&total, bytes.data() + 16, 8);
  if (version != kVersion) {
    return corrupt(8, "unknown version " + std::to_string(version) + " (this reader knows " +
                          std::to_string(kVersion) + ")");
  }
  if (reserved != 0) return corrupt(12, "reserved field is " + std::to_string(reserved) + ", expected 0");
  if (total > size) {
    return corrupt(size, "truncated: the file is " + std::to_string(size) + " bytes, its header says " +
                             std::to_string(total));
  }
  if (total < size) {
    return corrupt(total, std::to_string(size - total) + " trailing bytes after the " + std::to_string(total) +
                              " bytes its header declares");
  }
  if (size < kFixedHeaderBytes + kTrailerBytes) {
    return corrupt(16, "total_bytes " + std::to_string(total) + " is too small for a header and a trailer");
  }
  const size_t body_end = size - kTrailerBytes;
  Hash128 stored;
  std::memcpy(&stored.lo, bytes.data() + body_end, 8);
  std::memcpy(&stored.hi, bytes.data() + body_end + 8, 8);
  const Hash128 actual = Xxh3_128(bytes.data(), body_end);
  if (!(stored == actual)) {
    return corrupt(body_end, "checksum mismatch (trailer " + stored.hex() + ", content " + actual.hex() + ")");
  }
  Reader r(bytes, body_end, name);
  std::string skip;
  KEEL_RETURN_IF_ERROR(r.Bytes("fixed header", kFixedHeaderBytes, &skip));
  Calibration c;
  KEEL_RETURN_IF_ERROR(ParseBody(r, &c));
  return c;
}

Result<Calibration> ReadCalibration(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  return ParseCalibration(bytes, path);
}

Status CheckCalibrationFits(const Calibration& c, const KvShape& shape, const std::string& model_checksum_hex) {
  return CheckFitsShape(c, shape, model_checksum_hex);
}

Status CheckCalibrationFits(const Calibration& c, const KvShape& shape, int dim, float rope_theta,
                            const std::string& model_checksum_hex) {
  if (dim <= 0 || !(rope_theta > 0.f)) {
    return Status::InvalidArgument("CheckCalibrationFits: dim and rope_theta must be positive");
  }
  return CheckFits(c, shape, dim, rope_theta, model_checksum_hex);
}

std::string CalibrationFingerprint(const Calibration& c) {
  const std::string bytes = Encode(c);
  Hash128 h;
  std::memcpy(&h.lo, bytes.data() + bytes.size() - kTrailerBytes, 8);
  std::memcpy(&h.hi, bytes.data() + bytes.size() - kTrailerBytes + 8, 8);
  return h.hex();
}

}  // namespace keel::kv::bellows
