// CUDA gemm through cuBLASLt. kiln's matrices are row-major; cuBLASLt's are column-major, and a
// row-major [r, c] matrix is the column-major [c, r] matrix of its transpose, so
// out = op(a)·op(b) is computed as outᵀ = op(b)ᵀ·op(a)ᵀ with the operands swapped.
// f32 computes in f32 (CUBLAS_COMPUTE_32F: no TF32), f16/bf16 in f32, f64 in f64. Batches are
// strided (a batch stride of 0 broadcasts an operand). Alignment hints are taken from the
// actual pointers and strides so that views at any offset are handled.
#include <memory>

#include "kiln/kernels/copy.h"
#include "kiln/kernels/cuda/context.h"
#include "kiln/kernels/cuda/cublaslt.h"
#include "kiln/kernels/matmul.h"

namespace kiln::kernels::cuda {

namespace {

void check_lt(cublasStatus_t s, const char* what) { lt::check(s, "matmul", what); }
using lt::alignment_of;
using lt::Layout;
using lt::MatmulDesc;
using lt::Preference;
Layout make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  return lt::make_layout("matmul", type, rows, cols, ld, batch, stride);
}

}  // namespace

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
  cudaDataType_t type;
  cublasComputeType_t compute;
  cudaDataType_t scale;
  switch (a.dtype()) {
    case DType::f32: type = CUDA_R_32F; compute = CUBLAS_COMPUTE_32F; scale = CUDA_R_32F; break;
    case DType::f64: type = CUDA_R_64F; compute = CUBLAS_COMPUTE_64F; scale = CUDA_R_64F; break;
    case DType::f16: type = CUDA_R_16F; compute = CUBLAS_COMPUTE_32F; scale = CUDA_R_32F; break;
    case DType::bf16: type = CUDA_R_16BF; compute = CUBLAS_COMPUTE_32F; scale = CUDA_R_32F; break;
    default: fail("matmul: dtype ", dtype_name(a.dtype()), " is not supported (expected f64, f32, f16 or bf16)");
  }
  DeviceContext& ctx = context(out.device().index);
  const int64_t es = static_cast<int64_t>(itemsize(a.dtype()));

  // cuBLASLt's A is our b, its B is our a; its m×n output is our n×m (ldc = n).
  cublasOperation_t op_lt_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_lt_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  Layout la = g.trans_b ? make_layout(type, g.k, g.n, g.k, g.batch, g.batch_stride_b)
                        : make_layout(type, g.n, g.k, g.n, g.batch, g.batch_stride_b);
  Layout lb = g.trans_a ? make_layout(type, g.m, g.k, g.m, g.batch, g.batch_stride_a)
                        : make_layout(type, g.k, g.m, g.k, g.batch, g.batch_stride_a);
  Layout lc = make_layout(type, g.n, g.m, g.n, g.batch, g.m * g.n);

  cublasLtMatmulDesc_t d = nullptr;
  check_lt(cublasLtMatmulDescCreate(&d, compute, scale), "cublasLtMatmulDescCreate");
  MatmulDesc desc(d);
  check_lt(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a, sizeof(op_lt_a)), "transa");
  check_lt(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b, sizeof(op_lt_b)), "transb");

  const void* pa = b.data_ptr();  // cuBLASLt's A
  const void* pb = a.data_ptr();  // cuBLASLt's B
  void* pc = out.data_ptr();
  cublasLtMatmulPreference_t p = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&p), "cublasLtMatmulPreferenceCreate");
  Preference pref(p);
  uint64_t ws = ctx.workspace_bytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
           "workspace preference");
  uint32_t align_a = alignment_of(pa, g.batch > 1 ? g.batch_stride_b * es : 0);
  uint32_t align_b = alignment_of(pb, g.batch > 1 ? g.batch_stride_a * es : 0);
  uint32_t align_c = alignment_of(pc, g.batch > 1 ? g.m * g.n * es : 0);
  check_lt(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)), "alignment A");
  check_lt(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)), "alignment B");
  check_lt(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)), "alignment C");
  check_lt(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)), "alignment D");

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt, d, la.get(), lb.get(), lc.get(), lc.get(), p, 1, &heuristic, &found),
           "cublasLtMatmulAlgoGetHeuristic");
  KILN_CHECK(found > 0, "matmul: cuBLASLt found no algorithm for ", dtype_name(a.dtype()), " m=", g.m, " n=", g.n,
             " k=", g.k, " batch=", g.batch);

  const double alpha_d = 1.0, beta_d = g.beta;
  const float alpha_f = 1.0f, beta_f = static_cast<float>(g.beta);
  const void* alpha = scale == CUDA_R_64F ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = scale == CUDA_R_64F ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  check_lt(cublasLtMatmul(ctx.cublaslt, d, alpha, pa, la.get(), pb, lb.get(), beta, pc, lc.get(), pc, lc.get(),
                          &heuristic.algo, ctx.workspace, ctx.workspace_bytes, ctx.stream),
           "cublasLtMatmul");
}

}  // namespace kiln::kernels::cuda
