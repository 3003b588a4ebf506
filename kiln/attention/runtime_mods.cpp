// Run-time mods: capture checks, the JIT kernels (looked up in and added to the KernelRegistry),
// the forward with its recorded backward, the run-time BlockMask, precompilation; the CPU
// kernels here, the CUDA ones in runtime_mods_cuda.cpp.
#include "kiln/attention/runtime_mods.h"

#include "kiln/attention/runtime_mods_detail.h"

#include <cctype>
#include <tuple>

#include "kiln/autograd/grad_mode.h"
#include "kiln/core/kernel_registry.h"
#include "kiln/jit/cpu_backend.h"
#include "kiln/jit/expr_prelude.h"
#include "kiln/jit/flex_source.h"
#include "kiln/jit/sha256.h"

namespace kiln::attention {
namespace runtime_detail {

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

const char* flex_family(bool backward) { return backward ? "flex_backward" : "flex_forward"; }
// The name a compilation shows while it runs: "flex_forward hopper bf16 (score | q_idx >= kv_idx)".
std::string flex_name(bool backward, const std::string& kind, const std::string& storage, const jit::ModSpec& s,
                      const jit::ModSpec& m) {
  return std::string(flex_family(backward)) + kind + " " + storage + " (" + s.expr + " | " + m.expr + ")";
}
std::vector<std::string> flex_user_files() { return {"score_mod", "score_mod_derivative", "mask_mod"}; }

}  // namespace runtime_detail

namespace {
using namespace runtime_detail;
using FlexJitEntry = int (*)(const kernels::FlexParams*, const CaptureArg*, char*, int);
using ClassifyJitEntry = int (*)(const CaptureArg*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint8_t*,
                                 char*, int);

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

jit::CompileRequest flex_request(const jit::ModSpec& s, const jit::ModSpec& m, DType dt, bool backward) {
  return jit::CompileRequest{flex_name(backward, "", dtype_name(dt), s, m),
                             jit::flex_cpu_source(s, m, dtype_name(dt), backward), flex_user_files()};
}
KernelKey cpu_flex_key(const jit::ModSpec& s, const jit::ModSpec& m, DType dt, bool backward) {
  return KernelKey{flex_family(backward), "cpu", dtype_name(dt), 0, pair_digest(s, m), "jit"};
}
// The CPU kernel of a run-time pair, keyed by the pair (no source generated once it is loaded).
KernelEntry cpu_flex_entry(const jit::ModSpec& s, const jit::ModSpec& m, DType dt, bool backward) {
  return jit_entry(flex_family(backward), cpu_flex_key(s, m, dt, backward),
                   [&] { return flex_request(s, m, dt, backward); });
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
  if (device.is_cuda()) return precompile_cuda(s, m, dtype, backward, head_dim);
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
