// Module: the base of kiln's neural-network layers. A module owns tensors registered as
// parameters (trained) or buffers (state that is saved but not trained) and child modules;
// named_parameters() walks the tree and names each tensor by its path
// ("layers.0.self_attn.q_proj.weight"), which is also its checkpoint name. Modules are held by
// shared_ptr and never copied, so the registered pointers to their members stay valid.
// Forward hooks (PyTorch's register_forward_pre_hook / register_forward_hook): a module's
// forward run through call() runs its pre-hooks first and hands its output through its
// post-hooks, which may replace it (FSDP gathers a block's parameters in a pre-hook and frees
// them in a post-hook). Another layer may attach one state object to a module (FSDP's group),
// found again by walking named_modules().
// Also the simple layers: Linear, Embedding, RMSNorm.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/core/tensor.h"

namespace kiln::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor*>>;
class Module;
using NamedModules = std::vector<std::pair<std::string, Module*>>;

// Runs before a forward given to Module::call.
using ForwardPreHook = std::function<void(const Module& module)>;
// Runs after it with its output; returns the output the caller gets (the same, or a tensor that
// replaces it, e.g. one with an autograd node of the hook's own in front).
using ForwardHook = std::function<Tensor(const Module& module, const Tensor& output)>;

// What another layer attaches to a module (kiln/parallel's FSDP group state).
class ModuleState {
 public:
  virtual ~ModuleState() = default;
};

class Module {
 public:
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  virtual ~Module() = default;

  // Every parameter / buffer of this module and its children, depth first, in registration order.
  NamedTensors named_parameters(const std::string& prefix = "") const;
  NamedTensors named_buffers(const std::string& prefix = "") const;
  std::vector<Tensor*> parameters() const;
  int64_t num_parameters() const;

  // Train / eval mode for this module and all children.
  void train(bool on = true);
  void eval() { train(false); }
  bool training() const { return training_; }

  // This module ("" or `prefix`) and every descendant, depth first, in registration order.
  NamedModules named_modules(const std::string& prefix = "");

  // ---- forward hooks ----
  // Each returns an id for remove_hook. Hooks run in registration order.
  int register_forward_pre_hook(ForwardPreHook hook);
  int register_forward_hook(ForwardHook hook);
  // Removes a hook by id (kiln::Error for an id this module does not hold).
  void remove_hook(int id);
  // Runs `forward` (this module's forward on its inputs, as a closure) between the hooks: the
  // pre-hooks, forward(), then each post-hook on the output. Without hooks it is forward().
  Tensor call(const std::function<Tensor()>& forward) const;

  // The state another layer attached (null when none); set_state(nullptr) detaches it.
  ModuleState* state() const { return state_.get(); }
  void set_state(std::shared_ptr<ModuleState> state) { state_ = std::move(state); }

  // Drops the gradient of every parameter.
  void zero_grad();
  // Moves every parameter and buffer to `device` / casts floating ones to `dtype` (no autograd).
  void to(Device device);
  void to(DType dtype);

 protected:
  // Registers a member tensor; parameters are made leaves that require grad.
  void register_parameter(const std::string& name, Tensor* t);
  void register_buffer(const std::string& name, Tensor* t);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    children_.emplace_back(name, m);
    return m;
  }

 private:
  std::vector<std::pair<std::string, Tensor*>> params_, buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
  std::vector<std::pair<int, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<int, ForwardHook>> post_hooks_;
  int next_hook_id_ = 0;
  std::shared_ptr<ModuleState> state_;
};

// y = x Wᵀ (+ b); weight [out, in] initialised normal(0, init_std), bias zero.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen, double init_std = 0.02,
         Device device = kCPU);
  Tensor forward(const Tensor& x) const;
  int64_t in_features, out_features;
  Tensor weight, bias;
};

// ids → rows of weight [num, dim], initialised normal(0, init_std).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator& gen, double init_std = 0.02, Device device = kCPU);
  Tensor forward(const Tensor& ids) const;
  Tensor weight;
};

// x / rms(x) * weight, weight initialised to ones.
class RMSNorm : public Module {
 public:
  RMSNorm(int64_t dim, double eps, Device device = kCPU);
  Tensor forward(const Tensor& x) const;
  double eps;
  Tensor weight;
};

}  // namespace kiln::nn
