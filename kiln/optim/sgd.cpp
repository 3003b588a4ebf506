// SGD: hyper-parameter checks and the per-parameter step scalars, then the fused kernel: per
// parameter, or multi-tensor.
#include "kiln/optim/sgd.h"

#include <cmath>

#include "kiln/kernels/dispatch.h"
#include "kiln/kernels/optim.h"

namespace kiln::optim {
namespace {

void check_sgd(double momentum, double dampening, bool nesterov, const char* op) {
  KILN_CHECK(std::isfinite(momentum) && momentum >= 0.0, op, ": momentum=", momentum, " must be finite and >= 0");
  KILN_CHECK(std::isfinite(dampening), op, ": dampening=", dampening, " must be finite");
  KILN_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), op,
             ": nesterov needs momentum > 0 and dampening == 0 (got momentum=", momentum, ", dampening=", dampening,
             ")");
}

std::vector<std::string> sgd_buffers(double momentum) {
  if (momentum != 0.0) return {"momentum_buffer"};
  return {};
}

}  // namespace

SGD::SGD(NamedTensors params, const SgdOptions& o)
    : Optimizer("sgd", std::move(params), o.lr, o.weight_decay, o.decay, sgd_buffers(o.momentum)),
      momentum_(o.momentum), dampening_(o.dampening), nesterov_(o.nesterov) {
  check_sgd(momentum_, dampening_, nesterov_, "sgd");
}

kernels::SgdStep SGD::step_scalars(double weight_decay, int64_t step) const {
  kernels::SgdStep s;
  s.lr = static_cast<float>(lr());
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum_);
  s.one_minus_dampening = static_cast<float>(1.0 - dampening_);
  s.nesterov = nesterov_;
  s.first = step == 1;
  return s;
}

void SGD::update(const Tensor& param, const Tensor& grad, const std::vector<Tensor>& buffers, double weight_decay,
                 int64_t step) {
  Tensor buf = buffers.empty() ? Tensor() : buffers[0];
  KILN_DEVICE_CALL(param.device(), sgd, step_scalars(weight_decay, step), param, grad, buf);
}

void SGD::update_multi(Device device, const std::vector<MultiItem>& items, const Tensor& clip) {
  std::vector<kernels::SgdSlot> slots;
  slots.reserve(items.size());
  for (const MultiItem& it : items) {
    if (it.param.numel() == 0) continue;
    kernels::SgdSlot sl;
    sl.p = it.param.data<float>();
    sl.buf = it.buffers->empty() ? nullptr : (*it.buffers)[0].data<float>();
    sl.g = it.grad.data_ptr();
    sl.n = it.param.numel();
    sl.s = step_scalars(it.weight_decay, it.step);
    sl.grad_bf16 = it.grad.dtype() == DType::bf16;
    slots.push_back(sl);
  }
  if (!slots.empty()) KILN_DEVICE_CALL(device, sgd_multi, device, slots, clip);
}

void SGD::save_hyperparameters(json::Value& out) const {
  out["momentum"] = momentum_;
  out["dampening"] = dampening_;
  out["nesterov"] = nesterov_;
}

void SGD::load_hyperparameters(const json::Value& in) {
  auto find = [&](const char* key) -> const json::Value& {
    const json::Value* v = in.find(key);
    KILN_CHECK(v != nullptr, "sgd load_state_dict: scalars have no '", key, "'");
    return *v;
  };
  const double momentum = find("momentum").as_double("momentum");
  const double dampening = find("dampening").as_double("dampening");
  const bool nesterov = find("nesterov").as_bool("nesterov");
  check_sgd(momentum, dampening, nesterov, "sgd load_state_dict");
  // The buffers were fixed at construction: a state with(out) momentum cannot be loaded into an
  // optimizer without(with) it.
  KILN_CHECK((momentum != 0.0) == (momentum_ != 0.0), "sgd load_state_dict: the state has momentum=", momentum,
             ", this optimizer momentum=", momentum_, " (one of them keeps no momentum buffer)");
  momentum_ = momentum;
  dampening_ = dampening;
  nesterov_ = nesterov;
}

}  // namespace kiln::optim
