// OptimizerInBackward (in_backward.h): the hooks that update each parameter as its gradient
// arrives, and the step's gradient norm from per-chunk partials.
#include "kiln/optim/in_backward.h"

#include <cmath>

#include "kiln/autograd/grad_mode.h"
#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/optim.h"
#include "kiln/ops/backward.h"
#include "kiln/ops/ops.h"

namespace kiln::optim {

OptimizerInBackward::OptimizerInBackward(Optimizer& opt) : opt_(opt) {
  const NamedTensors& params = opt_.params();
  KILN_CHECK(!params.empty(), "optimizer in backward: the optimizer has no parameters");
  device_ = params[0].second.device();
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, p] = params[i];
    KILN_CHECK(p.device() == device_, "optimizer in backward: parameter '", name, "' is on ", p.device().str(),
               ", the first on ", device_.str(), " (one device)");
    first_partial_.push_back(total);
    total += kernels::norm_partials_count(p.numel());
  }
  partials_ = zeros({total}, DType::f64, device_);
  updates_.assign(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i)
    accumulators_.push_back(register_post_accumulate_grad_hook(params[i].second, [this, i](const Tensor&) {
      on_gradient(i);
    }));
}

OptimizerInBackward::~OptimizerInBackward() = default;

void OptimizerInBackward::begin_step() {
  NoGradGuard no_grad;
  partials_.zero_();
  updates_.assign(updates_.size(), 0);
  updated_ = 0;
}

void OptimizerInBackward::on_gradient(size_t i) {
  NoGradGuard no_grad;
  Tensor p = opt_.params()[i].second;  // a handle on the parameter (set_grad below)
  const Tensor g = p.grad();
  if (!g.defined()) return;
  KILN_CHECK(updates_[i] == 0, "optimizer in backward: parameter '", opt_.params()[i].first, "' got a second "
             "gradient in one step, after its update (a weight used in graphs that are backpropagated separately): "
             "train without --optimizer-in-backward");
  const int64_t count = kernels::norm_partials_count(p.numel());
  if (count > 0) {
    const Tensor gc = g.is_contiguous() ? g.detach() : g.detach().contiguous();
    KILN_DEVICE_CALL(device_, grad_norm_partials, gc, 2.0, partials_.narrow(0, first_partial_[i], count));
  }
  opt_.step_parameter(i);
  p.set_grad(Tensor());  // used up: its memory goes back now, not after the whole backward
  ++updates_[i];
  ++updated_;
}

double OptimizerInBackward::end_step() {
  opt_.end_step();
  NoGradGuard no_grad;
  const Tensor clip = Tensor::empty({2}, DType::f64, device_);
  KILN_DEVICE_CALL(device_, clip_from_partials, partials_, 2.0, INFINITY, clip);
  return clip.to_vector<double>()[0];
}

}  // namespace kiln::optim
