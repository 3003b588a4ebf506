// OptimizerInBackward: the optimizer step taken inside the backward, one parameter at a time
// (torchtune's optimizer_in_bwd; `kiln train --optimizer-in-backward`, docs/training.md). A
// post-accumulate hook on every parameter (ops/backward.h) updates it with Optimizer::step_parameter
// as soon as its gradient is complete and then drops that gradient, so the model's gradients are
// never all held at once: a step's peak memory loses up to the size of every gradient (f32: as
// much as the parameters). What this gives up, and why:
//   - no gradient-norm clip: the norm needs every gradient before the first update;
//   - no gradient accumulation: a micro-batch's gradient is used up before the next one adds to it;
//   - no skipped steps: the norm of the step (still measured, for the logs) is known only after the
//     parameters were updated, so a non-finite gradient reaches them (the trainer then stops at
//     once, before it saves anything).
// The norm is summed as the fused clip's (per-chunk partials in parameter order, then
// clip_from_partials, those of the parameters that got a gradient in parameter order), so it has
// the bits clip_and_step would have returned. A parameter whose gradient arrives twice in one step
// (a weight used in two graphs that are backpropagated separately) was updated with the first part:
// the second arrival is a kiln::Error, before a second update. The hooks stay on the parameters'
// accumulators after this object is gone, and then do nothing.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/optim/optimizer.h"

namespace kiln {
class AccumulateGrad;
}

namespace kiln::optim {

class OptimizerInBackward {
 public:
  // Registers the hooks on opt's parameters (all on one device). The optimizer must outlive this.
  explicit OptimizerInBackward(Optimizer& opt);
  ~OptimizerInBackward();
  OptimizerInBackward(const OptimizerInBackward&) = delete;
  OptimizerInBackward& operator=(const OptimizerInBackward&) = delete;

  // Before a step's backward: forgets the last step's gradients and updates.
  void begin_step();
  // After the backward: counts the optimizer step and returns its gradient norm (2-norm of the
  // gradients that arrived; one read from the device).
  double end_step();
  // Parameters updated in the current step so far.
  int64_t updated() const;

 private:
  void on_gradient(size_t i);
  // Parameter i's count of norm partials (its slice of partials_).
  int64_t partials_of(size_t i) const { return first_partial_[i + 1] - first_partial_[i]; }

  Optimizer& opt_;
  Device device_;
  std::vector<std::shared_ptr<AccumulateGrad>> accumulators_;  // keep the hooks registered
  std::vector<int64_t> first_partial_;  // per parameter: its first slot in partials_; then their total
  std::vector<bool> updated_;           // per parameter: updated in the current step
  Tensor partials_;                     // f64, every parameter's per-chunk |g|^2 sums
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // the hooks' guard (weakly held)
};

}  // namespace kiln::optim
