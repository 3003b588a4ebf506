// flex_builtin_files (kernels/flex_files.h): names each CUDA FlexAttention instantiation file
// (the symbol KILN_FLEX_CUDA_FILE defines in it), so that a static link keeps them all.
#include "kiln/kernels/flex_files.h"

extern "C" void kiln_flex_cuda_file_masks_dense();
extern "C" void kiln_flex_cuda_file_masks_document();
extern "C" void kiln_flex_cuda_file_masks_window();
extern "C" void kiln_flex_cuda_file_mods_alibi();
extern "C" void kiln_flex_cuda_file_mods_relative_bias();
extern "C" void kiln_flex_cuda_file_mods_softcap();

namespace kiln::kernels::cuda {
namespace {

// At namespace scope and [[gnu::used]]: the array is emitted with its relocations even though only
// its length is read, so the linker takes every file it names. (A function-local array whose
// length alone is read is folded away at -O2, and with it every reference: the Release build
// then linked no built-in CUDA FlexAttention kernel at all.)
[[gnu::used]] void (*const kFlexFiles[])() = {kiln_flex_cuda_file_masks_dense,    kiln_flex_cuda_file_masks_document,
                                              kiln_flex_cuda_file_masks_window,    kiln_flex_cuda_file_mods_alibi,
                                              kiln_flex_cuda_file_mods_relative_bias, kiln_flex_cuda_file_mods_softcap};

}  // namespace

int flex_builtin_files() { return static_cast<int>(sizeof kFlexFiles / sizeof kFlexFiles[0]); }

}  // namespace kiln::kernels::cuda
