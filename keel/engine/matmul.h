// Weight x activation products of the forward pass: y[b][o] = sum_i W[o][i] * x[b][i], weights in
// their stored dtype (read as they are, memory-mapped), activations and sums in fp32. One kernel
// per CPU level (keel/core/cpu.h), chosen per call from cpu::ActiveIsa().
//
// Determinism (within one level): every y[b][o] is one vector accumulator walking i in the same
// order, reduced in a fixed lane order, then the i past the last full vector added in order —
// whatever n_rows is and however rows are tiled or split across threads. So a token's result does
// not depend on how it was batched (decode == prefill, bit for bit), which prefix sharing and
// preemption rely on. Levels differ in lane count (8 or 16), so their results differ in the last
// bits.
//
// Threads: OpenMP over groups of weight rows (6 or 4, matmul_kernel.h) once the product is big
// enough to pay for them.
// Prompt-sized batches are walked in chunks of activation rows that stay in L2 while the
// weights stream past them.
#pragma once

#include <span>

#include "keel/engine/model.h"

namespace keel::engine {

// x: [n_rows][w.cols], y: [n_rows][w.rows].
void MatMul(const TensorView& w, const float* x, int n_rows, float* y);

// ys[j] = ws[j] x for the same x (Q/K/V, gate/up) in one parallel region: one thread fork and
// join instead of ws.size(). Every ws[j] must have the same cols; results are bit-identical to
// separate MatMul calls.
void MatMulSameInput(std::span<const TensorView> ws, const float* x, int n_rows, std::span<float* const> ys);

namespace matmul_detail {
// The per-level kernels behind MatMulSameInput (for tests and benchmarks that compare levels).
void RunAvx2(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows);
void RunAvx512(const TensorView* ws, float* const* ys, int count, const float* x, int n_rows);
}  // namespace matmul_detail

}  // namespace keel::engine
