// Module tree walking, forward hooks and the simple layers (Linear, Embedding, RMSNorm).
#include "kiln/nn/module.h"

#include <functional>

#include "kiln/autograd/grad_mode.h"
#include "kiln/ops/ops.h"

namespace kiln::nn {

namespace {
std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}
}  // namespace

NamedTensors Module::named_parameters(const std::string& prefix) const {
  NamedTensors out;
  for (const auto& [n, t] : params_) out.emplace_back(join(prefix, n), t);
  for (const auto& [n, c] : children_) {
    NamedTensors sub = c->named_parameters(join(prefix, n));
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

NamedTensors Module::named_buffers(const std::string& prefix) const {
  NamedTensors out;
  for (const auto& [n, t] : buffers_) out.emplace_back(join(prefix, n), t);
  for (const auto& [n, c] : children_) {
    NamedTensors sub = c->named_buffers(join(prefix, n));
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

NamedModules Module::named_modules(const std::string& prefix) {
  NamedModules out{{prefix, this}};
  for (const auto& [n, c] : children_) {
    NamedModules sub = c->named_modules(join(prefix, n));
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

int Module::register_forward_pre_hook(ForwardPreHook hook) {
  KILN_CHECK(hook != nullptr, "register_forward_pre_hook: the hook is empty");
  pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

int Module::register_forward_hook(ForwardHook hook) {
  KILN_CHECK(hook != nullptr, "register_forward_hook: the hook is empty");
  post_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

void Module::remove_hook(int id) {
  auto drop = [id](auto& hooks) {
    const auto before = hooks.size();
    std::erase_if(hooks, [id](const auto& h) { return h.first == id; });
    return hooks.size() != before;
  };
  const bool removed = drop(pre_hooks_) || drop(post_hooks_);
  KILN_CHECK(removed, "remove_hook: this module holds no hook with id ", id);
}

Tensor Module::call(const std::function<Tensor()>& forward) const {
  // Copies: a hook may register or remove hooks while it runs.
  const auto pre = pre_hooks_;
  for (const auto& [id, h] : pre) h(*this);
  Tensor out = forward();
  const auto post = post_hooks_;
  for (const auto& [id, h] : post) out = h(*this, out);
  return out;
}

std::vector<Tensor*> Module::parameters() const {
  std::vector<Tensor*> out;
  for (auto& [n, t] : named_parameters()) out.push_back(t);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto* t : parameters()) n += t->numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [n, c] : children_) c->train(on);
}

void Module::zero_grad() {
  for (auto* t : parameters()) t->set_grad(Tensor());
}

namespace {
// A parameter moved or cast as PyTorch's Module.to does: it keeps requires_grad (a frozen one
// came back trainable) and its .grad, converted the same way (it was dropped).
void convert_parameter(Tensor& t, const std::function<Tensor(const Tensor&)>& convert) {
  const bool trainable = t.requires_grad();
  const Tensor grad = t.grad();
  t = convert(t).detach();
  t.requires_grad_(trainable);
  if (grad.defined()) t.set_grad(convert(grad));
}
}  // namespace

void Module::to(Device device) {
  NoGradGuard ng;
  for (auto* t : parameters())
    if (t->device() != device) convert_parameter(*t, [&](const Tensor& x) { return x.to(device); });
  for (auto& [n, t] : named_buffers())
    if (t->defined() && t->device() != device) *t = t->to(device).detach();
}

void Module::to(DType dtype) {
  NoGradGuard ng;
  for (auto* t : parameters())
    if (t->dtype() != dtype && is_floating(t->dtype()))
      convert_parameter(*t, [&](const Tensor& x) { return x.to(dtype); });
}

void Module::register_parameter(const std::string& name, Tensor* t) {
  if (t->defined()) t->requires_grad_(true);
  params_.emplace_back(name, t);
}

void Module::register_buffer(const std::string& name, Tensor* t) { buffers_.emplace_back(name, t); }

Linear::Linear(int64_t in, int64_t out, bool has_bias, Generator& gen, double init_std, Device device)
    : in_features(in), out_features(out) {
  KILN_CHECK(in > 0 && out > 0, "Linear: in_features=", in, " and out_features=", out, " must be positive");
  weight = mul(randn({out, in}, gen, DType::f32, device), init_std).detach();
  register_parameter("weight", &weight);
  if (has_bias) {
    bias = zeros({out}, DType::f32, device);
    register_parameter("bias", &bias);
  }
}

Tensor Linear::forward(const Tensor& x) const { return linear(x, weight, bias); }

Embedding::Embedding(int64_t num, int64_t dim, Generator& gen, double init_std, Device device) {
  KILN_CHECK(num > 0 && dim > 0, "Embedding: num_embeddings=", num, " and dim=", dim, " must be positive");
  weight = mul(randn({num, dim}, gen, DType::f32, device), init_std).detach();
  register_parameter("weight", &weight);
}

Tensor Embedding::forward(const Tensor& ids) const { return embedding(weight, ids); }

RMSNorm::RMSNorm(int64_t dim, double eps_, Device device) : eps(eps_) {
  KILN_CHECK(dim > 0, "RMSNorm: dim=", dim, " must be positive");
  KILN_CHECK(eps_ > 0, "RMSNorm: eps=", eps_, " must be positive");
  weight = ones({dim}, DType::f32, device);
  register_parameter("weight", &weight);
}

Tensor RMSNorm::forward(const Tensor& x) const { return rms_norm(x, weight, eps); }

}  // namespace kiln::nn
