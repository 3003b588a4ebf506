// own_blas_core, blas_core_name (kernels/blas_core.h): a DYNAMIC_ARCH OpenBLAS's core, chosen
// again where it fell back to pre-AVX2 kernels on a CPU that has AVX2.
#include "kiln/kernels/blas_core.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "kiln/kernels/cpu/isa/isa.h"

namespace kiln::kernels::cpu {
namespace {

using CoreName = char* (*)();
using Hook = void (*)();

CoreName core_name_fn() { return reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename")); }

// OpenBLAS's x86 cores whose kernels use AVX2 or AVX-512 (driver/others/dynamic.c's names, in
// any case): a pick among these is OpenBLAS's own and stays.
bool is_vector_core(std::string_view core) {
  constexpr std::array<std::string_view, 7> kVector = {"haswell", "zen", "skylakex", "cooperlake",
                                                       "sapphirerapids", "excavator", "steamroller"};
  for (std::string_view v : kVector)
    if (core.size() == v.size() && std::equal(core.begin(), core.end(), v.begin(),
                                              [](char a, char b) { return (a | 0x20) == b; }))
      return true;
  return false;
}

// The core this CPU's features can run (isa::cpu_features: x86-64-v4 is AVX-512 F/BW/CD/DQ/VL,
// SkylakeX's set), or nullptr where it has no AVX2 + FMA. Arm keeps OpenBLAS's own pick (its arm64
// cores are chosen by the CPU's part number): there avx2 is false.
const char* wanted_core() {
  const isa::CpuFeatures& f = isa::cpu_features();
  if (!f.avx2 || !f.fma) return nullptr;
  return f.kernels == "x86-64-v4" ? "SkylakeX" : "Haswell";
}

}  // namespace

std::string blas_core_name() {
  const CoreName name = core_name_fn();
  const char* core = name ? name() : nullptr;
  return core ? core : "";
}

std::string own_blas_core() {
  const CoreName name = core_name_fn();
  if (!name) return "not OpenBLAS";
  const std::string took = blas_core_name();
  auto quit = reinterpret_cast<Hook>(::dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit"));
  auto init = reinterpret_cast<Hook>(::dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init"));
  if (!quit || !init) return "OpenBLAS core " + took + " (built for one CPU: not chosen at run time)";
  if (const char* forced = std::getenv("OPENBLAS_CORETYPE"); forced && *forced)
    return "OpenBLAS core " + took + " (OPENBLAS_CORETYPE=" + forced + ")";
  if (const char* keep = std::getenv("KILN_BLAS_CORE"); keep && std::strcmp(keep, "keep") == 0)
    return "OpenBLAS core " + took + " (its own pick, KILN_BLAS_CORE=keep)";
  const char* want = wanted_core();
  if (!want || is_vector_core(took)) return "OpenBLAS core " + took + " (its own pick)";
  ::setenv("OPENBLAS_CORETYPE", want, 0);
  quit();  // OpenBLAS forgets its kernel table (no BLAS call has run yet) ...
  init();  // ... and picks again, reading OPENBLAS_CORETYPE
  const std::string now = blas_core_name();
  if (now != want) {  // this OpenBLAS has no such core: back to its own pick
    ::unsetenv("OPENBLAS_CORETYPE");
    quit();
    init();
    return "OpenBLAS core " + blas_core_name() + " (its own pick; it has no " + want + " kernels)";
  }
  return "OpenBLAS core " + now + " (kiln's pick: OpenBLAS took " + took + ", its baseline, on a CPU with " +
         (std::strcmp(want, "Haswell") == 0 ? "AVX2" : "AVX-512") + ")";
}

}  // namespace kiln::kernels::cpu
