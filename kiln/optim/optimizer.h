// Optimizer: the base of kiln's optimizers (AdamW in adamw.h, SGD in sgd.h). It holds a list
// of named f32 leaf parameters, per-parameter state (a step count and named f32 buffers such
// as "exp_avg"), the learning rate, and which parameters get weight decay. step() skips
// parameters without a gradient (as torch), zero_grad() clears gradients, and
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
};

// Checks a hyper-parameter and throws kiln::Error "<op>: <what>=<value> <expectation>".
void check_lr(double lr, const char* op);
void check_weight_decay(double wd, const char* op);

}  // namespace kiln::optim
