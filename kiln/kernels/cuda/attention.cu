// Explicit instantiations of the CUDA FlexAttention bodies (attention_kernels.cuh) for the
// library's masks without a score_mod, and of the GPU BlockMask builder for those masks.
// The library's score mods are instantiated in attention_score_mods.cu.
#include "kiln/kernels/cuda/attention_kernels.cuh"

namespace kiln::kernels::cuda {

KILN_FLEX_CUDA_INSTANTIATE(attention::NoScoreMod, attention::NoMask)
KILN_FLEX_CUDA_INSTANTIATE(attention::NoScoreMod, attention::Causal)
KILN_FLEX_CUDA_INSTANTIATE(attention::NoScoreMod, attention::SlidingWindow)
KILN_FLEX_CUDA_INSTANTIATE(attention::NoScoreMod, attention::DocumentCausal)
KILN_FLEX_CUDA_INSTANTIATE(attention::NoScoreMod, attention::PrefixLM)
template void classify_tiles<attention::NoMask>(const attention::NoMask&, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                int64_t, uint8_t*);
template void classify_tiles<attention::Causal>(const attention::Causal&, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                int64_t, uint8_t*);
template void classify_tiles<attention::SlidingWindow>(const attention::SlidingWindow&, int64_t, int64_t, int64_t,
                                                       int64_t, int64_t, int64_t, uint8_t*);
template void classify_tiles<attention::DocumentCausal>(const attention::DocumentCausal&, int64_t, int64_t, int64_t,
                                                        int64_t, int64_t, int64_t, uint8_t*);
template void classify_tiles<attention::PrefixLM>(const attention::PrefixLM&, int64_t, int64_t, int64_t, int64_t,
                                                  int64_t, int64_t, uint8_t*);

}  // namespace kiln::kernels::cuda
