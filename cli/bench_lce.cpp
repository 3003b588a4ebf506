// `kiln bench lce`: forward + backward of the fused linear + cross-entropy and of the unfused
// reference at one shape; one JSON line per implementation (bench, impl, device, shape, dtype,
// ms_median, peak_bytes above the inputs, tflops of the three products, loss) and a table on
// stderr. peak_bytes counts everything allocated during a step (both gradients included) above
// what was live before it (inputs), from kiln::memory_stats after reset_peak_memory_stats.
// Measurement aids: impl `gemm_bound` times the three plain full-size products (logits [N, V],
// d_hidden with K = V, d_weight with K = N) with no loss work, the floor of any fused kernel;
// impl `fused_filter` runs with the gradient filter on and reports its max abs gradient error
// against the unfiltered run; impl `fused_kiln` runs the fused loss's products on kiln's Hopper
// GEMM (gemm_backend kiln) and reports its max abs gradient difference to `fused`, and
// `fused_kiln_filter` the same with the gradient filter skipping dz's zero blocks (its profile
// counts them; --logit-std makes the softmax as peaked as a trained model's); `--profile` (or KILN_LCE_PROFILE=1) adds a `fused_profile` line
// with the milliseconds of each phase of the fused kernel summed over its chunks (CUDA).
// Before any input is allocated, a lower-bound estimate of each chosen impl's memory is checked
// against what the device has available (kiln/train/memory_estimate.h's figure), so a shape that
// cannot fit is refused with the numbers instead of being killed by the out-of-memory killer.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cli/args.h"
#include "cli/bench.h"
#include "kiln/autograd/grad_mode.h"
#include "kiln/core/allocator.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/matmul.h"
#include "kiln/loss/linear_cross_entropy.h"
#include "kiln/ops/ops.h"
#include "kiln/train/memory_estimate.h"
#include "kiln/train/report.h"

namespace kiln::cli {
namespace {

// The fields every record of this bench starts with.
json::Value base_record(const std::string& impl, const Device& dev, int64_t n, int64_t d, int64_t v, DType dtype) {
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
  return r;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return amax(abs(sub(a.to(DType::f32), b.to(DType::f32)))).item();
}
double max_abs_of(const Tensor& a) { return amax(abs(a.to(DType::f32))).item(); }

bool env_profile() {
  const char* e = std::getenv("KILN_LCE_PROFILE");
  return e != nullptr && *e != '\0' && std::string(e) != "0";
}

// a * b and a + b, saturating (an absurd --tokens must not wrap around to a small estimate)
// (both clamp at INT64_MAX / 4, so a sum of clamped terms cannot overflow either)
int64_t sat_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX / 4 : std::min(r, INT64_MAX / 4);
}
int64_t sat_add(int64_t a, int64_t b) {
  int64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? INT64_MAX / 4 : std::min(r, INT64_MAX / 4);
}

// What one impl's step holds at once, at the least (allocator slack and small temporaries
// left out, so a shape it refuses cannot fit): the inputs, the gradients (d_hidden, d_weight) and
// the impl's own buffers. `filter`: fused_filter also holds a second set of gradients for its
// error figure.
struct LceBenchEstimate {
  int64_t inputs = 0, gradients = 0, buffers = 0;
  const char* buffers_what = "";
  int64_t total() const { return sat_add(sat_add(inputs, gradients), buffers); }
};
LceBenchEstimate estimate_lce_bench(const std::string& impl, const Device& dev, int64_t n, int64_t d, int64_t v,
                                    DType dtype) {
  const int64_t es = static_cast<int64_t>(itemsize(dtype));
  const int64_t nd = sat_mul(n, d), vd = sat_mul(v, d), nv = sat_mul(n, v);
  LceBenchEstimate e;
  e.inputs = sat_add(sat_mul(sat_add(nd, vd), es), sat_mul(n, 8));  // hidden, weight, i64 targets
  if (impl == "reference") {
    e.gradients = sat_mul(sat_add(nd, vd), es);
    e.buffers = sat_mul(sat_mul(nv, es), 2);  // the N x V logits and their gradient
    e.buffers_what = "the N x V logits and their gradient";
  } else if (impl == "gemm_bound") {
    e.gradients = sat_mul(sat_add(nd, vd), es);
    e.buffers = sat_mul(nv, es);  // the full-size logits product
    e.buffers_what = "the N x V logits";
  } else {
    // fused: gradients in the input dtype on CUDA, the accumulation dtype on the CPU (where
    // 16-bit inputs are also copied to f32); per-token loss / lse arrays
    const int64_t acc = static_cast<int64_t>(itemsize(compute_dtype(dtype)));
    e.gradients = sat_mul(sat_add(nd, vd), dev.is_cuda() ? es : acc);
    if (impl == "fused_filter" || impl == "fused_kiln" || impl == "fused_kiln_filter") e.gradients = sat_mul(e.gradients, 2);
    e.buffers = sat_mul(n, 16);
    if (!dev.is_cuda() && es < 4) e.buffers = sat_add(e.buffers, sat_mul(sat_add(nd, vd), 4));
    e.buffers_what = "per-token arrays and f32 copies of 16-bit inputs";
  }
  return e;
}

// kiln::Error when the largest impl's estimate exceeds the memory `dev` has available (nothing
// when the platform cannot say): both figures, the parts, and the flags to lower.
void check_lce_bench_fits(const std::vector<std::string>& impls, const Device& dev, int64_t n, int64_t d, int64_t v,
                          DType dtype, const train::AvailableMemory& available) {
  if (available.bytes < 0) return;
  std::string worst;
  LceBenchEstimate we;
  for (const std::string& impl : impls) {
    const LceBenchEstimate e = estimate_lce_bench(impl, dev, n, d, v, dtype);
    if (worst.empty() || e.total() > we.total()) worst = impl, we = e;
  }
  if (we.total() <= available.bytes) return;
  std::string advice = "Lower --tokens, --vocab or --dim";
  if (worst == "reference" || worst == "gemm_bound") {
    const LceBenchEstimate f = estimate_lce_bench("fused", dev, n, d, v, dtype);
    advice += ", or leave " + worst + " out of --impl (fused alone needs at least " + train::format_bytes(f.total()) +
              (f.total() <= available.bytes ? ", which fits)" : ")");
  }
  if (!dev.is_cuda()) advice += ", or run on a GPU (--device cuda)";
  fail("bench lce: impl ", worst, " at --tokens ", n, " --dim ", d, " --vocab ", v, " (", dtype_name(dtype),
       ") needs at least ", train::format_bytes(we.total()), " of memory on ", dev.str(), ", more than the ",
       train::format_bytes(available.bytes), " available (", available.source, "): inputs ",
       train::format_bytes(we.inputs), ", gradients ", train::format_bytes(we.gradients), ", ", we.buffers_what, " ",
       train::format_bytes(we.buffers), ". ", advice);
}

}  // namespace

int run_bench_lce(const Args& args) {
  std::string device_s = "cpu", dtype_s = "f32", impls;
  int64_t n = 4096, d = 512, v = 32000, iters = 5, warmup = 1, seed = 0, chunk = 0, dh_split = 0, dw_sms = 0;
  double filter_eps = std::ldexp(1.0, -12), logit_std = 1.0;
  bool profile = false;
  ArgParser p("bench lce", "Times forward + backward of linear_cross_entropy (impl 'fused'), of the unfused\n"
                           "linear + cross-entropy composed from core ops (impl 'reference'), of the fused loss\n"
                           "with the gradient filter on (impl 'fused_filter', with its max abs gradient error), of the\n"
                           "fused loss on kiln's Hopper GEMM (impl 'fused_kiln', CUDA, 16-bit)\n"
                           "and of the three plain full-size products alone (impl 'gemm_bound').");
  p.option("--device", &device_s, "DEV", "cpu or cuda[:N]");
  p.option("--tokens", &n, "N", "tokens (rows of hidden)");
  p.option("--dim", &d, "D", "hidden size");
  p.option("--vocab", &v, "V", "vocabulary size");
  p.option("--dtype", &dtype_s, "T", "f32 or bf16 (f16, f64 also accepted)");
  p.option("--iters", &iters, "K", "timed steps (median reported)");
  p.option("--warmup", &warmup, "K", "untimed steps first");
  p.option("--impl", &impls, "LIST",
           "comma-separated: fused, fused_filter, fused_kiln, fused_kiln_filter, gemm_bound, reference (default:\n"
           "fused,reference on the CPU, fused,fused_filter,gemm_bound,reference on CUDA, with fused_kiln for bf16 / f16)");
  p.option("--seed", &seed, "S", "random seed of the inputs");
  p.option("--chunk", &chunk, "M", "fused: tokens per chunk (0: chosen from V and the memory budget)");
  p.option("--dh-split", &dh_split, "S", "fused, CUDA: slices of V for the d_hidden product (0 or 1: unsplit)");
  p.option("--dw-sms", &dw_sms, "K",
           "fused, CUDA, experimental: d_weight product on a side stream on K SMs, concurrent with d_hidden\n"
           "(0: off; not in the --profile step)");
  p.option("--filter-eps", &filter_eps, "E", "fused_filter, fused_kiln_filter: the gradient filter's eps (default 2^-12)");
  p.option("--logit-std", &logit_std, "S",
           "the logits' standard deviation (default 1: a flat softmax; a trained model's is peaked,\n"
           "say 8-12, which is where the gradient filter has entries to drop)");
  p.flag("--profile", &profile,
         "fused, CUDA: one more step timing each phase (logits GEMM, row pass, d_hidden, its reduction,\n"
         "d_weight, d_bias) summed over the chunks; a 'fused_profile' line (also KILN_LCE_PROFILE=1)");
  p.epilog("example: kiln bench lce --device cuda --tokens 16384 --dim 4096 --vocab 128256 --dtype bf16 --profile");
  if (!p.parse(args)) return 0;
  KILN_CHECK(n > 0 && d > 0 && v > 0, "bench lce: --tokens, --dim and --vocab must be > 0");
  KILN_CHECK(iters > 0 && warmup >= 0, "bench lce: --iters must be > 0 and --warmup >= 0");
  KILN_CHECK(filter_eps > 0.0, "bench lce: --filter-eps must be > 0, got ", filter_eps);
  const Device dev = Device::parse(device_s);
  check_device_available(dev, "bench lce");
  const DType dtype = parse_dtype(dtype_s);
  KILN_CHECK(is_floating(dtype), "bench lce: --dtype ", dtype_s, " is not a floating dtype");
  const bool half = dtype == DType::bf16 || dtype == DType::f16;  // fused_kiln's dtypes
  if (!p.given("--impl"))
    impls = !dev.is_cuda() ? "fused,reference"
                           : half ? "fused,fused_filter,fused_kiln,gemm_bound,reference" : "fused,fused_filter,gemm_bound,reference";
  const std::vector<std::string> impl_list =
      parse_impls(impls, {"fused", "fused_filter", "fused_kiln", "fused_kiln_filter", "gemm_bound", "reference"}, "bench lce");
  const bool any_kiln = std::find(impl_list.begin(), impl_list.end(), "fused_kiln") != impl_list.end() ||
                        std::find(impl_list.begin(), impl_list.end(), "fused_kiln_filter") != impl_list.end();
  KILN_CHECK(!any_kiln || (dev.is_cuda() && half),
             "bench lce: impls fused_kiln and fused_kiln_filter need --device cuda and --dtype bf16 or f16");
  KILN_CHECK(logit_std > 0.0 && std::isfinite(logit_std), "bench lce: --logit-std must be > 0, got ", logit_std);
  profile = profile || env_profile();
  check_lce_bench_fits(impl_list, dev, n, d, v, dtype, train::available_memory(dev));

  Generator gen(static_cast<uint64_t>(seed));
  Tensor h = mul(randn({n, d}, gen, DType::f32, dev), 1.0).to(dtype).requires_grad_();
  Tensor w = mul(randn({v, d}, gen, DType::f32, dev), logit_std / std::sqrt(static_cast<double>(d))).to(dtype).requires_grad_();
  Tensor target;
  {
    Tensor u = rand({n}, gen, DType::f64);
    std::vector<int64_t> t(static_cast<size_t>(n));
    auto uv = u.to_vector<double>();
    for (size_t i = 0; i < t.size(); ++i) t[i] = std::min<int64_t>(v - 1, static_cast<int64_t>(uv[i] * v));
    target = from_vector<int64_t>(t, {n}).to(dev);
  }
  const double flops = 6.0 * static_cast<double>(n) * static_cast<double>(v) * static_cast<double>(d);
  LinearCrossEntropyOptions base_opts;
  base_opts.chunk_tokens = chunk;
  base_opts.dh_split = dh_split;
  base_opts.dw_sms = dw_sms;

  std::fprintf(stderr, "%-12s %-6s %-6s %10s %12s %9s %12s\n", "impl", "device", "dtype", "ms", "peak MiB", "TFLOP/s",
               "loss");
  for (const std::string& impl : impl_list) {
    LinearCrossEntropyOptions opts = base_opts;
    if (impl == "fused_filter" || impl == "fused_kiln_filter") opts.filter_eps = filter_eps;
    if (impl == "fused_kiln" || impl == "fused_kiln_filter") opts.gemm_backend = kernels::gemm::Backend::kiln;
    std::function<Tensor()> step;
    if (impl == "gemm_bound") {
      // The three products of a training step at full size, nothing else: logits = h·Wᵀ,
      // d_hidden = logits·W (K = V), d_weight = logitsᵀ·h (K = N).
      step = [&]() {
        NoGradGuard ng;
        Tensor logits = Tensor::empty({n, v}, dtype, dev);
        Tensor gh = Tensor::empty({n, d}, dtype, dev), gw = Tensor::empty({v, d}, dtype, dev);
        kernels::GemmArgs a;
        a.m = n, a.n = v, a.k = d, a.trans_b = true;
        KILN_DEVICE_CALL(dev, gemm, a, logits, h, w);
        kernels::GemmArgs b;
        b.m = n, b.n = d, b.k = v;
        KILN_DEVICE_CALL(dev, gemm, b, gh, logits, w);
        kernels::GemmArgs c;
        c.m = v, c.n = d, c.k = n, c.trans_a = true;
        KILN_DEVICE_CALL(dev, gemm, c, gw, logits, h);
        return Tensor();
      };
    } else {
      step = [&]() {
        Tensor loss = impl == "reference" ? linear_cross_entropy_reference(h, w, target).loss
                                          : linear_cross_entropy(h, w, target, opts).loss;
        loss.backward();
        return loss.detach();
      };
    }
    double loss_value = 0;
    auto value_of = [&](const Tensor& l) { return l.defined() ? l.item() : 0.0; };
    for (int64_t i = 0; i < warmup; ++i) {
      h.set_grad(Tensor());
      w.set_grad(Tensor());
      loss_value = value_of(step());
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
      loss_value = value_of(last);
    }
    h.set_grad(Tensor());
    w.set_grad(Tensor());
    const double ms = median(times);
    json::Value r = base_record(impl, dev, n, d, v, dtype);
    r["ms_median"] = ms;
    r["logit_std"] = logit_std;
    r["peak_bytes"] = peak;
    r["tflops"] = flops / (ms * 1e-3) / 1e12;
    r["iters"] = iters;
    if (impl != "gemm_bound") r["loss"] = loss_value;
    if (impl == "fused_filter" || impl == "fused_kiln" || impl == "fused_kiln_filter") {
      // The filter's (kiln GEMM's) effect on the gradients: max abs difference to the fused run.
      auto grads = [&](const LinearCrossEntropyOptions& o) {
        h.set_grad(Tensor());
        w.set_grad(Tensor());
        linear_cross_entropy(h, w, target, o).loss.backward();
        std::pair<Tensor, Tensor> g{h.grad(), w.grad()};
        h.set_grad(Tensor());
        w.set_grad(Tensor());
        return g;
      };
      auto [fh, fw] = grads(opts);
      auto [uh, uw] = grads(base_opts);
      if (impl != "fused_kiln") r["filter_eps"] = filter_eps;
      json::Value err = json::Value::object();
      err["hidden"] = max_abs_diff(fh, uh);
      err["weight"] = max_abs_diff(fw, uw);
      r["grad_max_abs_err"] = std::move(err);
      json::Value mag = json::Value::object();
      mag["hidden"] = max_abs_of(uh);
      mag["weight"] = max_abs_of(uw);
      r["grad_max_abs"] = std::move(mag);
    }
    print_record(r);
    std::fprintf(stderr, "%-12s %-6s %-6s %10.2f %12.1f %9.2f %12.6f\n", impl.c_str(), dev.str().c_str(),
                 dtype_name(dtype), ms, static_cast<double>(peak) / (1024.0 * 1024.0), flops / (ms * 1e-3) / 1e12,
                 loss_value);
    if ((impl == "fused" || impl == "fused_kiln" || impl == "fused_kiln_filter") && profile && dev.is_cuda()) {
      kernels::LceProfile prof;
      LinearCrossEntropyOptions po = opts;
      po.profile = &prof;
      h.set_grad(Tensor());
      w.set_grad(Tensor());
      const double total = bench_time_ms(dev, [&] { linear_cross_entropy(h, w, target, po).loss.backward(); });
      h.set_grad(Tensor());
      w.set_grad(Tensor());
      json::Value pr = base_record(impl + "_profile", dev, n, d, v, dtype);
      json::Value ph = json::Value::object();
      ph["logits_gemm"] = prof.logits_ms;
      ph["row_pass"] = prof.rows_ms;
      ph["dh_gemm"] = prof.dh_ms;
      ph["dh_reduce"] = prof.dh_reduce_ms;
      ph["dw_gemm"] = prof.dw_ms;
      ph["bias"] = prof.bias_ms;
      pr["phases_ms"] = std::move(ph);
      pr["step_ms"] = total;
      pr["chunks"] = prof.chunks;
      pr["chunk_tokens"] = prof.chunk_tokens;
      pr["dh_split"] = prof.dh_split;
      pr["extra_bytes"] = prof.extra_bytes;
      if (prof.sparse_blocks > 0) {  // the gradient filter on kiln's GEMM: dz's blocks skipped
        pr["sparse_blocks"] = prof.sparse_blocks;
        pr["sparse_zero_blocks"] = prof.sparse_zero_blocks;
      }
      json::Value al = json::Value::object();
      al["logits"] = prof.logits_algo;
      al["dh"] = prof.dh_algo;
      al["dw"] = prof.dw_algo;
      pr["cublaslt_algo"] = std::move(al);
      print_record(pr);
      std::fprintf(stderr,
                   "  profile: logits %.2f  rows %.2f  dh %.2f  dh_reduce %.2f  dw %.2f  bias %.2f  (step %.2f ms; "
                   "%lld chunks of %lld, dh split %lld)\n",
                   prof.logits_ms, prof.rows_ms, prof.dh_ms, prof.dh_reduce_ms, prof.dw_ms, prof.bias_ms, total,
                   static_cast<long long>(prof.chunks), static_cast<long long>(prof.chunk_tokens),
                   static_cast<long long>(prof.dh_split));
    }
  }
  return 0;
}

}  // namespace kiln::cli
