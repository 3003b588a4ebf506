// kiln's Hopper GEMM for bf16 inputs (sm90_launch.cuh's four layouts).
#include "kiln/kernels/cuda/gemm/sm90_launch.cuh"

namespace kiln::kernels::cuda::gemm_sm90 {
bool launch_bf16(const Launch& l) { return launch_impl<__nv_bfloat16>(l, true); }
}  // namespace kiln::kernels::cuda::gemm_sm90
