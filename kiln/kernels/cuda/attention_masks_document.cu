// The CUDA FlexAttention kernels (attention_kernels.cuh) without a score_mod for packed documents
// (causal within each), and the GPU BlockMask builder for that mask.
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE_MASK(attention::DocumentCausal)

}  // namespace kiln::kernels::cuda

KILN_FLEX_CUDA_FILE(masks_document)
