// kiln's Hopper GEMM for f16 inputs (sm90_launch.cuh's four layouts).
#include "kiln/kernels/cuda/gemm/sm90_launch.cuh"

namespace kiln::kernels::cuda::gemm_sm90 {
bool launch_f16(const Launch& l) { return launch_impl<__half>(l, false); }
}  // namespace kiln::kernels::cuda::gemm_sm90
