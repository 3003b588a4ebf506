// The CUDA FlexAttention kernels (attention_kernels.cuh) for the ALiBi score_mod with no mask and
// with the causal mask. Other combinations: instantiate them the same way in a .cu file of your
// own (docs/attention.md, "Your own mods on CUDA"); they register themselves.
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE(attention::Alibi, attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE(attention::Alibi, attention::Causal)

}  // namespace kiln::kernels::cuda

KILN_FLEX_CUDA_FILE(mods_alibi)
