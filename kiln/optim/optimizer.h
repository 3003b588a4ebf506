// Optimizer: the base of kiln's optimizers (AdamW in adamw.h, SGD in sgd.h). It holds a list
// of named f32 leaf parameters, per-parameter state (a step count and named f32 buffers such
// as "exp_avg"), the learning rate, and which parameters get weight decay. step() skips
// parameters without a gradient (as torch), clip_and_step() fuses clip_grad_norm_ into it,
// zero_grad() clears gradients, and
// state_dict()/load_state_dict() turn the state into named tensors plus a JSON object of
// scalars that a checkpoint stores (safetensors + JSON); a run resumed from them continues
// bitwise identically. Format and formulas: docs/optim.md.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/io/json.h"

namespace kiln::optim {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Decides which parameters get weight decay; returning false exempts a parameter (its
// weight decay is 0). Unset: every parameter decays.
using DecayFilter = std::function<bool(const std::string& name, const Tensor& param)>;
// The usual choice (nanoGPT, llm.c): decay tensors of rank >= 2 (matrices, embeddings), not
// norm weights or biases.
bool decay_matrices_only(const std::string& name, const Tensor& param);

// What state_dict() returns and load_state_dict() takes.
struct OptimizerState {
  // "<buffer>.<parameter name>", e.g. "exp_avg.layers.0.attn.wq"; f32, shaped as the parameter.
  NamedTensors tensors;
  // {"optimizer": "adamw", "step": calls of step(), "lr": ..., hyper-parameters...,
  //  "no_decay": [names], "param_steps": {name: updates of that parameter}}
  json::Value scalars;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient (others are skipped and keep their state),
  // then counts one step. Runs without recording autograd history.
  void step();
  // clip_grad_norm_(params(), max_norm, {norm_type}) and step() fused (NOTE [multi-tensor step],
  // kernels/optim.h): the total norm of the gradients from one multi-tensor reduction per device,
  // the clip's scale applied inside the update (the gradients themselves are not changed). Returns
  // the norm before clipping (0 when no parameter has a gradient). A non-finite norm skips the
  // step: parameters, state and step counts stay as they were (as a caller of clip_grad_norm_
  // that skips step() on a non-finite norm). max_norm = inf only measures the norm (as grad_norm).
  // With f32 gradients on the CPU the result has the bits of clip_grad_norm_ + step(); with bf16
  // gradients it is closer to exact (clip_grad_norm_ rounds the scaled gradient to bf16). One host
  // synchronisation, after the update was issued, to return the norm.
  double clip_and_step(double max_norm, double norm_type = 2.0);
  // clip_and_step's update with the total norm computed elsewhere (for example FSDP's norm over
  // every rank's shards, parallel/fsdp.h): the gradients are scaled by
  // kernels::clip_scale(total_norm, max_norm) inside the update, as clip_grad_norm_ would have
  // scaled them. A non-finite total_norm skips the step (nothing changes) and returns false.
  bool step_with_norm(double total_norm, double max_norm);
  // The optimizer step one parameter at a time, as its gradient arrives in the backward (torchtune's
  // optimizer-in-backward; kiln train --optimizer-in-backward): step_parameter(i) updates parameter i
  // from its gradient as step() would (nothing when it has none; no clip), end_step() then counts
  // the step. Calling step_parameter(i) for every parameter and then end_step() gives step()'s bits.
  void step_parameter(size_t i);  // kiln::Error past the last parameter, or for a bad gradient
  void end_step() { ++step_count_; }
  // The multi-tensor path (the default) or one kernel per parameter (the reference the tests
  // compare with; clip_and_step then runs clip_grad_norm_ and the per-parameter updates).
  void set_multi_tensor(bool on) { multi_tensor_ = on; }
  bool multi_tensor() const { return multi_tensor_; }
  // Clears the gradients: undefined (set_to_none, the default, as torch) or filled with zeros.
  void zero_grad(bool set_to_none = true);

  double lr() const { return lr_; }
  void set_lr(double lr);  // kiln::Error unless finite and >= 0
  // Calls of step() so far (restored by load_state_dict).
  int64_t step_count() const { return step_count_; }
  const NamedTensors& params() const { return params_; }
  double weight_decay() const { return weight_decay_; }
  // Whether parameter i gets weight decay (false when the decay filter exempted it).
  bool decays(size_t i) const;  // kiln::Error past the last parameter
  const std::string& kind() const { return kind_; }  // "adamw", "sgd"

  // The state as named tensors and scalars. The tensors are the optimizer's own buffers (no
  // copy): save them before the next step(). Parameters never updated have no tensors.
  OptimizerState state_dict() const;
  // Replaces the state with a copy of `state` (tensors may be on any device: they are copied
  // to the parameter's). Restores the step counts, lr and hyper-parameters. Throws kiln::Error
  // naming the entry when the optimizer kind, a name, a shape or a dtype does not match, and
  // then leaves the current state unchanged.
  void load_state_dict(const OptimizerState& state);

 protected:
  // kind: "adamw"; buffers: the names of the per-parameter state tensors.
  Optimizer(std::string kind, NamedTensors params, double lr, double weight_decay, const DecayFilter& decay,
            std::vector<std::string> buffers);

  // Updates one parameter: param and grad contiguous (grad f32 or bf16, same shape and
  // device), buffers allocated (zeros on its first update), `step` = its update count
  // including this one (1 on the first update).
  virtual void update(const Tensor& param, const Tensor& grad, const std::vector<Tensor>& buffers, double weight_decay,
                      int64_t step) = 0;
  // One parameter of a multi-tensor update: as update()'s arguments.
  struct MultiItem {
    Tensor param, grad;
    const std::vector<Tensor>* buffers = nullptr;
    double weight_decay = 0;
    int64_t step = 0;
  };
  // Updates every item (all on `device`) in one multi-tensor call; clip as kernels/optim.h's
  // (undefined: no clip).
  virtual void update_multi(Device device, const std::vector<MultiItem>& items, const Tensor& clip) = 0;
  // The hyper-parameters (besides lr and weight decay) as JSON members, and their restore
  // (validated) from a state's scalars.
  virtual void save_hyperparameters(json::Value& out) const = 0;
  virtual void load_hyperparameters(const json::Value& in) = 0;

 private:
  struct ParamState {
    int64_t step = 0;              // 0: never updated, buffers empty
    std::vector<Tensor> buffers;   // one per buffer name
  };
  std::string kind_;
  NamedTensors params_;
  std::vector<bool> decay_;
  std::vector<std::string> buffer_names_;
  std::vector<ParamState> state_;
  double lr_ = 0;
  double weight_decay_ = 0;
  int64_t step_count_ = 0;
  bool multi_tensor_ = true;

  // What a step clips by: nothing (step()), a norm it computes (clip_and_step) or a norm it is
  // given (step_with_norm).
  struct Clip {
    bool on = false;
    double max_norm = 0, norm_type = 2.0;
    bool given = false;
    double norm = 0;  // when given
  };
  // Returns the norm (0 without a clip).
  double run_step(const Clip& clip);
  // Parameter i's gradient, checked (shape, device, dtype) and contiguous; undefined when it has none.
  Tensor checked_grad(size_t i) const;
  // Updates parameter i from `grad` (checked_grad's) with the per-parameter kernel and counts it.
  void update_one(size_t i, const Tensor& grad);
  double run_step_per_parameter(const std::vector<Tensor>& grads, const Clip& clip);
  double run_step_multi_tensor(const std::vector<Tensor>& grads, const Clip& clip);
  void ensure_buffers(size_t i);
};

// Checks a hyper-parameter and throws kiln::Error "<op>: <what>=<value> <expectation>".
void check_lr(double lr, const char* op);
void check_weight_decay(double wd, const char* op);

}  // namespace kiln::optim
