// `kiln bench jit`: the JIT's compile times for run-time FlexAttention mods (docs/jit.md). Into a
// fresh cache folder of its own: one kernel compiled alone (cold), then --kernels distinct
// kernels submitted at once to the compile pool (cold, in parallel), then a cached forward +
// backward pair loaded again (warm: a cache hit, and on a GPU the module load). The kernels are
// the ones a call runs: the Hopper templates with the generated functors (--kind hopper, bf16,
// head dim 128), NVRTC's SIMT bodies (--kind simt) or the CPU kernels built by the system compiler
// (--kind cpu). One JSON line (cold_one_s, cold_parallel_s, kernels, threads, throughput_ratio =
// (kernels / cold_parallel_s) / (1 / cold_one_s), warm_pair_ms) and a summary on stderr.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "cli/args.h"
#include "cli/bench.h"
#include "kiln/core/error.h"
#include "kiln/core/stream.h"
#include "kiln/jit/cache.h"
#include "kiln/jit/compile_service.h"
#include "kiln/jit/cpu_backend.h"
#include "kiln/jit/cuda_backend.h"
#include "kiln/jit/flex_source.h"

namespace kiln::cli {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The request of kernel `i` of this run (a window of its own, so that no two sources agree).
jit::CompileRequest request(const std::string& kind, int64_t nonce, int i, bool backward) {
  const jit::ModSpec score{"score_mod", "score", "", {}};
  const jit::ModSpec mask{"mask_mod", "q_idx >= kv_idx && q_idx - kv_idx < " + std::to_string(nonce + i), "", {}};
  const std::string name = std::string(backward ? "flex_backward " : "flex_forward ") + kind + " (" + mask.expr + ")";
  const std::vector<std::string> files{"score_mod", "score_mod_derivative", "mask_mod"};
  if (kind == "hopper")
    return {name, jit::flex_hopper_source(score, mask, "bf16"), files, jit::flex_hopper_kernels(128, backward, "bf16")};
  if (kind == "simt") return {name, jit::flex_cuda_source(score, mask, 128, backward, "bf16"), files};
  return {name, jit::flex_cpu_source(score, mask, "f32", backward), files};
}

}  // namespace

int run_bench_jit(const Args& args) {
  std::string kind = "hopper";
  int64_t kernels = 8;
  ArgParser p("bench jit",
              "Times the JIT: one run-time FlexAttention kernel compiled alone, --kernels distinct ones compiled at\n"
              "once in the pool (KILN_COMPILE_THREADS threads), and a cached forward + backward pair loaded again.\n"
              "Runs in a fresh cache folder of its own (removed after); CUDA kinds need NVRTC, the load a GPU.");
  p.option("--kind", &kind, "K", "hopper (the wgmma templates, NVRTC), simt (NVRTC's SIMT bodies) or cpu (the system C++ compiler)");
  p.option("--kernels", &kernels, "N", "kernels compiled at once in the parallel round");
  if (!p.parse(args)) return 0;
  KILN_CHECK(kind == "hopper" || kind == "simt" || kind == "cpu", "bench jit: --kind must be hopper, simt or cpu, got '",
             kind, "'");
  KILN_CHECK(kernels >= 1 && kernels <= 64, "bench jit: --kernels must be 1 to 64, got ", kernels);
  const bool cuda = kind != "cpu";
  std::string why;
  KILN_CHECK(!cuda || jit::nvrtc(&why), "bench jit: --kind ", kind, " needs NVRTC: ", why);

  // A fresh cache folder: every compile below is cold until it is stored.
  std::string tmpl = (std::filesystem::temp_directory_path() / "kiln-bench-jit-XXXXXX").string();
  KILN_CHECK(::mkdtemp(tmpl.data()) != nullptr, "bench jit: cannot create a temporary cache folder under ",
             std::filesystem::temp_directory_path().string());
  const std::string dir = tmpl;
  const char* old = std::getenv("KILN_CACHE_DIR");
  const std::string saved = old ? old : "";
  ::setenv("KILN_CACHE_DIR", dir.c_str(), 1);
  struct Restore {
    std::string dir, saved;
    bool had;
    ~Restore() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
      if (had) ::setenv("KILN_CACHE_DIR", saved.c_str(), 1);
      else ::unsetenv("KILN_CACHE_DIR");
    }
  } restore{dir, saved, old != nullptr};

  auto compile = [&](const jit::CompileRequest& r, const jit::CancelToken* tok) {
    if (cuda) jit::compile_cuda(r, "sm_90a", tok);
    else jit::compile_cpu(r, tok);
  };
  const int64_t nonce = 1000 + std::random_device{}() % 100000;
  jit::CompileService& pool = jit::CompileService::global();
  pool.set_quiet(true);

  // Cold, alone (kernel 0).
  auto t0 = std::chrono::steady_clock::now();
  const jit::CompileRequest first = request(kind, nonce, 0, false);
  pool.submit(first.name, [&](const jit::CancelToken& tok) { compile(first, &tok); }).wait();
  const double cold_one = seconds_since(t0);

  // Cold, N at once (kernels 1 .. N).
  std::vector<jit::CompileRequest> reqs;
  for (int i = 1; i <= kernels; ++i) reqs.push_back(request(kind, nonce, i, false));
  t0 = std::chrono::steady_clock::now();
  std::vector<jit::Ticket> tickets;
  for (const auto& r : reqs) tickets.push_back(pool.submit(r.name, [&r, &compile](const jit::CancelToken& tok) { compile(r, &tok); }));
  for (const auto& t : tickets) t.wait();
  const double cold_parallel = seconds_since(t0);

  // Warm: kernel 0's forward (cached above) and its backward (compiled now, then cached) found
  // again, as a new process finds them; on a GPU with the module load.
  const jit::CompileRequest back = request(kind, nonce, 0, true);
  pool.submit(back.name, [&](const jit::CancelToken& tok) { compile(back, &tok); }).wait();
  const bool load = cuda && cuda_device_count() > 0;
  double warm_ms = 1e300;
  for (int rep = 0; rep < 3; ++rep) {  // the best of three (the first may meet a cold page cache)
    t0 = std::chrono::steady_clock::now();
    for (const jit::CompileRequest* r : {&first, &back}) {
      if (cuda) {
        const jit::Cubin c = jit::compile_cuda(*r);
        KILN_CHECK(c.from_cache, "bench jit: the cached kernel '", r->name, "' was compiled again");
        if (load)
          jit::load_cuda_functions(c, c.lowered_names.empty() ? jit::flex_cuda_kernels(r == &back, false) : c.lowered_names);
      } else {
        jit::compile_cpu(*r);
      }
    }
    warm_ms = std::min(warm_ms, 1e3 * seconds_since(t0));
  }

  const double ratio = (static_cast<double>(kernels) / cold_parallel) / (1.0 / cold_one);
  json::Value o = json::Value::object();
  o["bench"] = "jit";
  o["kind"] = kind;
  o["kernels"] = kernels;
  o["threads"] = pool.threads();
  o["cold_one_s"] = cold_one;
  o["cold_parallel_s"] = cold_parallel;
  o["throughput_ratio"] = ratio;
  o["warm_pair_ms"] = warm_ms;
  o["warm_includes_module_load"] = load;
  print_record(o);
  std::fprintf(stderr,
               "jit %s: one kernel cold %.2f s; %lld at once on %d threads %.2f s (throughput %.2f x one's, %.2f per "
               "thread); a cached fwd+bwd pair %.1f ms%s\n",
               kind.c_str(), cold_one, static_cast<long long>(kernels), pool.threads(), cold_parallel, ratio,
               ratio / std::min<double>(static_cast<double>(kernels), pool.threads()), warm_ms,
               load ? " (with the module load)" : cuda ? " (no GPU: cache read only, no module load)" : " (dlopen)");
  return 0;
}

}  // namespace kiln::cli
