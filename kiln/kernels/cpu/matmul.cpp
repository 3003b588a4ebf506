// CPU gemm through OpenBLAS (cblas_sgemm/dgemm); 16-bit inputs go through f32 copies.
#include <cblas.h>

#include "kiln/core/error.h"
#include "kiln/kernels/cpu/loops.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/matmul.h"

namespace kiln::kernels::cpu {

namespace {
template <class T>
void gemm_blas(const GemmArgs& g, T* out, const T* a, const T* b) {
  const int64_t lda = g.trans_a ? g.m : g.k;
  const int64_t ldb = g.trans_b ? g.k : g.n;
  for (int64_t i = 0; i < g.batch; ++i) {
    const T* ai = a + i * g.batch_stride_a;
    const T* bi = b + i * g.batch_stride_b;
    T* oi = out + i * g.m * g.n;
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), 1.0f, ai, static_cast<int>(lda),
                  bi, static_cast<int>(ldb), static_cast<float>(g.beta), oi, static_cast<int>(g.n));
    else
      cblas_dgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), 1.0, ai, static_cast<int>(lda),
                  bi, static_cast<int>(ldb), g.beta, oi, static_cast<int>(g.n));
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
}  // namespace

void gemm(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b) {
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
    case DType::f32: gemm_blas(g, out.data<float>(), a.data<float>(), b.data<float>()); break;
    case DType::f64: gemm_blas(g, out.data<double>(), a.data<double>(), b.data<double>()); break;
    case DType::f16:
    case DType::bf16: {
      Tensor o32 = as_f32(out);
      gemm_blas(g, o32.data<float>(), as_f32(a).data<float>(), as_f32(b).data<float>());
      copy(out, o32);
      break;
    }
    default: fail("matmul: dtype ", dtype_name(a.dtype()), " is not supported (expected f64, f32, f16 or bf16)");
  }
}

}  // namespace kiln::kernels::cpu
