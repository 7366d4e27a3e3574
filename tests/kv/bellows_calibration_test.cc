// BellowsKV calibration file: round trips through real files, and every rejection the format
// promises (bad magic, unknown version, truncation at every length, trailing bytes, any flipped
// byte, hostile sizes and inconsistent shapes with a valid checksum, NaN/Inf, another model).
#include "keel/kv/bellows/calibration.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>

#include "keel/core/mapped_file.h"
#include "tests/engine/test_util.h"

namespace keel::kv::bellows {
namespace {

// 3 layers in groups of 2 (the last group has one layer), GQA 2:1, a split latent in group 0
// and a joint one in group 1.
Calibration Sample(uint64_t seed = 1) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd;
  auto fill = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  Calibration c;
  c.model_checksum = Hash128{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  c.dim = 8;
  c.n_layers = 3;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.rope_theta = 10000.f;
  c.group_size = 2;
  c.method = "attention-aware, ridge 1e-6, 4096 tokens";
  const int kv = c.kv_dim();
  for (int g = 0; g < 2; ++g) {
    CalibrationGroup gr;
    gr.first_layer = 2 * g;
    gr.n_layers = g == 0 ? 2 : 1;
    gr.rank = g == 0 ? 5 : 3;
    gr.k_begin = 0;
    gr.k_end = g == 0 ? 3 : 3;
    gr.v_begin = g == 0 ? 3 : 0;
    gr.v_end = gr.rank;
    gr.x_mean = fill(gr.n_layers * c.dim);
    gr.compress = fill(static_cast<size_t>(gr.n_layers) * c.dim * gr.rank);
    for (int l = 0; l < gr.n_layers; ++l) {
      LayerRestore lr;
      lr.k_mean = fill(kv);
      lr.v_mean = fill(kv);
      lr.rk = fill(static_cast<size_t>(gr.k_end - gr.k_begin) * kv);
      lr.rv = fill(static_cast<size_t>(gr.v_end - gr.v_begin) * kv);
      lr.errors = LayerErrors{0.01f * (l + 1), 0.02f, 0.005f, 0.5f};
      gr.layers.push_back(lr);
    }
    c.groups.push_back(gr);
  }
  c.vocab = 5;
  c.token_kv = fill(static_cast<size_t>(c.vocab) * 2 * kv);
  return c;
}

std::string Bytes(const Calibration& c) {
  auto b = SerializeCalibration(c);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  return b.ok() ? *b : std::string();
}

// Rewrites the trailer so that the checksum matches again: what a hostile or buggy writer could
// produce, so every check after the checksum must stand on its own.
void Reseal(std::string& b) {
  const Hash128 h = Xxh3_128(b.data(), b.size() - 16);
  std::memcpy(b.data() + b.size() - 16, &h.lo, 8);
  std::memcpy(b.data() + b.size() - 8, &h.hi, 8);
}

template <typename T>
void Put(std::string& b, size_t off, T v) {
  std::memcpy(b.data() + off, &v, sizeof(T));
}

// Offsets of the layout in calibration.h.
constexpr size_t kOffVersion = 8, kOffTotal = 16, kOffModel = 24, kOffDim = 40, kOffLayers = 44, kOffHeads = 48,
                 kOffKvHeads = 52, kOffHeadDim = 56, kOffTheta = 60, kOffGroupSize = 64, kOffGroups = 68,
                 kOffMethodLen = 72;
size_t Group0(const Calibration& c) { return 76 + c.method.size(); }

void ExpectCorrupt(const std::string& bytes, const std::string& words, size_t offset) {
  auto r = ParseCalibration(bytes, "cal.bkv");
  ASSERT_FALSE(r.ok()) << "expected: " << words;
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  const std::string& m = r.status().message();
  EXPECT_EQ(m.rfind("cal.bkv: ", 0), 0u) << m;
  EXPECT_NE(m.find(words), std::string::npos) << m;
  EXPECT_NE(m.find("at offset " + std::to_string(offset)), std::string::npos) << m;
}

void ExpectSame(const Calibration& a, const Calibration& b) {
  EXPECT_EQ(a.model_checksum, b.model_checksum);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.group_size, b.group_size);
  EXPECT_EQ(a.method, b.method);
  ASSERT_EQ(a.groups.size(), b.groups.size());
  for (size_t g = 0; g < a.groups.size(); ++g) {
    const CalibrationGroup &x = a.groups[g], &y = b.groups[g];
    EXPECT_EQ(x.first_layer, y.first_layer);
    EXPECT_EQ(x.n_layers, y.n_layers);
    EXPECT_EQ(x.rank, y.rank);
    EXPECT_EQ(x.k_begin, y.k_begin);
    EXPECT_EQ(x.k_end, y.k_end);
    EXPECT_EQ(x.v_begin, y.v_begin);
    EXPECT_EQ(x.v_end, y.v_end);
    EXPECT_EQ(x.x_mean, y.x_mean);
    EXPECT_EQ(x.compress, y.compress);
    ASSERT_EQ(x.layers.size(), y.layers.size());
    for (size_t l = 0; l < x.layers.size(); ++l) {
      EXPECT_EQ(x.layers[l].k_mean, y.layers[l].k_mean);
      EXPECT_EQ(x.layers[l].v_mean, y.layers[l].v_mean);
      EXPECT_EQ(x.layers[l].rk, y.layers[l].rk);
      EXPECT_EQ(x.layers[l].rv, y.layers[l].rv);
      EXPECT_EQ(x.layers[l].errors.k_rel, y.layers[l].errors.k_rel);
      EXPECT_EQ(x.layers[l].errors.v_weighted_rel, y.layers[l].errors.v_weighted_rel);
    }
  }
}

TEST(BellowsCalibration, RoundTripThroughAFile) {
  test::TempDir dir("bellows-cal");
  const std::string path = dir.file("model.bkv");
  const Calibration c = Sample();
  ASSERT_TRUE(WriteCalibration(path, c).ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  auto back = ReadCalibration(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSame(c, *back);
  // Canonical: the parsed value serializes to the file's exact bytes.
  auto file = ReadFileToString(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(Bytes(*back), *file);
  EXPECT_EQ(file->size(), Bytes(c).size());
  // Overwriting replaces the file whole.
  const Calibration c2 = Sample(2);
  ASSERT_TRUE(WriteCalibration(path, c2).ok());
  auto back2 = ReadCalibration(path);
  ASSERT_TRUE(back2.ok());
  ExpectSame(c2, *back2);
}

TEST(BellowsCalibration, FingerprintIsTheFileChecksumAndCoversEveryValue) {
  const Calibration c = Sample();
  const std::string b = Bytes(c);
  Hash128 trailer;
  std::memcpy(&trailer.lo, b.data() + b.size() - 16, 8);
  std::memcpy(&trailer.hi, b.data() + b.size() - 8, 8);
  EXPECT_EQ(CalibrationFingerprint(c), trailer.hex());
  EXPECT_EQ(CalibrationFingerprint(c).size(), 32u);
  Calibration d = c;
  d.groups[1].layers[0].rv.back() = std::nextafter(d.groups[1].layers[0].rv.back(), 1e9f);
  EXPECT_NE(CalibrationFingerprint(d), CalibrationFingerprint(c));
  Calibration e = c;
  e.method += ".";
  EXPECT_NE(CalibrationFingerprint(e), CalibrationFingerprint(c));
}

TEST(BellowsCalibration, MissingFileAndUnwritableDirectory) {
  test::TempDir dir("bellows-cal");
  auto r = ReadCalibration(dir.file("absent.bkv"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  Status w = WriteCalibration(dir.file("no/such/dir/x.bkv"), Sample());
  EXPECT_EQ(w.code(), StatusCode::kIOError) << w.ToString();
  Calibration bad = Sample();
  bad.groups[0].compress.pop_back();
  w = WriteCalibration(dir.file("bad.bkv"), bad);
  EXPECT_EQ(w.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir.file("bad.bkv")));
}

TEST(BellowsCalibration, EveryTruncationIsRejected) {
  const std::string b = Bytes(Sample());
  for (size_t n = 0; n < b.size(); ++n) {
    auto r = ParseCalibration(std::string_view(b).substr(0, n), "cal.bkv");
    ASSERT_FALSE(r.ok()) << "accepted a file cut at " << n << " of " << b.size();
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find("cal.bkv: "), std::string::npos);
    if (n >= 24) {
      EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().ToString();
    }
  }
  ExpectCorrupt(b.substr(0, 100), "the file is 100 bytes, its header says " + std::to_string(b.size()), 100);
}

TEST(BellowsCalibration, TrailingBytesAreRejected) {
  const std::string b = Bytes(Sample());
  ExpectCorrupt(b + "x", "1 trailing bytes", b.size());
  // Also when total_bytes is patched to cover them (and the checksum resealed): the token table
  // ends before the trailer.
  std::string longer = b.substr(0, b.size() - 16) + std::string(4, '\0') + std::string(16, '\0');
  Put<uint64_t>(longer, kOffTotal, longer.size());
  Reseal(longer);
  ExpectCorrupt(longer, "4 unexpected bytes after the token table", b.size() - 16);
}

TEST(BellowsCalibration, TokenTableIsCheckedLikeEveryOtherArray) {
  const Calibration c = Sample();
  const std::string b = Bytes(c);
  const size_t table_bytes = c.token_kv.size() * sizeof(float);
  const size_t vocab_off = b.size() - 16 - table_bytes - 4;
  // NaN inside the table, checksum resealed.
  std::string nan = b;
  Put<float>(nan, vocab_off + 4 + 8, std::numeric_limits<float>::quiet_NaN());
  Reseal(nan);
  ExpectCorrupt(nan, "token table[2] is NaN", vocab_off + 4 + 8);
  // A hostile vocabulary: refused before anything is allocated.
  std::string huge = b;
  Put<uint32_t>(huge, vocab_off, 1u << 30);
  Reseal(huge);
  ExpectCorrupt(huge, "token table vocab", vocab_off);
  // A vocabulary larger than the bytes that follow.
  std::string big = b;
  Put<uint32_t>(big, vocab_off, 6);
  Reseal(big);
  ExpectCorrupt(big, "truncated: token table", vocab_off + 4);
  // In memory: the table must have vocab x 2 x kv_dim values.
  Calibration short_table = c;
  short_table.token_kv.pop_back();
  EXPECT_FALSE(ValidateCalibration(short_table).ok());
  Calibration none = c;
  none.vocab = 0;
  none.token_kv.clear();
  auto parsed = ParseCalibration(Bytes(none), "none.bkv");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->vocab, 0);
}

TEST(BellowsCalibration, AnyFlippedByteIsRejected) {
  const std::string b = Bytes(Sample());
  for (size_t i = 0; i < b.size(); ++i) {
    std::string x = b;
    x[i] = static_cast<char>(x[i] ^ 0x10);
    auto r = ParseCalibration(x, "cal.bkv");
    ASSERT_FALSE(r.ok()) << "accepted a flip at offset " << i;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  }
  std::string body = b;
  body[200] ^= 1;
  ExpectCorrupt(body, "checksum mismatch", b.size() - 16);
  std::string trailer = b;
  trailer[b.size() - 3] ^= 1;
  ExpectCorrupt(trailer, "checksum mismatch", b.size() - 16);
}

TEST(BellowsCalibration, BadMagicAndUnknownVersion) {
  std::string b = Bytes(Sample());
  std::string m = b;
  m[3] = 'X';
  ExpectCorrupt(m, "bad magic", 0);
  ExpectCorrupt("GGUF\3\0\0\0", "bad magic", 0);
  std::string v = b;
  Put<uint32_t>(v, kOffVersion, 2);
  Reseal(v);  // the version is checked on its own, not only through the checksum
  ExpectCorrupt(v, "unknown version 2 (this reader knows 1)", kOffVersion);
}

TEST(BellowsCalibration, NonFiniteValuesAreRejectedEvenWithAValidChecksum) {
  const Calibration c = Sample();
  const size_t g0 = Group0(c);
  const size_t x_mean0 = g0 + 28;
  const size_t compress0 = x_mean0 + 4 * 16;
  {
    std::string b = Bytes(c);
    const size_t off = compress0 + 4 * 7;
    Put<float>(b, off, std::numeric_limits<float>::quiet_NaN());
    Reseal(b);
    ExpectCorrupt(b, "group 0 compress[7] is NaN", off);
  }
  {
    // Finite but huge: the codec's products overflowed to inf and every answer was garbage.
    std::string b = Bytes(c);
    const size_t off = compress0 + 4 * 7;
    Put<float>(b, off, 3e38f);
    Reseal(b);
    ExpectCorrupt(b, "group 0 compress[7] is out of range", off);
  }
  {
    // Group 0 layer 1's rv[2]: after compress (16 x 5), layer 0 (4 errors, 2x4 means, 3x4 rk,
    // 2x4 rv), then layer 1's errors, means and rk.
    const size_t layer0 = compress0 + 4 * 16 * 5;
    const size_t layer_bytes = 4 * (4 + 8 + 12 + 8);
    const size_t rv = layer0 + layer_bytes + 4 * (4 + 8 + 12);
    std::string b = Bytes(c);
    Put<float>(b, rv + 8, -std::numeric_limits<float>::infinity());
    Reseal(b);
    ExpectCorrupt(b, "group 0 layer 1 rv[2] is infinite", rv + 8);
  }
  {
    std::string b = Bytes(c);
    Put<float>(b, kOffTheta, std::numeric_limits<float>::quiet_NaN());
    Reseal(b);
    ExpectCorrupt(b, "rope_theta is not a positive finite number", kOffDim);
  }
  // The writer refuses them too.
  Calibration n = c;
  n.groups[1].layers[0].k_mean[2] = std::nanf("");
  auto s = SerializeCalibration(n);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("group 1 layer 2 k_mean[2] is NaN"), std::string::npos) << s.status().ToString();
}

TEST(BellowsCalibration, HostileSizesAreRejectedBeforeAllocating) {
  Calibration c = Sample();
  c.vocab = 0;  // the offsets below assume nothing after the groups
  c.token_kv.clear();
  const size_t g0 = Group0(c);
  auto patched = [&](size_t off, uint32_t v) {
    std::string b = Bytes(c);
    Put<uint32_t>(b, off, v);
    Reseal(b);
    return b;
  };
  ExpectCorrupt(patched(kOffMethodLen, 0xfffffff0u), "method length 4294967280 > 65536", kOffMethodLen);
  ExpectCorrupt(patched(kOffMethodLen, 60000), "truncated: method text needs 60000 bytes", kOffMethodLen + 4);
  ExpectCorrupt(patched(kOffDim, 0x7fffffffu), "dim 2147483647 outside [1, 65536]", kOffDim);
  ExpectCorrupt(patched(kOffDim, 0xffffffffu), "dim -1 outside", kOffDim);
  ExpectCorrupt(patched(kOffLayers, 100000), "n_layers 100000 outside [1, 1024]", kOffDim);
  ExpectCorrupt(patched(kOffGroups, 0xffffffffu), "n_groups -1 but groups of 2 over 3 layers make 2", kOffDim + 28);
  // A large but legal rank: the compress matrix would need far more bytes than the file has.
  std::string big = patched(g0 + 8, 16);  // rank 16 = n_layers*dim, the maximum
  ExpectCorrupt(big, "truncated: group 0 ", g0 + 28 + 4 * 16);
  ExpectCorrupt(patched(g0 + 8, 17), "group 0: rank 17 outside [1, 16]", g0);
  // Larger dims that stay within the limits: every array is checked against the bytes left.
  ExpectCorrupt(patched(kOffDim, 60000), "group_size*dim 120000 outside [1, 65536]", kOffDim);
  ExpectCorrupt(patched(kOffDim, 30000), "truncated: group 0 x_mean needs 240000 bytes", g0 + 28);
}

TEST(BellowsCalibration, InconsistentShapesAreRejectedEvenWithAValidChecksum) {
  const Calibration c = Sample();
  const size_t g0 = Group0(c);
  const size_t g0_bytes = 28 + 4 * (16 + 16 * 5) + 2 * 4 * (4 + 8 + 12 + 8);
  const size_t g1 = g0 + g0_bytes;
  auto patched = [&](size_t off, uint32_t v) {
    std::string b = Bytes(c);
    Put<uint32_t>(b, off, v);
    Reseal(b);
    return b;
  };
  ExpectCorrupt(patched(g0 + 16, 6), "group 0: k range [0, 6) is empty or outside the latent [0, 5)", g0);
  ExpectCorrupt(patched(g0 + 12, 3), "group 0: k range [3, 3) is empty", g0);
  ExpectCorrupt(patched(g0 + 20, 5), "group 0: v range [5, 5)", g0);
  ExpectCorrupt(patched(g1, 1), "group 1: layers [1, +1) but groups of 2 over 3 layers need [2, +1)", g1);
  ExpectCorrupt(patched(g1 + 4, 2), "group 1: layers [2, +2)", g1);
  ExpectCorrupt(patched(g0 + 8, 0), "group 0: rank 0 outside", g0);
  ExpectCorrupt(patched(kOffHeadDim, 3), "head_dim 3 is odd", kOffDim);
  ExpectCorrupt(patched(kOffKvHeads, 3), "n_kv_heads 3 outside [1, 2]", kOffDim);
  std::string heads = Bytes(c);
  Put<uint32_t>(heads, kOffHeads, 3);
  Put<uint32_t>(heads, kOffKvHeads, 2);
  Reseal(heads);
  ExpectCorrupt(heads, "n_heads 3 is not a multiple of n_kv_heads 2", kOffDim);
  ExpectCorrupt(patched(kOffGroupSize, 1), "n_groups 2 but groups of 1 over 3 layers make 3", kOffDim + 28);
  ExpectCorrupt(patched(kOffGroupSize, 4), "group_size 4 outside [1, 3]", kOffDim);
  ExpectCorrupt(patched(kOffTotal + 4, 1), "truncated: the file is", Bytes(c).size());
  // The in-memory validator applies the same rules.
  Calibration d = c;
  d.groups[1].first_layer = 1;
  Status s = ValidateCalibration(d);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("group 1: layers [1, +1)"), std::string::npos) << s.ToString();
  d = c;
  d.groups[0].layers[1].rk.push_back(0.f);
  s = ValidateCalibration(d);
  EXPECT_NE(s.message().find("group 0 layer 1 rk has 13 values, expected 12"), std::string::npos) << s.ToString();
  d = c;
  d.groups.pop_back();
  EXPECT_NE(ValidateCalibration(d).message().find("1 groups, but groups of 2 over 3 layers make 2"), std::string::npos);
}

TEST(BellowsCalibration, AFileForAnotherModelDoesNotFit) {
  const Calibration c = Sample();
  KvShape shape;
  shape.n_layers = 3;
  shape.n_heads = 2;
  shape.n_kv_heads = 1;
  shape.head_dim = 4;
  const std::string hex = c.model_checksum.hex();
  EXPECT_TRUE(CheckCalibrationFits(c, shape, 8, 10000.f, hex).ok());
  std::string upper = hex;
  for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  EXPECT_TRUE(CheckCalibrationFits(c, shape, 8, 10000.f, upper).ok());

  const std::string other = "00000000000000000000000000000001";
  Status s = CheckCalibrationFits(c, shape, 8, 10000.f, other);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(hex), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(other), std::string::npos) << s.message();

  KvShape deeper = shape;
  deeper.n_layers = 4;
  s = CheckCalibrationFits(c, deeper, 8, 10000.f, hex);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("(dim 8, 3 layers, 2 heads, 1 kv heads, head_dim 4, rope theta 10000)"),
            std::string::npos) << s.message();
  EXPECT_NE(s.message().find("(dim 8, 4 layers"), std::string::npos) << s.message();
  EXPECT_FALSE(CheckCalibrationFits(c, shape, 16, 10000.f, hex).ok());
  EXPECT_FALSE(CheckCalibrationFits(c, shape, 8, 500000.f, hex).ok());
  // The KvShape overload compares dim and theta from the shape when it carries them.
  KvShape full = shape;
  full.dim = 8;
  full.rope_theta = 10000.f;
  EXPECT_TRUE(CheckCalibrationFits(c, full, hex).ok());
  full.dim = 12;
  EXPECT_FALSE(CheckCalibrationFits(c, full, hex).ok());
}

TEST(BellowsCalibration, MethodTextSurvivesAnyBytes) {
  Calibration c = Sample();
  c.method = std::string("a\0b\n\xff", 5);
  auto back = ParseCalibration(Bytes(c), "m.bkv");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->method, c.method);
}

}  // namespace
}  // namespace keel::kv::bellows
