// The backward engine and the recording of history (the ops layer's half of autograd, above
// kiln/autograd/node.h's graph records because it sums, casts and fills gradients with ops):
// record() connects an op's outputs to a FunctionNode, AccumulateGrad sums into a leaf's .grad
// and runs its post-accumulate hooks, run_backward() walks the graph in a fixed order, and
// end-of-backward callbacks. Bodies in ops/backward.cpp (with Tensor::backward and set_grad).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/autograd/node.h"
#include "kiln/core/tensor.h"

namespace kiln {

// Runs after a leaf's gradient was accumulated into its .grad (torch's
// register_post_accumulate_grad_hook); `leaf` is the leaf, its .grad the sum so far.
using PostAccumulateGradHook = std::function<void(const Tensor& leaf)>;

// Accumulates the incoming gradient into a leaf's .grad, then runs its post-accumulate hooks.
// Graphs share one per leaf while any holds it (the leaf keeps only a weak reference), so hooks
// stay on it for as long as the caller of grad_accumulator() keeps the pointer.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::weak_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::vector<Tensor> apply(const std::vector<Tensor>& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  void add_post_hook(PostAccumulateGradHook hook) { post_hooks_.push_back(std::move(hook)); }

 private:
  void accumulate(const std::shared_ptr<TensorImpl>& impl, const std::vector<Tensor>& grads);
  std::weak_ptr<TensorImpl> leaf_;
  std::vector<PostAccumulateGradHook> post_hooks_;
};

// The accumulator of a leaf that requires grad (made when it has none; kiln::Error for a
// non-leaf or a tensor that needs no gradient). Holding the pointer keeps it, and its hooks,
// for every later graph over the leaf.
std::shared_ptr<AccumulateGrad> grad_accumulator(const Tensor& leaf);
// Adds a post-accumulate hook to `leaf`; the returned accumulator must be kept for the hook to stay.
std::shared_ptr<AccumulateGrad> register_post_accumulate_grad_hook(const Tensor& leaf, PostAccumulateGradHook hook);

// Queues `fn` to run when the backward running on this thread ends (the outermost one, when
// backwards nest, as activation checkpointing's do), after its last node (torch's
// Variable._execution_engine.queue_callback). kiln::Error outside a backward. Callbacks run in
// queue order; one queued by a callback runs too. When the backward fails they are dropped.
void queue_backward_callback(std::function<void()> fn);
// Whether a backward is running on this thread.
bool in_backward();

// Connects `outputs` to a new FunctionNode over `inputs` when any_requires_grad(inputs).
// The backward returns one gradient per input (undefined where an input needs none).
void record(const std::string& op, const std::vector<Tensor>& inputs, const std::vector<Tensor*>& outputs,
            BackwardFn backward);
inline void record(const std::string& op, const std::vector<Tensor>& inputs, Tensor& output, BackwardFn backward) {
  record(op, inputs, std::vector<Tensor*>{&output}, std::move(backward));
}

// Runs backward from `roots` with the given output gradients: each defined, with its root's
// shape, dtype and device (checked: an error names the gradient).
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph);

}  // namespace kiln
