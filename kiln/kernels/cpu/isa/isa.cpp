// CPU feature detection and the choice of kernel set (kernels/cpu/isa/isa.h). Portable C++:
// compiled for the baseline ISA, it runs before anything knows whether SVE is there.
#include "kiln/kernels/cpu/isa/isa.h"

#include <cstdlib>
#include <cstring>

#include "kiln/core/error.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1 << 22)
#endif
#ifndef HWCAP2_SVE2
#define HWCAP2_SVE2 (1 << 1)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
#ifndef PR_SVE_GET_VL
#define PR_SVE_GET_VL 51
#endif
#ifndef PR_SVE_VL_LEN_MASK
#define PR_SVE_VL_LEN_MASK 0xffff
#endif
#endif

namespace kiln::kernels::cpu::isa {

#if defined(__aarch64__)
// Defined in sve_table.cpp (compiled with +sve); returns the table without running SVE code.
const SveKernels* sve_kernel_table();
#endif

namespace {

struct Choice {
  CpuFeatures features;
  const SveKernels* in_use = nullptr;
  const SveKernels* available = nullptr;
};

Choice detect() {
  Choice c;
  CpuFeatures& f = c.features;
  const char* forced = std::getenv("KILN_CPU_ISA");
  if (forced && *forced) f.forced = forced;
#if defined(__x86_64__)
  f.arch = "x86_64";
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  // What target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default") resolves to on this CPU.
  const bool v4 = __builtin_cpu_supports("x86-64-v4"), v3 = __builtin_cpu_supports("x86-64-v3");
  f.kernels = v4 ? "x86-64-v4" : v3 ? "x86-64-v3" : "baseline";
  f.vector_bits = v4 ? 512 : v3 ? 256 : 128;  // KILN_CPU_ISA has no effect here (kiln info shows it as ignored)
#elif defined(__aarch64__)
  f.arch = "aarch64";
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.neon = (hw & HWCAP_ASIMD) != 0;
  f.sve = (hw & HWCAP_SVE) != 0;
  f.sve2 = (hw2 & HWCAP2_SVE2) != 0;
  f.bf16 = (hw2 & HWCAP2_BF16) != 0;
  if (f.sve) {
    const int vl = prctl(PR_SVE_GET_VL);
    if (vl > 0) f.sve_bits = (vl & PR_SVE_VL_LEN_MASK) * 8;
  }
#else
  f.neon = true;  // Advanced SIMD is part of every Armv8-A core
#endif
  KILN_CHECK(f.forced.empty() || f.forced == "neon" || f.forced == "sve", "KILN_CPU_ISA='", f.forced,
             "': expected neon or sve (or unset: SVE where the CPU has it)");
  if (f.sve) c.available = sve_kernel_table();
  KILN_CHECK(f.forced != "sve" || c.available, "KILN_CPU_ISA=sve: this CPU has no SVE (HWCAP_SVE is not set)");
  if (c.available && f.forced != "neon") {
    c.in_use = c.available;
    f.kernels = "sve";
    f.vector_bits = c.in_use->vector_bits();
  } else {
    f.kernels = "neon";
    f.vector_bits = 128;
  }
#else
  f.arch = "other";
  f.kernels = "baseline";
#endif
  return c;
}

const Choice& choice() {
  static const Choice c = detect();
  return c;
}

thread_local uint64_t t_sve_calls = 0;

}  // namespace

const CpuFeatures& cpu_features() { return choice().features; }
const SveKernels* sve() { return choice().in_use; }
const SveKernels* sve_available() { return choice().available; }
uint64_t sve_calls() { return t_sve_calls; }
void count_sve_call() { ++t_sve_calls; }

std::string feature_list(const CpuFeatures& f) {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.avx512f, "avx512f");
  add(f.neon, "neon");
  add(f.sve, "sve");
  add(f.sve2, "sve2");
  add(f.bf16, "bf16");
  return s.empty() ? "none" : s;
}

}  // namespace kiln::kernels::cpu::isa
