// Activation checkpointing: a forward without history, a recorded node that recomputes it.
#include "kiln/nn/checkpoint.h"

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/backward.h"

namespace kiln::nn {
namespace {

class GradOn {  // grad mode on for a scope (the engine runs a node's backward with it off)
 public:
  GradOn() : previous_(grad_enabled()) { set_grad_enabled(true); }
  ~GradOn() { set_grad_enabled(previous_); }
  GradOn(const GradOn&) = delete;
  GradOn& operator=(const GradOn&) = delete;

 private:
  bool previous_;
};

}  // namespace

Tensor checkpoint(const CheckpointFn& fn, const Tensor& x) {
  if (!grad_enabled() || !x.requires_grad()) return fn(x);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = fn(x);
  }
  KILN_CHECK(out.defined() && !out.is_same(x), "checkpoint: the function must return a new tensor");
  SavedTensor saved(x);
  record("checkpoint", {x}, out, [saved, fn](const std::vector<Tensor>& grads) -> std::vector<Tensor> {
    Tensor in = saved.get("checkpoint").detach();
    in.requires_grad_(true);
    Tensor y;
    {
      GradOn on;
      y = fn(in);
    }
    KILN_CHECK(y.requires_grad(), "checkpoint: the recomputed output does not depend on anything needing a gradient");
    // retain_graph: nodes the recomputation reaches outside itself (the bf16 casts of the
    // parameters) belong to the caller's graph and are freed with it; the recomputed nodes go
    // when `y` does, at the end of this backward.
    run_backward({y}, {grads.at(0)}, /*retain_graph=*/true);
    return {in.grad()};
  });
  return out;
}

}  // namespace kiln::nn
