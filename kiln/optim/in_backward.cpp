// OptimizerInBackward (in_backward.h): the hooks that update each parameter as its gradient
// arrives, and the step's gradient norm from per-chunk partials.
#include "kiln/optim/in_backward.h"

#include <algorithm>
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
  first_partial_.push_back(total);
  partials_ = zeros({total}, DType::f64, device_);
  updated_.assign(params.size(), false);
  // A graph still holding a parameter's accumulator after this object is gone must not call it.
  std::weak_ptr<bool> alive = alive_;
  for (size_t i = 0; i < params.size(); ++i)
    accumulators_.push_back(register_post_accumulate_grad_hook(params[i].second, [this, alive, i](const Tensor&) {
      if (alive.lock()) on_gradient(i);
    }));
}

OptimizerInBackward::~OptimizerInBackward() = default;

void OptimizerInBackward::begin_step() {
  NoGradGuard no_grad;
  partials_.zero_();
  updated_.assign(updated_.size(), false);
}

int64_t OptimizerInBackward::updated() const { return std::count(updated_.begin(), updated_.end(), true); }

void OptimizerInBackward::on_gradient(size_t i) {
  NoGradGuard no_grad;
  Tensor p = opt_.params()[i].second;  // a handle on the parameter (set_grad below)
  const Tensor g = p.grad();
  if (!g.defined()) return;
  KILN_CHECK(!updated_[i], "optimizer in backward: parameter '", opt_.params()[i].first, "' got a second "
             "gradient in one step, after its update (a weight used in graphs that are backpropagated separately): "
             "train without --optimizer-in-backward");
  if (const int64_t count = partials_of(i); count > 0) {
    const Tensor gc = g.is_contiguous() ? g.detach() : g.detach().contiguous();
    KILN_DEVICE_CALL(device_, grad_norm_partials, gc, 2.0, partials_.narrow(0, first_partial_[i], count));
  }
  opt_.step_parameter(i);
  p.set_grad(Tensor());  // used up: its memory goes back now, not after the whole backward
  updated_[i] = true;
}

double OptimizerInBackward::end_step() {
  opt_.end_step();
  NoGradGuard no_grad;
  // The partials of the parameters that got a gradient, in parameter order, as clip_and_step lays
  // them out (on CUDA the reduction's split depends on their count).
  Tensor partials = partials_;
  if (updated() < static_cast<int64_t>(updated_.size())) {
    int64_t total = 0;
    for (size_t i = 0; i < updated_.size(); ++i)
      if (updated_[i]) total += partials_of(i);
    partials = Tensor::empty({total}, DType::f64, device_);
    int64_t at = 0;
    for (size_t i = 0; i < updated_.size(); ++i) {
      if (!updated_[i] || partials_of(i) == 0) continue;
      partials.narrow(0, at, partials_of(i)).copy_(partials_.narrow(0, first_partial_[i], partials_of(i)));
      at += partials_of(i);
    }
  }
  const Tensor clip = Tensor::empty({2}, DType::f64, device_);
  KILN_DEVICE_CALL(device_, clip_from_partials, partials, 2.0, INFINITY, clip);
  return clip.to_vector<double>()[0];
}

}  // namespace kiln::optim
