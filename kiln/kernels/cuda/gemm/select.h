// The matmul op's way into kiln's GEMM (gemm.h): matmul.cu asks first, and runs cuBLASLt
// itself when the answer is no. CUDA builds only.
#pragma once
#include "kiln/core/tensor.h"
#include "kiln/kernels/matmul.h"

namespace kiln::kernels::gemm {

// Runs out = op(a)·op(b) through gemm() and returns true when the default backend
// (default_backend(): KILN_GEMM_BACKEND or set_default_backend) is kiln or auto, the dtype is
// bf16 or f16, beta is 0, K > 0, and kiln's kernel applies; otherwise returns false and does
// nothing (auto may still pick cuBLASLt inside gemm()). KILN_GEMM_VERBOSE=1 says why kiln's
// kernel did not apply when kiln was asked for.
bool kiln_gemm_for_matmul(const GemmArgs& g, const Tensor& out, const Tensor& a, const Tensor& b);

}  // namespace kiln::kernels::gemm
