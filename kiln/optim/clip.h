// clip_grad_norm_: the total norm of the gradients of a list of parameters, and in-place
// scaling of those gradients when it exceeds max_norm, as torch.nn.utils.clip_grad_norm_.
// The norm is computed in double in a fixed order (per gradient, fixed-size chunks, then a
// host sum in parameter order), so it is bitwise reproducible whatever the thread count.
// Parameters without a gradient are skipped.
#pragma once
#include <vector>

#include "kiln/optim/optimizer.h"

namespace kiln::optim {

struct ClipGradOptions {
  double norm_type = 2.0;           // p > 0, or INFINITY for the max norm
  // A non-finite total norm (NaN or inf gradients): throw kiln::Error when true; when false
  // (the default) the gradients are left UNCHANGED and the non-finite norm is returned, so the
  // caller can skip the step. (torch instead multiplies the gradients by NaN or 0.)
  bool error_if_nonfinite = false;
};

// Returns the total norm before clipping. When max_norm / (norm + 1e-6) < 1 every gradient
// is multiplied by that coefficient (rounded to f32; in f64 for f64 gradients), as torch;
// max_norm = inf never clips.
double clip_grad_norm_(const NamedTensors& params, double max_norm, const ClipGradOptions& options = {});
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, const ClipGradOptions& options = {});
// The total norm of the gradients alone (no clipping).
double grad_norm(const std::vector<Tensor>& params, double norm_type = 2.0);
// The sum of the partial norms (|g|^p per chunk; their max for inf) of the tensors `grads`
// themselves, in that fixed order: what grad_norm turns into a norm, and what a sharded norm
// sums over ranks before the root (FSDP's grad_norm).
double sum_of_norm_partials(const std::vector<Tensor>& grads, double norm_type = 2.0);

}  // namespace kiln::optim
