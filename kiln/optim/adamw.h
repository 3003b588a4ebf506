// AdamW, exactly as torch.optim.AdamW (amsgrad off): decoupled weight decay, bias-corrected
// moments, eps added after the square root of the bias-corrected second moment. One fused
// multi-tensor update over all parameters of a device, or one kernel per parameter
// (kernels/optim.h). State buffers: "exp_avg", "exp_avg_sq".
#pragma once
#include <cstdint>
#include "kiln/kernels/optim.h"
#include "kiln/optim/optimizer.h"

namespace kiln::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  DecayFilter decay;  // unset: every parameter decays; see decay_matrices_only
};

class AdamW final : public Optimizer {
 public:
  explicit AdamW(NamedTensors params, const AdamWOptions& options = {});
  double beta1() const { return beta1_; }
  double beta2() const { return beta2_; }
  double eps() const { return eps_; }

 protected:
  void update(const Tensor& param, const Tensor& grad, const std::vector<Tensor>& buffers, double weight_decay,
              int64_t step) override;
  void update_multi(Device device, const std::vector<MultiItem>& items, const Tensor& clip) override;
  void save_hyperparameters(json::Value& out) const override;
  void load_hyperparameters(const json::Value& in) override;

 private:
  // The scalars of one update of a parameter (its weight decay, its update count).
  kernels::AdamWStep step_scalars(double weight_decay, int64_t step) const;
  double beta1_, beta2_, eps_;
};

}  // namespace kiln::optim
