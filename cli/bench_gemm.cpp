// `kiln bench gemm`: kiln's Hopper GEMM and cuBLASLt side by side on one problem (shape, layout,
// dtype, epilogue; kernels/cuda/gemm/gemm.h). impl `kiln` is kiln's kernel with the epilogue
// fused; impl `cublaslt` is cuBLASLt with the epilogue fused where it has one (none, bias,
// accumulate) and otherwise its product followed by kiln's epilogue pass (the unfused pair).
// One JSON line per impl (bench, impl, device, shape, dtype, ms_median, peak_bytes, tflops, and
// max_rel_diff to the other impl's output) and a table with the ratio on stderr. CUDA events,
// median of --iters runs after --warmup.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "cli/args.h"
#include "cli/bench.h"
#include "kiln/core/allocator.h"
#include "kiln/core/rng.h"
#include "kiln/kernels/cuda/gemm/gemm.h"
#include "kiln/ops/ops.h"

namespace kiln::cli {
namespace {

namespace kg = kernels::gemm;

std::vector<int64_t> parse_shape(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    char* end = nullptr;
    const long long x = std::strtoll(part.c_str(), &end, 10);
    KILN_CHECK(!part.empty() && end == part.c_str() + part.size() && x > 0, "bench gemm: --shape '", s,
               "' is not M,N,K of positive integers");
    v.push_back(x);
  }
  KILN_CHECK(v.size() == 3, "bench gemm: --shape '", s, "' is not M,N,K (three sizes)");
  return v;
}

}  // namespace

int run_bench_gemm(const Args& args) {
  std::string device_s = "cuda", dtype_s = "bf16", out_s, shape_s = "8192,8192,8192", layout = "nt", epi_s = "none",
              impls = "kiln,cublaslt";
  int64_t batch = 1, iters = 20, warmup = 5, seed = 0, tile_n = 0;
  ArgParser p("bench gemm",
              "Times out = epilogue(op(a)·op(b)) with kiln's Hopper GEMM (impl 'kiln', the epilogue fused) and with\n"
              "cuBLASLt (impl 'cublaslt': its own epilogue where it has one, else its product and kiln's\n"
              "epilogue pass). Impl 'kiln_direct' is kiln's kernel storing from registers where 'kiln' stores\n"
              "a 16-bit output's tiles by TMA (none, bias, residual, row_lse, row_sumsq). Layout: nn, nt, tn or tt (a, b transposed: nt = x·Wᵀ, nn = g·W, tn = gᵀ·x).");
  p.option("--device", &device_s, "DEV", "cuda[:N]");
  p.option("--shape", &shape_s, "M,N,K", "the product's sizes (N counts gate and up for swiglu)");
  p.option("--batch", &batch, "B", "batched products (strided)");
  p.option("--layout", &layout, "L", "nn, nt, tn or tt");
  p.option("--dtype", &dtype_s, "T", "bf16 or f16 (a and b)");
  p.option("--out-dtype", &out_s, "T", "the output dtype: the input dtype or f32 (default: the input's; f32 for accumulate)");
  p.without_default();
  p.option("--epilogue", &epi_s, "E", "none, bias, residual, swiglu, accumulate, row_lse or row_sumsq");
  p.option("--impl", &impls, "LIST", "comma-separated: kiln, kiln_direct, cublaslt");
  p.option("--tile-n", &tile_n, "W", "kiln: output columns a tile, 128 or 256 (0: kiln's choice, 128)");
  p.option("--iters", &iters, "N", "timed runs (the median is reported)");
  p.option("--warmup", &warmup, "N", "untimed runs first");
  p.option("--seed", &seed, "S", "random inputs' seed");
  p.epilog("example: kiln bench gemm --shape 8192,28672,4096 --layout nt --epilogue swiglu");
  if (!p.parse(args)) return 0;
  const std::vector<int64_t> shape = parse_shape(shape_s);
  const int64_t m = shape[0], n = shape[1], k = shape[2];
  KILN_CHECK(batch > 0 && iters > 0 && warmup >= 0, "bench gemm: --batch and --iters must be > 0, --warmup >= 0");
  KILN_CHECK(tile_n == 0 || tile_n == 128 || tile_n == 256, "bench gemm: --tile-n must be 0, 128 or 256, got ", tile_n);
  KILN_CHECK(layout == "nn" || layout == "nt" || layout == "tn" || layout == "tt", "bench gemm: --layout '", layout,
             "' is not nn, nt, tn or tt");
  const Device dev = Device::parse(device_s);
  KILN_CHECK(dev.is_cuda(), "bench gemm: --device must be a CUDA device (got ", device_s, ")");
  check_device_available(dev, "bench gemm");
  const DType dtype = parse_dtype(dtype_s);
  KILN_CHECK(dtype == DType::bf16 || dtype == DType::f16, "bench gemm: --dtype must be bf16 or f16, got ", dtype_s);
  const kg::Epilogue epi = kg::parse_epilogue(epi_s, "bench gemm: --epilogue");
  const DType out_dt = !out_s.empty() ? parse_dtype(out_s) : epi == kg::Epilogue::accumulate ? DType::f32 : dtype;
  const std::vector<std::string> impl_list = parse_impls(impls, {"kiln", "kiln_direct", "cublaslt"}, "bench gemm");
  const bool ta = layout[0] == 't', tb = layout[1] == 't';

  Generator gen(static_cast<uint64_t>(seed));
  auto operand = [&](int64_t r, int64_t c, double scale) {
    return mul(randn({batch, r, c}, gen, DType::f32, dev), scale).to(dtype);
  };
  kg::GemmProblem prob;
  prob.a = ta ? operand(k, m, 1.0) : operand(m, k, 1.0);
  prob.b = tb ? operand(n, k, 1.0 / std::sqrt(static_cast<double>(k))) : operand(k, n, 1.0 / std::sqrt(static_cast<double>(k)));
  prob.trans_a = ta, prob.trans_b = tb;
  const int64_t ocols = epi == kg::Epilogue::swiglu ? n / 2 : n;
  kg::EpilogueArgs e;
  e.kind = epi;
  if (epi == kg::Epilogue::bias) e.bias = randn({n}, gen, DType::f32, dev).to(out_dt);
  if (epi == kg::Epilogue::residual) e.residual = randn({batch, m, n}, gen, DType::f32, dev).to(out_dt);
  if (epi == kg::Epilogue::row_lse || epi == kg::Epilogue::row_sumsq)
    e.row_stats = zeros({batch, m, kg::row_stat_tiles(n)}, DType::f32, dev);
  const double flops = 2.0 * static_cast<double>(batch) * static_cast<double>(m) * static_cast<double>(n) *
                       static_cast<double>(k);

  std::fprintf(stderr, "%-11s %-22s %-6s %-4s %-10s %10s %9s %9s\n", "impl", "shape", "dtype", "lay", "epilogue", "ms",
               "TFLOP/s", "vs lt");
  std::vector<std::pair<std::string, double>> results;
  std::vector<Tensor> outs;
  for (const std::string& impl : impl_list) {
    kg::GemmOptions o;
    const bool kiln = impl != "cublaslt";
    o.backend = kiln ? kg::Backend::kiln : kg::Backend::cublaslt;
    o.direct_store = impl == "kiln_direct";
    o.tile_n = static_cast<int>(tile_n);
    kg::GemmProblem q = prob;
    q.out = zeros({batch, m, ocols}, out_dt, dev);
    std::string why;
    if (kiln && !kg::kiln_supported(q, e, &why)) {
      std::fprintf(stderr, "%-11s skipped: %s\n", impl.c_str(), why.c_str());
      continue;
    }
    auto run = [&] { kg::gemm(q, e, o); };
    for (int64_t i = 0; i < warmup; ++i) run();
    const int64_t base = memory_stats(dev).current_bytes;
    reset_peak_memory_stats(dev);
    std::vector<double> times;
    for (int64_t i = 0; i < iters; ++i) times.push_back(bench_time_ms(dev, run));
    const int64_t peak = memory_stats(dev).peak_bytes - base;
    const double ms = median(times);
    // One more clean run for the comparison (accumulate adds to its output every run).
    if (epi == kg::Epilogue::accumulate) q.out = zeros({batch, m, ocols}, out_dt, dev);
    run();
    outs.push_back(q.out.to(DType::f32));
    json::Value r = json::Value::object();
    r["bench"] = "gemm";
    r["impl"] = impl;
    r["device"] = dev.str();
    json::Value sh = json::Value::object();
    sh["m"] = m, sh["n"] = n, sh["k"] = k, sh["batch"] = batch;
    sh["layout"] = layout, sh["epilogue"] = kg::epilogue_name(epi);
    r["shape"] = std::move(sh);
    r["dtype"] = dtype_name(dtype);
    r["out_dtype"] = dtype_name(out_dt);
    r["ms_median"] = ms;
    r["peak_bytes"] = peak;
    r["tflops"] = flops / (ms * 1e-3) / 1e12;
    r["iters"] = iters;
    if (kiln) r["tile_n"] = tile_n;
    if (outs.size() >= 2) {  // against the first impl's output
      const double num = amax(abs(sub(outs.back(), outs[0]))).item(), den = amax(abs(outs[0])).item();
      r["max_rel_diff"] = den > 0 ? num / den : num;
    }
    print_record(r);
    results.emplace_back(impl, ms);
    const double lt_ms = [&] {
      for (auto& [name, t] : results)
        if (name == "cublaslt") return t;
      return 0.0;
    }();
    char shape_txt[64];
    std::snprintf(shape_txt, sizeof shape_txt, "%lldx%lldx%lld*%lld", static_cast<long long>(m),
                  static_cast<long long>(n), static_cast<long long>(k), static_cast<long long>(batch));
    std::fprintf(stderr, "%-11s %-22s %-6s %-4s %-10s %10.4f %9.1f", impl.c_str(), shape_txt, dtype_name(dtype),
                 layout.c_str(), kg::epilogue_name(epi), ms, flops / (ms * 1e-3) / 1e12);
    if (lt_ms > 0) std::fprintf(stderr, " %8.3fx", lt_ms / ms);
    std::fprintf(stderr, "\n");
  }
  if (results.size() == 2 && results[0].first == "kiln")
    std::fprintf(stderr, "kiln / cuBLASLt speed: %.3fx\n", results[1].second / results[0].second);
  return 0;
}

}  // namespace kiln::cli
