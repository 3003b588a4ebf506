// CUDA gemm through cuBLASLt. kiln's matrices are row-major; cuBLASLt's are column-major, and a
// row-major [r, c] matrix is the column-major [c, r] matrix of its transpose, so
// out = op(a)·op(b) is computed as outᵀ = op(b)ᵀ·op(a)ᵀ with the operands swapped.
// f32 computes in f32 (CUBLAS_COMPUTE_32F: no TF32), f16/bf16 in f32, f64 in f64. Batches are
// strided (a batch stride of 0 broadcasts an operand). Alignment hints are taken from the
// actual pointers and strides so that views at any offset are handled. Plans come from the one
// cuBLASLt planner (cublaslt.h); 16-bit products go to kiln's own GEMM instead where the
// backend selection picks it (gemm/select.h, KILN_GEMM_BACKEND).

#include "kiln/kernels/copy.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/cublaslt.h"
#include "kiln/kernels/cuda/gemm/select.h"
#include "kiln/kernels/matmul.h"

namespace kiln::kernels::cuda {

void gemm(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b) {
  KILN_CHECK(out.is_cuda() && a.device() == out.device() && b.device() == out.device(),
             "matmul: operands on ", a.device().str(), ", ", b.device().str(), " and ", out.device().str());
  KILN_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), "matmul: dtypes ", dtype_name(a.dtype()), ", ",
             dtype_name(b.dtype()), " and ", dtype_name(out.dtype()), " differ");
  KILN_CHECK(g.batch <= INT32_MAX, "matmul: batch ", g.batch, " too large for cuBLASLt");
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  if (g.k == 0) {
    if (g.beta == 0.0) fill(out, 0.0);
    else if (g.beta != 1.0) fail("matmul: k == 0 with beta ", g.beta, " is not supported");
    return;
  }
  DeviceContext& ctx = context(out.device().index);
  if (gemm::kiln_gemm_for_matmul(g, out, a, b)) return;
  const cudaDataType_t type = lt::cuda_type(a.dtype(), "matmul");
  const lt::ComputeTypes ct = lt::compute_types(a.dtype());
  const int64_t es = static_cast<int64_t>(itemsize(a.dtype()));
  const void* pa = b.data_ptr();  // cuBLASLt's A
  const void* pb = a.data_ptr();  // cuBLASLt's B
  void* pc = out.data_ptr();

  // cuBLASLt's A is our b, its B is our a; its m×n output is our n×m (ldc = n).
  lt::PlanKey key;
  key.ta = g.trans_b, key.tb = g.trans_a;
  key.m = g.n, key.n = g.m, key.k = g.k;
  key.at = key.bt = key.ct = type;
  key.compute = ct.compute, key.scale = ct.scale;
  key.lda = g.trans_b ? g.k : g.n, key.ldb = g.trans_a ? g.m : g.k, key.ldc = g.n;
  key.batch = g.batch, key.stride_a = g.batch_stride_b, key.stride_b = g.batch_stride_a, key.stride_c = g.m * g.n;
  if (g.batch == 1) key.stride_a = key.stride_b = key.stride_c = 0;
  key.align_a = lt::alignment_of(pa, g.batch > 1 ? g.batch_stride_b * es : 0);
  key.align_b = lt::alignment_of(pb, g.batch > 1 ? g.batch_stride_a * es : 0);
  key.align_c = lt::alignment_of(pc, g.batch > 1 ? g.m * g.n * es : 0);
  const lt::Plan& plan = lt::plan(ctx, key, "matmul");

  const double alpha_d = 1.0, beta_d = g.beta;
  const float alpha_f = 1.0f, beta_f = static_cast<float>(g.beta);
  const bool f64 = ct.scale == CUDA_R_64F;
  lt::run(ctx, plan, f64 ? static_cast<const void*>(&alpha_d) : &alpha_f, pa, pb,
          f64 ? static_cast<const void*>(&beta_d) : &beta_f, pc, "matmul");
}

}  // namespace kiln::kernels::cuda
