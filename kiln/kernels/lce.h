// Kernel entry points of the fused linear + cross-entropy loss (front end: kiln/loss/).
// One call walks the tokens in chunks: logits of a chunk (GEMM) → one row pass (online
// log-sum-exp, the loss terms, and — when gradients are asked — d(loss)/d(logits) written in
// place over the chunk's logits) → dh = dlogits·W and dW += dlogitsᵀ·h (GEMMs), db += column
// sums. The N × V logits never exist; memory is bounded by the chunk buffer (docs/loss.md).
// Bodies: cpu/lce.cpp (OpenBLAS + OpenMP) and cuda/lce.cu (cuBLASLt + a fused row kernel).
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "kiln/core/macros.h"
#include "kiln/core/tensor.h"
#include "kiln/kernels/cuda/gemm/options.h"

namespace kiln::kernels {

// Measurement aid (CUDA only; the CPU body leaves it alone): milliseconds per phase summed
// over the chunks of one call, from CUDA events between the phases (the call then waits for
// the device), the chunking chosen, and the cuBLASLt algorithm of each product.
struct LceProfile {
  double logits_ms = 0, rows_ms = 0, dh_ms = 0, dh_reduce_ms = 0, dw_ms = 0, bias_ms = 0;
  int64_t chunks = 0, chunk_tokens = 0, dh_split = 0, extra_bytes = 0;  // extra: the chunk buffers
  // The gradient filter on kiln's GEMM: dz's 64 × 64 blocks, and those all zero (skipped by the
  // d_hidden and d_weight products), over the chunks (read back after each row pass)
  int64_t sparse_blocks = 0, sparse_zero_blocks = 0;
  std::string logits_algo, dh_algo, dw_algo;  // cuBLASLt algo config (id, tile, split-K, ...) or
                                              // "kiln sm90 <epilogue>"
};

struct LceParams {
  int64_t n = 0, d = 0, v = 0;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double z_loss = 0.0;           // coefficient of lse²
  double softcap = 0.0;          // 0: off; else logits → softcap·tanh(logits/softcap)
  double class_weight_sum = 0;   // Σ_j w_j over the vocabulary (V without class weights)
  double grad_scale = 1.0;       // multiplies every row's gradient (1/divisor)
  double filter_eps = 0.0;       // > 0: gradient entries with |dz| < eps (before scaling) become 0
  int64_t chunk_tokens = 0;      // 0: the backend's choice
  int64_t dh_split = 0;          // CUDA: slices of V the d_hidden product is split into (each an
                                 // f32 partial, summed in a fixed order); 0 or 1: unsplit (cuBLASLt
                                 // picks its own split-K)
  int64_t dw_sms = 0;            // CUDA, experimental: > 0 runs each chunk's d_weight product on a
                                 // side stream with cuBLASLt's SM-count target dw_sms (no workspace),
                                 // concurrent with d_hidden on the other SMs; no extra memory;
                                 // ignored while profiling. 0: sequential (default)
  // CUDA, 16-bit inputs: kiln runs the chunk's products on kiln's Hopper GEMM where it applies
  // (the logits with their per-tile log-sum-exp in the epilogue, d_hidden, d_weight accumulated
  // in its epilogue; docs/loss.md); auto and cublaslt: cuBLASLt. The front end passes
  // LinearCrossEntropyOptions::gemm_backend (the process default unless set).
  gemm::Backend gemm_backend = gemm::Backend::cublaslt;
  LceProfile* profile = nullptr; // when set, filled (summed into) by the CUDA body
};

// Inputs are contiguous and on one device; hidden/weight/bias/class_weight share a floating dtype.
// Outputs: loss/zloss/lse [N] in the accumulation dtype (f64 for f64 inputs, else f32).
// Gradients are optional (undefined: not computed). grad_hidden is overwritten; grad_weight and
// grad_bias are accumulated into (the caller zeroes them). row_scale [N] (accumulation dtype),
// when defined, multiplies row i's gradient (reduction none's backward). grad_scale, when defined,
// is an f64 scalar on the inputs' device multiplying every gradient besides p.grad_scale (the
// mean's 1/divisor and grad_output, kept on the device so that no step waits for it).
// CPU: gradients in the accumulation dtype. CUDA: grad_hidden and grad_weight in the input dtype
// or f32, grad_bias f32.
struct LceTensors {
  Tensor hidden, weight, bias, target, class_weight, row_scale, grad_scale;
  Tensor loss, zloss, lse;
  Tensor grad_hidden, grad_weight, grad_bias;
};

// Row math shared by the CPU and CUDA row passes (one definition for both backends).
// z_j = cap(x_j) is the (soft-capped) logit, p_j = exp(z_j − lse). For a row with target t:
//   ce  = (1−ε)·w_t·(lse − z_t) + (ε/V)·(W·lse − Σ_j w_j z_j)      (W = Σ_j w_j; w ≡ 1 without weights)
//   zl  = s·lse²
//   dz_j = p_j·p_coef − [j = t]·target_coef − w_j·smooth_coef      (d(ce + zl)/dz_j)
// with p_coef = (1−ε)w_t + (ε/V)·W + 2·s·lse, target_coef = (1−ε)w_t, smooth_coef = ε/V.
// An ignored row has ce = zl = 0 and dz = 0.
template <class A>
struct LceRowTerms {
  A ce = 0, zl = 0, p_coef = 0, target_coef = 0, smooth_coef = 0;
  // dz_j before the soft-cap derivative and the row's scale, from p_j = exp(z_j − lse) and the
  // class weight w_j; entries with |dz_j| < filter (when filter > 0) become 0 (the gradient filter).
  KILN_HD A dz(A p_j, A w_j, bool is_target, A filter) const {
    A g = p_j * p_coef - w_j * smooth_coef;
    if (is_target) g -= target_coef;
    if (filter > A(0) && (g < A(0) ? -g : g) < filter) g = A(0);
    return g;
  }
};

template <class A>
KILN_HD LceRowTerms<A> lce_row_terms(const LceParams& p, A lse, A z_t, A wz_sum, A w_t, bool ignored) {
  LceRowTerms<A> r;
  if (ignored) return r;
  const A eps = static_cast<A>(p.label_smoothing);
  const A sv = eps / static_cast<A>(p.v);
  const A wsum = static_cast<A>(p.class_weight_sum);
  const A s = static_cast<A>(p.z_loss);
  r.ce = (A(1) - eps) * w_t * (lse - z_t) + (eps != A(0) ? sv * (wsum * lse - wz_sum) : A(0));
  r.zl = s * lse * lse;
  r.target_coef = (A(1) - eps) * w_t;
  r.smooth_coef = sv;
  r.p_coef = r.target_coef + sv * wsum + A(2) * s * lse;
  return r;
}

// Soft cap of a raw logit, and d cap/dx expressed through the capped value z.
template <class A>
KILN_HD A lce_cap(A x, A cap) {
  using std::tanh;
  return cap > A(0) ? cap * tanh(x / cap) : x;
}
template <class A>
KILN_HD A lce_cap_deriv(A z, A cap) {
  if (!(cap > A(0))) return A(1);
  A q = z / cap;
  return A(1) - q * q;
}

namespace cpu {
void linear_cross_entropy(const LceParams& p, const LceTensors& t);
}
namespace cuda {
void linear_cross_entropy(const LceParams& p, const LceTensors& t);
// x *= s in place, s an f32 scalar on x's device (grad_output); nothing is written when s == 1.
// x: f32, bf16 or f16, contiguous. No host synchronisation.
void lce_scale(const Tensor& x, const Tensor& s);
}

}  // namespace kiln::kernels
