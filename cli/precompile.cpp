// `kiln precompile`: compiles ahead of time, all at once in the JIT's pool, the kernels of the
// run-time FlexAttention mods a run will use (docs/jit.md), into the disk cache (KILN_CACHE_DIR):
// warm a cluster's cache before its jobs start, or check that expressions compile. The mods come
// from flags or from a .toml / .json file (--config) with the keys score_mod, score_mod_derivative,
// mask_mod, dtype (a name, or a comma-separated list), captures (a safetensors file), backward (default true).
#include <cstdio>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "kiln/attention/runtime_mods_setup.h"
#include "kiln/core/device.h"
#include "kiln/io/file.h"
#include "kiln/io/json.h"
#include "kiln/jit/cache.h"
#include "kiln/train/config.h"

namespace kiln::cli {

int run_precompile(const Args& args) {
  std::string config, score = "score", dscore, mask = "true", dtypes = "f32", captures, device_s = "cpu";
  bool backward = true, forward_only = false;
  int64_t head_dim = 0;
  ArgParser p("precompile", "Compile the kernels of run-time FlexAttention mods into the JIT cache ahead of a run.");
  p.option("--config", &config, "FILE", ".toml or .json with score_mod, score_mod_derivative, mask_mod, dtype, "
                                        "captures, backward (flags given too override it)")
      .option("--score-mod", &score, "EXPR", "score_mod expression over score, b, h, q_idx, kv_idx (docs/jit.md)")
      .option("--score-mod-derivative", &dscore, "EXPR", "its derivative w.r.t. score (default: automatic)")
      .option("--mask-mod", &mask, "EXPR", "mask_mod expression over b, h, q_idx, kv_idx")
      .option("--dtype", &dtypes, "LIST", "comma-separated storage dtypes: f32, bf16, f16")
      .option("--captures", &captures, "FILE", "safetensors file whose tensors the expressions name")
      .option("--device", &device_s, "DEV", "cpu or cuda[:N] (CUDA: NVRTC cubins for sm_90a into the cache)")
      .option("--head-dim", &head_dim, "D", "CUDA: the head dim the kernels run at (0: both SIMT row sizes)")
      .flag("--forward-only", &forward_only, "only the forward kernels (inference)");
  if (!p.parse(args)) return 0;
  if (!config.empty()) {
    const std::string text = io::read_file_prefix(config, size_t{1} << 20);
    const json::Value v = config.size() > 5 && config.substr(config.size() - 5) == ".json"
                              ? json::parse(text)
                              : train::parse_toml(text, config);
    auto str = [&](const char* key, const char* flag, std::string& out) {
      if (const json::Value* x = v.find(key); x && !p.given(flag)) out = x->as_string(key);
    };
    str("score_mod", "--score-mod", score);
    str("score_mod_derivative", "--score-mod-derivative", dscore);
    str("mask_mod", "--mask-mod", mask);
    str("captures", "--captures", captures);
    if (const json::Value* x = v.find("dtype"); x && !p.given("--dtype")) {
      if (x->is_array()) {
        dtypes.clear();
        for (const auto& d : x->as_array("dtype")) dtypes += (dtypes.empty() ? "" : ",") + d.as_string("dtype");
      } else {
        dtypes = x->as_string("dtype");
      }
    }
    if (const json::Value* x = v.find("backward"); x && !p.given("--forward-only")) backward = x->as_bool("backward");
    for (const auto& [key, value] : v.as_object("config"))
      KILN_CHECK(key == "score_mod" || key == "score_mod_derivative" || key == "mask_mod" || key == "captures" ||
                     key == "dtype" || key == "backward",
                 "precompile: ", config, ": unknown key '", key,
                 "' (expected score_mod, score_mod_derivative, mask_mod, dtype, captures, backward)");
  }
  if (forward_only) backward = false;
  const Device dev = Device::parse(device_s);
  check_device_available(dev, "precompile");
  std::vector<DType> dts;
  for (size_t at = 0; at <= dtypes.size();) {
    const size_t end = std::min(dtypes.find(',', at), dtypes.size());
    const DType dt = parse_dtype(dtypes.substr(at, end - at));
    KILN_CHECK(dt == DType::f32 || dt == DType::bf16 || dt == DType::f16, "precompile: --dtype takes f32, bf16, f16");
    dts.push_back(dt);
    at = end + 1;
  }
  const attention::RuntimeMods mods = attention::runtime_mods(score, mask, captures, dev, dscore, "precompile");
  const attention::PrecompileReport r = attention::precompile_runtime_mods(mods, dts, dev, backward, head_dim);
  std::printf("kiln precompile: %zu kernels ready in %.1f s (%d compile threads; cache %s)\n", r.kernels, r.seconds,
              jit::CompileService::global().threads(), jit::cache_dir().c_str());
  return 0;
}

}  // namespace kiln::cli
