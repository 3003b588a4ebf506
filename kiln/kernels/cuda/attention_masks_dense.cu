// The CUDA FlexAttention kernels (attention_kernels.cuh) without a score_mod for no mask and the
// causal mask, and the GPU BlockMask builder for both. The library's other combinations are in
// the sibling attention_masks_*.cu and attention_mods_*.cu files.
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE_MASK(attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE_MASK(attention::Causal)

}  // namespace kiln::kernels::cuda

KILN_FLEX_CUDA_FILE(masks_dense)
