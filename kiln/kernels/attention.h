// Kernel entry points of FlexAttention. The mods are template parameters, so the CPU bodies are
// templates (kernels/cpu/attention_impl.h, instantiated by the front end or explicitly in
// kernels/cpu/attention.cpp); the CUDA bodies are explicit instantiations in
// kernels/cuda/attention*.cu for the library's mods. FlexParams (the kernels' arguments) is in
// the device-only kernels/flex_params.h.
#pragma once
#include <cxxabi.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <typeinfo>

#include "kiln/core/dtype.h"
#include "kiln/core/kernel_registry.h"
#include "kiln/kernels/flex_params.h"

namespace kiln::kernels {

// CUDA bodies (kernels/cuda/attention_kernels.cuh): explicit instantiations for NoScoreMod ×
// {NoMask, Causal, SlidingWindow, DocumentCausal, PrefixLM} (attention_masks_*.cu) and {Alibi,
// Softcap, RelativePositionBias} × {NoMask, Causal} (attention_mods_*.cu). Each registers its
// type-erased entry points in the KernelRegistry (core/kernel_registry.h) under flex_key(...);
// the front end finds them there (and the JIT's kernels for run-time mods), so nothing keeps a
// list of which combinations exist.
namespace cuda {
template <class SM, class MM> void flex_forward(const FlexParams& p, DType dt, const SM& sm, const MM& mm);
template <class SM, class MM> void flex_backward(const FlexParams& p, DType dt, const SM& sm, const MM& mm);
// The GPU BlockMask builder: writes the tile classes (0 empty, 1 partial, 2 full) of
// [Bm, Hm, nQ, nKV] to `classes` (device memory), one thread per tile evaluating its elements.
template <class MM>
void classify_tiles(const MM& mm, int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb, int64_t kb,
                    uint8_t* classes);
}  // namespace cuda

// The registry's signature of a built-in flex_forward / flex_backward body: the mods passed by
// address, cast back to their types by the body (flex_erased).
using FlexEntry = void (*)(const FlexParams& p, DType dt, const void* score_mod, const void* mask_mod);
template <class SM, class MM, bool kForward>
void flex_erased(const FlexParams& p, DType dt, const void* sm, const void* mm) {
  if constexpr (kForward)
    cuda::flex_forward<SM, MM>(p, dt, *static_cast<const SM*>(sm), *static_cast<const MM*>(mm));
  else
    cuda::flex_backward<SM, MM>(p, dt, *static_cast<const SM*>(sm), *static_cast<const MM*>(mm));
}

// A mod type's name as the registry keys it: its C++ name without the kiln::attention:: prefixes
// ("AndMask<Causal, Document>"); the same in every translation unit of one build.
template <class M> std::string flex_mod_name() {
  int status = 0;
  char* d = abi::__cxa_demangle(typeid(M).name(), nullptr, nullptr, &status);
  std::string n = status == 0 && d ? d : typeid(M).name();
  std::free(d);
  const std::string prefix = "kiln::attention::";
  for (size_t at; (at = n.find(prefix)) != std::string::npos;) n.erase(at, prefix.size());
  return n;
}
// The registry key of a built-in body: family "flex_forward" / "flex_backward", any dtype and
// head dim (the body dispatches on both), mods "score_mod|mask_mod".
template <class SM, class MM> KernelKey flex_key(const char* family, const char* device) {
  return KernelKey{family, device, "*", 0, flex_mod_name<SM>() + "|" + flex_mod_name<MM>(), ""};
}

}  // namespace kiln::kernels
