// The CUDA FlexAttention kernels (attention_kernels.cuh) for the soft-capping score_mod with no
// mask and with the causal mask.
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE(attention::Softcap, attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE(attention::Softcap, attention::Causal)

}  // namespace kiln::kernels::cuda

KILN_FLEX_CUDA_FILE(mods_softcap)
