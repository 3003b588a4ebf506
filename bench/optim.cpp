// bench_optim: the optimizer step over a model's parameter list, per-parameter (one kernel per
// parameter, clip_grad_norm_ scaling the gradients in a pass of its own) against multi-tensor
// (one call per device, the clip folded into the update: Optimizer::clip_and_step), on the CPU
// and on each CUDA device. Cases: adamw_step (step() alone) and clip_adamw_step (the trainer's
// clip + step, max_norm 1 so the clip is active, as early in training), each with f32 and bf16
// gradients. The two paths run in alternation (per-parameter, multi-tensor, per-parameter, ...),
// so that a shared machine's changing load falls on both. One JSON object per case on stdout
// (ms_median, GB/s of the memory the update must move, peak_bytes above the inputs over both
// paths, and for multi-tensor cases the speedup: the median of the per-pair time ratios), a
// short table on stderr.
//
// Usage: bench_optim [--model llama1b|llama1.5b|125m|gpt2] [--layers N] [--vocab V]
//                    [--device cpu|cuda|all] [--grad f32|bf16|both] [--iters N]
// llama1b: Llama 3.2 1B's list (hidden 2048, 16 layers, kv 512, SwiGLU 8192, vocabulary 128256,
// tied); llama1.5b: the same untied (issue 35's target); 125m: kiln's preset (hidden 768, 12
// layers, kv 256, SwiGLU 2048, tied); gpt2: GPT-2 small's matrices. --layers and --vocab shrink
// a list to fit a small machine (the per-layer tensors keep their shapes).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

struct ModelShape {
  std::string name;
  int64_t hidden = 0, layers = 0, kv = 0, ffn = 0, vocab = 0;
  bool tied = true, gpt2 = false;
};

ModelShape model_shape(const std::string& m) {
  if (m == "llama1b") return {m, 2048, 16, 512, 8192, 128256, true, false};
  if (m == "llama1.5b") return {m, 2048, 16, 512, 8192, 128256, false, false};
  if (m == "125m") return {m, 768, 12, 256, 2048, 259, true, false};
  if (m == "gpt2") return {m, 768, 12, 768, 3072, 50257, true, true};
  std::fprintf(stderr, "bench_optim: --model %s is not one of llama1b, llama1.5b, 125m, gpt2\n", m.c_str());
  std::exit(2);
}

// The parameter list in the model's order (Llama: nn::LlamaForCausalLM's named_parameters()).
std::vector<std::pair<std::string, Shape>> param_shapes(const ModelShape& s) {
  std::vector<std::pair<std::string, Shape>> out;
  const int64_t d = s.hidden;
  out.push_back({"model.embed_tokens.weight", {s.vocab, d}});
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    out.push_back({pre + "input_layernorm.weight", {d}});
    if (s.gpt2) {
      out.push_back({pre + "attn.qkv.weight", {3 * d, d}});
      out.push_back({pre + "attn.proj.weight", {d, d}});
      out.push_back({pre + "post_attention_layernorm.weight", {d}});
      out.push_back({pre + "mlp.fc.weight", {s.ffn, d}});
      out.push_back({pre + "mlp.out.weight", {d, s.ffn}});
      continue;
    }
    out.push_back({pre + "self_attn.q_proj.weight", {d, d}});
    out.push_back({pre + "self_attn.k_proj.weight", {s.kv, d}});
    out.push_back({pre + "self_attn.v_proj.weight", {s.kv, d}});
    out.push_back({pre + "self_attn.o_proj.weight", {d, d}});
    out.push_back({pre + "post_attention_layernorm.weight", {d}});
    out.push_back({pre + "mlp.gate_proj.weight", {s.ffn, d}});
    out.push_back({pre + "mlp.up_proj.weight", {s.ffn, d}});
    out.push_back({pre + "mlp.down_proj.weight", {d, s.ffn}});
  }
  out.push_back({"model.norm.weight", {d}});
  if (!s.tied) out.push_back({"lm_head.weight", {s.vocab, d}});
  return out;
}

optim::NamedTensors make_params(const ModelShape& s, Device dev, DType grad_dtype) {
  Generator gen(1);
  optim::NamedTensors ps;
  for (const auto& [name, shape] : param_shapes(s)) {
    Tensor p = randn(shape, gen, DType::f32, dev);
    p.requires_grad_();
    p.set_grad(randn(shape, gen, grad_dtype, dev));
    ps.emplace_back(name, p);
  }
  return ps;
}

void sync(const optim::NamedTensors& ps) {
  NoGradGuard ng;
  (void)ps.back().second.detach().flatten().narrow(0, 0, 1).item();
}

double time_ms(const std::function<void()>& f, const optim::NamedTensors& ps) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  sync(ps);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `a` and `b` in alternation (a, b, a, b, ...) after two warm-up calls of each, so that a
// change of load on a shared machine falls on both: the median time of each, and the median of
// the per-pair ratios a/b.
struct Pair {
  double a_ms, b_ms, ratio;
};
Pair time_pair(const std::function<void()>& a, const std::function<void()>& b, const optim::NamedTensors& ps,
               int iters) {
  for (int i = 0; i < 2; ++i) {
    time_ms(a, ps);
    time_ms(b, ps);
  }
  std::vector<double> ta, tb, r;
  for (int i = 0; i < iters; ++i) {
    ta.push_back(time_ms(a, ps));
    tb.push_back(time_ms(b, ps));
    r.push_back(ta.back() / tb.back());
  }
  return {median(ta), median(tb), median(r)};
}

struct Row {
  const char* bench;
  const char* impl;
  Device dev;
  std::string shape;
  int64_t n = 0, tensors = 0;
  DType gd = DType::f32;
  double ms = 0, bytes = 0, speedup = 0;
  int64_t peak = 0;
};

void report(const Row& r) {
  json::Value j = json::Value::object();
  j["bench"] = r.bench;
  j["impl"] = r.impl;
  j["device"] = r.dev.str();
  j["shape"] = r.shape;
  j["params"] = r.n;
  j["tensors"] = r.tensors;
  j["dtype"] = std::string("f32 params, ") + dtype_name(r.gd) + " grads";
  j["ms_median"] = r.ms;
  j["gb_per_s"] = r.bytes / (r.ms * 1e-3) / 1e9;
  j["peak_bytes"] = r.peak;
  if (r.speedup > 0) j["speedup"] = r.speedup;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "%-16s %-13s %-7s %-5s %10lld params %4lld tensors %9.3f ms %7.1f GB/s", r.bench, r.impl,
               r.dev.str().c_str(), dtype_name(r.gd), static_cast<long long>(r.n), static_cast<long long>(r.tensors),
               r.ms, r.bytes / (r.ms * 1e-3) / 1e9);
  if (r.speedup > 0) std::fprintf(stderr, "  x%.3f", r.speedup);
  std::fprintf(stderr, "\n");
}

const char* arg_value(int& i, int argc, char** argv) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "bench_optim: %s needs a value\n", argv[i]);
    std::exit(2);
  }
  return argv[++i];
}

int64_t positive(const char* flag, const char* v) {
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || x <= 0) {
    std::fprintf(stderr, "bench_optim: %s=%s must be a positive integer\n", flag, v);
    std::exit(2);
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama1b", device = "all", grad = "both";
  int64_t layers = -1, vocab = -1, iters = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model") model = arg_value(i, argc, argv);
    else if (a == "--layers") layers = positive("--layers", arg_value(i, argc, argv));
    else if (a == "--vocab") vocab = positive("--vocab", arg_value(i, argc, argv));
    else if (a == "--device") device = arg_value(i, argc, argv);
    else if (a == "--grad") grad = arg_value(i, argc, argv);
    else if (a == "--iters") iters = positive("--iters", arg_value(i, argc, argv));
    else {
      std::fprintf(stderr, "bench_optim: unknown argument '%s' (see the usage at the top of bench/optim.cpp)\n",
                   a.c_str());
      return 2;
    }
  }
  ModelShape shape = model_shape(model);
  if (layers > 0) shape.layers = layers;
  if (vocab > 0) shape.vocab = vocab;
  std::vector<Device> devices;
  if (device == "cpu" || device == "all") devices.push_back(kCPU);
  if (device == "cuda" || device == "all")
    for (int i = 0; i < cuda_device_count(); ++i) devices.push_back(cuda(i));
  if (device != "cpu" && device != "cuda" && device != "all") {
    std::fprintf(stderr, "bench_optim: --device %s is not one of cpu, cuda, all\n", device.c_str());
    return 2;
  }
  std::vector<DType> grads;
  if (grad == "f32" || grad == "both") grads.push_back(DType::f32);
  if (grad == "bf16" || grad == "both") grads.push_back(DType::bf16);
  if (grads.empty()) {
    std::fprintf(stderr, "bench_optim: --grad %s is not one of f32, bf16, both\n", grad.c_str());
    return 2;
  }
  const std::string shape_str = shape.name + " (layers " + std::to_string(shape.layers) + ", vocab " +
                                std::to_string(shape.vocab) + ")";
  for (const Device& dev : devices) {
    for (DType gd : grads) {
      optim::NamedTensors ps = make_params(shape, dev, gd);
      int64_t n = 0;
      for (const auto& [name, p] : ps) n += p.numel();
      optim::AdamW opt(ps, {});
      opt.step();  // allocates the state
      const int it = static_cast<int>(iters > 0 ? iters : dev.is_cpu() ? 5 : 50);
      const int64_t base = memory_stats(dev).current_bytes;
      // The memory a step must move (both paths' GB/s use it): p, m, v read and written, g read;
      // the clip adds one read of g (the norm). The per-parameter clip also reads and writes g
      // once more (its scaling pass), which the figure leaves out.
      const double g_bytes = static_cast<double>(itemsize(gd));
      const double step_bytes = static_cast<double>(n) * (6 * 4 + g_bytes);
      const double clip_bytes = step_bytes + static_cast<double>(n) * g_bytes;
      for (const bool clip : {false, true}) {
        auto run = [&](bool multi) {
          return [&, multi] {
            opt.set_multi_tensor(multi);
            if (clip) opt.clip_and_step(1.0);
            else opt.step();
          };
        };
        reset_peak_memory_stats(dev);
        const Pair t = time_pair(run(false), run(true), ps, it);
        const int64_t peak = memory_stats(dev).peak_bytes - base;
        for (const bool multi : {false, true}) {
          Row r{clip ? "clip_adamw_step" : "adamw_step", multi ? "multi_tensor" : "per_parameter", dev, shape_str};
          r.n = n;
          r.tensors = static_cast<int64_t>(ps.size());
          r.gd = gd;
          r.ms = multi ? t.b_ms : t.a_ms;
          r.bytes = clip ? clip_bytes : step_bytes;
          r.peak = peak;  // of both paths together
          if (multi) r.speedup = t.ratio;
          report(r);
        }
      }
    }
  }
  return 0;
}
