// Shared cuBLASLt plumbing for the CUDA GEMM callers (matmul.cu, lce.cu): RAII owners of the
// descriptors, a checked strided-batch matrix layout, and the alignment hint of a pointer.
// Errors name the calling op (`op`) and the cuBLASLt step that failed.
#pragma once
#include <cublasLt.h>

#include <cstdint>
#include <memory>

#include "kiln/core/error.h"

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

// A column-major rows×cols matrix with leading dimension ld, `batch` of them `stride` apart.
inline Layout make_layout(const char* op, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                          int64_t batch = 1, int64_t stride = 0) {
  cublasLtMatrixLayout_t l = nullptr;
  check(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld), op,
        "cublasLtMatrixLayoutCreate");
  Layout out(l);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)), op,
          "batch count");
    check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
          op, "batch stride");
  }
  return out;
}

// The largest power of two (≤ 256) dividing the address and `step_bytes` (a batch stride or
// the step between chunks), i.e. the alignment every pointer p + k·step has.
inline uint32_t alignment_of(const void* p, int64_t step_bytes = 0) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(step_bytes) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

}  // namespace kiln::kernels::cuda::lt
