// Optimizer kernels: the AdamW and SGD updates (the math is written once below, host+device,
// and used by cpu/optim.cpp and cuda/optim.cu), per parameter (one fused pass each) and
// multi-tensor (one pass over a list of parameters: one parallel loop on the CPU, one launch per
// kMaxMultiSlots parameters on CUDA), and the per-chunk partial norms that clip_grad_norm_ and the
// fused clip sum in a fixed order. Parameters and optimizer state are contiguous f32; gradients
// contiguous f32 or bf16 of the same shape. No reductions in the updates, so every run gives the
// same bits; the norm's reduction order is fixed (NOTE [multi-tensor step], docs/optim.md).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

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

// NOTE [multi-tensor step]
// Optimizer::step and clip_and_step (optim/optimizer.h) hand every parameter of a device to one
// multi-tensor call instead of one kernel per parameter. A fused clip computes all partials of
// all gradients in one call (grad_norm_partials_multi: kNormChunk elements per partial, each as
// grad_norm_partials computes it), reduces them on the device into the clip tensor
// (clip_from_partials), and the update reads the scale from there: no pass that scales the
// gradients, no host round trip between the norm and the update. The CPU's sum runs in
// clip_grad_norm_'s order, so a fused f32 step gives the bits of clip_grad_norm_ + step; the
// update multiplies g by the scale in f32, which for f32 gradients is mul_'s rounding too (for
// bf16 gradients mul_ rounded the product to bf16 first; the fused step does not).
// One parameter of a multi-tensor update: raw pointers to contiguous buffers of n elements
// (g: f32, or bf16 when grad_bf16), and that parameter's step scalars (its own update count and
// weight decay).
struct AdamWSlot {
  float* p = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* g = nullptr;
  int64_t n = 0;
  AdamWStep s;
  bool grad_bf16 = false;
};
struct SgdSlot {
  float* p = nullptr;
  float* buf = nullptr;  // null when s.momentum == 0
  const void* g = nullptr;
  int64_t n = 0;
  SgdStep s;
  bool grad_bf16 = false;
};
// One gradient of a multi-tensor norm: its partials are norm_partials_count(n) consecutive
// entries of the partials buffer, the slots' in slot order.
struct NormSlot {
  const void* g = nullptr;
  int64_t n = 0;
  bool grad_bf16 = false;
};
// CUDA: the slots of one launch travel as a kernel parameter (CUDA 12.1's 32 KiB limit); longer
// lists take one launch per this many slots.
inline constexpr int kMaxMultiSlots = 256;

// The clip of a fused step, a contiguous f64 tensor of 2 elements on the parameters' device:
// {total norm, scale}. An update given one multiplies each gradient element (in f32) by
// float(scale) and does nothing at all when the norm is not finite (the step is skipped); an
// undefined clip tensor means scale 1, never skipped.
// The norm from a sum of |g|^p (or the max |g| for mode kNormInf), as clip_grad_norm_.
inline constexpr int kNormPow = 0, kNormL2 = 1, kNormL1 = 2, kNormInf = 3;
inline int norm_mode(double norm_type) {
  return std::isinf(norm_type) ? kNormInf : norm_type == 2.0 ? kNormL2 : norm_type == 1.0 ? kNormL1 : kNormPow;
}
KILN_HD double norm_from_sum(double acc, int mode, double norm_type) {
  using std::pow;
  using std::sqrt;
  if (mode == kNormL2) return sqrt(acc);
  if (mode == kNormPow) return pow(acc, 1.0 / norm_type);
  return acc;
}
// torch's coefficient: max_norm / (norm + 1e-6) when below 1 (rounded to f32, the gradients'
// precision), else 1 (max_norm = inf never clips).
KILN_HD double clip_scale(double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<double>(static_cast<float>(coef)) : 1.0;
}

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
// Multi-tensor forms; every slot's buffers live on `device`. clip: see above.
void adamw_multi(Device device, const std::vector<AdamWSlot>& slots, const Tensor& clip);
void sgd_multi(Device device, const std::vector<SgdSlot>& slots, const Tensor& clip);
// partials: contiguous f64, sum of norm_partials_count(n) over the slots; each chunk's partial
// is computed as grad_norm_partials computes it.
void grad_norm_partials_multi(Device device, const std::vector<NormSlot>& slots, double norm_type,
                              const Tensor& partials);
// clip = {norm, clip_scale(norm, max_norm)}, the norm from all partials. CPU: summed one after
// another in index order (clip_grad_norm_'s order, so the same bits); CUDA: one block, each
// thread a contiguous run, then a fixed tree.
void clip_from_partials(const Tensor& partials, double norm_type, double max_norm, const Tensor& clip);
}  // namespace cpu
namespace cuda {
void adamw(const AdamWStep& s, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
           const Tensor& exp_avg_sq);
void sgd(const SgdStep& s, const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer);
void grad_norm_partials(const Tensor& grad, double norm_type, const Tensor& partials);
void adamw_multi(Device device, const std::vector<AdamWSlot>& slots, const Tensor& clip);
void sgd_multi(Device device, const std::vector<SgdSlot>& slots, const Tensor& clip);
void grad_norm_partials_multi(Device device, const std::vector<NormSlot>& slots, double norm_type,
                              const Tensor& partials);
void clip_from_partials(const Tensor& partials, double norm_type, double max_norm, const Tensor& clip);
}  // namespace cuda

}  // namespace kiln::kernels
