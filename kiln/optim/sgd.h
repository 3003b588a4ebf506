// SGD with momentum, dampening, Nesterov and (coupled, L2) weight decay, exactly as
// torch.optim.SGD. One fused multi-tensor update over all parameters of a device, or one kernel
// per parameter (kernels/optim.h). State buffer:
// "momentum_buffer" (only when momentum != 0).
#pragma once
#include <cstdint>
#include "kiln/kernels/optim.h"
#include "kiln/optim/optimizer.h"

namespace kiln::optim {

struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0
  DecayFilter decay;      // unset: every parameter decays
};

class SGD final : public Optimizer {
 public:
  explicit SGD(NamedTensors params, const SgdOptions& options = {});
  double momentum() const { return momentum_; }
  double dampening() const { return dampening_; }
  bool nesterov() const { return nesterov_; }

 protected:
  void update(const Tensor& param, const Tensor& grad, const std::vector<Tensor>& buffers, double weight_decay,
              int64_t step) override;
  void update_multi(Device device, const std::vector<MultiItem>& items, const Tensor& clip) override;
  void save_hyperparameters(json::Value& out) const override;
  void load_hyperparameters(const json::Value& in) override;

 private:
  kernels::SgdStep step_scalars(double weight_decay, int64_t step) const;
  double momentum_, dampening_;
  bool nesterov_;
};

}  // namespace kiln::optim
