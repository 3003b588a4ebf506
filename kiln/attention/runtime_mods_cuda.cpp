// Run-time mods on CUDA (docs/jit.md): the kernels NVRTC compiles for a pair (the SIMT bodies on
// f32 / bf16 / f16, and the built-in Hopper templates instantiated with the generated functors),
// their registry entries, their launches on the thread's current stream, the GPU tile classifier
// of a run-time mask and the CUDA half of precompilation. The front end is runtime_mods.cpp.
#include <array>

#include "kiln/attention/runtime_mods_detail.h"
#include "kiln/core/kernel_registry.h"
#include "kiln/core/stream.h"
#include "kiln/jit/compile_service.h"
#include "kiln/jit/cuda_backend.h"
#include "kiln/jit/flex_source.h"
#include "kiln/jit/sha256.h"
#include "kiln/kernels/flex_hopper.h"

namespace kiln::attention::runtime_detail {
namespace {

// The SIMT CUDA kernels' request (f32, bf16 or f16 storage; head dims up to maxd).
jit::CompileRequest cuda_flex_request(const jit::ModSpec& s, const jit::ModSpec& m, int maxd, bool backward,
                                      const std::string& storage) {
  return jit::CompileRequest{flex_name(backward, " cuda", storage, s, m),
                             jit::flex_cuda_source(s, m, maxd, backward, storage), flex_user_files()};
}
// The Hopper kernels' request (the built-in templates with the generated functors).
jit::CompileRequest hopper_flex_request(const jit::ModSpec& s, const jit::ModSpec& m, int head_dim, bool backward,
                                        const std::string& storage) {
  return jit::CompileRequest{flex_name(backward, " hopper", storage, s, m), jit::flex_hopper_source(s, m, storage),
                             flex_user_files(), jit::flex_hopper_kernels(head_dim, backward, storage)};
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
    auto f = std::make_shared<jit::CudaFunctions>(jit::load_cuda_functions(cubin, jit::flex_cuda_kernels(backward, learn)));
    return KernelEntry{f.get(), f, "jit cuda " + cubin.key};
  });
  return std::shared_ptr<jit::CudaFunctions>(e.keep, static_cast<jit::CudaFunctions*>(const_cast<void*>(e.fn)));
}

// Whether the automatic backend runs run-time mods on the Hopper kernels where they apply (and
// kiln precompile adds them): yes since JitNvrtc.HopperRunTimeModsGiveTheBuiltinBits passed on
// the H200 (2026-12-06: causal, window, ALiBi + causal, bf16 and f16, forward and backward).
constexpr bool kRuntimeHopperByDefault = true;

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

}  // namespace

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

std::vector<jit::Ticket> precompile_cuda(const jit::ModSpec& s, const jit::ModSpec& m, DType dtype, bool backward,
                                         int64_t head_dim) {
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

}  // namespace kiln::attention::runtime_detail
