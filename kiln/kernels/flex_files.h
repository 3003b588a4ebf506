// The CUDA FlexAttention instantiation files of this build (kernels/cuda/attention_*.cu). They
// register their bodies in the KernelRegistry when the program starts and nothing else names
// them, so a static link would leave them out: the front end takes this function's address
// (attention/flex_attention.cpp) and its definition names every file. Defined in
// kernels/cuda/flex_files.cpp, or in kernels/cuda/direct_stub.cpp without CUDA.
//
// Also the registry's signature of a built-in GPU BlockMask builder (family
// "flex_classify_tiles", key flex_key<NoScoreMod, MM>): kernels::cuda::classify_tiles<MM> with
// the mask passed by address, registered by KILN_FLEX_CUDA_INSTANTIATE_MASK.
#pragma once
#include <cstdint>

namespace kiln::kernels {
using FlexClassifyEntry = void (*)(const void* mask_mod, int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb,
                                   int64_t kb, uint8_t* classes);
inline constexpr const char* kFlexClassifyFamily = "flex_classify_tiles";
}  // namespace kiln::kernels

namespace kiln::kernels::cuda {
// How many instantiation files are linked in (0 in a build without CUDA).
int flex_builtin_files();
}  // namespace kiln::kernels::cuda
