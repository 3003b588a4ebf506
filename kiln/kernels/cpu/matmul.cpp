// CPU gemm through OpenBLAS (cblas_sgemm/dgemm); 16-bit inputs go through f32 copies. Where
// the BLAS runs each call on one thread (blas_threads.h) and kiln has more, a large product is
// split into row (or column) blocks over kiln's OpenMP threads, one BLAS call a block: each
// output element is still one call's dot product over all of K.
#include <cblas.h>

#include <algorithm>

#include "kiln/core/error.h"
#include "kiln/kernels/blas_threads.h"
#include "kiln/kernels/cpu/loops.h"
#include "kiln/kernels/copy.h"
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

template <class T>
void gemm_blas(const GemmArgs& g, T* out, const T* a, const T* b, bool split) {
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

void gemm_dispatch(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b, bool split) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  // The BLAS takes int sizes: past 2^31 − 1 a cast wrapped (OpenBLAS refused on stderr and left
  // zeros; 2^32 + 1 rows would have computed one).
  constexpr int64_t kIntMax = 2147483647;
  KILN_CHECK(g.m <= kIntMax && g.n <= kIntMax && g.k <= kIntMax, "matmul (CPU): a product of [", g.m, ", ", g.k,
             "] by [", g.k, ", ", g.n, "] has a dimension past 2^31 - 1, the BLAS's limit; split it");
  if (g.k == 0) {
    if (g.beta == 0.0) fill(out, 0.0);
    return;
  }
  switch (a.dtype()) {
    case DType::f32: gemm_blas(g, out.data<float>(), a.data<float>(), b.data<float>(), split); break;
    case DType::f64: gemm_blas(g, out.data<double>(), a.data<double>(), b.data<double>(), split); break;
    case DType::f16:
    case DType::bf16: {
      Tensor o32 = as_f32(out);
      gemm_blas(g, o32.data<float>(), as_f32(a).data<float>(), as_f32(b).data<float>(), split);
      copy(out, o32);
      break;
    }
    default: fail("matmul: dtype ", dtype_name(a.dtype()), " is not supported (expected f64, f32, f16 or bf16)");
  }
}
}  // namespace

void gemm(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b) {
  gemm_dispatch(g, out, a, b, g.m * g.n * g.k >= kSplitFlops && blas_runs_one_thread());
}

void gemm_split_over_threads(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b) {
  gemm_dispatch(g, out, a, b, true);
}

}  // namespace kiln::kernels::cpu
