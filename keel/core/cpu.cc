#include "keel/core/cpu.h"

#include <cpuid.h>

#include <atomic>
#include <cstdlib>
#include <cstring>


namespace keel::cpu {
namespace {

Features Probe() {
  Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  bool osxsave = false;
  if (max_leaf >= 1) {
    __cpuid(1, a, b, c, d);
    f.fma = (c >> 12) & 1;
    f.f16c = (c >> 29) & 1;
    osxsave = (c >> 27) & 1;
  }
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  const bool os_ymm = (xcr0 & 0x6) == 0x6;
  f.os_saves_zmm = (xcr0 & 0xe6) == 0xe6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = ((b >> 5) & 1) && os_ymm;
    f.bmi2 = (b >> 8) & 1;
    f.avx512f = (b >> 16) & 1;
    f.avx512dq = (b >> 17) & 1;
    f.avx512bw = (b >> 30) & 1;
    f.avx512vl = (b >> 31) & 1;
    f.avx512vnni = (c >> 11) & 1;
    f.avx512fp16 = (d >> 23) & 1;
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512bf16 = (a >> 5) & 1;
  }
  if (!f.os_saves_zmm) f.avx512f = f.avx512dq = f.avx512bw = f.avx512vl = f.avx512vnni = f.avx512fp16 = f.avx512bf16 = false;
  char brand[49] = {};
  if (__get_cpuid_max(0x80000000, nullptr) >= 0x80000004) {
    for (unsigned leaf = 0; leaf < 3; ++leaf) {
      __cpuid(0x80000002 + leaf, a, b, c, d);
      std::memcpy(brand + 16 * leaf, &a, 4);
      std::memcpy(brand + 16 * leaf + 4, &b, 4);
      std::memcpy(brand + 16 * leaf + 8, &c, 4);
      std::memcpy(brand + 16 * leaf + 12, &d, 4);
    }
  }
  f.model = brand;
  while (!f.model.empty() && f.model.back() == ' ') f.model.pop_back();
  while (!f.model.empty() && f.model.front() == ' ') f.model.erase(0, 1);
  return f;
}

Isa Best() { return Supports(Isa::kAvx512) ? Isa::kAvx512 : Isa::kAvx2; }

Status ParseIsa(std::string_view name, Isa& out) {
  if (name == "auto") {
    out = Best();
  } else if (name == "avx2") {
    out = Isa::kAvx2;
  } else if (name == "avx512") {
    out = Isa::kAvx512;
  } else {
    return Status::InvalidArgument("unknown CPU level '" + std::string(name) + "' (choices: auto, avx2, avx512)");
  }
  if (!Supports(out)) {
    return Status::InvalidArgument("this CPU (" + Detected().model + ") lacks " + std::string(IsaName(out)) +
                                   (out == Isa::kAvx512 ? " (needs AVX-512 F, BW, VL and DQ enabled by the OS)" : ""));
  }
  return Status::Ok();
}

// Where the level came from, for Describe().
std::atomic<int> g_source{0};  // 0 cpuid, 1 KEEL_CPU_ISA, 2 SetActiveIsa
std::string g_env_error;        // why KEEL_CPU_ISA was ignored (written once, before first use)

std::atomic<Isa>& ActiveSlot() {
  static std::atomic<Isa> slot = [] {
    Isa isa = Best();
    if (const char* env = std::getenv("KEEL_CPU_ISA"); env != nullptr && *env != '\0') {
      Isa chosen;
      Status s = ParseIsa(env, chosen);
      if (s.ok()) {
        isa = chosen;
        g_source = 1;
      } else {
        g_env_error = "KEEL_CPU_ISA ignored: " + s.message();
      }
    }
    return std::atomic<Isa>(isa);
  }();
  return slot;
}

}  // namespace

const Features& Detected() {
  static const Features f = Probe();
  return f;
}

bool Supports(Isa isa) {
  const Features& f = Detected();
  switch (isa) {
    case Isa::kAvx2: return f.avx2 && f.fma && f.f16c;
    case Isa::kAvx512: return f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  }
  return false;
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512})
    if (Supports(isa)) out.push_back(isa);
  return out;
}

Isa ActiveIsa() { return ActiveSlot().load(std::memory_order_relaxed); }

Status SetActiveIsa(Isa isa) {
  if (!Supports(isa)) return SetActiveIsa(IsaName(isa));  // for the message
  ActiveSlot().store(isa, std::memory_order_relaxed);
  g_source = 2;
  return Status::Ok();
}

Status SetActiveIsa(std::string_view name) {
  Isa isa;
  KEEL_RETURN_IF_ERROR(ParseIsa(name, isa));
  ActiveSlot().store(isa, std::memory_order_relaxed);
  g_source = 2;
  return Status::Ok();
}

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

std::string Describe() {
  const Features& f = Detected();
  const Isa isa = ActiveIsa();
  std::string extras;
  if (f.avx512bf16) extras += " avx512_bf16";
  if (f.avx512vnni) extras += " avx512_vnni";
  if (f.avx512fp16) extras += " avx512_fp16";
  const char* why = g_source == 1 ? "KEEL_CPU_ISA" : g_source == 2 ? "--cpu-isa" : "best this CPU supports";
  return "CPU " + (f.model.empty() ? std::string("(unknown model)") : f.model) + ": kernels " + std::string(IsaName(isa)) +
         " (" + why + "; avx512 " + (Supports(Isa::kAvx512) ? "available" : "not available") +
         (extras.empty() ? "" : ";" + extras) + ")" + (g_env_error.empty() ? "" : "; " + g_env_error);
}

}  // namespace keel::cpu
