// The backward graph's records: graphs freed without recursion (Node::~Node), SavedTensor's
// version check, FunctionNode, grad mode, and the Tensor autograd methods that only read or set
// a tensor's autograd metadata (requires_grad, grad_fn, grad, detach). Recording, accumulation
// and the engine are ops/backward.cpp's (the determinism switch is core/switches.h's).
#include "kiln/autograd/grad_mode.h"
#include "kiln/autograd/node.h"
#include "kiln/core/error.h"

namespace kiln {

namespace {
thread_local bool t_grad_enabled = true;
}  // namespace

bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool on) { t_grad_enabled = on; }

// Frees a graph without recursion: each node's destructor would free the next through its edge
// (a 200 000-op chain overflowed an 8 MB stack when its graph went away). The nodes only this
// one holds are taken over and freed one at a time; every other edge is dropped at once, so that
// a node reached twice (a residual x + f(x), or x * x) comes to be held once and is taken over
// in its turn instead of being freed from inside a member destructor.
Node::~Node() {
  std::vector<std::shared_ptr<Node>> owned;
  auto take_sole = [&](std::vector<Edge>& edges) {
    for (Edge& e : edges) {
      if (e.node && e.node.use_count() == 1) owned.push_back(std::move(e.node));
      else e.node.reset();
    }
  };
  take_sole(next);
  while (!owned.empty()) {
    std::shared_ptr<Node> n = std::move(owned.back());
    owned.pop_back();
    take_sole(n->next);
  }  // n is freed here with no sole-owned edges left
}

SavedTensor::SavedTensor(const Tensor& t) {
  if (!t.defined()) return;
  tensor_ = t.detach();
  version_ = t.version();
}

Tensor SavedTensor::get(const std::string& op) const {
  if (tensor_.defined() && tensor_.version() != version_)
    fail(op, " backward: a tensor saved for backward (shape ", tensor_.shape(),
         ") was modified by an in-place operation: its version is ", tensor_.version(), ", it was ",
         version_, " when saved. Clone it before modifying it in place.");
  return tensor_;
}

std::vector<Tensor> FunctionNode::apply(const std::vector<Tensor>& grads) {
  KILN_CHECK(!released_, name_, " backward: trying to backward through the graph a second time (its saved "
             "tensors were freed); pass retain_graph=true to the first backward");
  return fn_(grads);
}

void FunctionNode::release() {
  fn_ = nullptr;
  released_ = true;
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!grad_enabled()) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

// ---- Tensor's autograd methods ----

bool Tensor::requires_grad() const {
  const auto& m = impl()->autograd;
  return m && m->requires_grad;
}

Tensor& Tensor::requires_grad_(bool on) {
  auto& m = impl()->autograd;
  KILN_CHECK(!m || !m->grad_fn || on, "requires_grad_: cannot turn off requires_grad on a non-leaf tensor "
             "(use detach())");
  KILN_CHECK(!on || is_floating(dtype()), "requires_grad_: only floating tensors can require grad, got ",
             dtype_name(dtype()));
  if (!m) m = std::make_unique<AutogradMeta>();
  m->requires_grad = on;
  return *this;
}

bool Tensor::is_leaf() const {
  const auto& m = impl()->autograd;
  return !m || !m->grad_fn;
}

const std::shared_ptr<Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<Node> kNone;
  const auto& m = impl()->autograd;
  return m ? m->grad_fn : kNone;
}

Tensor Tensor::grad() const {
  const auto& m = impl()->autograd;
  return (m && m->grad) ? *m->grad : Tensor();
}

Tensor Tensor::detach() const {
  auto impl2 = std::make_shared<TensorImpl>();
  impl2->storage = impl()->storage;
  impl2->shape = impl()->shape;
  impl2->strides = impl()->strides;
  impl2->offset = impl()->offset;
  impl2->dtype = impl()->dtype;
  return Tensor(std::move(impl2));
}

}  // namespace kiln
