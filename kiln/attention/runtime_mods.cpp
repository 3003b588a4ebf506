// Run-time mods: capture checks, the JIT kernels (looked up in and added to the KernelRegistry),
// the forward with its recorded backward, and the run-time BlockMask.
#include "kiln/attention/runtime_mods.h"

#include <array>
#include <cctype>
#include <tuple>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/kernel_registry.h"
#include "kiln/jit/cpu_backend.h"
#include "kiln/jit/cuda_backend.h"
#include "kiln/jit/expr_prelude.h"
#include "kiln/jit/flex_source.h"
#include "kiln/jit/sha256.h"
#include "kiln/kernels/flex_hopper.h"

namespace kiln::attention {
namespace {

using jit::expr::CaptureArg;
using FlexJitEntry = int (*)(const kernels::FlexParams*, const CaptureArg*, char*, int);
using ClassifyJitEntry = int (*)(const CaptureArg*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint8_t*,
                                 char*, int);

// A mod's captures, checked and laid out for the kernels (contiguous, ids as i32).
struct BoundCaptures {
  std::vector<Tensor> tensors;
  std::vector<jit::CaptureSig> sigs;
};

BoundCaptures bind_captures(const char* kind, const Captures& caps, Device device, bool allow_grad) {
  BoundCaptures out;
  for (const auto& [name, t] : caps) {
    KILN_CHECK(t.defined(), kind, ": capture '", name, "' is an undefined tensor");
    KILN_CHECK(t.device() == device, kind, ": capture '", name, "' is on ", t.device().str(), " but q is on ",
               device.str());
    KILN_CHECK(t.dim() >= 1 && t.dim() <= 4, kind, ": capture '", name, "' must have 1 to 4 dims, got ",
               shape_str(t.shape()));
    const bool is_int = is_integral(t.dtype());
    KILN_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::i32 || t.dtype() == DType::i64, kind, ": capture '",
               name, "' must be f32 (values) or i32 / i64 (ids), got ", dtype_name(t.dtype()));
    const bool learn = allow_grad && t.requires_grad() && grad_enabled();
    KILN_CHECK(!t.requires_grad() || allow_grad || !grad_enabled(), kind, ": capture '", name,
               "' requires grad, but only a score_mod's captures can have a gradient");
    Tensor c = t.dtype() == DType::i64 ? t.to(DType::i32) : t;
    out.tensors.push_back(c.contiguous());
    out.sigs.push_back(jit::CaptureSig{name, is_int, static_cast<int>(t.dim()), learn});
  }
  return out;
}

std::vector<CaptureArg> capture_args(const std::vector<Tensor>& tensors, std::vector<int32_t>& flags) {
  flags.assign(tensors.size(), 0);
  std::vector<CaptureArg> args(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    CaptureArg& a = args[i];
    a.data = t.data_ptr();
    for (int d = 0; d < 4; ++d) {
      a.sizes[d] = d < t.dim() ? t.size(d) : 1;
      a.strides[d] = d < t.dim() ? t.stride(d) : 0;
    }
    a.rank = static_cast<int32_t>(t.dim());
    a.is_int = is_integral(t.dtype());
    a.flag = &flags[i];
  }
  return args;
}

void check_flags(const std::vector<int32_t>& flags, const std::vector<std::pair<std::string, Tensor>>& named) {
  for (size_t i = 0; i < flags.size(); ++i)
    KILN_CHECK(flags[i] == 0, "flex_attention: capture '", named[i].first, "' ", shape_str(named[i].second.shape()),
               " was indexed out of range by its mod's expression (a mod is evaluated on masked pairs too, so its "
               "reads must be in range for every 0 <= q_idx < q_len, 0 <= kv_idx < kv_len)");
}

// What a flex kernel's generated source is made from besides its family, storage and options:
// the pair's expressions and capture signatures. The in-process registry keys on its digest, so a
// call finds its kernel without generating the source again (the disk cache keys on the source
// itself, kiln/jit/cache.h).
std::string pair_digest(const jit::ModSpec& s, const jit::ModSpec& m) {
  std::string t;
  for (const jit::ModSpec* x : {&s, &m}) {
    t += x->kind + '\x1f' + x->expr + '\x1f' + x->dscore;
    for (const auto& c : x->captures)
      t += '\x1f' + c.name + (c.is_int ? ":i" : ":f") + std::to_string(c.rank) + (c.learnable ? "g" : "");
    t += '\x1e';
  }
  return jit::sha256_hex(t);
}
KernelKey jit_key(const std::string& family, const std::string& dtype, const jit::CompileRequest& req) {
  return KernelKey{family, "cpu", dtype, 0, jit::sha256_hex(req.source), "jit"};
}
// Compiles (or loads from the disk cache) the kernel of `req` here, on the calling thread, and
// hands a flex kernel kiln's own tile products (kiln_flex_link, kiln/jit/flex_source.cpp).
KernelEntry load_entry(const std::string& family, const jit::CompileRequest& req, const jit::CancelToken* tok) {
  jit::LoadedModule m = jit::compile_cpu(req, tok);
  if (family != "flex_classify") {
    namespace fd = kernels::cpu::flex_detail;
    void* const fns[] = {reinterpret_cast<void*>(&fd::tile_abt),    reinterpret_cast<void*>(&fd::tile_ax),
                         reinterpret_cast<void*>(&fd::tile_atx),    reinterpret_cast<void*>(&fd::row_dot),
                         reinterpret_cast<void*>(&fd::row_max),     reinterpret_cast<void*>(&fd::row_exp_sum),
                         reinterpret_cast<void*>(&fd::row_softmax_grad)};
    reinterpret_cast<void (*)(void* const*)>(jit::module_symbol(m, "kiln_flex_link"))(fns);
  }
  const std::string sym = "kiln_" + family;
  return KernelEntry{jit::module_symbol(m, sym.c_str()), m.handle, "jit cpu " + m.key};
}
// The JIT kernel of `family` under `key`: from the registry, else make_request()'s compiled in
// the pool.
template <class MakeRequest>
KernelEntry jit_entry(const std::string& family, const KernelKey& key, MakeRequest&& make_request) {
  return KernelRegistry::global().get_or_make(key, [&] {
    const jit::CompileRequest req = make_request();
    KernelEntry e;
    jit::CompileService::global()
        .submit(req.name, [&](const jit::CancelToken& tok) { e = load_entry(family, req, &tok); })
        .wait();
    return e;
  });
}
KernelEntry jit_entry(const std::string& family, const std::string& dtype, const jit::CompileRequest& req) {
  return jit_entry(family, jit_key(family, dtype, req), [&] { return req; });
}

jit::ModSpec score_spec(const RuntimeScoreMod& sm, const BoundCaptures& c) {
  return jit::ModSpec{"score_mod", sm.expr, sm.dscore, c.sigs};
}
jit::ModSpec mask_spec(const RuntimeMaskMod& mm, const BoundCaptures& c) {
  return jit::ModSpec{"mask_mod", mm.expr, "", c.sigs};
}

const char* flex_family(bool backward) { return backward ? "flex_backward" : "flex_forward"; }
// The name a compilation shows while it runs: "flex_forward hopper bf16 (score | q_idx >= kv_idx)".
std::string flex_name(bool backward, const std::string& kind, const std::string& storage, const jit::ModSpec& s,
                      const jit::ModSpec& m) {
  return std::string(flex_family(backward)) + kind + " " + storage + " (" + s.expr + " | " + m.expr + ")";
}
const std::vector<std::string> kFlexUserFiles{"score_mod", "score_mod_derivative", "mask_mod"};

jit::CompileRequest flex_request(const jit::ModSpec& s, const jit::ModSpec& m, DType dt, bool backward) {
  return jit::CompileRequest{flex_name(backward, "", dtype_name(dt), s, m),
                             jit::flex_cpu_source(s, m, dtype_name(dt), backward), kFlexUserFiles};
}
KernelKey cpu_flex_key(const jit::ModSpec& s, const jit::ModSpec& m, DType dt, bool backward) {
  return KernelKey{flex_family(backward), "cpu", dtype_name(dt), 0, pair_digest(s, m), "jit"};
}
// The CPU kernel of a run-time pair, keyed by the pair (no source generated once it is loaded).
KernelEntry cpu_flex_entry(const jit::ModSpec& s, const jit::ModSpec& m, DType dt, bool backward) {
  return jit_entry(flex_family(backward), cpu_flex_key(s, m, dt, backward),
                   [&] { return flex_request(s, m, dt, backward); });
}
// The SIMT CUDA kernels' request (f32, bf16 or f16 storage; head dims up to maxd).
jit::CompileRequest cuda_flex_request(const jit::ModSpec& s, const jit::ModSpec& m, int maxd, bool backward,
                                      const std::string& storage) {
  return jit::CompileRequest{flex_name(backward, " cuda", storage, s, m),
                             jit::flex_cuda_source(s, m, maxd, backward, storage), kFlexUserFiles};
}
// The Hopper kernels' request (the built-in templates with the generated functors).
jit::CompileRequest hopper_flex_request(const jit::ModSpec& s, const jit::ModSpec& m, int head_dim, bool backward,
                                        const std::string& storage) {
  return jit::CompileRequest{flex_name(backward, " hopper", storage, s, m), jit::flex_hopper_source(s, m, storage),
                             kFlexUserFiles, jit::flex_hopper_kernels(head_dim, backward, storage)};
}

void require_cpu(Device d) {
  KILN_CHECK(d.is_cpu(), "flex_attention: run-time mods run on the CPU in this build; on ", d.str(),
             " use a library mod (docs/jit.md says where the CUDA path stands)");
}

void call_flex(const KernelEntry& e, const kernels::FlexParams& p, const std::vector<CaptureArg>& args) {
  char err[1024] = {0};
  const int rc = reinterpret_cast<FlexJitEntry>(e.fn)(&p, args.data(), err, sizeof err);
  KILN_CHECK(rc == 0, "flex_attention (", e.origin, "): ", err);
}

}  // namespace

namespace {
// The tile classes of a run-time mask on a GPU: the NVRTC classifier (kiln/jit/cuda_backend.h),
// one thread per tile, launched with the driver on the thread's current stream (where kiln's work
// on the device is) and read back by the copy.
std::vector<uint8_t> classify_on_gpu(const jit::ModSpec& spec, const std::vector<Tensor>& caps, const Captures& named,
                                     int64_t Bm, int64_t Hm, int64_t L, int64_t S, int64_t qb, int64_t kb,
                                     Device device) {
  KILN_CHECK(static_cast<int>(caps.size()) <= jit::kMaxCudaCaptures, "create_block_mask: at most ",
             jit::kMaxCudaCaptures, " captures on CUDA");
  const jit::CompileRequest req{"create_block_mask cuda (" + spec.expr + ")", jit::classify_cuda_source(spec),
                                {"mask_mod"}};
  const KernelKey key{"flex_classify", "cuda", "*", 0, jit::sha256_hex(req.source), "jit " + device.str()};
  const KernelEntry e = KernelRegistry::global().get_or_make(key, [&] {
    jit::Cubin cubin;  // compiled in the pool, loaded here (this thread has the device's context current)
    jit::CompileService::global()
        .submit(req.name, [&](const jit::CancelToken& tok) { cubin = jit::compile_cuda(req, "sm_90a", &tok); })
        .wait();
    const jit::CudaFunction f = jit::load_cuda_function(cubin, "kiln_flex_classify");
    return KernelEntry{f.function, f.library, "jit cuda " + cubin.key};
  });
  const int64_t n = Bm * Hm * ((L + qb - 1) / qb) * ((S + kb - 1) / kb);
  Tensor out = Tensor::empty({std::max<int64_t>(n, 1)}, DType::u8, device);
  Tensor flags = zeros({std::max<int64_t>(static_cast<int64_t>(caps.size()), 1)}, DType::i32, device);
  std::vector<int32_t> unused;
  struct Args {
    CaptureArg a[jit::kMaxCudaCaptures];
  } args{};
  const auto host_args = capture_args(caps, unused);
  for (size_t i = 0; i < host_args.size(); ++i) {
    args.a[i] = host_args[i];
    args.a[i].flag = flags.data<int32_t>() + i;
  }
  if (n > 0) {
    uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
    void* params[] = {&args, &Bm, &Hm, &L, &S, &qb, &kb, &o};
    jit::launch_cuda(const_cast<void*>(e.fn), static_cast<unsigned>((n + 255) / 256), 1, 1, 256, params,
                     current_stream(device), "create_block_mask (run-time mask on CUDA)");
  }
  check_flags(flags.to(kCPU).to_vector<int32_t>(), named);
  std::vector<uint8_t> cls = out.to(kCPU).to_vector<uint8_t>();
  cls.resize(static_cast<size_t>(n));
  return cls;
}
// The CUDA kernels of a run-time pair (the SIMT bodies on f32, bf16 or f16 storage;
// kiln/jit/flex_source.h), compiled in the pool and loaded on this thread: fwd {kiln_flex_fwd},
// bwd {delta, dq, dkdv}.
std::shared_ptr<jit::CudaFunctions> cuda_flex_kernels(const jit::ModSpec& s, const jit::ModSpec& m, int maxd,
                                                      bool backward, Device device, DType dt, bool learn) {
  const std::string storage = dtype_name(dt);
  const KernelKey key{flex_family(backward), "cuda", storage, maxd, pair_digest(s, m), "jit " + device.str()};
  const KernelEntry e = KernelRegistry::global().get_or_make(key, [&] {
    const jit::CompileRequest req = cuda_flex_request(s, m, maxd, backward, storage);
    jit::Cubin cubin;
    jit::CompileService::global()
        .submit(req.name, [&](const jit::CancelToken& tok) { cubin = jit::compile_cuda(req, "sm_90a", &tok); })
        .wait();
    auto f = std::make_shared<jit::CudaFunctions>(jit::load_cuda_functions(
        cubin, !backward ? std::vector<std::string>{"kiln_flex_fwd"}
               : learn   ? std::vector<std::string>{"kiln_flex_delta", "kiln_flex_dq", "kiln_flex_dkdv",
                                                  "kiln_flex_dcap_partial", "kiln_flex_dcap_reduce"}
                         : std::vector<std::string>{"kiln_flex_delta", "kiln_flex_dq", "kiln_flex_dkdv"}));
    return KernelEntry{f.get(), f, "jit cuda " + cubin.key};
  });
  return std::shared_ptr<jit::CudaFunctions>(e.keep, static_cast<jit::CudaFunctions*>(const_cast<void*>(e.fn)));
}

// Whether the automatic backend runs run-time mods on the Hopper kernels: not until
// JitNvrtc.HopperRunTimeModsGiveTheBuiltinBits has passed on a GPU (on the H200 its mask cases
// did; ALiBi's, mended since by rounding scale · dot alone, waits for a rerun);
// until then they run when asked for (FlexOptions::backend = hopper, KILN_FLEX_KERNEL=hopper).
constexpr bool kRuntimeHopperByDefault = false;

// The Hopper kernels of a run-time pair (the built-in kernels' templates instantiated with the
// generated functors through NVRTC, kiln/jit/flex_source.h), compiled in the pool, loaded on this
// thread, their shared memory allowed: fwd {forward}, bwd {dQ, dK/dV}.
std::shared_ptr<jit::CudaFunctions> hopper_flex_kernels(const jit::ModSpec& s, const jit::ModSpec& m,
                                                        const kernels::FlexHopperPlan& plan, bool backward,
                                                        Device device, DType dt) {
  const std::string storage = dtype_name(dt);
  const KernelKey key{flex_family(backward) + std::string("_hopper"), "cuda", storage, plan.head_dim,
                      pair_digest(s, m), "jit " + device.str()};
  const KernelEntry e = KernelRegistry::global().get_or_make(key, [&] {
    const jit::CompileRequest req = hopper_flex_request(s, m, plan.head_dim, backward, storage);
    jit::Cubin cubin;
    jit::CompileService::global()
        .submit(req.name, [&](const jit::CancelToken& tok) { cubin = jit::compile_cuda(req, "sm_90a", &tok); })
        .wait();
    auto f = std::make_shared<jit::CudaFunctions>(jit::load_cuda_functions(cubin, cubin.lowered_names));
    const kernels::FlexHopperLaunch* launches[] = {backward ? &plan.dq : &plan.fwd, &plan.dkdv};
    for (size_t i = 0; i < f->functions.size(); ++i)
      jit::allow_dynamic_smem(f->functions[i], static_cast<int>(launches[i]->smem), "flex_attention (Hopper, run-time mods)");
    return KernelEntry{f.get(), f, "jit cuda hopper " + cubin.key};
  });
  return std::shared_ptr<jit::CudaFunctions>(e.keep, static_cast<jit::CudaFunctions*>(const_cast<void*>(e.fn)));
}

// Runs a run-time pair on the Hopper kernels when they apply (as the built-in mods' would:
// automatic or hopper backends, 16-bit storage, no learnable capture in the backward, the layout
// of kernels/flex_hopper.h) and returns true; false: nothing ran. A required hopper backend that
// does not apply is an error.
bool run_hopper_flex(bool backward, kernels::FlexParams& p, const jit::ModSpec& s, const jit::ModSpec& m,
                     std::vector<unsigned char>& sm, std::vector<unsigned char>& mm, bool learn, Device device,
                     DType dt, const Stream& stream) {
  using kernels::FlexBackend;
  if (p.backend != FlexBackend::hopper && !(p.backend == FlexBackend::automatic && kRuntimeHopperByDefault)) return false;
  const bool sixteen = dt == DType::bf16 || dt == DType::f16;
  kernels::FlexHopperPlan plan;
  const Tensor counters = detail::tile_counters(p, 2, device);  // alive until the launches are queued
  const bool applies = sixteen && !(backward && learn) && kernels::plan_flex_hopper(p, dt == DType::bf16, backward, stream, plan);
  if (!applies) {
    KILN_CHECK(p.backend != FlexBackend::hopper, "flex_attention (run-time mods): backend hopper does not apply to ",
               "this call (it takes bf16 / f16, head dims E = Ev of 64 or 128, 16-byte aligned rows, blocks multiples "
               "of 128, and no learnable capture in the backward); use auto or simt");
    return false;
  }
  const auto k = hopper_flex_kernels(s, m, plan, backward, device, dt);
  auto launch = [&](void* fn, unsigned char* maps, const kernels::FlexHopperLaunch& l, const char* what) {
    if (l.grid == 0) return;
    bool heads_fastest = l.heads_fastest;
    int32_t* counter = l.tile_counter;
    std::vector<void*> args;
    if (!backward)
      for (int i = 0; i < 4; ++i) args.push_back(maps + 128 * i);
    else
      args.push_back(maps);
    for (void* a : {static_cast<void*>(&p), static_cast<void*>(sm.data()), static_cast<void*>(mm.data()),
                    static_cast<void*>(&heads_fastest), static_cast<void*>(&counter)})
      args.push_back(a);
    jit::launch_cuda(fn, l.grid, 1, 1, l.threads, args.data(), stream, what, l.smem);
  };
  if (!backward) {
    launch(k->functions[0], plan.maps[0], plan.fwd, "flex_attention (run-time mods, Hopper forward)");
  } else {  // dQ first: it writes the delta that the dK/dV pass reads
    launch(k->functions[0], plan.maps[0], plan.dq, "flex_attention (run-time mods, Hopper dQ)");
    launch(k->functions[1], plan.maps[6], plan.dkdv, "flex_attention (run-time mods, Hopper dK/dV)");
  }
  return true;
}

// Runs the forward or the backward of a run-time pair on CUDA (storage `dt`; the backward also
// gives a learnable capture's gradient when p.dbias is set), on the thread's current stream of
// `device`.
void run_cuda_flex(bool backward, const kernels::FlexParams& p, const jit::ModSpec& s, const jit::ModSpec& m,
                   const std::vector<Tensor>& caps, size_t n_score, const Captures& named, Device device, DType dt) {
  KILN_CHECK(p.E <= 256 && p.Ev <= 256, "flex_attention (CUDA, run-time mods): head dims up to 256, got E=", p.E,
             ", Ev=", p.Ev);
  KILN_CHECK(p.nQ < 65536 * 32 && p.Hq < 65536 && p.B < 65536, "flex_attention (CUDA): grid too large");
  const int maxd = p.E <= 128 && p.Ev <= 128 ? 128 : 256;
  bool learn = false;
  for (const auto& c : s.captures) learn = learn || c.learnable;
  const Stream stream = current_stream(device);
  // The out-of-range flags of the captures (none without captures: no fill kernel on the way).
  const Tensor flags = caps.empty() ? Tensor() : zeros({static_cast<int64_t>(caps.size())}, DType::i32, device);
  std::vector<const void*> data;
  std::vector<std::array<int64_t, 4>> sizes, strides;
  std::vector<int32_t*> fl;
  std::vector<int32_t> unused;
  for (const CaptureArg& a : capture_args(caps, unused)) {
    data.push_back(a.data);
    sizes.push_back({a.sizes[0], a.sizes[1], a.sizes[2], a.sizes[3]});
    strides.push_back({a.strides[0], a.strides[1], a.strides[2], a.strides[3]});
    fl.push_back(flags.data<int32_t>() + fl.size());
  }
  auto bytes = [&](bool identity, size_t from, size_t n) {
    return jit::functor_bytes(identity, p.L, p.S, data.data() + from,
                              reinterpret_cast<const int64_t(*)[4]>(sizes.data() + from),
                              reinterpret_cast<const int64_t(*)[4]>(strides.data() + from), fl.data() + from, n);
  };
  std::vector<unsigned char> sm = bytes(jit::is_identity(s), 0, n_score), mm = bytes(false, n_score, caps.size() - n_score);
  kernels::FlexParams pp = p;
  if (run_hopper_flex(backward, pp, s, m, sm, mm, learn, device, dt, stream)) {
    if (!caps.empty()) check_flags(flags.to(kCPU).to_vector<int32_t>(), named);
    return;
  }
  KILN_CHECK(p.backend != kernels::FlexBackend::sm80, "flex_attention (run-time mods): backend sm80 has no run-time ",
             "kernels (the hopper and simt ones do); use auto, hopper or simt");
  const auto k = cuda_flex_kernels(s, m, maxd, backward, device, dt, learn);
  void* args[] = {&pp, sm.data(), mm.data()};
  const unsigned B = static_cast<unsigned>(p.B);
  if (!backward) {
    jit::launch_cuda(k->functions[0], static_cast<unsigned>(p.nQ), static_cast<unsigned>(p.Hq), B, 128, args, stream,
                     "flex_attention (run-time mods, CUDA forward)");
  } else {
    const int64_t rows = p.B * p.Hq * p.L;
    jit::launch_cuda(k->functions[0], static_cast<unsigned>((rows + 255) / 256), 1, 1, 256, args, stream,
                     "flex_attention (run-time mods, CUDA delta)");
    jit::launch_cuda(k->functions[1], static_cast<unsigned>(p.nQ), static_cast<unsigned>(p.Hq), B, 128, args, stream,
                     "flex_attention (run-time mods, CUDA dQ)");
    jit::launch_cuda(k->functions[2], static_cast<unsigned>(p.nKV), static_cast<unsigned>(p.Hkv), B, 128, args, stream,
                     "flex_attention (run-time mods, CUDA dK/dV)");
    if (learn && p.dbias != nullptr) {
      const int64_t tasks = p.B * p.Hq * p.nQ;
      KILN_CHECK(tasks < (int64_t{1} << 31) * 128 && p.bias_row < (int64_t{1} << 31) * 256,
                 "flex_attention (CUDA): the captured gradient's grid is too large");
      jit::launch_cuda(k->functions[3], static_cast<unsigned>((tasks + 127) / 128), 1, 1, 128, args, stream,
                       "flex_attention (run-time mods, CUDA captured gradient)");
      jit::launch_cuda(k->functions[4], static_cast<unsigned>((p.bias_row + 255) / 256), 1, 1, 256, args, stream,
                       "flex_attention (run-time mods, CUDA captured gradient reduction)");
    }
  }
  // Only captures can be read out of range: without any, no flag to read back (no host wait).
  if (!caps.empty()) check_flags(flags.to(kCPU).to_vector<int32_t>(), named);
}

void check_cuda_call(const Tensor& q) {
  KILN_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16 || q.dtype() == DType::f16,
             "flex_attention: run-time mods on CUDA take f32, bf16 or f16 (the NVRTC SIMT kernels), got ",
             dtype_name(q.dtype()));
}

}  // namespace

RuntimeBlockMask create_block_mask(const RuntimeMaskMod& mask_mod, int64_t batch, int64_t heads, int64_t q_len,
                                   int64_t kv_len, int64_t q_block, int64_t kv_block, Device device) {
  KILN_CHECK(batch >= 1 && heads >= 1 && q_len >= 0 && kv_len >= 0, "create_block_mask: bad sizes batch=", batch,
             " heads=", heads, " q_len=", q_len, " kv_len=", kv_len);
  check_block_sizes(q_block, kv_block, "create_block_mask");
  KILN_CHECK(q_len < (int64_t{1} << 31) && kv_len < (int64_t{1} << 31), "create_block_mask: lengths must fit int32");
  BoundCaptures c = bind_captures("mask_mod", mask_mod.captures, device, false);
  const jit::ModSpec spec = mask_spec(mask_mod, c);
  if (device.is_cuda()) {
    check_device_available(device, "create_block_mask");
    const auto cls = classify_on_gpu(spec, c.tensors, mask_mod.captures, batch, heads, q_len, kv_len, q_block,
                                     kv_block, device);
    RuntimeBlockMask m{mask_mod, layout_from_classes(cls, batch, heads, q_len, kv_len, q_block, kv_block).to(device)};
    for (size_t i = 0; i < c.tensors.size(); ++i) m.mask_mod.captures[i].second = c.tensors[i];
    return m;
  }
  require_cpu(device);
  jit::CompileRequest req{"create_block_mask (" + mask_mod.expr + ")", jit::classify_cpu_source(spec), {"mask_mod"}};
  const KernelEntry e = jit_entry("flex_classify", "*", req);
  const int64_t nq = (q_len + q_block - 1) / q_block, nk = (kv_len + kv_block - 1) / kv_block;
  shape_numel({batch, heads, nq, nk});
  std::vector<uint8_t> cls(static_cast<size_t>(batch * heads * nq * nk));
  std::vector<int32_t> flags;
  const auto args = capture_args(c.tensors, flags);
  char err[1024] = {0};
  const int rc = reinterpret_cast<ClassifyJitEntry>(e.fn)(args.data(), batch, heads, q_len, kv_len, q_block, kv_block,
                                                          cls.data(), err, sizeof err);
  KILN_CHECK(rc == 0, "create_block_mask (", e.origin, "): ", err);
  check_flags(flags, mask_mod.captures);
  RuntimeBlockMask m{mask_mod, layout_from_classes(cls, batch, heads, q_len, kv_len, q_block, kv_block)};
  for (size_t i = 0; i < c.tensors.size(); ++i) m.mask_mod.captures[i].second = c.tensors[i];
  return m;
}

FlexResult flex_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const RuntimeScoreMod& score_mod,
                          const RuntimeBlockMask& block_mask, const FlexOptions& options) {
  const BlockLayout& layout = block_mask.layout;
  detail::check_flex_inputs(q_in, k_in, v_in, layout);
  KILN_CHECK(!options.bias.defined(), "flex_attention: options.bias is for RelativePositionBias; a run-time "
                                      "score_mod reads its tables as captures");
  Tensor q = detail::last_dim_contiguous(q_in), k = detail::last_dim_contiguous(k_in),
         v = detail::last_dim_contiguous(v_in);
  const double scale = detail::resolve_scale(options.scale, q.size(3));
  const kernels::FlexBackend backend = detail::resolve_backend(options.backend, q.device());
  kernels::FlexParams p = detail::make_params(q, k, v, layout, scale, backend);
  const BoundCaptures sc = bind_captures("score_mod", score_mod.captures, q.device(), true);
  const BoundCaptures mc = bind_captures("mask_mod", block_mask.mask_mod.captures, q.device(), false);
  const jit::ModSpec s = score_spec(score_mod, sc), m = mask_spec(block_mask.mask_mod, mc);
  std::vector<Tensor> caps = sc.tensors;
  caps.insert(caps.end(), mc.tensors.begin(), mc.tensors.end());
  Captures named = score_mod.captures;
  named.insert(named.end(), block_mask.mask_mod.captures.begin(), block_mask.mask_mod.captures.end());
  int learn_at = -1;
  for (size_t i = 0; i < sc.sigs.size(); ++i)
    if (sc.sigs[i].learnable) learn_at = static_cast<int>(i);

  const DType dt = q.dtype();
  const bool on_cuda = q.device().is_cuda();
  if (on_cuda) check_cuda_call(q);
  const size_t n_score = sc.tensors.size();
  const KernelEntry fwd = on_cuda ? KernelEntry{} : cpu_flex_entry(s, m, dt, false);
  Tensor out = Tensor::empty({p.B, p.Hq, p.L, p.Ev}, dt, q.device());
  Tensor lse = Tensor::empty({p.B, p.Hq, p.L}, DType::f32, q.device());
  p.out = out.data_ptr();
  p.lse = lse.data<float>();
  if (p.L > 0 && p.Ev > 0) {
    profile::Scope ps("flex_forward", q.device());
    if (on_cuda) {
      run_cuda_flex(false, p, s, m, caps, n_score, named, q.device(), dt);
    } else {
      std::vector<int32_t> flags;
      call_flex(fwd, p, capture_args(caps, flags));
      check_flags(flags, named);
    }
  } else {
    out.zero_(), lse.fill_(-INFINITY);
  }

  std::vector<Tensor> inputs{q_in, k_in, v_in};
  if (learn_at >= 0) inputs.push_back(score_mod.captures[static_cast<size_t>(learn_at)].second);
  std::vector<Tensor*> outputs{&out};
  if (options.return_lse) outputs.push_back(&lse);
  if (any_requires_grad(inputs)) {
    SavedTensor sq(q), sk(k), sv(v), so(out), slse(lse);
    std::vector<SavedTensor> scaps(caps.begin(), caps.end());
    const std::vector<SavedTensor> saved_tables = detail::save_block_tables(layout);
    const bool want_lse = options.return_lse;
    record("flex_attention", inputs, outputs,
           [=](const std::vector<Tensor>& grads) -> std::vector<Tensor> {
             detail::check_saved_block_tables(saved_tables, layout);
             const char* op = "flex_attention";
             Tensor q = sq.get(op), k = sk.get(op), v = sv.get(op), out = so.get(op), lse = slse.get(op);
             std::vector<Tensor> caps;
             for (const SavedTensor& c : scaps) caps.push_back(c.get("flex_attention's captures"));
             kernels::FlexParams bp = detail::make_params(q, k, v, layout, scale, backend);
             const KernelEntry bwd = on_cuda ? KernelEntry{} : cpu_flex_entry(s, m, q.dtype(), true);
             Tensor dcap, partial;
             if (learn_at >= 0) {
               const Tensor& c = caps[static_cast<size_t>(learn_at)];
               const int64_t tasks = bp.B * bp.Hq * std::max<int64_t>(bp.nQ, 1);
               KILN_CHECK(static_cast<double>(tasks) * static_cast<double>(c.numel()) * 4.0 <= 4.0 * (1 << 30),
                          "flex_attention: the gradient of capture '", named[static_cast<size_t>(learn_at)].first,
                          "' needs ", tasks, " partial copies of its ", c.numel(),
                          " elements (one per (b, h, q block), summed in order), over 4 GiB");
               bp.bias_row = c.numel();
               dcap = Tensor::empty(c.shape(), DType::f32, q.device());
               partial = Tensor::empty({tasks, c.numel()}, DType::f32, q.device());
               bp.dbias = dcap.data<float>();
               bp.dbias_partial = partial.data<float>();
             }
             const detail::BackwardBuffers buf = detail::backward_buffers(bp, q, out, lse, grads, want_lse);
             Tensor dq = buf.dq, dk = buf.dk, dv = buf.dv;
             if (bp.L > 0 && bp.S > 0) {
               profile::Scope ps("flex_backward", q.device());
               if (on_cuda) {
                 run_cuda_flex(true, bp, s, m, caps, n_score, named, q.device(), q.dtype());
               } else {
                 std::vector<int32_t> flags;
                 call_flex(bwd, bp, capture_args(caps, flags));
                 check_flags(flags, named);
               }
             } else {
               dq.zero_(), dk.zero_(), dv.zero_();
               if (dcap.defined()) dcap.zero_();
             }
             std::vector<Tensor> g{dq, dk, dv};
             if (learn_at >= 0) g.push_back(dcap);
             return g;
           });
  }
  FlexResult r;
  r.out = out;
  if (options.return_lse) r.lse = lse;
  return r;
}

Captures captures_named_in(const std::string& expr, const Captures& file) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  Captures out;
  for (const auto& [name, t] : file) {
    for (size_t at = expr.find(name); at != std::string::npos; at = expr.find(name, at + 1)) {
      const size_t end = at + name.size();
      if ((at == 0 || !ident(expr[at - 1])) && (end >= expr.size() || !ident(expr[end]))) {
        out.emplace_back(name, t);
        break;
      }
    }
  }
  return out;
}

std::vector<jit::Ticket> precompile_flex(const RuntimeScoreMod& score_mod, const RuntimeMaskMod& mask_mod, DType dtype,
                                         Device device, bool backward, int64_t head_dim) {
  const BoundCaptures sc = bind_captures("score_mod", score_mod.captures, device, true);
  const BoundCaptures mc = bind_captures("mask_mod", mask_mod.captures, device, false);
  const jit::ModSpec s = score_spec(score_mod, sc), m = mask_spec(mask_mod, mc);
  if (device.is_cuda()) {
    // The cubins into the disk cache, in the pool; each is loaded (a cache hit) on the thread of
    // its first call, which has the device's context.
    KILN_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16,
               "precompile: run-time mods on CUDA take f32, bf16 or f16, got ", dtype_name(dtype));
    std::vector<jit::CompileRequest> reqs{
        {"create_block_mask cuda (" + m.expr + ")", jit::classify_cuda_source(m), {"mask_mod"}}};
    for (int maxd : {128, 256}) {
      if (head_dim > 0 && maxd != (head_dim <= 128 ? 128 : 256)) continue;
      for (bool bwd : {false, true}) {
        if (bwd && !backward) continue;
        reqs.push_back(cuda_flex_request(s, m, maxd, bwd, dtype_name(dtype)));
      }
    }
    // The Hopper kernels of 16-bit storage (those calls run them where they apply), once the
    // automatic backend picks them.
    bool learn = false;
    for (const auto& c : s.captures) learn = learn || c.learnable;
    for (int hd : {64, 128}) {
      if (!kRuntimeHopperByDefault || (head_dim > 0 && head_dim != hd) || dtype == DType::f32) continue;
      for (bool bwd : {false, true}) {
        if (bwd && (!backward || learn)) continue;
        reqs.push_back(hopper_flex_request(s, m, hd, bwd, dtype_name(dtype)));
      }
    }
    std::vector<jit::Ticket> tickets;
    for (auto& req : reqs)
      tickets.push_back(jit::CompileService::global().submit(
          req.name, [req](const jit::CancelToken& tok) { jit::compile_cuda(req, "sm_90a", &tok); }));
    return tickets;
  }
  require_cpu(device);
  // (family, key, request): the keys the calls look up.
  std::vector<std::tuple<std::string, KernelKey, jit::CompileRequest>> reqs;
  const jit::CompileRequest classify{"create_block_mask (" + m.expr + ")", jit::classify_cpu_source(m), {"mask_mod"}};
  reqs.emplace_back("flex_classify", jit_key("flex_classify", "*", classify), classify);
  for (bool bwd : {false, true})
    if (!bwd || backward) reqs.emplace_back(flex_family(bwd), cpu_flex_key(s, m, dtype, bwd), flex_request(s, m, dtype, bwd));
  std::vector<jit::Ticket> tickets;
  for (auto& [family, key, req] : reqs)
    tickets.push_back(jit::CompileService::global().submit(req.name, [family, key, req](const jit::CancelToken& tok) {
      KernelRegistry::global().get_or_make(key, [&] { return load_entry(family, req, &tok); });
    }));
  return tickets;
}

}  // namespace kiln::attention
