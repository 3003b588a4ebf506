// bench_optim: one AdamW step (fused kernel per parameter) and one clip_grad_norm_ over a
// GPT-2-small-like set of parameters, on the CPU and on each CUDA device. One JSON object per
// case on stdout (ms_median, GB/s of the memory the update must move, peak_bytes above the
// inputs), a short table on stderr. Usage: bench_optim [total_params_millions] (default 124).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/allocator.h"
#include "kiln/io/json.h"
#include "kiln/ops/ops.h"
#include "kiln/optim/adamw.h"
#include "kiln/optim/clip.h"

using namespace kiln;

namespace {

// Layers of d×4d, 4d×d, d×3d, d×d matrices plus norms, scaled to about `total` elements.
optim::NamedTensors make_params(int64_t total, Device dev, DType grad_dtype) {
  const int64_t d = 768;
  const int64_t per_layer = 12 * d * d + 4 * d;
  const int64_t layers = std::max<int64_t>(1, total / per_layer);
  Generator gen(1);
  optim::NamedTensors ps;
  auto add = [&](const std::string& name, const Shape& s) {
    Tensor p = randn(s, gen).to(dev);
    p.requires_grad_();
    p.set_grad(randn(s, gen, grad_dtype).to(dev));
    ps.emplace_back(name, p);
  };
  for (int64_t l = 0; l < layers; ++l) {
    const std::string pre = "layers." + std::to_string(l) + ".";
    add(pre + "norm1", {d});
    add(pre + "qkv", {3 * d, d});
    add(pre + "proj", {d, d});
    add(pre + "norm2", {d});
    add(pre + "fc", {4 * d, d});
    add(pre + "out", {d, 4 * d});
  }
  return ps;
}

void sync(const optim::NamedTensors& ps) {
  NoGradGuard ng;
  (void)ps.back().second.detach().flatten().narrow(0, 0, 1).item();
}

double median_ms(const std::function<void()>& f, const optim::NamedTensors& ps, int iters) {
  for (int i = 0; i < 3; ++i) f();
  sync(ps);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    sync(ps);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void report(const char* bench, const Device& dev, int64_t n, DType gd, double ms, double bytes, int64_t peak) {
  json::Value r = json::Value::object();
  r["bench"] = bench;
  r["impl"] = "kiln";
  r["device"] = dev.str();
  r["shape"] = std::to_string(n) + " params";
  r["dtype"] = std::string("f32 params, ") + dtype_name(gd) + " grads";
  r["ms_median"] = ms;
  r["gb_per_s"] = bytes / (ms * 1e-3) / 1e9;
  r["peak_bytes"] = peak;
  std::printf("%s\n", r.dump().c_str());
  std::fprintf(stderr, "%-16s %-7s %-5s %10lld params  %8.3f ms  %7.1f GB/s\n", bench, dev.str().c_str(),
               dtype_name(gd), static_cast<long long>(n), ms, bytes / (ms * 1e-3) / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t total = static_cast<int64_t>((argc > 1 ? std::atof(argv[1]) : 124.0) * 1e6);
  std::vector<Device> devices = {kCPU};
  for (int i = 0; i < cuda_device_count(); ++i) devices.push_back(cuda(i));
  for (const Device& dev : devices) {
    for (DType gd : {DType::f32, DType::bf16}) {
      optim::NamedTensors ps = make_params(total, dev, gd);
      int64_t n = 0;
      for (const auto& [name, p] : ps) n += p.numel();
      optim::AdamW opt(ps, {});
      opt.step();  // allocates the state
      const int iters = dev.is_cpu() ? 5 : 50;
      reset_peak_memory_stats(dev);
      const int64_t base = memory_stats(dev).current_bytes;
      const double ms = median_ms([&] { opt.step(); }, ps, iters);
      // p, m, v read and written; g read.
      const double bytes = static_cast<double>(n) * (6 * 4 + static_cast<double>(itemsize(gd)));
      report("adamw_step", dev, n, gd, ms, bytes, memory_stats(dev).peak_bytes - base);
      reset_peak_memory_stats(dev);
      const double cms = median_ms([&] { optim::clip_grad_norm_(ps, 1e30); }, ps, iters);
      report("clip_grad_norm", dev, n, gd, cms, static_cast<double>(n) * static_cast<double>(itemsize(gd)),
             memory_stats(dev).peak_bytes - base);
    }
  }
  return 0;
}
