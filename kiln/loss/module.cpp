// kiln::nn::LinearCrossEntropyLoss (kiln/loss/module.h).
#include "kiln/loss/module.h"

#include <cmath>

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/ops.h"

namespace kiln::nn {

LinearCrossEntropyLoss::LinearCrossEntropyLoss(int64_t in_features, int64_t num_classes,
                                               const LinearCrossEntropyOptions& options, Generator& gen, DType dtype,
                                               Device device)
    : options_(options) {
  KILN_CHECK(in_features > 0 && num_classes > 0, "LinearCrossEntropyLoss: in_features=", in_features,
             " and num_classes=", num_classes, " must be > 0");
  KILN_CHECK(is_floating(dtype), "LinearCrossEntropyLoss: dtype ", dtype_name(dtype), " is not floating");
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  {
    NoGradGuard ng;
    Tensor u = rand({num_classes, in_features}, gen, DType::f32, device);
    weight_ = add(mul(u, 2.0 * bound), -bound).to(dtype).contiguous();
  }
  weight_.requires_grad_(true);
}

LinearCrossEntropyLoss::LinearCrossEntropyLoss(Tensor weight, const LinearCrossEntropyOptions& options)
    : weight_(std::move(weight)), options_(options), owns_weight_(false) {
  KILN_CHECK(weight_.defined() && weight_.dim() == 2, "LinearCrossEntropyLoss: the external weight must be [V, d], got ",
             weight_.defined() ? shape_str(weight_.shape()) : std::string("an undefined tensor"));
}

LinearCrossEntropyResult LinearCrossEntropyLoss::forward(const Tensor& hidden, const Tensor& target) const {
  return linear_cross_entropy(hidden, weight_, target, options_);
}

}  // namespace kiln::nn
