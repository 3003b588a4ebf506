// kiln's own f32 matrix product for x86-64 CPUs with AVX-512 or AVX2 + FMA (kernels/cpu/sgemm.cpp,
// its tiles in sgemm_avx512.cpp and sgemm_avx2.cpp), used by the CPU gemm (kernels/cpu/matmul.cpp)
// in place of the BLAS where it was measured faster: at the small preset's shapes (1024 rows,
// 64-352 columns, K 64-1024) Debian's OpenBLAS 0.3.21 reaches 170-300 GFLOP/s on two AVX-512 cores,
// this kernel 310-395, MKL ~410 (BENCHMARKS.md, "kiln's CPU GEMM"). Larger shapes stay on the BLAS
// (own_sgemm_takes).
//
// Goto's scheme: op(b) is packed once per K block into panels of the tile's width (zero-padded; a
// transposed b always, a row-major one by the AVX2 set, which the AVX-512 set reads in place), and
// a register tile of c (14 x 32 on AVX-512, 6 x 16 on AVX2) is formed from broadcasts of op(a): a
// row-major a read where it lies (a row stream per tile row), a transposed one copied a tile's rows
// at a time into one contiguous run. Deterministic: each element of c is one chain of FMAs over a
// K block (at most 256) in order, the blocks added in order; the split over threads (row panels;
// for a weight gradient, transposed a and row-major b, whole K blocks whose parts are added in
// block order afterwards) changes no bits, so results do not depend on OMP_NUM_THREADS, nor on
// which of the two instruction sets ran (kernels/cpu/sgemm_kernels.h).
#pragma once
#include <cstdint>

namespace kiln::kernels::cpu {

// Row-major c[m, n] (leading dim ldc) = op(a)[m, k] · op(b)[k, n] + beta · c. op(a) is a[m, k]
// (lda ≥ k) or, transposed, a[k, m] (lda ≥ m); op(b) likewise. beta == 0 never reads c.
struct SgemmProblem {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  const float* a = nullptr;
  int64_t lda = 0;
  const float* b = nullptr;
  int64_t ldb = 0;
  float* c = nullptr;
  int64_t ldc = 0;
  float beta = 0.0f;
};

// The instruction set of kiln's product: the best this CPU runs (AVX-512F, else AVX2 with FMA), or
// one named (tests and bench_cpu_gemm compare them).
enum class SgemmIsa { best, avx512, avx2 };

// Whether this build and CPU run kiln's product (x86-64 with AVX-512F, or AVX2 and FMA), or the
// named set of it; elsewhere the BLAS does.
bool own_sgemm_supported(SgemmIsa isa = SgemmIsa::best);
// The name of the set `isa` runs here ("AVX-512", "AVX2"), or "none" where this CPU has no such set.
const char* own_sgemm_isa_name(SgemmIsa isa = SgemmIsa::best);

// The product over kiln's OpenMP threads (one when called inside a parallel region). Requires
// own_sgemm_supported(isa); k ≥ 1.
void own_sgemm(const SgemmProblem& p, SgemmIsa isa = SgemmIsa::best);

// Whether f32 products run on kiln's kernel: KILN_CPU_GEMM=auto (the default: where
// own_sgemm_supported()), kiln (the same, an error where it cannot) or blas; read once. An
// unknown value is an error naming it.
bool own_sgemm_chosen();
// own_sgemm_chosen() and a shape where kiln's kernel was measured faster than the BLAS: m · n · k
// ≥ 2^18 multiply-adds, n ≤ 384, k ≤ 1024, and m ≥ 128 when b is transposed (kernels/cpu/matmul.cpp).
bool own_sgemm_takes(int64_t m, int64_t n, int64_t k, bool trans_b);

// The product on kiln's kernel where own_sgemm_takes() it, else one cblas_sgemm call
// (kernels/cpu/matmul.cpp). k = 0 sets c = beta · c.
void sgemm(const SgemmProblem& p);

}  // namespace kiln::kernels::cpu
