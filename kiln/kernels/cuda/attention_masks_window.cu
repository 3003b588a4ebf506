// The CUDA FlexAttention kernels (attention_kernels.cuh) without a score_mod for the sliding-window
// and prefix-LM masks, and the GPU BlockMask builder for both.
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE_MASK(attention::SlidingWindow)
KILN_FLEX_CUDA_INSTANTIATE_MASK(attention::PrefixLM)

}  // namespace kiln::kernels::cuda

KILN_FLEX_CUDA_FILE(masks_window)
