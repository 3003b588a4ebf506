// flex_attention: programmable block-sparse attention with autograd (PyTorch's API in C++).
//
//   auto mask = create_block_mask(Causal{}, 1, 1, L, S);
//   auto r = flex_attention(q, k, v, NoScoreMod{}, mask);          // r.out [B, Hq, L, Ev]
//
// q [B, Hq, L, E], k [B, Hkv, S, E], v [B, Hkv, S, Ev] (Hq a multiple of Hkv: GQA without
// copies; E, Ev >= 1), f32 / bf16 / f16 (16-bit storage, f32 math). Output in the input dtype;
// lse [B, Hq, L] f32 in natural log when options.return_lse. Fully masked rows give output 0 and
// lse −inf (gradients 0, never NaN). The template instantiates the CPU kernels for any mods; the CUDA
// kernels are looked up in the KernelRegistry (the library's mods: explicit instantiations in
// kernels/cuda/ that register themselves).
// For config-driven masks (the trainer), flex_attention(q, k, v, const MaskSpec&) selects a
// library mask at run time.
#pragma once
#include <cstdint>
#include <cmath>
#include <optional>
#include <string>

#include "kiln/attention/block_mask.h"
#include "kiln/attention/mods.h"
#include "kiln/core/profile.h"
#include "kiln/kernels/attention.h"
#include "kiln/kernels/cpu/attention_impl.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/ops.h"

namespace kiln::attention {

struct FlexOptions {
  std::optional<double> scale;  // default 1/sqrt(E)
  bool return_lse = false;
  Tensor bias;                   // the learnable table of a LearnableScoreMod (f32 [Hq, L+S-1])
  // CUDA kernels to run (kernels/attention.h; automatic: the fastest that applies). When it is
  // automatic, the environment variable KILN_FLEX_KERNEL=auto|hopper|sm80|simt picks instead
  // (for side-by-side measurements). CPU tensors accept only automatic.
  kernels::FlexBackend backend = kernels::FlexBackend::automatic;
};

// "auto", "hopper" (or "sm90"), "sm80", "simt" → FlexBackend; anything else fails, naming `what`
// (e.g. "--backend") and the accepted values.
kernels::FlexBackend parse_flex_backend(const std::string& text, const std::string& what = "backend");
const char* flex_backend_name(kernels::FlexBackend b);

struct FlexResult {
  Tensor out;
  Tensor lse;  // defined when options.return_lse
};

namespace detail {

void check_flex_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const BlockLayout& layout);
// options.scale, or 1/sqrt(E) when unset; fails unless options.scale is finite in f32 (the
// kernels' type).
double resolve_scale(const std::optional<double>& scale, int64_t E);
// The library's score mods with parameters that would crash or silently wreck every score (a
// null ALiBi slopes pointer; a softcap of 0, ±inf or NaN) fail here, naming the mod; other
// mods pass. The slopes' length cannot be checked (a raw pointer).
template <class SM> void check_score_mod(const SM&) {}
inline void check_score_mod(const Alibi& m) {
  KILN_CHECK(m.slopes != nullptr, "flex_attention: Alibi.slopes is null (it must point to Hq f32 slopes, e.g. from "
                                  "alibi_slopes)");
}
inline void check_score_mod(const Softcap& m) {
  // The kernels multiply by 1/cap: below 1/FLT_MAX that is inf, and a score of 0 gave NaN.
  KILN_CHECK(std::isfinite(m.cap) && std::isfinite(1.0f / m.cap),
             "flex_attention: Softcap.cap must be finite and non-zero with a finite f32 reciprocal, got ", m.cap);
}
// Makes the last dim contiguous (a copy only when needed); keeps other strides.
Tensor last_dim_contiguous(const Tensor& t);
kernels::FlexParams make_params(const Tensor& q, const Tensor& k, const Tensor& v, const BlockLayout& layout,
                                double scale, kernels::FlexBackend backend);
// The backend a call runs: `requested` unless automatic, then KILN_FLEX_KERNEL when set (CUDA
// only: the CPU has one kernel, so a requested one fails there and the variable is ignored).
kernels::FlexBackend resolve_backend(kernels::FlexBackend requested, Device device);
// The Hopper kernels' n tile counters (their launchers zero them) on a CUDA device, pointed to
// by p.tile_counters; none on the CPU.
Tensor tile_counters(kernels::FlexParams& p, int64_t n, Device device);
// The layout's block tables as the backward saves them (their versions), and the backward's check
// that they are unchanged: an in-place change after the forward is an error naming the block mask,
// as for q, k and v (a table filled with -1e7 segfaulted the backward; counts raised to a valid
// value gave wrong gradients); the values are checked again as in the forward.
std::vector<SavedTensor> save_block_tables(const BlockLayout& layout);
void check_saved_block_tables(const std::vector<SavedTensor>& saved, const BlockLayout& layout);
// The backward's inputs and outputs: the output gradient in q's dtype, the lse gradient (f32,
// when the forward returned lse), Δ and the contiguous dq, dk, dv, all pointed to by bp.
struct BackwardBuffers {
  Tensor dout, dlse, delta, dq, dk, dv;
};
BackwardBuffers backward_buffers(kernels::FlexParams& bp, const Tensor& q, const Tensor& out, const Tensor& lse,
                                 const std::vector<Tensor>& grads, bool want_lse);
// The registered CUDA body of `key` (kernels::flex_key), or an error naming the pair and the
// pairs that have one.
kernels::FlexEntry cuda_flex_entry(const KernelKey& key);

template <class SM, class MM>
void run_forward(const kernels::FlexParams& p, DType dt, Device dev, const SM& sm, const MM& mm) {
  profile::Scope ps("flex_forward", dev);
  if (dev.is_cuda()) return cuda_flex_entry(kernels::flex_key<SM, MM>("flex_forward", "cuda"))(p, dt, &sm, &mm);
  switch (dt) {
    case DType::f32: return kernels::cpu::flex_forward<float>(p, sm, mm);
    case DType::bf16: return kernels::cpu::flex_forward<BFloat16>(p, sm, mm);
    case DType::f16: return kernels::cpu::flex_forward<Half>(p, sm, mm);
    default: fail("flex_attention: dtype ", dtype_name(dt), " is not supported (expected f32, bf16 or f16)");
  }
}
template <class SM, class MM>
void run_backward(const kernels::FlexParams& p, DType dt, Device dev, const SM& sm, const MM& mm) {
  profile::Scope ps("flex_backward", dev);
  if (dev.is_cuda()) return cuda_flex_entry(kernels::flex_key<SM, MM>("flex_backward", "cuda"))(p, dt, &sm, &mm);
  switch (dt) {
    case DType::f32: return kernels::cpu::flex_backward<float>(p, sm, mm);
    case DType::bf16: return kernels::cpu::flex_backward<BFloat16>(p, sm, mm);
    case DType::f16: return kernels::cpu::flex_backward<Half>(p, sm, mm);
    default: fail("flex_attention: dtype ", dtype_name(dt), " is not supported (expected f32, bf16 or f16)");
  }
}

}  // namespace detail

template <ScoreMod SM, MaskMod MM>
FlexResult flex_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, SM score_mod,
                          const BlockMask<MM>& block_mask, const FlexOptions& options = {}) {
  const BlockLayout& layout = block_mask.layout;
  detail::check_flex_inputs(q_in, k_in, v_in, layout);
  detail::check_score_mod(score_mod);
  detail::check_mask_mod(block_mask.mask_mod);
  Tensor q = detail::last_dim_contiguous(q_in), k = detail::last_dim_contiguous(k_in),
         v = detail::last_dim_contiguous(v_in);
  const double scale = detail::resolve_scale(options.scale, q.size(3));
  const kernels::FlexBackend backend = detail::resolve_backend(options.backend, q.device());
  kernels::FlexParams p = detail::make_params(q, k, v, layout, scale, backend);
  Tensor bias;
  if constexpr (is_learnable_v<SM>) {
    KILN_CHECK(options.bias.defined(), "flex_attention: this score_mod needs its learnable table in options.bias");
    bias = options.bias;
    const int64_t offsets = std::max<int64_t>(p.L + p.S - 1, 0);  // q_idx - kv_idx + L - 1, none when empty
    KILN_CHECK(bias.dtype() == DType::f32 && bias.dim() == 2 && bias.size(0) == p.Hq && bias.size(1) == offsets &&
                   bias.device() == q.device(),
               "flex_attention: options.bias must be f32 [Hq=", p.Hq, ", L+S-1=", offsets, "] on ",
               q.device().str(), ", got ", dtype_name(bias.dtype()), " ", shape_str(bias.shape()));
    bias = bias.contiguous();
    score_mod.bias = static_cast<const float*>(bias.data_ptr());
    score_mod.row = p.L + p.S - 1;
    score_mod.offset = p.L - 1;
    p.bias_row = p.L + p.S - 1;
  } else {
    KILN_CHECK(!options.bias.defined(), "flex_attention: options.bias given but the score_mod has no learnable table");
  }
  Tensor out = Tensor::empty({p.B, p.Hq, p.L, p.Ev}, q.dtype(), q.device());
  Tensor lse = Tensor::empty({p.B, p.Hq, p.L}, DType::f32, q.device());
  p.out = out.data_ptr();
  p.lse = lse.data<float>();
  const MM mm = block_mask.mask_mod;
  const Tensor fwd_counter = detail::tile_counters(p, 1, q.device());  // the forward's
  if (p.L > 0 && p.Ev > 0) detail::run_forward(p, q.dtype(), q.device(), score_mod, mm);
  else out.zero_(), lse.fill_(-INFINITY);

  std::vector<Tensor> inputs{q_in, k_in, v_in};
  if constexpr (is_learnable_v<SM>) inputs.push_back(options.bias);
  std::vector<Tensor*> outputs{&out};
  if (options.return_lse) outputs.push_back(&lse);
  // The backward keeps the layout (its index tensors are shared handles) and the mods by value.
  SavedTensor sq(q), sk(k), sv(v), so(out), slse(lse), sbias(bias);
  const std::vector<SavedTensor> saved_tables = detail::save_block_tables(layout);
  const bool want_lse = options.return_lse;
  record("flex_attention", inputs, outputs,
         [=](const std::vector<Tensor>& grads) -> std::vector<Tensor> {
           detail::check_saved_block_tables(saved_tables, layout);
           Tensor q = sq.get("flex_attention"), k = sk.get("flex_attention"), v = sv.get("flex_attention");
           Tensor out = so.get("flex_attention"), lse = slse.get("flex_attention");
           kernels::FlexParams bp = detail::make_params(q, k, v, layout, scale, backend);
           SM sm = score_mod;
           Tensor bias_t, dbias, dbias_partial;
           if constexpr (is_learnable_v<SM>) {
             bias_t = sbias.get("flex_attention");
             bp.bias_row = bp.L + bp.S - 1;
             dbias = Tensor::empty({bp.Hq, bp.bias_row}, DType::f32, q.device());
             dbias_partial = Tensor::empty({bp.B, bp.Hq, std::max<int64_t>(bp.nQ, 1), bp.bias_row}, DType::f32,
                                           q.device());
             bp.dbias = dbias.data<float>();
             bp.dbias_partial = dbias_partial.data<float>();
             sm.bias = static_cast<const float*>(bias_t.data_ptr());
           }
           const detail::BackwardBuffers buf = detail::backward_buffers(bp, q, out, lse, grads, want_lse);
           const Tensor counters = detail::tile_counters(bp, 2, q.device());  // dQ's and dK/dV's
           Tensor dq = buf.dq, dk = buf.dk, dv = buf.dv;
           if (bp.L > 0 && bp.S > 0) {
             detail::run_backward(bp, q.dtype(), q.device(), sm, mm);
           } else {
             dq.zero_(), dk.zero_(), dv.zero_();
             if (dbias.defined()) dbias.zero_();
           }
           std::vector<Tensor> g{dq, dk, dv};
           if constexpr (is_learnable_v<SM>) g.push_back(dbias);
           return g;
         });
  FlexResult r;
  r.out = out;
  if (options.return_lse) r.lse = lse;
  return r;
}

// ---- run-time selection of a library mask (config-driven: the trainer, the CLI) ----
struct MaskSpec {
  enum class Kind { none, causal, sliding_window, document } kind = Kind::causal;
  int64_t window = 0;      // sliding_window: tokens back, the query included
  Tensor document_ids;     // document: i32 [S] per-token document ids (causal within each)
  int64_t block_size = kDefaultBlockSize;
};
// Parses "none", "causal", "window:W", "document:N" (documents of N tokens over `seq_len`).
MaskSpec parse_mask_spec(const std::string& text, int64_t seq_len, Device device = kCPU);

// A built block mask for a MaskSpec (build once per shape, reuse every step).
struct AnyBlockMask {
  MaskSpec spec;
  BlockLayout layout;
  Tensor document_ids_cpu;  // keeps the host ids alive for the CPU mask_mod
};
AnyBlockMask create_block_mask(const MaskSpec& spec, int64_t q_len, int64_t kv_len, Device device = kCPU);
FlexResult flex_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AnyBlockMask& mask,
                          const FlexOptions& options = {});

// Explicit instantiations in kiln/attention/flex_attention.cpp (saves compile time).
#define KILN_FLEX_EXTERN(SM, MM)                                                                       \
  extern template FlexResult flex_attention<SM, MM>(const Tensor&, const Tensor&, const Tensor&, SM, \
                                                     const BlockMask<MM>&, const FlexOptions&);
KILN_FLEX_EXTERN(NoScoreMod, NoMask)
KILN_FLEX_EXTERN(NoScoreMod, Causal)
KILN_FLEX_EXTERN(NoScoreMod, SlidingWindow)
KILN_FLEX_EXTERN(NoScoreMod, DocumentCausal)
KILN_FLEX_EXTERN(NoScoreMod, PrefixLM)

}  // namespace kiln::attention
