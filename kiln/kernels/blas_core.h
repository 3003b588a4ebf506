// Which kernels a DYNAMIC_ARCH OpenBLAS runs: its own pick, or a better one where it fell back.
// An OpenBLAS older than the CPU does not know the CPU's model and falls back to its baseline
// kernels (Prescott: SSE3) even where the CPU has AVX2 or AVX-512 (Debian 12's 0.3.21 on a 2-core
// Xeon VM, CPU model 207: the small preset's GEMMs 73 % of a step, the step at 0.35 x PyTorch's;
// BENCHMARKS.md). OPENBLAS_CORETYPE fixes it, but OpenBLAS reads it while it loads, before main.
#pragma once
#include <string>

namespace kiln::kernels::cpu {

// Where the OpenBLAS in use (found through its symbols, dlsym) is a DYNAMIC_ARCH build that took
// a core without AVX2 kernels (Prescott, Core2, Nehalem, Sandybridge and the like) on a CPU with
// AVX2 + FMA, and OPENBLAS_CORETYPE is not set: sets OPENBLAS_CORETYPE (SkylakeX where the CPU
// runs x86-64-v4, else Haswell; inherited by the processes kiln starts) and has OpenBLAS choose
// again (gotoblas_dynamic_quit, gotoblas_dynamic_init). Otherwise leaves OpenBLAS as it is.
// Returns what it found and did, in words (for a caller's log; the tests read it). Call once from
// the main thread before the first BLAS call and before any other thread runs (main does);
// KILN_BLAS_CORE=keep leaves OpenBLAS's own pick.
std::string own_blas_core();

// The OpenBLAS core in use ("SkylakeX"), or "" for another BLAS.
std::string blas_core_name();

}  // namespace kiln::kernels::cpu
