// Run-time mods from strings and a captures file, and their precompilation (runtime_mods_setup.h).
#include "kiln/attention/runtime_mods_setup.h"

#include <chrono>

#include "kiln/io/safetensors.h"

namespace kiln::attention {

RuntimeMods runtime_mods(const std::string& score_mod, const std::string& mask_mod, const std::string& captures_file,
                         Device device, const std::string& score_mod_derivative, const std::string& who) {
  Captures file;
  if (!captures_file.empty()) {
    try {
      for (auto& [name, t] : io::load_safetensors(captures_file))
        file.emplace_back(name, device.is_cpu() ? t : t.to(device));
    } catch (const Error& e) {
      fail(who, ": cannot read the captures file '", captures_file, "': ", e.what());
    }
  }
  const std::string score = score_mod.empty() ? "score" : score_mod, mask = mask_mod.empty() ? "true" : mask_mod;
  return RuntimeMods{RuntimeScoreMod(score, captures_named_in(score + " " + score_mod_derivative, file),
                                     score_mod_derivative),
                     RuntimeMaskMod(mask, captures_named_in(mask, file))};
}

PrecompileReport precompile_runtime_mods(const RuntimeMods& mods, const std::vector<DType>& dtypes, Device device,
                                         bool backward, int64_t head_dim) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<jit::Ticket> tickets;
  for (DType dt : dtypes)
    for (auto& t : precompile_flex(mods.score_mod, mods.mask_mod, dt, device, backward, head_dim))
      tickets.push_back(std::move(t));
  std::string first_error;
  for (const auto& t : tickets) {
    try {
      t.wait();
    } catch (const std::exception& e) {
      if (first_error.empty()) first_error = e.what();
    }
  }
  KILN_CHECK(first_error.empty(), first_error);
  return PrecompileReport{tickets.size(),
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

}  // namespace kiln::attention
