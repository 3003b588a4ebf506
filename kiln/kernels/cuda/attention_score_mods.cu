// Explicit instantiations of the CUDA FlexAttention bodies (attention_kernels.cuh) for the
// library's score mods (ALiBi, soft-capping, the learnable relative-position bias) with no mask
// and with the causal mask. Other combinations: instantiate them the same way in a .cu file of
// your own and specialise kernels::has_cuda_flex (docs/attention.md, "Your own mods on CUDA").
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE(attention::Alibi, attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE(attention::Alibi, attention::Causal)
KILN_FLEX_CUDA_INSTANTIATE(attention::Softcap, attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE(attention::Softcap, attention::Causal)
KILN_FLEX_CUDA_INSTANTIATE(attention::RelativePositionBias, attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE(attention::RelativePositionBias, attention::Causal)

}  // namespace kiln::kernels::cuda
