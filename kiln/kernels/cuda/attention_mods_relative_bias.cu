// The CUDA FlexAttention kernels (attention_kernels.cuh) for the learnable relative-position bias
// (with its table's gradient) with no mask and with the causal mask.
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE(attention::RelativePositionBias, attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE(attention::RelativePositionBias, attention::Causal)

}  // namespace kiln::kernels::cuda

KILN_FLEX_CUDA_FILE(mods_relative_bias)
