// MatMul kernel versus a plain scalar loop (the baseline), same shapes, same run, at each CPU
// level (AVX2, AVX-512). Prints a table with the speed-up ratios for decode-like (1 row) and
// prefill-like (64 rows) shapes, per dtype.
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "keel/core/aligned.h"
#include "keel/core/cpu.h"
#include "keel/core/dtype.h"
#include "keel/engine/transformer.h"

namespace {

using keel::DType;
using Clock = std::chrono::steady_clock;

void Scalar(const keel::AlignedFloats& w, const float* x, int rows, int out, int in, float* y) {
  for (int b = 0; b < rows; ++b)
    for (int o = 0; o < out; ++o) {
      float s = 0;
      for (int i = 0; i < in; ++i) s += w[static_cast<size_t>(o) * in + i] * x[b * in + i];
      y[b * out + o] = s;
    }
}

template <typename F>
double Best(F f, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

void Shape(int out, int in, const std::vector<int>& row_counts) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 0.02f);
  keel::AlignedFloats w(static_cast<size_t>(out) * in);
  for (float& v : w) v = nd(rng);
  std::vector<uint16_t, keel::AlignedAllocator<uint16_t>> wh(w.size()), wb(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    wh[i] = keel::F32ToF16(w[i]);
    wb[i] = keel::F32ToBf16(w[i]);
  }
  for (int rows : row_counts) {
    keel::AlignedFloats x(static_cast<size_t>(rows) * in), y(static_cast<size_t>(rows) * out);
    for (float& v : x) v = nd(rng);
    const double flops = 2.0 * out * in * rows;
    double base = Best([&] { Scalar(w, x.data(), rows, out, in, y.data()); }, 3);
    struct {
      const char* name;
      DType t;
      const void* data;
    } kinds[] = {{"f32", DType::kF32, w.data()}, {"f16", DType::kF16, wh.data()}, {"bf16", DType::kBF16, wb.data()}};
    for (const auto& k : kinds) {
      keel::engine::TensorView tv{k.data, k.t, out, in};
      std::printf("| %dx%d, %d | %s | %.2f |", out, in, rows, k.name, flops / base / 1e9);
      for (keel::cpu::Isa isa : {keel::cpu::Isa::kAvx2, keel::cpu::Isa::kAvx512}) {
        if (!keel::cpu::SetActiveIsa(isa).ok()) {
          std::printf(" - | - |");
          continue;
        }
        const double t = Best([&] { keel::engine::MatMul(tv, x.data(), rows, y.data()); }, 10);
        std::printf(" %.2f | %.1fx |", flops / t / 1e9, base / t);
      }
      std::printf("\n");
    }
  }
}

}  // namespace

int main() {
  // Each level this CPU has (keel/core/cpu.h), same run; "-" where the CPU lacks it.
  std::printf("%s\n\n", keel::cpu::Describe().c_str());
  std::printf("| shape (out x in, rows) | dtype | scalar baseline GFLOP/s | keel avx2 GFLOP/s | ratio | "
              "keel avx512 GFLOP/s | ratio |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|\n");
  Shape(2048, 768, {1, 16, 64});   // weights fit in cache (6 MB)
  Shape(32000, 768, {1, 16});      // a classifier: 98 MB of weights streamed from DRAM
  return 0;
}
