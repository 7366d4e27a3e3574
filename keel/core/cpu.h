// Runtime CPU dispatch. Keel is compiled for AVX2 + FMA + F16C (the floor on every machine it
// targets); hot kernels also have AVX-512 variants, compiled into the same binary and chosen once
// per process from cpuid, so one build uses what the CPU it runs on has.
//
// Contract:
// - ActiveIsa() is the best level this CPU supports, unless KEEL_CPU_ISA (environment) or
//   SetActiveIsa() (the `--cpu-isa` flag; tests) chose a lower one. It never returns a level the
//   CPU lacks: SetActiveIsa refuses those with InvalidArgument, and an unusable KEEL_CPU_ISA is
//   logged and ignored.
// - Results may differ in the last bits between levels (wider lanes sum in another order); within
//   one level every kernel keeps its determinism contract (e.g. decode == prefill bit for bit).
// - SetActiveIsa is for start-up and tests: call it while no kernel runs.
//
// Writing a variant: put it in its own .cc file, include every header first, then open the
// target region with KEEL_BEGIN_TARGET_AVX512 and close it with KEEL_END_TARGET. Functions
// defined inside the region may use AVX-512; inline functions from headers stay compiled for
// the baseline, so the linker can never pick an AVX-512 copy of a shared inline function.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/status.h"

namespace keel::cpu {

enum class Isa : uint8_t {
  kAvx2 = 0,    // AVX2 + FMA + F16C + BMI2: the build's baseline
  kAvx512 = 1,  // + AVX-512 F, BW, VL, DQ
};

struct Features {
  std::string model;  // brand string, e.g. "AMD EPYC 9B45"
  bool avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512vnni = false, avx512fp16 = false;
  bool os_saves_zmm = false;  // XCR0 has the opmask and ZMM state enabled (else AVX-512 faults)
};

// What this CPU (and the OS) offers; read once.
const Features& Detected();
bool Supports(Isa isa);
// Every level this CPU supports, lowest first (what tests iterate over).
std::vector<Isa> SupportedIsas();

Isa ActiveIsa();
Status SetActiveIsa(Isa isa);
// "auto" (best supported), "avx2" or "avx512". InvalidArgument names the choices, or says what
// the CPU lacks.
Status SetActiveIsa(std::string_view name);
std::string_view IsaName(Isa isa);
// One line for the start-up log: CPU model, features that matter, chosen level and why.
std::string Describe();

}  // namespace keel::cpu

// The AVX-512 target region (see the header comment). GCC and Clang spell it differently.
#if defined(__clang__)
#define KEEL_BEGIN_TARGET_AVX512                                                                 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq\"))), \
          apply_to = function)")
#define KEEL_END_TARGET _Pragma("clang attribute pop")
#else
// GCC 12 warns "__Y may be used uninitialized" inside its own AVX-512 headers (_mm512_undefined
// operands of inlined intrinsics); the region silences that one warning.
#define KEEL_BEGIN_TARGET_AVX512                                                                    \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq\")")          \
      _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define KEEL_END_TARGET _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")
#endif
