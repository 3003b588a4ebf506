// The Optimizer base: parameter checks, zero_grad, and the state as named tensors plus JSON
// scalars (save and checked load). step() and clip_and_step() are in optimizer_step.cpp.
#include "kiln/optim/optimizer.h"

#include <cmath>
#include <map>
#include <set>

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/ops.h"

namespace kiln::optim {

bool decay_matrices_only(const std::string&, const Tensor& param) { return param.dim() >= 2; }

void check_lr(double lr, const char* op) {
  KILN_CHECK(std::isfinite(lr) && lr >= 0.0, op, ": lr=", lr, " must be finite and >= 0");
}

void check_weight_decay(double wd, const char* op) {
  KILN_CHECK(std::isfinite(wd) && wd >= 0.0, op, ": weight_decay=", wd, " must be finite and >= 0");
}

Optimizer::Optimizer(std::string kind, NamedTensors params, double lr, double weight_decay, const DecayFilter& decay,
                     std::vector<std::string> buffers)
    : kind_(std::move(kind)), params_(std::move(params)), buffer_names_(std::move(buffers)) {
  const char* op = kind_.c_str();
  check_lr(lr, op);
  check_weight_decay(weight_decay, op);
  lr_ = lr;
  weight_decay_ = weight_decay;
  KILN_CHECK(!params_.empty(), op, ": got an empty parameter list");
  std::set<std::string> names;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    KILN_CHECK(!name.empty(), op, ": parameter ", i, " has an empty name");
    KILN_CHECK(names.insert(name).second, op, ": parameter name '", name, "' appears twice");
    KILN_CHECK(p.defined(), op, ": parameter '", name, "' is an undefined tensor");
    KILN_CHECK(p.dtype() == DType::f32, op, ": parameter '", name, "' has dtype ", dtype_name(p.dtype()),
               "; optimizers keep f32 parameters (master weights)");
    KILN_CHECK(p.is_leaf(), op, ": parameter '", name, "' is not a leaf tensor (it has autograd history)");
    // An update writes each element once: a layout that reaches an element twice (an expand())
    // kept only the last of its gradients.
    const ElementSpan sp = element_span(p);
    KILN_CHECK(sp.distinct, op, ": parameter '", name, "' reaches some memory through more than one index (shape ",
               p.shape(), ", strides ", p.strides(), ", as expand() gives); pass a tensor of its own (clone())");
    for (size_t j = 0; j < i; ++j) {
      const Tensor& q = params_[j].second;
      bool same = q.is_same(p) || (q.storage() == p.storage() && q.offset() == p.offset() && q.shape() == p.shape() &&
                                   q.strides() == p.strides());
      KILN_CHECK(!same, op, ": parameters '", params_[j].first, "' and '", name, "' are the same tensor");
      // Views of one buffer: dense ones overlap exactly when their spans do (strided views that
      // interleave, such as two column slices, are not checked: they may well not overlap).
      if (q.storage() == p.storage() && !same) {
        const ElementSpan sq = element_span(q);
        const bool overlap = sq.dense && sp.dense && sq.lo <= sp.hi && sp.lo <= sq.hi;  // empty spans never meet
        KILN_CHECK(!overlap, op, ": parameters '", params_[j].first, "' and '", name,
                   "' share memory (views of one buffer that overlap): each would be updated twice");
      }
    }
    decay_.push_back(decay ? decay(name, p) : true);
  }
  state_.resize(params_.size());
}

bool Optimizer::decays(size_t i) const {
  KILN_CHECK(i < decay_.size(), kind_, ": decays(", i, "): there are ", decay_.size(), " parameters");
  return decay_[i];
}

void Optimizer::set_lr(double lr) {
  check_lr(lr, kind_.c_str());
  lr_ = lr;
}

void Optimizer::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (auto& [name, p] : params_) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none) p.set_grad(Tensor());
    else g.zero_();
  }
}

OptimizerState Optimizer::state_dict() const {
  OptimizerState s;
  json::Value& j = s.scalars;
  j = json::Value::object();
  j["optimizer"] = kind_;
  j["step"] = step_count_;
  j["lr"] = lr_;
  j["weight_decay"] = weight_decay_;
  save_hyperparameters(j);
  json::Value no_decay = json::Value::array(), names = json::Value::array();
  json::Value steps = json::Value::object();
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = params_[i].first;
    names.push_back(name);
    if (!decay_[i]) no_decay.push_back(name);
    if (state_[i].step == 0) continue;
    steps[name] = state_[i].step;
    for (size_t k = 0; k < buffer_names_.size(); ++k)
      s.tensors.emplace_back(buffer_names_[k] + "." + name, state_[i].buffers[k]);
  }
  j["params"] = std::move(names);
  j["no_decay"] = std::move(no_decay);
  j["param_steps"] = std::move(steps);
  return s;
}

void Optimizer::load_state_dict(const OptimizerState& state) {
  const std::string op = kind_ + " load_state_dict";
  const json::Value& j = state.scalars;
  KILN_CHECK(j.is_object(), op, ": scalars must be a JSON object");
  auto member = [&](const char* key) -> const json::Value& {
    const json::Value* v = j.find(key);
    KILN_CHECK(v != nullptr, op, ": scalars have no '", key, "'");
    return *v;
  };
  const std::string& kind = member("optimizer").as_string("optimizer");
  KILN_CHECK(kind == kind_, op, ": the state is of optimizer '", kind, "', this optimizer is '", kind_, "'");
  const int64_t step_count = member("step").as_int("step");
  KILN_CHECK(step_count >= 0, op, ": step=", step_count, " must be >= 0");
  const double lr = member("lr").as_double("lr");
  check_lr(lr, op.c_str());
  const double wd = member("weight_decay").as_double("weight_decay");
  check_weight_decay(wd, op.c_str());

  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].first] = i;

  // The parameters the state was saved for (states written before this list load as before):
  // as torch's parameter-group check, a state for W, b loaded into an optimizer over W, b, E
  // restored the step count while E started over.
  if (const json::Value* saved = j.find("params")) {
    std::set<std::string> in_state;
    for (const json::Value& v : saved->as_array("params")) {
      const std::string& name = v.as_string("params entry");
      KILN_CHECK(index.count(name), op, ": the state is for parameter '", name, "', which this optimizer does not have");
      in_state.insert(name);
    }
    for (const auto& [name, p] : params_)
      KILN_CHECK(in_state.count(name), op, ": parameter '", name, "' of this optimizer is not in the state (it was "
                 "saved for ", in_state.size(), " parameters, this optimizer has ", params_.size(), ")");
  }
  std::set<std::string> no_decay;
  for (const json::Value& v : member("no_decay").as_array("no_decay")) {
    const std::string& name = v.as_string("no_decay entry");
    KILN_CHECK(index.count(name), op, ": no_decay names '", name, "', which is not a parameter of this optimizer");
    no_decay.insert(name);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& name = params_[i].first;
    KILN_CHECK(decay_[i] != (no_decay.count(name) > 0), op, ": parameter '", name, "' ",
               decay_[i] ? "gets weight decay here but is exempt in the state"
                         : "is exempt from weight decay here but gets it in the state");
  }

  std::vector<int64_t> steps(params_.size(), 0);
  for (const auto& [name, v] : member("param_steps").as_object("param_steps")) {
    auto it = index.find(name);
    KILN_CHECK(it != index.end(), op, ": param_steps names '", name, "', which is not a parameter of this optimizer");
    const int64_t s = v.as_int("param_steps entry");
    KILN_CHECK(s >= 1, op, ": param_steps['", name, "']=", s, " must be >= 1");
    steps[it->second] = s;
  }

  // Match the tensors to (buffer, parameter) slots.
  std::vector<std::vector<Tensor>> found(params_.size(), std::vector<Tensor>(buffer_names_.size()));
  for (const auto& [tname, t] : state.tensors) {
    bool matched = false;
    for (size_t k = 0; k < buffer_names_.size() && !matched; ++k) {
      const std::string prefix = buffer_names_[k] + ".";
      if (tname.compare(0, prefix.size(), prefix) != 0) continue;
      auto it = index.find(tname.substr(prefix.size()));
      if (it == index.end()) continue;
      const size_t i = it->second;
      const Tensor& p = params_[i].second;
      KILN_CHECK(steps[i] > 0, op, ": tensor '", tname, "' is given but param_steps has no entry for '",
                 params_[i].first, "'");
      KILN_CHECK(!found[i][k].defined(), op, ": tensor '", tname, "' is given twice");
      KILN_CHECK(t.defined(), op, ": tensor '", tname, "' is undefined");
      KILN_CHECK(t.shape() == p.shape(), op, ": tensor '", tname, "' has shape ", t.shape(), ", parameter '",
                 params_[i].first, "' has shape ", p.shape());
      KILN_CHECK(t.dtype() == DType::f32, op, ": tensor '", tname, "' has dtype ", dtype_name(t.dtype()),
                 " (expected f32)");
      found[i][k] = t;
      matched = true;
    }
    KILN_CHECK(matched, op, ": unexpected tensor '", tname, "' (not <buffer>.<parameter> for a buffer of ", kind_,
               " and a parameter of this optimizer)");
  }
  for (size_t i = 0; i < params_.size(); ++i)
    for (size_t k = 0; k < buffer_names_.size(); ++k)
      KILN_CHECK(steps[i] == 0 || found[i][k].defined(), op, ": missing tensor '", buffer_names_[k], ".",
                 params_[i].first, "'");

  load_hyperparameters(j);  // validates all its members before assigning any

  // Commit: copies on each parameter's device.
  NoGradGuard no_grad;
  std::vector<ParamState> fresh(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    fresh[i].step = steps[i];
    if (steps[i] == 0) continue;
    for (const Tensor& t : found[i]) {
      Tensor c = Tensor::empty(t.shape(), DType::f32, params_[i].second.device());
      c.copy_(t.detach());
      fresh[i].buffers.push_back(c);
    }
  }
  state_ = std::move(fresh);
  step_count_ = step_count;
  lr_ = lr;
  weight_decay_ = wd;
}

}  // namespace kiln::optim
