// `kiln bench attention`: times flex_attention against the
// dense reference path built from kiln ops (matmul + mask + softmax + matmul, autograd by the
// engine) at one shape and mask. One JSON line per implementation on stdout (bench, impl, device,
// shape, dtype, mask, backend_requested (flex), ms_median, peak_bytes, extra_peak_bytes, tflops
// counted on the unmasked (q, kv) pairs: forward 4·pairs·D, backward 10·pairs·D; with
// --backward ms_median and tflops are forward + backward's, and bwd_ms_median / bwd_tflops the
// backward's alone, timed on its own after each of `iters` untimed forwards), a table on
// stderr. --score-mod times flex with a library score_mod (softcap:C or alibi; masks none or
// causal, the pairs instantiated for them) or, given an expression, a run-time one
// (attention/runtime_mods.h, compiled by the JIT before the timing); --mask-mod EXPR a run-time
// mask (its flops counted on the tiles the kernels visit); --captures FILE their tensors.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "cli/args.h"
#include "cli/bench.h"
#include "cli/commands.h"
#include "kiln/attention/flex_attention.h"
#include "kiln/attention/reference.h"
#include "kiln/attention/runtime_mods.h"
#include "kiln/core/allocator.h"
#include "kiln/io/json.h"
#include "kiln/io/safetensors.h"

namespace kiln::cli {
namespace {

using namespace kiln::attention;

// Unmasked (q, kv) pairs of one head, in closed form per row.
double count_pairs(const MaskSpec& m, int64_t L, int64_t S, int64_t doc_len) {
  double n = 0;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t causal = std::min(i + 1, S);
    switch (m.kind) {
      case MaskSpec::Kind::none: n += static_cast<double>(S); break;
      case MaskSpec::Kind::causal: n += static_cast<double>(causal); break;
      case MaskSpec::Kind::sliding_window: n += static_cast<double>(std::min(causal, m.window)); break;
      case MaskSpec::Kind::document: n += static_cast<double>(std::min(causal, i - (i / doc_len) * doc_len + 1)); break;
    }
  }
  return n;
}

void sync(const Tensor& t) {
  if (t.is_cuda() && t.numel() > 0) (void)t.view({t.numel()}).select(0, 0).item();
}

}  // namespace

int run_bench_attention(const Args& args) {
  std::string device_s = "cpu", mask_s = "causal", dtype_s = "f32", impls = "flex,reference", backend_s = "auto";
  std::string score_s = "none", mask_mod_s, captures_s;
  int64_t B = 1, H = 8, S = 2048, D = 64, iters = 5, warmup = 1, block = kDefaultBlockSize;
  bool backward = false;
  ArgParser p("bench attention", "Time flex_attention against the dense reference path (kiln ops).");
  p.option("--device", &device_s, "DEV", "cpu or cuda[:N]")
      .option("--batch", &B, "B", "batch size")
      .option("--heads", &H, "H", "heads (q and kv)")
      .option("--seq", &S, "S", "sequence length (L = S)")
      .option("--head-dim", &D, "D", "head dimension")
      .option("--mask", &mask_s, "MASK", "none, causal, window:W (causal, W tokens back) or document:N (causal in N-token documents)")
      .option("--score-mod", &score_s, "MOD",
              "none, softcap:C (C·tanh(s/C), as Gemma 2) or alibi (the paper's per-head slopes); with --mask none "
              "or causal and --impl flex (the reference path has no score_mod), or a C++ expression over score, b, h, "
              "q_idx, kv_idx (a run-time mod, docs/jit.md)")
      .option("--mask-mod", &mask_mod_s, "EXPR",
              "a run-time mask_mod: a C++ expression over b, h, q_idx, kv_idx (replaces --mask; flex only)")
      .option("--captures", &captures_s, "FILE", "a safetensors file whose tensors the expressions name (captures)")
      .option("--dtype", &dtype_s, "DT", "f32, bf16 or f16")
      .option("--block", &block, "N", "BlockMask block size")
      .option("--iters", &iters, "N", "timed runs (median reported)")
      .option("--warmup", &warmup, "N", "untimed runs first")
      .option("--impl", &impls, "LIST", "comma-separated: flex, reference")
      .option("--backend", &backend_s, "NAME",
              "flex's CUDA kernels: auto (the fastest that applies), hopper, sm80 or simt (an error where they do not apply)")
      .flag("--backward", &backward, "time forward + backward, and the backward alone (bwd_ms_median)");
  if (!p.parse(args)) return 0;
  KILN_CHECK(B >= 1 && H >= 1 && S >= 1 && D >= 1, "bench attention: --batch, --heads, --seq and --head-dim must be "
             "positive, got ", B, ", ", H, ", ", S, ", ", D);
  KILN_CHECK(iters >= 1 && warmup >= 0, "bench attention: --iters must be >= 1 and --warmup >= 0, got ", iters, " and ",
             warmup);
  const Device dev = Device::parse(device_s);
  check_device_available(dev, "bench attention");
  const DType dt = parse_dtype(dtype_s);
  KILN_CHECK(dt == DType::f32 || dt == DType::bf16 || dt == DType::f16,
             "bench attention: --dtype must be f32, bf16 or f16, got '", dtype_s, "'");
  const std::vector<std::string> impl_list = parse_impls(impls, {"flex", "reference"}, "bench attention");
  FlexOptions flex_options;
  flex_options.backend = parse_flex_backend(backend_s, "--backend");
  MaskSpec spec = parse_mask_spec(mask_s, S, dev);
  spec.block_size = block;
  int64_t doc_len = 1;
  if (spec.kind == MaskSpec::Kind::document) doc_len = std::stoll(mask_s.substr(9));
  const double pairs = count_pairs(spec, S, S, doc_len) * static_cast<double>(B * H);
  const double flops = pairs * static_cast<double>(D) * (backward ? 14.0 : 4.0);
  const std::string shape = "B=" + std::to_string(B) + ",H=" + std::to_string(H) + ",S=" + std::to_string(S) +
                            ",D=" + std::to_string(D);

  const bool runtime_score = score_s != "none" && score_s != "alibi" && score_s.rfind("softcap:", 0) != 0;
  const bool runtime = runtime_score || !mask_mod_s.empty();
  const bool score = score_s != "none" && !runtime;
  if (runtime)
    KILN_CHECK(impl_list == std::vector<std::string>{"flex"},
               "bench attention: run-time mods (--score-mod EXPR, --mask-mod) time flex only; pass --impl flex");
  if (score) {
    KILN_CHECK(spec.kind == MaskSpec::Kind::none || spec.kind == MaskSpec::Kind::causal,
               "bench attention: --score-mod runs with --mask none or causal, got '", mask_s, "'");
    KILN_CHECK(impl_list == std::vector<std::string>{"flex"},
               "bench attention: --score-mod times flex only (the reference path has no score_mod); pass --impl flex");
  }

  Generator gen(0);
  Tensor q = randn({B, H, S, D}, gen, DType::f32, dev).to(dt), k = randn({B, H, S, D}, gen, DType::f32, dev).to(dt),
         v = randn({B, H, S, D}, gen, DType::f32, dev).to(dt), dout = randn({B, H, S, D}, gen, DType::f32, dev).to(dt);
  AnyBlockMask bm = create_block_mask(spec, S, S, dev);
  // flex's output for (q, k, v): the MaskSpec path, or a typed score_mod with its mask.
  std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)> flex = [&](const Tensor& q_, const Tensor& k_,
                                                                             const Tensor& v_) {
    return flex_attention(q_, k_, v_, bm, flex_options).out;
  };
  Tensor slopes;  // alibi's per-head slopes on the device, alive while flex runs
  if (score) {
    // The typed call on bm's layout (none or causal, built above).
    auto with_mask = [&]<class SM>(SM sm) -> decltype(flex) {
      auto typed = [&]<class MM>(MM mm) -> decltype(flex) {
        const BlockMask<MM> m{mm, bm.layout};
        return [=](const Tensor& q_, const Tensor& k_, const Tensor& v_) {
          return flex_attention(q_, k_, v_, sm, m, flex_options).out;
        };
      };
      return spec.kind == MaskSpec::Kind::causal ? typed(Causal{}) : typed(NoMask{});
    };
    if (score_s.rfind("softcap:", 0) == 0) {
      char* end = nullptr;
      const std::string tail = score_s.substr(8);
      const float cap = std::strtof(tail.c_str(), &end);
      KILN_CHECK(!tail.empty() && end && *end == '\0' && cap > 0 && std::isfinite(cap),
                 "bench attention: --score-mod softcap:C needs a positive number C, got '", score_s, "'");
      flex = with_mask(Softcap{cap});
    } else if (score_s == "alibi") {
      std::vector<float> sl(static_cast<size_t>(H));
      alibi_slopes(static_cast<int>(H), sl.data());
      slopes = from_vector(sl, {H}, dev);
      flex = with_mask(Alibi{slopes.data<float>()});
    } else {
      KILN_CHECK(false, "bench attention: --score-mod must be none, softcap:C or alibi, got '", score_s, "'");
    }
  }
  double runtime_pairs = pairs;
  if (runtime) {  // run-time mods: compiled (or loaded from the cache) here, before the timing
    const Captures file = captures_s.empty() ? Captures{} : io::load_safetensors(captures_s);
    Captures dev_file;
    for (const auto& [name, t] : file) dev_file.emplace_back(name, t.to(dev));
    const RuntimeScoreMod sm(runtime_score ? score_s : "score", captures_named_in(runtime_score ? score_s : "", dev_file));
    std::string mexpr = mask_mod_s;
    if (mexpr.empty()) {
      KILN_CHECK(spec.kind == MaskSpec::Kind::none || spec.kind == MaskSpec::Kind::causal,
                 "bench attention: a run-time --score-mod runs with --mask none or causal, or with --mask-mod EXPR");
      mexpr = spec.kind == MaskSpec::Kind::causal ? "q_idx >= kv_idx" : "true";
    }
    const RuntimeMaskMod mm(mexpr, captures_named_in(mexpr, dev_file));
    for (const jit::Ticket& t : precompile_flex(sm, mm, dt, dev, backward)) t.wait();
    const auto rbm = std::make_shared<RuntimeBlockMask>(create_block_mask(mm, 1, 1, S, S, block, block, dev));
    if (!mask_mod_s.empty()) {
      double visited = 0;
      for (const Tensor* t : {&rbm->layout.kv_num_blocks, &rbm->layout.full_kv_num_blocks})
        for (int32_t n : t->to_vector<int32_t>()) visited += n;
      runtime_pairs = visited * static_cast<double>(block * block) * static_cast<double>(B * H);
    }
    flex = [=](const Tensor& q_, const Tensor& k_, const Tensor& v_) {
      return flex_attention(q_, k_, v_, sm, *rbm, flex_options).out;
    };
  }
  const double flops_used = runtime ? runtime_pairs * static_cast<double>(D) * (backward ? 14.0 : 4.0) : flops;
  Tensor drop;  // the reference's element mask (true = masked out), built only when it runs

  std::fprintf(stderr, "%-10s %-6s %-28s %-6s %-14s %10s %14s %9s%s\n", "impl", "device", "shape", "dtype", "mask",
               "ms_median", "peak_bytes", "tflops", backward ? "  bwd_ms_median bwd_tflops" : "");
  for (const std::string& impl : impl_list) {
    if (impl == "reference" && !drop.defined() && spec.kind != MaskSpec::Kind::none) {
      std::vector<uint8_t> d(static_cast<size_t>(S * S));
      for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < S; ++j) {
          bool keep = j <= i;
          if (spec.kind == MaskSpec::Kind::sliding_window) keep = keep && i - j < spec.window;
          if (spec.kind == MaskSpec::Kind::document) keep = keep && i / doc_len == j / doc_len;
          d[static_cast<size_t>(i * S + j)] = !keep;
        }
      drop = from_vector(d, {S, S}, dev).to(DType::boolean);
    }
    // The forward on fresh leaves (requiring gradients with --backward): its output and q.
    auto forward = [&] {
      Tensor qg = q.detach(), kg = k.detach(), vg = v.detach();
      if (backward) qg.requires_grad_(), kg.requires_grad_(), vg.requires_grad_();
      Tensor out = impl == "flex" ? flex(qg, kg, vg) : dense_attention_ops(qg, kg, vg, drop, 1.0 / std::sqrt(double(D)));
      return std::pair{out, qg};
    };
    // One forward (+ backward). A timed run is only enqueued: on CUDA bench_time_ms's end event
    // waits for it, as the peers' script times theirs (events around the calls, then a sync); a
    // host sync inside the timed region added a one-element copy back and a host round trip to
    // every time. `wait` syncs it (the untimed runs).
    auto once = [&](bool wait) {
      auto run = forward();
      if (backward) run.first.backward(dout);
      if (wait) sync(backward ? run.second.grad() : run.first);
    };
    for (int64_t i = 0; i < warmup; ++i) once(true);
    const int64_t base = memory_stats(dev).current_bytes;
    reset_peak_memory_stats(dev);
    std::vector<double> ms;
    for (int64_t i = 0; i < iters; ++i) ms.push_back(bench_time_ms(dev, [&] { once(false); }));
    const double med = median(ms);
    const int64_t peak = memory_stats(dev).peak_bytes;
    std::vector<double> bwd_ms;  // --backward: each backward timed alone, after an untimed forward
    if (backward)
      for (int64_t i = 0; i < iters; ++i) {
        auto run = forward();
        sync(run.first);
        bwd_ms.push_back(bench_time_ms(dev, [&] { run.first.backward(dout); }));
      }
    json::Value o = json::Value::object();
    o["bench"] = "attention";
    o["impl"] = impl;
    o["device"] = dev.str();
    o["shape"] = shape;
    o["dtype"] = dtype_name(dt);
    o["mask"] = mask_mod_s.empty() ? mask_s : mask_mod_s;
    if (score || runtime_score) o["score_mod"] = score_s;
    if (runtime) o["runtime_mods"] = true;
    if (impl == "flex")  // the family asked for (--backend or KILN_FLEX_KERNEL); auto: the fastest that applies
      o["backend_requested"] = flex_backend_name(attention::detail::resolve_backend(flex_options.backend, dev));
    o["backward"] = backward;
    o["ms_median"] = med;
    o["peak_bytes"] = peak;
    o["extra_peak_bytes"] = peak - base;
    const double tflops = flops_used / (med * 1e-3) / 1e12;
    o["tflops"] = tflops;
    const double bwd_med = backward ? median(bwd_ms) : 0.0;
    const double bwd_tflops =
        backward ? (runtime ? runtime_pairs : pairs) * static_cast<double>(D) * 10.0 / (bwd_med * 1e-3) / 1e12 : 0.0;
    if (backward) o["bwd_ms_median"] = bwd_med, o["bwd_tflops"] = bwd_tflops;
    o["iters"] = iters;
    print_record(o);
    std::fprintf(stderr, "%-10s %-6s %-28s %-6s %-14s %10.3f %14lld %9.4f", impl.c_str(), dev.str().c_str(),
                 shape.c_str(), dtype_name(dt), (mask_mod_s.empty() ? mask_s : std::string("(mask-mod)")).c_str(), med,
                 static_cast<long long>(peak), tflops);
    if (backward) std::fprintf(stderr, "  %13.3f %10.4f", bwd_med, bwd_tflops);
    std::fprintf(stderr, "\n");
  }
  return 0;
}

}  // namespace kiln::cli
