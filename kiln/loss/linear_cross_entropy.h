// kiln::linear_cross_entropy: the output projection and the cross-entropy loss fused, never
// holding the N × V logits (kernels: kiln/kernels/lce.h), with autograd; and
// linear_cross_entropy_reference, the unfused composition of core ops that tests and
// benchmarks compare it to. Options follow PyTorch's F.cross_entropy plus the LLM extras of
// Liger-Kernel (z-loss, softcap). See docs/loss.md for the math, memory bounds and choices.
#pragma once
#include <cstdint>

#include "kiln/core/tensor.h"
#include "kiln/kernels/lce.h"
#include "kiln/ops/ops.h"

namespace kiln {

struct LinearCrossEntropyOptions {
  int64_t ignore_index = -100;     // targets equal to it contribute neither loss nor gradient
  Reduction reduction = Reduction::mean;
  double label_smoothing = 0.0;    // ε in [0, 1]: target distribution (1−ε)·onehot + ε/V
  double z_loss = 0.0;             // coefficient s of the auxiliary s·lse² per (non-ignored) token
  double softcap = 0.0;            // > 0: logits → softcap·tanh(logits/softcap)
  Tensor weight;                   // per-class weights [V] (as F.cross_entropy's `weight`); no gradient
  Tensor bias;                     // [V] output bias (gets a gradient when it requires grad)
  double num_items = 0.0;          // > 0: divide the summed loss by this instead (mean/sum only);
                                   // for gradient accumulation across micro-batches
  bool return_lse = false;         // also return the per-token log-sum-exp
  double filter_eps = 0.0;         // > 0: gradient filter (entries of |softmax − target| < eps
                                   // dropped); off by default, see docs/loss.md
  int64_t chunk_tokens = 0;        // tokens per chunk; 0: chosen from V (docs/loss.md)
  bool weight_grad_f32 = false;    // CUDA, 16-bit weights: accumulate dW across chunks in an f32
                                   // buffer of V × d (exact order, 2× the gradient's memory)
  int64_t dh_split = 0;            // CUDA: slices of V for the d_hidden product (f32 partials summed
                                   // in order); 0 or 1: unsplit, cuBLASLt's own split-K (docs/loss.md)
  int64_t dw_sms = 0;              // CUDA, experimental: > 0 overlaps each chunk's d_weight product
                                   // (on that many SMs) with its d_hidden product (docs/loss.md)
  // CUDA, 16-bit inputs: kiln takes kiln's Hopper GEMM for the loss's products where it applies,
  // auto and cublaslt cuBLASLt (default: the process's, KILN_GEMM_BACKEND; docs/loss.md)
  kernels::gemm::Backend gemm_backend = kernels::gemm::default_backend();
  kernels::LceProfile* profile = nullptr;  // CUDA measurement aid: per-phase times of the forward
                                           // call (which computes the gradients for mean/sum)
};

struct LinearCrossEntropyResult {
  Tensor loss;    // scalar (mean, sum) or target-shaped (none), hidden's dtype; differentiable
  Tensor z_loss;  // the z-loss part of `loss`, same shape, detached (for logging)
  Tensor lse;     // target-shaped per-token log-sum-exp (f32; f64 for f64 inputs) when asked
};

// hidden [N, d] or [B, T, d]; weight [V, d]; target [N] or [B, T] (i64 or i32).
// Mean divides by the number of non-ignored tokens (by Σ w[target] with class weights), as
// PyTorch does; all targets ignored give NaN (mean) or 0 (sum). 16-bit inputs accumulate in f32.
LinearCrossEntropyResult linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                                              const LinearCrossEntropyOptions& options = {});

// The same loss composed from core ops (linear, log_softmax, ...): materialises N × V.
// Any floating dtype including f64 (16-bit logits are computed in their dtype, the loss in f32).
// Differentiable through the ops' autograd. Test oracle and benchmark baseline.
LinearCrossEntropyResult linear_cross_entropy_reference(const Tensor& hidden, const Tensor& weight,
                                                        const Tensor& target,
                                                        const LinearCrossEntropyOptions& options = {});

namespace detail {
// The checks linear_cross_entropy makes of its arguments (shapes, dtypes, devices, options, target
// values), for linear_cross_entropy_reference: kiln::Error naming the reference and what is wrong.
void check_linear_cross_entropy_args(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                                     const LinearCrossEntropyOptions& options);
}  // namespace detail

}  // namespace kiln
