// CPU gemm: f32 products on kiln's own AVX-512 or AVX2 kernel where the CPU has one (kernels/cpu/sgemm.h;
// KILN_CPU_GEMM=blas keeps them on the BLAS), the rest through OpenBLAS (cblas_sgemm/dgemm);
// 16-bit inputs go through f32 copies. Where the BLAS runs each call on one thread
// (blas_threads.h) and kiln has more, a large product is split into row (or column) blocks over
// kiln's OpenMP threads, one BLAS call a block: each output element is still one call's dot
// product over all of K.
#include <cblas.h>

#include <algorithm>

#include "kiln/core/env.h"
#include "kiln/core/error.h"
#include "kiln/kernels/blas_threads.h"
#include "kiln/kernels/cpu/loops.h"
#include "kiln/kernels/cpu/sgemm.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/elementwise.h"
#include "kiln/kernels/matmul.h"

namespace kiln::kernels::cpu {

namespace {
// Row-major out[m, n] (leading dim ldo) = op(a)[m, k] · op(b)[k, n] + beta · out, one BLAS call.
template <class T>
void blas_call(const GemmArgs& g, int64_t m, int64_t n, T* out, int64_t ldo, const T* a, int64_t lda, const T* b,
               int64_t ldb) {
  const auto ta = g.trans_a ? CblasTrans : CblasNoTrans, tb = g.trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(g.k), 1.0f, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), static_cast<float>(g.beta), out, static_cast<int>(ldo));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(g.k), 1.0, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), g.beta, out, static_cast<int>(ldo));
}

constexpr int64_t kSplitFlops = int64_t{1} << 22;  // products below this stay one call
constexpr int64_t kSplitMinRows = 16;             // the smallest block (rows or columns) a thread takes
// The shapes kiln's kernel takes: those where it was measured faster than OpenBLAS 0.3.21
// (BENCHMARKS.md, "kiln's CPU GEMM": the small preset's products, 1.2-1.9 x). Below 2^18
// multiply-adds the BLAS starts faster (67 x 45 x 33: 1.1 us against 1.9); past 384 columns or a
// K of 1024 it lost (1024 x 4096 x 512: 0.73-0.85 x; its tile streams b from L2, and a row-major b
// read in place aliases in L1 when its rows are a multiple of 4 KiB apart); a transposed b under
// 128 rows of a costs more to pack than it gains (8-64 x 4096 x 512: 0.62-0.73 x).
constexpr int64_t kOwnSgemmMinMacs = int64_t{1} << 18;
constexpr int64_t kOwnSgemmMaxN = 384, kOwnSgemmMaxK = 1024, kOwnSgemmMinRowsPacked = 128;

}  // namespace

bool own_sgemm_chosen() {
  static const bool chosen = [] {
    const std::string v = env_string("KILN_CPU_GEMM").value_or("auto");
    KILN_CHECK(v == "auto" || v == "kiln" || v == "blas", "KILN_CPU_GEMM='", v,
               "' is not one of: auto, kiln, blas");
    KILN_CHECK(v != "kiln" || own_sgemm_supported(),
               "KILN_CPU_GEMM=kiln: kiln's own f32 product needs an x86-64 CPU with AVX-512F or AVX2 and FMA; this "
               "one has neither");
    return v != "blas" && own_sgemm_supported();
  }();
  return chosen;
}

bool own_sgemm_takes(int64_t m, int64_t n, int64_t k, bool trans_b) {
  // The choice first, so that a bad KILN_CPU_GEMM fails at the first f32 product, whatever its shape.
  return own_sgemm_chosen() && m * n * k >= kOwnSgemmMinMacs && n <= kOwnSgemmMaxN && k <= kOwnSgemmMaxK &&
         (!trans_b || m >= kOwnSgemmMinRowsPacked);
}

void sgemm(const SgemmProblem& p) {
  if (p.m == 0 || p.n == 0) return;
  if (p.k > 0 && own_sgemm_takes(p.m, p.n, p.k, p.trans_b)) return own_sgemm(p);
  cblas_sgemm(CblasRowMajor, p.trans_a ? CblasTrans : CblasNoTrans, p.trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1.0f, p.a, static_cast<int>(p.lda),
              p.b, static_cast<int>(p.ldb), p.beta, p.c, static_cast<int>(p.ldc));
}

namespace {

// The f32 product of every batch entry on kiln's kernel, when it takes this shape.
bool own_sgemm_batch(const GemmArgs& g, float* out, const float* a, const float* b) {
  if (!own_sgemm_takes(g.m, g.n, g.k, g.trans_b)) return false;
  SgemmProblem p;
  p.m = g.m, p.n = g.n, p.k = g.k, p.trans_a = g.trans_a, p.trans_b = g.trans_b;
  p.lda = g.trans_a ? g.m : g.k, p.ldb = g.trans_b ? g.k : g.n, p.ldc = g.n;
  p.beta = static_cast<float>(g.beta);
  for (int64_t i = 0; i < g.batch; ++i) {
    p.a = a + i * g.batch_stride_a, p.b = b + i * g.batch_stride_b, p.c = out + i * g.m * g.n;
    own_sgemm(p);
  }
  return true;
}

template <class T>
void gemm_typed(const GemmArgs& g, T* out, const T* a, const T* b, bool split, bool own_allowed) {
  if constexpr (std::is_same_v<T, float>)
    if (own_allowed && own_sgemm_batch(g, out, a, b)) return;
  const int64_t lda = g.trans_a ? g.m : g.k;
  const int64_t ldb = g.trans_b ? g.k : g.n;
  for (int64_t i = 0; i < g.batch; ++i) {
    const T* ai = a + i * g.batch_stride_a;
    const T* bi = b + i * g.batch_stride_b;
    T* oi = out + i * g.m * g.n;
    if (!split) {
      blas_call(g, g.m, g.n, oi, g.n, ai, lda, bi, ldb);
    } else if (g.m >= g.n || g.n < 2 * kSplitMinRows) {
      // Rows [r0, r1) of out: rows of a (or its columns, transposed).
      parallel_for(g.m, kSplitMinRows, [&](int64_t r0, int64_t r1) {
        blas_call(g, r1 - r0, g.n, oi + r0 * g.n, g.n, ai + (g.trans_a ? r0 : r0 * lda), lda, bi, ldb);
      });
    } else {
      // Columns [c0, c1) of out: columns of b (or its rows, transposed).
      parallel_for(g.n, kSplitMinRows, [&](int64_t c0, int64_t c1) {
        blas_call(g, g.m, c1 - c0, oi + c0, g.n, ai, lda, bi + (g.trans_b ? c0 * ldb : c0), ldb);
      });
    }
  }
}

// An f32 copy with the same memory layout as `t` (gemm operands may be a transposed
// contiguous matrix: a plain contiguous copy would silently transpose them).
Tensor as_f32(const Tensor& t) {
  Tensor f = Tensor::empty(t.shape(), DType::f32, t.device());
  if (!t.is_contiguous()) {
    Tensor base = Tensor::empty({t.numel()}, DType::f32, t.device());
    f = Tensor::from_storage(base.storage(), t.shape(), t.strides(), 0, DType::f32);
  }
  copy(f, t);
  return f;
}

void gemm_dispatch(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b, bool split, bool own_allowed) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  // The BLAS takes int sizes: past 2^31 − 1 a cast wrapped (OpenBLAS refused on stderr and left
  // zeros; 2^32 + 1 rows would have computed one).
  constexpr int64_t kIntMax = 2147483647;
  KILN_CHECK(g.m <= kIntMax && g.n <= kIntMax && g.k <= kIntMax, "matmul (CPU): a product of [", g.m, ", ", g.k,
             "] by [", g.k, ", ", g.n, "] has a dimension past 2^31 - 1, the BLAS's limit; split it");
  if (g.k == 0) {  // out = beta · out (out is not read when beta is 0)
    if (g.beta == 0.0)
      fill(out, 0.0);
    else if (g.beta != 1.0)
      unary(UnaryOp::mul_scalar, out, out, g.beta);
    return;
  }
  switch (a.dtype()) {
    case DType::f32: gemm_typed(g, out.data<float>(), a.data<float>(), b.data<float>(), split, own_allowed); break;
    case DType::f64: gemm_typed(g, out.data<double>(), a.data<double>(), b.data<double>(), split, own_allowed); break;
    case DType::f16:
    case DType::bf16: {
      Tensor o32 = as_f32(out);
      gemm_typed(g, o32.data<float>(), as_f32(a).data<float>(), as_f32(b).data<float>(), split, own_allowed);
      copy(out, o32);
      break;
    }
    default: fail("matmul: dtype ", dtype_name(a.dtype()), " is not supported (expected f64, f32, f16 or bf16)");
  }
}
}  // namespace

void gemm(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b) {
  gemm_dispatch(g, out, a, b, g.m * g.n * g.k >= kSplitFlops && blas_runs_one_thread(), true);
}

void gemm_split_over_threads(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b) {
  gemm_dispatch(g, out, a, b, true, false);
}

}  // namespace kiln::kernels::cpu
