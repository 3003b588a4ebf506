// The ops layer's half of autograd (ops/backward.h): record() connects an op's outputs to a
// FunctionNode; AccumulateGrad sums into a leaf's .grad (under the leaf's lock) and runs its
// post-accumulate hooks; the engine walks the graph reachable from the roots in topological
// order, summing gradients per node input in a fixed order (so results are deterministic);
// end-of-backward callbacks; Tensor::set_grad and Tensor::backward. Above kiln/autograd/ because
// it sums, casts and fills gradients with ops.
#include "kiln/ops/backward.h"

#include <unordered_map>
#include <unordered_set>

#include "kiln/autograd/grad_mode.h"
#include "kiln/autograd/node.h"
#include "kiln/core/profile.h"
#include "kiln/ops/ops.h"

namespace kiln {

namespace {
// The backward running on this thread: nesting depth and the callbacks queued for its end.
thread_local int t_backward_depth = 0;
thread_local std::vector<std::function<void()>> t_backward_callbacks;
}  // namespace

std::vector<Tensor> AccumulateGrad::apply(const std::vector<Tensor>& grads) {
  auto impl = leaf_.lock();
  if (!impl) return {};
  accumulate(impl, grads);
  // Outside the leaf's lock: a hook may read or replace the .grad.
  Tensor leaf(impl);
  if (leaf.requires_grad())
    for (const auto& h : post_hooks_) h(leaf);
  return {};
}

void AccumulateGrad::accumulate(const std::shared_ptr<TensorImpl>& impl, const std::vector<Tensor>& grads) {
  std::lock_guard<std::mutex> lock(impl->autograd->mutex);
  Tensor leaf(impl);
  // A leaf that stopped requiring grad after the graph was built gets no .grad (as PyTorch).
  if (!leaf.requires_grad()) return;
  Tensor g = grads.at(0);
  Tensor existing = leaf.grad();
  if (!existing.defined()) {
    // Own the gradient: never alias a tensor that other code may hold. A contiguous gradient
    // that nothing else can reach (only the engine's buffer and `g` hold its handle, and no
    // other handle shares its storage) is taken as is, saving a gradient-sized copy.
    const bool unshared = g.impl_ptr().use_count() <= 2 && g.storage().use_count() == 1 &&
                          g.storage()->nbytes() == g.nbytes();
    if (g.is_contiguous() && g.offset() == 0 && unshared) leaf.set_grad(g);
    else leaf.set_grad(g.contiguous().is_same(g) ? g.clone() : g.contiguous());
  } else {
    NoGradGuard ng;
    // A .grad of another dtype than the leaf's (set_grad: the optimizers' mixed precision) sums
    // in the wider of the two and is stored back in its own ("add: dtype mismatch" came from here).
    if (existing.dtype() == g.dtype()) {
      existing.copy_(add(existing, g));
    } else {
      const DType wide = itemsize(existing.dtype()) >= itemsize(g.dtype()) ? existing.dtype() : g.dtype();
      existing.copy_(add(existing.to(wide), g.to(wide)));
    }
  }
}

static std::shared_ptr<Node> gradient_edge_node(const Tensor& t, int* input_nr) {
  *input_nr = 0;
  if (!t.defined() || !t.requires_grad()) return nullptr;
  AutogradMeta* m = t.impl()->autograd.get();
  if (m->grad_fn) {
    *input_nr = m->output_nr;
    return m->grad_fn;
  }
  std::lock_guard<std::mutex> lock(m->mutex);
  auto acc = m->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    m->grad_accumulator = acc;
  }
  return acc;
}

std::shared_ptr<AccumulateGrad> grad_accumulator(const Tensor& leaf) {
  KILN_CHECK(leaf.defined() && leaf.requires_grad() && leaf.is_leaf(),
             "grad_accumulator: the tensor must be a leaf that requires grad");
  int nr = 0;
  return std::static_pointer_cast<AccumulateGrad>(gradient_edge_node(leaf, &nr));
}

std::shared_ptr<AccumulateGrad> register_post_accumulate_grad_hook(const Tensor& leaf, PostAccumulateGradHook hook) {
  KILN_CHECK(hook != nullptr, "register_post_accumulate_grad_hook: the hook is empty");
  auto acc = grad_accumulator(leaf);
  acc->add_post_hook(std::move(hook));
  return acc;
}

void queue_backward_callback(std::function<void()> fn) {
  KILN_CHECK(t_backward_depth > 0, "queue_backward_callback: no backward is running on this thread");
  t_backward_callbacks.push_back(std::move(fn));
}

bool in_backward() { return t_backward_depth > 0; }

namespace {
// Counts a backward on this thread; the outermost one runs the queued callbacks when it ends
// normally and drops them when it fails.
class BackwardScope {
 public:
  BackwardScope() { ++t_backward_depth; }
  ~BackwardScope() {
    if (--t_backward_depth == 0) t_backward_callbacks.clear();
  }
  void finish() {
    if (t_backward_depth != 1) return;
    for (size_t i = 0; i < t_backward_callbacks.size(); ++i) {
      auto fn = std::move(t_backward_callbacks[i]);
      fn();
    }
    t_backward_callbacks.clear();
  }
};
}  // namespace

void record(const std::string& op, const std::vector<Tensor>& inputs, const std::vector<Tensor*>& outputs,
            BackwardFn backward) {
  if (!any_requires_grad(inputs)) return;
  auto node = std::make_shared<FunctionNode>(op, std::move(backward));
  node->next.reserve(inputs.size());
  for (const auto& in : inputs) {
    Edge e;
    e.node = gradient_edge_node(in, &e.input_nr);
    node->next.push_back(std::move(e));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor& out = *outputs[i];
    node->outputs.push_back({out.shape(), out.dtype(), out.device()});
    auto& meta = out.impl()->autograd;
    if (!meta) meta = std::make_unique<AutogradMeta>();
    meta->requires_grad = true;
    meta->grad_fn = node;
    meta->output_nr = static_cast<int>(i);
  }
}

void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph) {
  KILN_CHECK(roots.size() == grads.size(), "backward: ", roots.size(), " roots but ", grads.size(), " gradients");
  // Ops read their output gradients as laid out like their outputs: a root's gradient must match it.
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    const Tensor& g = grads[i];
    KILN_CHECK(g.defined(), "backward: gradient ", i, " is undefined");
    KILN_CHECK(g.shape() == r.shape(), "backward: gradient ", i, " has shape ", g.shape(), ", its output has shape ",
               r.shape());
    KILN_CHECK(g.dtype() == r.dtype() && g.device() == r.device(), "backward: gradient ", i, " has dtype ",
               dtype_name(g.dtype()), " on ", g.device().str(), ", its output has ", dtype_name(r.dtype()), " on ",
               r.device().str());
  }
  NoGradGuard no_grad;
  BackwardScope scope;
  // Collect the graph and count, for each node, how many edges lead into it.
  std::vector<std::pair<std::shared_ptr<Node>, int>> root_edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    KILN_CHECK(roots[i].requires_grad(), "backward: element ", i, " of tensors does not require grad and has no grad_fn");
    int nr = 0;
    root_edges.emplace_back(gradient_edge_node(roots[i], &nr), nr);
  }
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  for (auto& [n, nr] : root_edges)
    if (seen.insert(n.get()).second) stack.push_back(n.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& e : n->next) {
      if (!e.node) continue;
      dependencies[e.node.get()]++;
      if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }
  // Gradient buffers per node, one slot per output, filled in graph order.
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep;  // keeps nodes alive while queued
  auto accumulate = [&](const std::shared_ptr<Node>& n, int slot, const Tensor& g) {
    auto& buf = buffers[n.get()];
    size_t nslots = std::max<size_t>(n->outputs.size(), 1);
    if (buf.size() < nslots) buf.resize(nslots);
    Tensor& b = buf[static_cast<size_t>(slot)];
    b = b.defined() ? add(b, g) : g;
    keep[n.get()] = n;
  };
  std::vector<std::shared_ptr<Node>> ready;
  for (size_t i = 0; i < roots.size(); ++i) {
    auto& [n, nr] = root_edges[i];
    accumulate(n, nr, grads[i]);
  }
  for (auto& [n, nr] : root_edges)
    if (dependencies[n.get()] == 0 &&
        std::find_if(ready.begin(), ready.end(), [&](auto& r) { return r.get() == n.get(); }) == ready.end())
      ready.push_back(n);
  while (!ready.empty()) {
    std::shared_ptr<Node> n = ready.back();
    ready.pop_back();
    std::vector<Tensor> in = std::move(buffers[n.get()]);
    buffers.erase(n.get());
    // Zeros for outputs that received no gradient.
    for (size_t i = 0; i < n->outputs.size(); ++i) {
      if (i >= in.size()) in.resize(n->outputs.size());
      if (!in[i].defined()) {
        const auto& m = n->outputs[i];
        in[i] = zeros(m.shape, m.dtype, m.device);
      }
    }
    std::vector<Tensor> out;
    {
      profile::Label label("backward:", profile::active() ? n->name() : std::string());
      out = n->apply(in);
    }
    if (!retain_graph) n->release();
    KILN_CHECK(out.empty() || out.size() == n->next.size(), n->name(), " backward returned ", out.size(),
               " gradients for ", n->next.size(), " inputs");
    for (size_t i = 0; i < out.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.node) continue;
      if (out[i].defined()) accumulate(e.node, e.input_nr, out[i]);
      if (--dependencies[e.node.get()] == 0) ready.push_back(e.node);
    }
    keep.erase(n.get());
  }
  scope.finish();
}

void Tensor::set_grad(const Tensor& g) {
  auto& m = impl()->autograd;
  if (!m) m = std::make_unique<AutogradMeta>();
  if (!g.defined()) {
    m->grad.reset();
    return;
  }
  KILN_CHECK(g.shape() == shape(), "set_grad: gradient shape ", g.shape(), " differs from tensor shape ", shape());
  // Any floating dtype (bf16 gradients of f32 weights are the optimizers' mixed precision), on
  // the tensor's device.
  KILN_CHECK(is_floating(g.dtype()) && g.device() == device(), "set_grad: gradient ", dtype_name(g.dtype()), " on ",
             g.device().str(), " for a tensor on ", device().str(), " (a gradient is floating, on the tensor's device)");
  // A gradient is updated in place (accumulation, clipping): an expanded or overlapping view would
  // have one element scaled once per alias (clip_grad_norm_ reported 5.657 for a 4-filled
  // expand and left 0.125 instead of 0.707), so such a view is stored as a copy.
  m->grad = std::make_shared<Tensor>(element_span(g).distinct ? g : g.contiguous());
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  Tensor g = gradient;
  if (!g.defined()) {
    KILN_CHECK(numel() == 1, "backward: grad can be implicitly created only for scalar outputs (shape ", shape(), ")");
    g = ones(shape(), dtype(), device());
  }
  run_backward({*this}, {g}, retain_graph);
}

}  // namespace kiln
