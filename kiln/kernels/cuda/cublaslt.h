// The one cuBLASLt GEMM planner of the CUDA backend (matmul.cu, lce.cu, the kiln GEMM's
// reference path): RAII owners of the descriptors, the dtype → CUDA type map, a checked
// strided-batch matrix layout, the alignment hint of a pointer, and plans — a matmul
// descriptor, its layouts and the heuristic's algorithm — made once per (device, shape, layout,
// dtypes, alignments, epilogue, workspace, SM target, determinism) and cached for the process
// (bodies in gemm/cublaslt_plan.cpp).
//
// NOTE [cuBLASLt determinism rule]
// cuBLASLt's split-K reduction schemes (cublasLtReductionScheme_t): INPLACE reduces in the
// output with counters in the workspace; COMPUTE_TYPE / OUTPUT_TYPE keep partials in the
// workspace and reduce them in a separate step. Under kiln::deterministic() a plan allows no
// split-K reduction at all (mask NONE): the product is then one pass per output tile, whose
// summation order is fixed by the algorithm alone, and the algorithm is fixed by the plan key.
// Outside determinism every scheme is allowed except OUTPUT_TYPE for outputs narrower than f32
// (it rounds each partial to 16 bits, which breaks f32 accumulation).
// Errors name the calling op (`op`) and the cuBLASLt step that failed.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "kiln/core/dtype.h"
#include "kiln/core/error.h"

namespace kiln::kernels::cuda {
struct DeviceContext;
}

namespace kiln::kernels::cuda::lt {

inline void check(cublasStatus_t s, const char* op, const char* what) {
  KILN_CHECK(s == CUBLAS_STATUS_SUCCESS, op, ": cuBLASLt error in ", what, ": status ", static_cast<int>(s));
}

struct Deleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* d) const { cublasLtMatrixLayoutDestroy(d); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* d) const { cublasLtMatmulPreferenceDestroy(d); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, Deleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, Deleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, Deleter>;

// The CUDA type of a kiln dtype (f64, f32, f16, bf16; anything else is an error naming `op`).
cudaDataType_t cuda_type(DType t, const char* op);
// The compute and scale types of products of `t`: f64 in f64, everything else in f32 (no TF32).
struct ComputeTypes {
  cublasComputeType_t compute;
  cudaDataType_t scale;
};
ComputeTypes compute_types(DType t);

// A column-major rows×cols matrix with leading dimension ld, `batch` of them `stride` apart.
Layout make_layout(const char* op, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch = 1,
                   int64_t stride = 0);

// The largest power of two (≤ 256) dividing the address and `step_bytes` (a batch stride or
// the step between chunks), i.e. the alignment every pointer p + k·step has.
inline uint32_t alignment_of(const void* p, int64_t step_bytes = 0) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(step_bytes) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// One product in cuBLASLt's column-major terms: D[m×n] (`batch` of them, strides in elements)
// = alpha·op(A)·op(B) (+ bias[m] per column of D with epilogue BIAS) + beta·D. The alignments
// are those every pointer later run with this plan has. Every field is part of the plan key.
struct PlanKey {
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  cudaDataType_t at = CUDA_R_32F, bt = CUDA_R_32F, ct = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  int64_t lda = 0, ldb = 0, ldc = 0;
  uint32_t align_a = 256, align_b = 256, align_c = 256;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;  // DEFAULT or BIAS (bias of type ct)
  int32_t sm_target = 0;      // > 0: CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET (a concurrent GEMM has the rest)
  bool no_workspace = false;  // runs beside another GEMM: no share of the context's workspace
  bool deterministic = false;  // filled in by plan() from kiln::deterministic()
  bool operator==(const PlanKey&) const = default;
};

struct Plan {
  PlanKey key;
  MatmulDesc op;
  Layout a, b, c;
  cublasLtMatmulHeuristicResult_t heur{};
  mutable std::mutex bias_mu;  // the bias pointer is set on `op` per run
};

// The cached plan of `key` on ctx's device (made on first use; a cuBLASLt failure or no
// algorithm is an error naming `op`). Thread-safe; plans live as long as the process.
const Plan& plan(DeviceContext& ctx, PlanKey key, const char* op);

// Runs a plan: alpha and beta point to host scalars of key.scale's type; bias (epilogue BIAS)
// is a device vector of m elements of key.ct. On `stream` (nullptr: the device's current stream).
void run(DeviceContext& ctx, const Plan& p, const void* alpha, const void* A, const void* B, const void* beta, void* C,
         const char* op, cudaStream_t stream = nullptr, const void* bias = nullptr);
// The same with f32 scalars (key.scale == CUDA_R_32F).
void run_f32(DeviceContext& ctx, const Plan& p, float alpha, const void* A, const void* B, float beta, void* C,
             const char* op, cudaStream_t stream = nullptr, const void* bias = nullptr);

// "id=.. tile=.. stages=.. splitk=.. red=.. swizzle=.. cluster=.. waves=.." of a plan's algorithm.
std::string describe(const Plan& p);

}  // namespace kiln::kernels::cuda::lt
