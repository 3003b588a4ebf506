// Batched matrix product kernel: out[b] = op(a[b]) · op(b[b]) where op transposes when asked.
// a is [batch, m, k] (or [batch, k, m] when trans_a), b is [batch, k, n] (or [batch, n, k]),
// all contiguous; out [batch, m, n] contiguous. f16/bf16 accumulate in f32 (CPU: converted to
// f32 for kiln's AVX-512 or AVX2 kernel or OpenBLAS; CUDA: cuBLASLt with f32 compute). A batch stride of 0
// broadcasts.
#pragma once
#include <cstdint>
#include "kiln/core/tensor.h"

namespace kiln::kernels {

struct GemmArgs {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int64_t batch_stride_a = 0, batch_stride_b = 0;  // elements; 0 broadcasts
  double beta = 0.0;  // out = a·b + beta·out
};

namespace cpu {
void gemm(const GemmArgs& args, const Tensor& out, const Tensor& a, const Tensor& b);
// gemm on the BLAS (never kiln's own f32 kernel, kernels/cpu/sgemm.h) with a large product always
// split into row or column blocks over kiln's OpenMP threads (gemm takes this path itself only
// where the BLAS runs each call on one thread: blas_threads.h). For the tests, which cannot choose
// the BLAS the machine installed.
void gemm_split_over_threads(const GemmArgs& args, const Tensor& out, const Tensor& a, const Tensor& b);
}
namespace cuda {
void gemm(const GemmArgs& args, const Tensor& out, const Tensor& a, const Tensor& b);
}

}  // namespace kiln::kernels
