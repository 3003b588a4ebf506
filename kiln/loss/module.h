// kiln::nn::LinearCrossEntropyLoss: the output projection + loss as a module. It owns its
// weight [V, d] or uses an external (tied) weight such as the embedding's, whose gradient then
// accumulates into that one parameter. Self-contained for now (no Module base class yet: the
// integrator adapts it to kiln/nn/module.h).
#pragma once
#include <cstdint>

#include "kiln/core/rng.h"
#include "kiln/loss/linear_cross_entropy.h"

namespace kiln::nn {

class LinearCrossEntropyLoss {
 public:
  // Own weight [num_classes, in_features], initialised as nn.Linear's: U(−1/√in, 1/√in).
  LinearCrossEntropyLoss(int64_t in_features, int64_t num_classes, const LinearCrossEntropyOptions& options,
                         Generator& gen, DType dtype = DType::f32, Device device = kCPU);
  // External (tied) weight [V, d]: shared, not copied; gradients accumulate into it.
  explicit LinearCrossEntropyLoss(Tensor weight, const LinearCrossEntropyOptions& options = {});

  // hidden [N, d] or [B, T, d], target [N] or [B, T].
  LinearCrossEntropyResult forward(const Tensor& hidden, const Tensor& target) const;
  LinearCrossEntropyResult operator()(const Tensor& hidden, const Tensor& target) const {
    return forward(hidden, target);
  }

  const Tensor& weight() const { return weight_; }
  Tensor& weight() { return weight_; }
  bool owns_weight() const { return owns_weight_; }
  int64_t in_features() const { return weight_.size(1); }
  int64_t num_classes() const { return weight_.size(0); }
  LinearCrossEntropyOptions& options() { return options_; }
  const LinearCrossEntropyOptions& options() const { return options_; }

 private:
  Tensor weight_;
  LinearCrossEntropyOptions options_;
  bool owns_weight_ = true;
};

}  // namespace kiln::nn
