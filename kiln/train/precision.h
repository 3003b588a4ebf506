// ParamCast: the trainer's mixed precision. For each forward the module's f32 master parameters
// are replaced by recorded casts to the compute dtype (bf16); afterwards the masters are put
// back. The forward's graph holds the casts it used, so its backward reaches the masters'
// gradients, and each forward (each micro-batch, each eval batch) has casts of its own: a
// micro-batch's backward never meets a cast an earlier backward freed (--accum N in bf16), and
// between forwards the module holds only its masters (checkpoints, the optimizer, the sample).
// The trainer puts the masters back after the micro-batch's backward, not right after its
// forward: an activation checkpoint (nn/checkpoint.h) recomputes its forward in the backward
// from the parameters it reads then, which must be the same casts.
#pragma once
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/nn/module.h"

namespace kiln::train {

class ParamCast {
 public:
  // `compute` f32 (the masters' dtype): nothing is cast.
  ParamCast(nn::Module& module, DType compute) : module_(module), compute_(compute) {}
  bool enabled() const { return compute_ != DType::f32; }
  void pre_forward() {
    if (!enabled() || !saved_.empty()) return;
    for (auto& [name, p] : module_.named_parameters()) {
      saved_.emplace_back(p, *p);
      *p = p->to(compute_);
    }
  }
  void post_forward() {
    for (auto& [p, master] : saved_) *p = master;
    saved_.clear();
  }
  // The casts for the scope of one forward (and its backward); post_forward also on a throw.
  class Forward {
   public:
    explicit Forward(ParamCast& c) : c_(c) { c_.pre_forward(); }
    ~Forward() { c_.post_forward(); }
    Forward(const Forward&) = delete;
    Forward& operator=(const Forward&) = delete;

   private:
    ParamCast& c_;
  };

 private:
  nn::Module& module_;
  DType compute_;
  std::vector<std::pair<Tensor*, Tensor>> saved_;
};

}  // namespace kiln::train
