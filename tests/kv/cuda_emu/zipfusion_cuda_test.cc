// The ZipFusion CUDA kernels (run on the CPU emulation of CUDA beside this file) over blocks made
// by Keel's own encoder (keel/kv/zipfusion/format.h), not the GPU harness's copy of it: every
// value comes back bit for bit, attention is bit-identical to the bf16 kernel, corrupt headers
// raise the error flag, and bad arguments get a status and a message.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "keel/kv/zipfusion/cuda/zipfusion_attention.h"
#include "keel/kv/zipfusion/cuda/zipfusion_attention_c.h"
#include "keel/kv/zipfusion/format.h"

extern "C" int keel_zf_c_api_run(const float* q, const uint16_t* k, const uint16_t* v, int tokens, float* out,
                                 const char** stage);
extern "C" int keel_zf_c_api_bad_head_dim(const char** name, const char** message);

namespace keel::kv::zipfusion {
namespace {

namespace gpu = keel::kv::zipfusion::gpu;
constexpr int kHd = 128;
constexpr int kBt = 16;

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// K/V of one kind of data, bf16 bits [batch][kv][tokens][128].
enum class Kind { kNormal, kOutliers, kRandomBits, kSpecials, kZeros };
std::vector<uint16_t> MakeValues(Kind kind, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (kind) {
      case Kind::kNormal: v[i] = Bf16(normal(rng)); break;
      case Kind::kOutliers: v[i] = Bf16(normal(rng) * (rng() % 50 == 0 ? 4096.f : 1.f)); break;
      case Kind::kRandomBits: {
        uint16_t b = static_cast<uint16_t>(rng());
        if ((b & 0x7F80) == 0x7F80) b &= 0xBFFF;  // keep attention finite: no inf/NaN here
        v[i] = b;
        break;
      }
      case Kind::kSpecials: {
        // Zeros of both signs and subnormals among normal values; exponents far apart.
        const uint32_t r = rng() % 8;
        v[i] = r == 0 ? 0x0000 : r == 1 ? 0x8000 : r == 2 ? static_cast<uint16_t>(1 + rng() % 0x7F)
                                                   : Bf16(normal(rng));
        break;
      }
      case Kind::kZeros: v[i] = 0; break;
    }
  }
  return v;
}

// Keel-encoded blocks of one tensor, uploaded: a buffer plus the offset table.
struct DeviceTensor {
  uint8_t* buf = nullptr;
  uint64_t* offsets = nullptr;
  std::vector<int> widths;
  int exceptions = 0;
  ~DeviceTensor() {
    gpu::zf_free(buf);
    gpu::zf_free(offsets);
  }
};

void Upload(const std::vector<uint16_t>& vals, int batch, int kv, int tokens, DeviceTensor& out) {
  const int n_blocks = (tokens + kBt - 1) / kBt;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<int> ns;
  for (int u = 0; u < batch * kv; ++u)
    for (int blk = 0; blk < n_blocks; ++blk) {
      const int fill = std::min(kBt, tokens - blk * kBt);
      const int n = fill * kHd;
      std::vector<uint8_t> enc(MaxEncodedBytes(n, Dtype::kBf16));
      const uint16_t* src = vals.data() + (static_cast<size_t>(u) * tokens + blk * kBt) * kHd;
      Result<size_t> size = EncodeBlock(src, n, Dtype::kBf16, enc.data(), enc.size());
      ASSERT_TRUE(size.ok()) << size.status().ToString();
      enc.resize(*size);
      Result<BlockView> view = ParseBlock(enc.data(), enc.size());
      ASSERT_TRUE(view.ok());
      out.widths.push_back(view->width);
      out.exceptions += view->n_exc;
      blocks.push_back(std::move(enc));
      ns.push_back(n);
    }
  std::vector<const uint8_t*> ptrs;
  std::vector<size_t> sizes;
  for (const auto& b : blocks) {
    ptrs.push_back(b.data());
    sizes.push_back(b.size());
  }
  ASSERT_EQ(gpu::zf_upload_blocks(ptrs.data(), sizes.data(), ns.data(), ptrs.size(), &out.buf, &out.offsets),
            gpu::kZfOk)
      << gpu::zf_last_error();
}

template <class T>
T* ToDevice(const std::vector<T>& h) {
  void* d = nullptr;
  EXPECT_EQ(gpu::zf_malloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)), gpu::kZfOk);
  EXPECT_EQ(gpu::zf_copy_to_device(d, h.data(), h.size() * sizeof(T)), gpu::kZfOk);
  return static_cast<T*>(d);
}
template <class T>
std::vector<T> ToHost(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(gpu::zf_copy_to_host(h.data(), d, n * sizeof(T)), gpu::kZfOk);
  return h;
}

TEST(ZipFusionCuda, KernelLoaderReproducesKeelEncodedBlocks) {
  const int batch = 2, kv = 2;
  std::set<int> widths;
  int exceptions = 0;
  for (Kind kind : {Kind::kNormal, Kind::kOutliers, Kind::kRandomBits, Kind::kSpecials, Kind::kZeros})
    for (int tokens : {1, 7, 16, 33, 100}) {
      SCOPED_TRACE("kind " + std::to_string(static_cast<int>(kind)) + ", tokens " + std::to_string(tokens));
      const std::vector<uint16_t> vals = MakeValues(kind, static_cast<size_t>(batch) * kv * tokens * kHd, 11 + tokens);
      DeviceTensor t;
      Upload(vals, batch, kv, tokens, t);
      widths.insert(t.widths.begin(), t.widths.end());
      exceptions += t.exceptions;
      gpu::ZfAttnShape s;
      s.batch = batch;
      s.n_kv_heads = kv;
      s.n_q_heads = kv;
      s.n_tokens = tokens;
      // Both register layouts the attention kernel reads blocks in: K's and V's.
      for (gpu::ZfOperand operand : {gpu::kZfKeyOperand, gpu::kZfValueOperand}) {
        std::vector<uint16_t> fill(vals.size(), 0xDEAD);
        uint16_t* d_out = ToDevice(fill);
        int* d_err = ToDevice(std::vector<int>{0});
        ASSERT_EQ(gpu::zf_decode_blocks(s, t.buf, t.offsets, d_out, operand, d_err), gpu::kZfOk)
            << gpu::zf_last_error();
        EXPECT_EQ(ToHost(d_err, 1)[0], 0);
        EXPECT_EQ(ToHost(d_out, vals.size()), vals) << "operand " << operand;
        gpu::zf_free(d_out);
        gpu::zf_free(d_err);
      }
    }
  // The data must have exercised the decoder: narrow and wide codes, width 0, exceptions.
  EXPECT_TRUE(widths.count(0) && widths.count(8)) << widths.size();
  EXPECT_GE(widths.size(), 4u);
  EXPECT_GT(exceptions, 100);
}

// Double-precision attention, for a loose sanity check (the kernels' own order differs). Returns
// the worst error over its bound, so < 1 passes. The bound is 1e-4 of sum_t p_t |v_td| plus what
// fp32 scores cannot avoid: a score is a sum of products whose rounding errors scale with
// sum_d |q_d k_td| / sqrt(128), not with the score, and an absolute score error e moves the
// output by up to ~e relative to that scale. With the outlier data (2% of values x4096) that
// floor is ~1e-4 itself.
double WorstErrorOverBound(const std::vector<float>& q, const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                           const std::vector<float>& got, int batch, int kv, int group, int tokens) {
  double worst = 0;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < kv * group; ++h) {
      const float* qh = q.data() + (static_cast<size_t>(b) * kv * group + h) * kHd;
      const size_t head = (static_cast<size_t>(b) * kv + h / group) * tokens * kHd;
      std::vector<double> p(tokens);
      double m = -INFINITY, l = 0, magnitude = 0;
      for (int t = 0; t < tokens; ++t) {
        double dot = 0, abs_dot = 0;
        for (int d = 0; d < kHd; ++d) {
          const double x = static_cast<double>(qh[d]) * FromBf16(k[head + t * kHd + d]);
          dot += x;
          abs_dot += std::fabs(x);
        }
        p[t] = dot / std::sqrt(static_cast<double>(kHd));
        magnitude = std::max(magnitude, abs_dot / std::sqrt(static_cast<double>(kHd)));
        m = std::max(m, p[t]);
      }
      const double bound = 1e-4 + 32 * std::ldexp(1.0, -24) * magnitude;
      for (int t = 0; t < tokens; ++t) l += (p[t] = std::exp(p[t] - m));
      for (int d = 0; d < kHd; ++d) {
        double o = 0, scale = 0;
        for (int t = 0; t < tokens; ++t) {
          const double x = FromBf16(v[head + t * kHd + d]);
          o += p[t] * x;
          scale += p[t] * std::fabs(x);
        }
        const double g = got[(static_cast<size_t>(b) * kv * group + h) * kHd + d];
        worst = std::max(worst, std::fabs(g - o / l) / std::max(scale / l, 1e-30) / bound);
      }
    }
  return worst;
}

TEST(ZipFusionCuda, AttentionOverKeelEncodedBlocksIsBitIdenticalToBf16Kernel) {
  const int batch = 2, kv = 2;
  for (Kind kind : {Kind::kNormal, Kind::kOutliers, Kind::kSpecials})
    for (int tokens : {1, 17, 130})
      for (int group : {1, 2, 4, 8})
        for (int bps : {0, 1, 5}) {
          SCOPED_TRACE("kind " + std::to_string(static_cast<int>(kind)) + ", tokens " + std::to_string(tokens) +
                       ", group " + std::to_string(group) + ", blocks per split " + std::to_string(bps));
          const size_t n = static_cast<size_t>(batch) * kv * tokens * kHd;
          const std::vector<uint16_t> k = MakeValues(kind, n, 100 + tokens), v = MakeValues(kind, n, 200 + tokens);
          DeviceTensor dk, dv;
          Upload(k, batch, kv, tokens, dk);
          Upload(v, batch, kv, tokens, dv);
          std::mt19937 rng(5);
          std::normal_distribution<float> normal(0.f, 1.f);
          std::vector<float> q(static_cast<size_t>(batch) * kv * group * kHd);
          for (float& x : q) x = normal(rng);
          gpu::ZfAttnShape s;
          s.batch = batch;
          s.n_kv_heads = kv;
          s.n_q_heads = kv * group;
          s.n_tokens = tokens;
          s.blocks_per_split = bps;
          gpu::ZfPlan plan;
          ASSERT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfOk);
          float* d_q = ToDevice(q);
          uint16_t* d_k = ToDevice(k);
          uint16_t* d_v = ToDevice(v);
          std::vector<float> init(q.size(), -1.f);
          float* d_o1 = ToDevice(init);
          float* d_o2 = ToDevice(init);
          int* d_err = ToDevice(std::vector<int>{0});
          void* ws = nullptr;
          ASSERT_EQ(gpu::zf_malloc(&ws, plan.workspace_bytes), gpu::kZfOk);
          ASSERT_EQ(gpu::zf_attention_bf16(s, d_q, d_k, d_v, d_o1, ws, plan.workspace_bytes), gpu::kZfOk)
              << gpu::zf_last_error();
          const std::vector<float> bf16_out = ToHost(d_o1, q.size());
          ASSERT_EQ(gpu::zf_attention_zipfusion(s, d_q, dk.buf, dk.offsets, dv.buf, dv.offsets, d_o2, ws,
                                                plan.workspace_bytes, d_err),
                    gpu::kZfOk)
              << gpu::zf_last_error();
          const std::vector<float> zf_out = ToHost(d_o2, q.size());
          EXPECT_EQ(ToHost(d_err, 1)[0], 0);
          EXPECT_EQ(std::memcmp(bf16_out.data(), zf_out.data(), q.size() * sizeof(float)), 0);
          EXPECT_LT(WorstErrorOverBound(q, k, v, zf_out, batch, kv, group, tokens), 1.0);
          for (void* p : {static_cast<void*>(d_q), static_cast<void*>(d_k), static_cast<void*>(d_v),
                          static_cast<void*>(d_o1), static_cast<void*>(d_o2), static_cast<void*>(d_err), ws})
            gpu::zf_free(p);
        }
}

TEST(ZipFusionCuda, CorruptHeadersAreRejectedOnTheHostAndFlaggedOnTheDevice) {
  const std::vector<uint16_t> vals = MakeValues(Kind::kOutliers, 16 * kHd, 3);
  std::vector<uint8_t> good(MaxEncodedBytes(16 * kHd, Dtype::kBf16));
  Result<size_t> size = EncodeBlock(vals.data(), 16 * kHd, Dtype::kBf16, good.data(), good.size());
  ASSERT_TRUE(size.ok());
  good.resize((*size + 7) & ~size_t{7});
  ASSERT_EQ(gpu::zf_validate_block(good.data(), *size, 16 * kHd), gpu::kZfOk) << gpu::zf_last_error();
  EXPECT_EQ(gpu::zf_validate_block(good.data(), *size - 1, 16 * kHd), gpu::kZfCorruptBlock);
  EXPECT_NE(std::string(gpu::zf_last_error()).find("truncated"), std::string::npos) << gpu::zf_last_error();

  struct Corruption {
    const char* what;
    int byte;
    uint8_t value;
  };
  const Corruption corruptions[] = {
      {"magic", 0, 0x00}, {"dtype", 1, 1}, {"width", 2, 9}, {"base", 3, 0xFF}, {"n", 4, 0x10},
  };
  for (const Corruption& c : corruptions) {
    SCOPED_TRACE(c.what);
    std::vector<uint8_t> bad = good;
    bad[c.byte] = c.value;
    EXPECT_EQ(gpu::zf_validate_block(bad.data(), *size, 16 * kHd), gpu::kZfCorruptBlock);
    EXPECT_STRNE(gpu::zf_last_error(), "");
    // Bypass validation: the kernel itself must notice, raise the flag and stay in bounds.
    uint8_t* d_buf = ToDevice(bad);
    uint64_t* d_off = ToDevice(std::vector<uint64_t>{0});
    std::vector<float> q(kHd, 0.5f);
    float* d_q = ToDevice(q);
    float* d_o = ToDevice(std::vector<float>(kHd, 0.f));
    int* d_err = ToDevice(std::vector<int>{0});
    gpu::ZfAttnShape s;
    s.n_q_heads = s.n_kv_heads = 1;
    s.n_tokens = 16;
    s.blocks_per_split = 1;
    gpu::ZfPlan plan;
    ASSERT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfOk);
    void* ws = nullptr;
    ASSERT_EQ(gpu::zf_malloc(&ws, plan.workspace_bytes), gpu::kZfOk);
    ASSERT_EQ(gpu::zf_attention_zipfusion(s, d_q, d_buf, d_off, d_buf, d_off, d_o, ws, plan.workspace_bytes, d_err),
              gpu::kZfOk);
    EXPECT_EQ(ToHost(d_err, 1)[0], 1);
    for (void* p : {static_cast<void*>(d_buf), static_cast<void*>(d_off), static_cast<void*>(d_q),
                    static_cast<void*>(d_o), static_cast<void*>(d_err), ws})
      gpu::zf_free(p);
  }
}

TEST(ZipFusionCuda, BadArgumentsGetAStatusAndAMessage) {
  gpu::ZfAttnShape s;
  s.n_tokens = 64;
  gpu::ZfPlan plan;
  s.head_dim = 64;
  EXPECT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfUnsupported);
  EXPECT_NE(std::string(gpu::zf_last_error()).find("head_dim"), std::string::npos);
  s.head_dim = 128;
  s.n_q_heads = 24;  // group 3
  EXPECT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfUnsupported);
  s.n_q_heads = 20;  // not a multiple of 8 KV heads
  EXPECT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfInvalidArgument);
  s.n_q_heads = 32;
  s.n_tokens = 0;
  EXPECT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfInvalidArgument);
  s.n_tokens = 64;
  s.blocks_per_split = 65;
  EXPECT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfInvalidArgument);
  s.blocks_per_split = 0;
  ASSERT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfOk);
  EXPECT_EQ(plan.n_blocks, 4);
  EXPECT_EQ(plan.blocks_per_split, 4);  // at least one block per warp
  EXPECT_EQ(plan.n_splits, 1);

  float* q = ToDevice(std::vector<float>(32 * kHd, 0.f));
  uint16_t* kv = ToDevice(std::vector<uint16_t>(8 * 64 * kHd, 0));
  float* out = ToDevice(std::vector<float>(32 * kHd, 0.f));
  void* ws = nullptr;
  ASSERT_EQ(gpu::zf_malloc(&ws, plan.workspace_bytes), gpu::kZfOk);
  EXPECT_EQ(gpu::zf_attention_bf16(s, q, kv, kv, out, ws, plan.workspace_bytes - 4), gpu::kZfInvalidArgument);
  EXPECT_NE(std::string(gpu::zf_last_error()).find("workspace"), std::string::npos);
  EXPECT_EQ(gpu::zf_attention_bf16(s, q + 1, kv, kv, out, ws, plan.workspace_bytes), gpu::kZfInvalidArgument);
  s.token_capacity = 32;  // < n_tokens
  EXPECT_EQ(gpu::zf_attention_bf16(s, q, kv, kv, out, ws, plan.workspace_bytes), gpu::kZfInvalidArgument);
  s.token_capacity = 0;
  EXPECT_EQ(gpu::zf_attention_bf16(s, q, kv, kv, out, ws, plan.workspace_bytes), gpu::kZfOk);
  EXPECT_STREQ(gpu::zf_last_error(), "");
  for (void* p : {static_cast<void*>(q), static_cast<void*>(kv), static_cast<void*>(out), ws}) gpu::zf_free(p);
}

TEST(ZipFusionCuda, CApiRunsAttentionLikeTheCppApi) {
  const int tokens = 40;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(32 * kHd);
  for (float& x : q) x = normal(rng);
  const std::vector<uint16_t> k = MakeValues(Kind::kNormal, static_cast<size_t>(8) * tokens * kHd, 31);
  const std::vector<uint16_t> v = MakeValues(Kind::kNormal, static_cast<size_t>(8) * tokens * kHd, 32);
  std::vector<float> from_c(32 * kHd, -1.f);
  const char* stage = "";
  ASSERT_EQ(keel_zf_c_api_run(q.data(), k.data(), v.data(), tokens, from_c.data(), &stage), KEEL_ZF_OK)
      << stage << ": " << keel_zf_last_error();

  gpu::ZfAttnShape s;  // the C API's defaults: 32 query heads over 8 KV heads
  s.n_tokens = tokens;
  gpu::ZfPlan plan;
  ASSERT_EQ(gpu::zf_make_plan(s, &plan), gpu::kZfOk);
  float* d_q = ToDevice(q);
  uint16_t* d_k = ToDevice(k);
  uint16_t* d_v = ToDevice(v);
  float* d_out = ToDevice(std::vector<float>(q.size(), -2.f));
  void* ws = nullptr;
  ASSERT_EQ(gpu::zf_malloc(&ws, plan.workspace_bytes), gpu::kZfOk);
  ASSERT_EQ(gpu::zf_attention_bf16(s, d_q, d_k, d_v, d_out, ws, plan.workspace_bytes), gpu::kZfOk);
  const std::vector<float> from_cpp = ToHost(d_out, q.size());
  EXPECT_EQ(std::memcmp(from_c.data(), from_cpp.data(), q.size() * sizeof(float)), 0);
  EXPECT_LT(WorstErrorOverBound(q, k, v, from_c, 1, 8, 4, tokens), 1.0);
  for (void* p : {static_cast<void*>(d_q), static_cast<void*>(d_k), static_cast<void*>(d_v), static_cast<void*>(d_out), ws})
    gpu::zf_free(p);

  const char* name = "";
  const char* message = "";
  EXPECT_EQ(keel_zf_c_api_bad_head_dim(&name, &message), KEEL_ZF_UNSUPPORTED);
  EXPECT_STREQ(name, "unsupported");
  EXPECT_NE(std::string(message).find("head_dim 64"), std::string::npos) << message;
  EXPECT_EQ(keel_zf_make_plan(nullptr, nullptr), KEEL_ZF_INVALID_ARGUMENT);
  EXPECT_STREQ(keel_zf_last_error(), "shape is NULL");
}

}  // namespace
}  // namespace keel::kv::zipfusion
