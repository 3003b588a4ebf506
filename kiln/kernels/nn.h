// Kernel entry points of the neural-network ops (front ends in kiln/ops/nn*.cpp; bodies in
// cpu/nn.cpp and cuda/nn.cu). Every tensor argument is contiguous (the front ends make it so);
// 16-bit inputs compute in f32 (f64 on CPU), statistics (rstd, lse, per-row loss) are f32, or
// f64 for f64 inputs. All reductions run in a fixed order: results are bitwise reproducible.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::kernels {

#define KILN_NN_KERNELS                                                                                     \
  /* First position p with ids[p] outside [lo, hi) and ids[p] != ignore, or -1 (ids i64/i32). */           \
  int64_t first_out_of_range(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore);                    \
  /* out [N, d] = weight [V, d] rows at ids [N] (ids already range-checked). */                            \
  void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& ids);                       \
  /* dweight [V, d] (fully written) = sum over positions n with ids[n] == v of grad[n] (fixed order). */    \
  void embedding_backward(const Tensor& dweight, const Tensor& grad, const Tensor& ids);                    \
  /* x, out [rows, d]; weight [d]; rstd [rows] (f32, f64 for f64 x) = 1/sqrt(mean(x^2) + eps). */          \
  void rms_norm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& weight,      \
                        double eps);                                                                        \
  /* dx [rows, d]; dweight [d] (weight dtype, undefined to skip). */                                        \
  void rms_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,        \
                         const Tensor& weight, const Tensor& rstd);                                         \
  /* x, out [rows, T, D]; cos, sin f32 [T, D]: out = x*cos + rotate_half(x)*sin, or with transpose */    \
  /* its adjoint (the backward): out_c = x_c*cos_c + (c < D/2 ? x_{c+D/2}*sin_{c+D/2} : -x_{c-D/2}*sin_{c-D/2}) */ \
  void rotary(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose);   \
  /* logits [N, C], target [N]; loss, lse [N] (f32, f64 for f64 logits). Ignored rows: loss 0. */         \
  void cross_entropy_forward(const Tensor& loss, const Tensor& lse, const Tensor& logits,                  \
                             const Tensor& target, int64_t ignore_index, double label_smoothing);           \
  /* dlogits [N, C] = scale[n] * (softmax - (1-ls)*onehot - ls/C); 0 on ignored rows. scale like lse. */   \
  void cross_entropy_backward(const Tensor& dlogits, const Tensor& scale, const Tensor& logits,            \
                              const Tensor& target, const Tensor& lse, int64_t ignore_index,                \
                              double label_smoothing);                                                      \
  /* keep [n] (bool) = uniform(philox_element(seed, offset, i).v[0]) >= p. */                               \
  void dropout_mask(const Tensor& keep, uint64_t seed, uint64_t offset, double p);                          \
  /* out = silu(gate)·up; dgate, dup from grad (one shape; swiglu_math of kernels/elementwise.h). */       \
  void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);                             \
  void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& grad, const Tensor& gate,      \
                       const Tensor& up);

namespace cpu {
KILN_NN_KERNELS
}  // namespace cpu

// CUDA only: the range check of first_out_of_range without a host synchronisation. A failure
// (the first out-of-range position of this call and its value) is recorded on the device and
// raised as kiln::Error "<what>[pos]=value<tail>" at the next point the host synchronises with
// the device anyway (a device-to-host copy such as item(), or synchronize()).
namespace cuda {
void defer_range_check(const Tensor& ids, int64_t lo, int64_t hi, int64_t ignore, const std::string& what,
                       const std::string& tail);
// Waits for `device`'s current stream, then raises a deferred check's failure (if any).
void synchronize_and_check(int device);
// CUDA graphs (train/step_graph.h): a replayed graph's check kernels write the positions they were
// captured at, so the host must hold the same records there at each replay. The count of checks
// queued now; the records (what, tail) queued from `mark` on; and those queued again at `mark`,
// before the replay is queued (after a synchronisation that reports and clears the queue when it
// holds more than `mark` checks; positions below `mark` are filled with records of no check).
size_t deferred_check_count(int device);
std::vector<std::pair<std::string, std::string>> deferred_checks_since(int device, size_t mark);
void requeue_deferred_checks(int device, size_t mark, const std::vector<std::pair<std::string, std::string>>& checks);
}  // namespace cuda
namespace cuda {
KILN_NN_KERNELS
}  // namespace cuda
#undef KILN_NN_KERNELS

}  // namespace kiln::kernels
