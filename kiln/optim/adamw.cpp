// AdamW: hyper-parameter checks and the per-parameter step scalars (computed in double, as
// torch does in Python floats), then the fused kernel: per parameter, or multi-tensor.
#include "kiln/optim/adamw.h"

#include <cmath>

#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/optim.h"

namespace kiln::optim {
namespace {

void check_adamw(double beta1, double beta2, double eps, const char* op) {
  KILN_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1=", beta1, " must be in [0, 1)");
  KILN_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2=", beta2, " must be in [0, 1)");
  KILN_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps=", eps, " must be finite and >= 0");
}

}  // namespace

AdamW::AdamW(NamedTensors params, const AdamWOptions& o)
    : Optimizer("adamw", std::move(params), o.lr, o.weight_decay, o.decay, {"exp_avg", "exp_avg_sq"}),
      beta1_(o.beta1), beta2_(o.beta2), eps_(o.eps) {
  check_adamw(beta1_, beta2_, eps_, "adamw");
}

kernels::AdamWStep AdamW::step_scalars(double weight_decay, int64_t step) const {
  const double lr = this->lr();
  const double t = static_cast<double>(step);
  kernels::AdamWStep s;
  s.lr_wd = static_cast<float>(lr * weight_decay);
  s.beta1 = static_cast<float>(beta1_);
  s.beta2 = static_cast<float>(beta2_);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1_);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2_);
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1_, t)));
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2_, t)));
  s.eps = static_cast<float>(eps_);
  return s;
}

void AdamW::update(const Tensor& param, const Tensor& grad, const std::vector<Tensor>& buffers, double weight_decay,
                   int64_t step) {
  KILN_DEVICE_CALL(param.device(), adamw, step_scalars(weight_decay, step), param, grad, buffers[0], buffers[1]);
}

void AdamW::update_multi(Device device, const std::vector<MultiItem>& items, const Tensor& clip) {
  std::vector<kernels::AdamWSlot> slots;
  slots.reserve(items.size());
  for (const MultiItem& it : items) {
    if (it.param.numel() == 0) continue;
    kernels::AdamWSlot sl;
    sl.p = it.param.data<float>();
    sl.m = (*it.buffers)[0].data<float>();
    sl.v = (*it.buffers)[1].data<float>();
    sl.g = it.grad.data_ptr();
    sl.n = it.param.numel();
    sl.s = step_scalars(it.weight_decay, it.step);
    sl.grad_bf16 = it.grad.dtype() == DType::bf16;
    slots.push_back(sl);
  }
  if (!slots.empty()) KILN_DEVICE_CALL(device, adamw_multi, device, slots, clip);
}

void AdamW::save_hyperparameters(json::Value& out) const {
  out["beta1"] = beta1_;
  out["beta2"] = beta2_;
  out["eps"] = eps_;
}

void AdamW::load_hyperparameters(const json::Value& in) {
  auto get = [&](const char* key) {
    const json::Value* v = in.find(key);
    KILN_CHECK(v != nullptr, "adamw load_state_dict: scalars have no '", key, "'");
    return v->as_double(key);
  };
  const double b1 = get("beta1"), b2 = get("beta2"), eps = get("eps");
  check_adamw(b1, b2, eps, "adamw load_state_dict");
  beta1_ = b1;
  beta2_ = b2;
  eps_ = eps;
}

}  // namespace kiln::optim
