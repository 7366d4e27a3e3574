#!/usr/bin/env bash
# ZipFusion CUDA decode attention on an NVIDIA GPU (H100/H200-class): builds the kernels and
# zipfusion_gpu_bench, checks that the ZipFusion kernel is bit-identical to the bf16 kernel of the
# same design (and to a CPU reference within tolerance), then times both at 1K..128K context,
# batch 1 and 8, on the measured and the harsh K/V profiles, and prints Markdown tables for
# docs/results.md. When PyTorch is importable and sees the GPU, the same run first times its
# scaled_dot_product_attention (cuDNN and flash backends) on the same shapes
# (bench/zipfusion/torch_sdpa.py), and the tables add those times and ZipFusion's ratio to the
# fastest of them. Under 5 minutes.
#
#   bench/zipfusion/gpu.sh [harness args, e.g. --quick | --iters 30 | --contexts 8192]
#
# Exits 2 with a message when there is no GPU, 1 when a check fails.
# Environment: KEEL_GPU_BUILD_DIR (default build-gpu), KEEL_GPU_BENCH_TIMEOUT (seconds, default 240).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu.sh: no NVIDIA GPU here (nvidia-smi not found); nothing to run" >&2
  exit 2
fi
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu.sh: no NVIDIA GPU here (nvidia-smi lists no device); nothing to run" >&2
  exit 2
fi
if ! command -v nvcc >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
  else
    echo "gpu.sh: a GPU is present but nvcc (CUDA toolkit) is not: install it or put it on PATH" >&2
    exit 2
  fi
fi

BUILD=${KEEL_GPU_BUILD_DIR:-build-gpu}
# Compile for this GPU only (faster); 80;90 stays the CMake default elsewhere.
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .' || true)
ARCH_ARGS=()
[[ "$CC" =~ ^[0-9]+$ ]] && ARCH_ARGS=(-DCMAKE_CUDA_ARCHITECTURES="$CC")

BIN=$BUILD/zipfusion_gpu_bench
mkdir -p "$BUILD"
if command -v cmake >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1 &&
   cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_CUDA=ON \
     -DKEEL_BUILD_TESTS=OFF -DKEEL_BUILD_BENCH=OFF ${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"} >"$BUILD/configure.log" 2>&1; then
  ninja -C "$BUILD" zipfusion_gpu_bench >/dev/null
else
  # The full project needs the CPU dependencies (fmt, spdlog, Boost, ...); a bare GPU box may
  # lack them. The kernels and the harness depend on nothing but CUDA, so build them directly.
  echo "gpu.sh: CMake configure failed or cmake/ninja missing (see $BUILD/configure.log); building with nvcc directly" >&2
  ARCH=${CC:-90}
  nvcc -O3 -std=c++17 -I. -gencode "arch=compute_$ARCH,code=sm_$ARCH" \
    keel/kv/zipfusion/cuda/zipfusion_attention.cu keel/kv/zipfusion/cuda/zipfusion_gpu_bench.cu -o "$BIN"
fi

echo "_$(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1), CUDA $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')_"
echo
PEER_ARGS=()
PEER=$BUILD/torch_sdpa.txt
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if timeout 120 python3 bench/zipfusion/torch_sdpa.py "$@" >"$PEER"; then
    sed -n 's/^# //p' "$PEER" | head -n 1
    PEER_ARGS=(--peer "$PEER")
  else
    echo "gpu.sh: torch_sdpa.py failed; the table has no PyTorch columns" >&2
  fi
else
  echo "(PyTorch with CUDA not importable here: no PyTorch columns)"
fi
echo
rc=0
timeout "${KEEL_GPU_BENCH_TIMEOUT:-240}" "$BIN" ${PEER_ARGS[@]+"${PEER_ARGS[@]}"} "$@" || rc=$?
if [ "$rc" -eq 124 ]; then
  echo "gpu.sh: zipfusion_gpu_bench timed out" >&2
fi
exit "$rc"
