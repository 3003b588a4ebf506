// Run-time FlexAttention mods from a run's settings (docs/jit.md): the expression strings and a
// captures file as `kiln train --score-mod / --attention-mask / --captures` and `kiln precompile`
// take them, made into RuntimeScoreMod / RuntimeMaskMod, and every kernel they need compiled at
// start, all at once in the JIT's pool, before the first step (so a cold compile is paid, and
// shown, before training, and an expression that does not compile fails the run at once).
#pragma once
#include <string>
#include <vector>

#include "kiln/attention/runtime_mods.h"

namespace kiln::attention {

struct RuntimeMods {
  RuntimeScoreMod score_mod;  // "score" (the identity) when none was given
  RuntimeMaskMod mask_mod;    // "true" (keep every pair) when none was given
};

// The mods of `score_mod` (its derivative `score_mod_derivative`, "" for automatic) and
// `mask_mod`, each with the tensors of `captures_file` (a safetensors file, "" for none) that it
// names, moved to `device`. An empty expression is the identity / keep-all. Errors (kiln::Error)
// name `who` (e.g. "train: --score-mod") and the file; expressions are checked when compiled.
RuntimeMods runtime_mods(const std::string& score_mod, const std::string& mask_mod, const std::string& captures_file,
                         Device device, const std::string& score_mod_derivative = "", const std::string& who = "mods");

struct PrecompileReport {
  size_t kernels = 0;   // compiled or found in the cache
  double seconds = 0;   // wall time of the whole batch
};
// Compiles every kernel of `mods` for each of `dtypes` (f32, bf16, f16) on `device` (the
// forward, the backward when `backward`, the mask's tile classifier), submitting them all to the
// pool before waiting on any; rethrows the first error after all have finished. On CUDA the
// cubins go to the disk cache (loaded at the first call: a cache hit), for the SIMT row size of
// `head_dim` (0: both 128 and 256).
PrecompileReport precompile_runtime_mods(const RuntimeMods& mods, const std::vector<DType>& dtypes, Device device,
                                         bool backward, int64_t head_dim = 0);

}  // namespace kiln::attention
