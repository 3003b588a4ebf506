// Optimizer kernels: one fused elementwise pass per parameter for AdamW and SGD (the update
// math is written once below, host+device, and used by cpu/optim.cpp and cuda/optim.cu), and
// the per-chunk partial norms that clip_grad_norm_ sums in a fixed order.
// Parameters and optimizer state are contiguous f32; gradients contiguous f32 or bf16 of the
// same shape. No reductions in the updates, so every run gives the same bits.
#pragma once
#include <cmath>
#include <cstdint>

#include "kiln/core/macros.h"
#include "kiln/core/tensor.h"

namespace kiln::kernels {

// The scalars of one AdamW step, computed on the host in double (as torch does in Python
// floats) and rounded to float once.
struct AdamWStep {
  float lr_wd = 0;            // lr * weight_decay (decoupled decay: p -= lr_wd * p)
  float beta1 = 0, beta2 = 0;
  float one_minus_beta1 = 0, one_minus_beta2 = 0;
  float step_size = 0;        // lr / (1 - beta1^t)
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^t)
  float eps = 0;
};

// torch.optim.AdamW (the fused formulation of torch's _fused_adamw):
//   p -= lr*wd*p;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
//   p -= step_size * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
KILN_HD void adamw_update(float& p, float& m, float& v, float g, const AdamWStep& s) {
  using std::sqrt;
  p = p - s.lr_wd * p;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  const float denom = sqrt(v) / s.bias_correction2_sqrt + s.eps;
  p = p - s.step_size * (m / denom);
}

// The scalars of one SGD step.
struct SgdStep {
  float lr = 0;
  float weight_decay = 0;
  float momentum = 0;          // 0: no buffer
  float one_minus_dampening = 1;
  bool nesterov = false;
  bool first = false;          // the buffer is uninitialised: it takes d (torch clones d_p)
};

// torch.optim.SGD: d = g + wd*p; b = first ? d : momentum*b + (1-dampening)*d;
// d = nesterov ? d + momentum*b : b; p -= lr*d. `b` is null when momentum == 0.
KILN_HD void sgd_update(float& p, float* b, float g, const SgdStep& s) {
  float d = s.weight_decay != 0.0f ? g + s.weight_decay * p : g;
  if (b) {
    float buf = s.first ? d : s.momentum * *b + s.one_minus_dampening * d;
    *b = buf;
    d = s.nesterov ? d + s.momentum * buf : buf;
  }
  p = p - s.lr * d;
}

// clip_grad_norm_ splits each gradient into chunks of this many elements; one partial per
// chunk, accumulated in double in a fixed order, so the norm does not depend on thread counts.
inline constexpr int64_t kNormChunk = 8192;
inline int64_t norm_partials_count(int64_t numel) { return (numel + kNormChunk - 1) / kNormChunk; }

// Calls f.template operator()<G>() for the gradient dtypes the updates accept.
template <class F>
void dispatch_grad(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: f.template operator()<float>(); return;
    case DType::bf16: f.template operator()<BFloat16>(); return;
    default: fail(op, ": gradient dtype ", dtype_name(t), " is not supported (expected f32 or bf16)");
  }
}

namespace cpu {
// param, exp_avg, exp_avg_sq: contiguous f32; grad: contiguous f32 or bf16; same numel.
void adamw(const AdamWStep& s, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
           const Tensor& exp_avg_sq);
// momentum_buffer: contiguous f32, or undefined when s.momentum == 0.
void sgd(const SgdStep& s, const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer);
// partials (contiguous f64, norm_partials_count(grad.numel()) elements): per chunk, the sum of
// |g|^norm_type, or max |g| when norm_type is infinite. grad: contiguous f32/bf16/f16/f64.
void grad_norm_partials(const Tensor& grad, double norm_type, const Tensor& partials);
}  // namespace cpu
namespace cuda {
void adamw(const AdamWStep& s, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
           const Tensor& exp_avg_sq);
void sgd(const SgdStep& s, const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer);
void grad_norm_partials(const Tensor& grad, double norm_type, const Tensor& partials);
}  // namespace cuda

}  // namespace kiln::kernels
