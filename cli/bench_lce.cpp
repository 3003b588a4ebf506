// `kiln bench lce`: forward + backward of the fused linear + cross-entropy and of the unfused
// reference at one shape; one JSON line per implementation (bench, impl, device, shape, dtype,
// ms_median, peak_bytes above the inputs, tflops of the three products, loss) and a table on
// stderr. peak_bytes counts everything allocated during a step (both gradients included) above
// what was live before it (inputs), from kiln::memory_stats after reset_peak_memory_stats.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cli/args.h"
#include "cli/bench.h"
#include "kiln/core/allocator.h"
#include "kiln/loss/linear_cross_entropy.h"
#include "kiln/ops/ops.h"

namespace kiln::cli {

int run_bench_lce(const Args& args) {
  std::string device_s = "cpu", dtype_s = "f32", impls = "fused,reference";
  int64_t n = 4096, d = 512, v = 32000, iters = 5, warmup = 1, seed = 0, chunk = 0;
  ArgParser p("bench lce", "Times forward + backward of linear_cross_entropy (impl 'fused') and of the unfused\n"
                           "linear + cross-entropy composed from core ops (impl 'reference').");
  p.option("--device", &device_s, "DEV", "cpu or cuda[:N]");
  p.option("--tokens", &n, "N", "tokens (rows of hidden)");
  p.option("--dim", &d, "D", "hidden size");
  p.option("--vocab", &v, "V", "vocabulary size");
  p.option("--dtype", &dtype_s, "T", "f32 or bf16 (f16, f64 also accepted)");
  p.option("--iters", &iters, "K", "timed steps (median reported)");
  p.option("--warmup", &warmup, "K", "untimed steps first");
  p.option("--impl", &impls, "LIST", "comma-separated: fused, reference");
  p.option("--seed", &seed, "S", "random seed of the inputs");
  p.option("--chunk", &chunk, "M", "fused: tokens per chunk (0: chosen from V)");
  p.epilog("example: kiln bench lce --device cuda --tokens 16384 --dim 4096 --vocab 128256 --dtype bf16");
  if (!p.parse(args)) return 0;
  KILN_CHECK(n > 0 && d > 0 && v > 0, "bench lce: --tokens, --dim and --vocab must be > 0");
  KILN_CHECK(iters > 0 && warmup >= 0, "bench lce: --iters must be > 0 and --warmup >= 0");
  const Device dev = Device::parse(device_s);
  check_device_available(dev, "bench lce");
  const DType dtype = parse_dtype(dtype_s);
  KILN_CHECK(is_floating(dtype), "bench lce: --dtype ", dtype_s, " is not a floating dtype");

  Generator gen(static_cast<uint64_t>(seed));
  Tensor h = mul(randn({n, d}, gen, DType::f32, dev), 1.0).to(dtype).requires_grad_();
  Tensor w = mul(randn({v, d}, gen, DType::f32, dev), 1.0 / std::sqrt(static_cast<double>(d))).to(dtype).requires_grad_();
  Tensor target;
  {
    Tensor u = rand({n}, gen, DType::f64);
    std::vector<int64_t> t(static_cast<size_t>(n));
    auto uv = u.to_vector<double>();
    for (size_t i = 0; i < t.size(); ++i) t[i] = std::min<int64_t>(v - 1, static_cast<int64_t>(uv[i] * v));
    target = from_vector<int64_t>(t, {n}).to(dev);
  }
  const double flops = 6.0 * static_cast<double>(n) * static_cast<double>(v) * static_cast<double>(d);

  std::fprintf(stderr, "%-10s %-6s %-6s %10s %12s %9s %12s\n", "impl", "device", "dtype", "ms", "peak MiB", "TFLOP/s",
               "loss");
  size_t pos = 0;
  while (pos <= impls.size()) {
    size_t comma = impls.find(',', pos);
    std::string impl = impls.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? impls.size() + 1 : comma + 1;
    KILN_CHECK(impl == "fused" || impl == "reference", "bench lce: unknown impl '", impl, "' (fused, reference)");
    LinearCrossEntropyOptions opts;
    opts.chunk_tokens = chunk;
    auto step = [&]() {
      Tensor loss = impl == "fused" ? linear_cross_entropy(h, w, target, opts).loss
                                    : linear_cross_entropy_reference(h, w, target).loss;
      loss.backward();
      return loss.detach();
    };
    double loss_value = 0;
    for (int64_t i = 0; i < warmup; ++i) {
      h.set_grad(Tensor());
      w.set_grad(Tensor());
      loss_value = step().item();
    }
    std::vector<double> times;
    int64_t peak = 0;
    for (int64_t i = 0; i < iters; ++i) {
      h.set_grad(Tensor());
      w.set_grad(Tensor());
      const int64_t base = memory_stats(dev).current_bytes;
      reset_peak_memory_stats(dev);
      Tensor last;
      times.push_back(bench_time_ms(dev, [&] { last = step(); }));
      peak = std::max(peak, memory_stats(dev).peak_bytes - base);
      loss_value = last.item();
    }
    h.set_grad(Tensor());
    w.set_grad(Tensor());
    const double ms = median(times);
    json::Value r = json::Value::object();
    r["bench"] = "lce";
    r["impl"] = impl;
    r["device"] = dev.str();
    json::Value shape = json::Value::object();
    shape["tokens"] = n;
    shape["dim"] = d;
    shape["vocab"] = v;
    r["shape"] = std::move(shape);
    r["dtype"] = dtype_name(dtype);
    r["ms_median"] = ms;
    r["peak_bytes"] = peak;
    r["tflops"] = flops / (ms * 1e-3) / 1e12;
    r["iters"] = iters;
    r["loss"] = loss_value;
    print_record(r);
    std::fprintf(stderr, "%-10s %-6s %-6s %10.2f %12.1f %9.2f %12.6f\n", impl.c_str(), dev.str().c_str(),
                 dtype_name(dtype), ms, static_cast<double>(peak) / (1024.0 * 1024.0), flops / (ms * 1e-3) / 1e12,
                 loss_value);
  }
  return 0;
}

}  // namespace kiln::cli
